"""Tilted moments for EP against adaptive quadrature (scipy ``quad``) of the tilted density, in the hard regimes."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from gpytorch.likelihoods import BernoulliLikelihood, PoissonLikelihood

from gpytorch_iterncgp import LogitBernoulliLikelihood
from gpytorch_iterncgp.likelihoods.adapters import ExpPoissonLikelihood, likelihood_adapter
from gpytorch_iterncgp.likelihoods.tilted import tilted_mode, tilted_moments
from tests import reference_ep

ADAPTERS = {
    "probit": lambda: likelihood_adapter(BernoulliLikelihood()),
    "logit": lambda: likelihood_adapter(LogitBernoulliLikelihood()),
    "poisson_exp": lambda: likelihood_adapter(ExpPoissonLikelihood()),
    "poisson_softplus": lambda: likelihood_adapter(PoissonLikelihood()),
}
# (targets, cavity means, cavity standard deviations): confident labels, wide and narrow cavities, counts to 1e6
GRIDS = {
    "probit": ([0.0, 1.0], [-40.0, -10.0, -1.0, 0.0, 1.0, 10.0, 40.0], [0.01, 1.0, 100.0]),
    "logit": ([0.0, 1.0], [-40.0, -10.0, -2.0, 0.0, 2.0, 10.0, 40.0], [0.01, 0.1, 1.0, 3.0, 10.0, 30.0, 100.0]),
    "poisson_exp": ([0.0, 1.0, 1e3, 1e6], [-20.0, -5.0, 0.0, 5.0, 20.0], [0.01, 0.1, 1.0, 3.0, 10.0]),
    "poisson_softplus": ([0.0, 1.0, 1e3, 1e6], [-20.0, -5.0, 0.0, 5.0, 20.0], [0.01, 0.1, 1.0, 3.0, 10.0]),
}


def _grid(likelihood: str, dtype: torch.dtype = torch.float64):
    rows = list(itertools.product(*GRIDS[likelihood]))
    y, mean, sd = (torch.tensor(column, dtype=dtype) for column in zip(*rows, strict=True))
    return y, mean, sd**2


def _errors(likelihood: str, y, mean, variance, moments):
    """Errors of (log Z, mean, variance) against quad: absolute in log Z (relative in Z) per max(1, |log Z|),
    the mean's per tilted sd and max(1, |mean|) * eps-scale, the variance's relative."""
    ref = [
        reference_ep.quad_moments(float(a), float(b), float(c), likelihood)
        for a, b, c in zip(y.double(), mean.double(), variance.double(), strict=True)
    ]
    ref_log_z, ref_mean, ref_var = (torch.tensor(column, dtype=torch.float64) for column in zip(*ref, strict=True))
    log_z, tilted_mean, tilted_var = (m.double() for m in moments)
    return (
        ((log_z - ref_log_z).abs() / ref_log_z.abs().clamp_min(1)).max().item(),
        ((tilted_mean - ref_mean).abs() / ref_var.sqrt()).max().item(),
        ((tilted_var - ref_var).abs() / ref_var).max().item(),
        ((tilted_mean - ref_mean).abs() / (ref_var.sqrt() + ref_mean.abs())).max().item(),
    )


@pytest.mark.parametrize("likelihood", list(GRIDS))
def test_tilted_moments_match_adaptive_quadrature_in_float64(likelihood):
    """Measured: all within 4e-10 (log Z and variance relative, mean per tilted sd); asserted at 1e-8."""
    y, mean, variance = _grid(likelihood)
    moments = tilted_moments(ADAPTERS[likelihood](), y, mean, variance)
    assert all(m.dtype == torch.float64 and m.shape == y.shape for m in moments)
    log_z_error, mean_error, var_error, _ = _errors(likelihood, y, mean, variance, moments)
    assert log_z_error < 1e-8 and mean_error < 1e-8 and var_error < 1e-8, (log_z_error, mean_error, var_error)


@pytest.mark.parametrize("likelihood", list(GRIDS))
def test_tilted_moments_in_float32_are_the_float64_moments_rounded(likelihood):
    """float32 in, float32 out: computed in float64, so only the rounding of inputs and outputs remains (measured
    ~6e-8 relative); the mean is compared per (tilted sd + |mean|), as float32 cannot hold 13.8 to 1e-3 of a
    tilted sd of 1e-3."""
    y, mean, variance = _grid(likelihood, torch.float32)
    moments = tilted_moments(ADAPTERS[likelihood](), y, mean, variance)
    assert all(m.dtype == torch.float32 for m in moments)
    log_z_error, _, var_error, mean_error = _errors(likelihood, y, mean, variance, moments)
    assert log_z_error < 3e-7 and mean_error < 3e-7 and var_error < 3e-7, (log_z_error, mean_error, var_error)


def test_probit_closed_form_is_stable_far_in_the_tails():
    """R&W eq. 3.58 with the ratio in log space: finite moments and positive variances for z from -40 to 40."""
    adapter = ADAPTERS["probit"]()
    z = torch.linspace(-40, 40, 81, dtype=torch.float64)
    y = torch.ones_like(z)
    for dtype in (torch.float32, torch.float64):
        log_z, mean, variance = tilted_moments(
            adapter, y.to(dtype), (z * math.sqrt(2)).to(dtype), torch.ones_like(z, dtype=dtype)
        )
        assert bool(torch.isfinite(log_z).all() & torch.isfinite(mean).all() & (variance > 0).all())
        assert float(log_z[0]) == pytest.approx(float(torch.special.log_ndtr(torch.tensor(-40.0))), rel=1e-6)


@pytest.mark.parametrize("likelihood", list(GRIDS))
def test_mode_is_the_root_of_the_tilted_log_density_slope(likelihood):
    if likelihood == "probit":
        return
    adapter = ADAPTERS[likelihood]()
    y, mean, variance = _grid(likelihood)
    mode, width = tilted_mode(adapter, y, mean, variance)
    _, gradient, curvature = adapter._terms(mode, y)
    slope = gradient - (mode - mean) / variance
    assert bool((slope.abs() * width < 1e-8 * (1 + mode.abs())).all())
    assert torch.allclose(width, (curvature + 1 / variance).rsqrt())


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_invalid_cavity_variance_raises_naming_it(bad):
    adapter = ADAPTERS["logit"]()
    variance = torch.tensor([1.0, bad, 2.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"cavity_variance.*point\(s\) \[1\]"):
        tilted_moments(adapter, torch.tensor([0.0, 1.0, 1.0]), torch.zeros(3, dtype=torch.float64), variance)
    with pytest.raises(ValueError, match="cavity_mean"):
        tilted_moments(adapter, torch.ones(2), torch.tensor([0.0, math.nan]), torch.ones(2))
    with pytest.raises(ValueError, match="shape"):
        tilted_moments(adapter, torch.ones(2), torch.zeros(3), torch.ones(3))


def test_unsupported_likelihood_raises():
    from gpytorch.likelihoods import SoftmaxLikelihood

    adapter = likelihood_adapter(SoftmaxLikelihood(num_classes=3, mixing_weights=False))
    with pytest.raises(TypeError, match="tilted moments"):
        tilted_moments(adapter, torch.zeros(2), torch.zeros(2), torch.ones(2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("likelihood", list(GRIDS))
def test_cuda_moments_equal_cpu_moments(likelihood):
    y, mean, variance = _grid(likelihood)
    adapter = ADAPTERS[likelihood]()
    cpu = tilted_moments(adapter, y, mean, variance)
    gpu = tilted_moments(adapter, y.cuda(), mean.cuda(), variance.cuda())
    for a, b in zip(cpu, gpu, strict=True):
        assert b.device.type == "cuda"
        torch.testing.assert_close(b.cpu(), a, rtol=1e-10, atol=1e-12)


def test_adapters_declare_their_ep_sites_and_predictive():
    """The flags that replace type checks: scalar tilted moments for the C = 1 closed forms, C x C site blocks for the
    multinomial probit, neither for the softmax and autograd likelihoods; class probabilities for the classifiers,
    from each point's C x C latent covariance for the multi-class ones."""
    from gpytorch.likelihoods import SoftmaxLikelihood, StudentTLikelihood

    from gpytorch_iterncgp import MultinomialProbitLikelihood
    from gpytorch_iterncgp.likelihoods.adapters import AutogradAdapter, MultitaskPoissonLikelihood

    for name, make in ADAPTERS.items():
        adapter = make()
        assert adapter.has_tilted_moments and adapter.supports_ep and not adapter.has_block_tilted_moments
        assert adapter.classification == (name in ("probit", "logit")) and not adapter.predictive_needs_blocks
    probit = likelihood_adapter(MultinomialProbitLikelihood(3))
    assert probit.supports_ep and probit.has_block_tilted_moments and not probit.has_tilted_moments
    assert probit.classification and probit.predictive_needs_blocks
    softmax = likelihood_adapter(SoftmaxLikelihood(num_classes=3, mixing_weights=False))
    assert not softmax.supports_ep and softmax.classification and softmax.predictive_needs_blocks
    for adapter in (likelihood_adapter(MultitaskPoissonLikelihood(2)), AutogradAdapter(StudentTLikelihood())):
        assert not (adapter.supports_ep or adapter.classification or adapter.predictive_needs_blocks)
