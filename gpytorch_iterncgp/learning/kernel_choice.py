r"""The kernel chosen among candidates: each learnt by type-II maximum likelihood on the learning rows, then scored by
its evidence (Bayesian model selection, R&W sec. 5.2-5.4), penalised for its hyperparameters by the Bayesian
information criterion as in the kernel search of Duvenaud et al. (2013), here over a small fixed family instead of a
grammar, and by its held-out predictions where rows are held out (cross-validation, R&W sec. 5.3).

.. code-block:: python

    kernels = gpytorch_iterncgp.kernels.family.kernel_family(train_x.shape[-1])
    report = gpytorch_iterncgp.fit_mll(mll, kernels=kernels)   # learns each, keeps the best (held-out score or BIC)
    report.kernel, report.kernel_scores                         # the choice, and every candidate's scores

:func:`~gpytorch_iterncgp.kernels.family.kernel_family` is the estimators' family (``kernel="auto"``; importable
from here too, where it lived before); :func:`choose_kernel` is
:func:`~gpytorch_iterncgp.fit_mll`'s (``kernels=``) loop over the candidates, around the learning phase of
:mod:`.fit`, given as a :class:`LearningPhase`.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import gpytorch
import torch
from gpytorch.kernels import Kernel
from torch import Tensor

from ..kernels.family import kernel_family
from ..mlls.itergp import EPMarginalLogLikelihood, LaplaceMarginalLogLikelihood
from ..strategies.itergp import EPStrategy
from .learner import LearnerModel
from .recipe import RECOVERABLE_ERRORS, LearningRecipe, LearningReport
from .scores import has_held_out_score, held_out_score

__all__ = [
    "SELECT_BY",
    "LearningPhase",
    "candidate_kernels",
    "check_select_by",
    "choose_kernel",
    "kernel_family",
    "kernel_owner",
    "learnt_evidence",
    "resolved_select_by",
    "time_share",
]

#: what :func:`choose_kernel` may choose by: the held-out score (log-loss or Poisson deviance), the learnt evidence, or
#: the learnt evidence penalised by BIC's count of hyperparameters; ``"auto"`` the first where rows are held out, else
#: the last (:func:`resolved_select_by`)
SELECT_BY = ("auto", "held_out", "evidence", "bic")


def kernel_owner(model: Any) -> Any:
    """The model whose ``covar_module`` ``model``'s prior evaluates: a :class:`~.learner.LearnerModel`'s prior model (a
    view of another model on other rows), the model itself otherwise."""
    return model.prior_model if isinstance(model, LearnerModel) else model


def candidate_kernels(kernels: Any, model: Any, select_by: Any) -> dict[str, Kernel]:
    """``fit_mll``'s ``kernels=`` as ``{name: kernel}``, checked before anything is learnt.

    :param kernels: a mapping ``{name: kernel}`` or a sequence of kernels (named ``"0:ScaleKernel(MaternKernel)"``, by
        position and structure).
    :param model: the model whose ``covar_module`` the candidates replace in turn.
    :param select_by: one of :data:`SELECT_BY`.
    :raises TypeError: for a model without a ``covar_module`` attribute, or candidates that are not GPyTorch kernels
        (or names that are not strings).
    :raises ValueError: for an unknown ``select_by``, or no candidate.
    """
    check_select_by(select_by)
    model = kernel_owner(model)
    if not hasattr(model, "covar_module"):
        raise TypeError(
            "fit_mll: kernels= puts each candidate in the model as its covar_module, but "
            f"{type(model).__name__} has no covar_module attribute: name the model's kernel covar_module (GPyTorch's convention, used in forward), or "
            "leave kernels= out."
        )
    if isinstance(kernels, Mapping):
        named = dict(kernels)
    elif isinstance(kernels, Sequence) and not isinstance(kernels, str):
        named = {f"{index}:{_structure(kernel)}": kernel for index, kernel in enumerate(kernels)}
    else:
        raise TypeError(
            "fit_mll: kernels must be a dict {name: kernel} or a list of gpytorch kernels, got "
            f"{type(kernels).__name__}."
        )
    if not named:
        raise ValueError("fit_mll: kernels= holds no candidate; give at least one kernel, or leave kernels= out.")
    for name, kernel in named.items():
        if not isinstance(name, str):
            raise TypeError(f"fit_mll: the names of kernels= must be strings, got {name!r}.")
        if not isinstance(kernel, Kernel):
            raise TypeError(
                f"fit_mll: kernels[{name!r}] must be a gpytorch.kernels.Kernel, got {type(kernel).__name__}."
            )
    return named


def check_select_by(select_by: Any) -> None:
    """:raises ValueError: for a ``select_by`` that is not one of :data:`SELECT_BY`."""
    if not (isinstance(select_by, str) and select_by in SELECT_BY):
        raise ValueError(
            "fit_mll: select_by must be 'auto' ('held_out' where rows are held out, else 'bic'), 'held_out' (the "
            "log-loss or Poisson deviance of held-out rows), 'bic' (the learnt evidence of the learning rows, "
            f"penalised for the kernel's hyperparameters) or 'evidence' (the learnt evidence alone); got {select_by!r}."
        )


def resolved_select_by(select_by: str, held_out: bool, likelihood: Any) -> str:
    """The score a kernel choice chooses by: ``select_by``, where ``"auto"`` is ``"held_out"`` where rows are held out
    (``held_out``) and the likelihood has a held-out score, ``"bic"`` otherwise: the estimators' rule
    (``docs/design_notes.md``, "Which score chooses")."""
    if select_by != "auto":
        return select_by
    return "held_out" if held_out and has_held_out_score(likelihood) else "bic"


def _structure(kernel: Kernel) -> str:
    """A kernel's class names, nested as its parts: ``ScaleKernel(AdditiveKernel(LinearKernel, MaternKernel))``."""
    parts = [kernel.base_kernel] if hasattr(kernel, "base_kernel") else list(getattr(kernel, "kernels", []))
    inner = ", ".join(_structure(part) for part in parts)
    return f"{type(kernel).__name__}({inner})" if inner else type(kernel).__name__


