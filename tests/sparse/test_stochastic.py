r"""Stochastic EP with inducing inputs (``sparse/stochastic.py``) against independent references.

* **One point** (:math:`N = 1`: the cavity is the prior and one step of fraction 1 is EP's exact update): the
  posterior of the whitened inducing values equals the moment-matched posterior of the joint Gaussian
  :math:`(\mathbf z, f)`, :math:`\operatorname{Cov} = [[\mathbf I, \mathbf v], [\mathbf v^\top, \mathbf v^\top
  \mathbf v + s]]`, computed by Gaussian conditioning on :math:`f` with the tilted moments of :math:`f` under its
  prior marginal (R&W eq. 3.58 for the probit; the factorised multinomial probit per class) — with inducing inputs
  away from the point (FITC spread :math:`s > 0`).
* **The energy's minibatch estimate is unbiased**: over a partition of the data into batches, the average of
  :math:`\frac{N}{|\mathcal B|}\sum_{i \in \mathcal B}\nabla\log\hat Z_i` is the full-data gradient.
* **Fixed point**: full-batch steps at a fixed kernel converge, and SEP's predictive probabilities are close to dense
  EP's (``tests/reference_ep.py``) where :math:`N` is large against the sites' spread (Li et al. 2015).
* **Dense limit** (per-point sites, :class:`PointSites`): with :math:`M = N` inducing inputs at the data and
  full-batch steps, the fixed point is dense EP's to 1e-6: the package's ``EPStrategy`` (complete solve) for the
  probit, the factorised dense EP of ``tests/reference_ep.py`` for the multinomial probit (a kernel per class); and
  the energy's gradient there is dense EP's evidence gradient with the sites fixed (R&W eq. 5.27).
* The tied site's saved form round-trips.
"""

from __future__ import annotations

import math

import gpytorch
import linear_operator
import pytest
import torch

from gpytorch_iterncgp import EPStrategy
from gpytorch_iterncgp.likelihoods.adapters import likelihood_adapter
from gpytorch_iterncgp.likelihoods.factorised import factorised_moments
from gpytorch_iterncgp.likelihoods.multinomial_probit import MultinomialProbitLikelihood
from gpytorch_iterncgp.sparse.stochastic import (
    PointSites,
    StochasticEP,
    TiedSite,
    WhitenedBatch,
    batch_marginals,
    step_fraction,
    tied_gaussian,
)
from tests import reference_ep
from tests.common import IterNCGPModel, binary_data

F64 = torch.float64


def _kernel(lengthscale=0.7, outputscale=2.0):
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(F64)
    kernel.base_kernel.lengthscale = lengthscale
    kernel.outputscale = outputscale
    return kernel


def _batch(kernel, inducing, inputs, num_latents=1, mean=None):
    prior_mean = torch.zeros(num_latents, len(inputs), dtype=F64) if mean is None else mean
    return WhitenedBatch.from_blocks(
        prior_mean,
        kernel(inducing).to_dense()[None],
        kernel(inducing, inputs).to_dense()[None],
        kernel(inputs, diag=True)[None],
    )


def _joint_posterior(batch, prior_mean, tilted_mean, tilted_variance):
    r"""The moment-matched posterior of :math:`\mathbf z` given the tilted moments of the one point's :math:`f`
    (prior mean ``prior_mean``)."""
    v = batch.whitened_cross[0, :, 0]
    prior_variance = v @ v + batch.spread[0, 0]
    gain = v / prior_variance  # Cov(z, f) / Var(f)
    mean = gain * (tilted_mean - prior_mean)
    covariance = torch.eye(len(v), dtype=F64) - torch.outer(v, gain) + tilted_variance * torch.outer(gain, gain)
    return mean, covariance


def _posterior_moments(site):
    cholesky, mean = tied_gaussian(site, 1.0)
    return mean, torch.cholesky_inverse(cholesky)


