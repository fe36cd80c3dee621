"""Statements of the paper checked on small problems against dense references.

Damping (seed 001's step halving), Theorem A.2 (Gaussian likelihood: one Newton step is GP regression), Proposition A.3
(the marginal variance does not increase over solver iterations), Proposition A.4 (after the virtual
solver run the residual is orthogonal to the recycled actions), recycling and compression (Algorithm 3)
and the cost model (one product with K per solver iteration).
"""

from __future__ import annotations

import math
import warnings
from itertools import pairwise

import gpytorch
import pytest
import torch

from gpytorch_iterncgp import ConjugateGradientPolicy, ExpPoissonLikelihood, NumericalBreakdownWarning, UnitVectorPolicy
from gpytorch_iterncgp.core.noise import DiagonalNoiseInverse, SoftmaxPseudoInverse
from gpytorch_iterncgp.core.recycling import ActionBuffer, virtual_solver_run
from gpytorch_iterncgp.core.sharding import RowBlock
from gpytorch_iterncgp.core.solver import itergp_solve
from tests import reference
from tests.common import IterNCGPModel, binary_data, count_data, multiclass_data

DTYPE = torch.float64
CPU = torch.device("cpu")


def assert_relative(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """``max |actual - expected| <= tol * max |expected|``."""
    actual, expected = actual.detach(), expected.detach()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = float(expected.abs().max())
    error = float((actual - expected).abs().max())
    assert error <= tol * max(scale, 1e-300), f"max error {error:.3g} > {tol:.1g} * {scale:.3g}"


def rbf_kernel(x: torch.Tensor, lengthscale: float = 0.3, outputscale: float = 2.0) -> torch.Tensor:
    return outputscale * torch.exp(-0.5 * torch.cdist(x, x).square() / lengthscale**2)


def dense_kernel(model, x) -> torch.Tensor:
    with torch.no_grad():
        return model.covar_module(x).to_dense()


def random_problem(num: int, seed: int, noise_range=(0.1, 1.1)):
    """Dense K (RBF on random 2-D inputs), a diagonal noise W^{-1} and a right-hand side."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(num, 2, generator=generator, dtype=DTYPE)
    low, high = noise_range
    noise = low + (high - low) * torch.rand(num, generator=generator, dtype=DTYPE)
    rhs = torch.randn(num, generator=generator, dtype=DTYPE)
    return rbf_kernel(x), noise, rhs


def make_policy(name: str, num: int, num_latents: int = 1):
    policy = ConjugateGradientPolicy() if name == "cg" else UnitVectorPolicy(seed=1)
    policy.prepare(num, num_latents, False)
    return policy


# ---------------------------------------------------------------------------------------------------
# Damping: undamped exact Newton decreases Psi; the damped package converges to the exact mode.
# ---------------------------------------------------------------------------------------------------
def poisson_damping_problem():
    """Poisson (exp link), outputscale 5, lengthscale 0.1 (the paper's Poisson prior), rates up to e^3."""
    x, y = count_data(60, seed=0, scale=3.0)
    return x, y, dict(lengthscale=0.1, outputscale=5.0)


def test_undamped_newton_decreases_log_posterior():
    x, y, options = poisson_damping_problem()
    model = IterNCGPModel(x, y, ExpPoissonLikelihood(), **options)
    kernel = dense_kernel(model, x)
    zero = torch.zeros(len(y), dtype=DTYPE)
    undamped = reference.laplace_mode(kernel, zero, y, "poisson_exp", damping=False, max_steps=30)
    psi = undamped.log_posteriors
    assert any(new < old - 1e-6 * abs(old) for old, new in pairwise(psi)), psi
    damped = reference.laplace_mode(kernel, zero, y, "poisson_exp")
    assert damped.converged and min(damped.step_sizes) < 1
    assert all(new >= old - 1e-12 * abs(old) for old, new in pairwise(damped.log_posteriors))


@pytest.mark.parametrize("max_solver_iterations", [None, 5, 1])
def test_damped_package_converges_to_exact_mode(max_solver_iterations):
    x, y, options = poisson_damping_problem()
    model = IterNCGPModel(
        x,
        y,
        ExpPoissonLikelihood(),
        policy="cg",
        max_solver_iterations=max_solver_iterations,
        outer_tol=1e-10,
        abs_tol=1e-10,
        rel_tol=0.0,
        max_newton_steps=100,
        **options,
    )
    report = model.variational_strategy.fit()
    exact = reference.laplace_mode(dense_kernel(model, x), torch.zeros(len(y), dtype=DTYPE), y, "poisson_exp")
    assert report.converged
    assert_relative(model.variational_strategy.mode[:, 0], exact.mode, 1e-6)
    assert math.isclose(report.log_posteriors[-1], exact.log_posteriors[-1], rel_tol=1e-9)
    assert min(report.step_sizes) < 1
    # damping never lets the log posterior decrease
    psi = report.log_posteriors
    assert all(new >= old - 1e-12 * abs(old) for old, new in pairwise(psi))
    if max_solver_iterations is None:  # exact Newton directions: the same step halving as the reference
        assert report.step_sizes[: len(exact.step_sizes)] == exact.step_sizes


# ---------------------------------------------------------------------------------------------------
# Theorem A.2: a Gaussian likelihood (autograd path) gives GP regression after one Newton step.
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["unit", "cg"])
def test_gaussian_likelihood_is_gp_regression(policy):
    generator = torch.Generator().manual_seed(7)
    x = torch.rand(50, 2, generator=generator, dtype=DTYPE)
    y = torch.sin(6 * x[:, 0]) + x[:, 1] + 0.2 * torch.randn(50, generator=generator, dtype=DTYPE)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DTYPE)
    likelihood.noise = 0.05
    model = IterNCGPModel(
        x,
        y,
        likelihood,
        policy=policy,
        max_solver_iterations=None,
        abs_tol=1e-13,
        rel_tol=0.0,
        max_newton_steps=1,
        constant_mean=0.3,
    )
    strategy = model.variational_strategy
    report = strategy.fit()
    assert report.steps == 1 and report.records[0].step_size == 1.0

    generator = torch.Generator().manual_seed(8)
    test_x = torch.rand(11, 2, generator=generator, dtype=DTYPE)
    noise = float(likelihood.noise.detach())
    with torch.no_grad():
        kernel = model.covar_module(x).to_dense()
        cross = model.covar_module(test_x, x).to_dense()
        test_kernel = model.covar_module(test_x).to_dense()
        prior_mean, test_mean = model.mean_module(x), model.mean_module(test_x)
    # at the training inputs the mode is the posterior mean
    train_mean, _ = reference.gp_regression(kernel, noise, y, prior_mean, kernel, kernel, prior_mean)
    assert_relative(strategy.mode[:, 0], train_mean, 1e-8)
    mean, covariance = reference.gp_regression(kernel, noise, y, prior_mean, cross, test_kernel, test_mean)
    model.eval()
    with torch.no_grad():
        posterior = model(test_x)
    assert_relative(posterior.mean, mean, 1e-8)
    if policy == "unit":  # the actions span everything: C = (K + s^2 I)^{-1}
        assert_relative(posterior.covariance_matrix, covariance, 1e-8)

    # a second fit continues from the solution: nothing changes. (CG's residual there is at rounding level, so
    # its next action may lie in the span of the earlier ones: a NumericalBreakdownWarning, whose stop is right.)
    weights = strategy.state.representer_weights.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumericalBreakdownWarning)
        strategy.fit()
    change = float((strategy.state.representer_weights - weights).norm()) / float(weights.norm())
    assert change < 1e-10


