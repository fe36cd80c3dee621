"""``gpytorch_iterncgp.integrations.botorch.IterNCGPBoTorchModel``: BoTorch acquisition functions on the latent posterior.

References: the strategy's own joint posterior (``model(x)`` in eval mode) per batch element, scikit-learn's
``GaussianProcessClassifier`` (exact Laplace latent moments, logit link), the closed-form expected
improvement of a Gaussian, and central finite differences for the gradient with respect to ``X``.
Skipped when BoTorch is not installed (``pip install -e ".[botorch]"``).
"""

from __future__ import annotations

import math
import warnings

import gpytorch
import numpy as np
import pytest
import torch

from tests.common import settings_snapshot


def _restore(snapshot: dict) -> None:
    for (setting, attribute), value in snapshot.items():
        setattr(setting, attribute, value)


# Importing BoTorch changes linear_operator's global settings (max_cholesky_size 800 -> 4096, fast
# computations off, ...). pytest imports every test module before running any test, so without this the
# whole session would run under BoTorch's settings: they apply to this module's tests only.
_DEFAULT_SETTINGS = settings_snapshot()
pytest.importorskip("botorch")
_BOTORCH_SETTINGS = settings_snapshot()
_restore(_DEFAULT_SETTINGS)

from botorch.acquisition import PosteriorMean, qExpectedImprovement  # noqa: E402
from botorch.acquisition.objective import ScalarizedPosteriorTransform  # noqa: E402
from botorch.optim import optimize_acqf  # noqa: E402
from botorch.posteriors import GPyTorchPosterior  # noqa: E402
from botorch.sampling import SobolQMCNormalSampler  # noqa: E402

from gpytorch_iterncgp import ExpPoissonLikelihood  # noqa: E402
from gpytorch_iterncgp.integrations.botorch import IterNCGPBoTorchModel  # noqa: E402
from gpytorch_iterncgp.integrations.sklearn import IterNCGPClassifier  # noqa: E402
from tests.common import IterNCGPModel, count_data, multiclass_data, softmax_likelihood  # noqa: E402

DTYPE = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _botorch_settings():
    """This module's tests run under the settings a BoTorch user has; the others under the defaults."""
    _restore(_BOTORCH_SETTINGS)
    yield
    _restore(_DEFAULT_SETTINGS)


@pytest.fixture(scope="module")
def poisson_model():
    x, y = count_data(num_data=50)
    model = IterNCGPModel(x, y, ExpPoissonLikelihood(), lengthscale=0.2, outputscale=2.0)
    model.variational_strategy.fit()
    return model


def _inputs(*shape, seed=0, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, dtype=DTYPE, generator=generator).requires_grad_(requires_grad)


def test_posterior_is_the_strategys_joint_posterior_per_batch(poisson_model):
    """batch × q × d: each batch element's mean and q × q covariance equal the strategy's posterior."""
    surrogate = IterNCGPBoTorchModel(poisson_model)
    X = _inputs(4, 3, 1)
    posterior = surrogate.posterior(X)
    assert isinstance(posterior, GPyTorchPosterior) and surrogate.num_outputs == 1
    assert posterior.mean.shape == (4, 3, 1) and posterior.variance.shape == (4, 3, 1)
    poisson_model.eval()
    with torch.no_grad():
        for b in range(4):
            latent = poisson_model(X[b])
            torch.testing.assert_close(posterior.mean[b, :, 0], latent.mean, rtol=0, atol=1e-12)
            torch.testing.assert_close(
                posterior.distribution.covariance_matrix[b], latent.covariance_matrix, rtol=0, atol=1e-12
            )
    # no batch dimension: q × d
    torch.testing.assert_close(surrogate.posterior(X[0]).mean, posterior.mean[0])


