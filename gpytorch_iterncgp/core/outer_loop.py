r"""The driver of an outer loop: one GP regression per step, observed from outside.

A fit is an iterator over steps (damped Newton here; expectation propagation is another such loop). Each
step solves one GP regression with IterGP and yields an :class:`OuterStep`: its record, the new state, and
whether the loop converged or cannot go on. :func:`run_outer_loop` drains it and is the only place that

* hands each state to ``commit`` (the strategy, the one owner of the committed state),
* counts products with :math:`\mathbf K` per step and in total (from :class:`~gpytorch_iterncgp.core.prior.LatentPrior`'s
  counters, which only ever increase),
* shows progress (tqdm), calls the user's callback, and
* stops a fit at its limits (``max_steps``, ``max_time``: a ``ConvergenceWarning`` naming the limit) and where the
  loop's progress stalls (:data:`STALL_STEPS` steps without progress: a ``NotConvergedWarning``), and
* turns the loop's outcome and the solver's warnings into warnings at the caller's line.

Budgets by convergence: without ``max_steps`` a fit runs until the loop converges, stalls, breaks down or runs past
``max_time``. The stall rule needs no tolerance from the user: a loop says when a step made progress on an earlier
one (:meth:`OuterLoop.made_progress`), and :data:`STALL_STEPS` steps without progress end the fit. Before that,
every :data:`ESCALATION_STEPS` steps without progress the driver asks the loop to spend more computation on its
next steps (``escalate``: EP refreshes its marginals, or gives its solves more iterations), as Newton–Krylov methods
tighten their forcing term where the inexact solves limit progress; a loop that raised its budget gets a fresh
window to progress in (its next step the new reference), up to :data:`MAX_ESCALATIONS` times a fit; one that cannot
has the rest of the :data:`STALL_STEPS`.
It is a rule of one call of the driver, as ``max_steps`` is: a fit resumed after a stall starts again from the loop's
own budget.

The loop itself (probnum's ``solve_iterator`` pattern) knows nothing of these.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
import warnings
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor
from tqdm.auto import tqdm

from ..exceptions import ConvergenceWarning, NotConvergedWarning, NumericalBreakdownWarning
from .sharding import RowBlock
from .threads import small_operations
from .validation import check_count, check_nonnegative

#: steps of an outer loop without progress (:meth:`OuterLoop.made_progress`) after which a fit stops as stalled
#: (EP's largest site change is noisy where the solves are incomplete: on 400 points of 3 classes with 5 CG
#: iterations per sweep, 25 sweeps passed between two new smallest changes on its way to converging)
STALL_STEPS = 20
#: steps without progress after which (and after each further this many) the driver asks the loop to escalate
ESCALATION_STEPS = 5
#: the most escalations of one fit that open a fresh window (each at least doubles a budget: 2^10 times the first)
MAX_ESCALATIONS = 10


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
class FitLimits:
    """The limits of one fit besides convergence (fields of every outer loop's options; its step limit is the
    loop's own option, ``max_newton_steps`` or ``max_sweeps``)."""

    max_time: float | None = None  # seconds per fit, checked after every step (None: no limit)

    def validate(self) -> None:
        """:raises ValueError: for a ``max_time`` that is not a non-negative number."""
        if self.max_time is not None:
            check_nonnegative(self.max_time, "max_time")


@dataclass
class TrainModeFits:
    r"""How a fit that ``model(train_x)`` starts in train mode after a change of the hyperparameters runs (fields of
    the options of the strategies that take such fits, ``IterNCGPStrategy`` and ``EPStrategy``).

    Where the evidence is estimated (:math:`N C >` ``settings.exact_evidence_size``) the fit is a loose one: at most
    ``train_fit_steps`` Newton steps (EP sweeps) on from the committed posterior, at most ``train_compression_rank``
    recycled actions, no covariance phase, and no ``ConvergenceWarning`` at these limits, so that each step of the
    usual GPyTorch loop (``loss = -mll(model(train_x), train_y)``, an optimiser step) costs a few products with
    :math:`\mathbf K` while the posterior follows the hyperparameters loosely; a prediction in eval mode,
    ``strategy.fit()`` and :func:`~gpytorch_iterncgp.fit_mll`'s final fit converge it. Each change of the kernel
    multiplies every recycled action by the new :math:`\mathbf K` once, hence the short buffer. ``train_fit_steps=None``
    fits whole at every call, as in the exact regime always (L-BFGS's line search compares converged values).
    """

    train_fit_steps: int | None = 2
    train_compression_rank: int | None = 20  # None: keep the fit's own compression_rank

    def validate(self) -> None:
        """:raises ValueError: naming the option that is not a positive count (or ``None``)."""
        check_count(self.train_fit_steps, "train_fit_steps", minimum=1, allow_none=True)
        check_count(self.train_compression_rank, "train_compression_rank", minimum=1, allow_none=True)


def sites_progressed(reference: EPSweep, record: EPSweep, site_tol: float) -> bool:
    r"""Whether an EP sweep made progress on an earlier one (:meth:`OuterLoop.made_progress` of the EP loops): its
    site change is above ``site_tol`` and below the earlier one's (the driver's reference is the last sweep with
    progress, so: a new smallest change). The largest relative change of the sites is noisy where EP converges: exact
    EP on 100 points (logit, complete solves) fell to 3e-3 in 11 sweeps, wandered between 1.4e-3 and 1e-2 for 20
    more, then fell to its tolerance in 6; a new smallest change came at least every 8 sweeps throughout. A change at
    ``site_tol`` or below is no progress: such a sweep has not converged for another reason (skipped or bounded
    cavities, an incomplete solve), and sweeps that stay there have reached what these marginals allow."""
    return site_tol < record.site_change < reference.site_change


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
    marginal_blocks: int = 0  # covariance-phase blocks refreshing the marginals after the solve (a product each)
    # how far the sweep moved the posterior marginals at the training points: the mean KL divergence per latent value
    # of the new ones from those it updated from (nats; nan where the loop does not measure it: no marginal_tol)
    marginal_change: float = math.nan
    kernel_products: int = 0  # filled in by the driver
    kernel_product_seconds: float = 0.0  # filled in by the driver

    def progress(self) -> dict[str, str]:
        """What the progress bar shows after this sweep."""
        return {
            "site_change": f"{self.site_change:.2g}",
            "bounded": str(self.bounded_cavities),
            "residual": f"{self.residual_norm:.2g}",
            **({} if math.isnan(self.marginal_change) else {"marginal_change": f"{self.marginal_change:.2g}"}),
        }

    def details(self, report: FitReport) -> str:
        """What ``str(report)`` says of a fit that ended with this sweep."""
        return (
            f"bounded cavities={report.bounded_cavities}, skipped site updates={report.skipped_sites}, "
            f"site change={self.site_change:.3g}"
            + ("" if math.isnan(self.marginal_change) else f", marginal change={self.marginal_change:.3g} nats")
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

    # Optional, for the driver's stall rule (a loop without them never stalls by it):
    #   made_progress(reference, record) -> bool: whether the step of ``record`` progressed on the earlier ``reference``
    #   stall_advice: str, what to change where the loop stalls
    #   escalate(record) -> bool: spend more computation on the next steps (called by the stall rule, after the step
    #       of ``record``, every ESCALATION_STEPS steps without progress); whether the budget was raised


class ProductCounter(Protocol):
    """Every product with K (calls, columns, seconds), and of those the ones set aside (a preconditioner's, which the
    report counts apart: :meth:`~gpytorch_iterncgp.core.prior.LatentPrior.set_aside`)."""

    products: int
    columns: int
    product_seconds: float
    products_aside: int
    columns_aside: int
    product_seconds_aside: float


def _solver_counts(counter: ProductCounter) -> tuple[int, int, float]:
    """The counter's products, columns and seconds less those it set aside."""
    return (
        counter.products - counter.products_aside,
        counter.columns - counter.columns_aside,
        counter.product_seconds - counter.product_seconds_aside,
    )


@dataclass
class FitReport:
    """What a call of :meth:`~gpytorch_iterncgp.IterNCGPStrategy.fit` or :meth:`~gpytorch_iterncgp.EPStrategy.fit` did.

    :attr:`steps` counts the outer loop's steps, which the loop calls :attr:`step_name` (Newton steps, or EP
    sweeps); :attr:`records` holds one record per step. :attr:`budget` is the solver budget where a caller chose it
    (the estimators: their ``solver_budget_``), whose ``"rule"`` the text ends with.
    """

    steps: int = 0
    solver_iterations: int = 0
    kernel_products: int = 0  # calls of the kernel matmul (including the renewal of stale products)
    kernel_columns: int = 0  # vectors multiplied by K in those calls
    kernel_product_seconds: float = 0.0  # wall time spent in those calls (the rest of wall_time is everything else)
    preconditioner_seconds: float = 0.0  # wall time building the preconditioner (core.preconditioner), not in products
    preconditioner_products: int = 0  # its calls of the kernel's columns or products (not in kernel_products)
    covariance_products: int = 0  # of kernel_products, the covariance phase's after the loop (covariance_iterations)
    covariance_seconds: float = 0.0  # wall time of the loop's finalize (its covariance phase too), in wall_time
    converged: bool = False
    breakdown: bool = False
    stopped_by_callback: bool = False
    limit: str = ""  # the limit that stopped the fit before it converged ("max_newton_steps", "max_time", ...), or ""
    stalled: bool = False  # stopped without converging: no step could progress (a NotConvergedWarning says why)
    wall_time: float = 0.0
    records: list[Any] = field(default_factory=list)  # NewtonStep or EPSweep records, one per step
    budget: dict[str, Any] | None = None  # the solver budget a caller chose, with its "rule" (e.g. the estimators)
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
            f"{self.kernel_products} products with K of {self.kernel_columns} vectors "
            f"({self.kernel_product_seconds:.2f}s"
            + (f"; {self.covariance_products} in the covariance phase" if self.covariance_products else "")
            + "), "
            f"converged={self.converged}, breakdown={self.breakdown}, {details}, "
            f"residual={last.residual_norm if last else float('nan'):.3g}, {self.wall_time:.2f}s"
            + (f"; {self.budget['rule']}" if self.budget else "")
        )


def _reemit(caught: list[warnings.WarningMessage], stacklevel: int) -> None:
    for warning in caught:
        warnings.warn(warning.message, warning.category, stacklevel=stacklevel + 1)


def run_outer_loop(
    loop: OuterLoop,
    state: Any,
    commit: Callable[[Any], None],
    counter: ProductCounter,
    max_steps: int | None = None,
    callback: Callable[[Any, Any], bool | None] | None = None,
    show_progress: bool = True,
    stacklevel: int = 2,
    description: str | None = None,
    limit_name: str | None = None,
    max_time: float | None = None,
) -> FitReport:
    """Run ``loop`` from ``state`` until it converges, stalls or breaks down, or a limit stops it; commit every
    completed step and the final state.

    :param counter: the prior whose products with K are counted (totals since it was built).
    :param max_steps: the most steps (``None``: no limit).
    :param callback: called after every step with its record and the state; returning ``True`` stops.
    :param stacklevel: of the warnings, counted from the caller of this function.
    :param description: the progress bar's name (``None``: the loop's).
    :param limit_name: the option that set ``max_steps`` (e.g. ``"max_sweeps"``): a fit it or ``max_time`` stops
        before convergence raises a :class:`~gpytorch_iterncgp.ConvergenceWarning` naming the limit; ``None``: no
        such warning (fits stopped early by design).
    :param max_time: seconds, checked after every step (``None``: no limit).
    """
    check_count(max_steps, "max_steps", allow_none=True)
    FitLimits(max_time).validate()
    start_time = time.perf_counter()
    report = FitReport(method=loop.name, step_name=loop.step_name)
    progress = tqdm(total=max_steps, desc=description or loop.name, disable=not show_progress, leave=False)
    iterator = loop.steps(state)
    stall_rule = _StallRule(loop)
    try:
        while max_steps is None or report.steps < max_steps:
            products, _, seconds = _solver_counts(counter)
            outcome = _next_step(iterator, stacklevel + 1)
            if outcome is None:
                break
            report.breakdown |= outcome.breakdown or outcome.status is LoopStatus.BREAKDOWN
            if outcome.record is None:  # the step could not be taken: nothing new to commit
                warnings.warn(outcome.message, NumericalBreakdownWarning, stacklevel=stacklevel + 1)
                break
            after, _, after_seconds = _solver_counts(counter)
            record = dataclasses.replace(
                outcome.record, kernel_products=after - products, kernel_product_seconds=after_seconds - seconds
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
            stall = outcome.message if outcome.status is LoopStatus.STALLED else stall_rule(record)
            if stall is not None:
                report.stalled = True
                warnings.warn(stall, NotConvergedWarning, stacklevel=stacklevel + 1)
                break
            if max_time is not None and time.perf_counter() - start_time >= max_time:
                report.limit = "max_time"
                break
    finally:
        iterator.close()
        progress.close()
    _finalize(loop, state, commit, counter, report)
    report.wall_time = time.perf_counter() - start_time
    stopped = not (report.converged or report.breakdown or report.stopped_by_callback or report.stalled)
    if stopped and max_steps is not None and report.steps >= max_steps > 0:
        report.limit = limit_name or "max_steps"
    if report.limit and limit_name is not None:
        value = f"{max_time:g} s" if report.limit == "max_time" else str(max_steps)
        warnings.warn(_limit_message(report, value), ConvergenceWarning, stacklevel=stacklevel + 1)
    return report


def _next_step(iterator: Iterator[OuterStep], stacklevel: int) -> OuterStep | None:
    """The loop's next step (``None``: the loop ended), its numerical warnings shown at every step (re-emitted with
    ``stacklevel`` counted from this function's caller, as :func:`warnings.warn` counts it)."""
    with warnings.catch_warnings(record=True) as caught, small_operations():
        warnings.simplefilter("always", NumericalBreakdownWarning)
        outcome = next(iterator, None)
    _reemit(caught, stacklevel + 1)
    return outcome


def _finalize(
    loop: OuterLoop, state: Any, commit: Callable[[Any], None], counter: ProductCounter, report: FitReport
) -> None:
    """Commit ``loop``'s final state from ``state`` (also after no step: the starting state, e.g. renewed after a
    change of K), and fill ``report``'s totals: the products with K and their seconds, those of the finalize (its
    covariance phase), and the preconditioner's where the loop has one."""
    loop_products, finalize_start = _solver_counts(counter)[0], time.perf_counter()
    with small_operations():
        final = loop.finalize(state)
    report.covariance_products = _solver_counts(counter)[0] - loop_products
    report.covariance_seconds = time.perf_counter() - finalize_start
    commit(final)
    report.kernel_products, report.kernel_columns, report.kernel_product_seconds = _solver_counts(counter)
    preconditioning = getattr(loop, "preconditioning", None)  # (the loops over IterGP's dense solves have one)
    if preconditioning is not None:
        report.preconditioner_seconds = preconditioning.seconds
        report.preconditioner_products = preconditioning.products


def _limit_message(report: FitReport, value: str) -> str:
    """The warning of a fit stopped by its limit ``report.limit`` at ``value``."""
    step = report.step_name[:-1]
    last = ", ".join(f"{name}={shown}" for name, shown in report.records[-1].progress().items())
    return (
        f"{report.method} stopped at {report.limit}={value} before it converged (last {step}: {last}); the "
        f"posterior is that of the last {step}. Raise {report.limit} (fit({report.limit}=...) or the strategy's "
        "option; None: no limit), or call fit() again to continue from there."
    )


class _StallRule:
    """The driver's stall rule for one fit: :data:`STALL_STEPS` steps after the last one with progress on its
    predecessor with progress (:meth:`OuterLoop.made_progress`; a loop without it never stalls by this rule), the
    loop's ``escalate`` called every :data:`ESCALATION_STEPS` of them."""

    def __init__(self, loop: OuterLoop):
        self.loop, self.made_progress = loop, getattr(loop, "made_progress", None)
        self.escalate = getattr(loop, "escalate", None)
        self.escalations = 0  # escalations that raised the loop's budget
        self.reference: StepRecord | None = None  # the last step with progress
        self.steps_without_progress = 0

    def __call__(self, record: StepRecord) -> str | None:
        """After a completed step that did not converge: the warning if the fit stalls with it, else ``None``."""
        if self.made_progress is None:
            return None
        if self.reference is None or self.made_progress(self.reference, record):
            self.reference, self.steps_without_progress = record, 0
            return None
        self.steps_without_progress += 1
        if self.steps_without_progress < STALL_STEPS:
            escalate, due = self.escalate, self.steps_without_progress % ESCALATION_STEPS == 0
            if escalate is not None and due and self.escalations < MAX_ESCALATIONS and escalate(record):
                # more computation from the next step: a fresh window to progress in
                self.reference, self.steps_without_progress = None, 0
                self.escalations += 1
            return None
        last = ", ".join(f"{name}={value}" for name, value in record.progress().items())
        advice = getattr(self.loop, "stall_advice", "")
        return (
            f"{self.loop.name} made no progress in {STALL_STEPS} {self.loop.step_name} (last: {last}) and stopped "
            f"before it converged; the posterior is that of the last one." + (f" {advice}" if advice else "")
        )