# ---------------------------------------------------------------------------------------------------
# Proposition A.3: the marginal variance does not increase over solver iterations.
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy_name", ["cg", "unit"])
def test_marginal_variance_non_increasing(policy_name):
    num = 30
    kernel, noise, rhs = random_problem(num, seed=1)
    exact = (kernel - kernel @ torch.linalg.solve(kernel + torch.diag(noise), kernel)).diagonal()
    previous = kernel.diagonal()
    for iterations in range(1, num + 1):
        result = itergp_solve(
            lambda v: kernel @ v,
            DiagonalNoiseInverse(noise),
            rhs,
            ActionBuffer.empty(RowBlock.single(num), DTYPE, CPU),
            make_policy(policy_name, num),
            max_solver_iterations=iterations,
            abs_tol=0.0,
            rel_tol=0.0,
        )
        assert result.iterations == iterations and not result.breakdown
        root = result.precision.root_tensor
        assert_relative(result.kernel_precision_root, kernel @ root, 1e-10)
        variance = kernel.diagonal() - (kernel @ root).square().sum(-1)
        assert float((variance - previous).max()) <= 1e-10
        assert float(variance.min()) >= -1e-10
        previous = variance
    assert_relative(variance, exact, 1e-8)


# ---------------------------------------------------------------------------------------------------
# Proposition A.4: after a virtual solver run with a new noise, the residual is orthogonal to span(S).
# ---------------------------------------------------------------------------------------------------
def noise_pair(kind: str, num_data: int, generator):
    """Two different noises W^{-1} (the earlier and the new Newton step) and the number of latents."""
    if kind == "diagonal":
        first, second = (0.1 + torch.rand(2, num_data, generator=generator, dtype=DTYPE)).unbind(0)
        return DiagonalNoiseInverse(first), DiagonalNoiseInverse(second), 1
    logits = 2 * torch.randn(2, num_data, 3, generator=generator, dtype=DTYPE)
    first, second = torch.softmax(logits, dim=-1).unbind(0)
    return SoftmaxPseudoInverse(first), SoftmaxPseudoInverse(second), 3


