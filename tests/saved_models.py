"""The models whose state_dicts ``tests/data/saved_state_dicts.pt`` and ``tests/data/saved_sep_state_dicts.pt`` hold,
built the same way by the scripts that wrote them and by the test that loads them."""

from __future__ import annotations

import gpytorch
import torch

from gpytorch_iterncgp import (
    EPStrategy,
    IterNCGPStrategy,
    MultinomialProbitLikelihood,
    SparseEPStrategy,
    StochasticEPStrategy,
)
from tests.common import IterNCGPModel, binary_data, multiclass_data, softmax_likelihood

CASES = ("laplace-softmax", "ep-probit", "ep-multinomial-probit", "sparse-ep-probit")
#: stochastic EP's cases (``saved_sep_state_dicts.pt``): the tied site, and per-point sites
SEP_CASES = ("sep-tied-multinomial-probit", "sep-points-probit")


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


class SEPModel(gpytorch.models.ApproximateGP):
    """An ``ApproximateGP`` with a :class:`~gpytorch_iterncgp.StochasticEPStrategy` (``strategy_options`` passed to it),
    a constant mean and a scaled RBF kernel, one per class for ``batch_classes``."""

    def __init__(self, inducing_points, likelihood, batch_classes=None, **strategy_options):
        super().__init__(StochasticEPStrategy(self, inducing_points, likelihood, **strategy_options))
        shape = torch.Size([] if batch_classes is None else [batch_classes])
        self.mean_module = gpytorch.means.ConstantMean(batch_shape=shape)
        self.covar_module = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(batch_shape=shape), batch_shape=shape
        )
        self.to(inducing_points.dtype)
        self.covar_module.base_kernel.lengthscale = 0.3
        self.covar_module.outputscale = 2.0

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def sep_data(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The 40 training points of SEP case ``name`` (float64)."""
    if name == "sep-tied-multinomial-probit":
        return multiclass_data(num_data=40)
    if name == "sep-points-probit":
        return binary_data(num_data=40)
    raise ValueError(name)


def build_sep(name: str, **strategy_options) -> SEPModel:
    """The untrained model of SEP case ``name`` (float64; ``strategy_options`` added to the case's)."""
    x, _ = sep_data(name)
    if name == "sep-tied-multinomial-probit":
        return SEPModel(x[::4].clone(), MultinomialProbitLikelihood(num_classes=3), 3, **strategy_options)
    return SEPModel(x[::2].clone(), gpytorch.likelihoods.BernoulliLikelihood(), sites="points", **strategy_options)


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
