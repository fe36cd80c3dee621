"""Kernel products and Newton steps on several processes (``ShardedKernel``, gloo) against one process.

    python -m benchmarks.distributed                  # N = 10^4, C = 10, float32, fused products
    python -m benchmarks.distributed --smoke --out /tmp/distributed

The paper's 10-class mixture in 3-D, a softmax likelihood over C latents sharing one Matérn-3/2 kernel, the fused
products of ``gpytorch_iterncgp.core.kernel_products`` (``dense_kernel_limit`` 0: the path of N = 10^6, where K is
never cached). Three configurations, each in fresh processes spawned here: one process with one thread, one process
with two threads, and two processes (gloo on localhost, ``ShardedKernel``) with one thread each. Each times, after
a warm-up product (which compiles the tile), ``--products`` products with one action (an ``(N C, 1)`` right-hand
side, as a CG iteration takes) and a fit of ``--steps`` Newton steps (the paper's CG without preconditioner, 5
products per step, R = 10), and counts
the bytes each rank sent per product; with two processes also the two parts of a product on each rank (its rows,
and the ``all_gather``, which includes the wait for the slower rank). ``OMP_WAIT_POLICY=PASSIVE`` (``benchmarks/README.md`` §3). Writes
``results/distributed.json`` and ``.png`` (with the machine and its load average) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGURATIONS = (  # label, processes, threads per process, shard_state
    ("1 process, 1 thread", 1, 1, False),
    ("1 process, 2 threads", 1, 2, False),
    ("2 processes, 1 thread each", 2, 1, False),
    ("2 processes, shard_state=True", 2, 1, True),
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _model(train_x, train_y, classes: int, sharded: bool, shard_state: bool):
    """The softmax model on the fused products: CG with 5 iterations per Newton step and R = 10 (the paper's solver,
    ``preconditioner_rank=0``: the configuration of the recorded results), one Matérn-3/2 kernel shared by the
    classes, sharded over the ranks with ``ShardedKernel`` where ``sharded``."""
    import gpytorch

    from gpytorch_iterncgp import IterNCGPStrategy
    from gpytorch_iterncgp.distributed import ShardedKernel

    class Model(gpytorch.models.ApproximateGP):
        def __init__(self):
            likelihood = gpytorch.likelihoods.SoftmaxLikelihood(num_classes=classes, mixing_weights=False)
            strategy = IterNCGPStrategy(self, train_x, train_y, likelihood, policy="cg", max_solver_iterations=5,
                                        compression_rank=10, preconditioner_rank=0, min_curvature=1e-6,
                                        show_progress=False)  # fmt: skip
            super().__init__(strategy)
            self.mean_module = gpytorch.means.ZeroMean()
            kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5))
            kernel.base_kernel.lengthscale, kernel.outputscale = 0.3, 5.0
            self.covar_module = ShardedKernel(kernel, shard_state=shard_state) if sharded else kernel

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    return Model().to(torch.float32)


def _product_seconds(prior, rhs: torch.Tensor, count: int, barrier) -> list[float]:
    """Seconds of ``count`` products of the prior with ``rhs``, after a warm-up product (which compiles the tile)."""
    prior.matmul(rhs)
    seconds = []
    for _ in range(count):
        barrier()
        start = time.perf_counter()
        prior.matmul(rhs)
        seconds.append(time.perf_counter() - start)
    return seconds


def _sharded_parts(prior, rhs: torch.Tensor, num: int, classes: int, count: int, barrier) -> tuple[list, list]:
    """The two parts of ``count`` sharded products: this rank's rows, and the ``all_gather`` (waits included)."""
    from gpytorch_iterncgp.core.prior import _local_matmul, _sharded

    matrix = _sharded(prior.covariance)
    shared_rhs = rhs.reshape(num, classes)
    local_seconds, gather_seconds = [], []
    for _ in range(count):
        barrier()
        start = time.perf_counter()
        local = _local_matmul(matrix.local_rows, shared_rhs)
        middle = time.perf_counter()
        matrix.gather(local)
        local_seconds.append(middle - start)
        gather_seconds.append(time.perf_counter() - middle)
    return local_seconds, gather_seconds


def _fit_and_phase(model, options: dict, sharded: bool, barrier) -> dict:
    """A fit of ``options["steps"]`` Newton steps, then the covariance phase alone (no further Newton step, then the
    final precision with the phase's blocks): their reports' totals and the bytes the kernel sent."""
    strategy = model.variational_strategy
    barrier()
    report = strategy.fit(max_newton_steps=options["steps"])
    strategy.options = dataclasses.replace(strategy.options, covariance_iterations=options["phase_iterations"])
    kernel = model.covar_module
    products, sent = (kernel.products, kernel.bytes_sent) if sharded else (0, 0)
    barrier()
    phase = strategy.fit(max_newton_steps=0)
    return {
        "newton_steps": report.steps,
        "fit_products": report.kernel_products,
        "fit_seconds": report.wall_time,
        "fit_product_seconds": report.kernel_product_seconds,
        "seconds_per_newton_step": report.wall_time / max(1, report.steps),
        "bytes_sent_per_product": sent / products if sharded else 0,
        "phase_seconds": phase.wall_time,
        "phase_products": phase.kernel_products,
        "phase_product_seconds": phase.kernel_product_seconds,
        "phase_columns": phase.kernel_columns,
        "phase_bytes_sent": kernel.bytes_sent - sent if sharded else 0,
        "phase_collective_products": kernel.products - products if sharded else 0,
    }


