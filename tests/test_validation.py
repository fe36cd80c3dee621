"""Bad input fails early with an error that names the problem.

Each case is paired with its valid counterpart where that is not obvious (e.g. integer-valued float
labels are accepted), so that a check rejecting everything would fail too.
"""

from __future__ import annotations

import warnings

import gpytorch
import pytest
import torch
from gpytorch.likelihoods.likelihood import _OneDimensionalLikelihood

from gpytorch_iterncgp import ExpPoissonLikelihood, LogitBernoulliLikelihood
from tests.common import IterNCGPModel, binary_data, count_data, multiclass_data


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
    assert model.variational_strategy.fit().steps >= 1


def test_valid_option_boundaries_accepted():
    train_x, train_y = binary_data(num_data=20)
    model = IterNCGPModel(
        train_x, train_y, LogitBernoulliLikelihood(), compression_rank=1, max_solver_iterations=1, outer_tol=0.0
    )
    report = model.variational_strategy.fit(max_newton_steps=3)
    assert report.steps == 3 and all(step.solver_iterations == 1 for step in report.records)


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


# ---------------------------------------------------------------------------------------------------
# Devices (a "meta" tensor stands in for a second device: only CPU is available here)
# ---------------------------------------------------------------------------------------------------
def test_train_data_on_two_devices():
    train_x, train_y = binary_data(num_data=20)
    with pytest.raises(ValueError, match="train_targets are on cpu but train_inputs on meta"):
        IterNCGPModel(train_x.to("meta"), train_y, LogitBernoulliLikelihood())
    with pytest.raises(ValueError, match="train_targets are on meta but train_inputs on cpu"):
        IterNCGPModel(train_x, train_y.to("meta"), LogitBernoulliLikelihood())


def test_test_inputs_on_another_device_than_the_model():
    model = _fitted_binary_model()
    inputs = torch.rand(4, 2, dtype=torch.float64, device="meta")
    strategy = model.variational_strategy
    for predict in (model, strategy.marginal_latent, strategy.predictive_mean, strategy.predictive_probabilities):
        with pytest.raises(ValueError, match="inputs are on meta but the model's training data on cpu"):
            predict(inputs)


def test_model_parameters_on_another_device_than_the_data():
    train_x, train_y = binary_data(num_data=20)
    model = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood())
    model.covar_module.to("meta")  # e.g. a submodule left behind by a partial .to(device)
    with pytest.raises(ValueError, match=r"parameter covar_module\.raw_outputscale is on meta but train_inputs on cpu"):
        model.variational_strategy.fit()
    assert model.variational_strategy.state is None


# ---------------------------------------------------------------------------------------------------
# Shapes, empty data, types
# ---------------------------------------------------------------------------------------------------
def test_empty_training_data():
    train_x, train_y = binary_data(num_data=20)
    with pytest.raises(ValueError, match=r"train_inputs is empty \(shape \(0, 2\)\)"):
        IterNCGPModel(train_x[:0], train_y[:0], LogitBernoulliLikelihood())
    with pytest.raises(ValueError, match="train_targets is empty"):
        IterNCGPModel(train_x, train_y[:0], LogitBernoulliLikelihood())
    with pytest.raises(ValueError, match=r"train_inputs has no features \(shape \(20, 0\)\)"):
        IterNCGPModel(train_x[:, :0], train_y, LogitBernoulliLikelihood())


def test_empty_or_featureless_test_inputs():
    model = _fitted_binary_model()
    with pytest.raises(ValueError, match="inputs is empty"):
        model(torch.zeros(0, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="inputs has no features"):
        model.variational_strategy.marginal_latent(torch.zeros(3, 0, dtype=torch.float64))


@pytest.mark.parametrize(
    "inputs, error, message",
    [
        ([[0.1, 0.2]] * 20, TypeError, "train_inputs must be a torch.Tensor, got list"),
        (torch.rand(20, 2, 1, dtype=torch.float64), ValueError, r"train_inputs must have shape \(N, D\) or \(N,\)"),
        (torch.rand(20, 2, dtype=torch.complex128), TypeError, "floating-point"),
    ],
)
def test_bad_train_inputs(inputs, error, message):
    _, train_y = binary_data(num_data=20)
    with pytest.raises(error, match=message):
        IterNCGPModel(inputs, train_y, LogitBernoulliLikelihood())


@pytest.mark.parametrize(
    "targets, error, message",
    [
        ([0, 1] * 10, TypeError, "train_targets must be a torch.Tensor, got list"),
        (torch.zeros(20, 1), ValueError, r"train_targets must be 1-D \(N,\), got shape \(20, 1\)"),
        (torch.zeros(20, dtype=torch.complex64), TypeError, "train_targets must be real"),
    ],
)
def test_bad_train_targets(targets, error, message):
    train_x, _ = binary_data(num_data=20)
    with pytest.raises(error, match=message):
        IterNCGPModel(train_x, targets, LogitBernoulliLikelihood())


def test_boolean_and_integer_labels_are_accepted():
    train_x, train_y = binary_data(num_data=20)
    reference = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood())
    reference.variational_strategy.fit()
    for labels in (train_y.bool(), train_y.long(), train_y.int()):
        model = IterNCGPModel(train_x, labels, LogitBernoulliLikelihood())
        model.variational_strategy.fit()
        assert torch.equal(model.variational_strategy.mode, reference.variational_strategy.mode)


