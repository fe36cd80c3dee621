r"""EP fits alone and beside another process that keeps two threads busy, with and without the package's thread
limits (:mod:`gpytorch_iterncgp.core.threads`).

    python -m benchmarks.busy_machine                 # each workload alone and busy, limits on and off
    python -m benchmarks.busy_machine --smoke

Workloads (each in a fresh process, the caller's default threads: as many as cores):

* ``multiclass_ep_300``: ``IterNCGPClassifier(inference="ep")`` (multinomial probit, nested EP) on 300 of
  scikit-learn's digits, the kernel fixed (``optimizer_steps=0``);
* ``binary_ep_2000``: the same with probit EP on 2000 points of the binary mixture;
* ``sep_multiclass``: 100 minibatch steps of stochastic EP (:class:`~gpytorch_iterncgp.StochasticEPStrategy`, the
  multinomial probit, M = 100, batches of 512) on the 10-class mixture of 10⁴ points, by
  :func:`~gpytorch_iterncgp.fit_mll` (whose loop runs each step on one thread: the limits).

The competitor is a second Python process multiplying 1500 × 1500 matrices in a loop on two threads. Writes
``results/busy_machine.json`` (with the machine) and ``.png``, and prints the seconds and the busy / alone ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"
WORKLOADS = ("multiclass_ep_300", "binary_ep_2000", "sep_multiclass")
COMPETITOR = "import torch\ntorch.set_num_threads(2)\na = torch.randn(1500, 1500)\nwhile True:\n    a @ a\n"


def _estimator_fit(x, y, **options) -> None:
    from gpytorch_iterncgp.sklearn import IterNCGPClassifier

    IterNCGPClassifier(inference="ep", optimizer_steps=0, random_state=0, **options).fit(x, y)


def run_workload(name: str, smoke: bool) -> float:
    """Seconds of one workload (in this process)."""
    import numpy as np
    import torch

    if name == "multiclass_ep_300":
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = (x - x.mean(0)) / (x.std(0) + 1e-9)
        size = 100 if smoke else 300
        start = time.perf_counter()
        _estimator_fit(x[:size], y[:size], link="probit")
        return time.perf_counter() - start
    from gpytorch_iterncgp.datasets import gaussian_mixture

    if name == "binary_ep_2000":
        x, y, _, _ = gaussian_mixture(200 if smoke else 2000, 10, sample_seed=0, dtype=torch.float64)
        start = time.perf_counter()
        _estimator_fit(x.numpy(), (y >= 5).numpy().astype(np.int64), link="probit")
        return time.perf_counter() - start
    import gpytorch

    from gpytorch_iterncgp import (
        MinibatchRecipe,
        MultinomialProbitLikelihood,
        StochasticEPMarginalLogLikelihood,
        StochasticEPStrategy,
        fit_mll,
    )

    x, y, _, _ = gaussian_mixture(1000 if smoke else 10_000, 10, sample_seed=0, dtype=torch.float64)

    class Model(gpytorch.models.ApproximateGP):
        def __init__(self, likelihood):
            super().__init__(StochasticEPStrategy(self, x[:100].clone(), likelihood, num_data=len(y)))
            self.mean_module = gpytorch.means.ConstantMean(batch_shape=torch.Size([10]))
            self.covar_module = gpytorch.kernels.ScaleKernel(
                gpytorch.kernels.MaternKernel(nu=2.5, batch_shape=torch.Size([10])), batch_shape=torch.Size([10])
            )

        def forward(self, inputs):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(inputs), self.covar_module(inputs))

    likelihood = MultinomialProbitLikelihood(10)
    model = Model(likelihood).double()
    mll = StochasticEPMarginalLogLikelihood(likelihood, model)
    recipe = MinibatchRecipe(batch_size=512, learning_rate=0.01, max_steps=20 if smoke else 100)
    start = time.perf_counter()
    fit_mll(mll, data=(x, y), recipe=recipe, seed=0, show_progress=False)
    return time.perf_counter() - start


def measure(name: str, busy: bool, limits: bool, smoke: bool) -> float:
    """One workload in a fresh process, beside the competitor if ``busy``."""
    competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR]) if busy else None
    try:
        if busy:
            time.sleep(1.0)
        command = [sys.executable, "-m", "benchmarks.busy_machine", "--one", name]
        command += [] if limits else ["--no-limits"]
        command += ["--smoke"] if smoke else []
        root = Path(__file__).resolve().parents[1]  # where `-m benchmarks.busy_machine` is found
        output = subprocess.run(command, check=True, capture_output=True, text=True, cwd=root).stdout
        return float(output.strip().splitlines()[-1])
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()


def plot(results: dict, path: Path) -> None:
    """Seconds alone and busy per workload, limits on and off, as grouped bars (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    figure, axis = plt.subplots(figsize=(7, 4))
    width = 0.2
    names = list(dict.fromkeys(row["workload"] for row in rows))
    for offset, (limits, condition) in enumerate(
        [(on, when) for on in (True, False) for when in ("alone_s", "busy_s")]
    ):
        values = [
            next(r[condition] for r in rows if r["workload"] == n and r["thread_limits"] == limits) for n in names
        ]
        label = f"limits {'on' if limits else 'off'}, {condition.removesuffix('_s')}"
        axis.bar([i + (offset - 1.5) * width for i in range(len(names))], values, width, label=label)
    axis.set_xticks(range(len(names)), names)
    axis.set_yscale("log")
    axis.set_ylabel("seconds")
    axis.set_title(f"beside a 2-thread process, {results['machine']['cpu']}", fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "busy_machine.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one workload here, print its seconds
    parser.add_argument("--no-limits", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        if args.no_limits:
            import gpytorch_iterncgp.core.outer_loop as outer_loop
            import gpytorch_iterncgp.learning.minibatch as minibatch

            outer_loop.small_operations = contextlib.nullcontext  # type: ignore[assignment]
            minibatch.small_operations = contextlib.nullcontext  # type: ignore[assignment]
        print(run_workload(args.one, args.smoke))
        return {}
    from benchmarks.common import machine

    rows = []
    for name in args.workloads:
        for limits in (True, False):
            alone = measure(name, False, limits, args.smoke)
            busy = measure(name, True, limits, args.smoke)
            rows.append({"workload": name, "thread_limits": limits, "alone_s": alone, "busy_s": busy})
            print(
                f"{name:>18} limits {'on ' if limits else 'off'} alone {alone:7.2f} s busy {busy:7.2f} s "
                f"ratio {busy / alone:5.2f}",
                flush=True,
            )
    results = {"machine": machine(), "competitor": COMPETITOR, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    plot(results, args.out.with_suffix(".png"))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
