r"""The dense EP reference (``tests/reference_ep.py``) against GPy's EP, from numbers committed in
``tests/data/gpy_ep_probit.json`` (written by ``tests/data/make_gpy_ep_reference.py`` with GPy 1.15.0; GPy is not
imported here).

Two probit problems with GPy's RBF kernel at fixed hyperparameters: 60 points in 2-D (variance 2, lengthscale 0.8)
and 40 points in 1-D (variance 5, lengthscale 0.3). GPy ran sequential EP, undamped, until the mean-squared change
of the sites over a sweep was below 1e-28 (root-mean-square ~1e-14), so its sites are ~1e-14 from the fixed point:
tolerances below 1e-12 would not be meaningful, and the measured agreement is ~1e-14 throughout.

The helpers :func:`load_gpy_problem`, :func:`rbf_kernel`, :func:`rbf_kernel_derivatives` and
:data:`GPY_PROBLEMS` are meant for reuse (e.g. the package's own EP against the same numbers).
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from tests import reference_ep

DTYPE = torch.float64
GPY_REFERENCE = pathlib.Path(__file__).parents[1] / "data" / "gpy_ep_probit.json"
GPY_PROBLEMS = ("probit_2d", "probit_1d")


# ---------------------------------------------------------------------------------------------------
# Helpers (reusable)
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPyProblem:
    """One problem of ``gpy_ep_probit.json`` as float64 tensors; names follow R&W (GPy's in brackets)."""

    x: Tensor  # (N, D) training inputs
    y: Tensor  # (N,) labels in {0, 1}
    x_test: Tensor  # (N*, D)
    variance: float  # RBF sigma^2
    lengthscale: float  # RBF ell
    log_marginal_likelihood: float  # log Z_EP (model.log_likelihood())
    site_precision: Tensor  # tau tilde (ga_approx.tau)
    site_natural_mean: Tensor  # nu tilde (ga_approx.v)
    cavity_precision: Tensor  # tau_{-i} (cav_params.tau, from the last sweep)
    cavity_natural_mean: Tensor  # nu_{-i} (cav_params.v, from the last sweep)
    train_latent_mean: Tensor  # posterior mean of f at x (model._raw_predict)
    train_latent_variance: Tensor
    test_latent_mean: Tensor  # at x_test
    test_latent_variance: Tensor
    test_probability: Tensor  # p(y* = 1) = Phi(mean / sqrt(1 + variance)) (model.predict)
    gradient: Tensor  # (d log Z_EP / d variance, d log Z_EP / d lengthscale), natural parameters (model.gradient)
    finite_difference_gradient: Tensor  # the same by GPy's re-converged log likelihood, step 1e-3 theta
    parallel_log_marginal_likelihood: float  # GPy's parallel EP (damping 0.5), same fixed point
    parallel_site_precision: Tensor
    parallel_site_natural_mean: Tensor
    raw: dict  # the JSON entry itself


@functools.cache
def _gpy_json() -> dict:
    return json.loads(GPY_REFERENCE.read_text())


def load_gpy_problem(name: str) -> GPyProblem:
    """``name`` in :data:`GPY_PROBLEMS`."""
    raw = _gpy_json()["problems"][name]

    def tensor(values) -> Tensor:
        return torch.tensor(values, dtype=DTYPE)

    gradient, fd = raw["gradient"], raw["finite_difference_gradient"]
    keys = ("d log Z_EP / d variance", "d log Z_EP / d lengthscale")
    return GPyProblem(
        x=tensor(raw["X"]),
        y=tensor(raw["y"]),
        x_test=tensor(raw["X_test"]),
        variance=float(raw["kernel"]["variance"]),
        lengthscale=float(raw["kernel"]["lengthscale"]),
        log_marginal_likelihood=float(raw["log_marginal_likelihood"]),
        site_precision=tensor(raw["site_precision"]),
        site_natural_mean=tensor(raw["site_natural_mean"]),
        cavity_precision=tensor(raw["cavity_precision"]),
        cavity_natural_mean=tensor(raw["cavity_natural_mean"]),
        train_latent_mean=tensor(raw["train_latent_mean"]),
        train_latent_variance=tensor(raw["train_latent_variance"]),
        test_latent_mean=tensor(raw["test_latent_mean"]),
        test_latent_variance=tensor(raw["test_latent_variance"]),
        test_probability=tensor(raw["test_probability"]),
        gradient=tensor([gradient[k] for k in keys]),
        finite_difference_gradient=tensor([fd[k] for k in keys]),
        parallel_log_marginal_likelihood=float(raw["parallel_run"]["log_marginal_likelihood"]),
        parallel_site_precision=tensor(raw["parallel_run"]["site_precision"]),
        parallel_site_natural_mean=tensor(raw["parallel_run"]["site_natural_mean"]),
        raw=raw,
    )


def _squared_distance(x1: Tensor, x2: Tensor) -> Tensor:
    return ((x1[:, None, :] - x2[None, :, :]) ** 2).sum(-1)


def rbf_kernel(x1: Tensor, x2: Tensor, variance: float, lengthscale: float) -> Tensor:
    r"""GPy's RBF, :math:`k(\mathbf x, \mathbf x') = \sigma^2\exp(-\|\mathbf x - \mathbf x'\|^2 / (2\ell^2))`, no jitter
    (GPy adds none unless a Cholesky fails). Inputs ``(N, D)``."""
    return variance * torch.exp(-_squared_distance(x1, x2) / (2 * lengthscale**2))


def rbf_kernel_derivatives(x: Tensor, variance: float, lengthscale: float) -> tuple[Tensor, Tensor]:
    r""":math:`\partial\mathbf K/\partial\sigma^2 = \mathbf K/\sigma^2` and
    :math:`\partial\mathbf K/\partial\ell = \mathbf K \odot \mathbf R^2/\ell^3` (natural parameters)."""
    kernel = rbf_kernel(x, x, variance, lengthscale)
    return kernel / variance, kernel * _squared_distance(x, x) / lengthscale**3


@functools.cache
def _reference(name: str, method: str) -> reference_ep.EPResult:
    problem = load_gpy_problem(name)
    kernel = rbf_kernel(problem.x, problem.x, problem.variance, problem.lengthscale)
    result = getattr(reference_ep, method)(kernel, problem.y, likelihood="probit")
    assert result.converged
    return result


def _max_error(a: Tensor | float, b: Tensor | float) -> float:
    return float(torch.as_tensor(a, dtype=DTYPE).sub(torch.as_tensor(b, dtype=DTYPE)).abs().max())


# ---------------------------------------------------------------------------------------------------
# The JSON itself
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", GPY_PROBLEMS)
def test_gpy_json_is_what_the_tests_assume(name):
    data, problem = _gpy_json(), load_gpy_problem(name)
    settings = data["settings"]
    ep_settings = (settings["epsilon"], settings["eta"], settings["delta"], settings["parallel_updates"])
    assert ep_settings == (1e-28, 1, 1, False)
    assert set(problem.y.tolist()) == {0.0, 1.0}
    change = problem.raw["ep_final_mean_squared_change"]
    assert max(change["tau"], change["v"]) < settings["epsilon"]  # GPy stopped by convergence, not max_iters
    # GPy's own analytic gradient (sites fixed) is the derivative of its re-converged log likelihood: measured 3e-11
    # (2-D) and 1.4e-10 (1-D), the five-point stencil's truncation error (doubling the step moves it by 4e-10 / 2.4e-9).
    assert _max_error(problem.gradient, problem.finite_difference_gradient) < 2e-9
    # paramz conventions: objective_function_gradients() = -model.gradient (exactly); the optimiser's gradient is wrt
    # x = softplus^-1(theta): -(d log Z / d theta) (1 - exp(-theta)); measured 1.6e-14, since model._grads(x) sets
    # theta = softplus(x) again (a round trip), which reruns GPy's nested EP from the converged sites.
    theta = torch.tensor([problem.variance, problem.lengthscale], dtype=DTYPE)
    objective = torch.tensor(problem.raw["gpy_objective_function_gradients"]["value"], dtype=DTYPE)
    assert _max_error(objective, -problem.gradient) == 0
    optimizer = torch.tensor(problem.raw["gpy_optimizer_gradients"]["value"], dtype=DTYPE)
    assert _max_error(optimizer, -problem.gradient * -torch.expm1(-theta)) < 1e-12
    # GPy's parallel damped EP reached the sequential fixed point: sites measured 4e-14, log Z 7e-15
    assert _max_error(problem.parallel_site_precision, problem.site_precision) < 1e-12
    assert _max_error(problem.parallel_site_natural_mean, problem.site_natural_mean) < 1e-12
    assert abs(problem.parallel_log_marginal_likelihood - problem.log_marginal_likelihood) < 1e-12
    # GPy's posterior from its EP loop and from its predictive (Woodbury) path: measured 1.1e-14
    internal_mean = torch.tensor(problem.raw["ep_internal_train_latent_mean"], dtype=DTYPE)
    internal_variance = torch.tensor(problem.raw["ep_internal_train_latent_variance"], dtype=DTYPE)
    assert _max_error(internal_mean, problem.train_latent_mean) < 1e-12
    assert _max_error(internal_variance, problem.train_latent_variance) < 1e-12


# ---------------------------------------------------------------------------------------------------
# reference_ep against GPy
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["sequential_ep", "parallel_ep"])
@pytest.mark.parametrize("name", GPY_PROBLEMS)
def test_reference_log_marginal_likelihood_matches_gpy(name, method):
    problem, result = load_gpy_problem(name), _reference(name, method)
    # log Z_EP ~ -34 and -18; measured 1.4e-14 and 3.6e-15 (both methods); GPy's sites are ~1e-14 from the fixed point
    assert abs(float(result.log_marginal_likelihood) - problem.log_marginal_likelihood) < 1e-12


