r"""Damped Newton's method (``gpytorch_iterncgp.laplace.newton``, paper Algorithm 1) and the Laplace evidence at its
mode, against a reference built from scipy alone.

The reference: the Matérn-3/2 kernel matrix written out in numpy; the mode :math:`\hat{\mathbf f}` of
:math:`\Psi(\mathbf f) = \log p(\mathbf y \mid \mathbf f) - \tfrac12 \mathbf f^\top \mathbf K^{-1} \mathbf f` by
``scipy.optimize.minimize`` (trust region, exact Hessian) polished by ``scipy.optimize.root``; the log-likelihood by
``scipy.stats`` (Bernoulli with :math:`\Phi(f)` or :math:`\sigma(f)`, Poisson with :math:`e^f`); and the evidence
(R&W eq. 3.32)

.. math::
    \log q(\mathbf y \mid \mathbf X, \theta) = \log p(\mathbf y \mid \hat{\mathbf f})
    - \tfrac12 \hat{\mathbf f}^\top \mathbf K^{-1} \hat{\mathbf f}
    - \tfrac12 \log |\mathbf I + \mathbf W^{1/2} \mathbf K \mathbf W^{1/2}|,

its gradient w.r.t. the outputscale and lengthscale by central differences of this whole computation (the mode
re-solved at each point). The package runs in its exact regime (:math:`N` below ``exact_evidence_size``), with solves
to convergence, so that both are the exact Laplace approximation.
"""

from __future__ import annotations

import math

import gpytorch
import numpy as np
import pytest
import torch

from gpytorch_iterncgp import ExpPoissonLikelihood, LaplaceMarginalLogLikelihood, LogitBernoulliLikelihood
from tests.common import IterNCGPModel, binary_data, count_data

stats = pytest.importorskip("scipy.stats")
special = pytest.importorskip("scipy.special")
optimize = pytest.importorskip("scipy.optimize")

DTYPE = torch.float64
TIGHT = dict(max_solver_iterations=None, outer_tol=1e-12, abs_tol=1e-12, rel_tol=1e-13, max_newton_steps=100)


