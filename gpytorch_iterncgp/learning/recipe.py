r"""What :func:`~gpytorch_iterncgp.fit_mll` does (:class:`LearningRecipe`) and what it did (:class:`LearningReport`)."""

from __future__ import annotations

import contextlib
import enum
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from linear_operator.utils.errors import NanError

from ..core.validation import check_count, check_nonnegative
from .thresholds import KERNEL_CHOICE_COST, LEARNING_SUBSET_COST

__all__ = ["EVIDENCES", "KERNEL_CHOICE_COST", "LEARNING_SUBSET_COST", "LearningRecipe", "LearningReport"]

#: the kernel choice's scores (:attr:`LearningReport.kernel_scores`) and their names in the report's sentence
KERNEL_SCORES = {"held_out": "held-out", "evidence": "evidence", "bic": "BIC"}
#: :attr:`LearningRecipe.evidence`'s values: the evidence an EP model's hyperparameters are learnt on
EVIDENCES = ("laplace", "ep")


@dataclass(frozen=True)
class LearningRecipe:
    r"""How :func:`~gpytorch_iterncgp.fit_mll` learns the hyperparameters (each default measured, ``benchmarks/``).

    :param optimizer_steps: where the evidence is exact (:math:`N C \le` ``settings.exact_evidence_size``), the most
        L-BFGS iterations (strong-Wolfe line search; whole fits at every evaluation); above it, the number of Adam
        steps, each on a loose fit. ``0``: no learning, only the final fit.
    :param loss_tol: where the evidence is exact, L-BFGS stops once an iteration changes the loss (the negative
        evidence per data point, GPyTorch's scale) by at most this, relative to the loss where it exceeds 1 (SciPy's
        L-BFGS-B ``ftol``): the fits' own tolerances make the evidence's last digits noise.
    :param learning_rate: Adam's learning rate.
    :param fit_steps: deprecated (a ``FutureWarning``): with Adam, each evaluation's fit runs the strategy's own
        ``train_fit_steps`` Newton steps (EP sweeps) on from the previous posterior; given, this replaces that option
        while learning, as it did before.
    :param compression_rank: deprecated (a ``FutureWarning``): with Adam, the strategy's own
        ``train_compression_rank`` recycled actions are kept; given, this replaces that option while learning.
    :param trace_samples: stochastic Lanczos quadrature while learning with Adam
        (``gpytorch.settings.num_trace_samples``; GPyTorch's default 10): half the products per evaluation for the
        same learnt hyperparameters (``docs/design_notes.md``).
    :param lanczos_iterations: ``gpytorch.settings.max_lanczos_quadrature_iterations`` while learning with Adam (20).
    :param outputscale_factors: classifiers whose kernel was learnt on a subset: the outputscale is chosen among the
        learnt one times these factors by the log-loss of held-out training rows (``docs/design_notes.md``, "The
        outputscale walks its grid"),
        walking from the first towards the lowest (:func:`~.outputscale.choose_outputscale`).
    :param outputscale_fit_steps: EP sweeps or Newton steps of each candidate's fit on the learning rows.
    :param outputscale_extensions: the most factors tried past the grid's edges, doubling (halving) the largest
        (smallest) while the walk goes on (``0``: the grid alone).
    :param min_validation_points: fewer spare rows than this: no held-out choice.
    :param held_out_fraction: ``learning_subset="auto"`` where the learning subset would hold all the rows: this
        fraction of them (at least ``min_validation_points``) is held out anyway, for the outputscale, the kernel choice and the check
        against a constant predictor (:func:`~.rows.auto_learning_size`); ``0``: none held out there.
    :param kernel_choice_subset: with candidate kernels (``fit_mll(kernels=...)``), the learning rows each candidate is
        learnt and scored on for the choice: ``"auto"`` (:data:`KERNEL_CHOICE_COST`), a number of rows, or ``None``
        (all the learning rows, no second learning). Where fewer, the chosen kernel is learnt again on all the learning
        rows from its initial values, as if it had been given alone (two fidelities, as successive halving: Jamieson &
        Talwalkar 2016).
    :param evidence: the evidence an EP model's hyperparameters are learnt on (:data:`EVIDENCES`; a Laplace model
        learns on its own either way): ``"laplace"``, Laplace's evidence of the same prior under the likelihood
        Laplace takes for EP's (:func:`~.learner.laplace_likelihood`: the softmax for the multinomial probit), after
        which EP fits at the learnt kernel (a classifier's outputscale then chosen on held-out rows where there are
        any): Newton's fits converge in a few steps where EP's sweeps take tens, and on scikit-learn's small sets EP
        predicts about as well at Laplace's kernel as at its own (``docs/design_notes.md``, "Learning EP's kernel"); or
        ``"ep"``, EP's own evidence where it is exact (:math:`N C \le` ``settings.exact_evidence_size``), Laplace's
        above it (EP's estimated evidence is biased there).
    """

    optimizer_steps: int = 25
    loss_tol: float = 1e-7
    learning_rate: float = 0.2
    fit_steps: int | None = None
    compression_rank: int | None = None
    trace_samples: int = 5
    lanczos_iterations: int = 10
    outputscale_factors: tuple[float, ...] = (1.0, 1 / 2, 1 / 4, 1 / 8, 1 / 16, 2.0)
    outputscale_fit_steps: int = 10
    outputscale_extensions: int = 4
    min_validation_points: int = 100
    held_out_fraction: float = 0.2
    kernel_choice_subset: int | str | None = "auto"
    evidence: str = "laplace"

    def __post_init__(self) -> None:
        for name, option, where in (
            ("fit_steps", "train_fit_steps", "the strategy, or the estimators' train_fit_steps="),
            ("compression_rank", "train_compression_rank", "the strategy"),
        ):
            if getattr(self, name) is not None:
                warnings.warn(
                    f"LearningRecipe({name}=) is deprecated and will be removed in a future release: fit_mll's fits "
                    f"while learning follow the strategy's own option {option} (set it on {where}); given, {name} "
                    "still replaces it while learning.",
                    FutureWarning,
                    stacklevel=3,
                )

    def validate(self) -> None:
        """:raises ValueError: naming the field that is out of range."""
        check_count(self.optimizer_steps, "optimizer_steps")
        for name in ("fit_steps", "compression_rank"):
            check_count(getattr(self, name), name, minimum=1, allow_none=True)
        for name in ("trace_samples", "lanczos_iterations", "outputscale_fit_steps"):
            check_count(getattr(self, name), name, minimum=1)
        check_count(self.min_validation_points, "min_validation_points")
        check_count(self.outputscale_extensions, "outputscale_extensions")
        check_nonnegative(self.learning_rate, "learning_rate", positive=True)
        check_nonnegative(self.loss_tol, "loss_tol")
        check_nonnegative(self.held_out_fraction, "held_out_fraction")
        if not self.held_out_fraction < 1:
            raise ValueError(f"held_out_fraction must lie in [0, 1), got {self.held_out_fraction!r}.")
        if not self.outputscale_factors or any(not factor > 0 for factor in self.outputscale_factors):
            raise ValueError(f"outputscale_factors must be positive numbers, got {self.outputscale_factors!r}.")
        subset = self.kernel_choice_subset
        if not (subset is None or subset == "auto" or (isinstance(subset, int) and not isinstance(subset, bool))):
            raise ValueError(f"kernel_choice_subset must be 'auto', None or a number of rows; got {subset!r}.")
        if isinstance(subset, int):
            check_count(subset, "kernel_choice_subset", minimum=2)
        if self.evidence not in EVIDENCES:
            raise ValueError(f"evidence must be one of {EVIDENCES}, got {self.evidence!r}.")


