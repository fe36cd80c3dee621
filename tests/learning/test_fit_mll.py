"""``fit_mll``: the learning function of every model with an IterNCGP or EP strategy (``gpytorch_iterncgp.learning``),
its rows, the learner on them, BoTorch's dispatch, the loose fits of the plain training loop, the warnings and the
progress of every phase."""

from __future__ import annotations

import math
import warnings

import gpytorch
import numpy as np
import pytest
import torch

from gpytorch_iterncgp import (
    ConvergenceWarning,
    EPMarginalLogLikelihood,
    EPStrategy,
    EstimatedEvidenceWarning,
    ExplicitGradientWarning,
    IterNCGPStrategy,
    LaplaceMarginalLogLikelihood,
    LearningRecipe,
    LogitBernoulliLikelihood,
    WorseThanConstantWarning,
    fit_mll,
    settings,
)
from gpytorch_iterncgp.learning.learner import LearnerModel
from gpytorch_iterncgp.learning.rows import draw_rows, held_out_rows
from gpytorch_iterncgp.mlls import itergp as itergp_mlls
from tests.common import (
    IterNCGPModel,
    MultitaskIterNCGPModel,
    binary_data,
    multiclass_data,
    multioutput_count_data,
    softmax_likelihood,
)


def _kernel_parameters(model) -> list[torch.Tensor]:
    return [parameter.detach().clone() for parameter in model.covar_module.parameters()]


# ---------------------------------------------------------------------------------------------------
# Rows and the learner
# ---------------------------------------------------------------------------------------------------
def test_rows_are_stratified_sorted_and_held_out_rows_disjoint():
    labels = torch.tensor([0] * 50 + [1] * 30 + [2] * 20)
    generator = torch.Generator().manual_seed(0)
    rows = draw_rows(torch.arange(100), 40, labels, generator)
    assert len(rows) == 40 and len(rows.unique()) == 40 and bool((rows.diff() > 0).all())
    assert torch.bincount(labels[rows], minlength=3).tolist() == [20, 12, 8]  # the shares 0.5, 0.3, 0.2 of 40
    held_out = held_out_rows(100, rows, labels, minimum=10, generator=generator)
    assert held_out is not None and len(held_out) == 40 and not set(held_out.tolist()) & set(rows.tolist())
    assert held_out_rows(100, torch.arange(95), labels, minimum=10, generator=generator) is None  # 5 left < 10
    with pytest.raises(ValueError, match="cannot draw"):
        draw_rows(torch.arange(5), 6, None, generator)


def test_the_learners_evidence_is_that_of_a_model_on_its_rows():
    """A ``LearnerModel`` on rows of the data, sharing the model's kernel, has the evidence and the gradient of a model
    built on those rows alone (the exact regime: deterministic), and its gradient reaches the model's parameters."""
    x, y = binary_data(80, seed=1)
    rows = torch.arange(0, 80, 2)
    options = dict(policy="unit", max_solver_iterations=None, abs_tol=0.0, rel_tol=0.0)
    model = IterNCGPModel(x, y, LogitBernoulliLikelihood(), **options)
    learner = LearnerModel(model, IterNCGPStrategy, x[rows], y[rows], model.variational_strategy.likelihood)
    alone = IterNCGPModel(x[rows], y[rows], LogitBernoulliLikelihood(), **options)
    values, gradients = [], []
    for subject in (learner, alone):
        subject.train()
        strategy = subject.variational_strategy
        evidence = LaplaceMarginalLogLikelihood(strategy.likelihood, subject)(subject(x[rows]), y[rows])
        evidence.backward()
        values.append(float(evidence.detach()))
        parameters = model.covar_module if subject is learner else alone.covar_module
        gradients.append(torch.stack([p.grad.reshape(()) for p in parameters.parameters()]))
    assert values[0] == pytest.approx(values[1], rel=1e-9)
    torch.testing.assert_close(gradients[0], gradients[1], rtol=1e-7, atol=1e-10)


