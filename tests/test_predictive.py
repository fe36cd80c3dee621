"""Predictive class probabilities: the rules against independent references.

* binary logit, :math:`\\mathbb E[\\sigma(f)]`: against scipy's adaptive ``quad`` of :math:`\\sigma(f)\\mathcal N(f)`;
* softmax, the pairwise mean-field approximation of :math:`\\mathbb E[\\operatorname{softmax}(\\mathbf f)]`:
  against Monte Carlo (fixed seed, 10^6 antithetic pairs), its error :math:`O(\\|\\Sigma\\|)` as the covariance
  shrinks, its invariance to a variance common to all classes (as the softmax's), and for :math:`C = 2` the
  binary probit formula;
* the per-point :math:`C \\times C` posterior blocks of the strategy against the dense posterior covariance of
  ``model(test_x)``, and the strategy's predictive probabilities against the rules applied to the dense
  exact Laplace reference.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gpytorch_iterncgp import LogitBernoulliLikelihood
from gpytorch_iterncgp.likelihoods import logistic_gaussian, softmax_gaussian
from tests.test_exact_laplace import EXACT, build, exact_laplace, make_test_inputs, reference_predictive

DTYPE = torch.float64


def _quad_logistic(mean: float, std: float) -> float:
    """E[sigma(f)], f ~ N(mean, std^2), by scipy's adaptive quadrature over the standardised variable."""
    from scipy.integrate import quad
    from scipy.special import expit

    if std == 0:
        return float(expit(mean))

    def integrand(z):
        return expit(mean + std * z) * math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)

    kink = -mean / std  # where the sigmoid switches: quad is told, so it does not step over it
    points = [kink] if abs(kink) < 40 else None
    value, _ = quad(integrand, -40, 40, points=points, epsabs=1e-14, epsrel=1e-13, limit=1000)
    return value  # the standard normal beyond |z| = 40: e^-800


@pytest.mark.parametrize("std", [0.0, 0.05, 0.5, 1.0, 1.0 + 1e-9, 1.5, 3.0, 7.0, 30.0, 300.0])
def test_logistic_gaussian_matches_scipy_quad(std):
    """To 1e-8 for latent standard deviations from 0 to 300 (both branches of the rule, and its switch at 1)."""
    means = [-40.0, -8.0, -1.3, 0.0, 0.4, 2.5, 12.0]
    mean = torch.tensor(means, dtype=DTYPE)
    ours = logistic_gaussian(mean, torch.full_like(mean, std**2))
    expected = torch.tensor([_quad_logistic(m, std) for m in means], dtype=DTYPE)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-8)
    torch.testing.assert_close(logistic_gaussian(-mean, torch.full_like(mean, std**2)), 1 - expected, rtol=0, atol=1e-8)


def test_logit_likelihood_marginal_is_the_quadrature():
    """``LogitBernoulliLikelihood.marginal`` integrates against each marginal (scipy quad, 1e-8)."""
    import gpytorch

    mean = torch.tensor([-2.0, 0.3, 1.0, 4.0], dtype=DTYPE)
    variance = torch.tensor([0.2, 4.0, 49.0, 1e-6], dtype=DTYPE)
    distribution = gpytorch.distributions.MultivariateNormal(mean, torch.diag(variance))
    probabilities = LogitBernoulliLikelihood().marginal(distribution).probs
    expected = [_quad_logistic(float(m), math.sqrt(float(v))) for m, v in zip(mean, variance, strict=True)]
    torch.testing.assert_close(probabilities, torch.tensor(expected, dtype=DTYPE), rtol=0, atol=1e-8)


# ---------------------------------------------------------------------------------------------------
# Softmax: the pairwise mean-field approximation
# ---------------------------------------------------------------------------------------------------
MEAN = torch.tensor([1.0, -0.5, 0.2, 0.0], dtype=DTYPE)


def _covariance() -> torch.Tensor:
    factor = torch.randn(4, 4, generator=torch.Generator().manual_seed(0), dtype=DTYPE)
    return factor @ factor.mT / 4


