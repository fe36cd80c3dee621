"""Where the default classifier's time goes: seconds by phase, and the fit's seconds by kind of work.

    python -m benchmarks.profile_fit --out benchmarks/results/profile_62/after.json     # ~6 min here
    python -m benchmarks.profile_fit --datasets breast_cancer --out /tmp/profile.json
    python -m benchmarks.profile_fit --table benchmarks/results/profile_62/before.json benchmarks/results/profile_62/after.json

For each data set, ``IterNCGPClassifier(random_state=0)`` (every parameter at its default) is fitted once on split 0
with ``--threads`` threads, under ``cProfile``, then predicts the test rows. Data sets: scikit-learn's breast cancer
(70/30 split, standardised as :mod:`benchmarks.sklearn_defaults` does; ``breast_cancer_raw``: the same rows
unscaled, feature ranges up to 4·10³), a binary and an 11-class set of the tabular panel
(:mod:`benchmarks.real_data`, 80/20 split, standardised).

Phases, from the fit's :class:`~gpytorch_iterncgp.LearningReport`: the kernel choice (every candidate's learning and
scoring), learning the hyperparameters, the held-out outputscale choice, the final fit (its covariance phase
included), everything else in ``fit`` (validation, the check against a constant predictor, model building), and
``predict_proba`` on the test rows.

Kinds of work within ``fit``, from the profile (cumulative seconds of the functions that do them, none inside
another's): products with K (``LatentPrior``'s counted products and kernel columns), factorisations and
eigendecompositions (Cholesky, ``eigh``, triangular solves and inverses outside the tilted moments), tilted moments
(EP's sites: closed form, quadrature, the multinomial probit's inner EP), autograd's backward pass, imports on first
use (``torch.optim`` imports ``torch._dynamo`` when the first optimiser is built: seconds, once per process), the
recycled actions' algebra (the virtual solver runs' S^T W^-1 S and S^T K S, S^T x, Q = S E and K Q = T E), and the rest
(Python, the kernel's evaluation for the evidence, linear_operator's dispatch). The profiler adds its own cost to
Python-heavy code, so the kinds are shares of a profiled fit; the phases' seconds are the report's.

Writes the JSON given by ``--out`` (every number, with the machine); ``--table`` renders one or more such files as the
markdown table of the docs (``docs/user_guide/speed.md`` includes ``benchmarks/results/profile_62/table.md``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
import warnings
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from benchmarks.common import machine

DATASETS = ("breast_cancer", "breast_cancer_raw", "banana", "texture")
# (file name ending, function name) of the functions whose cumulative time is each kind of work
KINDS = {
    "products": (("prior.py", "_counted"),),
    "tilted moments": (("tilted.py", "tilted_moments"), ("multinomial_probit.py", "multinomial_probit_moments")),
    "backward": (("~", "<method 'run_backward' of 'torch._C._EngineBase' objects>"),),
    "imports": (("<frozen importlib._bootstrap>", "_find_and_load"),),
    "buffer algebra": (
        ("recycling.py", "noise_gram"),
        ("recycling.py", "_combination"),
        ("recycling.py", "transpose_matmul"),
        ("recycling.py", "kernel_gram"),
        ("recycling.py", "combine"),
    ),
}
FACTORISATIONS = ("linalg_cholesky", "linalg_eigh", "linalg_solve_triangular", "linalg_inv", "cholesky_solve")
INSIDE_TILTED = ("multinomial_probit.py", "tilted.py")


def split(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``x_train, y_train, x_test, y_test`` of split 0."""
    if name.startswith("breast_cancer"):
        from sklearn.datasets import load_breast_cancer
        from sklearn.model_selection import train_test_split

        from benchmarks.sklearn_defaults import split as standardised_split

        if name == "breast_cancer":
            x_train, x_test, y_train, y_test = standardised_split("breast_cancer", 0)
        else:
            x, y = load_breast_cancer(return_X_y=True)
            x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.3, stratify=y, random_state=0)
        return x_train, y_train, x_test, y_test
    from benchmarks.real_data import load

    data = load(name, False, 0)
    return tuple(t.numpy() for t in (data.train_x, data.train_y, data.test_x, data.test_y))  # type: ignore[return-value]