def test_model_not_a_module():
    from gpytorch_iterncgp import IterNCGPStrategy

    train_x, train_y = binary_data(num_data=20)
    with pytest.raises(TypeError, match="model must be the gpytorch ApproximateGP that owns the strategy"):
        IterNCGPStrategy(None, train_x, train_y, LogitBernoulliLikelihood())


def test_model_in_another_dtype_than_the_data():
    train_x, train_y = binary_data(num_data=20, dtype=torch.float32)
    model = IterNCGPModel(train_x, train_y.float(), LogitBernoulliLikelihood(), constant_mean=0.5)
    model.mean_module.double()
    with pytest.raises(TypeError, match="The model computes in torch.float64 but train_inputs are torch.float32"):
        model.variational_strategy.fit()


# ---------------------------------------------------------------------------------------------------
# Options and policies
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, 0.0, -1e-3, float("nan"), float("inf"), "small", True])
def test_invalid_min_curvature(value):
    train_x, train_y = binary_data(num_data=20)
    with pytest.raises(ValueError, match="min_curvature must be (a number|a positive finite number)"):
        IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), min_curvature=value)


def test_valid_min_curvature_bounds_the_noise():
    train_x, train_y = binary_data(num_data=20)
    model = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), min_curvature=0.2)
    model.variational_strategy.fit()
    derivatives = model.variational_strategy.adapter.derivatives(model.variational_strategy.mode, train_y)
    assert float(derivatives.noise_inverse.diagonal().max()) <= 1 / 0.2 + 1e-12


@pytest.mark.parametrize("option, value", [("recycle", "yes"), ("recycle", 1), ("show_progress", None)])
def test_flags_must_be_booleans(option, value):
    train_x, train_y = binary_data(num_data=20)
    with pytest.raises(TypeError, match=f"{option} must be True or False"):
        IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), **{option: value})


@pytest.mark.parametrize("option", ["max_newton_steps", "max_solver_iterations", "compression_rank", "outer_tol"])
def test_booleans_are_not_numbers(option):
    train_x, train_y = binary_data(num_data=20)
    with pytest.raises(ValueError, match=f"{option} must be a number, got True"):
        IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), **{option: True})


@pytest.mark.parametrize("seed", [1.5, "0", True, None])
def test_seed_must_be_an_integer(seed):
    from gpytorch_iterncgp import UnitVectorPolicy

    train_x, train_y = binary_data(num_data=20)
    with pytest.raises(TypeError, match="seed must be an integer"):
        IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), policy="unit", seed=seed)
    with pytest.raises(TypeError, match="seed must be an integer"):
        UnitVectorPolicy(seed=seed)


@pytest.mark.parametrize("policy", [None, 3, object()])
def test_policy_of_the_wrong_type(policy):
    train_x, train_y = binary_data(num_data=20)
    with pytest.raises(TypeError, match="policy must be 'cg', 'unit' or a gpytorch_iterncgp.Policy instance"):
        IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), policy=policy)


def test_policy_names_ignore_case():
    from gpytorch_iterncgp import ConjugateGradientPolicy, UnitVectorPolicy

    train_x, train_y = binary_data(num_data=20)
    cg = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), policy="CG")
    unit = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), policy="Unit")
    assert isinstance(cg.variational_strategy.policy, ConjugateGradientPolicy)
    assert isinstance(unit.variational_strategy.policy, UnitVectorPolicy)


@pytest.mark.parametrize(
    "order, error, message",
    [
        ([0.5, 1.5], TypeError, "order must hold integer data indices, got dtype torch.float"),
        ([[0, 1], [2, 3]], ValueError, r"order must be a non-empty 1-D list, got shape \(2, 2\)"),
        ([], ValueError, "order must be a non-empty 1-D list"),
        ([3, 1, 3], ValueError, "order repeats a data index"),
    ],
)
def test_unit_vector_order_rejected_at_construction(order, error, message):
    from gpytorch_iterncgp import UnitVectorPolicy

    with pytest.raises(error, match=message):
        UnitVectorPolicy(order=order)


@pytest.mark.parametrize("bad", [20, -1])
def test_unit_vector_order_outside_the_data(bad):
    from gpytorch_iterncgp import UnitVectorPolicy

    train_x, train_y = binary_data(num_data=20)
    subset = UnitVectorPolicy(order=[0, 5, 19])
    model = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), policy=subset, max_solver_iterations=3)
    model.variational_strategy.fit(max_newton_steps=1)  # valid: a subset of the data
    model = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), policy=UnitVectorPolicy(order=[0, bad]))
    with pytest.raises(ValueError, match=rf"order must hold data indices in \[0, 20\); found \[{bad}\]"):
        model.variational_strategy.fit()