# ---------------------------------------------------------------------------------------------------
# fit_mll: the estimator's recipe, on GPyTorch models
# ---------------------------------------------------------------------------------------------------
def _estimator_model(estimator, x, y, likelihood, inference):
    """The model the estimator builds before it learns (``_fit_model``), and the seed it draws."""
    from gpytorch_iterncgp.integrations.sklearn import _LatentGP
    from gpytorch_iterncgp.learning.estimator_policy import default_kernel

    seed = int(np.random.RandomState(estimator.random_state).randint(np.iinfo(np.int32).max))
    _, options = estimator._solver_settings(seed, len(x), 1, inference)
    strategy_type = EPStrategy if inference == "ep" else IterNCGPStrategy
    train_x, train_y = torch.as_tensor(x), torch.as_tensor(y, dtype=torch.float64)
    mean = gpytorch.means.ZeroMean()
    model = _LatentGP(train_x, train_y, likelihood, default_kernel(x.shape[1]), mean, strategy_type, options)
    return model.double(), seed


# multi-class EP with 5 CG iterations per sweep stalls near a site change of 1e-3 (the computation-aware marginals
# move with every sweep's actions), the same in both
@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
@pytest.mark.filterwarnings("ignore::gpytorch_iterncgp.NotConvergedWarning")
@pytest.mark.parametrize("inference", ["laplace", "ep"])
def test_fit_mll_on_the_estimators_model_gives_the_estimators_hyperparameters(inference):
    """The estimator is validation, the default model and ``fit_mll``: on its model, ``fit_mll`` learns its
    hyperparameters (N = 1100 binary points: Adam on loose fits, and for EP Laplace's evidence) and its posterior."""
    from sklearn.datasets import make_classification

    from gpytorch_iterncgp.sklearn import IterNCGPClassifier

    x, y = make_classification(n_samples=1100, n_features=3, n_informative=3, n_redundant=0, random_state=2)
    estimator = IterNCGPClassifier(
        inference=inference, learning_subset=None, optimizer_steps=4, random_state=0, standardize=False
    )
    estimator.fit(x, y)
    model, seed = _estimator_model(estimator, x, y, LogitBernoulliLikelihood(), inference)
    evidence = EPMarginalLogLikelihood if inference == "ep" else LaplaceMarginalLogLikelihood
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        report = fit_mll(
            evidence(model.variational_strategy.likelihood, model),
            recipe=LearningRecipe(optimizer_steps=4),
            learning_subset=None,
        )
    assert report.evidence == "Laplace" and report.method == "Adam" and report.evaluations == 4
    for ours, theirs in zip(_kernel_parameters(model), estimator.kernel_.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs.detach(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(report.losses, estimator.loss_curve_, rtol=1e-10)
    test_x = torch.as_tensor(x[:50])
    with torch.no_grad():
        probabilities = model.variational_strategy.predictive_probabilities(test_x).numpy()
    np.testing.assert_allclose(probabilities, estimator.predict_proba(x[:50])[:, 1], rtol=1e-8, atol=1e-10)


def test_fit_mll_learns_a_batch_of_class_kernels_on_a_stratified_subset():
    """One GP per class (``batch_shape=[C]``, softmax Laplace) on a subset of 90 of 240 rows: every class keeps its
    share, the evidence rises, the model's own parameters move, and the final fit on all the rows converges."""
    x, y = multiclass_data(240, seed=3)
    model = IterNCGPModel(x, y, softmax_likelihood(3), batch_classes=3, max_solver_iterations=None)
    before = _kernel_parameters(model)
    mll = LaplaceMarginalLogLikelihood(model.variational_strategy.likelihood, model)
    report = fit_mll(mll, learning_subset=90, seed=0, recipe=LearningRecipe(optimizer_steps=10))
    assert report.data_points == 90 and report.num_data == 240 and report.method == "L-BFGS"
    assert report.losses[-1] < report.losses[0] - 1e-3
    assert any(not torch.equal(a, b) for a, b in zip(before, _kernel_parameters(model), strict=True))
    assert report.fit_report.converged and not model.training
    assert model.variational_strategy.num_data == 240


def test_fit_mll_learns_correlated_counts_with_missing_outputs_on_a_subset():
    """Correlated counts (an ``LCMKernel``, a fifth of the outputs missing): ``fit_mll`` learns on an unstratified subset
    (counts have no classes), the evidence rises, no outputscale is chosen (not a classifier), and the final fit on all
    the rows converges."""
    from gpytorch_iterncgp.likelihoods.adapters import MultitaskPoissonLikelihood

    x, y = multioutput_count_data(120, 3, seed=2, missing=0.2)
    model = MultitaskIterNCGPModel(x, y, MultitaskPoissonLikelihood(num_tasks=3), num_tasks=3, kernel="lcm")
    mll = LaplaceMarginalLogLikelihood(model.variational_strategy.likelihood, model)
    report = fit_mll(mll, learning_subset=80, seed=1, recipe=LearningRecipe(optimizer_steps=6))
    assert report.data_points == 80 and len(report.learning_rows) == 80 and report.validation_rows is None
    assert report.losses[-1] < report.losses[0] - 1e-3 and report.outputscale_scores == {}
    assert report.fit_report.converged and model.variational_strategy.num_data == 120


def test_fit_mll_chooses_eps_outputscale_on_held_out_rows_and_every_phase_shows_progress(capsys):
    """EP learnt on Laplace's evidence (above ``exact_evidence_size``) on a subset: the outputscale is chosen on held-out
    rows among Laplace's times the factors, and ``show_progress`` draws one bar per phase, each named."""
    x, y = binary_data(240, seed=4)
    model = IterNCGPModel(x, y, LogitBernoulliLikelihood(), strategy_class=EPStrategy, max_solver_iterations=10)
    mll = EPMarginalLogLikelihood(model.variational_strategy.likelihood, model)
    recipe = LearningRecipe(
        optimizer_steps=3, outputscale_factors=(1.0, 0.25), outputscale_fit_steps=5, outputscale_extensions=0
    )
    with settings.exact_evidence_size(50), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        report = fit_mll(mll, learning_subset=100, seed=0, recipe=recipe, show_progress=True)
    assert report.evidence == "Laplace" and report.data_points == 100 and report.validation_points == 100
    assert set(report.outputscale_scores) == {1.0, 0.25}
    assert report.outputscale_factor == min(report.outputscale_scores, key=report.outputscale_scores.__getitem__)
    errors = capsys.readouterr().err
    assert "learning: Adam on the Laplace evidence of 100 points" in errors
    assert "outputscale (EP)" in errors and "2/2" in errors
    assert "final fit (EP)" in errors


def test_the_outputscale_grid_follows_the_held_out_optimum_past_its_edge():
    """An outputscale far too small (s² = 0.01, not learnt): the grid's largest factor has the lowest held-out
    log-loss, so the grid is extended by doubling it, ``outputscale_extensions`` times here as the log-loss keeps
    falling; every recorded log-loss is a fit at that factor (the grid's equal to those of a run without extensions),
    and the factor chosen is the one of the lowest."""

    def fitted(extensions: int):
        x, y = binary_data(240, seed=4)
        model = IterNCGPModel(x, y, LogitBernoulliLikelihood())
        model.covar_module.outputscale = 0.01
        model.covar_module.raw_outputscale.requires_grad_(False)
        mll = LaplaceMarginalLogLikelihood(model.variational_strategy.likelihood, model)
        recipe = LearningRecipe(
            optimizer_steps=2,
            outputscale_factors=(1.0, 0.5),
            outputscale_fit_steps=5,
            outputscale_extensions=extensions,
        )
        return fit_mll(mll, learning_subset=100, seed=0, recipe=recipe), model

    with pytest.warns(WorseThanConstantWarning, match="worse than a constant predictor's"):
        grid, _ = fitted(0)  # at s² = 0.01 the probabilities stay near 1/2: worse than the class frequencies
    report, model = fitted(3)
    assert grid.held_out_score is not None and grid.constant_score is not None
    assert grid.held_out_score == grid.outputscale_scores[1.0] > grid.constant_score
    assert report.held_out_score == report.outputscale_scores[8.0] < report.constant_score
    assert list(grid.outputscale_scores) == [1.0, 0.5] and grid.outputscale_factor == 1.0
    losses = report.outputscale_scores
    assert list(losses) == [1.0, 0.5, 2.0, 4.0, 8.0]  # Laplace's walk: downwards first
    assert [losses[factor] for factor in (1.0, 0.5)] == pytest.approx(
        [grid.outputscale_scores[1.0], grid.outputscale_scores[0.5]], rel=1e-10
    )
    assert losses[8.0] < losses[4.0] < losses[2.0] < losses[1.0] < losses[0.5]
    assert report.outputscale_factor == 8.0
    assert model.covar_module.outputscale.item() == pytest.approx(0.08, rel=1e-6)


def test_after_a_kernel_choice_the_outputscale_walk_starts_where_the_choices_ended():
    """Candidates learnt on fewer rows each record the outputscale factor their walk chose; the chosen kernel's walk on
    all the learning rows starts at it (its first fit) and ends at the factor a walk from 1 reaches for the same
    kernel given alone (the same learnt kernel, as the choice's second learning is a cold one), every log-loss both
    fitted equal."""
    from gpytorch_iterncgp.kernels.family import kernel_family

    def fitted(names):
        x, y = binary_data(240, seed=4)
        model = IterNCGPModel(x, y, LogitBernoulliLikelihood(), strategy_class=EPStrategy, max_solver_iterations=10)
        mll = EPMarginalLogLikelihood(model.variational_strategy.likelihood, model)
        family = kernel_family(x.shape[1])
        recipe = LearningRecipe(optimizer_steps=3, outputscale_fit_steps=5, kernel_choice_subset=80)
        kernels = {name: family[name] for name in names} if len(names) > 1 else None
        if kernels is None:
            model.covar_module = family[names[0]]
        with settings.exact_evidence_size(50), warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            return fit_mll(mll, learning_subset=100, seed=0, recipe=recipe, kernels=kernels)

    report = fitted(("matern", "linear+matern"))
    factors = {name: score["outputscale_factor"] for name, score in report.kernel_scores.items()}
    assert all(factor is not None and factor > 0 for factor in factors.values()), factors
    assert next(iter(report.outputscale_scores)) == factors[report.kernel]
    alone = fitted((report.kernel,))
    assert report.outputscale_factor == alone.outputscale_factor
    common = set(report.outputscale_scores) & set(alone.outputscale_scores)
    assert report.outputscale_factor in common
    for factor in common:
        assert report.outputscale_scores[factor] == pytest.approx(alone.outputscale_scores[factor], rel=1e-9)


def test_fit_mll_refuses_other_objectives_and_bad_subsets():
    x, y = binary_data(30)
    model = IterNCGPModel(x, y, LogitBernoulliLikelihood())
    elbo = gpytorch.mlls.VariationalELBO(model.variational_strategy.likelihood, model, num_data=30)
    with pytest.raises(TypeError, match="LaplaceMarginalLogLikelihood"):
        fit_mll(elbo)
    mll = LaplaceMarginalLogLikelihood(model.variational_strategy.likelihood, model)
    for subset in ("half", 1, True):
        with pytest.raises(ValueError, match="subset"):
            fit_mll(mll, learning_subset=subset)
    with pytest.raises(ValueError, match="optimizer_steps"):
        fit_mll(mll, recipe=LearningRecipe(optimizer_steps=-1))
    with pytest.raises(ValueError, match="evidence must be one of"):
        fit_mll(mll, recipe=LearningRecipe(evidence="EP"))


def test_fit_mll_takes_masks_as_masks_and_checks_the_rows():
    """A boolean ``subset`` (or ``validation_rows``) is a mask of the training rows: 40 of 120 here (read as indices it
    was rows 0 and 1, 120 times); indices are range-checked, validation rows must be held out of a subset, and the
    stochastic evidence's ``data=`` is refused for a model that holds its data."""
    x, y = binary_data(120, seed=3)
    model = IterNCGPModel(x, y, LogitBernoulliLikelihood())
    mll = LaplaceMarginalLogLikelihood(model.variational_strategy.likelihood, model)
    mask = torch.zeros(120, dtype=torch.bool)
    mask[torch.randperm(120, generator=torch.Generator().manual_seed(0))[:40]] = True
    held_out = ~mask & (torch.arange(120) % 2 == 0)
    recipe = LearningRecipe(optimizer_steps=2)
    report = fit_mll(mll, learning_subset=mask, validation_rows=held_out, recipe=recipe, seed=0, show_progress=False)
    assert report.learning_rows == mask.nonzero()[:, 0].tolist() and report.data_points == 40
    assert report.validation_rows == held_out.nonzero()[:, 0].tolist()
    indices = fit_mll(
        mll, learning_subset=mask.nonzero()[:, 0], validation_rows=None, recipe=recipe, show_progress=False
    )
    assert indices.learning_rows == report.learning_rows
    bad = [
        (
            {"learning_subset": mask[:100]},
            ValueError,
            r"subset: a boolean mask must have one entry per training row, shape \(120",
        ),
        ({"learning_subset": torch.tensor([0, 5, 120])}, ValueError, r"subset: row indices must lie in \[0, 120\)"),
        ({"learning_subset": torch.tensor([0.0, 5.0])}, ValueError, "subset: row indices must be integers"),
        (
            {"learning_subset": mask, "validation_rows": torch.tensor([-1])},
            ValueError,
            "validation_rows: row indices must lie",
        ),
        (
            {"learning_subset": mask, "validation_rows": mask},
            ValueError,
            "validation_rows must lie outside the learning subset",
        ),
        (
            {"learning_subset": None, "validation_rows": held_out},
            ValueError,
            "none is held out: pass a learning subset too",
        ),
        ({"data": (x, y)}, TypeError, "data= does not apply to a LaplaceMarginalLogLikelihood"),
    ]
    for options, error, match in bad:
        with pytest.raises(error, match=match):
            fit_mll(mll, recipe=recipe, show_progress=False, **options)


def test_botorch_fit_gpytorch_mll_runs_fit_mll():
    """``botorch.fit.fit_gpytorch_mll(mll)`` on one of the package's evidences runs ``fit_mll`` (the model's
    ``custom_fit`` hook), forwards the keywords ``fit_mll`` takes and returns the objective in eval mode; BoTorch's
    optimiser options, which ``fit_mll`` would not use, and keywords ``fit_mll`` does not take are refused."""
    fit = pytest.importorskip("botorch.fit")
    x, y = binary_data(60, seed=5)
    learnt = []
    for run in ("botorch", "fit_mll"):
        model = IterNCGPModel(x, y, LogitBernoulliLikelihood(), max_solver_iterations=None)
        mll = LaplaceMarginalLogLikelihood(model.variational_strategy.likelihood, model)
        if run == "botorch":
            for refused, match in [
                ({"optimizer_kwargs": {"maxiter": 5}}, "optimizer_kwargs do not apply.*LearningRecipe"),
                ({"optimizer": object(), "closure": lambda: None}, "closure, optimizer do not apply"),
                ({"data": (x, y)}, "data= does not apply to a LaplaceMarginalLogLikelihood: its model holds"),
            ]:
                with pytest.raises(TypeError, match=match):
                    fit.fit_gpytorch_mll(mll, seed=0, **refused)
            returned = fit.fit_gpytorch_mll(mll, seed=0)
            assert returned is mll and not mll.training and not model.training
        else:
            fit_mll(mll, seed=0)
        learnt.append(_kernel_parameters(model))
    for ours, theirs in zip(*learnt, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert not torch.equal(learnt[0][0], IterNCGPModel(x, y, LogitBernoulliLikelihood()).covar_module.raw_outputscale)


# ---------------------------------------------------------------------------------------------------
# The plain loop, and the warnings
# ---------------------------------------------------------------------------------------------------
def test_the_plain_loop_runs_loose_fits_in_train_mode_and_converges_to_predict():
    """Above ``exact_evidence_size``, ``model(train_x)`` in train mode fits whole from the prior, then, after each change
    of the hyperparameters, at most ``train_fit_steps`` steps with at most ``train_compression_rank`` recycled
    actions (each step adds 3); a prediction in eval mode continues the loose state to convergence;
    ``train_fit_steps=None`` fits whole, and other values act."""
    x, y = binary_data(200, seed=6)
    model = IterNCGPModel(x, y, LogitBernoulliLikelihood(), max_solver_iterations=3, compression_rank=None)
    strategy = model.variational_strategy
    mll = LaplaceMarginalLogLikelihood(strategy.likelihood, model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    model.train()
    with settings.exact_evidence_size(50), warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)  # loose fits stop at their limit by design: no warning
        for step in range(4):
            optimizer.zero_grad()
            output = model(x)
            if step == 0:  # the first fit, from the prior, is whole: the first evidence is at a converged mode
                assert strategy.last_report.converged and strategy.last_report.steps > 2
            else:  # after an optimiser step: loose, warm-started
                assert strategy.last_report.steps <= 2 and strategy.state.actions.shape[-1] <= 20 + 2 * 3
            (-mll(output, y)).backward()
            optimizer.step()
        model(x)
        loose = strategy.state.representer_weights.clone()
        model.eval()
        model(x[:5])
        assert strategy.last_report.converged and strategy.last_report.steps >= 1
        assert not torch.equal(strategy.state.representer_weights, loose)
        model.train()
        with torch.no_grad():
            model.covar_module.outputscale = 3.0
        with strategy.overriding(train_fit_steps=None):
            model(x)
        assert strategy.last_report.converged
        with torch.no_grad():
            model.covar_module.outputscale = 2.0
        with strategy.overriding(train_fit_steps=1, train_compression_rank=5):
            model(x)
        assert strategy.last_report.steps == 1 and strategy.state.actions.shape[-1] <= 5 + 3
    with pytest.raises(ValueError, match="train_fit_steps"):
        IterNCGPModel(x, y, LogitBernoulliLikelihood(), train_fit_steps=0)


def test_a_fit_stopped_by_its_step_limit_warns_which_limit_to_raise():
    """A fit stopped by a step limit warns, naming it: the strategy's or one asked for in the call; a fit inside
    ``limit_warning=False`` (stopped early by design) and a converged fit do not."""
    x, y = binary_data(100, seed=7)
    model = IterNCGPModel(
        x, y, LogitBernoulliLikelihood(), strategy_class=EPStrategy, max_solver_iterations=None, max_sweeps=2
    )
    strategy = model.variational_strategy
    with pytest.warns(ConvergenceWarning, match=r"max_sweeps=2 before it converged.*Raise max_sweeps"):
        report = strategy.fit()
    assert not report.converged
    with pytest.warns(ConvergenceWarning, match=r"max_sweeps=1 before it converged"):
        assert not strategy.fit(max_sweeps=1).converged
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        assert not strategy.fit(max_sweeps=1, limit_warning=False).converged
        assert strategy.fit(max_sweeps=None).converged  # continued to convergence: no warning


def test_evaluations_whose_gradient_left_out_the_implicit_derivative_are_counted_and_warned_once(monkeypatch):
    """Where the matrix-free Laplace evidence does not trust its Newton step (every step here: the trust threshold
    set so), fit_mll counts the evaluations in ``explicit_gradients`` and warns once, naming the count; with the
    threshold as it is, the same learning counts none and does not warn."""
    x, y = binary_data(120, seed=9)
    recipe = LearningRecipe(optimizer_steps=3)
    counts = {}
    for trust in (itergp_mlls.NEWTON_STEP_TRUST, -1.0):  # -1: a step must raise the log posterior by 1 + |Psi|
        monkeypatch.setattr(itergp_mlls, "NEWTON_STEP_TRUST", trust)
        model = IterNCGPModel(x, y, LogitBernoulliLikelihood(), max_solver_iterations=5)
        mll = LaplaceMarginalLogLikelihood(model.variational_strategy.likelihood, model)
        with settings.exact_evidence_size(50), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = fit_mll(mll, recipe=recipe, show_progress=False)
        explicit = [warning for warning in caught if issubclass(warning.category, ExplicitGradientWarning)]
        counts[trust] = report.explicit_gradients
        if trust < 0:
            assert report.explicit_gradients == report.evaluations == 3
            assert len(explicit) == 1 and "at 3 of 3 evaluations" in str(explicit[0].message)
        else:
            assert report.explicit_gradients == 0 and explicit == []
    assert counts[-1.0] == 3


def test_eps_estimated_evidence_warns_once_and_names_fit_mll():
    x, y = binary_data(120, seed=8)
    model = IterNCGPModel(x, y, LogitBernoulliLikelihood(), strategy_class=EPStrategy, max_solver_iterations=5)
    mll = EPMarginalLogLikelihood(model.variational_strategy.likelihood, model)
    model.train()
    with settings.exact_evidence_size(50), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            value = mll(model(x), y)
    assert math.isfinite(float(value.detach()))
    estimated = [w for w in caught if issubclass(w.category, EstimatedEvidenceWarning)]
    assert len(estimated) == 1 and "fit_mll" in str(estimated[0].message)


def test_positive_hyperparameters_are_optimised_on_the_log_scale():
    """``LogScale``: softplus-constrained parameters become log(value - lower bound) (round trip to rounding), their
    gradients by the chain rule (dL/dlog v = v dL/dv, checked against the closed form); exp-parametrised and
    unconstrained parameters are the variables themselves."""
    from gpytorch_iterncgp.learning.scale import LogScale

    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5)).double()
    mean = gpytorch.means.ConstantMean().double()
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()  # noise: GreaterThan(1e-4)
    exp_kernel = gpytorch.kernels.RBFKernel(
        lengthscale_constraint=gpytorch.constraints.Positive(transform=torch.exp, inv_transform=torch.log)
    ).double()
    modules = gpytorch.Module()
    modules.kernel, modules.mean, modules.likelihood, modules.exp_kernel = kernel, mean, likelihood, exp_kernel
    kernel.outputscale, kernel.base_kernel.lengthscale, likelihood.noise = 30.0, 0.2, 0.5
    parameters = list(modules.parameters())
    scale = LogScale([modules], parameters)
    variables = dict(zip([id(raw) for raw, _, _ in scale.entries], scale.variables, strict=True))
    assert variables[id(mean.raw_constant)] is mean.raw_constant
    assert variables[id(exp_kernel.raw_lengthscale)] is exp_kernel.raw_lengthscale
    log_outputscale = variables[id(kernel.raw_outputscale)]
    assert float(log_outputscale.detach()) == pytest.approx(math.log(30.0), rel=1e-12)
    assert float(variables[id(likelihood.noise_covar.raw_noise)].detach()) == pytest.approx(
        math.log(0.5 - 1e-4), rel=1e-9
    )
    with torch.no_grad():
        log_outputscale.add_(0.5)
    scale.push()
    assert float(kernel.outputscale.detach()) == pytest.approx(30.0 * math.exp(0.5), rel=1e-10)
    loss = (kernel.outputscale - 3.0).square().sum() + likelihood.noise.sum() * 2.0 + mean.constant.sum()
    loss.backward()
    scale.pull_gradients()
    value = float(kernel.outputscale.detach())
    assert float(log_outputscale.grad) == pytest.approx(2 * (value - 3.0) * value, rel=1e-9)
    noise = float(likelihood.noise.detach())
    assert float(variables[id(likelihood.noise_covar.raw_noise)].grad) == pytest.approx(2.0 * (noise - 1e-4), rel=1e-9)
    assert float(mean.raw_constant.grad) == 1.0 and kernel.raw_outputscale.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fit_mll_in_float32_and_float64_learns_the_same_kernel(dtype):
    """The exact regime's L-BFGS in either precision: finite, the evidence rises, and float32 learns float64's kernel
    to float32's resolution of the optimum (1e-2 relative: a flat optimum amplifies rounding)."""
    x, y = (tensor.to(dtype) for tensor in binary_data(50, seed=9))  # the same data in either precision
    model = IterNCGPModel(x, y, LogitBernoulliLikelihood(), max_solver_iterations=None)
    report = fit_mll(LaplaceMarginalLogLikelihood(model.variational_strategy.likelihood, model), seed=0)
    assert all(math.isfinite(loss) for loss in report.losses) and report.losses[-1] < report.losses[0]
    reference = IterNCGPModel(*binary_data(50, seed=9), LogitBernoulliLikelihood(), max_solver_iterations=None)
    fit_mll(LaplaceMarginalLogLikelihood(reference.variational_strategy.likelihood, reference), seed=0)
    for ours, theirs in zip(_kernel_parameters(model), _kernel_parameters(reference), strict=True):
        assert ours.dtype == dtype
        torch.testing.assert_close(ours.double(), theirs, rtol=1e-2, atol=1e-3)


def test_fit_mll_without_trainable_parameters_only_fits():
    x, y = binary_data(40, seed=10)
    model = IterNCGPModel(x, y, LogitBernoulliLikelihood())
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    report = fit_mll(LaplaceMarginalLogLikelihood(model.variational_strategy.likelihood, model))
    assert report.evaluations == 0 and report.learning_rows is None and report.fit_report.steps >= 1
    assert str(report) == "hyperparameters not learnt"


def test_the_outputscale_scores_former_name_warns_and_still_reads_them():
    """``LearningReport.outputscale_log_loss`` (deprecated) is ``outputscale_scores`` itself, with a ``FutureWarning``."""
    from gpytorch_iterncgp import LearningReport

    report = LearningReport()
    report.outputscale_scores[0.5] = 0.25
    with pytest.warns(FutureWarning, match="outputscale_scores"):
        assert report.outputscale_log_loss is report.outputscale_scores


def test_learning_fits_follow_the_strategys_own_train_fit_steps_and_the_old_names_warn(monkeypatch):
    """While learning with Adam, each evaluation's loose fit runs the strategy's own ``train_fit_steps`` (no recipe
    replaces it silently); the deprecated ``LearningRecipe(fit_steps=)`` still replaces it, and ``subset=`` is
    ``learning_subset=``: each old name with one ``FutureWarning``, the same result, and refused beside the new one."""
    x, y = binary_data(120)
    steps: list[int | None] = []
    original = IterNCGPStrategy._run

    def spy(self, prior, options, *args):
        steps.append(options.max_newton_steps)
        return original(self, prior, options, *args)

    monkeypatch.setattr(IterNCGPStrategy, "_run", spy)

    def learn(recipe: LearningRecipe, **options):
        model = IterNCGPModel(x, y, LogitBernoulliLikelihood(), train_fit_steps=3, max_solver_iterations=None)
        mll = LaplaceMarginalLogLikelihood(model.variational_strategy.likelihood, model)
        steps.clear()
        with settings.exact_evidence_size(50):  # the estimated evidence: Adam on loose fits
            report = fit_mll(mll, seed=0, recipe=recipe, **options)
        return report, list(steps)

    def future_warnings(caught) -> list:
        return [warning for warning in caught if issubclass(warning.category, FutureWarning)]

    recipe = LearningRecipe(optimizer_steps=3)
    report, own = learn(recipe, learning_subset=None)
    assert report.method == "Adam" and own[:3] == [3, 3, 3] and own[-1] is None  # the final fit: no step limit
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replacing = LearningRecipe(optimizer_steps=3, fit_steps=1)
    assert [str(w.message).startswith("LearningRecipe(fit_steps=) is deprecated") for w in future_warnings(caught)] == [
        True
    ]
    assert learn(replacing, learning_subset=None)[1][:3] == [1, 1, 1]
    new, _ = learn(recipe, learning_subset=80)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old, _ = learn(recipe, subset=80)
    assert [str(w.message) for w in future_warnings(caught)] == [
        "fit_mll: subset= is deprecated and will be removed in a future release; it is now learning_subset=."
    ]
    assert caught[0].filename == __file__
    assert old.learning_rows == new.learning_rows and old.losses == new.losses
    with pytest.raises(ValueError, match="subset= is the deprecated name of learning_subset=; give learning_subset="):
        learn(recipe, subset=80, learning_subset=60)


def test_the_objectives_exact_argument_decides_the_learnings_regime():
    """``exact=`` of the objective given to ``fit_mll`` is carried down to the learning (optimiser, fits and evidence),
    instead of the size rule alone: exact at a size the rule would estimate (L-BFGS on the same losses as where the
    rule says exact), estimated at a size the rule calls exact (Adam, the recipe's steps)."""
    x, y = binary_data(40, seed=10)
    recipe = LearningRecipe(optimizer_steps=3)
    reports = {}
    for exact, size in [(None, 1000), (True, 10), (False, 1000)]:
        model = IterNCGPModel(x, y, LogitBernoulliLikelihood())
        mll = LaplaceMarginalLogLikelihood(model.variational_strategy.likelihood, model, exact=exact)
        with settings.exact_evidence_size(size):
            reports[exact] = fit_mll(mll, recipe=recipe, learning_subset=None, seed=0)
    assert reports[None].method == reports[True].method == "L-BFGS"
    assert reports[True].losses == reports[None].losses
    assert reports[False].method == "Adam" and reports[False].evaluations == 3
