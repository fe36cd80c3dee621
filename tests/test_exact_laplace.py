"""With exact solves, IterNCGP is the exact Laplace approximation (checked against the dense reference).

Unit-vector actions span the whole space after N C iterations, so the approximate precision becomes
exact and the posterior (mean *and* covariance) must equal R&W's Algorithms 3.1–3.4 (``tests/reference.py``).
With CG actions the mode and the mean are exact, while the covariance may keep computational uncertainty.
"""

from __future__ import annotations

import math

import gpytorch
import pytest
import torch

from gpytorch_iterncgp import ExpPoissonLikelihood, LogitBernoulliLikelihood
from gpytorch_iterncgp.likelihoods.adapters import MultitaskPoissonLikelihood
from tests import reference
from tests.common import (
    IterNCGPModel,
    MultitaskIterNCGPModel,
    binary_data,
    count_data,
    multiclass_data,
    multioutput_count_data,
    set_distinct_class_hyperparameters,
)
from tests.common import softmax_likelihood as _softmax

DTYPE = torch.float64
EXACT = dict(
    policy="unit", max_solver_iterations=None, outer_tol=1e-12, abs_tol=1e-11, rel_tol=0.0, max_newton_steps=100
)
TOL = 1e-6


# name: (likelihood factory, data factory, reference likelihood, C, model options)
CASES = {
    "probit": (gpytorch.likelihoods.BernoulliLikelihood, lambda: binary_data(60, seed=1), "probit", 1, {}),
    "logit-constant-mean": (
        LogitBernoulliLikelihood,
        lambda: binary_data(60, seed=2),
        "logit",
        1,
        {"constant_mean": 0.5},
    ),
    "poisson-exp": (ExpPoissonLikelihood, lambda: count_data(60, seed=3), "poisson_exp", 1, {"outputscale": 1.5}),
    "poisson-softplus": (
        gpytorch.likelihoods.PoissonLikelihood,
        lambda: count_data(60, seed=4),
        "poisson_softplus",
        1,
        {"kernel": "matern"},
    ),
    "softmax-independent": (
        _softmax,
        lambda: multiclass_data(50, seed=5),
        "softmax",
        3,
        {"batch_classes": 3, "constant_mean": 0.0},
    ),
    "softmax-shared": (_softmax, lambda: multiclass_data(50, seed=6), "softmax", 3, {}),
    # correlated latents (a MultitaskMultivariateNormal): K = K_x ⊗ B, B = V Vᵀ + diag(v), and the LCM Σ_q K_q ⊗ B_q
    "softmax-multitask": (
        _softmax,
        lambda: multiclass_data(40, seed=7),
        "softmax",
        3,
        {"multitask": {"kernel": "multitask", "rank": 2}},
    ),
    "poisson-multitask-lcm": (
        lambda: MultitaskPoissonLikelihood(num_tasks=3),
        lambda: multioutput_count_data(30, seed=8),
        "poisson_exp",
        3,
        {"multitask": {"kernel": "lcm", "rank": 1, "constant_mean": 0.3}},
    ),
    "poisson-multitask-missing": (
        lambda: MultitaskPoissonLikelihood(num_tasks=3),
        lambda: multioutput_count_data(30, seed=9, missing=0.2),
        "poisson_exp",
        3,
        {"multitask": {"kernel": "multitask", "rank": 1}},
    ),
}


def build(case: str, **options):
    """The model of ``case`` (not fitted), its data and its likelihood."""
    make_likelihood, make_data, name, num_classes, case_options = CASES[case]
    likelihood = make_likelihood()
    x, y = make_data()
    case_options = dict(case_options)
    multitask = case_options.pop("multitask", None)
    if multitask is not None:
        model = MultitaskIterNCGPModel(x, y, likelihood, num_tasks=num_classes, **multitask, **options)
        return model, likelihood, x, y, name, num_classes
    model = IterNCGPModel(x, y, likelihood, **{**case_options, **options})
    if case == "softmax-independent":
        set_distinct_class_hyperparameters(model)
    return model, likelihood, x, y, name, num_classes


def data_major_mean(model, x, num_classes: int) -> torch.Tensor:
    """The prior mean at ``x`` as a data-major vector ``(N C,)``."""
    mean = model.mean_module(x).detach()  # (a view of ConstantMean's parameter requires grad even in no_grad)
    if isinstance(model, MultitaskIterNCGPModel):  # (N, C): already data-major
        return mean.reshape(-1)
    if mean.dim() == 2:  # (C, N): one GP per class
        return mean.mT.reshape(-1)
    return mean[:, None].expand(-1, num_classes).reshape(-1)


def dense_prior(model, x1, x2, num_classes: int) -> torch.Tensor:
    """Dense data-major ``K(x1, x2)`` of shape ``(N1 C, N2 C)``."""
    if isinstance(model, MultitaskIterNCGPModel):  # a multitask kernel is data-major (interleaved) already
        return model.covar_module(x1, x2).to_dense()
    return reference.data_major(model.covar_module(x1, x2).to_dense(), num_classes)


