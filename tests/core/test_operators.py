"""Every LinearOperator of the package against its dense matrix.

The bulk of the checks comes from linear_operator's own mixins (``LinearOperatorTestCase`` for the
positive definite noise operators, ``RectangularLinearOperatorTestCase`` for the singular ones), each
test class supplying ``create_linear_op`` and an ``evaluate_linear_op`` that builds the dense matrix
independently of the operator's ``_matmul``. Mixin tests whose assumptions do not hold for an operator
are overridden with a comment saying why. Constructors (``from_curvature``, ``from_probabilities``),
Lemma A.7, ``project_to_zero_sum``, ``ColumnStore`` and ``LowRankPrecision.append`` are tested
separately against dense references.
"""

from __future__ import annotations

import pickle
import unittest

import pytest
import torch
from linear_operator.test.linear_operator_test_case import (
    LinearOperatorTestCase,
    RectangularLinearOperatorTestCase,
)

from gpytorch_iterncgp.core.noise import (
    BlockNoiseInverse,
    DiagonalNoiseInverse,
    SiteBlockNoiseInverse,
    SoftmaxPseudoInverse,
    project_to_zero_sum,
)
from gpytorch_iterncgp.core.precision import ColumnStore, LowRankPrecision
from gpytorch_iterncgp.ep.sites import site_block_spectrum, zero_sum_basis


def _block_diag(blocks: torch.Tensor) -> torch.Tensor:
    """Dense block-diagonal matrix ``(..., N C, N C)`` from blocks ``(..., N, C, C)`` (data-major)."""
    *batch, num, size, _ = blocks.shape
    flat = blocks.reshape(-1, num, size, size)
    dense = torch.stack([torch.block_diag(*list(b)) for b in flat])
    return dense.reshape(*batch, num * size, num * size)


def _centring(num_classes: int, dtype=torch.float64) -> torch.Tensor:
    """The projection P = I - 1 1^T / C."""
    return torch.eye(num_classes, dtype=dtype) - torch.full((num_classes, num_classes), 1 / num_classes, dtype=dtype)


def _softmax_blocks(probabilities: torch.Tensor) -> torch.Tensor:
    """Dense P diag(pi)^-1 P blocks ``(..., N, C, C)``."""
    centring = _centring(probabilities.shape[-1], probabilities.dtype)
    return centring @ torch.diag_embed(probabilities.reciprocal()) @ centring


def _random_probabilities(*shape, dtype=torch.float64, generator=None) -> torch.Tensor:
    logits = torch.randn(*shape, dtype=dtype, generator=generator)
    return torch.softmax(logits, dim=-1)


def _random_pd_blocks(*batch, num_data=4, size=3, dtype=torch.float32) -> torch.Tensor:
    """Well-conditioned positive definite blocks ``(*batch, N, C, C)``."""
    factor = torch.randn(*batch, num_data, size, size, dtype=dtype)
    return factor @ factor.mT / size + torch.eye(size, dtype=dtype)


# ---------------------------------------------------------------------------------------------------
# DiagonalNoiseInverse
# ---------------------------------------------------------------------------------------------------
class TestDiagonalNoiseInverse(LinearOperatorTestCase, unittest.TestCase):
    seed = 0
    should_test_sample = True
    should_call_cg = False  # closed-form solve (a DiagLinearOperator)
    should_call_lanczos = False

    def create_linear_op(self):
        curvature = torch.tensor([0.02, 0.5, 1.0, 0.25, 0.8])  # the first is clamped to min_curvature
        return DiagonalNoiseInverse.from_curvature(curvature, min_curvature=0.1)

    def evaluate_linear_op(self, linear_op):
        return torch.diag_embed(linear_op._diag)

    def test_solve_triangular(self):
        # The mixin expects NotImplementedError (generic operators are not triangular); a diagonal operator
        # is triangular and solves in closed form, as upstream's test_diag_linear_operator.py overrides it.
        linear_op = self.create_linear_op()
        rhs = torch.randn(linear_op.size(-1), 2)
        dense = self.evaluate_linear_op(linear_op)
        for upper in (True, False):
            res = torch.linalg.solve_triangular(linear_op, rhs, upper=upper)
            self.assertAllClose(res, torch.linalg.solve_triangular(dense, rhs, upper=upper))

    def test_from_curvature_dense(self):
        curvature = torch.tensor([0.02, 0.5, 1.0, 0.25, 0.8, 0.0], dtype=torch.float64)
        op = DiagonalNoiseInverse.from_curvature(curvature, min_curvature=0.1)
        expected = torch.diag(1 / torch.maximum(curvature, torch.tensor(0.1, dtype=torch.float64)))
        self.assertIsInstance(op, DiagonalNoiseInverse)
        self.assertAllClose(op.to_dense(), expected, rtol=1e-14, atol=0)


