r"""The outer loop of expectation propagation: parallel EP sweeps, each a GP regression solved by IterGP.

With Gaussian sites :math:`t_i(f_i) \propto \exp(\tilde\nu_i f_i - \tfrac12\tilde\tau_i f_i^2)` the posterior is that
of GP regression with pseudo-targets :math:`\tilde\mu_i = \tilde\nu_i / \tilde\tau_i` and noise
:math:`\tilde{\mathbf T}^{-1} = \operatorname{diag}(1/\tilde\tau_i)`:

.. math::
    \mathbf m + \mathbf K (\mathbf K + \tilde{\mathbf T}^{-1})^{-1} (\tilde{\boldsymbol\mu} - \mathbf m), \qquad
    \mathbf K - \mathbf K (\mathbf K + \tilde{\mathbf T}^{-1})^{-1} \mathbf K

(R&W eq. 3.53; the Newton step's problem with :math:`(\hat{\mathbf y}, \mathbf W^{-1})` replaced by
:math:`(\tilde{\boldsymbol\mu}, \tilde{\mathbf T}^{-1})`). IterGP solves it with the same policies, recycled actions
and compression; its precision :math:`\mathbf C = \mathbf Q\mathbf Q^\top \approx (\mathbf K + \tilde{\mathbf T}^{-1})^{-1}`
gives the marginal variances :math:`\sigma_i^2 = k_{ii} - \|(\mathbf K\mathbf Q)_{i,:}\|^2` from the
:math:`\mathbf K \mathbf Q` buffer, with no further product with :math:`\mathbf K`. One sweep
(:class:`ExpectationPropagation`): marginals of the current solve :math:`\to` cavities, tilted moments and damped
site updates (:func:`~gpytorch_iterncgp.ep.sites.update_sites`) :math:`\to` one IterGP solve for the new sites.

**Complete and incomplete solves.** When IterGP solves the regression completely (the unit-vector policy over
all actions, or CG to its tolerance), :math:`\mathbf C = (\mathbf K + \tilde{\mathbf T}^{-1})^{-1}` and this is
exact parallel EP. When it stops early, :math:`\sigma_i^2` includes the computational uncertainty: it is larger
than the exact marginal variance where the actions have not yet looked, so the cavity precision
:math:`\sigma_i^{-2} - \tilde\tau_i` is smaller and can turn negative. Such a site keeps its value for the
sweep (skipped and counted, as GPstuff does for negative cavities); the recycled actions accumulate across
sweeps (all of them unless ``compression_rank`` is set), so later sweeps resolve more sites, and once the
actions span the space the sweeps are exact EP. A cavity raised to the prior precision (*bounded*) marks a point
whose computation-aware variance is too wide for its site: up to ``bounded_point_actions`` actions a sweep go to such
points (their unit vectors, :math:`C - 1` per point for :math:`C` classes, with their kernel columns: no product with
:math:`\mathbf K`), after which their variance is at most that of the point observed alone and no later sweep bounds them. The loop reports convergence
only for a complete solve with no skipped or bounded site and a site change below ``site_tol``, or
(``marginal_tol``, 1e-3 by default) for a complete solve with no skipped site after which the marginals moved by at most ``marginal_tol``
(:func:`marginal_divergence`: their mean KL divergence per latent value from the marginals the sweep updated from;
bounded cavities allowed). Parallel EP converges linearly, so the marginals' distance from the fixed point is a small
multiple of the last sweep's change; predictions and the evidence are made of the marginals, and they settle long
before the largest relative site change reaches ``site_tol``. Marginals that settled while the solve stopped at its
budget double the budget at once. Where the sweeps stop
making progress, the driver's stall rule makes the loop escalate (:meth:`ExpectationPropagation.escalate`): more
iterations per solve, or a burst of the covariance phase that refreshes the marginals.

**Marginal refreshes** (``marginal_iterations``, ``marginal_every``; :meth:`ExpectationPropagation.refine_marginals`):
a few blocks of the covariance phase during the sweeps, their actions recycled, make the marginals accurate where
a handful of CG iterations per sweep cannot: fewer cavities are bounded, at the price of more products. On small
problems, where the recycled CG actions soon resolve the marginals, they cost more than they bring (measurements:
``docs/design_notes.md``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Generator
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.outer_loop import EPSweep, FitLimits, LoopStatus, OuterStep, TrainModeFits, sites_progressed
from ..core.policies import Policy
from ..core.prior import LatentPrior
from ..core.recycling import ActionBuffer
from ..core.sharding import RowBlock
from ..core.solver import IterGPResult, RegressionState
from ..core.validation import check_count, check_nonnegative
from ..likelihoods.adapters import LikelihoodAdapter
from ..likelihoods.multinomial_probit import InnerSites
from .regression import SiteRegression, SiteRegressionOptions
from .sites import SiteUpdate, update_site_blocks, update_sites


def marginal_divergence(
    marginals: tuple[Tensor, Tensor], previous: tuple[Tensor, Tensor], rows_block: RowBlock, num_points: int
) -> float:
    r"""How far the posterior marginals moved: the mean over the :math:`N` points of
    :math:`\operatorname{KL}(\mathcal N(\boldsymbol\mu_i, \boldsymbol\Sigma_i) \,\|\, \mathcal N(\boldsymbol\mu_i',
    \boldsymbol\Sigma_i'))`, divided by the :math:`C` latent values of a point (nats per latent value).

    ``marginals`` and ``previous`` are :meth:`ExpectationPropagation.marginals`' ``(mean, variance)``: ``(N,)`` each,
    or ``(N, C)`` and ``(N, C, C)`` blocks; of this rank's points where held by rows (the sum is reduced over the
    ranks of ``rows_block``). ``inf`` where a variance is not positive (a block not positive definite).
    """
    (mean, variance), (old_mean, old_variance) = marginals, previous
    if variance.dim() == 1:
        ratio = variance / old_variance
        divergence = 0.5 * (ratio + (mean - old_mean).square() / old_variance - 1 - ratio.log())
        num_latents = 1
    else:
        num_latents = variance.shape[-1]
        old_factor, old_info = torch.linalg.cholesky_ex(old_variance)
        factor, info = torch.linalg.cholesky_ex(variance)
        if bool((old_info != 0).any() | (info != 0).any()):
            return math.inf
        whitened = torch.linalg.solve_triangular(old_factor, factor, upper=False)  # L'^{-1} L: tr = ||.||_F^2
        offset = torch.linalg.solve_triangular(old_factor, (mean - old_mean)[..., None], upper=False)[..., 0]
        log_ratio = 2 * (old_factor.diagonal(dim1=-2, dim2=-1).log() - factor.diagonal(dim1=-2, dim2=-1).log()).sum(-1)
        divergence = 0.5 * (whitened.square().sum((-2, -1)) + offset.square().sum(-1) - num_latents + log_ratio)
    total = float(rows_block.summed(divergence.sum().detach()))
    return total / (num_points * num_latents) if math.isfinite(total) else math.inf


@dataclass
class SweepOptions(FitLimits):
    """The settings of the sweeps of any EP loop (dense EP, EP-DTC): how many, how far each moves the sites, and when
    they have converged."""

    max_sweeps: int | None = None  # None: until converged, stalled or max_time
    damping: float = 0.5  # delta in (0, 1], the fraction of the way each sweep moves the sites (1: undamped)
    site_tol: float = 1e-4  # converged when no site moves by more than this (relative)

    def validate(self) -> None:
        """:raises ValueError: naming the option that is out of range."""
        FitLimits.validate(self)
        check_count(self.max_sweeps, "max_sweeps", allow_none=True)
        check_nonnegative(self.site_tol, "site_tol")
        if isinstance(self.damping, bool) or not isinstance(self.damping, (int, float)) or not 0 < self.damping <= 1:
            raise ValueError(
                f"damping must be a number in (0, 1] (the fraction of the way each sweep moves the sites; 1 is "
                f"undamped), got {self.damping!r}."
            )


@dataclass
class EPOptions(SweepOptions, SiteRegressionOptions, TrainModeFits):
    """Settings of the EP loop, of IterGP and of the covariance phase (see :class:`~gpytorch_iterncgp.EPStrategy`)."""

    marginal_iterations: int = 0  # covariance-phase blocks (products with K) for the marginals during the sweeps
    marginal_every: int = 1  # ... after every this many sweeps (see ExpectationPropagation.refine_marginals)
    # unit-vector actions a sweep adds at most at points whose cavity it bounded (C - 1 per point for C classes),
    # largest site precision first (0: none)
    bounded_point_actions: int = 50
    # converged also where the marginals moved by at most this (marginal_divergence, nats per latent value) in a sweep
    # with a complete solve and no skipped site, bounded cavities allowed (None: the sites' test alone)
    marginal_tol: float | None = 1e-3

    def validate(self) -> None:
        """:raises ValueError: naming the option that is out of range."""
        SiteRegressionOptions.validate(self)
        SweepOptions.validate(self)
        TrainModeFits.validate(self)
        check_count(self.marginal_iterations, "marginal_iterations")
        check_count(self.marginal_every, "marginal_every", minimum=1)
        check_count(self.bounded_point_actions, "bounded_point_actions")
        if self.marginal_tol is not None:
            check_nonnegative(self.marginal_tol, "marginal_tol", positive=True)


@dataclass
class EPState(RegressionState):
    r"""Where the EP loop stands: the sites and IterGP's solution of the regression they define.

    ``site_precision`` :math:`\tilde\tau` and ``site_natural_mean`` :math:`\tilde\nu` are ``(N,)`` for :math:`C = 1`;
    for :math:`C` latent values per point they are the site blocks :math:`\tilde{\mathbf T}_i` ``(N, C, C)`` and
    :math:`\tilde{\boldsymbol\nu}_i` ``(N, C)``.
    """

    site_precision: Tensor
    site_natural_mean: Tensor
    sweeps: int = 0
    solved: bool = True  # the regression tensors belong to these sites and the current kernel
    gemm_columns: int = 0  # the buffer's ActionBuffer.gemm_columns: how a resumed fit computes its kernel Gram matrix

    saved_by = "EPStrategy"
    optional_entries = frozenset({"solved", "gemm_columns"})  # not saved by the first versions
    point_fields = ("site_precision", "site_natural_mean")  # held by points where the state is held by rows

    @classmethod
    def initial(cls, size: int, dtype: torch.dtype, device: torch.device, num_latents: int = 1) -> EPState:
        """The prior: every site flat (:math:`\\tilde\\tau = \\tilde\\nu = 0`), :math:`\\mathbf a = \\mathbf 0`; ``size``
        is :math:`N C`."""
        points = size // num_latents
        precision: tuple[int, ...] = (size,)
        natural_mean: tuple[int, ...] = (size,)
        if num_latents > 1:
            precision, natural_mean = (points, num_latents, num_latents), (points, num_latents)
        return cls(
            *cls.prior_tensors(size, dtype, device),
            site_precision=torch.zeros(precision, dtype=dtype, device=device),
            site_natural_mean=torch.zeros(natural_mean, dtype=dtype, device=device),
        )

    @classmethod
    def expected_shapes(cls, saved: dict[str, Tensor]) -> dict[str, tuple[int, ...]]:
        r"""The regression's shapes (:meth:`RegressionState.expected_shapes`, ``n = N C``), and the sites':
        ``(n,)`` each for :math:`C = 1`, ``(N, C, C)`` and ``(N, C)`` for site blocks (``C`` from a 2-d
        ``site_natural_mean``)."""
        size = saved["representer_weights"].numel()
        natural_mean = saved["site_natural_mean"]
        num_latents = natural_mean.shape[-1] if natural_mean.dim() == 2 else 1
        sites: dict[str, tuple[int, ...]] = {"site_precision": (size,), "site_natural_mean": (size,)}
        if num_latents > 1:
            points = size // num_latents
            sites = {"site_precision": (points, num_latents, num_latents), "site_natural_mean": (points, num_latents)}
        return {**super().expected_shapes(saved), **sites}


class ExpectationPropagation(SiteRegression):
    r"""Parallel EP with damping, each sweep a GP regression solved by IterGP (see the module docstring).

    An outer loop for :func:`~gpytorch_iterncgp.core.outer_loop.run_outer_loop`.

    **Multi-class** (:math:`C` latent values per point, the multinomial probit): the sites are :math:`C \times C`
    blocks of rank :math:`\le C - 1` (null space :math:`\mathbf 1`), the noise their bounded pseudo-inverses
    (:func:`~gpytorch_iterncgp.ep.sites.site_block_noise`), IterGP's actions have zero sum per point, the marginals are
    each point's :math:`C \times C` covariance, and the sweep is :func:`~gpytorch_iterncgp.ep.sites.update_site_blocks`
    (nested EP, its inner sites kept by the loop for warm starts).

    Its parameters are those of the sites' regression (:class:`~gpytorch_iterncgp.ep.regression.SiteRegression`),
    ``options`` with the sweeps' damping and tolerances too (``max_sweeps`` is the driver's business).

    **By rows** (``prior.rows`` sharded, a ``ShardedKernel`` with ``shard_state``): the sites, the marginals, cavities
    and tilted moments, :math:`\mathbf a`, :math:`\mathbf K \mathbf a` and the regression's right-hand side and
    noise are of this rank's points; the sweep's site change and its counts are reduced over the ranks (``all_reduce``:
    a maximum, sums), so every rank takes the same decisions. In one process the block's reductions are identities.
    """

    name = "EP"
    step_name = "sweeps"
    # this fit's budget (escalate raises it; reset at the start of every fit)
    solver_iterations: int | None  # of each solve
    last_solve_at_budget: bool  # the last solve stopped at its iteration budget, unconverged
    refresh_blocks: int  # covariance-phase blocks of the next sweep's refresh burst
    last_refresh_blocks: int  # ... of the last burst
    actions_exhausted: bool  # the last refresh found no new direction: the actions span the space
    stall_advice = (
        "The fit already spent more products on its marginals and solves where it made no progress; sweeps that "
        "stay near a site change need more accurate marginals from the start (a larger preconditioner_rank, "
        "max_solver_iterations or marginal_iterations), sweeps that oscillate a smaller damping."
    )

    def made_progress(self, reference: EPSweep, record: EPSweep) -> bool:
        """The stall rule's test (:func:`~gpytorch_iterncgp.core.outer_loop.sites_progressed`)."""
        return sites_progressed(reference, record, self.options.site_tol)

    def escalate(self, record: EPSweep) -> bool:
        r"""More computation for the next sweeps, where sweeps stopped making progress (called by the driver's stall
        rule; returns whether it raised the budget). If the last solve stopped at its budget, the mean lags the sites:
        the solves get twice the iterations for the rest of the fit. Otherwise the sites follow marginal variances
        that move as actions are added (the computation-aware variances, wider than exact EP's where no action has
        looked): the next sweep
        refreshes them with a burst of the covariance phase (:meth:`refine_marginals`), twice as many blocks as the
        last burst, whose actions stay in the recycled buffer. Either way the fixed point is exact EP's once the
        actions span the space, so the fit either converges or spends its ``max_time``; where a burst found no new
        direction (the actions span the space) there is nothing left to raise, and the stall rule may end the fit."""
        budget = self.solver_iterations
        if self.last_solve_at_budget and budget is not None:
            self.solver_iterations = 2 * budget
            return True
        if self.actions_exhausted:  # the last burst found no new direction: the marginals are exact already
            return False
        self.refresh_blocks = max(1, 2 * self.last_refresh_blocks)
        return True

    def __init__(
        self, prior: LatentPrior, adapter: LikelihoodAdapter, targets: Tensor, options: EPOptions, policy: Policy
    ):
        super().__init__(prior, adapter, targets, options, policy)
        self.options: EPOptions = options
        self.inner_sites: InnerSites | None = None  # multi-class: the nested EP's sites of the last sweep
        self._reset_budget()

    def _reset_budget(self) -> None:
        """A fit's own budget (:meth:`escalate` raises it): the options' solver iterations, no refresh burst."""
        self.solver_iterations = self.options.max_solver_iterations
        self.last_solve_at_budget = False
        self.refresh_blocks = self.last_refresh_blocks = 0
        self.actions_exhausted = False

    # -- states ------------------------------------------------------------------------------------------------
    def initial_state(self) -> EPState:
        """Flat sites and :math:`\\mathbf a = \\mathbf 0` (this rank's points where the state is held by rows)."""
        return EPState.initial(len(self.prior_mean), self.prior_mean.dtype, self.prior_mean.device, self.num_latents)

    def renew(self, state: EPState) -> EPState:
        """``state`` after a change of :math:`\\mathbf K`: products renewed (one product); the sites are kept (a warm
        start), and the next sweep first solves the regression they define for the new kernel."""
        return dataclasses.replace(state.with_kernel(self.kernel_matmul, self.rows_block), solved=False)

    def finalize(self, state: EPState) -> EPState:
        r"""Every yielded state's precision belongs to its own sites; with ``covariance_iterations > 0`` the covariance
        phase (:func:`~gpytorch_iterncgp.core.covariance.covariance_phase`, one product with :math:`\mathbf K` per block)
        enlarges it for the final sites' regression. The recycled actions are kept as they are; a later fit's first
        sweep takes its cavities from the enlarged precision."""
        if self.options.covariance_iterations == 0 or not state.solved:
            return state
        noise, _ = self.noise(state.site_precision, state.site_natural_mean, self.rows_block)
        phase = self.covariance_blocks(state, noise, self.options.covariance_iterations)
        return dataclasses.replace(
            state,
            precision_root=phase.precision_root,
            kernel_precision_root=phase.kernel_precision_root,
        )

    def refine_marginals(self, state: EPState, buffer: ActionBuffer, blocks: int) -> tuple[EPState, ActionBuffer]:
        r"""Enlarge the precision of ``state``'s regression for the next sweep's marginals, and recycle the new actions.

        ``blocks`` blocks (``marginal_iterations``, or :meth:`escalate`'s burst) of
        :func:`~gpytorch_iterncgp.core.covariance.covariance_phase` (block Lanczos on
        :math:`\hat{\mathbf K} = \mathbf K + \tilde{\mathbf T}^{-1}` preconditioned by the sites :math:`\tilde{\mathbf T}`,
        ``covariance_block_size`` columns and one product with :math:`\mathbf K` each), run after a sweep's solve. With
        the new :math:`\hat{\mathbf K}`-conjugate directions :math:`\mathbf D`, :math:`\mathbf Q \leftarrow [\mathbf Q, \mathbf D]` and
        :math:`\mathbf a \leftarrow \mathbf a + \mathbf D \mathbf D^\top \mathbf r` (the solution over the enlarged
        actions, :math:`\mathbf r` the residual; no product), so the next sweep's marginal covariances
        :math:`\mathbf K_{ii} - \mathbf R_i \mathbf R_i^\top` are narrower (never below the exact ones for these
        sites; see :mod:`~gpytorch_iterncgp.core.covariance`) and fewer cavities are bounded. The directions (normalised)
        and their kernel products are appended to the recycled actions, so every later sweep's virtual solver run
        re-conjugates them for its own sites at no product, and the marginals stay accurate as the sites move.

        Cost: ``blocks`` products with ``covariance_block_size`` columns per refresh, plus the
        Gram–Schmidt against :math:`\mathbf Q` (:math:`O(n r b)` per block); and the buffer grows by up to
        ``blocks * covariance_block_size`` columns per refresh, which every later sweep's virtual run
        pays for (:math:`O(n B^2 + B^3)`, :math:`B` the buffer size; ``compression_rank`` bounds it). At a
        complete solve (:math:`\mathbf Q` spans the action space) it adds nothing, so the fixed point stays exact
        EP's.
        """
        options = self.options
        noise, rhs = self.noise(state.site_precision, state.site_natural_mean, self.rows_block)
        phase = self.covariance_blocks(state, noise, blocks, seed=state.sweeps)
        block = self.rows_block
        start = state.precision_root.shape[-1]
        new_roots, new_kernel_roots = phase.precision_root[:, start:], phase.kernel_precision_root[:, start:]  # D, K D
        self.actions_exhausted = phase.added == 0
        if options.recycle and phase.added > 0:  # (this rank's rows of them where the buffer holds its rows)
            norms = block.summed(new_roots.square().sum(0)).sqrt()
            buffer.extend(new_roots / norms, new_kernel_roots / norms)
        weights, kernel_weights = state.representer_weights, state.kernel_representer_weights
        if phase.added > 0:  # the solution over the enlarged actions: a + D D^T r (D is K̂-conjugate to Q)
            residual = rhs - kernel_weights - noise.matmul(weights[:, None])[:, 0]  # (by rows: this rank's)
            if self.adapter.zero_sum_actions:
                residual = self.adapter.project(residual[:, None])[:, 0]
            coefficients = block.summed(new_roots.mT @ residual)  # D^T r (by rows: one all_reduce)
            weights = weights + new_roots @ coefficients
            kernel_weights = kernel_weights + new_kernel_roots @ coefficients
        state = dataclasses.replace(
            state,
            representer_weights=weights,
            kernel_representer_weights=kernel_weights,
            precision_root=phase.precision_root,
            kernel_precision_root=phase.kernel_precision_root,
            actions=buffer.actions.value,
            kernel_actions=buffer.kernel_actions.value,
        )
        return state, buffer

    def update(self, state: EPState, marginals: tuple[Tensor, Tensor] | None = None) -> SiteUpdate:
        """One parallel sweep's site update from the marginals of ``state``'s regression (:meth:`marginals`, unless
        given)."""
        mean, variance = self.marginals(state) if marginals is None else marginals
        damping, block = self.options.damping, self.rows_block
        if self.num_latents == 1:
            sites = (state.site_precision, state.site_natural_mean)
            return update_sites(
                self.adapter, self.targets, mean, variance, *sites, damping, self.prior_variance, rows_block=block
            )
        update = update_site_blocks(
            self.targets,
            mean,
            variance,
            state.site_precision,
            state.site_natural_mean,
            damping,
            self.prior_blocks,
            self.inner_sites,
            rows_block=block,
        )
        self.inner_sites = update.inner_sites
        return update

    def _bounded_points(self, update: SiteUpdate, state: EPState) -> Tensor:
        """The indices of the points whose cavity ``update`` bounded, as many as ``bounded_point_actions`` actions
        allow (one per point for :math:`C = 1`, :math:`C - 1` for :math:`C` classes, at least one point), those with the
        largest new site precision (trace of the block for :math:`C > 1`) first: where the computation-aware
        marginal is furthest above what the site allows. The same on every rank (gathered from each rank's points).
        None where ``state``'s precision already has the action space's full rank: the solve was complete, its
        marginals exact, a cavity bounded there is rounding at large site precisions, and the unit vectors would only
        grow the recycled actions past the dimension of the space (every later sweep's virtual run paying for them)."""
        dimension = self.rows_block.size if self.action_space_dimension is None else self.action_space_dimension
        if state.kernel_precision_root.shape[-1] >= dimension:  # (K Q: formed for the marginals; Q is not)
            return torch.zeros(0, dtype=torch.long, device=self.prior_mean.device)
        precision = update.site_precision
        if precision.dim() > 1:
            precision = precision.diagonal(dim1=-2, dim2=-1).sum(-1)
        score = torch.where(update.bounded, precision.to(self.prior_mean), -1.0)
        score = self.rows_block.all_points(score[:, None].expand(-1, self.num_latents).contiguous())[:, 0]
        allowed = self.options.bounded_point_actions
        per_point = self.preconditioning.latents_per_point
        number = min(0 if allowed == 0 else max(1, allowed // per_point), int((score >= 0).sum()))
        return torch.topk(score, number).indices.sort().values

    @staticmethod
    def _solved(state: EPState, result: IterGPResult, precision: Tensor, natural_mean: Tensor, sweeps: int) -> EPState:
        return EPState(
            result.representer_weights,
            result.kernel_representer_weights,
            *result.deferred_roots(),  # K Q for the next cavities; Q only if read (refreshes, finalize, callbacks)
            result.buffer.actions.value,
            result.buffer.kernel_actions.value,
            precision,
            natural_mean,
            sweeps,
            True,
            result.buffer.gemm_columns,
        )

    # -- the loop ------------------------------------------------------------------------------------------------
    def steps(self, state: EPState) -> Generator[OuterStep, None, None]:
        """Parallel EP sweeps from ``state`` until converged or stalled (the driver limits their number)."""
        options, block = self.options, self.rows_block
        self._reset_budget()
        state = state.with_own_rows(block)  # (a loaded state holds all rows)
        columns = None if not state.solved else state.gemm_columns  # (renewed: its kernel Gram matrix is one GEMM)
        buffer = ActionBuffer.from_tensors(state.actions, state.kernel_actions, self.rows_block, gemm_columns=columns)
        extra_iterations = 0
        if not state.solved:  # the kernel changed: the marginals need the kept sites' regression first
            result = self.solve(state, buffer, state.site_precision, state.site_natural_mean, self.solver_iterations)
            buffer, extra_iterations = result.buffer, result.iterations
            state = self._solved(state, result, state.site_precision, state.site_natural_mean, state.sweeps)
        marginals: tuple[Tensor, Tensor] | None = None  # of the state, where the last sweep measured them
        while True:
            if marginals is None:
                marginals = self.marginals(state)
            update, update_marginals = self.update(state, marginals), marginals
            if not options.recycle:
                buffer = ActionBuffer.empty(self.rows_block, self.prior_mean.dtype, self.prior_mean.device)
                self.policy.reset()
            # points whose cavity was bounded get actions: no later sweep bounds them (with_point_actions)
            buffer = self.preconditioning.with_point_actions(
                self.preconditioning.seeded(buffer), self._bounded_points(update, state)
            )
            result = self.solve(state, buffer, update.site_precision, update.site_natural_mean, self.solver_iterations)
            buffer = result.buffer
            # (by rows: the counts over all ranks, one all_reduce)
            counts = block.summed(torch.stack([update.skipped.sum(), update.bounded.sum(), update.clipped.sum()]))
            skipped, bounded, clipped = (int(count) for count in counts)
            state = self._solved(state, result, update.site_precision, update.site_natural_mean, state.sweeps + 1)
            budget = self.solver_iterations
            self.last_solve_at_budget = not result.converged and budget is not None and result.iterations >= budget
            blocks = options.marginal_iterations if state.sweeps % options.marginal_every == 0 else 0
            if self.refresh_blocks > 0:  # escalate's burst, once
                blocks += self.refresh_blocks
                self.last_refresh_blocks, self.refresh_blocks = self.refresh_blocks, 0
            if blocks > 0:
                state, buffer = self.refine_marginals(state, buffer, blocks)
            # how far this sweep moved the marginals (the next sweep updates from the new ones)
            marginal_change, marginals = math.nan, None
            if options.marginal_tol is not None:
                new_marginals = self.marginals(state)
                marginal_change = marginal_divergence(new_marginals, update_marginals, block, self.num_points)
                marginals = new_marginals
            record = EPSweep(
                step=state.sweeps,
                site_change=update.change,
                damping=options.damping,
                skipped_sites=skipped,
                bounded_cavities=bounded,
                clipped_sites=clipped,
                solver_iterations=result.iterations + extra_iterations,
                residual_norm=result.residual_norm,
                marginal_blocks=blocks,
                marginal_change=marginal_change,
            )
            extra_iterations = 0
            status, message = LoopStatus.CONTINUE, ""
            sites_settled = bounded == 0 and update.change <= options.site_tol
            marginals_settled = options.marginal_tol is not None and marginal_change <= options.marginal_tol
            if result.converged and skipped == 0 and (sites_settled or marginals_settled):
                status = LoopStatus.CONVERGED
            elif marginals_settled and self.last_solve_at_budget and budget is not None:
                self.solver_iterations = 2 * budget  # settled marginals of an unsolved regression: solve it
            elif skipped == self.num_points and result.iterations == 0:
                status = LoopStatus.STALLED
                message = (
                    "EP: every cavity precision is non-positive and the solver adds no action, so no site can be "
                    "updated; stopping. Give IterGP more iterations per sweep (max_solver_iterations) or a complete "
                    "solve (policy='unit', max_solver_iterations=None)."
                )
            yield OuterStep(record, state, status, message, breakdown=result.breakdown)
            if status is not LoopStatus.CONTINUE:
                return