#: the errors an evidence evaluation or a candidate's fit can stop on and learning recover from (keeping the best
#: hyperparameters seen, or skipping the candidate): non-finite values, a failed Cholesky, bad input to a solve
RECOVERABLE_ERRORS = (FloatingPointError, ValueError, torch.linalg.LinAlgError, NanError)


@contextlib.contextmanager
def cg_nans_as_nan_errors() -> Iterator[None]:
    """Re-raise linear_operator's CG stop on a NaN product (``linear_operator.utils.linear_cg``: a plain
    ``RuntimeError``, "NaNs encountered when trying to perform matrix-vector multiplication", e.g. in the backward
    solve of an evidence at extreme hyperparameters) as linear_operator's ``NanError``, one of
    :data:`RECOVERABLE_ERRORS`, so that learning recovers from it as from any other non-finite value."""
    try:
        yield
    except NanError:
        raise
    except RuntimeError as error:
        if str(error).startswith("NaNs encountered"):
            raise NanError(str(error)) from error
        raise


class LearningStop(enum.StrEnum):
    """Why :func:`~gpytorch_iterncgp.fit_mll`'s learning ended (:attr:`LearningReport.stopped`; a ``str``, so it
    compares equal to its value and writes as it in JSON)."""

    NOT_LEARNT = "not learnt"  # no learning: no trainable parameter, or optimizer_steps=0
    OPTIMIZER_STEPS = "optimizer_steps"  # the recipe's optimizer_steps were taken (dense evidence)
    CONVERGED = "converged"  # L-BFGS's own tolerances (the exact regime)
    MAX_STEPS = "max_steps"  # the minibatch recipe's max_steps were taken (stochastic EP)
    MAX_TIME = "max_time"  # fit_mll's max_time passed
    ERROR = "error"  # numerical trouble (a ConvergenceWarning says which); the best hyperparameters seen are kept


