"""``ShardedKernel`` (``gpytorch_iterncgp.kernels.sharded``) in one process: the wrapped kernel's products, fits,
evidence and gradients, state_dict keys and argument checks. In a process group of one process the wrapper's
products are the wrapped kernel's, so every fit equals the fit without the wrapper. Two processes (gloo) against one:
``tests/distributed/test_sharded.py``."""

from __future__ import annotations

import gpytorch
import pytest
import torch
import torch.distributed as dist

from gpytorch_iterncgp import EPStrategy, LaplaceMarginalLogLikelihood
from gpytorch_iterncgp.distributed import ShardedKernel
from tests.common import IterNCGPModel, binary_data, multiclass_data, softmax_likelihood

DTYPE = torch.float64
TOLERANCE = 1e-12


def _kernel() -> gpytorch.kernels.Kernel:
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5)).double()
    kernel.outputscale, kernel.base_kernel.lengthscale = 3.0, 0.2
    return kernel


def test_the_wrapper_keeps_the_wrapped_kernels_state_dict_keys():
    """``ShardedKernel(k).state_dict()`` has ``k``'s keys and values, and each loads into the other."""
    kernel = _kernel()
    wrapped = ShardedKernel(kernel)
    saved = wrapped.state_dict()
    assert saved.keys() == kernel.state_dict().keys()
    plain = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5)).double()
    plain.load_state_dict(saved)
    assert float(plain.outputscale.detach()) == pytest.approx(3.0)
    assert float(plain.base_kernel.lengthscale.detach()) == pytest.approx(0.2)
    other = ShardedKernel(gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5)).double())
    other.load_state_dict(kernel.state_dict())
    assert float(other.base_kernel.outputscale.detach()) == pytest.approx(3.0)


def test_shard_state_must_be_a_bool():
    with pytest.raises(TypeError, match="shard_state must be True or False"):
        ShardedKernel(gpytorch.kernels.RBFKernel(), shard_state="rows")


def test_a_product_before_init_process_group_names_the_fix(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # whether or not this module's group is up
    kernel = ShardedKernel(gpytorch.kernels.RBFKernel())
    with torch.no_grad(), pytest.raises(RuntimeError, match="init_process_group"):
        kernel(torch.rand(5, 1)).to_dense()


@pytest.fixture(scope="module")
def one_process_group():
    """A gloo process group of this process alone, for the module's tests."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("this process is already in a process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_products_are_the_wrapped_kernels(one_process_group):
    """Entries, products, the diagonal and cross-covariances of ``ShardedKernel(k)`` are ``k``'s."""
    kernel = _kernel()
    wrapped = ShardedKernel(kernel)
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(30, 2, dtype=DTYPE, generator=generator)
    test = torch.rand(7, 2, dtype=DTYPE, generator=generator)
    vectors = torch.randn(30, 4, dtype=DTYPE, generator=generator)
    with torch.no_grad():
        matrix, expected = wrapped(x), kernel(x).to_dense()
        assert type(matrix.evaluate_kernel()).__name__ == "ShardedKernelMatrix"
        torch.testing.assert_close(matrix.to_dense(), expected, rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(matrix @ vectors, expected @ vectors, rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(wrapped(x, diag=True), kernel(x, diag=True), rtol=0, atol=0)
        torch.testing.assert_close(wrapped(test, x).to_dense(), kernel(test, x).to_dense(), rtol=0, atol=TOLERANCE)
    assert wrapped.products > 0 and wrapped.bytes_sent == 0  # products counted; nothing sent to another rank
    assert wrapped.base_kernel is kernel


def _models(kind: str, shard_state: bool):
    """The same model twice, the second with its kernel wrapped: softmax Laplace (CG, recycling and compression),
    or binary probit EP."""
    if kind == "laplace":
        x, y = multiclass_data(60, seed=3)
        likelihood, options = softmax_likelihood(), {"compression_rank": 6}
    else:
        x, y = binary_data(60, seed=3)
        likelihood, options = gpytorch.likelihoods.BernoulliLikelihood(), {"strategy_class": EPStrategy}
    options |= {"policy": "cg", "max_solver_iterations": 5, "kernel": "matern"}
    plain = IterNCGPModel(x, y, likelihood, **options)
    wrapped = IterNCGPModel(x, y, likelihood, **options)
    wrapped.covar_module = ShardedKernel(wrapped.covar_module, shard_state=shard_state)
    return x, y, plain, wrapped


@pytest.mark.parametrize("shard_state", [False, True])
@pytest.mark.parametrize("kind", ["laplace", "ep"])
def test_one_process_fits_the_unwrapped_posterior(one_process_group, kind, shard_state):
    """Fit, predictive moments at test points and the evidence with its gradient: the same as without the wrapper."""
    x, y, plain, wrapped = _models(kind, shard_state)
    test = torch.rand(9, 2, dtype=DTYPE, generator=torch.Generator().manual_seed(4))
    results = []
    for model in (plain, wrapped):
        report = model.variational_strategy.fit(max_newton_steps=4) if kind == "laplace" else None
        if report is None:
            report = model.variational_strategy.fit(max_sweeps=3)
        with torch.no_grad():
            mean, variance = model.variational_strategy.marginal_latent(test)
        model.train()
        evidence = (
            LaplaceMarginalLogLikelihood(model.variational_strategy.likelihood, model)(model(x), y)
            if kind == "laplace"
            else None
        )
        gradient = {}
        if evidence is not None:
            evidence.backward()
            for name, parameter in model.named_parameters():  # the wrapped kernel's under the wrapper's name
                gradient[name.replace("covar_module.sharded_kernel.", "covar_module.")] = parameter.grad
        results.append((report.steps, mean, variance, evidence, gradient))
    (steps, mean, variance, evidence, gradient), expected = results[1], results[0]
    assert steps == expected[0] and wrapped.covar_module.products > 0
    torch.testing.assert_close(mean, expected[1], rtol=0, atol=1e-10)
    torch.testing.assert_close(variance, expected[2], rtol=0, atol=1e-10)
    if kind == "laplace":
        torch.testing.assert_close(evidence, expected[3], rtol=1e-12, atol=0)
        assert gradient.keys() == expected[4].keys() and "covar_module.raw_outputscale" in gradient
        for name, value in expected[4].items():
            assert value is not None
            torch.testing.assert_close(gradient[name], value, rtol=1e-10, atol=0, msg=name)
