r"""The evidences for learning hyperparameters: Laplace's (below) and EP's (:class:`EPMarginalLogLikelihood`,
:func:`ep_evidence`: R&W eq. 3.65 at the EP fixed point).

The Laplace evidence :math:`\log q(\mathbf y \mid \mathbf X, \theta)`:

.. math::
    \log q(\mathbf y \mid \mathbf X, \theta) = \ell(\hat{\mathbf f}) - \tfrac12 \hat{\mathbf a}^\top \mathbf K \hat{\mathbf a}
    - \tfrac12 \log \lvert \mathbf I + \mathbf R^\top \mathbf K \mathbf R \rvert,
    \qquad \hat{\mathbf f} = \mathbf m + \mathbf K \hat{\mathbf a},\quad \mathbf W = \mathbf R \mathbf R^\top,

(R&W eq. 3.32 and 3.44; :math:`\lvert \mathbf I + \mathbf R^\top \mathbf K \mathbf R \rvert = \lvert \mathbf I +
\mathbf W^{1/2} \mathbf K \mathbf W^{1/2} \rvert` by Sylvester's theorem, and the block root
:math:`\mathbf R_n = \operatorname{diag}(\sqrt{\boldsymbol\pi}) - \boldsymbol\pi \sqrt{\boldsymbol\pi}^\top` of the
softmax curvature needs no eigendecomposition). Two regimes behind :class:`LaplaceMarginalLogLikelihood`:

* **exact** (:math:`N C \le` :class:`gpytorch_iterncgp.settings.exact_evidence_size`): the strategy's mode (the
  fit that ``model(train_x)`` ran; no second mode finder), then one *differentiable* dense Newton step from it,
  :math:`\mathbf a' = (\mathbf I + \mathbf W \mathbf K)^{-1} (\mathbf W (\hat{\mathbf f} - \mathbf m) + \mathbf g)`.
  Its value is the mode, and because the Newton map has zero derivative at its fixed point, its
  derivative is the implicit derivative :math:`d\hat{\mathbf f} / d\theta` (R&W Algorithms 5.1, 5.2; the
  approach of BoTorch's ``PairwiseGP``). The gradient is the total derivative of the evidence. The value is
  the evidence one exact Newton step from the strategy's mode: as accurate as the strategy's solve makes the
  mode (quadratically better). Nothing here inverts :math:`\mathbf K`, so duplicate inputs or very long
  lengthscales (a numerically singular :math:`\mathbf K`) leave the evidence finite: this plays the role of
  a projection onto the well-conditioned eigenvectors of :math:`\mathbf K`.
* **matrix-free** (larger): the mode from IterNCGP (warm-started, recycled actions); the same
  differentiable Newton step, as an increment on the mode's weights in the symmetric form
  (:func:`matrix_free_newton_step`), solved by linear_operator's CG; the log-determinant by stochastic Lanczos
  quadrature (``gpytorch.settings.num_trace_samples`` probe vectors, ``max_lanczos_quadrature_iterations``); both
  preconditioned by a low-rank factor of :math:`\mathbf K` of the strategy's ``preconditioner_rank``
  (:func:`evidence_kernel_factor`). Products with :math:`\mathbf K` only. Estimated, not exact: the
  log-determinant and its gradient (stochastic), and the implicit derivative (up to the CG tolerance, ``cg_tolerance``
  and at most :data:`NEWTON_STEP_CG_TOLERANCE`, in the backward pass too). The value's quadratic and likelihood terms
  are those of IterNCGP's (approximate) mode. Far from the mode (a loose fit at new hyperparameters) an undamped Newton
  step through an ill-conditioned :math:`\mathbf B` can land anywhere (an exp link at counts in the tens: latent values of
  74, a log posterior of :math:`-10^{32}`); where it lowers the log posterior (by more than
  :data:`NEWTON_STEP_TRUST`, relative) it is not used: the value is the evidence at the mode,
  :math:`\ell(\hat{\mathbf f}) - \tfrac12 \hat{\mathbf a}^\top \mathbf K \hat{\mathbf a} - \tfrac12
  \log\lvert\mathbf B(\hat{\mathbf f})\rvert`, and the gradient its explicit part with the mode held fixed (R&W
  eq. 5.22 without the implicit term).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import linear_operator
import torch
from gpytorch.mlls import MarginalLogLikelihood
from linear_operator.operators import DiagLinearOperator, LinearOperator, PsdSumLinearOperator, RootLinearOperator
from torch import Tensor

from .. import settings
from ..core.preconditioner import ClassFactor, LowRankKernelFactor, low_rank_kernel_factor
from ..core.prior import LatentPrior
from ..ep.sites import (
    block_cavities,
    cavities,
    site_block_pseudo_inverse,
    site_block_spectrum,
    site_roots,
    zero_sum_basis,
)
from ..ep.sweeps import ExpectationPropagation
from ..exceptions import EstimatedEvidenceWarning, ExplicitGradientWarning, NonFiniteEvidenceError
from ..likelihoods.adapters import LikelihoodAdapter
from ..likelihoods.multinomial_probit import multinomial_probit_moments
from ..likelihoods.tilted import tilted_moments
from ..strategies.base import exact_regime
from ..strategies.itergp import EPStrategy, IterNCGPStrategy


def curvature_root(curvature: Tensor, probabilities: Tensor | None = None) -> Tensor:
    r"""Blocks :math:`\mathbf R_n` with :math:`\mathbf R_n \mathbf R_n^\top = \mathbf W_n`, shape ``(N, C, C)``.

    Softmax (``probabilities`` ``(N, C)`` given): :math:`\operatorname{diag}(\sqrt{\boldsymbol\pi}) -
    \boldsymbol\pi\sqrt{\boldsymbol\pi}^\top`; :math:`C = 1`: :math:`\sqrt{w}`; otherwise a Cholesky factor.
    """
    if probabilities is not None:
        root = probabilities.sqrt()
        return torch.diag_embed(root) - probabilities[:, :, None] * root[:, None, :]
    if curvature.shape[-1] == 1:
        # Clamped at the smallest normal number, not at 0: sqrt has an infinite derivative at 0, and a curvature
        # that underflows (a confidently classified point) must give a zero gradient, not NaN.
        return curvature.clamp_min(torch.finfo(curvature.dtype).tiny).sqrt()
    eye = torch.eye(curvature.shape[-1], dtype=curvature.dtype, device=curvature.device)
    return torch.linalg.cholesky(curvature + 1e3 * torch.finfo(curvature.dtype).eps * eye)


def _block_times_dense(blocks: Tensor, matrix: Tensor) -> Tensor:
    r"""Block-diagonal ``(N, C, C)`` times a dense ``(N C, k)`` matrix, in :math:`O(N C^2 k)`."""
    num_data, num_latents = blocks.shape[:2]
    return (blocks @ matrix.reshape(num_data, num_latents, -1)).reshape(matrix.shape)


class _WhitenedFactor:
    r"""The Cholesky factor :math:`\mathbf L` of :math:`\mathbf B = \mathbf I + \mathbf R^\top \mathbf K \mathbf R` for
    a dense :math:`\mathbf K` ``(n, n)`` and curvature roots :math:`\mathbf R` ``(N, C, C)``, :math:`n = N C`, with
    :math:`\mathbf R \mathbf R^\top = \mathbf W` (:func:`curvature_root`); all detached (constants of the gradient)."""

    def __init__(self, kernel_matrix: Tensor, roots: Tensor):
        self.kernel_matrix, self.roots = kernel_matrix, roots
        if roots.shape[-1] == 1:  # R diagonal
            root = roots.reshape(-1)
            whitened = root[:, None] * kernel_matrix * root
        else:
            whitened = _block_times_dense(roots.mT, _block_times_dense(roots.mT, kernel_matrix).mT)  # R^T K R
        whitened.diagonal().add_(1)  # B; its lower triangle is read
        self.cholesky = torch.linalg.cholesky(whitened)

    def solve_newton(self, rhs: Tensor) -> Tensor:
        r""":math:`(\mathbf I + \mathbf W \mathbf K)^{-1} \mathbf v = \mathbf v - \mathbf R \mathbf B^{-1} \mathbf R^\top
        \mathbf K \mathbf v` for ``rhs`` :math:`\mathbf v` ``(n,)`` (linear in it, differentiable in it alone)."""
        rooted = _block_times_dense(self.roots.mT, (self.kernel_matrix @ rhs)[:, None])
        return rhs - _block_times_dense(self.roots, torch.cholesky_solve(rooted, self.cholesky))[:, 0]

    def log_det(self) -> Tensor:
        r""":math:`\log\lvert\mathbf B\rvert = \log\lvert\mathbf I + \mathbf W \mathbf K\rvert`."""
        return 2 * self.cholesky.diagonal().log().sum()

    def log_det_adjoints(self) -> tuple[Tensor, Tensor]:
        r"""The derivatives of :math:`\log\lvert\mathbf I + \mathbf W \mathbf K\rvert` (R&W eq. 3.32's term, sec. 5.5.1):
        :math:`\mathbf Q = (\mathbf W^{-1} + \mathbf K)^{-1} = \mathbf R \mathbf B^{-1} \mathbf R^\top` ``(n, n)``, its
        gradient with respect to :math:`\mathbf K`, and the diagonal blocks ``(N, C, C)`` of
        :math:`\boldsymbol\Sigma = (\mathbf K^{-1} + \mathbf W)^{-1} = \mathbf K - \mathbf K \mathbf Q \mathbf K`, its
        gradient with respect to the blocks :math:`\mathbf W_n`."""
        num_data, num_latents = self.roots.shape[:2]
        inverse = torch.cholesky_inverse(self.cholesky)
        if num_latents == 1:  # R diagonal
            root = self.roots.reshape(-1)
            adjoint = root[:, None] * inverse * root
            rooted_kernel = root[:, None] * self.kernel_matrix
        else:
            adjoint = _block_times_dense(self.roots, _block_times_dense(self.roots, inverse).mT)  # R B^-1 R^T
            rooted_kernel = _block_times_dense(self.roots.mT, self.kernel_matrix)
        half = torch.linalg.solve_triangular(self.cholesky, rooted_kernel, upper=False)  # L^-1 R^T K
        half = half.reshape(-1, num_data, num_latents)
        explained = torch.einsum("knc,knd->ncd", half, half)
        blocks = self.kernel_matrix.reshape(num_data, num_latents, num_data, num_latents)
        prior_blocks = blocks.diagonal(dim1=0, dim2=2).permute(2, 0, 1)
        return adjoint, prior_blocks - explained


def exact_laplace_evidence(
    kernel_matrix: Tensor, prior_mean: Tensor, adapter: LikelihoodAdapter, targets: Tensor, weights: Tensor
) -> Tensor:
    r"""The Laplace evidence (R&W eq. 3.32) at the mode ``weights`` :math:`\mathbf a` (:math:`\hat{\mathbf f} =
    \mathbf m + \mathbf K \mathbf a`), differentiable in :math:`\mathbf K` ``(n, n)``, :math:`\mathbf m` ``(n,)`` and
    the likelihood; :math:`n = N C`, data-major.

    One Newton step from the (detached) mode, :math:`\mathbf a' = (\mathbf I + \mathbf W \mathbf K)^{-1}
    (\mathbf W (\hat{\mathbf f} - \mathbf m) + \nabla \log p(\mathbf y \mid \hat{\mathbf f}))`, carries the
    implicit dependence of the mode on the hyperparameters (R&W eqs. 5.23-5.24) into the gradient; the value is
    :math:`\log p(\mathbf y \mid \mathbf f) - \tfrac12 \mathbf a'^\top (\mathbf f - \mathbf m) - \tfrac12
    \log\lvert\mathbf I + \mathbf W \mathbf K\rvert` at :math:`\mathbf f = \mathbf m + \mathbf K \mathbf a'`.

    Both matrices are factorised once, by Cholesky in the symmetric form :math:`\mathbf B = \mathbf I + \mathbf
    R^\top \mathbf K \mathbf R` (:math:`\mathbf R \mathbf R^\top = \mathbf W`, R&W Alg. 3.1), detached: the gradient
    of the Newton step is :math:`(\mathbf I + \mathbf W \mathbf K)^{-1}` applied to the derivative of its right-hand
    side, and that of :math:`\log\lvert\mathbf B\rvert` the trace terms :math:`\operatorname{tr}(\mathbf Q\,
    \mathrm d\mathbf K) + \sum_n \operatorname{tr}(\boldsymbol\Sigma_{nn} \mathrm d\mathbf W_n)`
    (:meth:`_WhitenedFactor.log_det_adjoints`): no backward pass through a factorisation.
    """
    num_latents = adapter.num_latents
    fixed_kernel = kernel_matrix.detach()
    fixed_weights = weights.detach()
    mode = (prior_mean + fixed_kernel @ fixed_weights).detach()
    _, gradient, curvature = adapter.local_terms(mode.reshape(-1, num_latents), targets)
    rhs = _block_times_dense(curvature, (mode - prior_mean)[:, None])[:, 0] + gradient.reshape(-1)
    roots = curvature_root(curvature.detach(), _probabilities_if_softmax(adapter, mode.reshape(-1, num_latents)))
    newton = _WhitenedFactor(fixed_kernel, roots)
    step = newton.solve_newton(rhs.detach())
    # first order in the hyperparameters: d a' = (I + W K)^-1 (d rhs - d(W K) a'), with the values of a' itself
    product = kernel_matrix @ step
    moved = _block_times_dense(curvature, product[:, None])[:, 0]
    weights = step + newton.solve_newton(rhs - rhs.detach() - (moved - moved.detach()))
    latent = prior_mean + kernel_matrix @ weights
    log_likelihood, _, curvature = adapter.local_terms(latent.reshape(-1, num_latents), targets)
    probabilities = _probabilities_if_softmax(adapter, latent.detach().reshape(-1, num_latents))
    factor = _WhitenedFactor(fixed_kernel, curvature_root(curvature.detach(), probabilities))
    adjoint, marginal_blocks = factor.log_det_adjoints()
    log_det = (
        factor.log_det()
        + (adjoint * (kernel_matrix - fixed_kernel)).sum()
        + (marginal_blocks * (curvature - curvature.detach())).sum()
    )
    return log_likelihood - 0.5 * (weights @ (latent - prior_mean)) - 0.5 * log_det


def _probabilities_if_softmax(adapter: LikelihoodAdapter, latent: Tensor) -> Tensor | None:
    return torch.softmax(latent, dim=-1) if adapter.softmax else None


class WhitenedKernel(LinearOperator):
    r""":math:`\mathbf B = \mathbf I + \mathbf R^\top \mathbf K \mathbf R` (size ``(N C, N C)``, data-major).

    :math:`\mathbf R` is block diagonal with :math:`\mathbf R_n \mathbf R_n^\top = \mathbf W_n`, so
    :math:`\lvert\mathbf B\rvert = \lvert\mathbf I + \mathbf W^{1/2}\mathbf K\mathbf W^{1/2}\rvert` and
    :math:`\mathbf B \succeq \mathbf I`. One product with :math:`\mathbf K` per matmul; the diagonal uses the
    :math:`C \times C` prior blocks of the points, so linear_operator's preconditioner never indexes
    :math:`\mathbf K` entry by entry.

    :param roots: :math:`\mathbf R_n`, ``(N, C, C)``.
    :param kernel: :math:`\mathbf K`, a data-major ``(N C, N C)`` LinearOperator.
    :param kernel_point_blocks: :math:`\mathbf K_{nn}`, ``(N, C, C)``.
    :param cg_tolerance: the relative residual of every CG solve with :math:`\mathbf B`, those of backward passes
        included (linear_operator's ``Solve`` solves again in its backward pass, under the settings active at
        ``loss.backward()``: GPyTorch's training default of 1); ``None``: linear_operator's ``cg_tolerance``.
    :param kernel_factor: :math:`\mathbf L` with :math:`\mathbf K \approx \mathbf L \mathbf L^\top` (all rows), or
        ``None``: the preconditioner :math:`\mathbf P = \mathbf I + \mathbf R^\top \mathbf L \mathbf L^\top \mathbf R`
        of the solves and of the log-determinant's stochastic Lanczos quadrature (which then estimates
        :math:`\log\lvert\mathbf P^{-1}\mathbf B\rvert` and adds :math:`\log\lvert\mathbf P\rvert`; Gardner et al.
        2018), :math:`\mathbf P^{-1} = \mathbf I - \mathbf R^\top \mathbf L \mathbf G^{-1} \mathbf L^\top \mathbf R`
        with :math:`\mathbf G = \mathbf I + \mathbf L^\top \mathbf W \mathbf L` (Woodbury).
    :param kernel_product: :math:`\mathbf K \mathbf X` for data-major ``X`` ``(N C, k)`` where no gradient is recorded
        (the CG iterations and Lanczos quadrature of linear_operator's forward passes), e.g. the prior's
        :meth:`~gpytorch_iterncgp.core.prior.LatentPrior.matmul` (by the matrix it holds evaluated, fused or chunked
        past the dense limit, and counted); ``None``: ``kernel``'s own. Products that record gradients (the backward
        passes' bilinear derivatives) always run through ``kernel``.
    """

    def __init__(
        self,
        roots: Tensor,
        kernel: LinearOperator,
        kernel_point_blocks: Tensor,
        cg_tolerance: float | None = None,
        kernel_factor: LowRankKernelFactor | None = None,
        kernel_product: Callable[[Tensor], Tensor] | None = None,
    ):
        super().__init__(
            roots,
            kernel,
            kernel_point_blocks,
            cg_tolerance=cg_tolerance,
            kernel_factor=kernel_factor,
            kernel_product=kernel_product,
        )
        self.roots, self.kernel, self.kernel_point_blocks = roots, kernel, kernel_point_blocks
        self.cg_tolerance, self.kernel_factor, self.kernel_product = cg_tolerance, kernel_factor, kernel_product

    def with_cg_tolerance(self, cg_tolerance: float) -> WhitenedKernel:
        r"""The same :math:`\mathbf B`, its CG solves run to ``cg_tolerance``."""
        return WhitenedKernel(
            self.roots, self.kernel, self.kernel_point_blocks, cg_tolerance, self.kernel_factor, self.kernel_product
        )

    def _preconditioner(self) -> tuple[Callable[[Tensor], Tensor] | None, LinearOperator | None, Tensor | None]:
        r""":math:`\mathbf P^{-1}` as a function, :math:`\mathbf P = \mathbf I + \mathbf U \mathbf U^\top` with
        :math:`\mathbf U = \mathbf R^\top \mathbf L` ``(n, r)`` (linear_operator draws the log-determinant's probe vectors
        from :math:`\mathcal N(\mathbf 0, \mathbf P)`), and :math:`\log\lvert\mathbf P\rvert = \log\lvert\mathbf I +
        \mathbf U^\top \mathbf U\rvert` (held fixed: the gradient of :math:`\log\lvert\mathbf B\rvert` comes from the
        probes); ``None`` each without a factor."""
        factor = self.kernel_factor
        if factor is None:
            return None, None, None
        roots = self.roots.detach()
        eye = torch.eye(factor.rank, dtype=roots.dtype, device=roots.device)
        rooted = _block_times_dense(roots.mT, factor.matmul(eye))  # U, (n, r)
        rooted_double = rooted.double()  # G and its Cholesky factor in float64 whatever the model's dtype
        gram = rooted_double.mT @ rooted_double
        cholesky = torch.linalg.cholesky(
            (gram + gram.mT) / 2 + torch.eye(len(gram), dtype=gram.dtype, device=gram.device)
        )
        log_det = 2 * cholesky.diagonal().log().sum().to(roots.dtype)

        def precondition(rhs: Tensor) -> Tensor:
            solved = torch.cholesky_solve(rooted_double.mT @ rhs.double(), cholesky).to(rhs.dtype)
            return rhs - rooted @ solved

        ones = torch.ones(rooted.shape[0], dtype=roots.dtype, device=roots.device)
        return precondition, PsdSumLinearOperator(RootLinearOperator(rooted), DiagLinearOperator(ones)), log_det

    def _solve(self, rhs: Tensor, preconditioner=None, num_tridiag: int = 0):
        # linear_operator's CG treats a step p^T B p below its eps (1e-10) as zero, which with a preconditioner stalls
        # it near a relative residual of 1e-5 (|p| ~ the residual): eps at the dtype's rounding squared instead
        return linear_operator.utils.linear_cg(
            self._matmul,
            rhs,
            n_tridiag=num_tridiag,
            tolerance=self.cg_tolerance,  # None: linear_operator's cg_tolerance
            eps=torch.finfo(rhs.dtype).eps ** 2,
            max_iter=linear_operator.settings.max_cg_iterations.value(),
            max_tridiag_iter=linear_operator.settings.max_lanczos_quadrature_iterations.value(),
            preconditioner=preconditioner,
        )

    def _size(self) -> torch.Size:
        return self.kernel.shape

    def _matmul(self, rhs: Tensor) -> Tensor:
        num_data, num_latents = self.roots.shape[:2]
        blocks = rhs.reshape(*rhs.shape[:-2], num_data, num_latents, rhs.shape[-1])
        rooted = (self.roots @ blocks).reshape(rhs.shape)
        if self.kernel_product is None or torch.is_grad_enabled() or rhs.dim() != 2:
            product = self.kernel.matmul(rooted).reshape(blocks.shape)
        else:
            product = self.kernel_product(rooted).reshape(blocks.shape)
        return rhs + (self.roots.mT @ product).reshape(rhs.shape)

    def _transpose_nonbatch(self) -> LinearOperator:
        return self

    def _diagonal(self) -> Tensor:
        quadratic = torch.einsum("ndc,nde,nec->nc", self.roots, self.kernel_point_blocks, self.roots)
        return 1 + quadratic.reshape(-1)


def _whitened_kernel(prior: LatentPrior, roots: Tensor, kernel_factor: LowRankKernelFactor | None) -> WhitenedKernel:
    r""":math:`\mathbf B` of the prior's kernel and the curvature's roots :math:`\mathbf R` ``(N, C, C)``."""
    covariance = prior.data_major_covariance()
    return WhitenedKernel(
        roots, covariance, prior.point_blocks(), kernel_factor=kernel_factor, kernel_product=prior.matmul
    )


def _whitened_system(
    prior: LatentPrior,
    adapter: LikelihoodAdapter,
    latent: Tensor,
    targets: Tensor,
    kernel_factor: LowRankKernelFactor | None = None,
):
    r""":math:`\ell(\mathbf f)`, :math:`\mathbf g`, :math:`\mathbf W` blocks, :math:`\mathbf R` and :math:`\mathbf B = \mathbf I + \mathbf R^\top \mathbf K \mathbf R` (lazy)."""
    latent = latent.reshape(-1, adapter.num_latents)
    log_likelihood, gradient, curvature = adapter.local_terms(latent, targets)
    roots = curvature_root(curvature, _probabilities_if_softmax(adapter, latent))
    system = _whitened_kernel(prior, roots, kernel_factor)
    return log_likelihood, gradient, curvature, roots, system


#: relative residual of the matrix-free evidence's differentiable Newton step (CG on B, forward and backward), at most:
#: the step's derivative is the implicit derivative of the mode, and at learnt-scale kernels (outputscale 16-19) B is
#: ill-conditioned enough that a residual of 1e-2 leaves it wrong by a factor of 5 and 1e-4 by up to 8 % (GPyTorch's
#: training default ``cg_tolerance`` of 1 stops CG near a residual of 1); preconditioned, 1e-6 costs 25-29 products
NEWTON_STEP_CG_TOLERANCE = 1e-6
#: the Newton step is trusted where it lowers the log posterior by at most this times one plus its magnitude: at a converged
#: mode it moves it by rounding and the solve's tolerance; far from one, an ill-conditioned B (exp link, counts in the
#: tens) can send it to e^74 and the log posterior to -1e32
NEWTON_STEP_TRUST = 1e-4


def matrix_free_newton_step(
    prior: LatentPrior,
    adapter: LikelihoodAdapter,
    targets: Tensor,
    weights: Tensor,
    kernel_factor: LowRankKernelFactor | None = None,
) -> tuple[Tensor, Tensor, WhitenedKernel]:
    r"""One differentiable Newton step from :math:`\hat{\mathbf f} = \mathbf m + \mathbf K \hat{\mathbf a}`, with products
    with :math:`\mathbf K` only: the weights :math:`\mathbf a'` and latent values :math:`\mathbf m + \mathbf K \mathbf a'`,
    both ``(N C,)``, and :math:`\mathbf B = \mathbf I + \mathbf R^\top \mathbf K \mathbf R` at :math:`\hat{\mathbf f}`.

    The step is an increment on the weights (R&W eq. 3.18 with the matrix inversion lemma),

    .. math::
        \mathbf a' = \hat{\mathbf a} + \mathbf r - \mathbf R \mathbf B^{-1} \mathbf R^\top \mathbf K \mathbf r,
        \qquad \mathbf r = \mathbf W (\hat{\mathbf f} - \mathbf m - \mathbf K \hat{\mathbf a}) + \mathbf g - \hat{\mathbf a},

    with :math:`\hat{\mathbf f}`, :math:`\hat{\mathbf a}` held fixed and :math:`\mathbf K`, :math:`\mathbf m`
    differentiable. At the hyperparameters :math:`\hat{\mathbf f}` was found at, :math:`\mathbf r = \mathbf g -
    \hat{\mathbf a}` vanishes at the mode, so the CG solve's relative tolerance (``cg_tolerance``, at most
    :data:`NEWTON_STEP_CG_TOLERANCE`) bounds the step's error by the mode's residual; the derivative of
    :math:`\mathbf r`, :math:`-\mathbf W (d\mathbf m + d\mathbf K\, \hat{\mathbf a})`, carries the implicit term
    :math:`d\hat{\mathbf f} / d\theta`.

    :param weights: :math:`\hat{\mathbf a}`, ``(N C,)``, detached.
    :param kernel_factor: a low-rank factor of :math:`\mathbf K` (all rows) that preconditions the solves, or ``None``.
    """
    prior_mean = prior.mean.reshape(-1)
    kernel_weights = prior.matmul(weights[:, None])[:, 0]
    mode = (prior_mean + kernel_weights).detach()
    _, gradient, curvature, roots, system = _whitened_system(prior, adapter, mode, targets, kernel_factor)
    residual = _block_times_dense(curvature, (mode - prior_mean - kernel_weights)[:, None])[:, 0]
    residual = residual + gradient.reshape(-1) - weights
    tolerance = min(linear_operator.settings.cg_tolerance.value(), NEWTON_STEP_CG_TOLERANCE)
    correction = system.with_cg_tolerance(tolerance).solve(
        _block_times_dense(roots.mT, prior.matmul(residual[:, None]))
    )
    increment = residual - _block_times_dense(roots, correction)[:, 0]
    latent = prior_mean + kernel_weights + prior.matmul(increment[:, None])[:, 0]
    return weights + increment, latent, system


def evidence_kernel_factor(strategy: IterNCGPStrategy | EPStrategy, prior: LatentPrior) -> LowRankKernelFactor | None:
    """The low-rank factor of the kernel that preconditions the matrix-free evidences' CG solves and Lanczos quadrature
    (:class:`WhitenedKernel`): as the strategy's own preconditioner's
    (:attr:`~gpytorch_iterncgp.core.solver.IterGPOptions.preconditioner_rank` columns, pivoted Cholesky or Nyström),
    built from a prior without gradients; ``None`` where the rank is 0 or the rows are sharded (the evidences hold all
    rows). The strategy's own factor where it is current (:meth:`~gpytorch_iterncgp.IterNCGPStrategy.kernel_factor`;
    a pivoted Cholesky factor: Nyström's sketch of the loops is projected as their actions)."""
    rank = strategy.options.preconditioner_rank
    if rank == 0 or prior.rows.is_sharded:
        return None
    fitted = strategy.kernel_factor()
    if isinstance(fitted, ClassFactor):
        return fitted
    with torch.no_grad():
        return low_rank_kernel_factor(strategy.train_prior(), rank, cache_kernel=False)


def matrix_free_laplace_evidence(
    prior: LatentPrior,
    adapter: LikelihoodAdapter,
    targets: Tensor,
    state,
    kernel_factor: LowRankKernelFactor | None = None,
) -> Tensor:
    r"""The Laplace evidence at IterNCGP's mode, with products with :math:`\mathbf K` only (see the module docstring).

    The gradient is the total derivative: one differentiable Newton step from the mode
    (:func:`matrix_free_newton_step`), then the evidence at its latent values with the log-determinant by
    stochastic Lanczos quadrature. The value is the evidence at the strategy's mode.

    :param prior: the prior at the training inputs, built *with* gradients.
    :param state: the strategy's :class:`~gpytorch_iterncgp.LaplaceState` for the same hyperparameters.
    :param kernel_factor: preconditions the step's solves and the log-determinant (:func:`evidence_kernel_factor`), or
        ``None``.
    """
    block = prior.rows  # where the state holds its rows: all of them gathered (the evidence is replicated)
    weights = block.all_rows(state.representer_weights).detach()
    kernel_weights = block.all_rows(state.kernel_representer_weights).detach()
    prior_mean = prior.mean.reshape(-1)
    new_weights, latent, system = matrix_free_newton_step(prior, adapter, targets, weights, kernel_factor)
    log_likelihood, _, _, _, new_system = _whitened_system(prior, adapter, latent, targets, kernel_factor)
    log_posterior = log_likelihood - 0.5 * (new_weights @ (latent - prior_mean))
    mode = prior_mean.detach() + kernel_weights
    mode_likelihood = adapter.log_likelihood(mode.reshape(-1, adapter.num_latents), targets)
    mode_log_posterior = mode_likelihood - 0.5 * (weights @ kernel_weights)
    step, at_mode = float(log_posterior.detach()), float(mode_log_posterior.detach())
    if math.isfinite(step) and step >= at_mode - NEWTON_STEP_TRUST * (1 + abs(at_mode)):
        # Value at the strategy's mode; gradient through the differentiable Newton step.
        log_det = new_system.logdet()
        surrogate = log_posterior - 0.5 * log_det
    else:
        # The step is not trusted (far from the mode, B ill-conditioned): the gradient at the mode held fixed, the
        # explicit derivative (R&W eq. 5.22 without its implicit term): d(-1/2 u^T K^-1 u) = 1/2 a^T dK a + a^T dm
        # for u = f - m, a = K^-1 u, which 1/2 a^T K a + a^T m has with a held fixed.
        # (and the likelihood's own parameters, if any, through the log-likelihood at the mode)
        warnings.warn(
            f"LaplaceMarginalLogLikelihood: the Newton step from the strategy's mode moved the log posterior from "
            f"{at_mode:.6g} to {step:.6g}, so the evidence's gradient leaves out the mode's implicit derivative "
            "(R&W eq. 5.22 without eqs. 5.23-5.24). Fit the strategy closer to its mode (a smaller outer_tol, more "
            "Newton steps) before the evidence.",
            ExplicitGradientWarning,
            stacklevel=2,
        )
        log_det = system.logdet()
        quadratic = 0.5 * (weights @ prior.matmul(weights[:, None])[:, 0]) + weights @ prior_mean
        surrogate = mode_likelihood + quadratic - 0.5 * log_det
    return surrogate - surrogate.detach() + (mode_log_posterior - 0.5 * log_det).detach()


def log_prior(mll: MarginalLogLikelihood) -> Tensor:
    r""":math:`\sum_j \log p(\theta_j)` over the priors registered on ``mll``'s model and likelihood (GPyTorch's
    ``*_prior=`` arguments, e.g. ``ScaleKernel(..., outputscale_prior=...)``), the term GPyTorch's
    ``ExactMarginalLogLikelihood`` adds; a zero scalar without priors."""
    terms = [prior.log_prob(closure(module)).sum() for _, module, prior, closure, _ in mll.named_priors()]
    return torch.stack(terms).sum() if terms else torch.zeros(())


class BoTorchFitHook:
    """BoTorch's hook into ``botorch.fit.fit_gpytorch_mll`` (a model's ``custom_fit``): it runs
    :func:`~gpytorch_iterncgp.fit_mll` for this package's evidences with the keywords given (``fit_mll``'s options:
    ``max_time``, ``recipe``, ...; it refuses others, naming them), and returns the ``mll`` in eval mode, as BoTorch's
    fits do. BoTorch's own ``closure``, ``optimizer``, ``closure_kwargs`` and ``optimizer_kwargs`` do not apply
    (``fit_mll`` chooses its optimiser by the evidence) and are refused.

    Set on a model without a ``custom_fit`` of its own when one of the evidences below is built for it. ``fit_mll``
    belongs to the layer above (:mod:`gpytorch_iterncgp.learning.fit`, which imports this module): the hook imports it
    when BoTorch calls it, the package's one import from a higher layer (``tests/test_foundations.py`` lists it).
    """

    def __call__(self, mll, closure=None, closure_kwargs=None, optimizer_kwargs=None, **kwargs):
        botorch = {"closure": closure, "optimizer": kwargs.pop("optimizer", None)}
        botorch.update(closure_kwargs=closure_kwargs, optimizer_kwargs=optimizer_kwargs)
        given = [name for name, value in botorch.items() if value is not None]
        if given:
            raise TypeError(
                f"fit_gpytorch_mll on a {type(mll).__name__} runs gpytorch_iterncgp.fit_mll, which chooses its "
                f"optimiser by the evidence (L-BFGS where it is exact, Adam otherwise): {', '.join(given)} do not "
                "apply. Set the optimiser's steps and learning rate with recipe=gpytorch_iterncgp.LearningRecipe(...)."
            )
        from ..learning.fit import fit_mll  # the layer above, imported at the call

        fit_mll(mll, **kwargs)
        return mll.eval()


class _StrategyEvidence(MarginalLogLikelihood):
    """An evidence at a strategy's fitted state: checks the model, the likelihood and the training call."""

    _strategy_type: Any = IterNCGPStrategy
    approximation: str = ""  # the approximation whose evidence this is, in words ("Laplace", "EP")

    def __init__(self, likelihood, model, exact: bool | None = None):
        super().__init__(likelihood, model)
        name, strategy_name = type(self).__name__, self._strategy_type.__name__
        strategy = getattr(model, "variational_strategy", None)
        if not isinstance(strategy, self._strategy_type):
            raise TypeError(f"{name} needs a model whose variational_strategy is an {strategy_name}.")
        if strategy.likelihood is not likelihood:
            raise ValueError(f"{name}: likelihood must be the one the model's {strategy_name} uses.")
        self.exact = exact
        if not hasattr(model, "custom_fit"):  # botorch.fit.fit_gpytorch_mll(mll) runs fit_mll
            object.__setattr__(model, "custom_fit", BoTorchFitHook())

    def _checked_call(self, function_dist, target: Tensor):
        r"""The strategy, validated targets, its state and the prior (with gradients) for ``mll(model(train_x), train_y)``.

        :raises ValueError: if ``function_dist`` was not computed at the training inputs (another number of points,
            or a mean that is not the strategy's posterior mean there) or ``target`` is not the training targets.
        """
        name = type(self).__name__
        strategy = self.model.variational_strategy
        mean = getattr(function_dist, "mean", None)
        size = strategy.num_data * strategy.num_latents
        if mean is None or mean.numel() != size:
            raise ValueError(
                f"{name}: function_dist holds {None if mean is None else mean.numel()} latent "
                f"values, but the training data has {strategy.num_data} points x {strategy.num_latents} latent(s); "
                "call mll(model(train_x), train_y) with the strategy's training inputs."
            )
        targets = strategy.adapter.check_targets(target, strategy.train_inputs.dtype)
        same = targets.shape == strategy.train_targets.shape and bool(
            torch.allclose(targets, strategy.train_targets, rtol=0, atol=0, equal_nan=True)  # NaN: a missing output
        )
        if not same:
            raise ValueError(f"{name}: target must equal the strategy's training targets.")
        state = strategy.ensure_fitted()  # model(train_x) has fitted it: no work here
        prior = self._train_prior(strategy)
        fitted = self._fitted_mean(state, prior)
        given = mean.detach().reshape(-1)
        if not bool(torch.allclose(given, fitted, rtol=1e-4, atol=1e-4 * (1 + float(fitted.abs().max())))):
            raise ValueError(
                f"{name}: the mean of function_dist is not the strategy's posterior mean at the current "
                "hyperparameters; call mll(model(train_x), train_y) right after computing model(train_x)."
            )
        exact = exact_regime(strategy) if self.exact is None else self.exact
        return strategy, targets, state, prior, exact

    def _train_prior(self, strategy: Any) -> Any:
        """The strategy's prior at the training inputs, with gradients (the one ``model(train_x)`` evaluated, where
        the hyperparameters are unchanged: :meth:`~gpytorch_iterncgp.IterNCGPStrategy.evidence_prior`)."""
        return strategy.evidence_prior()

    def _fitted_mean(self, state: Any, prior: Any) -> Tensor:
        """The strategy's posterior mean at the training inputs, ``(N C,)`` (what ``model(train_x)`` returned)."""
        return prior.mean.detach().reshape(-1) + prior.rows.all_rows(state.kernel_representer_weights)

    def log_prior(self) -> Tensor:
        """:func:`log_prior` of this objective's model and likelihood."""
        return log_prior(self)

    def _per_point(self, evidence: Tensor, num_data: int) -> Tensor:
        """``(evidence + log_prior()) / N``: with priors the loss of a MAP estimate, as GPyTorch's
        ``ExactMarginalLogLikelihood`` adds them."""
        if not math.isfinite(float(evidence.detach())):
            raise NonFiniteEvidenceError(
                f"{type(self).__name__}: the evidence is {float(evidence.detach())} at the current "
                "hyperparameters (overflow of the likelihood, or EP sites that did not converge); lower the learning "
                "rate, bound the hyperparameters with constraints, or fit the strategy further."
            )
        return (evidence + self.log_prior().to(evidence)) / num_data


class LaplaceMarginalLogLikelihood(_StrategyEvidence):
    r"""The Laplace approximation of :math:`\log p(\mathbf y \mid \mathbf X, \theta)`, divided by :math:`N`.

    For a model whose ``variational_strategy`` is an :class:`~gpytorch_iterncgp.IterNCGPStrategy`:

    .. code-block:: python

        mll = LaplaceMarginalLogLikelihood(likelihood, model)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        for _ in range(100):
            optimizer.zero_grad()
            loss = -mll(model(train_x), train_y)
            loss.backward()
            optimizer.step()

    Every call re-finds the mode for the current hyperparameters, warm-started from the previous one
    (the strategy renews its stale kernel products after each optimizer step). See the module docstring
    for the two regimes.

    :param likelihood: the strategy's likelihood.
    :param model: the ``ApproximateGP`` with an ``IterNCGPStrategy``.
    :param exact: force the exact (``True``) or matrix-free (``False``) regime; default: exact when
        :math:`N C \le` :class:`gpytorch_iterncgp.settings.exact_evidence_size` (1000).
    """

    _strategy_type = IterNCGPStrategy
    approximation = "Laplace"

    def forward(self, function_dist, target: Tensor, **kwargs) -> Tensor:
        """The Laplace evidence per data point of the training data.

        :param function_dist: ``model(train_x)``: the strategy's posterior at the training inputs, whose mean is
            the mode the evidence is computed at.
        :raises ValueError: if ``function_dist`` was not computed at the training inputs (another number of
            points, or a mean that is not the strategy's mode) or ``target`` is not the training targets.
        :raises NonFiniteEvidenceError: if the evidence is not finite.
        """
        strategy, targets, state, prior, exact = self._checked_call(function_dist, target)
        if exact:
            kernel_matrix = prior.data_major_covariance().to_dense()
            prior_mean = prior.mean.reshape(-1)
            evidence = exact_laplace_evidence(
                kernel_matrix,
                prior_mean,
                strategy.adapter,
                targets,
                prior.rows.all_rows(state.representer_weights),
            )
        else:
            factor = evidence_kernel_factor(strategy, prior)
            evidence = matrix_free_laplace_evidence(prior, strategy.adapter, targets, state, factor)
        return self._per_point(evidence, strategy.num_data)


class EPMarginalLogLikelihood(_StrategyEvidence):
    r"""The EP approximation :math:`\log Z_{EP}` of :math:`\log p(\mathbf y \mid \mathbf X, \theta)`, divided by :math:`N`.

    For a model whose ``variational_strategy`` is an :class:`~gpytorch_iterncgp.EPStrategy`, in the usual GPyTorch
    loop (``loss = -mll(model(train_x), train_y)``); every call re-converges the sites for the current
    hyperparameters, warm-started from the previous sites. The value is R&W eq. 3.65 (:func:`ep_evidence`); at
    the EP fixed point its derivative with respect to the sites vanishes, so the gradient with respect to the
    kernel and mean hyperparameters is that of :math:`\log \mathcal N(\tilde{\boldsymbol\mu} \mid \mathbf m,
    \mathbf K + \tilde{\mathbf T}^{-1})` with the sites held fixed (R&W sec. 5.5.2, eq. 5.27; Seeger 2005). The
    gradient is exact at the fixed point: as exact as the strategy's convergence (``site_tol``, a complete solve).

    * **exact** (:math:`N \le` ``settings.exact_evidence_size``): dense Cholesky of
      :math:`\mathbf B = \mathbf I + \tilde{\mathbf T}^{1/2} \mathbf K \tilde{\mathbf T}^{1/2}`; the cavities from the
      exact marginals of the sites.
    * **matrix-free**: :math:`\log\lvert\mathbf B\rvert` by stochastic Lanczos quadrature and
      :math:`\mathbf b^\top \mathbf B^{-1} \mathbf b` by CG (linear_operator), products with :math:`\mathbf K` only; the
      cavities from the strategy's marginals (exact for a complete solve), bounded below by the prior precision as in
      the sweeps. With an incomplete solve the sites are those of the computation-aware EP, not exact EP's, and the
      value and gradient are biased towards larger outputscales (``docs/design_notes.md``): the estimators learn EP's
      hyperparameters on Laplace's evidence (there, and by default everywhere: ``LearningRecipe.evidence``).

    The package's EP likelihoods (probit, logit, Poisson) have no parameters of their own.

    :param likelihood: the strategy's likelihood.
    :param model: the ``ApproximateGP`` with an ``EPStrategy``.
    :param exact: force the exact (``True``) or matrix-free (``False``) regime.
    """

    _strategy_type = EPStrategy
    approximation = "EP"
    _warned = False  # EstimatedEvidenceWarning once per objective

    def forward(self, function_dist, target: Tensor, **kwargs) -> Tensor:
        """The EP evidence per data point of the training data.

        :raises ValueError: as :class:`LaplaceMarginalLogLikelihood`.
        :raises NonFiniteEvidenceError: if the evidence is not finite (e.g. a cavity precision that is not positive:
            the sites did not converge).
        """
        strategy, targets, state, prior, exact = self._checked_call(function_dist, target)
        if not exact and strategy.options.max_solver_iterations is not None and not self._warned:
            self._warned = True
            warnings.warn(
                f"EPMarginalLogLikelihood is estimated here (N C = {strategy.num_data * strategy.num_latents} > "
                f"exact_evidence_size = {settings.exact_evidence_size.value()}) from an incomplete solve "
                f"(max_solver_iterations={strategy.options.max_solver_iterations}): its maximiser is biased towards "
                "large outputscales (over-confident predictions). gpytorch_iterncgp.fit_mll(mll) learns EP's "
                "hyperparameters without this bias (Laplace's evidence, then a held-out choice of the outputscale).",
                EstimatedEvidenceWarning,
                stacklevel=3,
            )
        marginals = None if exact else ExpectationPropagation.marginals_of(prior, state)
        block = prior.rows  # the sites of every rank where they are held by rows (the evidence is replicated)
        sites = block.all_points(state.site_precision), block.all_points(state.site_natural_mean)
        factor = None if exact else evidence_kernel_factor(strategy, prior)
        evidence = ep_evidence(prior, strategy.adapter, targets, *sites, exact, marginals, factor)
        return self._per_point(evidence, strategy.num_data)


def ep_evidence(
    prior: LatentPrior,
    adapter: LikelihoodAdapter,
    targets: Tensor,
    site_precision: Tensor,
    site_natural_mean: Tensor,
    exact: bool = True,
    marginals: tuple[Tensor, Tensor] | None = None,
    kernel_factor: LowRankKernelFactor | None = None,
) -> Tensor:
    r"""The EP log marginal likelihood at fixed sites, differentiable in the prior's hyperparameters.

    R&W eq. 3.65 with :math:`|\mathbf K + \tilde{\mathbf T}^{-1}| = |\tilde{\mathbf T}|^{-1} |\mathbf B|` and
    :math:`\mathbf b = \tilde{\mathbf T}^{1/2}(\tilde{\boldsymbol\mu} - \mathbf m) = (\tilde{\boldsymbol\nu} - \tilde{\boldsymbol\tau} \mathbf m) /
    \sqrt{\tilde{\boldsymbol\tau}}`, so that a flat site (:math:`\tilde\tau_i = \tilde\nu_i = 0`) contributes nothing:

    .. math::
        \log Z_{EP} = -\tfrac12 \log|\mathbf B| - \tfrac12 \mathbf b^\top \mathbf B^{-1} \mathbf b
        + \sum_i \Big[\log \hat Z_i + \tfrac12 \log\big(1 + \tfrac{\tilde\tau_i}{\tau_{-i}}\big)
        + \frac{(\tilde\tau_i \mu_{-i} - \tilde\nu_i)^2 \, \tau_{-i}}{2 \tilde\tau_i (\tilde\tau_i + \tau_{-i})}\Big],

    :math:`\mathbf B = \mathbf I + \tilde{\mathbf T}^{1/2} \mathbf K \tilde{\mathbf T}^{1/2}`, with the cavities
    :math:`(\tau_{-i}, \mu_{-i})` of the posterior marginals and :math:`\log \hat Z_i` at them. The value is that
    sum; the gradient is that of the first two terms (:math:`\log \mathcal N(\tilde{\boldsymbol\mu} \mid \mathbf m,
    \mathbf K + \tilde{\mathbf T}^{-1})` up to site constants), the total derivative at the EP fixed point.

    :math:`C \times C` site blocks (multinomial probit): :math:`\tilde{\mathbf T}^{1/2}` becomes the block roots
    :math:`\mathbf R` of :func:`~gpytorch_iterncgp.ep.sites.site_roots` and :math:`\mathbf b = \mathbf R^+(\tilde{\boldsymbol\nu}
    - \tilde{\mathbf T}\mathbf m)`; the sites' part is :func:`ep_site_block_terms`.

    :param prior: the prior at the training inputs, built *with* gradients.
    :param site_precision: :math:`\tilde{\boldsymbol\tau}` ``(N,)`` or blocks ``(N, C, C)``; ``site_natural_mean``:
        :math:`\tilde{\boldsymbol\nu}` ``(N,)`` or ``(N, C)``.
    :param exact: dense Cholesky (and exact marginals) or linear_operator's CG and stochastic Lanczos quadrature.
    :param marginals: the posterior marginals for the cavities (means and variances ``(N,)``, or ``(N, C)`` and
        ``(N, C, C)``); required unless ``exact``.
    :param kernel_factor: preconditions the matrix-free regime's CG and Lanczos quadrature
        (:func:`evidence_kernel_factor`), or ``None``.
    """
    tau, nu = site_precision.detach(), site_natural_mean.detach()
    num_latents = prior.num_latents
    prior_mean = prior.mean.reshape(-1)
    roots, rhs = site_roots(tau, nu, prior_mean if num_latents == 1 else prior_mean.reshape(-1, num_latents))
    num_points = len(roots)
    if exact:
        kernel = prior.data_major_covariance().to_dense()
        size = len(kernel)
        rooted = (roots.mT @ kernel.reshape(num_points, num_latents, size)).reshape(size, size)  # R^T K
        quadratic = torch.einsum("imb,mbd->imd", rooted.reshape(size, num_points, num_latents), roots)
        system = torch.eye(size, dtype=kernel.dtype, device=kernel.device) + quadratic.reshape(size, size)
        cholesky = torch.linalg.cholesky(system)
        whitened = torch.linalg.solve_triangular(cholesky, rhs[:, None], upper=False)[:, 0]
        fixed_site_part = -cholesky.diagonal().log().sum() - 0.5 * whitened.square().sum()
        with torch.no_grad():
            rooted_kernel = torch.linalg.solve_triangular(cholesky, rooted, upper=False)
            mean = prior_mean + rooted_kernel.mT @ whitened
            columns = rooted_kernel.reshape(size, num_points, num_latents)
            covariance = prior.point_blocks() - torch.einsum("knc,knd->ncd", columns, columns)
            marginals = (
                (mean, covariance.reshape(-1)) if num_latents == 1 else (mean.reshape(num_points, -1), covariance)
            )
    else:
        if marginals is None:
            raise ValueError("ep_evidence: the matrix-free regime needs the posterior marginals (mean, variance).")
        system = _whitened_kernel(prior, roots, kernel_factor)
        inv_quad, logdet = system.inv_quad_logdet(inv_quad_rhs=rhs[:, None], logdet=True)
        fixed_site_part = -0.5 * logdet - 0.5 * inv_quad
    mean, variance = (marginal.detach() for marginal in marginals)
    # Computation-aware marginals (an incomplete solve) are too wide: their cavities are bounded by the prior as in
    # the sweeps (ep.sites); exact marginals never meet the bound.
    bound = None if exact else (prior.diagonal().reshape(-1) if num_latents == 1 else prior.point_blocks()).detach()
    if num_latents == 1:
        return fixed_site_part + ep_site_terms(adapter, targets, mean, variance, tau, nu, bound)
    return fixed_site_part + ep_site_block_terms(targets, mean, variance, tau, nu, bound)


def ep_site_terms(
    adapter: LikelihoodAdapter,
    targets: Tensor,
    mean: Tensor,
    variance: Tensor,
    tau: Tensor,
    nu: Tensor,
    prior_variance: Tensor | None = None,
) -> Tensor:
    r"""The sites' part of :math:`\log Z_{EP}` (:func:`ep_evidence`), no gradient:
    :math:`\sum_i \log \hat Z_i + \tfrac12 \log(1 + \tilde\tau_i/\tau_{-i}) + (\tilde\tau_i \mu_{-i} -
    \tilde\nu_i)^2 \tau_{-i} / (2 \tilde\tau_i (\tilde\tau_i + \tau_{-i}))` with the cavities of the posterior marginals
    ``(mean, variance)``, their precisions bounded below by :math:`1 / k_{ii}` where ``prior_variance`` is given
    (:func:`~gpytorch_iterncgp.ep.sites.cavities`); NaN if a cavity precision is not positive (the sites are not at
    a fixed point).
    """
    with torch.no_grad():
        positive = tau > 0
        cavity_precision, cavity_natural_mean = cavities(mean, variance, tau, nu, prior_variance)
        if not bool((cavity_precision > 0).all()):
            return torch.tensor(math.nan, dtype=mean.dtype, device=mean.device)
        cavity_variance = cavity_precision.reciprocal()
        cavity_mean = cavity_natural_mean * cavity_variance
        log_normalizer, _, _ = tilted_moments(adapter, targets, cavity_mean, cavity_variance)
        ratio = tau / cavity_precision
        safe_tau = torch.where(positive, tau, 1)
        mismatch = torch.where(positive, (tau * cavity_mean - nu).square() / (safe_tau * (1 + ratio)), 0.0)
        return (log_normalizer + 0.5 * torch.log1p(ratio) + 0.5 * mismatch).sum()


def ep_site_block_terms(
    targets: Tensor,
    mean: Tensor,
    covariance: Tensor,
    precision: Tensor,
    natural_mean: Tensor,
    prior_covariance: Tensor | None = None,
) -> Tensor:
    r"""The sites' part of :math:`\log Z_{EP}` for :math:`C \times C` multinomial probit sites, no gradient:

    .. math::
        \sum_i \Big[\log\hat Z_i + A(\boldsymbol\nu_{-i}, \boldsymbol\Lambda_{-i})
        - A(\boldsymbol\Sigma_{ii}^{-1}\boldsymbol\mu_i, \boldsymbol\Sigma_{ii}^{-1})
        + \tfrac12 \tilde{\boldsymbol\nu}_i^\top \tilde{\mathbf T}_i^+ \tilde{\boldsymbol\nu}_i\Big],
        \qquad A(\boldsymbol\eta, \boldsymbol\Lambda) = \tfrac12 \boldsymbol\eta^\top\boldsymbol\Lambda^{-1}
        \boldsymbol\eta - \tfrac12 \log|\boldsymbol\Lambda|

    (R&W eq. 3.65 for blocks; with the first two terms of :func:`ep_evidence` it is :math:`\log Z_{EP} = A(\text{post})
    - A(\text{prior}) + \sum_i [\log\hat Z_i + A(\text{cavity}_i) - A(\text{marginal}_i)]`), cavities of the marginals
    ``(mean (N, C), covariance (N, C, C))`` (:func:`~gpytorch_iterncgp.ep.sites.block_cavities`, bounded by the
    prior blocks :math:`\mathbf K_{ii}` where ``prior_covariance`` is given) and :math:`\log\hat Z_i` by nested EP. NaN
    if a cavity precision is not positive definite.
    """
    with torch.no_grad():
        cavity_precision, cavity_natural_mean, _ = block_cavities(
            mean, covariance, precision, natural_mean, prior_covariance
        )
        cavity_root, cavity_info = torch.linalg.cholesky_ex(cavity_precision)
        marginal_root, marginal_info = torch.linalg.cholesky_ex(covariance)
        if bool((cavity_info > 0).any() or (marginal_info > 0).any()):
            return torch.tensor(math.nan, dtype=mean.dtype, device=mean.device)
        cavity_covariance = torch.cholesky_inverse(cavity_root)
        cavity_mean = (cavity_covariance @ cavity_natural_mean.unsqueeze(-1)).squeeze(-1)
        log_normalizer = multinomial_probit_moments(targets, cavity_mean, cavity_covariance)[0]
        whitened_mean = torch.linalg.solve_triangular(marginal_root, mean.unsqueeze(-1), upper=False).squeeze(-1)
        basis = zero_sum_basis(mean.shape[-1], mean.dtype, mean.device)
        values, vectors = site_block_spectrum(precision, basis)
        projected = (vectors.mT @ natural_mean.unsqueeze(-1)).squeeze(-1)
        terms = (
            log_normalizer
            + 0.5 * (cavity_natural_mean * cavity_mean).sum(-1)
            - cavity_root.diagonal(dim1=-2, dim2=-1).log().sum(-1)
            - 0.5 * whitened_mean.square().sum(-1)
            - marginal_root.diagonal(dim1=-2, dim2=-1).log().sum(-1)
            + 0.5 * (site_block_pseudo_inverse(values) * projected.square()).sum(-1)
        )
        return terms.sum()
