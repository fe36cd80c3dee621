"""The data-major prior: products with K in every layout, and the chunked path for large kernels."""

import gpytorch
import pytest
import torch

from gpytorch_iterncgp.core.prior import LatentPrior, _chunk_rows
from gpytorch_iterncgp.settings import dense_kernel_limit, fused_kernel_products, kernel_chunk_bytes
from tests.common import IterNCGPModel, binary_data

DTYPE = torch.float64


def _dense_data_major(kernel_matrix: torch.Tensor, num_latents: int) -> torch.Tensor:
    """(N, M) shared or (C, N, M) independent kernel -> dense data-major (N C, M C)."""
    if kernel_matrix.dim() == 2:
        return torch.kron(kernel_matrix, torch.eye(num_latents, dtype=kernel_matrix.dtype))
    rows, cols = kernel_matrix.shape[-2:]
    dense = torch.zeros(rows * num_latents, cols * num_latents, dtype=kernel_matrix.dtype)
    for c in range(num_latents):
        dense[c::num_latents, c::num_latents] = kernel_matrix[c]
    return dense


@pytest.fixture
def small_chunks():
    """Chunks of 37 rows for a 120-point kernel (GPyTorch's chunked product, not the fused one)."""
    with dense_kernel_limit(1000), kernel_chunk_bytes(37 * 120 * 3 * 8), fused_kernel_products(False):
        yield


@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_matmul_equals_dense_data_major_matrix(batch, chunked, request):
    if chunked:
        request.getfixturevalue("small_chunks")
    num_latents = 3
    batch_shape = torch.Size([num_latents]) if batch else torch.Size([])
    x = torch.rand(120, 2, dtype=DTYPE, generator=torch.Generator().manual_seed(0))
    kernel = gpytorch.kernels.ScaleKernel(
        gpytorch.kernels.MaternKernel(nu=1.5, batch_shape=batch_shape), batch_shape=batch_shape
    ).to(DTYPE)
    if batch:
        kernel.base_kernel.lengthscale = torch.tensor([0.2, 0.5, 1.0], dtype=DTYPE).view(3, 1, 1)
    mean = torch.zeros(*batch_shape, 120, dtype=DTYPE)
    rhs = torch.randn(120 * num_latents, 5, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        prior = LatentPrior.from_distribution(gpytorch.distributions.MultivariateNormal(mean, kernel(x)), num_latents)
        assert (_chunk_rows(prior.covariance) > 0) == chunked
        product = prior.matmul(rhs)
        reference = _dense_data_major(kernel(x).to_dense(), num_latents) @ rhs
    torch.testing.assert_close(product, reference, rtol=1e-12, atol=1e-12)
    assert prior.products == 1 and prior.columns == 5


def test_fit_with_chunked_kernel_products_reaches_the_same_mode(small_chunks):
    train_x, train_y = binary_data(num_data=120)
    options = dict(max_solver_iterations=None, outer_tol=1e-10, abs_tol=1e-10, rel_tol=1e-12, max_newton_steps=50)
    chunked = IterNCGPModel(train_x, train_y, gpytorch.likelihoods.BernoulliLikelihood(), **options)
    chunked.variational_strategy.fit()
    with dense_kernel_limit(2**40):
        dense = IterNCGPModel(train_x, train_y, gpytorch.likelihoods.BernoulliLikelihood(), **options)
        dense.variational_strategy.fit()
    torch.testing.assert_close(
        chunked.variational_strategy.mode, dense.variational_strategy.mode, rtol=1e-8, atol=1e-10
    )


def test_dense_kernel_limit_restores_previous_value():
    before = dense_kernel_limit.value()
    with dense_kernel_limit(123):
        assert dense_kernel_limit.value() == 123
        with dense_kernel_limit(7):
            assert dense_kernel_limit.value() == 7
        assert dense_kernel_limit.value() == 123
    assert dense_kernel_limit.value() == before


def test_keops_kernels_are_never_chunked(small_chunks):
    """A KeOps kernel never forms the matrix; chunking would hand GPyTorch blocks of fewer rows than
    max_cholesky_size, which it evaluates densely (at N = 10^5: 3x slower products and 1.5 GB more)."""
    pytest.importorskip("pykeops")
    x = torch.rand(120, 2, dtype=DTYPE, generator=torch.Generator().manual_seed(0))
    keops = gpytorch.kernels.ScaleKernel(gpytorch.kernels.keops.MaternKernel(nu=1.5)).to(DTYPE)
    plain = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5)).to(DTYPE)
    assert _chunk_rows(keops(x)) == 0
    assert _chunk_rows(plain(x)) > 0  # the same size with a plain kernel is chunked
