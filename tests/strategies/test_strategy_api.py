"""The public API of IterNCGPStrategy: dtypes, state_dict, continued fits, fit options, stale caches,
train mode, KeOps kernels, the autograd fallback and the shared-kernel prior.

Every test compares with an independent reference: a float64 run, a fresh model, a dense-matrix
computation, the closed-form likelihood, or the eval-mode / standard-kernel version of the same model.
"""

from __future__ import annotations

import io
import math

import gpytorch
import pytest
import torch
from gpytorch.likelihoods.likelihood import _OneDimensionalLikelihood

from gpytorch_iterncgp import ExpPoissonLikelihood, LogitBernoulliLikelihood
from gpytorch_iterncgp.likelihoods.adapters import AutogradAdapter
from tests.common import IterNCGPModel, binary_data, count_data, multiclass_data

# Options under which both compared runs converge to the exact Laplace mode: every Newton step is solved
# exactly (unit-vector actions until the residual vanishes, at most N C of them) and the outer loop runs
# until the representer weights stop changing.
CONVERGED = dict(
    policy="unit", max_solver_iterations=None, outer_tol=1e-12, abs_tol=1e-12, rel_tol=1e-12, max_newton_steps=60
)


def _softmax():
    return gpytorch.likelihoods.SoftmaxLikelihood(num_classes=3, mixing_weights=False)


LIKELIHOODS = {
    "probit-bernoulli": (gpytorch.likelihoods.BernoulliLikelihood, binary_data),
    "logit-bernoulli": (LogitBernoulliLikelihood, binary_data),
    "exp-poisson": (ExpPoissonLikelihood, count_data),
    "softplus-poisson": (gpytorch.likelihoods.PoissonLikelihood, count_data),
    "softmax": (_softmax, multiclass_data),
}


def _data(name, num_data=40):
    return LIKELIHOODS[name][1](num_data=num_data)


def _test_inputs(train_x, num=7, seed=11):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(num, train_x.shape[-1], dtype=train_x.dtype, generator=generator)


def _fit(name, train_x, train_y, **options):
    model = IterNCGPModel(train_x, train_y, LIKELIHOODS[name][0](), **options)
    report = model.variational_strategy.fit()
    return model, report


def _posterior(model, inputs):
    model.eval()
    with torch.no_grad():
        latent = model(inputs)
        return latent.mean, latent.variance, latent.covariance_matrix


def _dense_prior_covariance(model, inputs):
    """K(X, X) as a dense (N, N) tensor, computed by GPyTorch directly."""
    with torch.no_grad():
        return model.covar_module(inputs).to_dense()


# ---------------------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(LIKELIHOODS))
def test_float32_matches_float64(name):
    """A float32 fit gives the float64 posterior at test points to 1e-3 relative (to the largest entry) for the mean,
    5e-3 for the variance.

    Both runs use the default (inexact, preconditioned) solver settings; float32 round-off (~1e-7) is amplified by the
    conditioning of K + W^{-1} (observed differences of the mean ~1e-5). The variance depends on the actions of the
    incomplete solves, which float32 rounding changes slightly (measured: 1.6e-3 relative for exp-Poisson).
    """
    x64, y64 = _data(name)
    x32 = x64.float()
    y32 = y64.float() if y64.is_floating_point() else y64
    test64 = _test_inputs(x64)
    results = {}
    for dtype, (x, y, test) in {torch.float64: (x64, y64, test64), torch.float32: (x32, y32, test64.float())}.items():
        model, report = _fit(name, x, y)
        assert report.steps >= 1
        mean, variance, _ = _posterior(model, test)
        assert mean.dtype == dtype and variance.dtype == dtype
        assert model.variational_strategy.mode.dtype == dtype
        results[dtype] = (mean, variance)
    mean64, variance64 = results[torch.float64]
    mean32, variance32 = (t.double() for t in results[torch.float32])
    assert bool(torch.isfinite(mean32).all() and torch.isfinite(variance32).all())
    torch.testing.assert_close(mean32, mean64, rtol=0, atol=1e-3 * float(mean64.abs().max()))
    torch.testing.assert_close(variance32, variance64, rtol=0, atol=5e-3 * float(variance64.abs().max()))


