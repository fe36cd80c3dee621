"""Fused products with RBF and Matérn kernel matrices: equal to the dense product, chosen where GPyTorch would chunk.

Tolerances are relative to the largest entry of the product: 1e-5 in float32, 1e-12 in float64, against the
dense GPyTorch kernel evaluated in float64. The Triton kernel runs in Triton's interpreter on CPU tensors, in a
subprocess (``TRITON_INTERPRET=1`` must be set before triton is imported).
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import os
import subprocess
import sys
import textwrap
import warnings

import gpytorch
import pytest
import torch
from linear_operator.utils.warnings import PerformanceWarning

from gpytorch_iterncgp import settings
from gpytorch_iterncgp.core import kernel_products, prior
from gpytorch_iterncgp.core.kernel_products import fused_kernel_matmul, stationary_kernel
from gpytorch_iterncgp.core.prior import LatentPrior
from tests.common import IterNCGPModel, binary_data, multiclass_data, softmax_likelihood

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}
KERNELS = {"rbf": None, "matern12": 0.5, "matern32": 1.5, "matern52": 2.5}
HAS_TRITON = importlib.util.find_spec("triton") is not None


def make_kernel(kind, dtype, ard=False, scale=True, batch=()):
    """A kernel with distinct lengthscales per dimension and class, and a distinct outputscale per class."""
    batch_shape = torch.Size(batch)
    options = dict(ard_num_dims=3 if ard else None, batch_shape=batch_shape)
    nu = KERNELS[kind]
    base = gpytorch.kernels.RBFKernel(**options) if nu is None else gpytorch.kernels.MaternKernel(nu=nu, **options)
    kernel = gpytorch.kernels.ScaleKernel(base, batch_shape=batch_shape) if scale else base
    kernel = kernel.to(dtype)
    generator = torch.Generator().manual_seed(3)
    base.lengthscale = 0.2 + 0.5 * torch.rand(base.lengthscale.shape, generator=generator, dtype=dtype)
    if scale:
        kernel.outputscale = 0.5 + torch.rand(kernel.outputscale.shape, generator=generator, dtype=dtype)
    return kernel


def inputs(dtype, rows=300, cols=200, width=3, batch=()):
    generator = torch.Generator().manual_seed(1)
    x1 = torch.rand(rows, 3, generator=generator, dtype=dtype)
    x2 = torch.rand(cols, 3, generator=generator, dtype=dtype)
    rhs = torch.randn(*batch, cols, width, generator=generator, dtype=dtype)
    return x1, x2, rhs


def assert_matches_dense(kernel, x1, x2, rhs, product):
    """``product`` equals the float64 dense product to TOLERANCE[dtype], relative to its largest entry."""
    with torch.no_grad():
        reference = copy.deepcopy(kernel).double()(x1.double(), x2.double()).to_dense() @ rhs.double()
    error = float((product.double() - reference).abs().max() / reference.abs().max())
    assert product.shape == reference.shape and product.dtype == rhs.dtype
    assert error <= TOLERANCE[rhs.dtype], error


# ---------------------------------------------------------------------------------------------------
# The blocked CPU loop (uncompiled here; the compiled loop is the same code) against the dense product.
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", list(KERNELS))
@pytest.mark.parametrize(("ard", "scale", "width"), [(False, True, 1), (True, True, 3), (True, False, 1)])
def test_fused_product_equals_dense_product(kind, dtype, ard, scale, width):
    kernel = make_kernel(kind, dtype, ard=ard, scale=scale)
    x1, x2, rhs = inputs(dtype, width=width)
    with torch.no_grad(), settings.fused_kernel_backend("eager"):
        product = fused_kernel_matmul(kernel(x1, x2), rhs)
    assert_matches_dense(kernel, x1, x2, rhs, product)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", list(KERNELS))
def test_fused_product_with_per_class_kernels_equals_dense_product(kind, dtype):
    """A batch of C = 3 kernels (ARD lengthscales and outputscale per class) times (C, M, k)."""
    kernel = make_kernel(kind, dtype, ard=True, batch=(3,))
    x1, x2, rhs = inputs(dtype, width=2, batch=(3,))
    with torch.no_grad(), settings.fused_kernel_backend("eager"):
        product = fused_kernel_matmul(kernel(x1, x2), rhs)
    assert_matches_dense(kernel, x1, x2, rhs, product)


def test_square_kernel_is_exact_on_its_diagonal():
    """Direct differences give r = 0 exactly on the diagonal (Matérn-1/2 has a kink there)."""
    kernel = make_kernel("matern12", torch.float32, ard=True)
    x = inputs(torch.float32)[0] * 100
    eye = torch.eye(len(x), dtype=torch.float32)
    with torch.no_grad(), settings.fused_kernel_backend("eager"):
        columns = fused_kernel_matmul(kernel(x), eye)
    torch.testing.assert_close(columns.diagonal(), kernel.outputscale.expand(len(x)), rtol=1e-6, atol=0)


def test_compiled_product_equals_dense_product_and_compiles_once():
    """``torch.compile`` of the tile: one graph per kernel, dtype and dimension, whatever the width."""
    from torch._dynamo.utils import counters

    kernel = make_kernel("matern52", torch.float32, ard=True)
    x1, x2, rhs = inputs(torch.float32, rows=300, cols=1100, width=5)
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad(), settings.fused_kernel_backend("compile"), warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch")  # inductor's own imports
        for width in (3, 5, 2):
            product = fused_kernel_matmul(kernel(x1, x2), rhs[:, :width])
            assert_matches_dense(kernel, x1, x2, rhs[:, :width], product)
    assert counters["stats"]["unique_graphs"] - graphs <= 1
    assert ("matern52", torch.float32, 3) not in kernel_products._COMPILE_FAILED


def test_compile_failure_falls_back_to_the_uncompiled_loop(monkeypatch):
    def broken(*args):
        def step(*tensors):
            raise RuntimeError("no C++ compiler")

        return step

    monkeypatch.setattr(kernel_products, "_compiled_step", broken)
    monkeypatch.setattr(kernel_products, "_COMPILE_FAILED", set())
    kernel = make_kernel("rbf", torch.float64)
    x1, x2, rhs = inputs(torch.float64)
    with torch.no_grad(), settings.fused_kernel_backend("compile"):
        with pytest.warns(PerformanceWarning, match="no C\\+\\+ compiler"):
            product = fused_kernel_matmul(kernel(x1, x2), rhs)
        assert_matches_dense(kernel, x1, x2, rhs, product)
        with warnings.catch_warnings():  # once per kernel: later products go uncompiled straight away
            warnings.simplefilter("error")
            fused_kernel_matmul(kernel(x1, x2), rhs)


def test_unsupported_kernels_are_not_fused():
    x1, x2, rhs = inputs(torch.float64)

    class MyRBF(gpytorch.kernels.RBFKernel):
        pass

    unsupported = [
        gpytorch.kernels.PeriodicKernel(),
        MyRBF(),  # a subclass may change the forward
        gpytorch.kernels.RBFKernel(active_dims=[0, 1]),
        gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel() + gpytorch.kernels.LinearKernel()),
        gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(), active_dims=[0]),
    ]
    for kernel in unsupported:
        assert stationary_kernel(kernel.double()(x1, x2)) is None
        assert fused_kernel_matmul(kernel.double()(x1, x2), rhs) is None
    kernel = make_kernel("rbf", torch.float64)
    assert stationary_kernel(kernel(x1, x2).to_dense()) is None  # not lazy: nothing to fuse
    with settings.fused_kernel_products(False):
        assert fused_kernel_matmul(kernel(x1, x2), rhs) is None


# ---------------------------------------------------------------------------------------------------
# LatentPrior picks the fused product where it would chunk, for supported kernels only.
# ---------------------------------------------------------------------------------------------------
@pytest.fixture
def spies(monkeypatch):
    calls = {"fused": 0, "chunked": 0}

    def spy(name, function):
        def wrapped(*args, **kwargs):
            result = function(*args, **kwargs)
            calls[name] += result is not None
            return result

        return wrapped

    monkeypatch.setattr(prior, "fused_kernel_matmul", spy("fused", prior.fused_kernel_matmul))
    monkeypatch.setattr(prior, "_chunked_matmul", spy("chunked", prior._chunked_matmul))
    with settings.fused_kernel_backend("eager"):
        yield calls


@pytest.mark.parametrize("batch", [False, True])
def test_latent_prior_fuses_supported_kernels_and_chunks_the_others(spies, batch):
    num = 3
    x = inputs(torch.float64)[0]
    mean = torch.zeros(*((num,) if batch else ()), len(x), dtype=torch.float64)
    rhs = torch.randn(len(x) * num, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    supported = make_kernel("matern32", torch.float64, ard=True, batch=(num,) if batch else ())
    periodic = gpytorch.kernels.PeriodicKernel(batch_shape=torch.Size([num] if batch else [])).double()
    for kernel, path in [(supported, "fused"), (periodic, "chunked")]:
        latent = LatentPrior.from_distribution(gpytorch.distributions.MultivariateNormal(mean, kernel(x)), num)
        with torch.no_grad():
            expected = latent.matmul(rhs)  # below the limit: the cached dense kernel
            before = dict(spies)
            with settings.dense_kernel_limit(0):
                product = latent.matmul(rhs)
            assert spies[path] == before[path] + 1 and sum(spies.values()) == sum(before.values()) + 1
        torch.testing.assert_close(product, expected, rtol=1e-12, atol=1e-12)
    with torch.no_grad(), settings.dense_kernel_limit(0), settings.fused_kernel_products(False):
        latent = LatentPrior.from_distribution(gpytorch.distributions.MultivariateNormal(mean, supported(x)), num)
        latent.matmul(rhs)
    assert spies["chunked"] == 2 and spies["fused"] == 1


def test_fit_with_fused_products_reaches_the_chunked_mode(spies):
    """Binary IterNCGP (one kernel) and softmax IterNCGP (per-class kernels) fit to the same mode either way."""
    options = dict(max_solver_iterations=None, outer_tol=1e-10, abs_tol=1e-10, rel_tol=1e-12, max_newton_steps=50)
    x, y = binary_data(num_data=120)
    xs, ys = multiclass_data(num_data=90)
    problems = [
        (x, y, gpytorch.likelihoods.BernoulliLikelihood, dict(kernel="matern")),
        (xs, ys, softmax_likelihood, dict(kernel="rbf", batch_classes=3)),
    ]
    for train_x, train_y, likelihood, model_options in problems:
        modes = []
        for fused in (True, False):
            with settings.dense_kernel_limit(0), settings.fused_kernel_products(fused):
                model = IterNCGPModel(train_x, train_y, likelihood(), **model_options, **options)
                model.variational_strategy.fit()
            modes.append(model.variational_strategy.mode)
        torch.testing.assert_close(modes[0], modes[1], rtol=1e-8, atol=1e-10)
    assert spies["fused"] > 0 and spies["chunked"] > 0


# ---------------------------------------------------------------------------------------------------
# The Triton kernel: in Triton's interpreter on CPU tensors, and compiled on a GPU.
# ---------------------------------------------------------------------------------------------------
INTERPRETED = textwrap.dedent(
    """
    import itertools, torch
    from gpytorch_iterncgp import settings
    from gpytorch_iterncgp.core.kernel_products import fused_kernel_matmul
    from tests.core.test_kernel_products import KERNELS, assert_matches_dense, inputs, make_kernel

    for dtype, kind, (width, ard, batch) in itertools.product(
        [torch.float32, torch.float64], KERNELS, [(1, False, ()), (3, True, ()), (20, True, (3,))]
    ):
        kernel = make_kernel(kind, dtype, ard=ard, batch=batch)
        x1, x2, rhs = inputs(dtype, rows=70, cols=50, width=width, batch=batch)
        with torch.no_grad(), settings.fused_kernel_backend("triton"):
            product = fused_kernel_matmul(kernel(x1, x2), rhs)
        assert_matches_dense(kernel, x1, x2, rhs, product)
    print("ok")
    """
)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="on a GPU the compiled kernel is tested instead (test_triton_kernel_on_cuda_equals_dense_product); the "
    "interpreter of the Triton on the project's GPU machine fails on the kernel's runtime loop bound (TypeError: only "
    "0-dimensional arrays can be converted to Python scalars)",
)
@pytest.mark.slow  # about 8 s
def test_triton_kernel_in_the_interpreter_equals_dense_product():
    """Every kernel and dtype, widths 1 and 3 (broadcast sums) and 20 (``tl.dot``, two width blocks), per-class."""
    environment = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [root, environment.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", INTERPRETED], env=environment, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_package_imports_without_triton():
    """Triton is imported only when a fused product runs on its path (GPyTorch itself imports pykeops if present)."""
    code = "import sys, gpytorch_iterncgp; print(sorted({'triton'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "triton" not in result.stdout, result.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_triton_kernel_on_cuda_equals_dense_product(dtype):
    for kind, (width, ard, batch) in itertools.product(KERNELS, [(1, False, ()), (10, True, ()), (20, True, (3,))]):
        kernel = make_kernel(kind, dtype, ard=ard, batch=batch)
        x1, x2, rhs = inputs(dtype, rows=700, cols=500, width=width, batch=batch)
        with torch.no_grad():
            product = fused_kernel_matmul(kernel.cuda()(x1.cuda(), x2.cuda()), rhs.cuda())
        assert_matches_dense(kernel.cpu(), x1, x2, rhs, product.cpu())
