r"""Dense binary EP at :math:`2 \cdot 10^4` and :math:`3 \cdot 10^4` points, at the kernel learning finds there, with
the strategy's defaults (no step limit: until it converges or stalls).

    python -m benchmarks.ep_large                                   # N 20000 and 30000, seeds 0 1 2 (about an hour)
    python -m benchmarks.ep_large --sizes 20000 --actions 0 50      # without and with the bounded points' actions
    python -m benchmarks.ep_large --sizes 10000 --seeds 0 --actions 0 50 --max-sweeps 20   # docs/design_notes.md
    python -m benchmarks.ep_large --sizes 30000 --marginal-tol 1e-3     # stopped on the marginals, as the estimator
    python -m benchmarks.ep_large --smoke                           # tiny, seconds

``EPStrategy`` (probit, a Matérn-5/2 kernel at :math:`s^2` 19.3, :math:`\ell` 0.37: what the estimator learnt on
:math:`2 \cdot 10^4` points of this problem, ``docs/design_notes.md``) on the binary mixture of
:mod:`benchmarks.learned` (``binary<N>``, 2000 test points), each data seed, each ``bounded_point_actions`` value,
one after the other in one process on ``--threads`` threads: sweeps, whether the fit converged or stalled, the
bounded cavities of the last sweep, the recycled actions, seconds, test NLL and accuracy. The issue this answers:
binary EP at these sizes diverged at this kernel before the preconditioner (test NLL 1.2–10).

Writes ``results/ep_large.json`` (with the machine) and ``results/ep_large.png`` (test NLL against seconds).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import gpytorch
import torch

from benchmarks.common import write_results
from benchmarks.data import load
from benchmarks.scoring import log_loss
from gpytorch_iterncgp import EPStrategy

RESULTS = Path(__file__).resolve().parent / "results"
OUTPUTSCALE, LENGTHSCALE = 19.3, 0.37


class _Model(gpytorch.models.ApproximateGP):
    def __init__(self, x, y, **options):
        likelihood = gpytorch.likelihoods.BernoulliLikelihood()
        super().__init__(EPStrategy(self, x, y, likelihood, show_progress=False, **options))
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5))

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def run(
    size: str, seed: int, actions: int, smoke: bool, max_sweeps: int | None = None, marginal_tol: float | None = None
) -> dict:
    """One EP fit with the defaults, ``bounded_point_actions=actions``, ``max_sweeps`` and ``marginal_tol``; its row."""
    data = load(f"binary{size}", smoke, seed)
    model = _Model(
        data.train_x, data.train_y.to(data.train_x), bounded_point_actions=actions, marginal_tol=marginal_tol
    ).double()
    model.covar_module.outputscale = OUTPUTSCALE
    model.covar_module.base_kernel.lengthscale = LENGTHSCALE
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = model.variational_strategy.fit(max_sweeps=max_sweeps)
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        scores = log_loss(model.variational_strategy.predictive_mean(data.test_x), data.test_y)
    last = report.records[-1]
    return {
        "num_train": len(data.train_y),
        "seed": seed,
        "bounded_point_actions": actions,
        "marginal_tol": marginal_tol,
        "sweeps": report.steps,
        "converged": report.converged,
        "stalled": report.stalled,
        "last_site_change": last.site_change,
        "last_bounded_cavities": last.bounded_cavities,
        "bounded_cavities": report.bounded_cavities,
        "recycled_actions": int(model.variational_strategy.state.actions.shape[-1]),
        "marginal_blocks": [record.marginal_blocks for record in report.records if record.marginal_blocks],
        "solver_iterations": [record.solver_iterations for record in report.records],
        "kernel_products": report.kernel_products,
        "seconds": seconds,
        **scores,
        "warnings": sorted({warning.category.__name__ for warning in caught}),
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for actions, marker in zip(sorted({row["bounded_point_actions"] for row in rows}), "osd^", strict=False):
        chosen = [row for row in rows if row["bounded_point_actions"] == actions]
        axis.scatter(
            [row["seconds"] for row in chosen],
            [row["nll"] for row in chosen],
            marker=marker,
            label=f"bounded_point_actions={actions}",
        )
        for row in chosen:
            axis.annotate(f"N={row['num_train']}, s{row['seed']}", (row["seconds"], row["nll"]), fontsize=7)
    axis.set_xscale("log")
    axis.set_xlabel("seconds (the EP fit)")
    axis.set_ylabel("test NLL")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["20000", "30000"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--actions", nargs="+", type=int, default=[50])
    parser.add_argument("--max-sweeps", type=int, default=None, help="a step limit (default: none, the strategy's)")
    parser.add_argument(
        "--marginal-tol", type=float, default=None, help="EPStrategy's marginal_tol (default: none, the sites' test)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny data, seconds")
    parser.add_argument("--out", type=Path, default=RESULTS / "ep_large.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for size in args.sizes:
        for seed in args.seeds:
            for actions in args.actions:
                row = run(size, seed, actions, args.smoke, args.max_sweeps, args.marginal_tol)
                rows.append(row)
                print(
                    f"N {row['num_train']:>6} seed {seed} actions {actions:>3}: {row['sweeps']} sweeps, "
                    f"converged {row['converged']}, stalled {row['stalled']}, bounded {row['last_bounded_cavities']}, "
                    f"NLL {row['nll']:.4f}, {row['seconds']:.1f} s",
                    flush=True,
                )
                write_results(args.out, "ep_large", argv, rows=rows)  # (after every fit: a long run keeps rows)
    plot(rows, args.out.with_suffix(".png"))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
