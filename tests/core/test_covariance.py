"""The covariance phase (``covariance_iterations``): actions spent on the posterior covariance after the outer loop.

:math:`\\mathbf C = \\mathbf S (\\mathbf S^\\top \\hat{\\mathbf K} \\mathbf S)^{-1} \\mathbf S^\\top` over nested action
spaces grows in the Loewner order and stays below :math:`\\hat{\\mathbf K}^{-1}`: the posterior covariance shrinks with
every block, never below the exact Laplace (or EP) covariance, and equals it once the actions span the space.
"""

from __future__ import annotations

import gpytorch
import pytest
import torch

from gpytorch_iterncgp import EPStrategy, MultinomialProbitLikelihood, settings
from gpytorch_iterncgp.core.covariance import covariance_phase
from gpytorch_iterncgp.core.noise import (
    DiagonalNoiseInverse,
    SiteBlockNoiseInverse,
    SoftmaxPseudoInverse,
    curvature_matmul,
)
from gpytorch_iterncgp.core.sharding import RowBlock
from gpytorch_iterncgp.exceptions import BufferLimitWarning
from tests.common import IterNCGPModel, binary_data, multiclass_data
from tests.test_exact_laplace import (
    EXACT,
    assert_relative,
    build,
    exact_laplace,
    make_test_inputs,
    reference_predictive,
)

# The exact mode by CG with compressed recycling (R = 8): C keeps a rank of at most 11 (of 60 or 100).
CG_MODE = {**EXACT, "policy": "cg", "max_solver_iterations": 3, "compression_rank": 8, "max_newton_steps": 400}


def _test_covariance(model, test_x):
    model.eval()
    with torch.no_grad():
        return model(test_x).covariance_matrix


@pytest.mark.parametrize("case", ["probit", "softmax-shared", "softmax-independent"])
def test_enough_covariance_actions_give_the_exact_laplace_covariance(case):
    """N = 60 (C = 1) or N = 50, C = 3 (zero-sum action space of dimension 100): CG finds the exact mode with a
    covariance well above the exact one; 20 blocks of 12 actions span the space and give the dense Laplace covariance
    (R&W Algorithm 3.4) to 1e-6, for a product count of the phase's 20 blocks at most."""
    model, _, x, y, name, num_classes = build(case, **CG_MODE, covariance_iterations=20, covariance_block_size=12)
    plain, *_ = build(case, **CG_MODE, covariance_iterations=0)
    report = model.variational_strategy.fit()
    plain_report = plain.variational_strategy.fit()
    assert report.converged
    assert report.kernel_products - plain_report.kernel_products <= 20
    exact, *_ = exact_laplace(model, x, y, name, num_classes)
    test_x = make_test_inputs(x.shape[-1])
    _, covariance = reference_predictive(model, exact, x, test_x, num_classes)
    assert float((_test_covariance(plain, test_x) - covariance).diagonal().max()) > 1e-3  # CG alone is not exact
    assert_relative(_test_covariance(model, test_x), covariance, tol=1e-6)


@pytest.mark.parametrize("case", ["probit", "softmax-shared"])
def test_covariance_shrinks_with_every_block_and_stays_above_exact(case):
    """Nested action spaces: the test covariance decreases in the Loewner order with every block (eigenvalues of the
    difference >= -1e-10) and stays above the exact Laplace covariance (>= -1e-8 relative)."""
    model, _, x, y, name, num_classes = build(case, **CG_MODE)
    exact, *_ = exact_laplace(model, x, y, name, num_classes)
    test_x = make_test_inputs(x.shape[-1], num=15)
    _, exact_covariance = reference_predictive(model, exact, x, test_x, num_classes)
    scale = float(exact_covariance.abs().max())
    previous = None
    for blocks in range(0, 6):
        model, *_ = build(case, **CG_MODE, covariance_iterations=blocks, covariance_block_size=6)
        model.variational_strategy.fit()
        covariance = _test_covariance(model, test_x)
        excess = covariance - exact_covariance
        assert float(torch.linalg.eigvalsh((excess + excess.mT) / 2)[0]) >= -1e-8 * scale
        if previous is not None:
            decrease = previous - covariance
            assert float(torch.linalg.eigvalsh((decrease + decrease.mT) / 2)[0]) >= -1e-10 * scale
            assert float(decrease.diagonal().sum()) > 0  # each block removes some uncertainty
        previous = covariance