def test_posterior_equals_exact_laplace_of_sklearn_gpc():
    """Logit classifier solved exactly (unit actions, all N): the posterior is scikit-learn's Laplace one."""
    pytest.importorskip("sklearn", minversion="1.7")  # latent_mean_and_variance
    from sklearn.gaussian_process import GaussianProcessClassifier
    from sklearn.gaussian_process.kernels import ConstantKernel, Matern

    rng = np.random.RandomState(0)
    x = rng.uniform(-2, 2, size=(60, 2))
    y = (rng.uniform(size=60) < 1 / (1 + np.exp(-3 * np.sin(2 * x[:, 0])))).astype(int)
    classifier = IterNCGPClassifier(
        inference="laplace",
        solver_options=dict(policy="unit", max_solver_iterations=None, abs_tol=1e-12, rel_tol=1e-12, outer_tol=1e-12),
        optimizer_steps=0,
        standardize=False,
    ).fit(x, y)
    surrogate = IterNCGPBoTorchModel(classifier)  # a fitted estimator works too
    X = torch.as_tensor(rng.uniform(-2, 2, size=(5, 1, 2)))
    posterior = surrogate.posterior(X)
    theirs = GaussianProcessClassifier(
        ConstantKernel(1.0, "fixed") * Matern(math.sqrt(2), "fixed", nu=2.5), optimizer=None
    )
    mean, variance = theirs.fit(x, y).latent_mean_and_variance(X[:, 0].numpy())
    np.testing.assert_allclose(posterior.mean[:, 0, 0].detach().numpy(), mean, atol=1e-6)
    np.testing.assert_allclose(posterior.variance[:, 0, 0].detach().numpy(), variance, atol=1e-6)


def test_posterior_mean_acquisition_and_its_gradient(poisson_model):
    """PosteriorMean on b × 1 × d: values are the latent mean; d/dX by autograd equals central differences."""
    surrogate = IterNCGPBoTorchModel(poisson_model)
    X = _inputs(5, 1, 1, requires_grad=True)
    values = PosteriorMean(surrogate)(X)
    poisson_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(values, poisson_model(X[:, 0]).mean, rtol=0, atol=1e-12)
    values.sum().backward()
    step = 1e-6
    with torch.no_grad():
        upper = PosteriorMean(surrogate)(X + step)
        lower = PosteriorMean(surrogate)(X - step)
    torch.testing.assert_close(X.grad[:, 0, 0], (upper - lower) / (2 * step), rtol=1e-5, atol=1e-6)


