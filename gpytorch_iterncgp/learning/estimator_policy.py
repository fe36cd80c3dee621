r"""How the scikit-learn estimators choose their inference, solver budget, kernel and strategy options from the data.

The estimators (:mod:`gpytorch_iterncgp.integrations.sklearn`) are a facade: they validate scikit-learn's input and
call this module's rules, then :func:`~gpytorch_iterncgp.fit_mll`. With :math:`N` training points of :math:`C`
latent values each (:math:`C = 1` for binary and count data, the number of classes otherwise):

* inference: :func:`auto_inference` (``inference="auto"``), :data:`CLASSIFIER_INFERENCE`, :data:`REGRESSOR_INFERENCE`;
* the solver budget: :func:`solver_budget` (``solver_options``' ``"policy"`` and ``"max_solver_iterations"``
  ``"auto"``), from
  :data:`~.thresholds.EXACT_SOLVE_SIZE`, :data:`DEFAULT_SOLVER_ITERATIONS` and
  :data:`~.thresholds.EP_POINTS_PER_BUDGET` (the sizes in :mod:`.thresholds`);
* the strategy's keyword arguments: :func:`solver_settings` (the rules' :func:`strategy_options`, then the
  estimators' ``solver_options`` by the strategy's names, :func:`solver_option_names`, and their former parameters,
  :data:`FORMER_SOLVER_PARAMETERS`); the evidence that goes with a strategy: :func:`evidence_class`;
* the prior: :func:`~gpytorch_iterncgp.kernels.family.default_kernel`, or with ``kernel="auto"`` the kernel chosen
  among :data:`AUTO_KERNELS` by the held-out score (:func:`auto_kernel_names`);
* the estimators' own defaults (:data:`ESTIMATOR_DEFAULTS`), and the parameters only one kind of inference reads
  (:data:`DENSE_ONLY`, :data:`SPARSE_ONLY`, :func:`check_parameters_apply`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from ..core.policies import Policy, make_policy
from ..core.validation import DEPRECATED, is_string
from ..kernels.family import default_kernel, log_positive
from ..laplace.newton import SolverOptions
from ..mlls.itergp import EPMarginalLogLikelihood, LaplaceMarginalLogLikelihood
from ..strategies.base import replaced_options
from ..strategies.itergp import EPStrategy, IterNCGPStrategy
from .rows import auto_choice_size, auto_learning_size, auto_subset_size, holds_out_rows
from .thresholds import (
    EP_POINTS_PER_BUDGET,
    EXACT_MARGINAL_TOL,
    EXACT_SOLVE_SIZE,
    SPARSE_EP_LATENT_VALUES,
    SPARSE_EP_NESTED_WORK,
    SPARSE_EP_POINTS,
)

__all__ = [
    "AUTO_KERNELS",
    "CLASSIFIER_INFERENCE",
    "DEFAULT_SOLVER_ITERATIONS",
    "DENSE_ONLY",
    "EP_POINTS_PER_BUDGET",
    "ESTIMATOR_DEFAULTS",
    "ESTIMATOR_SET_OPTIONS",
    "EXACT_SOLVE_SIZE",
    "FORMER_SOLVER_PARAMETERS",
    "REGRESSOR_INFERENCE",
    "SPARSE_EP_LATENT_VALUES",
    "SPARSE_EP_NESTED_WORK",
    "SPARSE_EP_POINTS",
    "SPARSE_ONLY",
    "EstimatorDefaults",
    "KernelChoice",
    "auto_inference",
    "auto_kernel_names",
    "check_parameters_apply",
    "checked_solver_options",
    "default_kernel",
    "evidence_class",
    "former_solver_options",
    "log_positive",
    "solver_budget",
    "solver_option_names",
    "solver_settings",
    "strategy_options",
]

#: ``inference="auto"`` of the classifier below :func:`auto_inference`'s switch: the approximation chosen by
#: measurement (``benchmarks/learned.py``, ``benchmarks/sklearn_defaults.py``).
CLASSIFIER_INFERENCE = "ep"
#: ``inference="auto"`` of the Poisson regressor (EP needs integer counts; the quasi-likelihood of non-integer targets
#: has no tilted moments).
REGRESSOR_INFERENCE = "laplace"
#: ``max_solver_iterations="auto"`` above :data:`~.thresholds.EXACT_SOLVE_SIZE`: the strategy's own default budget per
#: Newton step.
DEFAULT_SOLVER_ITERATIONS = cast(int, SolverOptions.max_solver_iterations)  # an int (the dataclass field allows None)


#: the estimators' former solver parameters, each now a key of ``solver_options`` (deprecated: a ``FutureWarning``,
#: and they keep working for one release; :func:`former_solver_options`)
FORMER_SOLVER_PARAMETERS = (
    "policy",
    "max_newton_steps",
    "max_solver_iterations",
    "compression_rank",
    "preconditioner_rank",
    "covariance_iterations",
    "recycle",
    "outer_tol",
    "solver_tol",
)
#: the parameters only dense inference (``"laplace"``, ``"ep"``) uses: its solver and its learning on a subset
DENSE_ONLY = (
    "solver_options",
    "train_fit_steps",
    "learning_fit_steps",
    "learning_subset",
    *FORMER_SOLVER_PARAMETERS,
)
#: the parameters only stochastic EP (``"sparse_ep"``) uses: its inducing inputs and minibatches
SPARSE_ONLY = ("num_inducing", "batch_size")
#: ``kernel="auto"``: the names of :func:`~gpytorch_iterncgp.kernels.family.kernel_family`'s kernels chosen
#: among (:func:`auto_kernel_names`)
AUTO_KERNELS = ("matern", "linear+matern", "warped_matern")


@dataclass(frozen=True)
class EstimatorDefaults:
    """The estimators' own defaults, written once; the solver's (``max_newton_steps``, ``compression_rank``,
    ``train_fit_steps``, ...) are :class:`~gpytorch_iterncgp.SolverOptions`' fields, the minibatches'
    (``batch_size``) :class:`~gpytorch_iterncgp.MinibatchRecipe`'s; the learning's ``"auto"`` (``optimizer_steps``,
    ``learning_rate``) are :class:`~gpytorch_iterncgp.LearningRecipe`'s under dense inference and
    :class:`~gpytorch_iterncgp.MinibatchRecipe`'s (``max_steps``, ``learning_rate``) under ``"sparse_ep"``."""

    kernel: str = "auto"  # the Matérn, linear + Matérn or warped Matérn, by the held-out score (auto_kernel_names)
    inference: str = "auto"
    policy: str = "auto"
    max_solver_iterations: str = "auto"
    solver_tol: float = 1e-5
    optimizer_steps: str = "auto"  # LearningRecipe's (dense) or MinibatchRecipe's (sparse_ep) default
    learning_rate: str = "auto"  # likewise
    learning_subset: str = "auto"
    num_inducing: int = 256  # inference="sparse_ep"