class LearningPhase(Protocol):
    """What :func:`choose_kernel` runs for each candidate (:mod:`.fit`'s learning phase on the learning rows)."""

    recipe: LearningRecipe
    #: the held-out rows ``(V,)`` and their inputs ``(V, D)`` and targets, or ``None`` where none are held out
    held_out: Tensor | None
    validation: tuple[Tensor, Tensor] | None

    def learn(self, report: LearningReport, deadline: float | None, name: str = "") -> Any:
        """Type-II maximum likelihood of the model's current kernel; returns the model whose evidence was maximised."""

    def choose_outputscale(self, report: LearningReport, deadline: float | None, start: float | None = None) -> None:
        """The outputscale phase (classifiers with a ``ScaleKernel`` and held-out rows), its walk from ``start``."""

    def final_model(self) -> gpytorch.models.ApproximateGP:
        """A new model of the final approximation on the learning rows (sharing the model's kernel)."""


def choose_kernel(
    model: Any,
    likelihood: gpytorch.likelihoods.Likelihood,
    candidates: dict[str, Kernel],
    phase: LearningPhase,
    select_by: str,
    report: LearningReport,
    deadline: float | None,
    choice: LearningPhase | None = None,
) -> None:
    r"""Put each candidate in ``model`` (``model.covar_module = kernel``; in the prior model of a
    :class:`~.learner.LearnerModel`, :func:`kernel_owner`), learn it (``choice``, or ``phase`` without
    one: type-II maximum likelihood on the :math:`M` learning rows and, for a classifier, the outputscale on the
    held-out rows), score it, and leave the model with the best one and its learnt hyperparameters (the kernel's, and
    the mean's and likelihood's, which every candidate learns from their values on entry). With ``choice`` (the same
    phase on fewer of the learning rows), the chosen candidate is then learnt again in ``phase``, from its values on
    entry (a cold start: the result is the chosen kernel learnt as if it had been given alone, whatever the choice's
    fewer rows made of it): a cheap low-fidelity ranking, then one full learning (successive halving's two rungs,
    Jamieson & Talwalkar 2016). Each candidate's outputscale walk starts at the factor the previous candidate's walk
    chose, and the chosen candidate's second walk at the factor its first chose (``outputscale_factor``): on a
    held-out log-loss unimodal in the outputscale the walk ends at the same factor from any start, in fewer fits
    from a nearby one (:func:`~.outputscale.choose_outputscale`).

    Each candidate's scores (held-out, evidence, BIC; :func:`_score_candidate`) are recorded in
    ``report.kernel_scores[name]`` with its number of kernel ``hyperparameters``, its ``seconds`` and its ``error``.

    The candidate with the lowest ``select_by`` score is chosen (``report.kernel``; the first of equal ones); the
    report's learning fields are its. A candidate whose learning or scoring fails (:data:`~.recipe.RECOVERABLE_ERRORS`,
    or a non-finite score) is skipped, with a ``RuntimeWarning``, and its ``error`` recorded. With ``deadline``, each
    candidate (and the chosen one's second learning) gets an equal share of the time left when it starts.

    :param model: the model (its ``covar_module`` is replaced).
    :param likelihood: the model's likelihood (its parameters are restored with the mean's).
    :param candidates: ``{name: kernel}`` (:func:`candidate_kernels`); each moved to the data's dtype and device and
        learnt in place (each keeps its learnt hyperparameters).
    :param phase: the learning phase (:class:`LearningPhase`).
    :param select_by: ``"held_out"``, ``"evidence"`` or ``"bic"`` (:func:`resolved_select_by`).
    :param report: filled: the chosen candidate's learning fields, ``kernel``, ``kernel_scores`` and ``selected_by``.
    :param deadline: ``time.perf_counter()`` by which learning stops (``None``: none).
    :param choice: the phase the candidates are learnt and scored in, on fewer rows (``None``: ``phase``).
    :raises RuntimeError: where every candidate failed (naming each error).
    """
    inputs = model.variational_strategy.train_inputs
    owner = kernel_owner(model)
    for kernel in candidates.values():
        kernel.to(device=inputs.device, dtype=inputs.dtype)
    initial_kernel = {id(parameter) for parameter in owner.covar_module.parameters()}
    others = list({id(p): p for p in itertools.chain(model.parameters(), likelihood.parameters())}.values())
    others = [parameter for parameter in others if id(parameter) not in initial_kernel]
    initial = [parameter.detach().clone() for parameter in others]
    initial_kernels = {name: copy.deepcopy(kernel.state_dict()) for name, kernel in candidates.items()}
    screen = phase if choice is None else choice
    outcomes = _first_rung(owner, others, initial, candidates, screen, select_by, report, deadline, choice is not None)
    if not outcomes:
        errors = "; ".join(f"{name}: {scores['error']}" for name, scores in report.kernel_scores.items())
        raise RuntimeError(f"fit_mll: every candidate kernel failed ({errors}).")
    chosen = min(outcomes, key=lambda name: report.kernel_scores[name][select_by])
    candidate, learnt = outcomes[chosen]
    owner.covar_module = candidates[chosen]
    _restore(others, learnt)
    if choice is not None:  # the chosen kernel learnt again on all the learning rows, cold
        owner.covar_module.load_state_dict(initial_kernels[chosen])
        _restore(others, initial)
        walk_from = report.kernel_scores[chosen]["outputscale_factor"]  # where the chosen candidate's walk ended
        candidate = dataclasses.replace(report, losses=[], outputscale_scores={}, kernel_scores={})
        phase.learn(candidate, deadline, chosen)
        phase.choose_outputscale(candidate, deadline, walk_from)
    scores = report.kernel_scores
    for field in dataclasses.fields(LearningReport):
        setattr(report, field.name, getattr(candidate, field.name))
    report.kernel, report.kernel_scores, report.selected_by = chosen, scores, select_by
    if phase.held_out is not None:
        report.validation_rows, report.validation_points = phase.held_out.tolist(), len(phase.held_out)


