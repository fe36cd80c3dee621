r"""StochasticEPStrategy and StochasticEPMarginalLogLikelihood: SVGP's training loop on minibatches.

* The strategy's posterior and the objective are those of ``sparse/stochastic.py`` on the same batch (a kernel shared
  by the classes or one GP per class, inducing inputs shared or one set per class); the objective's gradient is the
  core's energy gradient.
* The loop learns: on a binary problem the test log-loss after 15 epochs is within 0.03 of dense EP's at the
  data-generating kernel, and far below the prior's.
* ``state_dict`` round trip, float32, the idiom ``likelihood(model(x))``, and the errors.
* GPyTorch's contract (``VariationalELBO``'s): the objective is a pure function of the model (computing it moves no
  site); the site moves in ``update_site`` after the optimiser's step, exactly as the core's step from the cavities
  before it; ``num_data`` is the strategy's; a training output carries its own minibatch; per-point sites refuse a
  batch of other inputs, even of the same size.
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
    mll = StochasticEPMarginalLogLikelihood(likelihood, model)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for rows in torch.randperm(len(x), generator=generator).split(batch_size):
            optimizer.zero_grad()
            output = model(x[rows])
            loss = -mll(output, y[rows])
            loss.backward()
            optimizer.step()
            model.variational_strategy.update_site(output, y[rows])
    model.eval()
    return mll


@pytest.mark.parametrize("batch_classes, per_class", [(None, False), (3, False), (3, True), (None, True)])
def test_posterior_and_objective_are_the_cores(batch_classes, per_class):
    x, _ = binary_data(60, seed=1)
    y = _three_classes(x)
    likelihood = MultinomialProbitLikelihood(3)
    inducing = torch.stack([x[c::5][:12] for c in range(3)]) if per_class else x[::5].clone()  # (3, 12, 2) or (12, 2)
    model = SEPModel(inducing, likelihood, batch_classes, num_data=len(x)).to(F64)
    mll = _loop(model, likelihood, x, y, epochs=2, batch_size=20)
    assert model.variational_strategy.site.steps == 6
    model.train()
    rows = torch.arange(10, 30)
    strategy = model.variational_strategy
    site = strategy.site
    output = model(x[rows])  # the points' cavities under this site
    objective = mll(output, y[rows])  # SEP's energy there
    assert strategy.site is site
    strategy.update_site(output, y[rows])  # a step from there
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
    model = SEPModel(x[:40].clone(), likelihood, num_data=len(x)).to(F64)
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
    model = SEPModel(x[:10].clone(), likelihood, num_data=len(x)).to(F64)
    _loop(model, likelihood, x, y, epochs=2, batch_size=20)
    restored = SEPModel(torch.zeros(10, 2, dtype=F64), likelihood, num_data=len(x)).to(F64)
    restored.load_state_dict(model.state_dict())
    restored.eval()
    with torch.no_grad():
        torch.testing.assert_close(restored(x).mean, model(x).mean, rtol=0, atol=0)
        single = SEPModel(x[:10].clone().float(), likelihood, num_data=len(x))
        single.load_state_dict(model.state_dict())
        single.eval()
        assert single.variational_strategy.site.precision.dtype == torch.float32
        torch.testing.assert_close(single(x.float()).mean, model(x).mean.float(), rtol=1e-4, atol=1e-4)
    other = SEPModel(torch.zeros(7, 2, dtype=F64), likelihood, num_data=len(x)).to(F64)
    with pytest.raises(ValueError, match="saved site is for"):
        other.load_state_dict(model.state_dict())


def test_a_model_copied_in_training_trains_on_as_the_original():
    """``copy.deepcopy`` and ``pickle`` mid-training: the copy's next steps equal the original's."""
    import pickle

    x, y = binary_data(60, seed=4)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = SEPModel(x[:8].clone(), likelihood, num_data=len(x)).to(F64)
    mll = StochasticEPMarginalLogLikelihood(likelihood, model)
    model.train()
    output = model(x[:20])
    (-mll(output, y[:20])).backward()
    model.variational_strategy.update_site(output, y[:20])
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
    results = []
    for candidate in [model, *copies]:
        objective = StochasticEPMarginalLogLikelihood(candidate.variational_strategy.likelihood, candidate)
        candidate.train()
        candidate.zero_grad()
        output = candidate(x[20:40])
        value = objective(output, y[20:40])
        value.backward()
        candidate.variational_strategy.update_site(output, y[20:40])
        results.append(
            (value.detach(), candidate.variational_strategy.site.precision, candidate.mean_module.constant.grad)
        )
    for result in results[1:]:
        for copied, original in zip(result, results[0], strict=True):
            torch.testing.assert_close(copied, original, rtol=0, atol=0)


def test_errors_name_the_fix():
    x, y = binary_data(30, seed=0)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = SEPModel(x[:5].clone(), likelihood, num_data=30).to(F64)
    mll = StochasticEPMarginalLogLikelihood(likelihood, model)
    model.train()
    with pytest.raises(ValueError, match="holds 10 points, but the targets are"):
        mll(model(x[:10]), y[:9])
    with pytest.raises(ValueError, match="likelihood must be"):
        StochasticEPMarginalLogLikelihood(gpytorch.likelihoods.BernoulliLikelihood(), model)
    with pytest.raises(TypeError, match="tilted moments"):
        SEPModel(
            x[:5].clone(), gpytorch.likelihoods.SoftmaxLikelihood(num_classes=3, mixing_weights=False), num_data=30
        )
    with pytest.raises(ValueError, match="features"):
        model(torch.zeros(3, 4, dtype=F64))
    with pytest.raises(ValueError, match="one set per latent"):
        SEPModel(torch.zeros(2, 5, 2, dtype=F64), likelihood, num_data=30)
    with pytest.raises(ValueError, match="one set per latent"):
        SEPModel(torch.zeros(2, 5, 2, dtype=F64), MultinomialProbitLikelihood(3), num_data=30)
    assert isinstance(model.variational_strategy.site, TiedSite)


def test_fit_mll_runs_the_minibatch_loop():
    x, y = binary_data(300, seed=5)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = SEPModel(x[:30].clone(), likelihood, num_data=len(x)).to(F64)
    mll = StochasticEPMarginalLogLikelihood(likelihood, model, num_data=len(x))  # the strategy's N, given again
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
    with pytest.raises(
        TypeError, match=r"learning_subset= does not apply to a StochasticEP.*MinibatchRecipe\(batch_size"
    ):
        fit_mll(mll, data=(x, y), learning_subset=100)
    with pytest.raises(TypeError, match="validation_rows= does not apply.*no outputscale phase"):
        fit_mll(mll, data=(x, y), validation_rows=torch.arange(10))
    with pytest.raises(TypeError, match="unexpected keyword argument .subsets."):
        fit_mll(mll, data=(x, y), subsets=100)


def test_fit_mll_anneals_the_learning_rate(monkeypatch):
    r"""The recipe's cosine schedule: Adam's step t of T at :math:`\alpha_0 (1 + \cos(\pi t / T)) / 2`, or by the
    fraction of ``max_time`` spent when that is further; ``"constant"`` keeps :math:`\alpha_0`."""
    x, y = binary_data(200, seed=5)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = SEPModel(x[:20].clone(), likelihood, num_data=len(x)).to(F64)
    mll = StochasticEPMarginalLogLikelihood(likelihood, model)
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
    model = SEPModel(x.clone(), likelihood, sites="points", learn_inducing_locations=False, num_data=len(x)).to(F64)
    model.requires_grad_(False)  # the steps alone: EP at fixed hyperparameters
    mll = StochasticEPMarginalLogLikelihood(likelihood, model)
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
    restored = SEPModel(x.clone(), likelihood, sites="points", learn_inducing_locations=False, num_data=40).to(F64)
    restored.load_state_dict(model.state_dict())
    restored.eval()  # (a new module is in training mode: its output would be the cavities)
    with torch.no_grad():
        torch.testing.assert_close(restored(x).mean, model(x).mean, rtol=0, atol=0)
    model.train()
    with pytest.raises(ValueError, match="all 40 training points"):
        mll(model(x[:10]), y[:10])
    with pytest.raises(ValueError, match="sites must be one of"):
        SEPModel(x.clone(), likelihood, sites="each", num_data=40)


def _resident_bytes() -> int:
    """This process's resident memory now, from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 1


