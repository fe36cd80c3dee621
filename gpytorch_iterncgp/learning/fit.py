r"""One learning function for every model with an IterNCGP or EP strategy: :func:`fit_mll`, in the spirit of BoTorch's
``fit_gpytorch_mll``.

.. code-block:: python

    mll = gpytorch_iterncgp.LaplaceMarginalLogLikelihood(likelihood, model)   # or EPMarginalLogLikelihood
    report = gpytorch_iterncgp.fit_mll(mll, max_time=60)
    model.eval()                                                          # fitted, ready to predict

The recipe, in three phases (each a progress bar with ``show_progress``):

1. **learning**: type-II maximum likelihood on a random subset of the rows (:func:`~.rows.auto_learning_size`,
   stratified by class; R&W §8.3.3), L-BFGS where the evidence is exact, otherwise Adam with loose warm-started fits
   (the strategy's ``train_fit_steps``): exact as the objective's ``exact=`` says, where given, otherwise where the
   learning rows' :math:`N C` is at most ``settings.exact_evidence_size``. EP's hyperparameters are learnt on Laplace's evidence
   (:attr:`~.recipe.LearningRecipe.evidence`: Newton's fits converge in a few steps where EP's sweeps take tens;
   EP's evidence where it is exact on request, never where it would be estimated from incomplete solves: that
   estimate's maximiser is biased, ``docs/design_notes.md``);
2. **outputscale** (classifiers and count models learnt on a subset, a ``ScaleKernel`` as ``covar_module``): the
   outputscale by the held-out score (log-loss, Poisson deviance) of held-out rows (:mod:`.outputscale`): the
   evidence's maximiser is over-confident at large N (Laplace's softmax, and EP learnt on it; the Poisson evidence on
   overdispersed counts); then, wherever rows are held out, the learnt model against a constant predictor on
   them (:mod:`.baseline`: a ``WorseThanConstantWarning`` where it predicts them worse);
3. **final fit**: the strategy's own ``fit()`` on all the data, at its own options (with its covariance phase).

A model with a :class:`~gpytorch_iterncgp.StochasticEPStrategy` holds no data and has one phase: SVGP's loop on
minibatches of ``data`` (:mod:`.minibatch`), after the kernel choice on a dense EP view of rows of ``data`` where
candidate kernels are given.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NoReturn, TypeVar, cast

import gpytorch
import torch
from gpytorch.means import ConstantMean
from gpytorch.mlls import MarginalLogLikelihood
from torch import Tensor
from tqdm.auto import tqdm

from ..core.memory import peak_memory_bytes, retained_allocations, start_peak_memory
from ..core.threads import small_operations
from ..core.validation import DEPRECATED, check_flag, check_nonnegative, is_string, renamed
from ..exceptions import ConvergenceWarning, ExplicitGradientWarning, WorseThanConstantWarning
from ..mlls.itergp import EPMarginalLogLikelihood, LaplaceMarginalLogLikelihood
from ..mlls.stochastic import StochasticEPMarginalLogLikelihood
from ..strategies.base import exact_regime
from ..strategies.itergp import EPStrategy, IterNCGPStrategy
from .baseline import check_against_constant
from .kernel_choice import candidate_kernels, check_select_by, choose_kernel, resolved_select_by, time_share
from .learner import LearnerModel, laplace_likelihood
from .minibatch import MinibatchRecipe, fit_minibatches
from .optimisers import optimise
from .outputscale import choose_outputscale
from .recipe import RECOVERABLE_ERRORS, LearningRecipe, LearningReport, LearningStop, cg_nans_as_nan_errors
from .rows import auto_choice_size, auto_learning_size, draw_rows, held_out_rows
from .scale import LogScale, trainable_parameters
from .scores import has_held_out_score, held_out_metric, held_out_unavailable, log_rate
from .thresholds import ONE_THREAD_LEARNING_SIZE

__all__ = ["fit_dense_mll", "fit_minibatch_mll", "fit_mll"]


class _OutOfTime(Exception):
    """Raised inside an evidence evaluation once ``max_time`` has passed (the optimiser cannot be stopped otherwise)."""


def fit_mll(
    mll: MarginalLogLikelihood,
    data: tuple[Tensor, Tensor] | None = None,
    *,
    max_time: float | None = None,
    recipe: LearningRecipe | MinibatchRecipe | None = None,
    learning_subset: int | str | Tensor | None = "auto",
    validation_rows: Tensor | str | None = "auto",
    kernels: Mapping[str, gpytorch.kernels.Kernel] | Sequence[gpytorch.kernels.Kernel] | None = None,
    select_by: str = "auto",
    seed: int | None = None,
    show_progress: bool | None = None,
    subset: Any = DEPRECATED,
) -> LearningReport:
    r"""Learn the hyperparameters of ``mll``'s model and fit its posterior; the model is left fitted (call
    ``model.eval()`` to predict). One door for every evidence of the package, by its type:

    * a :class:`~gpytorch_iterncgp.LaplaceMarginalLogLikelihood` (a model with an
      :class:`~gpytorch_iterncgp.IterNCGPStrategy`) or an :class:`~gpytorch_iterncgp.EPMarginalLogLikelihood` (with an
      :class:`~gpytorch_iterncgp.EPStrategy`), whose model holds its data: :func:`fit_dense_mll`, every option but
      ``data``;
    * a :class:`~gpytorch_iterncgp.StochasticEPMarginalLogLikelihood`, whose model holds no data:
      :func:`fit_minibatch_mll`, every option but ``learning_subset`` and ``validation_rows``.

    An option the evidence's learner does not take, given, is refused (naming what to use instead). Each option is
    described in full by the learner that takes it.

    :param data: the training data ``(inputs (N, D), targets)``, drawn from in minibatches (stochastic EP only).
    :param max_time: seconds for learning (and the outputscale choice); ``None``: no limit.
    :param recipe: the learning's settings: a :class:`~gpytorch_iterncgp.LearningRecipe` (dense evidences) or a
        :class:`~gpytorch_iterncgp.MinibatchRecipe` (stochastic EP); ``None``: the defaults.
    :param learning_subset: the rows the hyperparameters are learnt on (dense evidences): ``"auto"``, a number of
        rows, row indices, a boolean mask, or ``None`` (all).
    :param validation_rows: the held-out rows (dense evidences): ``"auto"``, row indices, a mask, or ``None``.
    :param kernels: candidate kernels to choose among (``None``: the model's own).
    :param select_by: the kernel choice's score: ``"auto"`` (``"held_out"`` where rows are held out, else ``"bic"``),
        ``"held_out"``, ``"bic"`` or ``"evidence"``.
    :param seed: seeds the rows and minibatches drawn.
    :param show_progress: a progress bar per phase (``None``: the strategy's ``show_progress``).
    :param subset: the deprecated name of ``learning_subset`` (a ``FutureWarning``).
    :return: the :class:`~gpytorch_iterncgp.learning.recipe.LearningReport`.
    :raises TypeError: for another objective, or an option given that the evidence's learner does not take (naming
        it and what to use instead).
    """
    common: dict[str, Any] = dict(
        max_time=max_time, kernels=kernels, select_by=select_by, seed=seed, show_progress=show_progress
    )
    if isinstance(mll, StochasticEPMarginalLogLikelihood):
        dense_only = (
            ("learning_subset", learning_subset, "auto"),
            ("validation_rows", validation_rows, "auto"),
            ("subset", subset, DEPRECATED),
        )
        for name, value, default in dense_only:
            if not is_string(value, default):
                _refuse(mll, name, _NOT_FOR_MINIBATCHES[name])
        with retained_allocations():
            return fit_minibatch_mll(mll, data, recipe=cast(MinibatchRecipe | None, recipe), **common)
    _checked_strategy(mll)
    if data is not None:
        _refuse(mll, "data", _NOT_FOR_DENSE)
    with retained_allocations():
        return fit_dense_mll(
            mll,
            recipe=cast(LearningRecipe | None, recipe),
            learning_subset=learning_subset,
            validation_rows=validation_rows,
            subset=subset,
            **common,
        )


def _refuse(mll: MarginalLogLikelihood, name: str, reason: str) -> NoReturn:
    """:raises TypeError: ``fit_mll``'s option ``name`` does not apply to ``mll``, for ``reason``."""
    raise TypeError(f"fit_mll: {name}= does not apply to a {type(mll).__name__}: {reason}.")


#: why an option of the other mode does not apply, and what to use instead
_NOT_FOR_DENSE = (
    "its model holds its training data (the strategy's train_inputs, train_targets); leave data= out, and choose the "
    "rows to learn on with learning_subset="
)
_ROWS_FOR_MINIBATCHES = (
    "stochastic EP learns on all of data= in minibatches; set their size with recipe=MinibatchRecipe(batch_size=...)"
)
_NOT_FOR_MINIBATCHES = {
    "learning_subset": _ROWS_FOR_MINIBATCHES,
    "subset": _ROWS_FOR_MINIBATCHES,  # learning_subset's deprecated name
    "validation_rows": "stochastic EP has no outputscale phase (its objective is SEP's energy on all the data), and "
    "its kernel choice (kernels=) draws its own held-out rows from data=",
}


RecipeType = TypeVar("RecipeType", LearningRecipe, MinibatchRecipe)


def _checked_recipe(recipe: Any, recipe_type: type[RecipeType], objective: str) -> RecipeType:
    """``recipe`` (``None``: ``recipe_type``'s defaults), validated.

    :raises TypeError: for a recipe of another type than ``recipe_type``, the one of ``objective``.
    """
    recipe = recipe_type() if recipe is None else recipe
    if not isinstance(recipe, recipe_type):
        raise TypeError(
            f"fit_mll: recipe must be a {recipe_type.__name__} for {objective}, got {type(recipe).__name__}."
        )
    recipe.validate()
    return recipe


def fit_dense_mll(
    mll: LaplaceMarginalLogLikelihood | EPMarginalLogLikelihood,
    *,
    max_time: float | None = None,
    recipe: LearningRecipe | None = None,
    learning_subset: int | str | Tensor | None = "auto",
    validation_rows: Tensor | str | None = "auto",
    kernels: Mapping[str, gpytorch.kernels.Kernel] | Sequence[gpytorch.kernels.Kernel] | None = None,
    select_by: str = "auto",
    seed: int | None = None,
    show_progress: bool | None = None,
    subset: Any = DEPRECATED,
) -> LearningReport:
    r""":func:`fit_mll` for a model that holds its data (Laplace's or EP's evidence), in three phases (module docstring):
    learning on a subset, the outputscale on held-out rows, the final fit on all the data; with ``kernels``, the first
    two for each candidate kernel, then the final fit with the best (:func:`~.kernel_choice.choose_kernel`).

    :param mll: a :class:`~gpytorch_iterncgp.LaplaceMarginalLogLikelihood` of a model with an
        :class:`~gpytorch_iterncgp.IterNCGPStrategy`, or an :class:`~gpytorch_iterncgp.EPMarginalLogLikelihood` of one
        with an :class:`~gpytorch_iterncgp.EPStrategy`: any kernel, mean, likelihood and layout the strategy takes.
    :param max_time: seconds for learning and the outputscale choice (``None``: no limit); learning stops after the
        evidence evaluation running then, keeping the best hyperparameters seen, and the final fit follows. With
        ``kernels``, each candidate gets an equal share of the time left when it starts.
    :param recipe: the optimiser's settings (:class:`~gpytorch_iterncgp.learning.recipe.LearningRecipe`).
    :param learning_subset: the rows the hyperparameters are learnt on: ``"auto"`` (:math:`\lfloor\sqrt{10^7/C}\rfloor` rows,
        stratified by class for classifiers; for smaller data all but the recipe's ``held_out_fraction`` of them,
        which are held out, or all of them where that fraction is fewer than ``min_validation_points`` rows:
        :func:`~.rows.auto_learning_size`), a number of rows, the row indices ``(M,)``, a boolean mask ``(N,)``, or
        ``None`` (all).
    :param validation_rows: the held-out rows for the outputscale (classifiers) and the kernel choice: ``"auto"`` (as
        many others as the subset, stratified), the row indices or a boolean mask (outside the subset), or ``None``
        (no choice). Only where the learning holds rows out (a subset smaller than the data).
    :param kernels: candidate kernels, ``{name: kernel}`` or a list (named by position and structure): each is put in
        the model as its ``covar_module``, learnt as above (type-II maximum likelihood on the learning rows, from the
        mean's and likelihood's values on entry), and scored by its evidence on the learning rows, alone and
        penalised for its hyperparameters (BIC), and by its held-out log-loss (classifiers) or Poisson deviance (counts)
        where rows are held out (all recorded, ``report.kernel_scores``); the model keeps the best (``report.kernel``),
        whose final fit follows (:func:`~.kernel_choice.choose_kernel`). Each candidate is learnt in place; those that
        fail numerically are skipped. The choice learns and scores the candidates on the recipe's
        ``kernel_choice_subset`` of the learning rows (:math:`\lfloor\sqrt{10^6/C}\rfloor` by default), then learns
        the chosen one again on all of them (``docs/design_notes.md``, "The kernel choice learns the candidates on
        a subset"; ``kernel_choice_subset=None``: every candidate on all the learning rows,
        ``len(kernels)`` times). ``None`` (default): the model's own kernel.
    :param select_by: with ``kernels``, the score to choose by: ``"auto"`` (default: ``"held_out"`` where the learning
        holds rows out and the likelihood has a held-out score, else ``"bic"``; the estimators' rule, which chose the
        better kernels on the tabular panel, ``docs/design_notes.md``), ``"held_out"`` (the log-loss or Poisson
        deviance of the held-out rows; needs a subset smaller than the data), ``"bic"`` (the evidence per learning
        row penalised by :math:`k \log M / (2M)` for :math:`k` hyperparameters, Duvenaud et al. 2013) or
        ``"evidence"`` (alone, R&W sec. 5.4: of nested kernels it keeps the larger). The report's ``selected_by``
        says which.
    :param seed: seeds the rows drawn (``None``: drawn from torch's global generator).
    :param show_progress: a progress bar per phase (``None``: the strategy's ``show_progress``).
    :param subset: the deprecated name of ``learning_subset`` (a ``FutureWarning``).
    :return: the :class:`~gpytorch_iterncgp.learning.recipe.LearningReport` (its ``fit_report``: the final fit's).
    :raises TypeError: for another objective or strategy, a recipe that is not a ``LearningRecipe``, or ``kernels``
        that are not kernels or for a model without ``covar_module``.
    :raises ValueError: for rows out of range, a mask of another length, validation rows where nothing is held
        out, an unknown ``select_by`` (or one without ``kernels``), or ``kernels`` with nothing to learn
        (``optimizer_steps=0``) or, choosing by ``"held_out"``, nothing held out or a likelihood without a held-out
        score. Numerical trouble while learning stops the learning with a warning, keeping
        the best hyperparameters seen; a final fit that stops before it converges warns
        (:class:`~gpytorch_iterncgp.NotConvergedWarning`, or :class:`~gpytorch_iterncgp.ConvergenceWarning` at a
        limit of the strategy's).
    """
    learning_subset = renamed("fit_mll", "subset", "learning_subset", subset, learning_subset, "auto", stacklevel=4)
    strategy = _checked_strategy(mll)
    recipe = _checked_recipe(recipe, LearningRecipe, type(mll).__name__)
    candidates = _candidates(mll, kernels, select_by, recipe)
    deadline, show = _deadline(max_time), _show(show_progress, strategy.show_progress)
    device = _device(mll)
    start_peak_memory(device)
    report = _learn_dense(mll, deadline, recipe, learning_subset, validation_rows, candidates, select_by, seed, show)
    mll.model.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report.fit_report = strategy.fit(show_progress=show, description="final fit")
    for warning in caught:  # at the line that called fit_mll
        warnings.warn(warning.message, warning.category, stacklevel=3)
    report.peak_memory_bytes = peak_memory_bytes(device)
    return report


def _learn_dense(
    mll: LaplaceMarginalLogLikelihood | EPMarginalLogLikelihood,
    deadline: float | None,
    recipe: LearningRecipe,
    subset: int | str | Tensor | None,
    validation_rows: Tensor | str | None,
    candidates: dict[str, gpytorch.kernels.Kernel] | None,
    select_by: str,
    seed: int | None,
    show: bool,
) -> LearningReport:
    """Phases 1 and 2 of :func:`fit_dense_mll` (with ``candidates``: for each, and the choice among them), its
    options checked; the model is left with the learnt hyperparameters, not fitted."""
    strategy = mll.model.variational_strategy
    generator = _RowGenerator(seed)
    model = mll.model
    labels = strategy.train_targets.cpu() if strategy.adapter.classification else None
    parameters = trainable_parameters([model, mll.likelihood])
    learn = recipe.optimizer_steps > 0 and (bool(parameters) or candidates is not None)
    rows = _learning_rows(strategy, subset, labels, generator, recipe) if learn else None
    report = LearningReport(num_data=strategy.num_data, data_points=strategy.num_data if rows is None else len(rows))
    report.learning_rows = None if rows is None else rows.tolist()
    if learn:
        held_out = _held_out(strategy, rows, validation_rows, labels, recipe, generator)  # (checked before learning)
        phase = _LearningPhase(mll, rows, held_out, recipe, show)
        if candidates is None:
            phase.learn(report, deadline)
            phase.choose_outputscale(report, deadline)
        else:
            select = resolved_select_by(select_by, held_out is not None, mll.likelihood)
            if select == "held_out" and held_out is None:
                raise ValueError(_nothing_held_out(strategy, rows, validation_rows, recipe))
            choice = _choice_phase(mll, rows, held_out, labels, recipe, generator, show)
            choose_kernel(model, mll.likelihood, candidates, phase, select, report, deadline, choice)
        if phase.validation is not None and has_held_out_score(mll.likelihood):
            assert held_out is not None
            report.validation_rows, report.validation_points = held_out.tolist(), len(held_out)
            check_against_constant(
                report,
                phase.final_model,
                phase.targets,
                phase.validation,
                recipe.outputscale_fit_steps,
                mll.likelihood,
            )
    return report


def _candidates(
    mll: Any, kernels: Any, select_by: Any, recipe: LearningRecipe
) -> dict[str, gpytorch.kernels.Kernel] | None:
    """``kernels`` checked (:func:`~.kernel_choice.candidate_kernels`), ``None`` without.

    :raises ValueError: for a ``select_by`` other than the default without ``kernels``, ``kernels`` with
        ``optimizer_steps=0``, or choosing by ``"held_out"`` for a likelihood without a held-out score.
    """
    if kernels is None:
        check_select_by(select_by)
        if select_by != "auto":
            raise ValueError(
                f"fit_mll: select_by={select_by!r} chooses among candidate kernels; pass them as kernels=, or leave "
                "select_by out."
            )
        return None
    candidates = candidate_kernels(kernels, mll.model, select_by)
    if recipe.optimizer_steps == 0:
        raise ValueError(
            "fit_mll: kernels= chooses among kernels learnt by type-II maximum likelihood, but the recipe's "
            "optimizer_steps=0 learns nothing: give optimizer_steps > 0, or put one kernel in the model and leave "
            "kernels= out."
        )
    if select_by == "held_out" and not has_held_out_score(mll.likelihood):
        raise ValueError(held_out_unavailable(mll.likelihood))
    return candidates


def _nothing_held_out(strategy: Any, rows: Tensor | None, validation_rows: Any, recipe: LearningRecipe) -> str:
    """Why ``kernels=`` with ``select_by="held_out"`` has no rows to score on, and what to do."""
    if rows is None:
        why = f"the hyperparameters are learnt on all {strategy.num_data} rows"
    elif validation_rows is None:
        why = "validation_rows=None"
    else:
        why = f"fewer than recipe.min_validation_points={recipe.min_validation_points} rows are left out of the subset"
    return (
        f"fit_mll: kernels= with select_by='held_out' scores each candidate on held-out rows, but none are held out "
        f"({why}): pass learning_subset= smaller than the data (the rows outside it are held out, "
        "validation_rows='auto', or give them as validation_rows=), or choose by the evidence of the learning rows, select_by='bic' (or "
        "'evidence')."
    )


class _LearningPhase:
    """Phases 1 and 2 of :func:`fit_dense_mll` for the model's current kernel, on the learning ``rows`` (``None``:
    all): type-II maximum likelihood (:meth:`learn`), then a classifier's outputscale on the ``held_out`` rows
    (:meth:`choose_outputscale`). Run once, or once per candidate kernel
    (:class:`~.kernel_choice.LearningPhase`)."""

    def __init__(
        self, mll: Any, rows: Tensor | None, held_out: Tensor | None, recipe: LearningRecipe, show: bool
    ) -> None:
        self.model, self.likelihood = mll.model, mll.likelihood
        self.strategy = mll.model.variational_strategy
        self.exact: bool | None = getattr(mll, "exact", None)  # the evidence's regime, where the objective names one
        self.rows, self.held_out, self.recipe, self.show = rows, held_out, recipe, show
        self.inputs, self.targets = _rows_of(self.strategy, rows)
        self.validation = None if held_out is None else _rows_of(self.strategy, held_out)

    def learn(self, report: LearningReport, deadline: float | None, name: str = "") -> Any:
        """Maximise the evidence of the learning rows (:func:`_learn`); return the model whose evidence it was."""
        subset_model = self.rows is not None
        evidence = self.recipe.evidence
        learner = _learner(self.model, self.strategy, self.inputs, self.targets, subset_model, evidence, self.exact)
        _learn(learner, self.recipe, report, deadline, self.show, name, self.exact)
        return learner

    def final_model(self) -> LearnerModel:
        """A new model of the final approximation on the learning rows, sharing the model's kernel."""
        return LearnerModel(self.model, type(self.strategy), self.inputs, self.targets, self.likelihood)

    def choose_outputscale(self, report: LearningReport, deadline: float | None, start: float | None = None) -> None:
        """The outputscale by the held-out rows (:func:`~.outputscale.choose_outputscale`, walking from ``start``),
        where the kernel is a ``ScaleKernel``, rows are held out and the likelihood has a held-out score (classifiers,
        counts)."""
        kernel = getattr(self.model, "covar_module", None)
        scored = has_held_out_score(self.likelihood)
        if scored and isinstance(kernel, gpytorch.kernels.ScaleKernel) and self.validation is not None:
            assert self.held_out is not None
            report.validation_rows = self.held_out.tolist()
            report.held_out_metric = held_out_metric(self.likelihood)
            x, y = self.validation
            ep = isinstance(self.strategy, EPStrategy)  # (EP's walk goes upwards first, Laplace's downwards)
            name = f"outputscale ({'EP' if ep else 'Laplace'})"
            with tqdm(total=len(self.recipe.outputscale_factors), desc=name, disable=not self.show) as bar:

                def tick() -> None:
                    if bar.n >= bar.total:  # a factor past the grid's edge: one more fit than the grid
                        bar.total += 1
                    bar.update(1)

                mean = getattr(self.model, "mean_module", None)
                log_rate_mean = mean if log_rate(self.likelihood) and isinstance(mean, ConstantMean) else None
                choose_outputscale(
                    kernel, self.final_model, x, y, self.recipe, report, deadline, tick, start, ep, log_rate_mean
                )
                bar.total = bar.n  # the walk's fits (it stops at the first rise, mostly before the grid's size)
                bar.refresh()


def _choice_phase(
    mll: Any,
    rows: Tensor | None,
    held_out: Tensor | None,
    labels: Tensor | None,
    recipe: LearningRecipe,
    generator: _RowGenerator,
    show: bool,
) -> _LearningPhase | None:
    """The learning phase the candidate kernels are learnt and scored in for the choice: on the recipe's
    ``kernel_choice_subset`` of the learning ``rows`` (drawn as they were, stratified by ``labels``), with the same
    held-out rows; ``None`` where that is all of them (the choice then learns in the learning phase itself)."""
    strategy = mll.model.variational_strategy
    size = recipe.kernel_choice_subset
    if size is None:
        return None
    size = auto_choice_size(strategy.num_latents) if size == "auto" else int(size)
    learning = torch.arange(strategy.num_data) if rows is None else rows
    if size >= len(learning):
        return None
    choice_rows = draw_rows(learning, size, None if labels is None else labels[learning], generator())
    return _LearningPhase(mll, choice_rows, held_out, recipe, show)


def fit_minibatch_mll(
    mll: StochasticEPMarginalLogLikelihood,
    data: tuple[Tensor, Tensor] | None = None,
    *,
    max_time: float | None = None,
    recipe: MinibatchRecipe | None = None,
    kernels: Mapping[str, gpytorch.kernels.Kernel] | Sequence[gpytorch.kernels.Kernel] | None = None,
    select_by: str = "auto",
    seed: int | None = None,
    show_progress: bool | None = None,
) -> LearningReport:
    r""":func:`fit_mll` for a :class:`~gpytorch_iterncgp.StochasticEPMarginalLogLikelihood` (whose model holds no data):
    Adam on SEP's energy over minibatches of ``data`` (:func:`.minibatch.fit_minibatches`), until the recipe's
    ``max_steps`` or ``max_time``; with ``kernels``, after the kernel choice (:func:`_choose_for_minibatches`).

    :param data: ``(train_inputs, train_targets)``, ``(N, D)`` and ``(N,)``, ``N`` the objective's ``num_data``
        (required: the model holds no data).
    :param max_time: seconds (``None``: no limit); with ``kernels``, the choice gets an equal share per candidate of
        the time, the minibatch learning one more.
    :param recipe: a :class:`~.minibatch.MinibatchRecipe` (batch size, steps, learning rate and its schedule).
    :param kernels: candidate kernels, ``{name: kernel}`` or a list, as :func:`fit_dense_mll`'s: each learnt and scored
        on the dense evidence (Laplace's, as :func:`fit_dense_mll` learns EP's kernel) of :math:`M_c =
        \lfloor\sqrt{10^6/C}\rfloor` rows of ``data`` (and its held-out
        score on as many others); the model keeps the best at its initial values (``report.kernel``, every
        candidate's scores in ``report.kernel_scores``), which the minibatch learning then learns as if it had been
        given alone. ``None`` (default): the model's own kernel.
    :param select_by: with ``kernels``, ``"auto"``, ``"held_out"``, ``"bic"`` or ``"evidence"``, as
        :func:`fit_dense_mll`'s (``"auto"``: ``"held_out"`` where ``data`` leaves rows to hold out).
    :param seed: seeds the minibatches' order and the choice's rows (``None``: drawn from torch's global generator).
    :param show_progress: a progress bar (``None``: shown).
    :raises TypeError: for a recipe that is not a ``MinibatchRecipe``, ``data`` that is not two tensors, or
        ``kernels`` that are not kernels or for a model without ``covar_module``.
    :raises ValueError: for an unknown ``select_by`` (or one without ``kernels``), or ``"held_out"`` with too few rows
        to hold out.
    """
    recipe = _checked_recipe(recipe, MinibatchRecipe, "stochastic EP")
    if not (isinstance(data, tuple) and len(data) == 2 and all(torch.is_tensor(part) for part in data)):
        raise TypeError(
            "fit_mll: a StochasticEPMarginalLogLikelihood's model holds no data; pass data=(train_inputs, train_targets)."
        )
    candidates = _candidates(mll, kernels, select_by, LearningRecipe())
    deadline, show = _deadline(max_time), _show(show_progress, True)
    device = _device(mll)
    start_peak_memory(device)
    choice = None
    if candidates is not None:
        choice_deadline = time_share(deadline, len(candidates), len(candidates) + 1)
        choice = _choose_for_minibatches(mll, data, candidates, select_by, choice_deadline, _RowGenerator(seed)(), show)
    report = fit_minibatches(mll, data[0], data[1], recipe, deadline, _RowGenerator(seed)(), show)
    if choice is not None:
        report.kernel, report.kernel_scores = choice.kernel, choice.kernel_scores
        report.validation_rows, report.validation_points = choice.validation_rows, choice.validation_points
    report.peak_memory_bytes = peak_memory_bytes(device)
    return report


@contextlib.contextmanager
def _frozen(parameters: list[Tensor]) -> Iterator[None]:
    """``parameters`` (each with ``requires_grad``) left out of learning inside the context."""
    for parameter in parameters:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter in parameters:
            parameter.requires_grad_(True)


def _choose_for_minibatches(
    mll: StochasticEPMarginalLogLikelihood,
    data: tuple[Tensor, Tensor],
    candidates: dict[str, gpytorch.kernels.Kernel],
    select_by: str,
    deadline: float | None,
    generator: torch.Generator,
    show: bool,
) -> LearningReport:
    r"""The kernel choice of :func:`fit_minibatch_mll`: a dense EP view of the model (:class:`~.learner.LearnerModel`)
    on :math:`M_c` rows of ``data`` (:func:`~.rows.auto_choice_size`, at most half of them; stratified by class) and
    as many others held out (:func:`~.rows.held_out_rows`), in whose learning phases (:func:`fit_dense_mll`'s,
    without its final fit) each candidate is learnt on the :math:`M_c` rows and scored
    (:func:`~.kernel_choice.choose_kernel`). Successive halving's first rung, as the dense choice's, with SEP's
    learning on all the data as the second.

    The model is left with the chosen candidate at its initial values and its other parameters (the mean's, the
    inducing inputs, the likelihood's) as on entry; torch's global generator too (the choice runs under
    ``torch.random.fork_rng``), so that (with a ``seed``) the minibatch learning is that of the model given the chosen
    kernel alone. The strategy's own parameters (the inducing inputs) are not in the dense evidence and stay fixed.

    :return: the dense choice's report (``kernel``, ``kernel_scores``; ``validation_rows`` as rows of ``data``).
    :raises ValueError: for ``select_by="held_out"`` where ``data`` has too few rows to hold out.
    """
    model, likelihood = mll.model, mll.likelihood
    strategy = model.variational_strategy
    inputs, targets = data
    recipe = LearningRecipe(kernel_choice_subset=None)  # each candidate on the M_c rows, no second dense learning
    labels = targets.cpu() if strategy.adapter.classification else None
    size = min(auto_choice_size(strategy.num_latents), len(inputs) // 2)
    learning = draw_rows(torch.arange(len(inputs)), max(size, 2), labels, generator)
    held_out = held_out_rows(len(inputs), learning, labels, recipe.min_validation_points, generator)
    select_by = resolved_select_by(select_by, held_out is not None, likelihood)
    if held_out is None and select_by == "held_out":
        raise ValueError(
            f"fit_mll: kernels= with select_by='held_out' scores each candidate on rows of data= held out from its "
            f"learning, but {len(inputs)} rows leave fewer than recipe.min_validation_points="
            f"{recipe.min_validation_points} beside the {len(learning)} learnt on: choose by select_by='bic' (or "
            "'evidence')."
        )
    rows = learning if held_out is None else torch.cat([learning, held_out])
    index = rows.to(inputs.device)
    view = LearnerModel(model, EPStrategy, inputs[index], targets[index.to(targets.device)], likelihood)
    initial = {name: copy.deepcopy(kernel.state_dict()) for name, kernel in candidates.items()}
    kernel_ids = {id(parameter) for parameter in model.covar_module.parameters()}
    others = [p for p in (*model.parameters(), *likelihood.parameters()) if id(p) not in kernel_ids]
    entry = [parameter.detach().clone() for parameter in others]
    validation = None if held_out is None else torch.arange(len(learning), len(rows))
    frozen = [parameter for parameter in strategy.parameters() if parameter.requires_grad]  # not in the dense evidence
    with torch.random.fork_rng(devices=[]), _frozen(frozen), warnings.catch_warnings():
        # the dense view's check against a constant predictor is of the choice's model, not of SEP's: not said
        warnings.simplefilter("ignore", WorseThanConstantWarning)
        report = _learn_dense(
            EPMarginalLogLikelihood(likelihood, view),
            deadline,
            recipe,
            torch.arange(len(learning)),
            validation,
            candidates,
            select_by,
            int(torch.randint(2**62, (), generator=generator)),
            show,
        )
    assert report.kernel is not None
    model.covar_module = candidates[report.kernel]
    model.covar_module.load_state_dict(initial[report.kernel])
    with torch.no_grad():
        for parameter, value in zip(others, entry, strict=True):
            parameter.copy_(value)
    report.validation_rows = None if held_out is None else held_out.tolist()
    return report


def _deadline(max_time: float | None) -> float | None:
    """The ``time.perf_counter()`` by which learning stops (``None``: none). :raises ValueError: for a bad max_time."""
    if max_time is None:
        return None
    check_nonnegative(max_time, "max_time")
    return time.perf_counter() + float(max_time)


def _show(show_progress: bool | None, default: bool) -> bool:
    """Whether to show progress bars. :raises ValueError: for a ``show_progress`` that is not a flag or ``None``."""
    if show_progress is None:
        return default
    check_flag(show_progress, "show_progress")
    return show_progress


def _device(mll: MarginalLogLikelihood) -> torch.device:
    """The device of the model's parameters or buffers (the CPU without either)."""
    some_tensor = next(itertools.chain(mll.model.parameters(), mll.model.buffers()), None)
    return torch.device("cpu") if some_tensor is None else some_tensor.device


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


def _row_indices(value: Tensor, num_data: int, name: str) -> Tensor:
    """Row indices ``(M,)`` (sorted, unique) from a tensor of indices or a boolean mask ``(N,)``.

    :raises ValueError: naming ``name``, for a mask of another length than the data or indices outside ``[0, N)``.
    """
    if value.dtype == torch.bool:
        if value.shape != (num_data,):
            raise ValueError(
                f"{name}: a boolean mask must have one entry per training row, shape ({num_data},); got "
                f"{tuple(value.shape)}."
            )
        return value.cpu().nonzero()[:, 0]
    if value.dtype.is_floating_point or value.dtype.is_complex:
        raise ValueError(f"{name}: row indices must be integers (or a boolean mask), got a {value.dtype} tensor.")
    rows = value.to(device="cpu", dtype=torch.long).reshape(-1)
    if bool((rows < 0).any() or (rows >= num_data).any()):
        raise ValueError(f"{name}: row indices must lie in [0, {num_data}); got {int(rows.min())}..{int(rows.max())}.")
    return rows.unique()


def _learning_rows(
    strategy: Any, subset: Any, labels: Tensor | None, generator: _RowGenerator, recipe: LearningRecipe
) -> Tensor | None:
    """The rows to learn on (``None``: all), from ``fit_mll``'s ``learning_subset`` (``"auto"``: :func:`~.rows.auto_learning_size`).

    :raises ValueError: for a subset that is not ``"auto"``, ``None``, a count of at least 2, row indices or a mask
        (:func:`_row_indices`) of at least 2 rows.
    """
    num_data = strategy.num_data
    if torch.is_tensor(subset):
        rows = _row_indices(subset, num_data, "learning_subset")
        if len(rows) < 2:
            raise ValueError(f"learning_subset must hold at least 2 rows, got {len(rows)}.")
        return None if len(rows) == num_data else rows
    if subset is None:
        return None
    if isinstance(subset, str):
        if subset != "auto":
            raise ValueError(f"learning_subset must be 'auto', None, a number of rows or row indices; got {subset!r}.")
        auto = auto_learning_size(
            num_data, strategy.num_latents, recipe.min_validation_points, recipe.held_out_fraction
        )
        if auto is None:
            return None
        size = auto
    elif isinstance(subset, int) and not isinstance(subset, bool) and subset >= 2:
        size = subset
    else:
        raise ValueError(
            "learning_subset must be 'auto', None, a number of rows (at least 2), row indices or a boolean mask; got "
            f"{subset!r}."
        )
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
    """The held-out rows for the outputscale: ``None`` without a subset (nothing is held out) or where asked.

    :raises ValueError: for validation rows given where the learning uses every row, rows among the learning rows, or
        rows out of range (:func:`_row_indices`).
    """
    if torch.is_tensor(validation_rows):
        held_out = _row_indices(validation_rows, strategy.num_data, "validation_rows")
        if rows is None:
            raise ValueError(
                "validation_rows were given, but the hyperparameters are learnt on every row, so none is held out: "
                "pass a learning subset too (learning_subset=, smaller than the data), or validation_rows=None."
            )
        if bool(torch.isin(held_out, rows).any()):
            raise ValueError("validation_rows must lie outside the learning subset (rows held out from learning).")
        return held_out
    if rows is None or validation_rows is None:
        return None
    if validation_rows != "auto":
        raise ValueError(
            f"validation_rows must be 'auto', None, row indices or a boolean mask; got {validation_rows!r}."
        )
    return held_out_rows(strategy.num_data, rows, labels, recipe.min_validation_points, generator())


def _rows_of(strategy: Any, rows: Tensor | None) -> tuple[Tensor, Tensor]:
    """The strategy's training inputs and targets at ``rows`` (all: ``None``)."""
    if rows is None:
        return strategy.train_inputs, strategy.train_targets
    index = rows.to(strategy.train_inputs.device)
    return strategy.train_inputs[index], strategy.train_targets[index]


def _learner(
    model: Any, strategy: Any, inputs: Tensor, targets: Tensor, subset_model: bool, evidence: str, exact: bool | None
) -> Any:
    """The model whose evidence is maximised: ``model`` itself, or a :class:`LearnerModel` on the subset's rows, and,
    for EP, under Laplace's approximation (``evidence="laplace"``, or ``"ep"`` where EP's would be estimated:
    :attr:`~.recipe.LearningRecipe.evidence`; ``exact``: the objective's regime, ``None``: by the learner's size)."""
    learner = LearnerModel(model, type(strategy), inputs, targets, strategy.likelihood) if subset_model else model
    if exact is None:
        exact = exact_regime(learner.variational_strategy)
    if isinstance(strategy, EPStrategy) and (evidence == "laplace" or not exact):
        learner = LearnerModel(model, IterNCGPStrategy, inputs, targets, laplace_likelihood(strategy.likelihood))
    return learner


class _EvidenceEvaluations:
    """The negative evidence and its gradient as the optimiser evaluates them (:func:`~.optimise.optimise`'s two
    callables): each evaluation fits the strategy (``learner(inputs)``, warm-started from the last posterior), and the
    fit's, the evidence's and the gradient's seconds, the loss and the evaluations whose gradient was explicit go into
    ``report``; the ``parameters`` with the best evidence seen are kept (:meth:`restore_best`). An evaluation after
    ``deadline`` (the first excepted) raises :class:`_OutOfTime`."""

    def __init__(
        self,
        learner: Any,
        mll: Any,
        scale: LogScale,
        parameters: list[Tensor],
        report: LearningReport,
        deadline: float | None,
        bar: Any,
    ):
        self.learner, self.mll, self.scale, self.parameters = learner, mll, scale, parameters
        self.report, self.deadline, self.bar = report, deadline, bar
        self.best_loss = math.inf
        self.best_state: list[Tensor] | None = None

    def evaluate(self) -> Tensor:
        report, strategy = self.report, self.learner.variational_strategy
        if self.deadline is not None and report.losses and time.perf_counter() >= self.deadline:
            raise _OutOfTime
        self.scale.push()
        tic = time.perf_counter()
        output = self.learner(strategy.train_inputs)  # the strategy's fit, warm-started from the last posterior
        report.fit_seconds += time.perf_counter() - tic
        tic = time.perf_counter()
        with cg_nans_as_nan_errors(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ExplicitGradientWarning)
            loss = -self.mll(output, strategy.train_targets)
        report.evidence_seconds += time.perf_counter() - tic
        explicit = [warning for warning in caught if issubclass(warning.category, ExplicitGradientWarning)]
        report.explicit_gradients += bool(explicit)
        for warning in caught:  # the others again, from one line: a message repeated at every evaluation shows once
            if warning not in explicit:
                warnings.warn(warning.message, warning.category, stacklevel=2)
        value = float(loss.detach())
        report.losses.append(value)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{value:.4g}")
        if value < self.best_loss:
            self.best_loss, self.best_state = value, [parameter.detach().clone() for parameter in self.parameters]
        return loss

    def backward(self, loss: Tensor) -> None:
        tic = time.perf_counter()
        with cg_nans_as_nan_errors():
            loss.backward()
        self.scale.pull_gradients()
        self.report.gradient_seconds += time.perf_counter() - tic

    def restore_best(self) -> None:
        """The parameters with the best evidence seen (none where no evaluation ended)."""
        if self.best_state is not None:
            with torch.no_grad():
                for parameter, value in zip(self.parameters, self.best_state, strict=True):
                    parameter.copy_(value)


def _learn(
    learner: Any,
    recipe: LearningRecipe,
    report: LearningReport,
    deadline: float | None,
    show: bool,
    name: str = "",
    exact: bool | None = None,
) -> None:
    """Maximise ``learner``'s evidence, keeping the parameters with the best evidence seen; fills ``report``
    (``name``: the candidate kernel's, in the progress bar; ``exact``: the regime the objective ``fit_mll`` was given
    names, ``None``: the learner's by its size, :func:`~gpytorch_iterncgp.strategies.base.exact_regime`).

    Exact regime (a deterministic value and gradient): L-BFGS with a strong-Wolfe line search and whole fits.
    Otherwise (stochastic log-determinant): Adam, each evaluation on a loose fit from the previous posterior. Either
    works on positive hyperparameters' logarithms (:class:`~.scale.LogScale`).
    """
    strategy = learner.variational_strategy
    exact = exact_regime(strategy) if exact is None else exact
    evidence = EPMarginalLogLikelihood if isinstance(strategy, EPStrategy) else LaplaceMarginalLogLikelihood
    mll = evidence(strategy.likelihood, learner, exact=exact)
    report.method, report.evidence = ("L-BFGS" if exact else "Adam"), evidence.approximation
    modules = [learner, strategy.likelihood]
    parameters = trainable_parameters(modules)
    scale = LogScale(modules, parameters)  # positive hyperparameters on the log scale, whatever their constraint
    inputs = strategy.train_inputs
    start = time.perf_counter()
    kernel = f" ({name})" if name else ""
    description = f"learning{kernel}: {report.method} on the {report.evidence} evidence of {len(inputs)} points"
    bar = tqdm(total=recipe.optimizer_steps if not exact else None, desc=description, disable=not show)
    evaluations = _EvidenceEvaluations(learner, mll, scale, parameters, report, deadline, bar)

    learner.train()
    try:
        # the fits at each evaluation follow the hyperparameters; only the final fit's convergence is reported
        # a small exact regime (N C <= 500): every operation is small, and the products with K take the caller's threads
        small = exact and strategy.num_data * strategy.num_latents <= ONE_THREAD_LEARNING_SIZE
        with _loose_fits(strategy, recipe, exact), small_operations() if small else contextlib.nullcontext():
            if strategy.state is None:  # the first evaluation's fit starts loose from the prior, as the later ones
                strategy.loose_fit()
            report.stopped = optimise(scale.variables, evaluations.evaluate, evaluations.backward, exact, recipe)
    except _OutOfTime:
        report.stopped = LearningStop.MAX_TIME
    except RECOVERABLE_ERRORS as error:
        if evaluations.best_state is None:  # fails at the initial hyperparameters: a real error
            raise
        report.stopped = LearningStop.ERROR
        warnings.warn(
            f"fit_mll: learning{kernel} ({report.method}) stopped after {len(report.losses)} evidence evaluations "
            f"({error}); "
            "keeping the hyperparameters with the best evidence seen.",
            ConvergenceWarning,
            stacklevel=3,
        )
    finally:
        bar.close()
    evaluations.restore_best()
    report.evaluations, report.seconds = len(report.losses), time.perf_counter() - start
    if report.explicit_gradients:
        warnings.warn(
            f"fit_mll: learning{kernel}: at {report.explicit_gradients} of {report.evaluations} evaluations the "
            "Laplace evidence did not trust its Newton step from the fitted mode, and its gradient left out the "
            "mode's implicit derivative (LearningReport.explicit_gradients). Fit closer to the mode at each "
            "evaluation (the strategy's train_fit_steps) where this repeats.",
            ExplicitGradientWarning,
            stacklevel=3,
        )


@contextlib.contextmanager
def _loose_fits(strategy: Any, recipe: LearningRecipe, exact: bool) -> Iterator[None]:
    """The strategy's fits while learning: no covariance phase; whole fits at every evaluation in the exact regime
    (L-BFGS's line search compares converged values), loose ones (the strategy's own options ``train_fit_steps`` and
    ``train_compression_rank``, or the deprecated ``recipe.fit_steps`` and ``recipe.compression_rank`` where given)
    and a cheaper stochastic log-determinant otherwise."""
    with contextlib.ExitStack() as stack:
        if exact:
            stack.enter_context(strategy.overriding(covariance_iterations=0, train_fit_steps=None))
        else:
            replaced = (("train_fit_steps", recipe.fit_steps), ("train_compression_rank", recipe.compression_rank))
            loose = {option: value for option, value in replaced if value is not None}
            stack.enter_context(strategy.overriding(covariance_iterations=0, **loose))
            stack.enter_context(gpytorch.settings.num_trace_samples(recipe.trace_samples))
            stack.enter_context(gpytorch.settings.max_lanczos_quadrature_iterations(recipe.lanczos_iterations))
        yield
