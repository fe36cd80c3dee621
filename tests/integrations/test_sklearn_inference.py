"""The estimators' ``inference`` (Laplace or EP) and their hyperparameter learning with loose fits.

* EP in :class:`IterNCGPClassifier` against the dense EP references of ``tests/reference_ep.py`` (binary probit:
  R&W Algorithms 3.5 and 3.6; multi-class: parallel EP with the multinomial probit's nested EP), on kernel matrices built
  by scikit-learn's ``Matern``: the evidence and the predictive probabilities;
* the loose-fit schedule (``train_fit_steps``) learns the hyperparameters of whole refits: the exact evidence at the
  hyperparameters it learns is that of learning with a whole fit per step, to a tolerance set by Adam's own step;
* parameter checks and the fitted ``inference_``.
"""

from __future__ import annotations

import math
import warnings

import gpytorch
import numpy as np
import pytest
import torch

pytest.importorskip("sklearn", minversion="1.7")

from sklearn.metrics import log_loss  # noqa: E402

from gpytorch_iterncgp import EPMarginalLogLikelihood, LearningRecipe, fit_mll, settings  # noqa: E402
from gpytorch_iterncgp.learning import estimator_policy  # noqa: E402
from gpytorch_iterncgp.learning.estimator_policy import CLASSIFIER_INFERENCE, auto_inference  # noqa: E402
from gpytorch_iterncgp.sklearn import IterNCGPClassifier, IterNCGPPoissonRegressor  # noqa: E402
from tests import reference, reference_ep  # noqa: E402
from tests.integrations.test_sklearn import TIGHT, _binary, _kernel_with_priors, _matern, _multiclass  # noqa: E402

# Exact EP: the Laplace tests' exact solves (unit-vector actions to full rank in every sweep, sites to 1e-12), the
# default kernel fixed.
EXACT_EP = {
    **TIGHT,
    "inference": "ep",
    "solver_options": dict(
        policy="unit", max_solver_iterations=None, abs_tol=1e-12, rel_tol=1e-12, site_tol=1e-12, marginal_tol=None
    )
    | {"max_sweeps": 400},
}


def test_binary_ep_is_dense_ep():
    """Probit EP: the estimator's evidence and predictive probabilities are dense EP's (R&W Alg. 3.5, 3.6)."""
    x, y, x_test = _binary()
    classifier = IterNCGPClassifier(link="probit", **EXACT_EP).fit(x, y)
    assert classifier.inference_ == "ep"
    lengthscale = math.sqrt(x.shape[1])
    kernel = _matern(x, x, lengthscale)
    expected = reference_ep.parallel_ep(kernel, torch.as_tensor(y, dtype=torch.float64), damping=0.5, tol=1e-12)
    np.testing.assert_allclose(classifier.log_marginal_likelihood(), float(expected.log_marginal_likelihood), rtol=1e-8)
    _, _, probability = reference_ep.probit_predict(
        kernel, _matern(x, x_test, lengthscale), torch.ones(len(x_test), dtype=torch.float64), expected
    )
    np.testing.assert_allclose(classifier.predict_proba(x_test)[:, 1], probability.numpy(), rtol=1e-7, atol=1e-9)


def test_binary_ep_with_priors_leaves_them_out_of_the_evidence_and_adds_them_to_the_objective():
    """Probit EP, a kernel with priors: ``log_marginal_likelihood()`` is dense EP's evidence at the same kernel, and the
    objective of the learning (``N`` times the model's EP evidence object) that plus the log prior by scipy.stats."""
    x, y, _ = _binary()
    kernel, log_prior = _kernel_with_priors(x.shape[1])
    classifier = IterNCGPClassifier(kernel, link="probit", **EXACT_EP).fit(x, y)
    outputscale, lengthscale = 1.0, float(classifier.kernel_.base_kernel.lengthscale.detach())
    dense = _matern(x, x, lengthscale, outputscale)
    expected = reference_ep.parallel_ep(dense, torch.as_tensor(y, dtype=torch.float64), damping=0.5, tol=1e-12)
    evidence = float(expected.log_marginal_likelihood)
    np.testing.assert_allclose(classifier.log_marginal_likelihood(), evidence, rtol=1e-8)
    model, strategy = classifier.model_, classifier.model_.variational_strategy
    model.train()
    with torch.no_grad():
        mll = EPMarginalLogLikelihood(classifier.likelihood_, model)
        objective = float(mll(model(strategy.train_inputs), strategy.train_targets)) * len(x)
    np.testing.assert_allclose(objective, evidence + log_prior(outputscale, lengthscale), rtol=1e-8)


