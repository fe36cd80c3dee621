"""The scikit-learn estimators of ``gpytorch_iterncgp.integrations.sklearn``.

* scikit-learn's own estimator checks (``parametrize_with_checks``);
* numbers against independent references: scikit-learn's ``GaussianProcessClassifier`` (logit link,
  fixed kernel: latent mean and variance, log evidence), the dense exact Laplace implementation of
  ``tests/reference.py`` on kernel matrices built by scikit-learn's ``Matern`` (probit, softmax,
  Poisson with integer and with non-integer targets), and the underlying strategy's own predictions;
* a kernel with priors: ``log_marginal_likelihood()`` is scikit-learn's evidence, the learning's objective adds the
  log prior (scipy.stats), and the hyperparameters learnt are the MAP estimate of scikit-learn's evidence;
* label mapping, validation errors, hyperparameter learning, seeding, and that ``import gpytorch_iterncgp``
  leaves scikit-learn unimported.
"""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
import warnings

import gpytorch
import numpy as np
import pytest
import torch
from linear_operator.utils.errors import NanError

pytest.importorskip("sklearn", minversion="1.7")  # GaussianProcessClassifier.latent_mean_and_variance

from sklearn.base import clone  # noqa: E402
from sklearn.gaussian_process import GaussianProcessClassifier  # noqa: E402
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, Matern  # noqa: E402
from sklearn.utils.estimator_checks import parametrize_with_checks  # noqa: E402

from gpytorch_iterncgp import LaplaceMarginalLogLikelihood  # noqa: E402
from gpytorch_iterncgp.integrations.sklearn import IterNCGPClassifier, IterNCGPPoissonRegressor  # noqa: E402
from gpytorch_iterncgp.learning import estimator_policy  # noqa: E402
from gpytorch_iterncgp.learning.estimator_policy import (  # noqa: E402
    DEFAULT_SOLVER_ITERATIONS,
    EP_POINTS_PER_BUDGET,
    EXACT_SOLVE_SIZE,
    default_kernel,
)
from gpytorch_iterncgp.likelihoods.adapters import softmax_gaussian
from tests import reference  # noqa: E402

# Tiny settings for scikit-learn's checks (dozens of fits on up to 300 points); the hyperparameter path
# runs (two Adam steps) in the default classifier and the regressor.
FAST = dict(optimizer_steps=2, random_state=0)
EP_BUDGET = dict(solver_options={"max_sweeps": 5, "max_solver_iterations": 5})
LAPLACE_BUDGET = dict(solver_options={"max_newton_steps": 5, "max_solver_iterations": 5})
CHECKED = [
    IterNCGPClassifier(**FAST, **EP_BUDGET),  # EP (inference="auto")
    IterNCGPClassifier(link="probit", **{**FAST, "optimizer_steps": 0}, **EP_BUDGET),
    IterNCGPPoissonRegressor(**FAST, **LAPLACE_BUDGET),  # Laplace
]
CHECKED_SLOW = [IterNCGPClassifier(inference="laplace", **FAST, **LAPLACE_BUDGET)]  # the first's facade, with -m slow
# Every solve exact: unit-vector actions until the residual vanishes (all N of them, so the precision
# C = QQ^T is the exact (K + W^-1)^-1 and the covariance the exact Laplace covariance), Newton to 1e-12.
TIGHT = dict(
    standardize=False,  # the references' kernels act on the features as given
    inference="laplace",
    solver_options=dict(
        policy="unit", max_solver_iterations=None, abs_tol=1e-12, rel_tol=1e-12, outer_tol=1e-12, max_newton_steps=100
    ),
    optimizer_steps=0,
)


def expected_failed_checks(estimator) -> dict[str, str]:
    """Checks an estimator is known to fail, with the reason (see README, "scikit-learn and BoTorch").

    None at present: with the settings above every applicable check passes. (pandas and array-API
    checks are skipped by scikit-learn itself when those libraries are not installed.)
    """
    return {}


# The checks' budgets (5 Newton steps or EP sweeps) stop some fits before they converge, on purpose: scikit-learn's own
# estimator tests ignore the ConvergenceWarning that says so.
@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
@parametrize_with_checks(CHECKED, expected_failed_checks=expected_failed_checks)
def test_sklearn_estimator_checks(estimator, check):
    check(estimator)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
@parametrize_with_checks(CHECKED_SLOW, expected_failed_checks=expected_failed_checks)
def test_sklearn_estimator_checks_slow(estimator, check):
    check(estimator)


