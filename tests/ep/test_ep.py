"""EPStrategy and EPMarginalLogLikelihood against the independent dense EP of ``tests/reference_ep.py``.

With a complete solve (unit-vector actions over all points, no residual tolerance) the package's parallel EP is
exact EP: its fixed point (sites, posterior at test inputs, log marginal likelihood) must be R&W Algorithm 3.5's
(sequential, rank-one updates) to 1e-6 relative, for all four likelihoods with tilted moments. The evidence
gradient must match central differences of the re-converged evidence.
"""

from __future__ import annotations

import math
import warnings

import gpytorch
import pytest
import torch

from gpytorch_iterncgp import (
    BufferLimitWarning,
    EPMarginalLogLikelihood,
    EPState,
    EPStrategy,
    EPSweep,
    ExpPoissonLikelihood,
    LogitBernoulliLikelihood,
    NotConvergedWarning,
    settings,
)
from tests import reference_ep
from tests.common import IterNCGPModel, binary_data, count_data, softmax_likelihood

LIKELIHOODS = {
    "probit": gpytorch.likelihoods.BernoulliLikelihood,
    "logit": LogitBernoulliLikelihood,
    "poisson_exp": ExpPoissonLikelihood,
    "poisson_softplus": gpytorch.likelihoods.PoissonLikelihood,
}
COMPLETE = dict(policy="unit", max_solver_iterations=None, abs_tol=0.0, rel_tol=0.0)
# the sites' test alone (no stop on the marginals): the fits below are compared at exact EP's fixed point
FIXED_POINT = dict(marginal_tol=None)


def _data(name: str, num_data: int = 40, dtype=torch.float64, seed: int = 0):
    if name.startswith("poisson"):
        return count_data(num_data, dtype=dtype, seed=seed, scale=1.5)
    return binary_data(num_data, dtype=dtype, seed=seed)


def _model(name, x, y, lengthscale=0.3, outputscale=2.0, **options):
    options = {**COMPLETE, **FIXED_POINT, "site_tol": 1e-11, "max_sweeps": 400, **options}
    return IterNCGPModel(
        x,
        y,
        LIKELIHOODS[name](),
        lengthscale=lengthscale,
        outputscale=outputscale,
        strategy_class=EPStrategy,
        **options,
    )


def _kernel(model, x, z=None):
    with torch.no_grad():
        return model.covar_module(x, x if z is None else z).to_dense()


def _mll(model, likelihood):
    return EPMarginalLogLikelihood(likelihood, model)


