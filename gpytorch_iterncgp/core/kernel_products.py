r"""Fused products with stationary kernel matrices: :math:`\mathbf K \mathbf R` without forming :math:`\mathbf K`.

IterNCGP's cost is its products with the kernel matrix (one per solver iteration). Above
:class:`~gpytorch_iterncgp.settings.dense_kernel_limit` the kernel cannot be cached, and GPyTorch evaluates it in
row chunks, writing every chunk to memory and reading it back for the product. For the stationary kernels
GPyTorch ships,

.. math::

    \mathbf K_{ij} = \sigma^2 k(r_{ij}), \qquad r_{ij}^2 = \sum_d (x_{1,id} - x_{2,jd})^2 / \ell_d^2, \qquad
    k(r) \in \bigl\{ e^{-r^2/2},\; e^{-r},\; (1 + \sqrt3 r) e^{-\sqrt3 r},\; (1 + \sqrt5 r + \tfrac53 r^2)
    e^{-\sqrt5 r} \bigr\}

(``RBFKernel``, ``MaternKernel`` with :math:`\nu = \tfrac12, \tfrac32, \tfrac52`, Rasmussen & Williams 2006,
eqs. 4.9, 4.14, 4.17; ARD or shared lengthscale :math:`\boldsymbol\ell`, optionally in a ``ScaleKernel``
with outputscale :math:`\sigma^2`), the product is computed tile by tile instead, each tile of :math:`\mathbf K`
evaluated, multiplied and dropped while it is in cache (on CUDA: in registers):

* CUDA: a Triton kernel (:mod:`gpytorch_iterncgp.core.triton_kernels`);
* CPU: a blocked loop over ``1024 × 256`` tiles (1 MiB in float32, within a core's L2 cache), each tile's
  distances and kernel one ``torch.compile``\ d function, its product with :math:`\mathbf R` BLAS. If it cannot
  compile, the same loop runs uncompiled (with a ``PerformanceWarning``). Each tile is one OpenMP parallel
  region of about a millisecond: on a machine shared with other jobs, set ``OMP_WAIT_POLICY=PASSIVE`` (GNU
  OpenMP's spinning threads otherwise wait for descheduled ones; ``docs/design_notes.md``).

Distances come from direct coordinate differences, not :math:`\|a\|^2 + \|b\|^2 - 2 a^\top b`, so the kernel is
accurate to rounding at :math:`r = 0` too. :func:`stationary_kernel` recognises a supported covariance (``None``
for any other, which keeps GPyTorch's chunked product); :func:`fused_kernel_matmul` multiplies. No gradient flows
through a fused product: it is used where none is recorded (fits and predictions).
"""

from __future__ import annotations

import functools
import math
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from gpytorch.kernels import Kernel, MaternKernel, RBFKernel, ScaleKernel
from gpytorch.lazy import LazyEvaluatedKernelTensor
from linear_operator.operators import LinearOperator
from linear_operator.utils.warnings import PerformanceWarning
from torch import Tensor

from .. import settings

__all__ = ["KINDS", "StationaryKernel", "fused_kernel_matmul", "stationary_matmul", "stationary_kernel"]

KINDS = ("rbf", "matern12", "matern32", "matern52")
_MATERN_KINDS = {0.5: "matern12", 1.5: "matern32", 2.5: "matern52"}
CPU_TILE = (1024, 256)  # (columns M, rows N) of K per tile on CPU: 1 MiB in float32


@dataclass(frozen=True)
class StationaryKernel:
    r"""A stationary kernel matrix :math:`\sigma_b^2 k(\tilde{\mathbf X}_{1,b}, \tilde{\mathbf X}_{2,b})` per batch entry.

    :param kind: one of :data:`KINDS`.
    :param x1: row inputs divided by the lengthscales, ``(B, N, D)``.
    :param x2: column inputs divided by the lengthscales, ``(B, M, D)``.
    :param outputscale: :math:`\sigma_b^2`, ``(B,)`` (ones without a ``ScaleKernel``).
    :param batch_shape: the kernel matrix's batch shape (``B`` is its product).
    """

    kind: str
    x1: Tensor
    x2: Tensor
    outputscale: Tensor
    batch_shape: torch.Size


def _kind(kernel: Kernel) -> str | None:
    if kernel.active_dims is not None:
        return None
    if type(kernel) is RBFKernel:
        return "rbf"
    if type(kernel) is MaternKernel:
        return _MATERN_KINDS.get(float(kernel.nu))
    return None


