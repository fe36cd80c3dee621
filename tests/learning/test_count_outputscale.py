"""Count models' outputscale by the held-out Poisson deviance, the prior mean rate kept, and the warning that names the
negative binomial likelihood where a Poisson model predicts held-out rows worse than their mean."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from gpytorch_iterncgp import (
    ExpPoissonLikelihood,
    LaplaceMarginalLogLikelihood,
    LearningRecipe,
    NegativeBinomialLikelihood,
    WorseThanConstantWarning,
    fit_mll,
)
from gpytorch_iterncgp.learning import outputscale
from tests.common import IterNCGPModel


def overdispersed_counts(num_rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Negative binomial counts (dispersion 1.5: variance :math:`\\mu + \\mu^2 / 1.5`) around a smooth log rate of
    three uniform features, one of them irrelevant."""
    generator = np.random.default_rng(seed)
    x = generator.uniform(-2, 2, size=(num_rows, 3))
    rate = np.exp(1.0 + 0.8 * np.sin(1.5 * x[:, 0]) + 0.3 * x[:, 1])
    return x, generator.negative_binomial(1.5, 1.5 / (1.5 + rate)).astype(float)


def _fitted(likelihood, recipe: LearningRecipe, seed: int = 3):
    x, y = (torch.as_tensor(array) for array in overdispersed_counts(300, seed))
    model = IterNCGPModel(x, y, likelihood, kernel="matern", lengthscale=1.0, constant_mean=math.log(y.mean()))
    mll = LaplaceMarginalLogLikelihood(model.variational_strategy.likelihood, model)
    return fit_mll(mll, learning_subset=200, seed=0, recipe=recipe), model


def test_a_count_model_walks_its_outputscale_by_the_held_out_deviance_keeping_the_prior_mean_rate():
    """Learnt on 200 of 300 overdispersed counts, a Poisson model's outputscale is chosen by the mean Poisson deviance
    of the 100 held-out rows; with each factor a of the outputscale s² the constant mean m moves to m + (1 - a) s² / 2,
    so the prior mean rate e^{m + s²/2} is the learnt one whatever the factor: equal to that of the same learning with
    a one-factor walk (the learnt outputscale), to rounding."""
    recipe = LearningRecipe(optimizer_steps=20)
    report, model = _fitted(ExpPoissonLikelihood(), recipe)
    one_factor = LearningRecipe(optimizer_steps=20, outputscale_factors=(1.0,), outputscale_extensions=0)
    alone, learnt = _fitted(ExpPoissonLikelihood(), one_factor)
    assert report.held_out_metric == alone.held_out_metric == "Poisson deviance"
    scores = report.outputscale_scores
    assert len(scores) >= 2 and report.outputscale_factor == min(scores, key=scores.__getitem__)
    assert scores[1.0] == pytest.approx(alone.outputscale_scores[1.0], rel=1e-10)  # the same learning, the same fit
    assert report.held_out_score == scores[report.outputscale_factor] <= scores[1.0]
    factor = report.outputscale_factor
    assert factor != 1.0 and list(alone.outputscale_scores) == [1.0]  # (measured: 1/8 of the learnt outputscale)
    chosen, original = (module.covar_module.outputscale.item() for module in (model, learnt))
    assert chosen == pytest.approx(factor * original, rel=1e-12)
    mean = [module.mean_module.constant.item() for module in (model, learnt)]
    assert mean[0] + chosen / 2 == pytest.approx(mean[1] + original / 2, rel=1e-12)


@pytest.mark.parametrize("likelihood", [ExpPoissonLikelihood, NegativeBinomialLikelihood])
def test_a_poisson_model_worse_than_the_mean_count_names_the_negative_binomial(monkeypatch, likelihood):
    """Where the held-out deviance is above the mean count's, the ``WorseThanConstantWarning`` of a Poisson model
    names the negative binomial likelihood (overdispersion); a negative binomial model's does not."""
    monkeypatch.setattr(outputscale, "held_out_score", lambda *args: 1e3)  # every factor scores worse than the mean
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report, _ = _fitted(likelihood(), LearningRecipe(optimizer_steps=2))
    messages = [str(warning.message) for warning in caught if warning.category is WorseThanConstantWarning]
    assert len(messages) == 1 and report.held_out_score == 1e3 > report.constant_score
    assert ("NegativeBinomialLikelihood" in messages[0]) == (likelihood is ExpPoissonLikelihood)


def test_the_poisson_regressor_on_overdispersed_counts_predicts_new_rows_better_than_their_mean():
    """400 training rows of overdispersed counts, 300 of them learnt on: the Poisson regressor's test deviance (sklearn's
    ``mean_poisson_deviance``, 200 new rows) is below the training mean's (measured 3.925 against 4.045; 4.079 before
    the outputscale walk of count models, worse than the mean)."""
    from sklearn.metrics import mean_poisson_deviance

    from gpytorch_iterncgp.sklearn import IterNCGPPoissonRegressor

    x, y = overdispersed_counts(600, seed=1)
    regressor = IterNCGPPoissonRegressor(kernel=None, learning_subset=300, random_state=0).fit(x[:400], y[:400])
    assert regressor.learning_report_.outputscale_scores
    deviance = mean_poisson_deviance(y[400:], regressor.predict(x[400:]))
    assert deviance < mean_poisson_deviance(y[400:], np.full(200, y[:400].mean()))
