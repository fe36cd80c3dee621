r"""The predictive distribution of the observations from the posterior of the latents, for any strategy whose
posterior gives per-point latent marginals: :class:`LatentPredictions`, and :class:`PredictiveStrategy` for the
strategies that fit by an outer loop."""

from __future__ import annotations

import abc
import warnings
from typing import Any

import torch
from gpytorch.utils.warnings import NumericalWarning
from torch import Tensor

from ..core.validation import check_inputs
from .base import OuterLoopStrategy


def warn_lost_variance(variance: Tensor, prior_variance: Tensor) -> None:
    r"""Warn where a posterior variance :math:`k(x, x) - (\dots)` is below ``100 eps`` of the prior variance: there it
    is dominated by rounding (cancellation), e.g. float32 with an outputscale of 1e8.

    :param variance: the posterior variances, unclamped, any shape.
    :param prior_variance: the prior variances, of the same shape.
    """
    lost = variance < 100 * torch.finfo(variance.dtype).eps * prior_variance
    if bool(lost.any()):
        warnings.warn(
            f"IterNCGP: the posterior variance of {int(lost.sum())} latent value(s) is below 100 eps of the prior "
            f"variance (up to {float(prior_variance[lost].max()):.3g}) and dominated by rounding in K - K C K "
            f"({variance.dtype}); use float64 or a smaller outputscale for accurate variances there.",
            NumericalWarning,
            stacklevel=3,
        )


class LatentPredictions:
    r"""The predictive of the observations from the posterior marginals of the latents at test points, for a
    strategy with an ``adapter`` (:func:`~gpytorch_iterncgp.likelihoods.adapters.likelihood_adapter`) and
    ``num_latents``.

    A subclass defines :meth:`marginal_latent` (means and variances ``(N*, C)``) and :meth:`marginal_latent_blocks`
    (means ``(N*, C)`` and each point's :math:`C \times C` covariance ``(N*, C, C)``).
    """

    adapter: Any

    @property
    def num_latents(self) -> int:
        """:math:`C`, the number of latent functions (1 for binary and count data)."""
        return self.adapter.num_latents

    @abc.abstractmethod
    def marginal_latent(self, inputs: Tensor) -> tuple[Tensor, Tensor]:
        """Posterior means and variances of the latents at ``inputs`` ``(N*, D)``, ``(N*, C)`` each."""

    @abc.abstractmethod
    def marginal_latent_blocks(self, inputs: Tensor) -> tuple[Tensor, Tensor]:
        """Posterior means ``(N*, C)`` and each test point's latent covariance ``(N*, C, C)``."""

    def predictive_mean(self, inputs: Tensor) -> Tensor:
        r""":math:`\mathbb E[y_*]`: class probabilities (``(N*,)`` for :math:`p(y=1)`, ``(N*, C)`` for softmax) or
        expected counts ``(N*,)``, from the posterior of the latents at each test point.

        * Probit link: exact, :math:`\Phi(\mu / \sqrt{1 + \sigma^2})`.
        * Logit link: :math:`\mathbb E[\sigma(f)]` by quadrature to about 1e-13
          (:func:`~gpytorch_iterncgp.likelihoods.adapters.logistic_gaussian`).
        * Softmax: :math:`\mathbb E[\operatorname{softmax}(\mathbf f)]` by Monte Carlo with fixed base samples
          (deterministic; :func:`~gpytorch_iterncgp.likelihoods.adapters.softmax_gaussian`, ``settings.softmax_samples``)
          under each point's full :math:`C \times C` covariance (:meth:`marginal_latent_blocks`), not the
          per-class marginals: with a kernel shared by the classes most of the posterior variance is common to
          all classes and leaves the softmax unchanged.
        * Poisson: :math:`e^{\mu + \sigma^2/2}` (exp link) or Gauss–Hermite quadrature (softplus link).

        The latent posterior includes IterNCGP's computational uncertainty. Each rule is the exact predictive of the
        posterior the strategy holds (softmax: to Monte Carlo error). With a softmax Laplace posterior, whose
        variance stays near the prior's where :math:`\mathbf W \to 0` (confidently classified points), the probit
        approximation :math:`\operatorname{softmax}(\boldsymbol\mu / \sqrt{1 + \pi\boldsymbol\sigma^2/8})` can
        score a lower test NLL by under-counting that variance; it is not the posterior's predictive and is not used
        (``benchmarks/predictive_rule.py``, ``benchmarks/results/predictive_rule.json``).
        """
        if self.adapter.predictive_needs_blocks:
            return self.adapter.predictive_mean(*self.marginal_latent_blocks(inputs))
        mean, variance = self.marginal_latent(inputs)
        if self.num_latents == 1:
            return self.adapter.predictive_mean(mean[:, 0], variance[:, 0])
        return self.adapter.predictive_mean(mean, variance)

    def predictive_probabilities(self, inputs: Tensor) -> Tensor:
        """Class probabilities at ``inputs`` (see :meth:`predictive_mean`); classification likelihoods only.

        :raises TypeError: for a likelihood that is not a classifier's.
        """
        if not self.adapter.classification:
            raise TypeError(f"predictive_probabilities needs a classification likelihood, not {self.adapter.name}.")
        return self.predictive_mean(inputs)


class PredictiveStrategy(LatentPredictions, OuterLoopStrategy):
    r"""An :class:`~gpytorch_iterncgp.strategies.base.OuterLoopStrategy` whose posterior gives the latents' marginals at
    test points (:class:`LatentPredictions`), with its test inputs checked against the training inputs."""

    def _check_test_inputs(self, inputs: Tensor) -> Tensor:
        """``inputs`` ``(N*, D)`` checked against the training inputs (features, dtype, device).

        :raises ValueError: for another number of features, or a model on another device.
        :raises TypeError: for another dtype.
        """
        inputs = check_inputs(inputs, "inputs", device=self.train_inputs.device)
        if inputs.shape[-1] != self.train_inputs.shape[-1]:
            raise ValueError(
                f"inputs have {inputs.shape[-1]} features but the training inputs have {self.train_inputs.shape[-1]}."
            )
        if inputs.dtype != self.train_inputs.dtype:
            raise TypeError(f"inputs are {inputs.dtype} but the model's training data {self.train_inputs.dtype}.")
        self._check_model_device()
        return inputs
