"""The work outside the products with K: kernel columns for sparse actions, the buffer's incremental Gram matrices,
S^T W^{-1} S over chunks of whitened actions, virtual solver runs that do not re-weight (or copy) an uncompressed buffer, Q kept implicit (S E) by the solver and
left unformed in the Newton loop's states, and narrow products with a cached kernel as (X^T K)^T."""

import gpytorch
import pytest
import torch
from linear_operator.operators import BlockDiagLinearOperator, DenseLinearOperator

from gpytorch_iterncgp import ConjugateGradientPolicy, UnitVectorPolicy
from gpytorch_iterncgp.core import prior as prior_module
from gpytorch_iterncgp.core import recycling
from gpytorch_iterncgp.core.noise import (
    BlockNoiseInverse,
    DiagonalNoiseInverse,
    SiteBlockNoiseInverse,
    SoftmaxPseudoInverse,
    project_to_zero_sum,
)
from gpytorch_iterncgp.core.prior import NARROW_PRODUCT_COLUMNS, LatentPrior
from gpytorch_iterncgp.core.recycling import ActionBuffer, noise_gram, virtual_solver_run
from gpytorch_iterncgp.core.sharding import RowBlock
from gpytorch_iterncgp.core.solver import itergp_solve
from gpytorch_iterncgp.settings import dense_kernel_limit
from tests.common import IterNCGPModel

DTYPE = torch.float64
CPU = torch.device("cpu")


def _prior(
    layout: str, num_data: int = 40, num_latents: int = 3, dtype: torch.dtype = DTYPE, plus_linear: bool = False
) -> LatentPrior:
    x = torch.rand(num_data, 2, dtype=dtype, generator=torch.Generator().manual_seed(0))
    if layout == "multitask":
        kernel = gpytorch.kernels.MultitaskKernel(gpytorch.kernels.RBFKernel(), num_tasks=num_latents, rank=1).to(DTYPE)
        mean = torch.zeros(num_data, num_latents, dtype=DTYPE)
        distribution = gpytorch.distributions.MultitaskMultivariateNormal(mean, kernel(x), interleaved=True)
        return LatentPrior.from_distribution(distribution, num_latents)
    batch_shape = torch.Size([num_latents]) if layout == "independent" else torch.Size([])
    num_latents = 1 if layout == "single" else num_latents
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5, batch_shape=batch_shape)).to(dtype)
    if layout == "independent":
        kernel.base_kernel.lengthscale = torch.tensor([0.2, 0.5, 1.0], dtype=dtype).view(3, 1, 1)
    if plus_linear:  # a sum of kernels, evaluated as a sum of operators
        kernel = gpytorch.kernels.LinearKernel(batch_shape=batch_shape).to(dtype) + kernel
    mean = torch.zeros(*batch_shape, num_data, dtype=dtype)
    return LatentPrior.from_distribution(gpytorch.distributions.MultivariateNormal(mean, kernel(x)), num_latents)


@pytest.mark.parametrize("cached", [False, True], ids=["kernel-evaluated", "cached-matrix"])
@pytest.mark.parametrize("layout", ["single", "shared", "independent", "multitask"])
def test_kernel_columns_equal_products_with_one_hot_vectors(layout, cached):
    prior = _prior(layout)
    size = prior.shape[0] * prior.num_latents
    indices = torch.tensor([5, 0, size - 1, 7, 5, 8])  # repeated and neighbouring indices (same point)
    one_hot = torch.zeros(size, len(indices), dtype=DTYPE)
    one_hot[indices, torch.arange(len(indices))] = 1.0
    with torch.no_grad(), dense_kernel_limit(dense_kernel_limit.value() if cached else 0):
        if cached:
            prior.matmul(one_hot[:, :1])  # evaluates (and caches) the dense kernel
        columns = prior.kernel_columns(indices)
        reference = prior.matmul(one_hot)
    torch.testing.assert_close(columns, reference, rtol=1e-12, atol=1e-12)
    assert prior.products == 2 + cached and prior.columns == 2 * len(indices) + cached  # a call counts as a product


