"""How SparseEPStrategy (EP-DTC) scales with N at M = 256 inducing inputs: fit time and peak memory, CPU.

A synthetic probit problem in 2-D (labels drawn from a smooth latent function), a fixed RBF kernel, inducing inputs a
random subset of the training inputs, float64; N = 1e4, 3e4, 1e5. Each fit runs to ``site_tol = 1e-4`` (at most 50
sweeps, damping 0.5). Records per N: sweeps, fit wall time, time per sweep, the peak resident memory of the process
above the memory before the fit, and the test accuracy on 2000 held-out points. Writes
``results/sparse_ep_scale.json`` and ``results/sparse_ep_scale.png``.

    python -m benchmarks.sparse_ep_scale            # about 2-4 minutes on a 2-core CPU
    python -m benchmarks.sparse_ep_scale --smoke    # tiny sizes, a functional check (--quick: the same)
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
import torch

from benchmarks.common import add_smoke_flag, machine, peak_rss_bytes, reset_peak_rss, rss_bytes
from gpytorch_iterncgp import SparseEPStrategy

RESULTS = Path(__file__).parent / "results"


class Model(gpytorch.models.ApproximateGP):
    def __init__(self, train_x, train_y, likelihood, inducing_points):
        strategy = SparseEPStrategy(
            self, train_x, train_y, likelihood, inducing_points, learn_inducing_locations=False, show_progress=False
        )
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        self.to(train_x.dtype)
        self.covar_module.base_kernel.lengthscale = 0.2
        self.covar_module.outputscale = 4.0

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def data(num: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(num, 2, generator=generator, dtype=torch.float64)
    latent = 2 * torch.sin(6 * x[:, 0]) + 2 * torch.cos(4 * x[:, 1])
    y = (torch.rand(num, generator=generator, dtype=torch.float64) < torch.special.ndtr(latent)).to(torch.float64)
    return x, y


def run(num: int, num_inducing: int) -> dict:
    x, y = data(num, seed=0)
    test_x, test_y = data(2000, seed=1)
    inducing = x[torch.randperm(num, generator=torch.Generator().manual_seed(2))[:num_inducing]].clone()
    model = Model(x, y, gpytorch.likelihoods.BernoulliLikelihood(), inducing)
    before = rss_bytes()
    reset_peak_rss()
    start = time.perf_counter()
    report = model.variational_strategy.fit()
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes() - before
    model.eval()
    with torch.no_grad():
        accuracy = float(
            ((model.variational_strategy.predictive_probabilities(test_x) > 0.5) == (test_y > 0.5)).double().mean()
        )
    return {
        "num_data": num,
        "num_inducing": num_inducing,
        "sweeps": report.steps,
        "converged": report.converged,
        "fit_seconds": seconds,
        "seconds_per_sweep": seconds / max(report.steps, 1),
        "peak_memory_above_start_bytes": peak,
        "test_accuracy": accuracy,
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["num_data"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.loglog(sizes, [r["fit_seconds"] for r in results], "o-", label="fit")
    left.loglog(sizes, [r["seconds_per_sweep"] for r in results], "s--", label="per sweep")
    left.set_xlabel("N")
    left.set_ylabel("seconds")
    left.legend()
    right.loglog(sizes, [r["peak_memory_above_start_bytes"] / 2**20 for r in results], "o-")
    right.set_xlabel("N")
    right.set_ylabel("peak memory above start (MiB)")
    fig.suptitle(f"SparseEPStrategy (EP-DTC), M = {results[0]['num_inducing']}, probit, CPU float64")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_smoke_flag(parser, "tiny sizes (a functional check)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    sizes, num_inducing = ((500, 1000), 32) if args.smoke else ((10_000, 30_000, 100_000), 256)
    results = []
    for num in sizes:
        results.append(run(num, num_inducing))
        print(json.dumps(results[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "sparse_ep_scale_smoke" if args.smoke else "sparse_ep_scale"
    (args.out / f"{name}.json").write_text(json.dumps({"machine": machine(), "results": results}, indent=1))
    plot(results, args.out / f"{name}.png")


if __name__ == "__main__":
    main()