#: the defaults of the estimators' constructors
ESTIMATOR_DEFAULTS = EstimatorDefaults()


@dataclass(frozen=True)
class KernelChoice:
    """The estimators' ``kernel_choice_`` (``kernel="auto"``): the kernel fitted, the candidates and why, as data;
    ``str()`` says it in a sentence.

    :param kernel: the name of the kernel fitted (:func:`~gpytorch_iterncgp.kernels.family.kernel_family`'s).
    :param candidates: the names learnt and scored (one: no choice was made, :func:`auto_kernel_names`).
    :param reason: why these candidates, a clause (:func:`auto_kernel_names`).
    :param validation_points: the held-out points the candidates were scored on (0: no choice was made).
    :param learning_rows: under ``"sparse_ep"``, the rows each candidate was learnt on by dense EP (``None``
        otherwise).
    """

    kernel: str
    candidates: tuple[str, ...]
    reason: str
    validation_points: int = 0
    learning_rows: int | None = None

    def __str__(self) -> str:
        text = f"{self.kernel!r}: {self.reason}"
        if len(self.candidates) > 1:
            text += f" of {self.validation_points} points"
        if self.learning_rows is not None:
            text += f" (each learnt by dense EP on {self.learning_rows})"
        return text


def auto_inference(num_data: int, num_classes: int) -> str:
    r"""``inference="auto"`` for a classifier: ``"sparse_ep"`` (stochastic EP, :math:`O(C(M^3 + B M^2))` a minibatch
    whatever :math:`N`) past :data:`~.thresholds.SPARSE_EP_POINTS` training points, or for :math:`C > 2` classes past
    :data:`~.thresholds.SPARSE_EP_LATENT_VALUES` latent values :math:`N C` (dense EP's products and recycled actions) or
    :data:`~.thresholds.SPARSE_EP_NESTED_WORK` in :math:`N C^3` (dense multi-class EP's per-point work); else
    :data:`CLASSIFIER_INFERENCE` (dense computation-aware EP). The estimators fit on the CPU, where both limits were
    measured (``benchmarks/auto_switch.py``).

    :param num_data: :math:`N`, the number of training points.
    :param num_classes: :math:`C`, the number of classes (2 for binary data).
    :return: ``"sparse_ep"`` or :data:`CLASSIFIER_INFERENCE`.
    """
    classes = num_classes > 2 and (
        num_data * num_classes > SPARSE_EP_LATENT_VALUES or num_data * num_classes**3 > SPARSE_EP_NESTED_WORK
    )
    return "sparse_ep" if num_data > SPARSE_EP_POINTS or classes else CLASSIFIER_INFERENCE


