r"""The GPyTorch door: ``fit_mll`` and the plain training loop on a model written as in ``docs/user_guide/gpytorch_swap.md``,
beside GPyTorch's SVGP, every method learning its kernel, in one run on one machine.

    python -m benchmarks.gpytorch_door                    # the mixture (3 data seeds) and the real data sets (~1 h here)
    python -m benchmarks.gpytorch_door --datasets mixture5000 --seeds 0
    python -m benchmarks.gpytorch_door --smoke            # tiny sizes, seconds (the tests run it)

Data: the paper's 10-class mixture in 3-D (``mixture5000``: N = 5000, 2000 test points, the samples drawn by the data
seed) and real data sets no other file of the project uses (:mod:`benchmarks.real_data`). The model is the docs' (``SwapModel``):
zero mean and a Matérn-5/2 kernel shared by the classes (lengthscale :math:`\sqrt D`, outputscale 1 to start, GPyTorch's
default constraints), with the strategy's defaults. Methods:

* ``fit_mll_laplace``, ``fit_mll_ep``: ``fit_mll(mll)`` with its defaults, :class:`~gpytorch_iterncgp.IterNCGPStrategy`
  (softmax; logit for binary data) or :class:`~gpytorch_iterncgp.EPStrategy` (multinomial probit; probit), scored once
  after it returns (learning, outputscale choice and final fit counted);
* ``loop_laplace``, ``loop_ep``: the same model in the plain GPyTorch loop of ``docs/user_guide/hyperparameters.md`` (Adam, learning rate
  0.05, on ``-mll(model(train_x), train_y)``) for ``--budget`` seconds, scored ten times along the way;
* ``svgp``: GPyTorch's SVGP, 100 learnt inducing inputs per latent, Adam (learning rate 0.01) on the ELBO in batches
  of 1024, for ``--budget`` seconds (:func:`benchmarks.svgp.run_svgp`);
* ``logistic``, ``boosting``: scikit-learn's ``LogisticRegression`` and ``HistGradientBoostingClassifier`` with their
  defaults, what a practitioner would pick instead.

Test NLL of each method's own predictive against its wall time (evaluations not counted), one thread unless
``--threads``. Writes ``results/gpytorch_door.json`` (with the machine) and ``results/gpytorch_door.png``, and prints
a table per data set: mean ± standard deviation over the seeds of SVGP's NLL at 30, 60 and 120 s, of ``fit_mll``'s
NLL and seconds, and of the plain loop's NLL at 30, 60 and 120 s.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
import time
import warnings
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpytorch
import numpy as np
import torch

from benchmarks import real_data
from benchmarks.common import add_smoke_flag, machine
from benchmarks.data import Data, load
from benchmarks.loops import evidence_loop
from benchmarks.models import ep_likelihood
from benchmarks.scoring import Clock, nll_at, spread
from benchmarks.svgp import run_svgp
from gpytorch_iterncgp import (
    ConvergenceWarning,
    EPMarginalLogLikelihood,
    EPStrategy,
    IterNCGPStrategy,
    LaplaceMarginalLogLikelihood,
    LogitBernoulliLikelihood,
    fit_mll,
)

RESULTS = Path(__file__).resolve().parent / "results"
DATASETS = ("mixture5000", *real_data.DATASETS)
METHODS = ("svgp", "fit_mll_laplace", "fit_mll_ep", "loop_laplace", "loop_ep", "logistic", "boosting")
MARKS = (30.0, 60.0, 120.0)


class SwapModel(gpytorch.models.ApproximateGP):
    r"""The model of ``docs/user_guide/gpytorch_swap.md``: zero mean, ``ScaleKernel(MaternKernel(nu=2.5))`` shared by the
    classes (lengthscale :math:`\sqrt D`, outputscale 1 to start, GPyTorch's default constraints), the strategy's
    defaults."""

    def __init__(self, data: Data, targets: torch.Tensor, strategy_class, likelihood):
        super().__init__(strategy_class(self, data.train_x, targets, likelihood, show_progress=False))
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5))
        self.to(data.train_x)
        self.covar_module.base_kernel.lengthscale = math.sqrt(data.train_x.shape[-1])

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _swap_model(data: Data, inference: str) -> tuple[SwapModel, type]:
    """The docs' model with Laplace (softmax; logit for binary data) or EP (multinomial probit; probit), and the class
    of its evidence."""
    multiclass = data.num_classes > 2
    if inference == "laplace":
        likelihood = (
            gpytorch.likelihoods.SoftmaxLikelihood(num_classes=data.num_classes, mixing_weights=False)
            if multiclass
            else LogitBernoulliLikelihood()
        )
        strategy, evidence = IterNCGPStrategy, LaplaceMarginalLogLikelihood
    else:
        likelihood = ep_likelihood(data.num_classes)
        strategy, evidence = EPStrategy, EPMarginalLogLikelihood
    targets = data.train_y.to(data.train_x)
    return SwapModel(data, targets, strategy, likelihood), evidence


def run_fit_mll(data: Data, inference: str, seed: int) -> dict:
    """``fit_mll`` with its defaults on the docs' model; one score after it returns."""
    torch.manual_seed(seed)
    clock, history = Clock(), []
    model, evidence = _swap_model(data, inference)
    report = fit_mll(evidence(model.variational_strategy.likelihood, model), seed=seed)
    clock.evaluate(history, lambda: model.variational_strategy.predictive_probabilities(data.test_x), data.test_y)
    learning = {key: value for key, value in dataclasses.asdict(report).items() if key != "fit_report"}
    for key in ("learning_rows", "validation_rows"):
        learning.pop(key)
    return {
        "label": f"fit_mll ({inference})",
        "history": history,
        "learning": learning,
        "final_fit": str(report.fit_report),
        "kernel": {
            "lengthscale": float(model.covar_module.base_kernel.lengthscale.detach()),
            "outputscale": float(model.covar_module.outputscale.detach()),
        },
    }


def run_loop(data: Data, inference: str, budget: float, seed: int, learning_rate: float = 0.05) -> dict:
    """The plain GPyTorch loop on the docs' model: Adam on ``-mll(model(train_x), train_y)`` for ``budget`` seconds,
    scored ten times along the way."""
    torch.manual_seed(seed)
    clock = Clock()
    model, evidence = _swap_model(data, inference)
    mll = evidence(model.variational_strategy.likelihood, model)

    def probabilities() -> torch.Tensor:
        # a copy predicts: its eval mode continues the loose fit to convergence, which the training must not inherit
        scored = copy.deepcopy(model).eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)  # the copy's fit at the strategy's own limit
            return scored.variational_strategy.predictive_probabilities(data.test_x)

    history = evidence_loop(model, mll, learning_rate, budget, clock, probabilities, data.test_y)
    return {"label": f"plain loop ({inference}, Adam lr {learning_rate})", "history": history}


