"""Predictive class probabilities: the rules against independent references.

* binary logit, :math:`\\mathbb E[\\sigma(f)]`: against scipy's adaptive ``quad`` of :math:`\\sigma(f)\\mathcal N(f)`;
* softmax, :math:`\\mathbb E[\\operatorname{softmax}(\\mathbf f)]` by Monte Carlo with fixed base samples over
  the differences of the latents: against an independent Monte Carlo (10^6 antithetic pairs) within its standard
  error, its convergence in the samples, its invariance to a variance common to all classes (as the softmax's),
  and for :math:`C = 2` the 1-D logistic-Gaussian integral;
* the per-point :math:`C \\times C` posterior blocks of the strategy against the dense posterior covariance of
  ``model(test_x)``, and the strategy's predictive probabilities against the rules applied to the dense
  exact Laplace reference.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gpytorch_iterncgp import LogitBernoulliLikelihood, settings
from gpytorch_iterncgp.likelihoods.adapters import likelihood_adapter, logistic_gaussian, softmax_gaussian
from tests.common import IterNCGPModel, multiclass_data, softmax_likelihood
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
# Softmax: Monte Carlo over the differences of the latents, fixed base samples
# ---------------------------------------------------------------------------------------------------
MEAN = torch.tensor([1.0, -0.5, 0.2, 0.0], dtype=DTYPE)


def _covariance() -> torch.Tensor:
    factor = torch.randn(4, 4, generator=torch.Generator().manual_seed(0), dtype=DTYPE)
    return factor @ factor.mT / 4


def _monte_carlo(mean: torch.Tensor, covariance: torch.Tensor, pairs: int = 10**6) -> tuple[torch.Tensor, float]:
    """E[softmax(f)], f ~ N(mean, covariance), from ``pairs`` antithetic pairs of an independent generator (seed
    1, Cholesky root of the full covariance); and its largest standard error."""
    root = torch.linalg.cholesky(covariance)
    normal = torch.randn(pairs, len(mean), generator=torch.Generator().manual_seed(1), dtype=DTYPE) @ root.mT
    samples = (torch.softmax(mean + normal, -1) + torch.softmax(mean - normal, -1)) / 2
    return samples.mean(0), float(samples.std(0).max()) / math.sqrt(pairs)


@pytest.mark.parametrize("scale", [1.0, 10.0, 100.0])
def test_softmax_gaussian_against_a_large_monte_carlo_reference(scale):
    """A generic 4-class Gaussian (correlations of both signs), covariance ``scale * S``: within 4 standard errors
    of the 1024-sample rule (0.5 / sqrt(1024) per probability) of 10^6 independent antithetic pairs."""
    covariance = scale * _covariance()
    expected, error = _monte_carlo(MEAN, covariance)
    assert error < 1e-3
    ours = softmax_gaussian(MEAN, covariance)
    assert float((ours - expected).abs().max()) < 4 * 0.5 / math.sqrt(1024)
    torch.testing.assert_close(ours.sum(), torch.tensor(1.0, dtype=DTYPE), rtol=0, atol=1e-14)


def test_softmax_gaussian_converges_in_the_number_of_samples():
    """More samples, closer to the reference: 10^5 samples within 4 standard errors of 10^6 reference pairs."""
    covariance = 10 * _covariance()
    expected, error = _monte_carlo(MEAN, covariance)
    ours = softmax_gaussian(MEAN, covariance, num_samples=10**5)
    assert float((ours - expected).abs().max()) < 4 * (0.5 / math.sqrt(10**5) + error)


def test_softmax_gaussian_ignores_a_variance_common_to_all_classes():
    """softmax(f + c 1) = softmax(f): a common variance ``a 1 1^T`` (what a kernel shared by the classes puts into
    the posterior) changes neither the truth (an independent Monte Carlo) nor the rule (to rounding); the per-class
    probit approximation with the marginal variances moved by 0.1 there."""
    covariance = _covariance()
    common = covariance + 25 * torch.ones(4, 4, dtype=DTYPE)
    with_common, error = _monte_carlo(MEAN, common)
    without, _ = _monte_carlo(MEAN, covariance)
    assert float((with_common - without).abs().max()) < 6 * error
    torch.testing.assert_close(softmax_gaussian(MEAN, common), softmax_gaussian(MEAN, covariance), rtol=0, atol=1e-12)
    marginal_rule = torch.softmax(MEAN / torch.sqrt(1 + math.pi / 8 * common.diagonal()), -1)
    assert float((marginal_rule - with_common).abs().max()) > 0.09


def test_softmax_gaussian_for_two_classes_is_the_logistic_gaussian_integral():
    """C = 2: p_1 = E[sigma(f_1 - f_2)], a 1-D integral (quadrature to 1e-13): within 4 standard errors."""
    generator = torch.Generator().manual_seed(2)
    mean = 3 * torch.randn(50, 2, generator=generator, dtype=DTYPE)
    factor = torch.randn(50, 2, 2, generator=generator, dtype=DTYPE)
    covariance = factor @ factor.mT
    difference = covariance[:, 0, 0] + covariance[:, 1, 1] - 2 * covariance[:, 0, 1]
    expected = logistic_gaussian(mean[:, 0] - mean[:, 1], difference)
    ours = softmax_gaussian(mean, covariance)
    assert float((ours[:, 0] - expected).abs().max()) < 4 * 0.5 / math.sqrt(1024)
    torch.testing.assert_close(ours.sum(-1), torch.ones(50, dtype=DTYPE), rtol=0, atol=1e-14)


def test_softmax_gaussian_is_deterministic_and_without_covariance_the_softmax():
    mean = torch.tensor([[2.0, -1.0, 0.5], [800.0, 0.0, -800.0]], dtype=DTYPE)
    ours = softmax_gaussian(mean, torch.zeros(2, 3, 3, dtype=DTYPE))
    torch.testing.assert_close(ours, torch.softmax(mean, -1), rtol=1e-14, atol=1e-300)
    covariance = _covariance()[:3, :3].expand(2, 3, 3)
    torch.testing.assert_close(softmax_gaussian(mean, covariance), softmax_gaussian(mean, covariance), rtol=0, atol=0)
    float32 = softmax_gaussian(mean.float(), covariance.float()).double()
    torch.testing.assert_close(float32, softmax_gaussian(mean, covariance), rtol=0, atol=1e-5)


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


@pytest.mark.parametrize("case", ["softmax-shared", "softmax-independent", "logit-constant-mean"])
def test_predictive_probabilities_apply_the_rules_to_the_exact_laplace_posterior(case):
    """Exact solves: probabilities = the rule on the dense reference posterior (R&W Algorithms 3.1–3.4) at each test
    point (softmax: the Monte Carlo rule, same base samples, on the reference's C x C blocks; logit: scipy quad), to
    1e-8."""
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
        dense = covariance.reshape(len(test_x), num_classes, len(test_x), num_classes)
        blocks = torch.stack([dense[n, :, n, :] for n in range(len(test_x))])
        expected = softmax_gaussian(mean.reshape(-1, num_classes), blocks).numpy()
    torch.testing.assert_close(probabilities, torch.tensor(np.array(expected), dtype=DTYPE), rtol=0, atol=1e-8)


def test_softmax_predictive_is_monte_carlo_under_the_full_joint_posterior():
    """``predictive_probabilities`` is E[softmax(f)] under the posterior the strategy holds: against Monte Carlo from
    the full joint posterior ``model(test_x)`` (all N* C latents, GPyTorch's own sampler), within 4 standard errors.
    A shared kernel with an incomplete solve and the covariance phase: the classes' latents are strongly correlated,
    so the rule under independent marginals is measurably off, and the test can tell the two apart."""
    train_x, train_y = multiclass_data(num_data=60)
    model = IterNCGPModel(
        train_x, train_y, softmax_likelihood(), outputscale=5.0, max_solver_iterations=3, covariance_iterations=2
    )
    model.variational_strategy.fit()
    model.eval()
    test_x = torch.rand(6, 2, dtype=train_x.dtype, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), settings.softmax_samples(2**16):
        rule = model.variational_strategy.predictive_probabilities(test_x)
        joint = model(test_x)  # MultitaskMultivariateNormal over (N*, C), the full (N* C) x (N* C) covariance
        torch.manual_seed(0)
        samples = torch.softmax(joint.rsample(torch.Size([100_000])), dim=-1)  # (S, N*, C)
        mean, variance = model.variational_strategy.marginal_latent(test_x)
        independent = likelihood_adapter(softmax_likelihood()).predictive_mean(mean, torch.diag_embed(variance))
    tolerance = 4 * (samples.std(0) / math.sqrt(len(samples)) + 0.5 / math.sqrt(2**16))
    assert bool(((rule - samples.mean(0)).abs() <= tolerance).all())
    assert float((independent - samples.mean(0)).abs().max()) > 3 * float(tolerance.max())
