r""":class:`StochasticEPMarginalLogLikelihood`: SEP's energy on a minibatch, the objective of the SVGP-style loop of
:class:`~gpytorch_iterncgp.StochasticEPStrategy`."""

from __future__ import annotations

import math

import gpytorch
from torch import Tensor

from ..core.validation import check_count
from ..exceptions import NonFiniteEvidenceError
from ..sparse.stochastic import tilted
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
    Like ``VariationalELBO`` it is a pure function of the model's state and the output: it moves nothing. The site
    moves in :meth:`StochasticEPStrategy.update_site <gpytorch_iterncgp.StochasticEPStrategy.update_site>`, called
    after the optimiser's step (the loop in :mod:`~gpytorch_iterncgp.strategies.stochastic`).

    :param likelihood: the model's strategy's likelihood.
    :param model: an ``ApproximateGP`` whose ``variational_strategy`` is a :class:`~gpytorch_iterncgp.StochasticEPStrategy`.
    :param num_data: :math:`N`, the number of training points: the strategy's (``StochasticEPStrategy(...,
        num_data=N)``), which ``None`` takes; a number given must equal it.
    :raises TypeError: for another strategy.
    :raises ValueError: for another likelihood than the strategy's, or a ``num_data`` that is not the strategy's.
    """

    def __init__(self, likelihood, model, num_data: int | None = None):
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
        if num_data is not None:
            check_count(num_data, "num_data", minimum=1)
            if int(num_data) != strategy.num_data:
                raise ValueError(
                    f"{type(self).__name__}: num_data={num_data} differs from the model's StochasticEPStrategy's "
                    f"num_data={strategy.num_data}; N belongs to the strategy: leave num_data out or pass the same."
                )

    @property
    def num_data(self) -> int:
        """:math:`N`, the model's strategy's ``num_data``."""
        return self.model.variational_strategy.num_data

    def forward(self, function_dist, target: Tensor, **kwargs) -> Tensor:
        """The objective on the minibatch of ``function_dist = model(x_batch)`` (computed in training mode) and
        ``target`` ``(B,)``, at the cavities the output carries (:meth:`energy_and_moments`).

        :raises RuntimeError: if ``function_dist`` is not an output of ``model(x_batch)`` in training mode.
        :raises NonFiniteEvidenceError: if the objective is not finite.
        """
        return self.energy_and_moments(function_dist, target)[0]

    def energy_and_moments(self, function_dist, target: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
        r"""The objective (:meth:`forward`) and the tilted moments its quadrature computed at the output's cavities,
        :math:`\log\hat Z_i` ``(B,)`` (detached), the means and the variances ``(C, B)``
        (:func:`~gpytorch_iterncgp.sparse.stochastic.tilted`), which :meth:`StochasticEPStrategy.update_site
        <gpytorch_iterncgp.StochasticEPStrategy.update_site>` takes so as not to compute them again.

        :raises RuntimeError: if ``function_dist`` is not an output of ``model(x_batch)`` in training mode.
        :raises ValueError: for targets of another number of points than the output's, or invalid targets.
        :raises NonFiniteEvidenceError: if the objective is not finite.
        """
        strategy = self.model.variational_strategy
        cavities = strategy.training_cavities(function_dist, target)
        targets = strategy.adapter.check_targets(target, cavities.mean.dtype).to(cavities.mean.device)
        log_z, tilted_mean, tilted_variance = tilted(strategy.adapter, targets, cavities.mean, cavities.variance)
        objective = log_z.mean() + log_prior(self).to(log_z) / self.num_data
        if not math.isfinite(float(objective.detach())):
            raise NonFiniteEvidenceError(
                f"{type(self).__name__}: the objective is {float(objective.detach())} at the current hyperparameters; "
                "lower the learning rate or bound the hyperparameters with constraints."
            )
        return objective, (log_z.detach(), tilted_mean, tilted_variance)
