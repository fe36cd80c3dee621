"""The preconditioner of IterGP's systems (``core/preconditioner.py``) against dense linear algebra.

* The low-rank factors: :math:`\\mathbf K - \\mathbf L \\mathbf L^\\top` is positive semi-definite (a Schur complement
  for pivoted Cholesky; Nyström's shift at rounding level), and :math:`\\mathbf L \\mathbf L^\\top = \\mathbf K` once the
  rank reaches the kernel's, in every prior layout.
* The Woodbury form equals the dense :math:`(\\mathbf L \\mathbf L^\\top + \\mathbf W^{-1})^{-1}` (on
  :math:`\\operatorname{range}(\\mathbf W)` for the softmax's singular curvature), in float64 and float32.
* IterGP with the preconditioned residuals as actions solves the same system: with :math:`\\mathbf L \\mathbf
  L^\\top = \\mathbf K` in one iteration (then :math:`\\mathbf M = \\hat{\\mathbf K}`), and at a large outputscale, with a
  partial factor, in fewer iterations than without.
"""

from __future__ import annotations

import warnings

import gpytorch
import pytest
import torch

from gpytorch_iterncgp.core.noise import (
    DiagonalNoiseInverse,
    SiteBlockNoiseInverse,
    SoftmaxPseudoInverse,
    project_to_zero_sum,
)
from gpytorch_iterncgp.core.policies import ConjugateGradientPolicy
from gpytorch_iterncgp.core.preconditioner import (
    PIVOT_TOLERANCE,
    ClassFactor,
    KernelPreconditioning,
    PointFactor,
    WoodburyPreconditioner,
    low_rank_kernel_factor,
    pivoted_cholesky_factor,
)
from gpytorch_iterncgp.core.prior import LatentPrior
from gpytorch_iterncgp.core.recycling import ActionBuffer
from gpytorch_iterncgp.core.sharding import RowBlock
from gpytorch_iterncgp.core.solver import itergp_solve
from tests import reference
from tests.common import IterNCGPModel, MultitaskIterNCGPModel, binary_data, multiclass_data, softmax_likelihood
from tests.test_exact_laplace import dense_prior


def _prior(layout: str, num_data: int = 40, dtype=torch.float64, outputscale: float = 2.0):
    """The model and its training prior for a layout: ``single``, ``shared``, ``independent`` or ``multitask``."""
    x, y = multiclass_data(num_data, seed=3, dtype=dtype)
    if layout == "single":
        x, y = binary_data(num_data, seed=3, dtype=dtype)
        model = IterNCGPModel(x, y, gpytorch.likelihoods.BernoulliLikelihood(), outputscale=outputscale)
    elif layout == "multitask":
        model = MultitaskIterNCGPModel(x, y, softmax_likelihood(), kernel="multitask", rank=2)
    else:
        classes = 3 if layout == "independent" else None
        model = IterNCGPModel(x, y, softmax_likelihood(), batch_classes=classes, outputscale=outputscale)
        if classes:
            model.covar_module.base_kernel.lengthscale = torch.tensor([0.2, 0.35, 0.5], dtype=dtype).view(3, 1, 1)
    with torch.no_grad():
        prior = LatentPrior.from_distribution(model.forward(x), model.variational_strategy.num_latents)
        kernel = dense_prior(model, x, x, model.variational_strategy.num_latents).double()
    return model, prior, kernel


def _dense_factor(factor) -> torch.Tensor:
    return factor.matmul(torch.eye(factor.rank, dtype=factor.columns.dtype)).double()