def _sites_and_gradients(model, x, y, batch_size=20):
    """Six site steps on fixed batches (no optimiser: its normalised steps amplify rounding) with the gradient of the
    summed objective."""
    mll = StochasticEPMarginalLogLikelihood(model.variational_strategy.likelihood, model)
    model.train()
    total = 0
    for _ in range(2):
        for rows in torch.arange(len(x)).split(batch_size):
            output = model(x[rows])
            total = total + mll(output, y[rows])
            model.variational_strategy.update_site(output, y[rows])
    total.backward()
    model.eval()
    return [parameter.grad for parameter in model.parameters()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_steps_equal_cpu_steps(dtype):
    x, _ = binary_data(60, seed=1)
    y = _three_classes(x)
    inducing = torch.stack([x[c::5][:12] for c in range(3)])
    cpu = SEPModel(inducing, MultinomialProbitLikelihood(3), 3, num_data=len(x)).to(F64)
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


# -- GPyTorch's contract: a pure objective, an explicit site step, N the strategy's -----------------------------
def _site_tensors(strategy):
    return {name: tensor.clone() for name, tensor in strategy.site.tensors().items()}


def test_the_objective_is_a_pure_function_of_the_model():
    """A validation loss in training mode under ``torch.no_grad()``, twice, moves neither the site nor the
    predictions (it moved the tied site, and the test predictions by 0.1, when the objective took SEP's step)."""
    x, y = binary_data(120, seed=6)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = SEPModel(x[:15].clone(), likelihood, num_data=len(x)).to(F64)
    mll = _loop(model, likelihood, x, y, epochs=1, batch_size=40)
    strategy = model.variational_strategy
    site, steps = _site_tensors(strategy), strategy.site.steps
    with torch.no_grad():
        predictions = likelihood(model(x)).probs
        model.train()
        losses = [float(-mll(model(x[rows]), y[rows])) for rows in (torch.arange(40, 80), torch.arange(40, 80))]
        model.eval()
        assert losses[0] == losses[1]
        torch.testing.assert_close(likelihood(model(x)).probs, predictions, rtol=0, atol=0)
    assert strategy.site.steps == steps
    for name, tensor in _site_tensors(strategy).items():
        torch.testing.assert_close(tensor, site[name], rtol=0, atol=0)


@pytest.mark.parametrize("multiclass", [False, True])
def test_update_site_moves_the_site_as_the_cores_step_from_the_cavities_before_the_optimiser_step(multiclass):
    """The documented loop (energy, backward, Adam, then ``update_site(output, y)``) gives exactly the sites of the
    core's step (:meth:`StochasticEP.step`) from the prior before each optimiser step, as the objective's combined step
    did; with the energy's tilted moments passed (``fit_mll``'s path) the same. A constant mean (its output a view of
    its parameter, which Adam changes in place) and learnt inducing inputs both move."""
    x, y = binary_data(60, seed=1)
    likelihood = MultinomialProbitLikelihood(3) if multiclass else gpytorch.likelihoods.BernoulliLikelihood()
    y = _three_classes(x) if multiclass else y
    model = SEPModel(x[::5].clone(), likelihood, 3 if multiclass else None, num_data=len(x)).to(F64)
    twin = copy.deepcopy(model)
    strategy, core = model.variational_strategy, StochasticEP(model.variational_strategy.adapter, len(x))
    site, start = strategy.site, model.mean_module.constant.detach().clone()
    runs = []
    for candidate, with_moments in ((model, False), (twin, True)):
        mll = StochasticEPMarginalLogLikelihood(candidate.variational_strategy.likelihood, candidate)
        optimizer = torch.optim.Adam(candidate.parameters(), lr=0.05)
        candidate.train()
        for rows in torch.randperm(len(x), generator=torch.Generator().manual_seed(0)).split(15):
            optimizer.zero_grad()
            output = candidate(x[rows])
            objective, moments = mll.energy_and_moments(output, y[rows])
            (-objective).backward()
            if candidate is model:  # the core's step from the prior before the optimiser's step
                site, _ = core.step(site, strategy.whitened_batch(x[rows]), y[rows])
            optimizer.step()
            candidate.variational_strategy.update_site(output, y[rows], moments if with_moments else None)
        runs.append(_site_tensors(candidate.variational_strategy))
        assert candidate.variational_strategy.site.steps == 4  # one step per minibatch
    assert not torch.equal(model.mean_module.constant, start)  # the mean moved under the cavities' batch
    for name, tensor in site.tensors().items():
        torch.testing.assert_close(runs[0][name], tensor, rtol=0, atol=0)
        torch.testing.assert_close(runs[1][name], tensor, rtol=0, atol=0)


def test_a_training_output_carries_its_minibatch_and_others_are_refused():
    """``model(x)`` in training mode holds its batch and cavities: an earlier output is as good as the last (no
    identity check); an eval-mode output, the prior, a distribution derived from or built like the output are refused
    by the objective and by ``update_site``, naming the fix. The usual idioms still work on a training output."""
    x, y = binary_data(40, seed=2)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = SEPModel(x[:6].clone(), likelihood, num_data=len(x)).to(F64)
    mll = StochasticEPMarginalLogLikelihood(likelihood, model)
    model.train()
    first = model(x[:10])
    expected = mll(first, y[:10])
    model(x[10:20])  # another call in between
    torch.testing.assert_close(mll(first, y[:10]), expected, rtol=0, atol=0)
    assert isinstance(likelihood(first), torch.distributions.Bernoulli)  # the idiom on the cavities
    torch.testing.assert_close(first.variance, first.cavities.variance[0], rtol=0, atol=0)
    model.eval()
    evaluated = model(x[:10])
    model.train()
    rebuilt = gpytorch.distributions.MultivariateNormal(first.mean, first.lazy_covariance_matrix)
    others = [evaluated, model(x[:10], prior=True), rebuilt, first[:5]]
    for other in others:
        with pytest.raises(RuntimeError, match=r"call model.train\(\) and pass model\(x_batch\)"):
            mll(other, y[: other.mean.shape[-1]])
        with pytest.raises(RuntimeError, match=r"call model.train\(\) and pass model\(x_batch\)"):
            model.variational_strategy.update_site(other, y[: other.mean.shape[-1]])
    assert model.variational_strategy.site.steps == 0
    wider = SEPModel(x[:8].clone(), likelihood, num_data=len(x)).to(F64)
    wider.train()
    with pytest.raises(RuntimeError, match="this model's model"):
        mll(wider(x[:10]), y[:10])
    with pytest.raises(ValueError, match="holds 10 points"):
        model.variational_strategy.update_site(first, y[:12])
    model.variational_strategy.update_site(first, y[:10])
    moved = model.variational_strategy.site.steps
    with pytest.raises(RuntimeError, match="call it once per model"):  # a second step from the same cavities
        model.variational_strategy.update_site(first, y[:10])
    assert model.variational_strategy.site.steps == moved == 1
    classes = SEPModel(x[:6].clone(), MultinomialProbitLikelihood(3), 3, num_data=len(x)).to(F64)
    classes.train()
    output = classes(x[:10])  # (10, 3) cavities that carry their batch
    assert output.mean.shape == (10, 3) and output.cavities.mean.shape == (3, 10)
    assert classes.variational_strategy.likelihood(output).probs.shape[-2:] == (10, 3)  # (samples, 10, 3)


def test_num_data_belongs_to_the_strategy():
    """N is the strategy's required keyword, validated; a training output is the cavities without any objective; an
    objective's ``num_data`` is optional and must be the strategy's, which it never writes."""
    x, y = binary_data(30, seed=0)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    with pytest.raises(TypeError, match="num_data"):
        SEPModel(x[:5].clone(), likelihood)
    for bad in (0, -3, 2.5, True, None):
        with pytest.raises(ValueError, match=r"StochasticEPStrategy: num_data \(the number of training points\) must"):
            SEPModel(x[:5].clone(), likelihood, num_data=bad)
    model = SEPModel(x[:5].clone(), likelihood, num_data=30).to(F64)
    model.train()
    output = model(x[:10])  # no objective built yet
    strategy = model.variational_strategy
    cavity = strategy.site.cavity(strategy.whitened_batch(x[:10]), 30)
    torch.testing.assert_close(output.mean, cavity[0][0], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"num_data=40 differs from .*StochasticEPStrategy's num_data=30"):
        StochasticEPMarginalLogLikelihood(likelihood, model, num_data=40)
    with pytest.raises(ValueError, match="num_data must be an integer >= 1"):
        StochasticEPMarginalLogLikelihood(likelihood, model, num_data=0)
    assert StochasticEPMarginalLogLikelihood(likelihood, model, num_data=30).num_data == 30
    assert StochasticEPMarginalLogLikelihood(likelihood, model).num_data == strategy.num_data == 30


def test_per_point_sites_refuse_a_shuffled_full_batch():
    """Per-point sites need the same points in the same order at every step: a full batch of the same size but
    shuffled (which read other points' sites without an error) or of other inputs is refused, also after a
    ``state_dict`` round trip; the same inputs in a float32 copy are the same points."""
    x, y = binary_data(30, seed=3)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = SEPModel(x[::3].clone(), likelihood, sites="points", num_data=len(x)).to(F64)
    mll = StochasticEPMarginalLogLikelihood(likelihood, model)
    model.train()
    output = model(x)
    mll(output, y)
    model.variational_strategy.update_site(output, y)
    shuffled = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"same 30 training points.*shuffled.*sites='tied'"):
        model(x[shuffled])
    with pytest.raises(ValueError, match=r"same 30 training points.*sites='tied'"):
        model(x + 0.01)
    with pytest.raises(ValueError, match="all 30 training points"):
        model(x[:10])
    restored = SEPModel(x[::3].clone(), likelihood, sites="points", num_data=len(x)).to(F64)
    restored.load_state_dict(model.state_dict())
    restored.train()
    with pytest.raises(ValueError, match=r"same 30 training points.*sites='tied'"):
        restored(x[shuffled])
    output = restored(x)  # the training inputs in their order
    restored.variational_strategy.update_site(output, y)
    assert restored.variational_strategy.site.steps == 2
    single = copy.deepcopy(model).float()
    single.train()
    single.variational_strategy.update_site(single(x.float()), y.float())