def test_the_phase_spends_no_action_on_missing_outputs():
    """Correlated counts with missing outputs (NaN: no likelihood factor, W = 0 there; N = 30, C = 3, 67 of 90
    observed): the phase's directions live on the observed coordinates, as the solver's actions do, so Q has zero rows
    at the missing ones (the bounded noise 1 / min_curvature there is never used), and enough blocks give the dense
    Laplace covariance to 1e-10, never below it by more than rounding. (With directions on the missing coordinates
    the covariance fell below the exact one by 1e-8 and differed from it by 2.5e-9.)"""
    model, _, x, y, name, num_classes = build(
        "poisson-multitask-missing", **CG_MODE, covariance_iterations=20, covariance_block_size=12
    )
    assert model.variational_strategy.fit().converged
    missing = torch.isnan(y).reshape(-1)
    root = model.variational_strategy.state.precision_root
    assert int(missing.sum()) == 23 and root.shape[-1] > 10  # the phase added directions to the solver's 10
    assert torch.equal(root[missing], torch.zeros_like(root[missing]))
    exact, *_ = exact_laplace(model, x, y, name, num_classes)
    test_x = make_test_inputs(x.shape[-1])
    _, covariance = reference_predictive(model, exact, x, test_x, num_classes)
    excess = (_test_covariance(model, test_x) - covariance).detach()
    scale = float(covariance.abs().max())
    assert float(excess.abs().max()) <= 1e-10 * scale
    assert float(torch.linalg.eigvalsh((excess + excess.mT) / 2)[0]) >= -1e-10 * scale


def test_phase_keeps_the_recycled_buffer_and_repeated_fits_do_not_grow_the_state():
    model, *_ = build("softmax-shared", **CG_MODE, covariance_iterations=3, covariance_block_size=9)
    strategy = model.variational_strategy
    strategy.fit()
    first = strategy.state
    assert first.precision_root.shape[-1] > first.actions.shape[-1]  # Q holds the phase's directions, S does not
    strategy.fit()
    assert strategy.state.precision_root.shape[-1] <= first.precision_root.shape[-1] + 1


def test_curvature_matmul_inverts_the_noise_on_its_range():
    generator = torch.Generator().manual_seed(0)
    probabilities = torch.softmax(torch.randn(7, 4, generator=generator, dtype=torch.float64), -1)
    softmax_noise = SoftmaxPseudoInverse(probabilities)
    vectors = torch.randn(28, 5, generator=generator, dtype=torch.float64)
    centred = (vectors.reshape(7, 4, 5) - vectors.reshape(7, 4, 5).mean(1, keepdim=True)).reshape(28, 5)
    curvature = curvature_matmul(softmax_noise, 4)
    assert_relative(curvature(softmax_noise.matmul(centred)), centred, tol=1e-12)
    diagonal = DiagonalNoiseInverse(torch.rand(9, generator=generator, dtype=torch.float64) + 0.1)
    vectors = torch.randn(9, 2, generator=generator, dtype=torch.float64)
    assert_relative(curvature_matmul(diagonal, 1)(diagonal.matmul(vectors)), vectors, tol=1e-12)
    # a generic block-diagonal noise (EP's site blocks): pseudo-inverse of its blocks
    blocks = torch.randn(5, 3, 3, generator=generator, dtype=torch.float64)
    blocks = blocks @ blocks.mT + torch.eye(3, dtype=torch.float64)
    from linear_operator.operators import BlockDiagLinearOperator, DenseLinearOperator

    noise = BlockDiagLinearOperator(DenseLinearOperator(blocks))
    vectors = torch.randn(15, 2, generator=generator, dtype=torch.float64)
    assert_relative(curvature_matmul(noise, 3)(noise.matmul(vectors)), vectors, tol=1e-10)
    # EP's site blocks: rank C - 1 with the null space 1, inverted on the zero-sum vectors
    basis, _ = torch.linalg.qr(torch.eye(3, dtype=torch.float64)[:, :2] - 1 / 3)
    rotation, _ = torch.linalg.qr(torch.randn(5, 2, 2, generator=generator, dtype=torch.float64))
    eigenvalues = torch.rand(5, 2, generator=generator, dtype=torch.float64) + 0.1
    site_noise = SiteBlockNoiseInverse.from_site_spectrum(eigenvalues, basis @ rotation, min_precision=1e-3)
    centred = (vectors.reshape(5, 3, 2) - vectors.reshape(5, 3, 2).mean(1, keepdim=True)).reshape(15, 2)
    assert_relative(curvature_matmul(site_noise, 3)(site_noise.matmul(centred)), centred, tol=1e-10)