@pytest.mark.parametrize("layout", ["single", "shared", "independent", "multitask"])
def test_low_rank_factor_lies_below_the_kernel_and_reaches_it(layout):
    _, prior, kernel = _prior(layout)
    scale = float(kernel.diagonal().max())
    errors = []
    for rank in (6, 30):
        with torch.no_grad():
            factor = low_rank_kernel_factor(prior, rank)
        assert isinstance(factor, PointFactor if layout == "multitask" else ClassFactor)
        dense = _dense_factor(factor)
        remainder = kernel - dense @ dense.mT
        assert float(torch.linalg.eigvalsh(remainder)[0]) >= -1e-10 * scale  # L L^T <= K
        errors.append(float(remainder.diagonal().sum()))
    assert errors[1] < errors[0]  # a larger rank leaves less of K
    with torch.no_grad():
        full = _dense_factor(low_rank_kernel_factor(prior, kernel.shape[0]))
    # (the factorisation stops where the remaining diagonal falls below PIVOT_TOLERANCE of the largest variance)
    torch.testing.assert_close(full @ full.mT, kernel, atol=PIVOT_TOLERANCE * scale, rtol=0)


@pytest.mark.parametrize("layout", ["single", "shared", "independent"])
def test_the_factor_without_the_cached_kernel_is_the_same(layout):
    """``cache_kernel=False`` evaluates each pivot's column instead of reading it from the evaluated kernel matrix: the
    same factor and pivots (a fresh prior each, so that neither finds the other's cache)."""
    with torch.no_grad():
        cached = pivoted_cholesky_factor(_prior(layout)[1], 12)
        evaluated = pivoted_cholesky_factor(_prior(layout)[1], 12, cache_kernel=False)
    assert torch.equal(cached.pivots, evaluated.pivots)
    torch.testing.assert_close(evaluated.columns, cached.columns, rtol=0, atol=1e-12)


def test_the_cached_columns_of_a_sum_of_kernels_are_its_columns():
    """A sum of kernels evaluates to a structured matrix (``SumLinearOperator``): the columns read from its dense form
    (made once) are those the kernel evaluates at the pivots alone, and so is the factor."""
    x, y = binary_data(40, seed=3)
    model = IterNCGPModel(x, y, gpytorch.likelihoods.BernoulliLikelihood())
    model.covar_module = gpytorch.kernels.ScaleKernel(
        gpytorch.kernels.LinearKernel() + gpytorch.kernels.MaternKernel(nu=2.5)
    ).double()

    def prior():
        return LatentPrior.from_distribution(model.forward(x), 1)

    with torch.no_grad():
        cached = prior()
        cached.cache_kernel()
        points = torch.tensor([3, 17, 0])
        torch.testing.assert_close(
            cached.kernel_columns(points), model.covar_module(x, x[points]).to_dense(), rtol=1e-12, atol=1e-12
        )
        read = pivoted_cholesky_factor(prior(), 12)
        evaluated = pivoted_cholesky_factor(prior(), 12, cache_kernel=False)
    assert torch.equal(read.pivots, evaluated.pivots)
    torch.testing.assert_close(read.columns, evaluated.columns, rtol=0, atol=1e-12)


def test_a_fit_at_the_same_hyperparameters_takes_the_last_factor_and_so_does_the_evidence():
    """The factor preconditioned a fit of the same kernel matrix: the next fit and the matrix-free evidence take it (the
    same object, the same factor as one built afresh); after a change of a hyperparameter neither does."""
    from gpytorch_iterncgp.mlls.itergp import evidence_kernel_factor

    x, y = binary_data(60, seed=5)
    model = IterNCGPModel(x, y, gpytorch.likelihoods.BernoulliLikelihood(), max_solver_iterations=3)
    strategy = model.variational_strategy
    assert strategy.kernel_factor() is None  # before any fit
    strategy.fit()
    factor = strategy.kernel_factor()
    assert isinstance(factor, ClassFactor)
    with torch.no_grad():
        fresh = pivoted_cholesky_factor(
            strategy.train_prior(), strategy.options.preconditioner_rank, cache_kernel=False
        )
    assert torch.equal(factor.pivots, fresh.pivots)
    torch.testing.assert_close(factor.columns, fresh.columns, rtol=0, atol=1e-12)
    strategy.fit(max_newton_steps=1)
    assert strategy.kernel_factor() is factor
    assert evidence_kernel_factor(strategy, strategy.train_prior()) is factor
    with strategy.overriding(preconditioner_rank=5):  # another rank: not this factor
        assert strategy.kernel_factor() is None
    with torch.no_grad():
        model.covar_module.outputscale = 3.0
    assert strategy.kernel_factor() is None
    assert evidence_kernel_factor(strategy, strategy.train_prior()) is not factor
    strategy.fit()
    assert strategy.kernel_factor() is not factor


