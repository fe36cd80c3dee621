r"""The GP prior over data-major latents, as the Newton loop and the predictions see it.

A GPyTorch model's ``forward(x)`` returns one of

* a :class:`~gpytorch.distributions.MultivariateNormal` without batch shape: one GP (:math:`C = 1`),
  or one kernel shared by all :math:`C` classes, :math:`\mathbf K = \mathbf K_x \otimes \mathbf I_C`;
* a ``MultivariateNormal`` with ``batch_shape=[C]``: :math:`C` independent GPs;
* a :class:`~gpytorch.distributions.MultitaskMultivariateNormal` (correlated outputs).

:class:`LatentPrior` hides the difference: its mean is ``(N, C)`` and :meth:`LatentPrior.matmul` multiplies
data-major ``(N C, k)`` blocks by :math:`\mathbf K` with *one* call of the kernel's matmul (a shared kernel
is one ``N × (C k)`` product, independent kernels one batched product). It counts those calls and the
wall time spent in them.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator

import gpytorch
import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.lazy import LazyEvaluatedKernelTensor
from linear_operator.operators import (
    BlockInterleavedLinearOperator,
    DenseLinearOperator,
    IdentityLinearOperator,
    KroneckerProductLinearOperator,
    LinearOperator,
    SumLinearOperator,
)
from torch import Tensor

from .. import settings
from .kernel_products import fused_kernel_matmul
from .sharding import RowBlock, RowShardedKernel, ShardedKernelMatrix
from .threads import large_operation


def _uses_keops(kernel: gpytorch.kernels.Kernel) -> bool:
    return any(isinstance(module, gpytorch.kernels.keops.KeOpsKernel) for module in kernel.modules())


def _chunk_rows(covariance: LinearOperator) -> int:
    """Rows per chunk for products with a lazily evaluated kernel too large to cache (0: no chunking).

    KeOps kernels are never chunked: they never form the matrix, and GPyTorch evaluates a KeOps kernel
    densely on blocks below ``max_cholesky_size`` rows, so chunks would silently leave KeOps (slower, and more
    memory; ``docs/design_notes.md``).
    """
    if not isinstance(covariance, LazyEvaluatedKernelTensor) or _uses_keops(covariance.kernel):
        return 0
    rows, cols = covariance.shape[-2:]
    row_bytes = cols * covariance.batch_shape.numel() * covariance.dtype.itemsize
    if rows * row_bytes <= settings.dense_kernel_limit.value():
        return 0
    # whole points (C rows each) of a multitask kernel: a slice across a point evaluates the whole kernel
    outputs = covariance.kernel.num_outputs_per_input(covariance.x1, covariance.x2)
    outputs = outputs[0] if isinstance(outputs, tuple) else outputs
    return max(1, settings.kernel_chunk_bytes.value() // row_bytes // outputs) * outputs


def _point_block(covariance: LinearOperator, rows: slice, cols: slice, num: int) -> LinearOperator:
    r"""The rows of points ``rows`` and the columns of points ``cols`` of a data-major ``(N C, M C)`` covariance, lazily.

    :math:`\mathbf K_x \otimes \mathbf B` (a ``KroneckerProductLinearOperator`` whose last factor is ``C × C``, as a
    linear model of coregionalisation builds it) and sums of such (:math:`\sum_q \mathbf K_q \otimes \mathbf B_q`)
    are sliced in their data factors: linear_operator would otherwise index the interleaved entries through a
    sparse interpolation on every product. Anything else (a multitask ``LazyEvaluatedKernelTensor`` re-evaluates its
    kernel on the points) is sliced by its entries.
    """
    if isinstance(covariance, SumLinearOperator):
        return SumLinearOperator(*(_point_block(term, rows, cols, num) for term in covariance.linear_ops))
    if isinstance(covariance, KroneckerProductLinearOperator) and len(covariance.linear_ops) == 2:
        data, task = covariance.linear_ops
        if task.shape[-2:] == (num, num):
            return KroneckerProductLinearOperator(data[..., rows, cols], task)

    def scaled(points: slice) -> slice:
        return slice(
            None if points.start is None else points.start * num, None if points.stop is None else points.stop * num
        )

    return covariance[..., scaled(rows), scaled(cols)]


def _same_points(first: Tensor, second: Tensor) -> bool:
    return first is second or (first.shape == second.shape and bool(torch.equal(first, second)))


def _point_blocks(covariance: LinearOperator, num: int) -> Tensor:
    r"""The ``C × C`` diagonal blocks ``(N, C, C)`` of a square data-major covariance, without forming it.

    A multitask kernel is evaluated at each point alone (a batch of ``N`` one-point inputs, :math:`O(N C^2)`);
    :math:`\mathbf K_x \otimes \mathbf B` gives :math:`k_x(x_n, x_n) \mathbf B`, and sums are summed. Anything else
    is indexed entry by entry.
    """
    if isinstance(covariance, LazyEvaluatedKernelTensor) and _same_points(covariance.x1, covariance.x2):
        points = covariance.x1.unsqueeze(-2)  # (N, 1, D)
        return covariance.kernel(points, points, **covariance.params).to_dense()
    if isinstance(covariance, SumLinearOperator):
        return sum(
            (_point_blocks(term, num) for term in covariance.linear_ops[1:]),
            _point_blocks(covariance.linear_ops[0], num),
        )
    if isinstance(covariance, KroneckerProductLinearOperator) and len(covariance.linear_ops) == 2:
        data, task = covariance.linear_ops
        if task.shape[-2:] == (num, num):
            return data.diagonal(dim1=-2, dim2=-1)[..., :, None, None] * task.to_dense()[..., None, :, :]
    size = covariance.shape[-1] // num
    index = torch.arange(size, device=covariance.device)[:, None] * num + torch.arange(num, device=covariance.device)
    return covariance[..., index[:, :, None], index[:, None, :]]


#: Products with at most this many columns by a dense matrix on the CPU run transposed and padded (:func:`narrow_matmul`).
NARROW_PRODUCT_COLUMNS = 256


def _is_training_kernel(covariance: LinearOperator) -> bool:
    """Whether ``covariance`` is a lazily evaluated kernel of one set of points with themselves (a symmetric matrix)."""
    return isinstance(covariance, LazyEvaluatedKernelTensor) and covariance.x1 is covariance.x2


def _cached_kernel_matmul(covariance: LinearOperator, rhs: Tensor) -> Tensor | None:
    r""":math:`\mathbf K \mathbf X` for the dense kernel matrix of the training points with themselves (evaluated and
    cached on the first product) by :func:`narrow_matmul`; ``None`` for other kernels, or wide or non-CPU ``rhs``."""
    if rhs.device.type != "cpu" or rhs.shape[-1] > NARROW_PRODUCT_COLUMNS or torch.is_grad_enabled():
        return None
    if not _is_training_kernel(covariance):
        return None
    if _uses_keops(covariance.kernel):
        return None
    evaluated = covariance.evaluate_kernel()  # cached by GPyTorch, as its own product would do
    if not isinstance(evaluated, DenseLinearOperator):
        return None
    return narrow_matmul(evaluated.tensor, rhs)


def narrow_matmul(matrix: Tensor, rhs: Tensor) -> Tensor:
    r"""``matrix @ rhs`` for a dense ``matrix`` ``(*batch, N, M)``; on the CPU, for :math:`2 \le k \le`
    ``NARROW_PRODUCT_COLUMNS`` columns of ``rhs`` ``(*batch, M, k)``, as :math:`(\mathbf X^\top \mathbf A^\top)^\top`
    with :math:`\mathbf X` padded by zero columns to a multiple of four (a view of the transposed result).

    The same numbers to rounding; BLAS libraries' kernels for a few columns are far from the memory bandwidth one
    pass over the matrix allows, and this form with a multiple of four columns is not (``docs/design_notes.md``).
    """
    width = rhs.shape[-1]
    if rhs.device.type != "cpu" or not 2 <= width <= NARROW_PRODUCT_COLUMNS or rhs.dim() != matrix.dim():
        return matrix @ rhs
    padded = torch.nn.functional.pad(rhs.mT, (0, 0, 0, -width % 4))  # (*batch, k + p, M), differentiable
    return (padded @ matrix.mT)[..., :width, :].mT


class SymmetricMatrixOperator(DenseLinearOperator):
    """A dense symmetric matrix ``(*batch, N, N)`` (a kernel matrix of points with themselves) whose products, and
    products with its transpose, run by :func:`narrow_matmul`: linear_operator's dense product with the transpose
    reads the matrix by columns, which BLAS libraries multiply with a few columns ten times slower."""

    def _matmul(self, rhs: Tensor) -> Tensor:
        return narrow_matmul(self.tensor, rhs)

    def _t_matmul(self, rhs: Tensor) -> Tensor:
        return narrow_matmul(self.tensor, rhs)


def _chunked_matmul(covariance: LinearOperator, rhs: Tensor, chunk_rows: int) -> Tensor:
    """``covariance @ rhs`` over blocks of ``chunk_rows`` rows, each evaluated densely and dropped after use."""
    rows = covariance.shape[-2]
    blocks = [covariance[..., start : start + chunk_rows, :].to_dense() @ rhs for start in range(0, rows, chunk_rows)]
    return torch.cat(blocks, dim=-2)


def _kernel_matmul(covariance: LinearOperator, rhs: Tensor, chunk_rows: int) -> Tensor:
    """``covariance @ rhs``: cached (narrow products by :func:`narrow_matmul`) up to the dense limit, fused for RBF and
    Matérn kernels above it (``chunk_rows`` > 0), chunked otherwise."""
    if not chunk_rows:
        narrow = _cached_kernel_matmul(covariance, rhs)
        return covariance.matmul(rhs) if narrow is None else narrow
    fused = fused_kernel_matmul(covariance, rhs)  # RBF / Matérn: never forms K
    return _chunked_matmul(covariance, rhs, chunk_rows) if fused is None else fused


def _local_matmul(rows: LinearOperator, rhs: Tensor) -> Tensor:
    """One rank's rows of a sharded product, by the products of one process (:func:`_kernel_matmul`)."""
    return _kernel_matmul(rows, rhs, 0 if torch.is_grad_enabled() else _chunk_rows(rows))


