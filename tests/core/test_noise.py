r"""The noise operators of ``gpytorch_iterncgp.core.noise`` against their dense matrices.

The bulk of the checks comes from linear_operator's own mixins (``LinearOperatorTestCase`` for the
positive definite noise operators, ``RectangularLinearOperatorTestCase`` for the singular ones), each
test class supplying ``create_linear_op`` and an ``evaluate_linear_op`` that builds the dense matrix
independently of the operator's ``_matmul``. Mixin tests whose assumptions do not hold for an operator
are overridden with a comment saying why. Constructors (``from_curvature``, ``from_probabilities``),
Lemma A.7 and ``project_to_zero_sum`` are tested separately against dense references, and so are the products
the solver and the covariance phase take outside linear_operator: ``apply`` (:math:`\mathbf W^{-1} \mathbf X`),
``whiten_rows`` (:math:`\mathbf X \mathbf F` with :math:`\mathbf W^{-1} = \mathbf F \mathbf F^\top`) and
``curvature_matmul`` (:math:`\mathbf W \mathbf V`, the pseudo-inverse of the noise).
"""

from __future__ import annotations

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
    block_pseudo_inverse_matmul,
    project_to_zero_sum,
)
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
class _SingularBlockChecks:
    """The symmetric-operator checks that apply to operators whose blocks are singular (null space 1), which the
    rectangular mixin leaves out: the diagonal, and eigvalsh in float64 (the null-space eigenvalues are 0 only to
    rounding: ``zero``), one zero eigenvalue per data point and the others positive."""

    eigvalsh_tolerances = (1e-8, 1e-10)  # rtol, atol
    zero = 1e-10

    def test_diagonal(self):
        linear_op = self.create_linear_op()
        self.assertAllClose(linear_op.diagonal(), self.evaluate_linear_op(linear_op).diagonal(dim1=-2, dim2=-1))

    def test_eigvalsh(self):
        linear_op = self.create_linear_op().double()
        evals = torch.linalg.eigvalsh(linear_op)
        rtol, atol = self.eigvalsh_tolerances
        self.assertAllClose(evals, torch.linalg.eigvalsh(self.evaluate_linear_op(linear_op)), rtol=rtol, atol=atol)
        num_points = linear_op.shape[-1] // self.block_size(linear_op) * linear_op.shape[:-2].numel()
        self.assertEqual(int((evals.abs() < self.zero).sum()), num_points)
        self.assertTrue(bool((evals > -self.zero).all()))


class TestSoftmaxPseudoInverse(_SingularBlockChecks, RectangularLinearOperatorTestCase, unittest.TestCase):
    """Singular (each block has the null space 1), so solve / logdet / Cholesky tests of
    ``LinearOperatorTestCase`` do not apply; the symmetric-operator checks that do apply (diagonal,
    eigvalsh) are added by hand."""

    seed = 0

    def create_linear_op(self):
        probabilities = torch.softmax(torch.randn(4, 3), dim=-1)
        return SoftmaxPseudoInverse(probabilities)

    def evaluate_linear_op(self, linear_op):
        return _block_diag(_softmax_blocks(linear_op.probabilities))

    def block_size(self, linear_op) -> int:
        return linear_op.probabilities.shape[-1]

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


class TestSiteBlockNoiseInverse(_SingularBlockChecks, RectangularLinearOperatorTestCase, unittest.TestCase):
    """Singular (each block has the null space 1), so solve / logdet / Cholesky tests of
    ``LinearOperatorTestCase`` do not apply; diagonal and eigvalsh are added by hand (blocks formed in float32:
    looser tolerances)."""

    seed = 0
    eigvalsh_tolerances = (1e-6, 1e-7)
    zero = 1e-6

    def create_linear_op(self):
        return _site_noise(_site_precisions(num_data=4, num_classes=3), min_precision=1e-3)

    def evaluate_linear_op(self, linear_op):
        return _block_diag(linear_op.blocks)

    def block_size(self, linear_op) -> int:
        return linear_op.blocks.shape[-1]


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
# The products outside linear_operator: apply, whiten_rows, curvature_matmul
# ---------------------------------------------------------------------------------------------------
def _operator_and_curvature(kind: str, num_data: int = 6, generator=None):
    """A noise operator ``(N C, N C)`` in float64 and its dense curvature :math:`\\mathbf W` (whose (pseudo-)inverse
    the operator is), built without the operator's code: the reference of the products below."""
    if kind == "diagonal":
        curvature = torch.rand(num_data, dtype=torch.float64, generator=generator) + 0.05
        curvature[1] = 0.01  # below the bound: W^{-1} = 1 / 0.1 there
        operator = DiagonalNoiseInverse.from_curvature(curvature, min_curvature=0.1)
        return operator, torch.diag(curvature.clamp_min(0.1))
    if kind == "block":
        factor = torch.randn(num_data, 3, 3, dtype=torch.float64, generator=generator)
        blocks = factor @ factor.mT / 3 + 0.2 * torch.eye(3, dtype=torch.float64)
        operator = BlockNoiseInverse.from_curvature(blocks, min_curvature=0.05)
        return operator, _block_diag(blocks + 0.05 * torch.eye(3, dtype=torch.float64))
    if kind == "softmax":
        probabilities = _random_probabilities(num_data, 4, generator=generator)
        curvature = torch.diag_embed(probabilities) - probabilities[..., :, None] * probabilities[..., None, :]
        return SoftmaxPseudoInverse(probabilities), _block_diag(curvature)
    sites = _site_precisions(num_data=num_data, num_classes=4, dtype=torch.float64, generator=generator)
    return _site_noise(sites, min_precision=1e-3), _block_diag(sites)  # eigenvalues >= 0.5 > the bound


