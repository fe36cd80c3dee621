"""``IterNCGPClassifier()`` against scikit-learn's ``GaussianProcessClassifier``, averaged over stratified splits.

    python -m benchmarks.sklearn_defaults                         # iris, breast cancer, wine; 10 splits (~10 min here)
    python -m benchmarks.sklearn_defaults --splits 20 --datasets iris wine digits1000

Protocol, for each of scikit-learn's bundled iris, breast cancer, wine (and, on request, the first 1000 digits): for
each split seed ``s`` in ``0 .. splits - 1`` a 70/30 stratified split (``train_test_split(..., test_size=0.3,
stratify=y, random_state=s)``), features standardised by a ``StandardScaler`` fitted on the training part, then every
classifier fitted and scored by test log-loss (``sklearn.metrics.log_loss``) and accuracy:

* ``IterNCGPClassifier(random_state=s)`` with its defaults (``inference="auto"``), and with ``inference="laplace"`` and
  ``inference="ep"`` where those differ from the default;
* ``GaussianProcessClassifier(1.0 * RBF(ℓ), random_state=s)`` started at ``ℓ = 1`` (scikit-learn's default kernel) and
  at ``ℓ = 3`` (a start closer to the lengthscales standardised features need), one-vs-rest for more than two classes.

The table gives each method's mean test log-loss over the splits with its standard deviation, and marks the default
estimator's mean where it is at or below the better of the two GPC starts; its last column pairs the default with
that start split by split (the mean difference of the log-losses with its standard error, and the number of splits
where the default's is at or below). Fit times are wall-clock seconds with one thread. Writes ``results/sklearn_defaults.json`` (every split's numbers, with the machine) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer, load_digits, load_iris, load_wine
from sklearn.gaussian_process import GaussianProcessClassifier
from sklearn.gaussian_process.kernels import RBF
from sklearn.metrics import accuracy_score, log_loss
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

from benchmarks.common import machine
from gpytorch_iterncgp.learning.estimator_policy import CLASSIFIER_INFERENCE
from gpytorch_iterncgp.sklearn import IterNCGPClassifier

RESULTS = Path(__file__).resolve().parent / "results"


def _digits():
    x, y = load_digits(return_X_y=True)
    return x[:1000], y[:1000]


DATASETS = {
    "iris": lambda: load_iris(return_X_y=True),
    "breast_cancer": lambda: load_breast_cancer(return_X_y=True),
    "wine": lambda: load_wine(return_X_y=True),
    "digits1000": _digits,
}
DEFAULT = "IterNCGPClassifier()"


def split(name: str, seed: int):
    """The protocol's standardised 70/30 stratified split number ``seed``: ``x_train, x_test, y_train, y_test``."""
    x, y = DATASETS[name]()
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.3, stratify=y, random_state=seed)
    scaler = StandardScaler().fit(x_train)
    return scaler.transform(x_train), scaler.transform(x_test), y_train, y_test


def estimators() -> dict[str, Callable[[int], object]]:
    """The compared classifiers, each built from the split's seed."""
    methods: dict[str, Callable[[int], object]] = {DEFAULT: lambda seed: IterNCGPClassifier(random_state=seed)}
    for inference in ("laplace", "ep"):
        if inference != CLASSIFIER_INFERENCE:
            methods[f"IterNCGPClassifier(inference={inference!r})"] = lambda seed, inference=inference: (
                IterNCGPClassifier(inference=inference, random_state=seed)
            )
    for start in (1.0, 3.0):
        methods[f"GPC(1.0*RBF({start:g}))"] = lambda seed, start=start: GaussianProcessClassifier(
            1.0 * RBF(start), random_state=seed
        )
    return methods


def evaluate(estimator, data) -> dict:
    """Fit ``estimator`` on a split's training part; test log-loss, accuracy and fit seconds."""
    x_train, x_test, y_train, y_test = data
    start = time.perf_counter()
    estimator.fit(x_train, y_train)
    fit_seconds = time.perf_counter() - start
    proba = estimator.predict_proba(x_test)
    row = {
        "log_loss": float(log_loss(y_test, proba, labels=estimator.classes_)),
        "accuracy": float(accuracy_score(y_test, estimator.classes_[np.argmax(proba, axis=1)])),
        "fit_seconds": fit_seconds,
    }
    if isinstance(estimator, IterNCGPClassifier):
        row["inference"] = estimator.inference_
        row["learning"] = str(estimator.learning_report_)
        row["lengthscale"] = float(estimator.kernel_.base_kernel.lengthscale.detach())
        row["outputscale"] = float(estimator.kernel_.outputscale.detach())
    else:
        row["kernel"] = str(estimator.kernel_)
    return row


