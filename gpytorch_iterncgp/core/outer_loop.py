r"""The driver of an outer loop: one GP regression per step, observed from outside.

A fit is an iterator over steps (damped Newton here; expectation propagation is another such loop). Each
step solves one GP regression with IterGP and yields an :class:`OuterStep`: its record, the new state, and
whether the loop converged or cannot go on. :func:`run_outer_loop` drains it and is the only place that

* hands each state to ``commit`` (the strategy, the one owner of the committed state),
* counts products with :math:`\mathbf K` per step and in total (from :class:`~gpytorch_iterncgp.core.prior.LatentPrior`'s
  counters, which only ever increase),
* shows progress (tqdm), calls the user's callback, and
* turns the loop's outcome and the solver's warnings into warnings at the caller's line (and a fit stopped by its
  step limit into a ``ConvergenceWarning``).

The loop itself (probnum's ``solve_iterator`` pattern) knows nothing of these.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
import warnings
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor
from tqdm.auto import tqdm

from ..exceptions import ConvergenceWarning, NotConvergedWarning, NumericalBreakdownWarning
from .sharding import RowBlock
from .threads import small_operations


class LoopStatus(enum.Enum):
    """Where an outer loop stands after a step (:attr:`OuterStep.status`)."""

    CONTINUE = "continue"  # the loop goes on
    CONVERGED = "converged"  # the loop's own convergence test holds
    STALLED = "stalled"  # no progress is possible (the step's message says why)
    BREAKDOWN = "breakdown"  # the step could not be computed (the state is the last good one)


def relative_norm_change(new: Tensor, old: Tensor, rows_block: RowBlock) -> float:
    r""":math:`\|\mathbf x_{\text{new}} - \mathbf x_{\text{old}}\| / \|\mathbf x_{\text{old}}\|` (Euclidean norms), the
    change of the Newton loop's representer weights; 0 for no change, :math:`\infty` for a change from 0. Vectors
    held by rows of ``rows_block``: the norms by ``all_reduce``."""
    change, old_norm = float(rows_block.norm(new - old)), float(rows_block.norm(old))
    return change / old_norm if old_norm > 0 else (0.0 if change == 0 else math.inf)


def relative_max_change(new: Tensor, old: Tensor) -> float:
    r""":math:`\max_i |x_{\text{new}, i} - x_{\text{old}, i}| / \max_i |x_{\text{new}, i}|`, relative to the *new*
    values, the change of EP's site parameters; 0 for no change, :math:`\infty` for a change to 0."""
    return ratio_of_change(float((new - old).abs().max()), float(new.abs().max()))


def ratio_of_change(difference: float, scale: float) -> float:
    r"""``difference / scale`` for a largest change :math:`\max_i |x_{\text{new}, i} - x_{\text{old}, i}|` and a largest
    new value :math:`\max_i |x_{\text{new}, i}|` (:func:`relative_max_change`; e.g. maxima over ranks); 0 for no
    change, :math:`\infty` for a change to 0."""
    return difference / scale if scale > 0 else (0.0 if difference == 0 else math.inf)


@dataclass
class NewtonStep:
    """One step of the outer loop as recorded in the :class:`FitReport`."""

    step: int
    log_posterior: float
    step_size: float  # 1 (full step), 1/2, 1/4, ... (damped) or 0 (rejected)
    solver_iterations: int
    residual_norm: float
    relative_change: float
    kernel_products: int = 0  # filled in by the driver
    kernel_product_seconds: float = 0.0  # wall time of this step's products with K (filled in by the driver)

    def progress(self) -> dict[str, str]:
        """What the progress bar shows after this step."""
        return {"log_posterior": f"{self.log_posterior:.5g}", "residual": f"{self.residual_norm:.2g}"}

    def details(self, report: FitReport) -> str:
        """What ``str(report)`` says of a fit that ended with this step."""
        return f"log posterior={self.log_posterior:.6g}"


@dataclass
class EPSweep:
    """One parallel sweep of expectation propagation as recorded in the :class:`FitReport`."""

    step: int
    site_change: float  # max relative change the undamped update proposed for the site parameters
    damping: float
    skipped_sites: int  # sites whose cavity was not finite (kept as they were)
    bounded_cavities: int  # cavity precisions raised to the prior precision (computation-aware marginals too wide)
    clipped_sites: int  # sites whose new precision was negative (set to 0)
    solver_iterations: int
    residual_norm: float
    kernel_products: int = 0  # filled in by the driver
    kernel_product_seconds: float = 0.0  # filled in by the driver

    def progress(self) -> dict[str, str]:
        """What the progress bar shows after this sweep."""
        return {
            "site_change": f"{self.site_change:.2g}",
            "bounded": str(self.bounded_cavities),
            "residual": f"{self.residual_norm:.2g}",
        }

    def details(self, report: FitReport) -> str:
        """What ``str(report)`` says of a fit that ended with this sweep."""
        return (
            f"bounded cavities={report.bounded_cavities}, skipped site updates={report.skipped_sites}, "
            f"site change={self.site_change:.3g}"
        )


