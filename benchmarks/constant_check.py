"""The default estimator's test score beside the constant predictor's, per data set and split, read from results files:
no set may score worse than ignoring the inputs (the training rows' class frequencies, or their mean count).

    python -m benchmarks.constant_check --tabular benchmarks/results/tabular_kernels/outputscale_32/*.json \\
        --sklearn benchmarks/results/held_out_61/sklearn_defaults.json --out benchmarks/results/held_out_61/constant.json

``--tabular``: results of :mod:`benchmarks.tabular` (any number; for each data set and split the newest file's
``estimator_auto`` is taken, the default estimator); the constant's score of each split is computed from the same
split (:func:`benchmarks.real_data.load`). ``--sklearn``: a results file of :mod:`benchmarks.sklearn_defaults`, whose
``IterNCGPClassifier()`` splits are paired with the constant on the same split (:func:`benchmarks.sklearn_defaults.split`).
Prints a markdown table (mean over the splits of each score, and on how many splits the estimator is below the
constant) and writes it with every split's pair as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import write_results
from benchmarks.real_data import load
from benchmarks.tabular import run_method


def _tabular_pairs(paths: list[Path]) -> dict[str, list[dict]]:
    """``{data set: [{seed, estimator, constant, metric, source}]}`` from the newest ``estimator_auto`` per split."""
    newest: dict[tuple[str, int], tuple[str, dict, str]] = {}
    for path in paths:
        results = json.loads(path.read_text())
        for row in results.get("rows", []):
            run = row.get("methods", {}).get("estimator_auto")
            key = (row["dataset"], row["seed"])
            if run is not None and (key not in newest or newest[key][0] < results["machine"]["date"]):
                newest[key] = (results["machine"]["date"], run, str(path))
    pairs: dict[str, list[dict]] = {}
    for (name, seed), (_, run, source) in sorted(newest.items()):
        metric = "deviance" if "deviance" in run else "nll"
        constant = run_method(load(name, False, seed), "constant", seed, 0.0, None)[metric]
        pairs.setdefault(name, []).append(
            {"seed": seed, "estimator": run[metric], "constant": constant, "metric": metric, "source": source}
        )
    return pairs


def _sklearn_pairs(path: Path) -> dict[str, list[dict]]:
    """The same pairs for :mod:`benchmarks.sklearn_defaults`' ``IterNCGPClassifier()`` splits."""
    from sklearn.metrics import log_loss

    from benchmarks.sklearn_defaults import DEFAULT, split

    results = json.loads(path.read_text())["results"]
    pairs: dict[str, list[dict]] = {}
    for name, entry in results.items():
        for run in entry["methods"][DEFAULT]["splits"]:
            _, x_test, y_train, y_test = split(name, run["seed"])
            frequencies = np.bincount(y_train) / len(y_train)
            constant = log_loss(y_test, np.tile(frequencies, (len(y_test), 1)))
            pairs.setdefault(name, []).append(
                {"seed": run["seed"], "estimator": run["log_loss"], "constant": constant, "metric": "nll"}
            )
    return pairs


def table(pairs: dict[str, list[dict]]) -> str:
    """A markdown table: data set, score, splits, the estimator's and the constant's mean, splits below the constant."""
    lines = [
        "| data set | score | splits | estimator (mean) | constant (mean) | estimator below constant |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, runs in pairs.items():
        score = "Poisson deviance" if runs[0]["metric"] == "deviance" else "log-loss"
        below = sum(run["estimator"] < run["constant"] for run in runs)
        estimator, constant = (float(np.mean([run[key] for run in runs])) for key in ("estimator", "constant"))
        lines.append(f"| {name} | {score} | {len(runs)} | {estimator:.4f} | {constant:.4f} | {below} of {len(runs)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tabular", nargs="*", type=Path, default=[])
    parser.add_argument("--sklearn", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pairs = _tabular_pairs(args.tabular)
    if args.sklearn is not None:
        pairs.update(_sklearn_pairs(args.sklearn))
    rendered = table(pairs)
    print(rendered)
    if args.out is not None:
        write_results(args.out, "constant_check", argv, pairs=pairs, table=rendered)
    return pairs


if __name__ == "__main__":
    main()
