"""Correlated multi-output priors (a ``MultitaskMultivariateNormal``) with IterNCGP, beyond the exact-Laplace cases.

``tests/test_exact_laplace.py`` checks mode, mean and covariance against the dense reference for a softmax with a
``MultitaskKernel`` and multi-output counts with an ``LCMKernel`` (and with missing outputs). Here: one product
with :math:`\\mathbf K` per IterGP iteration, the Laplace evidence and its gradient with respect to the
coregionalisation parameters (finite differences of the dense reference), ``state_dict``, float32, the linear model
of coregionalisation written as mixing :math:`\\mathbf f = \\mathbf H \\mathbf x`, and target validation.
"""

from __future__ import annotations

import math
import warnings

import gpytorch
import pytest
import torch

from gpytorch_iterncgp import EPStrategy, LaplaceMarginalLogLikelihood, settings
from gpytorch_iterncgp.core.prior import LatentPrior
from gpytorch_iterncgp.likelihoods.adapters import MultitaskPoissonLikelihood
from tests import reference
from tests.common import LMCIterNCGPModel, MultitaskIterNCGPModel, multioutput_count_data
from tests.test_exact_laplace import (
    EXACT,
    assert_relative,
    build,
    data_major_mean,
    dense_prior,
    exact_laplace,
    make_test_inputs,
    reference_predictive,
)

MULTITASK_CASES = ["softmax-multitask", "poisson-multitask-lcm", "poisson-multitask-missing"]


# ---------------------------------------------------------------------------------------------------
# The cost: one product with K (one matmul of the multitask / LCM operator) per IterGP iteration.
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", MULTITASK_CASES)
def test_one_kernel_product_per_solver_iteration(case):
    # (a rank-4 Nyström preconditioner: its sketch, a product counted apart, would span these few points at rank 100)
    # (no covariance phase: the products of the loop alone, paper Alg. 2)
    model, *_ = build(
        case, policy="cg", max_solver_iterations=3, max_newton_steps=6, preconditioner_rank=4, covariance_iterations=0
    )
    strategy = model.variational_strategy
    report = strategy.fit()
    assert report.solver_iterations > 0
    assert report.kernel_products == report.solver_iterations
    assert report.kernel_columns == report.kernel_products  # one vector per product
    assert all(step.kernel_products == step.solver_iterations for step in report.records)
    # after a change of the coregionalisation, one extra product renews K a and K S (a warm start)
    with torch.no_grad():
        for module in model.covar_module.modules():
            if isinstance(module, gpytorch.kernels.IndexKernel):
                module.covar_factor.mul_(1.3)
    changed = strategy.fit(max_newton_steps=2)
    assert changed.kernel_products == changed.solver_iterations + 1


# ---------------------------------------------------------------------------------------------------
# The evidence and its gradient w.r.t. the coregionalisation (and all other) parameters, exact regime.
# ---------------------------------------------------------------------------------------------------
def _reference_evidence(model, x, y, name, num_classes) -> float:
    with torch.no_grad():
        kernel = dense_prior(model, x, x, num_classes)
        mean = data_major_mean(model, x, num_classes)
    return reference.laplace_evidence(kernel, mean, y, name, num_classes)[0]


@pytest.mark.parametrize("case", MULTITASK_CASES)
def test_evidence_and_its_gradient_match_the_dense_reference(case):
    model, likelihood, x, y, name, num_classes = build(case, **EXACT)
    mll = LaplaceMarginalLogLikelihood(likelihood, model)
    model.train()
    evidence = mll(model(x), y) * len(x)
    evidence.backward()
    expected = _reference_evidence(model, x, y, name, num_classes)
    assert math.isclose(float(evidence.detach()), expected, rel_tol=1e-10), (float(evidence.detach()), expected)

    # central differences of the dense reference, raw parameter by raw parameter
    step = 1e-5
    checked = set()
    for parameter_name, parameter in model.named_parameters():
        assert parameter.grad is not None, parameter_name
        flat = parameter.data.view(-1)
        for index in range(flat.numel()):
            original = float(flat[index])
            values = []
            for sign in (1, -1):
                flat[index] = original + sign * step
                values.append(_reference_evidence(model, x, y, name, num_classes))
            flat[index] = original
            difference = (values[0] - values[1]) / (2 * step)
            gradient = float(parameter.grad.view(-1)[index])
            assert abs(gradient - difference) <= 1e-5 * max(1.0, abs(difference)), (parameter_name, index)
        checked.add(parameter_name.rsplit(".", 1)[-1])
    assert {"covar_factor", "raw_var", "raw_lengthscale", "raw_constant"} <= checked