@pytest.mark.parametrize("kind", ["diagonal", "softmax"])
def test_virtual_run_residual_orthogonal_to_actions(kind):
    num_data = 40
    generator = torch.Generator().manual_seed(3)
    x = torch.rand(num_data, 2, generator=generator, dtype=DTYPE)
    old_noise, new_noise, num_latents = noise_pair(kind, num_data, generator)
    kernel = torch.kron(rbf_kernel(x), torch.eye(num_latents, dtype=DTYPE))
    size = num_data * num_latents
    old_rhs = torch.randn(size, generator=generator, dtype=DTYPE)
    rhs = torch.randn(size, generator=generator, dtype=DTYPE)

    earlier = itergp_solve(
        lambda v: kernel @ v,
        old_noise,
        old_rhs,
        ActionBuffer.empty(RowBlock.single(size), DTYPE, CPU),
        make_policy("cg", num_data, num_latents),
        max_solver_iterations=8,
        abs_tol=0.0,
        rel_tol=0.0,
    )
    actions = earlier.buffer.actions.value.clone()
    assert actions.shape == (size, 8)
    new_system = kernel + new_noise.to_dense()

    virtual = virtual_solver_run(earlier.buffer, new_noise)
    root = virtual.precision_root
    residual = rhs - new_system @ (root @ (root.mT @ rhs))
    bound = 1e-8 * float(torch.linalg.matrix_norm(actions, ord=2)) * float(rhs.norm())
    assert float((actions.mT @ residual).norm()) <= bound
    # C_0 = S (S^T K̂ S)^{-1} S^T with the new K̂, and K Q without a product with K
    expected = actions @ torch.linalg.solve(actions.mT @ new_system @ actions, actions.mT)
    assert_relative(root @ root.mT, expected, 1e-8)
    assert_relative(virtual.kernel_precision_root, kernel @ root, 1e-10)
    # not vacuous: the precision of the earlier solve (old noise) leaves a residual in span(S)
    old_root = earlier.precision.root_tensor
    stale = rhs - new_system @ (old_root @ (old_root.mT @ rhs))
    assert float((actions.mT @ stale).norm()) > 1e3 * bound


# ---------------------------------------------------------------------------------------------------
# Recycling: the same mode with fewer products with K.
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_solver_iterations", [10, None])
def test_recycling_reaches_exact_mode_with_fewer_products(max_solver_iterations):
    x, y = binary_data(80, seed=3)
    tight = dict(policy="cg", outer_tol=1e-10, abs_tol=1e-10, rel_tol=0.0, max_newton_steps=100)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    recycled = IterNCGPModel(
        x, y, likelihood, recycle=True, compression_rank=None, max_solver_iterations=max_solver_iterations, **tight
    )
    fresh = IterNCGPModel(x, y, likelihood, recycle=False, max_solver_iterations=None, **tight)
    recycled_report = recycled.variational_strategy.fit()
    fresh_report = fresh.variational_strategy.fit()
    assert recycled_report.converged and fresh_report.converged
    exact = reference.laplace_mode(dense_kernel(fresh, x), torch.zeros(len(y), dtype=DTYPE), y, "probit")
    assert_relative(recycled.variational_strategy.mode[:, 0], exact.mode, 1e-6)
    assert_relative(fresh.variational_strategy.mode[:, 0], exact.mode, 1e-6)
    assert recycled_report.kernel_products < fresh_report.kernel_products


