"""Ψ statistics and sparse EP with uncertain inputs (Hernández-Lobato-style sec. S5-S6), each against an independent
reference.

* Ψ statistics (closed forms) against a scrambled-Sobol quasi-Monte Carlo average of the kernel's own values (2^16
  points, written here, not the package's Monte Carlo): 1e-3 relative (measured: 7e-7 to 3e-6).
* With all variances exactly 0, against ``kernel(x)``, ``kernel(x, Z)`` and their outer products: 1e-8 (float64;
  measured at most 4e-15).
* Gradients: ``torch.autograd.gradcheck`` (float64 central differences) in the raw hyperparameters, the inducing
  inputs, the means and the variances.
* The package's Monte Carlo fallback against the closed form for RBF: 2e-2 relative at 40 000 draws (measured
  2e-3 with the fixed generator seed: a tenfold margin over this draw's error).
* The rank-one updates of S.26-S.32 against the dense N x N posterior of the same sites: 1e-10 (measured 2e-15).
* EP under the expected DTC prior P (parallel and sequential) against the independent dense sequential EP of
  ``tests/reference_ep.py`` run on the dense matrix P: sites 1e-8 (measured 5e-12 parallel, 1e-13 sequential); L_H
  against that EP's log Z minus the trace term, 1e-8 (measured 2e-16).
* At S = 0, L_H equals L_E of ``ep_dtc_bound`` at X = mu: 1e-8 (measured: equal to the last bit).
* L_H's gradient (sites fixed) against central differences in a lengthscale, an inducing input, a mean, a variance.
"""

from __future__ import annotations

import math
import warnings

import gpytorch
import pytest
import torch

from gpytorch_iterncgp.core.outer_loop import run_outer_loop
from gpytorch_iterncgp.likelihoods.adapters import likelihood_adapter
from gpytorch_iterncgp.mlls.sparse import ep_dtc_bound
from gpytorch_iterncgp.mlls.uncertain import (
    UncertainSparseEPMarginalLogLikelihood,
    gaussian_kl,
    uncertain_ep_bound,
)
from gpytorch_iterncgp.sparse.dtc import DTCPrior, SparseEP
from gpytorch_iterncgp.sparse.uncertain import (
    MonteCarloPsiWarning,
    RankOneFactors,
    UncertainDTCPrior,
    UncertainSparseEP,
    psi_statistics,
    sequential_sweep,
    uncertain_posterior,
)
from tests import reference_ep
from tests.common import binary_data

DTYPE = torch.float64


def _kernel(name: str) -> gpytorch.kernels.Kernel:
    if name == "rbf-ard":
        kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2)).to(DTYPE)
        kernel.outputscale = 1.7
        kernel.base_kernel.lengthscale = torch.tensor([0.6, 1.1], dtype=DTYPE)
    elif name == "rbf":
        kernel = gpytorch.kernels.RBFKernel().to(DTYPE)
        kernel.lengthscale = 0.8
    elif name == "linear-ard":
        kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.LinearKernel(ard_num_dims=2)).to(DTYPE)
        kernel.outputscale = 0.7
        kernel.base_kernel.variance = torch.tensor([0.5, 2.0], dtype=DTYPE)
    elif name == "linear":
        kernel = gpytorch.kernels.LinearKernel().to(DTYPE)
        kernel.variance = 1.3
    else:
        raise ValueError(name)
    return kernel


KERNELS = ["rbf-ard", "rbf", "linear-ard", "linear"]


def _inputs(num_points=3, num_inducing=4, seed=0, scale=0.3):
    generator = torch.Generator().manual_seed(seed)
    means = torch.randn(num_points, 2, generator=generator, dtype=DTYPE)
    variances = scale * torch.rand(num_points, 2, generator=generator, dtype=DTYPE)
    inducing = torch.randn(num_inducing, 2, generator=generator, dtype=DTYPE)
    return means, variances, inducing


def _quasi_monte_carlo(kernel, means, variances, inducing, log2_samples=16):
    """Independent reference: scrambled Sobol normals, then the kernel's own values, averaged."""
    engine = torch.quasirandom.SobolEngine(dimension=means.shape[-1], scramble=True, seed=0)
    uniform = engine.draw(2**log2_samples, dtype=DTYPE).clamp(1e-12, 1 - 1e-12)
    normal = torch.special.ndtri(uniform)  # (S, D), the same points for every data point (independent per point)
    psi0, psi1, psi2 = [], [], []
    with torch.no_grad():
        for mean, variance in zip(means, variances, strict=True):
            samples = mean + variance.sqrt() * normal
            cross = kernel(samples, inducing).to_dense()  # (S, M)
            psi0.append(kernel(samples, samples, diag=True).mean())
            psi1.append(cross.mean(0))
            psi2.append(cross.mT @ cross / len(samples))
    return torch.stack(psi0), torch.stack(psi1), torch.stack(psi2)


