r"""A preconditioner for IterGP's systems :math:`\hat{\mathbf K} = \mathbf K + \mathbf W^{-1}`: a low-rank part of
:math:`\mathbf K` plus the noise, inverted by Woodbury.

With a factor :math:`\mathbf K \approx \mathbf L \mathbf L^\top` (``(n, r)``, data-major, :math:`n = N C`) and the
block-diagonal curvature :math:`\mathbf W` (the (pseudo-)inverse of the noise),

.. math::
    \mathbf M^{-1} = (\mathbf L \mathbf L^\top + \mathbf W^{-1})^{-1}
    = \mathbf W - \mathbf W \mathbf L \mathbf G^{-1} \mathbf L^\top \mathbf W, \qquad
    \mathbf G = \mathbf I_r + \mathbf L^\top \mathbf W \mathbf L ,

which needs products with :math:`\mathbf W` only, never with :math:`\mathbf W^{-1}`, so it holds for the softmax's
singular :math:`\mathbf W` and EP's flat sites (:math:`\mathbf M^{-1} = \mathbf W^{1/2} (\mathbf I + \mathbf W^{1/2}
\mathbf L \mathbf L^\top \mathbf W^{1/2})^{-1} \mathbf W^{1/2}`, positive definite on :math:`\operatorname{range}(\mathbf
W)`; Rasmussen & Williams, Section 3.4.3, with :math:`\mathbf K` replaced by its low-rank part). IterGP takes
:math:`\mathbf s_j = \mathbf M^{-1} \mathbf r_{j-1}` as its CG action: preconditioned CG, one of IterGP's policies
(Wenger et al. 2022, *Posterior and Computational Uncertainty in Gaussian Processes*), so the approximate precision is
still :math:`\mathbf S (\mathbf S^\top \hat{\mathbf K} \mathbf S)^{-1} \mathbf S^\top` and the posterior never narrower
than the exact one. The residual's spectrum that unpreconditioned CG faces spans :math:`[\lambda_{\min}(\mathbf W^{-1}),
\lambda_{\max}(\mathbf K)]`; :math:`\mathbf W` takes off the noise's scale and :math:`\mathbf L` the leading spectrum of
:math:`\mathbf K` (Gardner et al. 2018, pivoted Cholesky in BBMM; Wenger et al. 2022, *Preconditioning for Scalable
Gaussian Process Hyperparameter Optimization*).

The factor depends on the kernel only, so an outer loop builds it once per fit (:func:`low_rank_kernel_factor`);
:math:`\mathbf G` depends on :math:`\mathbf W` and is formed for each solve (:class:`WoodburyPreconditioner`,
:math:`O(N r^2)` for :math:`r` columns of :math:`\mathbf L`, no product with :math:`\mathbf K`).

* :class:`ClassFactor`: :math:`\mathbf K` block diagonal over the classes (one GP, a kernel shared by the classes, one
  GP per class): a partial pivoted Cholesky factor of each class's kernel (Harbrecht, Peters & Schneider 2012), of
  rank :math:`\lceil r / C \rceil` each, from as many kernel columns per class, :math:`O(N D)` each; one factor for a
  shared kernel.
* :class:`PointFactor`: correlated latents (a multitask or LMC kernel): a randomized Nyström approximation from one
  product with ``rank`` Gaussian columns (Frangella, Tropp & Udell 2023, Algorithm 2.1, with its shift).

Where the solver's vectors are held by rows (``ShardedKernel(..., shard_state=True)``) the factor holds this rank's
rows: pivots are chosen by two ``all_reduce`` of a number per class, :math:`\mathbf L^\top \mathbf x` and
:math:`\mathbf L^\top \mathbf W \mathbf L` are sums over the ranks.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator

import torch
from linear_operator.operators import LinearOperator
from torch import Tensor

from .noise import curvature_matmul
from .prior import LatentPrior
from .recycling import ActionBuffer
from .sharding import RowBlock

# The pivoted Cholesky factorisation stops for a class where the largest remaining diagonal entry of its kernel falls
# below this fraction of the largest prior variance: above float32's rounding of the kernel columns, so that a float32
# and a float64 model take the same pivots (the factor's actions, KernelPreconditioning.seeded).
PIVOT_TOLERANCE = 1e-5


class LowRankKernelFactor:
    r""":math:`\mathbf L` ``(n, r)`` of :math:`\mathbf K \approx \mathbf L \mathbf L^\top` (this rank's rows ``n``), with
    the three products the Woodbury form needs."""

    rank: int  # r, the columns of L
    columns: Tensor  # the factor's entries, (N, C, k) or (N, C, r)

    def matmul(self, coefficients: Tensor) -> Tensor:
        r""":math:`\mathbf L \mathbf X` ``(n, m)`` for ``(r, m)``."""
        raise NotImplementedError

    def transpose_matmul(self, vectors: Tensor) -> Tensor:
        r""":math:`\mathbf L^\top \mathbf V` ``(r, m)`` for ``(n, m)`` (this rank's rows' share of it)."""
        raise NotImplementedError

    def curvature_gram(self, curvature_blocks: Tensor) -> Tensor:
        r""":math:`\mathbf L^\top \mathbf W \mathbf L` ``(r, r)`` for the curvature's blocks :math:`\mathbf W_n`
        ``(N, C, C)`` (this rank's points' share of it)."""
        raise NotImplementedError


class ClassFactor(LowRankKernelFactor):
    r"""A factor of a kernel block diagonal over the classes: :math:`\mathbf L_{(n, c), (c', j)} = \delta_{c c'}
    \mathbf F_{n c j}`, rank :math:`r = C k`, columns ordered class-major.

    :param columns: :math:`\mathbf F` ``(N, C, k)`` (a view with stride 0 over the classes for a shared kernel).
    :param pivots: the points ``(c, k)`` of the kernel columns behind :math:`\mathbf F` (``c`` = 1 for a kernel shared by
        the classes, :math:`C` for one per class; ``-1`` where a class stopped early).
    """

    def __init__(self, columns: Tensor, pivots: Tensor):
        self.columns, self.pivots = columns, pivots
        self.rank = columns.shape[1] * columns.shape[2]

    def matmul(self, coefficients: Tensor) -> Tensor:
        num_points, num_classes, width = self.columns.shape
        blocks = coefficients.reshape(num_classes, width, -1)
        return torch.einsum("ncj,cjm->ncm", self.columns, blocks).reshape(num_points * num_classes, -1)

    def transpose_matmul(self, vectors: Tensor) -> Tensor:
        num_points, num_classes, _ = self.columns.shape
        blocks = vectors.reshape(num_points, num_classes, -1)
        return torch.einsum("ncj,ncm->cjm", self.columns, blocks).reshape(self.rank, -1)

    def curvature_gram(self, curvature_blocks: Tensor) -> Tensor:
        num_points, num_classes, width = self.columns.shape
        rows = []
        for latent in range(num_classes):  # row block c: F_c^T diag(W_{:, c, d}) F_d for every d at once
            weighted = curvature_blocks[:, latent, :, None] * self.columns  # (N, C, k)
            rows.append(self.columns[:, latent, :].mT @ weighted.reshape(num_points, num_classes * width))
        return torch.cat(rows, dim=0)


class PointFactor(LowRankKernelFactor):
    r"""A dense factor: :math:`\mathbf L_{(n, c), j} = \mathbf F_{n c j}`, rank :math:`r`.

    :param columns: :math:`\mathbf F` ``(N, C, r)``.
    :param sketch: the Nyström sketch :math:`\boldsymbol\Omega` ``(N C, s)`` behind it, and ``image`` its product
        :math:`\mathbf K \boldsymbol\Omega` (this rank's rows).
    """

    def __init__(self, columns: Tensor, sketch: Tensor, image: Tensor):
        self.columns, self.sketch, self.image = columns, sketch, image
        self.rank = columns.shape[-1]

    def _flat(self) -> Tensor:
        return self.columns.reshape(-1, self.rank)

    def matmul(self, coefficients: Tensor) -> Tensor:
        return self._flat() @ coefficients

    def transpose_matmul(self, vectors: Tensor) -> Tensor:
        return self._flat().mT @ vectors

    def curvature_gram(self, curvature_blocks: Tensor) -> Tensor:
        return self._flat().mT @ (curvature_blocks @ self.columns).reshape(-1, self.rank)


def _pivot_columns(prior: LatentPrior, classes: int, num_points: int) -> Callable[[Tensor], Tensor]:
    r"""A function from the pivots ``(c,)`` (one point per class) to each class's kernel column at its pivot, this
    rank's rows ``(c, |I_p|)``: indexed in the kernel matrix where it is evaluated (:meth:`LatentPrior.evaluated_kernel`,
    counted as the prior's columns), else :meth:`LatentPrior.kernel_columns_by_rows`."""
    num = prior.num_latents
    latents = torch.arange(classes, device=prior.device)
    dense = None if prior.rows.is_sharded else prior.evaluated_kernel()
    if dense is None:

        def evaluated(pivot: Tensor) -> Tensor:
            columns = prior.kernel_columns_by_rows(pivot * num + latents)  # (|I_p| C, c)
            return columns.reshape(num_points, num, classes)[:, latents, latents].mT

        return evaluated
    matrix = dense.detach().reshape(classes, num_points, -1)  # (c, N, N): one kernel, or one per class

    def indexed(pivot: Tensor) -> Tensor:
        prior.count(classes)
        return matrix[latents, pivot]  # the pivot's row: its column (K is symmetric), read contiguously

    return indexed


def pivoted_cholesky_factor(prior: LatentPrior, rank: int, cache_kernel: bool = True) -> ClassFactor:
    r"""A partial pivoted Cholesky factor of rank :math:`k = \lceil r / C \rceil` of each class's kernel (one for a
    kernel shared by the classes; :math:`\mathbf L` then has :math:`C k \approx r` columns), from :math:`k` kernel
    columns per class (:meth:`LatentPrior.kernel_columns_by_rows`, all classes' in one
    call per pivot).

    Each step takes the point with the largest remaining diagonal entry :math:`d_p` of the class,
    :math:`\mathbf l = (\mathbf k_p - \mathbf L \mathbf L_{p,:}^\top) / \sqrt{d_p}`, :math:`\mathbf d \leftarrow \mathbf d -
    \mathbf l^2`; a class stops (zero columns) where :math:`d_p` falls below :data:`PIVOT_TOLERANCE` times its largest
    prior variance.

    :param prior: a prior of layout ``"single"``, ``"shared"`` or ``"independent"``.
    :param rank: :math:`r`, the columns of :math:`\mathbf L` (:math:`\mathbf L^\top \mathbf W \mathbf L` costs
        :math:`O(N r^2)` per solve).
    :param cache_kernel: evaluate and cache the kernel matrix where the prior's products would
        (:meth:`LatentPrior.cache_kernel`), so that the columns are read from it; ``False``: each column is evaluated
        (for a prior whose products never run, :math:`O(N D r)` instead of :math:`O(N^2 D)`).
    :return: the factor, this rank's rows where the prior's rows are sharded.
    """
    rows_block, num = prior.rows, prior.num_latents
    classes = num if prior.layout == "independent" else 1
    if cache_kernel:
        prior.cache_kernel()  # (where the products would cache K: its columns are then read, not evaluated one by one)
    # in float64 whatever the model's dtype: the pivots (ties broken by rounding) are then those of a float64 model
    diagonal = (
        rows_block.own_rows(prior.diagonal())
        .reshape(-1, num)[:, :classes]
        .mT.double()
        .clone(memory_format=torch.contiguous_format)
    )  # (c, |I_p|), updated in place
    num_points = diagonal.shape[-1]
    rank = min(-(-rank // num), prior.shape[0])
    factor = diagonal.new_zeros(classes, rank, num_points)  # L^T per class: its first rows are contiguous
    pivots = torch.full((classes, rank), -1, dtype=torch.long, device=diagonal.device)
    floor = PIVOT_TOLERANCE * rows_block.maximum(diagonal.max(dim=-1).values)
    first_point = rows_block.start // num
    latents = torch.arange(classes, device=diagonal.device)
    read = _pivot_columns(prior, classes, num_points)
    for step in range(rank):
        value, pivot = rows_block.largest_point(diagonal)
        active = value > floor
        if not bool(active.any()):
            factor, pivots = factor[:, :step], pivots[:, :step]
            break
        pivots[:, step] = pivot.masked_fill(~active, -1)
        column = read(pivot).double()  # (c, |I_p|): class c's kernel column at its pivot
        local = (pivot - first_point).clamp_(0, max(num_points - 1, 0))  # the pivot's row here, if this rank holds it
        held = pivot - first_point == local  # (c,): in one process, always
        at_pivot = rows_block.summed(factor[latents, :step, local] * held[:, None])  # (c, step): L_p
        new = torch.baddbmm(column[:, None, :], at_pivot[:, None, :], factor[:, :step], alpha=-1)[:, 0]
        new *= (active / value.clamp_min(floor).sqrt())[:, None]  # l = (k_p - L L_p^T) / sqrt(d_p)
        factor[:, step] = new
        diagonal.sub_(new.square_()).clamp_min_(0)
        diagonal[latents, local] *= ~held  # the pivot itself is exact
    columns = factor.permute(2, 0, 1).to(prior.dtype)  # (|I_p|, c, k)
    if classes == 1 and num > 1:
        columns = columns.expand(-1, num, -1)
    return ClassFactor(columns, pivots)


def nystrom_factor(
    prior: LatentPrior, rank: int, project: Callable[[Tensor], Tensor] | None = None, seed: int = 0
) -> PointFactor:
    r"""A randomized Nyström factor of :math:`\mathbf K` from one product with ``rank`` Gaussian columns
    :math:`\boldsymbol\Omega` (Frangella, Tropp & Udell 2023, Algorithm 2.1): :math:`\mathbf Y = \mathbf K
    \boldsymbol\Omega + \nu \boldsymbol\Omega`, :math:`\mathbf B = \mathbf Y \operatorname{chol}(\boldsymbol\Omega^\top
    \mathbf Y)^{-\top}` (here by the eigenvectors of :math:`\boldsymbol\Omega^\top \mathbf Y` above rounding, for a
    singular :math:`\mathbf K`), and with the thin SVD :math:`\mathbf B = \mathbf U \boldsymbol\Sigma \mathbf V^\top` the factor
    :math:`\mathbf U \max(\boldsymbol\Sigma^2 - \nu, 0)^{1/2}`, :math:`\nu` a shift at rounding level.

    The columns :math:`\boldsymbol\Omega` come from a CPU generator seeded with ``seed`` (reproducible on any device),
    mapped by ``project`` (the solver's projection of its actions: then :math:`\boldsymbol\Omega` can be actions too).
    Held by rows: the product by :meth:`LatentPrior.matmul_by_rows`, the small Gram matrices summed over the ranks,
    and the SVD's left factor as :math:`\mathbf B \mathbf V \boldsymbol\Sigma^{-1}` (this rank's rows).

    :return: the factor ``(N, C, r)``, this rank's rows where the prior's rows are sharded.
    """
    rows_block, num = prior.rows, prior.num_latents
    rank = min(rank, prior.shape[0] * num)
    generator = torch.Generator().manual_seed(seed)
    sketch = torch.randn(rows_block.size, rank, generator=generator, dtype=torch.float64)
    sketch = rows_block.own_rows(sketch).to(prior.dtype).to(prior.device)
    if project is not None:
        sketch = project(sketch)
    product = prior.matmul_by_rows(sketch)
    image, actions = product.double(), sketch
    sketch = sketch.double()
    shift = math.sqrt(rows_block.size) * torch.finfo(prior.dtype).eps * float(rows_block.norm(image.reshape(-1)))
    image = image + shift * sketch
    core = rows_block.summed(sketch.mT @ image)
    values, vectors = torch.linalg.eigh((core + core.mT) / 2)  # (a pseudo-inverse: K may be singular, e.g. an LMC)
    kept = values > 1e-12 * values[-1]
    basis = image @ (vectors[:, kept] / values[kept].sqrt())  # B, K + nu I ~ B B^T
    gram = rows_block.summed(basis.mT @ basis)  # B^T B = V S^2 V^T
    squares, right = torch.linalg.eigh(gram)
    kept = squares > shift
    squares, right = squares[kept], right[:, kept]
    left = basis @ (right / squares.sqrt())  # U
    columns = left * (squares - shift).sqrt()
    return PointFactor(columns.to(prior.dtype).reshape(-1, num, columns.shape[-1]), actions, product)


def low_rank_kernel_factor(
    prior: LatentPrior, rank: int, project: Callable[[Tensor], Tensor] | None = None, cache_kernel: bool = True
) -> LowRankKernelFactor:
    """The preconditioner's factor of ``prior``'s kernel: :func:`pivoted_cholesky_factor` (``cache_kernel`` passed on)
    where the kernel is block diagonal over the classes, :func:`nystrom_factor` (its sketch mapped by ``project``) for
    correlated latents (``"multitask"``)."""
    if prior.layout == "multitask":
        return nystrom_factor(prior, rank, project)
    return pivoted_cholesky_factor(prior, rank, cache_kernel)


class WoodburyPreconditioner:
    r""":math:`\mathbf r \mapsto \mathbf M^{-1} \mathbf r = \mathbf W \mathbf r - \mathbf W \mathbf L \mathbf G^{-1}
    \mathbf L^\top \mathbf W \mathbf r` for one solve's noise (see the module docstring); ``(n,)`` vectors held by
    ``rows_block``. :math:`\mathbf G` and its Cholesky factor are formed in float64 whatever the model's dtype.

    :param factor: :math:`\mathbf L`, the kernel's low-rank factor.
    :param noise_inverse: :math:`\mathbf W^{-1}` of the solve (this rank's blocks).
    :param num_latents: :math:`C`.
    :param rows_block: the rows of the solver's vectors this process holds.
    """

    def __init__(
        self, factor: LowRankKernelFactor, noise_inverse: LinearOperator, num_latents: int, rows_block: RowBlock
    ):
        self.factor, self.rows_block = factor, rows_block
        self.curvature: Callable[[Tensor], Tensor] = curvature_matmul(noise_inverse, num_latents)
        size = noise_inverse.shape[-1]
        selector = torch.eye(num_latents, dtype=noise_inverse.dtype, device=noise_inverse.device).repeat(
            size // num_latents, 1
        )
        blocks = self.curvature(selector).reshape(-1, num_latents, num_latents)  # W_n, (N, C, C)
        gram = rows_block.summed(factor.curvature_gram(blocks)).double()
        gram = (gram + gram.mT) / 2
        cholesky, info = torch.linalg.cholesky_ex(gram + torch.eye(len(gram), dtype=gram.dtype, device=gram.device))
        if bool(info > 0):  # L^T W L indefinite by rounding (a float32 W): its negative part taken off
            values, vectors = torch.linalg.eigh(gram)
            cholesky = torch.linalg.cholesky((vectors * (1 + values.clamp_min(0))) @ vectors.mT)
        self.gram_cholesky = cholesky

    def __call__(self, residual: Tensor) -> Tensor:
        curved = self.curvature(residual[:, None])  # W r, (n, 1)
        projected = self.rows_block.summed(self.factor.transpose_matmul(curved)).double()  # L^T W r
        solved = torch.cholesky_solve(projected, self.gram_cholesky).to(residual.dtype)
        return (curved - self.curvature(self.factor.matmul(solved)))[:, 0]


class KernelPreconditioning:
    r"""An outer loop's preconditioning over one fit: the kernel's factor built on the first solve and kept (the
    kernel is fixed during a fit), a :class:`WoodburyPreconditioner` for each solve's noise, and the factor's own
    directions as the first actions of a fit (:meth:`seeded`).

    **The factor's actions.** Preconditioned CG reaches the representer weights in few actions, and IterGP's
    precision :math:`\mathbf C = \mathbf S (\mathbf S^\top \hat{\mathbf K} \mathbf S)^{-1} \mathbf S^\top` has no more
    rank than it has actions: the posterior covariance would keep almost all of the prior's. The kernel columns behind
    the factor are known, so the unit vectors at the pivots (each point's latents, projected as the solver projects
    its actions; Nyström: the sketch :math:`\boldsymbol\Omega`) join the buffer with their products with
    :math:`\mathbf K` at no product's cost: :math:`\mathbf C` then holds the pivots' subset-of-data precision, which
    carries the leading part of the posterior covariance (EP's cavities need it). Any actions keep :math:`\mathbf C
    \preceq \hat{\mathbf K}^{-1}` (paper, Proposition A.3), so the covariance stays at least the exact one.

    The factor's kernel columns (or Nyström's product) are counted by the prior as set aside
    (:meth:`~gpytorch_iterncgp.core.prior.LatentPrior.set_aside`), so that a fit's report counts them apart from the
    solver's products with :math:`\mathbf K` (one per iteration): the calls are :attr:`products`, the time they take
    is :attr:`seconds`.

    :param prior: the prior at the training inputs.
    :param rank: :math:`r` (:attr:`~gpytorch_iterncgp.core.solver.IterGPOptions.preconditioner_rank`); ``0``: none.
    :param uses_residual: whether the policy reads the residual (:attr:`~gpytorch_iterncgp.Policy.uses_residual`);
        where it does not (unit vectors) nothing is built.
    :param project: the solver's projection of its actions (this rank's rows), or ``None``.
    :param latents_per_point: the first latents of a pivot point that get an action: :math:`C`, or :math:`C - 1`
        where the actions have zero sum over a point's latents (the last one is then the others' sum).
    """

    def __init__(
        self,
        prior: LatentPrior,
        rank: int,
        uses_residual: bool = True,
        project: Callable[[Tensor], Tensor] | None = None,
        latents_per_point: int | None = None,
    ):
        self.prior, self.rank, self.project = prior, rank if uses_residual else 0, project
        self.latents_per_point = prior.num_latents if latents_per_point is None else latents_per_point
        self._factor: LowRankKernelFactor | None = None
        self.seconds = 0.0  # wall time spent building the factor, its actions and the solves' Woodbury matrices
        self.products = 0  # calls of the kernel's columns or products for the factor and its actions

    @contextlib.contextmanager
    def _apart(self) -> Iterator[None]:
        """The block's kernel columns and products set aside on the prior (:meth:`LatentPrior.set_aside`, which the
        fit's report subtracts from the solver's) and counted in :attr:`products`; its time in :attr:`seconds`."""
        prior = self.prior
        before = prior.products_aside
        start = time.perf_counter()
        try:
            with prior.set_aside():
                yield
        finally:
            self.seconds += time.perf_counter() - start
            self.products += prior.products_aside - before

    @property
    def built_factor(self) -> LowRankKernelFactor | None:
        """The kernel's factor where it has been built, else ``None`` (nothing is built)."""
        return self._factor

    def adopt(self, earlier: KernelPreconditioning) -> None:
        """Take ``earlier``'s factor, where it was built at the same rank and on the same device and dtype: the
        caller's word that it preconditioned the same kernel matrix (the same hyperparameters and rows)."""
        factor = earlier.built_factor
        if factor is None or earlier.rank != self.rank or self.rank == 0:
            return
        if (factor.columns.dtype, factor.columns.device) == (self.prior.dtype, self.prior.device):
            self._factor = factor

    @property
    def factor(self) -> LowRankKernelFactor | None:
        """The kernel's factor (built on first read), or ``None`` without preconditioning."""
        if self._factor is None and self.rank > 0:
            with self._apart():
                self._factor = low_rank_kernel_factor(self.prior, self.rank, self.project)
        return self._factor

    def for_noise(self, noise_inverse: LinearOperator) -> WoodburyPreconditioner | None:
        r"""The preconditioner of :math:`\mathbf K + \mathbf W^{-1}` for ``noise_inverse`` (this rank's blocks), or
        ``None``."""
        factor = self.factor
        if factor is None:
            return None
        with self._apart():
            return WoodburyPreconditioner(factor, noise_inverse, self.prior.num_latents, self.prior.rows)

    def seeded(self, buffer: ActionBuffer) -> ActionBuffer:
        r"""``buffer``, or where it holds no action yet (a fit from the prior, or without recycling) the factor's
        actions and their products with :math:`\mathbf K` (see the class docstring), normalised."""
        factor = self.factor
        if factor is None or buffer.size > 0:
            return buffer
        with self._apart():
            if isinstance(factor, PointFactor):
                actions, kernel_actions = factor.sketch, factor.image
            else:
                assert isinstance(factor, ClassFactor)
                actions, kernel_actions = self._pivot_actions(factor.pivots)
            normalised = self._normalised(actions, kernel_actions)
            return ActionBuffer.from_tensors(*normalised, buffer.rows_block, gemm_columns=None)  # (new actions)

    def with_point_actions(self, buffer: ActionBuffer, points: Tensor) -> ActionBuffer:
        r"""``buffer`` with the unit vectors at the latents of ``points`` (indices of data points, the same on every
        rank; projected as the solver projects, normalised) and their kernel columns appended: no product with
        :math:`\mathbf K` (counted in :attr:`products`). With such an action the posterior variance at a point is at
        most that of the point observed alone, :math:`k_{ii} - k_{ii}^2 / (k_{ii} + \tilde\tau_i^{-1})`, whatever
        the other actions: EP appends the points whose cavity it bounded, so no later sweep bounds them again."""
        if len(points) == 0:
            return buffer
        with self._apart():
            latents = torch.arange(self.latents_per_point, device=points.device)
            actions, kernel_actions = self._unit_actions(
                (points[:, None] * self.prior.num_latents + latents).reshape(-1)
            )
            buffer.extend(*self._normalised(actions, kernel_actions))
        return buffer

    def _normalised(self, actions: Tensor, kernel_actions: Tensor) -> tuple[Tensor, Tensor]:
        """The actions of non-zero norm (missing outputs: none there) and their kernel products, scaled to unit norm."""
        norms = self.prior.rows.summed(actions.square().sum(0)).sqrt()
        kept = norms > 0
        scale = norms[kept].reciprocal()
        return actions[:, kept] * scale, kernel_actions[:, kept] * scale

    def _pivot_actions(self, pivots: Tensor) -> tuple[Tensor, Tensor]:
        r"""The projected unit vectors at the pivots and their products with :math:`\mathbf K`
        (:meth:`_unit_actions`)."""
        num = self.prior.num_latents
        device = pivots.device
        if pivots.shape[0] == 1:  # a kernel shared by the classes (or one latent): each point's first latents
            points = pivots[0][pivots[0] >= 0]
            latents = torch.arange(self.latents_per_point, device=device)
            indices = (points[:, None] * num + latents).reshape(-1)
        else:  # a kernel per class: each class's pivots, in its own latent
            classes = torch.arange(num, device=device)[:, None].expand_as(pivots)
            indices = (pivots * num + classes)[pivots >= 0]
        return self._unit_actions(indices)

    def _unit_actions(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        r"""The projected unit vectors at rows ``indices`` of the ``(N C,)`` vectors (this rank's rows
        ``(|I_p| C, m)``) and their products with :math:`\mathbf K`: the kernel columns at those points' latents
        times the actions' entries there."""
        prior, block, num = self.prior, self.prior.rows, self.prior.num_latents
        device = indices.device
        indices = indices.unique()
        support = indices.div(num, rounding_mode="floor").unique()[:, None] * num + torch.arange(num, device=device)
        support = support.reshape(-1)  # every latent of the pivot points
        local = torch.zeros(block.local_size, len(indices), dtype=prior.dtype, device=prior.device)
        mine = (indices >= block.start) & (indices < block.stop)
        local[indices[mine] - block.start, torch.arange(len(indices), device=device)[mine]] = 1
        actions = local if self.project is None else self.project(local)
        at_support = actions.new_zeros(len(support), len(indices))
        held = (support >= block.start) & (support < block.stop)
        at_support[held] = actions[support[held] - block.start]
        at_support = block.summed(at_support)  # the actions' entries on the pivot points, on every rank
        return actions, prior.kernel_columns_by_rows(support) @ at_support
