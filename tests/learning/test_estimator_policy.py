"""The scikit-learn estimators' policy (:mod:`gpytorch_iterncgp.learning.estimator_policy`) against the numbers its
docstrings state: ``auto_inference`` at the boundaries of its switch, the solver budget rule case by case, the
strategy's options, the refusal of parameters the inference ignores, the default kernel, and the estimators'
constructor defaults being the policy's (and the solver's and recipes') defaults."""

from __future__ import annotations

import dataclasses
import inspect
import math

import gpytorch
import pytest
import torch

from gpytorch_iterncgp import (
    EPMarginalLogLikelihood,
    EPStrategy,
    IterNCGPStrategy,
    LaplaceMarginalLogLikelihood,
    LogitBernoulliLikelihood,
    MinibatchRecipe,
    SolverOptions,
    UnitVectorPolicy,
)
from gpytorch_iterncgp.learning import estimator_policy
from gpytorch_iterncgp.learning.estimator_policy import (
    ESTIMATOR_DEFAULTS,
    EXACT_MARGINAL_TOL,
    auto_inference,
    check_parameters_apply,
    default_kernel,
    evidence_class,
    solver_budget,
)
from tests.common import IterNCGPModel, binary_data


# ---------------------------------------------------------------------------------------------------
# inference="auto"
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("num_classes", "last_dense"),
    [
        (2, 15_000),  # binary: the points' limit alone
        (3, 15_000),  # 15 001 * 3 < 8e4 and 15 001 * 27 < 4e7: the points' limit
        (10, 8_000),  # 8001 * 10 > 8e4: the latent values' limit (8001 * 1000 < 4e7)
        (26, 2_275),  # 2275 * 26**3 = 39 985 400 <= 4e7 < 2276 * 26**3 = 40 002 976
        (40, 625),  # 625 * 64 000 = 4e7 exactly (not past it) < 626 * 64 000
    ],
)
def test_auto_inference_switches_to_stochastic_ep_just_past_its_limits(num_classes, last_dense):
    assert auto_inference(last_dense, num_classes) == "ep"
    assert auto_inference(last_dense + 1, num_classes) == "sparse_ep"
    assert auto_inference(1, num_classes) == "ep"


def test_auto_inference_counts_nested_work_only_for_more_than_two_classes(monkeypatch):
    monkeypatch.setattr(estimator_policy, "SPARSE_EP_NESTED_WORK", 10)
    assert auto_inference(100, 2) == "ep"  # binary EP has no nested EP
    assert auto_inference(100, 3) == "sparse_ep"
    monkeypatch.setattr(estimator_policy, "SPARSE_EP_NESTED_WORK", 10**12)
    monkeypatch.setattr(estimator_policy, "SPARSE_EP_LATENT_VALUES", 10)
    assert auto_inference(100, 2) == "ep"  # the latent values' limit is for classes only
    assert auto_inference(100, 3) == "sparse_ep"
    assert estimator_policy.CLASSIFIER_INFERENCE == "ep" and estimator_policy.REGRESSOR_INFERENCE == "laplace"


# ---------------------------------------------------------------------------------------------------
# The solver budget
# ---------------------------------------------------------------------------------------------------
def _budget(num_points, num_latents=1, inference="laplace", policy="auto", iterations="auto", tol=1e-5):
    return solver_budget(policy, iterations, tol, num_points, num_latents, inference)


@pytest.mark.parametrize(("num_points", "num_latents"), [(1000, 1), (500, 2), (333, 3), (1, 1)])
def test_budget_is_the_exact_posterior_up_to_a_thousand_latent_values(num_points, num_latents):
    for inference in ("laplace", "ep"):
        for policy in ("auto", "unit"):
            budget = _budget(num_points, num_latents, inference, policy=policy)
            assert budget["policy"] == "unit" and budget["max_solver_iterations"] is None
            assert budget["solver_tol"] == 0.0 and budget["exact"] is True
            assert "exact Laplace posterior" in budget["rule"]


def test_budget_with_another_policy_on_a_small_problem_solves_to_the_tolerance():
    budget = _budget(1000, policy="cg", tol=1e-7)
    assert budget == dict(
        policy="cg",
        max_solver_iterations=None,
        solver_tol=1e-7,
        exact=False,
        rule="N C = 1000 <= 1000, policy 'cg': each solve until the residual is below solver_tol = 1e-07",
    )