def kinds_of_work(profile: cProfile.Profile) -> dict[str, float]:
    """Seconds of each kind of work in ``profile`` (see the module docstring)."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    seconds = dict.fromkeys([*KINDS, "factorisations"], 0.0)
    for (filename, _, function), (_, _, _, cumulative, callers) in stats.items():
        for kind, entries in KINDS.items():
            if any(filename.endswith(ending) and function == name for ending, name in entries):
                seconds[kind] += cumulative
        if filename == "~" and any(name in function for name in FACTORISATIONS):
            seconds["factorisations"] += sum(
                timing[2] for caller, timing in callers.items() if not caller[0].endswith(INSIDE_TILTED)
            )
    return seconds


def profile(name: str, threads: int, dump: Path | None = None) -> dict:
    """One profiled default fit and its prediction on ``name``."""
    from sklearn.metrics import log_loss

    from gpytorch_iterncgp.sklearn import IterNCGPClassifier

    torch.set_num_threads(threads)
    x_train, y_train, x_test, y_test = split(name)
    classifier = IterNCGPClassifier(random_state=0)
    profiler = cProfile.Profile()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        profiler.enable()
        classifier.fit(x_train, y_train)
        profiler.disable()
        fit_seconds = time.perf_counter() - start
        start = time.perf_counter()
        probabilities = classifier.predict_proba(x_test)
        predict_seconds = time.perf_counter() - start
    report = classifier.learning_report_
    phases = {
        "kernel choice": sum(scores["seconds"] for scores in report.kernel_scores.values()),
        "learning": report.seconds,
        "outputscale": report.outputscale_seconds,
        "final fit": classifier.fit_report_.wall_time,
    }
    phases["other"] = fit_seconds - sum(phases.values())
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(dump / f"{name}.prof")
    kinds = kinds_of_work(profiler)
    kinds["other"] = fit_seconds - sum(kinds.values())
    return dict(
        dataset=name,
        num_train=len(x_train),
        num_classes=int(len(np.unique(y_train))),
        fit_seconds=fit_seconds,
        predict_seconds=predict_seconds,
        test_rows=len(x_test),
        log_loss=float(log_loss(y_test, probabilities)),
        kernel=report.kernel,
        evaluations=report.evaluations,
        phases=phases,
        kinds=kinds,
    )


def table(paths: list[Path]) -> str:
    """The markdown table of the results files ``paths``: per data set, a row per file (named by its ``label``; a
    data set a file did not run is left out of its rows)."""
    runs = [json.loads(path.read_text()) for path in paths]
    first = runs[-1]["rows"][0]
    phases, kinds = list(first["phases"]), list(first["kinds"])
    header = ["data set (N, C)", "version", "fit s", *[f"{p} s" for p in phases], "predict s", "log-loss"]
    header += [f"{k} %" for k in kinds]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    names = list(dict.fromkeys(row["dataset"] for run in runs for row in run["rows"]))
    for name in names:
        for run in runs:
            entry = next((row for row in run["rows"] if row["dataset"] == name), None)
            if entry is None:
                continue
            cells = [f"{name} ({entry['num_train']}, {entry['num_classes']})", run["label"]]
            cells += [f"{entry['fit_seconds']:.1f}", *[f"{entry['phases'].get(p, 0.0):.1f}" for p in phases]]
            cells += [f"{entry['predict_seconds']:.2f}", f"{entry['log_loss']:.4f}"]
            cells += [f"{100 * entry['kinds'].get(k, 0.0) / entry['fit_seconds']:.0f}" for k in kinds]
            lines.append("| " + " | ".join(cells) + " |")
    machines = {run["label"]: run["machine"].get("cpu", "") for run in runs}
    lines.append("")
    lines.append("Machines: " + "; ".join(f"{label}: {cpu}" for label, cpu in machines.items()) + ".")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--label", default="after", help="the version's name in the table")
    parser.add_argument("--out", type=Path, default=Path("/tmp/profile_fit.json"))
    parser.add_argument("--dump", type=Path, help="also save each fit's cProfile statistics here (NAME.prof)")
    parser.add_argument("--table", type=Path, nargs="+", help="render these results files instead of running")
    parser.add_argument("--table-out", type=Path, help="write the rendered table here (default: print it)")
    args = parser.parse_args()
    if args.table:
        text = table(args.table)
        if args.table_out:
            args.table_out.write_text(text)
        print(text)
        return
    rows = []
    for name in args.datasets:
        rows.append(profile(name, args.threads, args.dump))
        print(json.dumps(rows[-1]), flush=True)
    result = dict(label=args.label, threads=args.threads, machine=machine(), rows=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