# ---------------------------------------------------------------------------------------------------
# Data and references
# ---------------------------------------------------------------------------------------------------
def _binary(num=70, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.uniform(-2, 2, size=(num, 2))
    latent = 2 * np.sin(2 * x[:, 0]) + x[:, 1]
    y = (rng.uniform(size=num) < 1 / (1 + np.exp(-latent))).astype(int)
    return x, y, rng.uniform(-2.5, 2.5, size=(25, 2))


def _multiclass(num=60, classes=3, seed=1):
    rng = np.random.RandomState(seed)
    x = rng.uniform(-2, 2, size=(num, 2))
    centres = rng.uniform(-2, 2, size=(classes, 2))
    logits = -2 * ((x[:, None, :] - centres[None]) ** 2).sum(-1)
    probabilities = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    y = np.array([rng.choice(classes, p=p) for p in probabilities])
    return x, y, rng.uniform(-2.5, 2.5, size=(20, 2))


def _counts(num=50, seed=2):
    rng = np.random.RandomState(seed)
    x = rng.uniform(0, 3, size=(num, 1))
    y = rng.poisson(np.exp(1 + np.sin(2 * x[:, 0])))
    return x, y, rng.uniform(0, 3, size=(15, 1))


def _matern(x1, x2, lengthscale, outputscale=1.0):
    """The default kernel of the estimators (scaled Matérn-5/2), computed by scikit-learn."""
    return torch.as_tensor((ConstantKernel(outputscale) * Matern(lengthscale, nu=2.5))(x1, x2))


def _reference_latent(x, y, x_test, likelihood, num_classes=1, prior_mean=0.0, blocks=False):
    """Exact Laplace latent mean and variance at ``x_test`` (``(M, C)``), dense, default kernel (shared);
    with ``blocks`` each point's ``(C, C)`` covariance ``(M, C, C)`` instead of the variance."""
    lengthscale = math.sqrt(x.shape[1])
    kernel = reference.data_major(_matern(x, x, lengthscale), num_classes)
    cross = reference.data_major(_matern(x_test, x, lengthscale), num_classes)
    test = reference.data_major(_matern(x_test, x_test, lengthscale), num_classes)
    mean = torch.full((len(x) * num_classes,), prior_mean, dtype=torch.float64)
    laplace = reference.laplace_mode(kernel, mean, torch.as_tensor(y, dtype=torch.float64), likelihood, num_classes)
    assert laplace.converged
    test_mean = torch.full((len(x_test) * num_classes,), prior_mean, dtype=torch.float64)
    latent_mean, covariance = laplace.predict(cross, test, test_mean)
    shape = (len(x_test), num_classes)
    if blocks:
        dense = covariance.reshape(len(x_test), num_classes, len(x_test), num_classes)
        point_blocks = torch.stack([dense[n, :, n, :] for n in range(len(x_test))])
        return latent_mean.reshape(shape).numpy(), point_blocks.numpy()
    return latent_mean.reshape(shape).numpy(), covariance.diagonal().reshape(shape).numpy()


# ---------------------------------------------------------------------------------------------------
# Numbers against independent references
# ---------------------------------------------------------------------------------------------------
def _assert_latent_matches_sklearn(ours, x, y, x_test):
    """Latent mean and variance of ``ours`` against ``GaussianProcessClassifier`` with the default kernel fixed (1e-6);
    returns scikit-learn's classifier and its moments."""
    kernel = ConstantKernel(1.0, "fixed") * Matern(math.sqrt(2), "fixed", nu=2.5)
    theirs = GaussianProcessClassifier(kernel, optimizer=None).fit(x, y)
    mean, std = ours.predict_latent(x_test)
    ref_mean, ref_variance = theirs.latent_mean_and_variance(x_test)
    np.testing.assert_allclose(mean, ref_mean, atol=1e-6)
    np.testing.assert_allclose(std**2, ref_variance, atol=1e-6)
    return theirs, ref_mean, ref_variance


def test_binary_logit_matches_sklearn_gaussian_process_classifier():
    """Logit link, default kernel fixed: latent mean/variance and log evidence equal scikit-learn's GPC
    (R&W Algorithms 3.1, 3.2, 5.1) to 1e-6. Probabilities: ours are E[σ(f)] by quadrature, checked against
    scipy's ``quad`` on scikit-learn's moments (1e-6, the moments' agreement), and against scikit-learn's own,
    a 5-term erf expansion of the same integral (R&W sec. 3.4), to 1e-3."""
    from scipy.integrate import quad
    from scipy.special import expit

    x, y, x_test = _binary()
    ours = IterNCGPClassifier(**TIGHT).fit(x, y)
    theirs, ref_mean, ref_variance = _assert_latent_matches_sklearn(ours, x, y, x_test)
    np.testing.assert_allclose(ours.log_marginal_likelihood(), theirs.log_marginal_likelihood_value_, atol=1e-6)

    def integral(m, s):
        density = lambda z: expit(m + s * z) * math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)  # noqa: E731
        return quad(density, -40, 40, epsabs=1e-13, epsrel=1e-12, limit=500)[0]

    expected = [integral(m, math.sqrt(v)) for m, v in zip(ref_mean, ref_variance, strict=True)]
    np.testing.assert_allclose(ours.predict_proba(x_test)[:, 1], expected, atol=1e-6)
    np.testing.assert_allclose(ours.predict_proba(x_test), theirs.predict_proba(x_test), atol=1e-3)
    np.testing.assert_array_equal(ours.predict(x_test), theirs.predict(x_test))


def _kernel_with_priors(num_features: int):
    """The default kernel with a Gamma(3, 2) prior on the outputscale and a log-normal(0, 0.5) one on the
    lengthscale (GPyTorch's ``register_prior``), and their log-density by scipy.stats at ``(outputscale, lengthscale)``."""
    from scipy import stats

    kernel = default_kernel(num_features)
    kernel.register_prior(
        "outputscale_prior",
        gpytorch.priors.GammaPrior(3.0, 2.0),
        lambda module: module.outputscale,
        lambda module, value: module._set_outputscale(value),
    )
    kernel.base_kernel.register_prior(
        "lengthscale_prior",
        gpytorch.priors.LogNormalPrior(0.0, 0.5),
        lambda module: module.lengthscale,
        lambda module, value: module._set_lengthscale(value),
    )

    def log_prior(outputscale: float, lengthscale: float) -> float:
        return float(stats.gamma(3.0, scale=1 / 2.0).logpdf(outputscale) + stats.lognorm(0.5).logpdf(lengthscale))

    return kernel, log_prior


def _sklearn_evidence_at(estimator, x, y) -> tuple[float, float, float]:
    """scikit-learn's Laplace evidence (``log_marginal_likelihood(theta)``) for Constant * Matérn-5/2 at the fitted
    estimator's outputscale and lengthscale, and those two."""
    outputscale = float(estimator.kernel_.outputscale.detach())
    lengthscale = float(estimator.kernel_.base_kernel.lengthscale.detach())
    kernel = ConstantKernel(1.0, (1e-5, 1e5)) * Matern(1.0, (1e-5, 1e5), nu=2.5)
    theirs = GaussianProcessClassifier(kernel, optimizer=None).fit(x, y)
    return theirs.log_marginal_likelihood(np.log([outputscale, lengthscale])), outputscale, lengthscale


def test_log_marginal_likelihood_with_priors_is_sklearns_evidence_and_the_objective_adds_the_log_prior():
    """A kernel with priors, fixed: ``log_marginal_likelihood()`` is the evidence alone, scikit-learn's number at the
    same kernel; the objective the learning maximises (``N`` times the model's evidence object) is that plus the log
    prior by scipy.stats."""
    x, y, _ = _binary()
    kernel, log_prior = _kernel_with_priors(x.shape[1])
    ours = IterNCGPClassifier(kernel, **TIGHT).fit(x, y)
    expected, outputscale, lengthscale = _sklearn_evidence_at(ours, x, y)
    assert (outputscale, lengthscale) == pytest.approx((1.0, math.sqrt(2)), rel=1e-7)  # the default kernel, fixed
    np.testing.assert_allclose(ours.log_marginal_likelihood(), expected, atol=1e-6)
    model = ours.model_
    mll = LaplaceMarginalLogLikelihood(ours.likelihood_, model)
    model.train()
    strategy = model.variational_strategy
    with torch.no_grad():
        objective = float(mll(model(strategy.train_inputs), strategy.train_targets)) * len(x)
    np.testing.assert_allclose(objective, expected + log_prior(outputscale, lengthscale), atol=1e-6)
    assert abs(log_prior(outputscale, lengthscale)) > 0.1  # the two differ


