"""SparseEPStrategy (EP-DTC) and SparseEPMarginalLogLikelihood against the independent dense EP of ``tests/reference_ep.py``.

* With M = N inducing inputs at the training inputs, Q_ff = K_ff up to the relative jitter 1e-8 of K_uu, and EP-DTC
  must be dense EP (R&W Alg. 3.5, sequential): sites, test posterior and evidence to 1e-6 relative (measured: about
  1e-8, the jitter's size).
* With M < N, EP-DTC is dense EP with the kernel Q_ff: the sites equal sequential EP on Q_ff, and the bound L_E (eq.
  S.21) equals that EP's log Z minus the trace term; L_E lies below the exact EP evidence, the gap shrinking with M.
* The bound's gradient (sites fixed) against central differences, with the sites fixed and re-converged.
"""

from __future__ import annotations

import math

import gpytorch
import linear_operator
import pytest
import torch

from gpytorch_iterncgp import (
    ExpPoissonLikelihood,
    SparseEPMarginalLogLikelihood,
    SparseEPState,
    SparseEPStrategy,
)
from gpytorch_iterncgp.mlls.sparse import ep_dtc_bound
from tests import reference_ep
from tests.common import IterNCGPModel, binary_data, count_data

LIKELIHOODS = {"probit": gpytorch.likelihoods.BernoulliLikelihood, "poisson_exp": ExpPoissonLikelihood}
TIGHT = dict(site_tol=1e-11, max_sweeps=400)


def _data(name, num_data=40, seed=0):
    if name.startswith("poisson"):
        return count_data(num_data, seed=seed, scale=1.5)
    return binary_data(num_data, seed=seed)


def _model(name, x, y, inducing, **options):
    return IterNCGPModel(
        x, y, LIKELIHOODS[name](), strategy_class=SparseEPStrategy, inducing_points=inducing, **{**TIGHT, **options}
    )


def _kernel(model, a, b=None):
    with torch.no_grad():
        return model.covar_module(a, a if b is None else b).to_dense()


def _bound(model, x, y):
    likelihood = model.variational_strategy.likelihood
    return SparseEPMarginalLogLikelihood(likelihood, model)(model(x), y) * len(y)


@pytest.mark.parametrize("name", list(LIKELIHOODS))
def test_inducing_inputs_at_the_data_give_dense_ep(name):
    """M = N, Z = X: sites, test posterior and L_E (trace term 0) equal sequential dense EP to 1e-6 relative.

    The relative jitter of K_uu (cond(K) = 1.7e8 here) limits the agreement linearly; measured for probit, max
    relative errors (sites, test means, test variances, evidence): jitter 1e-8 (the float64 default): 8e-9, 2.8e-6
    (extrapolated test points), 1.8e-8, 5e-9; jitter 1e-10: 9e-11, 2.8e-8, 1.8e-10, 5e-11. The test uses 1e-10.
    """
    with linear_operator.settings.cholesky_jitter(double_value=1e-10):
        _check_dense_ep(name)


