"""
Poisson counts: spreading a budget of solver iterations
=======================================================

Count data with a GP prior on the log rate, ``y ~ Poisson(exp f(x))``, has no closed-form posterior either. The
Laplace approximation's Newton steps are GP regressions; how many IterGP iterations should each of them get? The
paper's Figure 5 answers: few. Solving an outdated linearisation precisely is wasted work, and one iteration per
Newton step reaches the mode with the fewest products with K.

This tutorial draws a log rate from an RBF prior (lengthscale 0.1, outputscale 5), counts at 100 points on
[0, 1], and spends a budget of solver iterations as 1, 5 or 20 iterations per Newton step.
"""

# %%
# Data
# ----
import math
import os

import gpytorch
import matplotlib.pyplot as plt
import numpy as np
import torch

from gpytorch_iterncgp import ExpPoissonLikelihood, IterNCGPStrategy

SMOKE = os.environ.get("GPYTORCH_ITERNCGP_SMOKE", "0") not in ("", "0")
NUM_TRAIN, NUM_TEST, BUDGET = (50, 200, 40) if SMOKE else (100, 1000, 100)
SCHEDULES = (1, 5, 20)  # solver iterations per Newton step
DTYPE = torch.float64

generator = torch.Generator().manual_seed(0)
train_x = torch.linspace(0, 1, NUM_TRAIN, dtype=DTYPE)
test_x = torch.rand(NUM_TEST, generator=generator, dtype=DTYPE)
plot_x = torch.linspace(0, 1, 200, dtype=DTYPE)
inputs = torch.cat([train_x, test_x, plot_x])
prior = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DTYPE)
prior.base_kernel.lengthscale, prior.outputscale = 0.1, 5.0
with torch.no_grad():
    covariance = prior(inputs[:, None]).to_dense() + 1e-8 * torch.eye(len(inputs), dtype=DTYPE)
log_rate = torch.linalg.cholesky(covariance) @ torch.randn(len(inputs), generator=generator, dtype=DTYPE)
train_y = torch.poisson(log_rate[:NUM_TRAIN].exp(), generator=generator)
test_y = torch.poisson(log_rate[NUM_TRAIN : NUM_TRAIN + NUM_TEST].exp(), generator=generator)


class Model(gpytorch.models.ApproximateGP):
    """The same prior as the data's, and the exp-link Poisson likelihood."""

    def __init__(self, train_x, train_y, likelihood, **options):
        super().__init__(IterNCGPStrategy(self, train_x, train_y, likelihood, **options))
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        self.covar_module.base_kernel.lengthscale = 0.1
        self.covar_module.outputscale = 5.0

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


# %%
# The test NLL of held-out counts integrates the Poisson likelihood over each test point's latent marginal (which
# includes the computational uncertainty) by Gauss-Hermite quadrature.
nodes, weights = (torch.as_tensor(a, dtype=DTYPE) for a in np.polynomial.hermite.hermgauss(60))


def poisson_nll(mean, variance, counts):
    latent = mean[:, None] + math.sqrt(2) * variance.sqrt()[:, None] * nodes
    log_likelihood = counts[:, None] * latent - latent.exp() - torch.lgamma(counts[:, None] + 1)
    return float(-(torch.logsumexp(log_likelihood + weights.log(), -1) - 0.5 * math.log(math.pi)).mean())


# %%
# Spending the budget
# -------------------
# The ``callback`` of ``fit()`` is called after every Newton step; it records the test NLL against the solver
# iterations spent so far. The tolerances are 0 so that the whole budget is spent.
curves, models = {}, {}
for per_step in SCHEDULES:
    model = Model(
        train_x[:, None],
        train_y,
        ExpPoissonLikelihood(),
        policy="cg",
        max_solver_iterations=per_step,
        max_newton_steps=BUDGET // per_step,
        outer_tol=0.0,
        abs_tol=0.0,
        rel_tol=0.0,
        show_progress=False,
    )
    strategy = model.variational_strategy
    curve, spent = [], 0

    def callback(step, state, strategy=strategy, curve=curve):
        global spent
        spent += step.solver_iterations
        with torch.no_grad():
            mean, variance = strategy.marginal_latent(test_x[:, None])
        curve.append((spent, poisson_nll(mean[:, 0], variance[:, 0], test_y)))

    while spent < BUDGET:  # fit() stops early after Newton steps that no longer raise the log posterior
        report = strategy.fit(callback=callback)
        if report.solver_iterations == 0:
            break
    curves[per_step], models[per_step] = curve, model
    print(f"{per_step:2d} iterations per Newton step: test NLL {curve[-1][1]:.3f} after {spent} iterations")

# %%
# Left: the test NLL against the solver iterations spent. Right: the posterior rate of the one-iteration schedule
# with its 95% band (the band includes the computational uncertainty), the true rate and the counts.
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
for per_step, curve in curves.items():
    left.plot(*zip(*curve, strict=True), marker=".", label=f"{per_step} per Newton step")
left.set_xlabel("solver iterations (products with K)")
left.set_ylabel("test NLL")
left.legend()
with torch.no_grad():
    mean, variance = models[1].variational_strategy.marginal_latent(plot_x[:, None])
mean, std = mean[:, 0], variance[:, 0].sqrt()
right.fill_between(plot_x, (mean - 2 * std).exp(), (mean + 2 * std).exp(), alpha=0.3, label="95% band")
right.plot(plot_x, mean.exp(), label="posterior rate exp(μ)")
right.plot(plot_x, log_rate[NUM_TRAIN + NUM_TEST :].exp(), "k--", label="true rate")
right.scatter(train_x, train_y, s=8, color="k", label="counts")
right.set_yscale("log")
right.set_xlabel("x")
right.legend(fontsize=8)
fig.tight_layout()
plt.show()