def check_parameters_apply(
    estimator: str,
    values: Mapping[str, Any],
    defaults: Mapping[str, Any],
    inference: str,
    requested: str,
    num_points: int,
) -> None:
    """Refuse a parameter set away from its default that the ``inference`` in use ignores: the dense solver's and the
    dense learning's (:data:`DENSE_ONLY`) under ``"sparse_ep"``, the inducing points' and minibatches'
    (:data:`SPARSE_ONLY`) under dense inference.

    :param estimator: the estimator's class name, for the message.
    :param values: the estimator's parameters (``get_params(deep=False)``).
    :param defaults: their defaults (the constructor's); a name without a default is not checked.
    :param inference: the inference in use (``"laplace"``, ``"ep"`` or ``"sparse_ep"``).
    :param requested: the ``inference`` parameter as given (``"auto"`` or the inference itself).
    :param num_points: :math:`N`, the number of training points (named where ``"auto"`` chose).
    :raises ValueError: naming each such parameter, the inference and what to do.
    """
    ignored = DENSE_ONLY if inference == "sparse_ep" else SPARSE_ONLY
    changed = [name for name in ignored if name in defaults and values[name] != defaults[name]]
    if changed:
        chosen = (
            f"inference='auto' chose {inference!r} for {num_points} points"
            if requested == "auto"
            else f"inference={inference!r}"
        )
        other = "'ep' or 'laplace'" if inference == "sparse_ep" else "'sparse_ep'"
        raise ValueError(
            f"{estimator}: {', '.join(f'{name}={values[name]!r}' for name in changed)} do(es) not apply: {chosen}, "
            f"which does not use it. Set inference={other} to use it, or leave it at its default."
        )