def test_multiclass_ep_is_dense_multinomial_probit_ep():
    """Multi-class EP: the multinomial probit's evidence at the estimator's fixed point is dense parallel EP's."""
    x, y, x_test = _multiclass()
    classifier = IterNCGPClassifier(**EXACT_EP).fit(x, y)
    assert type(classifier.likelihood_).__name__ == "MultinomialProbitLikelihood"
    kernel = reference.data_major(_matern(x, x, math.sqrt(x.shape[1])), 3)
    targets = torch.as_tensor(y, dtype=torch.float64)
    expected = reference_ep.multiclass_parallel_ep(kernel, targets, 3, damping=0.5, tol=1e-11)
    np.testing.assert_allclose(classifier.log_marginal_likelihood(), float(expected.log_marginal_likelihood), rtol=1e-7)
    probabilities, std = classifier.predict_proba(x_test, return_std=True)
    assert probabilities.shape == std.shape == (len(x_test), 3)
    np.testing.assert_allclose(probabilities.sum(1), 1.0, atol=1e-6)


@pytest.mark.parametrize("data, link", [(_binary, "logit"), (_binary, "probit"), (_multiclass, None)])
def test_exact_ep_stops_where_its_marginals_settle_near_the_fixed_point(data, link):
    """With exact solves (a few hundred latent values) the default EP fit stops where a sweep moves the marginals by at
    most ``EXACT_MARGINAL_TOL``: in at most half the sweeps of exact EP run to the fixed point by its sites' test
    (``outer_tol``), its predictive probabilities within 3e-3 of the fixed point's and its evidence within 3e-3 nats
    (measured: 8 or 10 sweeps against 37–49; 4.4e-4–9.6e-4 and at most 3e-4 nats)."""
    x, y, x_test = data()
    options = dict(inference="ep", optimizer_steps=0, random_state=0, **({"link": link} if link else {}))
    settled = IterNCGPClassifier(**options).fit(x, y)
    to_the_sites = {"site_tol": 1e-10, "marginal_tol": None, "max_sweeps": 1000}
    fixed_point = IterNCGPClassifier(solver_options=to_the_sites, **options).fit(x, y)
    assert fixed_point.fit_report_.converged and settled.fit_report_.converged
    assert 2 * settled.fit_report_.steps <= fixed_point.fit_report_.steps
    np.testing.assert_allclose(settled.predict_proba(x_test), fixed_point.predict_proba(x_test), rtol=0, atol=3e-3)
    assert abs(settled.log_marginal_likelihood() - fixed_point.log_marginal_likelihood()) <= 3e-3


def _learnt_evidence(train_fit_steps: int) -> tuple[float, float]:
    """Learn by Adam on N = 1200 binary points (matrix-free evidence), then the exact Laplace evidence at the learnt
    hyperparameters, and at the start."""
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=1200, n_features=3, n_informative=3, n_redundant=0, random_state=0)
    options = dict(
        inference="laplace", optimizer_steps=12, random_state=0, solver_options={"max_solver_iterations": 10}
    )
    learnt = IterNCGPClassifier(train_fit_steps=train_fit_steps, **options).fit(x, y)
    start = IterNCGPClassifier(**{**options, "optimizer_steps": 0}).fit(x, y)
    with settings.exact_evidence_size(2000):
        return learnt.log_marginal_likelihood(), start.log_marginal_likelihood()


@pytest.mark.slow  # about 15 s
def test_loose_fits_learn_the_hyperparameters_of_whole_refits():
    """One Newton step per evaluation of the evidence (from the previous mode) learns hyperparameters whose exact
    evidence is that of whole refits (20 Newton steps) to 1% of the gain over the start (measured: 0.23%, the loose
    run ahead), and both gain. Twelve Adam steps are not at the optimum: the two runs follow different paths (other
    modes, other probe vectors), and 1% bounds how far apart their ends may be."""
    loose, start = _learnt_evidence(1)
    whole, _ = _learnt_evidence(20)
    assert loose > start + 10 and whole > start + 10
    assert abs(loose - whole) <= 1e-2 * (whole - start)


