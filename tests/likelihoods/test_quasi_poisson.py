"""The Poisson quasi-likelihoods of :mod:`gpytorch_iterncgp.likelihoods.quasi_poisson`: the log-density at non-integer
targets is y log λ − λ − lgamma(y + 1) (``torch.lgamma`` as the reference, elementwise: no BLAS), in float32 and
float64, for both links; the support is every y ≥ 0 (GPyTorch's Poisson refuses non-integers), and the autograd
adapter takes its derivatives."""

from __future__ import annotations

import pytest
import torch
from gpytorch.likelihoods import PoissonLikelihood

from gpytorch_iterncgp import ExpPoissonLikelihood, QuasiExpPoissonLikelihood, QuasiSoftplusPoissonLikelihood
from gpytorch_iterncgp.likelihoods.adapters import AutogradAdapter, likelihood_adapter
from gpytorch_iterncgp.likelihoods.quasi_poisson import NonNegativePoisson

LINKS = {
    "exp": (QuasiExpPoissonLikelihood, torch.exp, ExpPoissonLikelihood),
    "softplus": (QuasiSoftplusPoissonLikelihood, torch.nn.functional.softplus, PoissonLikelihood),
}
TOLERANCES = {torch.float32: dict(rtol=1e-6, atol=1e-5), torch.float64: dict(rtol=1e-14, atol=1e-13)}


def _targets_and_latents(dtype):
    y = torch.tensor([0.0, 0.25, 0.5, 1.5, 2.75, 7.1, 30.3], dtype=dtype)
    f = torch.tensor([-2.0, -0.7, 0.0, 0.4, 1.1, 2.0, 3.3], dtype=dtype)
    return y, f


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("link", ["exp", "softplus"])
def test_log_density_is_the_quasi_likelihood_at_non_integer_targets(link, dtype):
    likelihood_type, rate_of, _ = LINKS[link]
    y, f = _targets_and_latents(dtype)
    rate = rate_of(f)
    expected = y * torch.log(rate) - rate - torch.lgamma(y + 1)
    distribution = likelihood_type().forward(f)
    assert isinstance(distribution, NonNegativePoisson)
    got = distribution.log_prob(y)
    assert got.dtype == dtype and got.shape == y.shape
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])
    # y = 0: the log-density is -λ (0 log λ = 0, lgamma(1) = 0)
    torch.testing.assert_close(got[0], -rate[0], **TOLERANCES[dtype])


@pytest.mark.parametrize("link", ["exp", "softplus"])
def test_support_is_every_non_negative_real_and_batches_broadcast(link):
    likelihood_type, _, integer_type = LINKS[link]
    y, f = _targets_and_latents(torch.float64)
    assert bool(likelihood_type().forward(f).support.check(y).all())
    assert not bool(likelihood_type().forward(f).support.check(-y[1:]).any())
    assert not bool(integer_type().forward(f).support.check(y[1:5]).any())  # the integer Poisson refuses them
    samples = torch.stack([f, f + 1.0, f - 1.0])  # (S, N) function samples
    distribution = likelihood_type().forward(samples)
    assert distribution.batch_shape == torch.Size([3, len(f)]) and distribution.log_prob(y).shape == (3, len(f))


@pytest.mark.parametrize("link", ["exp", "softplus"])
def test_equals_the_integer_poisson_at_counts(link):
    likelihood_type, _, integer_type = LINKS[link]
    counts = torch.tensor([0.0, 1.0, 2.0, 5.0, 13.0], dtype=torch.float64)
    f = torch.linspace(-1.5, 2.5, len(counts), dtype=torch.float64)
    torch.testing.assert_close(
        likelihood_type().forward(f).log_prob(counts), integer_type().forward(f).log_prob(counts), rtol=0, atol=0
    )


@pytest.mark.parametrize("link", ["exp", "softplus"])
def test_the_adapter_takes_non_integer_targets_and_gives_the_quasi_likelihoods_gradient(link):
    likelihood_type, rate_of, _ = LINKS[link]
    y, f = _targets_and_latents(torch.float64)
    adapter = likelihood_adapter(likelihood_type())
    assert isinstance(adapter, AutogradAdapter)
    adapter._check_support(y)  # no ValueError
    _, gradient, _ = adapter.local_terms(f[:, None], y)
    # d/df [y log λ − λ] = (y / λ − 1) λ'
    derivative = rate_of(f) if link == "exp" else torch.sigmoid(f)
    torch.testing.assert_close(gradient[:, 0], (y / rate_of(f) - 1) * derivative, rtol=1e-13, atol=1e-13)