# ---------------------------------------------------------------------------------------------------
# state_dict
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["probit-bernoulli", "softmax"])
@pytest.mark.parametrize("through_bytes", [False, True], ids=["in-memory", "torch.save"])
def test_state_dict_round_trip_without_refit(name, through_bytes):
    train_x, train_y = _data(name)
    model, _ = _fit(name, train_x, train_y, policy="unit")
    state_dict = model.state_dict()
    if through_bytes:
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        buffer.seek(0)
        # The extra state holds only tensors, numbers, strings and dicts: loadable with weights_only=True.
        state_dict = torch.load(buffer, weights_only=True)
    fresh = IterNCGPModel(train_x, train_y, LIKELIHOODS[name][0](), policy="unit")
    fresh.load_state_dict(state_dict)
    test_x = _test_inputs(train_x)
    mean, variance, covariance = _posterior(model, test_x)
    mean2, variance2, covariance2 = _posterior(fresh, test_x)
    assert fresh.variational_strategy.last_report is None, "load_state_dict + predict must not refit"
    assert torch.equal(mean, mean2) and torch.equal(variance, variance2) and torch.equal(covariance, covariance2)
    assert torch.equal(fresh.variational_strategy.mode, model.variational_strategy.mode)
    assert fresh.variational_strategy.last_report is None
    assert fresh.variational_strategy.state.newton_steps == model.variational_strategy.state.newton_steps


def test_state_dict_then_continue_matches_original():
    """A loaded model continues the fit exactly like the original (buffers and unit-policy position restored)."""
    train_x, train_y = _data("logit-bernoulli")
    model, _ = _fit("logit-bernoulli", train_x, train_y, policy="unit", max_newton_steps=2)
    fresh = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), policy="unit")
    fresh.load_state_dict(model.state_dict())
    report = model.variational_strategy.fit(max_newton_steps=20)
    report2 = fresh.variational_strategy.fit(max_newton_steps=20)
    assert report.steps == report2.steps and report.solver_iterations == report2.solver_iterations
    torch.testing.assert_close(fresh.variational_strategy.mode, model.variational_strategy.mode, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# fit() continues
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["logit-bernoulli", "softmax"])
@pytest.mark.parametrize("options", [CONVERGED, {}], ids=["converged", "default"])
def test_fit_continues_from_current_state(name, options):
    train_x, train_y = _data(name)
    reference, reference_report = _fit(name, train_x, train_y, **options)
    assert reference_report.converged

    model = IterNCGPModel(train_x, train_y, LIKELIHOODS[name][0](), **options)
    first = model.variational_strategy.fit(max_newton_steps=2)
    assert first.steps == 2 and model.variational_strategy.state.newton_steps == 2
    second = model.variational_strategy.fit()
    assert second.converged
    assert model.variational_strategy.state.newton_steps == 2 + second.steps
    # Continuing does not start over: together the two calls take as many steps as one call.
    assert first.steps + second.steps == reference_report.steps
    torch.testing.assert_close(model.variational_strategy.mode, reference.variational_strategy.mode, rtol=0, atol=1e-8)


def test_fit_with_zero_steps_changes_nothing():
    train_x, train_y = _data("logit-bernoulli")
    model, _ = _fit("logit-bernoulli", train_x, train_y)
    mode = model.variational_strategy.mode.clone()
    steps = model.variational_strategy.state.newton_steps
    report = model.variational_strategy.fit(max_newton_steps=0)
    assert report.steps == 0 and report.records == []
    assert model.variational_strategy.state.newton_steps == steps
    assert torch.equal(model.variational_strategy.mode, mode)


# ---------------------------------------------------------------------------------------------------
# fit() options and the report
# ---------------------------------------------------------------------------------------------------
def test_callback_true_stops_after_first_step():
    train_x, train_y = _data("probit-bernoulli")
    model = IterNCGPModel(train_x, train_y, gpytorch.likelihoods.BernoulliLikelihood())
    calls = []

    def callback(step, state):
        calls.append((step, state))
        return True

    report = model.variational_strategy.fit(callback=callback)
    assert report.stopped_by_callback and not report.converged
    assert report.steps == 1 and len(calls) == 1
    step, state = calls[0]
    assert step.step == 1 and state.newton_steps == 1
    assert model.variational_strategy.state.newton_steps == 1
    torch.testing.assert_close(state.representer_weights, model.variational_strategy.state.representer_weights)


