r"""The multinomial probit's tilted moments under a factorised cavity, against independent references.

* :math:`\log\hat Z` against scipy's adaptive ``quad`` of the one-dimensional integral over :math:`w`, also where
  the observed class is improbable (the mass far in the cavity's tail);
* the moments against the EP identities :math:`\hat\mu = \mu + \sigma^2\alpha`, :math:`\hat\sigma^2 = \sigma^2 -
  \sigma^4(\alpha^2 - 2\beta)` with :math:`\alpha, \beta` central finite differences of scipy's :math:`\log\hat Z`;
* for :math:`C = 2` (one probit factor, where nested EP is exact) against nested EP's moments under the diagonal
  cavity covariance;
* the likelihood itself at a cavity of vanishing variance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from gpytorch_iterncgp.likelihoods.factorised import (
    factorised_log_normalizer,
    factorised_moments,
    factorised_probabilities,
)
from gpytorch_iterncgp.likelihoods.multinomial_probit import (
    multinomial_probit_log_probabilities,
    multinomial_probit_moments,
)

F64 = torch.float64


def _scipy_log_z(mean: np.ndarray, variance: np.ndarray, label: int) -> float:
    scale = np.sqrt(1 + variance)
    others = [j for j in range(len(mean)) if j != label]

    def integrand(w: float) -> float:
        return stats.norm.pdf(w, mean[label], scale[label]) * np.prod(
            [stats.norm.cdf((w - mean[j]) / scale[j]) for j in others]
        )

    centre, width = mean[label], scale[label]
    points = [centre + k * width for k in (-8, -4, 0, 4, 8)] + [float(mean[j]) for j in others]
    value, _ = integrate.quad(
        integrand, centre - 40 * width, centre + 40 * width, points=sorted(points), epsabs=0, epsrel=1e-12, limit=1000
    )
    return float(np.log(value))


def _problem(num_points: int, num_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    mean = 2 * torch.randn(num_points, num_classes, generator=generator, dtype=F64)
    variance = 0.05 + 3 * torch.rand(num_points, num_classes, generator=generator, dtype=F64)
    labels = torch.randint(num_classes, (num_points,), generator=generator)
    return labels, mean, variance


@pytest.mark.parametrize("num_classes", [3, 5])
def test_log_normalizer_against_scipy(num_classes):
    labels, mean, variance = _problem(8, num_classes, seed=num_classes)
    mean[0] = torch.linspace(6.0, 0.0, num_classes, dtype=F64)  # class 0 confident ...
    labels[0] = num_classes - 1  # ... and the observed class improbable
    log_z = factorised_log_normalizer(labels, mean, variance)
    expected = [_scipy_log_z(m.numpy(), v.numpy(), int(c)) for m, v, c in zip(mean, variance, labels, strict=True)]
    assert log_z[0] < -5
    torch.testing.assert_close(log_z, torch.tensor(expected, dtype=F64), rtol=1e-9, atol=1e-11)


def test_more_nodes_reach_scipy_where_the_classes_variances_lie_apart():
    """The observed class's variance 1000 times the others': each Φ in the integrand is a step narrower than its width
    at the mode, where the default 64 nodes err by about 3e-5 (docs/design_notes.md) and 256 reach scipy's ``quad``."""
    mean = torch.tensor([[0.0, 0.5, -0.5]], dtype=F64)
    variance = torch.tensor([[100.0, 0.1, 0.2]], dtype=F64)
    labels = torch.tensor([0])
    expected = _scipy_log_z(mean[0].numpy(), variance[0].numpy(), 0)
    errors = {
        count: abs(float(factorised_log_normalizer(labels, mean, variance, count)) - expected)
        for count in (16, 64, 256)
    }
    assert errors[16] > 1e-3 and 1e-6 < errors[64] < 1e-4 and errors[256] < 1e-10
    assert torch.equal(
        factorised_log_normalizer(labels, mean, variance), factorised_log_normalizer(labels, mean, variance, 64)
    )


