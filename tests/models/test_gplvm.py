"""The uncertain-input predictive, :class:`NoisyInputGPClassifier` and :class:`EPLatentVariableModel`, each against an
independent reference.

* The moment-matched predictive at an uncertain test input against quasi-Monte Carlo over the test input: scrambled
  Sobol draws of x* (2^14 per point), at each the known-input sparse predictive written here from the dense
  q(u) = N(mu_u, Sigma_u) and a dense solve with K_uu (not the whitened formulas of the package), averaged by the
  law of total variance: 1e-4 relative (measured: 2e-5 for the mean, 3e-5 for the variance, the quasi-Monte Carlo
  error; the input's variance changes the latent variance by 1.6 here).
* With zero test variances, the predictive is SparseEPStrategy's predictive of the same GP trained at X = mu (its
  own EP on the DTC prior): 1e-8 (measured: 9e-16 for the mean, 2e-15 for the variance).
* The probabilities are Phi(mean / sqrt(1 + variance)) (torch's normal cdf), 1e-12.
* The GP-LVM's loss decreases under its fit and every gradient is finite, in float32 and float64; a state_dict
  round trip restores the embedding and the predictions exactly; bad inputs raise ValueErrors naming the problem.
"""

from __future__ import annotations

import warnings

import gpytorch
import pytest
import torch

from gpytorch_iterncgp import SparseEPStrategy
from gpytorch_iterncgp.models.gplvm import EPLatentVariableModel, NoisyInputGPClassifier, pca_initialisation
from gpytorch_iterncgp.sparse.dtc import inducing_cholesky
from tests.common import IterNCGPModel, binary_data

DTYPE = torch.float64
CONSTANT = 0.3


def _kernel():
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DTYPE)
    kernel.outputscale = 2.0
    kernel.base_kernel.lengthscale = 0.3
    return kernel


def _classifier(variance=0.01, **options):
    x, y = binary_data(40, seed=0)
    inducing = x[::5].clone() + 0.01
    model = NoisyInputGPClassifier(
        x, torch.full_like(x, variance), y, inducing_points=inducing, kernel=_kernel(), **{"site_tol": 1e-11, **options}
    )
    model.mean_module.constant = CONSTANT
    return model, x, y, inducing


def _test_inputs(num=5, seed=1):
    generator = torch.Generator().manual_seed(seed)
    means = torch.rand(num, 2, generator=generator, dtype=DTYPE)
    variances = 0.02 + 0.05 * torch.rand(num, 2, generator=generator, dtype=DTYPE)
    return means, variances


def _known_input_predictive(kernel, inducing, mean_u, covariance_u, points):
    """mean m0 + k_*u K^-1 mu_u, variance k** - k_*u K^-1 k_u* + k_*u K^-1 Sigma_u K^-1 k_u* (dense solves)."""
    cholesky = inducing_cholesky(kernel(inducing).to_dense())
    gram = cholesky @ cholesky.mT  # the jittered K_uu of the model
    cross = kernel(inducing, points).to_dense()  # (M, S)
    solved = torch.linalg.solve(gram, cross)
    mean = CONSTANT + solved.mT @ mean_u
    variance = kernel(points, diag=True) - (cross * solved).sum(0) + (solved * (covariance_u @ solved)).sum(0)
    return mean, variance


