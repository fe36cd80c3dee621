r"""Every method learns its own kernel: test NLL against wall time, the benchmark users run first.

    python -m benchmarks.learned                                   # every data set and method (hours here)
    python -m benchmarks.learned --datasets mixture5000 --budget 240
    python -m benchmarks.learned --datasets mixture5000 --methods estimator svgp --learning-subsets auto 500 none
    python -m benchmarks.learned --smoke                           # tiny sizes, seconds (the tests run it)

Data sets: the paper's 10-class mixture in 3-D (Appendix C.3; ``mixture5000``, ``mixture10000``, 2000 test points),
all 1797 of scikit-learn's digits (a stratified 70/30 split, features standardised), and a binary problem, the
mixture's classes 0-4 against 5-9 (``binary10000``). Methods, each learning its hyperparameters itself:

* ``estimator``: ``IterNCGPClassifier(random_state=seed)`` with its defaults, and ``estimator_laplace`` and
  ``estimator_ep`` with ``inference="laplace"`` or ``"ep"`` (the rest default); each once per value of
  ``--learning-subsets`` (the estimator's ``learning_subset``: ``auto``, ``none`` or a number of points);
* ``laplace`` and ``ep``: the GPyTorch path, a Matérn-5/2 kernel and a constant mean per class (one latent for
  binary data) with :class:`~gpytorch_iterncgp.IterNCGPStrategy` and the Laplace evidence, or
  :class:`~gpytorch_iterncgp.EPStrategy` (multinomial probit; probit for binary data) and EP's evidence, Adam on
  the evidence for ``--budget`` seconds;
* ``svgp``: GPyTorch's SVGP with the same kernel and mean, learnt inducing inputs (U / C per class, started at
  training inputs) and kernel, Adam on the ELBO in mini-batches of 1024, for U in ``--inducing`` and each learning
  rate in ``--learning-rates``, for ``--budget`` seconds.

Each method is scored by its own predictive: the package's ``predictive_probabilities`` (the estimator's
``predict_proba``); for SVGP, whose latents are independent a posteriori, :math:`\mathbb E[\operatorname{softmax}
(\mathbf f)]` under its marginals by Monte Carlo with 512 fixed samples (:math:`\Phi(\mu/\sqrt{1 + \sigma^2})` for
binary data, exact). Wall time excludes the evaluations. All methods run one after the other in one process, on one
thread unless ``--threads``, so their seconds compare; the JSON records the machine.

Writes ``results/learned.json`` and ``results/learned.png`` (test NLL against wall time, a panel per data set) and
prints a table with each method's final NLL, its seconds, and its seconds as a ratio of the best SVGP run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from torch import Tensor

from benchmarks.common import add_smoke_flag, kernel_hyperparameters, machine
from benchmarks.data import Data, load
from benchmarks.loops import evidence_loop
from benchmarks.models import BenchmarkGP, classification_likelihood, ep_likelihood, training_targets
from benchmarks.scoring import Clock
from benchmarks.svgp import run_svgp
from gpytorch_iterncgp import EPMarginalLogLikelihood, EPStrategy, IterNCGPStrategy, LaplaceMarginalLogLikelihood

RESULTS = Path(__file__).resolve().parent / "results"
DATASETS = ("mixture5000", "mixture10000", "digits", "binary10000")
METHODS = ("estimator", "estimator_laplace", "estimator_ep", "laplace", "ep", "svgp")


class ExactInferenceModel(BenchmarkGP):
    """The shared prior with the package's strategy."""

    def __init__(self, data: Data, strategy_class, likelihood, **options):
        strategy = strategy_class(self, data.train_x, data.train_y, likelihood, show_progress=False, **options)
        super().__init__(strategy, data)