# ---------------------------------------------------------------------------------------------------
# Compression: at most R recycled actions (+ the iterations of the current step).
# ---------------------------------------------------------------------------------------------------
def filled_buffer(kernel, noise, rhs, iterations: int):
    num = len(rhs)
    result = itergp_solve(
        lambda v: kernel @ v,
        DiagonalNoiseInverse(noise),
        rhs,
        ActionBuffer.empty(RowBlock.single(num), DTYPE, CPU),
        make_policy("cg", num),
        max_solver_iterations=iterations,
        abs_tol=0.0,
        rel_tol=0.0,
    )
    assert result.buffer.size == iterations
    return result.buffer


@pytest.mark.parametrize("rank", [1, 4, 9])
def test_virtual_run_compression_keeps_top_eigenpairs(rank):
    kernel, noise, rhs = random_problem(40, seed=4)
    buffer = filled_buffer(kernel, noise, rhs, 12)
    actions = buffer.actions.value.clone()
    new_noise = noise.flip(0)
    virtual = virtual_solver_run(buffer, DiagonalNoiseInverse(new_noise), compression_rank=rank)
    assert virtual.buffer.size == rank
    assert virtual.precision_root.shape == (40, rank) and virtual.kernel_precision_root.shape == (40, rank)
    # reference: the top-R eigenpairs of M = S^T K̂ S, C_0 = S U_R L_R^{-1} U_R^T S^T
    new_system = kernel + torch.diag(new_noise)
    eigenvalues, eigenvectors = torch.linalg.eigh(actions.mT @ new_system @ actions)
    top_values, top_vectors = eigenvalues[-rank:], eigenvectors[:, -rank:]
    expected = actions @ top_vectors @ torch.diag(1 / top_values) @ top_vectors.mT @ actions.mT
    root = virtual.precision_root
    assert_relative(root @ root.mT, expected, 1e-8)
    assert_relative(root.mT @ new_system @ root, torch.eye(rank, dtype=DTYPE), 1e-8)
    # the kept actions span the same space, and their kernel products are K times them
    kept = virtual.buffer.actions.value
    assert_relative(kept.mT @ kept, torch.eye(rank, dtype=DTYPE), 1e-10)
    assert_relative(virtual.buffer.kernel_actions.value, kernel @ kept, 1e-10)


@pytest.mark.parametrize("rank, iterations", [(3, 2), (5, 4)])
def test_itergp_solve_with_compression_bounds_buffer(rank, iterations):
    kernel, noise, rhs = random_problem(40, seed=5)
    buffer = filled_buffer(kernel, noise, rhs, 12)
    result = itergp_solve(
        lambda v: kernel @ v,
        DiagonalNoiseInverse(noise.flip(0)),
        rhs.flip(0),
        buffer,
        make_policy("cg", 40),
        max_solver_iterations=iterations,
        abs_tol=0.0,
        rel_tol=0.0,
        compression_rank=rank,
    )
    assert result.iterations == iterations
    assert result.buffer.size <= rank + iterations
    assert result.precision.rank <= rank + iterations
    assert_relative(result.buffer.kernel_actions.value, kernel @ result.buffer.actions.value, 1e-10)


