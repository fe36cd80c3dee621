"""Poisson regression with IterNCGP: how to spread a budget of solver iterations over Newton steps.

Paper, Figure 5. 100 points on [0, 1], a log rate drawn from a GP with an RBF kernel (lengthscale 0.1,
outputscale 5), counts from a Poisson with rate exp(f), and the same prior in the model (exp-link
Poisson likelihood). A budget of 100 solver iterations (= products with K) is spent as 1, 5, 10 or 20
iterations per Newton step (100, 20, 10 or 5 Newton steps) with CG actions and recycling. After every
Newton step (fit callback) the test NLL of held-out counts is computed by Gauss–Hermite quadrature over
the latent marginals, which include the computational uncertainty. Ten data sets (counts redrawn from the
same rate) give the median and the min/max band.

    python examples/poisson_regression.py [--smoke] [--quiet] [--out DIR] [--threads N]
"""

from __future__ import annotations

import math
import warnings

import _common
import gpytorch
import matplotlib.pyplot as plt
import numpy as np
import torch

from gpytorch_iterncgp import ExpPoissonLikelihood, IterNCGPStrategy, NumericalBreakdownWarning

NAME = "poisson_regression"
LENGTHSCALE, OUTPUTSCALE = 0.1, 5.0
SCHEDULES = (1, 5, 10, 20)  # solver iterations per Newton step
SNAPSHOTS = (2, 10, 100)  # solver iterations after which the j = 1 run's posterior is plotted


class Model(gpytorch.models.ApproximateGP):
    """A zero-mean GP over the log rate with a scaled RBF kernel; IterNCGP replaces the variational strategy."""

    def __init__(self, train_x, train_y, likelihood, **options):
        strategy = IterNCGPStrategy(self, train_x, train_y, likelihood, **options)
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        self.covar_module.base_kernel.lengthscale = LENGTHSCALE
        self.covar_module.outputscale = OUTPUTSCALE

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def make_data(num_train: int, num_test: int, num_datasets: int):
    """One log rate drawn from the prior at train, test and plotting inputs; counts redrawn per data set."""
    generator = torch.Generator().manual_seed(0)
    train_x = torch.linspace(0, 1, num_train)
    test_x = torch.rand(num_test, generator=generator)
    plot_x = torch.linspace(0, 1, 300)
    inputs = torch.cat([train_x, test_x, plot_x])
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
    kernel.base_kernel.lengthscale, kernel.outputscale = LENGTHSCALE, OUTPUTSCALE
    with torch.no_grad():
        covariance = kernel(inputs[:, None]).to_dense() + 1e-8 * torch.eye(len(inputs))
    log_rate = torch.linalg.cholesky(covariance) @ torch.randn(len(inputs), generator=generator)
    train_rate, test_rate = log_rate[:num_train].exp(), log_rate[num_train : num_train + num_test].exp()
    datasets = [
        (torch.poisson(train_rate, generator=generator), torch.poisson(test_rate, generator=generator))
        for _ in range(num_datasets)
    ]
    return train_x, test_x, plot_x, log_rate[num_train + num_test :], datasets


_NODES, _WEIGHTS = (torch.as_tensor(a) for a in np.polynomial.hermite.hermgauss(60))


def poisson_nll(mean, variance, counts) -> float:
    r"""Mean of :math:`-\log \int \mathrm{Poisson}(y \mid e^f) \, \mathcal N(f; \mu, \sigma^2) \, df` (Gauss–Hermite)."""
    latent = mean[:, None] + math.sqrt(2) * variance.sqrt()[:, None] * _NODES  # (N, nodes)
    log_likelihood = counts[:, None] * latent - latent.exp() - torch.lgamma(counts[:, None] + 1)
    log_predictive = torch.logsumexp(log_likelihood + _WEIGHTS.log(), dim=-1) - 0.5 * math.log(math.pi)
    return float(-log_predictive.mean())


