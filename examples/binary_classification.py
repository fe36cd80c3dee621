"""Binary GP classification with IterNCGP: subset-of-data (unit-vector) actions versus CG actions.

Paper, Figures 1 and 3. Two interleaved moons, a Matérn-3/2 prior and the probit Bernoulli likelihood.
Both policies get the same schedule, 5 solver iterations (products with K) per Newton step with recycling
(tolerances 0, so that the whole budget is spent), and are stopped after 5, 20 and 100 products with K. The panels show the predictive probability
and the marginal standard deviation of the latent function, which includes the computational uncertainty:
it stays at the prior's level away from what the actions have "seen" and shrinks as the budget grows.
The last column holds the exact Laplace approximation (every Newton step solved to the end) and
the test NLL and mean latent standard deviation against the number of products with K.

    python examples/binary_classification.py [--smoke] [--quiet] [--out DIR] [--threads N]
"""

from __future__ import annotations

import math

import _common
import gpytorch
import matplotlib.pyplot as plt
import torch
from sklearn.datasets import make_moons

from gpytorch_iterncgp import IterNCGPStrategy

NAME = "binary_classification"
LENGTHSCALE, OUTPUTSCALE = 0.5, 10.0
ITERATIONS_PER_STEP = 5


class Model(gpytorch.models.ApproximateGP):
    """A zero-mean GP with a scaled Matérn-3/2 kernel; IterNCGP replaces the variational strategy."""

    def __init__(self, train_x, train_y, likelihood, **options):
        strategy = IterNCGPStrategy(self, train_x, train_y, likelihood, **options)
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5))
        self.covar_module.base_kernel.lengthscale = LENGTHSCALE
        self.covar_module.outputscale = OUTPUTSCALE

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def moons(num_train: int, num_test: int):
    x, y = make_moons(num_train + num_test, noise=0.25, random_state=0)
    x, y = torch.as_tensor(x), torch.as_tensor(y, dtype=torch.float64)
    return x[:num_train], y[:num_train], x[num_train:], y[num_train:]


def bernoulli_nll(probs, labels) -> float:
    probs = probs.clamp(1e-12, 1 - 1e-12)
    return float(-(labels * probs.log() + (1 - labels) * (1 - probs).log()).mean())


@torch.no_grad()
def evaluate(strategy, data, grid) -> dict:
    """Metrics and grid predictions of the current posterior (computational uncertainty included)."""
    train_x, train_y, test_x, test_y = data
    train_acc = float(((strategy.predictive_probabilities(train_x) > 0.5) == train_y.bool()).double().mean())
    test_probs = strategy.predictive_probabilities(test_x)
    _, test_var = strategy.marginal_latent(test_x)
    _, grid_var = strategy.marginal_latent(grid)
    return {
        "train_acc": train_acc,
        "test_nll": bernoulli_nll(test_probs, test_y),
        "test_std": float(test_var.sqrt().mean()),
        "grid_probs": strategy.predictive_probabilities(grid),
        "grid_std": grid_var.sqrt()[:, 0],
        "used": strategy.state.actions.abs().sum(-1) > 0,  # data points the actions touch
    }


def run_policy(policy, budgets, data, grid, quiet):
    """Newton steps of 5 solver iterations each; a snapshot after every step (for the curves) and at each budget.

    ``fit(max_newton_steps=1)`` continues where the previous call stopped, recycling the actions.
    """
    train_x, train_y = data[:2]
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = Model(
        train_x,
        train_y,
        likelihood,
        policy=policy,
        max_solver_iterations=ITERATIONS_PER_STEP,
        recycle=True,
        outer_tol=0.0,  # spend the whole budget: no stopping on the change of the mode ...
        abs_tol=0.0,  # ... nor on the solver's residual
        rel_tol=0.0,
        show_progress=not quiet,
    )
    strategy = model.variational_strategy
    curve, snapshots = [], {}
    products = newton_steps = iterations = 0
    with _common.Timer() as timer:
        while products < max(budgets):
            report = strategy.fit(max_newton_steps=1)
            products += report.kernel_products
            newton_steps += report.steps
            iterations += report.solver_iterations
            metrics = evaluate(strategy, data, grid)
            curve.append((products, metrics["test_nll"], metrics["test_std"]))
            for budget in budgets:
                if budget not in snapshots and (products >= budget or report.solver_iterations == 0):
                    snapshots[budget] = dict(
                        metrics, products=products, newton_steps=newton_steps, iterations=iterations
                    )
            if report.solver_iterations == 0:  # the actions span the whole space: nothing left to do
                break
    return snapshots, curve, timer.seconds