# -- the methods ---------------------------------------------------------------------------------------------------
def run_estimator(
    data: Data,
    seed: int,
    inference: str | None = None,
    learning_subset: str = "auto",
    max_time: float | None = None,
    kernel: str = "auto",
) -> dict:
    """``IterNCGPClassifier(random_state=seed)`` with its defaults (or with ``inference``, ``learning_subset``: an
    integer, ``"auto"`` or ``"none"``, ``max_time``, and ``kernel``: ``"auto"``, the default, or ``"none"``, the
    Matérn alone): one point, after ``fit``."""
    from gpytorch_iterncgp.sklearn import IterNCGPClassifier

    clock, history = Clock(), []
    options: dict = {} if inference is None else {"inference": inference}
    if learning_subset != "auto":
        options["learning_subset"] = None if learning_subset == "none" else int(learning_subset)
    if max_time is not None:
        options["max_time"] = max_time
    if kernel == "none":
        options["kernel"] = None
    label = f"estimator ({', '.join(f'{key}={value!r}' for key, value in options.items()) or 'defaults'})"
    estimator = IterNCGPClassifier(random_state=seed, **options).fit(data.train_x.numpy(), data.train_y.numpy())
    clock.evaluate(history, lambda: torch.as_tensor(estimator.predict_proba(data.test_x.numpy())), data.test_y)
    learning = dataclasses.asdict(estimator.learning_report_)
    return {
        "label": label,
        "inference": estimator.inference_,
        "kernel": kernel_hyperparameters(estimator.kernel_),
        "kernel_choice": None if estimator.kernel_choice_ is None else str(estimator.kernel_choice_),
        "history": history,
        "learning": learning,  # where the hyperparameter learning's time went
        # stochastic EP learns and fits in one loop: no final fit
        "final_fit_seconds": None if estimator.fit_report_ is None else estimator.fit_report_.wall_time,
        "final_fit": str(estimator.fit_report_),
    }


def run_gpytorch_path(data: Data, inference: str, budget: float, seed: int, learning_rate: float = 0.05) -> dict:
    """IterNCGP Laplace (``inference="laplace"``) or EP with Adam on its evidence for ``budget`` seconds."""
    torch.manual_seed(seed)
    if inference == "laplace":
        likelihood = classification_likelihood(data.num_classes)
        strategy, evidence = IterNCGPStrategy, LaplaceMarginalLogLikelihood
    else:
        likelihood = ep_likelihood(data.num_classes)
        strategy, evidence = EPStrategy, EPMarginalLogLikelihood
    targets = training_targets(data)
    clock = Clock()
    model = ExactInferenceModel(dataclasses.replace(data, train_y=targets), strategy, likelihood)
    mll = evidence(likelihood, model)
    strategy_object = model.variational_strategy

    def probabilities() -> Tensor:
        model.eval()
        result = strategy_object.predictive_probabilities(data.test_x)
        model.train()
        return result

    history = evidence_loop(model, mll, learning_rate, budget, clock, probabilities, data.test_y)
    return {"label": f"{inference} (GPyTorch path, Adam lr {learning_rate})", "history": history}


def run_dataset(data: Data, args: argparse.Namespace) -> list[dict]:
    """Every method of ``args.methods`` on ``data``, one after the other."""
    runs: list[dict] = []

    def done(run: dict) -> None:
        runs.append(run)
        final = run["history"][-1]
        print(
            f"{data.name:>13} {run['label']:<40} NLL {final['nll']:.4f} acc {final['accuracy']:.4f} "
            f"{final['time']:8.1f} s",
            flush=True,
        )

    for method in args.methods:
        if method.startswith("estimator"):
            for learning_subset in args.learning_subsets:
                inference = method.partition("_")[2] or None
                done(run_estimator(data, args.seed, inference, learning_subset, kernel=args.estimator_kernel))
        elif method in ("laplace", "ep"):
            done(run_gpytorch_path(data, method, args.budget, args.seed))
        else:
            for num_inducing in args.inducing:
                for learning_rate in args.learning_rates:
                    done(run_svgp(data, num_inducing, learning_rate, args.budget, args.seed))
    return runs


