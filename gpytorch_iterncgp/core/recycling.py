r"""Recycling and compression of actions across Newton steps (paper, Algorithm 3).

The solver keeps the actions :math:`\mathbf S` (``(N C, B)``) and their kernel products
:math:`\mathbf T = \mathbf K \mathbf S` across Newton steps. When the noise :math:`\mathbf W^{-1}`
changes, a *virtual solver run* turns them into an initial precision for the new system without a
single product with :math:`\mathbf K`:

.. math::
    \mathbf M = \mathbf S^\top (\mathbf T + \mathbf W^{-1} \mathbf S) = \mathbf S^\top \hat{\mathbf K} \mathbf S
    = \mathbf U \boldsymbol\Lambda \mathbf U^\top, \qquad
    \mathbf S \leftarrow \mathbf S \mathbf U_R,\quad \mathbf T \leftarrow \mathbf T \mathbf U_R,\quad
    \mathbf Q = \mathbf S \mathbf U_R \boldsymbol\Lambda_R^{-1/2},

keeping the top :math:`R` eigenpairs (compression). Then :math:`\mathbf C_0 = \mathbf Q \mathbf Q^\top
= \mathbf S (\mathbf S^\top \hat{\mathbf K} \mathbf S)^{-1} \mathbf S^\top` (for :math:`R = B`), and the
residual of :math:`\mathbf v_0 = \mathbf C_0 \mathbf b` is orthogonal to :math:`\operatorname{span}(\mathbf S)`
(Proposition A.4).

What a Newton step pays outside the products with :math:`\mathbf K`. The part of :math:`\mathbf M` that does not
depend on :math:`\mathbf W`, :math:`\mathbf S^\top \mathbf T = \mathbf S^\top \mathbf K \mathbf S`, is kept by the
:class:`ActionBuffer` and bordered by one row and column per appended action (:math:`O(N C B)`, the product IterGP's
conjugation needs anyway), so a virtual run computes only :math:`\mathbf S^\top \mathbf W^{-1} \mathbf S`: one
:math:`O(N C B^2)` GEMM over chunks of whitened actions (:func:`noise_gram`). Where nothing is compressed
(:math:`R = \infty`, or :math:`B \le R` without a kept direction) the buffer is not re-weighted at all:
:math:`\mathbf S` stays as it was and grows in place. :math:`\mathbf Q = \mathbf S \mathbf E` and
:math:`\mathbf K \mathbf Q = \mathbf T \mathbf E` stay implicit (:class:`ImplicitRoot`, with :math:`\mathbf E =
\mathbf U \boldsymbol\Lambda^{-1/2}` here): IterGP only needs their products with vectors. Compression also needs
:math:`\mathbf S^\top \mathbf S` (the norms of re-weighted actions), one GEMM over its at most :math:`R + j` actions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from linear_operator.operators import DiagLinearOperator, LinearOperator
from torch import Tensor

from .deferred import DeferredTensor, deferred
from .noise import FactoredNoise, NoiseOperator
from .precision import ColumnStore
from .sharding import RowBlock

# Bytes of W^{-1} S formed at once when a virtual run computes S^T W^{-1} S (column blocks of S) for a noise operator
# without a factor; and of the whitened chunk S_chunk^T F for the package's own noise operators (NOISE_CHUNK_BYTES:
# small enough to stay in cache and to be reused by the allocator instead of page-faulting fresh memory every step).
NOISE_BLOCK_BYTES = 2**28
NOISE_CHUNK_BYTES = 2**21
# Q^T = L^{-1} S^T of a root with a Cholesky factor by one triangular solve where S has at most this many rows per
# action (n <= 4 B, e.g. the exact path's n = B); for wider buffers E = L^{-T} and one GEMM, which the CPU runs faster
# per multiply-add than a triangular solve over many right-hand sides (docs/design_notes.md).
TRIANGULAR_COMBINATION_WIDTH = 4
# a product with a triangular matrix of at least twice this many rows is split in halves (lower_triangular_matmul)
TRIANGULAR_BLOCK_ROWS = 128


def _symmetric(matrix: Tensor) -> Tensor:
    return (matrix + matrix.mT) / 2


def _upper_mirrored(gram: Tensor) -> Tensor:
    r"""``gram`` with its strict lower triangle replaced by its upper one mirrored (entry :math:`(i, j)`,
    :math:`i \le j`, from :math:`\mathbf s_i^\top \mathbf t_j`, as the column-by-column kernel Gram matrix)."""
    upper = torch.triu(torch.ones_like(gram, dtype=torch.bool))
    return torch.where(upper, gram, gram.mT)


def _bordered(gram: Tensor, column: Tensor) -> Tensor:
    """``gram`` ``(B, B)`` with ``column`` ``(B + 1,)`` appended as last row and column."""
    size = gram.shape[-1]
    grown = gram.new_empty(size + 1, size + 1)
    grown[:size, :size] = gram
    grown[size, :] = column
    grown[:, size] = column
    return grown


@dataclass
class ActionBuffer:
    r"""Actions :math:`\mathbf S` and kernel products :math:`\mathbf T = \mathbf K \mathbf S`, each ``(N C, B)``.

    Actions are stored with unit norm; both grow by one column per solver iteration. The buffer also keeps
    :math:`\mathbf S^\top \mathbf K \mathbf S` (float64, :meth:`kernel_gram`): computed once when first needed, then
    bordered by :meth:`append` in :math:`O(N C B)`. :math:`\mathbf S^\top \mathbf S`, which only compression needs,
    is one GEMM when asked for (:meth:`action_gram`).

    The stores hold the rows of ``rows_block`` (a :class:`~gpytorch_iterncgp.core.sharding.RowBlock`): all ``N C`` in
    one process; where it is sharded this rank's rows :math:`\mathcal I_p` only, ``(|I_p| C, B)``, and so do the
    vectors given to and returned by the buffer's products (the solver holds its vectors by rows too; given all
    ``N C`` rows, the buffer takes this rank's): :meth:`transpose_matmul` and the Gram matrices reduce over the ranks,
    :meth:`combine` needs no collective.
    """

    actions: ColumnStore
    kernel_actions: ColumnStore
    rows_block: RowBlock
    _kernel_gram: Tensor | None = field(default=None, repr=False, compare=False)
    # (block size, actions checked, whether all of them sum to zero over every block): see zero_block_sums
    _zero_sums: tuple[int, int, bool] = field(default=(0, 0, True), repr=False, compare=False)
    # (block size, actions checked, their point_actions): see at_points
    _points: tuple[int, int, PointActions | None] = field(default=(0, 0, None), repr=False, compare=False)
    # the leading actions whose kernel Gram block is one GEMM (None: those held when it is first computed)
    _gemm_columns: int | None = field(default=0, repr=False, compare=False)

    @classmethod
    def from_tensors(
        cls, actions: Tensor, kernel_actions: Tensor, rows_block: RowBlock, gemm_columns: int | None = 0
    ) -> ActionBuffer:
        r"""A buffer holding copies of the rows of ``rows_block`` of ``actions`` and ``kernel_actions`` ``(N C, B)``
        (given all rows or those only).

        :param gemm_columns: how :meth:`kernel_gram` computes the matrix: ``0``, column by column; ``None``, by one
            GEMM over the actions held when it is first computed (for new actions, or kernel products just renewed
            for a new :math:`\mathbf K` by :meth:`~gpytorch_iterncgp.core.solver.RegressionState.with_kernel`: no
            buffer grew with that kernel); a number, that many leading actions' block by one GEMM, the rest column by
            column (the :attr:`gemm_columns` of the buffer a state was committed from: a resumed fit repeats it bit
            for bit).
        """
        actions, kernel_actions = rows_block.own_rows(actions), rows_block.own_rows(kernel_actions)
        return cls(ColumnStore(actions), ColumnStore(kernel_actions), rows_block, _gemm_columns=gemm_columns)

    @property
    def gemm_columns(self) -> int:
        """The leading actions whose block of :meth:`kernel_gram` was one GEMM (0: none, or not computed yet)."""
        return self._gemm_columns or 0

    def holds(self, actions: Tensor, kernel_actions: Tensor) -> bool:
        """Whether ``actions`` and ``kernel_actions`` are this buffer's columns, all of them: views of its storage, as
        the states of the loop that owns it hold them (then the buffer and its kernel Gram matrix can stand for them)."""
        views = ((actions, self.actions), (kernel_actions, self.kernel_actions))
        return all(
            view.shape == store.value.shape
            and view.data_ptr() == store.value.data_ptr()
            and view.stride() == store.value.stride()
            for view, store in views
        )

    @classmethod
    def empty(cls, rows_block: RowBlock, dtype: torch.dtype, device: torch.device) -> ActionBuffer:
        """A buffer of no actions of the rows of ``rows_block``."""
        empty = torch.zeros(rows_block.local_size, 0, dtype=dtype, device=device)
        return cls(ColumnStore(empty), ColumnStore(empty.clone()), rows_block)

    def frozen(self) -> ActionBuffer:
        """The buffer of the current actions, which appends to this one leave as they are (no copy:
        :meth:`ColumnStore.frozen`), with the kernel Gram matrix kept so far."""
        return ActionBuffer(
            self.actions.frozen(),
            self.kernel_actions.frozen(),
            self.rows_block,
            self._kernel_gram,
            _gemm_columns=self._gemm_columns,
        )

    @property
    def size(self) -> int:
        """The number of actions :math:`B`."""
        return self.actions.size

    @property
    def num_rows(self) -> int:
        """:math:`n = N C`, the length of the actions (on every rank, whatever rows it holds)."""
        return self.rows_block.size

    def transpose_matmul(self, vectors: Tensor) -> Tensor:
        r""":math:`\mathbf S^\top \mathbf x` ``(B, ...)`` for ``(N C, ...)`` vectors (sharded: one ``all_reduce``)."""
        return self.rows_block.summed(self.actions.rows @ self.rows_block.own_rows(vectors))

    def combine(self, coefficients: Tensor) -> tuple[Tensor, Tensor]:
        r""":math:`\mathbf S \mathbf c` and :math:`\mathbf T \mathbf c` ``(N C,)`` for ``(B,)`` coefficients (held by
        rows: this rank's rows ``(|I_p| C,)`` of them, no collective)."""
        return self.actions.rows.mT @ coefficients, self.kernel_actions.rows.mT @ coefficients

    def kernel_column(self, kernel_action: Tensor) -> Tensor:
        r""":math:`\mathbf S^\top \mathbf t` ``(B,)`` for a kernel product ``(N C,)``: the kernel Gram matrix's new
        column when its action is appended (:meth:`append`), which IterGP's conjugation also uses
        (:math:`\mathbf S^\top \hat{\mathbf K} \mathbf s = \mathbf S^\top \mathbf t + \mathbf S^\top \mathbf W^{-1}
        \mathbf s`)."""
        return self.transpose_matmul(kernel_action)

    def kernel_gram(self) -> Tensor:
        r""":math:`\mathbf S^\top \mathbf K \mathbf S`, float64 ``(B, B)``, symmetric.

        Entry :math:`(i, j)`, :math:`i \le j`, is :math:`\mathbf s_i^\top \mathbf t_j`, computed when action :math:`j`
        is appended, by :meth:`append` (:math:`\mathbf K` is symmetric: the other triangle is not computed again). A
        buffer built from tensors computes it here, column by column in the same way (:math:`O(N C B^2)`; for unit
        vectors a gather of :math:`\mathbf T`'s rows, :meth:`_unit_vector_gram`), so that it does not depend on whether
        the buffer grew in this process or was restored (a resumed fit repeats an uninterrupted one bit for bit); for
        new actions, or kernel products renewed for a new :math:`\mathbf K` (:meth:`from_tensors`' ``gemm_columns``),
        the block of those actions is one GEMM :math:`\mathbf S^\top \mathbf T`, its upper triangle kept (equal to
        the column-by-column block to rounding; one call instead of :math:`B`).
        """
        if self._kernel_gram is None or self._kernel_gram.shape[-1] != self.size:
            rows, kernel_rows = self.actions.rows, self.kernel_actions.rows
            gram = self._unit_vector_gram()
            if gram is not None:
                self._gemm_columns = 0  # (a gather: the dot products' values bit for bit)
            else:
                first = self.size if self._gemm_columns is None else min(self._gemm_columns, self.size)
                self._gemm_columns = first
                gram = torch.zeros(self.size, self.size, dtype=torch.float64, device=rows.device)
                gram[:first, :first] = _upper_mirrored((rows[:first] @ kernel_rows[:first].mT).double())
                for index in range(first, self.size):
                    column = self._gram_column(index, rows[:index] @ kernel_rows[index], reduce=False)
                    gram[index, : index + 1] = gram[: index + 1, index] = column
            self._kernel_gram = self.rows_block.summed(gram)
        return self._kernel_gram

    def zero_block_sums(self, block: int) -> bool:
        r"""Whether every action sums to zero over each block of ``block`` consecutive entries (a softmax's classes of
        one data point), to rounding: :math:`|\sum_c s_{nc}| \le 16\, C\, \epsilon \max |s|` per action. Only the
        actions appended since the last call with this ``block`` are checked (:math:`O(N C)` each)."""
        checked_block, checked, zero = self._zero_sums
        if checked_block != block or checked > self.size:
            checked, zero = 0, True
        rows = self.actions.rows[checked:]
        if zero and len(rows):
            sums = rows.reshape(len(rows), -1, block) @ rows.new_ones(block, 1)
            bound = 16 * block * torch.finfo(rows.dtype).eps * rows.abs().amax(dim=-1)
            zero = bool((sums.abs().amax(dim=(-2, -1)) <= bound).all())
        zero = self.rows_block.everywhere(zero, rows)  # zero on every rank
        self._zero_sums = (block, self.size, zero)
        return zero

    def at_points(self, block: int) -> PointActions:
        """:func:`point_actions` of the buffer's actions (this rank's rows) for data points of ``block`` entries; only
        the actions appended since the last call with this ``block`` are examined (:math:`O(N C)` each)."""
        checked_block, checked, known = self._points
        if checked_block != block or checked > self.size or known is None:
            checked, known = 0, None
        new = point_actions(self.actions.rows[checked:], block)
        found = new if known is None else PointActions(*(torch.cat(pair) for pair in zip(known, new, strict=True)))
        self._points = (block, self.size, found)
        return found

    def _unit_vector_gram(self) -> Tensor | None:
        r""":math:`\mathbf S^\top \mathbf T` float64 ``(B, B)`` where every action is a unit vector (one non-zero entry,
        :math:`\pm 1`: :meth:`at_points` of one-entry blocks): entry :math:`(i, j)` is :math:`\pm t_j` at
        :math:`\mathbf s_i`'s entry, a gather of :math:`O(B^2)` equal to the dot product :math:`\mathbf s_i^\top
        \mathbf t_j` bit for bit (its other terms are zeros); ``None`` for any other actions (and for this rank's rows of
        a sharded buffer, where a unit vector may lie on another rank)."""
        located = self.at_points(1)
        sign = located.entries  # (B, 1)
        if self.size == 0 or not bool(located.mask.all() & (sign.abs() == 1).all()):
            return None
        gram = (sign * self.kernel_actions.rows[:, located.points].mT).double()  # (i, j): s_i^T t_j
        return _upper_mirrored(gram)

    def action_gram(self) -> Tensor:
        r""":math:`\mathbf S^\top \mathbf S`, float64 ``(B, B)``, symmetric: one GEMM (:math:`O(N C B^2)`)."""
        rows = self.actions.rows
        return _symmetric(self.rows_block.summed(rows @ rows.mT).double())

    def _gram_column(self, index: int, kernel_column: Tensor, reduce: bool = True) -> Tensor:
        """Column ``index`` of the kernel Gram matrix up to the diagonal (float64), from its part above the diagonal
        (``reduce=False``: this rank's part of the diagonal, for a column of this rank's parts)."""
        diagonal = self.actions.rows[index] @ self.kernel_actions.rows[index]
        if reduce:
            diagonal = self.rows_block.summed(diagonal)
        return torch.cat([kernel_column, diagonal[None]]).double()

    def append(self, action: Tensor, kernel_action: Tensor, kernel_column: Tensor | None = None) -> None:
        """Append an action and its kernel product (shape ``(N C,)``, or this rank's rows of them where the buffer is held
        by rows, e.g. the covariance phase's new directions); the kernel Gram matrix, if kept, is bordered
        (:math:`O(N C B)`, or :math:`O(N C)` given ``kernel_column``, its :meth:`kernel_column` before appending)."""
        kept = self._kernel_gram is not None and self._kernel_gram.shape[-1] == self.size
        if kept and kernel_column is None:
            kernel_column = self.kernel_column(kernel_action)
        self.actions.append(self.rows_block.own_rows(action))
        self.kernel_actions.append(self.rows_block.own_rows(kernel_action))
        if kept and self._kernel_gram is not None and kernel_column is not None:
            self._kernel_gram = _bordered(self._kernel_gram, self._gram_column(self.size - 1, kernel_column))

    def extend(self, actions: Tensor, kernel_actions: Tensor) -> None:
        r"""Append the columns of ``actions`` and ``kernel_actions`` ``(N C, m)`` (or this rank's rows of them), as
        :meth:`append` does one at a time; the kernel Gram matrix, if kept, is bordered by :math:`\mathbf S^\top
        \mathbf T_{\text{new}}` and :math:`\mathbf S_{\text{new}}^\top \mathbf T_{\text{new}}` (upper triangle),
        two GEMMs that read :math:`\mathbf S` once instead of :math:`m` times (equal to the one-by-one bordering to
        rounding)."""
        actions, kernel_actions = self.rows_block.own_rows(actions), self.rows_block.own_rows(kernel_actions)
        size, count = self.size, actions.shape[-1]
        kept = self._kernel_gram is not None and self._kernel_gram.shape[-1] == size
        if kept and self._kernel_gram is not None and count > 0:
            cross, inner = (
                self.rows_block.summed(torch.cat([self.actions.rows @ kernel_actions, actions.mT @ kernel_actions]))
                .double()
                .split([size, count])
            )
            grown = self._kernel_gram.new_empty(size + count, size + count)
            grown[:size, :size] = self._kernel_gram
            grown[:size, size:] = cross
            grown[size:, :size] = cross.mT
            upper = torch.ones(count, count, dtype=torch.bool, device=grown.device).triu()
            grown[size:, size:] = torch.where(upper, inner, inner.mT)  # (i <= j: s_i^T t_j, as append borders)
            self._kernel_gram = grown
        self.actions.extend(count).copy_(actions.mT)
        self.kernel_actions.extend(count).copy_(kernel_actions.mT)


def combined_columns(store: ColumnStore, coefficients: Tensor) -> Tensor:
    r""":math:`\mathbf S \mathbf E` ``(n, r)`` for the first ``E.shape[0]`` columns :math:`\mathbf S` of ``store`` and
    coefficients :math:`\mathbf E` ``(B, r)``: one :math:`O(n B r)` product (over the non-zero rows only for sparse
    actions)."""
    return _combination(store.rows[: coefficients.shape[0]], None, coefficients, 0).value


@dataclass
class ImplicitRoot:
    r""":math:`\mathbf Q = \mathbf S \mathbf E` and :math:`\mathbf K \mathbf Q = \mathbf T \mathbf E`, kept as the buffer and
    the coefficients :math:`\mathbf E` ``(B, r)`` (working dtype): what a virtual solver run (and IterGP) return.

    The solver only ever needs :math:`\mathbf Q^\top \mathbf x = \mathbf E^\top (\mathbf S^\top \mathbf x)` and
    :math:`\mathbf Q \mathbf c = \mathbf S (\mathbf E \mathbf c)`, :math:`O(n B)` each; forming :math:`\mathbf Q` and
    :math:`\mathbf K \mathbf Q` costs :math:`O(n B r)` and is left to whoever reads :attr:`precision_root` and
    :attr:`kernel_precision_root`. The buffer's first ``B`` columns never change, so these stay valid while a later
    solve appends to the same buffer.

    A root from a Cholesky factor :math:`\mathbf L \mathbf L^\top = \mathbf S^\top \hat{\mathbf K} \mathbf S`
    (:attr:`cholesky`, float64 ``(B, B)``) has :math:`\mathbf E = \mathbf L^{-\top}` formed only when read
    (``root_coefficients`` a :class:`~gpytorch_iterncgp.core.deferred.DeferredTensor`): :meth:`coefficient_products`
    is two triangular solves, and in float64 :math:`\mathbf Q^\top = \mathbf L^{-1} \mathbf S^\top` and
    :math:`(\mathbf K \mathbf Q)^\top = \mathbf L^{-1} \mathbf T^\top` are one each where :math:`n \le`
    :data:`TRIANGULAR_COMBINATION_WIDTH` :math:`B`, where :math:`\mathbf E` costs :math:`B^3` multiply-adds more.
    """

    buffer: ActionBuffer
    root_coefficients: Tensor  # E, (B, r) (may be deferred where cholesky is given)
    cholesky: Tensor | None = field(default=None, kw_only=True)  # L, float64 (B, B), E = L^{-T}

    @property
    def rank(self) -> int:
        r"""The number of columns :math:`r` of :math:`\mathbf Q`."""
        return self.cholesky.shape[-1] if self.cholesky is not None else self.root_coefficients.shape[-1]

    def deferred_coefficients(self) -> Tensor:
        r""":math:`\mathbf E` as given, formed or not, for another root's ``root_coefficients`` (an
        :class:`~gpytorch_iterncgp.core.solver.IterGPResult` of these)."""
        return _ROOT_COEFFICIENTS.stored(self)

    def coefficient_products(self, vectors: Tensor) -> Tensor:
        r""":math:`\mathbf E \mathbf E^\top \mathbf x` for ``vectors`` :math:`\mathbf x` ``(B,)``: by the Cholesky
        factor where the root has one and :math:`\mathbf E` is not formed (in float64), else by :math:`\mathbf E`."""
        if self.cholesky is None or _ROOT_COEFFICIENTS.is_formed(self):
            return self.root_coefficients @ (self.root_coefficients.mT @ vectors)
        return torch.cholesky_solve(vectors.double()[:, None], self.cholesky)[:, 0].to(vectors.dtype)

    @property
    def precision_root(self) -> Tensor:
        r""":math:`\mathbf Q = \mathbf S \mathbf E`, ``(n, r)``: formed on each call (a buffer held by rows: its
        :attr:`local_precision_root` gathered)."""
        return self.buffer.rows_block.all_rows(self.local_precision_root)

    @property
    def kernel_precision_root(self) -> Tensor:
        r""":math:`\mathbf K \mathbf Q = \mathbf T \mathbf E`, ``(n, r)``: formed on each call."""
        return self.buffer.rows_block.all_rows(self.local_kernel_precision_root)

    @property
    def local_precision_root(self) -> Tensor:
        r"""This rank's rows :math:`\mathbf Q_{\mathcal I_p} = \mathbf S_{\mathcal I_p} \mathbf E`,
        ``(|I_p| C, r)``, of a buffer held by rows (:attr:`ActionBuffer.rows_block`), formed on each call with no
        collective; :attr:`precision_root` otherwise."""
        return self._combined(self.buffer.actions)

    @property
    def local_kernel_precision_root(self) -> Tensor:
        r"""This rank's rows :math:`(\mathbf K \mathbf Q)_{\mathcal I_p} = \mathbf T_{\mathcal I_p} \mathbf E`,
        ``(|I_p| C, r)`` (:attr:`local_precision_root`)."""
        return self._combined(self.buffer.kernel_actions)

    def _combined(self, store: ColumnStore) -> Tensor:
        r""":math:`\mathbf S \mathbf E` for ``store``'s columns :math:`\mathbf S` (this rank's rows): by one triangular
        solve with the Cholesky factor where :math:`\mathbf E` is not formed, the buffer is float64 and dense, and has
        at most :data:`TRIANGULAR_COMBINATION_WIDTH` rows per action; else by :math:`\mathbf E`."""
        factor = self.cholesky
        if factor is not None and not _ROOT_COEFFICIENTS.is_formed(self):
            rows = store.rows[: factor.shape[-1]]
            narrow = rows.shape[-1] <= TRIANGULAR_COMBINATION_WIDTH * len(rows)
            if rows.dtype == factor.dtype and narrow and row_support(rows) is None:
                return torch.linalg.solve_triangular(factor, rows, upper=False).mT  # (L^{-1} S^T)^T, row-major
        return combined_columns(store, self.root_coefficients)


_ROOT_COEFFICIENTS = DeferredTensor("root_coefficients")
ImplicitRoot.root_coefficients = _ROOT_COEFFICIENTS  # type: ignore[assignment]


def noise_gram(buffer: ActionBuffer, noise_inverse: LinearOperator) -> Tensor:
    r""":math:`\mathbf S^\top \mathbf W^{-1} \mathbf S`, float64 ``(B, B)``, symmetric: the part of the virtual run's
    Gram matrix that changes with :math:`\mathbf W`.

    The rows and columns of actions non-zero at one data point each (:meth:`ActionBuffer.at_points`: unit vectors, and
    those projected to zero class sums) are gathered from :math:`\mathbf W^{-1} \mathbf S` at their points,
    :math:`O(N C B)` (``W^{-1}`` is block diagonal by points); those among the other actions by :func:`_spread_gram`,
    :math:`O(N C B^2)`.

    A buffer held by rows (sharded :attr:`ActionBuffer.rows_block`) sums :math:`\sum_p \mathbf S_{\mathcal I_p}^\top
    (\mathbf W^{-1} \mathbf S)_{\mathcal I_p}` by one ``all_reduce`` of the ``(B, B)`` sum; ``noise_inverse`` then holds
    this rank's blocks of :math:`\mathbf W^{-1}` only, ``(|I_p| C, |I_p| C)`` (block diagonal by points).
    """
    rows = buffer.actions.rows
    size, num_rows = rows.shape
    if size == 0:
        return rows.new_zeros(0, 0, dtype=torch.float64)
    factored = noise_inverse.dim() == 2 and isinstance(noise_inverse, FactoredNoise)
    # (decided before the support, which may differ between ranks: the class sums are checked on every rank alike)
    centred = factored and noise_inverse.centring and buffer.zero_block_sums(noise_inverse.entries_per_point)
    block_size = noise_inverse.entries_per_point if isinstance(noise_inverse, NoiseOperator) else 1
    located = buffer.at_points(block_size) if noise_inverse.dim() == 2 and num_rows % block_size == 0 else None
    if located is None or not bool(located.mask.any()):
        return _symmetric(buffer.rows_block.summed(_spread_gram(rows, noise_inverse, centred)))
    at_points = located.mask.nonzero()[:, 0]
    spread = (~located.mask).nonzero()[:, 0]
    multiply = noise_inverse.apply if isinstance(noise_inverse, NoiseOperator) else noise_inverse.matmul
    points, entries = located.points[at_points], located.entries[at_points].double()
    # Known block diagonal: among point actions, s_a^T W^{-1} s_b = [p_a = p_b] e_a^T W_{p_a}^{-1} e_b, O(B^2 C).
    blocked = isinstance(noise_inverse, (NoiseOperator, DiagLinearOperator))
    among = None
    if blocked:
        blocks = _diagonal_blocks(multiply, num_rows, block_size, rows)[points].double()  # (A, C, C)
        among = entries @ (blocks @ entries[..., None])[..., 0].mT * (points[:, None] == points)
        if len(spread) == 0:
            return _symmetric(buffer.rows_block.summed(among))
    gram = rows.new_zeros(size, size, dtype=torch.float64)
    if among is not None:
        gram[at_points[:, None], at_points] = among
    if len(spread):
        gram[spread[:, None], spread] = _spread_gram(rows[spread], noise_inverse, centred)
    columns = spread if blocked else torch.arange(size, device=rows.device)
    width = max(1, NOISE_BLOCK_BYTES // max(1, num_rows * rows.element_size()))
    for start in range(0, len(columns), width):  # the point actions' rows: s_a^T (W^{-1} S) at their points
        chunk = columns[start : start + width]
        noisy = multiply(rows[chunk].mT).reshape(num_rows // block_size, block_size, -1)
        gram[at_points[:, None], chunk] = torch.einsum("bc,bck->bk", entries, noisy[points].double())
    gram[spread[:, None], at_points] = gram[at_points[:, None], spread].mT
    return _symmetric(buffer.rows_block.summed(gram))


def _diagonal_blocks(multiply: Callable[[Tensor], Tensor], num_rows: int, block_size: int, like: Tensor) -> Tensor:
    r"""The diagonal blocks :math:`\mathbf W^{-1}_p` ``(N, C, C)`` of a noise block diagonal by points, from one
    product ``multiply`` (:math:`\mathbf X \mapsto \mathbf W^{-1} \mathbf X`) with the :math:`C` columns
    :math:`\mathbf 1_N \otimes \mathbf I_C`, ``(N C, C)``: :math:`O(N C^2)`."""
    identity = torch.eye(block_size, dtype=like.dtype, device=like.device)
    return multiply(identity.repeat(num_rows // block_size, 1)).reshape(num_rows // block_size, block_size, block_size)


def _spread_gram(rows: Tensor, noise_inverse: LinearOperator, centred: bool) -> Tensor:
    r""":math:`\mathbf S^\top \mathbf W^{-1} \mathbf S` float64 ``(B, B)`` of this rank's rows of actions ``rows``
    (:math:`\mathbf S^\top`, ``(B, n)``), not symmetrised. For the package's block-diagonal noise
    (:class:`~gpytorch_iterncgp.core.noise.FactoredNoise`, :math:`\mathbf W^{-1} = \mathbf F \mathbf F^\top`) it is
    :math:`\sum_\text{chunks} \mathbf A \mathbf A^\top` with :math:`\mathbf A = \mathbf S_\text{chunk}^\top
    \mathbf F_\text{chunk}` over chunks of whole data points of about ``NOISE_CHUNK_BYTES`` (a chunk stays in cache
    and its memory is reused; positive semi-definite by construction; each chunk's product in the working dtype, their
    sum in float64); the softmax's centring is left out where the actions have zero class sums (``centred``:
    :meth:`ActionBuffer.zero_block_sums`, IterGP projects them). Any other noise, and sparse actions, form
    :math:`\mathbf W^{-1} \mathbf S` in blocks of columns of at most ``NOISE_BLOCK_BYTES``."""
    size, num_rows = rows.shape
    support = row_support(rows)
    if noise_inverse.dim() == 2 and isinstance(noise_inverse, FactoredNoise) and support is None:
        block = noise_inverse.entries_per_point
        chunk = block * max(1, NOISE_CHUNK_BYTES // (size * rows.element_size() * block))
        gram = rows.new_zeros(size, size, dtype=torch.float64)
        half = size // 2 if size >= 96 else 0  # above ~100 actions, the two lower blocks only: 3/4 of the flops
        for start in range(0, num_rows, chunk):
            whitened = noise_inverse.whiten_rows(rows[:, start : start + chunk], start, centred)
            gram[half:] += (whitened[half:] @ whitened.mT).double()
            if half:
                gram[:half, :half] += (whitened[:half] @ whitened[:half].mT).double()
        gram[:half, half:] = gram[half:, :half].mT
        return gram
    width = max(1, NOISE_BLOCK_BYTES // max(1, num_rows * rows.element_size()))
    blocks = []
    for start in range(0, size, width):
        noisy = noise_inverse.matmul(rows[start : start + width].mT)
        blocks.append(rows @ noisy if support is None else rows[:, support] @ noisy[support])
    return torch.cat(blocks, dim=-1).double()


class PointActions(NamedTuple):
    """Which actions are non-zero at one data point at most (:func:`point_actions`), and where."""

    mask: Tensor  # (B,) bool
    points: Tensor  # (B,) long: each action's point (0 where not at one point, or at none of this rank's)
    entries: Tensor  # (B, C): its entries there (zeros where not at one point)


def point_actions(rows: Tensor, block_size: int) -> PointActions:
    r"""Which actions of ``rows`` (:math:`\mathbf S^\top`, ``(B, n)``) are non-zero within one data point's block of
    ``block_size`` consecutive entries at most (unit vectors; vectors projected to zero sum over a point's classes):
    for those, :math:`\mathbf s^\top \mathbf X` is a gather of :math:`\mathbf X`'s block at the point,
    :math:`O(C k)`. :math:`O(n B)`. An action with no non-zero entry (a buffer held by rows: another rank's point) is at
    point 0 with zero entries."""
    size, num_rows = rows.shape
    blocks = rows.reshape(size, num_rows // block_size, block_size)
    touched = blocks.ne(0).any(-1)  # (B, N)
    mask = touched.sum(-1) <= 1
    points = torch.where(mask, touched.to(torch.uint8).argmax(-1), 0)
    entries = blocks[torch.arange(size, device=rows.device), points] * mask[:, None]
    return PointActions(mask, points, entries)


def row_support(rows: Tensor) -> Tensor | None:
    r"""The indices of the entries where some action of ``rows`` (:math:`\mathbf S^\top`, ``(B, n)``) is not zero, if
    they are at most a quarter of ``n`` (e.g. unit-vector actions not yet re-weighted); else ``None``.

    Products :math:`\mathbf S^\top \mathbf X` and :math:`\mathbf S \mathbf E` then run over these entries only.
    """
    if len(rows) and 4 * int(torch.count_nonzero(rows[-1])) > rows.shape[-1]:
        return None  # one dense action decides it (O(n), not O(n B)): CG's actions, re-weighted buffers
    support = rows.ne(0).any(0).nonzero()[:, 0]
    return support if 4 * len(support) <= rows.shape[-1] else None


def _top_eigenpairs(gram: Tensor, tolerance: float, limit: int | None) -> tuple[Tensor, Tensor]:
    """The eigenpairs of ``gram`` above ``tolerance`` times the largest, at most ``limit``, largest first."""
    if gram.shape[-1] == 0:
        return gram.new_zeros(0, 0), gram.new_zeros(0)
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    eigenvalues, eigenvectors = eigenvalues.flip(-1), eigenvectors.flip(-1)
    rank = int((eigenvalues > tolerance * eigenvalues[0].clamp_min(0)).sum())
    if eigenvalues[0] <= 0:
        rank = 0
    if limit is not None:
        rank = min(rank, limit)
    return eigenvectors[:, :rank], eigenvalues[:rank]


def _cholesky_factor(gram: Tensor, tolerance: float) -> Tensor | None:
    r"""The Cholesky factor :math:`\mathbf L` of ``gram`` ``(B, B)`` (:math:`B^3/3` multiply-adds, where an
    eigendecomposition takes several times that), giving the root :math:`\mathbf E = \mathbf L^{-\top}` with
    :math:`\mathbf E^\top \mathbf M \mathbf E = \mathbf I`; ``None`` where a pivot falls below ``1000 * tolerance``
    times the largest diagonal entry (nearly dependent actions, which only the eigendecomposition drops)."""
    factor, info = torch.linalg.cholesky_ex(gram)
    if int(info) != 0:
        return None
    if bool((factor.diagonal().square() <= 1000 * tolerance * gram.diagonal().max()).any()):
        return None
    return factor


def _inverse_transpose(factor: Tensor) -> Tensor:
    r""":math:`\mathbf L^{-\top}` of a lower triangular ``factor`` ``(B, B)``: one triangular solve,
    :math:`B^3` multiply-adds."""
    identity = torch.eye(factor.shape[-1], dtype=factor.dtype, device=factor.device)
    return torch.linalg.solve_triangular(factor.mT, identity, upper=True)


def _combination(rows: Tensor, extra: Tensor | None, coefficients: Tensor, capacity: int) -> ColumnStore:
    r"""A new store with the columns :math:`[\mathbf S, \mathbf x] \mathbf E` (``rows`` is :math:`\mathbf S^\top`,
    ``extra`` the optional :math:`\mathbf x`, ``coefficients`` :math:`\mathbf E` ``(B (+1), r)``)."""
    count = coefficients.shape[-1]
    store = ColumnStore.with_capacity(rows.shape[-1], count + capacity, rows.dtype, rows.device)
    target = store.extend(count)
    weights = coefficients.to(rows.dtype)
    support = row_support(rows) if extra is None else None
    if support is None and extra is None and _is_upper_triangular(weights):  # E = L^-T of a Cholesky root (bordered)
        lower_triangular_matmul(weights.mT, rows, out=target)
    elif support is None:
        torch.matmul(weights[: rows.shape[0]].mT, rows, out=target)
    else:  # sparse actions (unit vectors): the other rows of the combination are zero
        target.zero_()
        target[:, support] = weights.mT @ rows[:, support]
    if extra is not None:
        target.addr_(weights[-1], extra)
    return store


def _is_upper_triangular(matrix: Tensor) -> bool:
    """Whether ``matrix`` is square, large enough for :func:`lower_triangular_matmul` to split, and zero below its
    diagonal."""
    rows = matrix.shape[0]
    return rows == matrix.shape[-1] and rows >= 2 * TRIANGULAR_BLOCK_ROWS and not bool(matrix.tril(-1).any())


def lower_triangular_matmul(lower: Tensor, matrix: Tensor, out: Tensor) -> Tensor:
    r""":math:`\mathbf L \mathbf M` into ``out`` ``(B, n)`` for a lower triangular :math:`\mathbf L` ``(B, B)`` and
    :math:`\mathbf M` ``(B, n)``, without the multiply-adds of :math:`\mathbf L`'s zero upper half: with
    :math:`\mathbf L = \begin{pmatrix} \mathbf A & \mathbf 0 \\ \mathbf C & \mathbf D \end{pmatrix}` split in
    halves, the top rows are :math:`\mathbf A \mathbf M_1` and the bottom ones :math:`\mathbf C \mathbf M_1 + \mathbf D
    \mathbf M_2`, :math:`\mathbf A` and :math:`\mathbf D` again by halves down to :data:`TRIANGULAR_BLOCK_ROWS` rows: all
    GEMMs, :math:`\tfrac12 + 2^{-k-1}` of one GEMM's multiply-adds at :math:`k` levels (five eighths at
    :math:`B \ge 512`; ``docs/design_notes.md``). Equal to ``lower @ matrix`` to rounding."""
    size = lower.shape[0]
    if size < 2 * TRIANGULAR_BLOCK_ROWS:
        return torch.matmul(lower, matrix, out=out)
    half = size // 2
    lower_triangular_matmul(lower[half:, half:], matrix[half:], out[half:])
    out[half:].addmm_(lower[half:, :half], matrix[:half])
    lower_triangular_matmul(lower[:half, :half], matrix[:half], out[:half])
    return out


def _compressed_keeping(
    buffer: ActionBuffer,
    noise_inverse: LinearOperator,
    gram: Tensor,
    extra: tuple[Tensor, Tensor],
    compression_rank: int,
    relative_eigenvalue_tolerance: float,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Compression that keeps a direction :math:`\mathbf x` (``extra``: it and its kernel product, unit-norm): the top
    :math:`R - 1` eigen-directions of :math:`\mathbf M` (``gram``, ``(B, B)``), normalised, :math:`\mathbf x` beside
    them, and the eigenpairs of :math:`\hat{\mathbf K}` over these :math:`R`. Returns the coefficients ``(B + 1, R')``
    over :math:`[\mathbf S, \mathbf x]`, their eigenvalues, and :math:`[\mathbf S, \mathbf x]^\top [\mathbf S,
    \mathbf x]` (float64)."""
    block = buffer.rows_block
    first, _ = _top_eigenpairs(gram, relative_eigenvalue_tolerance, max(compression_rank - 1, 0))
    action_gram = buffer.action_gram()
    first = first / (first * (action_gram @ first)).sum(0).sqrt().clamp_min(torch.finfo(torch.float64).tiny)
    direction, kernel_direction = extra
    noisy_direction = kernel_direction + noise_inverse.matmul(direction[:, None])[:, 0]
    noisy_column = torch.cat(
        [buffer.transpose_matmul(noisy_direction), block.summed(direction @ noisy_direction)[None]]
    ).double()
    action_column = torch.cat([buffer.transpose_matmul(direction), block.summed(direction @ direction)[None]]).double()
    extended_gram = _bordered(gram, noisy_column)
    basis = torch.block_diag(first, torch.ones(1, 1, dtype=torch.float64, device=first.device))
    second, eigenvalues = _top_eigenpairs(
        _symmetric(basis.mT @ extended_gram @ basis), relative_eigenvalue_tolerance, None
    )
    return basis @ second, eigenvalues, _bordered(action_gram, action_column)


def virtual_solver_run(
    buffer: ActionBuffer,
    noise_inverse: LinearOperator,
    compression_rank: int | None = None,
    relative_eigenvalue_tolerance: float | None = None,
    keep: tuple[Tensor, Tensor] | None = None,
    spare: int = 0,
) -> ImplicitRoot:
    r"""Algorithm 3: the initial precision for a new noise :math:`\mathbf W^{-1}`, with no product with :math:`\mathbf K`.

    :param buffer: actions and kernel products ``(N C, B)`` from earlier solves with the *same* kernel. Where nothing
        is compressed, the result's buffer *is* ``buffer`` (not re-weighted, not copied), so a solver appending to it
        extends ``buffer`` in place.
    :param noise_inverse: the new :math:`\mathbf W^{-1}`, ``(N C, N C)`` (a buffer held by rows: this rank's blocks,
        ``(|I_p| C, |I_p| C)``).
    :param compression_rank: :math:`R`, the number of eigenpairs kept (``None``: all).
    :param relative_eigenvalue_tolerance: eigenvalues :math:`\lambda \le \epsilon \lambda_1` are dropped
        (numerically dependent actions); default ``1000 * finfo(dtype).eps``. Without compression the dependent
        actions stay in the buffer (each run drops them again from :math:`\mathbf Q`).
    :param keep: a direction and its kernel product, ``((N C,), (N C,))`` (or this rank's rows of them), that
        compression must not drop: the top :math:`R - 1` eigen-directions are kept, plus this one. The Newton loop
        passes the current representer weights :math:`\mathbf a`, so that the initial solution
        :math:`\mathbf C_0 \mathbf b` is never worse than (a multiple of) :math:`\mathbf a`.
    :param spare: room for this many more columns in a re-weighted buffer before its storage grows.
    :return: the buffer (at most :math:`R` columns, unit-norm actions, if compressed) and the coefficients of
        :math:`\mathbf Q` in it (:class:`ImplicitRoot`; without compression :math:`\mathbf U \boldsymbol\Lambda^{-1/2}`,
        with compression the diagonal :math:`\nu \boldsymbol\Lambda^{-1/2}` of the re-weighted actions).
    """
    rows = buffer.actions.rows
    dtype = rows.dtype
    if relative_eigenvalue_tolerance is None:
        relative_eigenvalue_tolerance = 1000 * torch.finfo(dtype).eps
    block = buffer.rows_block  # the rows of the vectors this rank holds
    extra: tuple[Tensor, Tensor] | None = None
    if keep is not None and compression_rank is not None:
        kept = (buffer.rows_block.own_rows(keep[0]), buffer.rows_block.own_rows(keep[1]))
        kept_norm = block.norm(kept[0])
        if float(kept_norm) > 0:
            extra = (kept[0] / kept_norm, kept[1] / kept_norm)
    if buffer.size == 0 and extra is None:
        return ImplicitRoot(buffer, rows.new_zeros(0, 0))
    # M = S^T K S (kept by the buffer) + S^T W^{-1} S (this W), decomposed in float64 (float32 eigh fails on it).
    gram = buffer.kernel_gram() + noise_gram(buffer, noise_inverse)
    if extra is None and compression_rank is None:  # nothing to compress: any root of M^{-1} will do, Cholesky's first
        factor = _cholesky_factor(gram, relative_eigenvalue_tolerance)
        if factor is not None:
            return ImplicitRoot(buffer, deferred(lambda: _inverse_transpose(factor).to(dtype)), cholesky=factor)
    if extra is None:
        coefficients, eigenvalues = _top_eigenpairs(gram, relative_eigenvalue_tolerance, compression_rank)
        if compression_rank is None or coefficients.shape[-1] == buffer.size:
            # Nothing compressed: the buffer stays as it is, Q = S U Λ^{-1/2} and K Q = T U Λ^{-1/2} (left implicit).
            return ImplicitRoot(buffer, (coefficients * eigenvalues.rsqrt()).to(dtype))
        extended_action_gram = buffer.action_gram()
    else:
        assert compression_rank is not None  # (extra is only set for a compression)
        coefficients, eigenvalues, extended_action_gram = _compressed_keeping(
            buffer, noise_inverse, gram, extra, compression_rank, relative_eigenvalue_tolerance
        )
    # Re-weight: the new buffer [S, x] E / ν with unit-norm columns (ν from S^T S), and
    # Q = [S, x] E Λ^{-1/2} = (new S) ν Λ^{-1/2}. The new buffer's kernel Gram matrix is computed when next needed.
    norms = (coefficients * (extended_action_gram @ coefficients)).sum(0).sqrt()
    norms = norms.clamp_min(torch.finfo(dtype).tiny)
    coefficients = coefficients / norms
    actions = _combination(rows, None if extra is None else extra[0], coefficients, spare)
    kernel_actions = _combination(buffer.kernel_actions.rows, None if extra is None else extra[1], coefficients, spare)
    return ImplicitRoot(
        ActionBuffer(actions, kernel_actions, buffer.rows_block), torch.diag(norms * eigenvalues.rsqrt()).to(dtype)
    )
