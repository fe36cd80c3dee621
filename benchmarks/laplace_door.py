r"""IterNCGP Laplace through its two doors at the kernels learning finds: does the final fit converge with the defaults,
and how far is it from the same kernel fitted to convergence?

    python -m benchmarks.laplace_door                          # the 10-class mixture, N = 5000, 3 data seeds
    python -m benchmarks.laplace_door --grid --doors fit_mll --ranks 100   # and the kernel grid below
    python -m benchmarks.laplace_door --smoke                  # tiny sizes, seconds (the tests run it)

Data: the paper's 10-class mixture in 3-D (``mixture5000``: N = 5000 training and 2000 test points, the samples
drawn by the data seed; :func:`benchmarks.data.load`). For each data seed and each ``preconditioner_rank`` (0, the
paper's plain CG, and the default):

* ``fit_mll``: the docs' model (:class:`benchmarks.gpytorch_door.SwapModel`, softmax, the strategy's defaults) and
  ``fit_mll(LaplaceMarginalLogLikelihood(...), seed=seed)`` with its defaults: the learnt kernel, whether the final fit
  converged (and any ``ConvergenceWarning``), its Newton steps, the whole call's seconds and the test NLL; then the
  same model fitted on to convergence (``fit(max_newton_steps=300)``, the kernel unchanged): its steps and test NLL;
* ``estimator``: ``IterNCGPClassifier(kernel=None, inference="laplace", random_state=seed)`` (the Matérn alone, the
  default kernel until ``kernel="auto"`` became it) with its other defaults, the same
  numbers (its final fit continued by ``fit(max_newton_steps=300)`` on its fitted strategy).

The test NLL is the mean negative log predictive probability of the test labels (the strategy's own predictive; the
estimator's ``predict_proba`` columns are taken in the order of its ``classes_``). A row's ``warnings`` are the
``ConvergenceWarning`` texts of the call: the package's, and scikit-learn's (the estimators re-raise the package's as
scikit-learn's); ``other_warnings`` the distinct texts of any others. A row also has the learning's summary
(``learning``: evaluations, seconds, why it stopped, the outputscale factor) and the final fit's preconditioner work
(``preconditioner``: none at rank 0). Writes ``results/laplace_door.json`` with the machine and the checkout's commit
(``code``; ``package_changes``: uncommitted changes of the package at the start). Seconds are wall time: on a shared
CPU another job's threads inflate them several-fold.

With ``--grid``, each ``fit_mll`` row also has ``grid``: the Laplace approximation on all the training points, fitted
to convergence (``max_newton_steps=300``), at the kernel the evidence learnt with its outputscale times each of
:data:`GRID_OUTPUTSCALE_FACTORS` and its lengthscale times each of :data:`GRID_LENGTHSCALE_FACTORS`: the test NLL of
each, so that the held-out choice of the outputscale (the recipe's factors) can be compared with no choice (factor
1) and with the best of the grid, the approximation's own best near the learnt kernel.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import subprocess
import sys
import time
import warnings
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning as SklearnConvergenceWarning

from benchmarks.common import add_smoke_flag, machine
from benchmarks.data import Data, load
from benchmarks.gpytorch_door import SwapModel, _swap_model
from benchmarks.scoring import log_loss
from gpytorch_iterncgp import ConvergenceWarning, IterNCGPStrategy, fit_mll
from gpytorch_iterncgp.sklearn import IterNCGPClassifier

RESULTS = Path(__file__).resolve().parent / "results"
RANKS = (0, 100)
#: ``--grid``: the learnt outputscale (before the held-out choice) times these, ...
GRID_OUTPUTSCALE_FACTORS = (1.0, 1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64)
#: ... and the learnt lengthscale times these
GRID_LENGTHSCALE_FACTORS = (0.7, 1.0, 1.4)


CONVERGENCE_WARNINGS = (ConvergenceWarning, SklearnConvergenceWarning)


def _nll(probabilities: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean of :math:`-\\log p(y_* \\mid x_*)` over the test points (``probabilities[:, k]``: class ``k``)."""
    return log_loss(probabilities, labels)["nll"]


def _warnings(caught: list) -> dict:
    """The ``ConvergenceWarning`` texts (the package's or scikit-learn's) and the distinct texts of the others."""
    convergence = [str(w.message) for w in caught if issubclass(w.category, CONVERGENCE_WARNINGS)]
    others = sorted(
        {f"{w.category.__name__}: {w.message}" for w in caught if not issubclass(w.category, CONVERGENCE_WARNINGS)}
    )
    return {"warnings": convergence, "other_warnings": others}


