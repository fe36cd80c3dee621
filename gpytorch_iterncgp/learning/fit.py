r"""One learning function for every model with an IterNCGP or EP strategy: :func:`fit_mll`, in the spirit of BoTorch's
``fit_gpytorch_mll``.

.. code-block:: python

    mll = gpytorch_iterncgp.LaplaceMarginalLogLikelihood(likelihood, model)   # or EPMarginalLogLikelihood
    report = gpytorch_iterncgp.fit_mll(mll, max_time=60)
    model.eval()                                                          # fitted, ready to predict

The recipe, in three phases (each a progress bar with ``show_progress``):

1. **learning**: type-II maximum likelihood on a random subset of the rows (:func:`~.rows.auto_subset_size`,
   stratified by class; R&W §8.3.3), L-BFGS where the evidence is exact, otherwise Adam with loose warm-started fits
   (:class:`gpytorch_iterncgp.settings.training_fit_steps`). EP's hyperparameters are learnt on Laplace's evidence
   where EP's would be estimated from incomplete solves (its maximiser is biased, ``docs/design_notes.md``);
2. **outputscale** (classifiers learnt on a subset, a ``ScaleKernel`` as ``covar_module``): the outputscale by the
   log-loss of held-out rows (:mod:`.outputscale`): the evidence's maximiser is over-confident at large N (Laplace's
   softmax, and EP learnt on it);
3. **final fit**: the strategy's own ``fit()`` on all the data, at its own options (with its covariance phase).

A model with a :class:`~gpytorch_iterncgp.StochasticEPStrategy` holds no data and has one phase: SVGP's loop on
minibatches of ``data`` (:mod:`.minibatch`).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import gpytorch
import torch
from gpytorch.mlls import MarginalLogLikelihood
from linear_operator.utils.errors import NanError
from torch import Tensor
from tqdm.auto import tqdm

from .. import settings
from ..core.memory import peak_memory_bytes, start_peak_memory
from ..core.validation import check_flag, check_nonnegative
from ..exceptions import ConvergenceWarning
from ..mlls.itergp import BoTorchFitHook, EPMarginalLogLikelihood, LaplaceMarginalLogLikelihood
from ..mlls.stochastic import StochasticEPMarginalLogLikelihood
from ..strategies.base import exact_regime
from ..strategies.itergp import EPStrategy, IterNCGPStrategy
from .learner import LearnerModel, laplace_likelihood
from .minibatch import MinibatchRecipe, fit_minibatches
from .outputscale import choose_outputscale
from .recipe import LearningRecipe, LearningReport
from .rows import auto_subset_size, draw_rows, held_out_rows
from .scale import LogScale

__all__ = ["fit_mll"]

_RECOVERABLE = (FloatingPointError, ValueError, torch.linalg.LinAlgError, NanError)


class _OutOfTime(Exception):
    """Raised inside an evidence evaluation once ``max_time`` has passed (the optimiser cannot be stopped otherwise)."""


def fit_mll(
    mll: MarginalLogLikelihood,
    *,
    max_time: float | None = None,
    recipe: LearningRecipe | MinibatchRecipe | None = None,
    subset: int | str | Tensor | None = "auto",
    validation_rows: Tensor | str | None = "auto",
    seed: int | None = None,
    show_progress: bool | None = None,
    data: tuple[Tensor, Tensor] | None = None,
) -> LearningReport:
    r"""Learn the hyperparameters of ``mll``'s model and fit its posterior on all the data; the model is left fitted
    (call ``model.eval()`` to predict).

    :param mll: a :class:`~gpytorch_iterncgp.LaplaceMarginalLogLikelihood` of a model with an
        :class:`~gpytorch_iterncgp.IterNCGPStrategy`, or an :class:`~gpytorch_iterncgp.EPMarginalLogLikelihood` of one
        with an :class:`~gpytorch_iterncgp.EPStrategy`: any kernel, mean, likelihood and layout the strategy takes.
    :param max_time: seconds for learning and the outputscale choice (``None``: no limit); learning stops after the
        evidence evaluation running then, keeping the best hyperparameters seen, and the final fit follows.
    :param recipe: the optimiser's settings (:class:`~gpytorch_iterncgp.learning.recipe.LearningRecipe`).
    :param subset: the rows the hyperparameters are learnt on: ``"auto"`` (:math:`\lfloor\sqrt{10^7/C}\rfloor` rows,
        stratified by class for classifiers; all of them for smaller data), a number of rows, the row indices
        ``(M,)``, or ``None`` (all).
    :param validation_rows: the held-out rows for the outputscale (classifiers): ``"auto"`` (as many others as the
        subset, stratified), the row indices, or ``None`` (no choice).
    :param seed: seeds the rows drawn (``None``: drawn from torch's global generator).
    :param show_progress: a progress bar per phase (``None``: the strategy's ``show_progress``).
    :param data: ``(train_inputs, train_targets)`` for a :class:`~gpytorch_iterncgp.StochasticEPMarginalLogLikelihood`
        (whose model holds no data): then Adam on SEP's energy over minibatches (:mod:`.minibatch`, ``recipe`` a
        :class:`~.minibatch.MinibatchRecipe`), until its ``max_steps`` or ``max_time``, and no other phase.
    :return: the :class:`~gpytorch_iterncgp.learning.recipe.LearningReport` (its ``fit_report``: the final fit's).
    :raises TypeError: for another objective or strategy. Numerical trouble while learning stops the learning with a
        warning, keeping the best hyperparameters seen; an unconverged final fit raises a
        :class:`~gpytorch_iterncgp.ConvergenceWarning`.
    """
    if max_time is not None:
        check_nonnegative(max_time, "max_time")
    if show_progress is not None:
        check_flag(show_progress, "show_progress")
    deadline = None if max_time is None else time.perf_counter() + float(max_time)
    generator = _RowGenerator(seed)
    some_tensor = next(itertools.chain(mll.model.parameters(), mll.model.buffers()), None)
    device = torch.device("cpu") if some_tensor is None else some_tensor.device
    start_peak_memory(device)
    if isinstance(mll, StochasticEPMarginalLogLikelihood):
        report = _fit_stochastic(mll, data, recipe, deadline, generator(), show_progress)
        report.peak_memory_bytes = peak_memory_bytes(device)
        return report
    strategy = _checked_strategy(mll)
    recipe = LearningRecipe() if recipe is None else recipe
    if not isinstance(recipe, LearningRecipe):
        raise TypeError(
            f"fit_mll: recipe must be a LearningRecipe for {type(mll).__name__}, got {type(recipe).__name__}."
        )
    recipe.validate()
    show = strategy.show_progress if show_progress is None else show_progress
    model, likelihood = mll.model, mll.likelihood
    labels = strategy.train_targets.cpu() if strategy.adapter.classification else None
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    learn = recipe.optimizer_steps > 0 and bool(parameters)
    rows = _learning_rows(strategy, subset, labels, generator) if learn else None
    report = LearningReport(num_data=strategy.num_data, data_points=strategy.num_data if rows is None else len(rows))
    report.learning_rows = None if rows is None else rows.tolist()
    if learn:
        inputs, targets = _rows_of(strategy, rows)
        learner = _learner(model, strategy, inputs, targets, subset_model=rows is not None)
        _learn(learner, recipe, report, deadline, show)
        held_out = _held_out(strategy, rows, validation_rows, labels, recipe, generator)
        kernel = getattr(model, "covar_module", None)
        if labels is not None and isinstance(kernel, gpytorch.kernels.ScaleKernel) and held_out is not None:
            report.validation_rows = held_out.tolist()
            validation_x, validation_y = _rows_of(strategy, held_out)
            name = f"outputscale ({'EP' if isinstance(strategy, EPStrategy) else 'Laplace'})"
            with tqdm(total=len(recipe.outputscale_factors), desc=name, disable=not show) as bar:
                choose_outputscale(
                    kernel,
                    lambda: LearnerModel(model, type(strategy), inputs, targets, likelihood),
                    validation_x,
                    validation_y,
                    recipe,
                    report,
                    deadline,
                    lambda: bar.update(1),
                )
    model.eval()
    with strategy.phase("final fit"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report.fit_report = strategy.fit(show_progress=show)
    for warning in caught:  # at the line that called fit_mll
        warnings.warn(warning.message, warning.category, stacklevel=2)
    report.peak_memory_bytes = peak_memory_bytes(device)
    return report


def _fit_stochastic(
    mll: StochasticEPMarginalLogLikelihood,
    data: Any,
    recipe: Any,
    deadline: float | None,
    generator: torch.Generator,
    show_progress: bool | None,
) -> LearningReport:
    """:func:`fit_mll` for stochastic EP (:func:`.minibatch.fit_minibatches`), its arguments checked."""
    recipe = MinibatchRecipe() if recipe is None else recipe
    if not isinstance(recipe, MinibatchRecipe):
        raise TypeError(f"fit_mll: recipe must be a MinibatchRecipe for stochastic EP, got {type(recipe).__name__}.")
    recipe.validate()
    if not (isinstance(data, tuple) and len(data) == 2 and all(torch.is_tensor(part) for part in data)):
        raise TypeError(
            "fit_mll: a StochasticEPMarginalLogLikelihood's model holds no data; pass data=(train_inputs, train_targets)."
        )
    return fit_minibatches(mll, data[0], data[1], recipe, deadline, generator, show_progress is not False)


def _checked_strategy(mll: Any) -> IterNCGPStrategy | EPStrategy:
    """The model's strategy. :raises TypeError: for an objective other than Laplace's or EP's evidence."""
    if not isinstance(mll, (LaplaceMarginalLogLikelihood, EPMarginalLogLikelihood)):
        raise TypeError(
            "fit_mll takes a LaplaceMarginalLogLikelihood (a model with an IterNCGPStrategy), an "
            "EPMarginalLogLikelihood (a model with an EPStrategy) or a StochasticEPMarginalLogLikelihood (with "
            f"data=...); got {type(mll).__name__}. For another objective "
            "use GPyTorch's training loop (or botorch.fit.fit_gpytorch_mll)."
        )
    return mll.model.variational_strategy


class _RowGenerator:
    """The generator of the rows drawn, made on first use: seeded by ``seed``, or else by a draw from torch's global
    generator (so ``torch.manual_seed`` makes ``fit_mll`` reproducible, and a fit that draws no rows leaves the global
    generator as it was)."""

    def __init__(self, seed: int | None):
        self.seed = seed
        self.generator: torch.Generator | None = None

    def __call__(self) -> torch.Generator:
        if self.generator is None:
            seed = int(torch.randint(2**62, ())) if self.seed is None else self.seed
            self.generator = torch.Generator().manual_seed(seed)
        return self.generator


def _learning_rows(strategy: Any, subset: Any, labels: Tensor | None, generator: _RowGenerator) -> Tensor | None:
    """The rows to learn on (``None``: all), from ``fit_mll``'s ``subset``.

    :raises ValueError: for a subset that is not ``"auto"``, ``None``, a count of at least 2 or row indices.
    """
    num_data = strategy.num_data
    if torch.is_tensor(subset):
        rows = subset.to(device="cpu", dtype=torch.long).reshape(-1)
        if len(rows) < 2 or bool((rows < 0).any() or (rows >= num_data).any()):
            raise ValueError(f"subset rows must be at least 2 indices in [0, {num_data}).")
        return None if len(rows.unique()) == num_data else rows
    if subset is None:
        return None
    if isinstance(subset, str):
        if subset != "auto":
            raise ValueError(f"subset must be 'auto', None, a number of rows or row indices; got {subset!r}.")
        size = auto_subset_size(strategy.num_latents)
    elif isinstance(subset, int) and not isinstance(subset, bool) and subset >= 2:
        size = subset
    else:
        raise ValueError(f"subset must be 'auto', None, a number of rows (at least 2) or row indices; got {subset!r}.")
    if size >= num_data:
        return None
    return draw_rows(torch.arange(num_data), size, labels, generator())


def _held_out(
    strategy: Any,
    rows: Tensor | None,
    validation_rows: Any,
    labels: Tensor | None,
    recipe: LearningRecipe,
    generator: _RowGenerator,
) -> Tensor | None:
    """The held-out rows for the outputscale: ``None`` without a subset (nothing is held out) or where asked."""
    if torch.is_tensor(validation_rows):
        return validation_rows.to(device="cpu", dtype=torch.long).reshape(-1)
    if rows is None or validation_rows is None:
        return None
    if validation_rows != "auto":
        raise ValueError(f"validation_rows must be 'auto', None or row indices; got {validation_rows!r}.")
    return held_out_rows(strategy.num_data, rows, labels, recipe.min_validation_points, generator())


def _rows_of(strategy: Any, rows: Tensor | None) -> tuple[Tensor, Tensor]:
    """The strategy's training inputs and targets at ``rows`` (all: ``None``)."""
    if rows is None:
        return strategy.train_inputs, strategy.train_targets
    index = rows.to(strategy.train_inputs.device)
    return strategy.train_inputs[index], strategy.train_targets[index]


def _learner(model: Any, strategy: Any, inputs: Tensor, targets: Tensor, subset_model: bool) -> Any:
    """The model whose evidence is maximised: ``model`` itself, or a :class:`LearnerModel` on the subset's rows, and,
    for EP whose evidence there would be estimated, under Laplace's approximation."""
    learner = LearnerModel(model, type(strategy), inputs, targets, strategy.likelihood) if subset_model else model
    if isinstance(strategy, EPStrategy) and not exact_regime(learner.variational_strategy):
        learner = LearnerModel(model, IterNCGPStrategy, inputs, targets, laplace_likelihood(strategy.likelihood))
    return learner


def _learn(learner: Any, recipe: LearningRecipe, report: LearningReport, deadline: float | None, show: bool) -> None:
    """Maximise ``learner``'s evidence, keeping the parameters with the best evidence seen; fills ``report``.

    Exact regime (a deterministic value and gradient): L-BFGS with a strong-Wolfe line search and whole fits.
    Otherwise (stochastic log-determinant): Adam, each evaluation on a loose fit from the previous posterior. Either
    works on positive hyperparameters' logarithms (:class:`~.scale.LogScale`).
    """
    strategy = learner.variational_strategy
    exact = exact_regime(strategy)
    evidence = EPMarginalLogLikelihood if isinstance(strategy, EPStrategy) else LaplaceMarginalLogLikelihood
    mll = evidence(strategy.likelihood, learner)
    report.method, report.evidence = ("L-BFGS" if exact else "Adam"), evidence.approximation
    parameters = [parameter for parameter in learner.parameters() if parameter.requires_grad]
    scale = LogScale(learner, parameters)  # positive hyperparameters on the log scale, whatever their constraint
    inputs, targets = strategy.train_inputs, strategy.train_targets
    best: dict[str, Any] = {"loss": math.inf, "state": None}
    start = time.perf_counter()
    description = f"learning: {report.method} on the {report.evidence} evidence of {len(inputs)} points"
    bar = tqdm(total=recipe.optimizer_steps if not exact else None, desc=description, disable=not show)

    def evaluate() -> Tensor:
        if deadline is not None and report.losses and time.perf_counter() >= deadline:
            raise _OutOfTime
        scale.push()
        tic = time.perf_counter()
        output = learner(inputs)  # the strategy's fit, warm-started from the last posterior
        report.fit_seconds += time.perf_counter() - tic
        tic = time.perf_counter()
        loss = -mll(output, targets)
        report.evidence_seconds += time.perf_counter() - tic
        value = float(loss.detach())
        report.losses.append(value)
        bar.update(1)
        bar.set_postfix(loss=f"{value:.4g}")
        if value < best["loss"]:
            best["loss"], best["state"] = value, [parameter.detach().clone() for parameter in parameters]
        return loss

    def backward(loss: Tensor) -> None:
        tic = time.perf_counter()
        loss.backward()
        scale.pull_gradients()
        report.gradient_seconds += time.perf_counter() - tic

    learner.train()
    try:
        # the fits at each evaluation follow the hyperparameters; only the final fit's convergence is reported
        with (
            strategy.overriding(covariance_iterations=0),
            _loose_fits(recipe, exact),
            strategy.without_convergence_warning(),
        ):
            if strategy.state is None:  # the first evaluation's fit starts loose from the prior, as the later ones
                strategy.loose_fit()
            report.stopped = _optimise(scale.variables, evaluate, backward, exact, recipe)
    except _OutOfTime:
        report.stopped = "max_time"
    except _RECOVERABLE as error:
        if best["state"] is None:  # fails at the initial hyperparameters: a real error
            raise
        report.stopped = "error"
        warnings.warn(
            f"fit_mll: learning ({report.method}) stopped after {len(report.losses)} evidence evaluations ({error}); "
            "keeping the hyperparameters with the best evidence seen.",
            ConvergenceWarning,
            stacklevel=3,
        )
    finally:
        bar.close()
    if best["state"] is not None:
        with torch.no_grad():
            for parameter, value in zip(parameters, best["state"], strict=True):
                parameter.copy_(value)
    report.evaluations, report.seconds = len(report.losses), time.perf_counter() - start


@contextlib.contextmanager
def _loose_fits(recipe: LearningRecipe, exact: bool) -> Iterator[None]:
    """Whole fits at every evaluation in the exact regime (L-BFGS's line search compares converged values), loose ones
    (``recipe.fit_steps``, ``recipe.compression_rank``) and a cheaper stochastic log-determinant otherwise."""
    with contextlib.ExitStack() as stack:
        if exact:
            stack.enter_context(settings.training_fit_steps(None))
        else:
            stack.enter_context(settings.training_fit_steps(recipe.fit_steps))
            stack.enter_context(settings.training_compression_rank(recipe.compression_rank))
            stack.enter_context(gpytorch.settings.num_trace_samples(recipe.trace_samples))
            stack.enter_context(gpytorch.settings.max_lanczos_quadrature_iterations(recipe.lanczos_iterations))
        yield


def _optimise(
    parameters: list[Tensor],
    evaluate: Callable[[], Tensor],
    backward: Callable[[Tensor], None],
    exact: bool,
    recipe: LearningRecipe,
) -> str:
    """Run L-BFGS (``exact``) or Adam on ``evaluate()``'s loss; return why it stopped."""
    if not exact:
        adam = torch.optim.Adam(parameters, lr=float(recipe.learning_rate))
        for _ in range(recipe.optimizer_steps):
            adam.zero_grad()
            backward(evaluate())
            adam.step()
        return "optimizer_steps"
    lbfgs = torch.optim.LBFGS(
        parameters,
        lr=1.0,
        max_iter=recipe.optimizer_steps,
        tolerance_grad=1e-6,
        tolerance_change=1e-10,
        line_search_fn="strong_wolfe",
    )

    def closure() -> Tensor:
        lbfgs.zero_grad()
        loss = evaluate()
        backward(loss)
        return loss

    lbfgs.step(closure)
    iterations = lbfgs.state[parameters[0]].get("n_iter", 0)
    return "optimizer_steps" if iterations >= recipe.optimizer_steps else "converged"


BoTorchFitHook.run = fit_mll
BoTorchFitHook.keywords = frozenset(inspect.signature(fit_mll).parameters) - {"mll"}
