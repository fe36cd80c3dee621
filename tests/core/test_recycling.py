r"""Recycling and compression (paper, Algorithm 3; ``gpytorch_iterncgp.core.recycling``) against dense linear algebra.

A virtual solver run turns actions :math:`\mathbf S` and their kernel products :math:`\mathbf T = \mathbf K \mathbf S`
into the precision :math:`\mathbf C_0 = \mathbf Q \mathbf Q^\top` for a new noise, with no product with
:math:`\mathbf K`. Here: compression that keeps a given direction (the Newton loop's representer weights), actions that
are numerically dependent, and sparse (unit-vector) actions, each against :math:`\mathbf S' (\mathbf S'^\top
\hat{\mathbf K} \mathbf S')^{-1} \mathbf S'^\top` formed densely (:math:`\hat{\mathbf K} = \mathbf K + \mathbf W^{-1}`),
and the buffer's products against dense ones. Elsewhere: the residual's orthogonality to the actions
(Proposition A.4) and compression to the top eigenpairs in ``tests/test_paper_statements.py``; the Gram matrices kept
across steps, :math:`\mathbf S^\top \mathbf W^{-1} \mathbf S` and the buffer left in place without compression in
``tests/core/test_outside_products.py``.
"""

from __future__ import annotations

import pytest
import torch

from gpytorch_iterncgp.core.noise import DiagonalNoiseInverse
from gpytorch_iterncgp.core.precision import ColumnStore
from gpytorch_iterncgp.core.recycling import ActionBuffer, combined_columns, lower_triangular_matmul, virtual_solver_run
from gpytorch_iterncgp.core.sharding import RowBlock

DTYPE = torch.float64


def _problem(size: int = 30, num_actions: int = 8, seed: int = 0):
    """A positive definite kernel matrix, a diagonal noise, unit-norm actions and a buffer holding them."""
    generator = torch.Generator().manual_seed(seed)
    factor = torch.randn(size, size, dtype=DTYPE, generator=generator)
    kernel = factor @ factor.mT / size + 0.05 * torch.eye(size, dtype=DTYPE)
    noise = DiagonalNoiseInverse(0.1 + torch.rand(size, dtype=DTYPE, generator=generator))
    actions = torch.randn(size, num_actions, dtype=DTYPE, generator=generator)
    actions = actions / actions.norm(dim=0)
    return kernel, noise, actions, generator


def _projection_precision(actions: torch.Tensor, system: torch.Tensor) -> torch.Tensor:
    r""":math:`\mathbf S (\mathbf S^\top \hat{\mathbf K} \mathbf S)^{-1} \mathbf S^\top` for independent columns."""
    return actions @ torch.linalg.solve(actions.mT @ system @ actions, actions.mT)


def _residual_of_projection(vector: torch.Tensor, basis: torch.Tensor) -> float:
    """The relative part of ``vector`` outside the span of ``basis``'s columns (least squares)."""
    coefficients = torch.linalg.lstsq(basis, vector[:, None]).solution
    return float((vector - (basis @ coefficients)[:, 0]).norm() / vector.norm())


