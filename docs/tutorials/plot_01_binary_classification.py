"""
Binary classification: from ``VariationalStrategy`` to ``IterNCGPStrategy``
===========================================================================

A GPyTorch ``ApproximateGP`` becomes an IterNCGP model by one change: its ``VariationalStrategy`` is replaced by an
:class:`~gpytorch_iterncgp.strategies.itergp.IterNCGPStrategy`. The kernel, the mean and the likelihood stay, and
nothing variational is learnt: ``fit()`` runs damped Newton steps towards the mode of the Laplace approximation,
each a GP regression solved approximately by IterGP. The posterior covariance is *wider* than the exact Laplace
covariance by exactly the error of having stopped early (the paper's computational uncertainty).

This tutorial follows the paper's Figures 1 and 3 on two interleaved moons with the probit likelihood: CG actions
against unit-vector actions (a growing subset of the data) after a few products with the kernel matrix K.
"""

# %%
# The data and the model
# ----------------------
# ``GPYTORCH_ITERNCGP_SMOKE=1`` (set when the documentation is built in CI) shrinks the data so that the tutorial
# runs in seconds; the numbers quoted in the text are from the full size.
import os

import gpytorch
import matplotlib.pyplot as plt
import torch
from sklearn.datasets import make_moons

from gpytorch_iterncgp import IterNCGPStrategy

SMOKE = os.environ.get("GPYTORCH_ITERNCGP_SMOKE", "0") not in ("", "0")
NUM_TRAIN, NUM_TEST, RESOLUTION = (60, 200, 30) if SMOKE else (300, 1000, 80)
BUDGETS = (5, 10, 20) if SMOKE else (5, 20, 100)
DTYPE = torch.float64

x, y = make_moons(NUM_TRAIN + NUM_TEST, noise=0.25, random_state=0)
x, y = torch.as_tensor(x, dtype=DTYPE), torch.as_tensor(y, dtype=DTYPE)
train_x, train_y, test_x, test_y = x[:NUM_TRAIN], y[:NUM_TRAIN], x[NUM_TRAIN:], y[NUM_TRAIN:]


class Model(gpytorch.models.ApproximateGP):
    """A zero-mean GP with a scaled Matérn-3/2 kernel; IterNCGP replaces the variational strategy."""

    def __init__(self, train_x, train_y, likelihood, **options):
        super().__init__(IterNCGPStrategy(self, train_x, train_y, likelihood, **options))
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5))
        self.covar_module.base_kernel.lengthscale = 0.5
        self.covar_module.outputscale = 10.0

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


# %%
# Fitting on a budget
# -------------------
# Every Newton step runs at most 5 IterGP iterations (one product with K each) and recycles the actions of the
# previous steps. ``fit(max_newton_steps=1)`` continues where the previous call stopped, so we can look at the
# posterior after every step. The tolerances are 0 so that the whole budget is spent.


def bernoulli_nll(probs, labels):
    probs = probs.clamp(1e-12, 1 - 1e-12)
    return float(-(labels * probs.log() + (1 - labels) * (1 - probs).log()).mean())


grid_axis = torch.linspace(-2.0, 3.0, RESOLUTION, dtype=DTYPE)
grid = torch.cartesian_prod(grid_axis, grid_axis.flip(0) / 1.6 + 0.25)


def run(policy):
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = Model(
        train_x,
        train_y,
        likelihood,
        policy=policy,
        max_solver_iterations=5,
        outer_tol=0.0,
        abs_tol=0.0,
        rel_tol=0.0,
        # the paper's plain CG, whose budget is its products with K (the default preconditioner's pivots are actions
        # that cost no product: with as many as there are points, its first solve is exact)
        preconditioner_rank=0,
        show_progress=False,
    )
    strategy = model.variational_strategy
    curve, snapshots, products = [], {}, 0
    while products < max(BUDGETS):
        report = strategy.fit(max_newton_steps=1)
        if report.kernel_products == 0:  # the actions span the space: nothing left to spend
            raise RuntimeError("the solver has nothing left to do before the largest budget")
        products += report.kernel_products
        with torch.no_grad():
            nll = bernoulli_nll(strategy.predictive_probabilities(test_x), test_y)
        curve.append((products, nll))
        for budget in BUDGETS:
            if budget not in snapshots and products >= budget:
                with torch.no_grad():
                    _, grid_variance = strategy.marginal_latent(grid)
                    grid_probs = strategy.predictive_probabilities(grid)
                snapshots[budget] = (grid_probs, grid_variance.sqrt()[:, 0], nll)
    return snapshots, curve


cg_snapshots, cg_curve = run("cg")
unit_snapshots, unit_curve = run("unit")
for budget in BUDGETS:
    print(
        f"{budget:4d} products with K: test NLL CG {cg_snapshots[budget][2]:.3f}, "
        f"unit vectors {unit_snapshots[budget][2]:.3f}"
    )

# %%
# The exact Laplace approximation, for reference: unit-vector actions over all N points with no early stop are a
# Cholesky factorisation, solved to convergence at every Newton step.
exact = Model(
    train_x,
    train_y,
    gpytorch.likelihoods.BernoulliLikelihood(),
    policy="unit",
    max_solver_iterations=NUM_TRAIN,
    abs_tol=0.0,
    rel_tol=0.0,
    outer_tol=1e-8,
    max_newton_steps=50,
    show_progress=False,
)
print(exact.variational_strategy.fit())
with torch.no_grad():
    exact_nll = bernoulli_nll(exact.variational_strategy.predictive_probabilities(test_x), test_y)
print(f"exact Laplace: test NLL {exact_nll:.3f}")

# %%
# What the budget buys
# --------------------
# Top row: the predictive probability; bottom row: the latent standard deviation, which includes the computational
# uncertainty. It stays at the prior's level away from what the CG actions have "seen" and shrinks as the budget
# grows. At the full size CG reaches a good decision boundary after about 20 products (test NLL 0.24 against the
# exact 0.21); the subset-of-data policy needs far more.
fig, axes = plt.subplots(2, len(BUDGETS), figsize=(3.2 * len(BUDGETS), 5.6), sharex=True, sharey=True)
shape = (RESOLUTION, RESOLUTION)
for column, budget in enumerate(BUDGETS):
    probs, std, _ = cg_snapshots[budget]
    axes[0, column].contourf(
        grid[:, 0].reshape(shape),
        grid[:, 1].reshape(shape),
        probs.reshape(shape),
        levels=20,
        cmap="RdBu_r",
        vmin=0,
        vmax=1,
    )
    axes[1, column].contourf(
        grid[:, 0].reshape(shape), grid[:, 1].reshape(shape), std.reshape(shape), levels=20, cmap="viridis"
    )
    axes[0, column].set_title(f"CG, {budget} products with K")
    for row in range(2):
        axes[row, column].scatter(*train_x.T, c=train_y, cmap="RdBu_r", s=6, edgecolors="k", linewidths=0.3)
axes[0, 0].set_ylabel("predictive probability")
axes[1, 0].set_ylabel("latent standard deviation")
fig.tight_layout()

# %%
# The test NLL against the number of products with K, for both policies:
fig, ax = plt.subplots(figsize=(5, 3.5))
ax.plot(*zip(*cg_curve, strict=True), marker="o", label="CG actions")
ax.plot(*zip(*unit_curve, strict=True), marker="s", label="unit vectors (subset of data)")
ax.axhline(exact_nll, color="k", linestyle="--", label="exact Laplace")
ax.set_xlabel("products with K")
ax.set_ylabel("test NLL")
ax.legend()
fig.tight_layout()
plt.show()
