r"""The outer loop: damped Newton's method as a sequence of GP regressions (paper, Algorithm 1).

With :math:`\mathbf f = \mathbf m + \mathbf K \mathbf a`, step :math:`i` computes
:math:`\mathbf W_i = \mathbf W(\mathbf f_i)`, the pseudo-targets
:math:`\hat{\mathbf y}_i = \mathbf f_i + \mathbf W_i^{-1} \mathbf g(\mathbf f_i)` and solves the regression
:math:`(\mathbf K + \mathbf W_i^{-1}) \mathbf v_i = \hat{\mathbf y}_i - \mathbf m` with IterGP, recycling
the actions of the earlier steps. The candidate :math:`\mathbf f_{i+1} = \mathbf m + \mathbf K \mathbf v_i`
is accepted if it increases the log posterior

.. math::
    \Psi(\mathbf f) = \ell(\mathbf f) - \tfrac12 (\mathbf f - \mathbf m)^\top \mathbf a ,

or if :math:`\Psi` still rises at it along the step (:math:`\Psi` is concave in :math:`\mathbf a`; this decides
where the change is below the rounding of :math:`\Psi`), otherwise the step is halved, :math:`\mathbf a \leftarrow \mathbf a_i + \alpha (\mathbf v_i - \mathbf a_i)`,
:math:`\alpha = \tfrac12, \tfrac14, \dots` (damping, a backtracking line search: the undamped iteration can diverge where
:math:`\Psi` is far from quadratic). :math:`\mathbf K \mathbf v_i` comes from the solver's buffers, so :math:`\Psi` costs no
product with :math:`\mathbf K`. The loop stops when
:math:`\|\mathbf a_{i+1} - \mathbf a_i\| \le \text{outer\_tol} \, \|\mathbf a_i\|` for the full step, provided
that step was a real Newton step (IterGP solved its system, or :math:`\mathbf a = \nabla \log p(\mathbf y \mid
\mathbf f)`, the first-order condition of the mode, holds to ``outer_tol``), or when a solved step promises
a gain in :math:`\Psi` (half the Newton decrement) below its resolution.

:class:`DampedNewton` is an *outer loop*: :meth:`DampedNewton.steps` is a generator that yields one
:class:`OuterStep` per completed Newton step (its record, the new :class:`LaplaceState`, and whether the loop
has converged or cannot go on). It never warns, shows progress or counts products itself: the driver
:func:`~gpytorch_iterncgp.core.outer_loop.run_outer_loop` does that for any outer loop. Each yielded state holds
everything the next step needs (:class:`NewtonControl`: the forcing term that scales IterGP's tolerances), so a
fit interrupted after a step, and resumed, repeats an uninterrupted fit exactly.

After the loop, a virtual solver run at :math:`\mathbf W(\hat{\mathbf f})` over all buffered actions makes the
approximate precision :math:`\mathbf C = \mathbf Q \mathbf Q^\top` that of the final mode (no product with
:math:`\mathbf K`), so that the posterior covariance is :math:`\mathbf K - \mathbf K \mathbf C \mathbf K`; with
``covariance_iterations > 0`` the covariance phase (:mod:`~gpytorch_iterncgp.core.covariance`) then enlarges
:math:`\mathbf C` by that many blocks of actions chosen for the covariance, one product with :math:`\mathbf K` each.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from linear_operator.operators import LinearOperator
from torch import Tensor

from ..core.covariance import CovarianceOptions, covariance_phase
from ..core.deferred import deferred
from ..core.outer_loop import FitLimits, LoopStatus, NewtonStep, OuterStep, TrainModeFits, relative_norm_change
from ..core.policies import Policy
from ..core.preconditioner import KernelPreconditioning
from ..core.prior import LatentPrior
from ..core.recycling import ActionBuffer, virtual_solver_run
from ..core.solver import IterGPOptions, IterGPResult, RegressionState, itergp_solve
from ..core.validation import check_count, check_nonnegative
from ..likelihoods.adapters import LikelihoodAdapter
from .line_search import LogPosterior, Point


@dataclass
class SolverOptions(IterGPOptions, CovarianceOptions, FitLimits, TrainModeFits):
    """Settings of the Newton loop, of IterGP and of the covariance phase (see
    :class:`~gpytorch_iterncgp.IterNCGPStrategy`)."""

    max_newton_steps: int | None = None  # None: until converged, stalled or max_time
    outer_tol: float = 1e-2
    covariance_iterations: int = 5
    min_step_size: float = 2.0**-10

    def validate(self) -> None:
        """:raises ValueError: naming the option that is out of range (or not a number; ``True`` is not a count)."""
        super().validate()
        CovarianceOptions.validate(self)
        FitLimits.validate(self)
        TrainModeFits.validate(self)
        check_count(self.max_newton_steps, "max_newton_steps", allow_none=True)
        check_nonnegative(self.outer_tol, "outer_tol")
        if not 0 < self.min_step_size <= 1:
            raise ValueError(f"min_step_size must lie in (0, 1], got {self.min_step_size!r}.")


@dataclass
class NewtonControl:
    """The Newton loop's own bookkeeping between steps, kept with the state so that a resumed fit repeats an
    uninterrupted one exactly."""

    # Scales IterGP's tolerances in the next step (tightened after a rejected step).
    forcing: float = 1.0
    # The last step was rejected: W is unchanged, and the next solve continues the same system with all its
    # actions (no compression, which would throw away the progress of the rejected solve; docs/design_notes.md).
    same_system: bool = False


@dataclass
class LaplaceState(RegressionState):
    r"""Where the Newton loop stands; all a fitted model needs to predict and to continue.

    The regression's tensors (:class:`~gpytorch_iterncgp.core.solver.RegressionState`: :math:`\mathbf a`,
    :math:`\mathbf K \mathbf a`, :math:`\mathbf Q`, :math:`\mathbf K \mathbf Q`, :math:`\mathbf S`,
    :math:`\mathbf K \mathbf S`) at the current mode, and the loop's own bookkeeping.
    """

    log_posterior: float = -math.inf
    newton_steps: int = 0
    control: NewtonControl = field(default_factory=NewtonControl)  # saved as "forcing" and "same_system"
    gemm_columns: int = 0  # the buffer's ActionBuffer.gemm_columns: how a resumed fit computes its kernel Gram matrix

    saved_by = "IterNCGPStrategy"
    optional_entries = frozenset({"forcing", "same_system", "gemm_columns"})  # not saved by the first versions

    @classmethod
    def initial(cls, size: int, dtype: torch.dtype, device: torch.device) -> LaplaceState:
        r"""The prior: :math:`\mathbf a = \mathbf 0`, no actions."""
        return cls(*cls.prior_tensors(size, dtype, device))


class _NewtonStepTaken(NamedTuple):
    r"""A damped Newton step: its size (0: rejected), the point it reaches, the relative change
    :math:`\|\Delta\mathbf a\| / \|\mathbf a\|` and whether the loop has converged with it."""

    step_size: float
    new: Point
    relative_change: float
    converged: bool


class DampedNewton:
    r"""Damped Newton's method for the Laplace mode, each step a GP regression solved by IterGP (Algorithm 1).

    An outer loop for :func:`~gpytorch_iterncgp.core.outer_loop.run_outer_loop`: :meth:`steps` yields after every
    Newton step, :meth:`finalize` makes the precision that of the final mode.

    :param prior: the GP prior at the training inputs (its matmul is the one product with K).
    :param adapter: the likelihood's derivatives.
    :param targets: validated targets ``(N,)``.
    :param options: tolerances and limits (``max_newton_steps`` is the driver's business).
    :param policy: IterGP's policy (already prepared for the problem size).

    **By rows** (``prior.rows`` sharded, a ``ShardedKernel`` with ``shard_state``): every ``(N C,)`` vector of the loop
    — :math:`\mathbf a`, :math:`\mathbf K \mathbf a`, the mode, the gradient, the right-hand side, the solver's own —
    and the curvature's blocks (the noise :math:`\mathbf W^{-1}` is built from this rank's points) are this rank's rows
    :math:`\mathcal I_p`; :math:`\Psi`, its slopes and the norms of the convergence tests are ``all_reduce`` sums, so
    every rank takes the same steps. A product with :math:`\mathbf K` gathers its right-hand side once and keeps this
    rank's rows of it (``LatentPrior.matmul_by_rows``). In one process the block's reductions are identities: the
    one-process computation.
    """

    def __init__(
        self,
        prior: LatentPrior,
        adapter: LikelihoodAdapter,
        targets: Tensor,
        options: SolverOptions,
        policy: Policy,
    ):
        self.prior, self.adapter, self.options, self.policy = prior, adapter, options, policy
        self.rows_block = block = prior.rows  # this rank's rows where the state is held by rows, else all
        prior_mean = prior.mean.reshape(-1)
        self.num_rows = len(prior_mean)  # n = N C
        self.prior_mean = block.own_rows(prior_mean)  # (this rank's rows of) m
        num_data = self.num_rows // adapter.num_latents
        latents = adapter.num_latents - 1 if adapter.zero_sum_actions else adapter.num_latents
        self.action_space_dimension = num_data * latents
        self.project = adapter.project if adapter.zero_sum_actions else None  # of IterGP's actions (this rank's rows)
        self.project_whole = self.project  # of whole vectors (all rows), as the covariance phase's blocks are
        self.buffer: ActionBuffer | None = None  # the loop's recycled actions after its last solve
        # K X and the kernel columns of sparse actions: by rows where the vectors are (the right-hand side gathered
        # once, this rank's rows of the product kept); the prior's own products otherwise
        self.kernel_matmul, self.kernel_columns = prior.matmul_by_rows, prior.kernel_columns_by_rows
        observed = adapter.observed_coordinates(targets)
        if observed is not None:  # missing outputs: W = 0 there, so actions (and residuals) live on the others
            whole = observed.to(self.prior_mean)[:, None]
            mask = block.own_rows(whole)
            self.action_space_dimension = int(observed.sum())
            self.project = lambda vectors: vectors * mask
            self.project_whole = lambda vectors: vectors * whole
        self.preconditioning = KernelPreconditioning(
            prior,
            options.preconditioner_rank,
            policy.uses_residual,
            self.project,
            latents if observed is None else adapter.num_latents,
        )
        # Psi, its slopes and the damped step, on this rank's points of y
        self.objective = LogPosterior(adapter, self.prior_mean, block.own_points(targets), block, options.min_step_size)

    name = "Laplace"
    step_name = "Newton steps"
    stall_advice = (
        "The solves do not reach the mode: raise preconditioner_rank or max_solver_iterations (None: each solve to "
        "its tolerance)."
    )

    def made_progress(self, reference: NewtonStep, record: NewtonStep) -> bool:
        r"""The stall rule's test: :math:`\Psi` rose above the earlier step's by more than ``outer_tol`` (nats, as the
        convergence test's predicted gain) or its resolution."""
        resolution = torch.finfo(self.prior_mean.dtype).eps * max(1.0, abs(record.log_posterior))
        return record.log_posterior - reference.log_posterior > max(self.options.outer_tol, resolution)

    # -- states ------------------------------------------------------------------------------------------------
    def initial_state(self) -> LaplaceState:
        r"""The prior: :math:`\mathbf a = \mathbf 0`, no actions (this rank's rows where the state is held by rows)."""
        return LaplaceState.initial(len(self.prior_mean), self.prior_mean.dtype, self.prior_mean.device)

    def renew(self, state: LaplaceState) -> LaplaceState:
        r"""``state`` after a change of :math:`\mathbf K`: its products renewed (one product), :math:`\mathbf a` kept as
        the warm start, and IterGP's tolerances start afresh (a new system)."""
        renewed = state.with_kernel(self.kernel_matmul, self.rows_block)
        return dataclasses.replace(renewed, log_posterior=-math.inf, control=NewtonControl())

    # -- the loop ------------------------------------------------------------------------------------------
    def steps(self, state: LaplaceState) -> Generator[OuterStep, None, None]:
        """Damped Newton steps from ``state`` (paper, Algorithm 1), until converged or stalled (the driver limits their
        number): each step solves its regression with IterGP (:meth:`_solve`), then halves the step until
        :math:`\\Psi` does not decrease (:meth:`_line_search`)."""
        state = state.with_own_rows(self.rows_block)  # (a loaded state holds all rows)
        current = self.objective.point(state.representer_weights, state.kernel_representer_weights)
        renewed = state.newton_steps > 0 and state.log_posterior == -math.inf  # K changed since these weights
        if renewed:
            current = self.objective.warm_start(state.representer_weights, state.kernel_representer_weights)
        columns = None if renewed else state.gemm_columns  # (renewed: its kernel Gram matrix is one GEMM)
        buffer = ActionBuffer.from_tensors(state.actions, state.kernel_actions, self.rows_block, gemm_columns=columns)
        while True:
            derivatives = self.objective.derivatives(current.kernel_weights)
            noise_inverse = derivatives.noise_inverse
            gradient_step = noise_inverse.matmul(derivatives.gradient.reshape(-1, 1))[:, 0]
            finite = bool(torch.isfinite(gradient_step).all()) and math.isfinite(float(derivatives.log_likelihood))
            if not self.rows_block.everywhere(finite, gradient_step):
                message = (
                    "IterNCGP: the likelihood's gradient or curvature is not finite at the current latent values; "
                    "stopping with the posterior of the last completed Newton step."
                )
                yield OuterStep(None, state, LoopStatus.BREAKDOWN, message)
                return
            if not self.options.recycle:
                buffer = ActionBuffer.empty(self.rows_block, self.prior_mean.dtype, self.prior_mean.device)
                self.policy.reset()
            buffer = self.preconditioning.seeded(buffer)
            result = self._solve(current, noise_inverse, gradient_step, buffer, state.control)
            buffer = self.buffer = result.buffer
            step = self._line_search(current, result)
            outer_step = self._outer_step(state, step, result, buffer)
            yield outer_step
            if outer_step.status is not LoopStatus.CONTINUE:
                return
            state, current = outer_step.state, step.new

    def _solve(
        self,
        current: Point,
        noise_inverse: LinearOperator,
        gradient_step: Tensor,
        buffer: ActionBuffer,
        control: NewtonControl,
    ) -> IterGPResult:
        r"""The step's regression :math:`(\mathbf K + \mathbf W^{-1}) \mathbf v = \hat{\mathbf y} - \mathbf m` by IterGP
        (paper, Algorithm 2), recycling ``buffer`` and keeping the current :math:`\mathbf a` in its compression.

        :param current: :math:`\mathbf f = \mathbf m + \mathbf K \mathbf a` and :math:`\Psi` there.
        :param noise_inverse: :math:`\mathbf W^{-1}` at ``current``, ``(n, n)``.
        :param gradient_step: :math:`\mathbf W^{-1} \mathbf g`, ``(n,)``; the right-hand side is
            :math:`\hat{\mathbf y} - \mathbf m = \mathbf K \mathbf a + \mathbf W^{-1} \mathbf g`.
        :param control: the forcing term (scales the tolerances) and whether the system is the last step's.
        """
        options = self.options
        return itergp_solve(
            self.kernel_matmul,
            noise_inverse,
            current.kernel_weights + gradient_step,  # pseudo-targets minus prior mean
            buffer,
            self.policy,
            project=self.project,
            max_solver_iterations=options.max_solver_iterations,
            abs_tol=options.abs_tol * control.forcing,
            rel_tol=options.rel_tol * control.forcing,
            compression_rank=None if control.same_system else options.compression_rank,
            action_space_dimension=self.action_space_dimension,
            keep=(current.weights, current.kernel_weights),
            kernel_columns=self.kernel_columns,
            preconditioner=self.preconditioning.for_noise(noise_inverse),
        )

    def _line_search(self, current: Point, result: IterGPResult) -> _NewtonStepTaken:
        r"""The damped step from ``current`` towards the solver's :math:`\mathbf v`
        (:meth:`~gpytorch_iterncgp.laplace.line_search.LogPosterior.damped_step`) and whether the loop has converged
        with it (:meth:`~gpytorch_iterncgp.laplace.line_search.LogPosterior.converged`)."""
        proposal = self.objective.point(result.representer_weights, result.kernel_representer_weights)
        # Half the Newton decrement: what the full step promises to gain in Psi (exact for a quadratic).
        predicted_gain = 0.5 * self.objective.slope(current, proposal.kernel_weights - current.kernel_weights)
        step_size, new, full_psi = self.objective.damped_step(current, proposal)
        relative_change = relative_norm_change(new.weights, current.weights, self.rows_block)
        proposed_change = relative_norm_change(proposal.weights, current.weights, self.rows_block)
        converged = self.objective.converged(
            new, step_size, full_psi, proposed_change, predicted_gain, result.converged, self.options.outer_tol
        )
        return _NewtonStepTaken(step_size, new, relative_change, converged)

    def _next_control(
        self, control: NewtonControl, result: IterGPResult, step_size: float, converged: bool
    ) -> tuple[NewtonControl, LoopStatus, str]:
        """The bookkeeping for the next step, the loop's status and its message.

        A rejected step (``step_size`` 0) tightens the forcing term a hundredfold and makes the next step solve the
        same system further; the loop stalls where that cannot help (no recycling, or nothing left to solve). A full
        step resets the forcing term.
        """
        status = LoopStatus.CONVERGED if converged else LoopStatus.CONTINUE
        forcing = control.forcing
        message = ""
        if not converged and step_size == 0.0:
            if not self.options.recycle or (result.iterations == 0 and forcing < 1e-10):
                status = LoopStatus.STALLED
                message = "IterNCGP: no step along the Newton direction increases the log posterior; stopping."
            else:
                # The direction was too inexact: the next step solves the same system further (recycled
                # actions) and to a tighter tolerance.
                forcing = max(forcing * 1e-2, 1e-12)
        elif not converged and step_size == 1.0:
            forcing = 1.0
        return NewtonControl(forcing=forcing, same_system=step_size == 0.0), status, message

    def _outer_step(
        self, state: LaplaceState, step: _NewtonStepTaken, result: IterGPResult, buffer: ActionBuffer
    ) -> OuterStep:
        """What :meth:`steps` yields after ``step`` from ``state``: its record and the new :class:`LaplaceState`."""
        control, status, message = self._next_control(state.control, result, step.step_size, step.converged)
        current = step.new
        state = LaplaceState(
            current.weights,
            current.kernel_weights,
            *result.deferred_roots(),  # Q, K Q: formed if read (a callback); finalize forms its own
            buffer.actions.value,
            buffer.kernel_actions.value,
            current.log_posterior,
            state.newton_steps + 1,
            control,
            buffer.gemm_columns,
        )
        record = NewtonStep(
            step=state.newton_steps,
            log_posterior=current.log_posterior,
            step_size=step.step_size,
            solver_iterations=result.iterations,
            residual_norm=result.residual_norm,
            relative_change=step.relative_change,
        )
        return OuterStep(record, state, status, message, breakdown=result.breakdown)

    def finalize(self, state: LaplaceState) -> LaplaceState:
        r"""The precision of the final mode: a virtual solver run at :math:`\mathbf W(\hat{\mathbf f})` over every
        buffered action (no product with :math:`\mathbf K`), then the covariance phase's
        ``covariance_iterations`` blocks (:func:`~gpytorch_iterncgp.core.covariance.covariance_phase`, one product each).

        Where the actions are held by rows (``shard_state``) the final :math:`\mathbf Q`, :math:`\mathbf K \mathbf Q`
        are too: each rank forms its rows of them from its rows of the buffer, and the covariance phase enlarges those
        rows (:func:`~gpytorch_iterncgp.core.covariance.covariance_phase` with the sharded ``RowBlock``).

        The buffer itself is kept as the loop left it (not the re-weighted one of this run, and without the covariance
        phase's actions, which only enlarge :math:`\mathbf Q`), so that a later fit continues exactly as if this one had
        not stopped here, and repeated fits do not grow the state. Without a covariance phase (``covariance_iterations``
        0, as while learning) the run and :math:`\mathbf Q`, :math:`\mathbf K \mathbf Q` are left to their first reader
        (:class:`~gpytorch_iterncgp.core.deferred.DeferredTensor`), on the buffer's actions as they are now
        (:meth:`~gpytorch_iterncgp.core.recycling.ActionBuffer.frozen`).
        """
        state = state.with_own_rows(self.rows_block)
        final = self.objective.derivatives(state.kernel_representer_weights)
        diagonal = final.noise_inverse.diagonal()
        if not self.rows_block.everywhere(bool(torch.isfinite(diagonal).all()), diagonal):
            return state
        buffer = self.buffer  # no copy where the state holds the loop's own buffer (the run appends nothing to it)
        if buffer is None or not buffer.holds(state.actions, state.kernel_actions):
            buffer = ActionBuffer.from_tensors(state.actions, state.kernel_actions, self.rows_block, state.gemm_columns)
        if not self.options.covariance_iterations:  # Q and K Q as the run gives them: formed when first read
            run = functools.cache(functools.partial(virtual_solver_run, buffer.frozen(), final.noise_inverse))
            return dataclasses.replace(
                state,
                precision_root=deferred(lambda: run().local_precision_root),
                kernel_precision_root=deferred(lambda: run().local_kernel_precision_root),
            )
        virtual = virtual_solver_run(buffer, final.noise_inverse)
        phase = covariance_phase(
            self.prior.matmul,
            final.noise_inverse,  # (this rank's blocks where the state is held by rows)
            virtual.local_precision_root,  # this rank's rows of S E, T E (all rows in one process)
            virtual.local_kernel_precision_root,
            self.adapter.num_latents,
            self.options.covariance_iterations,
            self.options.covariance_block_size,
            project=self.project_whole,
            action_space_dimension=self.action_space_dimension,
            rows_block=self.rows_block,
        )
        return dataclasses.replace(
            state, precision_root=phase.precision_root, kernel_precision_root=phase.kernel_precision_root
        )