def test_the_prior_counts_every_product_and_the_report_the_factors_apart():
    """The prior's counters only grow: the factor's kernel columns are counted among its products and, set aside, in
    ``products_aside``; the fit's report gives the solver's products (every product less those set aside, one per
    step's iterations and renewals) and the preconditioner's apart."""
    x, y = binary_data(60, seed=5)
    model = IterNCGPModel(x, y, gpytorch.likelihoods.BernoulliLikelihood(), max_solver_iterations=3)
    strategy = model.variational_strategy
    seen: list[tuple[int, int]] = []
    original = LatentPrior.count

    def spy(prior, columns, seconds=0.0):
        original(prior, columns, seconds)
        seen.append((prior.products, prior.products_aside))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LatentPrior, "count", spy)
        report = strategy.fit()
    assert report.preconditioner_products > 0 and report.kernel_products > 0
    assert [pair[0] for pair in seen] == list(range(1, len(seen) + 1))  # one more at every count
    assert all(later[1] >= earlier[1] for earlier, later in zip(seen, seen[1:], strict=False))
    assert seen[-1] == (report.kernel_products + report.preconditioner_products, report.preconditioner_products)
    assert (
        sum(record.kernel_products for record in report.records) + report.covariance_products <= report.kernel_products
    )


def _noise(kind: str, num_data: int, num_latents: int, dtype, generator):
    """A random noise of ``kind`` and its dense curvature ``W`` ``(n, n)`` (float64)."""
    if kind == "diagonal":
        curvature = torch.rand(num_data, generator=generator, dtype=torch.float64) ** 4  # down to ~1e-6: flat sites
        return DiagonalNoiseInverse.from_curvature(curvature.to(dtype), 1e-8), torch.diag(curvature)
    if kind == "softmax":
        logits = 3 * torch.randn(num_data, num_latents, generator=generator, dtype=torch.float64)
        probabilities = torch.softmax(logits, -1)  # (in float64: W 1 = 0 to rounding)
        blocks = torch.diag_embed(probabilities) - probabilities[..., :, None] * probabilities[..., None, :]
        return SoftmaxPseudoInverse(probabilities.to(dtype)), torch.block_diag(*blocks)
    basis = torch.linalg.qr(torch.randn(num_data, num_latents, num_latents, generator=generator).double())[0]
    basis = basis[..., 1:] - basis[..., 1:].mean(-2, keepdim=True)  # orthogonal to 1 ...
    basis = torch.linalg.qr(basis)[0]  # ... and orthonormal
    eigenvalues = 0.05 + 3 * torch.rand(num_data, num_latents - 1, generator=generator, dtype=torch.float64)
    noise = SiteBlockNoiseInverse.from_site_spectrum(eigenvalues.to(dtype), basis.to(dtype), 1e-8)
    return noise, torch.block_diag(*((basis * eigenvalues[..., None, :]) @ basis.mT))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("layout", "kind"), [("single", "diagonal"), ("shared", "softmax"), ("independent", "sites")])
