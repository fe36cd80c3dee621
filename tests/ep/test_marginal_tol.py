r"""EP's convergence on its marginals (``marginal_tol``): the divergence it measures is the mean Kullback–Leibler
divergence per latent value (checked against torch.distributions), and a fit that stops on it lands near exact EP's
marginals (the dense sequential reference, R&W Alg. 3.5) in a fraction of the sweeps the sites' test takes."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import MultivariateNormal, Normal, kl_divergence

from gpytorch_iterncgp.core.sharding import RowBlock
from gpytorch_iterncgp.ep.sweeps import marginal_divergence
from tests import reference_ep
from tests.ep.test_ep import _data, _kernel, _model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_marginal_divergence_is_the_mean_kl_divergence_per_latent_value(dtype):
    generator = torch.Generator().manual_seed(0)
    mean, old_mean = torch.randn(2, 50, generator=generator, dtype=dtype)
    variance, old_variance = torch.rand(2, 50, generator=generator, dtype=dtype) + 0.1
    expected = kl_divergence(Normal(mean, variance.sqrt()), Normal(old_mean, old_variance.sqrt())).mean()
    got = marginal_divergence((mean, variance), (old_mean, old_variance), RowBlock.single(50), 50)
    assert math.isclose(got, float(expected), rel_tol=1e-5)

    num_points, num_latents = 20, 4
    means = torch.randn(2, num_points, num_latents, generator=generator, dtype=dtype)
    roots = torch.randn(2, num_points, num_latents, num_latents, generator=generator, dtype=dtype)
    blocks = roots @ roots.mT + 0.5 * torch.eye(num_latents, dtype=dtype)
    expected = kl_divergence(MultivariateNormal(means[0], blocks[0]), MultivariateNormal(means[1], blocks[1]))
    got = marginal_divergence(
        (means[0], blocks[0]), (means[1], blocks[1]), RowBlock.single(num_points * num_latents), num_points
    )
    assert math.isclose(got, float(expected.mean()) / num_latents, rel_tol=1e-4)
    assert marginal_divergence((mean, variance), (mean, variance), RowBlock.single(50), 50) == 0.0
    # a variance that is not positive: no finite divergence, so no convergence on it
    assert marginal_divergence((mean, -variance), (mean, variance), RowBlock.single(50), 50) == math.inf
    assert marginal_divergence((means[0], -blocks[0]), (means[1], blocks[1]), RowBlock.single(80), 20) == math.inf


def test_a_fit_stopped_on_its_marginals_is_near_exact_ep_in_a_fraction_of_the_sweeps():
    """Binary probit EP with complete solves (60 points, s² 5): with the sites' test alone (site_tol 1e-11) the fit
    takes 52 sweeps; stopped where a sweep moves the marginals by at most ``marginal_tol`` it took 5, 7 and 9 sweeps
    for 1e-3, 1e-4 and 1e-5 (measured), and its marginals' mean KL divergence from exact EP's was 1.4, 1.6 and 1.9
    times the tolerance (parallel EP converges linearly, so the distance left is a multiple of the last step).
    Asserted: fewer sweeps than the sites' test, the last sweep's change at most the tolerance and every earlier one
    above it, and the distance from exact EP below 5 times the tolerance."""
    x, y = _data("probit", num_data=60, seed=2)
    strict = _model("probit", x, y, outputscale=5.0)
    strict_report = strict.variational_strategy.fit()
    assert strict_report.converged and all(math.isnan(record.marginal_change) for record in strict_report.records)
    reference = reference_ep.sequential_ep(_kernel(strict, x), y, likelihood="probit")
    covariance = torch.linalg.inv(torch.linalg.inv(_kernel(strict, x)) + torch.diag(reference.site_precision))
    exact = (covariance @ reference.site_natural_mean, covariance.diagonal())
    for tolerance in (1e-3, 1e-4, 1e-5):
        model = _model("probit", x, y, outputscale=5.0, marginal_tol=tolerance)
        report = model.variational_strategy.fit()
        changes = [record.marginal_change for record in report.records]
        assert report.converged and report.steps < strict_report.steps
        assert changes[-1] <= tolerance and all(change > tolerance for change in changes[:-1])
        assert "marginal change" in str(report)
        model.eval()
        with torch.no_grad():
            mean, variance = model.variational_strategy.marginal_latent(x)
        distance = marginal_divergence((mean[:, 0], variance[:, 0]), exact, RowBlock.single(60), 60)
        assert distance < 5 * tolerance


def test_marginal_tol_is_checked():
    x, y = _data("probit", num_data=10)
    for value in (0.0, -1e-3, True, "1e-3"):
        with pytest.raises(ValueError, match="marginal_tol"):
            _model("probit", x, y, marginal_tol=value)