def test_uncertain_test_input_predictive_matches_monte_carlo_over_the_input():
    model, _, _, inducing = _classifier(variance=0.02)
    test_means, test_variances = _test_inputs()
    mean, variance = model.predict_latent(test_means, test_variances)
    with torch.no_grad():
        posterior_cholesky, whitened_mean = (part[0] for part in model._posterior())
        cholesky = inducing_cholesky(model.covar_module(inducing).to_dense())
        mean_u = cholesky @ whitened_mean
        covariance_u = cholesky @ torch.cholesky_inverse(posterior_cholesky) @ cholesky.mT
        engine = torch.quasirandom.SobolEngine(2, scramble=True, seed=0)
        normal = torch.special.ndtri(engine.draw(2**14, dtype=DTYPE).clamp(1e-12, 1 - 1e-12))
        expected_mean, expected_variance = [], []
        for centre, spread in zip(test_means, test_variances, strict=True):
            points = centre + spread.sqrt() * normal
            means, variances = _known_input_predictive(model.covar_module, inducing, mean_u, covariance_u, points)
            expected_mean.append(means.mean())
            expected_variance.append(variances.mean() + means.var(correction=0))  # law of total variance
    expected_mean, expected_variance = torch.stack(expected_mean), torch.stack(expected_variance)
    assert float((expected_variance - model.predict_latent(test_means)[1]).abs().max()) > 1e-2  # the input matters
    torch.testing.assert_close(mean, expected_mean, rtol=1e-4, atol=1e-4 * float(expected_mean.abs().max()))
    torch.testing.assert_close(variance, expected_variance, rtol=1e-4, atol=0)
    probabilities = model.predict_proba(test_means, test_variances)
    expected = torch.distributions.Normal(0.0, 1.0).cdf(mean / (1 + variance).sqrt())
    torch.testing.assert_close(probabilities, expected, rtol=1e-12, atol=1e-12)


