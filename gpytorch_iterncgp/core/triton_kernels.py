r"""Triton kernel for products with a stationary kernel matrix that never forms the matrix.

For inputs already divided by their lengthscales, :math:`\tilde{\mathbf x}_i = \mathbf x_i / \boldsymbol\ell`,
each program computes a ``BLOCK_N`` row block of

.. math::

    \mathbf Y = \sigma^2\, k(\tilde{\mathbf X}_1, \tilde{\mathbf X}_2)\, \mathbf R, \qquad
    k(r) \in \bigl\{ e^{-r^2/2},\; e^{-r},\; (1 + \sqrt3 r) e^{-\sqrt3 r},\;
    (1 + \sqrt5 r + \tfrac53 r^2) e^{-\sqrt5 r} \bigr\}

(RBF; Matérn :math:`\nu = \tfrac12, \tfrac32, \tfrac52`; Rasmussen & Williams 2006, eqs. 4.9, 4.14, 4.17): it loops
over ``BLOCK_M`` column blocks, forms the ``BLOCK_N × BLOCK_M`` tile of squared distances from direct coordinate
differences :math:`\sum_d (\tilde x_{1,id} - \tilde x_{2,jd})^2` (no cancellation, so exact at :math:`r = 0`),
applies :math:`k` and accumulates the tile times the matching ``BLOCK_M × BLOCK_W`` block of :math:`\mathbf R` in
registers, with ``tl.dot`` for ``BLOCK_W ≥ 16`` and a broadcast sum below. Only :math:`\mathbf Y` is written.

Triton is optional: this module imports it and is itself imported only when a fused product runs on the Triton path.
The same kernel runs on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
imported), which is how the tests check it without a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["KIND_CODES", "interpreting", "stationary_matmul"]

KIND_CODES = {"rbf": 0, "matern12": 1, "matern32": 2, "matern52": 3}


def _stationary_matmul_kernel(  # pragma: no cover - traced by Triton, not run by Python
    x1_ptr,
    x2_ptr,
    rhs_ptr,
    out_ptr,
    scale_ptr,
    num_rows,
    num_cols,
    width,
    stride_x1b,
    stride_x1n,
    stride_x1d,
    stride_x2b,
    stride_x2m,
    stride_x2d,
    stride_rb,
    stride_rm,
    stride_rw,
    stride_ob,
    stride_on,
    stride_ow,
    DIM: tl.constexpr,  # input dimension D
    KIND: tl.constexpr,  # KIND_CODES
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,  # power of two; tl.dot needs >= 16
    USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee", "tf32x3" or "tf32" (float32 on CUDA only)
):
    batch = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    outs = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    row_mask = rows < num_rows
    out_mask = outs < width
    x1_base = x1_ptr + batch * stride_x1b + rows * stride_x1n
    x2_base = x2_ptr + batch * stride_x2b
    rhs_base = rhs_ptr + batch * stride_rb
    dtype = x1_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=dtype)
    for start in range(0, num_cols, BLOCK_M):
        cols = start + tl.arange(0, BLOCK_M)
        col_mask = cols < num_cols
        sq_dist = tl.zeros((BLOCK_N, BLOCK_M), dtype=dtype)
        for d in tl.static_range(DIM):
            a = tl.load(x1_base + d * stride_x1d, mask=row_mask, other=0.0)
            b = tl.load(x2_base + cols * stride_x2m + d * stride_x2d, mask=col_mask, other=0.0)
            diff = a[:, None] - b[None, :]
            sq_dist += diff * diff
        if KIND == 0:
            tile = tl.exp(-0.5 * sq_dist)
        else:
            s = tl.sqrt(sq_dist)
            if KIND == 1:
                tile = tl.exp(-s)
            elif KIND == 2:
                s = s * 1.7320508075688772
                tile = (1.0 + s) * tl.exp(-s)
            else:
                s = s * 2.23606797749979
                tile = (1.0 + s + s * s * 0.3333333333333333) * tl.exp(-s)
        rhs = tl.load(
            rhs_base + cols[:, None] * stride_rm + outs[None, :] * stride_rw,
            mask=col_mask[:, None] & out_mask[None, :],
            other=0.0,
        )
        if USE_DOT:
            acc += tl.dot(tile.to(dtype), rhs, input_precision=PRECISION)
        else:
            acc += tl.sum(tile.to(dtype)[:, :, None] * rhs[None, :, :], axis=1)
    acc = acc * tl.load(scale_ptr + batch)
    out = out_ptr + batch * stride_ob + rows[:, None] * stride_on + outs[None, :] * stride_ow
    tl.store(out, acc, mask=row_mask[:, None] & out_mask[None, :])


_CONFIGS = [  # (BLOCK_N, BLOCK_M, num_warps, num_stages), tried once per key by triton.autotune on CUDA
    (64, 64, 4, 2),
    (128, 64, 4, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (64, 128, 4, 3),
    (256, 64, 8, 2),
]


def interpreting() -> bool:
    """Whether Triton runs in its interpreter: ``TRITON_INTERPRET=1`` was set before triton was imported."""
    return bool(triton.knobs.runtime.interpret)


@functools.cache
def _kernel() -> Any:
    """The Triton kernel: interpreted (CPU tensors) or compiled and autotuned over ``_CONFIGS`` (CUDA)."""
    if interpreting():
        return triton.jit(_stationary_matmul_kernel)
    configs = [
        triton.Config({"BLOCK_N": n, "BLOCK_M": m}, num_warps=warps, num_stages=stages)
        for n, m, warps, stages in _CONFIGS
    ]
    return triton.autotune(configs, key=["DIM", "KIND", "BLOCK_W", "USE_DOT", "PRECISION"])(
        triton.jit(_stationary_matmul_kernel)
    )


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s float32 precision from ``torch.get_float32_matmul_precision()`` (highest → IEEE)."""
    if dtype != torch.float32:
        return "ieee"
    return {"highest": "ieee", "high": "tf32x3", "medium": "tf32"}[torch.get_float32_matmul_precision()]


