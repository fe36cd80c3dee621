r"""The learnt model against a constant predictor on the held-out rows: the check that a fit which interpolates its
learning rows but predicts others worse than knowing nothing about the inputs is never kept unseen.

The constant predictor ignores the inputs: a classifier's is the class frequencies of the learning rows (its
log-loss is their cross-entropy with the held-out labels), a count model's the mean count of the learning rows (its
mean Poisson deviance at the held-out counts). A GP whose held-out score is worse than that has learnt
hyperparameters that do not generalise (for example a lengthscale far below the spread of the features, with the
outputscale that makes the learning rows certain).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import gpytorch
import torch
from torch import Tensor

from ..exceptions import WorseThanConstantWarning
from ..likelihoods.adapters import likelihood_adapter
from ..likelihoods.negative_binomial import NegativeBinomialLikelihood
from .recipe import RECOVERABLE_ERRORS, LearningReport
from .scores import held_out_metric, held_out_score, log_loss, poisson_deviance

__all__ = ["check_against_constant", "constant_score"]


def constant_score(learning_targets: Tensor, held_out_targets: Tensor, classification: bool) -> float:
    r"""The held-out score of the constant predictor of ``learning_targets``: for a classifier (class indices
    ``(M,)``), the log-loss of the held-out labels under the learning rows' class frequencies :math:`\hat p_c`,
    :math:`-\frac1V \sum_i \log \hat p_{y_i}`; for counts (``(M,)`` or ``(M, C)``, NaN: missing), the mean Poisson
    deviance of the held-out counts at the learning rows' mean count (per output).

    :param held_out_targets: the held-out rows' labels or counts, ``(V,)`` or ``(V, C)``.
    """
    if classification:
        labels = learning_targets.long()
        num_classes = int(max(labels.max(), held_out_targets.long().max())) + 1
        frequencies = torch.bincount(labels, minlength=num_classes).to(learning_targets.dtype) / len(labels)
        return log_loss(frequencies.expand(len(held_out_targets), num_classes), held_out_targets)
    mean = learning_targets.nanmean(0)
    return poisson_deviance(mean.expand_as(held_out_targets), held_out_targets)


def check_against_constant(
    report: LearningReport,
    build: Callable[[], gpytorch.models.ApproximateGP],
    learning_targets: Tensor,
    validation: tuple[Tensor, Tensor],
    fit_steps: int,
    likelihood: gpytorch.likelihoods.Likelihood,
) -> None:
    r"""Score the learnt model and the constant predictor (:func:`constant_score`) on the held-out rows and warn with
    a :class:`~gpytorch_iterncgp.WorseThanConstantWarning` where the model is the worse; fills ``report``'s
    ``held_out_score``, ``constant_score`` and ``held_out_metric``.

    The model's score is the outputscale phase's at the chosen factor where it ran (a fit of the final approximation
    on the learning rows at these hyperparameters), otherwise that of such a fit, cold, with ``fit_steps`` Newton
    steps or EP sweeps (:func:`~.scores.held_out_score`, whose likelihood must have a held-out score). A fit
    that fails numerically leaves the scores ``None``. No model is built where the outputscale phase's score serves.

    :param build: a new model of the final approximation on the learning rows, sharing the learnt kernel.
    :param learning_targets: the learning rows' labels or counts; ``validation``: the held-out rows' inputs and
        targets.
    :param likelihood: the model's likelihood (a classifier's, or one of counts: with a Poisson likelihood the warning
        names the negative binomial one).
    """
    classification = likelihood_adapter(likelihood).classification
    report.held_out_metric = held_out_metric(likelihood)
    factor = report.outputscale_factor
    if factor in report.outputscale_scores:
        score = report.outputscale_scores[factor]
    else:
        try:
            score = held_out_score(build(), *validation, fit_steps)
        except RECOVERABLE_ERRORS:
            return
    constant = constant_score(learning_targets, validation[1], classification)
    report.held_out_score, report.constant_score = score, constant
    if score > constant:
        overdispersion = (
            ""
            if classification or isinstance(likelihood, NegativeBinomialLikelihood)
            else " Counts that vary more than a Poisson's mean allows (overdispersion) make the Poisson evidence learn "
            "a rough function: model them with NegativeBinomialLikelihood (IterNCGPNegativeBinomialRegressor)."
        )
        warnings.warn(
            f"fit_mll: the learnt model's held-out {report.held_out_metric} is {score:.4g} on {len(validation[1])} "
            f"rows, worse than a constant predictor's {constant:.4g} (the learning rows' "
            f"{'class frequencies' if classification else 'mean count'}): the hyperparameters fit the learning rows "
            "but do not predict others. Check the features' scaling (standardise them), try another kernel (a longer "
            "lengthscale, a linear part) or a simpler model; the scores are in the report's held_out_score and "
            f"constant_score.{overdispersion}",
            WorseThanConstantWarning,
            stacklevel=5,  # the line that called fit_mll
        )