def _relative(got, expected):
    return float((got - expected).detach().abs().max() / expected.detach().abs().max())


# ---------------------------------------------------------------------------------------------------
# Ψ statistics
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", KERNELS)
def test_psi_statistics_match_quasi_monte_carlo(name):
    kernel = _kernel(name)
    means, variances, inducing = _inputs()
    with torch.no_grad():
        got = psi_statistics(kernel, means, variances, inducing)
    expected = _quasi_monte_carlo(kernel, means, variances, inducing)
    assert [tuple(t.shape) for t in got] == [(3,), (3, 4), (3, 4, 4)]
    for statistic, reference in zip(got, expected, strict=True):
        assert _relative(statistic, reference) < 1e-3


@pytest.mark.parametrize("name", KERNELS)
def test_zero_variances_give_the_kernel_matrices(name):
    kernel = _kernel(name)
    means, _, inducing = _inputs(num_points=5)
    with torch.no_grad():
        psi0, psi1, psi2 = psi_statistics(kernel, means, torch.zeros_like(means), inducing)
        cross = kernel(means, inducing).to_dense()
        diagonal = kernel(means, diag=True)
    torch.testing.assert_close(psi0, diagonal, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(psi1, cross, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(psi2, cross[:, :, None] * cross[:, None, :], rtol=1e-8, atol=1e-8)


def test_batches_active_dims_and_float32():
    kernel = _kernel("rbf-ard")
    means, variances, inducing = _inputs(num_points=4)
    batched = torch.stack([means, means.flip(0)])
    got = psi_statistics(kernel, batched, torch.stack([variances, variances.flip(0)]), inducing)
    single = psi_statistics(kernel, means, variances, inducing)
    assert got.psi2.shape == (2, 4, 4, 4)
    for statistic, reference in zip(got, single, strict=True):
        torch.testing.assert_close(statistic[0], reference, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(statistic[1], reference.flip(0), rtol=1e-12, atol=1e-14)
    # active_dims: the statistics of the kernel on the selected column alone (the other input is integrated out)
    picked = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(), active_dims=torch.tensor([1])).to(DTYPE)
    alone = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DTYPE)
    for statistic, reference in zip(
        psi_statistics(picked, means, variances, inducing),
        psi_statistics(alone, means[:, 1:], variances[:, 1:], inducing[:, 1:]),
        strict=True,
    ):
        torch.testing.assert_close(statistic, reference, rtol=0, atol=0)
    # float32 in, float32 out, close to float64
    low = psi_statistics(kernel.float(), means.float(), variances.float(), inducing.float())
    assert all(statistic.dtype == torch.float32 for statistic in low)
    for statistic, reference in zip(low, single, strict=True):
        assert _relative(statistic.double(), reference.detach()) < 1e-5


class _Statistics(torch.nn.Module):
    def __init__(self, kernel):
        super().__init__()
        self.kernel = kernel

    def forward(self, means, variances, inducing):
        return tuple(psi_statistics(self.kernel, means, variances, inducing))


@pytest.mark.parametrize("name", ["rbf-ard", "linear-ard"])
def test_psi_statistics_gradcheck(name):
    module = _Statistics(_kernel(name))
    names = [parameter_name for parameter_name, _ in module.named_parameters()]
    means, variances, inducing = _inputs(num_points=2, num_inducing=3)
    values = [parameter.detach().clone().requires_grad_(True) for parameter in module.parameters()]

    def function(*arguments):
        parameters = dict(zip(names, arguments[: len(names)], strict=True))
        return torch.func.functional_call(module, parameters, arguments[len(names) :])

    arguments = (
        *values,
        means.requires_grad_(True),
        (variances + 0.05).requires_grad_(True),
        inducing.requires_grad_(),
    )
    assert torch.autograd.gradcheck(function, arguments, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_monte_carlo_fallback_matches_closed_form_and_uses_the_generator():
    kernel = _kernel("rbf-ard")
    means, variances, inducing = _inputs()
    closed = psi_statistics(kernel, means, variances, inducing)

    def draw(seed, samples=40_000):
        generator = torch.Generator().manual_seed(seed)
        return psi_statistics(kernel, means, variances, inducing, "monte_carlo", samples, generator)

    estimate = draw(1)
    for statistic, reference in zip(estimate, closed, strict=True):
        assert _relative(statistic.detach(), reference.detach()) < 2e-2
    torch.testing.assert_close(draw(1, 1000).psi2, draw(1, 1000).psi2, rtol=0, atol=0)
    assert not torch.equal(draw(1, 1000).psi2, draw(2, 1000).psi2)
    # the estimate is differentiable (reparametrised) in the means and the variances
    means.requires_grad_(True)
    variances.requires_grad_(True)
    generator = torch.Generator().manual_seed(3)
    psi_statistics(kernel, means, variances, inducing, "monte_carlo", 200, generator).psi2.sum().backward()
    assert bool(torch.isfinite(means.grad).all()) and bool(torch.isfinite(variances.grad).all())


def test_kernels_without_closed_form_warn_that_they_are_monte_carlo():
    kernel = gpytorch.kernels.MaternKernel(nu=2.5).to(DTYPE)
    means, variances, inducing = _inputs()
    with pytest.warns(MonteCarloPsiWarning, match="Monte Carlo"):
        psi0, psi1, psi2 = psi_statistics(kernel, means, variances, inducing, num_samples=500)
    assert psi2.shape == (3, 4, 4) and bool(torch.isfinite(psi2).all())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        psi_statistics(kernel, means, variances, inducing, "monte_carlo", 10)  # asked for: silent
    with pytest.raises(ValueError, match="closed forms for RBFKernel and LinearKernel"):
        psi_statistics(kernel, means, variances, inducing, "closed_form")


def test_bad_arguments_raise_clear_errors():
    kernel = _kernel("rbf-ard")
    means, variances, inducing = _inputs()
    with pytest.raises(ValueError, match="variances must be finite and >= 0"):
        psi_statistics(kernel, means, -variances - 1e-3, inducing)
    with pytest.raises(ValueError, match="variances must have the shape of means"):
        psi_statistics(kernel, means, variances[:2], inducing)
    with pytest.raises(ValueError, match="inducing_points have 3 features"):
        psi_statistics(kernel, means, variances, torch.zeros(4, 3, dtype=DTYPE))
    with pytest.raises(TypeError, match="kernel.to"):
        psi_statistics(kernel, means.float(), variances.float(), inducing.float())
    with pytest.raises(ValueError, match="method must be one of"):
        psi_statistics(kernel, means, variances, inducing, "exact")


# ---------------------------------------------------------------------------------------------------
# Sparse EP with uncertain inputs
# ---------------------------------------------------------------------------------------------------
PROBIT = likelihood_adapter(gpytorch.likelihoods.BernoulliLikelihood())


def _problem(num_data=40, variance=0.01, seed=0):
    x, y = binary_data(num_data, seed=seed)
    kernel = _kernel("rbf-ard")
    kernel.outputscale = 2.0
    kernel.base_kernel.lengthscale = 0.3
    inducing = x[::5].clone() + 0.01
    variances = torch.full_like(x, variance)
    return x, y, kernel, inducing, variances


def _prior(kernel, means, variances, inducing, mean=None):
    statistics = psi_statistics(kernel, means, variances, inducing)
    mean = torch.zeros(len(means), dtype=DTYPE) if mean is None else mean
    return UncertainDTCPrior.from_statistics(mean, statistics, kernel(inducing).to_dense())


def _dense(prior: UncertainDTCPrior):
    return prior.whitened_cross.mT @ prior.whitened_cross + torch.diag(prior.spread)


def _dense_posterior(covariance, prior_mean, tau, nu):
    """Sigma = (P^-1 + T)^-1 and mu = m + Sigma (nu - T m), through B = I + T^1/2 P T^1/2 (tau may be 0)."""
    root = tau.sqrt()
    system = torch.eye(len(tau), dtype=DTYPE) + root[:, None] * covariance * root
    sigma = covariance - (covariance * root) @ torch.linalg.solve(system, root[:, None] * covariance)
    return sigma, prior_mean + sigma @ (nu - tau * prior_mean)


def _converge(prior, y, schedule="parallel", damping=0.5, tol=1e-11):
    loop = UncertainSparseEP(prior.detached(), PROBIT, y, damping, tol, schedule)
    states = []
    with torch.no_grad():
        report = run_outer_loop(loop, loop.initial_state(), states.append, loop.prior, 400, show_progress=False)
    assert report.converged
    return states[-1], report


def test_posterior_and_rank_one_updates_equal_the_dense_recomputation():
    """Random sites (some flat), a constant prior mean; one sequential sweep of rank-one updates, damped."""
    x, y, kernel, inducing, variances = _problem()
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        prior = _prior(kernel, x, variances, inducing, mean=torch.full((40,), 0.3, dtype=DTYPE))
        tau = torch.rand(40, generator=generator, dtype=DTYPE) * (torch.arange(40) % 4 != 0)
        nu = torch.randn(40, generator=generator, dtype=DTYPE) * tau
        covariance = _dense(prior)
        assert float(prior.spread.min()) > 1e-3  # the diagonal Lambda matters here
        # the posterior of uncertain_posterior and of the factors, before any update
        sigma, mu = _dense_posterior(covariance, prior.mean, tau, nu)
        _, _, mean, variance = uncertain_posterior(prior, tau, nu)
        torch.testing.assert_close(mean, mu, rtol=0, atol=1e-10)
        torch.testing.assert_close(variance, sigma.diagonal(), rtol=0, atol=1e-10)
        factors = RankOneFactors.from_sites(prior, tau, nu)
        torch.testing.assert_close(factors.covariance(), sigma, rtol=0, atol=1e-10)
        # one sweep of S.26-S.32, in a random order
        order = torch.randperm(40, generator=generator)
        sweep = sequential_sweep(prior, PROBIT, y, tau, nu, damping=0.7, order=order)
        assert sweep.skipped == 0 and sweep.change > 0.1
        sigma, mu = _dense_posterior(covariance, prior.mean, sweep.site_precision, sweep.site_natural_mean)
    torch.testing.assert_close(sweep.factors.covariance(), sigma, rtol=0, atol=1e-10)
    torch.testing.assert_close(sweep.factors.mean(), mu, rtol=0, atol=1e-10)


@pytest.mark.parametrize("schedule", ["parallel", "sequential"])
def test_ep_is_dense_ep_on_the_expected_dtc_prior(schedule):
    """Both schedules reach the sites of R&W's sequential EP run on the dense P = Psi1 K^-1 Psi1^T + Lambda;
    L_H = that EP's log Z - 1/2 sum_i tau_i (psi0_i - P_ii)."""
    x, y, kernel, inducing, variances = _problem(variance=0.02)
    with torch.no_grad():
        prior = _prior(kernel, x, variances, inducing)
    state, report = _converge(prior, y, schedule, damping=1.0 if schedule == "sequential" else 0.5)
    assert report.method == "EP-DTC (uncertain inputs)"
    covariance = _dense(prior).detach()
    reference = reference_ep.sequential_ep(covariance, y, likelihood="probit")
    torch.testing.assert_close(state.site_precision, reference.site_precision, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(state.site_natural_mean, reference.site_natural_mean, rtol=1e-8, atol=1e-10)
    bound = float(uncertain_ep_bound(prior, PROBIT, y, state.site_precision, state.site_natural_mean))
    trace = float((state.site_precision * (prior.diagonal - covariance.diagonal())).sum())
    assert trace > 1e-2
    assert math.isclose(bound, float(reference.log_marginal_likelihood) - 0.5 * trace, rel_tol=1e-8)


def test_zero_input_variances_give_the_ep_dtc_bound_at_the_means():
    """S_i = 0: the expected DTC prior is the DTC prior at X = mu, and L_H = L_E (ep_dtc_bound) to 1e-8."""
    x, y, kernel, inducing, _ = _problem()
    with torch.no_grad():
        dtc = DTCPrior.from_blocks(
            torch.zeros(40, dtype=DTYPE),
            kernel(x, diag=True),
            kernel(inducing).to_dense(),
            kernel(inducing, x).to_dense(),
        )
        loop = SparseEP(dtc, PROBIT, y, 0.5, 1e-11)
        states = []
        run_outer_loop(loop, loop.initial_state(), states.append, dtc, 400, show_progress=False)
        tau, nu = states[-1].site_precision, states[-1].site_natural_mean
        prior = _prior(kernel, x, torch.zeros_like(x), inducing)
    assert float(prior.spread.abs().max()) < 1e-12
    uncertain_state, _ = _converge(prior, y)
    torch.testing.assert_close(uncertain_state.site_precision, tau, rtol=1e-8, atol=1e-10)
    expected = float(ep_dtc_bound(dtc, PROBIT, y, tau, nu))
    got = float(uncertain_ep_bound(prior, PROBIT, y, tau, nu))
    assert math.isclose(got, expected, rel_tol=1e-8)


@pytest.mark.parametrize("which", ["lengthscale", "inducing", "mean", "variance"])
def test_bound_gradient_matches_finite_differences(which):
    """dL_H/d(one parameter) with the sites fixed (at the fixed point of the centre) vs central differences."""
    x, y, kernel, inducing, variances = _problem(variance=0.02)
    means = x.clone()
    log_variances = variances.log()
    with torch.no_grad():
        state, _ = _converge(_prior(kernel, means, variances, inducing), y)
    tau, nu = state.site_precision, state.site_natural_mean
    parameter = {
        "lengthscale": kernel.base_kernel.raw_lengthscale,
        "inducing": inducing,
        "mean": means,
        "variance": log_variances,
    }[which]
    index = {"lengthscale": 1, "inducing": 5, "mean": 7, "variance": 9}[which]
    parameter.requires_grad_(True)

    def bound():
        prior = _prior(kernel, means, log_variances.exp(), inducing)
        return uncertain_ep_bound(prior, PROBIT, y, tau, nu)

    (gradient,) = torch.autograd.grad(bound(), parameter)
    centre, step = float(parameter.detach().reshape(-1)[index]), 1e-5
    values = []
    for sign in (1, -1):
        with torch.no_grad():
            parameter.view(-1)[index] = centre + sign * step
            values.append(float(bound()))
    with torch.no_grad():
        parameter.view(-1)[index] = centre
    difference = (values[0] - values[1]) / (2 * step)
    assert abs(difference) > 1e-3
    assert math.isclose(float(gradient.reshape(-1)[index]), difference, rel_tol=1e-6, abs_tol=1e-9)


class _NoisyInputGP(gpytorch.models.GP):
    def __init__(self, inducing):
        super().__init__()
        self.covar_module = _kernel("rbf-ard")
        self.mean_module = gpytorch.means.ConstantMean().to(DTYPE)
        self.inducing_points = torch.nn.Parameter(inducing.clone())


def test_mll_is_the_bound_per_point_and_differentiates_every_parameter():
    x, y, _, inducing, variances = _problem(variance=0.02)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = _NoisyInputGP(inducing)
    means = torch.nn.Parameter(x.clone())
    raw_variances = torch.nn.Parameter(variances.log())
    mll = UncertainSparseEPMarginalLogLikelihood(likelihood, model, latent_prior=True, site_tol=1e-10)
    value = mll(means, raw_variances.exp(), y)
    assert len(mll.last_reports) == 1 and mll.last_reports[0].converged
    value.backward()
    for parameter in [*model.parameters(), means, raw_variances]:
        assert parameter.grad is not None and bool(torch.isfinite(parameter.grad).all())
        assert float(parameter.grad.abs().max()) > 0
    with torch.no_grad():
        prior = mll.prior(means, raw_variances.exp())
        tau, nu = mll.sites
        expected = uncertain_ep_bound(prior, PROBIT, y, tau, nu) - gaussian_kl(means, raw_variances.exp())
    assert math.isclose(float(value.detach()) * len(y), float(expected), rel_tol=1e-12)
    # warm start: a second call at the same parameters needs one sweep
    mll(means, raw_variances.exp(), y)
    assert mll.last_reports[0].steps == 1
    with pytest.raises(ValueError, match="KL"):
        mll(means, torch.zeros_like(x), y)


def test_gaussian_kl_against_torch_distributions():
    means, variances, _ = _inputs(num_points=6)
    variances = variances + 0.1
    expected = torch.distributions.kl_divergence(
        torch.distributions.Normal(means, variances.sqrt()), torch.distributions.Normal(0.0, 1.0)
    ).sum()
    torch.testing.assert_close(gaussian_kl(means, variances), expected, rtol=1e-12, atol=0)


def test_mll_of_several_outputs_is_the_sum_over_columns():
    """(N, 2) targets sharing q(X): the bound is the sum of the one-column bounds (the KL counted once)."""
    x, y, _, inducing, variances = _problem(variance=0.02)
    other = binary_data(40, seed=7)[1]
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = _NoisyInputGP(inducing)

    def value(target, latent_prior=False):
        mll = UncertainSparseEPMarginalLogLikelihood(likelihood, model, latent_prior=latent_prior, site_tol=1e-10)
        with torch.no_grad():
            return float(mll(x, variances, target)) * len(x), mll

    both, mll = value(torch.stack([y, other], -1), latent_prior=True)
    assert mll.sites[0].shape == (2, 40) and all(report.converged for report in mll.last_reports)
    expected = value(y)[0] + value(other)[0] - float(gaussian_kl(x, variances))
    assert math.isclose(both, expected, rel_tol=1e-10)
    with pytest.raises(ValueError, match="40 rows"):
        mll(x[:30], variances[:30], torch.stack([y, other], -1))