@pytest.mark.parametrize("rank", [1, 3, 6])
def test_compression_keeps_the_given_direction(rank):
    """``keep=(a, K a)``: the compressed buffer holds ``rank`` unit-norm actions spanning the top ``rank - 1``
    eigen-directions :math:`\\mathbf S \\mathbf u_i` of :math:`\\mathbf S^\\top \\hat{\\mathbf K} \\mathbf S` and
    :math:`\\mathbf a`; :math:`\\mathbf C_0` is the projection onto their span, and so :math:`\\mathbf C_0 \\mathbf b`
    is at least as close to :math:`\\hat{\\mathbf K}^{-1} \\mathbf b` (in the :math:`\\hat{\\mathbf K}` norm) as the best
    multiple of :math:`\\mathbf a`."""
    kernel, noise, actions, generator = _problem(seed=rank)
    direction = torch.randn(len(kernel), dtype=DTYPE, generator=generator)
    buffer = ActionBuffer.from_tensors(actions, kernel @ actions, RowBlock.single(len(kernel)))
    virtual = virtual_solver_run(buffer, noise, compression_rank=rank, keep=(direction, kernel @ direction))
    kept = virtual.buffer.actions.value
    assert kept.shape == (len(kernel), rank) and virtual.rank == rank
    torch.testing.assert_close(kept.norm(dim=0), torch.ones(rank, dtype=DTYPE), rtol=1e-12, atol=0)
    torch.testing.assert_close(virtual.buffer.kernel_actions.value, kernel @ kept, rtol=1e-10, atol=1e-12)
    system = kernel + noise.to_dense()
    assert _residual_of_projection(direction, kept) < 1e-10
    _, eigenvectors = torch.linalg.eigh(actions.mT @ system @ actions)
    for index in range(1, rank):
        assert _residual_of_projection(actions @ eigenvectors[:, -index], kept) < 1e-8
    root = virtual.precision_root
    torch.testing.assert_close(root @ root.mT, _projection_precision(kept, system), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(virtual.kernel_precision_root, kernel @ root, rtol=1e-10, atol=1e-12)
    rhs = torch.randn(len(kernel), dtype=DTYPE, generator=generator)
    solution = torch.linalg.solve(system, rhs)

    def error(vector):
        return float((vector - solution) @ system @ (vector - solution))

    best_multiple = direction * (direction @ rhs) / (direction @ system @ direction)
    assert error(root @ (root.mT @ rhs)) <= error(best_multiple) * (1 + 1e-10)
    if rank > 1:  # and not vacuous: the top eigen-directions make it strictly better
        assert error(root @ (root.mT @ rhs)) < 0.999 * error(best_multiple)


def test_numerically_dependent_actions_are_left_out_of_the_root():
    """An action repeated (to rounding): :math:`\\mathbf S^\\top \\hat{\\mathbf K} \\mathbf S` is singular and its null
    direction is dropped, so :math:`\\mathbf Q` has one column fewer and :math:`\\mathbf C_0` is the projection onto
    the span of the independent actions; without compression the buffer keeps them all."""
    kernel, noise, actions, _ = _problem(num_actions=6, seed=5)
    dependent = torch.cat([actions, actions[:, 2:3] * (1 + 1e-15)], dim=-1)
    buffer = ActionBuffer.from_tensors(dependent, kernel @ dependent, RowBlock.single(len(kernel)))
    virtual = virtual_solver_run(buffer, noise)
    assert virtual.rank == 6 and virtual.buffer is buffer and buffer.size == 7
    root = virtual.precision_root
    expected = _projection_precision(actions, kernel + noise.to_dense())
    torch.testing.assert_close(root @ root.mT, expected, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("rank", [None, 3])
def test_unit_vector_actions_are_compressed_as_dense_ones(rank):
    """Unit vectors at a few points (the buffer multiplies over their rows only): the same precision as the dense
    reference, the top ``rank`` eigenpairs of :math:`\\mathbf S^\\top \\hat{\\mathbf K} \\mathbf S` when compressed."""
    kernel, noise, _, generator = _problem(size=40, seed=6)
    indices = torch.randperm(40, generator=generator)[:6]
    actions = torch.eye(40, dtype=DTYPE)[:, indices]
    virtual = virtual_solver_run(
        ActionBuffer.from_tensors(actions, kernel @ actions, RowBlock.single(len(kernel))), noise, compression_rank=rank
    )
    system = kernel + noise.to_dense()
    eigenvalues, eigenvectors = torch.linalg.eigh(actions.mT @ system @ actions)
    keep = slice(None) if rank is None else slice(-rank, None)
    top = actions @ eigenvectors[:, keep]
    root = virtual.precision_root
    torch.testing.assert_close(root @ root.mT, top @ torch.diag(1 / eigenvalues[keep]) @ top.mT, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(virtual.kernel_precision_root, kernel @ root, rtol=1e-10, atol=1e-12)
    assert virtual.buffer.size == (6 if rank is None else rank)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kernel_gram_of_unit_vectors_is_a_gather_equal_to_the_bordered_one_bit_for_bit(dtype):
    """Unit vectors (one entry +-1 each), as the exact regime's solves append them: the kernel Gram matrix of a buffer
    built from tensors (a gather of T's rows) equals, bit for bit, the one bordered by each appended action (dot
    products), and the dense S^T K S; one action with a second non-zero entry takes the column-by-column path."""
    kernel, _, _, _ = _problem(size=30, seed=3)
    kernel = kernel.to(dtype)
    points = torch.tensor([4, 17, 0, 29, 8, 11])
    actions = torch.zeros(30, len(points), dtype=dtype)
    actions[points, torch.arange(len(points))] = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 1.0], dtype=dtype)
    restored = ActionBuffer.from_tensors(actions, kernel @ actions, RowBlock.single(30))
    grown = ActionBuffer.from_tensors(actions[:, :1], kernel @ actions[:, :1], RowBlock.single(30))
    grown.kernel_gram()
    for index in range(1, len(points)):
        grown.append(actions[:, index], kernel @ actions[:, index])
    assert torch.equal(restored.kernel_gram(), grown.kernel_gram())
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5  # (K is symmetric to rounding: either triangle's entries)
    dense = (actions.mT @ kernel @ actions).double()
    torch.testing.assert_close(restored.kernel_gram(), dense, rtol=tolerance, atol=tolerance)
    mixed = actions.clone()
    mixed[5, 2] = 0.5  # (not a unit vector: the general path)
    buffer = ActionBuffer.from_tensors(mixed, kernel @ mixed, RowBlock.single(30))
    torch.testing.assert_close(
        buffer.kernel_gram(), (mixed.mT @ kernel @ mixed).double(), rtol=tolerance, atol=tolerance
    )


def test_action_buffer_products_equal_dense_ones():
    """:math:`\\mathbf S^\\top \\mathbf x`, :math:`(\\mathbf S \\mathbf c, \\mathbf T \\mathbf c)`, the kernel Gram
    matrix bordered by each appended action, and whether given tensors are the buffer's own columns."""
    kernel, _, actions, generator = _problem(num_actions=5, seed=7)
    buffer = ActionBuffer.from_tensors(actions[:, :3], kernel @ actions[:, :3], RowBlock.single(len(kernel)))
    torch.testing.assert_close(buffer.kernel_gram(), actions[:, :3].mT @ kernel @ actions[:, :3], rtol=1e-12, atol=0)
    for index in (3, 4):
        buffer.append(actions[:, index], kernel @ actions[:, index])
    assert buffer.size == 5 and buffer.num_rows == len(kernel)
    vectors = torch.randn(len(kernel), 2, dtype=DTYPE, generator=generator)
    torch.testing.assert_close(buffer.transpose_matmul(vectors), actions.mT @ vectors, rtol=1e-12, atol=1e-14)
    coefficients = torch.randn(5, dtype=DTYPE, generator=generator)
    combined, kernel_combined = buffer.combine(coefficients)
    torch.testing.assert_close(combined, actions @ coefficients, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(kernel_combined, kernel @ actions @ coefficients, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(buffer.kernel_gram(), actions.mT @ kernel @ actions, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(buffer.action_gram(), actions.mT @ actions, rtol=1e-12, atol=1e-14)
    assert buffer.holds(buffer.actions.value, buffer.kernel_actions.value)
    assert not buffer.holds(actions.clone(), kernel @ actions)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_extended_buffer_equals_the_one_appended_column_by_column(dtype):
    """Appending a block of actions at once (EP's point actions, the covariance phase's directions) leaves the same
    actions, kernel products and kernel Gram matrix S^T K S as appending them one by one, to rounding: both equal the
    dense S^T K S."""
    kernel, _, actions, _ = _problem(size=40, num_actions=9, seed=11)
    kernel, actions = kernel.to(dtype), actions.to(dtype)
    products = kernel @ actions
    one_by_one = ActionBuffer.from_tensors(actions[:, :3], products[:, :3], RowBlock.single(40))
    block = ActionBuffer.from_tensors(actions[:, :3], products[:, :3], RowBlock.single(40))
    one_by_one.kernel_gram(), block.kernel_gram()
    for index in range(3, 9):
        one_by_one.append(actions[:, index], products[:, index])
    block.extend(actions[:, 3:5], products[:, 3:5])
    block.extend(actions[:, 5:9], products[:, 5:9])
    assert block.size == one_by_one.size == 9
    assert torch.equal(block.actions.value, one_by_one.actions.value)
    assert torch.equal(block.kernel_actions.value, one_by_one.kernel_actions.value)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    dense = (actions.mT @ kernel @ actions).double()
    torch.testing.assert_close(block.kernel_gram(), one_by_one.kernel_gram(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(block.kernel_gram(), dense, rtol=tolerance, atol=tolerance)
    assert torch.equal(block.kernel_gram(), block.kernel_gram().mT)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kernel_gram_of_renewed_products_is_one_gemm_that_a_restored_buffer_repeats_bit_for_bit(dtype):
    """Kernel products renewed for a new K (``gemm_columns=None``): S^T K S by one GEMM, symmetric, equal to the dense
    matrix and to the column-by-column one to rounding; grown by appends (bordered column by column), the buffer
    rebuilt from its tensors with its ``gemm_columns`` (as a state records it) gives the same matrix bit for bit."""
    kernel, _, _, generator = _problem(size=30, seed=5)
    kernel = kernel.to(dtype)
    actions = torch.randn(30, 6, generator=generator, dtype=torch.float64).to(dtype)
    products = kernel @ actions
    block = RowBlock.single(30)
    renewed = ActionBuffer.from_tensors(actions[:, :4], products[:, :4], block, gemm_columns=None)
    gram = renewed.kernel_gram()
    assert renewed.gemm_columns == 4 and torch.equal(gram, gram.mT)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    column_by_column = ActionBuffer.from_tensors(actions[:, :4], products[:, :4], block).kernel_gram()
    torch.testing.assert_close(gram, column_by_column, rtol=tolerance, atol=tolerance)
    dense = (actions[:, :4].mT @ kernel @ actions[:, :4]).double()
    torch.testing.assert_close(gram, dense, rtol=tolerance, atol=tolerance)
    for index in (4, 5):
        renewed.append(actions[:, index].contiguous(), products[:, index].contiguous())
    restored = ActionBuffer.from_tensors(actions, products, block, gemm_columns=renewed.gemm_columns)
    assert torch.equal(restored.kernel_gram(), renewed.kernel_gram())
    torch.testing.assert_close(
        restored.kernel_gram(), (actions.mT @ kernel @ actions).double(), rtol=tolerance, atol=tolerance
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size", [255, 256, 700])  # no split, one level, two levels (TRIANGULAR_BLOCK_ROWS = 128)
def test_lower_triangular_product_by_halves_equals_the_product(dtype, size):
    generator = torch.Generator().manual_seed(size)
    lower = torch.randn(size, size, dtype=torch.float64, generator=generator).tril()
    matrix = torch.randn(size, 90, dtype=torch.float64, generator=generator)
    out = torch.full((size, 90), torch.nan, dtype=dtype)
    lower_triangular_matmul(lower.to(dtype), matrix.to(dtype), out)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out.double(), lower @ matrix, rtol=tolerance, atol=tolerance * size**0.5)


def test_combined_columns_of_a_triangular_root_equal_the_dense_product():
    """:math:`\\mathbf S \\mathbf E` for an upper triangular :math:`\\mathbf E` (a Cholesky root's :math:`\\mathbf L^{-\\top}`)
    by halves, and for a dense one, against the dense product."""
    generator = torch.Generator().manual_seed(3)
    store = ColumnStore.with_capacity(120, 300, DTYPE, torch.device("cpu"))
    store.extend(300).copy_(torch.randn(300, 120, dtype=DTYPE, generator=generator))
    for coefficients in (
        torch.randn(300, 300, dtype=DTYPE, generator=generator).triu(),
        torch.randn(300, 300, dtype=DTYPE, generator=generator),
    ):
        torch.testing.assert_close(
            combined_columns(store, coefficients), store.value @ coefficients, rtol=1e-12, atol=1e-11
        )