def _first_rung(
    owner: Any,
    others: list[Tensor],
    initial: list[Tensor],
    candidates: dict[str, Kernel],
    screen: LearningPhase,
    select_by: str,
    report: LearningReport,
    deadline: float | None,
    second_rung: bool,
) -> dict[str, tuple[LearningReport, list[Tensor]]]:
    """Each candidate put in ``owner`` (``owner.covar_module``), learnt and scored in ``screen``
    (:func:`_score_candidate`) from the ``others`` parameters' ``initial`` values, its scores in
    ``report.kernel_scores``; one that fails is skipped with a ``RuntimeWarning``. Returns, for those that did not, their
    report and their ``others`` parameters' learnt values. Each gets an equal share of the time left before
    ``deadline`` (as does the ``second_rung``'s learning, where there is one)."""
    outcomes: dict[str, tuple[LearningReport, list[Tensor]]] = {}
    report.kernel_scores = {}
    # each outputscale walk starts where the last one ended (the first: at the grid's start)
    walk_from: float | None = None
    for index, (name, kernel) in enumerate(candidates.items()):
        candidate_deadline = time_share(deadline, 1, len(candidates) - index + second_rung)
        owner.covar_module = kernel
        _restore(others, initial)
        candidate = dataclasses.replace(report, losses=[], outputscale_scores={}, kernel_scores={})
        start = time.perf_counter()
        count = sum(parameter.numel() for parameter in kernel.parameters() if parameter.requires_grad)
        scores: dict[str, Any] = dict(held_out=None, evidence=None, bic=None, hyperparameters=count, seconds=0.0)
        scores.update(rows=None, error=None, outputscale_factor=None)
        try:
            walk_from = _score_candidate(screen, candidate, name, scores, select_by, candidate_deadline, walk_from)
            outcomes[name] = (candidate, [parameter.detach().clone() for parameter in others])
        except RECOVERABLE_ERRORS as error:
            scores["error"] = f"{type(error).__name__}: {error}"
            warnings.warn(f"fit_mll: kernel {name!r} skipped ({scores['error']}).", RuntimeWarning, stacklevel=5)
        scores["seconds"] = time.perf_counter() - start
        report.kernel_scores[name] = scores
    return outcomes