StepRecord = NewtonStep | EPSweep


@dataclass
class OuterStep:
    """What an outer loop yields after each completed step.

    :param record: the step's record (the driver adds its products with K).
    :param state: the state after the step (complete: a fit can resume from it).
    :param status: :class:`LoopStatus`: ``CONTINUE``, ``CONVERGED``, ``STALLED`` (no progress possible; ``message``
        says why) or ``BREAKDOWN`` (the step could not be computed; ``state`` is the last good one).
    """

    record: StepRecord | None
    state: Any
    status: LoopStatus = LoopStatus.CONTINUE
    message: str = ""
    breakdown: bool = False  # IterGP stopped on a numerical breakdown inside this step (the step is still valid)


class OuterLoop(Protocol):
    """An outer loop over GP regressions solved by IterGP (damped Newton; EP)."""

    name: str  # "Laplace", "EP": shown on the progress bar and in the report
    step_name: str  # what the loop calls its steps in the report, plural: "Newton steps", "sweeps"

    def initial_state(self) -> Any:
        """The state to start from without a previous fit (the prior)."""
        ...

    def renew(self, state: Any) -> Any:
        """``state`` made valid for a changed kernel (its kernel products renewed)."""
        ...

    def steps(self, state: Any) -> Generator[OuterStep, None, None]:
        """Steps from ``state``, until converged, stalled or broken down (never on its own otherwise)."""
        ...

    def finalize(self, state: Any) -> Any:
        """The state to predict with after the last step (no product with K)."""
        ...


class ProductCounter(Protocol):
    products: int
    columns: int
    product_seconds: float


@dataclass
class FitReport:
    """What a call of :meth:`~gpytorch_iterncgp.IterNCGPStrategy.fit` or :meth:`~gpytorch_iterncgp.EPStrategy.fit` did.

    :attr:`steps` counts the outer loop's steps, which the loop calls :attr:`step_name` (Newton steps, or EP
    sweeps); :attr:`records` holds one record per step.
    """

    steps: int = 0
    solver_iterations: int = 0
    kernel_products: int = 0  # calls of the kernel matmul (including the renewal of stale products)
    kernel_columns: int = 0  # vectors multiplied by K in those calls
    kernel_product_seconds: float = 0.0  # wall time spent in those calls (the rest of wall_time is everything else)
    preconditioner_seconds: float = 0.0  # wall time building the preconditioner (core.preconditioner), not in products
    preconditioner_products: int = 0  # its calls of the kernel's columns or products (not in kernel_products)
    converged: bool = False
    breakdown: bool = False
    stopped_by_callback: bool = False
    wall_time: float = 0.0
    records: list[Any] = field(default_factory=list)  # NewtonStep or EPSweep records, one per step
    budget: str = ""  # how the solver budget was chosen (set by callers that choose it, e.g. the estimators)
    method: str = "Laplace"  # the outer loop: "Laplace" (IterNCGP's damped Newton), "EP" or "EP-DTC" (sparse EP)
    step_name: str = "Newton steps"  # what the loop calls its steps (OuterLoop.step_name), e.g. "sweeps" for EP

    @property
    def skipped_sites(self) -> int:
        """EP: site updates skipped for a cavity that was not finite, summed over the sweeps."""
        return sum(getattr(record, "skipped_sites", 0) for record in self.records)

    @property
    def bounded_cavities(self) -> int:
        """EP: cavity precisions raised to the prior precision, summed over the sweeps."""
        return sum(getattr(record, "bounded_cavities", 0) for record in self.records)

    @property
    def log_posteriors(self) -> list[float]:
        r"""Newton: :math:`\Psi` after every step (empty for EP's sweeps, whose records have no :math:`\Psi`)."""
        return [record.log_posterior for record in self.records if isinstance(record, NewtonStep)]

    @property
    def residual_norms(self) -> list[float]:
        return [record.residual_norm for record in self.records]

    @property
    def step_sizes(self) -> list[float]:
        """Newton: the damping of every step (empty for EP's sweeps: see their ``damping``)."""
        return [record.step_size for record in self.records if isinstance(record, NewtonStep)]

    @property
    def site_changes(self) -> list[float]:
        """EP: the largest relative site change every sweep proposed (empty for Newton steps)."""
        return [record.site_change for record in self.records if isinstance(record, EPSweep)]

    def __str__(self) -> str:
        last = self.records[-1] if self.records else None
        details = last.details(self) if last is not None else "no step taken"
        return (
            f"{self.method} fit: {self.steps} {self.step_name}, {self.solver_iterations} solver iterations, "
            f"{self.kernel_products} products with K ({self.kernel_product_seconds:.2f}s), "
            f"converged={self.converged}, breakdown={self.breakdown}, {details}, "
            f"residual={last.residual_norm if last else float('nan'):.3g}, {self.wall_time:.2f}s"
            + (f"; {self.budget}" if self.budget else "")
        )