# ---------------------------------------------------------------------------------------------------
# Predictions of the counts, state_dict, float32.
# ---------------------------------------------------------------------------------------------------
def test_expected_counts_and_latent_blocks():
    r""":math:`\mathbb E[y_{*c}] = e^{\mu_c + \sigma_c^2 / 2}` from the reference's marginals; the :math:`C \times C`
    blocks of the posterior covariance; GPyTorch's sampled predictive has the shape of the targets."""
    model, likelihood, x, y, name, num_classes = build("poisson-multitask-lcm", **EXACT)
    exact, _, _ = exact_laplace(model, x, y, name, num_classes)
    model.eval()
    test_x = make_test_inputs(1)
    mean, covariance = reference_predictive(model, exact, x, test_x, num_classes)
    strategy = model.variational_strategy
    with torch.no_grad():
        expected_counts = strategy.predictive_mean(test_x)
        block_mean, blocks = strategy.marginal_latent_blocks(test_x)
        samples = likelihood(model(test_x)).sample()
    assert_relative(expected_counts, torch.exp(mean + covariance.diagonal() / 2).reshape(-1, num_classes))
    assert_relative(block_mean, mean.reshape(-1, num_classes))
    expected_blocks = torch.stack([covariance[3 * n : 3 * n + 3, 3 * n : 3 * n + 3] for n in range(len(test_x))])
    assert_relative(blocks, expected_blocks)
    assert samples.shape[-2:] == (len(test_x), num_classes)


@pytest.mark.parametrize("case", ["softmax-multitask", "poisson-multitask-missing"])
def test_state_dict_round_trip_needs_no_fit(case):
    model, likelihood, x, y, _, num_classes = build(case, policy="cg", max_solver_iterations=4)
    model.variational_strategy.fit()
    saved = model.state_dict()
    fresh, *_ = build(case, policy="cg", max_solver_iterations=4)
    with torch.no_grad():
        for parameter in fresh.parameters():
            parameter.add_(0.1)  # the saved hyperparameters must replace these
    fresh.load_state_dict(saved)
    model.eval()
    fresh.eval()
    test_x = make_test_inputs(x.shape[-1])
    with torch.no_grad():
        expected, loaded = model(test_x), fresh(test_x)
    assert fresh.variational_strategy.last_report is None  # predicted from the loaded state
    assert torch.equal(loaded.mean, expected.mean) and torch.equal(loaded.variance, expected.variance)


@pytest.mark.parametrize("case", MULTITASK_CASES)
def test_float32_fit_is_the_float64_laplace_approximation(case):
    model, _, x, y, name, num_classes = build(case, **EXACT)
    exact, _, _ = exact_laplace(model, x, y, name, num_classes)
    model.eval()
    test_x = make_test_inputs(x.shape[-1])
    mean, covariance = reference_predictive(model, exact, x, test_x, num_classes)

    single, *_ = build(case, policy="unit", max_solver_iterations=None, outer_tol=1e-5, abs_tol=1e-5, rel_tol=1e-6)
    with torch.no_grad():
        for target, source in zip(single.parameters(), model.parameters(), strict=True):
            target.copy_(source)
    single = single.float()
    single.variational_strategy.train_inputs = x.float()
    single.variational_strategy.train_targets = single.variational_strategy.train_targets.float()
    assert single.variational_strategy.fit().converged
    single.eval()
    with torch.no_grad():
        posterior = single(test_x.float())
    assert posterior.mean.dtype == torch.float32
    assert_relative(single.variational_strategy.mode.double(), exact.mode.reshape(-1, num_classes), 1e-4)
    assert_relative(posterior.mean.double().reshape(-1), mean, 1e-4)
    assert_relative(posterior.variance.double().reshape(-1), covariance.diagonal(), 1e-3)