def _continued(strategy, data: Data, probabilities) -> dict:
    """The committed state fitted on to convergence with the kernel unchanged; its steps and test NLL."""
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = strategy.fit(max_newton_steps=300)
    return {
        "converged": report.converged,
        "steps": report.steps,
        "seconds": time.perf_counter() - start,
        **_warnings(caught),
        "nll": _nll(probabilities(), data.test_y),
    }


def _preconditioner(report) -> dict:
    """The final fit's preconditioner work (none with ``preconditioner_rank=0``)."""
    return {"products": report.preconditioner_products, "seconds": report.preconditioner_seconds}


def _learning(report) -> dict:
    """What the learning before the final fit did (:class:`~gpytorch_iterncgp.learning.recipe.LearningReport`)."""
    return {
        "evaluations": report.evaluations,
        "data_points": report.data_points,
        "seconds": report.seconds,
        "fit_seconds": report.fit_seconds,
        "stopped": report.stopped,
        "outputscale_factor": report.outputscale_factor,
        "text": str(report),
    }


def _grid(strategy, kernel, factor: float, data: Data, probabilities) -> list[dict]:
    """The converged fit's test NLL at the learnt kernel (outputscale divided by the held-out ``factor`` chosen)
    scaled by the grid's factors; the kernel is left as it was."""
    outputscale, lengthscale = kernel.outputscale.detach().clone(), kernel.base_kernel.lengthscale.detach().clone()
    learnt = outputscale / factor
    points = []
    for outputscale_factor in GRID_OUTPUTSCALE_FACTORS:
        for lengthscale_factor in GRID_LENGTHSCALE_FACTORS:
            kernel.outputscale = learnt * outputscale_factor
            kernel.base_kernel.lengthscale = lengthscale * lengthscale_factor
            point = _continued(strategy, data, probabilities)
            points.append({"outputscale_factor": outputscale_factor, "lengthscale_factor": lengthscale_factor, **point})
    kernel.outputscale, kernel.base_kernel.lengthscale = outputscale, lengthscale
    return points


def run_fit_mll(data: Data, seed: int, rank: int, grid: bool = False) -> dict:
    """``fit_mll`` with its defaults on the docs' model (preconditioner of ``rank``), then fitted on to convergence
    (and with ``grid`` at the kernels of :func:`_grid`)."""
    docs_model, evidence = _swap_model(data, "laplace")  # the likelihood and evidence of the docs' model
    likelihood = docs_model.variational_strategy.likelihood
    torch.manual_seed(seed)
    # the docs' model with the strategy built at this rank (validated by the constructor; the learner's subset model
    # copies the strategy's options)
    model = SwapModel(
        data, data.train_y.to(data.train_x), functools.partial(IterNCGPStrategy, preconditioner_rank=rank), likelihood
    )
    strategy = model.variational_strategy
    assert strategy.options.preconditioner_rank == rank
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = fit_mll(evidence(strategy.likelihood, model), seed=seed)
    seconds = time.perf_counter() - start
    model.eval()

    def probabilities() -> torch.Tensor:
        with torch.no_grad():
            return strategy.predictive_probabilities(data.test_x)

    final = report.fit_report
    row = {
        "door": "fit_mll",
        "seed": seed,
        "preconditioner_rank": rank,
        "seconds": seconds,
        "outputscale": float(model.covar_module.outputscale.detach()),
        "lengthscale": float(model.covar_module.base_kernel.lengthscale.detach()),
        "converged": final.converged,
        "steps": final.steps,
        "final_fit_seconds": final.wall_time,
        "preconditioner": _preconditioner(final),
        "learning": _learning(report),
        **_warnings(caught),
        "nll": _nll(probabilities(), data.test_y),
        "to_convergence": _continued(strategy, data, probabilities),
    }
    if grid:
        row["grid"] = _grid(strategy, model.covar_module, report.outputscale_factor, data, probabilities)
    return row


