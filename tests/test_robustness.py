"""Extreme regimes, interruptions and determinism.

Extreme regimes: every one either gives a finite, sensible posterior (checked against the dense exact
Laplace mode of ``tests/reference.py`` where that is defined) or stops with a warning; none gives NaN.
Interruptions: a fit stopped by its callback or by ``KeyboardInterrupt`` keeps the last completed Newton
step, resumes from it, and a ``state_dict`` saved then resumes in a fresh model bit for bit like the
uninterrupted fit. Determinism: the same seed gives the same result, and the unit-vector order is
reproducible.
"""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch

from gpytorch_iterncgp import UnitVectorPolicy
from gpytorch_iterncgp.core.prior import LatentPrior
from tests import reference
from tests.problems import (
    Problem,
    all_finite,
    data_major_prior_variance,
    dense_prior,
    exact_mode,
    fit_recording_warnings,
    log_posterior,
)

# Every Newton step solved to the tolerance, run until the weights stop changing (per dtype).
TIGHT = {
    torch.float64: dict(
        max_solver_iterations=None, outer_tol=1e-10, abs_tol=1e-10, rel_tol=1e-12, max_newton_steps=200
    ),
    torch.float32: dict(max_solver_iterations=None, outer_tol=1e-5, abs_tol=1e-6, rel_tol=1e-6, max_newton_steps=200),
}
# Relative to max(1, max|f|): float64 observed <= 1e-8 in these regimes, float32 <= 2e-4.
MODE_TOLERANCE = {torch.float64: 1e-6, torch.float32: 2e-3}
DTYPES = [torch.float64, torch.float32]
SINGLE = ["probit", "logit", "poisson_exp", "poisson_softplus"]
CLASSIFICATION = ("probit", "logit", "softmax")


def assert_sane(model, problem: Problem, x: torch.Tensor, caught: list) -> None:
    """Finite posterior at the data and away from it; variance within [0, prior]; predictions in range.

    Any non-finite number must come with a warning (and none is expected here).
    """
    strategy = model.variational_strategy
    inputs = torch.cat([x, problem.test_inputs().to(x.dtype)])
    with warnings.catch_warnings(record=True) as more:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", DeprecationWarning)
        with torch.no_grad():
            mean, variance = strategy.marginal_latent(inputs)
            expectation = strategy.predictive_mean(inputs)
            model.eval()
            posterior = model(inputs)
            posterior_mean, posterior_variance = posterior.mean, posterior.variance
            model.train()
    warned = bool(caught or more)
    finite = all_finite(mean, variance, expectation, posterior_mean, posterior_variance, strategy.mode)
    assert finite or warned, "a non-finite result without a warning"
    assert finite, [str(w.message) for w in caught + more]
    prior_variance = data_major_prior_variance(model, inputs).reshape(variance.shape)
    assert bool((variance >= 0).all())
    assert bool((variance <= prior_variance * (1 + 1e-5) + 1e-12).all())
    if problem.likelihood in CLASSIFICATION:
        assert bool(((expectation >= 0) & (expectation <= 1)).all())
        if problem.likelihood == "softmax":
            torch.testing.assert_close(expectation.sum(-1).double(), torch.ones(len(inputs), dtype=torch.float64))
    else:
        assert bool((expectation >= 0).all())


def fit_and_check(problem: Problem, x, y, compare: bool = True, **options):
    """Fit, check sanity, and (``compare``) the mode against the exact Laplace mode."""
    model = problem.model(x, y, **{**TIGHT[problem.dtype], **options})
    report, caught = fit_recording_warnings(model.variational_strategy)
    assert_sane(model, problem, x, caught)
    psi, psi_prior, _ = log_posterior(problem, model, x, y)
    assert psi >= psi_prior - 1e-6 * max(1.0, abs(psi_prior))
    if compare:
        exact = exact_mode(model, problem, x, y)
        assert exact.converged
        mode = model.variational_strategy.mode.detach().double().reshape(-1)
        error = float((mode - exact.mode).abs().max()) / max(1.0, float(exact.mode.abs().max()))
        assert error <= MODE_TOLERANCE[problem.dtype], (error, report, [str(w.message) for w in caught])
        if problem.dtype == torch.float64:
            assert report.converged
    return model, report, caught


def grid(num: int, dtype) -> torch.Tensor:
    return torch.linspace(0, 1, num, dtype=torch.float64)[:, None].to(dtype)