def _check_dense_ep(name):
    x, y = _data(name)
    model = _model(name, x, y, x.clone())
    strategy = model.variational_strategy
    report = strategy.fit()
    assert report.converged and report.method == "EP-DTC" and report.skipped_sites == 0
    assert "EP-DTC fit" in str(report)
    reference = reference_ep.sequential_ep(_kernel(model, x), y, likelihood=name)
    tau, nu = strategy.sites
    torch.testing.assert_close(tau, reference.site_precision, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(nu, reference.site_natural_mean, rtol=1e-6, atol=1e-9)

    test_x = torch.linspace(-0.2, 1.2, 17, dtype=x.dtype)[:, None].expand(-1, x.shape[-1]).contiguous()
    mean, variance, _ = reference_ep.probit_predict(
        _kernel(model, x), _kernel(model, x, test_x), _kernel(model, test_x).diagonal(), reference
    )
    model.eval()
    got_mean, got_variance = strategy.marginal_latent(test_x)
    torch.testing.assert_close(got_mean[:, 0], mean, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(got_variance[:, 0], variance, rtol=1e-6, atol=1e-9)
    with torch.no_grad():
        joint = model(test_x)  # the lazy covariance agrees with the marginals
    torch.testing.assert_close(joint.variance, variance, rtol=1e-6, atol=1e-9)
    model.train()

    bound = float(_bound(model, x, y).detach())
    assert math.isclose(bound, float(reference.log_marginal_likelihood), rel_tol=1e-6)


def _dtc_kernel(model, x, inducing):
    kuu = _kernel(model, inducing) + 1e-8 * _kernel(model, inducing).diagonal().mean() * torch.eye(len(inducing))
    cross = _kernel(model, inducing, x)
    return cross.mT @ torch.linalg.solve(kuu, cross)


def test_fewer_inducing_inputs_is_dense_ep_on_the_dtc_kernel():
    """M = 8 < N = 40: the sites are sequential EP's with kernel Q_ff; L_E = log Z_EP(Q_ff) - tr((K - Q) T) / 2."""
    x, y = _data("probit")
    inducing = x[::5].clone()
    model = _model("probit", x, y, inducing)
    assert model.variational_strategy.fit().converged
    q = _dtc_kernel(model, x, inducing)
    reference = reference_ep.sequential_ep(q, y, likelihood="probit")
    tau, nu = model.variational_strategy.sites
    torch.testing.assert_close(tau, reference.site_precision, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(nu, reference.site_natural_mean, rtol=1e-6, atol=1e-9)
    trace = float((tau * (_kernel(model, x).diagonal() - q.diagonal())).sum())
    expected = float(reference.log_marginal_likelihood) - 0.5 * trace
    assert trace > 1e-3  # the trace term matters here
    assert math.isclose(float(_bound(model, x, y).detach()), expected, rel_tol=1e-6)


def test_bound_is_below_dense_ep_and_tightens_with_more_inducing_inputs():
    """N = 80 probit: L_E(M) <= log Z_EP for M = 5, 10, 20, 40 (nested subsets of X), and the gap shrinks."""
    x, y = _data("probit", num_data=80, seed=3)
    order = torch.randperm(80, generator=torch.Generator().manual_seed(0))
    gaps = []
    exact = None
    for size in (5, 10, 20, 40):
        model = _model("probit", x, y, x[order[:size]].clone(), site_tol=1e-8)
        assert model.variational_strategy.fit().converged
        if exact is None:
            exact = float(reference_ep.sequential_ep(_kernel(model, x), y).log_marginal_likelihood)
        gaps.append(exact - float(_bound(model, x, y).detach()))
    assert all(gap > 0 for gap in gaps), gaps
    assert all(a > b for a, b in zip(gaps, gaps[1:], strict=False)), gaps


def _set(parameter, index, value):
    with torch.no_grad():
        parameter.view(-1)[index] = value


@pytest.mark.parametrize("which", ["lengthscale", "inducing"])
def test_bound_gradient_matches_finite_differences(which):
    """dL_E/d(raw lengthscale) and dL_E/d(one inducing coordinate), sites fixed, vs central differences (h = 1e-5).

    * Of the bound at the fixed sites: to 1e-6 relative.
    * Of the re-converged bound: it differs (by 20-30% here, M = 10, N = 40) by the trace term's dependence on the
      re-converged sites, -1/2 sum_i (k_ii - q_ii) d tau_i / d theta (the rest of L_E is stationary in the sites at
      the EP-DTC fixed point). With d tau / d theta from the same central differences of the re-converged sites,
      gradient + that term matches to 1e-5 relative.
    """
    x, y = _data("probit", num_data=40)
    model = _model("probit", x, y, x[::4].clone() + 0.01)
    strategy = model.variational_strategy
    parameter = model.covar_module.base_kernel.raw_lengthscale if which == "lengthscale" else strategy.inducing_points
    index = 0 if which == "lengthscale" else 5
    strategy.fit()
    bound = _bound(model, x, y)
    (gradient,) = torch.autograd.grad(bound, parameter)
    gradient = float(gradient.reshape(-1)[index])
    state: SparseEPState = strategy.state
    tau, nu = state.site_precision.clone(), state.site_natural_mean.clone()
    centre, step = float(parameter.detach().reshape(-1)[index]), 1e-5
    with torch.no_grad():
        prior = strategy.dtc_prior()
        trace_weight = prior.diagonal - prior.dtc_variance  # k_ii - q_ii
    fixed, reconverged, sites = [], [], []
    for sign in (1, -1):
        _set(parameter, index, centre + sign * step)
        with torch.no_grad():
            fixed.append(float(ep_dtc_bound(strategy.dtc_prior(), strategy.adapter, y, tau, nu)))
            assert strategy.fit().converged
            reconverged.append(float(_bound(model, x, y).detach()))
            sites.append(strategy.sites[0].clone())
    _set(parameter, index, centre)
    fixed_difference = (fixed[0] - fixed[1]) / (2 * step)
    reconverged_difference = (reconverged[0] - reconverged[1]) / (2 * step)
    implicit = -0.5 * float((trace_weight * (sites[0] - sites[1])).sum()) / (2 * step)
    assert math.isclose(gradient, fixed_difference, rel_tol=1e-6, abs_tol=1e-8)
    assert abs(implicit) > 0.1 * abs(reconverged_difference)  # the implicit part is not negligible here
    assert math.isclose(gradient + implicit, reconverged_difference, rel_tol=1e-5, abs_tol=1e-7)


def test_state_dict_round_trip_and_resume():
    """A fresh model loading the state_dict predicts identically without refitting, and resumes converged."""
    x, y = _data("probit")
    model = _model("probit", x, y, x[::3].clone())
    model.variational_strategy.fit()
    state_dict = model.state_dict()
    assert "variational_strategy.inducing_points" in state_dict
    other = _model("probit", x, y, torch.zeros(14, 2, dtype=x.dtype))
    other.load_state_dict(state_dict)
    test_x = torch.rand(9, 2, dtype=x.dtype, generator=torch.Generator().manual_seed(5))
    model.eval(), other.eval()
    expected = model.variational_strategy.marginal_latent(test_x)
    assert other.variational_strategy._is_current()
    got = other.variational_strategy.marginal_latent(test_x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(
        other.variational_strategy.predictive_probabilities(test_x),
        model.variational_strategy.predictive_probabilities(test_x),
    )
    assert other.variational_strategy.fit().steps == 1  # already at the fixed point


def test_bad_inducing_points_raise_and_more_inducing_than_data_is_fine():
    x, y = _data("probit", num_data=20)
    with pytest.raises(ValueError, match="inducing_points have 3 features"):
        _model("probit", x, y, torch.rand(5, 3, dtype=x.dtype))
    with pytest.raises(ValueError, match="inducing_points"):
        _model("probit", x, y, torch.full((5, 2), math.nan, dtype=x.dtype))
    model = _model("probit", x, y, torch.rand(30, 2, dtype=x.dtype, generator=torch.Generator().manual_seed(1)))
    assert model.variational_strategy.fit().converged
    assert math.isfinite(float(_bound(model, x, y).detach()))


def test_fixed_inducing_points_are_a_buffer_and_still_tracked():
    x, y = _data("probit", num_data=20)
    model = _model("probit", x, y, x[:5].clone(), learn_inducing_locations=False)
    strategy = model.variational_strategy
    assert "inducing_points" not in dict(strategy.named_parameters())
    strategy.fit()
    with torch.no_grad():
        strategy.inducing_points[0, 0] += 0.1
    assert not strategy._is_current()