def test_zero_test_variance_is_the_known_input_sparse_predictive():
    """q(X) with S = 0 and known test inputs: SparseEPStrategy's EP-DTC of the same GP, sites and predictive."""
    model, x, y, inducing = _classifier(variance=0.0)
    reference = IterNCGPModel(
        x,
        y,
        gpytorch.likelihoods.BernoulliLikelihood(),
        strategy_class=SparseEPStrategy,
        inducing_points=inducing,
        constant_mean=CONSTANT,
        site_tol=1e-11,
        max_sweeps=400,
    )
    reference.variational_strategy.fit()
    test_means, _ = _test_inputs(7)
    mean, variance = model.predict_latent(test_means)
    same = model.predict_latent(test_means, torch.zeros_like(test_means))
    with torch.no_grad():
        expected_mean, expected_variance = reference.variational_strategy.marginal_latent(test_means)
    torch.testing.assert_close(model.site_precision[0], reference.variational_strategy.sites[0], rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(mean, expected_mean[:, 0], rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(variance, expected_variance[:, 0], rtol=1e-8, atol=1e-8)
    # None and zeros are the same known inputs (a second call may re-converge the sites by one more sweep)
    torch.testing.assert_close(same[0], mean, rtol=0, atol=1e-10)
    torch.testing.assert_close(same[1], variance, rtol=0, atol=1e-10)


def test_noisy_input_classifier_trains():
    model, *_ = _classifier(variance=0.02, site_tol=1e-6)
    losses = model.fit(num_steps=10, lr=0.05, show_progress=False)
    assert losses[-1] < losses[0]
    probabilities = model.predict_proba(*_test_inputs())
    assert probabilities.shape == (5,) and bool(((probabilities > 0) & (probabilities < 1)).all())


def _binary_columns(num=30, columns=5, dtype=DTYPE):
    generator = torch.Generator().manual_seed(2)
    latent = torch.randn(num, 2, generator=generator, dtype=DTYPE)
    weights = torch.randn(2, columns, generator=generator, dtype=DTYPE)
    return (torch.sin(2 * latent) @ weights > 0).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gplvm_loss_decreases_with_finite_gradients(dtype):
    data = _binary_columns(dtype=dtype)
    model = EPLatentVariableModel(data, latent_dim=2, num_inducing=8)
    assert all(parameter.dtype == dtype for parameter in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses = model.fit(num_steps=15, lr=0.05, show_progress=False)
        model.zero_grad()
        model.loss().backward()
    assert losses[-1] < losses[0] - 0.05
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and bool(torch.isfinite(parameter.grad).all()), name
    assert float(model.q_mu.grad.abs().max()) > 0 and float(model.q_log_variance.grad.abs().max()) > 0
    probabilities = model.predict_proba(model.embedding()[:4], model.latent_variances().detach()[:4])
    assert probabilities.shape == (4, 5) and probabilities.dtype == dtype


def test_gplvm_state_dict_round_trip():
    data = _binary_columns()
    model = EPLatentVariableModel(data, latent_dim=2, num_inducing=8)
    model.fit(num_steps=5, show_progress=False)
    points = torch.randn(6, 2, dtype=DTYPE, generator=torch.Generator().manual_seed(3))
    expected = model.predict_proba(points)
    restored = EPLatentVariableModel(data, latent_dim=2, num_inducing=8, seed=5)
    restored.load_state_dict(model.state_dict())
    torch.testing.assert_close(restored.embedding(), model.embedding(), rtol=0, atol=0)
    torch.testing.assert_close(restored.site_precision, model.site_precision, rtol=0, atol=0)
    torch.testing.assert_close(restored.predict_proba(points), expected, rtol=0, atol=0)


def test_gplvm_state_dict_of_earlier_versions_loads():
    """Earlier versions saved the sites as buffers (P, N) beside their fingerprint: they load as the committed
    state, current for the saved parameters (predictions without refitting)."""
    data = _binary_columns()
    model = EPLatentVariableModel(data, latent_dim=2, num_inducing=8)
    model.fit(num_steps=3, show_progress=False)
    with torch.no_grad():
        model.loss()  # the sites converged at the final parameters
        fingerprint = model.mll.fingerprint(*model.train_inputs_distribution())
    saved = {key: value for key, value in model.state_dict().items() if key != "_extra_state"}
    saved.update(site_precision=model.site_precision, site_natural_mean=model.site_natural_mean)
    saved["site_fingerprint"] = fingerprint
    points = torch.randn(6, 2, dtype=DTYPE, generator=torch.Generator().manual_seed(3))
    restored = EPLatentVariableModel(data, latent_dim=2, num_inducing=8, seed=5)
    restored.load_state_dict(saved)
    torch.testing.assert_close(restored.site_precision, model.site_precision, rtol=0, atol=0)
    torch.testing.assert_close(restored.predict_proba(points), model.predict_proba(points), rtol=0, atol=0)
    assert restored.last_reports == [], "current sites: no refit"


def test_pca_initialisation_is_the_principal_subspace():
    data = _binary_columns(num=40, columns=6)
    scores = pca_initialisation(data, 2)
    torch.testing.assert_close(scores.std(0), torch.ones(2, dtype=DTYPE), rtol=1e-12, atol=0)
    centred = data - data.mean(0)
    _, _, right = torch.linalg.svd(centred, full_matrices=False)
    projection = right[:2].mT @ right[:2]  # the same span as sklearn's PCA(2)
    torch.testing.assert_close(
        scores @ torch.linalg.lstsq(scores, centred @ projection).solution, centred @ projection, rtol=0, atol=1e-10
    )


def test_bad_inputs_raise_value_errors():
    x, y = binary_data(20, seed=0)
    variances = torch.full_like(x, 0.01)
    with pytest.raises(ValueError, match="train_variances must be finite and >= 0"):
        NoisyInputGPClassifier(x, -variances, y)
    with pytest.raises(ValueError, match="train_variances must have the shape of train_means"):
        NoisyInputGPClassifier(x, variances[:, :1], y)
    with pytest.raises(ValueError, match=r"train_targets must have shape \(N,\) = \(20,\)"):
        NoisyInputGPClassifier(x, variances, y[:10])
    with pytest.raises(ValueError, match="inducing_points have 3 features"):
        NoisyInputGPClassifier(x, variances, y, inducing_points=torch.zeros(4, 3, dtype=DTYPE))
    model = NoisyInputGPClassifier(x, variances, y, inducing_points=5)
    with pytest.raises(ValueError, match=r"test means must have shape \(N\*, 2\)"):
        model.predict_latent(torch.zeros(3, 3, dtype=DTYPE))
    with pytest.raises(ValueError, match="variances must be finite and >= 0"):
        model.predict_latent(x[:3], -variances[:3])
    with pytest.raises(ValueError, match="variances must have the shape of means"):
        model.predict_latent(x[:3], variances[:2])
    with pytest.raises(ValueError, match="data must be a floating-point tensor"):
        EPLatentVariableModel(y.long())
    with pytest.raises(ValueError, match="latent_dim = 3 exceeds"):
        EPLatentVariableModel(_binary_columns(columns=2), latent_dim=3)
    with pytest.raises(ValueError, match=r"initial_means must have shape \(N, latent_dim\)"):
        EPLatentVariableModel(_binary_columns(), initial_means=torch.zeros(5, 2, dtype=DTYPE))
