r"""The GP regression that a set of EP sites defines, solved by IterGP: its noise, the solve and the posterior
marginals at the training inputs.

With Gaussian sites :math:`t_i(f_i) \propto \exp(\tilde\nu_i f_i - \tfrac12\tilde\tau_i f_i^2)` the posterior is that
of GP regression with pseudo-targets :math:`\tilde\mu_i = \tilde\nu_i / \tilde\tau_i` and noise
:math:`\tilde{\mathbf T}^{-1} = \operatorname{diag}(1/\tilde\tau_i)` (R&W eq. 3.53; see :mod:`~gpytorch_iterncgp.ep.sweeps`).

The noise is bounded where :math:`\tilde\tau_i \to 0` (first sweep, flat sites) by the likelihood's
``min_curvature``: :math:`\tilde{\mathbf T}^{-1} = \operatorname{diag}(1/\max(\tilde\tau_i, \tau_{\min}))` with the
right-hand side :math:`(\tilde\nu_i - \tilde\tau_i m_i)/\max(\tilde\tau_i, \tau_{\min})`, which equals
:math:`\tilde\mu_i - m_i` wherever :math:`\tilde\tau_i \ge \tau_{\min}` and keeps a site with
:math:`\tilde\tau_i = 0` as the linear term :math:`\exp(\tilde\nu_i f_i)` (to :math:`O(\tau_{\min})`).
"""

from __future__ import annotations

from dataclasses import dataclass

from linear_operator.operators import LinearOperator
from torch import Tensor

from ..core.covariance import CovarianceOptions, CovariancePhase, covariance_phase
from ..core.noise import DiagonalNoiseInverse
from ..core.policies import Policy
from ..core.preconditioner import KernelPreconditioning
from ..core.prior import LatentPrior
from ..core.recycling import ActionBuffer
from ..core.sharding import RowBlock
from ..core.solver import IterGPOptions, IterGPResult, RegressionState, itergp_solve
from ..likelihoods.adapters import LikelihoodAdapter
from .sites import site_block_noise, zero_sum_basis


def posterior_marginals(
    prior_mean: Tensor, prior_variance: Tensor, state: RegressionState, rows_block: RowBlock
) -> tuple[Tensor, Tensor]:
    r"""Posterior means :math:`m_i + (\mathbf K\mathbf a)_i` and variances :math:`k_{ii} - \|(\mathbf K\mathbf Q)_{i,:}\|^2`
    (including the computational uncertainty of an incomplete solve), ``(n,)`` each, from the state's buffers
    (:math:`\mathbf K\mathbf a`, :math:`\mathbf K\mathbf Q` held by rows of ``rows_block``: gathered, and each rank's
    row norms)."""
    mean = prior_mean + rows_block.all_rows(state.kernel_representer_weights)
    variance = prior_variance - rows_block.all_rows(state.kernel_precision_root.square().sum(-1))
    return mean, variance