def _sharded(covariance: LinearOperator) -> ShardedKernelMatrix | None:
    """The row-sharded matrix of a :class:`~gpytorch_iterncgp.core.sharding.RowShardedKernel` (without gradients;
    evaluating it forms nothing), ``None`` for any other covariance."""
    if not isinstance(covariance, LazyEvaluatedKernelTensor) or not isinstance(covariance.kernel, RowShardedKernel):
        return None
    evaluated = covariance.evaluate_kernel()
    return evaluated if isinstance(evaluated, ShardedKernelMatrix) else None


class ProductCounts:
    """Every product with K a prior made (calls, columns, seconds), and of those the ones made inside
    :meth:`set_aside` (a preconditioner's, which a fit's report counts apart): a
    :class:`~gpytorch_iterncgp.core.outer_loop.ProductCounter`. Counters only grow."""

    def __init__(self) -> None:
        self.products = 0  # calls of the kernel's matmul (or columns), every one
        self.columns = 0  # columns multiplied in those calls
        self.product_seconds = 0.0  # wall time spent in those calls
        # of those, the ones made inside set_aside()
        self.products_aside = 0
        self.columns_aside = 0
        self.product_seconds_aside = 0.0
        self._aside_depth = 0

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """Count the products made inside the block as every product, and also in :attr:`products_aside`,
        :attr:`columns_aside` and :attr:`product_seconds_aside` (a preconditioner's kernel columns, which a fit's report
        counts apart from the solver's products). Counters only grow."""
        self._aside_depth += 1
        try:
            yield
        finally:
            self._aside_depth -= 1

    def count(self, columns: int, seconds: float = 0.0) -> None:
        """Count one product (or read of kernel columns) with ``columns`` columns that took ``seconds``."""
        self.products += 1
        self.columns += columns
        self.product_seconds += seconds
        if self._aside_depth:
            self.products_aside += 1
            self.columns_aside += columns
            self.product_seconds_aside += seconds