def exact_laplace(model, x, y, name, num_classes):
    with torch.no_grad():
        kernel = dense_prior(model, x, x, num_classes)
        mean = data_major_mean(model, x, num_classes)
    result = reference.laplace_mode(kernel, mean, y, name, num_classes)
    assert result.converged
    return result, kernel, mean


def reference_predictive(model, result, x, test_x, num_classes):
    with torch.no_grad():
        cross = dense_prior(model, test_x, x, num_classes)
        test_kernel = dense_prior(model, test_x, test_x, num_classes)
        test_mean = data_major_mean(model, test_x, num_classes)
    return result.predict(cross, test_kernel, test_mean)


def make_test_inputs(dim: int, num: int = 9, seed: int = 11) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return -0.2 + 1.4 * torch.rand(num, dim, generator=generator, dtype=DTYPE)


def assert_relative(actual: torch.Tensor, expected: torch.Tensor, tol: float = TOL) -> None:
    """``max |actual - expected| <= tol * max |expected|`` (shapes must agree)."""
    actual, expected = actual.detach(), expected.detach()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = float(expected.abs().max())
    error = float((actual - expected).abs().max())
    assert error <= tol * max(scale, 1e-300), f"max error {error:.3g} > {tol:.1g} * {scale:.3g}"


# ---------------------------------------------------------------------------------------------------
# The reference itself: its likelihoods are GPyTorch's, its derivatives are those of autograd.
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_reference_likelihood_and_derivatives(case):
    make_likelihood, make_data, name, num_classes, _ = CASES[case]
    likelihood = make_likelihood()
    _, y = make_data()
    generator = torch.Generator().manual_seed(0)
    latent = 1.5 * torch.randn(len(y) * num_classes, generator=generator, dtype=DTYPE)
    # the same log-likelihood as the GPyTorch likelihood
    samples = latent.reshape(-1, num_classes) if num_classes > 1 else latent
    observed = ~torch.isnan(y)  # missing outputs (NaN) have no factor
    if bool(observed.all()):
        expected = likelihood.forward(samples).log_prob(y).sum()
    else:
        expected = likelihood.forward(samples).base_dist.log_prob(y.nan_to_num())[observed].sum()
    assert math.isclose(float(reference.log_likelihood(latent, y, name, num_classes)), float(expected), rel_tol=1e-12)
    # closed-form gradient and curvature against autograd
    gradient, curvature = reference.gradient_and_curvature(latent, y, name, num_classes)
    auto_gradient = torch.autograd.functional.jacobian(
        lambda f: reference.log_likelihood(f, y, name, num_classes), latent
    )
    auto_hessian = torch.autograd.functional.hessian(
        lambda f: reference.log_likelihood(f, y, name, num_classes), latent
    )
    assert_relative(gradient, auto_gradient, 1e-10)
    assert_relative(curvature, -auto_hessian, 1e-10)
    # the symmetric square root
    root = reference.symmetric_sqrt(curvature, num_classes)
    assert_relative(root @ root, curvature, 1e-10)
    assert_relative(root, root.mT, 0.0)


# ---------------------------------------------------------------------------------------------------
# Exact solves (unit-vector actions): mode, mean and covariance are the exact Laplace approximation.
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_exact_solves_give_exact_laplace_posterior(case):
    model, _, x, y, name, num_classes = build(case, **EXACT)
    report = model.variational_strategy.fit()
    assert report.converged
    exact, kernel, prior_mean = exact_laplace(model, x, y, name, num_classes)
    # the curvature clamp of the package (sqrt(eps)) is far away: the comparison is with the same W
    assert float(exact.curvature.diagonal().max()) > 0 and float(torch.linalg.eigvalsh(exact.curvature)[-1]) > 1e-6

    # the mode, (N, C)
    mode = model.variational_strategy.mode
    assert mode.shape == (len(x), num_classes)
    assert_relative(mode, exact.mode.reshape(-1, num_classes))

    # the log posterior of the fit is Psi at the exact mode
    assert math.isclose(report.log_posteriors[-1], exact.log_posteriors[-1], rel_tol=1e-8)

    # the approximate precision is exact: C = (K + W^{-1})^{-1} = W^{1/2} B^{-1} W^{1/2} (also for singular W)
    inverse_cholesky = torch.linalg.solve_triangular(exact.cholesky, exact.sqrt_curvature, upper=False)
    precision = model.variational_strategy.approximate_precision.to_dense()
    assert_relative(precision, inverse_cholesky.mT @ inverse_cholesky)

    # training mode at the training inputs (the cached K Q path)
    with torch.no_grad():
        train_posterior = model(x)
    mean, covariance = exact.predict(kernel, kernel, prior_mean)
    assert_relative(train_posterior.mean.reshape(-1), mean)
    assert_relative(train_posterior.covariance_matrix, covariance)

    # eval mode at test inputs
    model.eval()
    test_x = make_test_inputs(x.shape[-1])
    with torch.no_grad():
        posterior = model(test_x)
    mean, covariance = reference_predictive(model, exact, x, test_x, num_classes)
    if num_classes == 1:
        assert isinstance(posterior, gpytorch.distributions.MultivariateNormal)
        assert posterior.mean.shape == (len(test_x),)
    else:
        assert isinstance(posterior, gpytorch.distributions.MultitaskMultivariateNormal)
        assert posterior.mean.shape == (len(test_x), num_classes)
    assert_relative(posterior.mean.reshape(-1), mean)
    assert_relative(posterior.variance.reshape(-1), covariance.diagonal())
    assert_relative(posterior.covariance_matrix, covariance)

    # the marginals without covariance matrices
    with torch.no_grad():
        marginal_mean, marginal_variance = model.variational_strategy.marginal_latent(test_x)
    assert_relative(marginal_mean, mean.reshape(-1, num_classes))
    assert_relative(marginal_variance, covariance.diagonal().reshape(-1, num_classes))


