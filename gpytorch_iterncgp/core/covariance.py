r"""The covariance phase: products with :math:`\mathbf K` spent on the posterior covariance once the mode is found.

IterGP's approximate precision over actions :math:`\mathbf S` is :math:`\mathbf C = \mathbf S (\mathbf S^\top
\hat{\mathbf K} \mathbf S)^{-1} \mathbf S^\top`, :math:`\hat{\mathbf K} = \mathbf K + \mathbf W^{-1}`, and the excess of
the posterior variance at a test input :math:`x` over the exact Laplace variance is

.. math::
    \mathbf k_x^\top (\hat{\mathbf K}^{-1} - \mathbf C) \mathbf k_x
    = \|(\mathbf I - \boldsymbol\Pi_{\mathbf S}) \hat{\mathbf K}^{-1} \mathbf k_x\|_{\hat{\mathbf K}}^2 \ \ge 0,

with :math:`\boldsymbol\Pi_{\mathbf S}` the :math:`\hat{\mathbf K}`-orthogonal projector onto
:math:`\operatorname{span}(\mathbf S)` and :math:`\mathbf k_x = \mathbf K(\mathbf X, x)` (paper, Section 3 and
Proposition A.3). The Newton loop's CG actions chase the representer weights :math:`\hat{\mathbf K}^{-1}\mathbf b`;
once those have converged, more CG on the final system barely changes :math:`\mathbf C` (``docs/design_notes.md``).
The covariance needs :math:`\hat{\mathbf K}^{-1}\mathbf k_x` for all :math:`x` at once.

**Why precondition with** :math:`\mathbf W`. With :math:`\mathbf B = \mathbf I + \mathbf W^{1/2}\mathbf K
\mathbf W^{1/2}` (Rasmussen & Williams, Section 3.4.3), :math:`\hat{\mathbf K}^{-1} = \mathbf W^{1/2} \mathbf B^{-1}
\mathbf W^{1/2}` and :math:`\mathbf k_x^\top \hat{\mathbf K}^{-1} \mathbf k_x = \mathbf u^\top \mathbf B^{-1}
\mathbf u`, :math:`\mathbf u = \mathbf W^{1/2} \mathbf k_x`. :math:`\mathbf B`'s eigenvalues lie in
:math:`[1, 1 + \lambda_{\max}(\mathbf W^{1/2}\mathbf K\mathbf W^{1/2})]` and only a few are far from 1, so a block
Krylov space of :math:`\mathbf B` captures :math:`\mathbf B^{-1}` quickly, while one of :math:`\hat{\mathbf K}`
(eigenvalues spread over :math:`[\lambda_{\min}(\mathbf W^{-1}), \lambda_{\max}(\mathbf K)]`) does not. Mapped back to
actions (:math:`\mathbf S = \mathbf W^{1/2} \mathbf V`, so :math:`\mathbf S^\top \hat{\mathbf K} \mathbf S =
\mathbf V^\top \mathbf B \mathbf V`) this is block Lanczos on :math:`\hat{\mathbf K}` preconditioned by
:math:`\mathbf W` (exact where the kernel is negligible against the noise):

.. math::
    \mathbf S_0 = \mathbf W \mathbf E_Z, \qquad \mathbf S_{j+1} = \mathbf W \hat{\mathbf K} \mathbf D_j ,

where :math:`\mathbf E_Z` are the unit vectors of the latents of a random subset :math:`Z` of the data and
:math:`\mathbf D_j` the :math:`\hat{\mathbf K}`-conjugate directions block :math:`j` added
(:math:`\hat{\mathbf K}\mathbf D_j = \mathbf K\mathbf D_j + \mathbf W^{-1}\mathbf D_j` is known without a product).
It closes most of the gap to the exact Laplace covariance, far more than the same products spent on other actions
(``docs/design_notes.md``, the covariance phase; ``benchmarks/covariance.py``).

**Guarantees.** Each block is :math:`\hat{\mathbf K}`-conjugated against the current :math:`\mathbf Q` *before* its
product with :math:`\mathbf K` (:math:`\mathbf Q^\top \hat{\mathbf K} \mathbf S = (\mathbf K\mathbf Q)^\top \mathbf S
+ \mathbf Q^\top \mathbf W^{-1} \mathbf S`, no product), so :math:`\mathbf K \mathbf D` is computed, not tracked, and
costs one product with :math:`\mathbf K` per block. :math:`\mathbf C` stays :math:`\mathbf S (\mathbf S^\top
\hat{\mathbf K} \mathbf S)^{-1} \mathbf S^\top` over the enlarged (nested) action space, so the posterior covariance
never increases as blocks are added, never falls below the exact Laplace covariance, and equals it once the actions
span the space. The preconditioner only chooses the actions: any positive semi-definite :math:`\mathbf W` keeps
these properties.

**By rows.** With a sharded ``rows_block`` (:func:`covariance_phase`) the phase keeps :math:`\mathbf Q`, :math:`\mathbf K \mathbf Q` and the directions
it adds by rows, as the action buffer keeps :math:`\mathbf S`, :math:`\mathbf K \mathbf S`
(:class:`~gpytorch_iterncgp.core.recycling.ActionBuffer`): the conjugation :math:`\mathbf Q^\top \hat{\mathbf K}
\mathbf V = \sum_p (\mathbf K \mathbf Q)_{\mathcal I_p}^\top \mathbf V_{\mathcal I_p} + \mathbf Q_{\mathcal
I_p}^\top (\mathbf W^{-1} \mathbf V)_{\mathcal I_p}` and the block's Gram matrix :math:`\mathbf V^\top \hat{\mathbf
K} \mathbf V` are local products and one ``all_reduce`` each, :math:`\mathbf Q \mathbf c` a local product and one
``all_gather``. The block :math:`\mathbf V` (``block_size`` columns) is whole on every rank, the same on all:
it is the right-hand side of the block's product with :math:`\mathbf K`, which returns it whole;
:math:`\mathbf W` and :math:`\mathbf W^{-1}` act on this rank's rows (its blocks), and the next block
:math:`\mathbf W \hat{\mathbf K} \mathbf D` is gathered from them (one ``all_gather``). A rank so holds
:math:`\lceil N / P \rceil C (r + \text{added})` entries of :math:`\mathbf Q` and of :math:`\mathbf K \mathbf Q`
and a few whole blocks, never :math:`\mathbf Q` whole. Every rank takes the same decisions (kept directions,
eigenvalues), from the same reduced numbers; one process's up to the order of the sums over the ranks.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from linear_operator.operators import LinearOperator
from torch import Tensor

from .. import settings
from ..exceptions import BufferLimitWarning
from .noise import curvature_matmul
from .precision import ColumnStore
from .sharding import RowBlock
from .validation import check_count, check_seed

# A unit-norm action is kept if at least this fraction of its norm lies outside span(Q) after conjugation: the
# conjugation's rounding errors are divided by that fraction when the action is normalised again, and the columns of
# Q would lose their K̂-orthonormality (then C would exceed K̂^{-1} and the variances fall below the exact ones;
# docs/design_notes.md).
_NEW_FRACTION = {torch.float64: 1e-6, torch.float32: 1e-2}
# A direction of the conjugated block is kept if its K̂-energy exceeds this times the largest of the block.
_RELATIVE_EIGENVALUE_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


@dataclass
class CovarianceOptions:
    """The covariance phase's budget (see :mod:`gpytorch_iterncgp.core.covariance`)."""

    covariance_iterations: int = 0  # products with K spent on the covariance after the outer loop (0: none)
    covariance_block_size: int = 100  # actions per product (columns of each block; at least C of one data point)

    def validate(self) -> None:
        """:raises ValueError: naming the option that is out of range."""
        check_count(self.covariance_iterations, "covariance_iterations")
        check_count(self.covariance_block_size, "covariance_block_size", minimum=1)