def run_sklearn(data: Data, method: str, seed: int) -> dict:
    """What a practitioner would pick instead: scikit-learn's ``LogisticRegression`` (L2, its defaults, 1000 iterations)
    or ``HistGradientBoostingClassifier`` (its defaults, early stopping on 10% of the training rows); one score."""
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression

    estimator = (
        LogisticRegression(max_iter=1000)
        if method == "logistic"
        else HistGradientBoostingClassifier(early_stopping=True, random_state=seed)
    )
    clock, history = Clock(), []
    estimator.fit(data.train_x.numpy(), data.train_y.numpy())
    clock.evaluate(history, lambda: torch.as_tensor(estimator.predict_proba(data.test_x.numpy())), data.test_y)
    return {"label": type(estimator).__name__, "history": history}


def run_one(data: Data, method: str, budget: float, seed: int) -> dict:
    if method in ("logistic", "boosting"):
        return run_sklearn(data, method, seed)
    if method == "svgp":
        latents = data.num_classes if data.num_classes > 2 else 1
        return run_svgp(data, 100 * latents, 0.01, budget, seed)
    approach, _, inference = method.rpartition("_")
    if approach == "fit_mll":
        return run_fit_mll(data, inference, seed)
    return run_loop(data, inference, budget, seed)


def aggregate(runs_by_seed: dict[int, dict[str, dict]], marks: tuple[float, ...]) -> dict:
    """Mean and standard deviation over seeds: NLL at each mark for SVGP and the loops, NLL and seconds for fit_mll."""
    methods = sorted({method for runs in runs_by_seed.values() for method in runs})
    table: dict = {}
    for method in methods:
        runs = [runs[method] for runs in runs_by_seed.values() if method in runs]
        if method.startswith("fit_mll") or method in ("logistic", "boosting"):
            table[method] = {
                "nll": spread([run["history"][-1]["nll"] for run in runs]),
                "seconds": spread([run["history"][-1]["time"] for run in runs]),
            }
        else:
            table[method] = {f"nll_at_{mark:g}s": spread([nll_at(run, mark) for run in runs]) for mark in marks}
    svgp = [runs["svgp"] for runs in runs_by_seed.values() if "svgp" in runs]
    for method in methods:
        if method.startswith("fit_mll") and svgp:
            paired = [
                runs[method]["history"][-1]["nll"] - nll_at(runs["svgp"], 60.0)
                for runs in runs_by_seed.values()
                if method in runs and "svgp" in runs
            ]
            table[method]["minus_svgp_at_60s"] = spread(paired)
            table[method]["seeds_at_or_below_svgp_at_60s"] = sum(value <= 0 for value in paired)
            equal_time = [  # SVGP at fit_mll's own seconds (its last evaluation by then)
                runs[method]["history"][-1]["nll"] - nll_at(runs["svgp"], runs[method]["history"][-1]["time"])
                for runs in runs_by_seed.values()
                if method in runs and "svgp" in runs
            ]
            table[method]["minus_svgp_at_equal_time"] = spread(equal_time)
    return table


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["datasets"])
    figure, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    colors = dict(zip(METHODS, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for axis, name in zip(axes[0], names, strict=True):
        finals = []
        for seed, runs in results["datasets"][name]["runs"].items():
            for method, run in runs.items():
                times = [max(entry["time"], 1e-2) for entry in run["history"]]
                label = run["label"] if seed == next(iter(results["datasets"][name]["runs"])) else None
                style = "o" if len(run["history"]) == 1 else "-"  # fit_mll and the baselines: one score each
                axis.plot(times, [e["nll"] for e in run["history"]], style, color=colors[method], label=label, ms=6)
                finals.append(run["history"][-1]["nll"])
        low, high = min(finals), max(finals)
        axis.set_ylim(low - 0.1 * (high - low) - 0.01, high + 0.5 * (high - low) + 0.01)  # the end of the curves
        axis.set(xscale="log", xlabel="wall time [s] (one thread)", ylabel="test NLL", title=name)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="default: 0 1 2 (mixture), 0 (real data)")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds for SVGP and the plain loops")
    parser.add_argument("--threads", type=int, default=1)
    add_smoke_flag(parser, "tiny sizes and budgets (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.budget = min(args.budget, 2.0)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    marks = tuple(min(mark, args.budget) for mark in MARKS) if args.smoke else MARKS
    results: dict = {
        "machine": machine(),
        "command": "python -m benchmarks.gpytorch_door " + " ".join(sys.argv[1:] if argv is None else argv),
        "budget_seconds": args.budget,
        "threads": args.threads,
        "datasets": {},
    }
    start = time.perf_counter()
    for name in args.datasets:
        seeds = args.seeds if args.seeds is not None else ([0, 1, 2] if name.startswith("mixture") else [0])
        runs_by_seed: dict[int, dict[str, dict]] = {}
        for seed in seeds:
            data = load(name, args.smoke, seed)
            runs_by_seed[seed] = {}
            for method in args.methods:
                run = run_one(data, method, args.budget, seed)
                runs_by_seed[seed][method] = run
                final = run["history"][-1]
                print(
                    f"{name:>12} seed {seed} {run['label']:<36} NLL {final['nll']:.4f} acc {final['accuracy']:.4f} "
                    f"{final['time']:7.1f} s  [{time.perf_counter() - start:6.0f} s]",
                    flush=True,
                )
        results["datasets"][name] = {
            "num_train": len(data.train_y),
            "num_test": len(data.test_y),
            "num_features": data.train_x.shape[-1],
            "num_classes": data.num_classes,
            "seeds": seeds,
            "runs": runs_by_seed,
            "summary": aggregate(runs_by_seed, marks),
        }
        args.out.mkdir(parents=True, exist_ok=True)  # after every data set: a long run keeps what it measured
        stem = "gpytorch_door_smoke" if args.smoke else "gpytorch_door"
        (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1, default=float))
    plot(results, args.out / f"{stem}.png")
    for name, entry in results["datasets"].items():
        print(f"\n{name} (N = {entry['num_train']}, C = {entry['num_classes']}, seeds {entry['seeds']})")
        for method, row in entry["summary"].items():
            cells = ", ".join(
                f"{key} {value['mean']:.4f} ± {value['std']:.4f}" if isinstance(value, dict) else f"{key} {value}"
                for key, value in row.items()
            )
            print(f"  {method:<16} {cells}")
    return results


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