def _monte_carlo(mean: torch.Tensor, covariance: torch.Tensor, pairs: int = 10**6) -> tuple[torch.Tensor, float]:
    """E[softmax(f)], f ~ N(mean, covariance), from ``pairs`` antithetic pairs; and its largest standard error."""
    root = torch.linalg.cholesky(covariance)
    normal = torch.randn(pairs, len(mean), generator=torch.Generator().manual_seed(1), dtype=DTYPE) @ root.mT
    samples = (torch.softmax(mean + normal, -1) + torch.softmax(mean - normal, -1)) / 2
    return samples.mean(0), float(samples.std(0).max()) / math.sqrt(pairs)


def test_softmax_mean_field_against_monte_carlo():
    """A generic 4-class Gaussian (correlations of both signs, variances ~0.5): within 0.03 of Monte Carlo
    (measured 0.021; the Monte Carlo standard error is 1e-4)."""
    covariance = _covariance()
    expected, error = _monte_carlo(MEAN, covariance)
    assert error < 2e-4
    ours = softmax_gaussian(MEAN, covariance)
    assert float((ours - expected).abs().max()) < 0.03
    torch.testing.assert_close(ours.sum(), torch.tensor(1.0, dtype=DTYPE), rtol=0, atol=1e-15)


@pytest.mark.parametrize("scale", [1e-1, 1e-2, 1e-3])
def test_softmax_mean_field_error_vanishes_with_the_covariance(scale):
    """Covariance ``scale * S``: the error against Monte Carlo is below ``0.05 scale`` (measured 0.031 scale: first
    order in the covariance), far above the Monte Carlo error (antithetic pairs: the first-order term cancels)."""
    covariance = scale * _covariance()
    expected, error = _monte_carlo(MEAN, covariance)
    difference = float((softmax_gaussian(MEAN, covariance) - expected).abs().max())
    assert 5 * error < 0.01 * scale
    assert difference < 0.05 * scale


def test_softmax_mean_field_ignores_a_variance_common_to_all_classes():
    """softmax(f + c 1) = softmax(f): a common variance ``a 1 1^T`` (what a kernel shared by the classes puts into
    the posterior) changes neither the truth (Monte Carlo) nor the rule (to rounding); the former rule, the
    probit approximation per class with the marginal variances, moved by 0.1 there."""
    covariance = _covariance()
    common = covariance + 25 * torch.ones(4, 4, dtype=DTYPE)
    with_common, error = _monte_carlo(MEAN, common)
    without, _ = _monte_carlo(MEAN, covariance)
    assert float((with_common - without).abs().max()) < 6 * error
    torch.testing.assert_close(softmax_gaussian(MEAN, common), softmax_gaussian(MEAN, covariance), rtol=0, atol=1e-14)
    marginal_rule = torch.softmax(MEAN / torch.sqrt(1 + math.pi / 8 * common.diagonal()), -1)
    assert float((marginal_rule - with_common).abs().max()) > 0.09