def run_estimator(data: Data, seed: int, rank: int) -> dict:
    """``IterNCGPClassifier(kernel=None, inference="laplace")`` with its other defaults (preconditioner of ``rank``), then its strategy
    fitted on to convergence."""
    x, y = data.train_x.numpy(), data.train_y.numpy().astype(np.int64)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        estimator = IterNCGPClassifier(  # the Matérn alone, the door's subject (kernel="auto" may choose a sum)
            kernel=None, inference="laplace", solver_options={"preconditioner_rank": rank}, random_state=seed
        )
        estimator.fit(x, y)
    seconds = time.perf_counter() - start
    strategy = estimator.model_.variational_strategy
    assert strategy.options.preconditioner_rank == rank
    classes = torch.as_tensor(estimator.classes_).long()

    def probabilities() -> torch.Tensor:
        """By label: predict_proba's columns are the labels of ``classes_`` (those seen in training), in its order; a
        label the training lacked has probability 0."""
        proba = torch.as_tensor(estimator.predict_proba(data.test_x.numpy()))
        by_label = torch.zeros(len(proba), data.num_classes, dtype=proba.dtype)
        by_label[:, classes] = proba
        return by_label

    final = estimator.fit_report_
    kernel = estimator.model_.covar_module
    return {
        "door": "estimator",
        "seed": seed,
        "preconditioner_rank": rank,
        "seconds": seconds,
        "outputscale": float(kernel.outputscale.detach()),
        "lengthscale": float(kernel.base_kernel.lengthscale.detach().mean()),
        "converged": final.converged,
        "steps": final.steps,
        "final_fit_seconds": final.wall_time,
        "preconditioner": _preconditioner(final),
        "learning": _learning(estimator.learning_report_),
        **_warnings(caught),
        "test_labels_unseen_in_training": int((~torch.isin(data.test_y, classes)).sum()),
        "nll": _nll(probabilities(), data.test_y),
        "to_convergence": _continued(strategy, data, probabilities),
    }


def summarise(rows: list[dict]) -> str:
    """A markdown table: one row per door and rank, mean ± standard deviation over the seeds."""
    lines = [
        "| door | rank | converged | steps | seconds | test NLL | to convergence: steps, NLL | gap |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for door in ("fit_mll", "estimator"):
        for rank in sorted({row["preconditioner_rank"] for row in rows}):
            group = [row for row in rows if row["door"] == door and row["preconditioner_rank"] == rank]
            if not group:
                continue

            def stat(values: list[float]) -> str:
                mean = sum(values) / len(values)
                spread = math.sqrt(sum((v - mean) ** 2 for v in values) / max(1, len(values) - 1))
                return f"{mean:.3f} ± {spread:.3f}"

            gaps = [row["nll"] - row["to_convergence"]["nll"] for row in group]
            lines.append(
                f"| {door} | {rank} | {sum(row['converged'] for row in group)}/{len(group)} "
                f"| {stat([row['steps'] for row in group])} | {stat([row['seconds'] for row in group])} "
                f"| {stat([row['nll'] for row in group])} "
                f"| {stat([row['to_convergence']['steps'] for row in group])}, "
                f"{stat([row['to_convergence']['nll'] for row in group])} | {stat(gaps)} |"
            )
    return "\n".join(lines)


def _code() -> dict:
    """The checkout's commit and whether the package differs from it (the checkout is shared: a run may load code that
    changes under it)."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD"), "package_changes": git("status", "--short", "gpytorch_iterncgp")}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--ranks", nargs="+", type=int, default=list(RANKS))
    parser.add_argument("--doors", nargs="+", default=["fit_mll", "estimator"], choices=["fit_mll", "estimator"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--grid", action="store_true", help="fit_mll rows: the converged fit at a grid of kernels")
    add_smoke_flag(parser, "tiny sizes (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    code = _code()  # at the start, when the package is imported
    runners = {"fit_mll": functools.partial(run_fit_mll, grid=args.grid), "estimator": run_estimator}
    rows = []
    for seed in args.seeds:
        data = load("mixture5000", args.smoke, seed)
        for door in args.doors:
            for rank in args.ranks:
                rows.append(runners[door](data, seed, rank))
                row = rows[-1]
                print(
                    f"{door} seed {seed} rank {rank}: s2 {row['outputscale']:.3g} l {row['lengthscale']:.3g}, "
                    f"converged {row['converged']} in {row['steps']} steps, {row['seconds']:.1f} s, NLL "
                    f"{row['nll']:.4f}; to convergence {row['to_convergence']['steps']} more steps, NLL "
                    f"{row['to_convergence']['nll']:.4f}",
                    flush=True,
                )
                for point in row.get("grid", []):
                    print(
                        f"   s2 x {point['outputscale_factor']:.3g} (of the learnt), l x {point['lengthscale_factor']}: "
                        f"NLL {point['nll']:.4f} ({point['steps']} steps, converged {point['converged']})",
                        flush=True,
                    )
    results = {"machine": machine(), "code": code, "threads": args.threads, "smoke": args.smoke, "rows": rows}
    results["table"] = summarise(rows)
    print(results["table"])
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"laplace_door{'_grid' if args.grid else ''}{'_smoke' if args.smoke else ''}.json"
    (args.out / name).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
