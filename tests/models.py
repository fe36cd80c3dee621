"""A GPyTorch model using IterNCGPStrategy (or EPStrategy), and small data sets, shared by the tests."""

from __future__ import annotations

import gpytorch
import torch

from gpytorch_iterncgp import IterNCGPStrategy


class IterNCGPModel(gpytorch.models.ApproximateGP):
    """An ``ApproximateGP`` with a scaled RBF or Matérn kernel and IterNCGP inference (or ``strategy_class``'s).

    :param batch_classes: ``C`` for one independent GP per class (``batch_shape=[C]``); ``None`` for one
        kernel (shared by all classes when the likelihood has several).
    """

    def __init__(
        self,
        train_x,
        train_y,
        likelihood,
        kernel: str = "rbf",
        lengthscale: float = 0.3,
        outputscale: float = 2.0,
        batch_classes: int | None = None,
        constant_mean: float | None = None,
        strategy_class=IterNCGPStrategy,
        **strategy_options,
    ):
        strategy_options.setdefault("show_progress", False)
        strategy = strategy_class(self, train_x, train_y, likelihood, **strategy_options)
        super().__init__(strategy)
        batch_shape = torch.Size([batch_classes]) if batch_classes else torch.Size([])
        if constant_mean is None:
            self.mean_module = gpytorch.means.ZeroMean(batch_shape=batch_shape)
        else:
            self.mean_module = gpytorch.means.ConstantMean(batch_shape=batch_shape).to(train_x.dtype)
            self.mean_module.constant = constant_mean
        if kernel == "rbf":
            base = gpytorch.kernels.RBFKernel(batch_shape=batch_shape)
        elif kernel == "matern":
            base = gpytorch.kernels.MaternKernel(nu=1.5, batch_shape=batch_shape)
        elif kernel == "keops-matern":
            base = gpytorch.kernels.keops.MaternKernel(nu=1.5, batch_shape=batch_shape)
        else:
            raise ValueError(kernel)
        self.covar_module = gpytorch.kernels.ScaleKernel(base, batch_shape=batch_shape)
        self.to(train_x.dtype)  # before setting hyperparameters, so they are not rounded through float32
        self.covar_module.outputscale = outputscale
        self.covar_module.base_kernel.lengthscale = lengthscale

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def binary_data(num_data=60, dim=2, dtype=torch.float64, seed=0):
    """Inputs in [0, 1]^dim and labels in {0, 1} drawn from a smooth latent function."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(num_data, dim, generator=generator, dtype=dtype)
    latent = 3 * torch.sin(6 * x[:, 0]) + x[:, -1]
    y = (torch.rand(num_data, generator=generator, dtype=dtype) < torch.sigmoid(latent)).to(dtype)
    return x, y


def count_data(num_data=60, dtype=torch.float64, seed=0, scale=2.0):
    """Inputs on [0, 1] and Poisson counts with rate exp(scale * sin(8 x))."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(num_data, 1, generator=generator, dtype=dtype)
    rate = torch.exp(scale * torch.sin(8 * x[:, 0]))
    y = torch.poisson(rate, generator=generator)
    return x, y


def multiclass_data(num_data=60, num_classes=3, dim=2, dtype=torch.float64, seed=0):
    """Inputs in [0, 1]^dim and labels in [0, C) from the nearest of C random centres (with label noise)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(num_data, dim, generator=generator, dtype=dtype)
    centres = torch.rand(num_classes, dim, generator=generator, dtype=dtype)
    logits = -10 * torch.cdist(x, centres).square()
    y = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]
    return x, y


def softmax_likelihood(num_classes: int = 3):
    """GPyTorch's softmax likelihood with one latent function per class (no mixing weights)."""
    return gpytorch.likelihoods.SoftmaxLikelihood(num_classes=num_classes, mixing_weights=False)


def set_distinct_class_hyperparameters(model) -> None:
    """Different lengthscale, outputscale and mean per class (3 classes), so that a mix-up of classes shows."""
    dtype = model.variational_strategy.train_inputs.dtype
    model.covar_module.base_kernel.lengthscale = torch.tensor([0.2, 0.35, 0.5], dtype=dtype).view(3, 1, 1)
    model.covar_module.outputscale = torch.tensor([1.0, 2.5, 4.0], dtype=dtype)
    model.mean_module.constant = torch.tensor([0.5, -0.3, 0.1], dtype=dtype)