def test_hyperparameters_learnt_with_priors_are_the_map_estimate_of_sklearns_evidence():
    """Learnt with the priors (L-BFGS on the exact evidence): the maximum of scikit-learn's evidence plus the log
    prior (scipy.stats), found by scipy's L-BFGS-B over the log hyperparameters; at it, ``log_marginal_likelihood()``
    is scikit-learn's evidence alone. Not the maximum of the evidence alone (scikit-learn's own optimum)."""
    from scipy.optimize import minimize

    x, y, _ = _binary(num=80, seed=5)
    kernel, log_prior = _kernel_with_priors(x.shape[1])
    learnt = IterNCGPClassifier(kernel, **{**TIGHT, "optimizer_steps": 60}).fit(x, y)
    evidence, outputscale, lengthscale = _sklearn_evidence_at(learnt, x, y)
    np.testing.assert_allclose(learnt.log_marginal_likelihood(), evidence, atol=1e-6)
    theirs = GaussianProcessClassifier(ConstantKernel() * Matern(nu=2.5), optimizer=None).fit(x, y)

    def negative_log_posterior(theta):
        return -(theirs.log_marginal_likelihood(theta) + log_prior(*np.exp(theta)))

    optimum = minimize(negative_log_posterior, np.log([1.0, math.sqrt(2)]), method="L-BFGS-B", options={"ftol": 1e-14})
    expected = np.exp(optimum.x)
    np.testing.assert_allclose([outputscale, lengthscale], expected, rtol=1e-2)
    assert -negative_log_posterior(np.log([outputscale, lengthscale])) >= -optimum.fun - 1e-4
    unregularised = GaussianProcessClassifier(
        ConstantKernel(1.0, (1e-3, 1e4)) * Matern(math.sqrt(2), (1e-2, 1e3), nu=2.5), random_state=0
    ).fit(x, y)
    no_prior = [unregularised.kernel_.k1.constant_value, unregularised.kernel_.k2.length_scale]
    assert np.abs(np.log(no_prior) - np.log(expected)).max() > 0.1  # the priors move the optimum


def test_binary_probit_matches_exact_laplace():
    """Probit link: latent moments against the dense exact Laplace reference; probabilities are exactly
    Φ(μ/√(1+σ²)) of the reference moments (1e-6)."""
    from scipy.special import ndtr

    x, y, x_test = _binary(seed=3)
    ours = IterNCGPClassifier(link="probit", **TIGHT).fit(x, y)
    ref_mean, ref_variance = _reference_latent(x, y, x_test, "probit")
    mean, std = ours.predict_latent(x_test)
    np.testing.assert_allclose(mean, ref_mean[:, 0], atol=1e-6)
    np.testing.assert_allclose(std**2, ref_variance[:, 0], atol=1e-6)
    expected = ndtr(ref_mean[:, 0] / np.sqrt(1 + ref_variance[:, 0]))
    np.testing.assert_allclose(ours.predict_proba(x_test)[:, 1], expected, atol=1e-6)


def test_multiclass_softmax_matches_exact_laplace():
    """Three classes, softmax, one kernel shared by the classes: latent moments against the dense exact
    Laplace reference (R&W Algorithm 3.3/3.4), probabilities against the softmax rule (tested on its own in
    tests/strategies/test_predictive.py) on each test point's 3 x 3 block of the reference covariance."""
    x, y, x_test = _multiclass()
    ours = IterNCGPClassifier(**TIGHT).fit(x, y)
    ref_mean, ref_covariance = _reference_latent(x, y, x_test, "softmax", num_classes=3, blocks=True)
    ref_variance = np.diagonal(ref_covariance, axis1=1, axis2=2)
    mean, std = ours.predict_latent(x_test)
    np.testing.assert_allclose(mean, ref_mean, atol=1e-6)
    np.testing.assert_allclose(std**2, ref_variance, atol=1e-6)
    expected = softmax_gaussian(torch.as_tensor(ref_mean), torch.as_tensor(ref_covariance)).numpy()
    proba, latent_std = ours.predict_proba(x_test, return_std=True)
    np.testing.assert_allclose(proba, expected, atol=1e-6)
    np.testing.assert_allclose(latent_std, np.sqrt(ref_variance), atol=1e-6)
    np.testing.assert_allclose(ours.predict_proba(x_test), proba, rtol=1e-12)


def test_kernel_per_class_matches_exact_laplace():
    """A GPyTorch kernel with ``batch_shape=[3]``: one independent GP per class (lengthscales 0.5, 1, 2),
    against the dense exact Laplace reference with the block-diagonal (data-major) prior."""
    x, y, x_test = _multiclass()
    batch = torch.Size([3])
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5, batch_shape=batch), batch_shape=batch)
    kernel = kernel.double()
    lengthscales = [0.5, 1.0, 2.0]
    kernel.base_kernel.lengthscale = torch.tensor(lengthscales, dtype=torch.float64).reshape(3, 1, 1)
    kernel.outputscale = torch.ones(3, dtype=torch.float64)
    ours = IterNCGPClassifier(kernel, **TIGHT).fit(x, y)

    def blocks(a, b):
        return reference.data_major(torch.stack([_matern(a, b, ell) for ell in lengthscales]))

    laplace = reference.laplace_mode(
        blocks(x, x), torch.zeros(3 * len(x), dtype=torch.float64), torch.as_tensor(y), "softmax", 3
    )
    zeros = torch.zeros(3 * len(x_test), dtype=torch.float64)
    ref_mean, ref_covariance = laplace.predict(blocks(x_test, x), blocks(x_test, x_test), zeros)
    mean, std = ours.predict_latent(x_test)
    np.testing.assert_allclose(mean, ref_mean.reshape(-1, 3).numpy(), atol=1e-6)
    np.testing.assert_allclose(std**2, ref_covariance.diagonal().reshape(-1, 3).numpy(), atol=1e-6)


