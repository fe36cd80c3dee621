"""The estimators' subset-of-data hyperparameter learning (``learning_subset``): the kernel is learnt on a stratified
random subset of the rows, then the posterior is fitted on all of them at that kernel."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn", minversion="1.7")

from gpytorch_iterncgp.integrations.sklearn import IterNCGPClassifier, IterNCGPPoissonRegressor  # noqa: E402
from gpytorch_iterncgp.learning import rows as learning_rows  # noqa: E402


def _classes(num=150, seed=0, shares=(0.5, 0.3, 0.2)):
    """Three unequal classes in 2-D: labels drawn by ``shares``, inputs around one centre per class."""
    rng = np.random.RandomState(seed)
    y = rng.choice(len(shares), size=num, p=shares)
    x = rng.normal(size=(num, 2)) + 1.5 * np.array([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0]])[y]
    return x, y


def _kernel_values(estimator) -> list[torch.Tensor]:
    return [p.detach() for p in estimator.kernel_.parameters()]


@pytest.mark.parametrize("inference", ["laplace", "ep"])
def test_subset_learning_learns_what_a_fit_on_the_subset_learns(inference):
    """Learning on ``learning_rows_`` maximises the evidence of those rows alone: the learnt kernel equals the one an
    estimator fitted on exactly those rows learns (the exact-regime evidence is deterministic: L-BFGS takes the same
    steps), while the final posterior holds all the rows."""
    x, y = _classes(num=120)
    y = (y > 0).astype(int)  # binary: the learner on 60 points (Laplace's, for EP too) is in the exact regime
    options = dict(inference=inference, optimizer_steps=8, random_state=4, standardize=False)  # the same features
    subset = IterNCGPClassifier(learning_subset=60, **options).fit(x, y)
    rows = subset.learning_rows_
    assert len(rows) == 60 and len(np.unique(rows)) == 60
    alone = IterNCGPClassifier(learning_subset=None, **options)
    alone.fit(x[rows], y[rows])
    assert alone.learning_rows_ is None
    for ours, reference in zip(_kernel_values(subset), _kernel_values(alone), strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(subset.loss_curve_, alone.loss_curve_, rtol=1e-8)
    assert subset.learning_report_.evidence == "Laplace"  # (EP's kernel too: LearningRecipe.evidence)
    assert subset.model_.variational_strategy.num_data == 120
    assert "of 60 of the 120 points" in str(subset.learning_report_)
    # the learnt kernel moved from the initial one, and the final fit is the posterior at it on all the data
    fixed = IterNCGPClassifier(inference=inference, kernel=subset.kernel_, optimizer_steps=0).fit(x, y)
    np.testing.assert_allclose(subset.predict_proba(x), fixed.predict_proba(x), rtol=1e-6, atol=1e-9)


def test_subset_is_stratified_and_auto_size_follows_the_latent_budget(monkeypatch):
    """``"auto"`` takes ``isqrt(LEARNING_SUBSET_COST // C)`` points (C classes); every class keeps its share of them (to
    rounding), and the draw follows ``random_state``."""
    monkeypatch.setattr(learning_rows, "LEARNING_SUBSET_COST", 3 * 40**2 + 5)
    x, y = _classes(num=90, seed=1)
    first = IterNCGPClassifier(inference="laplace", optimizer_steps=1, random_state=0).fit(x, y)
    rows = first.learning_rows_
    assert len(rows) == 40 and np.all(np.diff(rows) > 0)
    expected = 40 * np.bincount(y) / len(y)
    assert np.all(np.abs(np.bincount(y[rows], minlength=3) - expected) <= 1)
    again = IterNCGPClassifier(inference="laplace", optimizer_steps=1, random_state=0).fit(x, y)
    other = IterNCGPClassifier(inference="laplace", optimizer_steps=1, random_state=1).fit(x, y)
    np.testing.assert_array_equal(again.learning_rows_, rows)
    assert not np.array_equal(other.learning_rows_, rows)
    # binary data (C = 1): the same cost of a product buys sqrt(3) times as many points
    binary = IterNCGPClassifier(inference="laplace", optimizer_steps=1, random_state=0).fit(x, y > 0)
    assert len(binary.learning_rows_) == math.isqrt(3 * 40**2 + 5) == 69
    # a subset as large as the data, or no learning: all the rows, no subset
    small = IterNCGPClassifier(inference="laplace", optimizer_steps=1, learning_subset=90).fit(x, y)
    fixed = IterNCGPClassifier(optimizer_steps=0).fit(x, y)
    assert small.learning_rows_ is None and fixed.learning_rows_ is None
    assert small.learning_report_.data_points == small.learning_report_.num_data == 90


def test_regressor_learns_on_a_random_subset():
    """The Poisson regressor draws its subset unstratified; its kernel and constant mean are learnt there (the same
    optimum of the subset's evidence as a fit on those rows alone reaches; the starting mean differs, the mean count
    of all the rows or of the subset's), and the posterior is fitted on all the rows."""
    rng = np.random.RandomState(2)
    x = rng.uniform(0, 3, size=(80, 1))
    y = rng.poisson(np.exp(1 + np.sin(2 * x[:, 0])))
    options = dict(optimizer_steps=100, random_state=0, standardize=False)  # the same features in both fits
    subset = IterNCGPPoissonRegressor(learning_subset=40, **options).fit(x, y)
    rows = subset.learning_rows_
    assert subset.learning_report_.stopped == "converged"
    alone = IterNCGPPoissonRegressor(learning_subset=None, **options).fit(x[rows], y[rows])
    for ours, reference in zip(subset.model_.parameters(), alone.model_.parameters(), strict=True):
        torch.testing.assert_close(ours.detach(), reference.detach(), rtol=1e-3, atol=1e-4)
    assert subset.model_.variational_strategy.num_data == 80
