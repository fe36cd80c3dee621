"""The latent posterior at test rows away from the data, against the prior and dense references.

A theorem: where :math:`\\mathbf k_* = \\mathbf K(\\mathbf X, x_*) = \\mathbf 0` the posterior at :math:`x_*` is the
prior, whatever the approximate precision :math:`\\mathbf C`: mean :math:`m(x_*)`, variance :math:`k(x_*, x_*)`.
With the squared-exponential kernel :math:`k_*` underflows to 0 beyond about 40 lengthscales; the test rows at 60
lengthscales must get the prior's variance to 1e-6 relative (the rows' variances are never clamped towards 0 there,
at any outputscale, in float32 too). Between the data and there, the strategy's variances are the dense exact
posterior's (exact solves; R&W Alg. 3.2, 3.6), and with a budget of solver iterations at least them (the
computational uncertainty only widens them) and at most the prior's.
"""

from __future__ import annotations

import warnings

import gpytorch
import pytest
import torch

from gpytorch_iterncgp import EPStrategy, IterNCGPStrategy, LogitBernoulliLikelihood, MultinomialProbitLikelihood
from gpytorch_iterncgp.exceptions import NumericalBreakdownWarning
from tests import reference_ep
from tests.common import IterNCGPModel, binary_data, multiclass_data, softmax_likelihood
from tests.test_exact_laplace import EXACT, dense_prior, exact_laplace, reference_predictive

LENGTHSCALE = 0.3
#: distances from the data's centre, in lengthscales: near the data, between, and where k_* underflows to 0
DISTANCES = (0.0, 1.0, 2.0, 4.0, 8.0, 60.0)
#: EP's sweeps to its fixed point with complete solves (the dense reference takes the strategy's own sites)
EXACT_EP = dict(policy="unit", max_solver_iterations=None, abs_tol=1e-11, rel_tol=0.0, site_tol=1e-10, max_sweeps=400)


def _rows_along_a_ray(x: torch.Tensor) -> torch.Tensor:
    """Test rows from the centre of the inputs outwards along a fixed direction, at :data:`DISTANCES` lengthscales."""
    direction = torch.tensor([0.6, 0.8], dtype=x.dtype)
    steps = torch.tensor(DISTANCES, dtype=x.dtype)[:, None] * LENGTHSCALE
    return x.mean(0) + steps * direction


CASES = {
    "laplace-logit": (IterNCGPStrategy, LogitBernoulliLikelihood, lambda: binary_data(60, seed=1), "logit", 1),
    "laplace-softmax": (IterNCGPStrategy, softmax_likelihood, lambda: multiclass_data(50, seed=6), "softmax", 3),
    "ep-probit": (EPStrategy, gpytorch.likelihoods.BernoulliLikelihood, lambda: binary_data(60, seed=1), "probit", 1),
    "ep-multinomial-probit": (
        EPStrategy,
        lambda: MultinomialProbitLikelihood(num_classes=3),
        lambda: multiclass_data(50, seed=6),
        "probit",
        3,
    ),
}


def _fitted(case: str, outputscale: float, dtype: torch.dtype = torch.float64, **options):
    strategy, likelihood, data, _, _ = CASES[case]
    x, y = data()
    x = x.to(dtype)
    model = IterNCGPModel(
        x,
        y.to(dtype),
        likelihood(),
        outputscale=outputscale,
        lengthscale=LENGTHSCALE,
        strategy_class=strategy,
        **options,
    )
    model.variational_strategy.fit()
    model.eval()
    return model, x, y


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("outputscale", [2.0, 1e4])
@pytest.mark.parametrize("case", list(CASES))
def test_far_rows_get_the_prior(case, outputscale, dtype):
    """At 60 lengthscales, mean and variance of every latent are the prior's (0 and the outputscale) to 1e-6
    relative; the variances of ``marginal_latent`` and the diagonal of ``marginal_latent_blocks`` agree. (In float32
    at outputscale 1e4, K's rounding is about 1e-3 in absolute terms, and a solver action may lie numerically in the
    span of the earlier ones: the solve then stops with a ``NumericalBreakdownWarning``, whether it does depends on
    the rounding, and the far rows are the prior's all the same.)"""
    with warnings.catch_warnings():
        if dtype == torch.float32 and outputscale > 100:
            warnings.simplefilter("ignore", NumericalBreakdownWarning)
        model, x, _ = _fitted(case, outputscale, dtype, max_solver_iterations=5)
    far = _rows_along_a_ray(x)[-1:]
    strategy = model.variational_strategy
    with torch.no_grad():
        mean, variance = strategy.marginal_latent(far)
        block_mean, blocks = strategy.marginal_latent_blocks(far)
    torch.testing.assert_close(variance, torch.full_like(variance, outputscale), rtol=1e-6, atol=0)
    torch.testing.assert_close(mean, torch.zeros_like(mean), rtol=0, atol=1e-6 * outputscale**0.5)
    torch.testing.assert_close(blocks.diagonal(dim1=-2, dim2=-1), variance, rtol=1e-6, atol=0)
    torch.testing.assert_close(block_mean, mean)