def _reemit(caught: list[warnings.WarningMessage], stacklevel: int) -> None:
    for warning in caught:
        warnings.warn(warning.message, warning.category, stacklevel=stacklevel + 1)


def run_outer_loop(
    loop: OuterLoop,
    state: Any,
    commit: Callable[[Any], None],
    counter: ProductCounter,
    max_steps: int,
    callback: Callable[[Any, Any], bool | None] | None = None,
    show_progress: bool = True,
    stacklevel: int = 2,
    description: str | None = None,
    limit_name: str | None = None,
) -> FitReport:
    """Run at most ``max_steps`` steps of ``loop`` from ``state``; commit every completed step and the final state.

    :param counter: the prior whose products with K are counted (totals since it was built).
    :param callback: called after every step with its record and the state; returning ``True`` stops.
    :param stacklevel: of the warnings, counted from the caller of this function.
    :param description: the progress bar's name (``None``: the loop's).
    :param limit_name: the option that set ``max_steps`` (e.g. ``"max_sweeps"``): a fit it stops before convergence
        raises a :class:`~gpytorch_iterncgp.ConvergenceWarning` naming it; ``None``: no warning (fits stopped early by
        design).
    """
    start_time = time.perf_counter()
    report = FitReport(method=loop.name, step_name=loop.step_name)
    progress = tqdm(total=max_steps, desc=description or loop.name, disable=not show_progress, leave=False)
    iterator = loop.steps(state)
    try:
        for _ in range(max_steps):
            products, seconds = counter.products, counter.product_seconds
            with warnings.catch_warnings(record=True) as caught, small_operations():
                warnings.simplefilter("always", NumericalBreakdownWarning)
                outcome = next(iterator, None)
            _reemit(caught, stacklevel + 1)
            if outcome is None:
                break
            report.breakdown |= outcome.breakdown or outcome.status is LoopStatus.BREAKDOWN
            if outcome.record is None:  # the step could not be taken: nothing new to commit
                warnings.warn(outcome.message, NumericalBreakdownWarning, stacklevel=stacklevel + 1)
                break
            record = dataclasses.replace(
                outcome.record,
                kernel_products=counter.products - products,
                kernel_product_seconds=counter.product_seconds - seconds,
            )
            state = outcome.state
            commit(state)
            report.records.append(record)
            report.steps += 1
            report.solver_iterations += record.solver_iterations
            progress.update(1)
            progress.set_postfix(record.progress())
            if callback is not None and callback(record, state):
                report.stopped_by_callback = True
                break
            if outcome.status is LoopStatus.CONVERGED:
                report.converged = True
                break
            if outcome.status is LoopStatus.STALLED:
                warnings.warn(outcome.message, NotConvergedWarning, stacklevel=stacklevel + 1)
                break
    finally:
        iterator.close()
        progress.close()
    with small_operations():
        final = loop.finalize(state)
    commit(final)  # also after no step: the starting state (e.g. renewed after a change of K)
    report.kernel_products = counter.products
    report.kernel_columns = counter.columns
    report.kernel_product_seconds = counter.product_seconds
    preconditioning = getattr(loop, "preconditioning", None)  # (the loops over IterGP's dense solves have one)
    if preconditioning is not None:
        report.preconditioner_seconds = preconditioning.seconds
        report.preconditioner_products = preconditioning.products
    report.wall_time = time.perf_counter() - start_time
    stopped_by_limit = report.steps >= max_steps > 0 and not (
        report.converged or report.breakdown or report.stopped_by_callback
    )
    if stopped_by_limit and limit_name is not None:
        step = report.step_name[:-1]
        last = ", ".join(f"{name}={value}" for name, value in report.records[-1].progress().items())
        warnings.warn(
            f"{report.method} stopped at {limit_name}={max_steps} before it converged (last {step}: {last}); the "
            f"posterior is that of the last {step}. Raise {limit_name} (fit({limit_name}=...) or the strategy's "
            "option), or call fit() again to continue from there.",
            ConvergenceWarning,
            stacklevel=stacklevel + 1,
        )
    return report