@dataclass
class LearningReport:
    """What :func:`~gpytorch_iterncgp.fit_mll` did, phase by phase (also the estimators' ``learning_report_``).

    Learning: ``seconds`` is its wall time; of it, ``fit_seconds`` went to the strategy's fits at each evaluation of
    the evidence (warm-started), ``evidence_seconds`` to the evidence at the fitted posterior and ``gradient_seconds``
    to its gradient. ``stopped`` says why it ended (:class:`LearningStop`). ``evidence`` is the approximation whose evidence was
    maximised (``"Laplace"`` or ``"EP"``), on ``data_points`` of the ``num_data`` training points (``learning_rows``,
    sorted; ``None``: all); ``losses`` is ``-evidence / n`` at every evaluation. ``explicit_gradients`` counts the
    evaluations whose matrix-free Laplace gradient left out the mode's implicit derivative
    (:class:`~gpytorch_iterncgp.ExplicitGradientWarning`; ``fit_mll`` then warns once).

    Outputscale (where rows are held out: classifiers and count models): ``outputscale_factor``, the factor the learnt
    outputscale was multiplied by, chosen by the held-out score (``held_out_metric``: log-loss or mean Poisson
    deviance) of the ``validation_points`` rows ``validation_rows``; ``outputscale_scores``, that score at each factor
    tried (``outputscale_log_loss``: its former name, deprecated); and ``outputscale_seconds``.

    Kernel choice (``fit_mll(kernels=...)``, the estimators' ``kernel="auto"``): ``kernel``, the name of the chosen
    candidate (``None``: no choice, the model's own kernel), and ``kernel_scores``, for every candidate a dict:
    ``held_out``, its log-loss (classifiers) or mean Poisson deviance (counts) on the ``validation_rows`` (``None``
    without them); ``evidence``, its learnt evidence ``-log q(y) / M`` on the ``M`` rows it was learnt on (``rows``:
    the recipe's ``kernel_choice_subset`` of the learning rows); ``bic``, that plus ``k log(M) / (2 M)`` for its
    ``hyperparameters`` ``k`` (both ``None`` where the choice is by the held-out score); ``outputscale_factor``,
    the factor its outputscale phase chose (``None``: no phase), where the chosen candidate's walk on all the learning
    rows starts; ``seconds``, its learning and scoring; ``error``, why it was skipped (``None``: scored)
    (:func:`~gpytorch_iterncgp.learning.kernel_choice.choose_kernel`); ``selected_by``, the score it chose by
    (``"held_out"``, ``"evidence"`` or ``"bic"``: ``select_by="auto"`` resolved). The learning and outputscale fields above are
    then the chosen candidate's (learnt again on all the learning rows where the choice used fewer).

    Check (where rows are held out and the likelihood has a held-out score): ``held_out_score``, the learnt model's
    ``held_out_metric`` (``"log-loss"`` or ``"Poisson deviance"``) on the ``validation_rows``, and ``constant_score``,
    a constant predictor's (the learning rows' class frequencies or mean count); a
    :class:`~gpytorch_iterncgp.WorseThanConstantWarning` where the model's is the higher
    (:func:`~gpytorch_iterncgp.learning.baseline.check_against_constant`; ``None``: not checked).

    Final fit: ``fit_report``, the :class:`~gpytorch_iterncgp.FitReport` of the fit on all the data.

    ``peak_memory_bytes``: at the end, the peak memory (:func:`~gpytorch_iterncgp.core.memory.peak_memory_bytes`: on
    CUDA the peak allocation during ``fit_mll``, on a CPU the process's peak resident memory).
    """

    method: str = ""
    evidence: str = ""
    data_points: int = 0
    num_data: int = 0
    evaluations: int = 0
    seconds: float = 0.0
    fit_seconds: float = 0.0
    evidence_seconds: float = 0.0
    gradient_seconds: float = 0.0
    explicit_gradients: int = 0
    stopped: LearningStop = LearningStop.NOT_LEARNT
    losses: list[float] = field(default_factory=list)
    learning_rows: list[int] | None = None
    outputscale_factor: float = 1.0
    outputscale_scores: dict[float, float] = field(default_factory=dict)
    validation_points: int = 0
    validation_rows: list[int] | None = None
    outputscale_seconds: float = 0.0
    kernel: str | None = None
    kernel_scores: dict[str, dict[str, Any]] = field(default_factory=dict)
    selected_by: str | None = None
    held_out_metric: str = ""
    held_out_score: float | None = None
    constant_score: float | None = None
    fit_report: Any = None
    peak_memory_bytes: int = 0

    def __str__(self) -> str:
        if not self.evaluations:
            return "hyperparameters not learnt"
        subset = "" if self.data_points == self.num_data else f" of {self.data_points} of the {self.num_data} points"
        outputscale = (
            f"; outputscale times {self.outputscale_factor:g} by the {self.held_out_metric} of "
            f"{self.validation_points} held-out points ({len(self.outputscale_scores)} fits in "
            f"{self.outputscale_seconds:.2f}s)"
            if self.outputscale_scores
            else ""
        )
        return (
            f"{self._kernel_choice()}hyperparameters: {self.method} on the {self.evidence} evidence{subset}, "
            f"{self.evaluations} evaluations in {self.seconds:.2f}s (fits "
            f"{self.fit_seconds:.2f}s, evidence {self.evidence_seconds:.2f}s, gradients {self.gradient_seconds:.2f}s), "
            f"stopped by {self.stopped}{outputscale}{self._check()}"
        )

    @property
    def outputscale_log_loss(self) -> dict[float, float]:
        """Deprecated name of :attr:`outputscale_scores` (the score is the log-loss or the Poisson deviance)."""
        warnings.warn(
            "LearningReport.outputscale_log_loss is deprecated and will be removed in a future release: it is "
            "outputscale_scores (the held-out log-loss or Poisson deviance at each factor).",
            FutureWarning,
            stacklevel=2,
        )
        return self.outputscale_scores

    def _check(self) -> str:
        """``"; held-out log-loss ... against a constant predictor's ..."`` (or nothing: not checked)."""
        if self.held_out_score is None or self.constant_score is None:
            return ""
        verdict = "WORSE than" if self.held_out_score > self.constant_score else "against"
        return (
            f"; held-out {self.held_out_metric} {self.held_out_score:.4g} {verdict} a constant predictor's "
            f"{self.constant_score:.4g}"
        )

    def _kernel_choice(self) -> str:
        """``"kernel 'name' of K candidates (name: held-out ..., evidence ...; ...) in ...s; "`` (or nothing: no
        choice)."""
        if self.kernel is None:
            return ""

        def scores(name: str, score: dict[str, Any]) -> str:
            if score["error"] is not None:
                return f"{name}: skipped, {score['error']}"
            parts = [f"{label} {score[key]:.4g}" for key, label in KERNEL_SCORES.items() if score[key] is not None]
            return f"{name}: {', '.join(parts)}"

        listed = "; ".join(scores(name, score) for name, score in self.kernel_scores.items())
        seconds = sum(score["seconds"] for score in self.kernel_scores.values())
        by = f" by {KERNEL_SCORES[self.selected_by]}" if self.selected_by in KERNEL_SCORES else ""
        return (
            f"kernel {self.kernel!r}{by} of {len(self.kernel_scores)} candidates ({listed}) in {seconds:.2f}s; "
            "the chosen one's "
        )
