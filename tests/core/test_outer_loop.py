r"""The driver of the outer loops, :func:`~gpytorch_iterncgp.core.outer_loop.run_outer_loop`, on a loop of its
protocol written here: Heron's iteration :math:`x \leftarrow (x + a / x) / 2` for :math:`\sqrt a` (the reference:
``math.sqrt``), which "multiplies by K" a known number of times per step. What the driver adds: every step's state
and the final one committed, products counted per step, the callback, the loop's outcome (converged, stalled,
breakdown) a fit stopped by its step or time limit, and the stall rule (steps without progress) turned into warnings at the
caller's line."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import pytest

from gpytorch_iterncgp import ConvergenceWarning, NotConvergedWarning, NumericalBreakdownWarning
from gpytorch_iterncgp.core.outer_loop import (
    ESCALATION_STEPS,
    MAX_ESCALATIONS,
    STALL_STEPS,
    EPSweep,
    FitReport,
    LoopStatus,
    NewtonStep,
    OuterStep,
    run_outer_loop,
    sites_progressed,
)


@dataclass
class Counter:
    products: int = 0
    columns: int = 0
    product_seconds: float = 0.0
    products_aside: int = 0
    columns_aside: int = 0
    product_seconds_aside: float = 0.0


class Heron:
    """Steps towards :math:`\\sqrt a`; step ``k`` (from 1) takes ``k`` products of 2 columns; converged when the step
    changes :math:`x` by less than ``tol``. ``stall_at``, ``break_at``: the step that stalls or cannot be taken;
    ``warn_at``: a step that warns of a breakdown inside it (and is still taken)."""

    name = "Heron"
    step_name = "Heron steps"

    def __init__(
        self, counter: Counter, a: float = 2.0, tol: float = 1e-12, stall_at=None, break_at=None, warn_at=None
    ):
        self.counter, self.a, self.tol = counter, a, tol
        self.stall_at, self.break_at, self.warn_at = stall_at, break_at, warn_at
        self.closed = False

    def initial_state(self) -> float:
        return 1.0

    def renew(self, state: float) -> float:
        return state

    def finalize(self, state: float) -> tuple[str, float]:
        return ("final", state)

    def steps(self, state: float):
        step = 0
        try:
            while True:
                step += 1
                if step == self.break_at:
                    yield OuterStep(None, state, LoopStatus.BREAKDOWN, "step could not be computed")
                    return
                self.counter.products += step
                self.counter.columns += 2 * step
                if step == self.warn_at:
                    warnings.warn("breakdown inside the solve", NumericalBreakdownWarning, stacklevel=2)
                new = (state + self.a / state) / 2
                record = NewtonStep(step, -abs(new * new - self.a), 1.0, 3, abs(new - state), 0.0)
                status = LoopStatus.CONVERGED if abs(new - state) < self.tol else LoopStatus.CONTINUE
                if step == self.stall_at:
                    status = LoopStatus.STALLED
                state = new
                yield OuterStep(record, state, status, "no progress possible", breakdown=step == self.warn_at)
        finally:
            self.closed = True


class SlowHeron(Heron):
    """Heron's iteration judged by the stall rule: step ``k`` progressed on an earlier one where ``k`` is in
    ``progress_at`` (never by default); ``tol=0``, so it never converges."""

    stall_advice = "Try another a."

    def __init__(self, counter: Counter, progress_at=()):
        super().__init__(counter, tol=0.0)
        self.progress_at = set(progress_at)

    def made_progress(self, reference: NewtonStep, record: NewtonStep) -> bool:
        return record.step in self.progress_at


def _run(loop: Heron, max_steps: int | None = 50, **options) -> tuple[FitReport, list]:
    committed: list = []
    report = run_outer_loop(
        loop, loop.initial_state(), committed.append, loop.counter, max_steps, show_progress=False, **options
    )
    return report, committed


def _caught(function):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = function()
    return result, caught


def test_converged_loop_commits_every_state_and_counts_products_per_step():
    loop = Heron(Counter())
    (report, committed), caught = _caught(lambda: _run(loop, limit_name="max_steps"))
    assert not caught
    assert report.converged and not report.breakdown and not report.stopped_by_callback and loop.closed
    assert report.steps == len(report.records) == len(committed) - 1 == 6
    assert committed[-1] == ("final", committed[-2])
    assert committed[-2] == pytest.approx(math.sqrt(2.0), rel=1e-15)
    assert [record.kernel_products for record in report.records] == list(range(1, 7))
    assert (report.kernel_products, report.kernel_columns) == (21, 42)
    assert report.solver_iterations == 18
    assert report.log_posteriors == [record.log_posterior for record in report.records]
    assert str(report).startswith("Heron fit: 6 Heron steps, 18 solver iterations, 21 products with K")


def test_callback_sees_every_step_and_stops_the_loop():
    seen = []

    def callback(record, state):
        seen.append((record.step, state))
        return record.step == 2

    loop = Heron(Counter())
    (report, committed), caught = _caught(lambda: _run(loop, callback=callback, limit_name="max_steps"))
    assert not caught  # stopped by the callback, not by the limit
    assert report.stopped_by_callback and not report.converged and loop.closed
    assert seen == [(1, 1.5), (2, 1.5 + (2 / 1.5 - 1.5) / 2)]
    assert committed == [seen[0][1], seen[1][1], ("final", seen[1][1])]


def test_step_limit_warns_at_the_callers_line_naming_the_option():
    loop = Heron(Counter())
    (report, committed), caught = _caught(lambda: _run(loop, max_steps=2, limit_name="max_newton_steps"))
    assert report.steps == 2 and not report.converged and len(committed) == 3
    assert [warning.category for warning in caught] == [ConvergenceWarning] and report.limit == "max_newton_steps"
    assert "stopped at max_newton_steps=2 before it converged (last Heron step: log_posterior=" in str(
        caught[0].message
    )
    assert caught[0].filename == __file__  # the caller of run_outer_loop (here: _run)
    (_, _), silent = _caught(lambda: _run(Heron(Counter()), max_steps=2))  # no limit_name: stopped early by design
    assert not silent


def test_no_step_commits_the_finalised_starting_state():
    loop = Heron(Counter())
    (report, committed), caught = _caught(lambda: _run(loop, max_steps=0, limit_name="max_steps"))
    assert report.steps == 0 and committed == [("final", 1.0)] and not caught
    assert str(report).startswith("Heron fit: 0 Heron steps") and "no step taken" in str(report)


def test_stalled_loop_warns_and_keeps_its_last_state():
    loop = Heron(Counter(), stall_at=3)
    (report, committed), caught = _caught(lambda: _run(loop, limit_name="max_steps"))
    assert report.steps == 3 and not report.converged
    assert [warning.category for warning in caught] == [NotConvergedWarning]
    assert str(caught[0].message) == "no progress possible" and caught[0].filename == __file__
    assert committed[-1] == ("final", committed[-2])


def test_breakdowns_are_reported_and_their_warnings_reemitted_at_the_callers_line():
    loop = Heron(Counter(), warn_at=2, break_at=4)
    (report, committed), caught = _caught(lambda: _run(loop, limit_name="max_steps"))
    assert report.breakdown and report.steps == 3 and loop.closed
    assert [warning.category for warning in caught] == [NumericalBreakdownWarning, NumericalBreakdownWarning]
    assert str(caught[0].message) == "breakdown inside the solve"
    assert str(caught[1].message) == "step could not be computed"
    assert all(warning.filename == __file__ for warning in caught)
    assert committed[-1] == ("final", committed[-2]) and len(committed) == 4  # the last good state


def test_without_a_step_limit_the_loop_runs_until_it_stalls():
    """``max_steps=None``: the stall rule ends a loop that never converges, :data:`STALL_STEPS` steps after its last
    step with progress (the first step is the first reference), with a ``NotConvergedWarning`` that says so."""
    loop = SlowHeron(Counter())
    (report, committed), caught = _caught(lambda: _run(loop, max_steps=None, limit_name="max_steps"))
    assert report.steps == STALL_STEPS + 1 and report.stalled and not report.converged and report.limit == ""
    assert [warning.category for warning in caught] == [NotConvergedWarning]
    message = str(caught[0].message)
    assert message.startswith(f"Heron made no progress in {STALL_STEPS} Heron steps (last: log_posterior=")
    assert message.endswith("the posterior is that of the last one. Try another a.")
    assert caught[0].filename == __file__ and committed[-1] == ("final", committed[-2])
    (later, _), _ = _caught(lambda: _run(SlowHeron(Counter(), progress_at={5, 12}), max_steps=None))
    assert later.steps == 12 + STALL_STEPS and later.stalled  # each step with progress restarts the count


class EscalatingHeron(SlowHeron):
    """A :class:`SlowHeron` that records the steps after which the stall rule asked it to escalate, and raises its
    budget the first ``escalations`` times."""

    def __init__(self, counter: Counter, progress_at=(), escalations=0):
        super().__init__(counter, progress_at)
        self.escalated_after: list[int] = []
        self.escalations = escalations

    def escalate(self, record: NewtonStep) -> bool:
        self.escalated_after.append(record.step)
        return len(self.escalated_after) <= self.escalations


def test_the_stall_rule_asks_the_loop_to_escalate_before_it_stops_the_fit():
    """Every :data:`ESCALATION_STEPS` steps without progress the driver calls the loop's ``escalate`` with the last
    record; a step with progress restarts the count. An escalation that raised the budget (``True``) opens a fresh
    window (the next step is the new reference); one that could not leaves the count to run to
    :data:`STALL_STEPS`."""
    loop = EscalatingHeron(Counter())
    (report, _), _ = _caught(lambda: _run(loop, max_steps=None))
    assert report.stalled and report.steps == STALL_STEPS + 1
    assert loop.escalated_after == [1 + k for k in range(ESCALATION_STEPS, STALL_STEPS, ESCALATION_STEPS)]
    later = EscalatingHeron(Counter(), progress_at={8})
    _caught(lambda: _run(later, max_steps=None))
    assert later.escalated_after[:2] == [1 + ESCALATION_STEPS, 8 + ESCALATION_STEPS]
    raised = EscalatingHeron(Counter(), escalations=2)
    (report, _), _ = _caught(lambda: _run(raised, max_steps=None))
    first = 1 + ESCALATION_STEPS  # step 1 is the reference; then a fresh reference after each raised budget
    second = first + 1 + ESCALATION_STEPS
    assert raised.escalated_after[:3] == [first, second, second + 1 + ESCALATION_STEPS]
    assert report.stalled and report.steps == second + 1 + STALL_STEPS
    endless = EscalatingHeron(Counter(), escalations=10**6)  # a loop that always raises: at most MAX_ESCALATIONS
    (report, _), _ = _caught(lambda: _run(endless, max_steps=None))
    window = 1 + ESCALATION_STEPS  # its reference step and the steps without progress before each raise
    assert len(endless.escalated_after) == MAX_ESCALATIONS and report.stalled
    assert report.steps == MAX_ESCALATIONS * window + 1 + STALL_STEPS


def test_time_limit_stops_after_a_step_and_warns_naming_it():
    loop = SlowHeron(Counter(), progress_at=range(100))
    (report, committed), caught = _caught(lambda: _run(loop, max_steps=None, limit_name="max_steps", max_time=0.0))
    assert report.steps == 1 and report.limit == "max_time" and not report.stalled and len(committed) == 2
    assert [warning.category for warning in caught] == [ConvergenceWarning]
    assert "Heron stopped at max_time=0 s before it converged" in str(caught[0].message)
    (quiet, _), silent = _caught(lambda: _run(SlowHeron(Counter()), max_steps=None, max_time=0.0))
    assert quiet.limit == "max_time" and not silent  # no limit_name: stopped early by design
    with pytest.raises(ValueError, match="max_time must be a non-negative finite number"):
        _run(SlowHeron(Counter()), max_time=-1.0)


def test_sites_progress_by_a_new_smallest_change_above_the_tolerance():
    def sweep(change: float) -> EPSweep:
        return EPSweep(1, change, 0.5, 0, 0, 0, 3, 0.0)

    assert sites_progressed(sweep(0.1), sweep(0.09), site_tol=1e-4)
    assert not sites_progressed(sweep(0.1), sweep(0.12), site_tol=1e-4)  # oscillating sweeps
    assert not sites_progressed(sweep(1e-3), sweep(1e-5), site_tol=1e-4)  # at the tolerance, yet not converged