# ---------------------------------------------------------------------------------------------------
# The LMC written as mixing f = H x of independent latent GPs: an LCMKernel, exact Laplace, evidence gradient in H.
# ---------------------------------------------------------------------------------------------------
def _lmc(missing: float = 0.0, **options):
    x, y = multioutput_count_data(30, seed=10, missing=missing)
    likelihood = MultitaskPoissonLikelihood(num_tasks=3)
    mixing = torch.tensor([[1.0, 0.3], [-0.6, 0.8], [0.4, -0.9]], dtype=x.dtype)  # H, (C, Q) = (3, 2)
    model = LMCIterNCGPModel(x, y, likelihood, mixing, lengthscales=[0.25, 0.6], **options)
    return model, likelihood, x, y


def test_lmc_mixing_is_an_lcm_kernel_with_rank_one_task_covariances():
    r""":math:`\operatorname{Cov}(\mathbf H \mathbf x(t), \mathbf H \mathbf x(t')) = \sum_q \mathbf h_q \mathbf h_q^\top k_q(t, t')`:
    GPyTorch's ``LCMKernel`` with ``covar_factor`` :math:`\mathbf h_q` and task variances 0."""
    model, likelihood, x, y = _lmc()
    lcm = MultitaskIterNCGPModel(x, y, likelihood, num_tasks=3, kernel="lcm", rank=1, num_components=2)
    with torch.no_grad():
        for q, component in enumerate(lcm.covar_module.covar_module_list):
            component.data_covar_module.lengthscale = model.latent_covar_module.lengthscale[q]
            component.task_covar_module.covar_factor.copy_(model.mixing[:, q : q + 1])
            component.task_covar_module.var = torch.full((3,), 1e-14, dtype=x.dtype)
        mixed = model.forward(x).covariance_matrix
        assert_relative(lcm.covar_module(x).to_dense(), mixed, 1e-12)
    assert int(torch.linalg.matrix_rank(mixed)) <= 2 * len(x)  # rank <= Q N < C N: a singular prior


@pytest.mark.parametrize("missing", [0.0, 0.25])
def test_lmc_mixing_gives_the_exact_laplace_posterior_and_evidence_gradient(missing):
    model, likelihood, x, y = _lmc(missing, **EXACT)
    report = model.variational_strategy.fit()
    assert report.converged
    with torch.no_grad():
        kernel = model.forward(x).covariance_matrix
    zero = torch.zeros(kernel.shape[0], dtype=x.dtype)
    exact = reference.laplace_mode(kernel, zero, y, "poisson_exp", 3)
    assert_relative(model.variational_strategy.mode, exact.mode.reshape(-1, 3))
    model.eval()
    test_x = make_test_inputs(1)
    with torch.no_grad():
        posterior = model(test_x)
        joint = model.forward(torch.cat([x, test_x])).covariance_matrix
    num = 3 * len(x)
    mean, covariance = exact.predict(joint[num:, :num], joint[num:, num:], torch.zeros(3 * len(test_x), dtype=x.dtype))
    assert_relative(posterior.mean.reshape(-1), mean)
    assert_relative(posterior.variance.reshape(-1), covariance.diagonal())

    # d evidence / d H against central differences of the dense reference
    model.train()
    mll = LaplaceMarginalLogLikelihood(likelihood, model)
    evidence = mll(model(x), y) * len(x)
    evidence.backward()

    def reference_evidence() -> float:
        with torch.no_grad():
            dense = model.forward(x).covariance_matrix
        return reference.laplace_evidence(dense, zero, y, "poisson_exp", 3)[0]

    assert math.isclose(float(evidence.detach()), reference_evidence(), rel_tol=1e-10)
    step, mixing = 1e-5, model.mixing.data
    for index in range(mixing.numel()):
        original = float(mixing.view(-1)[index])
        values = []
        for sign in (1, -1):
            mixing.view(-1)[index] = original + sign * step
            values.append(reference_evidence())
        mixing.view(-1)[index] = original
        difference = (values[0] - values[1]) / (2 * step)
        assert abs(float(model.mixing.grad.view(-1)[index]) - difference) <= 1e-5 * max(1.0, abs(difference))