def svgp_at(runs: list[dict], seconds: float) -> dict | None:
    """The SVGP runs' lowest test NLL among their evaluations within ``seconds`` of training (``None`` without SVGP)."""
    entries = [
        {**entry, "method": run["label"]}
        for run in runs
        if run["label"].startswith("SVGP")
        for entry in run["history"]
        if entry["time"] <= seconds
    ]
    return min(entries, key=lambda entry: entry["nll"]) if entries else None


def summary(runs: list[dict]) -> list[dict]:
    """Each run's final NLL and seconds, and its seconds as a ratio of the best (lowest final NLL) SVGP run's."""
    svgp = [run for run in runs if run["label"].startswith("SVGP")]
    best = min(svgp, key=lambda run: run["history"][-1]["nll"]) if svgp else None
    rows = []
    for run in runs:
        final = run["history"][-1]
        ratio = final["time"] / best["history"][-1]["time"] if best else math.nan
        rows.append(
            {
                "method": run["label"],
                "nll": final["nll"],
                "accuracy": final["accuracy"],
                "seconds": final["time"],
                "seconds_vs_best_svgp": ratio,
            }
        )
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["datasets"])
    figure, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for axis, name in zip(axes[0], names, strict=True):
        for run in results["datasets"][name]["runs"]:
            times = [max(entry["time"], 1e-2) for entry in run["history"]]
            axis.plot(times, [entry["nll"] for entry in run["history"]], marker="o", markersize=3, label=run["label"])
        axis.set(xscale="log", xlabel="wall time [s]", ylabel="test NLL", title=name)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--budget", type=float, default=240.0, help="seconds for each learning method")
    parser.add_argument("--inducing", nargs="+", type=int, default=[100, 500, 1000])
    parser.add_argument("--learning-rates", nargs="+", type=float, default=[0.01, 0.05])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--learning-subsets",
        nargs="+",
        default=["auto"],
        help="the estimators' learning_subset values to run: 'auto', 'none' (all the data) or a number of points",
    )
    parser.add_argument(
        "--svgp-within", nargs="+", type=float, default=[60.0], help="report SVGP's best test NLL within these seconds"
    )
    parser.add_argument(
        "--estimator-kernel",
        choices=["auto", "none"],
        default="auto",
        help="the estimators' kernel: 'auto' (their default) or 'none' (the Matérn alone, kernel=None)",
    )
    parser.add_argument("--threads", type=int, default=1)
    add_smoke_flag(parser, "tiny sizes and budgets (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.budget = min(args.budget, 2.0)
        args.inducing, args.learning_rates = [20], [0.05]
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {
        "machine": machine(),
        "command": "python -m benchmarks.learned " + " ".join(sys.argv[1:] if argv is None else argv),
        "budget_seconds": args.budget,
        "seed": args.seed,
        "datasets": {},
    }
    for name in args.datasets:
        data = load(name, args.smoke, args.seed)
        runs = run_dataset(data, args)
        results["datasets"][name] = {
            "num_train": len(data.train_y),
            "num_test": len(data.test_y),
            "num_classes": data.num_classes,
            "runs": runs,
            "summary": summary(runs),
            "svgp_within": {f"{seconds:g}": svgp_at(runs, seconds) for seconds in args.svgp_within},
        }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "learned_smoke" if args.smoke else "learned"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1, default=float))
    plot(results, args.out / f"{stem}.png")
    for name, entry in results["datasets"].items():
        print(f"\n{name} (N = {entry['num_train']})\n| method | test NLL | accuracy | seconds | ÷ best SVGP's |")
        print("| --- | --- | --- | --- | --- |")
        for row in entry["summary"]:
            print(
                f"| {row['method']} | {row['nll']:.4f} | {row['accuracy']:.4f} | {row['seconds']:.1f} | "
                f"{row['seconds_vs_best_svgp']:.2f} |"
            )
        for seconds, best in entry["svgp_within"].items():
            if best is not None:
                print(
                    f"best SVGP within {seconds} s: NLL {best['nll']:.4f} ({best['method']}, at {best['time']:.1f} s)"
                )
    return results


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