def _matern(x: np.ndarray, outputscale: float, lengthscale: float) -> np.ndarray:
    r""":math:`s (1 + \sqrt 3 r / \ell) e^{-\sqrt 3 r / \ell}`, Matérn-3/2."""
    scaled = math.sqrt(3) * np.sqrt(((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)) / lengthscale
    return outputscale * (1 + scaled) * np.exp(-scaled)


def _log_likelihood(name: str, f: np.ndarray, y: np.ndarray) -> float:
    """:math:`\\log p(\\mathbf y \\mid \\mathbf f)` by scipy.stats."""
    if name == "probit":
        return float(stats.bernoulli.logpmf(y, special.ndtr(f)).sum())
    if name == "logit":
        return float(stats.bernoulli.logpmf(y, special.expit(f)).sum())
    return float(stats.poisson.logpmf(y, np.exp(f)).sum())


def _derivatives(name: str, f: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    r"""A numerically stable :math:`\log p(\mathbf y \mid \mathbf f)`, its gradient and :math:`\mathbf W = -\nabla^2`
    (diagonal) in closed form (R&W eqs. 3.15, 3.16)."""
    if name == "probit":
        sign = 2 * y - 1
        ratio = sign * np.exp(stats.norm.logpdf(f) - special.log_ndtr(sign * f))
        return float(special.log_ndtr(sign * f).sum()), ratio, ratio**2 + f * ratio
    if name == "logit":
        probability = special.expit(f)
        return float(-np.logaddexp(0, -(2 * y - 1) * f).sum()), y - probability, probability * (1 - probability)
    rate = np.exp(f)
    return float((y * f - rate - special.gammaln(y + 1)).sum()), y - rate, rate


def scipy_laplace(name: str, x: np.ndarray, y: np.ndarray, outputscale: float, lengthscale: float):
    r"""The mode by scipy's trust-region Newton and the evidence at it (``log_likelihood`` by scipy.stats).

    Minimised in whitened coordinates :math:`\mathbf f = \mathbf L \mathbf u` (:math:`\mathbf K = \mathbf L
    \mathbf L^\top`), where the Hessian :math:`\mathbf L^\top \mathbf W \mathbf L + \mathbf I` is well conditioned
    and :math:`\mathbf f^\top \mathbf K^{-1} \mathbf f = \mathbf u^\top \mathbf u`.
    """
    kernel = _matern(x, outputscale, lengthscale)
    factor = np.linalg.cholesky(kernel)

    def objective(u):
        value, gradient, _ = _derivatives(name, factor @ u, y)
        return -value + 0.5 * u @ u, -factor.T @ gradient + u

    def hessian(u):
        return factor.T @ (_derivatives(name, factor @ u, y)[2][:, None] * factor) + np.eye(len(u))

    start = optimize.minimize(objective, np.zeros(len(y)), jac=True, hess=hessian, method="trust-exact")
    # polished by Powell's hybrid method on the gradient (the trust region may stop a little short of the rounding)
    result = optimize.root(lambda u: objective(u)[1], start.x, jac=hessian, method="hybr", options={"xtol": 1e-15})
    result.jac = objective(result.x)[1]
    mode = factor @ result.x
    root = np.sqrt(_derivatives(name, mode, y)[2])
    _, log_det = np.linalg.slogdet(np.eye(len(y)) + root[:, None] * kernel * root[None, :])
    evidence = _log_likelihood(name, mode, y) - 0.5 * result.x @ result.x - 0.5 * log_det
    return mode, evidence, result


# name: likelihood, data, (outputscale, lengthscale), where the gradients compared are not small (0.13 to 35)
CASES = {
    "probit": (gpytorch.likelihoods.BernoulliLikelihood, lambda: binary_data(40, seed=41), (1.7, 0.35)),
    "logit": (LogitBernoulliLikelihood, lambda: binary_data(40, seed=42), (1.7, 0.35)),
    "poisson": (ExpPoissonLikelihood, lambda: count_data(40, seed=43, scale=1.5), (2.0, 0.1)),
}


def _model(name: str):
    """The package's model of case ``name``, its likelihood, data and hyperparameters."""
    make_likelihood, make_data, (outputscale, lengthscale) = CASES[name]
    x, y = make_data()
    likelihood = make_likelihood()
    model = IterNCGPModel(x, y, likelihood, kernel="matern", outputscale=outputscale, lengthscale=lengthscale, **TIGHT)
    return model, likelihood, x, y, {"outputscale": outputscale, "lengthscale": lengthscale}


@pytest.mark.parametrize("name", list(CASES))
def test_newtons_mode_and_evidence_are_scipys(name):
    """The damped Newton loop converges to scipy's mode, and ``N * mll`` is the evidence assembled from scipy."""
    model, likelihood, x, y, hyperparameters = _model(name)
    report = model.variational_strategy.fit()
    assert report.converged and report.method == "Laplace"
    mode, expected, result = scipy_laplace(name, x.numpy(), y.numpy(), **hyperparameters)
    assert np.abs(result.jac).max() < 1e-10  # scipy's mode: the gradient of Ψ vanishes to rounding
    # the package's mode to ~sqrt(eps): Newton stops where the gain it promises is below the rounding of Ψ
    np.testing.assert_allclose(model.variational_strategy.mode[:, 0].detach().numpy(), mode, rtol=1e-6, atol=1e-7)
    model.train()
    with torch.no_grad():
        evidence = float(LaplaceMarginalLogLikelihood(likelihood, model, exact=True)(model(x), y)) * len(x)
    assert abs(evidence - expected) <= 1e-8 * abs(expected), (evidence, expected)
    # not vacuous: the evidence differs from the log-likelihood at the mode by its prior and log-determinant terms
    assert abs(_log_likelihood(name, mode, y.numpy()) - expected) > 1.0


@pytest.mark.parametrize("name", list(CASES))
def test_evidence_gradient_is_the_central_difference_of_scipys_evidence(name):
    r"""Autograd of the exact-regime evidence w.r.t. the outputscale and lengthscale (through their raw parameters:
    :math:`\partial / \partial \theta = (\partial / \partial \rho) / \sigma(\rho)` for :math:`\theta =
    \operatorname{softplus}(\rho)`) against central differences of scipy's evidence, relative step ``1e-4``, to
    ``1e-4`` relative."""
    model, likelihood, x, y, hyperparameters = _model(name)
    model.train()
    evidence = LaplaceMarginalLogLikelihood(likelihood, model, exact=True)(model(x), y) * len(x)
    evidence.backward()
    kernel = model.covar_module
    raw = {"outputscale": kernel.raw_outputscale, "lengthscale": kernel.base_kernel.raw_lengthscale}
    for parameter, value in hyperparameters.items():
        gradient = float(raw[parameter].grad.sum() / torch.sigmoid(raw[parameter].detach()).sum())
        step = 1e-4 * value
        values = []
        for shift in (step, -step):
            _, shifted, _ = scipy_laplace(name, x.numpy(), y.numpy(), **{**hyperparameters, parameter: value + shift})
            values.append(shifted)
        expected = (values[0] - values[1]) / (2 * step)
        assert abs(expected) > 0.1, (parameter, expected)  # a gradient to compare (not at a stationary point)
        assert abs(gradient - expected) <= 1e-4 * abs(expected), (parameter, gradient, expected)


def test_without_a_covariance_phase_the_final_roots_are_formed_when_read():
    """With ``covariance_iterations=0`` the final virtual run's :math:`\\mathbf Q` and :math:`\\mathbf K \\mathbf Q` are
    formed when first read (learning never reads them): the same as read at once, even after a later fit appended to
    the buffer the state's actions live in, and :math:`\\mathbf Q^\\top (\\mathbf K + \\mathbf W^{-1}) \\mathbf Q =
    \\mathbf I` at the final mode."""
    import gpytorch

    from tests.common import IterNCGPModel, binary_data

    x, y = binary_data(50, seed=9)
    roots = []
    for later_fit in (False, True):
        model = IterNCGPModel(x, y, gpytorch.likelihoods.BernoulliLikelihood(), max_solver_iterations=3)
        strategy = model.variational_strategy
        strategy.fit(covariance_iterations=0)
        state = strategy.state
        assert not torch.is_tensor(state.__dict__["_deferred_precision_root"])  # not formed yet
        if later_fit:
            with torch.no_grad():
                model.covar_module.outputscale = 3.0
            strategy.fit(covariance_iterations=0)
            assert strategy.state.actions.shape[-1] > state.actions.shape[-1]  # it appended actions
        roots.append((state.precision_root, state.kernel_precision_root))
    assert all(torch.equal(first, second) for first, second in zip(*roots, strict=True))
    with torch.no_grad():
        model.covar_module.outputscale = 2.0  # (the first state's hyperparameters)
        kernel = model.covar_module(x).to_dense()
        mode = state.kernel_representer_weights
        _, _, curvature = strategy.adapter.local_terms(mode[:, None], y)
    root, kernel_root = roots[0]
    torch.testing.assert_close(kernel_root, kernel @ root)
    noisy = root.mT @ kernel_root + root.mT @ (root / curvature.reshape(-1, 1))
    torch.testing.assert_close(noisy, torch.eye(root.shape[-1], dtype=noisy.dtype), atol=1e-8, rtol=0)
