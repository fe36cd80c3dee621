"""The covariance phase: test NLL against products with K and wall time, with and without it.

The paper's 10-class mixture (N = 5000 training, 10^4 test points, sample seed 0), Matérn-3/2 with lengthscale 0.3 and
outputscale 5 shared by the classes, softmax, float32, K cached (the package's default at this size): IterNCGP-CG with
recycling, j <= 20 per Newton step (``suite.py`` uses 5: its 60 virtual solver runs cost minutes here), then
``covariance_iterations`` blocks of the covariance phase (100 actions each).
The test NLL uses the suite's rule (E[softmax] under independent latent marginals), so it compares with the suite's
exact Laplace (``--exact`` runs it here: about 11 minutes at N = 5000 on a quiet 2-core CPU).

1. One fit without the phase (the trace of its Newton steps: products, time, test NLL).
2. The phase with 0, 4, 8, ... blocks from the fitted state (``DampedNewton.finalize``), each timed alone.
3. End-to-end fits ``IterNCGPStrategy(covariance_iterations=k)`` for ``--end-to-end`` values of k: wall time.

    python -m benchmarks.covariance --threads 1 --tag _j20   # ~7 min on a loaded 2-core CPU
    python -m benchmarks.covariance --smoke                  # N = 500, a functional check (--quick: the same)
    python -m benchmarks.covariance --exact                  # also exact Laplace by Cholesky (R&W 3.3/3.4)

Writes ``results/covariance/covariance.json`` (with the machine) and ``results/covariance/covariance.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks import methods
from benchmarks.common import add_smoke_flag, load_average, machine
from benchmarks.suite import load_problem

RESULTS = Path(__file__).resolve().parent / "results" / "covariance"
FIT = dict(policy="cg", max_solver_iterations=5, max_newton_steps=60, outer_tol=1e-3, min_curvature=1e-6)


def test_nll(problem, state) -> dict:
    """Test accuracy / NLL / ECE of the state's predictive (the suite's rule), not timed."""
    kernel = methods.fixed_kernel(problem)
    parts = []
    with torch.no_grad():
        for test_x in problem.test_x.split(2048):
            cross = kernel(test_x, problem.train_x).to_dense()
            parts.append(methods.shared_kernel_marginals(state, cross, problem.outputscale, problem.num_classes))
        mean, variance = (torch.cat(part) for part in zip(*parts, strict=True))
        probabilities = methods.class_probabilities(mean, variance, problem.num_classes)
    return methods.classification_metrics(probabilities, problem.test_y, problem.num_classes)


def fit(problem, **options):
    model = methods.IterNCGPModel(problem, False, show_progress=False, **{**FIT, **options})
    strategy = model.variational_strategy
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", category=Warning)
        tic = time.perf_counter()
        report = strategy.fit()
        seconds = time.perf_counter() - tic
    return strategy, report, seconds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-train", type=int, default=5000)
    parser.add_argument("--n-test", type=int, default=10_000)
    parser.add_argument("--blocks", type=int, nargs="+", default=[0, 6, 10, 14])
    parser.add_argument("--block-size", type=int, default=100)
    parser.add_argument("--end-to-end", type=int, nargs="*", default=[10, 14])
    parser.add_argument("--exact", action="store_true", help="also exact Laplace by Cholesky on all training points")
    parser.add_argument(
        "--exact-nll", type=float, default=0.4104, help="exact Laplace's test NLL (measured with --exact, N = 5000)"
    )
    parser.add_argument("--newton-steps", type=int, default=15, help="max_newton_steps of the fit (suite: 60)")
    parser.add_argument("--solver-iterations", type=int, default=20, help="j per Newton step (suite: 5)")
    parser.add_argument("--compression-rank", type=int, default=None, help="R of the fit (default: all actions)")
    parser.add_argument("--threads", type=int, default=2)
    add_smoke_flag(parser, "N = 500, 1000 test points, few blocks")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--tag", default="", help="suffix of the result files' names")
    args = parser.parse_args(argv)
    if args.smoke:
        args.n_train, args.n_test, args.blocks, args.end_to_end = 500, 1000, [0, 2, 4], [2]
    return args


def newton_loop(problem) -> tuple:
    """1. The Newton loop without the phase: its strategy, and its products, time, rank and test metrics."""
    strategy, report, seconds = fit(problem)
    entry = {
        "seconds": seconds,
        "products": report.kernel_products,
        "columns": report.kernel_columns,
        "newton_steps": report.steps,
        "converged": report.converged,
        "rank": int(strategy.state.precision_root.shape[-1]),
        **test_nll(problem, strategy.state),
    }
    print(f"fit: {entry}", flush=True)
    return strategy, entry


def phase_alone(problem, strategy, fitted: dict, blocks_list: list[int], block_size: int) -> list[dict]:
    """2. The phase alone from the fitted state (``DampedNewton.finalize``), for each number of blocks, each timed."""
    loop = strategy._make_loop(strategy.train_prior(), strategy.options)
    committed = strategy.state
    phase = []
    for blocks in blocks_list:
        loop.options.covariance_iterations, loop.options.covariance_block_size = blocks, block_size
        products, columns = loop.prior.products, loop.prior.columns
        with torch.no_grad():
            tic = time.perf_counter()
            state = loop.finalize(committed)
            elapsed = time.perf_counter() - tic
        entry = {
            "blocks": blocks,
            "phase_seconds": elapsed,
            "phase_products": loop.prior.products - products,
            "phase_columns": loop.prior.columns - columns,
            "rank": int(state.precision_root.shape[-1]),
            "total_products": fitted["products"] + loop.prior.products - products,
            "total_seconds": fitted["seconds"] + elapsed,
            "load": load_average(),
            **test_nll(problem, state),
        }
        phase.append(entry)
        print(f"phase: {entry}", flush=True)
    return phase


def end_to_end(problem, blocks_list: list[int], block_size: int) -> list[dict]:
    """3. End-to-end fits ``IterNCGPStrategy(covariance_iterations=k)`` for each k: wall time, products, test metrics."""
    entries = []
    for blocks in blocks_list:
        strategy, report, seconds = fit(problem, covariance_iterations=blocks, covariance_block_size=block_size)
        entry = {
            "covariance_iterations": blocks,
            "seconds": seconds,
            "products": report.kernel_products,
            "columns": report.kernel_columns,
            "product_seconds": report.kernel_product_seconds,
            "rank": int(strategy.state.precision_root.shape[-1]),
            "load": load_average(),
            **test_nll(problem, strategy.state),
        }
        entries.append(entry)
        print(f"end to end: {entry}", flush=True)
    return entries


def exact_laplace(problem, args: argparse.Namespace) -> dict:
    """Exact Laplace's test NLL: measured here with ``--exact``, else the ``--exact-nll`` given."""
    if not args.exact:
        return {"nll": args.exact_nll, "source": "--exact-nll (methods.run_sod_laplace on all 5000 points: 0.4104)"}
    exact = methods.run_sod_laplace(problem, problem.num_train)
    result = {"nll": exact["history"][-1]["nll"], "seconds": exact["fit_seconds"], "source": "this run"}
    print(f"exact: {result}", flush=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    FIT.update(
        max_newton_steps=args.newton_steps,
        compression_rank=args.compression_rank,
        max_solver_iterations=args.solver_iterations,
    )
    problem = load_problem("mixture", "sensible", args.n_train, args.n_test, 0)
    results: dict = {
        "machine": machine(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "load_start": load_average(),
    }
    strategy, results["fit"] = newton_loop(problem)
    results["phase"] = phase_alone(problem, strategy, results["fit"], args.blocks, args.block_size)
    results["end_to_end"] = end_to_end(problem, args.end_to_end, args.block_size)
    results["exact"] = exact_laplace(problem, args)
    results["load_end"] = load_average()
    args.out.mkdir(parents=True, exist_ok=True)
    name = ("covariance_smoke" if args.smoke else "covariance") + args.tag
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / f"{name}.png")
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    exact = results["exact"]["nll"]
    phase = results["phase"]
    for axis, key, label in ((axes[0], "total_products", "products with K"), (axes[1], "total_seconds", "seconds")):
        axis.plot([e[key] for e in phase], [e["nll"] for e in phase], marker="o", label="Newton loop, then the phase")
        axis.axhline(exact, color="black", linestyle="--", label="exact Laplace")
        axis.axhline(1.02 * exact, color="gray", linestyle=":", label="exact + 2%")
        axis.set_xlabel(f"{label} (fit + phase)")
        axis.set_ylabel("test NLL")
        axis.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"covariance phase, 10-class mixture, N = {results['args']['n_train']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
