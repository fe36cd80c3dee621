r""":class:`StochasticEPMarginalLogLikelihood`: SEP's energy on a minibatch, the objective of the SVGP-style loop of
:class:`~gpytorch_iterncgp.StochasticEPStrategy`."""

from __future__ import annotations

import math

import gpytorch
from torch import Tensor

from ..core.validation import check_count
from ..exceptions import NonFiniteEvidenceError
from ..sparse.stochastic import SEPStepRecord, tilted
from ..strategies.stochastic import StochasticEPStrategy
from .itergp import log_prior


class StochasticEPMarginalLogLikelihood(gpytorch.mlls.MarginalLogLikelihood):
    r"""SEP's approximate log marginal likelihood per data point, estimated on a minibatch :math:`\mathcal B`
    (:mod:`~gpytorch_iterncgp.sparse.stochastic`): at the points' cavities that ``model(x_batch)`` returned in
    training mode,

    .. math::
        \frac{1}{|\mathcal B|}\sum_{i \in \mathcal B}\log\hat Z_i + \frac{1}{N}\sum_j \log p(\theta_j),

    the terms of :math:`\frac1N \log Z_{\text{SEP}}` that depend on the hyperparameters and the inducing inputs (with
    the site held fixed in the whitened coordinates), plus the log priors registered on the model and likelihood,
    divided by :math:`N` as GPyTorch's ``VariationalELBO`` does. Its minibatch estimate is unbiased for the full data.
    In training mode each call also moves the site on the batch (SEP's step from the same cavities, so that the model
    is evaluated once per minibatch); in eval mode the site is not moved.

    :param likelihood: the model's strategy's likelihood.
    :param model: an ``ApproximateGP`` whose ``variational_strategy`` is a :class:`~gpytorch_iterncgp.StochasticEPStrategy`.
    :param num_data: :math:`N`, the number of training points.
    :raises TypeError: for another strategy.
    :raises ValueError: for another likelihood than the strategy's, or a ``num_data`` that is not a positive integer.
    """

    def __init__(self, likelihood, model, num_data: int):
        super().__init__(likelihood, model)
        strategy = getattr(model, "variational_strategy", None)
        if not isinstance(strategy, StochasticEPStrategy):
            raise TypeError(
                f"{type(self).__name__} needs a model whose variational_strategy is a StochasticEPStrategy."
            )
        if strategy.likelihood is not likelihood:
            raise ValueError(
                f"{type(self).__name__}: likelihood must be the one the model's StochasticEPStrategy uses."
            )
        check_count(num_data, "num_data", minimum=1)
        self.num_data = int(num_data)
        strategy.num_data = self.num_data  # the N the site stands for: the training outputs become the cavities
        self.last_step: SEPStepRecord | None = None

    def forward(self, function_dist, target: Tensor, **kwargs) -> Tensor:
        """The objective on the minibatch of ``function_dist = model(x_batch)`` (computed in training mode) and
        ``target`` ``(B,)`` at the cavities the output holds; in training mode also moves the site from them.

        :raises RuntimeError: if ``function_dist`` is not the model's last output in training mode.
        :raises NonFiniteEvidenceError: if the objective is not finite.
        """
        strategy = self.model.variational_strategy
        batch, cavity = strategy.training_batch(function_dist)
        targets = strategy.adapter.check_targets(target, batch.mean.dtype).to(batch.mean.device)
        log_z, tilted_mean, tilted_variance = tilted(strategy.adapter, targets, *cavity)
        if self.training:  # the step takes its moments from the energy's quadrature
            self.last_step = strategy.step(function_dist, targets, (log_z.detach(), tilted_mean, tilted_variance))
        objective = log_z.mean() + log_prior(self).to(log_z) / self.num_data
        if not math.isfinite(float(objective.detach())):
            raise NonFiniteEvidenceError(
                f"{type(self).__name__}: the objective is {float(objective.detach())} at the current hyperparameters; "
                "lower the learning rate or bound the hyperparameters with constraints."
            )
        return objective