@pytest.mark.parametrize("integer", [True, False], ids=["counts", "non-integer"])
def test_poisson_matches_exact_laplace(integer):
    """Exp link with a constant prior mean log(ȳ): expected counts exp(μ + σ²/2) from the dense exact
    Laplace reference. Non-integer targets go through the autograd quasi-likelihood; the reference's
    ℓ(f) = Σ y f − e^f − log Γ(y+1) is the same function of f for any y ≥ 0."""
    x, y, x_test = _counts()
    y = y if integer else y * 0.7 + 0.05
    ours = IterNCGPPoissonRegressor(**TIGHT).fit(x, y)
    offset = math.log(y.mean())
    ref_mean, ref_variance = _reference_latent(x, y, x_test, "poisson_exp", prior_mean=offset)
    np.testing.assert_allclose(ours.model_.mean_module.constant.item(), offset, rtol=1e-12)
    expected = np.exp(ref_mean[:, 0] + ref_variance[:, 0] / 2)
    prediction, latent_std = ours.predict(x_test, return_std=True)
    np.testing.assert_allclose(prediction, expected, rtol=1e-6)
    np.testing.assert_allclose(latent_std, np.sqrt(ref_variance[:, 0]), atol=1e-6)


@pytest.mark.parametrize("case", ["binary", "multiclass"])
def test_predict_proba_is_the_strategys_predictive_probabilities(case):
    """With the default (inexact, computationally uncertain) solver: the estimator only converts (and standardises
    the features)."""
    x, y, x_test = _binary() if case == "binary" else _multiclass()
    classifier = IterNCGPClassifier(optimizer_steps=0, random_state=0).fit(x, y)
    strategy = classifier.model_.variational_strategy
    inputs = torch.as_tensor(classifier.scaler_.transform(x_test))  # the kernel sees standardised features
    with torch.no_grad():
        expected = strategy.predictive_probabilities(inputs).numpy()
        mean, variance = strategy.marginal_latent(inputs)
    proba, std = classifier.predict_proba(x_test, return_std=True)
    if case == "binary":
        expected, mean, variance = np.stack([1 - expected, expected], 1), mean[:, 0], variance[:, 0]
    np.testing.assert_allclose(proba, expected, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(std, variance.sqrt().numpy(), rtol=1e-12)
    np.testing.assert_allclose(classifier.predict_latent(x_test)[0], mean.numpy(), rtol=1e-12)
    np.testing.assert_allclose(proba.sum(1), 1, atol=1e-12)


def test_poisson_predict_is_the_strategys_predictive_mean():
    x, y, x_test = _counts()
    regressor = IterNCGPPoissonRegressor(random_state=0, optimizer_steps=5).fit(x, y)
    with torch.no_grad():
        inputs = torch.as_tensor(regressor.scaler_.transform(x_test))
        expected = regressor.model_.variational_strategy.predictive_mean(inputs).numpy()
    np.testing.assert_allclose(regressor.predict(x_test), expected, rtol=1e-12)


def test_softplus_link_matches_gauss_hermite_of_latent():
    """Softplus link: E[softplus(f)] under the latent marginal by 60-point Gauss–Hermite (numpy)."""
    x, y, x_test = _counts()
    regressor = IterNCGPPoissonRegressor(link="softplus", optimizer_steps=0).fit(x, y)
    mean, std = regressor.predict_latent(x_test)
    nodes, weights = np.polynomial.hermite_e.hermegauss(60)
    samples = mean[:, None] + std[:, None] * nodes[None]
    expected = (np.logaddexp(0, samples) * weights).sum(1) / weights.sum()
    np.testing.assert_allclose(regressor.predict(x_test), expected, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Labels, kernels, hyperparameters, seeding
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "labels", [np.array(["cat", "dog"]), np.array([-1, 1]), np.array([7.0, 3.0]), np.array([True, False])]
)
def test_labels_of_any_type_map_like_sklearn(labels):
    """Any two labels give the same probabilities as {0, 1} (columns in sorted label order)."""
    x, y, x_test = _binary()
    plain = IterNCGPClassifier(optimizer_steps=0).fit(x, y)
    relabelled = IterNCGPClassifier(optimizer_steps=0).fit(x, labels[y])
    order = np.argsort(labels)  # classes_ are sorted
    np.testing.assert_array_equal(relabelled.classes_, labels[order])
    np.testing.assert_allclose(relabelled.predict_proba(x_test), plain.predict_proba(x_test)[:, order], atol=1e-12)
    np.testing.assert_array_equal(relabelled.predict(x_test), labels[plain.predict(x_test)])


def test_multiclass_string_labels():
    x, y, x_test = _multiclass()
    names = np.array(["setosa", "versicolor", "virginica"])
    classifier = IterNCGPClassifier(optimizer_steps=0).fit(x, names[y])
    plain = IterNCGPClassifier(optimizer_steps=0).fit(x, y)
    assert classifier.n_classes_ == 3 and classifier.predict_proba(x_test).shape == (len(x_test), 3)
    np.testing.assert_array_equal(classifier.predict(x_test), names[plain.predict(x_test)])


def test_user_kernel_is_copied_and_matches_sklearn():
    """A GPyTorch RBF kernel: the estimator fits a copy (``kernel_``), the parameter is untouched, and with
    fixed hyperparameters the latent posterior equals scikit-learn's GPC with the same RBF kernel."""
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    kernel.base_kernel.lengthscale, kernel.outputscale = 0.8, 2.0
    before = [p.detach().clone() for p in kernel.parameters()]
    x, y, x_test = _binary()
    learnt = IterNCGPClassifier(kernel, optimizer_steps=3).fit(x, y)
    assert learnt.kernel_ is not kernel and learnt.kernel is kernel
    assert all(torch.equal(a, b) for a, b in zip(before, kernel.parameters(), strict=True))
    assert not torch.isclose(learnt.kernel_.outputscale, torch.tensor(2.0, dtype=torch.float64))
    ours = IterNCGPClassifier(kernel, **TIGHT).fit(x, y)
    theirs = GaussianProcessClassifier(ConstantKernel(2.0, "fixed") * RBF(0.8, "fixed"), optimizer=None).fit(x, y)
    ref_mean, ref_variance = theirs.latent_mean_and_variance(x_test)
    mean, std = ours.predict_latent(x_test)
    np.testing.assert_allclose(mean, ref_mean, atol=1e-6)
    np.testing.assert_allclose(std**2, ref_variance, atol=1e-6)
    clone(ours)  # deep-copies the kernel parameter


def test_hyperparameter_learning_reaches_sklearn_optimum():
    """L-BFGS on the exact Laplace evidence reaches scikit-learn's L-BFGS-B optimum for the same kernel family
    (Constant * Matérn-5/2, an interior optimum): the same evidence to 1e-4 nats and the same hyperparameters
    to 1%. Our evidence at scikit-learn's hyperparameters is scikit-learn's value (the same Laplace evidence)."""
    x, y, _ = _binary(num=80, seed=5)
    fixed = IterNCGPClassifier(**TIGHT).fit(x, y).log_marginal_likelihood()
    learnt = IterNCGPClassifier(**{**TIGHT, "optimizer_steps": 60}).fit(x, y)
    assert learnt.log_marginal_likelihood() > fixed + 1.0
    assert 1 < len(learnt.loss_curve_) <= 1.25 * 60 + 1
    kernel = ConstantKernel(1.0, (1e-3, 1e4)) * Matern(math.sqrt(2), (1e-2, 1e3), nu=2.5)
    theirs = GaussianProcessClassifier(kernel, random_state=0).fit(x, y)
    assert abs(learnt.log_marginal_likelihood() - theirs.log_marginal_likelihood_value_) < 1e-4
    np.testing.assert_allclose(float(learnt.kernel_.outputscale.detach()), theirs.kernel_.k1.constant_value, rtol=1e-2)
    lengthscale = float(learnt.kernel_.base_kernel.lengthscale.detach())
    np.testing.assert_allclose(lengthscale, theirs.kernel_.k2.length_scale, rtol=1e-2)
    optimum = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5)).double()
    optimum.outputscale = theirs.kernel_.k1.constant_value
    optimum.base_kernel.lengthscale = theirs.kernel_.k2.length_scale
    at_optimum = IterNCGPClassifier(optimum, **TIGHT).fit(x, y).log_marginal_likelihood()
    np.testing.assert_allclose(at_optimum, theirs.log_marginal_likelihood_value_, atol=1e-5)