def run(train_x, train_y, test_x, test_y, iterations_per_step, budget, plot_x=None, quiet=True):
    """One IterNCGP run; returns (solver iterations, test NLL) after every Newton step and snapshots on plot_x."""
    model = Model(
        train_x,
        train_y,
        ExpPoissonLikelihood(),
        policy="cg",
        max_solver_iterations=iterations_per_step,
        max_newton_steps=budget // iterations_per_step,
        recycle=True,
        outer_tol=0.0,  # never stop on the change of the mode: spend the budget
        abs_tol=0.0,
        rel_tol=0.0,
        show_progress=not quiet,
    )
    strategy = model.variational_strategy
    curve, snapshots = [], {}
    total = 0

    def callback(step, state):
        nonlocal total
        total += step.solver_iterations
        mean, variance = strategy.marginal_latent(test_x)
        curve.append((total, poisson_nll(mean[:, 0], variance[:, 0], test_y)))
        if plot_x is not None and total in SNAPSHOTS:
            snapshots[total] = tuple(t[:, 0] for t in strategy.marginal_latent(plot_x))

    # fit() gives up after several Newton steps that did not increase the log posterior (with one solver
    # iteration per step that happens long before the budget is spent); calling it again continues from
    # the same state with every action taken so far, so the budget is spent in up to a few calls.
    newton_steps, restarts = 0, -1
    while total < budget:
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always", NumericalBreakdownWarning)
            report = strategy.fit(max_newton_steps=(budget - total) // iterations_per_step, callback=callback)
        newton_steps += report.steps
        restarts += 1
        if report.solver_iterations == 0 or report.steps == 0:
            break
    if plot_x is not None:  # the final posterior (precision updated to the final mode)
        snapshots["final"] = tuple(t[:, 0] for t in strategy.marginal_latent(plot_x))
    return curve, snapshots, {"newton_steps": newton_steps, "iterations": total, "restarts": restarts}


def exact_nll(train_x, train_y, test_x, test_y) -> float:
    """The converged Laplace approximation: every Newton step solved to tolerance."""
    model = Model(
        train_x,
        train_y,
        ExpPoissonLikelihood(),
        policy="cg",
        max_solver_iterations=None,
        max_newton_steps=100,
        outer_tol=1e-8,
        abs_tol=1e-10,
        rel_tol=1e-10,
        show_progress=False,
    )
    model.variational_strategy.fit()
    mean, variance = model.variational_strategy.marginal_latent(test_x)
    return poisson_nll(mean[:, 0], variance[:, 0], test_y)


def value_at(curve, iterations) -> float:
    """The test NLL after the last Newton step that finished within ``iterations`` solver iterations."""
    values = [nll for total, nll in curve if total <= iterations]
    return values[-1] if values else float("nan")


def main():
    args = _common.parse_args(__doc__.splitlines()[0])
    _common.setup(seed=0)
    num_datasets, budget = (2, 20) if args.smoke else (10, 100)
    train_x, test_x, plot_x, plot_log_rate, datasets = make_data(100, 100, num_datasets)

    checkpoints = {j: np.arange(0, budget + 1, j) for j in SCHEDULES}  # ends of the Newton steps
    curves = {j: [] for j in SCHEDULES}  # per schedule and data set: test NLL at the checkpoints
    exact, snapshots, finals = [], None, {}
    with _common.Timer() as timer, torch.no_grad():
        for index, (train_y, test_y) in enumerate(datasets):
            exact.append(exact_nll(train_x, train_y, test_x, test_y))
            prior_nll = poisson_nll(torch.zeros(len(test_x)), torch.full((len(test_x),), OUTPUTSCALE), test_y)
            for j in SCHEDULES:
                want_plot = index == 0 and j == 1
                curve, snaps, report = run(
                    train_x, train_y, test_x, test_y, j, budget, plot_x if want_plot else None, quiet=args.quiet
                )
                curve = [(0, prior_nll)] + curve
                curves[j].append(np.array([value_at(curve, i) for i in checkpoints[j]]))
                finals.setdefault(j, []).append((report["newton_steps"], report["iterations"], report["restarts"]))
                if want_plot:
                    snapshots = snaps
    exact = np.array(exact)
    stacked = {j: np.stack(curves[j]) for j in SCHEDULES}  # (data sets, checkpoints)
    median = {j: np.median(stacked[j], axis=0) for j in SCHEDULES}

    # -- table ------------------------------------------------------------------------------------
    columns = [c for c in (5, 10, 20, 50, 100) if c <= budget]

    def after(j, iterations):  # median test NLL after the last Newton step that ended within `iterations`
        return float(median[j][iterations // j])

    # Efficiency: the test NLL in excess of the exact one, averaged over the budget (a step function of the
    # iterations spent: until a Newton step ends, the previous posterior is what one has).
    excess = {j: float(np.mean([after(j, i) for i in range(1, budget + 1)]) - np.median(exact)) for j in SCHEDULES}
    rows = []
    for j in SCHEDULES:
        steps, iterations, _ = np.median(finals[j], axis=0).astype(int)
        restarts = int(np.sum([f[2] for f in finals[j]]))
        rows.append([f"j <= {j}", steps, iterations, restarts] + [after(j, c) for c in columns] + [excess[j]])
    rows.append(["exact Laplace", "-", "-", "-"] + [float(np.median(exact))] * len(columns) + [0.0])
    _common.print_table(
        ["schedule", "Newton steps", "solver its", "fit restarts"]
        + [f"NLL @{c}" for c in columns]
        + ["mean excess NLL"],
        rows,
        title=f"Poisson regression, test NLL (median over {num_datasets} data sets) after a number of solver iterations",
    )
    best = min(SCHEDULES, key=lambda j: excess[j])
    print(
        f"most efficient schedule (lowest test NLL averaged over the budget): j <= {best} iteration(s) per Newton step; "
        f"the paper's finding (j <= 1 wins) {'holds' if best == 1 else 'does not hold'} here."
    )
    print(
        f"wall time: {timer.seconds:.2f}s for {num_datasets} data sets x {len(SCHEDULES)} schedules (incl. evaluation)"
    )

    # -- figure -----------------------------------------------------------------------------------
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8), constrained_layout=True)
    colors = dict(zip(SCHEDULES, ["tab:red", "tab:orange", "tab:green", "tab:blue"], strict=True))
    ax = axes[0]
    for j in SCHEDULES:
        x = checkpoints[j]
        ax.plot(x, median[j], ".-" if j > 1 else "-", color=colors[j], label=f"j ≤ {j} ({budget // j} Newton steps)")
        ax.fill_between(x, stacked[j].min(0), stacked[j].max(0), color=colors[j], alpha=0.15, lw=0)
        ax.plot(x[-1], median[j][-1], "x", color=colors[j], ms=9, mew=2)
    ax.axhline(np.median(exact), color="k", ls="--", lw=1, label="exact Laplace")
    ax.set_ylim(0.95 * np.median(exact), None)
    ax.set_xlabel("solver iterations (products with K)")
    ax.set_ylabel("test NLL")
    ax.set_title(f"Test NLL, median and min/max over {num_datasets} data sets")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")

    train_y = datasets[0][0]
    shown = [k for k in SNAPSHOTS if k in snapshots]
    shades = dict(zip(shown, ["tab:orange", "tab:green", "tab:purple"], strict=False))
    ax = axes[1]
    for k in shown:
        mean, variance = snapshots[k]
        std = variance.sqrt()
        ax.plot(plot_x, mean, color=shades[k], label=f"after {k} iterations")
        ax.fill_between(plot_x, mean - 1.96 * std, mean + 1.96 * std, color=shades[k], alpha=0.15, lw=0)
        ax.plot(plot_x, mean - 1.96 * std, color=shades[k], lw=0.6, ls=":")
        ax.plot(plot_x, mean + 1.96 * std, color=shades[k], lw=0.6, ls=":")
    ax.plot(plot_x, plot_log_rate, "k--", lw=1, label="true log rate")
    ax.set_xlabel("x")
    ax.set_ylabel("log rate f(x)")
    ax.set_title("Latent log rate, j ≤ 1: mean and 95% band during the run")
    ax.legend(fontsize=8, loc="lower left")

    ax = axes[2]
    mean, variance = snapshots["final"]
    std = variance.sqrt()
    ax.fill_between(
        plot_x,
        (mean - 1.96 * std).exp(),
        (mean + 1.96 * std).exp(),
        color="tab:purple",
        alpha=0.25,
        lw=0,
        label="95% band",
    )
    ax.plot(plot_x, (mean + variance / 2).exp(), color="tab:purple", label="posterior mean of the rate")
    ax.plot(plot_x, plot_log_rate.exp(), "k--", lw=1, label="true rate")
    ax.plot(train_x, train_y, ".", color="0.3", ms=5, label="counts (training data)")
    ax.set_xlabel("x")
    ax.set_ylabel("rate λ(x) = exp f(x)")
    ax.set_title(f"Rate after {budget} iterations (j ≤ 1)")
    ax.legend(fontsize=8)
    fig.suptitle(
        f"IterNCGP-CG with recycling, Poisson regression (exp link), N=100, RBF (ℓ={LENGTHSCALE}, s²={OUTPUTSCALE}): "
        f"a budget of {budget} solver iterations spread over Newton steps"
    )
    _common.save_figure(fig, args, NAME)


if __name__ == "__main__":
    main()
