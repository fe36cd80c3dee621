"""The kernel chosen by the evidence (``fit_mll(kernels=...)``, the estimators' ``kernel="auto"``): the family, the
choice on data with a known structure (linear, one relevant feature, isotropic), the report, the errors."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import warnings

import gpytorch
import numpy as np
import pytest
import torch

from gpytorch_iterncgp import (
    ExpPoissonLikelihood,
    LaplaceMarginalLogLikelihood,
    LearningRecipe,
    LogitBernoulliLikelihood,
    MinibatchRecipe,
    fit_mll,
)
from gpytorch_iterncgp.kernels.additive import FirstOrderAdditiveKernel
from gpytorch_iterncgp.kernels.family import kernel_family
from gpytorch_iterncgp.kernels.warping import KumaraswamyWarpedKernel
from gpytorch_iterncgp.learning.estimator_policy import AUTO_KERNELS, default_kernel
from gpytorch_iterncgp.learning.kernel_choice import candidate_kernels
from gpytorch_iterncgp.learning.scores import poisson_deviance
from tests.common import IterNCGPModel, count_data

#: the solver and learning of every fit here: CG to a tolerance (cheaper than the exact unit-vector solves the
#: estimators take at this size), 10 L-BFGS iterations
SOLVER = dict(policy="cg", max_solver_iterations=None, abs_tol=1e-4, rel_tol=1e-4)
RECIPE = LearningRecipe(optimizer_steps=10)


def _model(x, y, likelihood=None, kernel=None, **options):
    """An IterNCGP Laplace model of ``x``, ``y`` with ``kernel`` (default: the estimators' Matérn)."""
    likelihood = LogitBernoulliLikelihood() if likelihood is None else likelihood
    model = IterNCGPModel(x, y, likelihood, **{**SOLVER, **options})
    model.covar_module = default_kernel(x.shape[1]) if kernel is None else kernel
    return model, LaplaceMarginalLogLikelihood(likelihood, model)


def _labels(latent: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Bernoulli labels of the logistic model :math:`p(y = 1) = \\sigma(f)`."""
    return (torch.rand(latent.shape, generator=generator, dtype=latent.dtype) < torch.sigmoid(latent)).double()


def linear_data(num_data: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """3 standard normal features, labels from a logistic model on :math:`f = 3 (2 x_1 - 1.5 x_2 + x_3)`."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_data, 3, generator=generator, dtype=torch.float64)
    return x, _labels(3 * x @ torch.tensor([2.0, -1.5, 1.0], dtype=torch.float64), generator)


def wide_linear_data(num_data: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    r"""8 standard normal features, labels from a logistic model on :math:`f = 8.1\, w^\top x / \lVert w \rVert`, the
    weights :math:`w` evenly spaced from 2 to -1.5: a linear function an isotropic Matérn learns slowly from few
    points."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_data, 8, generator=generator, dtype=torch.float64)
    weights = torch.linspace(2.0, -1.5, 8, dtype=torch.float64)
    return x, _labels(8.1 * x @ weights / weights.norm(), generator)


def one_relevant_feature(num_data: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """4 standard normal features, labels from :math:`f = 3 \\sin(2 x_1)`: the last three are noise."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_data, 4, generator=generator, dtype=torch.float64)
    return x, _labels(3 * torch.sin(2 * x[:, 0]), generator)


def additive_data(num_data: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    r"""3 standard normal features, labels from :math:`f = 3 \sum_d \sin(2 x_d)`: a sum of functions of one feature."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_data, 3, generator=generator, dtype=torch.float64)
    return x, _labels(3 * torch.sin(2 * x).sum(dim=1), generator)


def skewed_data(num_data: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    r"""2 standardised log-normal features :math:`x_d \propto e^{2 z_d}` (:math:`z_d` standard normal), labels from
    :math:`f = 4 \sin(2.5 z_1)`: the function varies where the standardised feature is bunched up near its minimum,
    and not in its long tail."""
    generator = torch.Generator().manual_seed(seed)
    latent = torch.randn(num_data, 2, generator=generator, dtype=torch.float64)
    x = torch.exp(2 * latent)
    return (x - x.mean(dim=0)) / x.std(dim=0), _labels(4 * torch.sin(2.5 * latent[:, 0]), generator)


def radial_data(num_data: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """2 features uniform on :math:`[-2, 2]^2`, labels from :math:`f = 4 \\sin(2.5 \\lVert x \\rVert)` (isotropic)."""
    generator = torch.Generator().manual_seed(seed)
    x = 4 * torch.rand(num_data, 2, generator=generator, dtype=torch.float64) - 2
    return x, _labels(4 * torch.sin(2.5 * x.norm(dim=1)), generator)


#: the Matérn, its ARD form and their sums with a linear kernel (the family without the warped and additive kernels,
#: which cost more to learn)
STRUCTURES = ("matern", "matern_ard", "linear+matern", "linear+matern_ard")


def _family(num_features: int, names: tuple[str, ...]) -> dict[str, gpytorch.kernels.Kernel]:
    """The kernels of :func:`kernel_family` named ``names``."""
    family = kernel_family(num_features)
    return {name: family[name] for name in names}


def _lengthscales(kernel) -> torch.Tensor:
    """Every Matérn lengthscale of ``kernel``, concatenated."""
    materns = [module for module in kernel.modules() if isinstance(module, gpytorch.kernels.MaternKernel)]
    return torch.cat([matern.lengthscale.detach().reshape(-1) for matern in materns])


class _BrokenKernel(gpytorch.kernels.Kernel):
    """A kernel whose every evaluation fails as a failed Cholesky would (a candidate to skip)."""

    def __init__(self):
        super().__init__()
        self.register_parameter("raw_scale", torch.nn.Parameter(torch.zeros((), dtype=torch.float64)))

    def forward(self, x1, x2, diag=False, **params):
        raise torch.linalg.LinAlgError("broken kernel")


# ---------------------------------------------------------------------------------------------------
# The family
# ---------------------------------------------------------------------------------------------------
def test_the_family_is_the_default_matern_its_ard_form_their_sums_with_a_linear_kernel_warped_and_additive():
    family = kernel_family(4)
    assert list(family) == ["matern", "matern_ard", "linear+matern", "linear+matern_ard", "warped_matern", "additive"]
    reference = default_kernel(4)
    assert all(
        torch.equal(value, reference.state_dict()[name]) for name, value in family["matern"].state_dict().items()
    )
    initial_lengthscales = {"warped_matern": math.sqrt(4 / 12), "additive": 1.0}  # of uniform features, of one
    for name, kernel in family.items():
        assert isinstance(kernel, gpytorch.kernels.ScaleKernel) and kernel.batch_shape == torch.Size([])
        assert float(kernel.outputscale.detach()) == 1.0 and kernel.raw_outputscale.dtype == torch.float64
        lengthscales = _lengthscales(kernel)
        expected = torch.full((4 if "ard" in name or name == "additive" else 1,), initial_lengthscales.get(name, 2.0))
        assert torch.allclose(lengthscales, expected.double()), (name, lengthscales)
        linear = [module for module in kernel.modules() if isinstance(module, gpytorch.kernels.LinearKernel)]
        assert len(linear) == ("linear" in name)
        for module in linear:
            assert float(module.raw_variance.detach()) == pytest.approx(math.log(1 / 4))  # log-parametrised (exp)
            assert torch.equal(module.raw_variance_constraint.transform(torch.zeros(1)), torch.ones(1))
    warped = family["warped_matern"].base_kernel
    assert isinstance(warped, KumaraswamyWarpedKernel) and warped.num_dims == 4
    for concentration in (warped.concentration1, warped.concentration0):  # w = Phi(x) at first, log-parametrised
        torch.testing.assert_close(concentration.detach(), torch.ones(1, 4, dtype=torch.float64), rtol=0, atol=1e-15)
    additive = family["additive"].base_kernel
    assert isinstance(additive, FirstOrderAdditiveKernel) and len(additive.base_kernels) == 4
    weights = torch.stack([kernel.outputscale.detach() for kernel in additive.base_kernels])
    torch.testing.assert_close(weights, torch.full((4,), 0.25, dtype=torch.float64), rtol=0, atol=1e-15)
    assert family["matern"] is not kernel_family(4)["matern"]  # new kernels on every call
    assert kernel_family(3, torch.float32)["linear+matern"].raw_outputscale.dtype == torch.float32
    some = kernel_family(4, names=["warped_matern", "matern"])  # only these built, in the family's order
    assert list(some) == ["matern", "warped_matern"]
    assert all(
        torch.equal(value, family["warped_matern"].state_dict()[name])
        for name, value in some["warped_matern"].state_dict().items()
    )
    with pytest.raises(ValueError, match="no kernel 'rbf'"):
        kernel_family(4, names=["matern", "rbf"])


def test_candidates_are_named_and_checked():
    x, y = linear_data(20)
    model, _ = _model(x, y)
    named = candidate_kernels([default_kernel(3), kernel_family(3)["linear+matern"]], model, "bic")
    assert list(named) == ["0:ScaleKernel(MaternKernel)", "1:ScaleKernel(AdditiveKernel(LinearKernel, MaternKernel))"]
    np.testing.assert_allclose(
        poisson_deviance(torch.tensor([1.0, 2.0, 0.5]), torch.tensor([0.0, 3.0, 1.0])),
        np.mean([2 * 1.0, 2 * (3 * math.log(1.5) - 1.0), 2 * (math.log(2.0) - 0.5)]),
    )


# ---------------------------------------------------------------------------------------------------
# The choice on data of a known structure
# ---------------------------------------------------------------------------------------------------
def test_a_linear_decision_boundary_chooses_a_linear_kernel():
    """Labels from a logistic model on a linear function of 3 features: the evidence, penalised for the
    hyperparameters (BIC), prefers a kernel with the linear part to the Matérn alone."""
    x, y = linear_data(150)
    model, mll = _model(x, y)
    kernels = kernel_family(3)
    report = fit_mll(mll, kernels=kernels, recipe=RECIPE, seed=0)
    assert "linear" in report.kernel and model.covar_module is kernels[report.kernel]
    scores = report.kernel_scores
    assert scores[report.kernel]["bic"] < scores["matern"]["bic"] - 0.005
    assert report.learning_rows is None and all(score["held_out"] is None for score in scores.values())


def test_one_relevant_feature_among_four_chooses_ard_and_lengthens_the_noise_features():
    """Labels from a function of the first of 4 features: an ARD kernel is chosen, and its learnt lengthscales of
    the 3 noise features are longer than that of the relevant one."""
    x, y = one_relevant_feature(150)
    model, mll = _model(x, y)
    report = fit_mll(mll, kernels=kernel_family(4), recipe=RECIPE, seed=0)
    assert report.kernel.endswith("_ard")
    lengthscales = _lengthscales(model.covar_module)
    assert bool((lengthscales[1:] > 2 * lengthscales[0]).all()), lengthscales


def _chosen_over_the_matern(x, y, name: str, margin: float):
    """``fit_mll`` choosing by BIC between the Matérn and the family's ``name``: checks that ``name`` is chosen, its
    BIC lower by more than ``margin``; returns the model."""
    model, mll = _model(x, y)
    kernels = _family(x.shape[1], ("matern", name))
    report = fit_mll(mll, kernels=kernels, recipe=RECIPE, seed=0)
    assert report.kernel == name and model.covar_module is kernels[name]
    scores = report.kernel_scores
    assert scores[name]["bic"] < scores["matern"]["bic"] - margin, scores
    return model


def test_an_additive_function_chooses_the_additive_kernel():
    """Labels from a sum of functions of one feature each: BIC prefers the first-order additive kernel (a weight and
    a lengthscale per feature) to the Matérn of all features, despite its 5 more hyperparameters."""
    _chosen_over_the_matern(*additive_data(250), "additive", margin=0.02)


def test_skewed_features_choose_the_warped_kernel():
    """Labels varying where a log-normal feature is bunched up: BIC prefers the Matérn of the warped features to
    the Matérn of the standardised ones, and the learnt warp of the relevant feature spreads its bulk (the warped
    values of its middle half span more than under the initial warp, the normal CDF)."""
    x, y = skewed_data(300)
    model = _chosen_over_the_matern(x, y, "warped_matern", margin=0.01)
    quartiles = torch.quantile(x[:, 0], torch.tensor([0.25, 0.75], dtype=torch.float64))
    with torch.no_grad():
        learnt = model.covar_module.base_kernel.warp(quartiles[:, None].expand(2, 2))[:, 0]
    initial = torch.special.ndtr(quartiles)
    assert float(learnt[1] - learnt[0]) > float(initial[1] - initial[0]), (learnt, initial)


@pytest.mark.slow  # about 13 s
def test_the_choice_learns_the_candidates_on_fewer_rows_and_the_chosen_one_again_on_all():
    """``kernel_choice_subset``: every candidate is learnt and scored on that many of the learning rows, and the
    chosen one learnt again on all of them from its initial values: the same evidence evaluations and hyperparameters as
    ``fit_mll`` given the chosen kernel alone (L-BFGS here: deterministic). ``None``: every candidate on all."""
    x, y = one_relevant_feature(240)
    model, mll = _model(x, y)
    kernels = _family(4, STRUCTURES)
    report = fit_mll(mll, kernels=kernels, recipe=dataclasses.replace(RECIPE, kernel_choice_subset=100), seed=0)
    assert [score["rows"] for score in report.kernel_scores.values()] == [100] * 4
    assert report.kernel.endswith("_ard") and model.covar_module is kernels[report.kernel]
    assert report.data_points == 240 and report.learning_rows is None  # the second learning: all the rows
    lengthscales = _lengthscales(model.covar_module)
    assert bool((lengthscales[1:] > 2 * lengthscales[0]).all()), lengthscales
    cold_model, cold_mll = _model(x, y, kernel=kernel_family(4)[report.kernel])
    cold = fit_mll(cold_mll, recipe=RECIPE, seed=0)
    assert report.losses == pytest.approx(cold.losses, rel=1e-9, abs=1e-12) and len(report.losses) > 2
    torch.testing.assert_close(lengthscales, _lengthscales(cold_model.covar_module))
    every = fit_mll(
        _model(x, y)[1],
        kernels=_family(4, STRUCTURES),
        recipe=dataclasses.replace(RECIPE, kernel_choice_subset=None),
        seed=0,
    )
    assert [score["rows"] for score in every.kernel_scores.values()] == [240] * 4
    with pytest.raises(ValueError, match="kernel_choice_subset must be 'auto', None or a number of rows"):
        LearningRecipe(kernel_choice_subset="all").validate()
    with pytest.raises(ValueError, match="kernel_choice_subset"):
        LearningRecipe(kernel_choice_subset=1).validate()


@pytest.mark.slow  # about 10 s
def test_an_isotropic_function_keeps_a_good_kernel_and_the_report_has_every_candidate():
    """Labels from sin of the radius: the chosen kernel's held-out log-loss is within 0.02 of the best candidate's.
    The report: every candidate scored (a failing one skipped with its error), the chosen one's score the least,
    the learning fields the chosen one's, JSON-able, said in its text."""
    x, y = radial_data(250)
    model, mll = _model(x, y)
    kernels = {**kernel_family(2), "broken": _BrokenKernel()}
    recipe = dataclasses.replace(RECIPE, outputscale_factors=(1.0, 0.5, 2.0))
    with pytest.warns(RuntimeWarning, match="kernel 'broken' skipped"):
        report = fit_mll(mll, kernels=kernels, learning_subset=130, select_by="bic", recipe=recipe, seed=0)
    scores = report.kernel_scores
    assert list(scores) == list(kernels) and report.kernel in kernel_family(2)
    assert scores["broken"]["error"].endswith("LinAlgError: broken kernel") and scores["broken"]["bic"] is None
    scored = {name: score for name, score in scores.items() if name != "broken"}
    for score in scored.values():
        assert score["error"] is None and score["seconds"] > 0
        assert all(math.isfinite(score[key]) for key in ("held_out", "evidence", "bic"))
        assert score["bic"] > score["evidence"]
    assert [score["hyperparameters"] for score in scored.values()] == [2, 3, 3, 4, 2 + 2 * 2, 1 + 2 * 2]
    assert report.kernel == min(scored, key=lambda name: scored[name]["bic"])
    assert scores[report.kernel]["held_out"] <= min(score["held_out"] for score in scored.values()) + 0.02
    # the learning fields are the chosen candidate's, the held-out rows those it was scored on
    assert report.data_points == 130 and report.validation_points == 120 and len(report.validation_rows) == 120
    assert scores[report.kernel]["evidence"] == pytest.approx(min(report.losses), rel=1e-6)
    assert scores[report.kernel]["held_out"] == report.outputscale_scores[report.outputscale_factor]
    assert report.fit_report.converged and model.covar_module is kernels[report.kernel]
    json.dumps({key: value for key, value in dataclasses.asdict(report).items() if key != "fit_report"})
    assert f"kernel {report.kernel!r} by BIC of 7 candidates" in str(report) and "broken: skipped" in str(report)


def test_without_kernels_fit_mll_learns_as_before_and_one_candidate_learns_the_same():
    """``kernels=None`` is ``fit_mll`` without the option: the same losses, hyperparameters and rows, no choice in
    the report; a single candidate, a copy of the model's kernel, is learnt exactly as the model's own kernel."""
    x, y = radial_data(160, seed=1)
    recipe = LearningRecipe(optimizer_steps=5, min_validation_points=20)
    model, mll = _model(x, y)
    same, single, own = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model.covar_module)
    same_mll = LaplaceMarginalLogLikelihood(same.variational_strategy.likelihood, same)
    single_mll = LaplaceMarginalLogLikelihood(single.variational_strategy.likelihood, single)
    plain = fit_mll(mll, learning_subset=60, recipe=recipe, seed=0)
    explicit = fit_mll(same_mll, learning_subset=60, recipe=recipe, seed=0, kernels=None)
    chosen = fit_mll(single_mll, learning_subset=60, recipe=recipe, seed=0, kernels={"own": own})
    assert plain.kernel is None and plain.kernel_scores == {} and "kernel" not in str(plain)
    for report in (explicit, chosen):
        assert report.losses == plain.losses and report.learning_rows == plain.learning_rows
        assert report.outputscale_scores == plain.outputscale_scores
        assert report.validation_rows == plain.validation_rows
    for other in (same, single):
        for mine, theirs in zip(model.parameters(), other.parameters(), strict=True):
            assert torch.equal(mine, theirs)
    assert explicit.kernel is None and chosen.kernel == "own"


def test_by_default_the_choice_is_by_the_held_out_score_where_rows_are_held_out_else_by_bic():
    """``select_by="auto"`` (the default, the estimators' rule): the held-out log-loss where the learning holds rows
    out, the BIC where it learns on all of them; the report says which (``selected_by``), computes only that score,
    and chooses the candidate with the least."""
    x, y = radial_data(250)
    recipe = LearningRecipe(optimizer_steps=4)
    for subset, by, unused in ((130, "held_out", "bic"), (None, "bic", "held_out")):
        model, mll = _model(x, y)
        report = fit_mll(mll, kernels=_family(2, ("matern", "linear+matern")), learning_subset=subset, recipe=recipe)
        scores = report.kernel_scores
        assert report.selected_by == by and all(score[unused] is None for score in scores.values())
        assert report.kernel == min(scores, key=lambda name: scores[name][by])
        assert f"kernel {report.kernel!r} by {'held-out' if by == 'held_out' else 'BIC'} of 2" in str(report)


def test_counts_are_scored_by_their_held_out_poisson_deviance():
    """A Poisson model: the held-out score is the mean Poisson deviance of the expected counts; choosing by it keeps
    the candidate with the least, whose outputscale is then walked by the same score (as a classifier's by the
    log-loss), and the mean's learnt constant is the chosen candidate's."""
    x, y = count_data(160, seed=2)
    likelihood = ExpPoissonLikelihood()
    model, mll = _model(x, y, likelihood, constant_mean=0.5)
    kernels = {name: kernel for name, kernel in kernel_family(1).items() if name in ("matern", "linear+matern")}
    recipe = LearningRecipe(optimizer_steps=5, min_validation_points=20)
    report = fit_mll(mll, kernels=kernels, learning_subset=80, select_by="held_out", recipe=recipe, seed=0)
    scores = report.kernel_scores
    assert report.kernel == min(scores, key=lambda name: scores[name]["held_out"])
    assert all(0 < score["held_out"] < 5 for score in scores.values())
    assert report.held_out_metric == "Poisson deviance" and len(report.outputscale_scores) >= 2
    assert report.held_out_score == min(report.outputscale_scores.values()) <= scores[report.kernel]["held_out"]
    assert report.validation_points == 80 and float(model.mean_module.constant.detach()) != 0.5


# ---------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------
class _NoCovarModule(gpytorch.models.ApproximateGP):
    """A model whose kernel is not called ``covar_module``."""

    def __init__(self, x, y, likelihood):
        from gpytorch_iterncgp import IterNCGPStrategy

        super().__init__(IterNCGPStrategy(self, x, y, likelihood, show_progress=False))
        self.kernel = default_kernel(x.shape[1])

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(torch.zeros(x.shape[:-1], dtype=x.dtype), self.kernel(x))


def test_fit_mll_refuses_kernels_it_cannot_choose_among():
    x, y = linear_data(40)
    likelihood = LogitBernoulliLikelihood()
    other = _NoCovarModule(x, y, likelihood)
    with pytest.raises(TypeError, match="no covar_module attribute"):
        fit_mll(LaplaceMarginalLogLikelihood(likelihood, other), kernels=kernel_family(3))
    model, mll = _model(x, y)
    bad = [
        (dict(kernels=kernel_family(3), select_by="loss"), ValueError, "select_by must be"),
        (dict(select_by="evidence"), ValueError, "pass them as kernels="),
        (dict(kernels=kernel_family(3), select_by="held_out"), ValueError, "none are held out .*all 40 rows"),
        (
            dict(kernels=kernel_family(3), select_by="held_out", learning_subset=30),
            ValueError,
            "recipe.min_validation_points",
        ),
        (dict(kernels={}), ValueError, "no candidate"),
        (dict(kernels=["rbf"]), TypeError, "must be a gpytorch.kernels.Kernel"),
        (dict(kernels=default_kernel(3)), TypeError, "a dict"),
        (dict(kernels=kernel_family(3), recipe=LearningRecipe(optimizer_steps=0)), ValueError, "optimizer_steps=0"),
    ]
    for options, error, message in bad:
        with pytest.raises(error, match=message):
            fit_mll(mll, **options)
    assert model.variational_strategy.state is None  # refused before anything was learnt
    with pytest.raises(RuntimeError, match="every candidate kernel failed"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fit_mll(mll, kernels={"broken": _BrokenKernel()}, recipe=RECIPE)


_CANNOT_CHOOSE = {
    "small": ("classifier", {}, "learnt on all 60 points, leaving fewer than 100 held-out points"),
    "subset": ("classifier", dict(learning_subset=30), "learnt on 30 of the 60 points"),
    "not-learnt": ("regressor", dict(optimizer_steps=0), "not learnt"),
    # stochastic EP's 2000 minibatch steps, twice: about 40 s here
    "sparse-ep": pytest.param(
        ("classifier", dict(inference="sparse_ep", num_inducing=8), "would learn each kernel on 30 of the 60"),
        marks=pytest.mark.slow,
    ),
}


@pytest.mark.parametrize("case", list(_CANNOT_CHOOSE.values()), ids=list(_CANNOT_CHOOSE))
def test_the_estimators_auto_kernel_is_the_matern_where_it_cannot_choose_and_says_why(case):
    """``kernel="auto"`` (the default) without rows held out (small data, also under stochastic EP, whose choice holds
    out rows of its own) or without learning is the default Matérn, fitted exactly as ``kernel=None`` (scikit-learn's
    small sets keep their numbers), with the reason."""
    from gpytorch_iterncgp.sklearn import IterNCGPClassifier, IterNCGPPoissonRegressor

    x, y = (tensor.numpy() for tensor in linear_data(60))
    kind, options, reason = case
    estimator_type, targets = (IterNCGPClassifier, y) if kind == "classifier" else (IterNCGPPoissonRegressor, 2 * y)
    auto = estimator_type(random_state=0, **options).fit(x, targets)  # kernel="auto", the default
    matern = estimator_type(kernel=None, random_state=0, **options).fit(x, targets)
    choice = auto.kernel_choice_
    assert auto.kernel == "auto" and (choice.kernel, choice.candidates, choice.validation_points) == (
        "matern",
        ("matern",),
        0,
    )
    assert str(choice).startswith("'matern': ") and reason in choice.reason
    assert matern.kernel_choice_ is None and auto.learning_report_.kernel is None
    np.testing.assert_array_equal(auto.predict_latent(x)[0], matern.predict_latent(x)[0])
    if kind == "regressor":
        with pytest.raises(ValueError, match="'kernel' parameter .*'auto'"):
            IterNCGPClassifier(kernel="ard").fit(x, y)


# ---------------------------------------------------------------------------------------------------
# The estimator
# ---------------------------------------------------------------------------------------------------
@pytest.mark.slow  # about 9 s
def test_the_classifier_with_kernel_auto_chooses_a_linear_kernel_on_linear_data_by_the_held_out_log_loss():
    """8 features, learnt on 150 of 350 points, 150 of the others held out: the Matérn and linear + Matérn are each
    learnt and scored by the held-out log-loss; the linear one is chosen (the lower score), reported, and predicts."""
    from gpytorch_iterncgp.sklearn import IterNCGPClassifier

    x, y = (tensor.numpy() for tensor in wide_linear_data(550, seed=3))
    classifier = IterNCGPClassifier(
        kernel="auto",
        learning_subset=150,
        solver_options=dict(policy="cg", max_solver_iterations=None, abs_tol=1e-4, rel_tol=1e-4),
        optimizer_steps=10,
        random_state=0,
    ).fit(x[:350], y[:350])
    report, scores = classifier.learning_report_, classifier.learning_report_.kernel_scores
    assert classifier.inference_ == "ep" and report.evidence == "Laplace" and list(scores) == list(AUTO_KERNELS)
    assert report.kernel == "linear+matern" and report.validation_points == 150
    assert scores["linear+matern"]["held_out"] < min(
        scores[name]["held_out"] for name in scores if "linear" not in name
    )
    assert all(score["rows"] == 150 and score["error"] is None for score in scores.values())
    assert all(score["evidence"] is None and score["bic"] is None for score in scores.values())  # (not read)
    among = ", ".join(map(repr, AUTO_KERNELS))
    choice = classifier.kernel_choice_
    assert (choice.kernel, choice.candidates, choice.validation_points) == ("linear+matern", AUTO_KERNELS, 150)
    assert str(choice) == f"'linear+matern': chosen among {among} by the held-out score of 150 points"
    assert classifier.kernel_ is classifier.model_.covar_module
    assert any(isinstance(module, gpytorch.kernels.LinearKernel) for module in classifier.kernel_.modules())
    assert f"kernel {report.kernel!r} by held-out of {len(AUTO_KERNELS)} candidates" in str(classifier.learning_report_)
    probabilities = classifier.predict_proba(x[350:])
    assert probabilities.shape == (200, 2) and classifier.score(x[350:], y[350:]) > 0.85


@pytest.mark.slow  # about 18 s
def test_the_classifier_with_kernel_auto_chooses_under_stochastic_ep(monkeypatch):
    """``inference="sparse_ep"`` with ``kernel="auto"``: the candidates learnt by dense EP on half of 400 rows and
    scored on the other half (:func:`~gpytorch_iterncgp.learning.fit.fit_minibatch_mll`'s choice); on skewed features
    the warped Matérn is chosen, and the report, ``kernel_choice_`` and ``kernel_`` say so (stochastic EP's minibatch
    steps cut to 20 here)."""
    from gpytorch_iterncgp.integrations import sklearn as integration
    from gpytorch_iterncgp.sklearn import IterNCGPClassifier

    monkeypatch.setattr(integration, "MinibatchRecipe", lambda **fields: MinibatchRecipe(max_steps=20, **fields))
    x, y = (tensor.numpy() for tensor in skewed_data(400))
    classifier = IterNCGPClassifier(inference="sparse_ep", num_inducing=20, batch_size=100, random_state=0).fit(x, y)
    report, scores = classifier.learning_report_, classifier.learning_report_.kernel_scores
    assert classifier.inference_ == "sparse_ep" and list(scores) == list(AUTO_KERNELS) and report.evaluations == 20
    assert report.kernel == "warped_matern" == min(scores, key=lambda name: scores[name]["held_out"])
    assert all(score["rows"] == 200 and score["error"] is None for score in scores.values())
    among = ", ".join(map(repr, AUTO_KERNELS))
    assert classifier.kernel_choice_.learning_rows == 200 and str(classifier.kernel_choice_) == (
        f"'warped_matern': chosen among {among} by the held-out score of 200 points (each learnt by dense EP on 200)"
    )
    assert classifier.kernel_ is classifier.model_.covar_module
    assert isinstance(classifier.kernel_.base_kernel, KumaraswamyWarpedKernel)
    assert classifier.predict_proba(x).shape == (400, 2)


def test_the_poisson_regressor_with_kernel_auto_keeps_the_lower_held_out_deviance():
    """Counts of log-rate :math:`0.8 x_1`, learnt on 150 of 300 points: each candidate's held-out score is the
    Poisson deviance of the 150 others at its fit, recomputed here from the chosen model's predictions."""
    from gpytorch_iterncgp.sklearn import IterNCGPPoissonRegressor

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(300, 2, generator=generator, dtype=torch.float64)
    y = torch.poisson(torch.exp(0.8 * x[:, 0]), generator=generator)
    regressor = IterNCGPPoissonRegressor(kernel="auto", learning_subset=150, optimizer_steps=10, random_state=0)
    regressor.fit(x.numpy(), y.numpy())
    report, scores = regressor.learning_report_, regressor.learning_report_.kernel_scores
    assert list(scores) == list(AUTO_KERNELS) and report.validation_points == 150
    assert report.kernel == min(scores, key=lambda name: scores[name]["held_out"])
    assert regressor.kernel_choice_.kernel == report.kernel and str(regressor.kernel_choice_).startswith(
        f"{report.kernel!r}: chosen among"
    )
    assert np.isfinite(regressor.predict(x.numpy())).all()


def _sep_model(x: torch.Tensor, kernel: gpytorch.kernels.Kernel | None = None):
    """A stochastic-EP model of ``x`` (its first 20 rows the inducing inputs; zero mean, probit likelihood) and its
    objective; ``kernel`` in place of the model's scaled RBF."""
    from gpytorch_iterncgp import StochasticEPMarginalLogLikelihood
    from tests.saved_models import SEPModel

    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = SEPModel(x[:20].clone(), likelihood, num_data=len(x))
    model.mean_module = gpytorch.means.ZeroMean()
    if kernel is not None:
        model.covar_module = kernel
    return model, StochasticEPMarginalLogLikelihood(likelihood, model)


def test_stochastic_ep_chooses_on_dense_rows_then_learns_the_chosen_kernel_alone():
    """``fit_mll(kernels=...)`` on stochastic EP's objective: each candidate learnt by dense EP on half of 400 rows
    (``min(M_c, N / 2)``) and scored on the other half; on skewed features the held-out log-loss chooses the warped
    Matérn (measured margins 0.09-0.19 on seeds 0-2 at 400 points). The model keeps the chosen kernel at its initial
    values and its other parameters as on entry, so the minibatch learning that follows is the chosen kernel's alone:
    the same losses and hyperparameters as ``fit_mll`` on a new model given that kernel (same seed)."""
    x, y = skewed_data(400)
    model, mll = _sep_model(x)
    inducing = model.variational_strategy.inducing_points.detach().clone()
    recipe = MinibatchRecipe(batch_size=100, max_steps=6)
    kernels = _family(2, ("matern", "warped_matern"))
    report = fit_mll(
        mll, data=(x, y), kernels=kernels, select_by="held_out", recipe=recipe, seed=0, show_progress=False
    )
    scores = report.kernel_scores
    assert report.kernel == "warped_matern" and model.covar_module is kernels["warped_matern"]
    assert scores["warped_matern"]["held_out"] < scores["matern"]["held_out"] - 0.02, scores
    assert all(score["rows"] == 200 and score["error"] is None for score in scores.values())
    assert report.validation_points == 200 and len(report.validation_rows) == 200
    assert report.evidence == "SEP" and report.evaluations == 6  # then SEP's own learning, on all the data
    torch.testing.assert_close(model.variational_strategy.inducing_points, inducing, rtol=0, atol=0.05)
    alone, alone_mll = _sep_model(x, kernel_family(2)["warped_matern"])
    expected = fit_mll(alone_mll, data=(x, y), recipe=recipe, seed=0, show_progress=False)
    assert report.losses == pytest.approx(expected.losses, rel=1e-10, abs=1e-12)
    for name, parameter in alone.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], parameter, rtol=1e-10, atol=1e-12)
    quick = fit_mll(
        _sep_model(x)[1],
        data=(x, y),
        kernels=_family(2, ("matern", "warped_matern")),
        max_time=0.0,
        show_progress=False,
    )
    assert quick.stopped == "max_time" and quick.evaluations == 1 and quick.kernel in kernels  # max_time shared out
    with pytest.raises(ValueError, match="select_by='held_out'.*fewer than recipe.min_validation_points"):
        fit_mll(_sep_model(x[:150])[1], data=(x[:150], y[:150]), kernels=kernels, select_by="held_out")
    with pytest.raises(ValueError, match="select_by"):
        fit_mll(_sep_model(x)[1], data=(x, y), select_by="held_out")  # nothing to select among