@pytest.mark.slow  # about 9 s
def test_hyperparameter_learning_above_the_exact_evidence_size_is_adam():
    """Matrix-free (estimated) evidence: ``optimizer_steps`` Adam steps, and the evidence rises."""
    from gpytorch_iterncgp import settings

    x, y, _ = _binary(num=80, seed=5)
    with settings.exact_evidence_size(10):
        learnt = IterNCGPClassifier(optimizer_steps=30, random_state=0).fit(x, y)
    assert len(learnt.loss_curve_) == 30
    assert min(learnt.loss_curve_[-5:]) < learnt.loss_curve_[0] - 0.05


@pytest.mark.parametrize(
    "regime, failure",
    [
        ("exact (L-BFGS)", FloatingPointError),
        ("matrix-free (Adam)", FloatingPointError),
        ("matrix-free (Adam)", NanError),
        ("matrix-free (Adam)", RuntimeError),  # linear_operator's CG on a NaN product: a plain RuntimeError
    ],
)
def test_failing_evidence_keeps_the_best_hyperparameters(monkeypatch, regime, failure):
    """If the evidence fails after some evaluations (here: forced on the 4th call; linear_operator's CG raises a
    ``NanError`` when a product with K is not finite, its ``linear_cg`` a plain ``RuntimeError``), learning stops with a ConvergenceWarning and the model keeps the
    hyperparameters of the best evidence seen (recorded at every call); a failure at the initial hyperparameters is
    raised."""
    from sklearn.exceptions import ConvergenceWarning

    import gpytorch_iterncgp.learning.fit as learning
    from gpytorch_iterncgp import settings

    seen = []

    class FailingEvidence(estimator_policy.LaplaceMarginalLogLikelihood):
        def forward(self, function_dist, target, **kwargs):
            seen.append([p.detach().clone() for p in self.model.covar_module.parameters()])
            if len(seen) == fail_at:
                raise failure("NaNs encountered when trying to perform matrix-vector multiplication (forced)")
            return super().forward(function_dist, target, **kwargs)

    monkeypatch.setattr(estimator_policy, "LaplaceMarginalLogLikelihood", FailingEvidence)
    monkeypatch.setattr(learning, "LaplaceMarginalLogLikelihood", FailingEvidence)
    x, y, _ = _binary()
    fail_at = 4
    size = 1000 if regime.startswith("exact") else 10
    with settings.exact_evidence_size(size), pytest.warns(ConvergenceWarning, match="stopped after 3 evidence"):
        classifier = IterNCGPClassifier(inference="laplace", optimizer_steps=10, random_state=0).fit(x, y)
    assert len(classifier.loss_curve_) == 3
    best = int(np.argmin(classifier.loss_curve_))
    for ours, theirs in zip(classifier.kernel_.parameters(), seen[best], strict=True):
        torch.testing.assert_close(ours.detach(), theirs, rtol=0, atol=0)
    assert any(not torch.equal(a, b) for a, b in zip(seen[0], seen[2], strict=True))  # it did move
    fail_at, seen[:] = 1, []
    with settings.exact_evidence_size(size), pytest.raises(failure, match="forced"):
        IterNCGPClassifier(inference="laplace", optimizer_steps=10).fit(x, y)


def test_random_state_reproducible_and_global_rng_untouched():
    from gpytorch_iterncgp import settings

    x, y, x_test = _multiclass(num=90)  # N C = 270; forced matrix-free evidence is stochastic
    state = torch.random.get_rng_state()
    with settings.exact_evidence_size(10):
        unit = dict(solver_options={"policy": "unit"}, optimizer_steps=3, random_state=3)
        first = IterNCGPClassifier(**unit).fit(x, y)
        second = IterNCGPClassifier(**unit).fit(x, y)
    assert torch.equal(state, torch.random.get_rng_state())
    np.testing.assert_array_equal(first.predict_proba(x_test), second.predict_proba(x_test))
    assert first.loss_curve_ == second.loss_curve_


def test_pickle_round_trip_predicts_without_refitting():
    x, y, x_test = _counts()
    regressor = IterNCGPPoissonRegressor(random_state=0, optimizer_steps=3).fit(x, y)
    loaded = pickle.loads(pickle.dumps(regressor))
    np.testing.assert_array_equal(loaded.predict(x_test), regressor.predict(x_test))
    assert loaded.model_.variational_strategy._is_current()


