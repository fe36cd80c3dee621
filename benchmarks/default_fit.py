"""The default estimators' seconds and test scores on the tabular panel, one fit at a time, for before/after
comparisons.

    git worktree add /tmp/old 926b2a3                  # the package as it was before a change
    python -m benchmarks.default_fit banana 0 --label old --package-root /tmp/old >> /tmp/panel.jsonl
    python -m benchmarks.default_fit banana 0 --label new >> /tmp/panel.jsonl          # this checkout's package
    python -m benchmarks.default_fit --render /tmp/panel.jsonl --versions old new \
        --out benchmarks/results/speed_62/panel_2.json --table benchmarks/results/speed_62/panel_2.md

One fit is ``IterNCGPClassifier(random_state=0)`` (every other parameter at its default) of the package in
``--package-root`` (default: this checkout) on split ``SPLIT`` of this checkout's :func:`benchmarks.real_data.load`
(80/20, standardised; ``--smoke``: 300 training rows), with ``--threads`` threads, then ``predict_proba`` on the test
rows. A count data set (``nmes1988``, ``doctor_visits``) is fitted by ``IterNCGPPoissonRegressor(random_state=0)``
(``--regressor negbin``: ``IterNCGPNegativeBinomialRegressor``) and ``predict``. The JSON line records the fit's and
the prediction's seconds, the test log-loss and accuracy (:func:`benchmarks.scoring.log_loss`; counts: the mean Poisson
deviance, :func:`benchmarks.scoring.poisson_deviance`, and the training mean's), the package's commit, and the phases of the fit's
:class:`~gpytorch_iterncgp.LearningReport` (kernel choice, learning, outputscale, final fit) with the outputscale
factors the walk fitted. Each fit runs in a process of its own, so that two versions compare as a user meets them;
alternate them per data set and split (the fits of one data set then share the machine's state). ``--render``
collects the lines into a results file (with this machine) and a markdown table: mean ± standard deviation over the
splits per data set and version, and the ratio of the mean fit seconds to the first version's.
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


ROOT = Path(__file__).resolve().parents[1]


def _import_package(root: Path):
    """``gpytorch_iterncgp``'s estimators module from the checkout ``root`` (the package must not have been imported
    from elsewhere)."""
    sys.path.insert(0, str(root))
    import gpytorch_iterncgp

    if Path(gpytorch_iterncgp.__file__).resolve().parents[1] != root.resolve():
        raise RuntimeError(f"gpytorch_iterncgp was imported from {gpytorch_iterncgp.__file__}, not from {root}.")
    from gpytorch_iterncgp.integrations import sklearn as estimators

    sys.path.remove(str(root))
    return estimators


def fit_once(
    dataset: str,
    split: int,
    label: str,
    package_root: Path = ROOT,
    threads: int = 2,
    smoke: bool = False,
    regressor: str = "poisson",
) -> dict:
    """One default fit and prediction on ``dataset``'s split ``split`` (the fields listed in the module docstring);
    a count data set is fitted by the Poisson (``regressor="poisson"``) or negative binomial (``"negbin"``)
    regressor and scored by the test rows' mean Poisson deviance (``deviance``, beside the training mean's)."""
    estimators = _import_package(package_root)
    import torch

    from benchmarks.real_data import load
    from benchmarks.scoring import log_loss, poisson_deviance

    torch.set_num_threads(threads)
    data = load(dataset, smoke, split)
    counts = data.num_classes == 0
    x_train, y_train, x_test = (tensor.numpy() for tensor in (data.train_x, data.train_y, data.test_x))
    if counts:
        names = {"poisson": "IterNCGPPoissonRegressor", "negbin": "IterNCGPNegativeBinomialRegressor"}
        classifier = getattr(estimators, names[regressor])(random_state=0)
    else:
        classifier = estimators.IterNCGPClassifier(random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        classifier.fit(x_train, y_train)
        fit_seconds = time.perf_counter() - start
        start = time.perf_counter()
        probabilities = classifier.predict(x_test) if counts else classifier.predict_proba(x_test)
        predict_seconds = time.perf_counter() - start
    report = getattr(classifier, "learning_report_", None)
    commit = subprocess.run(
        ["git", "-C", str(package_root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    row = dict(
        dataset=dataset,
        split=split,
        version=label,
        commit=commit,
        inference=getattr(classifier, "inference_", None),
        fit=fit_seconds,
        predict=predict_seconds,
    )
    if counts:
        mean = torch.full_like(data.test_y, float(data.train_y.double().mean()), dtype=torch.float64)
        row.update(
            estimator=type(classifier).__name__,
            deviance=poisson_deviance(torch.as_tensor(probabilities), data.test_y)["deviance"],
            mean_deviance=poisson_deviance(mean, data.test_y)["deviance"],
        )
    else:
        score = log_loss(torch.as_tensor(probabilities), data.test_y)
        row.update(log_loss=score["nll"], accuracy=score["accuracy"])
    if report is not None:
        scores = report.kernel_scores or {}
        row.update(
            kernel=report.kernel,
            choice=sum(entry["seconds"] for entry in scores.values()),
            learning=report.seconds,
            outputscale=report.outputscale_seconds,
            factor=report.outputscale_factor,
            factors={str(factor): loss for factor, loss in report.outputscale_scores.items()},
        )
    final = getattr(classifier, "fit_report_", None)
    row["final"] = getattr(final, "wall_time", None)
    return row


def _mean_sd(values: list[float], digits: int) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {spread:.{digits}f}"


def table(rows: list[dict], versions: list[str]) -> str:
    """The markdown table of ``rows`` (one per fit): per data set the splits every version ran, each version's mean ±
    sd fit seconds (and its ratio to the first version's mean), predict seconds and test score (log-loss; counts:
    mean Poisson deviance)."""
    commits = {version: next((r["commit"] for r in rows if r["version"] == version), "") for version in versions}
    names = [f"{version} ({commits[version]})" for version in versions]
    header = ["data set", "splits"]
    header += [f"fit s, {name}" for name in names] + [f"ratio, {name}" for name in names[1:]]
    header += [f"predict s, {name}" for name in names] + [f"test score, {name}" for name in names]
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
        cells += [_mean_sd([r["log_loss"] if "log_loss" in r else r["deviance"] for r in runs[v]], 4) for v in versions]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Fit once (the row) or render (the results file's fields and the table); see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dataset", nargs="?", help="a data set of benchmarks.real_data (classification or counts)")
    parser.add_argument("--regressor", choices=("poisson", "negbin"), help="a count data set's (default: poisson)")
    parser.add_argument("split", nargs="?", type=int, default=0)
    parser.add_argument("--label", default="new", help="the version's name in the results")
    parser.add_argument("--package-root", type=Path, default=ROOT, help="the checkout whose package is fitted")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="300 training rows (seconds)")
    parser.add_argument("--render", type=Path, help="render these JSON lines instead of fitting")
    parser.add_argument("--versions", nargs="+", help="with --render: the versions' labels, the reference first")
    parser.add_argument("--what", default="", help="with --render: what was compared, for the results file")
    parser.add_argument("--out", type=Path, help="with --render: the results file to write")
    parser.add_argument("--table", type=Path, help="with --render: the markdown table to write")
    args = parser.parse_args(argv)
    if args.render is None:
        if args.dataset is None:
            parser.error("give a data set and a split, or --render")
        from benchmarks.real_data import COUNTS

        if args.regressor is not None and args.dataset not in COUNTS:
            parser.error(
                f"--regressor is for the count data sets ({', '.join(COUNTS)}); {args.dataset} is fitted by the classifier"
            )
        regressor = args.regressor or "poisson"
        row = fit_once(args.dataset, args.split, args.label, args.package_root, args.threads, args.smoke, regressor)
        print(json.dumps(row), flush=True)
        return row
    from benchmarks.common import machine

    rows = [json.loads(line) for line in args.render.read_text().splitlines() if line.startswith("{")]
    versions = args.versions or list(dict.fromkeys(row["version"] for row in rows))
    text = table(rows, versions) + f"\n\nMachine: {machine().get('cpu', '')}, two threads."
    command = "python -m benchmarks.default_fit DATASET SPLIT --label VERSION --package-root WORKTREE, per fit"
    result = dict(what=args.what, command=command, machine=machine(), rows=rows, table=text)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.table is not None:
        args.table.write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