# ---------------------------------------------------------------------------------------------------
# Targets of the multi-output count likelihood.
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (torch.ones(30), r"shape \(N, 3\)"),
        (torch.ones(30, 2), r"shape \(N, 3\)"),
        (torch.full((30, 3), math.inf), "inf"),
        (-torch.ones(30, 3), "non-negative"),
        (torch.full((30, 3), 0.5), "integers"),
    ],
)
def test_invalid_count_targets_are_refused(targets, message):
    x, _ = multioutput_count_data(30)
    with pytest.raises(ValueError, match=message):
        MultitaskIterNCGPModel(x, targets.double(), MultitaskPoissonLikelihood(num_tasks=3))


def test_missing_outputs_are_fine_but_ep_is_refused():
    x, y = multioutput_count_data(30, missing=0.3)
    y[0] = torch.nan  # one point without any observed output
    model = MultitaskIterNCGPModel(x, y, MultitaskPoissonLikelihood(num_tasks=3), policy="cg", max_solver_iterations=5)
    assert model.variational_strategy.fit().converged
    assert bool(torch.isfinite(model.variational_strategy.mode).all())
    with pytest.raises(TypeError, match="tilted moments"):
        MultitaskIterNCGPModel(x, y, MultitaskPoissonLikelihood(num_tasks=3), strategy_class=EPStrategy)


# ---------------------------------------------------------------------------------------------------
# The data-major prior of a multitask model: blocks, point blocks and (chunked) products without dense detours.
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["multitask", "lcm", "lmc-operator"])
def test_multitask_prior_blocks_and_chunked_products_equal_the_dense_matrix(kernel):
    x, y = multioutput_count_data(40, seed=11)
    likelihood = MultitaskPoissonLikelihood(num_tasks=3)
    if kernel == "lmc-operator":
        model = LMCIterNCGPModel(x, y, likelihood, torch.randn(3, 2, dtype=x.dtype), lengthscales=[0.2, 0.5])
    else:
        model = MultitaskIterNCGPModel(x, y, likelihood, num_tasks=3, kernel=kernel, rank=2)
    num_train, rhs = 25, torch.randn(40 * 3, 2, dtype=x.dtype)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. linear_operator's sparse interpolation when slicing interleaved entries
        dense = model.forward(x).covariance_matrix
        prior = LatentPrior.from_distribution(model.forward(x), 3)
        assert_relative(
            prior.point_blocks(), torch.stack([dense[3 * n : 3 * n + 3, 3 * n : 3 * n + 3] for n in range(40)])
        )
        test_block = prior.block(slice(num_train, None), slice(num_train, None))
        cross_block = prior.block(slice(num_train, None), slice(None, num_train))
        assert_relative(test_block.data_major_covariance().to_dense(), dense[3 * num_train :, 3 * num_train :])
        assert_relative(
            test_block.point_blocks(),
            torch.stack([dense[3 * n : 3 * n + 3, 3 * n : 3 * n + 3] for n in range(num_train, 40)]),
        )
        assert_relative(
            cross_block.matmul(rhs[: 3 * num_train]), dense[3 * num_train :, : 3 * num_train] @ rhs[: 3 * num_train]
        )
        with settings.dense_kernel_limit(1000), settings.kernel_chunk_bytes(7 * 120 * 8):  # 7 rows -> 6 (2 points)
            chunked = LatentPrior.from_distribution(model.forward(x), 3)
            assert_relative(chunked.matmul(rhs), dense @ rhs, 1e-12)
