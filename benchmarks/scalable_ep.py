r"""Stochastic EP with inducing inputs beside GPyTorch's SVGP on minibatches, each learning its kernel and inducing
inputs in the same plain loop, in one run on one machine.

    python -m benchmarks.scalable_ep                                   # binary and 10-class mixture, N = 10^5, seed 0
    python -m benchmarks.scalable_ep --seed S --datasets binary100000 binary1000000 mixture100000 magic letter
    python -m benchmarks.scalable_ep --summarise                       # over the seeds in --out: summary.json
    python -m benchmarks.scalable_ep --smoke                           # tiny sizes, seconds
    python -m benchmarks.scalable_ep --device cuda --out benchmarks/results/scalable_ep_cuda

(the second line for S = 0, 1, 2 and the summary are ``benchmarks/README.md`` §18's table; its section lists the
other rows' commands). Data: the paper's mixture in 3-D with :math:`N = 10^5` training points (``mixture100000``: 10
classes; ``binary100000``: classes 0-4 against 5-9) and 2000 test points, and the real data sets of
:mod:`benchmarks.real_data` past :math:`10^4` points (``magic``: binary, ``letter``: 26 classes). Both methods use
GPyTorch's idiom, SVGP's loop (Adam, learning rate 0.01, minibatches of 1024, ``-mll(model(x_b), y_b)``) with the same
Matérn-5/2 kernel (one per class for multi-class data), constant mean, and :math:`M` = ``--inducing`` learnt inducing
inputs in all, started at training inputs:

* ``sep``: :class:`~gpytorch_iterncgp.StochasticEPStrategy` and :class:`~gpytorch_iterncgp.StochasticEPMarginalLogLikelihood`
  (probit for binary data, the multinomial probit for classes); by default (``--sep-layout per-class``) in SVGP's
  layout, :math:`M / C` inducing inputs per class for :math:`C` classes (one set of :math:`M` for binary data);
  ``--sep-layout shared``: one set of :math:`M` shared by the classes;
* ``svgp``: ``VariationalStrategy`` with a Cholesky variational distribution (independent per class) and
  ``VariationalELBO``; Bernoulli (probit) or softmax likelihood (:class:`benchmarks.svgp.SVGPModel`, :math:`M / C`
  inducing inputs per class).

Test NLL of each method's own predictive against its wall time (evaluations not counted), ``--threads`` threads (one
by default) and the peak resident memory of the process. Writes ``results/scalable_ep/<dataset>_seed<S>.json`` (with the
machine) and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import add_smoke_flag, machine, peak_rss_bytes
from benchmarks.data import Data, load
from benchmarks.loops import minibatch_loop
from benchmarks.models import BenchmarkGP, ep_likelihood, inducing_starts, training_targets
from benchmarks.scoring import nll_at, spread
from benchmarks.svgp import run_svgp
from gpytorch_iterncgp import StochasticEPMarginalLogLikelihood, StochasticEPStrategy

RESULTS = Path(__file__).resolve().parent / "results" / "scalable_ep"
MARKS = (60.0, 90.0, 120.0, 150.0, 180.0)  # seconds at which the summary compares the methods


class SEPModel(BenchmarkGP):
    """The benchmarks' shared prior (:class:`benchmarks.models.BenchmarkGP`) with stochastic EP and ``num_inducing`` inducing inputs
    started at training inputs: shared by the classes, or (``per_class``) ``num_inducing / C`` per class, SVGP's
    layout."""

    def __init__(self, data: Data, num_inducing: int, likelihood, generator: torch.Generator, per_class: bool = False):
        sets = data.num_classes if per_class and data.num_classes > 2 else 1
        inducing = inducing_starts(data, num_inducing, sets, generator).squeeze(0)  # (M, D) when shared
        super().__init__(StochasticEPStrategy(self, inducing, likelihood, num_data=len(data.train_y)), data)


def run_sep(
    data: Data,
    num_inducing: int,
    learning_rate: float,
    budget: float,
    seed: int,
    per_class: bool = False,
    schedule: str = "constant",
) -> dict:
    """Stochastic EP in SVGP's loop (module docstring) for ``budget`` seconds, scored ten times along the way
    (``schedule``: :func:`benchmarks.loops.minibatch_steps`)."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    likelihood = ep_likelihood(data.num_classes)
    model = SEPModel(data, num_inducing, likelihood, generator, per_class)
    targets = training_targets(data)
    objective = StochasticEPMarginalLogLikelihood(likelihood, model)
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    strategy = model.variational_strategy

    def probabilities() -> torch.Tensor:
        model.eval()
        result = torch.cat([strategy.predictive_probabilities(x) for x in data.test_x.split(4096)])
        model.train()
        return result

    history = minibatch_loop(
        model, objective, optimizer, data, targets, budget, generator, probabilities, schedule, strategy.update_site
    )
    layout = f"{num_inducing // data.num_classes}/class" if per_class and data.num_classes > 2 else f"M={num_inducing}"
    suffix = "" if schedule == "constant" else f" {schedule}"
    return {"label": f"SEP {layout} lr {learning_rate}{suffix}", "history": history}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for run in results["runs"]:
        history = run["history"]
        axis.plot([h["time"] for h in history], [h["nll"] for h in history], marker="o", label=run["label"])
    axis.set_xlabel("seconds (evaluations not counted)")
    axis.set_ylabel("test NLL")
    where = results["machine"].get("cuda_device") if results.get("device", "cpu") != "cpu" else None
    axis.set_title(f"{results['dataset']}, seed {results['seed']}, {where or results['machine']['cpu']}", fontsize=8)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def window_nll(run: dict, start: float, stop: float) -> float:
    """The mean test NLL of the run's evaluations from ``start`` to ``stop`` seconds (5% grace, as
    :func:`~benchmarks.scoring.nll_at`): one number per run with less of one evaluation's noise."""
    values = [entry["nll"] for entry in run["history"] if 0.95 * start <= entry["time"] <= 1.05 * stop]
    return sum(values) / len(values) if values else math.nan


