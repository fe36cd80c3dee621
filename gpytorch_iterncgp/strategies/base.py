r"""What every strategy of the package shares, whatever its outer loop: :class:`OuterLoopStrategy`, the owner of the
committed state of a fit.

A strategy fits by running an outer loop (damped Newton, EP, EP-DTC; see :mod:`~gpytorch_iterncgp.core.outer_loop`)
through :func:`~gpytorch_iterncgp.core.outer_loop.run_outer_loop`, which hands it every completed step's state to
commit. The committed state belongs to the hyperparameters it was fitted at: their *fingerprint* (every parameter,
flattened) is stored with it, and :meth:`OuterLoopStrategy.ensure_fitted` refits when they changed. Commit, rewind,
fingerprint, save and load are one component, :class:`~gpytorch_iterncgp.core.state.CommittedState`, that the
strategy holds (and models that are not strategies hold too); :func:`converge` runs a loop for a caller that keeps
only its final state.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import gpytorch
import torch
from torch import Tensor

from .. import settings
from ..core.memory import retained_allocations
from ..core.outer_loop import FitReport, OuterLoop, ProductCounter, run_outer_loop
from ..core.state import CommittedState, Companion, parameter_fingerprint
from ..core.validation import check_flag, check_inputs
from ..likelihoods.adapters import likelihood_adapter
from .saved_state import SavedCommittedState


def replaced_options(options: Any, changes: Mapping[str, Any], caller: str) -> Any:
    """A validated copy of the dataclass ``options`` with ``changes``.

    :param caller: named in the error (e.g. ``"IterNCGPStrategy"``, ``"EPStrategy.fit"``).
    :raises TypeError: naming the changes that are not fields of ``options``, and the fields there are.
    :raises ValueError: for a value out of range (the options' ``validate``).
    """
    names = {field.name for field in dataclasses.fields(options)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise TypeError(
            f"{caller} got unknown option(s) {', '.join(map(repr, unknown))}; the options of "
            f"{type(options).__name__} are: {', '.join(sorted(names))}."
        )
    replaced = dataclasses.replace(options, **changes)
    replaced.validate()
    return replaced


def exact_regime(strategy: Any) -> bool:
    r"""Whether a strategy's evidence is computed densely by default: exact and deterministic for
    :math:`N C \le` :class:`gpytorch_iterncgp.settings.exact_evidence_size`."""
    return strategy.num_data * strategy.num_latents <= settings.exact_evidence_size.value()


def converge(
    loop: OuterLoop, start: Any, counter: ProductCounter, max_steps: int | None, stacklevel: int = 2
) -> tuple[Any, FitReport]:
    """Run ``loop`` from ``start`` by :func:`~gpytorch_iterncgp.core.outer_loop.run_outer_loop`, without progress
    bar or callback, for a caller that keeps only the final state.

    :param loop: the outer loop.
    :param start: its starting state (e.g. warm-started sites).
    :param counter: the prior whose products with K the report counts.
    :param max_steps: the most steps (``None``: until converged or stalled).
    :param stacklevel: of the loop's warnings, counted from the caller of this function.
    :return: the last committed (finalised) state and the report.
    """
    committed = [start]
    report = run_outer_loop(
        loop, start, committed.append, counter, max_steps, show_progress=False, stacklevel=stacklevel + 1
    )
    return committed[-1], report


def checked_training_data(adapter: Any, train_inputs: Tensor, train_targets: Tensor) -> tuple[Tensor, Tensor]:
    """The training inputs ``(N, D)`` and the targets checked by the likelihood's ``adapter``, of one length and device.

    :raises ValueError: for data of different lengths or devices (or targets outside the likelihood's support).
    """
    if torch.is_tensor(train_inputs) and torch.is_tensor(train_targets):
        if train_targets.device != train_inputs.device:
            raise ValueError(
                f"train_targets are on {train_targets.device} but train_inputs on {train_inputs.device}: "
                "put both on one device."
            )
    train_inputs = check_inputs(train_inputs, "train_inputs")
    targets = adapter.check_targets(train_targets, train_inputs.dtype)
    if len(targets) != len(train_inputs):
        raise ValueError(
            f"train_inputs has {len(train_inputs)} points but train_targets has {len(targets)}: they must match."
        )
    return train_inputs, targets


def attach_to_model(strategy: torch.nn.Module, model: Any, likelihood: Any) -> None:
    """Give ``strategy`` its ``model`` and ``likelihood`` without making them submodules (the model owns the strategy).

    :raises TypeError: for a ``model`` that is not a ``torch.nn.Module``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model must be the gpytorch ApproximateGP that owns the strategy (pass self), got {type(model).__name__}."
        )
    object.__setattr__(strategy, "model", model)
    object.__setattr__(strategy, "likelihood", likelihood)


@contextlib.contextmanager
def _swapped(owner: Any, name: str, value: Any) -> Iterator[Any]:
    """``owner.name`` is ``value`` inside the ``with`` block (which it yields), as it was after it."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield value
    finally:
        setattr(owner, name, saved)


def _show_progress(callback: Callable | None, show_progress: bool | None, default: bool) -> bool:
    """Check ``fit``'s ``callback`` and ``show_progress``; return whether to show progress (``None``: ``default``).

    :raises TypeError: for a callback that is not callable.
    """
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable (step, state) -> bool | None, got {type(callback).__name__}.")
    if show_progress is not None:
        check_flag(show_progress, "show_progress")
    return default if show_progress is None else show_progress


class OuterLoopStrategy(SavedCommittedState, metaclass=abc.ABCMeta):
    r"""A ``VariationalStrategy`` replacement that fits by an outer loop: the committed state (a
    :class:`~gpytorch_iterncgp.core.state.CommittedState`), refitting when it is stale, driving a fit, its report,
    ``state_dict`` and devices.

    It knows no particular loop. **The contract** (written here once): a concrete subclass

    * names its state, options and step limit: the class attributes :attr:`_state_type` (an
      :class:`~gpytorch_iterncgp.core.state.ExtraState`), :attr:`_options_type` (a dataclass with ``validate()``: every
      option is one of its fields, given to the constructor by name and overridden in :meth:`fit` by the same name) and
      :attr:`max_steps_option` (the field that limits a fit's steps), checked when one is built;
    * builds its prior in :meth:`_prior_for_fit` and its loop in :meth:`_make_loop` (abstract);
    * predicts: ``forward`` (``model(x)``), :meth:`marginal_latent` and :meth:`marginal_latent_blocks` (abstract; the
      predictive follows from them, :class:`~gpytorch_iterncgp.strategies.predictive.LatentPredictions`),

    and may override what the state depends on besides the parameters of model and likelihood
    (:meth:`_fingerprint_tensors`), checks of a fit's options (:meth:`_check_fit`) and the options of a loose fit in
    train mode (:meth:`_loose_fit_options`).

    :param model: the ``ApproximateGP`` that owns the strategy (not a submodule of it).
    :param train_inputs: :math:`\mathbf X`, ``(N, D)`` (or ``(N,)``).
    :param train_targets: ``(N,)`` (or ``(N, C)``), checked by the likelihood's adapter.
    :param likelihood: the GPyTorch likelihood.
    :param min_curvature: the adapter's lower bound on the curvature (``None``: its default).
    :param show_progress: show a tqdm progress bar in ``fit``.
    :param companion: what is committed beside the state (a policy), or ``None``.
    :param options: by name, fields of :attr:`_options_type` (its defaults for the others; validated here).
    :raises ValueError: for data of different lengths or devices, or an option out of range.
    :raises TypeError: for a ``model`` that is not a ``torch.nn.Module``, or an unknown option.
    """

    _state_type: Any = None  # the ExtraState of the committed state
    _options_type: Any = None  # the dataclass of the strategy's options (every constructor keyword option)
    #: the option of :attr:`options` that limits the outer loop's steps in a fit (``"max_newton_steps"``, ``"max_sweeps"``)
    max_steps_option: str = ""
    options: Any

    @classmethod
    def _check_contract(cls) -> None:
        """:raises TypeError: for a strategy class that does not name its state, options and step limit (the contract,
        class docstring; the abstract methods are ABC's to check)."""
        if cls._state_type is None or cls._options_type is None:
            raise TypeError(f"{cls.__name__} must set _state_type and _options_type (OuterLoopStrategy's contract).")
        fields = {field.name for field in dataclasses.fields(cls._options_type)}
        if cls.max_steps_option not in fields:
            raise TypeError(
                f"{cls.__name__}.max_steps_option must name a field of {cls._options_type.__name__} (the option that "
                f"limits a fit's steps), got {cls.max_steps_option!r}."
            )

    def __init__(
        self,
        model: gpytorch.models.ApproximateGP,
        train_inputs: Tensor,
        train_targets: Tensor,
        likelihood: gpytorch.likelihoods.Likelihood,
        *,
        min_curvature: float | None = None,
        show_progress: bool = True,
        companion: Companion | None = None,
        **options: Any,
    ):
        self._check_contract()
        options_object = replaced_options(self._options_type(), options, type(self).__name__)
        super().__init__()
        attach_to_model(self, model, likelihood)
        self.adapter = likelihood_adapter(likelihood, min_curvature)
        train_inputs, targets = checked_training_data(self.adapter, train_inputs, train_targets)
        check_flag(show_progress, "show_progress")
        self.register_buffer("train_inputs", train_inputs, persistent=False)
        self.register_buffer("train_targets", targets, persistent=False)
        self.options = options_object
        self.show_progress = show_progress
        self._committed = CommittedState(self._state_type, companion)  # the state, its fingerprint, the companion's
        self._loose = False  # the committed state is a loose fit's (train mode), not converged
        self.last_report: FitReport | None = None

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def num_data(self) -> int:
        """:math:`N`, the number of training points."""
        return self.train_inputs.shape[0]

    @property
    def num_latents(self) -> int:
        """:math:`C`, the number of latent functions (1 for binary and count data)."""
        return self.adapter.num_latents

    @property
    def state(self) -> Any:
        """The committed state of the outer loop, or ``None`` before fitting."""
        return self._committed.state

    # -- the committed state ---------------------------------------------------------------------
    def _fingerprint_tensors(self) -> list[Tensor]:
        """What the state depends on besides the data: the parameters of model and likelihood."""
        return [*self.model.parameters(), *self.likelihood.parameters()]

    def _is_current(self) -> bool:
        """Whether a state is committed and belongs to the current hyperparameters."""
        return self._committed.is_current(parameter_fingerprint(self._fingerprint_tensors(), self.train_inputs))

    def _commit(self, state: Any) -> None:
        """Make ``state`` the committed state, for the current hyperparameters (every completed step)."""
        self._committed.commit(state, parameter_fingerprint(self._fingerprint_tensors(), self.train_inputs))

    def _starting_state(self, loop: OuterLoop) -> Any:
        """The state to continue from: the loop's initial state, the committed one, or (if the hyperparameters
        changed) the committed one renewed by the loop."""
        state = self._committed.state
        if state is None:
            return loop.initial_state()
        return state if self._is_current() else loop.renew(state)

    def ensure_fitted(self) -> Any:
        """The state for the current hyperparameters: fitted (without progress bar) if it is missing or stale.

        Every prediction calls it, so predictions before ``fit()``, or after a change of a hyperparameter, fit first.
        In train mode (``model(train_x)`` in a training loop) a stale state is continued by a :meth:`loose_fit` where
        the strategy takes one; in eval mode a loose state is fitted on to convergence first.
        """
        if self._is_current() and (self.training or not self._loose):
            return self._committed.state
        if not (self.training and self._committed.state is not None and self.loose_fit()):
            self.fit(show_progress=False)
        assert self._committed.state is not None  # fit() always commits (the starting state, if no step was taken)
        return self._committed.state

    def loose_fit(self) -> bool:
        """A fit of a few steps from the committed state (or the prior), without a ``ConvergenceWarning`` at its
        limits, where :meth:`_loose_fit_options` gives one (the options ``train_fit_steps`` and
        ``train_compression_rank``, :class:`~gpytorch_iterncgp.core.outer_loop.TrainModeFits`): the posterior follows
        the hyperparameters loosely while they are learnt. Returns whether it ran; a prediction in eval mode fits the
        loose state on to convergence."""
        loose = self._loose_fit_options()
        if not loose:
            return False
        self.fit(show_progress=False, limit_warning=False, **loose)
        self._loose = True
        return True

    def _loose_fit_options(self) -> dict[str, Any]:
        """The option changes of a loose fit in train mode (``{}``: fit whole); none here."""
        return {}

    @contextlib.contextmanager
    def overriding(self, **changes: Any) -> Iterator[Any]:
        """The strategy's options with ``changes`` (validated, ``None`` included as a value) inside the ``with`` block,
        as they were after it; yields the options in force.

        .. code-block:: python

            with model.variational_strategy.overriding(max_newton_steps=2, compression_rank=20):
                loss = -mll(model(train_x), train_y)

        :raises ValueError: for an option out of range; :raises TypeError: for a name that is not an option.
        """
        with _swapped(self, "options", replaced_options(self.options, changes, f"{type(self).__name__}.overriding")):
            yield self.options

    def fit(
        self,
        callback: Callable[[Any, Any], bool | None] | None = None,
        show_progress: bool | None = None,
        *,
        description: str | None = None,
        limit_warning: bool = True,
        **overrides,
    ) -> FitReport:
        """Run the outer loop from the committed state until it converges, stalls, or reaches a limit (its step limit,
        ``max_time``; by default neither is set: budgets by convergence).

        Calling it again continues where the last call stopped (the committed state, its recycled actions). The
        ``overrides`` change the strategy's options for this call only: any field of :attr:`options` (e.g.
        ``max_newton_steps=5``, ``max_sweeps=10``, ``max_solver_iterations=None`` for solves to the tolerances,
        ``site_tol=1e-6``).

        :param callback: called after every step with its record (:class:`~gpytorch_iterncgp.NewtonStep`,
            :class:`~gpytorch_iterncgp.EPSweep`) and the state; returning ``True`` stops.
        :param show_progress: a progress bar (``None``: the strategy's ``show_progress``).
        :param description: what the fit is for, on its progress bar (``"final fit"``: ``"final fit (EP)"``).
        :param limit_warning: ``False`` for a fit whose limits are by design (a loose fit, a candidate's short fit): no
            ``ConvergenceWarning`` where a limit stops it (a stall still warns).
        :return: a :class:`~gpytorch_iterncgp.FitReport` (steps, solver iterations, products with K, time).

        Interruption: the state is replaced only after each completed step. A fit stopped by the callback, or by an
        exception such as ``KeyboardInterrupt`` (also one raised inside the callback), keeps the state of the last
        completed step (and the unit-vector policy its position there), so that ``fit()`` resumes from it, and a
        ``state_dict()`` saved then (or inside the callback) resumes in a fresh model exactly as the uninterrupted
        fit continues. A fit stopped by a limit (the step limit or ``max_time``, the strategy's or this call's) raises a
        :class:`~gpytorch_iterncgp.ConvergenceWarning` naming it; one that stalls (no progress in
        :data:`~gpytorch_iterncgp.core.outer_loop.STALL_STEPS` steps) a :class:`~gpytorch_iterncgp.NotConvergedWarning`.

        :raises TypeError: for an unknown option, a callback that is not callable, or a model computing in another
            dtype.
        :raises ValueError: for an option out of range, or model parameters on another device than the data.
        """
        options = replaced_options(self.options, overrides, f"{type(self).__name__}.fit")
        show = _show_progress(callback, show_progress, self.show_progress)
        with torch.no_grad(), retained_allocations():
            self._check_model_device()
            prior = self._prior_for_fit()
            if prior.dtype != self.train_inputs.dtype:
                raise TypeError(
                    f"The model computes in {prior.dtype} but train_inputs are {self.train_inputs.dtype}: "
                    "convert the model and the data to one dtype."
                )
            self._check_fit(options, prior)
            limit_name = self.max_steps_option if limit_warning else None
            return self._run(prior, options, callback, show, description, limit_name)

    @abc.abstractmethod
    def _prior_for_fit(self) -> Any:
        """The prior at the training inputs the loop runs on (with a ``dtype``; the model is on the data's device)."""

    def _check_fit(self, options: Any, prior: Any) -> None:
        """Checks of a fit's options against its prior (warnings); none here."""

    # -- driving a fit ---------------------------------------------------------------------------
    def _check_model_device(self) -> None:
        """:raises ValueError: for a parameter of model or likelihood on another device than the data."""
        device = self.train_inputs.device
        for name, parameter in [*self.model.named_parameters(), *self.likelihood.named_parameters()]:
            if parameter.device != device:
                raise ValueError(
                    f"The model's parameter {name} is on {parameter.device} but train_inputs on {device}: move the "
                    "model (model.to(device)) and the likelihood to the device of the data."
                )

    @abc.abstractmethod
    def _make_loop(self, prior: Any, options: Any) -> OuterLoop:
        """The outer loop for ``prior`` (the model's prior at the training inputs) and ``options``."""

    def _run(
        self, prior: ProductCounter, options: Any, callback, show: bool, description: str | None, limit_name: str | None
    ) -> FitReport:
        """Drive the subclass's outer loop from the starting state by ``run_outer_loop``, at most the options' step
        limit (:attr:`max_steps_option`) and ``max_time``; the committed state follows every step, and an interrupted
        fit keeps the last completed one.

        :param prior: the prior at the training inputs (also the counter of products with K).
        :param options: this call's options.
        :param callback: called after every step with its record and state; ``True`` stops.
        :param show: show a progress bar.
        :param description: what the fit is for, on the progress bar (``None``: nothing).
        :param limit_name: the step limit's name for the warning of a fit it stops (``None``: no warning).
        :return: the report, also kept as :attr:`last_report`.
        """
        loop = self._make_loop(prior, options)
        state = self._starting_state(loop)
        try:
            report = run_outer_loop(
                loop,
                state,
                commit=self._commit,
                counter=prior,
                max_steps=getattr(options, self.max_steps_option),
                callback=callback,
                show_progress=show,
                stacklevel=3,
                description=None if description is None else f"{description} ({loop.name})",
                limit_name=limit_name,
                max_time=options.max_time,
            )
        except BaseException:
            # Interrupted (KeyboardInterrupt, an error in the callback, ...): the state is that of the last
            # completed step; put back what belongs to it.
            self._committed.rewind()
            raise
        self._loose = False
        self.last_report = report
        return report

    @abc.abstractmethod
    def forward(self, inputs: Tensor, **kwargs: Any) -> Any:
        """``model(x)``: the posterior of the latents at ``inputs`` (the model's distribution type)."""

    @abc.abstractmethod
    def marginal_latent(self, inputs: Tensor) -> tuple[Tensor, Tensor]:
        """Posterior means and variances of the latents at ``inputs`` ``(N*, D)``, ``(N*, C)`` each."""

    @abc.abstractmethod
    def marginal_latent_blocks(self, inputs: Tensor) -> tuple[Tensor, Tensor]:
        """Posterior means ``(N*, C)`` and each test point's latent covariance ``(N*, C, C)``."""