def summary(runs: list[dict]) -> dict:
    """Mean and standard deviation over the splits of the log-loss, accuracy and fit seconds."""
    return {
        f"{key}_{statistic}": float(function([run[key] for run in runs]))
        for key in ("log_loss", "accuracy", "fit_seconds")
        for statistic, function in (("mean", np.mean), ("std", np.std))
    }


def paired(entry: dict) -> dict:
    """The default against the better GPC start (the lower mean log-loss), split by split: the mean difference of
    the log-losses (negative: the default is better), its standard error, and the splits the default wins."""
    gpcs = [method for method in entry["methods"] if method.startswith("GPC")]
    better = min(gpcs, key=lambda method: entry["methods"][method]["summary"]["log_loss_mean"])
    differences = np.array(
        [
            own["log_loss"] - other["log_loss"]
            for own, other in zip(entry["methods"][DEFAULT]["splits"], entry["methods"][better]["splits"], strict=True)
        ]
    )
    return {
        "against": better,
        "difference_mean": float(differences.mean()),
        "difference_standard_error": float(differences.std(ddof=1) / np.sqrt(len(differences))),
        "splits_won": int((differences <= 0).sum()),
        "splits": len(differences),
    }


def table(results: dict) -> str:
    methods = list(next(iter(results.values()))["methods"])
    header = "| data set (N train, D, C) | " + " | ".join(methods) + " | default − better GPC, paired (splits won) |"
    lines = [header, "|---" * (len(methods) + 2) + "|"]
    for name, entry in results.items():
        stats = {method: entry["methods"][method]["summary"] for method in methods}
        best_gpc = min(stats[m]["log_loss_mean"] for m in methods if m.startswith("GPC"))
        cells = []
        for method in methods:
            cell = f"{stats[method]['log_loss_mean']:.3f} ± {stats[method]['log_loss_std']:.3f}"
            cells.append(f"**{cell}**" if method == DEFAULT and stats[method]["log_loss_mean"] <= best_gpc else cell)
        pair = entry["paired"]
        cells.append(
            f"{pair['difference_mean']:+.3f} ± {pair['difference_standard_error']:.3f} "
            f"({pair['splits_won']} / {pair['splits']})"
        )
        shape = f"{entry['num_train']}, {entry['num_features']}, {entry['num_classes']}"
        lines.append(f"| {name} ({shape}) | " + " | ".join(cells) + " |")
    lines.append(
        "| mean fit seconds, last data set | "
        + " | ".join(f"{stats[m]['fit_seconds_mean']:.1f}" for m in methods)
        + " | |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--splits", type=int, default=10, help="stratified 70/30 splits per data set (default 10)")
    parser.add_argument("--datasets", nargs="+", default=["iris", "breast_cancer", "wine"], choices=list(DATASETS))
    parser.add_argument("--output", type=Path, default=RESULTS / "sklearn_defaults.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results: dict = {}
    for name in args.datasets:
        x_train, _, y_train, _ = split(name, 0)
        entry = {
            "num_train": len(y_train),
            "num_features": x_train.shape[1],
            "num_classes": len(np.unique(y_train)),
            "methods": {method: {"splits": []} for method in estimators()},
        }
        for seed in range(args.splits):
            data = split(name, seed)
            for method, make in estimators().items():
                row = evaluate(make(seed), data)
                entry["methods"][method]["splits"].append({"seed": seed, **row})
                print(f"{name} split {seed} {method}: log-loss {row['log_loss']:.4f} ({row['fit_seconds']:.1f} s)")
        for method in entry["methods"].values():
            method["summary"] = summary(method["splits"])
        entry["paired"] = paired(entry)
        results[name] = entry
    report = table(results)
    print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    saved = {"machine": machine(), "splits": args.splits, "default_inference": CLASSIFIER_INFERENCE, "results": results}
    args.output.write_text(json.dumps(saved, indent=1))


if __name__ == "__main__":
    main()