class LatentPrior(ProductCounts):
    r"""Prior mean ``(N, C)`` and covariance :math:`\mathbf K` (``(N C, M C)``, data-major) of the latents.

    One subclass per layout of the model's output (:meth:`from_distribution`): :class:`OneLatentPrior` (one GP),
    :class:`SharedKernelPrior` (:math:`\mathbf K_x \otimes \mathbf I_C`), :class:`IndependentPrior` (``batch_shape=[C]``)
    and :class:`MultitaskPrior` (a data-major ``(N C, M C)`` covariance). Each says how a data-major block
    ``(M C, k)`` becomes the kernel's right-hand side and back (:meth:`_layout_matmul`), its mean, its diagonal and
    its point blocks; the products themselves (cached, fused, chunked, or by rows of a
    :class:`~gpytorch_iterncgp.core.sharding.RowShardedKernel`) are this class's.

    :param mean: prior mean as the model returned it (``(N,)``, ``(C, N)`` or ``(N, C)``).
    :param covariance: the kernel matrix as GPyTorch returned it (``(N, M)``, ``(C, N, M)`` or ``(N C, M C)``).
    :param num_latents: :math:`C`.
    """

    layout = ""  # the name of the layout ("single", "shared", "independent", "multitask")

    def __init__(self, mean: Tensor, covariance: LinearOperator, num_latents: int):
        self._mean = mean
        self.covariance = covariance
        self.num_latents = num_latents
        super().__init__()
        self._evaluated_kernel: Tensor | None = None  # the kernel matrix as a tensor, once read (evaluated_kernel)

    @classmethod
    def from_distribution(cls, distribution: MultivariateNormal, num_latents: int) -> LatentPrior:
        """The prior of the layout of the output of a model's ``forward``.

        :raises ValueError: if its shape does not fit ``num_latents`` (e.g. a batch model for C = 1).
        """
        if isinstance(distribution, MultitaskMultivariateNormal):
            if distribution.num_tasks != num_latents:
                raise ValueError(
                    f"The model returns a MultitaskMultivariateNormal with {distribution.num_tasks} tasks, but the "
                    f"likelihood needs {num_latents} latent functions."
                )
            covariance = distribution.lazy_covariance_matrix
            if not distribution._interleaved:
                raise ValueError("IterNCGP needs an interleaved MultitaskMultivariateNormal (data-major order).")
            return MultitaskPrior(distribution.mean, covariance, num_latents)
        if not isinstance(distribution, MultivariateNormal):
            raise TypeError(f"The model's forward must return a MultivariateNormal, got {type(distribution).__name__}.")
        batch_shape = tuple(distribution.batch_shape)
        if batch_shape == ():
            layout = OneLatentPrior if num_latents == 1 else SharedKernelPrior
            return layout(distribution.mean, distribution.lazy_covariance_matrix, num_latents)
        if batch_shape == (num_latents,) and num_latents > 1:
            return IndependentPrior(distribution.mean, distribution.lazy_covariance_matrix, num_latents)
        raise ValueError(
            f"The model's forward returns batch_shape {list(batch_shape)}; with {num_latents} latent function(s) "
            f"IterNCGP expects batch_shape [] (one kernel{' shared by all classes' if num_latents > 1 else ''})"
            + (f" or [{num_latents}] (one GP per class)." if num_latents > 1 else ".")
        )

    # -- the layout (one subclass each) ------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        """``(N, M)``: the number of row and column points."""
        rows, cols = self.covariance.shape[-2:]
        return rows, cols

    @property
    def mean(self) -> Tensor:
        """Prior mean at the row points, ``(N, C)``."""
        raise NotImplementedError

    def _layout_matmul(self, multiply: Callable[[Tensor], Tensor], rhs: Tensor, num_rows: int, num_cols: int) -> Tensor:
        """``multiply`` (the kernel's product) applied to data-major ``rhs`` ``(num_cols C, k)`` in the kernel's own
        layout, and its result ``(num_rows C, k)`` data-major again: the covariance is data-major already here."""
        return multiply(rhs)

    def diagonal(self) -> Tensor:
        """The prior variances, data-major ``(N C,)`` (square blocks only)."""
        return self.covariance.diagonal(dim1=-2, dim2=-1)

    def point_blocks(self) -> Tensor:
        r"""The :math:`C \times C` prior covariance of each point's latents, ``(N, C, C)`` (square blocks only)."""
        return torch.diag_embed(self.diagonal().reshape(-1, self.num_latents))

    def data_major_covariance(self) -> LinearOperator:
        r"""The square covariance as one data-major ``(N C, N C)`` LinearOperator (lazy)."""
        return self._kernel_operator()

    def _kernel_operator(self) -> LinearOperator:
        """The kernel matrix as an operator: the matrix the prior holds evaluated, where it is the training points'
        with themselves (a :class:`SymmetricMatrixOperator`, with the evaluation's graph), else the covariance."""
        if self._evaluated_kernel is None or not _is_training_kernel(self.covariance):
            return self.covariance
        return SymmetricMatrixOperator(self._evaluated_kernel)

    def block(self, rows: slice, cols: slice) -> LatentPrior:
        """The prior restricted to row points ``rows`` and column points ``cols`` (lazy; nothing is evaluated)."""
        return type(self)(self._mean[..., rows], self.covariance[..., rows, cols], self.num_latents)

    def _pick_columns(self, kernel: Tensor, inverse: Tensor, latents: Tensor) -> Tensor:
        """The columns ``(N, k)`` of point ``inverse[j]`` (of the kernel's columns ``(N, u)`` at the unique points)
        for the data-major indices of latents ``latents``."""
        return kernel[:, inverse]

    # -- common -----------------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self._mean.dtype

    @property
    def device(self) -> torch.device:
        return self._mean.device

    @functools.cached_property
    def rows(self) -> RowBlock:
        """The rows of the solver's data-major vectors this process holds: this rank's where the kernel is a
        :class:`~gpytorch_iterncgp.core.sharding.RowShardedKernel` holding the state by rows (``shard_state``), else
        all of them (:meth:`~gpytorch_iterncgp.core.sharding.RowBlock.single`)."""
        kernel = getattr(self.covariance, "kernel", None)
        if isinstance(self.covariance, LazyEvaluatedKernelTensor) and isinstance(kernel, RowShardedKernel):
            return kernel.row_block(self.shape[0], self.num_latents)
        return RowBlock.single(self.shape[0], self.num_latents)

    def matmul(self, rhs: Tensor) -> Tensor:
        r""":math:`\mathbf K \mathbf X` for data-major ``X`` of shape ``(M C, k)``; returns ``(N C, k)``.

        One call of the underlying kernel matmul, whatever :math:`C` and :math:`k`. Where the dense kernel would
        exceed :class:`~gpytorch_iterncgp.settings.dense_kernel_limit` (and no gradient is recorded), fused for
        RBF and Matérn kernels (:mod:`~gpytorch_iterncgp.core.kernel_products`, unless
        :class:`~gpytorch_iterncgp.settings.fused_kernel_products` is off), in row chunks otherwise; a row-sharded
        kernel multiplies each rank's rows and gathers them.
        """
        return self._counted(rhs.shape[-1], lambda: self._layout_matmul(self._product(), rhs, *self.shape))

    def matmul_by_rows(self, rhs: Tensor) -> Tensor:
        r""":math:`\mathbf K \mathbf X` for the square kernel of the training points, ``X`` and the product held by
        :attr:`rows` (as the solver holds its vectors: this rank's ``(|I_p| C, k)``, or all rows of ``X``).

        ``X`` is gathered once, each rank multiplies its rows of :math:`\mathbf K` and keeps them,
        :math:`(\mathbf K \mathbf X)_{\mathcal I_p}` ``(|I_p| C, k)``: no second collective. All rows in one
        process: :meth:`matmul`.
        """
        rows = self.rows
        if not rows.is_sharded:
            return self.matmul(rhs)
        whole, sharded = rows.all_rows(rhs), _sharded(self.covariance)
        if sharded is None:  # the wrapped kernel's own evaluation (gradients): all rows, then this rank's
            return rows.own_rows(self.matmul(whole))

        def own(matrix: Tensor) -> Tensor:  # each rank its rows, by the products of one process; not gathered
            return sharded.sharded_matmul(_local_matmul, matrix, gather=False)

        num_rows = rows.local_size // self.num_latents
        return self._counted(rhs.shape[-1], lambda: self._layout_matmul(own, whole, num_rows, self.shape[1]))

    def matmul_by_columns(self, rhs: Tensor, columns: RowBlock) -> Tensor:
        r""":math:`\mathbf K \mathbf X` ``(N C, k)`` for ``X`` held by rows of ``columns`` (the column points' rows:
        this rank's ``(|I_p| C, k)``, e.g. a state's :math:`\mathbf Q` for a cross-covariance :math:`\mathbf K_{*X}`).

        Each rank multiplies the kernel's columns of its points, :math:`\mathbf K_{:, \mathcal I_p} \mathbf
        X_{\mathcal I_p}`, and one ``all_reduce`` sums them
        (:meth:`~gpytorch_iterncgp.core.sharding.ShardedKernelMatrix.column_block_matmul`). Where the kernel is not
        sharded (gradients recorded), or ``columns`` holds all rows: ``X`` gathered, then :meth:`matmul`.
        """
        sharded = _sharded(self.covariance)
        if sharded is None or not columns.is_sharded:
            return self.matmul(columns.all_rows(rhs))

        def summed(matrix: Tensor) -> Tensor:  # each rank its columns; then summed
            return sharded.column_block_matmul(_local_matmul, matrix, columns)

        num_cols = rhs.shape[0] // self.num_latents  # this rank's column points
        return self._counted(rhs.shape[-1], lambda: self._layout_matmul(summed, rhs, self.shape[0], num_cols))

    def _product(self) -> Callable[[Tensor], Tensor]:
        """The kernel's product with a right-hand side in its own layout: by rows of a row-sharded kernel, gathered;
        else cached, fused or chunked (:func:`_kernel_matmul`)."""
        sharded = _sharded(self.covariance)
        if sharded is not None:
            return functools.partial(sharded.sharded_matmul, _local_matmul)
        if self._evaluated_kernel is not None:
            # the matrix read already (the preconditioner's pivots), with its graph where the kernel's evaluation has
            # one: one product, not one per term of a sum of kernels, and one N x N derivative per product backwards
            return functools.partial(narrow_matmul, self._evaluated_kernel)
        chunk_rows = 0 if torch.is_grad_enabled() else _chunk_rows(self.covariance)
        return functools.partial(_kernel_matmul, self.covariance, chunk_rows=chunk_rows)

    def _counted(self, columns: int, product: Callable[[], Tensor], work: int | None = None) -> Tensor:
        """``product()``, counted as one product with ``columns`` columns and timed (:meth:`count`); ``work``
        (default: a product's, :math:`N M` per column) decides whether it runs on the caller's threads
        (:func:`large_operation`)."""
        start = self._clock()
        with large_operation(self.shape[0] * self.shape[1] * columns if work is None else work):
            result = product()
        self.count(columns, self._clock() - start)
        return result

    def _clock(self) -> float:
        """Wall time, after the device's queued work (CUDA runs asynchronously: without this, a product's time would
        be counted wherever the host next waits for the device)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def cache_kernel(self) -> bool:
        """Evaluate the kernel matrix and cache it where its products would (a lazily evaluated kernel within
        :class:`~gpytorch_iterncgp.settings.dense_kernel_limit`, not KeOps, not sharded), so that
        :meth:`kernel_columns` reads columns instead of evaluating the kernel for each (under autograd: with its graph,
        as a product's evaluation would be); otherwise nothing. Returns whether it is cached."""
        covariance = self.covariance
        if not isinstance(covariance, LazyEvaluatedKernelTensor):
            return False
        if _uses_keops(covariance.kernel) or _sharded(covariance) is not None or _chunk_rows(covariance):
            return False
        covariance.evaluate_kernel()  # memoized by GPyTorch: the products read the same evaluation
        return True

    def kernel_columns(self, indices: Tensor) -> Tensor:
        r"""The columns :math:`\mathbf K_{:, \text{indices}}` for data-major indices ``(k,)`` (latent ``c`` of point ``p`` is
        ``p C + c``); returns ``(N C, k)``.

        The kernel is evaluated at the rows and the indexed points only, :math:`O(N D)` per point (or read from the
        kernel matrix if a product has already evaluated and cached it); correlated outputs (:class:`MultitaskPrior`)
        take a product with the one-hot columns instead. :math:`\mathbf K \mathbf s` for an action ``s`` with few
        non-zero entries is then a combination of columns, not a product with :math:`\mathbf K`; a call counts as one
        product with ``k`` columns, and its time as time in products.
        """
        return self._counted(len(indices), lambda: self._columns(indices, own_rows=False), self._column_work(indices))

    def kernel_columns_by_rows(self, indices: Tensor) -> Tensor:
        r""":meth:`kernel_columns`, this rank's rows ``(|I_p| C, k)`` of them where :attr:`rows` are sharded (a sharded
        kernel evaluates them from its rows, with no collective)."""
        if not self.rows.is_sharded:
            return self.kernel_columns(indices)
        return self._counted(len(indices), lambda: self._columns(indices, own_rows=True), self._column_work(indices))

    def _column_work(self, indices: Tensor) -> int:
        """The work of :meth:`kernel_columns`: :math:`N C` entries per column (a product's for correlated outputs)."""
        return self.shape[0] * self.num_latents * len(indices)

    def _columns(self, indices: Tensor, own_rows: bool) -> Tensor:
        """:meth:`kernel_columns` (``own_rows``: this rank's rows of them)."""
        num = self.num_latents
        points, latents = indices // num, indices % num
        unique, inverse = points.unique(return_inverse=True)
        kernel = self._point_columns(unique, own_rows)  # (N, u), or (C, N, u) for independent GPs
        picked = self._pick_columns(kernel, inverse, latents)
        block = picked.new_zeros(picked.shape[0], num, len(indices))
        block[:, latents, torch.arange(len(indices), device=self.device)] = picked
        return block.reshape(-1, len(indices))

    def _point_columns(self, points: Tensor, own_rows: bool) -> Tensor:
        """The kernel's columns at ``points`` ``(u,)``, ``(*batch, N, u)`` (sharded by rows for a sharded kernel; with
        ``own_rows`` this rank's rows ``(*batch, |I_p|, u)`` of them)."""
        covariance = self.covariance
        sharded = _sharded(covariance)
        if sharded is not None:
            return sharded.sharded_columns(points, gather=not own_rows)
        if own_rows:
            rows = self.rows
            covariance = covariance[..., rows.start // self.num_latents : rows.stop // self.num_latents, :]
        else:
            dense = self.evaluated_kernel()
            if dense is not None:
                return dense[..., :, points]
        return covariance[..., :, points].to_dense()

    def evaluated_kernel(self) -> Tensor | None:
        """The kernel matrix ``(*batch, N, M)`` as a tensor where a product (or :meth:`cache_kernel`) has evaluated and
        cached it; ``None`` otherwise (not yet evaluated, KeOps, chunked or sharded: the kernel is then evaluated where
        it is read).

        The dense matrix is made once (memoized by linear_operator for a structured one, e.g. a sum of kernels) and
        kept by the prior; made with autograd on, so that where the evaluation records gradients (the evidence's prior,
        read by a fit) it does too.
        """
        covariance = self.covariance
        if self._evaluated_kernel is None and _sharded(covariance) is None:
            cache = getattr(covariance, "_memoize_cache", {})
            if isinstance(covariance, LazyEvaluatedKernelTensor) and any(key[0] == "kernel_eval" for key in cache):
                with torch.enable_grad():
                    self._evaluated_kernel = covariance.evaluate_kernel().to_dense()
        return self._evaluated_kernel


class OneLatentPrior(LatentPrior):
    """One GP (:math:`C = 1`): the mean ``(N,)``, the covariance ``(N, M)``."""

    layout = "single"

    @property
    def mean(self) -> Tensor:
        return self._mean[:, None]


class SharedKernelPrior(LatentPrior):
    r"""One kernel shared by all :math:`C` latents, :math:`\mathbf K = \mathbf K_x \otimes \mathbf I_C`: the mean
    ``(N,)``, the covariance ``(N, M)``; a data-major block ``(M C, k)`` is one ``(M, C k)`` right-hand side."""

    layout = "shared"

    @property
    def mean(self) -> Tensor:
        return self._mean[:, None].expand(-1, self.num_latents)

    def _layout_matmul(self, multiply: Callable[[Tensor], Tensor], rhs: Tensor, num_rows: int, num_cols: int) -> Tensor:
        num, width = self.num_latents, rhs.shape[-1]
        return multiply(rhs.reshape(num_cols, num * width)).reshape(num_rows * num, width)

    def diagonal(self) -> Tensor:
        return super().diagonal()[:, None].expand(-1, self.num_latents).reshape(-1)

    def data_major_covariance(self) -> LinearOperator:
        identity = IdentityLinearOperator(self.num_latents, dtype=self.dtype, device=self.device)
        return KroneckerProductLinearOperator(self._kernel_operator(), identity)


class IndependentPrior(LatentPrior):
    r"""One GP per latent (``batch_shape=[C]``): the mean ``(C, N)``, the covariance ``(C, N, M)``; a data-major block
    ``(M C, k)`` is the batch ``(C, M, k)`` of one batched product."""

    layout = "independent"

    @property
    def mean(self) -> Tensor:
        return self._mean.mT

    def _layout_matmul(self, multiply: Callable[[Tensor], Tensor], rhs: Tensor, num_rows: int, num_cols: int) -> Tensor:
        num, width = self.num_latents, rhs.shape[-1]
        per_class = rhs.reshape(num_cols, num, width).permute(1, 0, 2)
        product = multiply(per_class)  # (C, N, k)
        return product.permute(1, 0, 2).reshape(num_rows * num, width)

    def _pick_columns(self, kernel: Tensor, inverse: Tensor, latents: Tensor) -> Tensor:
        return kernel[latents, :, inverse].mT

    def diagonal(self) -> Tensor:
        return super().diagonal().mT.reshape(-1)

    def data_major_covariance(self) -> LinearOperator:
        return BlockInterleavedLinearOperator(self._kernel_operator(), block_dim=-3)


class MultitaskPrior(LatentPrior):
    r"""Correlated latents (a ``MultitaskMultivariateNormal``, interleaved): the mean ``(N, C)``, the covariance
    data-major ``(N C, M C)`` (e.g. :math:`\mathbf K_x \otimes \mathbf B`, or :math:`\sum_q \mathbf K_q \otimes
    \mathbf B_q`)."""

    layout = "multitask"

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.covariance.shape[-2:]
        return rows // self.num_latents, cols // self.num_latents

    @property
    def mean(self) -> Tensor:
        return self._mean

    def block(self, rows: slice, cols: slice) -> LatentPrior:
        num = self.num_latents
        return MultitaskPrior(self._mean[rows], _point_block(self.covariance, rows, cols, num), num)

    def point_blocks(self) -> Tensor:
        return _point_blocks(self.covariance, self.num_latents)

    def _column_work(self, indices: Tensor) -> int:
        return self.shape[0] * self.shape[1] * self.num_latents**2 * len(indices)  # a product

    def _columns(self, indices: Tensor, own_rows: bool) -> Tensor:
        """The product with the one-hot columns (``own_rows``: this rank's rows of it)."""
        one_hot = torch.zeros(self.covariance.shape[-1], len(indices), dtype=self.dtype, device=self.device)
        one_hot[indices, torch.arange(len(indices), device=self.device)] = 1
        product = self._layout_matmul(self._product(), one_hot, *self.shape)
        return self.rows.own_rows(product) if own_rows else product