def _score_candidate(
    screen: LearningPhase,
    candidate: LearningReport,
    name: str,
    scores: dict[str, Any],
    select_by: str,
    deadline: float | None,
    walk_from: float | None,
) -> float | None:
    r"""Learn the kernel in the model (``screen``'s learning, then its outputscale walk from ``walk_from``, into
    ``candidate``) and fill its ``scores``: ``rows``, ``outputscale_factor`` and the scores, each the lower the better.
    Returns the factor the walk ended at (``walk_from`` where there was no walk).

    * ``held_out``: :func:`held_out_score` on the rows the learning held out (``None`` without any);
    * ``evidence``: :func:`learnt_evidence`, :math:`-\log q(\mathbf y \mid \theta^*) / M` at the learnt
      hyperparameters :math:`\theta^*` (before the outputscale phase), exact: type-II maximum likelihood across
      kernels (R&W sec. 5.4). Of two nested kernels (Matérn and its ARD form) the larger scores at least as well
      at its maximum;
    * ``bic``: the Bayesian information criterion per row, :math:`-\log q(\mathbf y \mid \theta^*) / M +
      k \log M / (2 M)`, the evidence penalised for the hyperparameters fitted (Schwarz 1978; the kernel search of
      Duvenaud et al. 2013): a kernel with more hyperparameters must raise the evidence by :math:`\tfrac12 \log M`
      nats for each.

    The evidence and the BIC are computed only where ``select_by`` is one of them (``None`` under ``"held_out"``): the
    exact evidence is a dense factorisation of all :math:`M C` latent values after a whole fit, seconds for a
    multi-class candidate, which a choice by the held-out score would not read.

    :raises FloatingPointError: where the ``select_by`` score is missing or not finite.
    """
    learner = screen.learn(candidate, deadline, name)
    rows = scores["rows"] = learner.variational_strategy.num_data
    if select_by != "held_out":
        scores["evidence"] = learnt_evidence(learner)
        scores["bic"] = scores["evidence"] + scores["hyperparameters"] * math.log(rows) / (2 * rows)
    screen.choose_outputscale(candidate, deadline, walk_from)
    if candidate.outputscale_scores:
        scores["outputscale_factor"] = walk_from = candidate.outputscale_factor
    if screen.validation is not None:
        losses = candidate.outputscale_scores
        scores["held_out"] = (
            losses[candidate.outputscale_factor]  # the outputscale phase's fit at the chosen factor
            if candidate.outputscale_factor in losses
            else held_out_score(screen.final_model(), *screen.validation, screen.recipe.outputscale_fit_steps)
        )
    chosen_score = scores[select_by]
    if chosen_score is None or not math.isfinite(chosen_score):
        raise FloatingPointError(f"the {select_by} score is {chosen_score}")
    return walk_from


def time_share(deadline: float | None, parts: int, whole: int) -> float | None:
    """The ``time.perf_counter()`` by which ``parts`` of ``whole`` equal shares of the time left before ``deadline``
    have passed (``None`` without a deadline): the next candidate's deadline is one share among those left."""
    if deadline is None:
        return None
    now = time.perf_counter()
    return now + max(deadline - now, 0.0) * parts / whole


def _restore(parameters: list[Tensor], values: list[Tensor]) -> None:
    with torch.no_grad():
        for parameter, value in zip(parameters, values, strict=True):
            parameter.copy_(value)


def learnt_evidence(learner: Any) -> float:
    r""":math:`-\log q(\mathbf y \mid \theta) / M` of ``learner``'s :math:`M` training points (the objective ``fit_mll``
    minimised: Laplace's or EP's evidence, R&W eqs. 3.32, 3.65, with the hyperparameters' log priors), at its
    current hyperparameters, dense and exact (the objective's ``exact=True``, whatever :math:`M C`: no stochastic
    estimate, so candidates compare without noise), after a whole fit (no ``train_fit_steps``, no covariance
    phase)."""
    strategy = learner.variational_strategy
    evidence = EPMarginalLogLikelihood if isinstance(strategy, EPStrategy) else LaplaceMarginalLogLikelihood
    mll = evidence(strategy.likelihood, learner, exact=True)
    learner.train()
    with torch.no_grad(), strategy.overriding(covariance_iterations=0, train_fit_steps=None):
        return float(-mll(learner(strategy.train_inputs), strategy.train_targets))
