r"""Kernel products sharded by rows over the processes of a ``torch.distributed`` process group.

With :math:`P` processes (ranks :math:`p = 0, \dots, P - 1`) the row points of :math:`\mathbf K` (``(N, M)``, or
``(N C, M C)`` data-major for correlated outputs) are split into :math:`P` contiguous blocks
:math:`\mathcal I_p` of :math:`\lceil N / P \rceil` points (the last ones shorter, as :func:`torch.tensor_split`).
Rank :math:`p` evaluates its rows of the product, :math:`\mathbf K_{\mathcal I_p, :} \mathbf R`
(:math:`|\mathcal I_p| \times M` kernel evaluations per column of :math:`\mathbf R`), and one ``all_gather``
assembles

.. math::
    \mathbf K \mathbf R = \begin{bmatrix} \mathbf K_{\mathcal I_0, :} \mathbf R \\ \vdots \\
    \mathbf K_{\mathcal I_{P-1}, :} \mathbf R \end{bmatrix}

on every rank: the same tensor, bit for bit, so every rank continues with identical state. :math:`\mathbf K` is
never formed nor sent; a rank sends its :math:`|\mathcal I_p| \cdot C k` entries of the product to the others
(Wang et al. 2019, "Exact Gaussian processes on a million data points", partition :math:`\mathbf K` by rows in the
same way in GPyTorch's ``MultiDeviceKernel``, there over the GPUs of one process).

:class:`ShardedKernelMatrix` is the ``LinearOperator`` a row-sharded kernel (``gpytorch_iterncgp.distributed.
ShardedKernel``) evaluates to; :class:`~gpytorch_iterncgp.core.prior.LatentPrior` recognises it and multiplies
each rank's rows by the package's own products (cached dense block, or the fused tiles of
:mod:`~gpytorch_iterncgp.core.kernel_products`), then gathers them with :meth:`ShardedKernelMatrix.gather`.

The rows of the solver's vectors a process holds are a :class:`RowBlock`, always present: all rows in one process
(or the state replicated on every rank), whose sums, maxima, norms and gathers are the identity, so that the loops
run one code for one process and for :math:`P` ranks; and :class:`ShardedRowBlock`, rank :math:`p`'s rows
:math:`\mathcal I_p`, whose are collectives (``ShardedKernel(..., shard_state=True)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from gpytorch.kernels import Kernel
from gpytorch.lazy import LazyEvaluatedKernelTensor
from linear_operator.operators import LinearOperator
from torch import Tensor

__all__ = ["RowBlock", "RowShardedKernel", "ShardedKernelMatrix", "ShardedRowBlock", "row_bounds"]


def row_bounds(num_points: int, world_size: int) -> list[tuple[int, int]]:
    r"""The contiguous point blocks :math:`\mathcal I_p = [\text{start}_p, \text{stop}_p)` of ``num_points`` points
    over ``world_size`` ranks, as :func:`torch.tensor_split` splits them (sizes differ by at most one)."""
    base, extra = divmod(num_points, world_size)
    bounds, start = [], 0
    for rank in range(world_size):
        stop = start + base + (rank < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


class RowShardedKernel(Kernel):
    """A kernel whose matrix, where no gradient is recorded, is a :class:`ShardedKernelMatrix` (the base of
    ``gpytorch_iterncgp.distributed.ShardedKernel``): what :class:`~gpytorch_iterncgp.core.prior.LatentPrior` looks
    for before it evaluates a kernel. Where :attr:`shard_state` is set, the solver's recycled actions and precision
    roots are held by rows too (:class:`ShardedRowBlock`)."""

    process_group: dist.ProcessGroup | None = None
    shard_state: bool = False

    def row_block(self, num_points: int, num_latents: int) -> RowBlock:
        """The rows of data-major ``(num_points * num_latents,)`` vectors this rank holds: its
        :class:`ShardedRowBlock` where :attr:`shard_state` is set, else all of them (:meth:`RowBlock.single`: the
        state replicated on every rank)."""
        if not self.shard_state:
            return RowBlock.single(num_points, num_latents)
        return ShardedRowBlock.of_rank(num_points, num_latents, self.process_group)


class RowBlock:
    r"""The rows of data-major vectors of :math:`n = N C` entries (whole points, :math:`C` rows each) that this process
    holds, and the collectives that combine the processes' rows: here all :math:`n` rows in one process (or the state
    replicated on every rank), so every reduction and gather is the identity and returns its argument itself (no
    collective, no copy: results are those of the one-process computation, bit for bit).
    :class:`ShardedRowBlock` is rank :math:`p`'s rows :math:`\mathcal I_p` of :math:`P` ranks.

    A matrix :math:`\mathbf S` ``(n, B)`` held by rows keeps :math:`\mathbf S_{\mathcal I_p}` on rank :math:`p`;
    :math:`\mathbf S^\top \mathbf x = \sum_p \mathbf S_{\mathcal I_p}^\top \mathbf x_{\mathcal I_p}` is a local
    product and a sum over the ranks (:meth:`reduce`), and :math:`\mathbf S \mathbf c` the local
    :math:`\mathbf S_{\mathcal I_p} \mathbf c`, whose rows every rank gathers (:meth:`gather`).

    :param size: :math:`n`.
    :param num_latents: :math:`C`, the rows of each point.
    """

    is_sharded = False  # whether the rows are split over the ranks of a process group (the one source of truth)
    process_group: dist.ProcessGroup | None = None

    def __init__(self, size: int, num_latents: int = 1):
        self.start, self.stop, self.size, self.num_latents = 0, size, size, num_latents
        self.bounds = [(0, size)]

    @classmethod
    def single(cls, num_points: int, num_latents: int = 1) -> RowBlock:
        """All rows of ``num_points`` points of ``num_latents`` entries each, in one process."""
        return cls(num_points * num_latents, num_latents)

    @property
    def local_size(self) -> int:
        r""":math:`|\mathcal I_p| C`, the rows this process holds (:math:`n` here)."""
        return self.stop - self.start

    def local(self, tensor: Tensor) -> Tensor:
        """This process's rows of a full ``(n, ...)`` tensor: ``tensor`` itself."""
        return tensor

    def reduce(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        """The sum (or ``op``, e.g. the maximum) over the processes of ``tensor``: ``tensor`` itself."""
        return tensor

    def gather(self, local: Tensor) -> Tensor:
        """The full ``(n, ...)`` tensor from every process's rows: ``local`` itself."""
        return local

    def own_rows(self, tensor: Tensor) -> Tensor:
        """This process's rows ``(|I_p| C, ...)`` of ``tensor``, given all its rows ``(n, ...)`` or those already:
        ``tensor`` itself."""
        return tensor

    def all_rows(self, tensor: Tensor) -> Tensor:
        """``tensor`` ``(n, ...)`` with all its rows, given this process's rows or all of them: ``tensor`` itself."""
        return tensor

    def own_points(self, tensor: Tensor) -> Tensor:
        """This process's points ``(|I_p|, ...)`` of a point-major ``tensor`` ``(N, ...)`` (targets, ``(N, C)``
        latents, ``(N, C, C)`` blocks), or those already: ``tensor`` itself."""
        return tensor

    def all_points(self, tensor: Tensor) -> Tensor:
        """A point-major ``tensor`` ``(N, ...)`` with all its points, given this process's or all: ``tensor`` itself."""
        return tensor

    def summed(self, local_product: Tensor) -> Tensor:
        """The sum over the processes of a product of their rows (:meth:`reduce`)."""
        return self.reduce(local_product)

    def maximum(self, tensor: Tensor) -> Tensor:
        """The entrywise maximum over the processes of ``tensor`` (:meth:`reduce` with ``MAX``)."""
        return self.reduce(tensor, op=dist.ReduceOp.MAX)

    def norm(self, vector: Tensor) -> Tensor:
        r"""The Euclidean norm :math:`\|\mathbf x\|` of an ``(n,)`` vector held by these rows: ``vector.norm()``."""
        return vector.norm()

    def largest_point(self, values: Tensor) -> tuple[Tensor, Tensor]:
        """The largest entry of each row of ``values`` ``(c, points held)`` over all processes and its global point
        index (the smallest where several processes hold it), ``(c,)`` each: ``values.max(dim=-1)`` here."""
        return values.max(dim=-1)

    def everywhere(self, flag: bool, like: Tensor) -> bool:
        """Whether ``flag`` holds in every process (so that the processes take one decision from their own rows, e.g.
        all entries finite): ``flag`` itself."""
        return flag


class ShardedRowBlock(RowBlock):
    r"""Rank :math:`p`'s rows :math:`\mathcal I_p` (whole points, :func:`row_bounds`) of data-major vectors of
    :math:`n = N C` entries, and the collectives of ``process_group`` that combine the ranks' rows. Every rank gets
    the same result, bit for bit (tested with gloo); one process's up to the order of the sums.

    A tensor given to :meth:`own_rows`, :meth:`all_rows`, :meth:`own_points` or :meth:`all_points` may hold all rows
    (a state loaded from a ``state_dict``, the prior) or this rank's; its length says which.

    :param start: first entry of this rank's rows.
    :param stop: one past the last.
    :param size: :math:`n`.
    :param bounds: every rank's ``(start, stop)``.
    :param process_group: the ranks (``None``: the default group).
    :param num_latents: :math:`C`, the rows of each point (whole points are never split).
    """

    is_sharded = True

    def __init__(
        self,
        start: int,
        stop: int,
        size: int,
        bounds: list[tuple[int, int]],
        process_group: dist.ProcessGroup | None,
        num_latents: int = 1,
    ):
        super().__init__(size, num_latents)
        self.start, self.stop, self.bounds, self.process_group = start, stop, bounds, process_group

    @classmethod
    def of_rank(cls, num_points: int, num_latents: int, process_group: dist.ProcessGroup | None) -> ShardedRowBlock:
        """This rank's block: the points of :func:`row_bounds`, ``num_latents`` entries each."""
        points = row_bounds(num_points, dist.get_world_size(process_group))
        bounds = [(start * num_latents, stop * num_latents) for start, stop in points]
        start, stop = bounds[dist.get_rank(process_group)]
        return cls(start, stop, num_points * num_latents, bounds, process_group, num_latents)

    def local(self, tensor: Tensor) -> Tensor:
        """This rank's rows of a full ``(n, ...)`` tensor (a view)."""
        return tensor[self.start : self.stop]

    def largest_point(self, values: Tensor) -> tuple[Tensor, Tensor]:
        """The largest entry of each row of ``values`` ``(c, |I_p| points)`` over all ranks and its global point index
        (the smallest where several ranks hold it), ``(c,)`` each: two ``all_reduce``."""
        local_value, local_index = values.max(dim=-1)
        value = self.maximum(local_value)
        first_point = self.start // self.num_latents
        candidate = torch.where(local_value == value, local_index + first_point, torch.full_like(local_index, 2**62))
        return value, self.reduce(candidate, op=dist.ReduceOp.MIN)

    def reduce(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        """The sum (or ``op``, e.g. the maximum) over the ranks of ``tensor`` (one ``all_reduce``), as a new tensor."""
        total = tensor.clone().contiguous()
        dist.all_reduce(total, op=op, group=self.process_group)
        return total

    def gather(self, local: Tensor) -> Tensor:
        """The full ``(n, ...)`` tensor from every rank's rows ``(|I_p| C, ...)`` (one ``all_gather``, blocks padded to
        one shape)."""
        largest = max(stop - start for start, stop in self.bounds)
        padded = local.new_zeros(largest, *local.shape[1:])
        padded[: local.shape[0]] = local
        blocks = [torch.empty_like(padded) for _ in self.bounds]
        dist.all_gather(blocks, padded, group=self.process_group)
        return torch.cat([block[: stop - start] for block, (start, stop) in zip(blocks, self.bounds, strict=True)])

    def own_rows(self, tensor: Tensor) -> Tensor:
        """This rank's rows ``(|I_p| C, ...)`` of ``tensor`` ``(n, ...)`` (or already them), as a contiguous tensor
        where they are sliced from all rows."""
        return tensor if tensor.shape[0] == self.local_size else self.local(tensor).contiguous()

    def all_rows(self, tensor: Tensor) -> Tensor:
        """``tensor`` ``(n, ...)``, or its rows on every rank ``(|I_p| C, ...)`` gathered to it (a collective)."""
        return tensor if tensor.shape[0] == self.size else self.gather(tensor)

    def own_points(self, tensor: Tensor) -> Tensor:
        """This rank's points ``(|I_p|, ...)`` of a point-major ``tensor`` ``(N, ...)`` (a view), or ``tensor`` if it
        holds them already."""
        num = self.num_latents
        if tensor.shape[0] * num == self.local_size:
            return tensor
        return tensor[self.start // num : self.stop // num]

    def all_points(self, tensor: Tensor) -> Tensor:
        r"""A point-major ``tensor`` ``(N, ...)`` (e.g. EP's sites ``(N,)``, ``(N, C, C)``) gathered from every rank's
        points ``(|I_p|, ...)`` (one ``all_gather``; a point's entries over its :math:`C` data-major rows); itself
        where it holds all points already."""
        num = self.num_latents
        per_row = math.prod(tensor.shape[1:]) // num  # a point's entries over its C data-major rows
        rows = tensor.reshape(tensor.shape[0] * num, per_row)
        return self.all_rows(rows).reshape(-1, *tensor.shape[1:])

    def norm(self, vector: Tensor) -> Tensor:
        r""":math:`\|\mathbf x\| = (\sum_p \|\mathbf x_{\mathcal I_p}\|^2)^{1/2}` for an ``(n,)`` vector held by rows,
        one ``all_reduce`` of a number."""
        return self.reduce(vector.square().sum()).sqrt()

    def everywhere(self, flag: bool, like: Tensor) -> bool:
        """Whether ``flag`` holds on every rank (one ``all_reduce`` of a number on ``like``'s device)."""
        return not bool(self.reduce(like.new_tensor([float(not flag)])))


class ShardedKernelMatrix(LinearOperator):
    r"""The kernel matrix :math:`k(\mathbf X_1, \mathbf X_2)` ``(*batch, N C, M C)`` of ``kernel``, whose products
    are computed by rows over the ranks of ``process_group`` (see the module docstring).

    Everything but the products (entries, diagonal, dense form) is ``kernel``'s own, evaluated on every rank.

    :param x1: row inputs ``(*batch, N, D)``.
    :param x2: column inputs ``(*batch, M, D)``.
    :param kernel: the kernel of the entries (the wrapped kernel of a ``ShardedKernel``).
    :param process_group: the ranks sharing the products (``None``: the default group).
    :param record: called with the bytes this rank sent after each gathered or summed product (e.g. to count them).
    :param params: keyword arguments of the kernel's call.
    """

    def __init__(
        self,
        x1: Tensor,
        x2: Tensor,
        kernel: Kernel,
        process_group: dist.ProcessGroup | None = None,
        record: Callable[[int], None] | None = None,
        **params,
    ):
        super().__init__(x1, x2, kernel=kernel, process_group=process_group, record=record, **params)
        self.x1, self.x2, self.kernel, self.process_group, self.params = x1, x2, kernel, process_group, params
        self.record = record
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.bounds = row_bounds(x1.shape[-2], self.world_size)
        start, stop = self.bounds[self.rank]
        # this rank's rows: the kernel's own lazy tensor, evaluated (and cached) by the first product
        self.local_rows = LazyEvaluatedKernelTensor(x1[..., start:stop, :], x2, kernel=kernel, **params)
        self.full = LazyEvaluatedKernelTensor(x1, x2, kernel=kernel, **params)
        self.bytes_sent = 0  # bytes of products this rank sent to the others (gathered rows; summed columns' operand)
        self._checked = False  # whether the ranks' inputs were found equal (check_same_inputs)

    def _size(self) -> torch.Size:
        return self.full.shape

    def _transpose_nonbatch(self) -> LinearOperator:
        return ShardedKernelMatrix(self.x2, self.x1, self.kernel, self.process_group, self.record, **self.params)

    def _diagonal(self) -> Tensor:
        return self.full._diagonal()

    def _get_indices(self, row_index, col_index, *batch_indices) -> Tensor:
        return self.full._get_indices(row_index, col_index, *batch_indices)

    def _getitem(self, row_index, col_index, *batch_indices) -> LinearOperator:
        return self.full._getitem(row_index, col_index, *batch_indices)

    def to_dense(self) -> Tensor:
        return self.full.to_dense()

    def _matmul(self, rhs: Tensor) -> Tensor:
        """``self @ rhs``: this rank's rows by the kernel's own (dense) product, then :meth:`gather`."""
        return self.sharded_matmul(lambda rows, block: rows.to_dense() @ block, rhs)

    def sharded_matmul(
        self, local_matmul: Callable[[LinearOperator, Tensor], Tensor], rhs: Tensor, gather: bool = True
    ) -> Tensor:
        r""":math:`\mathbf K \mathbf R` for ``rhs`` ``(*batch, M C, k)``: ``local_matmul(local_rows, rhs)`` on this
        rank's rows :math:`\mathcal I_p` (:attr:`local_rows`, a lazily evaluated kernel ``(*batch, |I_p| C, M C)``),
        then :meth:`gather`; with ``gather=False`` this rank's rows ``(*batch, |I_p| C, k)`` only, for a right-hand side
        the caller gathered from every rank's rows (counted as one product, with the bytes of this rank's rows of it
        sent to each other rank: the same volume as the gathered product's)."""
        self.check_same_inputs()
        start, stop = self.bounds[self.rank]
        if stop > start:
            local = local_matmul(self.local_rows, rhs)
        else:  # more ranks than row points: nothing to evaluate here
            batch = torch.broadcast_shapes(self.batch_shape, rhs.shape[:-2])
            local = rhs.new_zeros(*batch, 0, rhs.shape[-1])
        if gather:
            return self.gather(local)
        self._count(
            self._padded_rows(local.shape[-2])
            * local[..., :1, :].numel()
            * local.element_size()
            * (self.world_size - 1)
        )
        return local

    def column_block_matmul(
        self, local_matmul: Callable[[LinearOperator, Tensor], Tensor], rhs_rows: Tensor, block: RowBlock
    ) -> Tensor:
        r""":math:`\mathbf K \mathbf R = \sum_p \mathbf K_{:, \mathcal I_p} \mathbf R_{\mathcal I_p}` for
        :math:`\mathbf R` held by rows of ``block`` (the column points' blocks, e.g. the training points of the state;
        ``rhs_rows`` is this rank's ``(*batch, |I_p| C, k)``): ``local_matmul`` of the kernel at all row points and this
        rank's column points (a lazily evaluated kernel ``(*batch, N C, |I_p| C)``, :math:`N |\mathcal I_p|`
        evaluations) by its rows, then :meth:`RowBlock.reduce` (one ``all_reduce`` of :math:`N C k` numbers).
        Every rank gets the same sum, bit for bit; one process's up to the order of the sum over the ranks.

        Counted as one product in :attr:`bytes_sent` (and ``record``) with the bytes this rank contributes to the sum,
        :math:`N C k` times the element size: what an ``all_reduce`` moves per rank depends on the backend's algorithm
        (a ring sends about twice that, in :math:`2(P - 1)` pieces), so the count is the volume of the operand.
        """
        self.check_same_inputs()
        start, stop = row_bounds(self.x2.shape[-2], self.world_size)[self.rank]
        if stop > start:
            columns = LazyEvaluatedKernelTensor(self.x1, self.x2[..., start:stop, :], kernel=self.kernel, **self.params)
            local = local_matmul(columns, rhs_rows)
        else:  # more ranks than column points: nothing to add here
            batch = torch.broadcast_shapes(self.batch_shape, rhs_rows.shape[:-2])
            local = rhs_rows.new_zeros(*batch, self.shape[-2], rhs_rows.shape[-1])
        total = block.reduce(local)
        self._count(local.numel() * local.element_size())
        return total

    def check_same_inputs(self) -> None:
        """Check once (one ``all_gather`` of a few numbers) that every rank has the same inputs and kernel
        hyperparameters: each computes its rows with its own, so ranks that differ would assemble a product of no
        kernel at all.

        :raises ValueError: naming the fix, on every rank, if they differ.
        """
        if self._checked:
            return
        with torch.no_grad():
            summary = [self.x1.sum(), self.x1.square().sum(), self.x2.sum(), self.x2.square().sum()]
            summary += [parameter.sum() for parameter in self.kernel.parameters()]
            local = torch.stack([value.to(torch.float64) for value in summary])
        ranks = self._all_gather(local)
        if not all(torch.allclose(other, local, rtol=1e-6, atol=0) for other in ranks):
            raise ValueError(
                f"ShardedKernel: the ranks differ in their inputs or kernel hyperparameters (rank {self.rank} of "
                f"{self.world_size}). Every process must build the same model on the same data: seed the data, load "
                "the same files and the same state_dict on every rank."
            )
        self._checked = True

    def sharded_columns(self, points: Tensor, gather: bool = True) -> Tensor:
        r"""The columns :math:`\mathbf K_{:, \text{points}}` ``(*batch, N C, u)`` for column points ``points`` ``(u,)``:
        this rank's rows of them (read from its cached rows where a product has evaluated them), then :meth:`gather`
        (``gather=False``: this rank's rows ``(*batch, |I_p| C, u)``, no collective)."""
        self.check_same_inputs()
        start, stop = self.bounds[self.rank]
        if stop > start:
            rows = self.local_rows
            if any(key[0] == "kernel_eval" for key in getattr(rows, "_memoize_cache", {})):
                rows = rows.evaluate_kernel()
            local = rows[..., :, points].to_dense()
        else:
            local = self.x1.new_zeros(*self.batch_shape, 0, len(points))
        if gather:
            return self.gather(local)
        self._count(0)  # one product; its sparse right-hand side was gathered by the caller (RowBlock.gather)
        return local

    def gather(self, local: Tensor) -> Tensor:
        r"""The rows of all ranks, ``(*batch, N C, k)``, from this rank's ``(*batch, |I_p| C, k)``: one ``all_gather``
        (blocks padded to :math:`\lceil N / P \rceil` points, so that every rank sends a tensor of one shape).

        :raises RuntimeError: if another rank does not take part within the process group's ``timeout`` (it failed,
            or hangs).
        """
        sizes = self._row_sizes()
        padded = torch.nn.functional.pad(local, (0, 0, 0, max(sizes) - local.shape[-2])).contiguous()
        blocks = self._all_gather(padded)
        self._count(padded.numel() * padded.element_size() * (self.world_size - 1))  # its block to each other rank
        return torch.cat([block[..., :size, :] for block, size in zip(blocks, sizes, strict=True)], dim=-2)

    def _row_sizes(self) -> list[int]:
        """The rows of every rank's block (points times the rows per point: C for correlated outputs)."""
        outputs = self.full.shape[-2] // max(1, self.x1.shape[-2])
        return [(stop - start) * outputs for start, stop in self.bounds]

    def _padded_rows(self, rows: int) -> int:
        """The rows of a block as :meth:`gather` sends it (padded to the largest block)."""
        return max(rows, *self._row_sizes())

    def _count(self, sent: int) -> None:
        """Count one collective product of which this rank sent ``sent`` bytes (:attr:`bytes_sent`, ``record``)."""
        self.bytes_sent += sent
        if self.record is not None:
            self.record(sent)

    def _all_gather(self, tensor: Tensor) -> list[Tensor]:
        """``tensor`` of every rank (one shape on all), by ``torch.distributed.all_gather``.

        :raises RuntimeError: if another rank does not take part within the process group's ``timeout``, naming the
            rank that waited and what to do.
        """
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        try:
            dist.all_gather(gathered, tensor, group=self.process_group)
        except Exception as error:  # gloo and NCCL raise their own types (DistBackendError, RuntimeError)
            raise RuntimeError(
                f"ShardedKernel: rank {self.rank} of {self.world_size} could not gather the other ranks' rows of a "
                f"kernel product ({type(error).__name__}: {error}). Another rank failed or stopped taking part "
                "(each waits at most the timeout= given to torch.distributed.init_process_group, or to new_group for "
                "a process_group). Every rank must take part in every product, predictions included. The strategy "
                "keeps the state of the last completed step: save its state_dict() and resume from it."
            ) from error
        return gathered
