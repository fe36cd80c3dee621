r"""The held-out scores :func:`~gpytorch_iterncgp.fit_mll` chooses by (a kernel among candidates, the outputscale, the
check against a constant predictor): a classifier's log-loss, a count model's mean Poisson deviance, both lower the
better, each of a cold fit at the held-out rows.
"""

from __future__ import annotations

from typing import Any

import gpytorch
import torch
from gpytorch.likelihoods import PoissonLikelihood
from torch import Tensor

from ..likelihoods.adapters import ExpPoissonLikelihood, MultitaskPoissonLikelihood, likelihood_adapter
from ..likelihoods.negative_binomial import NegativeBinomialLikelihood

__all__ = [
    "log_rate",
    "has_held_out_score",
    "held_out_metric",
    "held_out_score",
    "held_out_unavailable",
    "log_loss",
    "poisson_deviance",
]


def log_loss(probabilities: Tensor, labels: Tensor) -> float:
    r"""The mean negative log probability of ``labels`` ``(V,)`` (class indices) under ``probabilities``: ``(V,)``
    of class 1 (binary) or ``(V, C)``; each clipped at the dtype's machine epsilon, as scikit-learn's ``log_loss``."""
    if probabilities.dim() == 1:
        probabilities = torch.stack([1 - probabilities, probabilities], dim=-1)
    chosen = probabilities.gather(-1, labels.long()[:, None])[:, 0]
    return float(-chosen.clamp_min(torch.finfo(chosen.dtype).eps).log().mean())


def held_out_score(model: gpytorch.models.ApproximateGP, inputs: Tensor, targets: Tensor, fit_steps: int) -> float:
    """The held-out score of ``model`` (fitted here, cold, with at most ``fit_steps`` Newton steps or EP sweeps, as
    the outputscale phase's candidates): the log-loss (:func:`log_loss`) of a classifier's predictive
    probabilities, the mean Poisson deviance (:func:`poisson_deviance`) of the expected counts of a Poisson likelihood.

    :param inputs: the held-out rows' inputs ``(V, D)``; ``targets``: their labels or counts ``(V,)`` (or ``(V, C)``).
    :raises TypeError: for another likelihood (no held-out score: choose by ``select_by="bic"``).
    """
    strategy = model.variational_strategy
    counts = _count_adapter(strategy.likelihood)
    if not (strategy.adapter.classification or counts is not None):
        raise TypeError(held_out_unavailable(strategy.likelihood))
    model.eval()
    with torch.no_grad():
        strategy.fit(show_progress=False, limit_warning=False, **{strategy.max_steps_option: fit_steps})
        if counts is None:
            return log_loss(strategy.predictive_probabilities(inputs), targets)
        mean, variance = strategy.marginal_latent(inputs)
        if strategy.num_latents == 1:
            mean, variance = mean[:, 0], variance[:, 0]
        return poisson_deviance(counts.predictive_mean(mean, variance), targets)


def has_held_out_score(likelihood: gpytorch.likelihoods.Likelihood) -> bool:
    """Whether :func:`held_out_score` scores ``likelihood``'s models: classifiers and Poisson likelihoods."""
    return likelihood_adapter(likelihood).classification or _count_adapter(likelihood) is not None


def held_out_metric(likelihood: gpytorch.likelihoods.Likelihood) -> str:
    """The name of :func:`held_out_score`'s score for ``likelihood``'s models: ``"log-loss"`` or ``"Poisson deviance"``."""
    return "log-loss" if likelihood_adapter(likelihood).classification else "Poisson deviance"


def log_rate(likelihood: gpytorch.likelihoods.Likelihood) -> bool:
    r"""Whether ``likelihood`` is one of counts whose latent :math:`f` is a log rate (exp link: the Poisson's and its
    quasi-likelihood's, the negative binomial's), one output."""
    return isinstance(likelihood, ExpPoissonLikelihood | NegativeBinomialLikelihood)


def held_out_unavailable(likelihood: gpytorch.likelihoods.Likelihood) -> str:
    """Why a ``likelihood`` has no held-out score, and what to use instead."""
    return (
        f"fit_mll: the held-out score is the log-loss of a classifier or the Poisson deviance of counts; "
        f"{type(likelihood).__name__} has neither: choose the kernel by select_by='bic' (or 'evidence')."
    )


def _count_adapter(likelihood: gpytorch.likelihoods.Likelihood) -> Any:
    """The closed-form adapter whose ``predictive_mean`` is a Poisson likelihood's :math:`\\mathbb E[y_*]` (the
    quasi-likelihoods of non-integer targets and the negative binomial, of the same mean, included), or ``None`` for
    another likelihood."""
    if isinstance(likelihood, MultitaskPoissonLikelihood):
        return likelihood_adapter(likelihood)
    if isinstance(likelihood, ExpPoissonLikelihood | NegativeBinomialLikelihood):  # the same E[y*] = E[e^f]
        return likelihood_adapter(ExpPoissonLikelihood())
    if isinstance(likelihood, PoissonLikelihood):
        return likelihood_adapter(PoissonLikelihood())
    return None


def poisson_deviance(expected: Tensor, counts: Tensor) -> float:
    r"""The mean Poisson deviance :math:`\frac 1 V \sum_i 2 (y_i \log(y_i / \mu_i) - y_i + \mu_i)` of the expected
    counts ``expected`` :math:`\mu` at the observed ``counts`` :math:`y` (same shape; missing counts, NaN, skipped), as
    scikit-learn's ``mean_poisson_deviance``; :math:`\mu` clipped at the dtype's machine epsilon."""
    observed = torch.isfinite(counts)
    y, mu = counts[observed], expected[observed].clamp_min(torch.finfo(expected.dtype).eps)
    return float((2 * (torch.special.xlogy(y, y) - y * mu.log() - y + mu)).mean())
