"""Multi-class EP on the 10-class mixture with and without covariance-phase refreshes of the marginals during the
sweeps (``EPStrategy(marginal_iterations=..., marginal_every=...)``), or SVGP for a wall-clock budget.

Prints the fit's totals as JSON and then one line per evaluated sweep (or SVGP evaluation): wall time of the fit so far
(evaluations excluded), test NLL and accuracy of the predictive, NLL of the plug-in (the latent mean alone), and for
EP the bounded cavities of that sweep and the products with K so far. Run from the repository root:

    python -m benchmarks.ep_marginals ep --num-train 10000 --sweeps 20 --marginal-iterations 3 --marginal-every 10 \\
        --eval 5 10 11 15 20 --threads 2
    python -m benchmarks.ep_marginals svgp --num-train 10000 --inducing 1000 --lr 0.01 --budget 92 --threads 2
    python -m benchmarks.ep_marginals plot        # the figure of every saved run

(``benchmarks/README.md`` §6 and §11 have the commands of their tables.) The SVGP runs are the suite's
(:func:`benchmarks.methods.run_svgp`).

Each run is saved as ``results/ep_marginals/<label>.json`` (``--label``; with the machine); ``plot`` draws the test NLL
of every saved run against its wall time into ``results/ep_marginals/ep_marginals.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks import methods, suite
from benchmarks.common import machine

RESULTS = Path(__file__).resolve().parent / "results" / "ep_marginals"

KEYS = ("time", "step", "nll", "accuracy", "plug_in_nll", "bounded_cavities", "products", "adam_steps", "final")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("method", choices=("ep", "svgp", "plot"))
    parser.add_argument("--label", default=None, help="name of the saved run (default: from the method's options)")
    parser.add_argument("--num-train", type=int, default=10_000)
    parser.add_argument("--num-test", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0, help="the mixture's sample seed (training and test points)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sweeps", type=int, default=30)
    parser.add_argument("--solver-iterations", type=int, default=5)
    parser.add_argument("--marginal-iterations", type=int, default=0)
    parser.add_argument("--marginal-every", type=int, default=1)
    parser.add_argument("--eval", type=int, nargs="*", default=[5, 10, 15, 20, 25, 30], help="EP sweeps to evaluate")
    parser.add_argument("--inducing", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--budget", type=float, default=70.0)
    args = parser.parse_args()
    if args.method == "plot":
        plot(sorted(RESULTS.glob("*.json")), RESULTS / "ep_marginals.png")
        return
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    problem = suite.load_problem("mixture", "sensible", args.num_train, args.num_test, args.seed)
    if args.method == "ep":
        methods.EVALUATION_STEPS = frozenset(args.eval)
        result = methods.run_ep(
            problem,
            max_sweeps=args.sweeps,
            max_solver_iterations=args.solver_iterations,
            marginal_iterations=args.marginal_iterations,
            marginal_every=args.marginal_every,
        )
        totals = {key: result[key] for key in ("fit_seconds", "product_seconds", "products", "buffer_columns")}
    else:
        result = methods.run_svgp(problem, args.inducing, args.lr, args.budget, evaluations=10)
        totals = {key: result[key] for key in ("fit_seconds", "adam_steps", "epochs")}
    print(json.dumps({**vars(args), **totals}))
    history = [{key: value for key, value in entry.items() if key in KEYS} for entry in result["history"]]
    for entry in history:
        print({key: round(value, 4) if isinstance(value, float) else value for key, value in entry.items()})
    if args.label is None:
        args.label = (
            f"ep_m{args.marginal_iterations}_every{args.marginal_every}_t{args.threads}"
            if args.method == "ep"
            else f"svgp_u{args.inducing}_lr{args.lr:g}_t{args.threads}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    saved = {"machine": machine(), "arguments": vars(args), "totals": totals, "history": history}
    (RESULTS / f"{args.label}.json").write_text(json.dumps(saved, indent=1))


def plot(paths: list[Path], out: Path) -> None:
    """Test NLL against wall time of the saved runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for path in paths:
        run = json.loads(path.read_text())
        history = [entry for entry in run["history"] if entry["time"] > 5]
        ax.plot([e["time"] for e in history], [e["nll"] for e in history], marker="o", ms=3, label=path.stem)
    ax.axhline(0.339, color="black", linestyle="--", linewidth=1, label="0.339 (best SVGP, benchmarks §1)")
    ax.set_ylim(0.33, 0.40)
    ax.set_xlabel("wall time of the fit [s]")
    ax.set_ylabel("test NLL")
    ax.set_title("10-class mixture, N = 10⁴, ℓ 0.3, s² 5: EP with marginal refreshes vs SVGP")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
