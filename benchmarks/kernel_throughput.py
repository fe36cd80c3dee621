"""Throughput of one product with K (kernel entries per second): fused, chunked torch, KeOps, cached dense.

    python -m benchmarks.kernel_throughput                        # CPU: N in {1e4, 1e5}, C in {1, 10}
    python -m benchmarks.kernel_throughput --device cuda          # the same on a GPU (fused: IEEE and TF32)
    python -m benchmarks.kernel_throughput --sizes 2000 --classes 3 --paths fused chunked --repeats 1

A product with K is one N × N kernel (Matérn-3/2 on 3-D inputs, lengthscale 0.05 in a ScaleKernel, as in
the paper's large-scale experiment) times an N × C block (one kernel shared by C classes), through
``LatentPrior.matmul`` as IterNCGP calls it. Paths:

* ``fused``: ``gpytorch_iterncgp.core.kernel_products``, N × N never formed: a Triton kernel on CUDA (float32 dot
  products in IEEE precision), the ``torch.compile``d blocked loop on CPU;
* ``fused-tf32`` (CUDA only): the Triton kernel with ``torch.set_float32_matmul_precision("medium")`` (TF32
  tile products);
* ``chunked``: GPyTorch's kernel in row chunks (``fused_kernel_products`` off), N × N never formed;
* ``keops``: ``gpytorch.kernels.keops.MaternKernel``, evaluated on the fly by KeOps (if installed);
* ``dense``: the whole kernel evaluated once and cached (only where it fits in ``--dense-limit-gb``), then BLAS.

Each path is warmed up first (the fused path compiles, KeOps compiles, on a 2000-point problem; the dense
path evaluates and caches K), then timed over ``--repeats`` products. A path whose estimated time at a size
(from its throughput at the previous size) exceeds ``--time-cap`` seconds is skipped and reported as such.
Writes ``benchmarks/results/kernel_throughput[_cuda].json`` and ``.png``, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpytorch
import torch

from benchmarks.common import machine
from gpytorch_iterncgp.core.prior import LatentPrior
from gpytorch_iterncgp.settings import dense_kernel_limit, fused_kernel_products

RESULTS = Path(__file__).resolve().parent / "results"
PATHS = ("fused", "fused-tf32", "chunked", "keops", "dense")


def peak_flops_estimate(dtype: torch.dtype, device: torch.device) -> float:
    """Measured matmul FLOP/s on this device (a 4000 × 4000 product), for comparison."""
    a = torch.randn(4000, 4000, dtype=dtype, device=device)
    a @ a
    _sync(device)
    start = time.perf_counter()
    for _ in range(3):
        a @ a
    _sync(device)
    return 3 * 2 * 4000**3 / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_kernel(path: str, dtype: torch.dtype, device: torch.device) -> gpytorch.kernels.Kernel:
    base = gpytorch.kernels.keops.MaternKernel(nu=1.5) if path == "keops" else gpytorch.kernels.MaternKernel(nu=1.5)
    kernel = gpytorch.kernels.ScaleKernel(base).to(dtype=dtype, device=device)
    kernel.base_kernel.lengthscale = 0.05
    return kernel


def prior(kernel: gpytorch.kernels.Kernel, x: torch.Tensor, classes: int) -> LatentPrior:
    mean = torch.zeros(len(x), dtype=x.dtype, device=x.device)
    return LatentPrior.from_distribution(gpytorch.distributions.MultivariateNormal(mean, kernel(x)), classes)


def time_product(path: str, x: torch.Tensor, classes: int, repeats: int) -> tuple[float, float]:
    """(seconds per product, seconds of the warm-up: compiling, or evaluating and caching K for dense)."""
    kernel = make_kernel(path, x.dtype, x.device)
    rhs = torch.randn(len(x) * classes, 1, dtype=x.dtype, device=x.device)
    limit = 2**62 if path == "dense" else 0
    precision = torch.get_float32_matmul_precision()
    if path == "fused-tf32":
        torch.set_float32_matmul_precision("medium")
    try:
        with (
            torch.no_grad(),
            dense_kernel_limit(limit),
            fused_kernel_products(path.startswith("fused")),
            gpytorch.settings.max_cholesky_size(0),
        ):
            start = time.perf_counter()
            if path == "dense":
                latent = prior(kernel, x, classes)
                latent.matmul(rhs)
            else:  # compile (fused, KeOps) on a small problem: the compiled code does not depend on N
                small = min(len(x), 2000)
                prior(kernel, x[:small], classes).matmul(rhs[: small * classes])
                latent = prior(kernel, x, classes)
            _sync(x.device)
            warm_up = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(repeats):
                latent.matmul(rhs)
            _sync(x.device)
    finally:
        torch.set_float32_matmul_precision(precision)
    return (time.perf_counter() - start) / repeats, warm_up


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    measured = [row for row in rows if row.get("entries_per_second")]
    for name in PATHS:
        for classes, marker in zip(sorted({row["C"] for row in measured}), "os^v", strict=False):
            points = sorted(
                (row["N"], row["entries_per_second"]) for row in measured if row["path"] == name and row["C"] == classes
            )
            if points:
                ax.plot(*zip(*points, strict=True), marker=marker, label=f"{name}, C = {classes}")
    ax.set(xscale="log", yscale="log", xlabel="N", ylabel="kernel entries per second", title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--classes", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=None, help="default: all that apply")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--time-cap", type=float, default=600.0, help="skip a path estimated to take longer (s)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--dense-limit-gb", type=float, default=4.0, help="skip the dense path above this size")
    parser.add_argument("--note", default="", help="stored with the results (e.g. 'machine shared with 5 jobs')")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default results/kernel_throughput*.json)")
    args = parser.parse_args()
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    paths = list(args.paths or [p for p in PATHS if device.type == "cuda" or p != "fused-tf32"])
    if "keops" in paths:
        try:
            import pykeops  # noqa: F401
        except ImportError:
            print("pykeops is not installed: no KeOps row")
            paths.remove("keops")
    torch.manual_seed(0)
    rows: list[dict] = []
    for classes in args.classes:
        throughput: dict[str, float] = {}
        for size in sorted(args.sizes):
            x = (torch.rand(size, 3, dtype=dtype) * 2 - 1).to(device)
            for path in paths:
                row = {"N": size, "C": classes, "path": path}
                estimate = size**2 * (args.repeats + 1) / throughput[path] if path in throughput else 0.0
                if path == "dense" and size**2 * dtype.itemsize > args.dense_limit_gb * 2**30:
                    row["skipped"] = f"dense K needs {size**2 * dtype.itemsize / 2**30:.0f} GiB"
                elif estimate > args.time_cap:
                    row["skipped"] = f"estimated {estimate:.0f} s > --time-cap {args.time_cap:.0f} s"
                else:
                    seconds, warm_up = time_product(path, x, classes, args.repeats)
                    throughput[path] = size**2 / seconds
                    row.update(seconds_per_product=seconds, entries_per_second=size**2 / seconds, warm_up_s=warm_up)
                rows.append(row)
                if "skipped" in row:
                    print(f"N={size:>7} C={classes:>3} {path:>10}: skipped ({row['skipped']})", flush=True)
                else:
                    print(
                        f"N={size:>7} C={classes:>3} {path:>10}: {row['seconds_per_product']:9.4f} s per product, "
                        f"{row['entries_per_second']:.3g} kernel entries/s (warm-up {warm_up:.1f} s)",
                        flush=True,
                    )
    peak = peak_flops_estimate(dtype, device)
    print(f"matmul peak on this device ({args.dtype}): {peak:.3g} FLOP/s")
    info = machine()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    RESULTS.mkdir(exist_ok=True)
    out = args.out or RESULTS / f"kernel_throughput{'_cuda' if device.type == 'cuda' else ''}.json"
    result = {"machine": info, "device": str(device), "dtype": args.dtype, "matmul_flops": peak, "note": args.note}
    out.write_text(json.dumps(result | {"rows": rows}, indent=2))
    plot(rows, out.with_suffix(".png"), f"Matérn-3/2 products, {info.get('gpu', info['cpu'])}")
    print(f"saved {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