@pytest.mark.parametrize(
    ("num_points", "num_latents", "inference", "iterations"),
    [
        (1001, 1, "laplace", 5),  # just past the exact size
        (334, 3, "laplace", 5),  # N C = 1002
        (25_000, 1, "laplace", 5),  # Laplace's Newton steps use only the mean: no growth
        (10_000, 1, "ep", 5),  # EP up to 10 000 points of one latent: the default
        (10_001, 1, "ep", 10),  # 5 ceil(N / 10^4)
        (20_000, 1, "ep", 10),
        (20_001, 1, "ep", 15),
        (25_000, 1, "ep", 15),
        (25_000, 10, "ep", 5),  # multi-class EP: the default
    ],
)
def test_budget_past_a_thousand_latent_values_is_cg_with_the_documented_iterations(
    num_points, num_latents, inference, iterations
):
    budget = _budget(num_points, num_latents, inference)
    assert budget["policy"] == "cg" and budget["max_solver_iterations"] == iterations
    assert budget["solver_tol"] == 1e-5 and budget["exact"] is False
    assert f"at most {iterations} solver iterations per" in budget["rule"]
    unit = _budget(num_points, num_latents, inference, policy="unit")  # an explicit policy is kept
    assert unit["policy"] == "unit" and unit["max_solver_iterations"] == iterations


def test_budget_set_by_the_user_is_kept():
    policy = UnitVectorPolicy(seed=3)
    for num_points in (10, 25_000):
        budget = _budget(num_points, inference="ep", policy=policy, iterations=7, tol=1e-3)
        assert budget["policy"] is policy and budget["max_solver_iterations"] == 7
        assert budget["solver_tol"] == 1e-3 and budget["exact"] is False
        assert budget["rule"] == "max_solver_iterations set by the user"
    budget = _budget(10, iterations=None)  # no budget asked for: "auto" policy is CG, to the tolerance
    assert budget["policy"] == "cg" and budget["max_solver_iterations"] is None and budget["solver_tol"] == 1e-5


def test_documented_constants():
    assert estimator_policy.EXACT_SOLVE_SIZE == 1000
    assert estimator_policy.EP_POINTS_PER_BUDGET == 10_000
    assert estimator_policy.DEFAULT_SOLVER_ITERATIONS == 5 == SolverOptions().max_solver_iterations
    assert (estimator_policy.SPARSE_EP_POINTS, estimator_policy.SPARSE_EP_NESTED_WORK) == (15_000, 4 * 10**7)


# ---------------------------------------------------------------------------------------------------
# The strategy's options and evidence
# ---------------------------------------------------------------------------------------------------
def test_strategy_options_are_the_rules_then_the_solver_options():
    """The strategy's keywords: the budget's policy (a copy), iterations and tolerance (both ``abs_tol`` and
    ``rel_tol``), the estimator's seed, progress bar and loose-fit steps, EP's marginals to ``EXACT_MARGINAL_TOL``
    with exact solves; then each ``solver_options`` key replaces the option of its name alone."""
    policy = UnitVectorPolicy(seed=1)
    common = dict(seed=4, train_fit_steps=3, show_progress=False, stacklevel=1)
    expected = dict(max_solver_iterations=9, train_fit_steps=3, abs_tol=1e-5, rel_tol=1e-5, seed=4, show_progress=False)
    given = dict(policy=policy, max_solver_iterations=9, compression_rank=7, recycle=False)
    for inference, steps in (("laplace", "max_newton_steps"), ("ep", "max_sweeps")):
        budget, options = estimator_policy.solver_settings("E", {**given, steps: 12}, {}, inference, 2000, 1, **common)
        assert options.pop("policy") is not policy  # a copy: the estimator's policy is not advanced by its fits
        assert options == {**expected, "compression_rank": 7, "recycle": False, steps: 12}
        assert budget["max_solver_iterations"] == 9 and budget["rule"] == "max_solver_iterations set by the user"
    # exact solves (a few hundred latent values): EP until its marginals settle to EXACT_MARGINAL_TOL, unless given
    _, exact = estimator_policy.solver_settings("E", None, {}, "ep", 100, 1, **common)
    assert exact["marginal_tol"] == EXACT_MARGINAL_TOL and exact["abs_tol"] == exact["rel_tol"] == 0.0
    _, given_tol = estimator_policy.solver_settings("E", {"marginal_tol": None}, {}, "ep", 100, 1, **common)
    assert given_tol["marginal_tol"] is None
    with pytest.raises(ValueError, match=r"solver_options\['max_sweeps'\] is no option of IterNCGPStrategy"):
        estimator_policy.solver_settings("E", {"max_sweeps": 3}, {}, "laplace", 100, 1, **common)
    with pytest.raises(ValueError, match=r"estimator's parameter train_fit_steps="):
        estimator_policy.solver_settings("E", {"train_fit_steps": 3}, {}, "laplace", 100, 1, **common)
    with pytest.raises(ValueError, match="'solver_options' parameter of E is invalid"):
        estimator_policy.solver_settings("E", {"outer_tol": -1.0}, {}, "laplace", 100, 1, **common)