def _dense_reference(case: str, model, x, y, test_x) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact posterior's latent means and variances at ``test_x`` ``(N*, C)``: the dense Laplace approximation
    (R&W Alg. 3.2), or EP's at the strategy's own sites (R&W Alg. 3.6, the sites' regression solved densely)."""
    _, _, _, name, num_classes = CASES[case]
    if CASES[case][0] is IterNCGPStrategy:
        exact, _, _ = exact_laplace(model, x, y, name, num_classes)
        mean, covariance = reference_predictive(model, exact, x, test_x, num_classes)
        return mean.reshape(-1, num_classes), covariance.diagonal().reshape(-1, num_classes)
    tau, nu = model.variational_strategy.sites
    with torch.no_grad():
        kernel = dense_prior(model, x, x, num_classes)
        cross = dense_prior(model, x, test_x, num_classes)
        diagonal = dense_prior(model, test_x, test_x, num_classes).diagonal()
    if num_classes == 1:
        mean, variance = reference_ep.latent_predict(kernel, cross, diagonal, tau, nu)
        return mean[:, None], variance[:, None]
    precision = torch.block_diag(*tau)  # the site blocks T, data-major (singular: solved through T K + I)
    system = precision @ kernel + torch.eye(len(kernel), dtype=kernel.dtype)
    weights = torch.linalg.solve(system, nu.reshape(-1))  # (T K + I)^{-1} nu: the representer weights
    reduction = cross.mT @ torch.linalg.solve(system, precision @ cross)  # k*^T (K + T^{-1})^{-1} k*
    mean = cross.mT @ weights
    return mean.reshape(-1, num_classes), (diagonal - reduction.diagonal()).reshape(-1, num_classes)


@pytest.mark.parametrize("case", list(CASES))
def test_rows_between_the_data_and_far_away_match_the_dense_posterior(case):
    """With exact solves the strategy's marginals along the ray are the dense exact posterior's (1e-6 relative); with
    five solver iterations a step the variances stay within the prior's, and at the far row equal it."""
    exact = EXACT_EP if CASES[case][0] is EPStrategy else EXACT
    model, x, y = _fitted(case, 2.0, **exact)
    rows = _rows_along_a_ray(x)
    with torch.no_grad():
        mean, variance = model.variational_strategy.marginal_latent(rows)
    expected_mean, expected_variance = _dense_reference(case, model, x, y, rows)
    torch.testing.assert_close(variance, expected_variance, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(mean, expected_mean, rtol=1e-6, atol=1e-8)

    budgeted, _, _ = _fitted(case, 2.0, max_solver_iterations=5)
    with torch.no_grad():
        _, wide = budgeted.variational_strategy.marginal_latent(rows)
    assert bool((wide > 0).all() and (wide <= 2.0 * (1 + 1e-12)).all())
    torch.testing.assert_close(wide[-1], torch.full_like(wide[-1], 2.0), rtol=1e-12, atol=0)


@pytest.mark.parametrize("case", ["laplace-logit", "ep-multinomial-probit"])
def test_exact_unit_vector_fits_read_the_kernel_once_with_the_same_posterior(case):
    """Unit-vector actions to full rank read their columns from one evaluation of K per fit; with the cache ruled out
    (``dense_kernel_limit(0)``: every column evaluated on its own) the posterior is the same to rounding."""
    from gpytorch_iterncgp import settings

    exact = EXACT_EP if CASES[case][0] is EPStrategy else EXACT
    evaluations = []
    forward = gpytorch.kernels.RBFKernel.forward

    def counted(self, *args, **kwargs):
        evaluations.append(1)
        return forward(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gpytorch.kernels.RBFKernel, "forward", counted)
        cached, x, _ = _fitted(case, 2.0, **exact)
        once = len(evaluations)
        with settings.dense_kernel_limit(0):
            alone, _, _ = _fitted(case, 2.0, **exact)
    assert once <= 3 < len(evaluations) - once  # one evaluation of K a fit, against one per column
    rows = _rows_along_a_ray(x)
    with torch.no_grad():
        for ours, theirs in zip(
            cached.variational_strategy.marginal_latent(rows),
            alone.variational_strategy.marginal_latent(rows),
            strict=True,
        ):
            torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-10)
    assert (
        cached.variational_strategy.last_report.kernel_products
        == alone.variational_strategy.last_report.kernel_products
    )
