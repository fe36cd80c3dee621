r"""The model whose evidence :func:`~gpytorch_iterncgp.fit_mll` maximises: a view of the user's model on other rows, or
under Laplace's approximation, that shares the user's kernel, mean and their parameters, so what it learns is what the
final fit uses."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import gpytorch
from torch import Tensor

from ..likelihoods.multinomial_probit import MultinomialProbitLikelihood
from ..strategies.itergp import EPStrategy, IterNCGPStrategy

__all__ = ["LearnerModel", "laplace_likelihood"]


def laplace_likelihood(likelihood: gpytorch.likelihoods.Likelihood) -> gpytorch.likelihoods.Likelihood:
    """The likelihood Laplace learns EP's hyperparameters on: the softmax for the multinomial probit (both multi-class
    classifiers, one latent per class), the likelihood itself otherwise."""
    if isinstance(likelihood, MultinomialProbitLikelihood):
        return gpytorch.likelihoods.SoftmaxLikelihood(num_classes=likelihood.num_classes, mixing_weights=False)
    return likelihood


class LearnerModel(gpytorch.models.ApproximateGP):
    r"""``model``'s prior (its ``forward``: kernel, mean and their parameters, shared, not copied) on ``inputs`` and
    ``targets``, with its own strategy of ``strategy_type``.

    The strategy takes ``model``'s strategy's options where the two have the same fields (the step limit as a step
    limit: ``max_newton_steps`` and ``max_sweeps``), a copy of its policy, and ``likelihood``; for a model with a
    :class:`~gpytorch_iterncgp.StochasticEPStrategy` (which has no solver), the strategy's own defaults.

    :param model: the user's ``ApproximateGP`` with an :class:`~gpytorch_iterncgp.IterNCGPStrategy`, an
        :class:`~gpytorch_iterncgp.EPStrategy` or a :class:`~gpytorch_iterncgp.StochasticEPStrategy`.
    :param strategy_type: ``IterNCGPStrategy`` or ``EPStrategy``.
    :param inputs: ``(M, D)``; ``targets``: ``(M,)`` or ``(M, C)``; rows of the training data.
    :param likelihood: the learner's likelihood (:func:`laplace_likelihood` of the user's, or the user's).
    """

    def __init__(
        self,
        model: gpytorch.models.ApproximateGP,
        strategy_type: type[IterNCGPStrategy] | type[EPStrategy],
        inputs: Tensor,
        targets: Tensor,
        likelihood: gpytorch.likelihoods.Likelihood,
    ):
        source = model.variational_strategy
        options: dict[str, Any] = {}
        if isinstance(source, IterNCGPStrategy | EPStrategy):
            fields = {field.name for field in dataclasses.fields(strategy_type._options_type)}
            options = {name: getattr(source.options, name) for name in fields if hasattr(source.options, name)}
            options[strategy_type.max_steps_option] = getattr(source.options, source.max_steps_option)
            options["policy"] = copy.deepcopy(source.policy)
        strategy = strategy_type(self, inputs, targets, likelihood, show_progress=False, **options)
        super().__init__(strategy)
        self.prior_model = model

    def forward(self, x: Tensor, **kwargs: Any) -> Any:
        return self.prior_model.forward(x, **kwargs)