class TestDiagonalNoiseInverseBatch(TestDiagonalNoiseInverse):
    seed = 0

    def create_linear_op(self):
        curvature = torch.rand(3, 5) + 0.05
        return DiagonalNoiseInverse.from_curvature(curvature, min_curvature=0.1)


# ---------------------------------------------------------------------------------------------------
# BlockNoiseInverse
# ---------------------------------------------------------------------------------------------------
class TestBlockNoiseInverse(LinearOperatorTestCase, unittest.TestCase):
    """Positive definite: the full mixin applies (solve and logdet through CG / Lanczos of the generic base)."""

    seed = 0
    should_test_sample = True

    def create_linear_op(self):
        return BlockNoiseInverse.from_curvature(_random_pd_blocks(num_data=4, size=3), min_curvature=1e-3)

    def evaluate_linear_op(self, linear_op):
        # Dense reference independent of the operator's _matmul: W_n^{-1} = cholesky_inverse(L_n) per block.
        return _block_diag(torch.cholesky_inverse(linear_op.curvature_cholesky))

    def test_from_curvature_dense(self):
        blocks = _random_pd_blocks(num_data=5, size=3, dtype=torch.float64)
        op = BlockNoiseInverse.from_curvature(blocks, min_curvature=0.01)
        shifted = blocks + 0.01 * torch.eye(3, dtype=torch.float64)
        expected = torch.block_diag(*[torch.linalg.inv(b) for b in shifted])
        self.assertEqual(op.shape, torch.Size((15, 15)))
        self.assertAllClose(op.to_dense(), expected, rtol=1e-10, atol=1e-12)
        self.assertAllClose(op.diagonal(), expected.diagonal(), rtol=1e-10, atol=1e-12)

    def test_from_curvature_not_positive_definite(self):
        blocks = _random_pd_blocks(num_data=4, size=2, dtype=torch.float64)
        blocks[2] = torch.tensor([[1.0, 0.0], [0.0, -1.0]], dtype=torch.float64)
        with self.assertRaisesRegex(ValueError, "log-concave"):
            BlockNoiseInverse.from_curvature(blocks, min_curvature=1e-6)


class TestBlockNoiseInverseBatch(TestBlockNoiseInverse):
    seed = 0

    def create_linear_op(self):
        return BlockNoiseInverse.from_curvature(_random_pd_blocks(2, num_data=3, size=2), min_curvature=1e-3)


# ---------------------------------------------------------------------------------------------------
# SoftmaxPseudoInverse
# ---------------------------------------------------------------------------------------------------
class TestSoftmaxPseudoInverse(RectangularLinearOperatorTestCase, unittest.TestCase):
    """Singular (each block has the null space 1), so solve / logdet / Cholesky tests of
    ``LinearOperatorTestCase`` do not apply; the symmetric-operator checks that do apply (diagonal,
    eigvalsh) are added by hand."""

    seed = 0

    def create_linear_op(self):
        probabilities = torch.softmax(torch.randn(4, 3), dim=-1)
        return SoftmaxPseudoInverse(probabilities)

    def evaluate_linear_op(self, linear_op):
        return _block_diag(_softmax_blocks(linear_op.probabilities))

    def test_diagonal(self):
        linear_op = self.create_linear_op()
        self.assertAllClose(linear_op.diagonal(), self.evaluate_linear_op(linear_op).diagonal(dim1=-2, dim2=-1))

    def test_eigvalsh(self):
        # In float64 throughout: the null-space eigenvalues are exactly 0 only up to rounding.
        linear_op = self.create_linear_op().double()
        evals = torch.linalg.eigvalsh(linear_op)
        self.assertAllClose(evals, torch.linalg.eigvalsh(self.evaluate_linear_op(linear_op)), rtol=1e-8, atol=1e-10)
        # One zero eigenvalue per data point (null space 1), the others positive.
        num_data = linear_op.probabilities.shape[-2]
        self.assertEqual(int((evals.abs() < 1e-10).sum()), num_data * linear_op.probabilities[..., 0, 0].numel())

    def test_from_probabilities_clamps(self):
        probabilities = torch.tensor([[0.5, 0.5 - 1e-12, 1e-12]], dtype=torch.float64)
        op = SoftmaxPseudoInverse.from_probabilities(probabilities, min_probability=1e-4)
        expected = _softmax_blocks(probabilities.clamp_min(1e-4))[0]
        self.assertAllClose(op.to_dense(), expected, rtol=1e-12, atol=1e-12)
        self.assertTrue(bool(torch.isfinite(op.to_dense()).all()))