def test_the_former_solver_parameters_map_to_the_strategys_names():
    """``max_newton_steps`` is EP's ``max_sweeps``, ``outer_tol`` EP's ``site_tol`` with the sites' test alone, and
    ``solver_tol`` both tolerances of the budget; a parameter left ``DEPRECATED`` is not given."""
    from gpytorch_iterncgp.core.validation import DEPRECATED

    former = {name: DEPRECATED for name in estimator_policy.FORMER_SOLVER_PARAMETERS}
    former.update(max_newton_steps=12, outer_tol=1e-3, solver_tol=1e-6, max_solver_iterations=9)
    common = dict(seed=4, train_fit_steps=3, show_progress=False, stacklevel=1)
    with pytest.warns(FutureWarning, match=r"outer_tol= as solver_options\['site_tol'\]"):
        budget, ep = estimator_policy.solver_settings("E", None, former, "ep", 2000, 1, **common)
    assert (ep["max_sweeps"], ep["site_tol"], ep["marginal_tol"], ep["abs_tol"], ep["rel_tol"]) == (
        12,
        1e-3,
        None,
        1e-6,
        1e-6,
    )
    assert budget["solver_tol"] == 1e-6
    with pytest.warns(FutureWarning, match=r"outer_tol= as solver_options\['outer_tol'\]"):
        _, laplace = estimator_policy.solver_settings("E", None, former, "laplace", 2000, 1, **common)
    assert (laplace["max_newton_steps"], laplace["outer_tol"]) == (12, 1e-3) and "marginal_tol" not in laplace


def test_the_evidence_class_follows_the_strategy():
    x, y = binary_data(10)
    for strategy_class, evidence in (
        (IterNCGPStrategy, LaplaceMarginalLogLikelihood),
        (EPStrategy, EPMarginalLogLikelihood),
    ):
        model = IterNCGPModel(x, y, LogitBernoulliLikelihood(), strategy_class=strategy_class)
        assert evidence_class(model.variational_strategy) is evidence


# ---------------------------------------------------------------------------------------------------
# Parameters the inference ignores
# ---------------------------------------------------------------------------------------------------
DEFAULTS = dict(policy="auto", solver_tol=1e-5, num_inducing=256, batch_size=512)


def test_a_dense_parameter_under_stochastic_ep_is_refused_by_name():
    values = {**DEFAULTS, "policy": "cg", "solver_tol": 1e-3}
    expected = (
        "Est: policy='cg', solver_tol=0.001 do(es) not apply: inference='sparse_ep', which does not use it. Set "
        "inference='ep' or 'laplace' to use it, or leave it at its default."
    )
    with pytest.raises(ValueError) as error:
        check_parameters_apply("Est", values, DEFAULTS, "sparse_ep", "sparse_ep", 100)
    assert str(error.value) == expected
    check_parameters_apply("Est", values, DEFAULTS, "ep", "ep", 100)  # dense inference reads them