def test_q_expected_improvement_runs_with_gradients_and_matches_closed_form(poisson_model):
    """qEI over q = 2 points is finite, non-negative and differentiable in X; for q = 1 and 2^14 QMC
    samples it equals the closed form σ φ(z) + (μ − f*) Φ(z) of the latent marginals (2 % relative)."""
    surrogate = IterNCGPBoTorchModel(poisson_model)
    best = float(poisson_model.variational_strategy.mode.max())
    X = _inputs(6, 2, 1, seed=1, requires_grad=True)
    with warnings.catch_warnings():  # BoTorch recommends qLogExpectedImprovement; qEI is what we test here
        warnings.simplefilter("ignore")
        acquisition = qExpectedImprovement(surrogate, best_f=best)
    values = acquisition(X)
    assert values.shape == (6,) and bool(torch.isfinite(values).all()) and bool((values >= 0).all())
    values.sum().backward()
    assert X.grad is not None and bool(torch.isfinite(X.grad).all()) and float(X.grad.abs().sum()) > 0

    X1 = _inputs(8, 1, 1, seed=2)
    sampler = SobolQMCNormalSampler(sample_shape=torch.Size([2**14]), seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mc = qExpectedImprovement(surrogate, best_f=best, sampler=sampler)
    with torch.no_grad():
        estimate = mc(X1)
        mean, variance = poisson_model.variational_strategy.marginal_latent(X1[:, 0])
    sigma = variance[:, 0].sqrt()
    z = (mean[:, 0] - best) / sigma
    normal = torch.distributions.Normal(0.0, 1.0)
    closed_form = sigma * normal.log_prob(z).exp() + (mean[:, 0] - best) * normal.cdf(z)
    torch.testing.assert_close(estimate, closed_form, rtol=2e-2, atol=1e-4)


def test_optimize_acqf_finds_the_latent_maximum(poisson_model):
    """End to end: BoTorch's optimize_acqf on PosteriorMean finds the maximum of the latent mean on [0, 1]
    (the reference: the latent mean on a fine grid)."""
    surrogate = IterNCGPBoTorchModel(poisson_model)
    bounds = torch.tensor([[0.0], [1.0]], dtype=DTYPE)
    candidate, value = optimize_acqf(PosteriorMean(surrogate), bounds=bounds, q=1, num_restarts=4, raw_samples=64)
    grid = torch.linspace(0, 1, 2001, dtype=DTYPE)[:, None]
    with torch.no_grad():
        grid_mean = poisson_model.variational_strategy.marginal_latent(grid)[0][:, 0]
    assert float(value) >= float(grid_mean.max()) - 1e-4


def test_multiclass_posterior_and_scalarized_acquisition():
    """Softmax (C = 3): a batch × q × C multitask posterior equal to the strategy's per batch element;
    output_indices selects latents; a ScalarizedPosteriorTransform feeds PosteriorMean."""
    x, y = multiclass_data(num_data=40)
    model = IterNCGPModel(x, y, softmax_likelihood(3), lengthscale=0.3)
    model.variational_strategy.fit()
    surrogate = IterNCGPBoTorchModel(model)
    assert surrogate.num_outputs == 3
    X = _inputs(3, 2, 2, seed=4)
    posterior = surrogate.posterior(X)
    assert posterior.mean.shape == (3, 2, 3)
    model.eval()
    with torch.no_grad():
        for b in range(3):
            latent = model(X[b])
            torch.testing.assert_close(posterior.mean[b], latent.mean, rtol=0, atol=1e-12)
            torch.testing.assert_close(
                posterior.distribution.covariance_matrix[b], latent.covariance_matrix, rtol=0, atol=1e-12
            )
    single = surrogate.posterior(X, output_indices=[1])
    torch.testing.assert_close(single.mean[..., 0], posterior.mean[..., 1])
    torch.testing.assert_close(single.variance[..., 0], posterior.variance[..., 1])
    weights = torch.tensor([1.0, -1.0, 0.0], dtype=DTYPE)
    transform = ScalarizedPosteriorTransform(weights)
    Xq = _inputs(4, 1, 2, seed=5, requires_grad=True)
    values = PosteriorMean(surrogate, posterior_transform=transform)(Xq)
    with torch.no_grad():
        expected = surrogate.posterior(Xq).mean[:, 0] @ weights
    torch.testing.assert_close(values, expected)
    values.sum().backward()
    assert bool(torch.isfinite(Xq.grad).all())


def test_refuses_observation_noise_and_wrong_models(poisson_model):
    surrogate = IterNCGPBoTorchModel(poisson_model)
    with pytest.raises(NotImplementedError, match="observation_noise"):
        surrogate.posterior(_inputs(2, 1, 1), observation_noise=True)
    with pytest.raises(ValueError, match="features"):
        surrogate.posterior(_inputs(2, 1, 3))
    with pytest.raises(TypeError, match="IterNCGPStrategy"):
        IterNCGPBoTorchModel(gpytorch.kernels.RBFKernel())


def test_posterior_of_an_ep_classifier_is_its_latent_posterior():
    """An EP estimator (``inference="ep"``) wraps too: the posterior is the EP strategy's latent posterior."""
    from gpytorch_iterncgp.sklearn import IterNCGPClassifier

    rng = np.random.RandomState(1)
    x = rng.uniform(-2, 2, size=(50, 2))
    y = (rng.uniform(size=50) < 1 / (1 + np.exp(-3 * np.sin(2 * x[:, 0])))).astype(int)
    classifier = IterNCGPClassifier(inference="ep", optimizer_steps=0).fit(x, y)
    test = rng.uniform(-2, 2, size=(4, 2))
    posterior = IterNCGPBoTorchModel(classifier).posterior(torch.as_tensor(test[:, None, :]))
    mean, std = classifier.predict_latent(test)
    np.testing.assert_allclose(posterior.mean[:, 0, 0].detach().numpy(), mean, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(posterior.variance[:, 0, 0].detach().numpy(), std**2, rtol=1e-10, atol=1e-12)
