r"""The SVGP baseline every benchmark compares with: GPyTorch's ``VariationalStrategy`` with learnt inducing inputs, a
Cholesky variational distribution and independent latents, trained by Adam on the ELBO in minibatches
(:func:`benchmarks.loops.minibatch_steps`); for counts with the Poisson likelihood of the exponential link."""

from __future__ import annotations

import gpytorch
import torch
from torch import Tensor

from benchmarks.data import Data
from benchmarks.loops import minibatch_loop
from benchmarks.models import BenchmarkGP, classification_likelihood, inducing_starts, latent_shape, training_targets
from benchmarks.scoring import log_loss, poisson_deviance
from gpytorch_iterncgp import ExpPoissonLikelihood


class SVGPModel(BenchmarkGP):
    """GPyTorch's SVGP: U / C learnt inducing inputs per class started at training inputs (:func:`inducing_starts`,
    ``disjoint_starts`` its ``disjoint``), a Cholesky variational distribution, independent latents (one latent for
    binary data); the prior of :class:`~benchmarks.models.BenchmarkGP`, or ``mean_module`` and ``covar_module``."""

    def __init__(
        self,
        data: Data,
        num_inducing: int,
        generator: torch.Generator,
        mean_module=None,
        covar_module=None,
        disjoint_starts: bool = False,
    ):
        batch = latent_shape(data)
        latents = batch.numel()
        starts = inducing_starts(data, num_inducing, latents, generator, disjoint_starts)
        per_latent = starts.shape[-2]
        inducing = starts.reshape(*batch, per_latent, -1)
        distribution = gpytorch.variational.CholeskyVariationalDistribution(per_latent, batch_shape=batch)
        strategy = gpytorch.variational.VariationalStrategy(self, inducing, distribution, learn_inducing_locations=True)
        if latents > 1:
            strategy = gpytorch.variational.IndependentMultitaskVariationalStrategy(strategy, num_tasks=latents)
        super().__init__(strategy, data, mean_module, covar_module)


def svgp_marginals(model: SVGPModel, inputs: Tensor, batch_size: int = 4096) -> tuple[Tensor, Tensor]:
    """The latent means and variances at ``inputs``, in batches of ``batch_size``."""
    means, variances = [], []
    for batch in inputs.split(batch_size):
        output = model(batch)
        means.append(output.mean)
        variances.append(output.variance)
    return torch.cat(means), torch.cat(variances)


def svgp_probabilities(model: SVGPModel, inputs: Tensor, num_classes: int, samples: int = 512) -> Tensor:
    r"""SVGP's predictive: :math:`\Phi(\mu / \sqrt{1 + \sigma^2})` for binary data, else
    :math:`\mathbb E[\operatorname{softmax}(\mathbf f)]` under independent marginals by Monte Carlo (fixed samples)."""
    model.eval()
    output = model(inputs)
    mean, variance = output.mean, output.variance
    model.train()
    if num_classes == 2:
        return torch.special.ndtr(mean / (1 + variance).sqrt())
    base = torch.randn(samples, 1, num_classes, generator=torch.Generator().manual_seed(0), dtype=mean.dtype)
    base = base.to(mean.device)
    return torch.softmax(mean + variance.sqrt() * base, dim=-1).mean(0)


def svgp_expected_counts(model: SVGPModel, inputs: Tensor) -> Tensor:
    r"""SVGP's predicted mean count under the exponential link, :math:`e^{\mu + \sigma^2 / 2}` (the log-normal's
    mean)."""
    model.eval()
    output = model(inputs)
    model.train()
    return (output.mean + output.variance / 2).exp()


def run_svgp(
    data: Data, num_inducing: int, learning_rate: float, budget: float, seed: int, schedule: str = "constant"
) -> dict:
    """SVGP with learnt kernel and inducing inputs, Adam on the ELBO in mini-batches of 1024, ``budget`` seconds
    (``schedule``: :func:`benchmarks.loops.minibatch_steps`), scored by :func:`svgp_probabilities`; for counts
    (``data.num_classes == 0``) the Poisson likelihood of the exponential link, its constant mean started at the log
    of the mean training count, scored by the mean Poisson deviance of :func:`svgp_expected_counts`."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = SVGPModel(data, num_inducing, generator)
    counts = data.num_classes == 0
    likelihood = (ExpPoissonLikelihood() if counts else classification_likelihood(data.num_classes)).to(data.train_x)
    targets = training_targets(data)
    if counts:
        model.mean_module.constant = targets.mean().clamp_min(1e-3).log()
    objective = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=len(targets))
    optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=learning_rate)

    def predictions() -> Tensor:
        if counts:
            return svgp_expected_counts(model, data.test_x)
        return svgp_probabilities(model, data.test_x, data.num_classes)

    score = poisson_deviance if counts else log_loss
    history = minibatch_loop(
        model, objective, optimizer, data, targets, budget, generator, predictions, schedule, score=score
    )
    suffix = "" if schedule == "constant" else f" {schedule}"
    return {"label": f"SVGP U={num_inducing} lr {learning_rate}{suffix}", "history": history}