def summarise(directory: Path, marks: tuple[float, ...] = MARKS) -> dict:
    """Over the seeds of each data set in ``directory``: each method's test NLL at each mark (mean, standard deviation,
    seeds), SEP's minus SVGP's paired by seed, how many seeds SEP was at or below SVGP, the paired difference of the
    mean NLL from the first mark to the last (:func:`window_nll`), and each method's peak memory
    (:func:`benchmarks.scoring.spread`). Written to ``summary.json`` beside the runs."""
    by_dataset: dict[str, list[dict]] = {}
    for path in sorted(directory.glob("*_seed*.json")):
        results = json.loads(path.read_text())
        by_dataset.setdefault(results["dataset"], []).append(results)
    table = {}
    for name, seeds in by_dataset.items():
        runs = [{run["method"]: run for run in results["runs"]} for results in seeds]
        entry: dict = {"seeds": [results["seed"] for results in seeds], "num_train": seeds[0]["num_train"]}
        for method in ("sep", "svgp"):
            present = [by_method[method] for by_method in runs if method in by_method]
            entry[method] = {f"nll_at_{mark:g}s": spread([nll_at(run, mark) for run in present]) for mark in marks}
            entry[method]["peak_rss_gb"] = spread([run["peak_rss_bytes"] / 2**30 for run in present])
        paired = [by_method for by_method in runs if {"sep", "svgp"} <= set(by_method)]
        for mark in marks:
            differences = [nll_at(pair["sep"], mark) - nll_at(pair["svgp"], mark) for pair in paired]
            entry[f"sep_minus_svgp_at_{mark:g}s"] = spread(differences)
            entry[f"seeds_sep_at_or_below_at_{mark:g}s"] = sum(difference <= 0 for difference in differences)
        window = (marks[0], marks[-1])
        differences = [window_nll(pair["sep"], *window) - window_nll(pair["svgp"], *window) for pair in paired]
        entry[f"sep_minus_svgp_mean_{window[0]:g}_to_{window[1]:g}s"] = spread(differences)
        table[name] = entry
    (directory / "summary.json").write_text(json.dumps(table, indent=1))
    return table


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["binary100000", "mixture100000"])
    parser.add_argument("--methods", nargs="+", default=["sep", "svgp"], choices=["sep", "svgp"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=float, default=180.0, help="seconds of each method's own work")
    parser.add_argument("--inducing", type=int, default=200, help="M in all (SVGP: M / C per class)")
    parser.add_argument(
        "--sep-layout",
        choices=["shared", "per-class"],
        default="per-class",
        help="SEP's inducing inputs for C classes: M shared, or M / C per class (SVGP's layout)",
    )
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument(
        "--schedule",
        choices=["constant", "cosine"],
        default="constant",
        help="both methods' learning rate: constant, or annealed to 0 over the budget (cosine)",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="where the data and models live (cpu, cuda)")
    add_smoke_flag(parser, "tiny data and a few seconds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--summarise", action="store_true", help="only summarise the runs in --out over their seeds")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.summarise:
        table = summarise(args.out)
        for name, entry in table.items():
            cells = [
                f"{mark:g}s {entry['sep'][f'nll_at_{mark:g}s']['mean']:.4f}/{entry['svgp'][f'nll_at_{mark:g}s']['mean']:.4f}"
                f" ({entry[f'seeds_sep_at_or_below_at_{mark:g}s']}/{len(entry['seeds'])})"
                for mark in MARKS
            ]
            window = entry[f"sep_minus_svgp_mean_{MARKS[0]:g}_to_{MARKS[-1]:g}s"]
            print(f"{name:>14} SEP/SVGP mean NLL (seeds SEP <= SVGP): " + "  ".join(cells))
            print(
                f"{'':>14} SEP - SVGP, mean over {MARKS[0]:g}-{MARKS[-1]:g} s: {window['mean']:+.4f} ± {window['std']:.4f}"
            )
        return [table]
    torch.set_num_threads(args.threads)
    budget, inducing = (3.0, 20) if args.smoke else (args.budget, args.inducing)
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in args.datasets:
        data = load(name, args.smoke, args.seed).to(args.device)
        runs = []
        for method in args.methods:
            if method == "sep":
                per_class = args.sep_layout == "per-class"
                run = run_sep(data, inducing, args.learning_rate, budget, args.seed, per_class, args.schedule)
            else:
                run = run_svgp(data, inducing, args.learning_rate, budget, args.seed, args.schedule)
            run["method"], run["peak_rss_bytes"] = method, peak_rss_bytes()  # of the process so far
            final = run["history"][-1]
            print(
                f"{name:>14} {run['label']:<24} NLL {final['nll']:.4f} acc {final['accuracy']:.4f} "
                f"{final['time']:7.1f} s {final['adam_steps']} steps",
                flush=True,
            )
            runs.append(run)
        results = {
            "dataset": name,
            "num_train": len(data.train_y),
            "num_classes": data.num_classes,
            "seed": args.seed,
            "budget": budget,
            "schedule": args.schedule,
            "threads": args.threads,
            "device": args.device,
            "machine": machine(),
            "runs": runs,
        }
        path = args.out / f"{name}_seed{args.seed}.json"
        if path.exists():  # keep the other methods' runs of an earlier call with this data set and seed
            earlier = json.loads(path.read_text())["runs"]
            results["runs"] = [run for run in earlier if run.get("method") not in args.methods] + runs
        path.write_text(json.dumps(results, indent=1))
        plot(results, path.with_suffix(".png"))
        written.append(results)
    return written


if __name__ == "__main__":
    main(sys.argv[1:])