# ---------------------------------------------------------------------------------------------------
# Extreme regimes
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy", ["cg", "unit"])
def test_softmax_saturated_logits_and_a_class_without_data(dtype, policy):
    """Prior logits +50 / -50 / 0 (probabilities 1, e^-100, e^-50), labels only 0 and 1: half of the points
    are confidently wrong (pi_y = e^-100, bounded by min_curvature inside W+), class 2 has no data."""
    problem = Problem("softmax", num_classes=3, num_data=30, dim=2, dtype=dtype, independent=True)
    x, y = problem.data()
    y = y % 2
    assert not bool((y == 2).any()) and bool((y == 1).any())
    model = problem.model(x, y, constant_mean=0.0, policy=policy, **TIGHT[dtype])
    with torch.no_grad():
        model.mean_module.constant.copy_(torch.tensor([50.0, -50.0, 0.0], dtype=dtype))
    report, caught = fit_recording_warnings(model.variational_strategy)
    assert_sane(model, problem, x, caught)
    exact = exact_mode(model, problem, x, y)
    assert exact.converged
    mode = model.variational_strategy.mode.detach().double()
    error = float((mode.reshape(-1) - exact.mode).abs().max()) / float(exact.mode.abs().max())
    assert error <= MODE_TOLERANCE[dtype], error
    # Far from the data the prior wins: class 0 with probability ~1, class 2 (no data) ~e^-50.
    far = torch.tensor([[5.0, 5.0]], dtype=dtype)
    with torch.no_grad():
        probabilities = model.variational_strategy.predictive_probabilities(far)
    assert float(probabilities[0, 0]) > 0.999 and float(probabilities[0, 2]) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("likelihood", ["poisson_exp", "poisson_softplus"])
def test_poisson_all_counts_zero(likelihood, dtype):
    problem = Problem(likelihood, num_data=30, dtype=dtype)
    x = grid(30, dtype)
    y = torch.zeros(30, dtype=dtype)
    model, _, _ = fit_and_check(problem, x, y)
    # Zero counts pull the rate down everywhere: f < 0 at every point, expected counts below the prior's.
    assert bool((model.variational_strategy.mode < 0).all())
    with torch.no_grad():
        expected = model.variational_strategy.predictive_mean(x)
        prior = model.variational_strategy.adapter.predictive_mean(
            torch.zeros(30, dtype=dtype), data_major_prior_variance(model, x)
        )
    assert bool((expected < prior).all())


@pytest.mark.parametrize("likelihood", ["poisson_exp", "poisson_softplus"])
def test_poisson_counts_up_to_a_million(likelihood):
    """Counts 1 ... 10^6 (log-rate 0 ... 13.8). With the exp link the first Newton step from f = 0 overflows
    exp(f) far along its direction: the damping halves it back to a finite log posterior (before the fix,
    every step was rejected and the fit stopped at the prior with a warning)."""
    problem = Problem(likelihood, num_data=40)
    x = grid(40, torch.float64)
    y = torch.round(10 ** (6 * x[:, 0]))
    model = problem.model(x, y, **TIGHT[torch.float64])
    report, caught = fit_recording_warnings(model.variational_strategy)
    assert_sane(model, problem, x, caught)
    assert report.converged
    kernel, mean = dense_prior(model, x)
    exact = reference.laplace_mode(kernel, mean, y, likelihood, max_steps=500)
    # The reference's own stopping rule on Psi is too strict for Psi ~ 1e7; it is at the mode: one more
    # undamped Newton step from it changes f by < 1e-7 relative.
    mode = model.variational_strategy.mode.detach().double()[:, 0]
    error = float((mode - exact.mode).abs().max()) / float(exact.mode.abs().max())
    assert error <= 1e-6, error
    psi, _, _ = log_posterior(problem, model, x, y)
    assert psi >= exact.log_posteriors[-1] - 1e-10 * abs(exact.log_posteriors[-1])
    if likelihood == "poisson_exp":  # where the counts are large, the expected count follows them
        with torch.no_grad():
            rate = model.variational_strategy.predictive_mean(x)
        large = y >= 1000
        assert float(((rate - y).abs() / y)[large].max()) < 0.01