def auto_kernel_names(
    inference: str,
    learn: bool,
    num_points: int,
    num_latents: int,
    learning_subset: Any,
    min_validation_points: int,
    held_out_fraction: float,
) -> tuple[tuple[str, ...], str]:
    r"""``kernel="auto"``: the names of :func:`~gpytorch_iterncgp.kernels.family.kernel_family`'s kernels to
    choose among, and why. :data:`AUTO_KERNELS` (``"matern"``, ``"linear+matern"`` and ``"warped_matern"``), each
    learnt on the learning rows and chosen by the held-out score of the rows the learning holds out (the log-loss of
    a classifier, the Poisson deviance of counts: cross-validation, R&W sec. 5.3), where the hyperparameters are
    learnt and :math:`N` exceeds the learning subset (:math:`\lfloor\sqrt{10^7 / C}\rfloor` rows by default) by at
    least ``min_validation_points``; under ``"sparse_ep"``, beyond the :math:`M_c = \lfloor\sqrt{10^6 / C}\rfloor`
    rows (at most half of them) each candidate is learnt on by dense EP
    (:func:`~gpytorch_iterncgp.learning.fit.fit_minibatch_mll`'s ``kernels=``), stochastic EP then learning the
    chosen one on all the data. Otherwise ``("matern",)``, :func:`default_kernel` alone. Data within the learning
    subset still hold rows out (:func:`~.rows.auto_learning_size`), for the outputscale and the check against a
    constant predictor; the choice is not made there for its cost (the candidates' exact evidence at up to
    :math:`10^3` rows dominates such a fit; ``docs/design_notes.md``, "Held-out rows on data within the subset").

    Why these three and this rule (``docs/design_notes.md``, "``kernel="auto"`` is the estimators' default"): on
    the tabular panel the linear part lowered the
    test log-loss on average and by up to a half (texture), the learnt warping of the features by up to a fifth
    (spambase's heavy-tailed word frequencies), and the held-out score chose well where the evidence and BIC did not
    (of nested kernels the evidence keeps the larger; BIC kept the Matérn on five of seven sets; on overdispersed
    counts the evidence rewards a rough latent function); the ARD forms gained less and cost two to ten times as
    much to learn, and the additive kernel costs :math:`D` times the Matérn's work per evaluation.

    :param inference: the inference in use (``"laplace"``, ``"ep"`` or ``"sparse_ep"``).
    :param learn: whether the hyperparameters are learnt (``optimizer_steps > 0``).
    :param num_points: :math:`N`; ``num_latents``: :math:`C`.
    :param learning_subset: the estimator's ``learning_subset`` (``"auto"``, ``None`` or a number of rows).
    :param min_validation_points: the fewest held-out rows a choice is made on, and ``held_out_fraction`` the share
        of the rows held out on data within the learning subset (:class:`~gpytorch_iterncgp.LearningRecipe`'s).
    :return: ``(names, reason)``: the names (one: no choice) and why (a clause, for the estimators'
        ``kernel_choice_``, a :class:`KernelChoice`).
    """
    if not learn:
        return ("matern",), "the hyperparameters are not learnt (nothing to choose by)"
    if inference == "sparse_ep":  # the choice's own rows: M_c learnt on (at most half the data), as many held out
        size, learnt = min(auto_choice_size(num_latents), num_points // 2), "the choice would learn each kernel"
    else:
        size = auto_subset_size(num_latents) if learning_subset == "auto" else learning_subset
        learnt = "the hyperparameters are learnt"
    if not holds_out_rows(num_points, size, min_validation_points):
        within = learning_subset == "auto" and inference != "sparse_ep"
        if within and auto_learning_size(num_points, num_latents, min_validation_points, held_out_fraction):
            return ("matern",), (
                f"the {num_points} points are within the learning subset of {size} points plus "
                f"{min_validation_points} held out (the choice among kernels is made past it)"
            )
        rows = f"all {num_points}" if size is None or size >= num_points else f"{size} of the {num_points}"
        return ("matern",), (
            f"{learnt} on {rows} points, leaving fewer than {min_validation_points} held-out points to choose by"
        )
    return AUTO_KERNELS, f"chosen among {', '.join(map(repr, AUTO_KERNELS))} by the held-out score"


def solver_budget(
    policy: str | Policy,
    max_solver_iterations: str | int | None,
    solver_tol: float,
    num_points: int,
    num_latents: int = 1,
    inference: str = "laplace",
) -> dict:
    r"""Resolve ``policy`` and ``max_solver_iterations`` (each may be ``"auto"``) for :math:`N` ``num_points`` of
    :math:`C` ``num_latents`` latent values each and the ``inference``. With ``max_solver_iterations="auto"``:

    * :math:`N C \le` :data:`~.thresholds.EXACT_SOLVE_SIZE` (1000) and ``policy`` ``"auto"`` or ``"unit"``:
      unit-vector actions until the approximate precision :math:`\mathbf C` has full rank (no iteration budget,
      tolerance 0): the exact Laplace posterior, ``exact=True``;
    * :math:`N C \le` :data:`~.thresholds.EXACT_SOLVE_SIZE` with another policy: no iteration budget, each solve
      until its residual is below ``solver_tol``;
    * EP (``inference="ep"``) with :math:`C = 1` and :math:`N >` :data:`~.thresholds.EP_POINTS_PER_BUDGET` (10 000):
      CG, :data:`DEFAULT_SOLVER_ITERATIONS` (5) iterations per sweep for every
      :data:`~.thresholds.EP_POINTS_PER_BUDGET` points, rounded up (:math:`5 \lceil N / 10^4 \rceil`: 10 at
      :math:`N = 10\,001`, 15 at :math:`N = 25\,000`);
    * otherwise: CG, at most :data:`DEFAULT_SOLVER_ITERATIONS` iterations per Newton step (EP sweep).

    ``policy="auto"`` is ``"unit"`` in the first case, ``"cg"`` otherwise; a policy or iteration budget given explicitly
    is kept as given (``max_solver_iterations`` set: ``solver_tol`` kept, ``exact=False``).

    :param policy: ``"auto"``, ``"cg"``, ``"unit"`` or a :class:`~gpytorch_iterncgp.Policy`.
    :param max_solver_iterations: ``"auto"``, an iteration budget per Newton step (EP sweep), or ``None`` (until the
        residual is below ``solver_tol``).
    :param solver_tol: IterGP's absolute and relative residual tolerance.
    :param num_points: :math:`N`.
    :param num_latents: :math:`C`.
    :param inference: ``"laplace"`` or ``"ep"``.
    :return: a dict: ``policy``, ``max_solver_iterations`` and ``solver_tol`` as passed to the strategy, ``exact``
        (whether every solve runs until :math:`\mathbf C` has full rank) and ``rule`` (a sentence saying which case).
    """
    auto_policy = is_string(policy, "auto")
    auto_iterations = is_string(max_solver_iterations, "auto")
    num_latent_values = num_points * num_latents
    small = num_latent_values <= EXACT_SOLVE_SIZE
    chosen = ("unit" if small and auto_iterations else "cg") if auto_policy else policy
    iterations, tolerance, exact = max_solver_iterations, float(solver_tol), False
    if auto_iterations and small and chosen == "unit":
        # Unit vectors up to full rank: C = (K + W^-1)^-1 on the action space, the exact Laplace posterior.
        iterations, tolerance, exact = None, 0.0, True
        rule = (
            f"N C = {num_latent_values} <= {EXACT_SOLVE_SIZE}: unit-vector actions until C has full rank "
            "(exact Laplace posterior)"
        )
    elif auto_iterations and small:
        iterations = None
        rule = (
            f"N C = {num_latent_values} <= {EXACT_SOLVE_SIZE}, policy {chosen!r}: each solve until the residual is "
            f"below solver_tol = {tolerance:g}"
        )
    elif auto_iterations and inference == "ep" and num_latents == 1 and num_points > EP_POINTS_PER_BUDGET:
        iterations = DEFAULT_SOLVER_ITERATIONS * math.ceil(num_points / EP_POINTS_PER_BUDGET)
        rule = (
            f"N = {num_points} > {EP_POINTS_PER_BUDGET} points of one latent value: at most {iterations} "
            f"solver iterations per EP sweep, {DEFAULT_SOLVER_ITERATIONS} for every {EP_POINTS_PER_BUDGET} points "
            "(computational uncertainty in the posterior)"
        )
    elif auto_iterations:
        iterations = DEFAULT_SOLVER_ITERATIONS
        rule = (
            f"N C = {num_latent_values} > {EXACT_SOLVE_SIZE}: at most {iterations} solver iterations per Newton "
            "step (computational uncertainty in the posterior)"
        )
    else:
        rule = "max_solver_iterations set by the user"
    return dict(policy=chosen, max_solver_iterations=iterations, solver_tol=tolerance, exact=exact, rule=rule)


#: the strategy options the estimators set from parameters of their own (``solver_options`` refuses them)
ESTIMATOR_SET_OPTIONS = {"train_fit_steps": "train_fit_steps", "seed": "random_state", "show_progress": "verbose"}


def _strategy_type(inference: str) -> type[IterNCGPStrategy] | type[EPStrategy]:
    """The dense strategy of ``inference`` (``"laplace"`` or ``"ep"``)."""
    return EPStrategy if inference == "ep" else IterNCGPStrategy


def solver_option_names(inference: str) -> tuple[str, ...]:
    """The keys ``solver_options`` takes under ``inference`` (``"laplace"`` or ``"ep"``): ``policy`` and the fields
    of the strategy's options (:class:`~gpytorch_iterncgp.SolverOptions`, EP's ``EPOptions``), by their names there,
    but those the estimators set from their own parameters (:data:`ESTIMATOR_SET_OPTIONS`)."""
    fields = [field.name for field in dataclasses.fields(_strategy_type(inference)._options_type)]
    return ("policy", *(name for name in fields if name not in ESTIMATOR_SET_OPTIONS))


def checked_solver_options(estimator: str, solver_options: Any, inference: str) -> dict:
    """``solver_options`` (``None`` or a mapping) as a dict, its keys checked against :func:`solver_option_names`.

    :raises ValueError: for another type, or a key that is no option of ``inference``'s strategy (naming the
        estimator parameter where it is one, the keys otherwise).
    """
    if solver_options is None:
        return {}
    if not isinstance(solver_options, Mapping):
        raise ValueError(
            f"The 'solver_options' parameter of {estimator} must be a dict of the solver's options or None, got "
            f"{solver_options!r}."
        )
    names = solver_option_names(inference)
    for key in solver_options:
        if key in ESTIMATOR_SET_OPTIONS:
            raise ValueError(
                f"{estimator}: solver_options[{key!r}] is set by the estimator's parameter "
                f"{ESTIMATOR_SET_OPTIONS[key]}=; give it there."
            )
        if key not in names:
            raise ValueError(
                f"{estimator}: solver_options[{key!r}] is no option of {_strategy_type(inference).__name__} "
                f"(inference={inference!r}); its options are {', '.join(names)}."
            )
    return dict(solver_options)


def _check_solver_values(estimator: str, options: Mapping[str, Any], inference: str) -> None:
    """The values of ``options`` (strategy options by name) as the strategy checks them; ``"auto"`` is the
    estimators' rule for ``policy`` and ``max_solver_iterations``.

    :raises ValueError: with the strategy's message.
    """
    policy = options.get("policy", "auto")
    values = {key: value for key, value in options.items() if key != "policy" and not is_string(value, "auto")}
    try:
        if not is_string(policy, "auto"):
            make_policy(policy)
        replaced_options(_strategy_type(inference)._options_type(), values, f"{estimator}'s solver_options")
    except (TypeError, ValueError) as error:
        raise ValueError(f"The 'solver_options' parameter of {estimator} is invalid: {error}") from error


def former_solver_options(estimator: str, former: Mapping[str, Any], inference: str, stacklevel: int) -> dict:
    """The deprecated solver parameters given (those of :data:`FORMER_SOLVER_PARAMETERS` not
    :data:`~gpytorch_iterncgp.core.validation.DEPRECATED`) as ``solver_options`` under ``inference``, with one
    ``FutureWarning`` naming each and its key: ``max_newton_steps`` is EP's ``max_sweeps``; ``outer_tol`` is EP's
    ``site_tol`` (then the sites' test alone, ``marginal_tol=None``, as before); ``solver_tol`` is ``abs_tol`` and
    ``rel_tol`` (returned as ``"solver_tol"``: :func:`solver_budget` reads it, as it read the parameter).

    :param stacklevel: of the warning, counted from this function.
    """
    given = {name: value for name, value in former.items() if not is_string(value, DEPRECATED)}
    if not given:
        return {}
    ep = inference == "ep"
    options: dict[str, Any] = {}
    named = []
    for name, value in given.items():
        keys = _as_solver_options(name, value, ep)
        options.update(keys)
        key = "'abs_tol' and 'rel_tol'" if name == "solver_tol" else repr(next(iter(keys)))
        named.append(f"{name}= as solver_options[{key}]")
    warnings.warn(
        f"{estimator}: the solver's parameters are deprecated and will be removed in a future release; give "
        f"{', '.join(named)} (solver_options takes the strategy's options by their names).",
        FutureWarning,
        stacklevel=stacklevel,
    )
    return options


def _as_solver_options(name: str, value: Any, ep: bool) -> dict[str, Any]:
    """The former parameter ``name`` given ``value`` as ``solver_options`` (EP's names under ``ep``)."""
    if ep and name == "max_newton_steps":
        return {"max_sweeps": value}
    if ep and name == "outer_tol":
        return {"site_tol": value, "marginal_tol": None}
    return {name: value}


def solver_settings(
    estimator: str,
    solver_options: Any,
    former: Mapping[str, Any],
    inference: str,
    num_points: int,
    num_latents: int,
    *,
    seed: int,
    train_fit_steps: int,
    show_progress: bool,
    stacklevel: int,
) -> tuple[dict, dict]:
    """The solver budget (:func:`solver_budget`) and the strategy's keyword arguments (:func:`strategy_options`) of
    an estimator's ``solver_options`` (:func:`checked_solver_options`) and its deprecated solver parameters
    (:func:`former_solver_options`; refused beside ``solver_options`` keys they would set), under ``inference``.

    :raises ValueError: as :func:`checked_solver_options`, for a former parameter beside its key, or for a value
        the strategy refuses (its message).
    """
    options = checked_solver_options(estimator, solver_options, inference)
    former_options = former_solver_options(estimator, former, inference, stacklevel + 1)
    both = sorted(set(options) & set(former_options))
    if both or ("solver_tol" in former_options and {"abs_tol", "rel_tol"} & set(options)):
        raise ValueError(
            f"{estimator}: solver_options and the deprecated solver parameters both set "
            f"{', '.join(both) or 'the tolerances'}; give solver_options alone."
        )
    tolerance = former_options.pop("solver_tol", ESTIMATOR_DEFAULTS.solver_tol)
    options.update(former_options)
    _check_solver_values(estimator, {"abs_tol": tolerance, **options}, inference)
    budget = solver_budget(
        options.pop("policy", ESTIMATOR_DEFAULTS.policy),
        options.pop("max_solver_iterations", ESTIMATOR_DEFAULTS.max_solver_iterations),
        tolerance,
        num_points,
        num_latents,
        inference,
    )
    settings = strategy_options(
        budget, inference, seed=seed, train_fit_steps=train_fit_steps, show_progress=show_progress
    )
    return budget, {**settings, **options}


def strategy_options(
    budget: Mapping[str, Any],
    inference: str,
    *,
    seed: int,
    train_fit_steps: int,
    show_progress: bool,
) -> dict:
    """The keyword arguments of the strategy (:class:`~gpytorch_iterncgp.IterNCGPStrategy` or
    :class:`~gpytorch_iterncgp.EPStrategy`) that the estimators' rules set, before ``solver_options``: the budget's
    policy and iterations, its tolerance as both ``abs_tol`` and ``rel_tol``, and under EP with exact solves
    (``budget["exact"]``: a few hundred latent values, where exact EP is cheap and its evidence exact) the
    marginals' test at :data:`~.thresholds.EXACT_MARGINAL_TOL` (elsewhere the strategy's default ``marginal_tol``).
    The policy is copied, so that a :class:`~gpytorch_iterncgp.Policy` given to the estimator is not advanced by its
    fits.

    :param budget: :func:`solver_budget`'s result.
    :param inference: ``"laplace"`` or ``"ep"``.
    :param seed: the strategy's seed (unit-vector policy, probe vectors).
    :return: a dict of the strategy's keyword arguments.
    """
    options = dict(
        policy=copy.deepcopy(budget["policy"]),
        max_solver_iterations=budget["max_solver_iterations"],
        train_fit_steps=int(train_fit_steps),
        abs_tol=budget["solver_tol"],
        rel_tol=budget["solver_tol"],
        seed=seed,
        show_progress=bool(show_progress),
    )
    if inference == "ep" and budget["exact"]:
        options["marginal_tol"] = EXACT_MARGINAL_TOL
    return options


def evidence_class(strategy: Any) -> type[LaplaceMarginalLogLikelihood] | type[EPMarginalLogLikelihood]:
    """The evidence of the strategy's approximation: :class:`~gpytorch_iterncgp.EPMarginalLogLikelihood` for an
    :class:`~gpytorch_iterncgp.EPStrategy`, :class:`~gpytorch_iterncgp.LaplaceMarginalLogLikelihood` otherwise."""
    return EPMarginalLogLikelihood if isinstance(strategy, EPStrategy) else LaplaceMarginalLogLikelihood