NOISE_KINDS = ["diagonal", "block", "softmax", "site-block"]


@pytest.mark.parametrize("kind", NOISE_KINDS)
def test_apply_is_the_dense_pseudo_inverse_of_the_curvature(kind):
    """``apply(X)`` (and linear_operator's ``matmul``) equal :math:`\\mathbf W^+ \\mathbf X` with the dense
    pseudo-inverse (the inverse for the positive definite noises), for columns stored either way."""
    generator = torch.Generator().manual_seed(11)
    operator, curvature = _operator_and_curvature(kind, generator=generator)
    dense = torch.linalg.pinv(curvature, hermitian=True)
    vectors = torch.randn(operator.shape[-1], 3, dtype=torch.float64, generator=generator)
    for layout in (vectors, vectors.mT.contiguous().mT):  # columns contiguous, or stored as rows
        torch.testing.assert_close(operator.apply(layout), dense @ vectors, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(operator.matmul(layout), dense @ vectors, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", NOISE_KINDS)
def test_curvature_matmul_is_the_curvature(kind):
    """``curvature_matmul()`` multiplies by :math:`\\mathbf W` (the site blocks, for EP's noise): the pseudo-inverse
    of the noise, which the covariance phase preconditions with."""
    generator = torch.Generator().manual_seed(12)
    operator, curvature = _operator_and_curvature(kind, generator=generator)
    vectors = torch.randn(operator.shape[-1], 2, dtype=torch.float64, generator=generator)
    torch.testing.assert_close(operator.curvature_matmul()(vectors), curvature @ vectors, rtol=1e-9, atol=1e-10)


def test_diagonal_curvature_matmul_is_zero_where_the_noise_is():
    operator = DiagonalNoiseInverse(torch.tensor([2.0, 0.0, 0.5], dtype=torch.float64))
    vectors = torch.ones(3, 1, dtype=torch.float64)
    torch.testing.assert_close(operator.curvature_matmul()(vectors), torch.tensor([[0.5], [0.0], [2.0]]).double())


@pytest.mark.parametrize("kind", ["diagonal", "block", "softmax"])
@pytest.mark.parametrize("points_per_chunk", [1, 4, 6])
def test_whitened_rows_give_the_dense_quadratic_form(kind, points_per_chunk):
    """:math:`\\sum_\\text{chunks} (\\mathbf X \\mathbf F)(\\mathbf X \\mathbf F)^\\top = \\mathbf X \\mathbf W^+
    \\mathbf X^\\top` over chunks of whole points (the last one shorter); with ``centred`` for rows whose blocks sum
    to zero, the same without the softmax's centring."""
    generator = torch.Generator().manual_seed(13)
    operator, curvature = _operator_and_curvature(kind, generator=generator)
    dense = torch.linalg.pinv(curvature, hermitian=True)
    size = operator.entries_per_point
    rows = torch.randn(5, operator.shape[-1], dtype=torch.float64, generator=generator)
    centred_rows = project_to_zero_sum(rows.mT, size).mT.contiguous() if size > 1 else rows

    def quadratic_form(vectors, centred):
        chunk, total = size * points_per_chunk, torch.zeros(5, 5, dtype=torch.float64)
        for start in range(0, vectors.shape[-1], chunk):
            whitened = operator.whiten_rows(vectors[:, start : start + chunk], start, centred)
            assert whitened.shape == vectors[:, start : start + chunk].shape
            total += whitened @ whitened.mT
        return total

    torch.testing.assert_close(quadratic_form(rows, False), rows @ dense @ rows.mT, rtol=1e-10, atol=1e-10)
    expected = centred_rows @ dense @ centred_rows.mT
    torch.testing.assert_close(quadratic_form(centred_rows, True), expected, rtol=1e-10, atol=1e-10)
    if operator.centring:  # the factor P diag(π)^{-1/2} centres: the flag may leave P out only for centred rows
        assert not torch.allclose(quadratic_form(rows, True), rows @ dense @ rows.mT, rtol=1e-6)


def test_block_pseudo_inverse_matmul_of_singular_blocks():
    """Blocks of rank 1 and 2 (and a zero block): products with their Moore–Penrose pseudo-inverses."""
    generator = torch.Generator().manual_seed(14)
    factors = torch.randn(3, 3, 2, dtype=torch.float64, generator=generator)
    factors[0, :, 1] = 0  # rank 1
    factors[2] = 0  # zero
    blocks = factors @ factors.mT
    vectors = torch.randn(9, 2, dtype=torch.float64, generator=generator)
    expected = torch.block_diag(*[torch.linalg.pinv(block, hermitian=True) for block in blocks]) @ vectors
    torch.testing.assert_close(block_pseudo_inverse_matmul(blocks)(vectors), expected, rtol=1e-9, atol=1e-10)
