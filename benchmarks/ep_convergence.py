r"""How far the estimator's EP must sweep: its final fit stopped on the marginals (``marginal_tol``, the default) beside
the same fit run on by its sites' test alone, with the test log-loss along the way.

    python -m benchmarks.ep_convergence                                     # three data sets, seeds 0 1 2 (hours)
    python -m benchmarks.ep_convergence --datasets mixture5000 --seeds 0 --max-sweeps 40
    python -m benchmarks.ep_convergence --smoke                             # tiny, seconds

For each data set and seed (one after the other, ``--threads`` threads):

* ``IterNCGPClassifier(random_state=seed)`` with its defaults (the kernel learnt on a subset, the final EP fit stopped
  where a sweep moves the marginals by less than the default ``marginal_tol``): its final fit's sweeps and seconds, the test
  NLL and accuracy;
* at the kernel it learnt, ``IterNCGPClassifier(kernel_, optimizer_steps=0, solver_options={"site_tol": 1e-4, "marginal_tol": None})``: the same
  final fit with the sites' test alone (``site_tol`` 1e-4, no bounded cavity), ``--chunk`` sweeps at a time
  (``EPStrategy.fit(max_sweeps=chunk)`` resumes the sites and recycled actions; each call ends with the covariance
  phase, as the estimator's fit does) up to ``--max-sweeps`` or convergence: the test NLL and the seconds after each
  chunk.

Writes ``results/ep_convergence.json`` (with the machine) and ``results/ep_convergence.png`` (test NLL against the
final fit's seconds).
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch

from benchmarks.common import add_smoke_flag, write_results
from benchmarks.data import load
from benchmarks.scoring import log_loss
from gpytorch_iterncgp.ep.sweeps import EPOptions
from gpytorch_iterncgp.sklearn import IterNCGPClassifier

RESULTS = Path(__file__).resolve().parent / "results"
DATASETS = ("mixture5000", "binary10000", "digits")


def _scores(classifier: IterNCGPClassifier, data) -> dict:
    probabilities = torch.as_tensor(classifier.predict_proba(data.test_x.numpy()))
    return log_loss(probabilities, data.test_y)


def run(name: str, seed: int, chunk: int, max_sweeps: int, smoke: bool) -> dict:
    """The estimator's fit and the sites-only fit at its kernel for one data set and seed; their row."""
    data = load(name, smoke, seed)
    x, y = data.train_x.numpy(), data.train_y.numpy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        classifier = IterNCGPClassifier(random_state=seed).fit(x, y)
        seconds = time.perf_counter() - start
    report = classifier.fit_report_
    default = {
        "inference": classifier.inference_,
        "seconds": seconds,
        "final_fit_seconds": report.wall_time,
        "sweeps": report.steps,
        "converged": report.converged,
        "marginal_change": [record.marginal_change for record in report.records],
        "warnings": sorted({warning.category.__name__ for warning in caught}),
        **_scores(classifier, data),
    }
    sites_only = IterNCGPClassifier(
        classifier.kernel_,
        random_state=seed,
        optimizer_steps=0,
        solver_options={"site_tol": 1e-4, "marginal_tol": None, "max_sweeps": chunk},
    )
    checkpoints, seconds = [], 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each chunk ends at its step limit: that is the point
        sites_only.fit(x, y)
        report, sweeps = sites_only.fit_report_, 0
        while True:
            sweeps, seconds = sweeps + report.steps, seconds + report.wall_time  # the fits' own time, not the scoring
            last = report.records[-1]
            checkpoints.append(
                {
                    "sweeps": sweeps,
                    "seconds": seconds,
                    "converged": report.converged,
                    "site_change": last.site_change,
                    "bounded_cavities": last.bounded_cavities,
                    **_scores(sites_only, data),
                }
            )
            if report.converged or sweeps >= max_sweeps:
                break
            report = sites_only.model_.variational_strategy.fit(max_sweeps=chunk)
    return {"dataset": name, "seed": seed, "num_train": data.num_train, "default": default, "sites_only": checkpoints}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({row["dataset"] for row in rows})
    figure, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.6), squeeze=False)
    for axis, name in zip(axes[0], names, strict=True):
        for row, colour in zip([r for r in rows if r["dataset"] == name], "C0 C1 C2 C3 C4".split(), strict=False):
            points = row["sites_only"]
            axis.plot([p["seconds"] for p in points], [p["nll"] for p in points], "-", color=colour, alpha=0.7)
            axis.plot(row["default"]["final_fit_seconds"], row["default"]["nll"], "*", color=colour, markersize=11)
        axis.set_title(f"{name}: stars stop on the marginals", fontsize=9)
        axis.set_xlabel("seconds of the final EP fit")
        axis.set_ylabel("test NLL")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--chunk", type=int, default=5, help="sweeps between the sites-only fit's test scores")
    parser.add_argument("--max-sweeps", type=int, default=80, help="where the sites-only fit stops if not converged")
    parser.add_argument("--threads", type=int, default=1)
    add_smoke_flag(parser, "tiny data, seconds")
    parser.add_argument("--out", type=Path, default=RESULTS / "ep_convergence.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.chunk, args.max_sweeps = 2, 4
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.datasets:
        for seed in args.seeds:
            row = run(name, seed, args.chunk, args.max_sweeps, args.smoke)
            rows.append(row)
            default, last = row["default"], row["sites_only"][-1]
            print(
                f"{name} seed {seed}: marginals {default['sweeps']} sweeps {default['final_fit_seconds']:.1f} s "
                f"NLL {default['nll']:.4f}; sites only {last['sweeps']} sweeps {last['seconds']:.1f} s "
                f"NLL {last['nll']:.4f} (converged {last['converged']})",
                flush=True,
            )
            # (written after every row: a long run keeps rows)
            write_results(args.out, "ep_convergence", argv, marginal_tol=EPOptions.marginal_tol, rows=rows)
    plot(rows, args.out.with_suffix(".png"))
    return rows


if __name__ == "__main__":
    main()