def test_a_stochastic_ep_parameter_under_dense_inference_is_refused_by_name():
    values = {**DEFAULTS, "num_inducing": 10}
    expected = (
        "Est: num_inducing=10 do(es) not apply: inference='auto' chose 'laplace' for 30 points, which does not use "
        "it. Set inference='sparse_ep' to use it, or leave it at its default."
    )
    with pytest.raises(ValueError) as error:
        check_parameters_apply("Est", values, DEFAULTS, "laplace", "auto", 30)
    assert str(error.value) == expected
    check_parameters_apply("Est", values, DEFAULTS, "sparse_ep", "sparse_ep", 30)
    check_parameters_apply("Est", DEFAULTS, DEFAULTS, "ep", "ep", 30)  # all at their defaults
    check_parameters_apply("Est", {"batch_size": 3}, {}, "ep", "ep", 30)  # no default known: not checked


def test_the_estimator_refuses_an_inapplicable_parameter():
    pytest.importorskip("sklearn")
    from gpytorch_iterncgp.sklearn import IterNCGPClassifier

    x, y = binary_data(20)
    with pytest.raises(ValueError, match="IterNCGPClassifier: batch_size=8 do\\(es\\) not apply: inference='ep'"):
        IterNCGPClassifier(inference="ep", batch_size=8).fit(x.numpy(), y.numpy())


# ---------------------------------------------------------------------------------------------------
# The default kernel and the constructor defaults
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_features", [1, 3, 30])
def test_default_kernel_is_a_log_parametrised_matern_at_root_d(num_features):
    kernel = default_kernel(num_features)
    assert isinstance(kernel, gpytorch.kernels.ScaleKernel)
    assert isinstance(kernel.base_kernel, gpytorch.kernels.MaternKernel)
    assert kernel.base_kernel.nu == 2.5 and kernel.batch_shape == torch.Size([])
    assert kernel.raw_outputscale.dtype == torch.float64
    # (set as float64 tensors: GPyTorch's setter passes a Python float through torch's default float32)
    assert float(kernel.base_kernel.lengthscale.detach()) == pytest.approx(math.sqrt(num_features), rel=1e-15)
    assert float(kernel.base_kernel.raw_lengthscale.detach()) == pytest.approx(0.5 * math.log(num_features), abs=1e-15)
    assert float(kernel.outputscale.detach()) == 1.0 and float(kernel.raw_outputscale.detach()) == 0.0  # log 1
    assert torch.equal(kernel.base_kernel.raw_lengthscale_constraint.transform(torch.zeros(1)), torch.ones(1))  # exp
    assert default_kernel(num_features, torch.float32).raw_outputscale.dtype == torch.float32


def test_estimator_constructor_defaults_are_the_policys_and_the_options():
    pytest.importorskip("sklearn")
    from gpytorch_iterncgp.sklearn import IterNCGPClassifier, IterNCGPPoissonRegressor

    rule = ("policy", "max_solver_iterations", "solver_tol")  # the solver budget's defaults, not parameters
    fields = [field.name for field in dataclasses.fields(ESTIMATOR_DEFAULTS) if field.name not in rule]
    expected = {name: getattr(ESTIMATOR_DEFAULTS, name) for name in fields}
    expected["train_fit_steps"] = SolverOptions().train_fit_steps
    expected.update(
        solver_options=None,  # the estimator's rules (solver_budget), the strategy's options otherwise
        optimizer_steps="auto",  # LearningRecipe's or MinibatchRecipe's, by the inference
        learning_rate="auto",
        learning_fit_steps="deprecated",  # the old name of train_fit_steps: not given
        optimize_hyperparameters="deprecated",  # optimizer_steps=0 says the same
        batch_size=MinibatchRecipe().batch_size,
        **{name: "deprecated" for name in estimator_policy.FORMER_SOLVER_PARAMETERS},  # now solver_options keys
    )
    assert expected["inference"] == "auto" and expected["num_inducing"] == 256 and ESTIMATOR_DEFAULTS.solver_tol == 1e-5
    for estimator in (IterNCGPClassifier, IterNCGPPoissonRegressor):
        defaults = {name: p.default for name, p in inspect.signature(estimator.__init__).parameters.items()}
        assert {name: defaults[name] for name in expected} == expected
        params = estimator().get_params()
        assert {name: params[name] for name in expected} == expected
