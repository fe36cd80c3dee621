r"""Learning on minibatches: :func:`~gpytorch_iterncgp.fit_mll`'s recipe for a model with a
:class:`~gpytorch_iterncgp.StochasticEPStrategy`, SVGP's loop (Adam on random minibatches, ``num_data`` the
training set's size) run for the caller: the kernel, the mean and the inducing inputs follow SEP's energy, and after
each optimiser step the tied site moves on the batch
(:meth:`~gpytorch_iterncgp.StochasticEPStrategy.update_site`, :mod:`~gpytorch_iterncgp.sparse.stochastic`)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..core.threads import small_operations
from ..core.validation import check_count, check_inputs, check_nonnegative
from ..mlls.stochastic import StochasticEPMarginalLogLikelihood
from .recipe import LearningReport, LearningStop
from .scale import LogScale, trainable_parameters


@dataclass(frozen=True)
class MinibatchRecipe:
    r"""How :func:`~gpytorch_iterncgp.fit_mll` learns a stochastic-EP model.

    :param batch_size: points per minibatch (all of them, in their order, for smaller data: the full-batch steps of
        :class:`~gpytorch_iterncgp.StochasticEPStrategy`'s per-point sites).
    :param learning_rate: Adam's learning rate, on the logarithms of positive hyperparameters
        (:class:`~.scale.LogScale`) and on the inducing inputs.
    :param max_steps: minibatch steps at most (``max_time`` may stop it earlier); each visits ``batch_size`` points
        without replacement within a pass over the data.
    :param schedule: ``"cosine"``: the learning rate :math:`\alpha_0\,\tfrac12(1 + \cos\pi p)` at progress
        :math:`p`, the larger of the fractions of ``max_steps`` and of ``max_time`` spent (cosine annealing, Loshchilov &
        Hutter 2017), so that the inducing inputs and the kernel come to rest and the tied site settles on them;
        ``"constant"``: :math:`\alpha_0` throughout.
    """

    batch_size: int = 512
    learning_rate: float = 0.01
    max_steps: int = 2000
    schedule: str = "cosine"

    #: the ``schedule`` choices
    SCHEDULES = ("cosine", "constant")

    def validate(self) -> None:
        """:raises ValueError: naming the field that is out of range."""
        check_count(self.batch_size, "batch_size", minimum=1)
        check_count(self.max_steps, "max_steps", minimum=1)
        check_nonnegative(self.learning_rate, "learning_rate", positive=True)
        if self.schedule not in self.SCHEDULES:
            raise ValueError(f"MinibatchRecipe: schedule must be one of {self.SCHEDULES}, got {self.schedule!r}.")

    def rate_factor(self, step: int, elapsed: float, max_time: float | None) -> float:
        """The learning rate's factor after ``step`` steps and ``elapsed`` seconds of ``max_time`` (``schedule``)."""
        if self.schedule == "constant":
            return 1.0
        progress = step / self.max_steps
        if max_time is not None and max_time > 0:
            progress = max(progress, elapsed / max_time)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def fit_minibatches(
    mll: StochasticEPMarginalLogLikelihood,
    inputs: Tensor,
    targets: Tensor,
    recipe: MinibatchRecipe,
    deadline: float | None,
    generator: torch.Generator,
    show: bool,
) -> LearningReport:
    r"""Adam on SEP's energy over random minibatches of ``(inputs, targets)`` for ``recipe.max_steps`` steps or until the
    ``deadline`` (``time.perf_counter()``), each followed by the site's step on the batch from the cavities the energy
    was computed at (:meth:`~gpytorch_iterncgp.StochasticEPStrategy.update_site`, given the energy's tilted moments);
    the model is left in eval mode. Without trainable parameters the steps only move the tied site.

    :param inputs: ``(N, D)``, ``N`` the ``num_data`` of ``mll``; ``targets``: ``(N,)``.
    :return: the report: ``losses`` the negative objective of every step, ``stopped``
        :attr:`~.recipe.LearningStop.MAX_STEPS` or :attr:`~.recipe.LearningStop.MAX_TIME`.
    :raises ValueError: for data whose size is not ``mll.num_data``.
    """
    model = mll.model
    strategy = model.variational_strategy
    inputs = check_inputs(inputs, "train_inputs", device=strategy.inducing_points.device)
    if len(inputs) != mll.num_data or len(targets) != mll.num_data:
        raise ValueError(
            f"fit_mll: the data has {len(inputs)} inputs and {len(targets)} targets, but the objective's num_data is "
            f"{mll.num_data}."
        )
    modules = [model, mll.likelihood]
    parameters = trainable_parameters(modules)
    scale = LogScale(modules, parameters)
    start = time.perf_counter()
    max_time = None if deadline is None else deadline - start
    schedule = (  # Adam and its learning rate (recipe.schedule); None: nothing to learn
        torch.optim.lr_scheduler.LambdaLR(
            torch.optim.Adam(scale.variables, lr=recipe.learning_rate),
            lambda step: recipe.rate_factor(step, time.perf_counter() - start, max_time),
        )
        if parameters
        else None
    )
    batch_size = min(recipe.batch_size, len(inputs))
    report = LearningReport(method="Adam", evidence="SEP", data_points=len(inputs), num_data=len(inputs))
    description = f"learning: Adam on SEP's energy, batches of {batch_size} of {len(inputs)} points"
    bar = tqdm(total=recipe.max_steps, desc=description, disable=not show)
    report.stopped = LearningStop.MAX_STEPS

    model.train()
    try:
        for step, rows in enumerate(_batches(len(inputs), batch_size, recipe.max_steps, generator)):
            if step == recipe.max_steps:
                break
            if deadline is not None and report.losses and time.perf_counter() >= deadline:
                report.stopped = LearningStop.MAX_TIME
                break
            with small_operations():  # one thread a step: a busy machine's other process costs little
                objective = _step(mll, scale, schedule, inputs[rows], targets[rows])
            report.losses.append(-float(objective.detach()))
            bar.update(1)
            bar.set_postfix(loss=f"{report.losses[-1]:.4g}")
    finally:
        bar.close()
        scale.push()
        model.eval()
    report.evaluations, report.seconds = len(report.losses), time.perf_counter() - start
    return report


def _batches(num_rows: int, batch_size: int, max_steps: int, generator: torch.Generator) -> Iterator[Tensor]:
    """The rows of each step's batch: all of them in the data's order where a batch holds them all (as per-point sites
    need), else random permutations of the ``num_rows`` rows split into batches, enough for ``max_steps``."""
    if batch_size == num_rows:
        yield from (torch.arange(num_rows) for _ in range(max_steps))
        return
    for _ in range(math.ceil(max_steps * batch_size / num_rows)):
        yield from torch.randperm(num_rows, generator=generator).split(batch_size)


def _step(
    mll: StochasticEPMarginalLogLikelihood,
    scale: LogScale,
    schedule: torch.optim.lr_scheduler.LambdaLR | None,
    inputs: Tensor,
    targets: Tensor,
) -> Tensor:
    """One step on the batch ``(inputs, targets)``: SEP's energy and its tilted moments at the batch, Adam's step on
    the energy (``schedule``'s optimiser and learning rate; ``None``: nothing to learn), and the site's step from the
    cavities the energy was computed at. Returns the energy."""
    model = mll.model
    if schedule is None:
        with torch.no_grad():
            output = model(inputs)
            objective, moments = mll.energy_and_moments(output, targets)
    else:
        scale.push()
        schedule.optimizer.zero_grad()
        output = model(inputs)
        objective, moments = mll.energy_and_moments(output, targets)
        (-objective).backward()
        scale.pull_gradients()
        schedule.optimizer.step()
        schedule.step()
    model.variational_strategy.update_site(output, targets, moments)  # from the cavities before Adam's step
    return objective
