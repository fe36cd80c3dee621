"""Bad input fails early with an error that names the problem.

Each case is paired with its valid counterpart where that is not obvious (e.g. integer-valued float
labels are accepted), so that a check rejecting everything would fail too.
"""

from __future__ import annotations

import gpytorch
import pytest
import torch
from gpytorch.likelihoods.likelihood import _OneDimensionalLikelihood

from gpytorch_iterncgp import ExpPoissonLikelihood, LogitBernoulliLikelihood
from tests.models import IterNCGPModel, binary_data, count_data, multiclass_data


def _softmax(**kwargs):
    return gpytorch.likelihoods.SoftmaxLikelihood(num_classes=3, mixing_weights=False, **kwargs)


BERNOULLI = [gpytorch.likelihoods.BernoulliLikelihood, LogitBernoulliLikelihood]
POISSON = [gpytorch.likelihoods.PoissonLikelihood, ExpPoissonLikelihood]


# ---------------------------------------------------------------------------------------------------
# Targets outside the support
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("likelihood", BERNOULLI)
@pytest.mark.parametrize("bad", [2.0, -1.0, 0.5])
def test_bernoulli_labels_outside_zero_one(likelihood, bad):
    train_x, train_y = binary_data(num_data=20)
    train_y = train_y.clone()
    train_y[4] = bad
    with pytest.raises(ValueError, match=r"labels must be 0 or 1.*" + str(bad).replace(".", r"\.")):
        IterNCGPModel(train_x, train_y, likelihood())


@pytest.mark.parametrize("likelihood", BERNOULLI)
def test_bernoulli_integer_labels_outside_zero_one(likelihood):
    train_x, train_y = binary_data(num_data=20)
    train_y = train_y.long()
    IterNCGPModel(train_x, train_y, likelihood()).variational_strategy.fit(max_newton_steps=1)  # valid
    train_y[0] = 2
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        IterNCGPModel(train_x, train_y, likelihood())


@pytest.mark.parametrize("bad", [3, -1, 7])
def test_softmax_labels_outside_range(bad):
    train_x, train_y = multiclass_data(num_data=20)
    train_y = train_y.clone()
    train_y[2] = bad
    with pytest.raises(ValueError, match=rf"labels must lie in \[0, 3\).*{bad}"):
        IterNCGPModel(train_x, train_y, _softmax())


def test_softmax_non_integer_labels():
    train_x, train_y = multiclass_data(num_data=20)
    # Integer-valued float labels are fine ...
    IterNCGPModel(train_x, train_y.double(), _softmax()).variational_strategy.fit(max_newton_steps=1)
    labels = train_y.double()
    labels[5] = 1.5
    with pytest.raises(ValueError, match="labels must be integers"):
        IterNCGPModel(train_x, labels, _softmax())


@pytest.mark.parametrize("likelihood", POISSON)
def test_poisson_negative_counts(likelihood):
    train_x, train_y = count_data(num_data=20)
    train_y = train_y.clone()
    train_y[3] = -2.0
    with pytest.raises(ValueError, match=r"counts must be non-negative.*-2"):
        IterNCGPModel(train_x, train_y, likelihood())
    with pytest.raises(ValueError, match="counts must be non-negative"):
        IterNCGPModel(train_x, train_y.long(), likelihood())


@pytest.mark.parametrize("likelihood", POISSON)
def test_poisson_non_integer_counts(likelihood):
    train_x, train_y = count_data(num_data=20)
    train_y = train_y.clone()
    train_y[3] = 2.5
    with pytest.raises(ValueError, match=r"counts must be integers.*2\.5"):
        IterNCGPModel(train_x, train_y, likelihood())


# ---------------------------------------------------------------------------------------------------
# NaN / inf, lengths, dtypes, features
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_inputs(value):
    train_x, train_y = binary_data(num_data=20)
    train_x = train_x.clone()
    train_x[3, 1] = value
    with pytest.raises(ValueError, match="train_inputs contains NaN or inf"):
        IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood())


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize(
    "likelihood, data",
    [(LogitBernoulliLikelihood, binary_data), (ExpPoissonLikelihood, count_data), (_softmax, multiclass_data)],
)
def test_non_finite_targets(value, likelihood, data):
    train_x, train_y = data(num_data=20)
    train_y = train_y.double()
    train_y[6] = value
    with pytest.raises(ValueError, match="train_targets contain NaN or inf"):
        IterNCGPModel(train_x, train_y, likelihood())


@pytest.mark.parametrize("num_targets", [19, 21])
def test_mismatched_lengths(num_targets):
    train_x, _ = binary_data(num_data=20)
    train_y = torch.zeros(num_targets, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"20 points but train_targets has {num_targets}"):
        IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood())


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_inputs(dtype):
    train_x, train_y = binary_data(num_data=20)
    with pytest.raises(TypeError, match=f"floating-point.*{dtype}"):
        IterNCGPModel((10 * train_x).to(dtype), train_y, LogitBernoulliLikelihood())


def _fitted_binary_model():
    train_x, train_y = binary_data(num_data=20)
    model = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood())
    model.variational_strategy.fit()
    model.eval()
    return model


@pytest.mark.parametrize("num_features", [1, 3])
def test_test_inputs_with_wrong_number_of_features(num_features):
    model = _fitted_binary_model()
    model(torch.rand(4, 2, dtype=torch.float64))  # valid
    with pytest.raises(ValueError, match=f"inputs have {num_features} features but the training inputs have 2"):
        model(torch.rand(4, num_features, dtype=torch.float64))
    with pytest.raises(ValueError, match="features"):
        model.variational_strategy.predictive_mean(torch.rand(4, num_features, dtype=torch.float64))