def test_callback_none_is_called_every_step():
    train_x, train_y = _data("probit-bernoulli")
    model = IterNCGPModel(train_x, train_y, gpytorch.likelihoods.BernoulliLikelihood())
    seen = []
    report = model.variational_strategy.fit(callback=lambda step, state: seen.append(step.step))
    assert not report.stopped_by_callback and report.converged
    assert seen == list(range(1, report.steps + 1)) and report.steps > 1


def test_show_progress_false_prints_nothing(capsys):
    train_x, train_y = _data("logit-bernoulli")
    model = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), show_progress=True)
    model.variational_strategy.fit(show_progress=False)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""
    # Control: the same fit with the progress bar on does write to stderr (so the check above can fail).
    model2 = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), show_progress=False)
    model2.variational_strategy.fit(show_progress=True)
    assert "Laplace" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["probit-bernoulli", "exp-poisson", "softmax"])
def test_report_is_consistent(name):
    """Report fields agree with each other and the final log posterior with a dense recomputation."""
    train_x, train_y = _data(name)
    model, report = _fit(name, train_x, train_y)
    strategy = model.variational_strategy
    assert report.steps == len(report.records) == strategy.state.newton_steps
    assert report.solver_iterations == sum(step.solver_iterations for step in report.records)
    # CG: exactly one product with K per solver iteration, and one per block of the covariance phase after the steps
    assert report.kernel_products == sum(step.kernel_products for step in report.records) + report.covariance_products
    assert report.kernel_products == report.solver_iterations + report.covariance_products
    assert 0 < report.covariance_products <= strategy.options.covariance_iterations
    assert f"; {report.covariance_products} in the covariance phase)" in str(report)
    assert [step.step for step in report.records] == list(range(1, report.steps + 1))
    assert report.log_posteriors == [step.log_posterior for step in report.records]
    # Damped Newton: the log posterior never decreases.
    assert all(
        b >= a - 1e-10 * abs(a) for a, b in zip(report.log_posteriors[:-1], report.log_posteriors[1:], strict=True)
    )
    assert strategy.last_report is report
    # Psi(f) = log p(y | f) - 1/2 a^T K a with f = m + K a, from a dense K and the likelihood's own log_prob.
    weights = strategy.state.representer_weights
    num_latents = strategy.num_latents
    kernel = _dense_prior_covariance(model, train_x)
    weights_by_class = weights.reshape(-1, num_latents)
    latent = kernel @ weights_by_class  # zero prior mean, kernel shared by all classes
    torch.testing.assert_close(strategy.mode, latent, rtol=1e-10, atol=1e-10)
    likelihood = model.variational_strategy.likelihood
    if num_latents == 1:
        log_likelihood = likelihood.forward(latent[:, 0]).log_prob(train_y).sum()
    else:
        log_likelihood = torch.distributions.Categorical(logits=latent).log_prob(train_y).sum()
    psi = float(log_likelihood) - 0.5 * float((weights_by_class * latent).sum())
    assert math.isclose(report.log_posteriors[-1], psi, rel_tol=1e-10, abs_tol=1e-10)


# ---------------------------------------------------------------------------------------------------
# Hyperparameter changes invalidate K·S
# ---------------------------------------------------------------------------------------------------
def _model_with_outputscale(train_x, train_y, outputscale, **options):
    # Set the hyperparameter after construction (in float64) in both models, so that they are bit-identical.
    model = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), **options)
    model.covar_module.outputscale = outputscale
    return model


