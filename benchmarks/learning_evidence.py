"""Which evidence learns EP's kernel: the default classifier with ``LearningRecipe.evidence="ep"`` (EP's own evidence
where it is exact, N C <= 1000) and ``"laplace"`` (Laplace's everywhere), split by split, in one run.

    python -m benchmarks.learning_evidence --out benchmarks/results/profile_62/learning_evidence_small.json
    python -m benchmarks.learning_evidence --datasets banana phoneme twonorm spambase --splits 3 --threads 2 \\
        --out benchmarks/results/profile_62/learning_evidence_panel.json

For each data set and split, ``IterNCGPClassifier(random_state=split)`` with every other parameter at its default,
fitted twice, once per value of the recipe's ``evidence`` (the estimators build their ``LearningRecipe`` in
:mod:`gpytorch_iterncgp.integrations.sklearn`; the script gives that name a ``functools.partial`` with the value), then
scored by test log-loss and accuracy. scikit-learn's small sets are split as :mod:`benchmarks.sklearn_defaults` splits
them (70/30 stratified, standardised), the tabular panel's as :mod:`benchmarks.real_data` does (80/20, standardised).
Where the evidences differ: the small sets (N C <= 1000, EP's evidence exact: L-BFGS on it against L-BFGS on
Laplace's) and the binary sets' kernel choice on 1000 rows; the multi-class panel sets learn on Laplace's either way.

Writes every fit's seconds and scores, with the machine, to ``--out`` and prints a summary per data set: the mean
log-loss of each with its standard deviation, the mean paired difference (Laplace's minus EP's) with its standard
error, and the mean seconds.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from sklearn.metrics import accuracy_score, log_loss

import gpytorch_iterncgp.integrations.sklearn as sklearn_integration
from benchmarks.common import machine
from gpytorch_iterncgp.learning.recipe import EVIDENCES, LearningRecipe
from gpytorch_iterncgp.sklearn import IterNCGPClassifier

SMALL = ("iris", "wine", "breast_cancer")


def split(name: str, seed: int):
    """``x_train, y_train, x_test, y_test`` (numpy) of split ``seed``."""
    if name in SMALL:
        from benchmarks.sklearn_defaults import split as small_split

        x_train, x_test, y_train, y_test = small_split(name, seed)
        return x_train, y_train, x_test, y_test
    from benchmarks.real_data import load

    data = load(name, False, seed)
    return tuple(t.numpy() for t in (data.train_x, data.train_y, data.test_x, data.test_y))


def fit(name: str, seed: int, evidence: str) -> dict:
    """One default fit with the recipe's ``evidence``, and its test scores."""
    x_train, y_train, x_test, y_test = split(name, seed)
    sklearn_integration.LearningRecipe = functools.partial(LearningRecipe, evidence=evidence)  # type: ignore[misc]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            classifier = IterNCGPClassifier(random_state=seed).fit(x_train, y_train)
            seconds = time.perf_counter() - start
            probabilities = classifier.predict_proba(x_test)
    finally:
        sklearn_integration.LearningRecipe = LearningRecipe  # type: ignore[misc]
    return dict(
        dataset=name,
        split=seed,
        evidence=evidence,
        seconds=seconds,
        log_loss=float(log_loss(y_test, probabilities, labels=classifier.classes_)),
        accuracy=float(accuracy_score(y_test, classifier.classes_[probabilities.argmax(1)])),
        learnt_on=classifier.learning_report_.evidence,
        kernel=classifier.learning_report_.kernel,
        evaluations=classifier.learning_report_.evaluations,
    )


def summary(rows: list[dict]) -> str:
    """The printed table: per data set, each evidence's mean log-loss and seconds, and the paired difference."""
    lines = [
        "| data set | splits | EP's evidence | Laplace's | Laplace - EP (se) | Laplace at or below | seconds, EP / Laplace |"
    ]
    lines.append("| --- | --- | --- | --- | --- | --- | --- |")
    for name in dict.fromkeys(row["dataset"] for row in rows):
        by = {e: [r for r in rows if r["dataset"] == name and r["evidence"] == e] for e in EVIDENCES}
        splits = sorted({r["split"] for r in by["ep"]} & {r["split"] for r in by["laplace"]})
        if not splits:
            continue
        pick = {e: [next(r for r in by[e] if r["split"] == s) for s in splits] for e in EVIDENCES}
        losses = {e: [r["log_loss"] for r in pick[e]] for e in EVIDENCES}
        seconds = {e: statistics.mean(r["seconds"] for r in pick[e]) for e in EVIDENCES}
        difference = [b - a for a, b in zip(losses["ep"], losses["laplace"], strict=True)]
        spread = statistics.stdev if len(splits) > 1 else (lambda values: 0.0)
        error = spread(difference) / len(difference) ** 0.5
        lines.append(
            f"| {name} | {len(splits)} | {statistics.mean(losses['ep']):.4f} ± {spread(losses['ep']):.4f} | "
            f"{statistics.mean(losses['laplace']):.4f} ± {spread(losses['laplace']):.4f} | "
            f"{statistics.mean(difference):+.4f} ({error:.4f}) | {sum(d <= 0 for d in difference)} of {len(splits)} | "
            f"{seconds['ep']:.1f} / {seconds['laplace']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=list(SMALL))
    parser.add_argument("--splits", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows: list[dict] = []
    for name in args.datasets:
        for seed in range(args.splits):
            for evidence in EVIDENCES:
                rows.append(fit(name, seed, evidence))
                print(json.dumps(rows[-1]), flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                result = dict(machine=machine(), threads=args.threads, fits=rows)
                args.out.write_text(json.dumps(result, indent=1))
    print(summary(rows))


if __name__ == "__main__":
    main()
