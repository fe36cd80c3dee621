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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gpytorch
import numpy as np
import torch
from torch import Tensor

from benchmarks.common import machine
from gpytorch_iterncgp import (
    EPMarginalLogLikelihood,
    EPStrategy,
    IterNCGPStrategy,
    LaplaceMarginalLogLikelihood,
    MinibatchRecipe,
    MultinomialProbitLikelihood,
)
from gpytorch_iterncgp.datasets import gaussian_mixture

RESULTS = Path(__file__).resolve().parent / "results"
DATASETS = ("mixture5000", "mixture10000", "digits", "binary10000")
METHODS = ("estimator", "estimator_laplace", "estimator_ep", "laplace", "ep", "svgp")


@dataclass
class Data:
    """A classification problem: standardised float64 inputs, integer labels in ``[0, num_classes)``."""

    name: str
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    num_classes: int


def load(name: str, smoke: bool, seed: int) -> Data:
    """The data set ``name`` (``mixture<N>``, ``binary<N>``, ``digits``); smaller with ``smoke``."""
    if name == "digits":
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
        from sklearn.preprocessing import StandardScaler

        x, y = load_digits(return_X_y=True)
        if smoke:
            x, y = x[:300], y[:300]
        x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.3, stratify=y, random_state=seed)
        scaler = StandardScaler().fit(x_train)
        tensors = [torch.as_tensor(a) for a in (scaler.transform(x_train), y_train, scaler.transform(x_test), y_test)]
        return Data(name, tensors[0], tensors[1].long(), tensors[2], tensors[3].long(), 10)
    num_train = 200 if smoke else int(name.removeprefix("mixture").removeprefix("binary"))
    train_x, train_y, test_x, test_y = gaussian_mixture(
        num_train, 100 if smoke else 2000, sample_seed=seed, dtype=torch.float64
    )
    if name.startswith("binary"):
        return Data(name, train_x, (train_y >= 5).long(), test_x, (test_y >= 5).long(), 2)
    return Data(name, train_x, train_y, test_x, test_y, 10)


def log_loss(probabilities: Tensor, labels: Tensor) -> dict[str, float]:
    """Test NLL (mean negative log probability of the true class, clamped at 1e-15) and accuracy; ``probabilities``
    ``(N*, C)``, or ``(N*,)`` for :math:`p(y = 1)`."""
    if probabilities.dim() == 1:
        probabilities = torch.stack([1 - probabilities, probabilities], dim=-1)
    probabilities = probabilities.double()
    true_class = probabilities.gather(-1, labels[:, None])[:, 0].clamp_min(1e-15)
    accuracy = (probabilities.argmax(-1) == labels).double().mean()
    return {"nll": float(-true_class.log().mean()), "accuracy": float(accuracy)}


class Clock:
    """Wall time of a method's own work: :meth:`paused` blocks (the evaluations) are not counted."""

    def __init__(self) -> None:
        self.start, self.paused_seconds = time.perf_counter(), 0.0

    def elapsed(self) -> float:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the work queued so far, not only launched
        return time.perf_counter() - self.start - self.paused_seconds

    def evaluate(self, history: list[dict], probabilities: Callable[[], Tensor], labels: Tensor, **extra) -> dict:
        """Score ``probabilities()`` against ``labels`` into ``history``, the time spent not counted."""
        now, tic = self.elapsed(), time.perf_counter()
        with torch.no_grad():
            entry = {"time": now, **log_loss(probabilities(), labels), **extra}
        history.append(entry)
        self.paused_seconds += time.perf_counter() - tic
        return entry


# -- the GPyTorch models -------------------------------------------------------------------------------------------
def _latent_shape(data: Data) -> torch.Size:
    return torch.Size([data.num_classes]) if data.num_classes > 2 else torch.Size([])


def matern_kernel(data: Data, batch: torch.Size) -> gpytorch.kernels.ScaleKernel:
    r"""Matérn-5/2 with outputscale 1 and lengthscale :math:`\sqrt D` to start (standardised inputs in :math:`D`
    dimensions are about :math:`\sqrt{2 D}` apart), the same start for every method."""
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5, batch_shape=batch), batch_shape=batch)
    kernel.base_kernel.lengthscale = math.sqrt(data.train_x.shape[-1])
    return kernel


class BenchmarkGP(gpytorch.models.ApproximateGP):
    """The prior every method shares: Matérn-5/2 kernel (:func:`matern_kernel`) and constant mean per class (one
    latent for binary data), in the data's dtype; a subclass passes its strategy."""

    def __init__(self, strategy, data: Data):
        super().__init__(strategy)
        batch = _latent_shape(data)
        self.mean_module = gpytorch.means.ConstantMean(batch_shape=batch)
        self.covar_module = matern_kernel(data, batch)
        self.to(data.train_x)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