def test_learning_runs_loose_fits_and_the_final_fit_whole(monkeypatch):
    """During Adam, each evaluation runs at most ``train_fit_steps`` Newton steps and keeps at most 20 recycled
    actions; the final fit its own budget; the strategy's options are restored afterwards."""
    from sklearn.datasets import make_classification

    from gpytorch_iterncgp import IterNCGPStrategy

    x, y = make_classification(n_samples=1100, n_features=3, n_informative=3, n_redundant=0, random_state=1)
    budgets: list[tuple] = []
    original = IterNCGPStrategy._run

    def spy(self, prior, options, *args):
        budgets.append((options.max_newton_steps, options.compression_rank, options.covariance_iterations))
        return original(self, prior, options, *args)

    monkeypatch.setattr(IterNCGPStrategy, "_run", spy)
    classifier = IterNCGPClassifier(
        inference="laplace",
        optimizer_steps=3,
        random_state=0,
        train_fit_steps=2,
        solver_options={"covariance_iterations": 2},
        learning_subset=None,
    ).fit(x, y)
    assert budgets == [(2, 20, 0)] * 3 + [(None, None, 2)]  # the final fit: no step limit
    options = classifier.model_.variational_strategy.options
    assert options.max_newton_steps is None and options.compression_rank is None
    assert options.train_fit_steps == 2  # the strategy's own option, which fit_mll's learning follows

    budgets.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = IterNCGPClassifier(
            inference="laplace", optimizer_steps=3, random_state=0, learning_fit_steps=1, learning_subset=None
        ).fit(x, y)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == [
        "IterNCGPClassifier: learning_fit_steps= is deprecated and will be removed in a future release; it is now "
        "train_fit_steps=."
    ]
    assert budgets[:3] == [(1, 20, 0)] * 3 and old.model_.variational_strategy.options.train_fit_steps == 1
    with pytest.raises(ValueError, match="learning_fit_steps= is the deprecated name of train_fit_steps="):
        IterNCGPClassifier(learning_fit_steps=1, train_fit_steps=3).fit(x, y)


def test_ep_evidence_is_finite_with_an_incomplete_solve():
    """With 5 CG iterations per sweep the computation-aware marginals are too wide; EP's evidence bounds the cavities
    by the prior as the sweeps do, and stays finite (unbounded, some cavity precisions are negative: NaN)."""
    import gpytorch

    from gpytorch_iterncgp import (
        EPMarginalLogLikelihood,
        EPStrategy,
        EstimatedEvidenceWarning,
        MultinomialProbitLikelihood,
    )

    x, y, _ = _multiclass(num=400)
    train_x, train_y = torch.as_tensor(x), torch.as_tensor(y, dtype=torch.float64)
    likelihood = MultinomialProbitLikelihood(num_classes=3)

    class Model(gpytorch.models.ApproximateGP):
        def __init__(self):
            strategy = EPStrategy(self, train_x, train_y, likelihood, max_solver_iterations=5, show_progress=False)
            super().__init__(strategy)
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5))
            self.covar_module.outputscale = 4.0

        def forward(self, inputs):
            mean = torch.zeros(len(inputs), dtype=inputs.dtype)
            return gpytorch.distributions.MultivariateNormal(mean, self.covar_module(inputs))

    model = Model().double()
    report = model.variational_strategy.fit(max_sweeps=10)
    assert report.bounded_cavities > 0
    model.train()
    with pytest.warns(EstimatedEvidenceWarning, match="fit_mll"):  # estimated from incomplete solves: biased
        evidence = EPMarginalLogLikelihood(likelihood, model)(model(train_x), train_y)
    assert math.isfinite(float(evidence.detach()))
    evidence.backward()
    assert math.isfinite(float(model.covar_module.raw_outputscale.grad))