# ---------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "estimator, x, y, message",
    [
        (IterNCGPClassifier(), [[np.nan, 1.0], [0.0, 1.0]], [0, 1], "Input X contains NaN"),
        (IterNCGPClassifier(), [[np.inf, 1.0], [0.0, 1.0]], [0, 1], "Input X contains infinity"),
        (IterNCGPClassifier(), np.zeros((3, 2, 2)), [0, 1, 0], "Found array with dim 3"),
        (IterNCGPClassifier(), np.zeros((3, 2)), [0, 1], "inconsistent numbers of samples"),
        (IterNCGPClassifier(), np.zeros((3, 2)), [0, 0, 0], "got 1 class"),
        (IterNCGPClassifier(), np.zeros((3, 2)), [0.5, 1.5, 2.5], "Unknown label type"),
        (
            IterNCGPClassifier(link="probit", inference="laplace"),
            np.zeros((3, 2)),
            [0, 1, 2],
            "Laplace's multi-class likelihood is the softmax",
        ),
        (IterNCGPClassifier(link="cauchit"), np.zeros((2, 2)), [0, 1], "'link' parameter of IterNCGPClassifier"),
        (IterNCGPClassifier(solver_options={"max_sweeps": -1}), np.zeros((2, 2)), [0, 1], "max_sweeps must be"),
        (IterNCGPClassifier(solver_options={"max_newton_steps": 2}), np.zeros((2, 2)), [0, 1], "no option of EP"),
        (IterNCGPClassifier(solver_options={"seed": 2}), np.zeros((2, 2)), [0, 1], "parameter random_state="),
        (IterNCGPClassifier(solver_options=[2]), np.zeros((2, 2)), [0, 1], "'solver_options' parameter"),
        (IterNCGPClassifier(kernel="rbf"), np.zeros((2, 2)), [0, 1], "'kernel' parameter"),
        (IterNCGPClassifier(solver_options={"policy": "random"}), np.zeros((2, 2)), [0, 1], "'solver_options' param"),
        (IterNCGPClassifier(learning_subset="all"), np.zeros((2, 2)), [0, 1], "'learning_subset' parameter"),
        (IterNCGPClassifier(learning_subset=1), np.zeros((2, 2)), [0, 1], "'learning_subset' parameter"),
        (IterNCGPPoissonRegressor(learning_subset=True), np.zeros((2, 1)), [1, 2], "'learning_subset' parameter"),
        (IterNCGPPoissonRegressor(), np.zeros((3, 1)), [1, -1, 2], "Some value\\(s\\) of y are negative"),
        (IterNCGPPoissonRegressor(), np.zeros((3, 1)), [1, np.nan, 2], "Input y contains NaN"),
        (IterNCGPPoissonRegressor(link="log"), np.zeros((2, 1)), [1, 2], "'link' parameter"),
    ],
)
def test_bad_input_raises_value_error(estimator, x, y, message):
    with pytest.raises(ValueError, match=message):
        estimator.fit(x, y)


def test_prediction_input_is_validated():
    x, y, _ = _binary()
    classifier = IterNCGPClassifier(optimizer_steps=0).fit(x, y)
    with pytest.raises(ValueError, match="X has 3 features, but IterNCGPClassifier is expecting 2"):
        classifier.predict(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="Input X contains NaN"):
        classifier.predict_proba([[np.nan, 0.0]])


def test_features_on_any_scale_fit_as_standardised_ones():
    """With the package's kernel (standardize="auto"), features scaled by 1e-3 to 4e3 and shifted fit and predict as
    their standardised values do (to rounding): ``scaler_`` holds the training rows' mean and standard deviation,
    ``feature_lengthscales_`` is the learnt lengthscale times each feature's standard deviation, a constant feature is
    centred only; ``standardize=False`` leaves the features as given (another model)."""
    generator = np.random.default_rng(3)
    x = generator.normal(size=(80, 3))
    y = (x[:, 0] + np.sin(2 * x[:, 1]) + 0.3 * generator.normal(size=80) > 0).astype(int)
    raw = np.column_stack([x * [1e-3, 1.0, 4e3] + [5.0, -2.0, 1e4], np.full(80, 7.0)])
    train, test = slice(0, 60), slice(60, 80)
    scaled = (raw - raw[train].mean(0)) / np.where(raw[train].std(0) > 0, raw[train].std(0), 1.0)
    fast = dict(optimizer_steps=3, random_state=0)
    reference_fit = IterNCGPClassifier(standardize=False, **fast).fit(scaled[train], y[train])
    fitted = IterNCGPClassifier(**fast).fit(raw[train], y[train])
    np.testing.assert_allclose(fitted.scaler_.mean_, raw[train].mean(0), rtol=1e-12)
    np.testing.assert_allclose(fitted.scaler_.scale_, np.where(raw[train].std(0) > 0, raw[train].std(0), 1.0))
    np.testing.assert_allclose(fitted.predict_proba(raw[test]), reference_fit.predict_proba(scaled[test]), atol=1e-6)
    lengthscale = float(fitted.kernel_.base_kernel.lengthscale.detach())
    np.testing.assert_allclose(fitted.feature_lengthscales_, lengthscale * fitted.scaler_.scale_, rtol=1e-12)
    assert reference_fit.scaler_ is None
    np.testing.assert_allclose(reference_fit.feature_lengthscales_, np.full(4, lengthscale), rtol=1e-5)
    unscaled = IterNCGPClassifier(standardize=False, optimizer_steps=0).fit(raw[train], y[train])
    assert unscaled.scaler_ is None
    assert np.abs(unscaled.predict_proba(raw[test]) - fitted.predict_proba(raw[test])).max() > 0.05
    own = IterNCGPClassifier(kernel=gpytorch.kernels.RBFKernel(), optimizer_steps=0).fit(x[train], y[train])
    assert own.scaler_ is None  # a kernel of one's own sees the features as given
    with pytest.raises(ValueError, match="'standardize' parameter"):
        IterNCGPClassifier(standardize="yes").fit(x, y)


def test_importing_the_package_does_not_import_sklearn_or_botorch():
    code = "import sys, gpytorch_iterncgp; print('sklearn' in sys.modules, 'botorch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2:] == ["False", "False"]