@pytest.mark.parametrize("method", ["sequential_ep", "parallel_ep"])
@pytest.mark.parametrize("name", GPY_PROBLEMS)
def test_reference_sites_match_gpy(name, method):
    problem, result = load_gpy_problem(name), _reference(name, method)
    # tau tilde in [0.06, 0.8], |nu tilde| < 0.9; GPy stops at mean-squared site change < 1e-28 (rms ~1e-14).
    # Measured: sequential 1.5e-14; parallel 1.5e-13 (the reference's damped iteration stops at steps < 1e-13).
    assert _max_error(result.site_precision, problem.site_precision) < 2e-12
    assert _max_error(result.site_natural_mean, problem.site_natural_mean) < 2e-12
    # GPy's parallel damped run (delta 0.5): measured 4.2e-14 (reference sequential), 1.2e-13 (reference parallel)
    assert _max_error(result.site_precision, problem.parallel_site_precision) < 2e-12
    assert _max_error(result.site_natural_mean, problem.parallel_site_natural_mean) < 2e-12


@pytest.mark.parametrize("name", GPY_PROBLEMS)
def test_reference_cavities_match_gpy(name):
    problem, result = load_gpy_problem(name), _reference(name, "sequential_ep")
    # GPy's cavities come from its last sweep, each before its own site update, so they equal the end-of-run ones
    # only up to the convergence tolerance; measured 5e-14
    assert _max_error(result.cavity_precision, problem.cavity_precision) < 1e-12
    assert _max_error(result.cavity_natural_mean, problem.cavity_natural_mean) < 1e-12