def test_bad_test_inputs():
    model = _fitted_binary_model()
    with pytest.raises(ValueError, match="inputs contains NaN or inf"):
        model(torch.tensor([[0.1, float("nan")]], dtype=torch.float64))
    with pytest.raises(TypeError, match="floating-point"):
        model(torch.ones(3, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="float32"):
        model(torch.ones(3, 2, dtype=torch.float32))


# ---------------------------------------------------------------------------------------------------
# Likelihoods that are refused
# ---------------------------------------------------------------------------------------------------
def test_student_t_likelihood_refused_at_construction():
    train_x, _ = binary_data(num_data=20)
    train_y = torch.randn(20, dtype=torch.float64)
    with pytest.raises(ValueError, match="StudentTLikelihood is not log-concave"):
        IterNCGPModel(train_x, train_y, gpytorch.likelihoods.StudentTLikelihood())


def test_softmax_with_mixing_weights_refused():
    train_x, train_y = multiclass_data(num_data=20)
    likelihood = gpytorch.likelihoods.SoftmaxLikelihood(num_classes=3, num_features=3, mixing_weights=True)
    with pytest.raises(ValueError, match="mixing_weights"):
        IterNCGPModel(train_x, train_y, likelihood)


def test_not_a_likelihood():
    train_x, train_y = binary_data(num_data=20)
    with pytest.raises(TypeError, match="gpytorch.likelihoods.Likelihood"):
        IterNCGPModel(train_x, train_y, torch.distributions.Bernoulli)


class CauchyLikelihood(_OneDimensionalLikelihood):
    """y ~ Cauchy(f, 1): log p = -log(1 + (y - f)^2) + const, concave only where |y - f| < 1."""

    def forward(self, function_samples, *args, **kwargs):
        return torch.distributions.StudentT(1.0, loc=function_samples, scale=torch.ones_like(function_samples))


class StudentTFourLikelihood(_OneDimensionalLikelihood):
    """y ~ StudentT(4, f, 0.5): not log-concave for large residuals."""

    def forward(self, function_samples, *args, **kwargs):
        return torch.distributions.StudentT(4.0, loc=function_samples, scale=0.5 * torch.ones_like(function_samples))


@pytest.mark.parametrize("likelihood", [CauchyLikelihood, StudentTFourLikelihood])
def test_autograd_likelihood_not_log_concave_raises_during_fit(likelihood):
    train_x, _ = binary_data(num_data=20)
    small_residuals = 0.1 * torch.sin(6 * train_x[:, 0])
    # Valid control: residuals within the concave region at the prior mean f = 0.
    model = IterNCGPModel(train_x, small_residuals, likelihood())
    model.variational_strategy.fit(max_newton_steps=1)
    large_residuals = torch.linspace(-10, 10, 20, dtype=torch.float64)
    model = IterNCGPModel(train_x, large_residuals, likelihood())  # construction is fine
    with pytest.raises(ValueError, match="log-concave"):
        model.variational_strategy.fit()


# ---------------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------------
def test_unknown_policy():
    train_x, train_y = binary_data(num_data=20)
    with pytest.raises(ValueError, match="Unknown policy 'lanczos'"):
        IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), policy="lanczos")


@pytest.mark.parametrize(
    "option, value",
    [
        ("max_newton_steps", -1),
        ("max_newton_steps", 1.5),
        ("compression_rank", 0),
        ("compression_rank", -3),
        ("max_solver_iterations", 0),
        ("outer_tol", -1.0),
        ("abs_tol", float("nan")),
        ("rel_tol", -1e-3),
    ],
)
def test_invalid_options_at_construction(option, value):
    train_x, train_y = binary_data(num_data=20)
    with pytest.raises(ValueError, match=option):
        IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), **{option: value})


@pytest.mark.parametrize(
    "option, value",
    [("max_newton_steps", -1), ("max_solver_iterations", 0), ("outer_tol", -1.0), ("abs_tol", -1.0)],
)
def test_invalid_options_in_fit(option, value):
    train_x, train_y = binary_data(num_data=20)
    model = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood())
    with pytest.raises(ValueError, match=option):
        model.variational_strategy.fit(**{option: value})
    assert model.variational_strategy.state is None  # nothing ran
    # The options of the strategy are untouched: a normal fit still works.
    assert model.variational_strategy.fit().newton_steps >= 1


def test_valid_option_boundaries_accepted():
    train_x, train_y = binary_data(num_data=20)
    model = IterNCGPModel(
        train_x, train_y, LogitBernoulliLikelihood(), compression_rank=1, max_solver_iterations=1, outer_tol=0.0
    )
    report = model.variational_strategy.fit(max_newton_steps=3)
    assert report.newton_steps == 3 and all(step.solver_iterations == 1 for step in report.steps)


# ---------------------------------------------------------------------------------------------------
# Model forward with the wrong batch shape
# ---------------------------------------------------------------------------------------------------
def test_wrong_batch_shape_single_latent():
    train_x, train_y = binary_data(num_data=20)
    model = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), batch_classes=2)
    with pytest.raises(ValueError, match=r"batch_shape \[2\].*expects batch_shape \[\]"):
        model.variational_strategy.fit()
    model.eval()
    with pytest.raises(ValueError, match="batch_shape"):
        model(torch.rand(3, 2, dtype=torch.float64))


def test_wrong_batch_shape_softmax():
    train_x, train_y = multiclass_data(num_data=20)
    model = IterNCGPModel(train_x, train_y, _softmax(), batch_classes=2)
    with pytest.raises(ValueError, match=r"batch_shape \[2\].*\[3\] \(one GP per class\)"):
        model.variational_strategy.fit()