def stationary_matmul(
    kind: str,
    x1: Tensor,  # shape: (B, N, D), divided by the lengthscales
    x2: Tensor,  # shape: (B, M, D)
    outputscale: Tensor,  # shape: (B,)
    rhs: Tensor,  # shape: (B, M, W)
) -> Tensor:  # shape: (B, N, W)
    r""":math:`\sigma_b^2 k(\tilde{\mathbf X}_{1,b}, \tilde{\mathbf X}_{2,b}) \mathbf R_b` for each batch entry ``b``.

    :param kind: one of :data:`KIND_CODES`.
    :raises RuntimeError: for CPU tensors unless Triton interprets (``TRITON_INTERPRET=1`` before its import).
    """
    interpret = interpreting()
    if x1.device.type == "cpu" and not interpret:
        raise RuntimeError(
            "The Triton kernel runs on CPU tensors only in Triton's interpreter: set TRITON_INTERPRET=1 before "
            "triton is first imported (or use the compiled CPU path)."
        )
    batch, num_rows, dim = x1.shape
    num_cols, width = rhs.shape[-2:]
    out = torch.empty(batch, num_rows, width, dtype=x1.dtype, device=x1.device)
    block_w = 1 << max(0, (width - 1).bit_length())
    use_dot = block_w >= 16
    block_w = min(block_w, 64)
    meta = dict(DIM=dim, KIND=KIND_CODES[kind], BLOCK_W=block_w, USE_DOT=use_dot, PRECISION=_precision(x1.dtype))
    kernel = _kernel()
    if interpret:
        meta.update(BLOCK_N=32, BLOCK_M=32)

    def grid(config: dict[str, int]) -> tuple[int, int, int]:
        return (-(-num_rows // config["BLOCK_N"]), -(-width // block_w), batch)

    kernel[grid](
        x1,
        x2,
        rhs,
        out,
        outputscale.contiguous(),
        num_rows,
        num_cols,
        width,
        *x1.stride(),
        *x2.stride(),
        *rhs.stride(),
        *out.stride(),
        **meta,
    )
    return out
