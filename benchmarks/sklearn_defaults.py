"""``IterNCGPClassifier()`` with its defaults against scikit-learn's ``GaussianProcessClassifier`` with its own.

    python -m benchmarks.sklearn_defaults             # four data sets, about a minute here (one thread)

Protocol, for each of scikit-learn's bundled iris, breast cancer, wine and digits (its first 1000 rows):
a 70/30 stratified split (``train_test_split(..., test_size=0.3, stratify=y, random_state=0)``), features
standardised by a ``StandardScaler`` fitted on the training part, then both classifiers fitted with their
defaults (ours: ``IterNCGPClassifier(random_state=0)``, the seed of its random probe vectors; scikit-learn's: ``GaussianProcessClassifier(1.0 * RBF(1.0),
random_state=0)``, its default kernel, one-vs-rest for more than two classes) and scored by test log-loss
(``sklearn.metrics.log_loss``) and accuracy. Fit times are wall-clock seconds with one thread.

Writes ``results/sklearn_defaults.json`` (with the machine it ran on) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import sklearn
import torch
from sklearn.datasets import load_breast_cancer, load_digits, load_iris, load_wine
from sklearn.gaussian_process import GaussianProcessClassifier
from sklearn.gaussian_process.kernels import RBF
from sklearn.metrics import accuracy_score, log_loss
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

from benchmarks.common import machine
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


def split(name: str):
    """The protocol's standardised 70/30 stratified split: ``x_train, x_test, y_train, y_test``."""
    x, y = DATASETS[name]()
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.3, stratify=y, random_state=0)
    scaler = StandardScaler().fit(x_train)
    return scaler.transform(x_train), scaler.transform(x_test), y_train, y_test


def evaluate(estimator, name: str) -> dict:
    """Fit ``estimator`` on the training part of ``name``; test log-loss, accuracy and fit seconds."""
    x_train, x_test, y_train, y_test = split(name)
    start = time.perf_counter()
    estimator.fit(x_train, y_train)
    fit_seconds = time.perf_counter() - start
    proba = estimator.predict_proba(x_test)
    return {
        "log_loss": float(log_loss(y_test, proba, labels=estimator.classes_)),
        "accuracy": float(accuracy_score(y_test, estimator.classes_[np.argmax(proba, axis=1)])),
        "fit_seconds": fit_seconds,
        "num_train": len(y_train),
        "num_test": len(y_test),
        "num_features": x_train.shape[1],
        "num_classes": len(estimator.classes_),
    }


def estimators() -> dict:
    return {
        "IterNCGPClassifier(random_state=0)": lambda: IterNCGPClassifier(random_state=0),
        "GaussianProcessClassifier(1.0*RBF(1.0))": lambda: GaussianProcessClassifier(1.0 * RBF(1.0), random_state=0),
    }


def _solver(budget: dict | None) -> str:
    if not budget:
        return ""
    if budget["exact"]:
        return f"exact ({budget['policy']}, full rank)"
    return f"{budget['policy']}, <= {budget['max_solver_iterations']} iterations / Newton step"


def table(results: dict) -> str:
    ours, theirs = list(estimators())
    lines = [
        "| data set | N train | D | C | log-loss ours | log-loss sklearn | accuracy ours | accuracy sklearn "
        "| fit s ours | fit s sklearn | our solver |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results.items():
        a, b = row[ours], row[theirs]
        lines.append(
            f"| {name} | {a['num_train']} | {a['num_features']} | {a['num_classes']} | **{a['log_loss']:.3f}** "
            if a["log_loss"] <= b["log_loss"]
            else f"| {name} | {a['num_train']} | {a['num_features']} | {a['num_classes']} | {a['log_loss']:.3f} "
        )
        lines[-1] += (
            f"| {b['log_loss']:.3f} | {a['accuracy']:.3f} | {b['accuracy']:.3f} "
            f"| {a['fit_seconds']:.1f} | {b['fit_seconds']:.1f} | {_solver(a.get('solver'))} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--output", type=Path, default=RESULTS / "sklearn_defaults.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    for name in args.datasets:
        results[name] = {}
        for label, make in estimators().items():
            estimator = make()
            row = evaluate(estimator, name)
            if isinstance(estimator, IterNCGPClassifier):
                row["solver"] = {k: (v if k != "policy" else str(v)) for k, v in estimator.solver_budget_.items()}
                row["fit_report"] = str(estimator.fit_report_)
                row["kernel"] = {
                    "outputscale": float(estimator.kernel_.outputscale.detach()),
                    "lengthscale": float(estimator.kernel_.base_kernel.lengthscale.detach()),
                }
                row["evidence_evaluations"] = len(estimator.loss_curve_)
                row["log_marginal_likelihood"] = estimator.log_marginal_likelihood()
            else:
                row["kernel"] = str(estimator.kernel_)
                if hasattr(estimator, "log_marginal_likelihood_value_"):
                    row["log_marginal_likelihood"] = float(estimator.log_marginal_likelihood_value_)
            results[name][label] = row
            print(
                f"{name:14s} {label:42s} log-loss {row['log_loss']:.4f}  accuracy {row['accuracy']:.3f}  "
                f"fit {row['fit_seconds']:.1f}s",
                flush=True,
            )
    record = {
        "machine": {**machine(), "sklearn": sklearn.__version__, "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "protocol": "70/30 stratified split (random_state=0), StandardScaler fitted on the training part, test log-loss",
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    print()
    print(table(results))


if __name__ == "__main__":
    main()