@pytest.mark.parametrize("how", ["fit", "predict", "mode"])
def test_changed_hyperparameter_is_not_stale(how):
    train_x, train_y = _data("logit-bernoulli")
    test_x = _test_inputs(train_x)
    model = _model_with_outputscale(train_x, train_y, 2.0, **CONVERGED)
    model.variational_strategy.fit()
    old_mode = model.variational_strategy.mode.clone()
    model.covar_module.outputscale = 0.5
    model.covar_module.base_kernel.lengthscale = 0.2

    fresh = _model_with_outputscale(train_x, train_y, 0.5, **CONVERGED)
    fresh.covar_module.base_kernel.lengthscale = 0.2
    fresh.variational_strategy.fit()
    if how == "fit":
        report = model.variational_strategy.fit()
        assert report.converged
    elif how == "predict":
        model.eval()
        model(test_x)  # refits on demand
        assert model.variational_strategy.last_report.converged
    mode = model.variational_strategy.mode
    assert float((mode - old_mode).abs().max()) > 1e-2  # the change matters
    torch.testing.assert_close(mode, fresh.variational_strategy.mode, rtol=0, atol=1e-6)
    mean, variance, covariance = _posterior(model, test_x)
    mean_ref, variance_ref, covariance_ref = _posterior(fresh, test_x)
    torch.testing.assert_close(mean, mean_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(covariance, covariance_ref, rtol=0, atol=1e-6)


def test_changed_likelihood_hyperparameter_is_not_stale():
    """GaussianLikelihood (autograd path): after changing the noise the mode is the exact GP posterior mean."""
    train_x, _ = binary_data(num_data=30)
    train_y = torch.sin(6 * train_x[:, 0])
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    likelihood.noise = 0.1
    model = IterNCGPModel(train_x, train_y, likelihood, **CONVERGED)
    model.variational_strategy.fit()
    likelihood.noise = 0.02
    mode = model.variational_strategy.mode[:, 0]
    kernel = _dense_prior_covariance(model, train_x)
    noise = likelihood.noise.item()
    expected = kernel @ torch.linalg.solve(kernel + noise * torch.eye(30, dtype=torch.float64), train_y)
    torch.testing.assert_close(mode, expected, rtol=0, atol=1e-8)


# ---------------------------------------------------------------------------------------------------
# Train mode
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["logit-bernoulli", "softmax"])
def test_train_mode_posterior_at_training_inputs(name):
    train_x, train_y = _data(name, num_data=30)
    model, _ = _fit(name, train_x, train_y)
    strategy = model.variational_strategy
    model.train()
    with torch.no_grad():
        train_posterior = model(train_x)
    mode = strategy.mode
    num_latents = strategy.num_latents
    mean = train_posterior.mean if num_latents > 1 else train_posterior.mean[:, None]
    torch.testing.assert_close(mean, mode, rtol=0, atol=1e-12)

    _, _, eval_covariance = _posterior(model, train_x)
    model.eval()
    with torch.no_grad():
        eval_posterior = model(train_x)
    torch.testing.assert_close(train_posterior.mean, eval_posterior.mean, rtol=0, atol=1e-8)
    torch.testing.assert_close(train_posterior.covariance_matrix, eval_covariance, rtol=0, atol=1e-8)

    # Dense reference: K - K C K, with K the data-major prior covariance and C the approximate precision.
    kernel = torch.kron(_dense_prior_covariance(model, train_x), torch.eye(num_latents, dtype=torch.float64))
    precision = strategy.approximate_precision.to_dense()
    torch.testing.assert_close(
        train_posterior.covariance_matrix, kernel - kernel @ precision @ kernel, rtol=0, atol=1e-8
    )