def _noise(kind: str, num_data: int, num_latents: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(7)
    if kind == "softmax":
        return SoftmaxPseudoInverse(
            torch.softmax(3 * torch.randn(num_data, num_latents, generator=generator), -1).to(dtype)
        )
    if kind == "diagonal":
        return DiagonalNoiseInverse(torch.rand(num_data * num_latents, generator=generator).to(dtype))
    factor = torch.randn(num_data, num_latents, num_latents, generator=generator).to(dtype)
    curvature = factor @ factor.mT + 0.1 * torch.eye(num_latents, dtype=dtype)
    if kind == "cholesky":
        return BlockNoiseInverse(torch.linalg.cholesky(curvature))
    if kind == "site-blocks":  # EP's C x C sites: rank C - 1, null space 1
        values, vectors = torch.linalg.eigh(curvature)
        centred = vectors - vectors.mean(-2, keepdim=True)
        basis, _ = torch.linalg.qr(centred[..., :-1])
        return SiteBlockNoiseInverse.from_site_spectrum(values[..., 1:], basis, min_precision=1e-3)
    return BlockDiagLinearOperator(DenseLinearOperator(torch.linalg.inv(curvature)))  # a generic noise: no factor


@pytest.mark.parametrize("size", [9, 100])  # 100: the Gram matrix from its two lower blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["softmax", "softmax-zero-sum", "diagonal", "cholesky", "blocks", "site-blocks"])
def test_noise_gram_equals_the_dense_quadratic_form(kind, dtype, size, monkeypatch):
    """S^T W^{-1} S over chunks of whitened actions X F (W^{-1} = F F^T; several chunks here, the last one short) and
    over column blocks of W^{-1} S for a noise without a factor, against the dense float64 form. Uncentred actions
    exercise the softmax's centring P; zero-sum ones (IterGP's projected actions) skip it."""
    num_data, num_latents = 50, 4
    monkeypatch.setattr(recycling, "NOISE_CHUNK_BYTES", 7 * size * torch.finfo(dtype).bits // 8 * num_latents)
    monkeypatch.setattr(recycling, "NOISE_BLOCK_BYTES", 4 * num_data * num_latents * torch.finfo(dtype).bits // 8)
    noise = _noise(kind.removesuffix("-zero-sum"), num_data, num_latents, dtype)
    actions = torch.randn(num_data * num_latents, size, generator=torch.Generator().manual_seed(1)).to(dtype)
    if kind == "softmax-zero-sum":
        actions = project_to_zero_sum(actions, num_latents)
    buffer = ActionBuffer.from_tensors(actions, actions, RowBlock.single(len(actions)))
    gram = noise_gram(buffer, noise)
    assert buffer.zero_block_sums(num_latents) == (kind == "softmax-zero-sum")
    expected = actions.double().mT @ noise.to_dense().double() @ actions.double()
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    assert gram.dtype == torch.float64 and torch.equal(gram, gram.mT)
    torch.testing.assert_close(gram, expected, rtol=tolerance, atol=tolerance * float(expected.abs().max()))


@pytest.mark.parametrize("mixed", [False, True], ids=["points-only", "with-dense-actions"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["softmax", "softmax-zero-sum", "diagonal", "cholesky", "blocks", "site-blocks"])
def test_noise_gram_of_actions_at_one_point_each_is_gathered(kind, dtype, mixed, monkeypatch):
    """Actions non-zero at one data point each (unit vectors, also several at one point and one twice; projected to
    zero class sums; one all zero): among themselves e_a^T W_p^{-1} e_b from the noise's diagonal blocks where the
    noise is the package's (block diagonal by points), else gathered from W^{-1} S at their points (in column blocks
    here); the other actions of a mixed buffer (CG's, dense) go through the chunked GEMM, and their cross terms with
    the point actions are gathered; the whole equals the dense float64 form. A noise without blocks of the package
    gathers at single entries."""
    num_data, num_latents = 30, 4
    monkeypatch.setattr(recycling, "NOISE_BLOCK_BYTES", 3 * num_data * num_latents * torch.finfo(dtype).bits // 8)
    noise = _noise(kind.removesuffix("-zero-sum"), num_data, num_latents, dtype)
    entries = torch.tensor([0, 5, 6, 7, 5, 119, 42, 43, 100])
    actions = torch.zeros(num_data * num_latents, len(entries) + 1, dtype=dtype)
    actions[entries, torch.arange(len(entries))] = torch.linspace(0.5, 2.0, len(entries), dtype=dtype)
    dense = torch.randn(num_data * num_latents, 4, generator=torch.Generator().manual_seed(2)).to(dtype)
    if mixed:  # dense actions first, between and last
        actions = torch.cat([dense[:, :1], actions[:, :4], dense[:, 1:3], actions[:, 4:], dense[:, 3:]], dim=1)
    if kind == "softmax-zero-sum":
        actions = project_to_zero_sum(actions, num_latents)
    buffer = ActionBuffer.from_tensors(actions, actions, RowBlock.single(len(actions)))
    block = 1 if kind == "blocks" else num_latents
    located = buffer.at_points(block)
    assert int((~located.mask).sum()) == (4 if mixed else 0)
    called = []
    original = recycling._spread_gram
    monkeypatch.setattr(
        recycling, "_spread_gram", lambda rows, *rest: called.append(len(rows)) or original(rows, *rest)
    )
    gram = noise_gram(buffer, noise)
    assert called == ([4] if mixed else []) and gram.dtype == torch.float64 and torch.equal(gram, gram.mT)
    expected = actions.double().mT @ noise.to_dense().double() @ actions.double()
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(gram, expected, rtol=tolerance, atol=tolerance * float(expected.abs().max()))


def test_point_actions_are_found_per_action_and_incrementally():
    """An action is at a point where its non-zero entries lie in one block (its entries there returned), not where
    they span two; the buffer examines only the actions appended since it last looked, and starts over for another
    block size."""
    actions = torch.zeros(3, 12, dtype=DTYPE)
    actions[0, [0, 1]] = 1.0  # one point (entries 0, 1 of blocks of 4)
    actions[1, 4] = 1.0
    actions[2, 8] = 1.0
    located = recycling.point_actions(actions, 4)
    assert located.mask.all() and located.points.tolist() == [0, 1, 2]
    assert torch.equal(located.entries[0], torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=DTYPE))
    actions[0, 11] = 1.0
    assert recycling.point_actions(actions, 4).mask.tolist() == [False, True, True]
    assert recycling.point_actions(actions, 1).mask.tolist() == [False, True, True]
    buffer = ActionBuffer.from_tensors(actions.mT.contiguous(), actions.mT.contiguous(), RowBlock.single(12))
    assert buffer.at_points(4).mask.tolist() == [False, True, True]
    seen = []
    original = recycling.point_actions
    recycling_point_actions = lambda rows, block: seen.append(len(rows)) or original(rows, block)  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(recycling, "point_actions", recycling_point_actions)
        buffer.append(torch.eye(12, dtype=DTYPE)[5], torch.zeros(12, dtype=DTYPE))
        assert buffer.at_points(4).mask.tolist() == [False, True, True, True] and seen == [1]
        assert buffer.at_points(4).points.tolist() == [0, 1, 2, 1] and seen == [1, 0]
        assert buffer.at_points(2).points.tolist() == [0, 2, 4, 2] and seen == [1, 0, 4]


def test_zero_block_sums_checks_only_new_actions():
    """The buffer's zero-class-sum check covers every action, incrementally: an appended action with a non-zero sum
    turns it off for good, and another block size starts over."""
    actions = project_to_zero_sum(torch.randn(12, 3, dtype=DTYPE), 4)
    buffer = ActionBuffer.from_tensors(actions, actions, RowBlock.single(len(actions)))
    assert buffer.zero_block_sums(4) and not buffer.zero_block_sums(3)
    assert buffer.zero_block_sums(4)
    buffer.append(project_to_zero_sum(torch.randn(12, 1, dtype=DTYPE), 4)[:, 0], torch.zeros(12, dtype=DTYPE))
    assert buffer.zero_block_sums(4)
    buffer.append(torch.ones(12, dtype=DTYPE), torch.zeros(12, dtype=DTYPE))
    assert not buffer.zero_block_sums(4)
    buffer.append(project_to_zero_sum(torch.randn(12, 1, dtype=DTYPE), 4)[:, 0], torch.zeros(12, dtype=DTYPE))
    assert not buffer.zero_block_sums(4)


def _spd_problem(size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    factor = torch.randn(size, size, dtype=DTYPE, generator=generator)
    kernel = factor @ factor.mT / size + 0.1 * torch.eye(size, dtype=DTYPE)
    rhs = torch.randn(size, dtype=DTYPE, generator=generator)
    return kernel, rhs, generator


@pytest.mark.parametrize(("policy_name", "rank"), [("cg", None), ("cg", 4), ("unit", None), ("unit", 4)])
def test_incremental_gram_matrices_equal_recomputed_ones_over_newton_like_steps(policy_name, rank):
    """Solves with a changing noise (as in Newton steps), recycling one buffer: the kernel Gram matrix it keeps (and
    the action Gram matrix it computes) equal S^T K S and S^T S recomputed from the buffer, and each virtual run's
    C_0 = S (S^T K̂ S)^{-1} S^T."""
    size = 30
    kernel, rhs, generator = _spd_problem(size, seed=3)
    policy = ConjugateGradientPolicy() if policy_name == "cg" else UnitVectorPolicy(seed=1)
    policy.prepare(size, 1, False)
    buffer = ActionBuffer.empty(RowBlock.single(size), DTYPE, CPU)
    for _ in range(6):
        noise = DiagonalNoiseInverse(0.05 + torch.rand(size, dtype=DTYPE, generator=generator))
        if buffer.size:
            virtual = virtual_solver_run(buffer, noise, compression_rank=rank)
            actions = virtual.buffer.actions.value
            noisy = kernel + noise.to_dense()
            expected = actions @ torch.linalg.solve(actions.mT @ noisy @ actions, actions.mT)
            root = virtual.precision_root
            torch.testing.assert_close(root @ root.mT, expected, rtol=1e-8, atol=1e-10)
            torch.testing.assert_close(virtual.kernel_precision_root, kernel @ root, rtol=1e-10, atol=1e-12)
        result = itergp_solve(kernel.matmul, noise, rhs, buffer, policy, max_solver_iterations=3, compression_rank=rank)
        buffer = result.buffer
        kernel_gram, action_gram = buffer.kernel_gram(), buffer.action_gram()
        actions, kernel_actions = buffer.actions.value, buffer.kernel_actions.value
        torch.testing.assert_close(kernel_gram, actions.mT @ kernel_actions, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(action_gram, actions.mT @ actions, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(kernel_actions, kernel @ actions, rtol=1e-12, atol=1e-13)
    assert buffer.size == (18 if rank is None else rank + 3)


def test_uncompressed_virtual_run_neither_reweights_nor_copies_the_buffer():
    size = 20
    kernel, rhs, generator = _spd_problem(size, seed=4)
    noise = DiagonalNoiseInverse(torch.full((size,), 0.3, dtype=DTYPE))
    first = itergp_solve(
        kernel.matmul,
        noise,
        rhs,
        ActionBuffer.empty(RowBlock.single(size), DTYPE, CPU),
        ConjugateGradientPolicy(),
        max_solver_iterations=4,
    )
    actions = first.buffer.actions.value.clone()
    second = itergp_solve(kernel.matmul, noise, rhs, first.buffer, ConjugateGradientPolicy(), max_solver_iterations=3)
    assert second.buffer is first.buffer and second.buffer.size == 7  # appended in place
    assert torch.equal(second.buffer.actions.value[:, :4], actions)
    compressed = virtual_solver_run(second.buffer, noise, compression_rank=5)
    assert compressed.buffer is not second.buffer and compressed.buffer.size == 5
    torch.testing.assert_close(compressed.buffer.actions.value.norm(dim=0), torch.ones(5, dtype=DTYPE))


@pytest.mark.parametrize("projected", [False, True], ids=["one-hot", "zero-sum"])
def test_unit_vector_actions_take_kernel_columns_not_products(projected):
    """The solve is the same with kernel columns; the columns replace the products one for one."""
    num_data, num_latents = 25, 3
    size = num_data * num_latents
    kernel, rhs, _ = _spd_problem(size, seed=5)
    noise = DiagonalNoiseInverse(torch.full((size,), 0.2, dtype=DTYPE))

    def project(vectors):
        if not projected:
            return vectors
        blocks = vectors.reshape(num_data, num_latents, -1)
        return (blocks - blocks.mean(1, keepdim=True)).reshape(size, -1)

    calls = {"matmul": 0, "columns": 0}

    def kernel_matmul(vectors):
        calls["matmul"] += 1
        return kernel @ vectors

    def kernel_columns(indices):
        calls["columns"] += 1
        return kernel[:, indices]

    results = []
    for columns in (None, kernel_columns):
        policy = UnitVectorPolicy(seed=2)
        policy.prepare(num_data, num_latents, projected)
        results.append(
            itergp_solve(
                kernel_matmul,
                noise,
                rhs,
                ActionBuffer.empty(RowBlock.single(size), DTYPE, CPU),
                policy,
                project=project,
                max_solver_iterations=12,
                kernel_columns=columns,
            )
        )
    assert calls == {"matmul": 12, "columns": 12}
    torch.testing.assert_close(results[1].representer_weights, results[0].representer_weights)
    torch.testing.assert_close(results[1].kernel_precision_root, results[0].kernel_precision_root)


def test_unit_vector_fit_counts_kernel_columns_as_products():
    generator = torch.Generator().manual_seed(0)
    train_x = torch.rand(60, 2, dtype=DTYPE, generator=generator)
    train_y = (train_x.sum(-1) > 1).to(DTYPE)
    model = IterNCGPModel(
        train_x,
        train_y,
        gpytorch.likelihoods.BernoulliLikelihood(),
        policy="unit",
        max_solver_iterations=7,
        covariance_iterations=0,  # (the phase's products have many columns)
    )
    report = model.variational_strategy.fit(max_newton_steps=4)
    assert report.kernel_products == report.solver_iterations > 0
    assert report.kernel_columns == report.solver_iterations  # one column per one-hot action


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["single", "shared", "independent"])
def test_narrow_products_with_the_cached_kernel_equal_the_dense_product(layout, dtype, monkeypatch):
    """Products with the cached K on the CPU go through narrow_matmul (few columns transposed and padded, wide ones as
    K X). Both equal the dense product to rounding, and the kernel is evaluated once."""
    narrow = []
    original = prior_module._cached_kernel_matmul

    def spy(covariance, rhs):
        product = original(covariance, rhs)
        narrow.append(product is not None)
        return product

    monkeypatch.setattr(prior_module, "_cached_kernel_matmul", spy)
    prior = _prior(layout, dtype=dtype)
    size = prior.shape[0] * prior.num_latents
    dense = _dense(prior)
    generator = torch.Generator().manual_seed(1)
    tolerance = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        for width in (1, 2, NARROW_PRODUCT_COLUMNS + 1):
            vectors = torch.randn(size, width, dtype=dtype, generator=generator)
            torch.testing.assert_close(prior.matmul(vectors), dense @ vectors, **tolerance)
    assert narrow == [True, True, False]
    assert sum(key[0] == "kernel_eval" for key in prior.covariance._memoize_cache) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch", [(), (3,)])
def test_narrow_matmul_equals_the_product(batch, dtype):
    """Every width (padded to a multiple of four or not, past NARROW_PRODUCT_COLUMNS or not), square or not, batched
    or not: the product to rounding, the right shape, and the inputs untouched."""
    generator = torch.Generator().manual_seed(2)
    matrix = torch.randn(*batch, 37, 29, dtype=dtype, generator=generator)
    tolerance = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for width in (1, 2, 3, 4, 5, 8, 11, NARROW_PRODUCT_COLUMNS, NARROW_PRODUCT_COLUMNS + 1):
        rhs = torch.randn(*batch, 29, width, dtype=dtype, generator=generator)
        copy = rhs.clone()
        product = prior_module.narrow_matmul(matrix, rhs)
        assert product.shape == (*batch, 37, width)
        expected = torch.einsum("...nm,...mk->...nk", matrix.double(), rhs.double()).to(dtype)
        torch.testing.assert_close(product, expected, **tolerance)
        assert torch.equal(rhs, copy)


def _dense(prior: LatentPrior) -> torch.Tensor:
    """The data-major (N C, N C) prior covariance, from the kernel matrix."""
    matrix = prior.covariance.to_dense()
    num = prior.num_latents
    if prior.layout == "single":
        return matrix
    if prior.layout == "shared":
        return torch.kron(matrix, torch.eye(num, dtype=matrix.dtype))
    blocks = torch.zeros(matrix.shape[-1], num, matrix.shape[-1], num, dtype=matrix.dtype)
    for latent in range(num):
        blocks[:, latent, :, latent] = matrix[latent]
    return blocks.reshape(matrix.shape[-1] * num, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["single", "shared", "independent"])
def test_products_read_the_kernel_matrix_the_prior_holds_evaluated(layout, dtype, monkeypatch):
    """A sum of kernels evaluates to a sum of operators, whose products would run term by term; once the prior holds
    the matrix evaluated (the preconditioner's pivots read it), products without gradients use that one matrix,
    by narrow_matmul, and equal the dense product; with gradients too (the matrix's own graph)."""
    prior = _prior(layout, dtype=dtype, plus_linear=True)
    called = []
    original = prior_module.narrow_matmul
    monkeypatch.setattr(
        prior_module, "narrow_matmul", lambda *args, **kwargs: called.append(1) or original(*args, **kwargs)
    )
    generator = torch.Generator().manual_seed(1)
    size = prior.shape[0] * prior.num_latents
    tolerance = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    vectors = torch.randn(size, 3, dtype=dtype, generator=generator)
    with torch.no_grad():
        before = prior.matmul(vectors)  # the kernel evaluated (a sum of operators), the product by its terms
    assert called == [] and prior.evaluated_kernel() is not None
    dense = _dense(prior).detach()
    with torch.no_grad():
        for width in (1, 3, NARROW_PRODUCT_COLUMNS + 1):
            wide = torch.randn(size, width, dtype=dtype, generator=generator)
            torch.testing.assert_close(prior.matmul(wide), dense @ wide, **tolerance)
        torch.testing.assert_close(prior.matmul(vectors), before, **tolerance)
    assert len(called) == 4


@pytest.mark.parametrize("layout", ["single", "shared", "independent"])
def test_products_with_the_evaluated_matrix_differentiate_as_the_kernel(layout):
    """With gradients, a product by the matrix the prior holds evaluated (made with its graph) has the gradient, with
    respect to the hyperparameters and the right-hand side, of the product through the kernel's operators."""
    gradients = []
    for evaluated in (False, True):
        prior = _prior(layout, plus_linear=True)
        size = prior.shape[0] * prior.num_latents
        vectors = torch.randn(size, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(3)).requires_grad_()
        weights = torch.randn(size, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(4))
        if evaluated:
            prior.matmul(vectors)  # evaluates the kernel (with its graph)
            assert prior.evaluated_kernel() is not None and prior.evaluated_kernel().requires_grad
        else:
            assert prior.evaluated_kernel() is None
        parameters = list(prior.covariance.kernel.parameters())
        loss = (weights * prior.matmul(vectors)).sum()
        gradients.append(torch.autograd.grad(loss, [*parameters, vectors]))
    for through_kernel, through_matrix in zip(*gradients, strict=True):
        torch.testing.assert_close(through_matrix, through_kernel, rtol=1e-12, atol=1e-12)


def test_solver_keeps_the_root_implicit_and_its_columns_conjugate():
    """Q = S E (the buffer times coefficients): K̂-orthonormal columns, K Q = T E, C b = v for the solved v."""
    size = 30
    kernel, rhs, generator = _spd_problem(size, seed=6)
    noise = DiagonalNoiseInverse(0.05 + torch.rand(size, dtype=DTYPE, generator=generator))
    buffer = ActionBuffer.empty(RowBlock.single(size), DTYPE, CPU)
    for _ in range(3):  # the second and third solves start from a virtual run over the recycled actions
        result = itergp_solve(kernel.matmul, noise, rhs, buffer, ConjugateGradientPolicy(), max_solver_iterations=4)
        buffer = result.buffer
        assert result.root_coefficients.shape == (buffer.size, result.rank)
        root = result.precision_root
        noisy = kernel + noise.to_dense()
        torch.testing.assert_close(root.mT @ noisy @ root, torch.eye(result.rank, dtype=DTYPE), rtol=0, atol=1e-10)
        torch.testing.assert_close(result.kernel_precision_root, kernel @ root, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(root @ (root.mT @ rhs), result.representer_weights, rtol=1e-10, atol=1e-12)
    assert result.rank == 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_cholesky_root_forms_its_coefficients_only_when_read(dtype):
    """A root from a Cholesky factor L of S^T K̂ S (nothing compressed) leaves E = L^{-T} unformed: the exact solve
    and a recycled solve give C b by two triangular solves; Q, K Q (triangular solves over S^T, T^T in float64 where
    n <= 4 B; E and a GEMM otherwise) equal the dense references, E E^T x equals the one of the formed E, and Q^T K̂ Q
    is the identity."""
    size = 24
    kernel, rhs, generator = _spd_problem(size, seed=3)
    kernel, rhs = kernel.to(dtype), rhs.to(dtype)
    noise = DiagonalNoiseInverse((0.05 + torch.rand(size, dtype=DTYPE, generator=generator)).to(dtype))
    noisy = (kernel + noise.to_dense()).double()
    tolerance = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    buffer = ActionBuffer.empty(RowBlock.single(size), dtype, CPU)
    for solve in range(2):  # the first solve takes its block of unit vectors at once, the second recycles them
        policy = UnitVectorPolicy(seed=solve)
        policy.prepare(size, 1, False)
        result = itergp_solve(kernel.matmul, noise, rhs, buffer, policy, abs_tol=0.0, rel_tol=0.0)
        buffer = result.buffer
        assert result.cholesky is not None and not recycling._ROOT_COEFFICIENTS.is_formed(result)
        assert result.rank == size and result.converged
        expected = torch.linalg.solve(noisy, rhs.double())
        torch.testing.assert_close(result.representer_weights.double(), expected, **tolerance)
        root, kernel_root = result.precision_root.double(), result.kernel_precision_root.double()
        assert recycling._ROOT_COEFFICIENTS.is_formed(result) == (dtype == torch.float32)
        torch.testing.assert_close(root.mT @ noisy @ root, torch.eye(size, dtype=DTYPE), **tolerance)
        torch.testing.assert_close(kernel_root, kernel.double() @ root, **tolerance)
        vector = torch.randn(size, dtype=dtype, generator=generator)
        products = result.coefficient_products(vector)
        coefficients = result.root_coefficients  # formed now: the products below by E
        assert recycling._ROOT_COEFFICIENTS.is_formed(result)
        torch.testing.assert_close(products, coefficients @ (coefficients.mT @ vector), **tolerance)
        torch.testing.assert_close(result.precision_root, root.to(dtype), **tolerance)


def test_newton_states_form_their_root_only_when_read():
    """The states the Newton loop yields hold Q and K Q as functions until read; what a callback reads is the
    step's IterGP root (K Q equals K times Q); the final state has its own (finalize)."""
    generator = torch.Generator().manual_seed(0)
    train_x = torch.rand(50, 2, dtype=DTYPE, generator=generator)
    train_y = (train_x.sum(-1) > 1).to(DTYPE)
    model = IterNCGPModel(train_x, train_y, gpytorch.likelihoods.BernoulliLikelihood(), max_solver_iterations=3)
    kernel = model.covar_module(train_x).to_dense().detach()
    unformed, read = [], []

    def callback(record, state):
        unformed.append(not torch.is_tensor(state.__dict__["_deferred_precision_root"]))
        if record.step == 2:
            read.append((state.precision_root.clone(), state.kernel_precision_root.clone()))

    report = model.variational_strategy.fit(max_newton_steps=4, callback=callback)
    assert report.steps == 4 and all(unformed)
    root, kernel_root = read[0]
    assert root.shape[-1] > 0
    torch.testing.assert_close(kernel_root, kernel @ root, rtol=1e-10, atol=1e-12)
    final = model.variational_strategy.state
    assert torch.is_tensor(final.__dict__["_deferred_precision_root"])  # formed by finalize
    torch.testing.assert_close(final.kernel_precision_root, kernel @ final.precision_root, rtol=1e-10, atol=1e-12)
