"""Models and small data sets shared by the tests: a GPyTorch model using IterNCGPStrategy (or EPStrategy)."""

from __future__ import annotations

import gpytorch
import linear_operator
import torch
from linear_operator.operators import KroneckerProductLinearOperator, RootLinearOperator, SumLinearOperator

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


class MultitaskIterNCGPModel(gpytorch.models.ApproximateGP):
    r"""Correlated latents :math:`\mathbf f(x) \in \mathbb R^C` (a ``MultitaskMultivariateNormal``, data-major) with
    IterNCGP inference (or ``strategy_class``'s).

    ``kernel="multitask"``: GPyTorch's ``MultitaskKernel``, :math:`\mathbf K = \mathbf K_x \otimes \mathbf B`,
    :math:`\mathbf B = \mathbf V \mathbf V^\top + \operatorname{diag}(\mathbf v)` (``rank`` columns of
    :math:`\mathbf V`); ``kernel="lcm"``: ``LCMKernel``, :math:`\mathbf K = \sum_q \mathbf K_q \otimes \mathbf B_q`
    with ``num_components`` RBF kernels of different lengthscales. The coregionalisation parameters are set from a
    seeded generator, so that the outputs are correlated (positively and negatively) from the start.
    """

    def __init__(
        self,
        train_x,
        train_y,
        likelihood,
        num_tasks: int = 3,
        kernel: str = "multitask",
        rank: int = 1,
        num_components: int = 2,
        lengthscale: float = 0.3,
        constant_mean: float = 0.0,
        seed: int = 0,
        strategy_class=IterNCGPStrategy,
        **strategy_options,
    ):
        strategy_options.setdefault("show_progress", False)
        strategy = strategy_class(self, train_x, train_y, likelihood, **strategy_options)
        super().__init__(strategy)
        self.mean_module = gpytorch.means.MultitaskMean(gpytorch.means.ConstantMean(), num_tasks=num_tasks)
        if kernel == "multitask":
            self.covar_module = gpytorch.kernels.MultitaskKernel(
                gpytorch.kernels.RBFKernel(), num_tasks=num_tasks, rank=rank
            )
            components = [self.covar_module]
        elif kernel == "lcm":
            bases = [gpytorch.kernels.RBFKernel() for _ in range(num_components)]
            self.covar_module = gpytorch.kernels.LCMKernel(bases, num_tasks=num_tasks, rank=rank)
            components = list(self.covar_module.covar_module_list)
        else:
            raise ValueError(kernel)
        self.to(train_x.dtype)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for index, component in enumerate(components):
                component.data_covar_module.lengthscale = lengthscale * (1 + index)
                task = component.task_covar_module
                task.covar_factor.copy_(torch.randn(task.covar_factor.shape, generator=generator, dtype=train_x.dtype))
                task.var = 0.1 + 0.2 * torch.rand(num_tasks, generator=generator, dtype=train_x.dtype)
            for task, base in enumerate(self.mean_module.base_means):
                base.constant.fill_(constant_mean + 0.2 * (task - 1))

    def forward(self, x):
        return gpytorch.distributions.MultitaskMultivariateNormal(self.mean_module(x), self.covar_module(x))


class LMCIterNCGPModel(gpytorch.models.ApproximateGP):
    r"""A linear model of coregionalisation written as mixing, :math:`\mathbf f(x) = \mathbf H \mathbf x(x)`, of
    :math:`Q` independent latent GPs :math:`x_q \sim \mathcal{GP}(0, k_q)` (RBF, batch ``[Q]``) by
    :math:`\mathbf H \in \mathbb R^{C \times Q}`.

    Its prior is :math:`\operatorname{Cov}(\mathbf f(x), \mathbf f(x')) = \sum_q \mathbf h_q \mathbf h_q^\top
    k_q(x, x')`, i.e. data-major :math:`\mathbf K = \sum_q \mathbf K_q \otimes \mathbf h_q \mathbf h_q^\top`:
    GPyTorch's ``LCMKernel`` with rank-1 task covariances and zero task variances (``IndexKernel``'s ``var``).
    With :math:`Q < C` the prior covariance has rank :math:`Q N < C N` (singular); Laplace needs no
    :math:`\mathbf K^{-1}`.
    """

    def __init__(self, train_x, train_y, likelihood, mixing, lengthscales, **strategy_options):
        strategy_options.setdefault("show_progress", False)
        strategy = IterNCGPStrategy(self, train_x, train_y, likelihood, **strategy_options)
        super().__init__(strategy)
        num_components = mixing.shape[-1]
        self.mixing = torch.nn.Parameter(mixing.to(train_x.dtype).clone())  # H, (C, Q)
        self.latent_covar_module = gpytorch.kernels.RBFKernel(batch_shape=torch.Size([num_components]))
        self.to(train_x.dtype)
        self.latent_covar_module.lengthscale = torch.as_tensor(lengthscales, dtype=train_x.dtype).view(-1, 1, 1)

    def forward(self, x):
        latent_covariances = self.latent_covar_module(x)  # (Q, N, N)
        covariance = SumLinearOperator(
            *(
                KroneckerProductLinearOperator(latent_covariances[q], RootLinearOperator(self.mixing[:, q : q + 1]))
                for q in range(self.mixing.shape[-1])
            )
        )
        mean = torch.zeros(len(x), self.mixing.shape[0], dtype=x.dtype, device=x.device)
        return gpytorch.distributions.MultitaskMultivariateNormal(mean, covariance)


def multioutput_count_data(num_data=40, num_tasks=3, dtype=torch.float64, seed=0, missing=0.0):
    """Inputs on [0, 1] and ``(N, C)`` Poisson counts with correlated rates ``exp(0.5 + x(t) H)`` from two latent
    curves; a fraction ``missing`` of the counts is NaN."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(num_data, 1, generator=generator, dtype=dtype)
    curves = torch.stack([1.5 * torch.sin(6 * x[:, 0]), torch.cos(4 * x[:, 0])], dim=-1)
    mixing = 0.8 * torch.randn(2, num_tasks, generator=generator, dtype=dtype)
    y = torch.poisson(torch.exp(0.5 + curves @ mixing), generator=generator)
    if missing:
        y[torch.rand(y.shape, generator=generator, dtype=dtype) < missing] = torch.nan
    return x, y


def settings_snapshot() -> dict:
    """The global values of every linear_operator / GPyTorch setting (class attributes)."""
    snapshot = {}
    for module in (linear_operator.settings, gpytorch.settings):
        for setting in vars(module).values():
            if isinstance(setting, type):
                for attribute in ("_global_value", "_default", "_state"):
                    if attribute in vars(setting):
                        snapshot[setting, attribute] = vars(setting)[attribute]
    return snapshot