# ---------------------------------------------------------------------------------------------------
# Defaults: the solver budget, and scikit-learn's GaussianProcessClassifier on bundled data sets
# ---------------------------------------------------------------------------------------------------
def test_default_solver_budget_gives_the_exact_laplace_posterior_on_small_problems():
    """``max_solver_iterations="auto"`` with N C <= EXACT_SOLVE_SIZE: unit vectors to full rank, so the default
    classifier's latent mean *and variance* equal scikit-learn's exact Laplace posterior (fixed kernel)."""
    x, y, x_test = _binary()
    ours = IterNCGPClassifier(inference="laplace", optimizer_steps=0, random_state=0, standardize=False)
    ours.fit(x, y)
    budget = ours.solver_budget_
    assert len(x) <= EXACT_SOLVE_SIZE and budget["exact"] and budget["policy"] == "unit"
    assert budget["max_solver_iterations"] is None and "exact Laplace posterior" in budget["rule"]
    assert ours.model_.variational_strategy.state.precision_root.shape == (len(x), len(x))  # C has full rank
    theirs, ref_mean, ref_variance = _assert_latent_matches_sklearn(ours, x, y, x_test)


def test_default_solver_budget_above_the_exact_size_is_the_strategys_default():
    """N C > EXACT_SOLVE_SIZE: CG with the strategy's default budget; explicit settings are kept as given."""
    from gpytorch_iterncgp import SolverOptions

    assert DEFAULT_SOLVER_ITERATIONS == SolverOptions().max_solver_iterations  # the strategy's default option
    x, y, _ = _multiclass(num=EXACT_SOLVE_SIZE // 3 + 1)  # N C = 3 (EXACT_SOLVE_SIZE // 3 + 1) > EXACT_SOLVE_SIZE
    fast = dict(optimizer_steps=0, random_state=0)
    budget = IterNCGPClassifier(solver_options={"max_sweeps": 2}, **fast).fit(x, y).solver_budget_
    assert budget["policy"] == "cg" and budget["max_solver_iterations"] == DEFAULT_SOLVER_ITERATIONS
    assert not budget["exact"] and budget["solver_tol"] == 1e-5
    options = {"policy": "cg", "max_solver_iterations": None, "max_sweeps": 2}
    classifier = IterNCGPClassifier(solver_options=options, **fast).fit(x[:90], y[:90])
    assert classifier.solver_budget_["max_solver_iterations"] is None and not classifier.solver_budget_["exact"]
    options = {"policy": "cg", "max_sweeps": 2}  # small, CG asked for: to the tolerances
    classifier = IterNCGPClassifier(solver_options=options, **fast).fit(x[:90], y[:90])
    assert (
        classifier.solver_budget_["max_solver_iterations"] is None and classifier.solver_budget_["solver_tol"] == 1e-5
    )


def test_default_binary_ep_budget_grows_with_the_number_of_points():
    """Binary EP past EP_POINTS_PER_BUDGET points: DEFAULT_SOLVER_ITERATIONS per sweep for every EP_POINTS_PER_BUDGET
    points (rounded up); multi-class EP and Laplace keep the strategy's default, and a budget the user set is kept."""
    estimator = IterNCGPClassifier()
    for points, blocks in ((EP_POINTS_PER_BUDGET, 1), (EP_POINTS_PER_BUDGET + 1, 2), (25_000, 3)):
        budget, _ = estimator._solver_settings(0, points, 1, "ep")
        assert budget["max_solver_iterations"] == blocks * DEFAULT_SOLVER_ITERATIONS and budget["policy"] == "cg"
        assert f"at most {blocks * DEFAULT_SOLVER_ITERATIONS} solver iterations" in budget["rule"]
        for latents, inference in ((1, "laplace"), (10, "ep")):
            other, _ = estimator._solver_settings(0, points, latents, inference)
            assert other["max_solver_iterations"] == DEFAULT_SOLVER_ITERATIONS
    budget, _ = IterNCGPClassifier(solver_options={"max_solver_iterations": 7})._solver_settings(0, 25_000, 1, "ep")
    assert budget["max_solver_iterations"] == 7


def test_dense_ep_past_the_switch_names_stochastic_ep_when_it_does_not_converge(monkeypatch):
    """``inference="ep"`` on data where ``"auto"`` picks stochastic EP: a fit that stops before convergence says so and
    names ``'sparse_ep'``; below the switch the warning has no such hint (the switch lowered to 150 points here)."""
    from sklearn.exceptions import ConvergenceWarning

    x, y, _ = _binary(num=200)
    fast = dict(inference="ep", optimizer_steps=0, solver_options={"max_sweeps": 1}, random_state=0)
    monkeypatch.setattr(estimator_policy, "SPARSE_EP_POINTS", 150)
    assert len(x) > 150 and estimator_policy.auto_inference(len(x), 2) == "sparse_ep"
    with pytest.warns(ConvergenceWarning, match="stopped at max_sweeps=1") as caught:
        IterNCGPClassifier(**fast).fit(x, y)
    assert any("inference='auto' picks 'sparse_ep'" in str(warning.message) for warning in caught)
    with pytest.warns(ConvergenceWarning, match="stopped at max_sweeps=1") as caught:
        IterNCGPClassifier(**fast).fit(x[:150], y[:150])
    assert not any("sparse_ep" in str(warning.message) for warning in caught)


def test_multiclass_log_marginal_likelihood_matches_exact_laplace_evidence():
    """Softmax with a kernel shared by the classes (its prior has N, not N C, values)."""
    x, y, _ = _multiclass()
    classifier = IterNCGPClassifier(inference="laplace", optimizer_steps=0, standardize=False).fit(x, y)
    kernel = reference.data_major(_matern(x, x, math.sqrt(2)), 3)
    targets, mean = torch.as_tensor(y, dtype=torch.float64), torch.zeros(3 * len(x), dtype=torch.float64)
    expected, _ = reference.laplace_evidence(kernel, mean, targets, "softmax", 3)
    np.testing.assert_allclose(classifier.log_marginal_likelihood(), expected, rtol=1e-8)


def _protocol_split(name):
    """The protocol of benchmarks/sklearn_defaults.py: 70/30 stratified split, features standardised."""
    from sklearn.datasets import load_breast_cancer, load_digits, load_iris, load_wine
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    loaders = {"iris": load_iris, "breast_cancer": load_breast_cancer, "wine": load_wine, "digits1000": load_digits}
    x, y = loaders[name](return_X_y=True)
    if name == "digits1000":
        x, y = x[:1000], y[:1000]
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.3, stratify=y, random_state=0)
    scaler = StandardScaler().fit(x_train)
    return scaler.transform(x_train), scaler.transform(x_test), y_train, y_test