# ---------------------------------------------------------------------------------------------------
# KeOps
# ---------------------------------------------------------------------------------------------------
def test_keops_kernel_matches_dense_kernel(monkeypatch):
    pytest.importorskip("pykeops")
    from gpytorch.kernels.keops import matern_kernel

    lazy_tensor_type = pytest.importorskip("pykeops.torch").LazyTensor
    used_keops = []
    original = matern_kernel._lazify_and_expand_inputs

    def recording(x1, x2):
        result = original(x1, x2)
        used_keops.append(isinstance(result[0], lazy_tensor_type))
        return result

    monkeypatch.setattr(matern_kernel, "_lazify_and_expand_inputs", recording)
    train_x, train_y = _data("logit-bernoulli", num_data=50)
    test_x = _test_inputs(train_x)
    options = dict(max_solver_iterations=None, outer_tol=1e-10, abs_tol=1e-10, rel_tol=1e-10, max_newton_steps=50)
    models = {}
    for kernel in ("keops-matern", "matern"):
        model = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), kernel=kernel, **options)
        # max_cholesky_size(2): without it the KeOps kernel falls back to dense below 800 rows; the kernel's diagonal
        # (the preconditioner's pivots) stays dense (see below).
        with gpytorch.settings.max_cholesky_size(2), torch.no_grad():
            model.variational_strategy.fit()
            model.eval()
            mean = model(test_x).mean
        # The variance needs the kernel's diagonal, which GPyTorch's KeOps kernels compute with one-row
        # inputs; with max_cholesky_size(0) those go to KeOps too and GPyTorch 1.15.2 fails on them
        # ("LazyTensor cannot be made into a Tensor"), so: KeOps for >= 2 rows, dense for the diagonal.
        with gpytorch.settings.max_cholesky_size(2), torch.no_grad():
            variance = model(test_x).variance
        models[kernel] = (model.variational_strategy.mode, mean, variance)
    assert any(used_keops), "the KeOps kernel never built a pykeops LazyTensor"
    (mode_k, mean_k, var_k), (mode_d, mean_d, var_d) = models["keops-matern"], models["matern"]
    torch.testing.assert_close(mode_k, mode_d, rtol=0, atol=1e-6)
    torch.testing.assert_close(mean_k, mean_d, rtol=0, atol=1e-6)
    torch.testing.assert_close(var_k, var_d, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# Autograd fallback
# ---------------------------------------------------------------------------------------------------
class AutogradLogitBernoulli(_OneDimensionalLikelihood):
    """Bernoulli(logits=f) without a closed form: goes through the autograd adapter."""

    def forward(self, function_samples, *args, **kwargs):
        return torch.distributions.Bernoulli(logits=function_samples)


class AutogradSoftmax(gpytorch.likelihoods.SoftmaxLikelihood):
    """The softmax likelihood, but not the exact type: autograd C×C blocks (BlockNoiseInverse)."""


def test_autograd_bernoulli_matches_closed_form():
    train_x, train_y = _data("logit-bernoulli")
    test_x = _test_inputs(train_x)
    autograd = IterNCGPModel(train_x, train_y, AutogradLogitBernoulli(), **CONVERGED)
    closed = IterNCGPModel(train_x, train_y, LogitBernoulliLikelihood(), **CONVERGED)
    assert isinstance(autograd.variational_strategy.adapter, AutogradAdapter)
    assert not isinstance(closed.variational_strategy.adapter, AutogradAdapter)
    assert autograd.variational_strategy.fit().converged and closed.variational_strategy.fit().converged
    torch.testing.assert_close(autograd.variational_strategy.mode, closed.variational_strategy.mode, rtol=0, atol=1e-8)
    mean, variance, _ = _posterior(autograd, test_x)
    mean_ref, variance_ref, _ = _posterior(closed, test_x)
    torch.testing.assert_close(mean, mean_ref, rtol=0, atol=1e-8)
    torch.testing.assert_close(variance, variance_ref, rtol=0, atol=1e-8)


def test_autograd_gaussian_is_exact_gp_regression():
    """For a Gaussian likelihood Newton converges in one step to the exact GP posterior (dense reference)."""
    train_x, _ = binary_data(num_data=30)
    train_y = torch.sin(6 * train_x[:, 0]) + 0.5
    test_x = _test_inputs(train_x)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    likelihood.noise = 0.05
    model = IterNCGPModel(train_x, train_y, likelihood, constant_mean=0.3, **CONVERGED)
    model.double()
    report = model.variational_strategy.fit()
    assert isinstance(model.variational_strategy.adapter, AutogradAdapter)
    assert report.converged and report.records[-1].relative_change < 1e-10
    # The first step already reached the mode: later steps take no solver iterations.
    assert all(step.solver_iterations == 0 for step in report.records[1:])
    noise = likelihood.noise.item()
    mean_constant = model.mean_module.constant.item()
    with torch.no_grad():
        joint = model.covar_module(torch.cat([train_x, test_x])).to_dense()
    kernel, cross, test_kernel = joint[:30, :30], joint[30:, :30], joint[30:, 30:]
    noisy = kernel + noise * torch.eye(30, dtype=torch.float64)
    weights = torch.linalg.solve(noisy, train_y - mean_constant)
    torch.testing.assert_close(
        model.variational_strategy.mode[:, 0], mean_constant + kernel @ weights, rtol=0, atol=1e-8
    )
    mean, _, covariance = _posterior(model, test_x)
    torch.testing.assert_close(mean, mean_constant + cross @ weights, rtol=0, atol=1e-8)
    expected_covariance = test_kernel - cross @ torch.linalg.solve(noisy, cross.mT)
    torch.testing.assert_close(covariance, expected_covariance, rtol=0, atol=1e-8)


def test_autograd_softmax_blocks_match_closed_form_mode():
    """C×C autograd curvature blocks (shifted to be positive definite) reach the closed-form softmax mode.

    At a fixed point of f = m + K (K + W̃^{-1})^{-1} (f - m + W̃^{-1} g) we have f = m + K g(f), the MAP
    condition, for any positive definite W̃: so the mode does not depend on how W is regularised.
    """
    train_x, train_y = _data("softmax", num_data=30)
    autograd = IterNCGPModel(train_x, train_y, AutogradSoftmax(num_classes=3, mixing_weights=False), **CONVERGED)
    closed = IterNCGPModel(train_x, train_y, _softmax(), **CONVERGED)
    assert isinstance(autograd.variational_strategy.adapter, AutogradAdapter)
    assert autograd.variational_strategy.num_latents == 3
    autograd.variational_strategy.fit()
    closed.variational_strategy.fit()
    torch.testing.assert_close(autograd.variational_strategy.mode, closed.variational_strategy.mode, rtol=0, atol=1e-7)


# ---------------------------------------------------------------------------------------------------
# Shared kernel vs one GP per class
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [CONVERGED, {}], ids=["converged", "default"])
def test_shared_kernel_equals_batched_identical_kernels(options):
    train_x, train_y = _data("softmax")
    test_x = _test_inputs(train_x)
    shared, shared_report = _fit("softmax", train_x, train_y, **options)
    batched, batched_report = _fit("softmax", train_x, train_y, batch_classes=3, **options)
    assert batched.covar_module.outputscale.shape == (3,)  # really three kernels
    assert shared_report.steps == batched_report.steps
    torch.testing.assert_close(shared.variational_strategy.mode, batched.variational_strategy.mode, rtol=0, atol=1e-8)
    mean, variance, covariance = _posterior(shared, test_x)
    mean_b, variance_b, covariance_b = _posterior(batched, test_x)
    assert mean.shape == (7, 3) and covariance.shape == (21, 21)
    torch.testing.assert_close(mean, mean_b, rtol=0, atol=1e-8)
    torch.testing.assert_close(variance, variance_b, rtol=0, atol=1e-8)
    torch.testing.assert_close(covariance, covariance_b, rtol=0, atol=1e-8)


