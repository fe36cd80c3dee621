"""IterNCGP's time outside the products with K: how much of a fit is the solver's own work, and where it goes.

    python -m benchmarks.outside_products                       # N = 10^4, C = 10, cached and chunked K
    python -m benchmarks.outside_products --paths dense --steps 10 --label quick
    python -m benchmarks.outside_products --replot benchmarks/results/outside_products.json

On the paper's 10-class mixture (lengthscale 0.3, outputscale 5, float32) each configuration — policy (CG with
j <= 5 solver iterations per Newton step, unit vectors with j <= 10), compression rank R (infinity, 10) and the
path of the products with K (``dense``: K evaluated once and cached, the package's default at this size;
``chunked``: K re-evaluated in row chunks, as above ``dense_kernel_limit`` for kernels that are not fused;
``fused``: re-evaluated by the fused product, the default above ``dense_kernel_limit`` for RBF/Matérn) — is fitted for a fixed number of
Newton steps in a fresh process. Recorded: the fit's wall time, the time inside products with K
(``LatentPrior.product_seconds``; kernel columns, the products of unit-vector actions, count there too), the
fraction outside, the peak resident memory the fit added, the size of the solver state, and with ``--profile``
the cumulative time of the package's functions (cProfile).

Results go to ``results/outside_products.json`` (runs of every ``--label``, with the machine) and
``results/outside_products.png``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import subprocess
import sys
import time
import warnings
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import load_average, machine, peak_rss_bytes, reset_peak_rss, rss_bytes

RESULTS = Path(__file__).resolve().parent / "results"

# Package functions whose cumulative time the profile reports (file name, function name).
PROFILED = [
    ("outer_loop.py", "run_outer_loop"),
    ("solver.py", "itergp_solve"),
    ("recycling.py", "virtual_solver_run"),
    ("prior.py", "matmul"),
    ("prior.py", "kernel_columns"),
    ("newton.py", "point"),
    ("newton.py", "derivatives"),
    ("newton.py", "damped_step"),
]


def run_one(config: dict) -> dict:
    """Fit one configuration in this process; the result's entry for the JSON."""
    import gpytorch

    from benchmarks.methods import IterNCGPModel, buffer_bytes
    from benchmarks.suite import load_problem
    from gpytorch_iterncgp.settings import dense_kernel_limit, fused_kernel_products

    torch.set_num_threads(config["threads"])
    problem = load_problem("mixture", "sensible", config["n_train"], 1000, seed=0, device=config.get("device", "cpu"))
    model = IterNCGPModel(
        problem,
        keops=False,
        policy=config["policy"],
        max_solver_iterations=config["iterations"],
        compression_rank=config["rank"],
        max_newton_steps=config["steps"],
        outer_tol=1e-3,
        min_curvature=1e-6,
        show_progress=False,
    )
    strategy = model.variational_strategy
    if config["path"] == "fused":  # compile the fused product first (torch.compile): not part of any fit's time
        from gpytorch_iterncgp.core.kernel_products import fused_kernel_matmul

        with torch.no_grad():
            points = problem.train_x[:2048]
            ones = torch.ones(len(points), 10, dtype=points.dtype, device=points.device)
            fused_kernel_matmul(model.covar_module(points), ones)
    cpu = _count_product_cpu_time()
    limit = dense_kernel_limit(0 if config["path"] in ("chunked", "fused") else dense_kernel_limit.value())
    fused = fused_kernel_products(config["path"] != "chunked")
    profiler = cProfile.Profile() if config["profile"] else None
    reset_peak_rss()
    cuda = problem.train_x.is_cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats(problem.train_x.device)
    baseline = rss_bytes()
    with torch.no_grad(), warnings.catch_warnings(), limit, fused:
        warnings.simplefilter("ignore", gpytorch.utils.warnings.NumericalWarning)
        start, start_cpu = time.perf_counter(), time.process_time()
        if profiler is not None:
            profiler.enable()
        report = strategy.fit()
        if profiler is not None:
            profiler.disable()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    peak = peak_rss_bytes()
    result = {
        **config,
        "fit_seconds": seconds,
        "product_seconds": report.kernel_product_seconds,
        "outside_seconds": seconds - report.kernel_product_seconds,
        "outside_fraction": (seconds - report.kernel_product_seconds) / seconds,
        # CPU time of this process (one thread): what the fit itself computed, less affected by other processes
        "fit_cpu_seconds": cpu_seconds,
        "product_cpu_seconds": cpu["seconds"],
        "outside_cpu_fraction": (cpu_seconds - cpu["seconds"]) / cpu_seconds,
        "products": report.kernel_products,
        "kernel_columns": report.kernel_columns,
        "solver_iterations": report.solver_iterations,
        "newton_steps": report.steps,
        "log_posterior": report.log_posteriors[-1] if report.records else None,
        "peak_rss_bytes": peak,
        "fit_added_rss_bytes": peak - baseline,
        "cuda_peak_bytes": torch.cuda.max_memory_allocated(problem.train_x.device) if cuda else None,
        **buffer_bytes(strategy.state),
    }
    if profiler is not None:
        stats = pstats.Stats(profiler)
        cumulative = {}
        for (filename, _, name), (_, _, _, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
            for file, function in PROFILED:
                if filename.endswith(file) and name == function:
                    cumulative[f"{file}:{function}"] = cumulative.get(f"{file}:{function}", 0.0) + cum
        builtins = sorted(
            ((name, tottime) for (filename, _, name), (_, _, tottime, _, _) in stats.stats.items() if filename == "~"),
            key=lambda item: -item[1],
        )[:12]
        result["profile_cumulative_seconds"] = cumulative
        result["profile_top_builtins_seconds"] = dict(builtins)
    return result


def _count_product_cpu_time() -> dict:
    """Wrap the products with K (and kernel columns) to add up their CPU time (``time.process_time``)."""
    from gpytorch_iterncgp.core.prior import LatentPrior

    totals = {"seconds": 0.0}

    def timed(method):
        def wrapper(self, argument):
            start = time.process_time()
            try:
                return method(self, argument)
            finally:
                totals["seconds"] += time.process_time() - start

        return wrapper

    for name in ("matmul", "kernel_columns"):
        if hasattr(LatentPrior, name):
            setattr(LatentPrior, name, timed(getattr(LatentPrior, name)))
    return totals


def label_of(run: dict) -> str:
    rank = "∞" if run["rank"] is None else str(run["rank"])
    return f"{run['policy']} R={rank} {run['path']}"


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({run["label"] for run in runs})
    configs = sorted({label_of(run) for run in runs})
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.5 + 0.5 * len(configs)), sharey=True)
    height = 0.8 / max(len(labels), 1)
    for ax, key, scale in ((axes[0], "outside_cpu_fraction", 100), (axes[1], "fit_cpu_seconds", 1)):
        for offset, label in enumerate(labels):
            by_config = {label_of(run): run for run in runs if run["label"] == label}
            ys = [index + offset * height for index, config in enumerate(configs) if config in by_config]
            values = [scale * by_config[config][key] for config in configs if config in by_config]
            ax.barh(ys, values, height=height, label=label)
    axes[0].axvline(10, color="black", linestyle="--", linewidth=1, label="10% target")
    axes[0].set_yticks([index + height * (len(labels) - 1) / 2 for index in range(len(configs))], configs)
    axes[0].set_xlabel("CPU time outside products with K [% of the fit]")
    axes[0].set_xlim(0, 100)
    axes[0].legend(loc="lower right")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("CPU time of the fit [s] (log)")
    fig.suptitle(f"IterNCGP, mixture N = {runs[0]['n_train']}, C = 10 (CPU, one thread)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(runs: list[dict]) -> None:
    print(
        f"{'label':<8} {'configuration':<24} {'fit s':>8} {'in K s':>8} {'outside':>8} {'cpu s':>8} {'out cpu':>8} "
        f"{'products':>8} "
        f"{'peak MiB':>9} {'state MiB':>9} {'log post':>10}"
    )
    for run in runs:
        print(
            f"{run['label']:<8} {label_of(run):<24} {run['fit_seconds']:8.2f} {run['product_seconds']:8.2f} "
            f"{100 * run['outside_fraction']:7.1f}% {run['fit_cpu_seconds']:8.2f} {100 * run['outside_cpu_fraction']:7.1f}% "
            f"{run['products']:8d} {run['fit_added_rss_bytes'] / 2**20:9.0f} "
            f"{run['state_bytes'] / 2**20:9.0f} {run['log_posterior']:10.1f}"
        )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n-train", type=int, default=10_000)
    parser.add_argument("--policies", nargs="+", default=["cg", "unit"], choices=["cg", "unit"])
    parser.add_argument("--ranks", nargs="+", default=["inf", "10"], help="compression ranks R ('inf': none)")
    parser.add_argument("--paths", nargs="+", default=["dense", "chunked"], choices=["dense", "chunked", "fused"])
    parser.add_argument("--steps", type=int, default=20, help="Newton steps (dense path)")
    parser.add_argument("--chunked-steps", type=int, default=6, help="Newton steps on the chunked path")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="torch device (cuda: compare the wall times, not CPU times)")
    parser.add_argument("--profile", action="store_true", help="cProfile each fit (adds a little overhead)")
    parser.add_argument("--label", default="after", help="name of this set of runs in the JSON (e.g. before)")
    parser.add_argument("--note", default="", help="recorded with the runs (e.g. the load of the machine)")
    parser.add_argument("--out", type=Path, default=RESULTS / "outside_products.json")
    parser.add_argument("--replot", type=Path, help="redraw the figure and table from a saved JSON")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: a JSON config to run in this process
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    if args.replot:
        saved = json.loads(args.replot.read_text())
        print_table(saved["runs"])
        plot(saved["runs"], args.replot.with_suffix(".png"))
        return
    saved = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
    saved["runs"] = [run for run in saved["runs"] if run["label"] != args.label]
    saved.setdefault("machines", {})
    saved["machines"][args.label] = {**machine(), "torch_threads": args.threads, "load_average": load_average()}
    for path in args.paths:
        for policy in args.policies:
            for rank in args.ranks:
                config = {
                    "label": args.label,
                    "note": args.note,
                    "n_train": args.n_train,
                    "policy": policy,
                    "iterations": 5 if policy == "cg" else 10,
                    "rank": None if rank == "inf" else int(rank),
                    "path": path,
                    "steps": args.steps if path == "dense" else args.chunked_steps,
                    "threads": args.threads,
                    "device": args.device,
                    "profile": args.profile,
                }
                load_before = load_average()
                output = subprocess.run(
                    [sys.executable, __file__, "--one", json.dumps(config)], capture_output=True, text=True
                )
                if output.returncode != 0:
                    print(output.stderr, file=sys.stderr)
                    raise SystemExit(f"{label_of(config)} failed")
                run = json.loads(output.stdout.strip().splitlines()[-1])
                run["load_average"] = [load_before, load_average()]
                saved["runs"].append(run)
                print_table([run])
                if run.get("profile_cumulative_seconds"):
                    print("   ", {k: round(v, 2) for k, v in run["profile_cumulative_seconds"].items()})
                    print("   ", {k: round(v, 2) for k, v in run["profile_top_builtins_seconds"].items()})
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(saved, indent=1))
    print_table(saved["runs"])
    plot(saved["runs"], args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
