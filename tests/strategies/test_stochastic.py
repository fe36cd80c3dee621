r"""StochasticEPStrategy and StochasticEPMarginalLogLikelihood: SVGP's training loop on minibatches.

* The strategy's posterior and the objective are those of ``sparse/stochastic.py`` on the same batch (a kernel shared
  by the classes or one GP per class, inducing inputs shared or one set per class); the objective's gradient is the
  core's energy gradient.
* The loop learns: on a binary problem the test log-loss after 15 epochs is within 0.03 of dense EP's at the
  data-generating kernel, and far below the prior's.
* ``state_dict`` round trip, float32, the idiom ``likelihood(model(x))``, and the errors.
* ``fit_mll(mll, data=...)`` runs the loop for the caller: epochs, ``max_time``, and its errors.
* On CUDA (skipped without a GPU), six steps give the CPU's sites, gradients and predictions.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import gpytorch
import pytest
import torch

from gpytorch_iterncgp import (
    LearningRecipe,
    MinibatchRecipe,
    MultinomialProbitLikelihood,
    StochasticEPMarginalLogLikelihood,
    StochasticEPStrategy,
    fit_mll,
)
from gpytorch_iterncgp.sparse.stochastic import PointSites, StochasticEP, TiedSite, WhitenedBatch
from tests import reference_ep
from tests.common import binary_data

F64 = torch.float64


class SEPModel(gpytorch.models.ApproximateGP):
    def __init__(self, inducing_points, likelihood, batch_classes=None, **options):
        super().__init__(StochasticEPStrategy(self, inducing_points, likelihood, **options))
        shape = torch.Size([] if batch_classes is None else [batch_classes])
        self.mean_module = gpytorch.means.ConstantMean(batch_shape=shape)
        self.covar_module = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(batch_shape=shape), batch_shape=shape
        )
        self.covar_module.base_kernel.lengthscale = 0.3
        self.covar_module.outputscale = 2.0

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _three_classes(x):
    return (x[:, 0] > 0.33).long() + (x[:, 0] > 0.66).long()


def _loop(model, likelihood, x, y, epochs, batch_size, lr=0.02, seed=0):
    mll = StochasticEPMarginalLogLikelihood(likelihood, model, num_data=len(x))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for rows in torch.randperm(len(x), generator=generator).split(batch_size):
            optimizer.zero_grad()
            loss = -mll(model(x[rows]), y[rows])
            loss.backward()
            optimizer.step()
    model.eval()
    return mll


@pytest.mark.parametrize("batch_classes, per_class", [(None, False), (3, False), (3, True), (None, True)])
def test_posterior_and_objective_are_the_cores(batch_classes, per_class):
    x, _ = binary_data(60, seed=1)
    y = _three_classes(x)
    likelihood = MultinomialProbitLikelihood(3)
    inducing = torch.stack([x[c::5][:12] for c in range(3)]) if per_class else x[::5].clone()  # (3, 12, 2) or (12, 2)
    model = SEPModel(inducing, likelihood, batch_classes).to(F64)
    mll = _loop(model, likelihood, x, y, epochs=2, batch_size=20)
    assert model.variational_strategy.site.steps == 6
    model.train()
    rows = torch.arange(10, 30)
    strategy = model.variational_strategy
    site = strategy.site
    output = model(x[rows])  # the points' cavities under this site
    objective = mll(output, y[rows])  # SEP's energy there, and a step from there
    assert strategy.site.steps == 7
    kernel, z = model.covar_module, strategy.inducing_points  # the prior's blocks, each from the kernel
    batch = WhitenedBatch.from_blocks(
        model.mean_module(x[rows]).expand(3, -1),
        kernel(z).to_dense().expand(3, -1, -1),
        kernel(z, x[rows].expand(*z.shape[:-2], -1, -1)).to_dense().expand(3, -1, -1),
        kernel(x[rows], diag=True).expand(3, -1),
    )
    core = StochasticEP(strategy.adapter, len(x))
    cavity_mean, cavity_variance = site.cavity(batch, len(x))
    torch.testing.assert_close(output.mean, cavity_mean.mT, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(output.variance, cavity_variance.mT, rtol=1e-12, atol=1e-12)
    expected = core.log_normalizers(site, batch, y[rows]).mean()
    stepped, _ = core.step(site, batch, y[rows])
    torch.testing.assert_close(strategy.site.precision, stepped.precision, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(strategy.site.natural_mean, stepped.natural_mean, rtol=1e-12, atol=1e-12)
    site = strategy.site
    torch.testing.assert_close(objective, expected, rtol=1e-12, atol=1e-12)
    parameters = list(model.parameters())
    gradient = torch.autograd.grad(objective, parameters, retain_graph=True)
    expected_gradient = torch.autograd.grad(expected, parameters)
    for actual, wanted in zip(gradient, expected_gradient, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-10, atol=1e-12)
    model.eval()
    mean_c, variance_c = core.posterior_marginals(site, batch)
    means, variances = strategy.marginal_latent(x[rows])
    torch.testing.assert_close(means, mean_c.mT.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(variances, variance_c.mT.detach(), rtol=1e-10, atol=1e-12)


def test_the_loop_learns_a_binary_problem():
    x, y = binary_data(400, seed=3)
    test_x, test_y = binary_data(400, seed=4)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = SEPModel(x[:40].clone(), likelihood).to(F64)
    with torch.no_grad():
        prior_probabilities = likelihood(model(test_x)).probs
    _loop(model, likelihood, x, y, epochs=15, batch_size=50)
    with torch.no_grad():
        probabilities = likelihood(model(test_x)).probs
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(F64)
    kernel.base_kernel.lengthscale, kernel.outputscale = 0.3, 9.0  # the data's latent 3 sin(6 x): amplitude 3
    with torch.no_grad():
        dense = reference_ep.sequential_ep(kernel(x).to_dense(), y, "probit", tol=1e-10, max_sweeps=200)
        *_, dense_probabilities = reference_ep.probit_predict(
            kernel(x).to_dense(), kernel(x, test_x).to_dense(), kernel(test_x, diag=True), dense
        )

    def log_loss(p):
        return float(-torch.where(test_y > 0, p.log(), (1 - p).log()).mean())

    # measured 0.433 against dense EP's 0.420 at the generating kernel and the prior's 0.693
    assert log_loss(probabilities) < log_loss(dense_probabilities) + 0.03
    assert log_loss(probabilities) < log_loss(prior_probabilities) - 0.1


def test_state_dict_round_trip_and_float32():
    x, y = binary_data(80, seed=2)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = SEPModel(x[:10].clone(), likelihood).to(F64)
    _loop(model, likelihood, x, y, epochs=2, batch_size=20)
    restored = SEPModel(torch.zeros(10, 2, dtype=F64), likelihood).to(F64)
    restored.load_state_dict(model.state_dict())
    restored.eval()
    with torch.no_grad():
        torch.testing.assert_close(restored(x).mean, model(x).mean, rtol=0, atol=0)
        single = SEPModel(x[:10].clone().float(), likelihood)
        single.load_state_dict(model.state_dict())
        single.eval()
        assert single.variational_strategy.site.precision.dtype == torch.float32
        torch.testing.assert_close(single(x.float()).mean, model(x).mean.float(), rtol=1e-4, atol=1e-4)
    other = SEPModel(torch.zeros(7, 2, dtype=F64), likelihood).to(F64)
    with pytest.raises(ValueError, match="saved site is for"):
        other.load_state_dict(model.state_dict())


def test_a_model_copied_in_training_trains_on_as_the_original():
    """``copy.deepcopy`` and ``pickle`` mid-training (the last training output's graph is not copied): the copy's
    next steps equal the original's."""
    import pickle

    x, y = binary_data(60, seed=4)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = SEPModel(x[:8].clone(), likelihood).to(F64)
    mll = StochasticEPMarginalLogLikelihood(likelihood, model, num_data=len(x))
    model.train()
    (-mll(model(x[:20]), y[:20])).backward()  # a training output is held
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
    results = []
    for candidate in [model, *copies]:
        objective = StochasticEPMarginalLogLikelihood(
            candidate.variational_strategy.likelihood, candidate, num_data=len(x)
        )
        candidate.train()
        candidate.zero_grad()
        value = objective(candidate(x[20:40]), y[20:40])
        value.backward()
        results.append(
            (value.detach(), candidate.variational_strategy.site.precision, candidate.mean_module.constant.grad)
        )
    for result in results[1:]:
        for copied, original in zip(result, results[0], strict=True):
            torch.testing.assert_close(copied, original, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="last call in training mode"):
        copied = copies[0]
        StochasticEPMarginalLogLikelihood(copied.variational_strategy.likelihood, copied, num_data=len(x))(
            model(x[:5]), y[:5]
        )


def test_errors_name_the_fix():
    x, y = binary_data(30, seed=0)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = SEPModel(x[:5].clone(), likelihood).to(F64)
    mll = StochasticEPMarginalLogLikelihood(likelihood, model, num_data=30)
    model.train()
    first = model(x[:10])
    model(x[10:20])
    with pytest.raises(RuntimeError, match="last call in training mode"):
        mll(first, y[:10])
    with pytest.raises(ValueError, match="likelihood must be"):
        StochasticEPMarginalLogLikelihood(gpytorch.likelihoods.BernoulliLikelihood(), model, num_data=30)
    with pytest.raises(TypeError, match="tilted moments"):
        SEPModel(x[:5].clone(), gpytorch.likelihoods.SoftmaxLikelihood(num_classes=3, mixing_weights=False))
    with pytest.raises(ValueError, match="features"):
        model(torch.zeros(3, 4, dtype=F64))
    with pytest.raises(ValueError, match="one set per latent"):
        SEPModel(torch.zeros(2, 5, 2, dtype=F64), likelihood)
    with pytest.raises(ValueError, match="one set per latent"):
        SEPModel(torch.zeros(2, 5, 2, dtype=F64), MultinomialProbitLikelihood(3))
    assert isinstance(model.variational_strategy.site, TiedSite)


def test_fit_mll_runs_the_minibatch_loop():
    x, y = binary_data(300, seed=5)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = SEPModel(x[:30].clone(), likelihood).to(F64)
    mll = StochasticEPMarginalLogLikelihood(likelihood, model, num_data=len(x))
    recipe = MinibatchRecipe(batch_size=64, learning_rate=0.02, max_steps=30)
    report = fit_mll(mll, data=(x, y), recipe=recipe, seed=0, show_progress=False)
    assert report.stopped == "max_steps" and report.evaluations == 30 and not model.training
    assert sum(report.losses[-5:]) < sum(report.losses[:5])  # the energy improves
    assert model.variational_strategy.site.steps == 30
    quick = fit_mll(mll, data=(x, y), recipe=recipe, max_time=0.0, show_progress=False)
    assert quick.stopped == "max_time" and quick.evaluations == 1
    with pytest.raises(TypeError, match="data="):
        fit_mll(mll)
    with pytest.raises(ValueError, match="num_data"):
        fit_mll(mll, data=(x[:10], y[:10]))
    with pytest.raises(TypeError, match="MinibatchRecipe"):
        fit_mll(mll, data=(x, y), recipe=LearningRecipe())
    # the dense fits' options are refused, naming what to use instead (they were accepted and ignored)
    with pytest.raises(TypeError, match=r"subset= does not apply to a StochasticEP.*MinibatchRecipe\(batch_size"):
        fit_mll(mll, data=(x, y), subset=100)
    with pytest.raises(TypeError, match="validation_rows= does not apply.*no outputscale phase"):
        fit_mll(mll, data=(x, y), validation_rows=torch.arange(10))
    with pytest.raises(TypeError, match="subsets= does not apply.*not an option of fit_mll"):
        fit_mll(mll, data=(x, y), subsets=100)


def test_fit_mll_anneals_the_learning_rate(monkeypatch):
    r"""The recipe's cosine schedule: Adam's step t of T at :math:`\alpha_0 (1 + \cos(\pi t / T)) / 2`, or by the
    fraction of ``max_time`` spent when that is further; ``"constant"`` keeps :math:`\alpha_0`."""
    x, y = binary_data(200, seed=5)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = SEPModel(x[:20].clone(), likelihood).to(F64)
    mll = StochasticEPMarginalLogLikelihood(likelihood, model, num_data=len(x))
    rates: list[float] = []
    adam_step = torch.optim.Adam.step

    def recording_step(self, *args, **kwargs):
        rates.append(self.param_groups[0]["lr"])
        return adam_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", recording_step)
    fit_mll(mll, data=(x, y), recipe=MinibatchRecipe(batch_size=50, learning_rate=0.02, max_steps=12), seed=0)
    expected = [0.01 * (1 + math.cos(math.pi * t / 12)) for t in range(12)]
    torch.testing.assert_close(torch.tensor(rates), torch.tensor(expected), rtol=1e-12, atol=0)
    rates.clear()
    fit_mll(mll, data=(x, y), recipe=MinibatchRecipe(batch_size=50, max_steps=5, schedule="constant"), seed=0)
    assert rates == [0.01] * 5
    recipe = MinibatchRecipe(max_steps=100)
    assert recipe.rate_factor(10, 30.0, 60.0) == pytest.approx(0.5)  # half the time spent, a tenth of the steps
    assert recipe.rate_factor(50, 1.0, None) == pytest.approx(0.5) and recipe.rate_factor(200, 0.0, None) == 0.0
    with pytest.raises(ValueError, match="schedule"):
        fit_mll(mll, data=(x, y), recipe=MinibatchRecipe(schedule="step"))


def test_per_point_sites_through_fit_mll_are_the_cores_full_batch_ep():
    x, y = binary_data(40, seed=7)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = SEPModel(x.clone(), likelihood, sites="points", learn_inducing_locations=False).to(F64)
    model.requires_grad_(False)  # the steps alone: EP at fixed hyperparameters
    mll = StochasticEPMarginalLogLikelihood(likelihood, model, num_data=len(x))
    recipe = MinibatchRecipe(batch_size=len(x), max_steps=60)
    resident = _resident_bytes()  # before the fit: its peak is at least this (afterwards the process may grow)
    report = fit_mll(mll, data=(x, y), recipe=recipe, show_progress=False)
    assert isinstance(model.variational_strategy.site, PointSites) and report.evaluations == 60
    assert report.peak_memory_bytes >= resident > 0
    strategy = model.variational_strategy
    core = StochasticEP(strategy.adapter, len(x))
    with torch.no_grad():
        batch = strategy.whitened_batch(x)
        site = PointSites.flat(1, len(x), x)
        for _ in range(60):
            site, _ = core.step(site, batch, y)
    torch.testing.assert_close(strategy.site.site_precision, site.site_precision, rtol=1e-12, atol=1e-12)
    restored = SEPModel(x.clone(), likelihood, sites="points", learn_inducing_locations=False).to(F64)
    restored.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(restored(x).mean, model(x).mean, rtol=0, atol=0)
    model.train()
    with pytest.raises(ValueError, match="all 40 training points"):
        mll(model(x[:10]), y[:10])
    with pytest.raises(ValueError, match="sites must be one of"):
        SEPModel(x.clone(), likelihood, sites="each")


def _resident_bytes() -> int:
    """This process's resident memory now, from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 1


def _sites_and_gradients(model, x, y, batch_size=20):
    """Six site steps on fixed batches (no optimiser: its normalised steps amplify rounding) with the gradient of the
    summed objective."""
    mll = StochasticEPMarginalLogLikelihood(model.variational_strategy.likelihood, model, num_data=len(x))
    model.train()
    total = sum(mll(model(x[rows]), y[rows]) for _ in range(2) for rows in torch.arange(len(x)).split(batch_size))
    total.backward()
    model.eval()
    return [parameter.grad for parameter in model.parameters()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_steps_equal_cpu_steps(dtype):
    x, _ = binary_data(60, seed=1)
    y = _three_classes(x)
    cpu = SEPModel(torch.stack([x[c::5][:12] for c in range(3)]), MultinomialProbitLikelihood(3), 3).to(F64)
    gpu = copy.deepcopy(cpu).to(device="cuda", dtype=dtype)
    expected_gradients = _sites_and_gradients(cpu, x, y)
    gradients = _sites_and_gradients(gpu, x.to("cuda", dtype), y.cuda())
    site = gpu.variational_strategy.site
    assert site.precision.device.type == "cuda" and site.precision.dtype == dtype and site.steps == 6
    tolerance = {"rtol": 1e-3, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-8, "atol": 1e-10}
    torch.testing.assert_close(
        site.natural_mean.cpu().double(), cpu.variational_strategy.site.natural_mean, **tolerance
    )
    for gradient, expected in zip(gradients, expected_gradients, strict=True):
        torch.testing.assert_close(gradient.cpu().double(), expected, **tolerance)
    with torch.no_grad():
        expected = cpu.variational_strategy.predictive_probabilities(x)
        probabilities = gpu.variational_strategy.predictive_probabilities(x.to("cuda", dtype))
    torch.testing.assert_close(probabilities.cpu().double(), expected, **tolerance)