class TestSoftmaxPseudoInverseBatch(TestSoftmaxPseudoInverse):
    seed = 0

    def create_linear_op(self):
        return SoftmaxPseudoInverse(torch.softmax(torch.randn(2, 3, 4), dim=-1))


# ---------------------------------------------------------------------------------------------------
# SiteBlockNoiseInverse
# ---------------------------------------------------------------------------------------------------
def _site_precisions(*batch, num_data=4, num_classes=3, dtype=torch.float32, generator=None) -> torch.Tensor:
    """EP-like site blocks ``(*batch, N, C, C)``: positive semi-definite, null space 1, eigenvalues >= 0.5 on 1^perp."""
    basis = zero_sum_basis(num_classes, dtype, torch.device("cpu"))
    factor = torch.randn(*batch, num_data, num_classes - 1, num_classes - 1, dtype=dtype, generator=generator)
    inner = factor @ factor.mT / num_classes + 0.5 * torch.eye(num_classes - 1, dtype=dtype)
    return basis @ inner @ basis.mT


def _site_noise(site_precision: torch.Tensor, min_precision: float) -> SiteBlockNoiseInverse:
    basis = zero_sum_basis(site_precision.shape[-1], site_precision.dtype, site_precision.device)
    return SiteBlockNoiseInverse.from_site_spectrum(*site_block_spectrum(site_precision, basis), min_precision)


class TestSiteBlockNoiseInverse(RectangularLinearOperatorTestCase, unittest.TestCase):
    """Singular (each block has the null space 1), so solve / logdet / Cholesky tests of
    ``LinearOperatorTestCase`` do not apply; diagonal and eigvalsh are added by hand."""

    seed = 0

    def create_linear_op(self):
        return _site_noise(_site_precisions(num_data=4, num_classes=3), min_precision=1e-3)

    def evaluate_linear_op(self, linear_op):
        return _block_diag(linear_op.blocks)

    def test_diagonal(self):
        linear_op = self.create_linear_op()
        self.assertAllClose(linear_op.diagonal(), self.evaluate_linear_op(linear_op).diagonal(dim1=-2, dim2=-1))

    def test_eigvalsh(self):
        linear_op = self.create_linear_op().double()
        evals = torch.linalg.eigvalsh(linear_op)
        self.assertAllClose(evals, torch.linalg.eigvalsh(self.evaluate_linear_op(linear_op)), rtol=1e-6, atol=1e-7)
        # One zero eigenvalue per data point (null space 1), the others positive.
        num_points = linear_op.blocks[..., 0, 0].numel()
        self.assertEqual(int((evals.abs() < 1e-6).sum()), num_points)
        self.assertTrue(bool((evals > -1e-6).all()))


class TestSiteBlockNoiseInverseBatch(TestSiteBlockNoiseInverse):
    seed = 0

    def create_linear_op(self):
        return _site_noise(_site_precisions(2, num_data=3, num_classes=4), min_precision=1e-3)