def test_moments_against_finite_differences_of_scipy():
    labels, mean, variance = _problem(3, 3, seed=11)
    _, tilted_mean, tilted_variance = factorised_moments(labels, mean, variance)
    step = 1e-4
    for i in range(3):
        m, v, c = mean[i].numpy(), variance[i].numpy(), int(labels[i])
        for j in range(3):
            shift = np.eye(3)[j] * step
            alpha = (_scipy_log_z(m + shift, v, c) - _scipy_log_z(m - shift, v, c)) / (2 * step)
            beta = (_scipy_log_z(m, v + shift, c) - _scipy_log_z(m, v - shift, c)) / (2 * step)
            expected_mean = m[j] + v[j] * alpha
            expected_variance = v[j] - v[j] ** 2 * (alpha**2 - 2 * beta)
            assert abs(float(tilted_mean[i, j]) - expected_mean) < 1e-6
            assert abs(float(tilted_variance[i, j]) - expected_variance) < 1e-6


def test_two_classes_equal_nested_ep():
    labels, mean, variance = _problem(20, 2, seed=3)
    log_z, tilted_mean, tilted_variance = factorised_moments(labels, mean, variance)
    nested_log_z, nested_mean, nested_covariance = multinomial_probit_moments(labels, mean, torch.diag_embed(variance))
    torch.testing.assert_close(log_z, nested_log_z, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(tilted_mean, nested_mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(tilted_variance, nested_covariance.diagonal(dim1=-2, dim2=-1), rtol=1e-9, atol=1e-12)


def test_vanishing_cavity_variance_is_the_likelihood():
    labels, mean, _ = _problem(10, 4, seed=5)
    log_z = factorised_log_normalizer(labels, mean, torch.full_like(mean, 1e-14))
    expected = multinomial_probit_log_probabilities(mean).gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(log_z, expected, rtol=1e-10, atol=1e-12)


def test_probabilities_are_the_normalisers_of_every_class_and_sum_to_one():
    _, mean, variance = _problem(6, 4, seed=8)
    probabilities = factorised_probabilities(mean, variance)
    torch.testing.assert_close(probabilities.sum(-1), torch.ones(6, dtype=F64), rtol=1e-12, atol=1e-12)
    expected = [
        [np.exp(_scipy_log_z(m.numpy(), v.numpy(), c)) for c in range(4)] for m, v in zip(mean, variance, strict=True)
    ]
    torch.testing.assert_close(probabilities, torch.tensor(expected, dtype=F64), rtol=1e-8, atol=1e-12)


def test_probabilities_in_blocks_are_those_in_one(monkeypatch):
    from gpytorch_iterncgp.likelihoods import factorised

    _, mean, variance = _problem(7, 3, seed=9)
    whole = factorised_probabilities(mean, variance)
    monkeypatch.setattr(factorised, "_CHUNK", 3 * 3 * 64 * 2)  # blocks of two points
    torch.testing.assert_close(factorised_probabilities(mean, variance), whole, rtol=0, atol=1e-15)


def test_float32_in_float32_out():
    labels, mean, variance = _problem(6, 3, seed=2)
    log_z, tilted_mean, tilted_variance = factorised_moments(labels, mean.float(), variance.float())
    assert log_z.dtype == tilted_mean.dtype == tilted_variance.dtype == torch.float32
    reference = factorised_moments(labels, mean, variance)
    torch.testing.assert_close(tilted_mean, reference[1].float(), rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused():
    labels, mean, variance = _problem(4, 3, seed=1)
    with pytest.raises(ValueError, match="positive finite variances"):
        factorised_moments(labels, mean, variance.neg())
    with pytest.raises(ValueError, match="shape"):
        factorised_moments(labels, mean, variance[:, :2])
    with pytest.raises(ValueError, match="class indices"):
        factorised_moments(labels + 3, mean, variance)
    for count in (0, 257):
        with pytest.raises(ValueError, match="num_nodes"):
            factorised_moments(labels, mean, variance, count)
