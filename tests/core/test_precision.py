r"""``gpytorch_iterncgp.core.precision``: the low-rank precision :math:`\mathbf C = \mathbf Q \mathbf Q^\top` against its
dense matrix (linear_operator's ``RectangularLinearOperatorTestCase``), and ``ColumnStore`` against ``torch.cat``."""

from __future__ import annotations

import pickle
import unittest

import pytest
import torch
from linear_operator.test.linear_operator_test_case import RectangularLinearOperatorTestCase

from gpytorch_iterncgp.core.precision import ColumnStore, LowRankPrecision


# ---------------------------------------------------------------------------------------------------
# LowRankPrecision
# ---------------------------------------------------------------------------------------------------
# The mixin's test_add adds a matrix to Q Q^T, which is singular (rank j < n): linear_operator's Cholesky then adds
# jitter and says so.
@pytest.mark.filterwarnings("ignore:A not p.d., added jitter:linear_operator.utils.warnings.NumericalWarning")
class TestLowRankPrecision(RectangularLinearOperatorTestCase, unittest.TestCase):
    """Q Q^T with Q (n, j), j < n: singular, hence the rectangular mixin (as upstream tests
    LowRankRootLinearOperator)."""

    seed = 0

    def create_linear_op(self):
        return LowRankPrecision(torch.randn(6, 2))

    def evaluate_linear_op(self, linear_op):
        root = linear_op.root.tensor
        return root @ root.mT

    def test_rank_and_root(self):
        root = torch.randn(6, 2)
        op = LowRankPrecision(root)
        self.assertEqual(op.rank, 2)
        self.assertEqual(op.root_tensor, root)


class TestLowRankPrecisionBatch(TestLowRankPrecision):
    seed = 1

    def create_linear_op(self):
        return LowRankPrecision(torch.randn(3, 5, 2))

    def test_rank_and_root(self):
        root = torch.randn(3, 5, 2)
        op = LowRankPrecision(root)
        self.assertEqual(op.rank, 2)
        self.assertEqual(op.root_tensor, root)


def test_low_rank_precision_pickles():
    root = torch.randn(4, 2, dtype=torch.float64)
    op = LowRankPrecision(root)
    restored = pickle.loads(pickle.dumps(op))
    torch.testing.assert_close(restored.to_dense(), op.to_dense(), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------
# ColumnStore
# ---------------------------------------------------------------------------------------------------
def test_column_store_matches_cat():
    generator = torch.Generator().manual_seed(2)
    initial = torch.randn(5, 3, dtype=torch.float64, generator=generator)
    initial_copy = initial.clone()
    store = ColumnStore(initial)
    columns = torch.randn(5, 30, dtype=torch.float64, generator=generator)
    views = []
    for k in range(30):
        store.append(columns[:, k])
        views.append(store.value)
        assert store.size == 4 + k
    torch.testing.assert_close(store.value, torch.cat([initial_copy, columns], -1), rtol=0, atol=0)
    # Views handed out earlier keep their values; the caller's initial tensor is not written to.
    for k, view in enumerate(views):
        torch.testing.assert_close(view, torch.cat([initial_copy, columns[:, : k + 1]], -1), rtol=0, atol=0)
    torch.testing.assert_close(initial, initial_copy, rtol=0, atol=0)


def test_column_store_from_empty():
    store = ColumnStore(torch.zeros(3, 0))
    assert store.size == 0 and store.value.shape == (3, 0)
    store.append(torch.tensor([1.0, 2.0, 3.0]))
    torch.testing.assert_close(store.value, torch.tensor([[1.0], [2.0], [3.0]]), rtol=0, atol=0)