@dataclass
class CovariancePhase:
    r"""The result of :func:`covariance_phase`: the enlarged :math:`\mathbf Q`, :math:`\mathbf K \mathbf Q` and the
    products with :math:`\mathbf K` it took."""

    precision_root: Tensor  # Q, (n, r + added); sharded: this rank's rows (|I_p| C, r + added)
    kernel_precision_root: Tensor  # K Q, likewise
    products: int
    added: int  # columns added to Q


def _memory_capped_rank(rank: int, target: int, size: int, dtype: torch.dtype) -> int:
    r"""``target``, the rank of :math:`\mathbf Q` the phase may reach, or where :math:`\mathbf Q` and
    :math:`\mathbf K \mathbf Q` at that rank (:math:`2 n` numbers of ``dtype`` a column, :math:`n` = ``size`` of
    all ranks) would pass :class:`~gpytorch_iterncgp.settings.recycled_buffer_limit`, the largest rank that fits (at
    least ``rank``, the columns already there), with a :class:`~gpytorch_iterncgp.exceptions.BufferLimitWarning`."""
    column_bytes = 2 * size * torch.empty((), dtype=dtype).element_size()
    room = max(rank, settings.recycled_buffer_limit.value() // column_bytes)
    if target <= room:
        return target
    warnings.warn(
        f"The covariance phase would grow the posterior's precision root to {target} columns of {size} latent values "
        f"({target * column_bytes / 2**30:.1f} GiB with their kernel products), past "
        f"settings.recycled_buffer_limit ({settings.recycled_buffer_limit.value() / 2**30:.1f} GiB): it stops at "
        f"{room} columns, so the predictive variances keep more computational uncertainty (never less than the "
        "exact ones). Lower covariance_iterations or covariance_block_size, or raise the limit where memory allows.",
        BufferLimitWarning,
        stacklevel=3,
    )
    return int(room)


def _unit_vectors_of_points(size: int, num_latents: int, block_size: int, seed: int, like: Tensor) -> Tensor:
    r""":math:`\mathbf E_Z` ``(n, |Z| C)``: the unit vectors of the :math:`C` latents of each point of a random subset
    :math:`Z` of ``block_size // C`` points (at least one; of ``n / C`` points; ``seed``), in ``like``'s dtype and on its
    device."""
    num_points = size // num_latents
    generator = torch.Generator().manual_seed(seed)
    points = torch.randperm(num_points, generator=generator)[: max(1, block_size // num_latents)]
    coordinates = (points[:, None] * num_latents + torch.arange(num_latents)).flatten().to(like.device)
    start = like.new_zeros(size, len(coordinates))
    start[coordinates, torch.arange(len(coordinates), device=start.device)] = 1.0
    return start


def _conjugated(
    directions: Tensor,
    root: Tensor,
    kernel_root: Tensor,
    noise_inverse: LinearOperator,
    project: Callable[[Tensor], Tensor],
    rows_block: RowBlock,
) -> Tensor:
    r"""``directions`` ``(n, k)`` (whole) normalised and :math:`\hat{\mathbf K}`-conjugated against :math:`\mathbf Q`:
    classical Gram–Schmidt in the :math:`\hat{\mathbf K}` inner product, twice, with :math:`\mathbf Q^\top \hat{\mathbf
    K} \mathbf V = (\mathbf K \mathbf Q)^\top \mathbf V + \mathbf Q^\top \mathbf W^{-1} \mathbf V` (no product with
    :math:`\mathbf K`; ``root``, ``kernel_root``: this rank's rows of :math:`\mathbf Q`, :math:`\mathbf K \mathbf Q`),
    projected after each pass."""
    local = rows_block.local
    directions = directions / directions.norm(dim=0).clamp_min(torch.finfo(directions.dtype).tiny)
    for _ in range(2):
        noisy_rows = noise_inverse.matmul(local(directions))
        conjugation = rows_block.summed(kernel_root.mT @ local(directions) + root.mT @ noisy_rows)
        directions = project(directions - rows_block.all_rows(root @ conjugation))
    return directions


def _orthonormalising(gram: Tensor, tolerance: float, room: int) -> Tensor | None:
    r"""The combinations ``(k, k')`` of a block's columns that are :math:`\hat{\mathbf K}`-orthonormal, from its Gram
    matrix :math:`\mathbf V^\top \hat{\mathbf K} \mathbf V` ``(k, k)``: eigenvectors over the square roots of their
    eigenvalues, of the eigenvalues above ``tolerance`` times the largest, at most ``room`` of them (the weakest
    dropped); ``None`` where none is kept."""
    eigenvalues, eigenvectors = torch.linalg.eigh((gram + gram.mT) / 2)
    keep = eigenvalues > tolerance * eigenvalues[-1].clamp_min(0)
    excess = int(keep.sum()) - room
    if excess > 0:
        keep[keep.nonzero()[:excess, 0]] = False
    if not bool(keep.any()):
        return None
    return eigenvectors[:, keep] * eigenvalues[keep].rsqrt()


def covariance_phase(
    kernel_matmul: Callable[[Tensor], Tensor],
    noise_inverse: LinearOperator,
    precision_root: Tensor,
    kernel_precision_root: Tensor,
    num_latents: int,
    iterations: int,
    block_size: int,
    project: Callable[[Tensor], Tensor] | None = None,
    action_space_dimension: int | None = None,
    seed: int = 0,
    *,
    rows_block: RowBlock,
) -> CovariancePhase:
    r"""Extend :math:`\mathbf C = \mathbf Q \mathbf Q^\top \approx \hat{\mathbf K}^{-1}` by ``iterations`` blocks of
    :math:`\mathbf W`-preconditioned block Lanczos (see the module docstring), one product with :math:`\mathbf K` each.

    :param kernel_matmul: :math:`\mathbf X \mapsto \mathbf K \mathbf X` for ``(n, k)`` blocks (one product per call).
    :param noise_inverse: :math:`\mathbf W^{-1}` ``(n, n)`` of the system whose :math:`\mathbf Q` this is.
    :param precision_root: :math:`\mathbf Q` ``(n, r)``, :math:`\hat{\mathbf K}`-orthonormal
        (:math:`\mathbf Q^\top \hat{\mathbf K} \mathbf Q = \mathbf I`), e.g. of a virtual solver run.
    :param kernel_precision_root: :math:`\mathbf K \mathbf Q` ``(n, r)``.
    :param num_latents: :math:`C` (data-major blocks of the curvature).
    :param iterations: the number of blocks (products with :math:`\mathbf K`).
    :param block_size: columns per block; the start block takes the latents of ``block_size // C`` data points.
    :param project: projection of the actions (softmax: zero sum per point).
    :param action_space_dimension: stop when :math:`\mathbf Q` has this rank (default :math:`n`).
    :param seed: seed of the random subset :math:`Z` of the start block.
    :param rows_block: the rows of :math:`\mathbf Q`, :math:`\mathbf K \mathbf Q` this process holds (all in one
        process; this rank's where sharded, ``shard_state``, given as this rank's rows or all of them).
        ``noise_inverse`` is then this rank's blocks of :math:`\mathbf W^{-1}`, ``(|I_p| C, |I_p| C)``.
    :return: :math:`[\mathbf Q, \mathbf D]`, :math:`[\mathbf K\mathbf Q, \mathbf K\mathbf D]` (sharded: this
        rank's rows ``(|I_p| C, r + added)``) and the products taken.
    """
    check_count(iterations, "iterations")
    check_count(block_size, "block_size", minimum=1)
    check_seed(seed)
    project = project or (lambda vectors: vectors)
    size = rows_block.size
    dtype = precision_root.dtype
    full_rank = size if action_space_dimension is None else action_space_dimension
    tolerance = _RELATIVE_EIGENVALUE_TOLERANCE.get(dtype, 1e-5)
    new_fraction = _NEW_FRACTION.get(dtype, 1e-2)
    rank, products = precision_root.shape[-1], 0
    if iterations > 0:
        full_rank = _memory_capped_rank(rank, min(full_rank, rank + iterations * block_size), size, dtype)
    if iterations == 0 or rank >= full_rank:
        return CovariancePhase(rows_block.own_rows(precision_root), rows_block.own_rows(kernel_precision_root), 0, 0)
    # this rank's rows of Q, K Q (all rows in one process), growing without copies
    roots = ColumnStore(rows_block.own_rows(precision_root))
    kernel_roots = ColumnStore(rows_block.own_rows(kernel_precision_root))
    local = rows_block.local  # this rank's rows of whole vectors (themselves in one process)

    curvature = curvature_matmul(noise_inverse, num_latents)
    start = _unit_vectors_of_points(size, num_latents, block_size, seed, precision_root)
    block = rows_block.all_rows(curvature(local(start)))  # W E_Z
    while products < iterations and rank < full_rank:
        root, kernel_root = roots.value, kernel_roots.value
        directions = _conjugated(project(block), root, kernel_root, noise_inverse, project, rows_block)
        directions = directions[:, directions.norm(dim=0) > new_fraction]
        if directions.shape[-1] == 0:
            break
        directions = directions / directions.norm(dim=0)
        kernel_directions = kernel_matmul(directions)
        products += 1
        noisy_rows = local(kernel_directions) + noise_inverse.matmul(local(directions))  # this rank's rows of K̂ V
        gram = rows_block.summed(local(directions).double().mT @ noisy_rows.double())
        scale = _orthonormalising(gram, tolerance, full_rank - rank)  # never beyond the action space's dimension
        if scale is None:
            break
        scale = scale.to(dtype)
        new_root, new_kernel_root = directions @ scale, kernel_directions @ scale
        for column, kernel_column in zip(local(new_root).mT, local(new_kernel_root).mT, strict=True):
            roots.append(column)
            kernel_roots.append(kernel_column)
        rank += new_root.shape[-1]
        # W K̂ D: the next Lanczos block (by rows, gathered)
        block = rows_block.all_rows(curvature(local(new_kernel_root) + noise_inverse.matmul(local(new_root))))
    root, kernel_root = roots.value, kernel_roots.value
    return CovariancePhase(root, kernel_root, products, root.shape[-1] - precision_root.shape[-1])