def stationary_kernel(covariance: LinearOperator) -> StationaryKernel | None:
    """The fused form of a lazily evaluated RBF or Matérn kernel matrix; ``None`` for anything else.

    Supported: a ``LazyEvaluatedKernelTensor`` of ``RBFKernel`` or ``MaternKernel(nu ∈ {0.5, 1.5, 2.5})``, alone or
    in a ``ScaleKernel``, without ``active_dims``, with any lengthscale shape (shared or ARD) and batch shape
    (one kernel, or a batch of per-class kernels). Subclasses are not recognised (they may change the forward).
    """
    if not isinstance(covariance, LazyEvaluatedKernelTensor):
        return None
    if getattr(covariance, "last_dim_is_batch", False) or covariance.params.get("diag", False):
        return None
    kernel, outputscale = covariance.kernel, None
    if type(kernel) is ScaleKernel:
        if kernel.active_dims is not None:
            return None
        kernel, outputscale = kernel.base_kernel, kernel.outputscale
    kind = _kind(kernel)
    x1, x2 = covariance.x1, covariance.x2
    if kind is None or x1.dtype != x2.dtype or not x1.dtype.is_floating_point:
        return None
    lengthscale = kernel.lengthscale.to(x1.dtype)  # (*kernel batch, 1, D or 1)
    batch_shape = covariance.batch_shape
    num_rows, num_cols, dim = x1.shape[-2], x2.shape[-2], x1.shape[-1]
    batch = batch_shape.numel()
    with torch.no_grad():
        scaled1 = (x1 / lengthscale).expand(*batch_shape, num_rows, dim).reshape(batch, num_rows, dim)
        scaled2 = (x2 / lengthscale).expand(*batch_shape, num_cols, dim).reshape(batch, num_cols, dim)
        scale = torch.ones((), dtype=x1.dtype, device=x1.device) if outputscale is None else outputscale.to(x1.dtype)
        scale = scale.expand(batch_shape).reshape(batch)
    return StationaryKernel(kind, scaled1, scaled2, scale, batch_shape)


def _profile(kind: str, sq_dist: Tensor) -> Tensor:
    r""":math:`k(r)` from :math:`r^2 \ge 0`."""
    if kind == "rbf":
        return torch.exp(-0.5 * sq_dist)
    distance = sq_dist.sqrt()
    if kind == "matern12":
        return torch.exp(-distance)
    if kind == "matern32":
        scaled = math.sqrt(3.0) * distance
        return (1.0 + scaled) * torch.exp(-scaled)
    scaled = math.sqrt(5.0) * distance
    return (1.0 + scaled + scaled * scaled / 3.0) * torch.exp(-scaled)


def _make_tile(kind: str) -> Callable[[Tensor, Tensor], Tensor]:
    def tile(
        x2_t: Tensor,  # shape: (D, TM)
        x1_t: Tensor,  # shape: (D, TN)
    ) -> Tensor:  # shape: (TM, TN)
        r"""One tile of :math:`k(\mathbf X_2, \mathbf X_1)`, transposed so that its product is one wide GEMM."""
        sq_dist = (x2_t[0][:, None] - x1_t[0][None, :]) ** 2
        for d in range(1, x2_t.shape[0]):
            sq_dist = sq_dist + (x2_t[d][:, None] - x1_t[d][None, :]) ** 2
        return _profile(kind, sq_dist)

    return tile


def _make_step(kind: str, tile: Callable[[Tensor, Tensor], Tensor] | None = None) -> Callable[..., Tensor]:
    """``step(accumulated (W, TN), rhs_t (W, TM), x2_t, x1_t)``: ``accumulated + rhs_t @ tile``, the GEMM in eager
    torch (BLAS): inductor's own code for a product this narrow is slower than its tile plus BLAS
    (``docs/design_notes.md``)."""
    tile = _make_tile(kind) if tile is None else tile

    def step(accumulated: Tensor, rhs_t: Tensor, x2_t: Tensor, x1_t: Tensor) -> Tensor:
        return torch.addmm(accumulated, rhs_t, tile(x2_t, x1_t))

    return step


@functools.cache
def _compiled_step(kind: str, dtype: torch.dtype, dim: int) -> Callable[..., Tensor]:
    r"""The step with its tile ``torch.compile``\ d: one code object per key (Dynamo caches per code object, so
    keys never share its recompile limit); tiles have one shape (inputs are padded), so one graph per key."""
    tile = _make_tile(kind)
    code = tile.__code__.replace(co_name=f"fused_{kind}_tile")
    fresh = types.FunctionType(code, tile.__globals__, code.co_name, tile.__defaults__, tile.__closure__)
    return _make_step(kind, torch.compile(fresh, dynamic=False))


_COMPILE_FAILED: set[tuple[str, torch.dtype, int]] = set()


def _blocks(tensor: Tensor, size: int) -> Tensor:
    """``(B, L, F)`` zero-padded to a multiple of ``size`` rows and split, ``(B, L / size, F, size)`` contiguous."""
    batch, length, features = tensor.shape
    padded = torch.nn.functional.pad(tensor, (0, 0, 0, -length % size))
    return padded.reshape(batch, -1, size, features).transpose(-1, -2).contiguous()


