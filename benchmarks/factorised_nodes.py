r"""How many Gauss–Hermite nodes the multinomial probit's factorised tilted moments need (stochastic EP's moments).

    python -m benchmarks.factorised_nodes            # 4000 cavities per row, about a minute here (one thread)
    python -m benchmarks.factorised_nodes --smoke    # 200 cavities, C = 10

:func:`~gpytorch_iterncgp.likelihoods.factorised.factorised_moments` integrates over one variable :math:`u` with a
Gauss–Hermite rule centred at the integrand's mode and scaled by its width there. For each number of classes
:math:`C` and spread :math:`s`, random cavities: means :math:`\mathcal N(0, 3^2)`, a point's variances
:math:`v\, e^{z_j}` with :math:`v` log-uniform on :math:`[0.01, 20]` (the prior variances of learnt kernels reach
about 20) and :math:`z_j \sim \mathcal N(0, s^2)` per class (:math:`s = 1`: the classes' variances apart, as at a
point near one class's inducing inputs and far from another's). Each rule's tilted variances against
``--reference-nodes`` nodes: the relative error's quantiles over the points (a point's largest over its classes),
its share above :math:`10^{-3}`, and the seconds of one call. The point with the largest error is checked against
scipy's adaptive ``quad`` of :math:`\log \hat Z` (an independent reference for the reference rule). Writes
``results/factorised_nodes.json`` and ``.png`` (with the machine).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from scipy import integrate, special

from benchmarks.common import add_smoke_flag, write_results
from gpytorch_iterncgp.likelihoods.factorised import factorised_log_normalizer, factorised_moments

RESULTS = Path(__file__).resolve().parent / "results"
QUANTILES = (0.5, 0.99, 0.999)


def cavities(num_points: int, num_classes: int, spread: float, seed: int) -> tuple[torch.Tensor, ...]:
    """Targets ``(N,)``, cavity means and variances ``(N, C)``, float64 (the module docstring's distribution)."""
    generator = torch.Generator().manual_seed(seed)
    mean = 3 * torch.randn(num_points, num_classes, generator=generator, dtype=torch.float64)
    log_scale = torch.rand(num_points, 1, generator=generator, dtype=torch.float64) * math.log(2000) + math.log(0.01)
    variance = (
        log_scale + spread * torch.randn(num_points, num_classes, generator=generator, dtype=torch.float64)
    ).exp()
    targets = torch.randint(num_classes, (num_points,), generator=generator)
    return targets, mean, variance


def adaptive_log_normalizer(target: int, mean: np.ndarray, variance: np.ndarray) -> float:
    r""":math:`\log \hat Z = \log \int \mathcal N(u) \prod_{j \ne c} \Phi(b_j u + a_j)\, du` by scipy's ``quad``,
    split at each factor's step :math:`-a_j / b_j` (one point's cavity, ``(C,)`` each)."""
    scale = np.sqrt(1 + variance)
    offsets, slopes = (mean[target] - mean) / scale, scale[target] / scale
    others = [j for j in range(len(mean)) if j != target]

    def integrand(u: float) -> float:
        return math.exp(-0.5 * u * u + sum(special.log_ndtr(slopes[j] * u + offsets[j]) for j in others)) / math.sqrt(
            2 * math.pi
        )

    steps = sorted(-offsets[j] / slopes[j] for j in others if abs(offsets[j] / slopes[j]) < 40)
    value, _ = integrate.quad(integrand, -40, 40, points=steps, limit=500, epsabs=0, epsrel=1e-12)
    return math.log(value)


def measure(num_points: int, num_classes: int, spread: float, nodes: list[int], reference: int, seed: int) -> dict:
    """One row: each rule's error quantiles, share above 1e-3, largest error and seconds; the worst point's log Ẑ."""
    targets, mean, variance = cavities(num_points, num_classes, spread, seed)
    reference_variance = factorised_moments(targets, mean, variance, reference)[2]
    rules = {}
    for count in nodes:
        start = time.perf_counter()
        tilted_variance = factorised_moments(targets, mean, variance, count)[2]
        seconds = time.perf_counter() - start
        error = ((tilted_variance - reference_variance) / reference_variance).abs().amax(-1)
        rules[count] = {
            "relative_variance_error_quantiles": {
                str(q): v
                for q, v in zip(QUANTILES, torch.quantile(error, error.new_tensor(QUANTILES)).tolist(), strict=True)
            },
            "share_above_1e-3": float((error > 1e-3).double().mean()),
            "largest": float(error.max()),
            "worst_point": int(error.argmax()),
            "seconds": seconds,
        }
    worst = rules[min(nodes)]["worst_point"]
    exact = adaptive_log_normalizer(int(targets[worst]), mean[worst].numpy(), variance[worst].numpy())
    chosen = slice(worst, worst + 1)
    log_z_error = {
        str(count): float(factorised_log_normalizer(targets[chosen], mean[chosen], variance[chosen], count)) - exact
        for count in [*nodes, reference]
    }
    return {
        "classes": num_classes,
        "spread": spread,
        "points": num_points,
        "rules": rules,
        "worst_point": {"index": worst, "variance": variance[worst].tolist(), "log_z_error_against_quad": log_z_error},
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for row in rows:
        counts = sorted(row["rules"], key=int)
        label = f"C = {row['classes']}, s = {row['spread']}"
        axes[0].semilogy(
            counts, [row["rules"][c]["relative_variance_error_quantiles"]["0.999"] for c in counts], "o-", label=label
        )
        axes[1].plot(counts, [100 * row["rules"][c]["share_above_1e-3"] for c in counts], "o-", label=label)
    axes[0].set(
        xlabel="Gauss–Hermite nodes",
        ylabel="99.9 % quantile of the relative error",
        title="tilted variance against the reference rule",
    )
    axes[1].set(xlabel="Gauss–Hermite nodes", ylabel="% of points above 1e-3", title="the tail")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description="Gauss–Hermite nodes of the factorised multinomial probit moments")
    add_smoke_flag(parser, "200 cavities, C = 10")
    parser.add_argument("--classes", type=int, nargs="+", default=[10, 26])
    parser.add_argument("--spreads", type=float, nargs="+", default=[0.3, 1.0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[32, 48, 64])
    parser.add_argument("--reference-nodes", type=int, default=256, help="the reference rule (numpy's limit: 256)")
    parser.add_argument("--points", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    points, classes = (200, [10]) if args.smoke else (args.points, args.classes)
    rows = []
    for num_classes in classes:
        for spread in args.spreads:
            rows.append(measure(points, num_classes, spread, args.nodes, args.reference_nodes, args.seed))
            for count, rule in rows[-1]["rules"].items():
                print(
                    f"C {num_classes:2d} s {spread:.1f} nodes {count:3d}: 99.9 % "
                    f"{rule['relative_variance_error_quantiles']['0.999']:.1e} share>1e-3 "
                    f"{rule['share_above_1e-3']:.4f} largest {rule['largest']:.1e} {rule['seconds']:.3f} s",
                    flush=True,
                )
    write_results(args.out / "factorised_nodes.json", "factorised_nodes", argv, rows=rows)
    plot(rows, args.out / "factorised_nodes.png")
    return rows


if __name__ == "__main__":
    main()