def test_site_block_noise_is_the_bounded_pseudo_inverse_of_the_sites():
    """Blocks V max(Λ, λ_min)^{-1} V^T: the Moore–Penrose pseudo-inverse of sites whose eigenvalues on 1^perp exceed
    λ_min, the bound where one is below it (a flat site direction: noise 1 / λ_min), zero along 1."""
    generator = torch.Generator().manual_seed(5)
    sites = _site_precisions(num_data=5, num_classes=4, dtype=torch.float64, generator=generator)
    noise = _site_noise(sites, min_precision=1e-3)
    torch.testing.assert_close(noise.blocks, torch.linalg.pinv(sites, hermitian=True), rtol=0, atol=1e-12)
    basis = zero_sum_basis(4, torch.float64, torch.device("cpu"))
    rotation, _ = torch.linalg.qr(torch.randn(5, 3, 3, dtype=torch.float64, generator=generator))
    directions = basis @ rotation  # (N, C, C - 1): orthonormal, orthogonal to 1
    eigenvalues = torch.tensor([1e-6, 2.0, 5.0], dtype=torch.float64)  # the first below the bound 0.25
    flat_sites = (directions * eigenvalues) @ directions.mT
    bounded = _site_noise(flat_sites, min_precision=0.25).blocks
    expected = (directions / torch.tensor([0.25, 2.0, 5.0], dtype=torch.float64)) @ directions.mT
    torch.testing.assert_close(bounded, expected, rtol=0, atol=1e-12)
    ones = torch.ones(4, dtype=torch.float64)
    torch.testing.assert_close(bounded @ ones, torch.zeros(5, 4, dtype=torch.float64), rtol=0, atol=1e-12)


def test_lemma_a7_pseudo_inverse():
    """Lemma A.7: P diag(pi)^-1 P is the Moore–Penrose pseudo-inverse of W = diag(pi) - pi pi^T."""
    generator = torch.Generator().manual_seed(7)
    probabilities = _random_probabilities(5, 4, generator=generator)
    op = SoftmaxPseudoInverse(probabilities)
    dense = op.to_dense()
    assert dense.shape == (20, 20)
    for n in range(5):
        pi = probabilities[n]
        curvature = torch.diag(pi) - torch.outer(pi, pi)
        block = dense[4 * n : 4 * n + 4, 4 * n : 4 * n + 4]
        torch.testing.assert_close(block, torch.linalg.pinv(curvature), rtol=0, atol=1e-10)
        # The four Penrose conditions with A = W, X = W^+.
        a, x = curvature, block
        torch.testing.assert_close(a @ x @ a, a, rtol=0, atol=1e-10)
        torch.testing.assert_close(x @ a @ x, x, rtol=0, atol=1e-10)
        torch.testing.assert_close((a @ x).mT, a @ x, rtol=0, atol=1e-10)
        torch.testing.assert_close((x @ a).mT, x @ a, rtol=0, atol=1e-10)
    # Off-diagonal blocks are zero: one block per data point.
    mask = torch.block_diag(*[torch.ones(4, 4, dtype=torch.bool)] * 5)
    assert bool((dense[~mask] == 0).all())


def test_softmax_pseudo_inverse_null_space():
    """W^+ maps every point's constant direction 1 to zero and its range to itself."""
    generator = torch.Generator().manual_seed(3)
    op = SoftmaxPseudoInverse(_random_probabilities(6, 3, generator=generator))
    constant = torch.kron(torch.randn(6, 1, dtype=torch.float64, generator=generator), torch.ones(3, 1))
    torch.testing.assert_close(op.matmul(constant), torch.zeros_like(constant), rtol=0, atol=1e-12)


@pytest.mark.parametrize("num_classes", [2, 3, 5])
def test_project_to_zero_sum(num_classes):
    """project_to_zero_sum == blockdiag(I - 1 1^T / C) for data-major vectors, several columns."""
    generator = torch.Generator().manual_seed(num_classes)
    num_data, width = 4, 3
    vectors = torch.randn(num_data * num_classes, width, dtype=torch.float64, generator=generator)
    projection = torch.block_diag(*[_centring(num_classes)] * num_data)
    result = project_to_zero_sum(vectors, num_classes)
    torch.testing.assert_close(result, projection @ vectors, rtol=0, atol=1e-14)
    # A projection: idempotent, and every point's classes sum to zero.
    torch.testing.assert_close(project_to_zero_sum(result, num_classes), result, rtol=0, atol=1e-14)
    sums = result.reshape(num_data, num_classes, width).sum(1)
    torch.testing.assert_close(sums, torch.zeros_like(sums), rtol=0, atol=1e-14)


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
