"""The default classifier's seconds and log-loss on the tabular panel, one fit at a time, for before/after comparisons.

    python -m benchmarks.default_fit banana 0 --label new >> /tmp/panel.jsonl     # one fit: one JSON line
    python -m benchmarks.default_fit --render /tmp/panel.jsonl --out benchmarks/results/speed_62/panel_2.json \\
        --table benchmarks/results/speed_62/panel_2.md --versions old new

One fit is ``IterNCGPClassifier(random_state=0)`` (every other parameter at its default) on split ``SPLIT`` of
:func:`benchmarks.real_data.load` (80/20, standardised), with two threads, then ``predict_proba`` on the test rows; the
line records the fit's and the prediction's seconds, the test log-loss (scikit-learn's) and accuracy, the commit, and
the phases of the fit's :class:`~gpytorch_iterncgp.LearningReport` (kernel choice, learning, outputscale, final fit)
with the outputscale factors the walk fitted. Each fit runs in a process of its own, so that two versions compare as a
user meets them; to compare two commits, run the module from the repository root with ``PYTHONPATH`` set to a
worktree of each commit in turn, alternating per data set and split (the fits of one data set then share the
machine's state). ``--render`` collects the lines into a results file (with this machine) and a markdown table: mean ±
standard deviation over the splits per data set and version, and the ratio of the mean fit seconds to the first
version's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

if not __package__:  # run as a file: the package imports below need the repository's root (or PYTHONPATH's)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def fit_once(dataset: str, split: int, label: str) -> dict:
    """One default fit and prediction on ``dataset``'s split ``split`` (the fields listed in the module docstring)."""
    import torch
    from sklearn.metrics import accuracy_score, log_loss

    from benchmarks.real_data import load
    from gpytorch_iterncgp.sklearn import IterNCGPClassifier

    torch.set_num_threads(2)
    data = load(dataset, False, split)
    x_train, y_train, x_test, y_test = (t.numpy() for t in (data.train_x, data.train_y, data.test_x, data.test_y))
    classifier = IterNCGPClassifier(random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        classifier.fit(x_train, y_train)
        fit_seconds = time.perf_counter() - start
        start = time.perf_counter()
        probabilities = classifier.predict_proba(x_test)
        predict_seconds = time.perf_counter() - start
    report = getattr(classifier, "learning_report_", None)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    row = dict(
        dataset=dataset,
        split=split,
        version=label,
        commit=commit,
        inference=getattr(classifier, "inference_", None),
        fit=fit_seconds,
        predict=predict_seconds,
        log_loss=float(log_loss(y_test, probabilities, labels=list(range(probabilities.shape[1])))),
        accuracy=float(accuracy_score(y_test, probabilities.argmax(1))),
    )
    if report is not None:
        scores = report.kernel_scores or {}
        row.update(
            kernel=report.kernel,
            choice=sum(score["seconds"] for score in scores.values()),
            learning=report.seconds,
            outputscale=report.outputscale_seconds,
            factor=report.outputscale_factor,
            factors={str(factor): loss for factor, loss in report.outputscale_log_loss.items()},
        )
    final = getattr(classifier, "fit_report_", None)
    row["final"] = getattr(final, "wall_time", None)
    return row


def _mean_sd(values: list[float], digits: int) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {spread:.{digits}f}"


def table(rows: list[dict], versions: list[str]) -> str:
    """The markdown table of ``rows`` (one per fit): per data set the splits every version ran, each version's mean ±
    sd fit seconds (and its ratio to the first version's mean), predict seconds and test log-loss."""
    commits = {version: next((r["commit"] for r in rows if r["version"] == version), "") for version in versions}
    names = [f"{version} ({commits[version]})" for version in versions]
    header = ["data set", "splits"]
    header += [f"fit s, {name}" for name in names] + [f"ratio, {name}" for name in names[1:]]
    header += [f"predict s, {name}" for name in names] + [f"log-loss, {name}" for name in names]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        by = {v: {r["split"]: r for r in rows if r["dataset"] == dataset and r["version"] == v} for v in versions}
        splits = sorted(set.intersection(*(set(runs) for runs in by.values())))
        if not splits:
            continue
        runs = {v: [by[v][s] for s in splits] for v in versions}
        fits = {v: [r["fit"] for r in runs[v]] for v in versions}
        cells = [dataset, str(len(splits))]
        cells += [_mean_sd(fits[v], 1) for v in versions]
        cells += [f"{statistics.mean(fits[v]) / statistics.mean(fits[versions[0]]):.2f}" for v in versions[1:]]
        cells += [_mean_sd([r["predict"] for r in runs[v]], 2) for v in versions]
        cells += [_mean_sd([r["log_loss"] for r in runs[v]], 4) for v in versions]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dataset", nargs="?", help="a data set of benchmarks.real_data")
    parser.add_argument("split", nargs="?", type=int, default=0)
    parser.add_argument("--label", default="new", help="the version's name in the results")
    parser.add_argument("--render", type=Path, help="render these JSON lines instead of fitting")
    parser.add_argument("--out", type=Path, help="with --render: the results file to write")
    parser.add_argument("--table", type=Path, help="with --render: the markdown table to write")
    parser.add_argument("--versions", nargs="+", help="with --render: the versions' labels, the reference first")
    parser.add_argument("--what", default="", help="with --render: what was compared, for the results file")
    args = parser.parse_args()
    if args.render is None:
        if args.dataset is None:
            parser.error("give a data set and a split, or --render")
        print(json.dumps(fit_once(args.dataset, args.split, args.label)), flush=True)
        return
    from benchmarks.common import machine

    rows = [json.loads(line) for line in args.render.read_text().splitlines() if line.startswith("{")]
    versions = args.versions or list(dict.fromkeys(r["version"] for r in rows))
    text = table(rows, versions) + f"\n\nMachine: {machine().get('cpu', '')}, two threads."
    if args.out is not None:
        command = "python -m benchmarks.default_fit DATASET SPLIT --label VERSION, in a worktree of each version"
        result = dict(what=args.what, command=command, machine=machine(), rows=rows)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.table is not None:
        args.table.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