def worker(
    rank: int, world_size: int, port: int, threads: int, shard_state: bool, options: dict, directory: str
) -> None:
    """One process of a configuration: time products and a fit; each rank saves its timings."""
    import torch.distributed as dist

    from gpytorch_iterncgp import settings
    from gpytorch_iterncgp.datasets import gaussian_mixture

    torch.set_num_threads(threads)
    sharded = world_size > 1
    if sharded:
        timeout = datetime.timedelta(minutes=10)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timeout)  # fmt: skip
    num, classes = options["num_data"], options["classes"]
    train_x, train_y, _, _ = gaussian_mixture(num, classes, num_classes=classes, dtype=torch.float32)
    model = _model(train_x, train_y, classes, sharded, shard_state)

    def barrier() -> None:
        if sharded:
            dist.barrier()

    with torch.no_grad(), settings.dense_kernel_limit(0):
        prior = model.variational_strategy.train_prior()
        rhs = torch.randn(num * classes, 1, generator=torch.Generator().manual_seed(rank), dtype=torch.float32)
        seconds = _product_seconds(prior, rhs, options["products"], barrier)
        parts = _sharded_parts(prior, rhs, num, classes, options["products"], barrier) if sharded else None
        fit = _fit_and_phase(model, options, sharded, barrier)
    result = {
        "product_seconds": seconds,
        "product_median_seconds": statistics.median(seconds),
        "local_rows_median_seconds": statistics.median(parts[0]) if parts else None,
        "all_gather_median_seconds": statistics.median(parts[1]) if parts else None,
        **fit,
    }
    (Path(directory) / f"result{rank}.json").write_text(json.dumps(result))
    if sharded:
        dist.destroy_process_group()


def run_configuration(processes: int, threads: int, shard_state: bool, options: dict) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        args = (processes, _free_port(), threads, shard_state, options, directory)
        mp.start_processes(worker, args=args, nprocs=processes, start_method="spawn")
        ranks = [json.loads((Path(directory) / f"result{rank}.json").read_text()) for rank in range(processes)]
    result = dict(ranks[0])  # the fit's timings are rank 0's (every rank waits for the slowest in each product)
    result["per_rank"] = [
        {key: rank[key] for key in ("product_median_seconds", "local_rows_median_seconds", "all_gather_median_seconds")}
        for rank in ranks
    ]
    return result


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [entry["label"] for entry in results["configurations"]]
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    phase = f"covariance phase ({results['options']['phase_iterations']} blocks)"
    for axis, key, title in (
        (axes[0], "product_median_seconds", "one product with K (1 action)"),
        (axes[1], "seconds_per_newton_step", "one Newton step (5 products)"),
        (axes[2], "phase_seconds", phase),
    ):
        values = [entry[key] for entry in results["configurations"]]
        axis.bar(range(len(values)), values, color=[f"C{index}" for index in range(len(values))])
        axis.set_xticks(range(len(values)), [label.replace(", ", ",\n") for label in labels])
        axis.set(ylabel="seconds", title=title)
    options = results["options"]
    figure.suptitle(
        f"N = {options['num_data']}, C = {options['classes']}, float32, fused products; "
        f"{results['machine']['cpu_count']} cores shared with other jobs (load {results['load_average_before'][0]:.1f})"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-data", type=int, default=10000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--products", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--phase-iterations", type=int, default=10, help="covariance_iterations of the phase timed")
    parser.add_argument("--smoke", action="store_true", help="N = 1000, 2 products, 1 Newton step")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    options = {
        "num_data": args.num_data,
        "classes": args.classes,
        "products": args.products,
        "steps": args.steps,
        "phase_iterations": args.phase_iterations,
    }
    if args.smoke:
        options.update(num_data=1000, products=2, steps=1, phase_iterations=2)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    results = {"machine": machine(), "options": options, "load_average_before": os.getloadavg(), "configurations": []}
    for label, processes, threads, shard_state in CONFIGURATIONS:
        entry = {"label": label, "processes": processes, "threads": threads, "shard_state": shard_state}
        entry.update(run_configuration(processes, threads, shard_state, options))
        results["configurations"].append(entry)
        print(
            f"{label:28s} product {entry['product_median_seconds']:.3f} s, Newton step "
            f"{entry['seconds_per_newton_step']:.3f} s ({entry['fit_product_seconds'] / max(1, entry['newton_steps']):.3f} s"
            f" in products), {entry['bytes_sent_per_product'] / 1024:.1f} KiB sent per product and rank; per rank "
            f"(rows, all_gather): {[(r['local_rows_median_seconds'], r['all_gather_median_seconds']) for r in entry['per_rank']]}"
            f"; covariance phase {entry['phase_seconds']:.3f} s ({entry['phase_product_seconds']:.3f} s in "
            f"{entry['phase_products']} products), "
            f"{entry['phase_bytes_sent'] / 1024:.1f} KiB sent per rank",
            flush=True,
        )
    results["load_average_after"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "distributed.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "distributed.png")
    print(f"wrote {args.out / 'distributed.json'} and .png")


if __name__ == "__main__":
    main()
