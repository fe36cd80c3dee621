"""``KumaraswamyWarpedKernel`` (``gpytorch_iterncgp.kernels.warping``): the warp against torch's Kumaraswamy CDF of the
normal CDF, the kernel against its base kernel of warped inputs, finite gradients in the tails, gradients against
central differences, the state_dict, the argument checks."""

from __future__ import annotations

import copy
import pickle

import gpytorch
import pytest
import torch

from gpytorch_iterncgp.kernels.warping import KumaraswamyWarpedKernel

TOLERANCES = {torch.float32: 1e-5, torch.float64: 1e-12}


def _kernel(dtype: torch.dtype = torch.float64) -> KumaraswamyWarpedKernel:
    """A warped Matérn-5/2 of 3 features, lengthscale 0.4, concentrations :math:`a = (0.5, 1, 3)`,
    :math:`b = (2, 0.7, 1)`."""
    kernel = KumaraswamyWarpedKernel(gpytorch.kernels.MaternKernel(nu=2.5), 3).to(dtype)
    kernel.base_kernel.lengthscale = 0.4
    kernel.concentration1 = torch.tensor([0.5, 1.0, 3.0])
    kernel.concentration0 = torch.tensor([2.0, 0.7, 1.0])
    return kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_warp_is_the_kumaraswamy_cdf_of_the_normal_cdf(dtype):
    kernel = _kernel(dtype)
    x = torch.randn(50, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    reference = torch.distributions.Kumaraswamy(
        kernel.concentration1.detach().double(), kernel.concentration0.detach().double()
    ).cdf(torch.special.ndtr(x))
    warped = kernel.warp(x.to(dtype)).detach()
    assert warped.dtype == dtype
    torch.testing.assert_close(warped.double(), reference, rtol=0, atol=TOLERANCES[dtype] * 10)
    for feature in range(3):  # monotone increasing in each feature
        order = x[:, feature].argsort()
        assert bool((warped[order, feature].diff() >= 0).all())


def test_unit_concentrations_are_the_normal_cdf_and_on_the_unit_cube_the_identity():
    x = torch.randn(20, 2, dtype=torch.float64)
    kernel = KumaraswamyWarpedKernel(gpytorch.kernels.RBFKernel(), 2).double()
    kernel.concentration1 = kernel.concentration0 = 1.0  # (the initial raw values were rounded to float32)
    torch.testing.assert_close(kernel.warp(x), torch.special.ndtr(x), rtol=0, atol=1e-14)
    cube = KumaraswamyWarpedKernel(gpytorch.kernels.RBFKernel(), 2, unit_cube=True).double()
    cube.concentration1 = cube.concentration0 = 1.0
    u = torch.rand(20, 2, dtype=torch.float64)
    torch.testing.assert_close(cube.warp(u), u, rtol=0, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_kernel_is_its_base_kernel_of_the_warped_inputs(dtype):
    kernel = gpytorch.kernels.ScaleKernel(_kernel(dtype)).to(dtype)
    kernel.outputscale = 2.5
    generator = torch.Generator().manual_seed(2)
    x1, x2 = torch.randn(7, 3, generator=generator).to(dtype), torch.randn(5, 3, generator=generator).to(dtype)
    base = gpytorch.kernels.MaternKernel(nu=2.5).to(dtype)
    base.lengthscale = 0.4
    warp = kernel.base_kernel.warp
    with torch.no_grad():
        reference = 2.5 * base(warp(x1), warp(x2)).to_dense()
        torch.testing.assert_close(kernel(x1, x2).to_dense(), reference, rtol=0, atol=TOLERANCES[dtype])
        torch.testing.assert_close(kernel(x1, diag=True), torch.full((7,), 2.5, dtype=dtype), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inputs_far_in_the_tails_have_finite_values_and_gradients(dtype):
    """Standardised features of 40 standard deviations (a heavy-tailed column): :math:`\\Phi(40)` rounds to 1, and
    the log-space warp keeps the kernel and its gradients finite."""
    kernel = _kernel(dtype)
    x = torch.tensor([[-45.0, 0.0, 40.0], [40.0, -40.0, 3.0], [0.5, 45.0, -2.0]], dtype=dtype, requires_grad=True)
    matrix = kernel(x).to_dense()
    matrix.sum().backward()
    assert bool(torch.isfinite(matrix).all())
    gradients = [x.grad, *(parameter.grad for parameter in kernel.parameters())]
    assert all(bool(torch.isfinite(gradient).all()) for gradient in gradients)


def test_the_gradients_equal_central_differences():
    kernel = _kernel()
    x = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    weights = torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    def value() -> torch.Tensor:
        return (kernel(x).to_dense() * weights).sum()

    value().backward()
    step = 1e-6
    for parameter in kernel.parameters():
        gradient = parameter.grad.clone()
        for index in range(parameter.numel()):
            with torch.no_grad():
                parameter.view(-1)[index] += step
                upper = float(value())
                parameter.view(-1)[index] -= 2 * step
                lower = float(value())
                parameter.view(-1)[index] += step
            assert gradient.view(-1)[index].item() == pytest.approx((upper - lower) / (2 * step), rel=1e-6, abs=1e-9)


def test_the_state_dict_round_trips():
    kernel = _kernel()
    other = KumaraswamyWarpedKernel(gpytorch.kernels.MaternKernel(nu=2.5), 3).double()
    other.load_state_dict(kernel.state_dict())
    x = torch.randn(4, 3, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(other(x).to_dense(), kernel(x).to_dense(), rtol=0, atol=0)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="num_dims must be a positive int"):
        KumaraswamyWarpedKernel(gpytorch.kernels.RBFKernel(), 0)
    with pytest.raises(ValueError, match="inputs have 4 features"):
        KumaraswamyWarpedKernel(gpytorch.kernels.RBFKernel(), 3)(torch.randn(5, 4)).to_dense()


def _reference_warp(kernel: KumaraswamyWarpedKernel, x: torch.Tensor) -> torch.Tensor:
    """The warp by torch.distributions (nothing kept)."""
    a, b = kernel.concentration1.detach(), kernel.concentration0.detach()
    return torch.distributions.Kumaraswamy(a, b).cdf(torch.special.ndtr(x))


def test_the_inputs_log_cdf_is_kept_only_while_the_inputs_are_unchanged(monkeypatch):
    """log Φ(x) is kept for the last inputs (matched by memory and version, never by value); w(x), which depends on
    the concentrations too, is computed at every call, on every device alike."""
    kernel = _kernel()
    x = torch.randn(40, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    calls = []
    log_ndtr = torch.special.log_ndtr
    monkeypatch.setattr(torch.special, "log_ndtr", lambda t: calls.append(t.shape) or log_ndtr(t))
    with torch.no_grad():
        first = kernel.warp(x)
        for view in (x[:, :], x.view(40, 3)):  # other views of the same memory
            assert torch.equal(kernel.warp(view), first)
        kernel(x, x[:5]).to_dense()  # the pivot columns' pattern: the inputs kept beside each other block
        kernel(x, x[5:6]).to_dense()
        assert torch.equal(kernel.warp(x), first)
        assert calls == [(40, 3), (5, 3), (1, 3)]
        torch.testing.assert_close(first, _reference_warp(kernel, x), rtol=0, atol=1e-12)
        x.mul_(0.5)  # in place: a new version
        torch.testing.assert_close(kernel.warp(x), _reference_warp(kernel, x), rtol=0, atol=1e-12)
        kernel.concentration1 = torch.tensor([2.0, 1.0, 0.5])  # GPyTorch's initialize (no version change)
        torch.testing.assert_close(kernel.warp(x), _reference_warp(kernel, x), rtol=0, atol=1e-12)
        kernel.raw_concentration0.add_(0.3)  # as an optimiser's step
        torch.testing.assert_close(kernel.warp(x), _reference_warp(kernel, x), rtol=0, atol=1e-12)
        count = len(calls)
        kernel.warp(x.clone())  # the same values in other memory: not matched
        assert len(calls) == count + 1
    warped = kernel.warp(x)  # gradients recorded: a new graph each time, log u(x) kept
    assert warped.requires_grad and kernel.warp(x) is not warped
    torch.autograd.grad(warped.sum(), kernel.raw_concentration1)
    inputs = x.clone().requires_grad_(True)  # inputs that require gradients: nothing kept
    count = len(calls)
    kernel.warp(inputs), kernel.warp(inputs)
    assert len(calls) == count + 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_inputs_log_cdf_is_kept_as_on_the_cpu(monkeypatch):
    kernel = _kernel().cuda()
    x = torch.randn(40, 3, dtype=torch.float64, device="cuda")
    calls = []
    log_ndtr = torch.special.log_ndtr
    monkeypatch.setattr(torch.special, "log_ndtr", lambda t: calls.append(t.shape) or log_ndtr(t))
    with torch.no_grad():
        first = kernel.warp(x)
        kernel.concentration1 = torch.tensor([2.0, 1.0, 0.5])
        second = kernel.warp(x)
    assert calls == [(40, 3)] and not torch.equal(second, first)  # the concentrations changed: w(x) with them
    torch.testing.assert_close(second.cpu(), _reference_warp(kernel.cpu(), x.cpu()), rtol=0, atol=1e-12)


def test_copies_and_pickles_of_the_kernel_keep_no_inputs():
    kernel = _kernel()
    x = torch.randn(30, 3, dtype=torch.float64)
    with torch.no_grad():
        kernel(x, x).to_dense()
    assert kernel._last_log_u.entries
    for other in (copy.deepcopy(kernel), pickle.loads(pickle.dumps(kernel))):
        assert not other._last_log_u.entries
        with torch.no_grad():
            torch.testing.assert_close(other(x, x).to_dense(), kernel(x, x).to_dense(), rtol=0, atol=0)