def test_softmax_mean_field_for_two_classes_is_the_binary_probit_approximation():
    """C = 2: p_1 = sigma((mu_1 - mu_2) / sqrt(1 + pi Var(f_1 - f_2) / 8)), in closed form (batch of points)."""
    generator = torch.Generator().manual_seed(2)
    mean = 3 * torch.randn(50, 2, generator=generator, dtype=DTYPE)
    factor = torch.randn(50, 2, 2, generator=generator, dtype=DTYPE)
    covariance = factor @ factor.mT
    difference = covariance[:, 0, 0] + covariance[:, 1, 1] - 2 * covariance[:, 0, 1]
    expected = 1 / (1 + torch.exp(-(mean[:, 0] - mean[:, 1]) / torch.sqrt(1 + math.pi * difference / 8)))
    ours = softmax_gaussian(mean, covariance)
    torch.testing.assert_close(ours[:, 0], expected, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(ours[:, 1], 1 - expected, rtol=1e-13, atol=1e-15)


def test_softmax_mean_field_without_covariance_is_the_softmax():
    mean = torch.tensor([[2.0, -1.0, 0.5], [800.0, 0.0, -800.0]], dtype=DTYPE)
    ours = softmax_gaussian(mean, torch.zeros(2, 3, 3, dtype=DTYPE))
    torch.testing.assert_close(ours, torch.softmax(mean, -1), rtol=1e-14, atol=1e-300)


# ---------------------------------------------------------------------------------------------------
# The strategy: per-point C x C posterior blocks, and its predictive probabilities
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["softmax-shared", "softmax-independent", "logit-constant-mean"])
@pytest.mark.parametrize("policy", ["unit", "cg"])
def test_marginal_latent_blocks_are_the_dense_posterior_blocks(case, policy):
    """Blocks of ``model(test_x).covariance_matrix`` (eval mode, interleaved) to 1e-10, with exact solves and with a
    few CG iterations (computational uncertainty); the diagonals are ``marginal_latent``'s variances."""
    options = EXACT if policy == "unit" else dict(policy="cg", max_solver_iterations=3, max_newton_steps=3)
    model, _, x, _, _, num_classes = build(case, **options)
    model.variational_strategy.fit()
    model.eval()
    test_x = make_test_inputs(x.shape[-1], num=7)
    with torch.no_grad():
        posterior = model(test_x)
        mean, blocks = model.variational_strategy.marginal_latent_blocks(test_x)
        marginal_mean, variance = model.variational_strategy.marginal_latent(test_x)
    dense = posterior.covariance_matrix.reshape(7, num_classes, 7, num_classes)
    expected = torch.stack([dense[n, :, n, :] for n in range(7)])
    assert blocks.shape == (7, num_classes, num_classes)
    torch.testing.assert_close(blocks, expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(mean, posterior.mean.reshape(7, num_classes), rtol=0, atol=1e-10)
    torch.testing.assert_close(mean, marginal_mean, rtol=0, atol=0)
    torch.testing.assert_close(blocks.diagonal(dim1=-2, dim2=-1), variance, rtol=0, atol=1e-12)


def _mean_field_numpy(mean: np.ndarray, covariance: np.ndarray) -> np.ndarray:
    """The pairwise mean-field formula of Lu, Ie and Sha (2020), written out with loops (one point)."""
    num = len(mean)
    unnormalised = np.empty(num)
    for k in range(num):
        total = 1.0
        for j in range(num):
            if j != k:
                spread = covariance[k, k] + covariance[j, j] - 2 * covariance[k, j]
                total += math.exp(-(mean[k] - mean[j]) / math.sqrt(1 + math.pi / 8 * spread))
        unnormalised[k] = 1 / total
    return unnormalised / unnormalised.sum()


@pytest.mark.parametrize("case", ["softmax-shared", "softmax-independent", "logit-constant-mean"])
def test_predictive_probabilities_apply_the_rules_to_the_exact_laplace_posterior(case):
    """Exact solves: probabilities = the rule on the dense reference posterior (R&W Algorithms 3.1–3.4) at each test
    point (softmax: its C x C block, formula with loops; logit: scipy quad), to 1e-8."""
    model, _, x, y, name, num_classes = build(case, **EXACT)
    model.variational_strategy.fit()
    exact, _, _ = exact_laplace(model, x, y, name, num_classes)
    model.eval()
    test_x = make_test_inputs(x.shape[-1], seed=12)
    mean, covariance = reference_predictive(model, exact, x, test_x, num_classes)
    with torch.no_grad():
        probabilities = model.variational_strategy.predictive_probabilities(test_x)
    if num_classes == 1:
        expected = [
            _quad_logistic(float(m), math.sqrt(float(v))) for m, v in zip(mean, covariance.diagonal(), strict=True)
        ]
    else:
        dense = covariance.reshape(len(test_x), num_classes, len(test_x), num_classes).numpy()
        means = mean.reshape(-1, num_classes).numpy()
        expected = [_mean_field_numpy(means[n], dense[n, :, n, :]) for n in range(len(test_x))]
    torch.testing.assert_close(probabilities, torch.tensor(np.array(expected), dtype=DTYPE), rtol=0, atol=1e-8)
