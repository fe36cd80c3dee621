"""The negative binomial likelihood (:class:`~gpytorch_iterncgp.NegativeBinomialLikelihood`) and its estimator.

* its distribution is torch's ``NegativeBinomial`` of mean :math:`e^f` and variance :math:`e^f + e^{2f}/r` (the
  moments checked against their closed forms);
* the closed-form adapter's log-likelihood, gradient and curvature equal autograd's of torch's ``log_prob`` (an
  independent implementation), in float32 and float64, and its curvature is non-negative (log-concave);
* EP refuses it (no tilted moments); the evidence's value and gradient, the dispersion's included, are checked
  against the dense reference and finite differences in ``tests/mlls/test_evidence.py``;
* ``IterNCGPNegativeBinomialRegressor`` learns the dispersion: near the generating one on Gamma-Poisson counts,
  growing without bound (the Poisson limit) on Poisson counts; it refuses what it cannot fit.
"""

from __future__ import annotations

import gpytorch
import numpy as np
import pytest
import torch

from gpytorch_iterncgp import EPStrategy, NegativeBinomialLikelihood
from gpytorch_iterncgp.likelihoods.adapters import AutogradAdapter, NegativeBinomialAdapter, likelihood_adapter

TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.float64: dict(rtol=1e-12, atol=1e-11)}


def _counts_and_latents(dtype):
    y = torch.tensor([0.0, 0.0, 1.0, 2.0, 3.0, 7.0, 30.0, 89.0], dtype=dtype)
    f = torch.tensor([-3.0, 0.5, -0.7, 0.0, 1.1, 2.0, 3.3, 1.0], dtype=dtype)
    return y, f


def test_the_distribution_has_mean_e_to_the_f_and_variance_beyond_it():
    likelihood = NegativeBinomialLikelihood(dispersion=2.5)
    assert float(likelihood.dispersion.detach()) == pytest.approx(2.5, rel=1e-15)
    _, f = _counts_and_latents(torch.float64)
    distribution = likelihood.forward(f)
    assert isinstance(distribution, torch.distributions.NegativeBinomial)
    torch.testing.assert_close(distribution.mean, f.exp(), rtol=1e-13, atol=0)
    torch.testing.assert_close(distribution.variance, f.exp() + f.exp() ** 2 / 2.5, rtol=1e-13, atol=0)
    likelihood.dispersion = 0.3
    restored = NegativeBinomialLikelihood()
    restored.load_state_dict(likelihood.state_dict())
    assert float(restored.dispersion.detach()) == pytest.approx(0.3, rel=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dispersion", [0.4, 1.0, 25.0])
def test_the_closed_forms_are_autograds_of_torchs_log_prob(dispersion, dtype):
    likelihood = NegativeBinomialLikelihood(dispersion=dispersion).to(dtype)
    adapter = likelihood_adapter(likelihood)
    assert isinstance(adapter, NegativeBinomialAdapter) and not adapter.supports_ep
    y, f = _counts_and_latents(dtype)
    latent = f[:, None]
    closed = adapter.local_terms(latent, y)
    autograd = AutogradAdapter(likelihood).local_terms(latent, y)
    for got, expected in zip(closed, autograd, strict=True):
        torch.testing.assert_close(got, expected, **TOLERANCES[dtype])
    assert closed[0].dtype == dtype and bool((closed[2] >= 0).all())
    derivatives = adapter.derivatives(latent, y)
    torch.testing.assert_close(derivatives.gradient, closed[1].detach(), rtol=0, atol=0)


def test_ep_refuses_it():
    x = torch.linspace(0, 1, 10, dtype=torch.float64)[:, None]
    y = torch.arange(10, dtype=torch.float64)

    class Model(gpytorch.models.ApproximateGP):
        def __init__(self):
            super().__init__(EPStrategy(self, x, y, NegativeBinomialLikelihood()))
            self.mean_module, self.covar_module = gpytorch.means.ZeroMean(), gpytorch.kernels.RBFKernel()

    with pytest.raises(TypeError, match="tilted moments.*NegativeBinomialLikelihood"):
        Model()


def _gamma_poisson_counts(dispersion: float | None, seed: int = 0):
    """400 points on [-2, 2], mean exp(1 + sin 2x); counts Poisson of a Gamma rate of that mean and shape
    ``dispersion`` (negative binomial), or plain Poisson (``None``)."""
    generator = np.random.default_rng(seed)
    x = generator.uniform(-2, 2, size=(400, 1))
    mean = np.exp(1 + np.sin(2 * x[:, 0]))
    rate = mean if dispersion is None else generator.gamma(dispersion, mean / dispersion)
    return x, generator.poisson(rate)


def test_the_regressor_learns_the_dispersion():
    from gpytorch_iterncgp.sklearn import IterNCGPNegativeBinomialRegressor

    x, y = _gamma_poisson_counts(2.0)
    regressor = IterNCGPNegativeBinomialRegressor(random_state=0).fit(x, y)
    assert 1.4 < regressor.dispersion_ < 3.2  # the generating 2 (its sampling spread at 400 counts is ~±0.5)
    assert regressor.dispersion_ == float(regressor.likelihood_.dispersion.detach())
    assert regressor.inference_ == "laplace" and np.isfinite(regressor.predict(x)).all()
    x, y = _gamma_poisson_counts(None)
    assert IterNCGPNegativeBinomialRegressor(random_state=0).fit(x, y).dispersion_ > 100  # towards Poisson


def test_the_regressor_refuses_what_it_cannot_fit():
    from gpytorch_iterncgp.sklearn import IterNCGPNegativeBinomialRegressor

    x, y = _gamma_poisson_counts(2.0)
    with pytest.raises(ValueError, match="Laplace only"):
        IterNCGPNegativeBinomialRegressor(inference="ep").fit(x, y)
    with pytest.raises(ValueError, match="integer counts.*IterNCGPPoissonRegressor"):
        IterNCGPNegativeBinomialRegressor().fit(x, y + 0.5)
    with pytest.raises(ValueError, match="'link' parameter"):
        IterNCGPNegativeBinomialRegressor(link="softplus").fit(x, y)