def test_woodbury_preconditioner_is_the_dense_inverse(layout, kind, dtype):
    _, prior, _ = _prior(layout, dtype=dtype)
    with torch.no_grad():
        factor = low_rank_kernel_factor(prior, 12)
    num_latents = prior.num_latents
    noise, curvature = _noise(kind, prior.shape[0], num_latents, dtype, torch.Generator().manual_seed(0))
    preconditioner = WoodburyPreconditioner(factor, noise, num_latents, RowBlock.single(prior.shape[0], num_latents))
    dense = _dense_factor(factor)
    # W^{1/2} (I + W^{1/2} L L^T W^{1/2})^{-1} W^{1/2}: (L L^T + W^{-1})^{-1}, on range(W) where W is singular
    root = reference.symmetric_sqrt(curvature, num_latents)
    inner = torch.eye(len(root), dtype=torch.float64) + root @ dense @ dense.mT @ root
    expected = root @ torch.linalg.solve(inner, root)
    residuals = torch.randn(len(root), 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    actual = torch.stack([preconditioner(column.to(dtype)) for column in residuals.mT], dim=-1).double()
    tolerance = 1e-10 if dtype == torch.float64 else 1e-4
    scale = float((expected @ residuals).abs().max())
    torch.testing.assert_close(actual, expected @ residuals, atol=tolerance * scale, rtol=0)


def _solve(prior, noise, rhs, rank: int, max_iterations=None):
    """IterGP's CG to a relative residual of 1e-9, preconditioned with a factor of ``rank`` columns (0: none); for
    C > 1 (the softmax) on range(W), as the Newton loop solves it."""
    preconditioning = KernelPreconditioning(prior, rank)
    buffer = ActionBuffer.empty(prior.rows, rhs.dtype, rhs.device)
    num = prior.num_latents
    return itergp_solve(
        prior.matmul,
        noise,
        rhs,
        buffer,
        ConjugateGradientPolicy(),
        project=(lambda vectors: project_to_zero_sum(vectors, num)) if num > 1 else None,
        action_space_dimension=prior.shape[0] * (num - 1) if num > 1 else None,
        max_solver_iterations=max_iterations,
        abs_tol=0.0,
        rel_tol=1e-9,
        preconditioner=preconditioning.for_noise(noise),
    )


def test_a_complete_factor_solves_in_one_iteration():
    """With L L^T = K the preconditioner is K̂^{-1}, and its action v = M^{-1} b is the solution: here L L^T is K to
    PIVOT_TOLERANCE, so a second iteration may finish what the first left."""
    _, prior, kernel = _prior("single", outputscale=20.0)
    noise, curvature = _noise("diagonal", prior.shape[0], 1, torch.float64, torch.Generator().manual_seed(2))
    rhs = torch.randn(prior.shape[0], generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        result = _solve(prior, noise, rhs, rank=prior.shape[0])
    assert result.iterations <= 2 and result.converged
    exact = torch.linalg.solve(kernel + torch.diag(1 / curvature.diagonal().clamp_min(1e-8)), rhs)
    torch.testing.assert_close(result.representer_weights, exact, atol=1e-7 * float(exact.abs().max()), rtol=0)


@pytest.mark.parametrize("layout", ["single", "shared"])
def test_preconditioned_solves_take_fewer_iterations_at_a_large_outputscale(layout):
    """At outputscale 20 with curvatures down to ~1e-6 (flat logit sites), a rank-10 factor plus the noise cuts the
    iterations to the same tolerance, and the solution is the dense one."""
    _, prior, kernel = _prior(layout, num_data=120, outputscale=20.0)
    generator = torch.Generator().manual_seed(4)
    kind = "diagonal" if layout == "single" else "softmax"
    noise, curvature = _noise(kind, prior.shape[0], prior.num_latents, torch.float64, generator)
    rhs = torch.randn(len(curvature), generator=generator, dtype=torch.float64)
    if layout == "shared":  # on range(W): zero sum per point
        rhs = rhs.reshape(-1, prior.num_latents)
        rhs = (rhs - rhs.mean(-1, keepdim=True)).reshape(-1)
    with torch.no_grad():
        plain = _solve(prior, noise, rhs, rank=0, max_iterations=400)
        preconditioned = _solve(prior, noise, rhs, rank=10, max_iterations=400)
    assert preconditioned.converged
    assert preconditioned.iterations * 2 <= plain.iterations
    noisy = noise.to_dense().double()
    if layout == "shared":  # the system on range(W) (the zero-sum vectors), in a basis of it
        centring = torch.eye(prior.num_latents, dtype=torch.float64) - 1 / prior.num_latents
        basis = torch.block_diag(*[torch.linalg.qr(centring)[0][:, :-1]] * prior.shape[0])
    else:
        basis = torch.eye(len(rhs), dtype=torch.float64)
    system = basis.mT @ (kernel + noisy) @ basis
    expected = basis @ torch.linalg.solve(system, basis.mT @ rhs)
    error = float((preconditioned.representer_weights - expected).abs().max())
    assert error <= 1e-5 * float(expected.abs().max())


def test_unit_vector_actions_build_no_factor():
    _, prior, _ = _prior("single")
    assert KernelPreconditioning(prior, 50, uses_residual=False).factor is None
    assert KernelPreconditioning(prior, 0).factor is None


def test_a_preconditioned_action_in_the_span_is_followed_by_the_plain_residual():
    """A preconditioner whose action IterGP already holds (here: always the first recycled action) costs a product and
    is skipped; the plain residual follows, so the solve still converges (every other iteration plain CG), without a
    breakdown."""
    _, prior, kernel = _prior("single")
    noise, curvature = _noise("diagonal", prior.shape[0], 1, torch.float64, torch.Generator().manual_seed(5))
    rhs = torch.randn(prior.shape[0], generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    held = torch.zeros(prior.shape[0], 1, dtype=torch.float64)
    held[0] = 1.0
    with torch.no_grad():
        buffer = ActionBuffer.from_tensors(held, prior.matmul(held), prior.rows)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no NumericalBreakdownWarning
            result = itergp_solve(
                prior.matmul,
                noise,
                rhs,
                buffer,
                ConjugateGradientPolicy(),
                max_solver_iterations=4 * prior.shape[0],  # (every other product is the skipped action's)
                abs_tol=0.0,
                rel_tol=1e-9,
                preconditioner=lambda residual: held[:, 0].clone(),
            )
    assert result.converged and not result.breakdown
    exact = torch.linalg.solve(kernel + torch.diag(1 / curvature.diagonal().clamp_min(1e-8)), rhs)
    torch.testing.assert_close(result.representer_weights, exact, atol=1e-6 * float(exact.abs().max()), rtol=0)


def test_point_actions_bound_the_variance_by_the_point_observed_alone():
    r"""With the unit vector at point :math:`i` among the actions (``with_point_actions``, beside any others: here 5
    random ones), the computation-aware posterior variance there is at most that of :math:`i` observed alone,
    :math:`k_{ii} - k_{ii}^2 / (k_{ii} + \tilde\tau_i^{-1})` (a theorem: a larger action space projects more of
    :math:`k_i`), so EP's cavity precision :math:`\sigma_i^{-2} - \tilde\tau_i` stays at or above the prior's
    :math:`1 / k_{ii}`; elsewhere the few actions leave it far above. The actions' kernel columns are no product with
    K; the dense kernel is the reference."""
    _, prior, kernel = _prior("single", num_data=40)
    generator = torch.Generator().manual_seed(0)
    site_precision = torch.rand(40, generator=generator, dtype=torch.float64) * 4 + 0.5
    random = torch.randn(40, 5, generator=generator, dtype=torch.float64)
    random = random / random.norm(dim=0)
    buffer = ActionBuffer.from_tensors(random, kernel @ random, RowBlock.single(40))
    preconditioning = KernelPreconditioning(prior, rank=0)
    points = torch.tensor([3, 17, 29])
    with torch.no_grad():
        buffer = preconditioning.with_point_actions(buffer, points)
    assert buffer.size == 8 and prior.products == prior.products_aside == preconditioning.products > 0
    actions = buffer.actions.value
    torch.testing.assert_close(buffer.kernel_actions.value, kernel @ actions)
    gram = actions.mT @ (kernel + torch.diag(site_precision.reciprocal())) @ actions
    kernel_actions = kernel @ actions
    variance = kernel.diagonal() - (kernel_actions @ torch.linalg.solve(gram, kernel_actions.mT)).diagonal()
    alone = kernel.diagonal() - kernel.diagonal() ** 2 / (kernel.diagonal() + site_precision.reciprocal())
    assert bool((variance[points] <= alone[points] * (1 + 1e-10)).all())
    others = torch.ones(40, dtype=torch.bool)
    others[points] = False
    assert bool((variance[others] > alone[others]).any())  # not a property of the random actions