@pytest.mark.parametrize("name", list(LIKELIHOODS))
def test_complete_solve_is_exact_ep(name):
    """Sites, test-point posterior and log Z_EP equal the sequential dense reference (R&W Alg. 3.5) to 1e-6."""
    x, y = _data(name)
    likelihood = LIKELIHOODS[name]()
    model = IterNCGPModel(
        x, y, likelihood, strategy_class=EPStrategy, **COMPLETE, **FIXED_POINT, site_tol=1e-11, max_sweeps=400
    )
    report = model.variational_strategy.fit()
    assert report.converged and report.method == "EP" and report.skipped_sites == 0
    assert all(isinstance(step, EPSweep) for step in report.records)
    reference = reference_ep.sequential_ep(_kernel(model, x), y, likelihood=name)
    assert reference.converged
    tau, nu = model.variational_strategy.sites
    torch.testing.assert_close(tau, reference.site_precision, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(nu, reference.site_natural_mean, rtol=1e-6, atol=1e-9)

    test_x = torch.linspace(-0.2, 1.2, 17, dtype=x.dtype)[:, None].expand(-1, x.shape[-1]).contiguous()
    mean, variance, _ = reference_ep.probit_predict(
        _kernel(model, x), _kernel(model, x, test_x), _kernel(model, test_x).diagonal(), reference
    )
    model.eval()
    got_mean, got_variance = model.variational_strategy.marginal_latent(test_x)
    torch.testing.assert_close(got_mean[:, 0], mean, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(got_variance[:, 0], variance, rtol=1e-6, atol=1e-9)
    model.train()

    evidence = _mll(model, likelihood)(model(x), y).detach() * len(y)
    assert math.isclose(evidence.item(), float(reference.log_marginal_likelihood), rel_tol=1e-6)


@pytest.mark.parametrize("damping", [0.3, 0.8, 1.0])
def test_fixed_point_does_not_depend_on_damping_or_update_order(damping):
    """Parallel EP at any damping reaches the sequential reference's fixed point (probit and logit)."""
    for name in ("probit", "logit"):
        x, y = _data(name, num_data=30, seed=1)
        model = _model(name, x, y, damping=damping)
        assert model.variational_strategy.fit().converged
        reference = reference_ep.sequential_ep(_kernel(model, x), y, likelihood=name)
        tau, nu = model.variational_strategy.sites
        torch.testing.assert_close(tau, reference.site_precision, rtol=1e-7, atol=1e-10)
        torch.testing.assert_close(nu, reference.site_natural_mean, rtol=1e-7, atol=1e-10)


def test_undamped_parallel_ep_takes_more_sweeps_than_needed_when_damped_less():
    """Damping changes the path, not the destination: the sweep counts differ, the sites do not."""
    x, y = _data("probit", num_data=30)
    reports, sites = [], []
    for damping in (0.4, 0.9):
        model = _model("probit", x, y, damping=damping)
        reports.append(model.variational_strategy.fit())
        sites.append(model.variational_strategy.sites[0])
    assert reports[0].steps > reports[1].steps
    torch.testing.assert_close(sites[0], sites[1], rtol=1e-8, atol=1e-11)


def _converged_evidence(name, x, y, raw: dict[str, float], constant_mean: float | None = None) -> float:
    model = _model(name, x, y, constant_mean=constant_mean)
    _set_raw(model, raw)
    model.variational_strategy.fit()
    with torch.no_grad():
        return float(_mll(model, model.variational_strategy.likelihood)(model(x), y))


def _set_raw(model, raw: dict[str, float]) -> None:
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for parameter_name, value in raw.items():
            parameters[parameter_name].fill_(value)


@pytest.mark.parametrize("name", ["probit", "poisson_exp"])
def test_evidence_gradient_matches_central_differences_of_the_reconverged_evidence(name):
    x, y = _data(name, num_data=30, seed=2)
    model = _model(name, x, y, constant_mean=0.3)
    raw = {n: p.item() for n, p in model.named_parameters()}
    model.variational_strategy.fit()
    loss = _mll(model, model.variational_strategy.likelihood)(model(x), y)
    loss.backward()
    for parameter_name, parameter in model.named_parameters():
        step = 1e-5
        plus = _converged_evidence(name, x, y, {**raw, parameter_name: raw[parameter_name] + step}, 0.3)
        minus = _converged_evidence(name, x, y, {**raw, parameter_name: raw[parameter_name] - step}, 0.3)
        difference = (plus - minus) / (2 * step)
        assert math.isclose(float(parameter.grad), difference, rel_tol=1e-4, abs_tol=1e-7), (parameter_name,)


def test_matrix_free_evidence_agrees_with_the_exact_one():
    """SLQ's log-determinant is stochastic: the value agrees to 1%, the gradient's sign and size to 10%."""
    x, y = _data("probit", num_data=120, seed=3)
    values, gradients = [], []
    for exact in (True, False):
        model = _model("probit", x, y)
        model.variational_strategy.fit()
        mll = EPMarginalLogLikelihood(model.variational_strategy.likelihood, model, exact=exact)
        with gpytorch.settings.num_trace_samples(200), gpytorch.settings.max_lanczos_quadrature_iterations(60):
            torch.manual_seed(0)
            loss = mll(model(x), y)
            loss.backward()
        values.append(loss.item())
        gradients.append(torch.stack([p.grad.reshape(()) for p in model.parameters()]))
    assert math.isclose(values[0], values[1], rel_tol=1e-2)
    torch.testing.assert_close(gradients[1], gradients[0], rtol=0.1, atol=1e-3)


def test_incomplete_solves_bound_cavities_stay_finite_and_approach_exact_ep():
    """CG with 2 iterations per sweep: the computation-aware marginal variances are too wide, cavity precisions are
    raised to the prior precision (counted), nothing is NaN, and with recycled actions the sites approach dense EP
    as the sweeps accumulate actions (measured: 2.6e-5 after 60 sweeps, from 5e-2 after 10)."""
    x, y = _data("probit", num_data=120, seed=4)
    options = dict(abs_tol=1e-10, rel_tol=1e-10, max_sweeps=10, preconditioner_rank=0)  # plain CG
    model = _model("probit", x, y, policy="cg", max_solver_iterations=2, **options)
    strategy = model.variational_strategy
    reference = reference_ep.sequential_ep(_kernel(model, x), y, likelihood="probit")
    errors, bounded = [], []
    for _ in range(6):
        report = strategy.fit(max_sweeps=10)
        tau, nu = strategy.sites
        assert torch.isfinite(tau).all() and torch.isfinite(nu).all() and (tau >= 0).all()
        errors.append(float((nu - reference.site_natural_mean).abs().max()))
        bounded.append(report.bounded_cavities)
    assert bounded[0] > 0 and bounded[-1] == 0 and report.skipped_sites == 0
    assert errors[-1] < 1e-2 * errors[0] and errors[-1] < 2e-4
    mean, variance = strategy.marginal_latent(x)
    assert torch.isfinite(mean).all() and (variance > 0).all()
    assert "EP fit" in str(report) and "bounded cavities=0" in str(report)


def test_a_buffer_past_its_memory_limit_is_compressed_with_a_warning_and_the_fit_stays_finite():
    """``settings.recycled_buffer_limit`` at room for 40 actions and their kernel products of 120 latent values: the
    fit that recycles all 120 without it (the case above) warns (``BufferLimitWarning``), keeps at most 40 actions
    between sweeps, and its sites stay finite and near exact EP's (measured: 3e-2 away, where the full buffer
    reaches 5e-9; compression drops what the sweeps learnt, the price of the memory bound)."""
    x, y = _data("probit", num_data=120, seed=4)
    model = _model("probit", x, y, policy="cg", max_solver_iterations=2, preconditioner_rank=0, max_sweeps=30)
    strategy = model.variational_strategy
    reference = reference_ep.sequential_ep(_kernel(model, x), y, likelihood="probit")
    with settings.recycled_buffer_limit(2 * 120 * 8 * 40), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy.fit()  # (30 sweeps do not converge it: a ConvergenceWarning too)
    assert any(issubclass(w.category, BufferLimitWarning) and "compressed to" in str(w.message) for w in caught)
    assert strategy.state.actions.shape == (120, 40)
    tau, nu = strategy.sites
    assert torch.isfinite(tau).all() and torch.isfinite(nu).all() and (tau >= 0).all()
    assert float((nu - reference.site_natural_mean).abs().max()) < 0.1
    mean, variance = strategy.marginal_latent(x)
    assert torch.isfinite(mean).all() and (variance > 0).all()


def test_preconditioned_incomplete_solves_bound_no_cavity():
    """The same 2 iterations per sweep, preconditioned by a rank-40 factor of K (120 points): the factor's pivots are
    actions from the first sweep, so the marginals are never too wide (no cavity bounded, where plain CG bounds 62 in
    its first 10 sweeps), and the sites approach dense EP (measured: 3.2e-2 after 10 sweeps, 2e-4 after 60; plain CG's
    2.6e-5)."""
    x, y = _data("probit", num_data=120, seed=4)
    options = dict(abs_tol=1e-10, rel_tol=1e-10, preconditioner_rank=40)
    model = _model("probit", x, y, policy="cg", max_solver_iterations=2, **options)
    strategy = model.variational_strategy
    reference = reference_ep.sequential_ep(_kernel(model, x), y, likelihood="probit")
    errors = []
    for _ in range(6):
        report = strategy.fit(max_sweeps=10)
        assert report.bounded_cavities == 0 and report.skipped_sites == 0
        # the factor's columns are no products with K; a refresh of the marginals (escalate) costs one per block
        refreshes = sum(record.marginal_blocks for record in report.records)
        assert report.kernel_products == report.solver_iterations + refreshes
        errors.append(float((strategy.sites[1] - reference.site_natural_mean).abs().max()))
    assert errors[-1] < 1e-2 * errors[0] and errors[-1] < 5e-4


def test_escalation_converges_incomplete_solves_at_a_learnt_scale_kernel(monkeypatch):
    """At an outputscale learning finds (s² 20, 300 points, CG with 5 iterations a sweep, the defaults' budget by
    convergence), the computation-aware marginals move with every sweep's actions and the sites hover at a change
    near 1e-2: the stall rule asks the loop to escalate, refresh bursts (twice the blocks each time) make the
    marginals accurate, and the fit converges, near exact EP's fixed point (the sequential dense reference, R&W
    Alg. 3.5; measured 0.9% relative: the computational uncertainty the converged actions keep). Without escalation the same fit stalls (measured 5-8% from exact EP)."""
    from gpytorch_iterncgp.core import outer_loop

    x, y = _data("probit", num_data=300, seed=0)

    def fit():
        options = dict(policy="cg", max_solver_iterations=5, abs_tol=1e-5, rel_tol=1e-5, site_tol=1e-4)
        model = _model("probit", x, y, outputscale=20.0, lengthscale=0.4, max_sweeps=None, **options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = model.variational_strategy.fit()
        return model, report, [warning.category for warning in caught]

    model, report, caught = fit()
    assert report.converged and not caught
    bursts = [record.marginal_blocks for record in report.records if record.marginal_blocks]
    assert bursts and bursts == [2**k for k in range(len(bursts))]  # each burst twice the last
    reference = reference_ep.sequential_ep(_kernel(model, x), y, likelihood="probit")
    tau, nu = model.variational_strategy.sites
    for sites, exact in ((tau, reference.site_precision), (nu, reference.site_natural_mean)):
        assert float((sites - exact).abs().max() / exact.abs().max()) < 2e-2
    monkeypatch.setattr(outer_loop, "ESCALATION_STEPS", 10**9)
    _, stalled, caught = fit()
    assert stalled.stalled and caught == [NotConvergedWarning]


def test_compressed_incomplete_solves_keep_every_site_finite():
    """With R = 3 recycled actions the marginals stay too wide for good: many cavities are bounded every sweep, the
    sites stay finite and non-negative, and the fit is not reported as converged."""
    x, y = _data("probit", num_data=120, seed=4)
    model = _model(
        "probit", x, y, outputscale=10.0, lengthscale=0.2, policy="cg", max_solver_iterations=3, compression_rank=3
    )
    report = model.variational_strategy.fit(max_sweeps=15)
    tau, nu = model.variational_strategy.sites
    assert not report.converged and report.records[-1].bounded_cavities > 0
    assert torch.isfinite(nu).all() and (tau >= 0).all()
    model.eval()
    probabilities = model.variational_strategy.predictive_probabilities(x)
    assert torch.isfinite(probabilities).all()


def test_site_update_bounds_cavities_by_the_prior_and_skips_non_finite_ones():
    """Direct check of the local step against hand-computed cavities (R&W eq. 3.56)."""
    from gpytorch_iterncgp.core.sharding import RowBlock
    from gpytorch_iterncgp.ep.sites import update_sites
    from gpytorch_iterncgp.likelihoods.adapters import likelihood_adapter

    adapter = likelihood_adapter(gpytorch.likelihoods.BernoulliLikelihood())
    targets = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    mean = torch.tensor([0.4, -0.2, 0.1], dtype=torch.float64)
    variance = torch.tensor([0.5, 1.9, 0.0], dtype=torch.float64)  # site 1: 1/1.9 - 1 < 0; site 2: not finite
    tau = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
    nu = torch.tensor([0.3, -0.1, 0.2], dtype=torch.float64)
    prior_variance = torch.tensor([2.0, 2.0, 2.0], dtype=torch.float64)
    update = update_sites(adapter, targets, mean, variance, tau, nu, 1.0, prior_variance, rows_block=RowBlock.single(3))
    assert update.bounded.tolist() == [False, True, False] and update.skipped.tolist() == [False, False, True]
    torch.testing.assert_close(update.cavity_precision[:2], torch.tensor([1 / 0.5 - 1, 1 / 2.0], dtype=torch.float64))
    # the raised cavity keeps the marginal mean: nu_cav = mu (tau_cav + tau) - nu
    assert math.isclose(float(update.cavity_natural_mean[1]), -0.2 * (0.5 + 1.0) + 0.1, rel_tol=1e-14)
    assert update.site_precision[2] == tau[2] and update.site_natural_mean[2] == nu[2]
    without_bound = update_sites(adapter, targets, mean, variance, tau, nu, 1.0, rows_block=RowBlock.single(3))
    assert without_bound.skipped.tolist() == [False, True, True]


def test_state_dict_round_trip_and_resume_repeat_an_uninterrupted_fit():
    x, y = _data("logit", num_data=50)
    options = dict(policy="cg", max_solver_iterations=4, site_tol=1e-9, max_sweeps=30)
    uninterrupted = _model("logit", x, y, **options)
    uninterrupted.variational_strategy.fit(max_sweeps=12)

    first = _model("logit", x, y, **options)
    first.variational_strategy.fit(max_sweeps=5)
    saved = first.state_dict()
    assert isinstance(saved["variational_strategy._extra_state"]["state"]["site_precision"], torch.Tensor)
    second = _model("logit", x, y, **options)
    second.load_state_dict(saved)
    second.variational_strategy.fit(max_sweeps=7)
    for a, b in zip(second.variational_strategy.sites, uninterrupted.variational_strategy.sites, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert isinstance(second.variational_strategy.state, EPState)


def test_hyperparameter_change_warm_starts_from_the_kept_sites():
    """After a kernel change the kept sites are re-solved for the new kernel first; the fixed point is the cold one."""
    x, y = _data("probit", num_data=40)
    warm = _model("probit", x, y)
    warm.variational_strategy.fit()
    warm.covar_module.base_kernel.lengthscale = 0.45
    warm_report = warm.variational_strategy.fit()
    cold = _model("probit", x, y, lengthscale=0.45)
    cold_report = cold.variational_strategy.fit()
    assert warm_report.converged and warm_report.steps < cold_report.steps
    torch.testing.assert_close(
        warm.variational_strategy.sites[0], cold.variational_strategy.sites[0], rtol=1e-7, atol=1e-10
    )


def test_float32_fit_and_predictions_are_finite_and_close_to_float64():
    x, y = _data("probit", num_data=60)
    results = []
    for dtype in (torch.float32, torch.float64):
        model = _model("probit", x.to(dtype), y.to(dtype), site_tol=1e-4, max_sweeps=100)
        model.variational_strategy.fit()
        model.eval()
        results.append(model.variational_strategy.predictive_probabilities(x.to(dtype)).double())
    assert torch.isfinite(results[0]).all()
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-3)


def test_bad_options_and_likelihoods_are_refused_with_the_fix():
    x, y = _data("probit", num_data=10)
    with pytest.raises(ValueError, match="damping must be a number in"):
        _model("probit", x, y, damping=0.0)
    with pytest.raises(ValueError, match="damping must be a number in"):
        _model("probit", x, y, damping=True)
    with pytest.raises(ValueError, match="max_sweeps"):
        _model("probit", x, y, max_sweeps=-1)
    labels = torch.randint(0, 3, (10,))
    with pytest.raises(TypeError, match="Use IterNCGPStrategy"):
        IterNCGPModel(x, labels, softmax_likelihood(3), strategy_class=EPStrategy, batch_classes=3)
    model = _model("probit", x, y)
    with pytest.raises(TypeError, match="IterNCGPStrategy"):
        from gpytorch_iterncgp import LaplaceMarginalLogLikelihood

        LaplaceMarginalLogLikelihood(model.variational_strategy.likelihood, model)


@pytest.mark.parametrize("name", ["probit_2d", "probit_1d"])
def test_ep_strategy_reproduces_gpy(name):
    """GPy 1.15's EP (numbers committed in tests/data, sequential EP converged to ~1e-14): log Z_EP, sites, test
    posterior, predictive probabilities and the gradient in the natural kernel parameters agree to 1e-8."""
    from tests.ep.test_gpy_reference import load_gpy_problem

    problem = load_gpy_problem(name)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = IterNCGPModel(
        problem.x,
        problem.y,
        likelihood,
        lengthscale=problem.lengthscale,
        outputscale=problem.variance,
        strategy_class=EPStrategy,
        **COMPLETE,
        **FIXED_POINT,
        site_tol=1e-12,
        max_sweeps=500,
    )
    # float64 tensors: a Python float goes through float32 in GPyTorch's setter (lengthscale 0.3 off by 1.2e-8)
    model.covar_module.base_kernel.lengthscale = torch.tensor(problem.lengthscale, dtype=torch.float64)
    model.covar_module.outputscale = torch.tensor(problem.variance, dtype=torch.float64)
    strategy = model.variational_strategy
    assert strategy.fit().converged
    tau, nu = strategy.sites
    torch.testing.assert_close(tau, problem.site_precision, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(nu, problem.site_natural_mean, rtol=1e-8, atol=1e-10)

    loss = EPMarginalLogLikelihood(likelihood, model)(model(problem.x), problem.y) * len(problem.y)
    loss.backward()
    assert math.isclose(loss.item(), problem.log_marginal_likelihood, rel_tol=1e-9)
    natural = []
    for module, raw_name in (
        (model.covar_module, "raw_outputscale"),
        (model.covar_module.base_kernel, "raw_lengthscale"),
    ):
        raw = getattr(module, raw_name)
        natural.append(raw.grad.reshape(()) / torch.sigmoid(raw.detach().reshape(())))  # softplus constraint
    torch.testing.assert_close(torch.stack(natural), problem.gradient, rtol=1e-7, atol=1e-9)

    model.eval()
    mean, variance = strategy.marginal_latent(problem.x_test)
    torch.testing.assert_close(mean[:, 0], problem.test_latent_mean, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(variance[:, 0], problem.test_latent_variance, rtol=1e-8, atol=1e-10)
    probability = strategy.predictive_probabilities(problem.x_test)
    torch.testing.assert_close(probability, problem.test_probability, rtol=1e-8, atol=1e-10)