@pytest.mark.parametrize("name", GPY_PROBLEMS)
def test_reference_training_posterior_matches_gpy(name):
    problem, result = load_gpy_problem(name), _reference(name, "sequential_ep")
    # latent means within +-3, variances in [0.28, 2.01]; measured 2.5e-14 (mean), 4.8e-14 (variance)
    assert _max_error(result.mean, problem.train_latent_mean) < 1e-12
    assert _max_error(result.covariance.diagonal(), problem.train_latent_variance) < 1e-12


@pytest.mark.parametrize("name", GPY_PROBLEMS)
def test_reference_predictions_match_gpy(name):
    problem, result = load_gpy_problem(name), _reference(name, "sequential_ep")
    kernel = rbf_kernel(problem.x, problem.x, problem.variance, problem.lengthscale)
    cross = rbf_kernel(problem.x, problem.x_test, problem.variance, problem.lengthscale)
    diagonal = torch.full((len(problem.x_test),), problem.variance, dtype=DTYPE)
    mean, variance, probability = reference_ep.probit_predict(kernel, cross, diagonal, result)
    # measured 2.4e-14 (mean), 5.1e-14 (variance), 2.4e-15 (probability)
    assert _max_error(mean, problem.test_latent_mean) < 1e-12
    assert _max_error(variance, problem.test_latent_variance) < 1e-12
    assert _max_error(probability, problem.test_probability) < 1e-13
    # GPy's probabilities are Phi(mean / sqrt(1 + variance)) of its own latent moments (R&W eq. 3.80)
    own = torch.special.ndtr(problem.test_latent_mean / torch.sqrt(1 + problem.test_latent_variance))
    assert _max_error(own, problem.test_probability) < 1e-15


@pytest.mark.parametrize("name", GPY_PROBLEMS)
def test_reference_evidence_gradient_matches_gpy(name):
    problem, result = load_gpy_problem(name), _reference(name, "sequential_ep")
    kernel = rbf_kernel(problem.x, problem.x, problem.variance, problem.lengthscale)
    gradient = torch.stack(
        [
            reference_ep.evidence_gradient(kernel, derivative, result)
            for derivative in rbf_kernel_derivatives(problem.x, problem.variance, problem.lengthscale)
        ]
    )
    assert all(math.isfinite(g) for g in gradient.tolist())
    # against GPy's analytic gradient (|g| ~ 0.09-2.2): measured 2.5e-14
    assert _max_error(gradient, problem.gradient) < 1e-12
    # against GPy's finite differences of its re-converged log likelihood: measured 1.4e-10, the stencil's error
    assert _max_error(gradient, problem.finite_difference_gradient) < 2e-9
