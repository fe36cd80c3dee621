"""How the policy and the solver budget trade products with K for test NLL (the README's advice on choosing them).

For a binary problem (two moons, probit) and the paper's 10-class mixture (softmax, one kernel shared by the
classes), each with a fixed Matérn-3/2 kernel, fits IterNCGP under several policies and budgets and records,
after every Newton step, the products with K so far, the fit's own wall time, and the test NLL and accuracy
of the predictive (computational uncertainty included). A fit with CG run to convergence in every Newton step
is the reference (the exact Laplace posterior; binary problem only). Writes ``results/budget.json`` and ``results/budget.png``.

    python -m benchmarks.budget            # a few minutes on a 2-core CPU
    python -m benchmarks.budget --smoke    # tiny sizes, a functional check (--quick: the same)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpytorch
import torch

from benchmarks.common import add_smoke_flag, machine
from benchmarks.scoring import log_loss
from gpytorch_iterncgp import IterNCGPStrategy, LogitBernoulliLikelihood
from gpytorch_iterncgp.datasets import gaussian_mixture

RESULTS = Path(__file__).parent / "results"

# name: strategy options (max_newton_steps bounds the run; every setting stops at convergence otherwise)
CONFIGS = {
    "CG, 1 iteration per step": dict(policy="cg", max_solver_iterations=1, max_newton_steps=300),
    "CG, 5 per step": dict(policy="cg", max_solver_iterations=5, max_newton_steps=60),
    "CG, 20 per step": dict(policy="cg", max_solver_iterations=20, max_newton_steps=15),
    "CG, 5 per step, R = 10": dict(policy="cg", max_solver_iterations=5, compression_rank=10, max_newton_steps=60),
    "unit vectors, 20 per step": dict(policy="unit", max_solver_iterations=20, max_newton_steps=15),
    "CG to convergence (exact Laplace)": dict(
        policy="cg", max_solver_iterations=None, abs_tol=1e-8, rel_tol=1e-8, outer_tol=1e-6, max_newton_steps=30
    ),
}


class Model(gpytorch.models.ApproximateGP):
    def __init__(self, train_x, train_y, likelihood, **options):
        super().__init__(IterNCGPStrategy(self, train_x, train_y, likelihood, show_progress=False, **options))
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5))
        self.covar_module.base_kernel.lengthscale = 0.3
        self.covar_module.outputscale = 5.0

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def problems(smoke: bool) -> dict:
    from sklearn.datasets import make_moons

    size = 100 if smoke else 1000
    x, y = make_moons(2 * size, noise=0.25, random_state=0)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
    mixture = gaussian_mixture(200 if smoke else 1000, 200 if smoke else 1000, sample_seed=1, dtype=torch.float32)
    return {
        f"two moons (N = {size}, logit)": (x[:size], y[:size], x[size:], y[size:], LogitBernoulliLikelihood),
        f"10-class mixture (N = {len(mixture[0])}, softmax)": (
            *mixture,
            lambda: gpytorch.likelihoods.SoftmaxLikelihood(num_classes=10, mixing_weights=False),
        ),
    }


def nll_and_accuracy(strategy, test_x, test_y) -> tuple[float, float]:
    with torch.no_grad():
        scores = log_loss(strategy.predictive_probabilities(test_x), test_y)
    return scores["nll"], scores["accuracy"]


def run(train_x, train_y, test_x, test_y, make_likelihood, options) -> list[dict]:
    model = Model(train_x, train_y, make_likelihood(), **options)
    strategy = model.variational_strategy
    trace, clock = [], {"fit": 0.0, "since": time.perf_counter()}

    def record(step, state):
        clock["fit"] += time.perf_counter() - clock["since"]
        nll, accuracy = nll_and_accuracy(strategy, test_x, test_y)  # not timed
        products = sum(s.kernel_products for s in trace_steps) + step.kernel_products
        trace_steps.append(step)
        trace.append(dict(products=products, seconds=clock["fit"], nll=nll, accuracy=accuracy, psi=step.log_posterior))
        clock["since"] = time.perf_counter()

    trace_steps: list = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # breakdowns of long CG runs are reported in the trace's flattening
        strategy.fit(callback=record)
    return trace


def plot(results: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
    for axis, (problem, runs) in zip(axes[0], results.items(), strict=True):
        for name, trace in runs.items():
            style = dict(color="black", linestyle="--") if "exact" in name else {}
            axis.plot([t["products"] for t in trace], [t["nll"] for t in trace], marker=".", label=name, **style)
        axis.set_xscale("log")
        axis.set_xlabel("products with K")
        axis.set_ylabel("test NLL (computational uncertainty included)")
        axis.set_title(problem)
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """The budget benchmarks' options (``--smoke``, ``--out``); this one and :mod:`benchmarks.ep_budget` run on at most
    two threads."""
    parser = argparse.ArgumentParser(description=description)
    add_smoke_flag(parser, "tiny sizes (a functional check)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv, __doc__.splitlines()[0])
    results: dict = {}
    for problem, data in problems(args.smoke).items():
        results[problem] = {}
        for name, options in CONFIGS.items():
            if "exact" in name and "mixture" in problem and not args.smoke:
                continue  # N C = 10^4: the buffer of a fully converged fit makes the virtual runs too slow here
            trace = run(*data, options)
            results[problem][name] = trace
            last = trace[-1]
            print(
                f"{problem:36s} {name:36s} products {last['products']:5d}  {last['seconds']:7.2f} s  "
                f"NLL {last['nll']:.4f}  acc {last['accuracy']:.3f}",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    name = "budget_smoke" if args.smoke else "budget"
    (args.out / f"{name}.json").write_text(json.dumps({"machine": machine(), "results": results}, indent=1))
    plot(results, args.out / f"{name}.png")
    return results


if __name__ == "__main__":
    main()