def test_one_probit_point_is_the_moment_matched_posterior():
    kernel = _kernel()
    inducing = torch.tensor([[-1.0], [0.4], [1.5]], dtype=F64)
    point, label = torch.tensor([[0.1]], dtype=F64), torch.tensor([1.0])
    batch = _batch(kernel, inducing, point, mean=torch.tensor([[0.3]], dtype=F64))
    assert float(batch.spread.detach().min()) > 1e-2  # FITC's conditional variance matters here
    sep = StochasticEP(likelihood_adapter(gpytorch.likelihoods.BernoulliLikelihood()), num_data=1)
    site, record = sep.step(TiedSite.flat(1, 3, point), batch, label)
    assert record.fraction == 1.0
    prior_variance = batch.whitened_cross[0, :, 0].square().sum() + batch.spread[0, 0]
    _, tilted_mean, tilted_variance = reference_ep.probit_moments(
        torch.tensor([1.0], dtype=F64), batch.mean[0], prior_variance.reshape(1)
    )
    expected_mean, expected_covariance = _joint_posterior(batch, 0.3, tilted_mean[0], tilted_variance[0])
    mean, covariance = _posterior_moments(site)
    torch.testing.assert_close(mean[0], expected_mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(covariance[0], expected_covariance, rtol=1e-10, atol=1e-12)


def test_one_multiclass_point_is_the_factorised_moment_matched_posterior():
    num_classes = 3
    kernel = _kernel(lengthscale=0.5)
    inducing = torch.tensor([[-1.0], [0.2], [1.1], [2.0]], dtype=F64)
    point, label = torch.tensor([[0.6]], dtype=F64), torch.tensor([2])
    prior_mean = torch.tensor([[0.5], [-0.2], [0.1]], dtype=F64)
    batch = _batch(kernel, inducing, point, num_latents=num_classes, mean=prior_mean)
    sep = StochasticEP(likelihood_adapter(MultinomialProbitLikelihood(num_classes)), num_data=1)
    site, _ = sep.step(TiedSite.flat(num_classes, 4, point), batch, label)
    prior_variance = batch.whitened_cross[0, :, 0].square().sum() + batch.spread[0, 0]
    _, tilted_mean, tilted_variance = factorised_moments(label, prior_mean.mT, prior_variance.expand(1, num_classes))
    mean, covariance = _posterior_moments(site)
    for c in range(num_classes):
        expected_mean, expected_covariance = _joint_posterior(
            batch, prior_mean[c, 0], tilted_mean[0, c], tilted_variance[0, c]
        )
        torch.testing.assert_close(mean[c], expected_mean, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(covariance[c], expected_covariance, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("likelihood", ["probit", "multinomial_probit"])
def test_minibatch_energy_is_unbiased_over_a_partition(likelihood):
    x, y = binary_data(48, seed=4)
    if likelihood == "probit":
        adapter, num_latents, targets = likelihood_adapter(gpytorch.likelihoods.BernoulliLikelihood()), 1, y
    else:
        adapter, num_latents = likelihood_adapter(MultinomialProbitLikelihood(3)), 3
        targets = (x[:, 0] > 0.33).long() + (x[:, 0] > 0.66).long()
    kernel = _kernel()
    inducing = torch.nn.Parameter(x[::6].clone())
    sep = StochasticEP(adapter, num_data=len(x))
    site = TiedSite.flat(num_latents, len(inducing), x)
    for _ in range(3):  # a site away from flat
        site, _ = sep.step(site, _batch(kernel, inducing, x, num_latents), targets)
    parameters = [*kernel.parameters(), inducing]

    def gradient(rows):
        energy = (
            len(x)
            / len(rows)
            * sep.log_normalizers(site, _batch(kernel, inducing, x[rows], num_latents), targets[rows]).sum()
        )
        return torch.cat([g.flatten() for g in torch.autograd.grad(energy, parameters)])

    full = gradient(torch.arange(len(x)))
    batches = torch.randperm(len(x), generator=torch.Generator().manual_seed(0)).reshape(6, 8)
    average = torch.stack([gradient(rows) for rows in batches]).mean(0)
    torch.testing.assert_close(average, full, rtol=1e-10, atol=1e-10)
    assert float(full.abs().max()) > 1e-3  # the energy does depend on the hyperparameters


@torch.no_grad()
def test_full_batch_fixed_point_is_close_to_dense_ep():
    x, y = binary_data(200, seed=2)
    kernel = _kernel(lengthscale=0.6, outputscale=3.0)
    adapter = likelihood_adapter(gpytorch.likelihoods.BernoulliLikelihood())
    sep = StochasticEP(adapter, num_data=len(x))
    batch = _batch(kernel, x, x)  # M = N inducing inputs at the data: the dense prior
    site = TiedSite.flat(1, len(x), x)
    for _ in range(80):
        site, record = sep.step(site, batch, y)
    assert record.fraction == 0.5 and record.site_change < 1e-8  # converged (full batches, damped)
    dense = reference_ep.sequential_ep(kernel(x).to_dense(), y, "probit", tol=1e-12, max_sweeps=200)
    test_x = torch.rand(41, 2, generator=torch.Generator().manual_seed(9), dtype=F64) * 1.4 - 0.2
    mean, variance = sep.posterior_marginals(site, _batch(kernel, x, test_x))
    sep_probability = torch.special.ndtr(mean[0] / (1 + variance[0]).sqrt())
    *_, dense_probability = reference_ep.probit_predict(
        kernel(x).to_dense(), kernel(x, test_x).to_dense(), kernel(test_x, diag=True), dense
    )
    # SEP's averaged site is not EP's N sites: 4e-4 apart here (N = 200)
    assert float((sep_probability - dense_probability).abs().max()) < 0.01


#: K_uu's Cholesky factor jittered by 1e-12 of its mean diagonal instead of 1e-8: at M = N it is the dense prior
UNJITTERED = linear_operator.settings.cholesky_jitter(float_value=1e-6, double_value=1e-12)


def _converged(sep, site, batch, targets, max_steps=600):
    for _ in range(max_steps):
        site, record = sep.step(site, batch, targets)
        if record.site_change < 1e-13:
            return site
    raise AssertionError(f"no fixed point after {max_steps} steps: {record}")


def test_point_sites_at_the_data_are_the_packages_dense_ep():
    x, y = binary_data(40, seed=0)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    complete = dict(
        policy="unit", max_solver_iterations=None, abs_tol=0.0, rel_tol=0.0, site_tol=1e-12, marginal_tol=None
    )
    model = IterNCGPModel(x, y, likelihood, strategy_class=EPStrategy, max_sweeps=400, **complete)
    assert model.variational_strategy.fit().converged
    kernel = model.covar_module
    sep = StochasticEP(likelihood_adapter(likelihood), num_data=len(x))
    test_x = torch.rand(23, 2, generator=torch.Generator().manual_seed(5), dtype=F64) * 1.4 - 0.2
    with torch.no_grad(), UNJITTERED:
        site = _converged(sep, PointSites.flat(1, len(x), x), _batch(kernel, x, x), y)
        mean, variance = site.posterior(_batch(kernel, x, test_x))
    tau, nu = model.variational_strategy.sites
    torch.testing.assert_close(site.site_precision[0], tau, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(site.site_natural_mean[0], nu, rtol=1e-6, atol=1e-9)
    model.eval()
    with torch.no_grad():
        expected = model(test_x)
    torch.testing.assert_close(mean[0], expected.mean, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(variance[0], expected.variance, rtol=1e-6, atol=1e-8)


def test_energy_gradient_at_the_dense_fixed_point_is_dense_eps():
    x, y = binary_data(30, seed=3)
    kernel = _kernel(lengthscale=0.4, outputscale=1.5)
    sep = StochasticEP(likelihood_adapter(gpytorch.likelihoods.BernoulliLikelihood()), num_data=len(x))
    parameters = list(kernel.parameters())
    with UNJITTERED:
        with torch.no_grad():
            site = _converged(sep, PointSites.flat(1, len(x), x), _batch(kernel, x, x), y)
        energy = sep.log_normalizers(site, _batch(kernel, x, x), y).sum()
    gradient = torch.autograd.grad(energy, parameters)
    matrix = kernel(x).to_dense()
    dense = reference_ep.parallel_ep(matrix.detach(), y, tol=1e-13)
    assert dense.converged
    # R&W eq. 5.27: with the sites fixed, linear in dK/dtheta, so autograd through the kernel matrix gives it
    expected = torch.autograd.grad(reference_ep.evidence_gradient(matrix.detach(), matrix, dense), parameters)
    for actual, wanted in zip(gradient, expected, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-6, atol=1e-8)
    assert min(float(g.abs().min()) for g in gradient) > 1e-2


def test_multiclass_point_sites_at_the_data_are_factorised_dense_ep():
    x, _ = binary_data(36, seed=6)
    y = (x[:, 0] > 0.33).long() + (x[:, 0] > 0.66).long()
    kernel = gpytorch.kernels.ScaleKernel(
        gpytorch.kernels.RBFKernel(batch_shape=torch.Size([3])), batch_shape=torch.Size([3])
    ).to(F64)
    kernel.base_kernel.lengthscale = torch.tensor([0.3, 0.5, 0.4], dtype=F64).reshape(3, 1, 1)
    kernel.outputscale = torch.tensor([2.0, 1.0, 3.0], dtype=F64)
    test_x = torch.rand(19, 2, generator=torch.Generator().manual_seed(2), dtype=F64)
    sep = StochasticEP(likelihood_adapter(MultinomialProbitLikelihood(3)), num_data=len(x))
    with torch.no_grad(), UNJITTERED:
        kernels = kernel(x).to_dense()

        def batch(points):
            zeros = torch.zeros(3, len(points), dtype=F64)
            return WhitenedBatch.from_blocks(zeros, kernels, kernel(x, points).to_dense(), kernel(points, diag=True))

        site = _converged(sep, PointSites.flat(3, len(x), x), batch(x), y)
        mean, variance = site.posterior(batch(test_x))
    tau, nu, converged = reference_ep.factorised_parallel_ep(kernels, y)
    assert converged
    torch.testing.assert_close(site.site_precision, tau, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(site.site_natural_mean, nu, rtol=1e-6, atol=1e-9)
    with torch.no_grad():
        expected_mean, expected_variance = reference_ep.factorised_predict(
            kernels, kernel(x, test_x).to_dense(), kernel(test_x, diag=True), tau, nu
        )
    torch.testing.assert_close(mean, expected_mean, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(variance, expected_variance, rtol=1e-6, atol=1e-8)


def test_point_sites_refuse_minibatches_and_round_trip():
    x, y = binary_data(20, seed=1)
    kernel = _kernel()
    sep = StochasticEP(likelihood_adapter(gpytorch.likelihoods.BernoulliLikelihood()), num_data=len(x))
    site, _ = sep.step(PointSites.flat(1, 5, x), _batch(kernel, x[:5], x), y)
    with pytest.raises(ValueError, match="all 20 training points"):
        sep.step(site, _batch(kernel, x[:5], x[:8]), y[:8])
    restored = PointSites.from_extra(site.to_extra(), torch.zeros((), dtype=F64))
    assert restored.steps == 1 and restored.site_precision.shape == (1, 20)
    torch.testing.assert_close(restored.site_natural_mean, site.site_natural_mean, rtol=0, atol=0)


def test_step_fraction_averages_then_forgets():
    assert [step_fraction(t, 10, 1000) for t in (0, 1, 3)] == [1.0, 0.5, 0.25]
    assert step_fraction(500, 10, 1000) == 0.01
    assert step_fraction(5000, 10, 10**6) == 0.01 and step_fraction(500, 10, 2000) == 0.01  # the floor, and |B|/N
    assert step_fraction(5000, 1000, 50_000) == 0.02
    assert step_fraction(0, 2000, 1000) == 1.0 and step_fraction(5, 2000, 1000) == 0.5  # damped full batches


def test_tied_site_round_trips():
    site = TiedSite(torch.randn(2, 3, 3, dtype=F64), torch.randn(2, 3, dtype=F64), steps=7)
    restored = TiedSite.from_extra(site.to_extra(), torch.zeros((), dtype=F64))
    assert restored.steps == 7
    torch.testing.assert_close(restored.precision, site.precision, rtol=0, atol=0)
    with pytest.raises(ValueError):
        TiedSite.from_extra({**site.to_extra(), "precision": torch.zeros(2, 3, 4)}, torch.zeros(()))


def test_likelihood_without_tilted_moments_is_refused():
    with pytest.raises(TypeError, match="tilted moments"):
        StochasticEP(
            likelihood_adapter(gpytorch.likelihoods.SoftmaxLikelihood(num_classes=3, mixing_weights=False)), num_data=10
        )
    assert math.isfinite(step_fraction(0, 1, 1))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
    ],
)
@pytest.mark.parametrize("kernels", [1, 3])
def test_batch_marginals_are_the_triangular_solves_and_their_gradient(kernels, device):
    """The variances from the explicit covariance equal s_i + ||L^-1 v_i||^2 (R&W eq. A.12) by triangular solves,
    values and gradients in the batch, for a kernel shared by 3 latents (broadcast) or one per latent."""
    generator = torch.Generator().manual_seed(3)

    def draw(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=generator).to(device)

    factor = draw(3, 6, 6)
    cholesky = torch.linalg.cholesky(torch.eye(6, dtype=torch.float64, device=device) + factor @ factor.mT)
    mean, weights = draw(3, 6), draw(3, 5)
    cross = draw(kernels, 6, 5).requires_grad_()
    spread = draw(kernels, 5).abs()
    batch = WhitenedBatch(torch.zeros(3, 5, dtype=torch.float64, device=device), cross, spread)
    means, variances = batch_marginals(cholesky, mean, batch)
    (gradient,) = torch.autograd.grad((variances * weights).sum() + means.sum(), cross)
    projected = torch.linalg.solve_triangular(cholesky, cross, upper=False)
    expected = spread + (projected * projected).sum(-2)
    (expected_gradient,) = torch.autograd.grad((expected * weights).sum() + (mean.unsqueeze(-1) * cross).sum(), cross)
    torch.testing.assert_close(variances, expected.expand(3, 5), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gradient, expected_gradient, rtol=1e-12, atol=1e-12)
