r"""EP's outputscale at the lengthscale the estimator learns: where the N = 5000 gap to SVGP comes from.

    python -m benchmarks.ep_outputscale full --seed 0 --lengthscale 0.499 --outputscales 1.25 2.5 5 10 20
    python -m benchmarks.ep_outputscale subset --seed 1 --lengthscale 0.5215 --outputscales 40 20 10 5 2.5 1.25

The paper's 10-class mixture (:func:`benchmarks.data.load`'s ``mixture5000``, data seed ``--seed``), the estimator's
default kernel (Matérn-5/2) with the lengthscale the estimator learnt on that seed (``learning_report_`` of
``python -m benchmarks.learned --datasets mixture5000 --methods estimator --seed S``: 0.499, 0.5215, 0.5132 on seeds
0, 1, 2) held fixed, and each outputscale of ``--outputscales``:

* ``full``: ``IterNCGPClassifier(kernel, optimizer_steps=0, inference="ep")`` on all 5000 points (its
  defaults: 20 sweeps, j ≤ 5 CG per sweep), test NLL on the 2000 test points;
* ``subset``: the same EP on the estimator's own learning rows (the 1000 rows ``learning_subset="auto"`` draws with
  ``random_state=seed``), ``--sweeps`` sweeps, with ``--max-solver-iterations`` (``auto``: j ≤ 5; ``none``: each
  solve to ``solver_tol``): EP's estimated evidence per point (5 probes, 10 Lanczos iterations, the probes seeded as
  the estimator seeds them), the log-loss on 1000 further training rows (stratified, not among the learning rows),
  and the test NLL.

Prints one JSON line per outputscale and writes them to ``results/ep_outputscale/<mode>_seed<S>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpytorch
import numpy as np
import torch
from sklearn.utils import check_random_state, resample

from benchmarks.common import machine
from benchmarks.data import load
from benchmarks.scoring import log_loss
from gpytorch_iterncgp import EPMarginalLogLikelihood
from gpytorch_iterncgp.integrations.sklearn import IterNCGPClassifier
from gpytorch_iterncgp.learning.estimator_policy import default_kernel

RESULTS = Path(__file__).resolve().parent / "results" / "ep_outputscale"


def run(mode: str, seed: int, lengthscale: float, outputscales: list[float], sweeps: int, iterations) -> list[dict]:
    data = load("mixture5000", False, seed)
    x, y = data.train_x.numpy(), data.train_y.numpy()
    # the estimator's own learning rows: IterNCGPClassifier(random_state=seed) draws them with this seed
    estimator_seed = int(check_random_state(seed).randint(np.iinfo(np.int32).max))
    rows = IterNCGPClassifier(random_state=seed)._learning_rows(len(x), 10, y, estimator_seed)
    rest = np.setdiff1d(np.arange(len(x)), rows)
    held_out = resample(rest, replace=False, n_samples=1000, stratify=y[rest], random_state=estimator_seed)
    results = []
    for outputscale in outputscales:
        kernel = default_kernel(x.shape[1])
        kernel.base_kernel.lengthscale, kernel.outputscale = lengthscale, outputscale
        options = dict(optimizer_steps=0, inference="ep", random_state=seed)
        if mode == "subset":
            options.update(solver_options={"max_sweeps": sweeps, "max_solver_iterations": iterations})
        estimator = IterNCGPClassifier(kernel, **options)
        fit_x, fit_y = (x, y) if mode == "full" else (x[rows], y[rows])
        tic = time.perf_counter()
        estimator.fit(fit_x, fit_y)
        row = dict(
            mode=mode,
            seed=seed,
            lengthscale=lengthscale,
            outputscale=outputscale,
            fit_seconds=time.perf_counter() - tic,
            fit=str(estimator.fit_report_).split(";")[0],
        )
        row["test_nll"] = log_loss(torch.as_tensor(estimator.predict_proba(data.test_x.numpy())), data.test_y)["nll"]
        if mode == "subset":
            row["held_out_nll"] = log_loss(
                torch.as_tensor(estimator.predict_proba(x[held_out])), torch.as_tensor(y[held_out])
            )["nll"]
            model, strategy = estimator.model_, estimator.model_.variational_strategy
            model.train()
            with (
                torch.no_grad(),
                gpytorch.settings.num_trace_samples(5),
                gpytorch.settings.max_lanczos_quadrature_iterations(10),
            ):
                torch.manual_seed(estimator_seed)
                evidence = EPMarginalLogLikelihood(estimator.likelihood_, model)(
                    model(strategy.train_inputs), strategy.train_targets
                )
            row["evidence_per_point"] = float(evidence)
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("full", "subset"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lengthscale", type=float, required=True)
    parser.add_argument("--outputscales", type=float, nargs="+", required=True)
    parser.add_argument("--sweeps", type=int, default=10)
    parser.add_argument("--max-solver-iterations", default="auto", help="'auto' (j <= 5) or 'none' (to solver_tol)")
    parser.add_argument("--threads", type=int, default=1)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    iterations = None if args.max_solver_iterations == "none" else args.max_solver_iterations
    rows = run(args.mode, args.seed, args.lengthscale, args.outputscales, args.sweeps, iterations)
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "" if iterations == "auto" else "_full_solves"
    path = RESULTS / f"{args.mode}_seed{args.seed}{suffix}.json"
    path.write_text(
        json.dumps(
            dict(machine=machine(), command=" ".join(["python -m benchmarks.ep_outputscale", *argv]), rows=rows),
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