def test_custom_policy_without_rows_is_refused_where_the_state_is_held_by_rows(monkeypatch):
    """With ``shard_state`` the policy is prepared with this rank's rows; a custom ``Policy`` whose ``prepare`` has no
    ``rows`` gets a ``TypeError`` that names the fix (one process stands in for a rank holding all rows)."""
    from gpytorch_iterncgp.core.policies import ConjugateGradientPolicy, Policy
    from gpytorch_iterncgp.core.sharding import ShardedRowBlock

    class OldStyle(ConjugateGradientPolicy):
        def prepare(self, num_data, num_latents, zero_sum_actions, observed=None):
            super().prepare(num_data, num_latents, zero_sum_actions, observed)

    x, y = binary_data(30, seed=3)
    model = IterNCGPModel(x, y, LogitBernoulliLikelihood(), policy=OldStyle())
    strategy = model.variational_strategy
    monkeypatch.setattr(strategy, "_rows_block", lambda: ShardedRowBlock(0, 30, 30, [(0, 30)], None))
    with pytest.raises(TypeError, match="accept rows=\\(start, stop\\) in prepare"):
        strategy._prepare_loop()
    assert issubclass(OldStyle, Policy)
    strategy.policy = ConjugateGradientPolicy()  # the package's policies take rows
    strategy._prepare_loop()


def test_the_strategy_contract_is_checked():
    """``OuterLoopStrategy`` is an abstract base: a subclass that leaves out a member of the contract cannot be built
    (``abc``), and one whose step limit is not a field of its options is refused naming it."""
    from gpytorch_iterncgp import IterNCGPStrategy
    from gpytorch_iterncgp.strategies.base import OuterLoopStrategy

    x, y = binary_data(20)

    class NoLoop(IterNCGPStrategy):
        _make_loop = OuterLoopStrategy._make_loop  # the abstract one

    with pytest.raises(TypeError, match="abstract method.*_make_loop"):
        IterNCGPModel(x, y, LogitBernoulliLikelihood(), strategy_class=NoLoop)

    class WrongLimit(IterNCGPStrategy):
        max_steps_option = "max_sweeps"

    with pytest.raises(TypeError, match="WrongLimit.max_steps_option must name a field of SolverOptions"):
        IterNCGPModel(x, y, LogitBernoulliLikelihood(), strategy_class=WrongLimit)
