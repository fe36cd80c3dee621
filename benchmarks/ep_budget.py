"""EP with incomplete solves: how the solver budget per sweep, and compression, move EP away from exact EP.

Two moons (N = 1000, probit, fixed Matérn-3/2 kernel). Exact EP is ``EPStrategy`` with a complete solve in every
sweep (unit-vector actions over all points); it is checked against nothing here (``tests/ep/test_ep.py`` checks it
against dense EP). Every other configuration runs parallel EP (damping 0.5) with a fixed number of CG iterations
per sweep; after each sweep the callback records the products with K so far, the fit's wall time, the test NLL
and accuracy of the predictive (computational uncertainty included), the largest distance of the site natural
means from exact EP's, and how many cavity precisions were raised to the prior precision (marginal variances
too wide). Laplace with an exact solve is the horizontal reference: what EP is for. Writes
``results/ep_budget.json`` and ``results/ep_budget.png``.

    python -m benchmarks.ep_budget            # about two minutes on a 2-core CPU
    python -m benchmarks.ep_budget --smoke    # tiny sizes, a functional check (--quick: the same)
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpytorch
import torch

from benchmarks.budget import nll_and_accuracy, parse_args
from benchmarks.common import machine
from gpytorch_iterncgp import EPStrategy, IterNCGPStrategy

EXACT = "exact EP (complete solve every sweep)"
CONFIGS = {
    EXACT: dict(policy="unit", max_solver_iterations=None, abs_tol=0.0, rel_tol=0.0, max_sweeps=60),
    "CG, 2 iterations per sweep": dict(policy="cg", max_solver_iterations=2, max_sweeps=120),
    "CG, 5 per sweep": dict(policy="cg", max_solver_iterations=5, max_sweeps=60),
    "CG, 20 per sweep": dict(policy="cg", max_solver_iterations=20, max_sweeps=40),
    "CG, 5 per sweep, R = 20": dict(policy="cg", max_solver_iterations=5, compression_rank=20, max_sweeps=60),
    "CG, 5 per sweep, R = 100": dict(policy="cg", max_solver_iterations=5, compression_rank=100, max_sweeps=60),
    "unit vectors, 20 per sweep": dict(policy="unit", max_solver_iterations=20, max_sweeps=60),
}


class Model(gpytorch.models.ApproximateGP):
    def __init__(self, train_x, train_y, strategy_class, **options):
        likelihood = gpytorch.likelihoods.BernoulliLikelihood()
        super().__init__(strategy_class(self, train_x, train_y, likelihood, show_progress=False, **options))
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5))
        self.to(train_x.dtype)
        self.covar_module.base_kernel.lengthscale = torch.tensor(0.3, dtype=train_x.dtype)
        self.covar_module.outputscale = torch.tensor(5.0, dtype=train_x.dtype)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def problem(smoke: bool):
    from sklearn.datasets import make_moons

    size = 150 if smoke else 1000
    x, y = make_moons(2 * size, noise=0.25, random_state=0)
    x, y = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    return x[:size], y[:size], x[size:], y[size:]


def run(train_x, train_y, test_x, test_y, options, exact_sites) -> list[dict]:
    strategy = Model(train_x, train_y, EPStrategy, site_tol=1e-8, **options).variational_strategy
    trace, clock = [], {"fit": 0.0, "since": time.perf_counter(), "products": 0}

    def record(sweep, state):
        clock["fit"] += time.perf_counter() - clock["since"]
        clock["products"] += sweep.kernel_products
        strategy.eval()
        nll, accuracy = nll_and_accuracy(strategy, test_x, test_y)  # not timed
        strategy.train()
        error = float("nan") if exact_sites is None else float((state.site_natural_mean - exact_sites).abs().max())
        trace.append(
            dict(
                products=clock["products"],
                seconds=clock["fit"],
                nll=nll,
                accuracy=accuracy,
                site_error=error,
                bounded_cavities=sweep.bounded_cavities,
                site_change=sweep.site_change,
            )
        )
        clock["since"] = time.perf_counter()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # breakdowns of long CG runs show in the trace
        strategy.fit(callback=record)
    return trace, strategy


def plot(results: dict, laplace_nll: float, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, trace in results.items():
        style = dict(color="black", linestyle="--") if name == EXACT else {}
        products = [t["products"] for t in trace]
        axes[0].plot(products, [t["nll"] for t in trace], marker=".", label=name, **style)
        if name != EXACT:
            axes[1].plot(products, [t["site_error"] for t in trace], marker=".", label=name)
    axes[0].axhline(laplace_nll, color="gray", linestyle=":", label="exact Laplace")
    axes[0].set_ylabel("test NLL (computational uncertainty included)")
    axes[1].set_ylabel("max |site natural mean - exact EP's|")
    axes[1].set_yscale("log")
    for axis in axes:
        axis.set_xscale("log")
        axis.set_xlabel("products with K")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("EP with incomplete solves, two moons (probit, Matérn-3/2 l 0.3 s² 5)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv, __doc__.splitlines()[0])
    data = problem(args.smoke)
    results: dict = {}
    exact_sites = None
    for name, options in CONFIGS.items():
        trace, strategy = run(*data, options, exact_sites)
        if name == EXACT:
            exact_sites = strategy.sites[1]
        results[name] = trace
        last = trace[-1]
        print(
            f"{name:40s} sweeps {len(trace):4d} products {last['products']:5d} {last['seconds']:7.2f} s  "
            f"NLL {last['nll']:.4f}  acc {last['accuracy']:.3f}  site error {last['site_error']:.2e}  "
            f"bounded {last['bounded_cavities']}",
            flush=True,
        )
    laplace = Model(
        data[0], data[1], IterNCGPStrategy, policy="cg", max_solver_iterations=None, abs_tol=1e-10, rel_tol=1e-10
    ).variational_strategy
    laplace.fit()
    laplace.eval()
    laplace_nll, laplace_accuracy = nll_and_accuracy(laplace, data[2], data[3])
    print(f"{'exact Laplace':40s} NLL {laplace_nll:.4f}  acc {laplace_accuracy:.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    name = "ep_budget_smoke" if args.smoke else "ep_budget"
    output = {"machine": machine(), "laplace": {"nll": laplace_nll, "accuracy": laplace_accuracy}, "results": results}
    (args.out / f"{name}.json").write_text(json.dumps(output, indent=1))
    plot(results, laplace_nll, args.out / f"{name}.png")
    return results


if __name__ == "__main__":
    main()