def posterior_marginal_blocks(
    prior_mean: Tensor, prior_blocks: Tensor, state: RegressionState, rows_block: RowBlock
) -> tuple[Tensor, Tensor]:
    r"""Each point's posterior mean ``(N, C)`` and :math:`C \times C` covariance
    :math:`\mathbf K_{ii} - \mathbf R_i \mathbf R_i^\top` ``(N, C, C)``, :math:`\mathbf R_i` the point's :math:`C` rows
    of :math:`\mathbf K\mathbf Q` (data-major); ``prior_mean`` ``(N, C)``, ``prior_blocks`` :math:`\mathbf K_{ii}`
    ``(N, C, C)`` (:math:`\mathbf K\mathbf Q` held by rows of ``rows_block``: each rank's blocks, gathered)."""
    num_latents = prior_mean.shape[-1]
    kernel_root = state.kernel_precision_root
    rows = kernel_root.reshape(kernel_root.shape[0] // num_latents, num_latents, kernel_root.shape[-1])
    products = rows_block.all_rows((rows @ rows.mT).reshape(-1, num_latents)).reshape(-1, num_latents, num_latents)
    covariance = prior_blocks - products
    mean = prior_mean + rows_block.all_rows(state.kernel_representer_weights).reshape(-1, num_latents)
    return mean, (covariance + covariance.mT) / 2


@dataclass
class SiteRegressionOptions(IterGPOptions, CovarianceOptions):
    """IterGP's settings for the sites' regression, and the covariance phase's for its marginals."""

    def validate(self) -> None:
        """:raises ValueError: naming the option that is out of range."""
        IterGPOptions.validate(self)
        CovarianceOptions.validate(self)


class SiteRegression:
    r"""The regression of EP's sites at the training inputs: the prior's quantities it needs, its noise
    :math:`\tilde{\mathbf T}^{-1}` and right-hand side, IterGP's solve, and the posterior marginals of a solve.

    :param prior: the GP prior at the training inputs (its matmul is the one product with K).
    :param adapter: a likelihood with tilted moments: :math:`C = 1` (probit, logit, Poisson exp/softplus) or the
        multinomial probit (:math:`C \times C` site blocks, their noise the bounded pseudo-inverses, IterGP's actions
        with zero sum per point).
    :param targets: validated targets ``(N,)``.
    :param options: IterGP's budget and the covariance phase's block size.
    :param policy: IterGP's policy (already prepared for the problem size).

    **By rows** (``prior.rows`` sharded): the prior's mean and variances, the targets, the noise and the marginals
    are of this rank's points.
    """

    def __init__(
        self,
        prior: LatentPrior,
        adapter: LikelihoodAdapter,
        targets: Tensor,
        options: SiteRegressionOptions,
        policy: Policy,
    ):
        if adapter.num_latents > 1 and not adapter.has_block_tilted_moments:
            raise ValueError(
                f"EP with C x C site blocks needs a likelihood that is flat along (1, ..., 1) with nested-EP tilted "
                f"moments (MultinomialProbitLikelihood); {adapter.name} has C = {adapter.num_latents}."
            )
        self.prior, self.adapter, self.options, self.policy = prior, adapter, options, policy
        self.num_latents = num = adapter.num_latents
        self.rows_block = block = prior.rows  # this rank's rows where the state is held by rows, else all
        prior_mean = prior.mean.reshape(-1)
        self.num_points = len(prior_mean) // num  # N
        # this rank's points (all of them in one process): the loop's vectors, sites and marginals are held by rows
        self.prior_mean = block.own_rows(prior_mean)
        # this rank's rows read as all there are: the marginals of its own points, with no collective
        self.own_rows = RowBlock(block.local_size, num)
        self.prior_variance = block.own_rows(prior.diagonal().reshape(-1))
        self.targets = block.own_points(targets)
        self.kernel_matmul, self.kernel_columns = prior.matmul_by_rows, prior.kernel_columns_by_rows
        zero_sum = adapter.zero_sum_actions
        self.project = adapter.project if zero_sum else None  # of IterGP's actions
        self.preconditioning = KernelPreconditioning(
            prior, options.preconditioner_rank, policy.uses_residual, self.project, num - 1 if zero_sum else num
        )
        self.min_precision = adapter._min_curvature(self.prior_mean.dtype)
        self.prior_blocks: Tensor | None = None
        self.action_space_dimension: int | None = None
        if num > 1:
            self.prior_blocks = block.own_points(prior.point_blocks())
            self.action_space_dimension = self.num_points * (num - 1)
            self.basis = zero_sum_basis(num, self.prior_mean.dtype, self.prior_mean.device)

    def marginals(self, state: RegressionState) -> tuple[Tensor, Tensor]:
        """The posterior marginals at the training inputs (as :meth:`marginals_of`): of this rank's points where the
        state is held by rows (its rows of :math:`\\mathbf K \\mathbf a` and :math:`\\mathbf K \\mathbf Q`; no
        collective)."""
        if self.num_latents == 1:
            return posterior_marginals(self.prior_mean, self.prior_variance, state, self.own_rows)
        assert self.prior_blocks is not None
        prior_mean = self.prior_mean.reshape(-1, self.num_latents)
        return posterior_marginal_blocks(prior_mean, self.prior_blocks, state, self.own_rows)

    @staticmethod
    def marginals_of(prior: LatentPrior, state: RegressionState) -> tuple[Tensor, Tensor]:
        """:func:`posterior_marginals` (``(N,)`` each) for ``prior`` at the training inputs, or for :math:`C > 1`
        :func:`posterior_marginal_blocks` (``(N, C)`` and ``(N, C, C)``)."""
        block = prior.rows
        if prior.num_latents == 1:
            return posterior_marginals(prior.mean.reshape(-1), prior.diagonal().reshape(-1), state, block)
        return posterior_marginal_blocks(prior.mean.reshape(-1, prior.num_latents), prior.point_blocks(), state, block)

    def noise(self, precision: Tensor, natural_mean: Tensor, rows_block: RowBlock) -> tuple[LinearOperator, Tensor]:
        r"""The noise :math:`\tilde{\mathbf T}^{-1}` (bounded; pseudo-inverse blocks for :math:`C > 1`) and the
        right-hand side :math:`\tilde{\boldsymbol\mu} - \mathbf m` of the sites' regression (see the module docstring):
        of the points of ``rows_block`` (this rank's where sharded: its blocks and rows, as the solver holds them)."""
        num = self.num_latents
        precision, natural_mean = rows_block.own_points(precision), rows_block.own_points(natural_mean)
        prior_mean = rows_block.own_rows(self.prior_mean)
        if num == 1:
            bounded = precision.clamp_min(self.min_precision)
            return DiagonalNoiseInverse(bounded.reciprocal()), (natural_mean - precision * prior_mean) / bounded
        noise, rhs = site_block_noise(
            precision, natural_mean, prior_mean.reshape(-1, num), self.min_precision, self.basis
        )
        return noise, rhs.reshape(-1)

    def solve(
        self,
        state: RegressionState,
        buffer: ActionBuffer,
        precision: Tensor,
        natural_mean: Tensor,
        max_iterations: int | None,
    ) -> IterGPResult:
        r"""IterGP on :math:`(\mathbf K + \tilde{\mathbf T}^{-1}) \mathbf v = \tilde{\boldsymbol\mu} - \mathbf m` for the
        sites ``(precision, natural_mean)``, from ``buffer``, at most ``max_iterations`` iterations (``None``: until
        converged; noise bounded as in the module docstring); ``state``'s solution is kept where no action is
        added."""
        options = self.options
        noise, rhs = self.noise(precision, natural_mean, self.rows_block)
        return itergp_solve(
            self.kernel_matmul,
            noise,
            rhs,
            self.preconditioning.seeded(buffer),
            self.policy,
            project=self.project,
            action_space_dimension=self.action_space_dimension,
            max_solver_iterations=max_iterations,
            abs_tol=options.abs_tol,
            rel_tol=options.rel_tol,
            compression_rank=options.compression_rank,
            keep=(state.representer_weights, state.kernel_representer_weights),
            kernel_columns=self.kernel_columns,
            preconditioner=self.preconditioning.for_noise(noise),
        )

    def covariance_blocks(
        self, state: RegressionState, noise: LinearOperator, blocks: int, seed: int = 0
    ) -> CovariancePhase:
        r"""``blocks`` blocks of the covariance phase for ``state``'s regression with the noise of its sites (its
        :math:`\mathbf Q`, :math:`\mathbf K \mathbf Q` by rows where they are held by rows, and so the result)."""
        return covariance_phase(
            self.prior.matmul,
            noise,
            state.precision_root,
            state.kernel_precision_root,
            self.num_latents,
            blocks,
            self.options.covariance_block_size,
            project=self.adapter.project if self.adapter.zero_sum_actions else None,
            action_space_dimension=self.action_space_dimension,
            seed=seed,
            rows_block=self.rows_block,
        )
