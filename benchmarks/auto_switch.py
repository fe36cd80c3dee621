r"""Where ``inference="auto"`` switches from dense EP to stochastic EP: both estimators on each side of the switch.

    python -m benchmarks.auto_switch                                   # binary and 10-class mixtures (25 minutes)
    python -m benchmarks.auto_switch --datasets mixture20000 --seeds 0 1   # adds rows to the results
    python -m benchmarks.auto_switch --datasets binary20000 --inferences ep  # replaces only dense EP's rows
    python -m benchmarks.auto_switch --smoke                           # tiny sizes, seconds

For each data set (the mixture of :func:`benchmarks.data.load`: ``binary<N>``, ``mixture<N>`` with 10 classes) and seed,
``IterNCGPClassifier(inference=...)`` with its other defaults for ``"ep"`` (dense computation-aware EP) and
``"sparse_ep"`` (stochastic EP with inducing inputs), one after the other in one process on ``--threads`` threads:
each fit's wall time (learning included) and test NLL, and which of the two ``"auto"`` picks
(:func:`gpytorch_iterncgp.learning.estimator_policy.auto_inference`). The switch has no step backwards where, on each
side of it, the method ``"auto"`` picks reaches at most the other's NLL, or the same NLL sooner.

Writes ``results/auto_switch.json`` (with the machine; rows of other data sets, seeds and inferences already there are
kept) and ``results/auto_switch.png`` (test NLL against seconds, a
point per fit, a panel per number of classes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import add_smoke_flag, machine
from benchmarks.data import load
from benchmarks.learned import run_estimator
from gpytorch_iterncgp import MinibatchRecipe
from gpytorch_iterncgp.learning.estimator_policy import auto_inference

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["binary10000", "binary20000", "mixture3000", "mixture6000"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--inferences", nargs="+", default=["ep", "sparse_ep"], choices=["ep", "sparse_ep"])
    parser.add_argument("--threads", type=int, default=1)
    add_smoke_flag(parser, "tiny data, seconds")
    parser.add_argument("--out", type=Path, default=RESULTS / "auto_switch.json")
    return parser.parse_args(argv)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({row["num_classes"] for row in rows})
    figure, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for axis, classes in zip(axes[0], groups, strict=True):
        for inference, marker in (("ep", "o"), ("sparse_ep", "s")):
            chosen = [row for row in rows if row["num_classes"] == classes and row["inference"] == inference]
            axis.scatter(
                [row["seconds"] for row in chosen], [row["nll"] for row in chosen], marker=marker, label=inference
            )
            for row in chosen:
                axis.annotate(f"N={row['num_train']}", (row["seconds"], row["nll"]), fontsize=7)
        axis.set_xscale("log")
        axis.set_xlabel("seconds (fit, learning included)")
        axis.set_ylabel("test NLL")
        axis.set_title(f"{classes} classes", fontsize=9)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _write(rows: list[dict], args: argparse.Namespace, earlier: list[dict]) -> list[dict]:
    """The results file: ``rows`` and the ``earlier`` rows of other data sets, seeds and inferences, each marked
    with the rule as it is now; returns them all."""
    measured = {(row["dataset"], row["seed"], row["inference"]) for row in rows}
    rows = [row for row in earlier if (row["dataset"], row["seed"], row["inference"]) not in measured] + rows
    for row in rows:
        row["auto_picks"] = auto_inference(row["num_train"], row["num_classes"]) == row["inference"]
    args.out.write_text(json.dumps({"machine": machine(), "threads": args.threads, "rows": rows}, indent=1))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    earlier = json.loads(args.out.read_text())["rows"] if args.out.exists() else []  # kept, but for those rerun
    rows = []
    for name in args.datasets:
        for seed in args.seeds:
            data = load(name, args.smoke, seed)
            picked = auto_inference(len(data.train_y), data.num_classes)
            for inference in args.inferences:
                run = run_estimator(data, seed, inference, max_time=2.0 if args.smoke else None)
                final = run["history"][-1]
                row = {
                    "dataset": name,
                    "seed": seed,
                    "num_train": len(data.train_y),
                    "num_classes": data.num_classes,
                    "inference": inference,
                    "auto_picks": picked == inference,
                    "seconds": final["time"],
                    "nll": final["nll"],
                    "accuracy": final["accuracy"],
                }
                if inference == "sparse_ep":  # rows without it ran before fit_mll annealed its learning rate
                    row["schedule"] = MinibatchRecipe.schedule
                rows.append(row)
                print(
                    f"{name:>14} seed {seed} {inference:>9}{' (auto)' if row['auto_picks'] else '':7} "
                    f"NLL {row['nll']:.4f} acc {row['accuracy']:.4f} {row['seconds']:7.1f} s",
                    flush=True,
                )
                _write(rows, args, earlier)  # after every fit: a long run keeps what it measured
    rows = _write(rows, args, earlier)
    plot(rows, args.out.with_suffix(".png"))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