def run_exact(data, grid):
    """Every Newton step solved exactly: unit-vector actions over all N points (= Cholesky), to convergence."""
    train_x, train_y = data[:2]
    num = len(train_x)
    model = Model(
        train_x,
        train_y,
        gpytorch.likelihoods.BernoulliLikelihood(),
        policy="unit",
        max_solver_iterations=num,
        abs_tol=0.0,
        rel_tol=0.0,
        outer_tol=1e-8,
        max_newton_steps=50,
        show_progress=False,
    )
    report = model.variational_strategy.fit()
    metrics = evaluate(model.variational_strategy, data, grid)
    metrics.update(products=report.kernel_products, newton_steps=report.steps, iterations=report.solver_iterations)
    return metrics


def main():
    args = _common.parse_args(__doc__.splitlines()[0])
    _common.setup(seed=0)
    num_train, num_test, resolution = (60, 200, 30) if args.smoke else (300, 1000, 80)
    budgets = (5, 10, 20) if args.smoke else (5, 20, 100)
    data = moons(num_train, num_test)
    train_x, train_y = data[:2]
    lo, hi = train_x.min(0).values - 0.5, train_x.max(0).values + 0.5
    g0, g1 = torch.meshgrid(
        torch.linspace(lo[0], hi[0], resolution), torch.linspace(lo[1], hi[1], resolution), indexing="xy"
    )
    grid = torch.stack([g0.reshape(-1), g1.reshape(-1)], -1)

    results, curves, times = {}, {}, {}
    for policy in ("unit", "cg"):
        results[policy], curves[policy], times[policy] = run_policy(policy, budgets, data, grid, args.quiet)
    with _common.Timer() as timer:
        exact = run_exact(data, grid)
    times["exact"] = timer.seconds

    rows = []
    for policy, label in (("unit", "unit (SoD)"), ("cg", "CG")):
        for budget in budgets:
            r = results[policy][budget]
            rows.append(
                [
                    label,
                    budget,
                    r["newton_steps"],
                    r["iterations"],
                    r["products"],
                    r["train_acc"],
                    r["test_nll"],
                    r["test_std"],
                ]
            )
    rows.append(
        [
            "exact",
            "-",
            exact["newton_steps"],
            exact["iterations"],
            exact["products"],
            exact["train_acc"],
            exact["test_nll"],
            exact["test_std"],
        ]
    )
    _common.print_table(
        ["policy", "budget", "Newton steps", "solver its", "products with K", "train acc", "test NLL", "mean test std"],
        rows,
        title=f"Binary classification, two moons, N={num_train}, {ITERATIONS_PER_STEP} solver iterations per Newton step",
    )
    print(
        f"wall time: unit {times['unit']:.2f}s, CG {times['cg']:.2f}s, exact {times['exact']:.2f}s (incl. evaluation)"
    )

    # -- figure -----------------------------------------------------------------------------------
    fig, axes = plt.subplots(4, len(budgets) + 1, figsize=(4.0 * (len(budgets) + 1), 14.5), constrained_layout=True)
    shape = g0.shape
    extent = (float(lo[0]), float(hi[0]), float(lo[1]), float(hi[1]))
    prior_std = math.sqrt(OUTPUTSCALE)
    colors = ["tab:blue" if label == 0 else "tab:red" for label in train_y.tolist()]

    def panel_probs(ax, r, title):
        image = ax.imshow(
            r["grid_probs"].reshape(shape), origin="lower", extent=extent, cmap="RdBu_r", vmin=0, vmax=1, aspect="auto"
        )
        ax.contour(g0, g1, r["grid_probs"].reshape(shape), levels=[0.5], colors="k", linewidths=1.2)
        ax.scatter(train_x[:, 0], train_x[:, 1], c=colors, s=8, edgecolors="w", linewidths=0.3)
        ax.set_title(title, fontsize=10)
        return image

    def panel_std(ax, r, title, mark_used):
        image = ax.imshow(
            r["grid_std"].reshape(shape),
            origin="lower",
            extent=extent,
            cmap="viridis",
            vmin=0,
            vmax=prior_std,
            aspect="auto",
        )
        if mark_used:
            used = r["used"]
            ax.scatter(train_x[~used, 0], train_x[~used, 1], s=5, c="w", alpha=0.5, linewidths=0)
            ax.scatter(
                train_x[used, 0],
                train_x[used, 1],
                s=14,
                c="k",
                edgecolors="w",
                linewidths=0.5,
                label="used by the actions",
            )
        else:
            ax.scatter(train_x[:, 0], train_x[:, 1], s=5, c="w", alpha=0.5, linewidths=0)
        ax.set_title(title, fontsize=10)
        return image

    for row, (policy, label) in enumerate((("unit", "unit vectors (SoD)"), ("cg", "CG"))):
        for col, budget in enumerate(budgets):
            r = results[policy][budget]
            steps = r["newton_steps"]
            suffix = f"{r['products']} products with K, {steps} Newton step{'s' if steps > 1 else ''}"
            prob_image = panel_probs(axes[2 * row, col], r, f"{label}: p(y=1)\n{suffix}")
            std_image = panel_std(
                axes[2 * row + 1, col], r, f"{label}: latent std\n{suffix}", mark_used=policy == "unit"
            )
    panel_probs(
        axes[0, -1],
        exact,
        f"exact Laplace: p(y=1)\n{exact['products']} products with K, {exact['newton_steps']} Newton steps",
    )
    panel_std(axes[1, -1], exact, "exact Laplace: latent std", mark_used=False)
    axes[1, 0].legend(loc="lower left", fontsize=8)
    fig.colorbar(prob_image, ax=axes[0, :], label="p(y=1) (rows 1 and 3)", shrink=0.9, pad=0.01)
    fig.colorbar(std_image, ax=axes[1, :], label="latent std (rows 2 and 4)", shrink=0.9, pad=0.01)
    for ax in axes[:, :-1].flat:
        ax.set_xticks([])
        ax.set_yticks([])
    for ax in axes[:2, -1]:
        ax.set_xticks([])
        ax.set_yticks([])

    styles = {"unit": ("tab:orange", "unit vectors (SoD)"), "cg": ("tab:green", "CG")}
    for key, ax, exact_value, ylabel in (
        (1, axes[2, -1], exact["test_nll"], "test NLL"),
        (2, axes[3, -1], exact["test_std"], "mean latent std on the test set"),
    ):
        for policy, (color, label) in styles.items():
            xs = [c[0] for c in curves[policy]]
            ys = [c[key] for c in curves[policy]]
            ax.plot(xs, ys, "o-", ms=3, color=color, label=label)
        ax.axhline(exact_value, color="k", ls="--", lw=1, label="exact Laplace")
        ax.set_xlabel("products with K")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log")
        ax.set_ylim(bottom=0.9 * exact_value)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[2, -1].set_title("test NLL vs computation", fontsize=10)
    axes[3, -1].set_title("computational + mathematical uncertainty", fontsize=10)
    fig.suptitle(
        f"IterNCGP, two moons (N={num_train}), probit likelihood, Matérn-3/2 (ℓ={LENGTHSCALE}, s²={OUTPUTSCALE}), "
        f"{ITERATIONS_PER_STEP} solver iterations per Newton step with recycling",
        fontsize=12,
    )
    _common.save_figure(fig, args, NAME)


if __name__ == "__main__":
    main()
