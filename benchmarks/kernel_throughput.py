"""Throughput of one product with K (kernel entries per second): KeOps, chunked torch, cached dense.

    python benchmarks/kernel_throughput.py              # N in {1e4, 5e4}, C = 10 right-hand sides
    python benchmarks/kernel_throughput.py --sizes 2000 5000 --repeats 2

A product with K is one N × N kernel (Matérn-3/2 on 3-D inputs, as in the paper's large-scale
experiment) times an N × C block. Three paths:

* ``keops``: ``gpytorch.kernels.keops.MaternKernel``, evaluated on the fly by KeOps (if installed);
* ``chunked``: GPyTorch's kernel in row chunks (``dense_kernel_limit`` forces the chunked path), the
  N × N matrix is never formed;
* ``dense``: the whole kernel evaluated once and cached (only where it fits in memory), then BLAS.

Writes ``benchmarks/results/kernel_throughput.json`` with the machine it ran on, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import gpytorch
import torch
from common import machine

from gpytorch_iterncgp.prior import LatentPrior
from gpytorch_iterncgp.settings import dense_kernel_limit

RESULTS = Path(__file__).resolve().parent / "results"


def peak_flops_estimate(dtype: torch.dtype) -> float:
    """Measured matmul FLOP/s on this CPU (a 2000 × 2000 product), for comparison."""
    a = torch.randn(2000, 2000, dtype=dtype)
    a @ a
    start = time.perf_counter()
    for _ in range(3):
        a @ a
    return 3 * 2 * 2000**3 / (time.perf_counter() - start)


def time_product(kernel, x, rhs, path: str, repeats: int) -> float:
    """Seconds per product with K (the first, compiling/evaluating product excluded for keops/dense)."""
    mean = torch.zeros(len(x), dtype=x.dtype)
    limit = 0 if path == "chunked" else 2**62
    with torch.no_grad(), dense_kernel_limit(limit), gpytorch.settings.max_cholesky_size(0):
        prior = LatentPrior.from_distribution(
            gpytorch.distributions.MultivariateNormal(mean, kernel(x)), rhs.shape[0] // len(x)
        )
        prior.matmul(rhs)  # warm-up: KeOps compiles, the dense path evaluates and caches K
        start = time.perf_counter()
        for _ in range(repeats):
            prior.matmul(rhs)
    return (time.perf_counter() - start) / repeats


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 50_000])
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--dense-limit-gb", type=float, default=4.0, help="skip the dense path above this size")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    paths = {"chunked": gpytorch.kernels.MaternKernel(nu=1.5)}
    try:
        import pykeops  # noqa: F401

        paths["keops"] = gpytorch.kernels.keops.MaternKernel(nu=1.5)
    except ImportError:
        print("pykeops is not installed: no KeOps row")
    paths["dense"] = gpytorch.kernels.MaternKernel(nu=1.5)
    rows = []
    for size in args.sizes:
        x = torch.rand(size, 3, dtype=dtype) * 2 - 1
        rhs = torch.randn(size * args.classes, 1, dtype=dtype)
        for path, base in paths.items():
            if path == "dense" and size**2 * dtype.itemsize > args.dense_limit_gb * 2**30:
                continue
            kernel = gpytorch.kernels.ScaleKernel(base).to(dtype)
            kernel.base_kernel.lengthscale = 0.05
            seconds = time_product(kernel, x, rhs, path, args.repeats)
            rows.append(
                {
                    "N": size,
                    "C": args.classes,
                    "path": path,
                    "seconds_per_product": seconds,
                    "entries_per_second": size**2 / seconds,
                }
            )
            print(f"N={size:>7}  {path:>8}: {seconds:8.3f} s per product, {size**2 / seconds:.3g} kernel entries/s")
    peak = peak_flops_estimate(dtype)
    print(f"matmul peak on this CPU ({args.dtype}): {peak:.3g} FLOP/s")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "kernel_throughput.json"
    path.write_text(
        json.dumps({"machine": machine(), "dtype": args.dtype, "matmul_flops": peak, "rows": rows}, indent=2)
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