@pytest.mark.parametrize(
    "name",
    [
        "iris",
        "breast_cancer",
        "wine",
        pytest.param("digits1000", marks=pytest.mark.slow),  # about a minute
    ],
)
def test_defaults_match_or_beat_sklearn_gaussian_process_classifier(name):
    """Test log-loss of ``IterNCGPClassifier()`` <= that of ``GaussianProcessClassifier(1.0 * RBF(1.0))`` (the
    protocol and the measured numbers: ``benchmarks/sklearn_defaults.py`` and its results)."""
    from sklearn.gaussian_process.kernels import RBF
    from sklearn.metrics import log_loss

    x_train, x_test, y_train, y_test = _protocol_split(name)
    ours = IterNCGPClassifier(random_state=0).fit(x_train, y_train)  # the seed of the matrix-free evidence's probes
    theirs = GaussianProcessClassifier(1.0 * RBF(1.0), random_state=0).fit(x_train, y_train)
    assert log_loss(y_test, ours.predict_proba(x_test)) <= log_loss(y_test, theirs.predict_proba(x_test))


def test_covariance_iterations_shrink_the_predictive_variance_of_the_final_fit_only():
    """With N C > 1000 (CG, 5 iterations per Newton step) the covariance phase adds one product with K per block to
    the final fit and shrinks every predictive variance (it only ever enlarges the action space: Loewner-monotone,
    ``tests/core/test_covariance.py``); the hyperparameters are learnt exactly as without it."""
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=400, n_features=4, n_informative=3, n_redundant=0, n_classes=3, random_state=0)
    options = dict(random_state=0, optimizer_steps=3, inference="laplace")  # (EP's escalations refresh its marginals)
    without = IterNCGPClassifier(solver_options={"covariance_iterations": 0}, **options).fit(x, y)
    with_phase = IterNCGPClassifier(solver_options={"covariance_iterations": 2}, **options).fit(x, y)
    assert with_phase.model_.variational_strategy.options.covariance_iterations == 2
    np.testing.assert_array_equal(with_phase.loss_curve_, without.loss_curve_)
    assert with_phase.fit_report_.kernel_products == without.fit_report_.kernel_products + 2
    test_x = torch.as_tensor(x[:100])
    with torch.no_grad():
        _, variance = with_phase.model_.variational_strategy.marginal_latent(test_x)
        _, reference_variance = without.model_.variational_strategy.marginal_latent(test_x)
    assert bool((variance <= reference_variance + 1e-10).all())
    assert float((reference_variance - variance).mean()) > 1e-3 * float(reference_variance.mean())


def test_covariance_iterations_must_be_a_count():
    with pytest.raises(ValueError, match="covariance_iterations"):
        IterNCGPClassifier(solver_options={"covariance_iterations": -1}).fit(np.zeros((4, 1)), np.array([0, 1, 0, 1]))


@pytest.mark.parametrize("regime", ["exact (L-BFGS)", "matrix-free (Adam)"])
def test_max_time_stops_learning_after_the_running_evaluation(regime):
    """``max_time=0``: the first evidence evaluation runs, the optimiser stops before the next one (no warning), and
    the model keeps the initial hyperparameters (the only evidence seen)."""
    from sklearn.exceptions import ConvergenceWarning

    from gpytorch_iterncgp import settings

    x, y, _ = _binary()
    size = 1000 if regime.startswith("exact") else 10
    with settings.exact_evidence_size(size), warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        stopped = IterNCGPClassifier(optimizer_steps=10, max_time=0.0, random_state=0).fit(x, y)
        initial = IterNCGPClassifier(optimizer_steps=0, random_state=0).fit(x, y)
    assert len(stopped.loss_curve_) == 1 and stopped.learning_report_.evaluations == 1
    assert stopped.learning_report_.stopped == "max_time"
    for ours, theirs in zip(stopped.kernel_.parameters(), initial.kernel_.parameters(), strict=True):
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=0)
    assert initial.learning_report_.stopped == "not learnt" and "not learnt" in str(initial.learning_report_)


def test_learning_report_says_where_the_time_went():
    """Adam (forced matrix-free evidence): one evaluation per step, the parts of the time within the whole, and the
    report's text says them; the final fit's report holds the solver budget as data, its text ends with the rule;
    L-BFGS with one iteration stops by ``optimizer_steps``."""
    from gpytorch_iterncgp import settings

    x, y, _ = _binary(num=60, seed=2)
    with settings.exact_evidence_size(10):
        adam = IterNCGPClassifier(inference="laplace", optimizer_steps=4, random_state=0).fit(x, y)
    report = adam.learning_report_
    assert (report.method, report.evaluations, report.stopped) == ("Adam", 4, "optimizer_steps")
    assert len(adam.loss_curve_) == 4
    parts = (report.fit_seconds, report.evidence_seconds, report.gradient_seconds)
    assert all(part > 0 for part in parts) and sum(parts) <= report.seconds
    assert "hyperparameters: Adam on the Laplace evidence, 4 evaluations" in str(adam.learning_report_)
    assert adam.fit_report_.budget is adam.solver_budget_ and set(adam.solver_budget_) >= {"policy", "rule"}
    assert str(adam.fit_report_).endswith(f"; {adam.solver_budget_['rule']}")
    lbfgs = IterNCGPClassifier(optimizer_steps=1, random_state=0).fit(x, y)
    assert lbfgs.learning_report_.method == "L-BFGS" and lbfgs.learning_report_.stopped == "optimizer_steps"
    assert lbfgs.learning_report_.evaluations == len(lbfgs.loss_curve_) >= 1


@pytest.mark.parametrize("value", [-1.0, "soon", float("nan")])
def test_bad_max_time_is_a_value_error_naming_it(value):
    x, y, _ = _binary(num=20)
    with pytest.raises(ValueError, match="max_time"):
        IterNCGPClassifier(max_time=value).fit(x, y)