def test_ep_estimator_learns_on_the_laplace_evidence_unless_the_recipe_asks_for_eps():
    """The EP estimator learns the kernel on Laplace's evidence and fits EP at the learnt kernel, above
    ``exact_evidence_size`` and below it; ``fit_mll`` with ``LearningRecipe(evidence="ep")`` maximises EP's evidence
    where it is exact (below), Laplace's where EP's would be estimated (biased by the computation-aware cavities)."""
    x, y, _ = _multiclass(num=400)
    large = IterNCGPClassifier(inference="ep", optimizer_steps=3, random_state=0).fit(x, y)
    assert large.learning_report_.evidence == "Laplace" and large.learning_report_.evaluations == 3
    assert type(large.model_.variational_strategy).__name__ == "EPStrategy"
    assert large.kernel_.outputscale.item() != 1.0  # learnt, and the EP model holds the learnt kernel
    assert "Laplace evidence" in str(large.learning_report_)
    small = IterNCGPClassifier(inference="ep", optimizer_steps=3, random_state=0).fit(x[:60], y[:60])
    assert small.learning_report_.evidence == "Laplace" and small.learning_report_.method == "L-BFGS"
    recipe = LearningRecipe(optimizer_steps=3, evidence="ep")
    for classifier, evidence in ((small, "EP"), (large, "Laplace")):
        model = classifier.model_
        report = fit_mll(
            EPMarginalLogLikelihood(classifier.likelihood_, model), recipe=recipe, learning_subset=None, seed=0
        )
        assert report.evidence == evidence and report.evaluations >= 2


def test_ep_outputscale_is_chosen_by_the_held_out_log_loss():
    """Where Laplace's evidence learns EP's kernel on a subset, EP's outputscale is then chosen among Laplace's times
    ``outputscale_factors`` by the log-loss of held-out training rows (``validation_rows_``), walking from 1: the
    chosen factor is the grid's minimum of the dense reference (parallel EP, R&W Alg. 3.6's predictive, scikit-learn's
    ``log_loss``) on the learning rows, reached with fits at fewer factors than the grid's, each recorded log-loss
    the reference's at its factor; the final posterior holds the chosen outputscale."""
    x, y, _ = _binary(num=200, seed=3)
    with settings.exact_evidence_size(50):  # 80 learning rows: above it, so Laplace learns EP's kernel
        classifier = IterNCGPClassifier(  # the Matérn alone (kernel="auto" would choose between two)
            kernel=None,
            link="probit",
            inference="ep",
            learning_subset=80,
            optimizer_steps=3,
            random_state=0,
            standardize=False,
        ).fit(x, y)
    report = classifier.learning_report_
    rows, held_out = classifier.learning_rows_, classifier.validation_rows_
    assert report.evidence == "Laplace" and len(rows) == len(held_out) == report.validation_points == 80
    assert not set(rows) & set(held_out)
    assert "log-loss of 80 held-out points" in str(classifier.learning_report_)
    lengthscale = classifier.kernel_.base_kernel.lengthscale.item()
    laplace_outputscale = classifier.kernel_.outputscale.item() / report.outputscale_factor

    def reference(factor: float) -> float:
        outputscale = laplace_outputscale * factor
        kernel = _matern(x[rows], x[rows], lengthscale, outputscale)
        result = reference_ep.parallel_ep(kernel, torch.as_tensor(y[rows], dtype=torch.float64), tol=1e-10)
        cross = _matern(x[rows], x[held_out], lengthscale, outputscale)
        diagonal = torch.full((len(held_out),), outputscale, dtype=torch.float64)
        _, _, probability = reference_ep.probit_predict(kernel, cross, diagonal, result)
        return log_loss(y[held_out], probability.numpy(), labels=[0, 1])

    expected = {factor: reference(factor) for factor in LearningRecipe.outputscale_factors}
    for _ in range(LearningRecipe.outputscale_extensions):  # past the grid's edge while the edge is the best
        best = min(expected, key=expected.__getitem__)
        if best not in (max(expected), min(expected)):
            break
        factor = best * 2 if best == max(expected) else best / 2
        expected[factor] = reference(factor)
    walked = report.outputscale_scores  # the walk's fits: a subset of the grid's, and its minimum
    assert 3 <= len(walked) < len(expected) and walked == pytest.approx({f: expected[f] for f in walked}, abs=2e-4)
    assert report.outputscale_factor == min(expected, key=expected.__getitem__)
    assert classifier.model_.covar_module.outputscale.item() == classifier.kernel_.outputscale.item()