# ---------------------------------------------------------------------------------------------------
# CG actions: the mode and the mean are exact; the covariance is at least the exact one.
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preconditioner_rank", [0, 4, 100])
@pytest.mark.parametrize("case", list(CASES))
def test_cg_gives_exact_mode_and_mean(case, preconditioner_rank):
    """Also preconditioned (a factor of rank 4, and one of rank 100, nearly K itself at these sizes): the actions change,
    the mode and the guarantee on the covariance do not."""
    options = {**EXACT, "policy": "cg", "preconditioner_rank": preconditioner_rank}
    model, _, x, y, name, num_classes = build(case, **options)
    report = model.variational_strategy.fit()
    assert report.converged
    exact, _, _ = exact_laplace(model, x, y, name, num_classes)
    assert_relative(model.variational_strategy.mode, exact.mode.reshape(-1, num_classes))

    model.eval()
    test_x = make_test_inputs(x.shape[-1])
    with torch.no_grad():
        posterior = model(test_x)
    mean, covariance = reference_predictive(model, exact, x, test_x, num_classes)
    assert_relative(posterior.mean.reshape(-1), mean)
    # C = S (S^T K̂ S)^{-1} S^T <= K̂^{-1} (on range(W) for softmax): computational uncertainty only adds
    excess = posterior.covariance_matrix.detach() - covariance
    assert float(torch.linalg.eigvalsh((excess + excess.mT) / 2)[0]) >= -1e-8 * float(covariance.abs().max())


# ---------------------------------------------------------------------------------------------------
# Class probabilities from the latent marginals.
# ---------------------------------------------------------------------------------------------------
def test_predictive_probabilities():
    """Probit: exact, E[Phi(f)] = Phi(mu / sqrt(1 + s^2)) of the reference posterior, and GPyTorch's own predictive.
    (Logit and softmax, against scipy quadrature and the mean-field formula on the reference's C x C blocks:
    ``tests/strategies/test_predictive.py``.)"""
    model, likelihood, x, y, name, num_classes = build("probit", **EXACT)
    model.variational_strategy.fit()
    exact, _, _ = exact_laplace(model, x, y, name, num_classes)
    model.eval()
    test_x = make_test_inputs(x.shape[-1], seed=12)
    mean, covariance = reference_predictive(model, exact, x, test_x, num_classes)
    expected = torch.special.ndtr(mean / torch.sqrt(1 + covariance.diagonal()))
    with torch.no_grad():
        probabilities = model.variational_strategy.predictive_probabilities(test_x)
        assert_relative(probabilities, expected)
        assert_relative(likelihood(model(test_x)).probs, expected)


# ---------------------------------------------------------------------------------------------------
# A change of hyperparameters: the warm-started fit reaches the new exact Laplace approximation.
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["probit", "poisson-exp", "softmax-independent"])
def test_refit_after_hyperparameter_change(case):
    model, _, x, y, name, num_classes = build(case, **EXACT)
    model.variational_strategy.fit()
    with torch.no_grad():
        model.covar_module.outputscale = model.covar_module.outputscale * 1.7
        model.covar_module.base_kernel.lengthscale = model.covar_module.base_kernel.lengthscale * 0.8
    report = model.variational_strategy.fit()
    assert report.converged
    exact, _, _ = exact_laplace(model, x, y, name, num_classes)
    assert_relative(model.variational_strategy.mode, exact.mode.reshape(-1, num_classes))
    model.eval()
    test_x = make_test_inputs(x.shape[-1], seed=13)
    with torch.no_grad():
        posterior = model(test_x)
    mean, covariance = reference_predictive(model, exact, x, test_x, num_classes)
    assert_relative(posterior.mean.reshape(-1), mean)
    assert_relative(posterior.covariance_matrix, covariance)
