"""The dense EP reference (``tests/reference_ep.py``) checked against itself and brute force.

Sequential (R&W Alg. 3.5) and parallel damped EP reach one fixed point; there the posterior marginals carry the
tilted moments (moment matching); the EP evidence (R&W eq. 3.65) is exact for one point and for independent points,
close to 2-D quadrature for two correlated points, and its hyperparameter gradient with the sites fixed (R&W eq. 5.27)
is the finite-difference derivative of the re-converged evidence.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gpytorch.likelihoods import BernoulliLikelihood, PoissonLikelihood
from scipy import integrate

from gpytorch_iterncgp import LogitBernoulliLikelihood
from gpytorch_iterncgp.likelihoods.adapters import ExpPoissonLikelihood, likelihood_adapter
from gpytorch_iterncgp.likelihoods.tilted import tilted_moments
from tests import reference_ep

DTYPE = torch.float64
ADAPTERS = {
    "probit": BernoulliLikelihood,
    "logit": LogitBernoulliLikelihood,
    "poisson_exp": ExpPoissonLikelihood,
    "poisson_softplus": PoissonLikelihood,
}


def _kernel(x: torch.Tensor, lengthscale: float = 0.7, outputscale: float = 2.0) -> torch.Tensor:
    distance = (x[:, None] - x[None, :]) ** 2
    return outputscale * torch.exp(-distance / (2 * lengthscale**2)) + 1e-8 * torch.eye(len(x), dtype=DTYPE)


def _problem(n: int, likelihood: str = "probit", seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(n, generator=generator, dtype=DTYPE) * 4
    truth = torch.sin(2 * x)
    if likelihood in ("probit", "logit"):
        y = (truth + 0.3 * torch.randn(n, generator=generator, dtype=DTYPE) > 0).to(DTYPE)
    else:
        y = torch.poisson(torch.exp(truth + 1), generator=generator).to(DTYPE)
    return x, y


def test_sequential_and_parallel_damped_ep_reach_the_same_fixed_point():
    x, y = _problem(25)
    kernel = _kernel(x)
    sequential = reference_ep.sequential_ep(kernel, y)
    parallel = reference_ep.parallel_ep(kernel, y, damping=0.7)
    assert sequential.converged and parallel.converged
    for a, b in [
        (sequential.site_precision, parallel.site_precision),
        (sequential.site_natural_mean, parallel.site_natural_mean),
        (sequential.mean, parallel.mean),
        (sequential.covariance, parallel.covariance),
        (sequential.log_marginal_likelihood, parallel.log_marginal_likelihood),
    ]:
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8)
    assert bool((sequential.site_precision > 0).all())  # probit is log-concave: positive site precisions


@pytest.mark.parametrize("likelihood", list(ADAPTERS))
def test_posterior_marginals_match_the_tilted_moments_at_the_fixed_point(likelihood):
    """EP's moment matching, checked with the package's tilted moments (independent of the reference's)."""
    x, y = _problem(8 if likelihood != "probit" else 25, likelihood, seed=1)
    kernel = _kernel(x, outputscale=1.0)
    result = reference_ep.parallel_ep(kernel, y, likelihood, damping=0.8, tol=1e-11)
    assert result.converged
    cavity_mean, cavity_variance = result.cavity_natural_mean / result.cavity_precision, 1 / result.cavity_precision
    _, mean, variance = tilted_moments(likelihood_adapter(ADAPTERS[likelihood]()), y, cavity_mean, cavity_variance)
    torch.testing.assert_close(result.mean, mean, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(result.covariance.diagonal(), variance, rtol=1e-8, atol=1e-8)


def test_probit_closed_form_and_quadrature_ep_agree():
    x, y = _problem(6, seed=2)
    kernel = _kernel(x)
    closed = reference_ep.parallel_ep(kernel, y, "probit", damping=0.8, tol=1e-11)
    quadrature = reference_ep.parallel_ep(kernel, y, "probit_quad", damping=0.8, tol=1e-11)
    torch.testing.assert_close(closed.site_precision, quadrature.site_precision, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(closed.log_marginal_likelihood, quadrature.log_marginal_likelihood, rtol=1e-10, atol=0)


def _exact_log_evidence_1d(y: float, variance: float, likelihood: str) -> float:
    return reference_ep.quad_moments(y, 0.0, variance, likelihood)[0]


@pytest.mark.parametrize("likelihood", list(ADAPTERS))
@pytest.mark.parametrize("target", [0.0, 1.0])
def test_ep_is_exact_for_one_point(likelihood, target):
    kernel = torch.tensor([[3.0]], dtype=DTYPE)
    y = torch.tensor([target], dtype=DTYPE)
    result = reference_ep.sequential_ep(kernel, y, likelihood)
    exact = _exact_log_evidence_1d(target, 3.0, likelihood)
    assert float(result.log_marginal_likelihood) == pytest.approx(exact, rel=1e-8, abs=1e-10)


def test_ep_is_exact_for_independent_points_and_close_for_two_correlated_points():
    y = torch.tensor([1.0, 0.0], dtype=DTYPE)
    independent = reference_ep.sequential_ep(torch.diag(torch.tensor([2.0, 0.5], dtype=DTYPE)), y)
    exact = _exact_log_evidence_1d(1.0, 2.0, "probit") + _exact_log_evidence_1d(0.0, 0.5, "probit")
    assert float(independent.log_marginal_likelihood) == pytest.approx(exact, rel=1e-10)
    # two correlated points: the exact evidence by 2-D quadrature; EP is an approximation, close but not equal
    kernel = torch.tensor([[2.0, 1.2], [1.2, 1.5]], dtype=DTYPE)
    inverse, log_det = np.linalg.inv(kernel.numpy()), math.log(np.linalg.det(kernel.numpy()))
    from scipy.special import log_ndtr

    def integrand(f2: float, f1: float) -> float:
        f = np.array([f1, f2])
        return math.exp(log_ndtr(f1) + log_ndtr(-f2) - 0.5 * f @ inverse @ f - 0.5 * log_det - math.log(2 * math.pi))

    exact2 = math.log(integrate.dblquad(integrand, -15, 15, -15, 15, epsabs=1e-13, epsrel=1e-11)[0])
    ep = float(reference_ep.sequential_ep(kernel, y).log_marginal_likelihood)
    assert abs(ep - exact2) < 2e-3 and abs(ep - exact2) > 1e-6, (ep, exact2)


def test_probit_predictions_at_the_training_inputs_are_the_posterior_marginals():
    """R&W Alg. 3.6 at X reproduces the posterior (mean, diag covariance) of Alg. 3.5; elsewhere it is the GP
    regression mean/variance with targets mu_tilde and noise 1/tau_tilde."""
    x, y = _problem(20, seed=3)
    kernel = _kernel(x)
    result = reference_ep.sequential_ep(kernel, y)
    mean, variance, probability = reference_ep.probit_predict(kernel, kernel, kernel.diagonal(), result)
    torch.testing.assert_close(mean, result.mean, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(variance, result.covariance.diagonal(), rtol=1e-9, atol=1e-9)
    x_test = torch.linspace(-1, 5, 7, dtype=DTYPE)
    cross = 2.0 * torch.exp(-((x[:, None] - x_test[None, :]) ** 2) / (2 * 0.7**2))
    mean, variance, probability = reference_ep.probit_predict(kernel, cross, torch.full((7,), 2.0, dtype=DTYPE), result)
    noisy = kernel + torch.diag(1 / result.site_precision)
    pseudo = result.site_natural_mean / result.site_precision
    torch.testing.assert_close(mean, cross.mT @ torch.linalg.solve(noisy, pseudo), rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(variance, 2.0 - (cross * torch.linalg.solve(noisy, cross)).sum(0), rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(probability, torch.special.ndtr(mean / torch.sqrt(1 + variance)))


@pytest.mark.parametrize("likelihood", ["probit", "poisson_exp"])
def test_evidence_gradient_with_fixed_sites_is_the_derivative_of_the_converged_evidence(likelihood):
    """At the fixed point the EP evidence is stationary in the sites, so R&W eq. 5.27 (sites fixed) is the total
    derivative: central finite differences of the re-converged evidence in the lengthscale."""
    x, y = _problem(10 if likelihood == "probit" else 6, likelihood, seed=4)
    lengthscale, h = 0.7, 1e-4

    def evidence(ell: float) -> float:
        return float(
            reference_ep.parallel_ep(_kernel(x, ell), y, likelihood, damping=0.8, tol=1e-12).log_marginal_likelihood
        )

    result = reference_ep.parallel_ep(_kernel(x, lengthscale), y, likelihood, damping=0.8, tol=1e-12)
    distance = (x[:, None] - x[None, :]) ** 2
    derivative = 2.0 * torch.exp(-distance / (2 * lengthscale**2)) * distance / lengthscale**3
    analytic = float(reference_ep.evidence_gradient(_kernel(x, lengthscale), derivative, result))
    numeric = (evidence(lengthscale + h) - evidence(lengthscale - h)) / (2 * h)
    assert analytic == pytest.approx(numeric, rel=1e-5, abs=1e-7)