class ExactInferenceModel(BenchmarkGP):
    """The shared prior with the package's strategy."""

    def __init__(self, data: Data, strategy_class, likelihood, **options):
        strategy = strategy_class(self, data.train_x, data.train_y, likelihood, show_progress=False, **options)
        super().__init__(strategy, data)


def inducing_starts(data: Data, num_inducing: int, sets: int, generator: torch.Generator) -> Tensor:
    """``num_inducing / sets`` training inputs (at least one, at most all) for each of ``sets`` sets of inducing
    inputs, drawn without replacement within a set: ``(sets, M, D)``."""
    size = min(max(1, num_inducing // sets), len(data.train_y))
    index = torch.cat([torch.randperm(len(data.train_y), generator=generator)[:size] for _ in range(sets)])
    return data.train_x[index].reshape(sets, size, -1).clone()


class SVGPModel(BenchmarkGP):
    """GPyTorch's SVGP with the same kernel and mean: U / C learnt inducing inputs per class started at training
    inputs, a Cholesky variational distribution, independent latents (one latent for binary data)."""

    def __init__(self, data: Data, num_inducing: int, generator: torch.Generator):
        batch = _latent_shape(data)
        latents = batch.numel()
        starts = inducing_starts(data, num_inducing, latents, generator)
        per_latent = starts.shape[-2]
        inducing = starts.reshape(*batch, per_latent, -1)
        distribution = gpytorch.variational.CholeskyVariationalDistribution(per_latent, batch_shape=batch)
        strategy = gpytorch.variational.VariationalStrategy(self, inducing, distribution, learn_inducing_locations=True)
        if latents > 1:
            strategy = gpytorch.variational.IndependentMultitaskVariationalStrategy(strategy, num_tasks=latents)
        super().__init__(strategy, data)


def svgp_probabilities(model: SVGPModel, inputs: Tensor, num_classes: int, samples: int = 512) -> Tensor:
    r"""SVGP's predictive: :math:`\Phi(\mu / \sqrt{1 + \sigma^2})` for binary data, else
    :math:`\mathbb E[\operatorname{softmax}(\mathbf f)]` under independent marginals by Monte Carlo (fixed samples)."""
    model.eval()
    output = model(inputs)
    mean, variance = output.mean, output.variance
    model.train()
    if num_classes == 2:
        return torch.special.ndtr(mean / (1 + variance).sqrt())
    base = torch.randn(samples, 1, num_classes, generator=torch.Generator().manual_seed(0), dtype=mean.dtype)
    base = base.to(mean.device)
    return torch.softmax(mean + variance.sqrt() * base, dim=-1).mean(0)


# -- the methods ---------------------------------------------------------------------------------------------------
def run_estimator(
    data: Data, seed: int, inference: str | None = None, learning_subset: str = "auto", max_time: float | None = None
) -> dict:
    """``IterNCGPClassifier(random_state=seed)`` with its defaults (or with ``inference``, ``learning_subset``: an
    integer, ``"auto"`` or ``"none"``, and ``max_time``): one point, after ``fit``."""
    from gpytorch_iterncgp.sklearn import IterNCGPClassifier

    clock, history = Clock(), []
    options: dict = {} if inference is None else {"inference": inference}
    if learning_subset != "auto":
        options["learning_subset"] = None if learning_subset == "none" else int(learning_subset)
    if max_time is not None:
        options["max_time"] = max_time
    label = f"estimator ({', '.join(f'{key}={value!r}' for key, value in options.items()) or 'defaults'})"
    estimator = IterNCGPClassifier(random_state=seed, **options).fit(data.train_x.numpy(), data.train_y.numpy())
    clock.evaluate(history, lambda: torch.as_tensor(estimator.predict_proba(data.test_x.numpy())), data.test_y)
    learning = dataclasses.asdict(estimator.learning_report_)
    return {
        "label": label,
        "inference": estimator.inference_,
        "kernel": {
            "lengthscale": estimator.kernel_.base_kernel.lengthscale.detach().flatten().tolist(),
            "outputscale": estimator.kernel_.outputscale.detach().flatten().tolist(),
        },
        "history": history,
        "learning": learning,  # where the hyperparameter learning's time went
        # stochastic EP learns and fits in one loop: no final fit
        "final_fit_seconds": None if estimator.fit_report_ is None else estimator.fit_report_.wall_time,
        "final_fit": str(estimator.fit_report_),
    }


def _evidence_steps(model, mll, learning_rate: float, budget: float) -> Iterator[int]:
    """Adam on the negative evidence; yields the step count after each step until ``budget`` seconds have passed
    (the caller's clock decides)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    model.train()
    step = 0
    while True:
        optimizer.zero_grad()
        loss = -mll(model(model.variational_strategy.train_inputs), model.variational_strategy.train_targets)
        loss.backward()
        optimizer.step()
        step += 1
        yield step


def run_gpytorch_path(data: Data, inference: str, budget: float, seed: int, learning_rate: float = 0.05) -> dict:
    """IterNCGP Laplace (``inference="laplace"``) or EP with Adam on its evidence for ``budget`` seconds."""
    torch.manual_seed(seed)
    multiclass = data.num_classes > 2
    if inference == "laplace":
        likelihood = (
            gpytorch.likelihoods.SoftmaxLikelihood(num_classes=data.num_classes, mixing_weights=False)
            if multiclass
            else gpytorch.likelihoods.BernoulliLikelihood()
        )
        strategy, evidence = IterNCGPStrategy, LaplaceMarginalLogLikelihood
    else:
        likelihood = (
            MultinomialProbitLikelihood(num_classes=data.num_classes)
            if multiclass
            else gpytorch.likelihoods.BernoulliLikelihood()
        )
        strategy, evidence = EPStrategy, EPMarginalLogLikelihood
    targets = data.train_y if multiclass else data.train_y.to(data.train_x)
    clock, history = Clock(), []
    model = ExactInferenceModel(Data(**{**data.__dict__, "train_y": targets}), strategy, likelihood)
    mll = evidence(likelihood, model)
    strategy_object = model.variational_strategy

    def probabilities() -> Tensor:
        model.eval()
        result = strategy_object.predictive_probabilities(data.test_x)
        model.train()
        return result

    next_evaluation = 0.0
    for step in _evidence_steps(model, mll, learning_rate, budget):
        if clock.elapsed() >= next_evaluation or clock.elapsed() >= budget:
            clock.evaluate(history, probabilities, data.test_y, optimizer_steps=step)
            next_evaluation = clock.elapsed() + budget / 10
        if clock.elapsed() >= budget:
            break
    return {"label": f"{inference} (GPyTorch path, Adam lr {learning_rate})", "history": history}


def run_svgp(
    data: Data, num_inducing: int, learning_rate: float, budget: float, seed: int, schedule: str = "constant"
) -> dict:
    """SVGP with learnt kernel and inducing inputs, Adam on the ELBO in mini-batches of 1024, ``budget`` seconds
    (``schedule``: :func:`minibatch_loop`)."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = SVGPModel(data, num_inducing, generator)
    multiclass = data.num_classes > 2
    likelihood = (
        gpytorch.likelihoods.SoftmaxLikelihood(num_classes=data.num_classes, mixing_weights=False)
        if multiclass
        else gpytorch.likelihoods.BernoulliLikelihood()
    ).to(data.train_x)
    targets = data.train_y if multiclass else data.train_y.to(data.train_x)
    objective = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=len(targets))
    optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=learning_rate)
    history = minibatch_loop(
        model,
        objective,
        optimizer,
        data,
        targets,
        budget,
        generator,
        lambda: svgp_probabilities(model, data.test_x, data.num_classes),
        schedule,
    )
    suffix = "" if schedule == "constant" else f" {schedule}"
    return {"label": f"SVGP U={num_inducing} lr {learning_rate}{suffix}", "history": history}


