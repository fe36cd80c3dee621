"""The prior the benchmarks' GPyTorch models share, the likelihoods they take by the number of classes, and where their
inducing inputs start."""

from __future__ import annotations

import math

import gpytorch
import torch
from torch import Tensor

from benchmarks.data import Data
from gpytorch_iterncgp import MultinomialProbitLikelihood


def latent_shape(data: Data) -> torch.Size:
    """One latent per class, one latent for binary data: the batch shape of the mean and kernel."""
    return torch.Size([data.num_classes]) if data.num_classes > 2 else torch.Size([])


def classification_likelihood(num_classes: int) -> gpytorch.likelihoods.Likelihood:
    """Softmax over the classes' latents, or Bernoulli (probit) for binary data: SVGP's, and the GPyTorch path's
    with Laplace (:func:`benchmarks.learned.run_gpytorch_path`)."""
    if num_classes > 2:
        return gpytorch.likelihoods.SoftmaxLikelihood(num_classes=num_classes, mixing_weights=False)
    return gpytorch.likelihoods.BernoulliLikelihood()


def ep_likelihood(num_classes: int) -> gpytorch.likelihoods.Likelihood:
    """The multinomial probit over the classes' latents, or Bernoulli (probit) for binary data: EP's."""
    if num_classes > 2:
        return MultinomialProbitLikelihood(num_classes=num_classes)
    return gpytorch.likelihoods.BernoulliLikelihood()


def training_targets(data: Data) -> Tensor:
    """The training labels as the likelihoods take them: class indices, or floats in the inputs' dtype for binary
    data."""
    return data.train_y if data.num_classes > 2 else data.train_y.to(data.train_x)


def matern_kernel(data: Data, batch: torch.Size) -> gpytorch.kernels.ScaleKernel:
    r"""Matérn-5/2 with outputscale 1 and lengthscale :math:`\sqrt D` to start (standardised inputs in :math:`D`
    dimensions are about :math:`\sqrt{2 D}` apart), the same start for every method."""
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5, batch_shape=batch), batch_shape=batch)
    kernel.base_kernel.lengthscale = math.sqrt(data.train_x.shape[-1])
    return kernel


class BenchmarkGP(gpytorch.models.ApproximateGP):
    """The prior every method shares: Matérn-5/2 kernel (:func:`matern_kernel`) and constant mean per class (one
    latent for binary data), in the data's dtype; a subclass passes its strategy, and ``mean_module`` and
    ``covar_module`` where a benchmark fixes its own prior (:func:`benchmarks.methods.run_svgp`)."""

    def __init__(self, strategy, data: Data, mean_module=None, covar_module=None):
        super().__init__(strategy)
        batch = latent_shape(data)
        self.mean_module = gpytorch.means.ConstantMean(batch_shape=batch) if mean_module is None else mean_module
        self.covar_module = matern_kernel(data, batch) if covar_module is None else covar_module
        self.to(data.train_x)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def inducing_starts(
    data: Data, num_inducing: int, sets: int, generator: torch.Generator, disjoint: bool = False
) -> Tensor:
    """``num_inducing / sets`` training inputs (at least one, at most all) for each of ``sets`` sets of inducing
    inputs, drawn without replacement within a set: ``(sets, M, D)``. ``disjoint``: one draw for all sets, so no two
    share a start, where the data has enough inputs (else each set its own draw, as without it)."""
    num_train = len(data.train_y)
    size = min(max(1, num_inducing // sets), num_train)
    if disjoint and size * sets <= num_train:
        index = torch.randperm(num_train, generator=generator)[: size * sets]
    else:
        index = torch.cat([torch.randperm(num_train, generator=generator)[:size] for _ in range(sets)])
    return data.train_x[index].reshape(sets, size, -1).clone()