def blocked_matmul(kernel: StationaryKernel, rhs: Tensor, compiled: bool = True) -> Tensor:
    r""":math:`\mathbf K \mathbf R` over ``CPU_TILE`` tiles of :math:`\mathbf K` (``rhs``: ``(B, M, W)``).

    Padding columns meet zero rows of :math:`\mathbf R`; padding rows are cut from the result.
    """
    tile_cols, tile_rows = CPU_TILE
    batch, num_rows, dim = kernel.x1.shape
    width = rhs.shape[-1]
    x1_t = _blocks(kernel.x1, tile_rows)  # (B, nN, D, TN)
    x2_t = _blocks(kernel.x2, tile_cols)  # (B, nM, D, TM)
    rhs_t = _blocks(rhs, tile_cols)  # (B, nM, W, TM)
    key = (kernel.kind, rhs.dtype, dim)
    use_compiled = compiled and key not in _COMPILE_FAILED
    step = _compiled_step(*key) if use_compiled else _make_step(kernel.kind)
    out = torch.empty(batch, x1_t.shape[1], width, tile_rows, dtype=rhs.dtype, device=rhs.device)
    for b in range(batch):
        for i in range(x1_t.shape[1]):
            accumulated = torch.zeros(width, tile_rows, dtype=rhs.dtype, device=rhs.device)
            for j in range(x2_t.shape[1]):
                try:
                    accumulated = step(accumulated, rhs_t[b, j], x2_t[b, j], x1_t[b, i])
                except Exception as error:  # any compiler failure falls back to the uncompiled step
                    if not use_compiled:
                        raise
                    use_compiled, step = False, _make_step(kernel.kind)
                    _COMPILE_FAILED.add(key)
                    warnings.warn(
                        f"torch.compile of the fused kernel product failed ({type(error).__name__}: {error}); "
                        "fused products run uncompiled (slower). Set gpytorch_iterncgp.settings.fused_kernel_backend"
                        '("eager") to skip the attempt.',
                        PerformanceWarning,
                        stacklevel=2,
                    )
                    accumulated = step(accumulated, rhs_t[b, j], x2_t[b, j], x1_t[b, i])
            out[b, i] = accumulated
    out = out.permute(0, 1, 3, 2).reshape(batch, -1, width)[:, :num_rows]
    return out * kernel.outputscale[:, None, None]


def _backend(device: torch.device) -> str:
    backend = settings.fused_kernel_backend.value()
    if backend not in ("auto", "triton", "compile", "eager"):
        raise ValueError(f"fused_kernel_backend must be auto, triton, compile or eager; got {backend!r}.")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "compile"
    return backend


def stationary_matmul(kernel: StationaryKernel, rhs: Tensor) -> Tensor:
    r""":math:`\mathbf K \mathbf R` for a recognised kernel; ``rhs`` is ``(*batch, M, W)`` or ``(M, W)``.

    :return: ``(*batch, N, W)``, the kernel's batch shape broadcast with ``rhs``'s.
    """
    batch_shape = torch.broadcast_shapes(kernel.batch_shape, rhs.shape[:-2])
    num_cols, width = rhs.shape[-2:]
    if batch_shape != kernel.batch_shape:  # rhs brings extra batch dimensions: repeat the kernel's inputs

        def repeat(inputs: Tensor) -> Tensor:
            return inputs.reshape(*kernel.batch_shape, *inputs.shape[1:]).expand(*batch_shape, *inputs.shape[1:])

        scale = kernel.outputscale.reshape(kernel.batch_shape).expand(batch_shape).reshape(-1)
        kernel = StationaryKernel(
            kernel.kind, repeat(kernel.x1).flatten(0, -3), repeat(kernel.x2).flatten(0, -3), scale, batch_shape
        )
    flat_rhs = rhs.expand(*batch_shape, num_cols, width).reshape(-1, num_cols, width)
    backend = _backend(rhs.device)
    if backend == "triton":
        try:
            from . import triton_kernels
        except ImportError:
            if settings.fused_kernel_backend.value() == "triton":
                raise
            backend = "eager" if rhs.device.type == "cuda" else "compile"
        else:
            x1, x2 = (inputs.mT.contiguous().mT for inputs in (kernel.x1, kernel.x2))  # coalesced loads per d
            product = triton_kernels.stationary_matmul(kernel.kind, x1, x2, kernel.outputscale, flat_rhs)
    if backend != "triton":
        product = blocked_matmul(kernel, flat_rhs, compiled=backend == "compile")
    return product.reshape(*batch_shape, -1, width)


def fused_kernel_matmul(covariance: LinearOperator, rhs: Tensor) -> Tensor | None:
    """``covariance @ rhs`` fused, or ``None`` if ``covariance`` is not a supported kernel (or fusing is off).

    See :func:`stationary_kernel` for what is supported and :class:`~gpytorch_iterncgp.settings.fused_kernel_backend`
    for how it runs. No gradient is recorded.
    """
    if settings.fused_kernel_products.off() or rhs.dim() < 2:
        return None
    kernel = stationary_kernel(covariance)
    if kernel is None or kernel.x1.dtype != rhs.dtype or kernel.x1.device != rhs.device:
        return None
    with torch.no_grad():
        return stationary_matmul(kernel, rhs)
