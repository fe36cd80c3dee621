"""IterGP (paper, Algorithm 2; ``gpytorch_iterncgp.core.solver``): its argument checks, and what it does with an
action that carries no new direction. The paper's statements about it (one product with K per iteration, the
residual orthogonal to the actions, compression to R columns) are in ``tests/test_paper_statements.py``; its buffer
and implicit root in ``tests/core/test_outside_products.py``."""

from __future__ import annotations

import warnings

import pytest
import torch

from gpytorch_iterncgp import UnitVectorPolicy


def test_itergp_solve_checks_its_arguments():
    from gpytorch_iterncgp import ConjugateGradientPolicy
    from gpytorch_iterncgp.core.noise import DiagonalNoiseInverse
    from gpytorch_iterncgp.core.recycling import ActionBuffer
    from gpytorch_iterncgp.core.sharding import RowBlock
    from gpytorch_iterncgp.core.solver import itergp_solve

    kernel = torch.eye(5, dtype=torch.float64)
    noise = DiagonalNoiseInverse(torch.ones(5, dtype=torch.float64))
    buffer = ActionBuffer.empty(RowBlock.single(5), torch.float64, torch.device("cpu"))
    policy = ConjugateGradientPolicy()
    rhs = torch.ones(5, dtype=torch.float64)
    itergp_solve(kernel.matmul, noise, rhs, buffer, policy)  # valid
    with pytest.raises(ValueError, match=r"noise_inverse must be \(4, 4\) to match rhs"):
        itergp_solve(kernel.matmul, noise, rhs[:4], buffer, policy)
    with pytest.raises(ValueError, match="rhs must be a 1-D floating-point tensor"):
        itergp_solve(kernel.matmul, noise, rhs[:, None], buffer, policy)
    with pytest.raises(ValueError, match="rhs contains NaN or inf"):
        itergp_solve(kernel.matmul, noise, rhs * float("nan"), buffer, policy)
    with pytest.raises(ValueError, match=r"buffer must hold actions and kernel products of shape \(5, B\)"):
        itergp_solve(
            kernel.matmul,
            noise,
            rhs,
            ActionBuffer.empty(RowBlock.single(4), torch.float64, torch.device("cpu")),
            policy,
        )
    with pytest.raises(ValueError, match="max_solver_iterations"):
        itergp_solve(kernel.matmul, noise, rhs, buffer, policy, max_solver_iterations=-1)
    with pytest.raises(ValueError, match="rel_tol"):
        itergp_solve(kernel.matmul, noise, rhs, buffer, policy, rel_tol=float("nan"))


def _spd_problem(size: int = 6, seed: int = 0):
    from gpytorch_iterncgp.core.noise import DiagonalNoiseInverse

    generator = torch.Generator().manual_seed(seed)
    factor = torch.randn(size, size, generator=generator, dtype=torch.float64)
    kernel = factor @ factor.mT / size + 0.1 * torch.eye(size, dtype=torch.float64)
    noise = DiagonalNoiseInverse(torch.full((size,), 0.5, dtype=torch.float64))
    rhs = torch.randn(size, generator=generator, dtype=torch.float64)
    return kernel, noise, rhs


def test_action_in_the_span_of_recycled_ones_is_skipped():
    """A unit vector that a recycled action already covers carries no new direction: IterGP skips it (its
    product with K counts as an iteration) and goes on; the result is the exact solve."""
    from gpytorch_iterncgp.core.recycling import ActionBuffer
    from gpytorch_iterncgp.core.sharding import RowBlock
    from gpytorch_iterncgp.core.solver import itergp_solve

    kernel, noise, rhs = _spd_problem()
    recycled = torch.zeros(6, 1, dtype=torch.float64)
    recycled[2] = 1.0
    buffer = ActionBuffer.from_tensors(recycled, kernel @ recycled, RowBlock.single(len(recycled)))
    policy = UnitVectorPolicy(order=[2, 0, 1, 3, 4, 5])
    policy.prepare(6, 1, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = itergp_solve(kernel.matmul, noise, rhs, buffer, policy, abs_tol=0.0, rel_tol=0.0)
    assert result.iterations == 6 and result.precision.rank == 6 and not result.breakdown
    exact = torch.linalg.solve(kernel + 0.5 * torch.eye(6, dtype=torch.float64), rhs)
    torch.testing.assert_close(result.representer_weights, exact)


def test_policy_repeating_a_dependent_action_stops_with_a_warning():
    from gpytorch_iterncgp import NumericalBreakdownWarning, Policy
    from gpytorch_iterncgp.core.recycling import ActionBuffer
    from gpytorch_iterncgp.core.sharding import RowBlock
    from gpytorch_iterncgp.core.solver import itergp_solve

    class Always(Policy):
        def __call__(self, residual):
            action = torch.zeros_like(residual)
            action[0] = 1.0
            return action

    kernel, noise, rhs = _spd_problem()
    buffer = ActionBuffer.empty(RowBlock.single(6), torch.float64, torch.device("cpu"))
    with pytest.warns(NumericalBreakdownWarning, match="lies numerically in the span of the previous ones"):
        result = itergp_solve(kernel.matmul, noise, rhs, buffer, Always())
    assert result.breakdown and result.precision.rank == 1 and result.iterations == 2


@pytest.mark.parametrize("max_solver_iterations", [None, 4])
def test_unit_vectors_to_the_tolerance_zero_are_one_block(max_solver_iterations):
    """Unit vectors with no tolerance (the exact budget) take no decision by the residual: the solver takes the next
    ``min(limit, n)`` of them as one block, one call of the kernel's columns, the policy advanced past them. The
    precision and the representer weights are those of the actions taken one by one (a tolerance of 1e-300, never
    met, keeps the one-by-one loop) and, at full rank, the dense solve's."""
    from gpytorch_iterncgp.core.recycling import ActionBuffer
    from gpytorch_iterncgp.core.sharding import RowBlock
    from gpytorch_iterncgp.core.solver import itergp_solve

    kernel, noise, rhs = _spd_problem(size=8)
    results, calls = {}, {}
    for name, tolerance in (("block", 0.0), ("one by one", 1e-300)):
        policy = UnitVectorPolicy(seed=3)
        policy.prepare(8, 1, False)
        columns = []

        def kernel_columns(indices, found=columns):
            found.append(len(indices))
            return kernel[:, indices]

        buffer = ActionBuffer.empty(RowBlock.single(8), torch.float64, torch.device("cpu"))
        results[name] = itergp_solve(
            kernel.matmul,
            noise,
            rhs,
            buffer,
            policy,
            max_solver_iterations=max_solver_iterations,
            abs_tol=tolerance,
            rel_tol=0.0,
            kernel_columns=kernel_columns,
        )
        calls[name] = (columns, policy.position)
    size = 8 if max_solver_iterations is None else max_solver_iterations
    assert calls["block"] == ([size], size) and calls["one by one"] == ([1] * size, size)
    block, sequential = results["block"], results["one by one"]
    assert block.iterations == sequential.iterations == size and not block.breakdown
    torch.testing.assert_close(block.representer_weights, sequential.representer_weights, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(block.precision.to_dense(), sequential.precision.to_dense(), rtol=1e-10, atol=1e-12)
    if max_solver_iterations is None:
        assert block.converged
        noisy = kernel + 0.5 * torch.eye(8, dtype=torch.float64)
        torch.testing.assert_close(block.representer_weights, torch.linalg.solve(noisy, rhs))
        torch.testing.assert_close(block.precision.to_dense(), torch.linalg.inv(noisy))
