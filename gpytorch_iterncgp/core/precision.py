r"""The low-rank approximate precision :math:`\mathbf C_j = \mathbf Q \mathbf Q^\top \approx \hat{\mathbf K}^{-1}`.

IterGP's belief about :math:`\hat{\mathbf K}^{-1} = (\mathbf K + \mathbf W^{-1})^{-1}` after :math:`j`
actions is the rank-:math:`j` matrix :math:`\mathbf C_j = \mathbf S (\mathbf S^\top \hat{\mathbf K}
\mathbf S)^{-1} \mathbf S^\top = \mathbf Q \mathbf Q^\top`, with :math:`\hat{\mathbf K}`-conjugate
columns :math:`\mathbf q_i`; IterGP keeps them as :math:`\mathbf Q = \mathbf S \mathbf E` (``recycling.ImplicitRoot``).
:class:`ColumnStore` holds matrices that grow by columns (the recycled actions).
"""

from __future__ import annotations

import torch
from linear_operator.operators import LowRankRootLinearOperator
from torch import Tensor


class ColumnStore:
    r"""A matrix ``(n, k)`` that grows by one column at a time without copying its old columns.

    Storage is allocated with spare capacity and doubled when full, so appending a column costs
    :math:`O(n)` amortised. :attr:`value` is a view of the filled part; views handed out earlier stay
    valid, because appending only writes beyond them.

    :param columns: the initial columns, shape ``(n, k)``.
    """

    def __init__(self, columns: Tensor):
        # Stored as rows of a (capacity, n) tensor, so appending writes one contiguous row; the initial
        # copy leaves room for as many columns again (at least 8), so the first appends copy nothing.
        self.size = columns.shape[-1]
        self._storage = columns.new_empty(max(8, 2 * self.size), columns.shape[0])
        self._storage[: self.size] = columns.mT

    @classmethod
    def with_capacity(cls, num_rows: int, capacity: int, dtype: torch.dtype, device: torch.device) -> ColumnStore:
        """An empty store of ``num_rows`` rows with room for ``capacity`` columns (at least 8) before it grows."""
        store = cls.__new__(cls)
        store.size = 0
        store._storage = torch.empty(max(8, capacity), num_rows, dtype=dtype, device=device)
        return store

    def frozen(self) -> ColumnStore:
        """A store of the filled columns that appends to this one leave as they are, without a copy: it views exactly
        the filled rows, so that its own appends reallocate (its storage has no room) instead of writing into ours."""
        store = type(self).__new__(type(self))
        store.size, store._storage = self.size, self._storage[: self.size]
        return store

    @property
    def value(self) -> Tensor:
        """The filled columns, shape ``(n, size)`` (a transposed view of the row storage)."""
        return self._storage[: self.size].mT

    @property
    def rows(self) -> Tensor:
        """The filled columns as rows, shape ``(size, n)``: :attr:`value` transposed, contiguous."""
        return self._storage[: self.size]

    def extend(self, count: int) -> Tensor:
        """Append ``count`` columns for the caller to fill: returns them as rows ``(count, n)`` (a view to write into,
        e.g. with ``torch.matmul(..., out=...)``)."""
        if self.size + count > self._storage.shape[0]:
            storage = self._storage.new_empty(max(8, 2 * (self.size + count)), self._storage.shape[-1])
            storage[: self.size] = self._storage[: self.size]
            self._storage = storage
        self.size += count
        return self._storage[self.size - count : self.size]

    def append(self, column: Tensor) -> None:
        """Append ``column`` (shape ``(n,)``) as the last column."""
        if self.size == self._storage.shape[0]:
            capacity = max(8, 2 * self.size)
            storage = self._storage.new_empty(capacity, self._storage.shape[-1])
            storage[: self.size] = self._storage[: self.size]
            self._storage = storage
        self._storage[self.size] = column
        self.size += 1


class LowRankPrecision(LowRankRootLinearOperator):
    r"""Approximate precision :math:`\mathbf C = \mathbf Q \mathbf Q^\top` of size ``(N C, N C)``.

    Positive semi-definite with rank :math:`j` (the number of columns of :math:`\mathbf Q`).
    :math:`\mathbf C \mathbf b` is IterGP's estimate of :math:`\hat{\mathbf K}^{-1} \mathbf b`, and the
    posterior covariance :math:`\mathbf K - \mathbf K \mathbf C \mathbf K` includes the computational
    uncertainty of having stopped after :math:`j` iterations.

    :param root: :math:`\mathbf Q`, shape ``(N C, j)``.
    """

    @property
    def root_tensor(self) -> Tensor:
        r""":math:`\mathbf Q` as a dense tensor ``(N C, j)``."""
        return self.root.to_dense()

    @property
    def rank(self) -> int:
        return self.root.shape[-1]