def minibatch_loop(
    model,
    objective,
    optimizer,
    data: Data,
    targets: Tensor,
    budget: float,
    generator,
    probabilities,
    schedule: str = "constant",
    update_site=None,
):
    r"""GPyTorch's minibatch loop (batches of 1024, ``-objective(model(x_b), y_b)``) for ``budget`` seconds of its own
    work, ``probabilities()`` scored ten times along the way and at the end: the history. ``schedule="cosine"``
    anneals the learning rate by the fraction of the budget spent, by ``fit_mll``'s own rule with ``max_time`` the
    budget (:meth:`~gpytorch_iterncgp.MinibatchRecipe.rate_factor`, through ``torch.optim.lr_scheduler.LambdaLR``).
    ``update_site``: stochastic EP's site step, ``update_site(output, y_b)`` after each optimiser step
    (:meth:`~gpytorch_iterncgp.StochasticEPStrategy.update_site`); ``None`` for SVGP."""
    clock, history, steps, next_evaluation = Clock(), [], 0, 0.0
    recipe = MinibatchRecipe(schedule=schedule)
    annealing = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: recipe.rate_factor(0, clock.elapsed(), budget))
    model.train()
    while clock.elapsed() < budget:
        for batch in torch.randperm(len(targets), generator=generator).split(1024):
            optimizer.zero_grad()
            output = model(data.train_x[batch])
            loss = -objective(output, targets[batch])
            loss.backward()
            optimizer.step()
            annealing.step()
            if update_site is not None:
                update_site(output, targets[batch])
            steps += 1
            if clock.elapsed() >= next_evaluation:
                clock.evaluate(history, probabilities, data.test_y, adam_steps=steps)
                next_evaluation = clock.elapsed() + budget / 10
            if clock.elapsed() >= budget:
                break
    clock.evaluate(history, probabilities, data.test_y, adam_steps=steps)
    return history


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
                done(run_estimator(data, args.seed, method.partition("_")[2] or None, learning_subset))
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
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and budgets (seconds)")
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