def test_ep_outputscale_needs_held_out_rows_an_outputscale_and_time():
    """No choice where every row was learnt on, the kernel has no outputscale, or ``max_time`` has passed."""
    x, y, _ = _binary(num=200, seed=3)
    with settings.exact_evidence_size(50):
        everything = IterNCGPClassifier(inference="ep", learning_subset=None, optimizer_steps=2, random_state=0)
        no_outputscale = IterNCGPClassifier(
            gpytorch.kernels.MaternKernel(nu=2.5), inference="ep", learning_subset=80, optimizer_steps=2, random_state=0
        )
        out_of_time = IterNCGPClassifier(kernel=None, inference="ep", learning_subset=80, max_time=0.0, random_state=0)
        for classifier in (everything.fit(x, y), no_outputscale.fit(x, y), out_of_time.fit(x, y)):
            assert classifier.learning_report_.evidence == "Laplace"
            assert classifier.learning_report_.outputscale_scores == {}
            assert classifier.learning_report_.outputscale_factor == 1.0
            assert "outputscale times" not in str(classifier.learning_report_)
    assert everything.validation_rows_ is None and everything.learning_report_.held_out_score is None
    # without an outputscale the held-out rows still check the model against a constant predictor
    assert len(no_outputscale.validation_rows_) == 80 and no_outputscale.learning_report_.held_out_score is not None
    assert len(out_of_time.validation_rows_) == 80 and out_of_time.learning_report_.stopped == "max_time"


def test_inference_parameter(monkeypatch):
    x, y, _ = _multiclass()
    assert IterNCGPClassifier(optimizer_steps=0).fit(x, y).inference_ == CLASSIFIER_INFERENCE
    assert auto_inference(15_000, 2) == CLASSIFIER_INFERENCE and auto_inference(15_001, 2) == "sparse_ep"
    assert auto_inference(8_000, 10) == CLASSIFIER_INFERENCE and auto_inference(8_001, 10) == "sparse_ep"
    assert auto_inference(2_275, 26) == CLASSIFIER_INFERENCE and auto_inference(2_276, 26) == "sparse_ep"
    monkeypatch.setattr(estimator_policy, "SPARSE_EP_POINTS", len(x) - 1)  # this data past the switch
    switched = IterNCGPClassifier(optimizer_steps=0, max_time=0.5, num_inducing=8).fit(x, y)
    assert switched.inference_ == "sparse_ep"
    with pytest.raises(ValueError, match="'inference' parameter"):
        IterNCGPClassifier(inference="vi").fit(x, y)
    with pytest.raises(ValueError, match="inference='ep'"):
        IterNCGPClassifier(link="probit", inference="laplace").fit(x, y)
    with pytest.raises(ValueError, match="'train_fit_steps' parameter"):
        IterNCGPClassifier(train_fit_steps=0).fit(x, y)
    counts = np.arange(len(x)) % 4
    regressor = IterNCGPPoissonRegressor(inference="ep", optimizer_steps=0).fit(x, counts)
    assert regressor.inference_ == "ep" and type(regressor.model_.variational_strategy).__name__ == "EPStrategy"
    assert IterNCGPPoissonRegressor(optimizer_steps=0).fit(x, counts).inference_ == "laplace"
    with pytest.raises(ValueError, match="integer counts"):
        IterNCGPPoissonRegressor(inference="ep").fit(x, counts + 0.5)


def test_a_final_fit_stopped_by_its_limit_raises_scikit_learns_convergence_warning():
    """The estimators raise scikit-learn's ``ConvergenceWarning`` (the package's, converted) at the caller's line,
    naming their own parameter; a fit that converges raises none."""
    from sklearn.datasets import make_moons
    from sklearn.exceptions import ConvergenceWarning

    x, y = make_moons(200, noise=0.3, random_state=0)
    with pytest.warns(ConvergenceWarning, match=r"solver_options=\{'max_sweeps': ...\} sets this limit") as caught:
        IterNCGPClassifier(solver_options={"max_sweeps": 1}, optimizer_steps=0).fit(x, y)
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        IterNCGPClassifier(inference="laplace", optimizer_steps=0).fit(x, y)