def test_model_buffer_bounded_by_compression_rank():
    rank, iterations = 6, 4
    x, y = binary_data(60, seed=6)
    model = IterNCGPModel(
        x,
        y,
        gpytorch.likelihoods.BernoulliLikelihood(),
        policy="cg",
        max_solver_iterations=iterations,
        compression_rank=rank,
        max_newton_steps=8,
        outer_tol=0.0,
        preconditioner_rank=0,  # the paper's CG (a preconditioner's factor adds its actions to the first buffer)
        covariance_iterations=0,  # (the phase's actions enlarge Q after the steps, not the buffer)
    )
    sizes = []

    def record(step, state):
        sizes.append((state.actions.shape[-1], state.precision_root.shape[-1], step.solver_iterations))

    report = model.variational_strategy.fit(callback=record)
    assert report.steps == 8 and len(sizes) == 8
    assert sizes[0][0] == iterations  # the first step starts with an empty buffer
    assert all(actions <= rank + iterations and root <= rank + iterations for actions, root, _ in sizes)
    assert max(actions for actions, _, _ in sizes) > rank  # not vacuous: the buffer was compressed
    state = model.variational_strategy.state
    assert state.actions.shape[-1] <= rank + iterations and state.precision_root.shape[-1] <= rank + iterations


# ---------------------------------------------------------------------------------------------------
# Cost: exactly one product with K per solver iteration.
# ---------------------------------------------------------------------------------------------------
def _softmax_model(batch_classes):
    x, y = multiclass_data(40, seed=9)
    likelihood = gpytorch.likelihoods.SoftmaxLikelihood(num_classes=3, mixing_weights=False)
    return IterNCGPModel(x, y, likelihood, batch_classes=batch_classes, policy="cg", max_solver_iterations=5)


MODELS = {
    "probit": lambda: IterNCGPModel(
        *binary_data(50, seed=8), gpytorch.likelihoods.BernoulliLikelihood(), policy="cg", max_solver_iterations=5
    ),
    "poisson-unit": lambda: IterNCGPModel(
        *count_data(50, seed=8), ExpPoissonLikelihood(), policy="unit", max_solver_iterations=3, max_newton_steps=4
    ),
    "softmax-independent": lambda: _softmax_model(3),
    "softmax-shared": lambda: _softmax_model(None),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_one_kernel_product_per_solver_iteration(name):
    model = MODELS[name]()
    strategy = model.variational_strategy
    # (preconditioned by a rank-4 factor of K, whose kernel columns are not products: with the default rank its
    # actions would span these few points and leave nothing to iterate)
    # (and no covariance phase: the products of the loop alone, paper Alg. 2)
    report = strategy.fit(preconditioner_rank=4, covariance_iterations=0)
    assert report.solver_iterations > 0 and report.covariance_products == 0
    assert report.kernel_products == report.solver_iterations
    assert report.kernel_columns == report.kernel_products  # one vector per product
    assert all(step.kernel_products == step.solver_iterations for step in report.records)
    assert sum(step.solver_iterations for step in report.records) == report.solver_iterations
    # continuing with the same hyperparameters: still one product per iteration
    more = dict(
        outer_tol=0.0, abs_tol=0.0, rel_tol=0.0, max_newton_steps=2, preconditioner_rank=4, covariance_iterations=0
    )
    again = strategy.fit(**more)
    assert again.solver_iterations > 0 and again.kernel_products == again.solver_iterations
    # after a change of the kernel, one extra product renews K a and K S (a warm start)
    with torch.no_grad():
        model.covar_module.outputscale = model.covar_module.outputscale * 1.5
    changed = strategy.fit(**more)
    assert changed.kernel_products == changed.solver_iterations + 1


@pytest.mark.parametrize("policy_name", ["cg", "unit"])
def test_itergp_solve_counts_kernel_products(policy_name):
    kernel, noise, rhs = random_problem(40, seed=10)
    calls = []

    def kernel_matmul(vectors):
        calls.append(vectors.shape)
        return kernel @ vectors

    # from scratch, and again from a recycled buffer (the virtual run costs no product)
    buffer = ActionBuffer.empty(RowBlock.single(40), DTYPE, CPU)
    policy = make_policy(policy_name, 40)
    for noise_now, limit in ((noise, 7), (noise.flip(0), 5), (noise, None)):
        calls.clear()
        result = itergp_solve(
            kernel_matmul,
            DiagonalNoiseInverse(noise_now),
            rhs,
            buffer,
            policy,
            max_solver_iterations=limit,
            abs_tol=1e-9,
        )
        buffer = result.buffer
        assert len(calls) == result.iterations > 0
        assert all(shape == (40, 1) for shape in calls)
        if limit is not None:
            assert result.iterations == limit
