"""Small random problems for the property-based and robustness tests, and independent checks of a fit.

A :class:`Problem` fixes everything about one test problem (likelihood, sizes, dtype, hyperparameters, data
seed); the helpers compute what a fit should satisfy from a dense float64 kernel and the independent
likelihood code of ``tests/reference.py`` (nothing here calls the package's own likelihood adapters).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import gpytorch
import torch

from gpytorch_iterncgp import ExpPoissonLikelihood, LogitBernoulliLikelihood
from tests import reference
from tests.common import IterNCGPModel, binary_data, multiclass_data, softmax_likelihood

# Reference name (tests/reference.py) -> likelihood factory, for C = 1.
SINGLE_LATENT = {
    "probit": gpytorch.likelihoods.BernoulliLikelihood,
    "logit": LogitBernoulliLikelihood,
    "poisson_exp": ExpPoissonLikelihood,
    "poisson_softplus": gpytorch.likelihoods.PoissonLikelihood,
}


def count_data(num_data: int, dim: int = 1, dtype=torch.float64, seed: int = 0, scale: float = 2.0):
    """Inputs in [0, 1]^dim and Poisson counts with rate exp(scale * sin(8 x_0))."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(num_data, dim, generator=generator, dtype=torch.float64)
    y = torch.poisson(torch.exp(scale * torch.sin(8 * x[:, 0])), generator=generator)
    return x.to(dtype), y.to(dtype)


@dataclass(frozen=True)
class Problem:
    """One small problem: ``likelihood`` is a reference name, ``num_classes`` > 1 only for ``"softmax"``."""

    likelihood: str
    num_classes: int = 1
    num_data: int = 20
    dim: int = 1
    dtype: torch.dtype = torch.float64
    seed: int = 0
    lengthscale: float = 0.3
    outputscale: float = 2.0
    independent: bool = False  # softmax: one GP per class (batch_shape [C]) instead of one shared kernel

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, drawn in float64 and then cast: the float32 problem is the float64 one, rounded."""
        if self.likelihood in ("probit", "logit"):
            x, y = binary_data(self.num_data, self.dim, torch.float64, self.seed)
            return x.to(self.dtype), y.to(self.dtype)
        if self.likelihood.startswith("poisson"):
            x, y = count_data(self.num_data, self.dim, torch.float64, self.seed)
            return x.to(self.dtype), y.to(self.dtype)
        x, y = multiclass_data(self.num_data, self.num_classes, self.dim, torch.float64, self.seed)
        return x.to(self.dtype), y

    def make_likelihood(self):
        if self.likelihood == "softmax":
            return softmax_likelihood(self.num_classes)
        return SINGLE_LATENT[self.likelihood]()

    def model(self, x=None, y=None, **options) -> IterNCGPModel:
        if x is None:
            x, y = self.data()
        return IterNCGPModel(
            x,
            y,
            self.make_likelihood(),
            lengthscale=self.lengthscale,
            outputscale=self.outputscale,
            batch_classes=self.num_classes if self.independent else None,
            **options,
        )

    def test_inputs(self, num: int = 7) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed + 1)
        return (1.4 * torch.rand(num, self.dim, generator=generator, dtype=torch.float64) - 0.2).to(self.dtype)


def dense_prior(model, x) -> tuple[torch.Tensor, torch.Tensor]:
    """Prior covariance ``(N C, N C)`` and mean ``(N C,)`` at ``x``, data-major, in float64 (from GPyTorch).

    Symmetrised: a float32 kernel matrix is symmetric only up to rounding, which stalls the reference's
    damped Newton iteration.
    """
    num_classes = model.variational_strategy.num_latents
    with torch.no_grad():
        prior = model.forward(x)
        kernel, mean = prior.covariance_matrix.double(), prior.mean.double()
    kernel = (kernel + kernel.mT) / 2  # a float32 kernel matrix is symmetric only up to rounding
    if kernel.dim() == 3:  # one GP per class
        return reference.data_major(kernel), mean.mT.reshape(-1)
    return reference.data_major(kernel, num_classes), mean[:, None].expand(-1, num_classes).reshape(-1)


def exact_mode(model, problem: Problem, x, y) -> reference.LaplaceReference:
    """The exact Laplace mode of the model's (float64-cast) kernel by the dense reference Newton iteration."""
    kernel, mean = dense_prior(model, x)
    return reference.laplace_mode(kernel, mean, y.double(), problem.likelihood, problem.num_classes, max_steps=500)


def log_posterior(problem: Problem, model, x, y) -> tuple[float, float, float]:
    r"""Independent :math:`\Psi` at the strategy's mode and at the prior mean, and :math:`\max|\mathbf m + \mathbf K \mathbf a - \hat{\mathbf f}|`.

    :math:`\Psi(\mathbf f) = \log p(\mathbf y \mid \mathbf f) - \tfrac12 \mathbf a^\top \mathbf K \mathbf a`, from a
    dense float64 :math:`\mathbf K` and the reference likelihood, with the strategy's representer weights
    :math:`\mathbf a`.
    """
    strategy = model.variational_strategy
    kernel, mean = dense_prior(model, x)
    weights = strategy.state.representer_weights.detach().double()
    latent = mean + kernel @ weights
    mode = strategy.mode.detach().double().reshape(-1)
    targets = y.double()
    psi = float(reference.log_likelihood(latent, targets, problem.likelihood, problem.num_classes)) - 0.5 * float(
        weights @ kernel @ weights
    )
    psi_prior = float(reference.log_likelihood(mean, targets, problem.likelihood, problem.num_classes))
    return psi, psi_prior, float((latent - mode).abs().max())


def data_major_prior_variance(model, inputs) -> torch.Tensor:
    """The prior variance at ``inputs``, data-major ``(N* C,)``, straight from the model's forward."""
    num_classes = model.variational_strategy.num_latents
    with torch.no_grad():
        variance = model.forward(inputs).variance
    if variance.dim() == 2:  # (C, N*)
        return variance.mT.reshape(-1)
    return variance[:, None].expand(-1, num_classes).reshape(-1)


def posterior_variance_unclamped(model, inputs) -> torch.Tensor:
    """diag(K_** - K_*X Q Q^T K_X*), data-major ``(N* C,)``, before any clamping (from the eval-mode posterior)."""
    model.eval()
    try:
        with torch.no_grad():
            posterior = model(inputs)
            return posterior.lazy_covariance_matrix.diagonal(dim1=-2, dim2=-1).reshape(-1)
    finally:
        model.train()


def fit_recording_warnings(strategy, **options):
    """``strategy.fit(**options)`` and the warnings it raised (deprecation warnings of GPyTorch left out)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", DeprecationWarning)
        report = strategy.fit(**options)
    return report, [w for w in caught if not issubclass(w.category, DeprecationWarning)]


def all_finite(*values) -> bool:
    """Tensors and floats all finite."""
    for value in values:
        if torch.is_tensor(value):
            if not bool(torch.isfinite(value).all()):
                return False
        elif not math.isfinite(value):
            return False
    return True