def test_warnings_are_rewritten_by_category_not_by_message():
    """The package's ``ConvergenceWarning`` (a limit) gets the limit's note and the hint, its ``NotConvergedWarning``
    (a stall) the hint, both as scikit-learn's ``ConvergenceWarning``; any other category is left as it was, whatever
    its message says."""
    from sklearn.exceptions import ConvergenceWarning

    from gpytorch_iterncgp import ConvergenceWarning as PackageConvergenceWarning
    from gpytorch_iterncgp import NotConvergedWarning, NumericalBreakdownWarning
    from gpytorch_iterncgp.integrations.sklearn import _reemit_as_scikit_learn

    sent = [
        ("a limit", PackageConvergenceWarning),
        ("a stall", NotConvergedWarning),
        ("a breakdown", NumericalBreakdownWarning),
        ("stopped at max_newton_steps=3 before it converged", UserWarning),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for message, category in sent:
            warnings.warn(message, category, stacklevel=1)
    with warnings.catch_warnings(record=True) as reemitted:
        warnings.simplefilter("always")
        _reemit_as_scikit_learn(caught, " [note]", " [hint]")
    assert [(str(w.message), w.category) for w in reemitted] == [
        ("a limit [note] [hint]", ConvergenceWarning),
        ("a stall [hint]", ConvergenceWarning),
        ("a breakdown", NumericalBreakdownWarning),
        ("stopped at max_newton_steps=3 before it converged", UserWarning),
    ]


@pytest.mark.slow  # about 35 s and 20 s (2000 minibatch steps, and dense EP's learning)
@pytest.mark.parametrize("dataset", ["breast_cancer", "iris"])
def test_sparse_ep_is_near_dense_ep(dataset):
    """``inference="sparse_ep"`` (stochastic EP, binary and multinomial probit) scores a test log-loss within 0.03 of
    dense EP's, each learning its kernel (measured: 0.102 against 0.098 and 0.051 against 0.033 on the full splits),
    and has no evidence to report."""
    from sklearn import datasets
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = getattr(datasets, f"load_{dataset}")(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    scaler = StandardScaler().fit(x_train)
    x_train, x_test = scaler.transform(x_train)[:200], scaler.transform(x_test)
    y_train = y_train[:200]
    dense = IterNCGPClassifier(inference="ep", random_state=0).fit(x_train, y_train)
    sparse = IterNCGPClassifier(inference="sparse_ep", num_inducing=40, batch_size=100, random_state=0).fit(
        x_train, y_train
    )
    assert sparse.inference_ == "sparse_ep" and sparse.fit_report_ is None
    probabilities = sparse.predict_proba(x_test)
    np.testing.assert_allclose(probabilities.sum(1), 1.0, rtol=1e-12)
    assert log_loss(y_test, probabilities) < log_loss(y_test, dense.predict_proba(x_test)) + 0.03
    with pytest.raises(NotImplementedError, match="sparse_ep"):
        sparse.log_marginal_likelihood()


def test_sparse_ep_fits_within_max_time_and_refuses_the_evidence():
    x, y = _multiclass()[:2]
    classifier = IterNCGPClassifier(inference="sparse_ep", num_inducing=10, batch_size=16, max_time=1.0, random_state=0)
    classifier.fit(x, y)
    assert classifier.inference_ == "sparse_ep" and classifier.learning_report_.stopped in ("max_time", "max_steps")
    probabilities = classifier.predict_proba(x)
    assert probabilities.shape == (len(x), classifier.n_classes_)
    np.testing.assert_allclose(probabilities.sum(1), 1.0, rtol=1e-12)
    with pytest.raises(NotImplementedError, match="sparse_ep"):
        classifier.log_marginal_likelihood()
    with pytest.raises(ValueError, match="num_inducing"):
        IterNCGPClassifier(inference="sparse_ep", num_inducing=0).fit(x, y)


def test_parameters_the_inference_does_not_use_are_refused():
    """A parameter set away from its default that the inference in use ignores is an error naming it (they were
    accepted and ignored): the dense solver's under stochastic EP, the inducing points' under dense EP, also where
    ``inference="auto"`` made the choice."""
    from gpytorch_iterncgp.sklearn import IterNCGPClassifier

    x, y, _ = _multiclass(num=60)
    with pytest.raises(ValueError, match=r"solver_options=\{'max_solver_iterations': 10\} do\(es\) not apply"):
        IterNCGPClassifier(inference="sparse_ep", solver_options={"max_solver_iterations": 10}).fit(x, y)
    with pytest.raises(ValueError, match=r"num_inducing=32, batch_size=16 do\(es\) not apply: inference='auto' chose"):
        IterNCGPClassifier(num_inducing=32, batch_size=16).fit(x, y)
    with pytest.raises(ValueError, match="Set inference='sparse_ep' to use it"):
        IterNCGPClassifier(inference="ep", num_inducing=32).fit(x, y)


class _Recorded(Exception):
    """Raised by the spy in place of ``fit_mll`` once it has recorded what the estimator passed."""


def _recorded_calls(monkeypatch, record) -> list[dict]:
    """Replace the estimators' ``fit_mll`` by a spy that records ``record(mll)`` and the keywords it was given, then
    raises :class:`_Recorded`; returns the list the calls go to."""
    from gpytorch_iterncgp.integrations import sklearn as estimators

    calls: list[dict] = []

    def spy(mll, **options):
        calls.append({**record(mll), **options})
        raise _Recorded

    monkeypatch.setattr(estimators, "fit_mll", spy)
    return calls


#: the solver's options set away from the estimators' choices, by the strategies' names (``solver_options``)
SOLVER_GIVEN = dict(
    policy="cg",
    max_solver_iterations=9,
    compression_rank=11,
    preconditioner_rank=13,
    covariance_iterations=3,
    recycle=False,
    abs_tol=1e-3,
    rel_tol=1e-3,
)
#: the former estimator parameters of the same values (``max_newton_steps`` and ``outer_tol`` are EP's ``max_sweeps``
#: and ``site_tol``)
FORMER_GIVEN = {
    **{name: value for name, value in SOLVER_GIVEN.items() if name not in ("abs_tol", "rel_tol")},
    "solver_tol": 1e-3,
    "max_newton_steps": 7,
    "outer_tol": 0.05,
}


def _check_solver_options(strategy, inference: str) -> None:
    """``strategy`` has :data:`SOLVER_GIVEN`'s options, 7 steps at most and a tolerance of 0.05 for its outer loop."""
    from gpytorch_iterncgp import ConjugateGradientPolicy
    from gpytorch_iterncgp.integrations import sklearn as estimators

    options = strategy.options
    steps, tolerance = ("max_sweeps", "site_tol") if inference == "ep" else ("max_newton_steps", "outer_tol")
    assert isinstance(strategy, estimators.EPStrategy if inference == "ep" else estimators.IterNCGPStrategy)
    assert isinstance(strategy.policy, ConjugateGradientPolicy)
    assert (getattr(options, steps), getattr(options, tolerance)) == (7, 0.05)
    assert (options.max_solver_iterations, options.compression_rank, options.preconditioner_rank) == (9, 11, 13)
    assert (options.covariance_iterations, options.recycle) == (3, False)
    assert options.abs_tol == options.rel_tol == 1e-3


@pytest.mark.parametrize("inference", ["laplace", "ep"])
def test_every_estimator_parameter_reaches_what_it_names(monkeypatch, inference):
    """Each parameter of the dense estimators, set away from its default, arrives where its name says:
    ``solver_options`` at the strategy's options of their names, the learning's at the ``LearningRecipe``, the rest at
    ``fit_mll``'s keyword or the strategy option of its name; the stochastic-EP ones are refused (the test above)."""
    from sklearn.utils import check_random_state

    calls = _recorded_calls(monkeypatch, lambda mll: {"strategy": mll.model.variational_strategy})
    x, y = _binary(num=1200)[:2]
    steps, tolerance = ("max_sweeps", "site_tol") if inference == "ep" else ("max_newton_steps", "outer_tol")
    given = dict(
        solver_options={**SOLVER_GIVEN, steps: 7, tolerance: 0.05},
        optimizer_steps=6,
        learning_rate=0.05,
        train_fit_steps=4,
        learning_subset=500,
        max_time=30.0,
        random_state=5,
        verbose=True,
    )
    with pytest.raises(_Recorded):
        IterNCGPClassifier(inference=inference, **given).fit(x, y)
    (call,) = calls
    strategy, recipe = call["strategy"], call["recipe"]
    _check_solver_options(strategy, inference)
    assert strategy.options.train_fit_steps == 4
    assert (recipe.optimizer_steps, recipe.learning_rate) == (6, 0.05)
    assert (call["learning_subset"], call["max_time"], call["show_progress"]) == (500, 30.0, True)
    assert call["seed"] == check_random_state(5).randint(np.iinfo(np.int32).max)
    calls.clear()
    with pytest.raises(_Recorded):
        IterNCGPClassifier(inference=inference, optimizer_steps=0).fit(x, y)
    assert calls[0]["recipe"].optimizer_steps == 0


@pytest.mark.parametrize("inference", ["laplace", "ep"])
def test_the_former_solver_parameters_warn_once_and_reach_the_same_options(monkeypatch, inference):
    """The nine solver parameters ``solver_options`` replaced still work for one release: one ``FutureWarning`` at the
    caller's line naming each one's key, and the strategy gets the options ``solver_options`` would give it (EP's
    ``outer_tol`` tests the sites alone, as before: ``marginal_tol=None``); beside ``solver_options`` setting the
    same option they are refused."""
    calls = _recorded_calls(monkeypatch, lambda mll: {"strategy": mll.model.variational_strategy})
    x, y = _binary(num=1200)[:2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(_Recorded):
            IterNCGPClassifier(inference=inference, **FORMER_GIVEN).fit(x, y)
    future = [warning for warning in caught if issubclass(warning.category, FutureWarning)]
    assert len(future) == 1 and future[0].filename == __file__
    steps = "max_sweeps" if inference == "ep" else "max_newton_steps"
    assert f"max_newton_steps= as solver_options['{steps}']" in str(future[0].message)
    _check_solver_options(calls[0]["strategy"], inference)
    if inference == "ep":
        assert calls[0]["strategy"].options.marginal_tol is None
    with pytest.raises(ValueError, match="both set policy"), pytest.warns(FutureWarning):
        IterNCGPClassifier(inference=inference, policy="cg", solver_options={"policy": "unit"}).fit(x, y)


def test_stochastic_eps_steps_and_learning_rate_are_the_estimators_optimizer_steps_and_learning_rate(monkeypatch):
    """Under ``"sparse_ep"`` the minibatch loop's steps and learning rate are ``optimizer_steps`` and
    ``learning_rate`` (``"auto"``: ``MinibatchRecipe``'s, where the dense learning's are ``LearningRecipe``'s);
    ``optimizer_steps=0`` fixes the kernel, the loop fitting the sites for its default steps."""
    from gpytorch_iterncgp import LearningRecipe, MinibatchRecipe

    calls = _recorded_calls(monkeypatch, lambda mll: {"parameters": [p.requires_grad for p in mll.model.parameters()]})
    x, y = _binary(num=200)[:2]
    for given, steps, rate in [
        ({}, MinibatchRecipe.max_steps, MinibatchRecipe.learning_rate),
        ({"optimizer_steps": 40, "learning_rate": 0.03}, 40, 0.03),
        ({"optimizer_steps": 0}, MinibatchRecipe.max_steps, MinibatchRecipe.learning_rate),
    ]:
        calls.clear()
        with pytest.raises(_Recorded):
            IterNCGPClassifier(inference="sparse_ep", kernel=None, num_inducing=8, **given).fit(x, y)
        recipe = calls[0]["recipe"]
        assert (recipe.max_steps, recipe.learning_rate) == (steps, rate)
        assert any(calls[0]["parameters"]) == (given.get("optimizer_steps") != 0)
    calls.clear()
    with pytest.raises(_Recorded):
        IterNCGPClassifier(inference="laplace", kernel=None).fit(x, y)
    assert (calls[0]["recipe"].optimizer_steps, calls[0]["recipe"].learning_rate) == (
        LearningRecipe.optimizer_steps,
        LearningRecipe.learning_rate,
    )


def test_optimize_hyperparameters_is_deprecated_for_optimizer_steps_zero():
    """``optimize_hyperparameters=False`` still fixes the kernel, with one ``FutureWarning`` at the caller's line
    naming ``optimizer_steps=0``; ``True`` learns as the default; beside an ``optimizer_steps`` given it is refused."""
    x, y = _binary(num=60)[:2]
    with pytest.warns(FutureWarning, match="optimizer_steps=0") as caught:
        old = IterNCGPClassifier(optimize_hyperparameters=False, random_state=0).fit(x, y)
    assert len(caught) == 1 and caught[0].filename == __file__
    new = IterNCGPClassifier(optimizer_steps=0, random_state=0).fit(x, y)
    assert old.learning_report_.evaluations == new.learning_report_.evaluations == 0
    np.testing.assert_array_equal(old.predict_proba(x), new.predict_proba(x))
    with pytest.warns(FutureWarning):
        learnt = IterNCGPClassifier(optimize_hyperparameters=True, random_state=0).fit(x, y)
    assert learnt.learning_report_.evaluations > 0
    with pytest.raises(ValueError, match="give optimizer_steps= alone"):
        IterNCGPClassifier(optimize_hyperparameters=False, optimizer_steps=3).fit(x, y)
