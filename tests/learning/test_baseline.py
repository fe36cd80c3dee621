"""Held-out rows on data within the learning subset, the check against a constant predictor, and a classifier on
binary indicator features with rare columns (the case of a silent wrong answer: a lengthscale that interpolates the
training rows and a test score below chance)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss, mean_poisson_deviance

from gpytorch_iterncgp import LearningRecipe
from gpytorch_iterncgp.learning.baseline import constant_score
from gpytorch_iterncgp.learning.rows import auto_learning_size, auto_subset_size
from gpytorch_iterncgp.likelihoods.adapters import logistic_gaussian


def test_auto_learning_size_holds_rows_out_where_the_data_fit_in_the_subset():
    """The subset of ``sqrt(10^7 / C)`` rows where it leaves ``minimum`` out; else all but a fifth where a fifth is at
    least ``minimum``; else the subset where smaller than the data, else all rows."""
    recipe = LearningRecipe()
    minimum, fraction = recipe.min_validation_points, recipe.held_out_fraction
    subset = auto_subset_size(1)
    assert subset == 3162
    assert auto_learning_size(subset + minimum, 1, minimum, fraction) == subset
    assert auto_learning_size(subset + minimum - 1, 1, minimum, fraction) == subset + minimum - 1 - 653
    assert auto_learning_size(2556, 1, minimum, fraction) == 2556 - 512
    assert auto_learning_size(500, 1, minimum, fraction) == 400
    assert auto_learning_size(496, 1, minimum, fraction) == 396  # a fifth rounded up: 100 rows
    assert auto_learning_size(495, 1, minimum, fraction) is None  # 99 rows: all of them learnt on
    assert auto_learning_size(1000, 1, minimum, 0.0) is None
    assert auto_learning_size(1500, 10, minimum, fraction) == 1000  # 10 classes: the subset of 1000 leaves 500
    assert auto_learning_size(1050, 10, minimum, fraction) == 840
    with pytest.raises(ValueError, match="held_out_fraction"):
        LearningRecipe(held_out_fraction=1.0).validate()


def test_constant_score_is_scikit_learns_score_of_the_learning_rows_frequencies_and_mean():
    generator = np.random.default_rng(0)
    learning, held_out = generator.integers(0, 3, 80), generator.integers(0, 3, 30)
    frequencies = np.bincount(learning, minlength=3) / len(learning)
    expected = log_loss(held_out, np.tile(frequencies, (len(held_out), 1)), labels=[0, 1, 2])
    ours = constant_score(torch.as_tensor(learning, dtype=torch.float64), torch.as_tensor(held_out), True)
    assert ours == pytest.approx(expected, rel=1e-12)
    counts, held_out_counts = generator.poisson(3.0, 80), generator.poisson(3.0, 30)
    expected = mean_poisson_deviance(held_out_counts, np.full(len(held_out_counts), counts.mean()))
    ours = constant_score(
        torch.as_tensor(counts, dtype=torch.float64), torch.as_tensor(held_out_counts, dtype=torch.float64), False
    )
    assert ours == pytest.approx(expected, rel=1e-12)


def test_logistic_gaussian_is_a_probability_where_its_weights_sum_past_one():
    """Without the clamp, the trapezoid rule's weights (summing to 1 + 1e-15) give E[sigma(f)] = 1 + 1e-15 at
    confident points (mean 37, sd 1.2), which scikit-learn's log_loss refuses as a probability."""
    mean = torch.linspace(-60, 60, 2001, dtype=torch.float64)
    for variance in (0.5, 1.5, 25.0, 1e4):
        probability = logistic_gaussian(mean, torch.full_like(mean, variance))
        assert bool((probability >= 0).all() and (probability <= 1).all())
    log_loss(np.ones(2001), np.stack([1 - probability.numpy(), probability.numpy()], axis=1), labels=[0, 1])


def indicator_data(num_rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Binary indicator features, a third of them rare (set in 0.3–3 % of the rows), balanced labels from a rule: a
    rare indicator, where set, decides the label (as a piece on a board decides a game); otherwise a score of the
    common indicators with an interaction, thresholded at its median. No noise: the classes are separable, and a
    lengthscale that interpolates the training rows fits them all."""
    generator = np.random.default_rng(seed)
    num_rare, num_common = 10, 20
    frequency = np.concatenate([generator.uniform(0.003, 0.03, num_rare), generator.uniform(0.1, 0.6, num_common)])
    x = (generator.random((num_rows, num_rare + num_common)) < frequency).astype(float)
    common = x[:, num_rare:]
    score = common[:, 0] * common[:, 1] + common[:, 2] - common[:, 3] * (1 - common[:, 4])
    score = score + 0.5 * common[:, 5:12].sum(1) - 0.4 * common[:, 12:18].sum(1)
    y = (score > np.median(score)).astype(int)
    for column in range(num_rare):
        y = np.where(x[:, column] == 1, column % 2, y)
    return x, y


@pytest.mark.parametrize("inference", ["laplace", pytest.param("auto", marks=pytest.mark.slow)])
def test_classifier_on_indicator_features_with_rare_columns_beats_the_constant(inference):
    """Standardised by the training rows (a rare column becomes values up to ~20), 512 training rows: the
    classifier (Laplace, and the default EP: 80 s, slow) holds 103 rows out (a fifth), chooses the outputscale on
    them and checks itself against the class frequencies; its test accuracy is above the majority class's and its
    test log-loss below the constant predictor's; the latent variance at a row far from every training row is the
    prior's (1e-6)."""
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    from gpytorch_iterncgp.sklearn import IterNCGPClassifier

    x, y = indicator_data(640, seed=0)
    train_x, test_x, train_y, test_y = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
    scaler = StandardScaler().fit(train_x)
    train_x, test_x = scaler.transform(train_x), scaler.transform(test_x)
    classifier = IterNCGPClassifier(inference=inference, random_state=0).fit(train_x, train_y)
    report = classifier.learning_report_
    assert len(classifier.learning_rows_) == 409 and len(classifier.validation_rows_) == 103
    assert report.held_out_score is not None and report.held_out_score < report.constant_score
    probabilities = classifier.predict_proba(test_x)
    majority = max(test_y.mean(), 1 - test_y.mean())
    constant = log_loss(test_y, np.tile([1 - train_y.mean(), train_y.mean()], (len(test_y), 1)))
    assert float((classifier.predict(test_x) == test_y).mean()) > majority + 0.1
    assert log_loss(test_y, probabilities) < 0.7 * constant
    far = test_x[:1] + 1e3
    _, std = classifier.predict_latent(far)
    outputscale = classifier.kernel_.outputscale.item()
    assert std[0] ** 2 == pytest.approx(outputscale, rel=1e-6)
    assert math.isfinite(report.held_out_score)