def test_fit_callback_and_show_progress_types():
    train_x, train_y = binary_data(num_data=20)
    model = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood())
    with pytest.raises(TypeError, match="callback must be callable"):
        model.variational_strategy.fit(callback="stop")
    with pytest.raises(TypeError, match="show_progress must be True or False"):
        model.variational_strategy.fit(show_progress="no")
    assert model.variational_strategy.state is None
    model.variational_strategy.fit(callback=lambda step, state: None, show_progress=False)


def test_unknown_options_are_type_errors_naming_them():
    train_x, train_y = binary_data(num_data=20)
    with pytest.raises(TypeError, match="max_iterations"):
        IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), max_iterations=3)
    model = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood())
    with pytest.raises(TypeError, match="tol"):
        model.variational_strategy.fit(tol=1e-3)


def test_outer_tol_below_float32_resolution_warns():
    train_x, train_y = binary_data(num_data=20, dtype=torch.float32)
    model = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), max_newton_steps=3)
    with pytest.warns(UserWarning, match=r"outer_tol=1e-10 is below what torch.float32 resolves"):
        model.variational_strategy.fit(outer_tol=1e-10)
    # float64 resolves it; and 0 (run every step) is a deliberate choice, not a precision problem.
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.variational_strategy.fit(outer_tol=0.0)
        train_x, train_y = binary_data(num_data=20)
        IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), max_newton_steps=3).variational_strategy.fit(
            outer_tol=1e-10
        )


def test_likelihood_adapter_validates_min_curvature():
    from gpytorch_iterncgp.likelihoods.adapters import likelihood_adapter

    with pytest.raises(ValueError, match="min_curvature"):
        likelihood_adapter(LogitBernoulliLikelihood(), min_curvature=-1.0)
    assert likelihood_adapter(LogitBernoulliLikelihood(), min_curvature=1).min_curvature == 1.0


# ---------------------------------------------------------------------------------------------------
# load_state_dict
# ---------------------------------------------------------------------------------------------------
def test_state_dict_of_other_training_data_is_discarded_with_a_warning():
    train_x, train_y = binary_data(num_data=20)
    model = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood())
    model.variational_strategy.fit()
    state_dict = model.state_dict()
    for other_x, other_y in [binary_data(num_data=20, seed=5), binary_data(num_data=25)]:
        other = IterNCGPModel(other_x, other_y, LogitBernoulliLikelihood())
        with pytest.warns(UserWarning, match="belongs to other training data"):
            other.load_state_dict(state_dict)
        assert other.variational_strategy.state is None  # not silently reused
        fresh = IterNCGPModel(other_x, other_y, LogitBernoulliLikelihood())
        other.eval(), fresh.eval()
        test_x = torch.rand(5, 2, dtype=torch.float64)
        with torch.no_grad():
            assert torch.equal(other(test_x).mean, fresh(test_x).mean)  # refitted to its own data
    # The same data as float32 is the same data: no warning, the state is kept.
    model32 = IterNCGPModel(train_x.float(), train_y.float(), LogitBernoulliLikelihood())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model32.load_state_dict(state_dict)
    assert model32.variational_strategy.state.newton_steps == model.variational_strategy.state.newton_steps


def test_malformed_extra_state_is_rejected():
    train_x, train_y = binary_data(num_data=20)
    model = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood())
    model.variational_strategy.fit()
    state_dict = model.state_dict()
    key = "variational_strategy._extra_state"
    broken = {**state_dict, key: {**state_dict[key], "state": {**state_dict[key]["state"]}}}
    broken[key]["state"]["actions"] = broken[key]["state"]["actions"][:5]
    with pytest.raises(ValueError, match="extra state is malformed: inconsistent shapes"):
        IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood()).load_state_dict(broken)
    del broken[key]["state"]["actions"]
    with pytest.raises(ValueError, match=r"extra state is malformed: missing or non-tensor entries \['actions'\]"):
        IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood()).load_state_dict(broken)


def test_extra_state_of_a_newer_version_is_refused_and_one_without_a_version_read():
    """The saved state's ``version`` is checked on load: a newer one is refused naming it; the first versions wrote
    none, and such a state still loads (and predicts as the saved model)."""
    train_x, train_y = binary_data(num_data=20)
    model = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood())
    model.variational_strategy.fit()
    state_dict = model.state_dict()
    key = "variational_strategy._extra_state"
    with pytest.raises(ValueError, match="extra state has version 3, newer than this package reads"):
        IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood()).load_state_dict(
            {**state_dict, key: {**state_dict[key], "version": 3}}
        )
    unversioned = {name: value for name, value in state_dict[key].items() if name != "version"}
    restored = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood())
    restored.load_state_dict({**state_dict, key: unversioned})
    torch.testing.assert_close(restored.variational_strategy.state.actions, model.variational_strategy.state.actions)