@pytest.mark.parametrize("likelihood", ["poisson_exp", "poisson_softplus"])
def test_poisson_counts_up_to_a_million_float32(likelihood):
    """float32 (exp(f) overflows at f = 88): a finite posterior that improves on the prior, or a warning."""
    problem = Problem(likelihood, num_data=40, dtype=torch.float32)
    x = grid(40, torch.float32)
    y = torch.round(10 ** (6 * x[:, 0].double())).float()
    model = problem.model(x, y)  # default options: a budget of 20 Newton steps
    report, caught = fit_recording_warnings(model.variational_strategy)
    assert_sane(model, problem, x, caught)
    assert report.converged or report.steps == 20 or caught
    psi, psi_prior, _ = log_posterior(problem, model, x, y)
    assert psi > psi_prior


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("likelihood", ["probit", "logit"])
def test_bernoulli_separable_data_with_outputscale_1e3(likelihood, dtype):
    """Perfectly separable labels: the likelihood alone has no maximum, the prior (outputscale 1e3) keeps a
    finite but large mode."""
    problem = Problem(likelihood, num_data=30, dtype=dtype, outputscale=1e3)
    x = grid(30, dtype)
    y = (x[:, 0] > 0.5).to(dtype)
    model, _, _ = fit_and_check(problem, x, y)
    mode = model.variational_strategy.mode[:, 0]
    assert float(mode.abs().max()) > 5  # confident ...
    assert bool(((mode > 0) == (y > 0.5)).all())  # ... and on the right side everywhere
    with torch.no_grad():
        probabilities = model.variational_strategy.predictive_probabilities(x)
    assert bool(((probabilities > 0.5) == (y > 0.5)).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("likelihood", [*SINGLE, "softmax"])
def test_duplicate_inputs(likelihood, dtype):
    """Every input three times: K is singular (rank N/3). The copies get the same mode."""
    problem = Problem(likelihood, num_classes=3 if likelihood == "softmax" else 1, num_data=15, dtype=dtype)
    x, y = problem.data()
    x, y = torch.cat([x, x, x]), torch.cat([y, y, y])
    model, _, _ = fit_and_check(problem, x, y)
    mode = model.variational_strategy.mode.detach().double()
    copies = mode.reshape(3, 15, -1)
    scale = max(1.0, float(mode.abs().max()))
    assert float((copies - copies[0]).abs().max()) <= MODE_TOLERANCE[dtype] * scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengthscale", [1e-4, 1e4])
@pytest.mark.parametrize("likelihood", [*SINGLE, "softmax"])
def test_extreme_lengthscales(likelihood, lengthscale, dtype):
    """1e-4: K = outputscale * I, every point on its own, the posterior away from the data is the prior.
    1e4: K = outputscale * 1 1^T (numerically singular), one latent value shared by all points."""
    num_classes = 3 if likelihood == "softmax" else 1
    problem = Problem(likelihood, num_classes=num_classes, num_data=30, dtype=dtype, lengthscale=lengthscale)
    x, y = problem.data()
    model, _, _ = fit_and_check(problem, x, y)
    mode = model.variational_strategy.mode.detach().double()
    if lengthscale > 1:
        spread = (mode - mode.mean(0)).abs().max()
        assert float(spread) <= 1e-3 * max(1.0, float(mode.abs().max()))
    else:
        far = torch.tensor([[3.0]], dtype=dtype)
        with torch.no_grad():
            mean, variance = model.variational_strategy.marginal_latent(far)
        torch.testing.assert_close(mean.double(), torch.zeros_like(mean, dtype=torch.float64), rtol=0, atol=1e-6)
        torch.testing.assert_close(variance.double(), torch.full_like(variance, 2.0, dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy", ["cg", "unit"])
@pytest.mark.parametrize("likelihood", [*SINGLE, "softmax", "softmax-independent"])
def test_single_data_point(likelihood, policy, dtype):
    independent = likelihood == "softmax-independent"
    name = "softmax" if independent else likelihood
    problem = Problem(name, num_classes=3 if name == "softmax" else 1, num_data=1, dtype=dtype, independent=independent)
    x, y = problem.data()
    model, _, _ = fit_and_check(problem, x, y, policy=policy)
    assert model.variational_strategy.mode.shape == (1, problem.num_classes)


@pytest.mark.parametrize("independent", [False, True], ids=["shared-kernel", "one-gp-per-class"])
def test_fifty_classes(independent):
    """C = 50 with 20 points: most classes have no data; N C = 1000 latent values."""
    problem = Problem("softmax", num_classes=50, num_data=20, dim=2, independent=independent)
    x, y = problem.data()
    assert len(y.unique()) < 50
    fit_and_check(problem, x, y)
    # The default (budgeted) options give a finite posterior too.
    fit_and_check(problem, x, y, compare=False, max_solver_iterations=5, outer_tol=1e-2, max_newton_steps=20)


# ---------------------------------------------------------------------------------------------------
# Interruption
# ---------------------------------------------------------------------------------------------------
INTERRUPT_CASES = [
    pytest.param(Problem("probit", num_data=40), "cg", None, id="probit-cg"),
    pytest.param(Problem("softmax", num_classes=3, num_data=30, dim=2), "unit", 3, id="softmax-unit-R3"),
    pytest.param(Problem("poisson_exp", num_data=40), "unit", None, id="poisson-unit"),
    pytest.param(Problem("logit", num_data=40, dim=2), "cg", 1, id="logit-cg-R1"),
]
# Two solver iterations per Newton step and 30 Newton steps in all (unit-vector actions with compression do
# not converge to outer_tol in 30 steps; that does not matter here, the step counts are matched).
# The paper's CG, unpreconditioned: every product is the solver's, so the 8th falls in the middle of the fit.
STEPWISE = dict(max_solver_iterations=2, outer_tol=1e-8, seed=3, preconditioner_rank=0)
TOTAL_STEPS = 30


def _model(problem, policy, rank):
    x, y = problem.data()
    return problem.model(x, y, policy=policy, compression_rank=rank, max_newton_steps=TOTAL_STEPS, **STEPWISE)


def _uninterrupted(problem, policy, rank):
    model = _model(problem, policy, rank)
    report = model.variational_strategy.fit()
    assert report.steps > 4
    return model


def _resume(model):
    """Continue a fit to TOTAL_STEPS Newton steps in all (the uninterrupted fit's budget)."""
    return model.variational_strategy.fit(max_newton_steps=TOTAL_STEPS - model.variational_strategy.state.newton_steps)


def assert_bit_identical(model, other) -> None:
    state, other_state = model.variational_strategy.state, other.variational_strategy.state
    assert state.newton_steps == other_state.newton_steps
    assert state.log_posterior == other_state.log_posterior
    for name, tensor in state.tensors().items():
        assert torch.equal(tensor, other_state.tensors()[name]), name
    assert torch.equal(model.variational_strategy.mode, other.variational_strategy.mode)


def assert_consistent(model, steps: int) -> None:
    """The state is that of a completed Newton step: K a is K times a, Psi as recorded, predictions finite."""
    strategy = model.variational_strategy
    state = strategy.state
    assert state.newton_steps == steps
    x = strategy.train_inputs
    kernel, _ = dense_prior(model, x)
    torch.testing.assert_close(kernel @ state.representer_weights, state.kernel_representer_weights)
    torch.testing.assert_close(kernel @ state.actions, state.kernel_actions)
    torch.testing.assert_close(kernel @ state.precision_root, state.kernel_precision_root)
    with torch.no_grad():
        mean, variance = strategy.marginal_latent(x)
    assert all_finite(mean, variance)
    assert strategy.last_report is None or strategy.last_report.steps <= steps


def _save(model) -> dict:
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(("problem", "policy", "rank"), INTERRUPT_CASES)
def test_callback_stop_then_resume_is_bit_identical(problem, policy, rank):
    reference_model = _uninterrupted(problem, policy, rank)
    model = _model(problem, policy, rank)
    report = model.variational_strategy.fit(callback=lambda step, state: step.step == 3)
    assert report.stopped_by_callback and report.steps == 3
    assert_consistent(model, 3)
    saved = _save(model)  # after the stop
    _resume(model)
    assert_bit_identical(model, reference_model)
    fresh = _model(problem, policy, rank)
    fresh.load_state_dict(saved)
    _resume(fresh)
    assert_bit_identical(fresh, reference_model)


@pytest.mark.parametrize(("problem", "policy", "rank"), INTERRUPT_CASES)
def test_state_dict_saved_inside_callback_resumes_bit_identical(problem, policy, rank):
    """Saved in the middle of a fit that then runs on: the fresh model ends exactly where the fit ended."""
    saved = {}
    model = _model(problem, policy, rank)

    def save_at_step_two(step, state):
        if step.step == 2:
            saved["state_dict"] = _save(model)

    report = model.variational_strategy.fit(callback=save_at_step_two)
    assert not report.stopped_by_callback
    assert_bit_identical(model, _uninterrupted(problem, policy, rank))
    fresh = _model(problem, policy, rank)
    fresh.load_state_dict(saved["state_dict"])
    assert fresh.variational_strategy.state.newton_steps == 2
    _resume(fresh)
    assert_bit_identical(fresh, model)


def _after_a_kernel_change(problem, policy, rank):
    """A model fitted for 4 Newton steps, then given another lengthscale: its next fit renews the state's products with
    K (their kernel Gram matrix one GEMM, ``ActionBuffer.from_tensors(gemm_columns=None)``)."""
    model = _model(problem, policy, rank)
    model.variational_strategy.fit(max_newton_steps=4)
    with torch.no_grad():
        model.covar_module.base_kernel.lengthscale = 1.25 * model.covar_module.base_kernel.lengthscale
    return model


# Softmax with unit vectors compressed to R = 3: the resumed fit ends within 1e-13 of the uninterrupted one, not bit for
# bit, with the renewed Gram matrix computed column by column as well (a rounding difference this test found, not yet
# traced; the same case resumes bit for bit without a kernel change, above).
KERNEL_CHANGE_CASES = [
    pytest.param(
        *case.values, marks=pytest.mark.xfail(strict=True, reason="rounding after a kernel change"), id=case.id
    )
    if case.id == "softmax-unit-R3"
    else case
    for case in INTERRUPT_CASES
]


@pytest.mark.parametrize(("problem", "policy", "rank"), KERNEL_CHANGE_CASES)
def test_resume_after_a_kernel_change_is_bit_identical(problem, policy, rank):
    """After a change of the kernel, a fit stopped by its callback and resumed, in the same model or in a fresh one
    from its ``state_dict``, ends bit for bit where the uninterrupted fit ends."""
    reference_model = _after_a_kernel_change(problem, policy, rank)
    report = reference_model.variational_strategy.fit(max_newton_steps=8)
    assert report.steps > 3
    model = _after_a_kernel_change(problem, policy, rank)
    report = model.variational_strategy.fit(max_newton_steps=8, callback=lambda step, state: step.step == 7)
    assert report.stopped_by_callback
    saved = _save(model)
    model.variational_strategy.fit(max_newton_steps=12 - model.variational_strategy.state.newton_steps)
    assert_bit_identical(model, reference_model)
    fresh = _after_a_kernel_change(problem, policy, rank)
    fresh.load_state_dict(saved)
    fresh.variational_strategy.fit(max_newton_steps=12 - fresh.variational_strategy.state.newton_steps)
    assert_bit_identical(fresh, reference_model)


def _interrupt_kernel_product(monkeypatch, at_call: int) -> None:
    """Raise KeyboardInterrupt in the ``at_call``-th product with K (in the middle of a Newton step); the kernel
    columns that unit-vector actions take instead of a product count as products."""
    calls = [0]

    def interrupting(original):
        def interrupted(self, argument):
            calls[0] += 1
            if calls[0] == at_call:
                raise KeyboardInterrupt
            return original(self, argument)

        return interrupted

    monkeypatch.setattr(LatentPrior, "matmul", interrupting(LatentPrior.matmul))
    monkeypatch.setattr(LatentPrior, "kernel_columns", interrupting(LatentPrior.kernel_columns))


@pytest.mark.parametrize(("problem", "policy", "rank"), INTERRUPT_CASES)
def test_keyboard_interrupt_mid_step_keeps_last_completed_step(problem, policy, rank, monkeypatch):
    reference_model = _uninterrupted(problem, policy, rank)
    model = _model(problem, policy, rank)
    completed = []
    _interrupt_kernel_product(monkeypatch, at_call=8)
    with pytest.raises(KeyboardInterrupt):
        model.variational_strategy.fit(
            callback=lambda step, state: completed.append((step.step, model.variational_strategy.policy.state()))
        )
    monkeypatch.undo()
    last_step, policy_state = completed[-1]
    assert last_step >= 2
    assert_consistent(model, last_step)
    # The unit-vector policy is back at its position after the last completed step.
    assert model.variational_strategy.policy.state() == policy_state
    saved = _save(model)
    _resume(model)
    assert_bit_identical(model, reference_model)
    fresh = _model(problem, policy, rank)
    fresh.load_state_dict(saved)
    _resume(fresh)
    assert_bit_identical(fresh, reference_model)


def test_keyboard_interrupt_raised_by_the_callback():
    problem = Problem("softmax", num_classes=3, num_data=30, dim=2)
    reference_model = _uninterrupted(problem, "unit", 3)
    model = _model(problem, "unit", 3)

    def interrupt(step, state):
        if step.step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        model.variational_strategy.fit(callback=interrupt)
    assert_consistent(model, 2)
    _resume(model)
    assert_bit_identical(model, reference_model)


def test_interrupted_before_the_first_step_leaves_no_state(monkeypatch):
    problem = Problem("probit", num_data=20)
    model = _model(problem, "unit", None)
    _interrupt_kernel_product(monkeypatch, at_call=1)
    with pytest.raises(KeyboardInterrupt):
        model.variational_strategy.fit()
    monkeypatch.undo()
    assert model.variational_strategy.state is None
    assert model.variational_strategy.policy.state() == {"position": 0}
    model.variational_strategy.fit()
    assert_bit_identical(model, _uninterrupted(problem, "unit", None))


# ---------------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------------
def _unit_order(seed: int, num_data: int = 20, num_latents: int = 1, zero_sum: bool = False) -> torch.Tensor:
    policy = UnitVectorPolicy(seed=seed)
    policy.prepare(num_data, num_latents, zero_sum)
    residual = torch.ones(num_data * num_latents, dtype=torch.float64)
    return torch.stack([policy(residual).argmax() for _ in range(num_data * (num_latents - zero_sum))])


def test_unit_vector_order_is_reproducible():
    torch.manual_seed(0)
    first = _unit_order(7)
    torch.manual_seed(123)  # the global random state does not matter
    torch.rand(1000)
    assert torch.equal(_unit_order(7), first)
    assert sorted(first.tolist()) == list(range(20))  # a permutation of the data
    assert not torch.equal(_unit_order(8), first)  # the seed does
    # It is the seeded CPU permutation, so it can be written down: torch.randperm(N, generator=seed).
    assert torch.equal(first, torch.randperm(20, generator=torch.Generator().manual_seed(7)))
    # Softmax: all but the last class of each point, point by point in the same order.
    order = _unit_order(7, num_data=20, num_latents=3, zero_sum=True)
    assert torch.equal(order[::2] // 3, first) and bool((order % 3 < 2).all())


@pytest.mark.parametrize("name", ["probit", "softmax"])
def test_unit_vector_actions_follow_the_seeded_order(name):
    problem = Problem(name, num_classes=3 if name == "softmax" else 1, num_data=20)
    x, y = problem.data()
    orders = []
    for _ in range(2):
        model = problem.model(x, y, policy="unit", seed=11, max_solver_iterations=6, max_newton_steps=1)
        model.variational_strategy.fit()
        actions = model.variational_strategy.state.actions  # the buffer as the solver left it
        orders.append(actions.abs().argmax(0))
    assert torch.equal(orders[0], orders[1])
    expected = torch.randperm(20, generator=torch.Generator().manual_seed(11))
    points = orders[0] // problem.num_classes
    if name == "softmax":  # two coordinates (classes 0 and 1) per point
        assert torch.equal(points, expected[:3].repeat_interleave(2))
    else:
        assert torch.equal(points, expected[:6])


def test_explicit_unit_vector_order_is_followed():
    problem = Problem("logit", num_data=20)
    x, y = problem.data()
    order = [5, 3, 19, 0]
    model = problem.model(x, y, policy=UnitVectorPolicy(order=order), max_solver_iterations=4, max_newton_steps=1)
    model.variational_strategy.fit()
    assert model.variational_strategy.state.actions.abs().argmax(0).tolist() == order


# three unit vectors per step, three kept: on some problems Psi gains too little to go on (a stall, warned of)
@pytest.mark.filterwarnings("ignore::gpytorch_iterncgp.NotConvergedWarning")
def test_same_seed_same_result_twice_for_every_likelihood():
    for problem in [Problem(name) for name in SINGLE] + [Problem("softmax", num_classes=3, dim=2)]:
        results = []
        for _ in range(2):
            x, y = problem.data()
            model = problem.model(x, y, policy="unit", seed=4, compression_rank=3, max_solver_iterations=3)
            report = model.variational_strategy.fit()
            with torch.no_grad():
                results.append((*model.variational_strategy.marginal_latent(problem.test_inputs()), report))
        assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
        assert results[0][2].log_posteriors == results[1][2].log_posteriors
        assert all(math.isfinite(psi) for psi in results[0][2].log_posteriors)


# ---------------------------------------------------------------------------------------------------
# A small step of an incomplete solve is not convergence
# ---------------------------------------------------------------------------------------------------
def test_a_step_that_moves_nothing_is_not_convergence():
    """Exp-link Poisson at f = 0: the pseudo-target of a point with count 1 is y - 1 = 0. A unit-vector action
    on that point makes the first Newton step move nothing (relative change 0). That used to be reported as
    converged after one step, at the prior."""
    problem = Problem("poisson_exp", num_data=10)
    x = grid(10, torch.float64)
    y = torch.tensor([1.0, 0, 3, 7, 2, 5, 9, 4, 1, 0])
    options = {**TIGHT[torch.float64], "max_solver_iterations": 1}
    model = problem.model(x, y, policy=UnitVectorPolicy(order=list(range(10))), **options)
    first = model.variational_strategy.fit(max_newton_steps=1)
    assert first.records[0].relative_change == 0.0 and not first.converged
    report = model.variational_strategy.fit()
    assert report.converged
    exact = exact_mode(model, problem, x, y)
    torch.testing.assert_close(model.variational_strategy.mode[:, 0], exact.mode, rtol=0, atol=1e-8)


# Found by the property tests (one solver iteration per Newton step, outer_tol 1e-10): each was reported as
# converged with the mode off by 90%, 0.6%, 29% and 0.05% (max relative).
FALSE_CONVERGENCE = [
    pytest.param(
        Problem("poisson_exp", num_data=32, seed=54615, lengthscale=1.832653665847946, outputscale=0.10909929632435693),
        "unit",
        3,
        id="poisson-exp-unit-after-1-step",
    ),
    pytest.param(
        Problem(
            "probit", num_data=21, dim=2, seed=36877, lengthscale=0.0534510264407816, outputscale=0.2521773187850291
        ),
        "unit",
        3,
        id="probit-unit-psi-change-below-sqrt-eps",
    ),
    pytest.param(
        Problem(
            "softmax",
            num_classes=5,
            num_data=11,
            seed=5318,
            lengthscale=1.4689409180172637,
            outputscale=0.4240305150359521,
        ),
        "unit",
        1,
        id="softmax-unit-after-4-steps",
    ),
    pytest.param(
        Problem("poisson_softplus", num_data=15, seed=0, lengthscale=2.0, outputscale=3.0),
        "cg",
        None,
        id="softplus-cg-stagnating-after-8-steps",
    ),
]


# one iteration per step: a fit may stall (warned of); what matters here is that it never claims convergence falsely
@pytest.mark.filterwarnings("ignore::gpytorch_iterncgp.NotConvergedWarning")
@pytest.mark.parametrize(("problem", "policy", "rank"), FALSE_CONVERGENCE)
def test_converged_means_at_the_exact_mode(problem, policy, rank):
    x, y = problem.data()
    # plain CG, one iteration per step: the scenarios where its steps stagnated (a preconditioned step solves these
    # small systems at once)
    options = {**TIGHT[torch.float64], "max_newton_steps": 60, "max_solver_iterations": 1, "preconditioner_rank": 0}
    model = problem.model(x, y, policy=policy, compression_rank=rank, **options)
    report = model.variational_strategy.fit()
    mode = model.variational_strategy.mode.detach().reshape(-1)
    exact = exact_mode(model, problem, x, y)
    error = float((mode - exact.mode).abs().max()) / max(1.0, float(exact.mode.abs().max()))
    assert not report.converged or error <= 1e-6, (report.steps, error)
    assert report.steps > 8


# ---------------------------------------------------------------------------------------------------
# IterGP: an action already in the span of the earlier ones
# ---------------------------------------------------------------------------------------------------


NEARLY_DEPENDENT_ACTIONS = [
    pytest.param(Problem("softmax", num_classes=2, num_data=36, dim=2, seed=174, lengthscale=0.05078125), id="C2-a"),
    pytest.param(Problem("softmax", num_classes=2, num_data=36, dim=2, seed=174, lengthscale=0.0546875), id="C2-b"),
    pytest.param(
        Problem("softmax", num_classes=5, num_data=36, dim=2, seed=5659, lengthscale=0.05, outputscale=1.0), id="C5-a"
    ),
    pytest.param(
        Problem("softmax", num_classes=5, num_data=36, dim=2, seed=5659, lengthscale=0.05, outputscale=0.1), id="C5-b"
    ),
]


@pytest.mark.parametrize("problem", NEARLY_DEPENDENT_ACTIONS)
def test_reported_residual_is_the_true_residual(problem, monkeypatch):
    """Softmax, unit-vector actions, R = 3 (property-test draws): the recycled eigen-directions were nearly
    unit vectors (short lengthscale), the policy picked the same coordinates again, and appending those nearly
    dependent actions made the tracked K v drift: IterGP reported a residual of 1.6e-9 where the true one was
    1.6e-3, and the fit "converged" 0.05% off the mode, or ran 300 Newton steps and ended 2% off it."""
    import gpytorch_iterncgp.laplace.newton as newton

    x, y = problem.data()
    model = problem.model(x, y, policy="unit", compression_rank=3, **TIGHT[torch.float64])
    kernel, _ = dense_prior(model, x)
    solves = []
    original = newton.itergp_solve

    def recording(kernel_matmul, noise_inverse, rhs, *args, **kwargs):
        result = original(kernel_matmul, noise_inverse, rhs, *args, **kwargs)
        weights = result.representer_weights
        true = kwargs["project"]((rhs - kernel @ weights - noise_inverse.matmul(weights[:, None])[:, 0])[:, None])
        solves.append((result.residual_norm, float(true.norm()), float(rhs.norm())))
        return result

    monkeypatch.setattr(newton, "itergp_solve", recording)
    report = model.variational_strategy.fit()
    for reported, true, scale in solves:
        assert abs(reported - true) <= 1e-10 * scale, (reported, true)
    assert report.converged
    exact = exact_mode(model, problem, x, y)
    torch.testing.assert_close(model.variational_strategy.mode.reshape(-1), exact.mode, rtol=0, atol=1e-8)


def test_rejected_step_continues_the_same_system_without_compression():
    """After a rejected Newton step W is unchanged: the next solve continues with all its actions instead of
    compressing them away (otherwise it repeats the same too-short solve, and with R = 10, j <= 5 on the
    10-class mixture at N = 10^4 every step after the 10th was rejected). The next accepted step compresses."""
    import gpytorch

    from gpytorch_iterncgp.datasets import gaussian_mixture
    from tests.common import IterNCGPModel

    x, y, _, _ = gaussian_mixture(500, 10, num_classes=10, dtype=torch.float64)
    likelihood = gpytorch.likelihoods.SoftmaxLikelihood(num_classes=10, mixing_weights=False)
    rank, iterations = 3, 2
    model = IterNCGPModel(
        x,
        y,
        likelihood,
        kernel="matern",
        lengthscale=0.3,
        outputscale=20.0,
        compression_rank=rank,
        max_solver_iterations=iterations,
        max_newton_steps=18,
        min_curvature=1e-6,
        preconditioner_rank=0,  # the scenario of plain CG (a preconditioned fit rejects other steps)
    )
    records, saved = [], {}

    def callback(step, state):
        records.append((step.step_size, state.actions.shape[-1], state.control.same_system))
        if step.step_size == 0.0 and not saved:
            saved.update(model.state_dict())

    model.variational_strategy.fit(callback=callback)
    rejected = [index for index, (size, _, _) in enumerate(records) if size == 0.0]
    assert rejected, "the problem is chosen so that a step is rejected"
    index = rejected[0]
    assert records[index] == (0.0, rank + iterations, True)
    assert records[index + 1][1] == rank + 2 * iterations  # the same system, continued with every action
    later = [columns for size, columns, _ in records[index + 2 :] if size > 0]
    assert later and max(later) <= rank + iterations  # compressed again once W changed
    fresh = IterNCGPModel(x, y, likelihood, kernel="matern", lengthscale=0.3, outputscale=20.0)
    fresh.load_state_dict(saved)
    assert fresh.variational_strategy.state.control.same_system
