"""The models whose state_dicts ``tests/data/saved_state_dicts.pt`` holds, built the same way by the script that
wrote it and by the test that loads it."""

from __future__ import annotations

import gpytorch
import torch

from gpytorch_iterncgp import (
    EPStrategy,
    IterNCGPStrategy,
    MultinomialProbitLikelihood,
    SparseEPStrategy,
)
from tests.common import IterNCGPModel, binary_data, multiclass_data, softmax_likelihood

CASES = ("laplace-softmax", "ep-probit", "ep-multinomial-probit", "sparse-ep-probit")


class _SparseModel(gpytorch.models.ApproximateGP):
    def __init__(self, x, y, likelihood):
        super().__init__(SparseEPStrategy(self, x, y, likelihood, x[::4].clone(), show_progress=False))
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        self.to(x.dtype)
        self.covar_module.base_kernel.lengthscale = 0.3
        self.covar_module.outputscale = 2.0

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def build(name: str) -> gpytorch.models.ApproximateGP:
    """The unfitted model of case ``name`` (float64, 40 points)."""
    if name == "laplace-softmax":
        x, y = multiclass_data(num_data=40)
        return IterNCGPModel(
            x, y, softmax_likelihood(), batch_classes=3, strategy_class=IterNCGPStrategy, max_solver_iterations=8
        )
    if name == "ep-probit":
        x, y = binary_data(num_data=40)
        return IterNCGPModel(x, y, gpytorch.likelihoods.BernoulliLikelihood(), strategy_class=EPStrategy)
    if name == "ep-multinomial-probit":
        x, y = multiclass_data(num_data=40)
        return IterNCGPModel(
            x, y, MultinomialProbitLikelihood(num_classes=3), batch_classes=3, strategy_class=EPStrategy
        )
    if name == "sparse-ep-probit":
        x, y = binary_data(num_data=40)
        return _SparseModel(x, y, gpytorch.likelihoods.BernoulliLikelihood())
    raise ValueError(name)


def prediction_inputs() -> torch.Tensor:
    """Nine test inputs in [0, 1]^2 (float64)."""
    return torch.rand(9, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