def test_phase_counts_products_and_stops_at_the_action_space():
    generator = torch.Generator().manual_seed(1)
    root = torch.randn(20, 20, generator=generator, dtype=torch.float64)
    kernel = root @ root.mT / 20
    noise = DiagonalNoiseInverse(torch.full((20,), 0.5, dtype=torch.float64))
    calls = []

    def kernel_matmul(vectors):
        calls.append(vectors.shape[-1])
        return kernel @ vectors

    empty = torch.zeros(20, 0, dtype=torch.float64)
    rows = RowBlock.single(20)
    phase = covariance_phase(kernel_matmul, noise, empty, empty, 1, iterations=10, block_size=8, rows_block=rows)
    assert phase.products == len(calls) <= 10 and phase.precision_root.shape[-1] == 20
    precision = phase.precision_root @ phase.precision_root.mT
    assert_relative(precision, torch.linalg.inv(kernel + 0.5 * torch.eye(20, dtype=torch.float64)), tol=1e-8)
    assert (
        covariance_phase(kernel_matmul, noise, empty, empty, 1, iterations=0, block_size=8, rows_block=rows).products
        == 0
    )
    # the memory limit: Q and K Q of 20 rows in float64 take 320 bytes a column; room for 12 columns
    with settings.recycled_buffer_limit(12 * 320), pytest.warns(BufferLimitWarning, match="covariance phase"):
        capped = covariance_phase(kernel_matmul, noise, empty, empty, 1, iterations=10, block_size=8, rows_block=rows)
    assert capped.precision_root.shape[-1] == 12
    gram = capped.precision_root.mT @ (kernel + 0.5 * torch.eye(20, dtype=torch.float64)) @ capped.precision_root
    assert_relative(gram, torch.eye(12, dtype=torch.float64), tol=1e-8)
    with pytest.raises(ValueError, match="covariance_iterations"):
        build("probit", covariance_iterations=-1)
    with pytest.raises(ValueError, match="covariance_block_size"):
        build("probit", covariance_block_size=0)


def _ep_regression_covariance(model, x, test_x):
    """K** - K*X (K + T̃^{-1})^{-1} KX* for the fitted binary EP sites (dense)."""
    precision, _ = model.variational_strategy.sites
    with torch.no_grad():
        kernel = model.covar_module(x).to_dense()
        cross = model.covar_module(test_x, x).to_dense()
        test_kernel = model.covar_module(test_x).to_dense()
    system = kernel + torch.diag(1 / precision)
    return test_kernel - cross @ torch.linalg.solve(system, cross.mT)


def test_ep_phase_narrows_the_marginals_to_those_of_its_sites_regression():
    """Binary probit EP with 4 CG iterations per sweep: the phase's covariance lies between the solver's and the exact
    one of the final sites' regression, and equals the latter once the actions span the space (N = 40)."""
    x, y = binary_data(40, seed=3)
    # plain CG (a preconditioner's factor would span these 40 points before the phase)
    options = dict(
        policy="cg", max_solver_iterations=4, max_sweeps=15, strategy_class=EPStrategy, preconditioner_rank=0
    )
    test_x = make_test_inputs(x.shape[-1])
    covariances = {}
    for blocks in (0, 2, 12):
        model = IterNCGPModel(
            x,
            y,
            gpytorch.likelihoods.BernoulliLikelihood(),
            covariance_iterations=blocks,
            covariance_block_size=5,
            **options,
        )
        model.variational_strategy.fit()
        covariances[blocks] = (_test_covariance(model, test_x), _ep_regression_covariance(model, x, test_x))
    exact = covariances[12][1]
    assert_relative(covariances[12][0], exact, tol=1e-6)
    for blocks in (0, 2):
        assert_relative(covariances[blocks][1], exact, tol=1e-10)  # the phase runs after the sweeps: same sites
    excess = [covariances[blocks][0] - exact for blocks in (0, 2)]
    assert float(excess[0].diagonal().max()) > 1e-3
    assert float(torch.linalg.eigvalsh(excess[1]).min()) > -1e-8
    assert float(torch.linalg.eigvalsh(excess[0] - excess[1]).min()) > -1e-10
    assert float(excess[1].diagonal().sum()) < 0.5 * float(excess[0].diagonal().sum())


def test_multiclass_ep_phase_shrinks_the_marginal_blocks():
    x, y = multiclass_data(45, 3, seed=2)
    blocks = {}
    for iterations in (0, 4):
        model = IterNCGPModel(
            x,
            y,
            MultinomialProbitLikelihood(3),
            strategy_class=EPStrategy,
            policy="cg",
            max_solver_iterations=3,
            max_sweeps=8,
            covariance_iterations=iterations,
            covariance_block_size=15,
        )
        model.variational_strategy.fit()
        with torch.no_grad():
            blocks[iterations] = model.variational_strategy.marginal_latent_blocks(make_test_inputs(2))[1]
    decrease = blocks[0] - blocks[4]
    assert float(torch.linalg.eigvalsh(decrease).min()) >= -1e-10
    assert float(decrease.diagonal(dim1=-2, dim2=-1).sum()) > 1e-3
