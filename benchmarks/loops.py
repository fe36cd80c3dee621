"""The training loops the benchmarks time for a budget of wall time: GPyTorch's minibatch loop (the SVGP baseline,
stochastic EP) and the plain loop on a whole-data evidence."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from benchmarks.data import Data
from benchmarks.scoring import Clock, log_loss
from gpytorch_iterncgp import MinibatchRecipe


def minibatch_steps(
    model,
    objective,
    optimizer,
    train_x: Tensor,
    targets: Tensor,
    budget: float,
    generator: torch.Generator,
    clock,
    evaluate: Callable[[int, int, Tensor | None], object],
    batch_size: int = 1024,
    evaluations: int = 10,
    schedule: str = "constant",
    update_site=None,
) -> tuple[int, int]:
    r"""Adam (``optimizer``) on ``-objective(model(x_b), y_b)`` over random batches, epoch after epoch, until
    ``clock.elapsed()`` reaches ``budget`` seconds; the optimiser steps and whole epochs done.

    ``evaluate(steps, epochs, loss)`` runs after the first step, after the first step each time ``budget /
    evaluations`` seconds have passed since the last evaluation, and at the end (``loss`` ``None``); the clock decides
    what it counts. ``schedule="cosine"`` anneals the learning rate by the fraction of the budget spent, by
    ``fit_mll``'s own rule with ``max_time`` the budget (:meth:`~gpytorch_iterncgp.MinibatchRecipe.rate_factor`,
    through ``torch.optim.lr_scheduler.LambdaLR``). ``update_site``: stochastic EP's site step, ``update_site(output,
    y_b, moments)`` after each optimiser step (:meth:`~gpytorch_iterncgp.StochasticEPStrategy.update_site`), given the
    tilted moments the objective's quadrature computed (``objective.energy_and_moments``), so that a step computes them
    once; ``None`` for SVGP.
    """
    steps, epochs, next_evaluation = 0, 0, 0.0
    recipe = MinibatchRecipe(schedule=schedule)
    annealing = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: recipe.rate_factor(0, clock.elapsed(), budget))
    model.train()
    while clock.elapsed() < budget:
        for batch in torch.randperm(len(targets), generator=generator).split(batch_size):
            optimizer.zero_grad()
            output = model(train_x[batch])
            if update_site is None:
                loss, moments = -objective(output, targets[batch]), None
            else:
                energy, moments = objective.energy_and_moments(output, targets[batch])
                loss = -energy
            loss.backward()
            optimizer.step()
            annealing.step()
            if update_site is not None:
                update_site(output, targets[batch], moments)
            steps += 1
            if clock.elapsed() >= next_evaluation:
                evaluate(steps, epochs, loss)
                next_evaluation = clock.elapsed() + budget / evaluations
            if clock.elapsed() >= budget:
                break
        else:
            epochs += 1
    evaluate(steps, epochs, None)
    return steps, epochs


def minibatch_loop(
    model,
    objective,
    optimizer,
    data: Data,
    targets: Tensor,
    budget: float,
    generator: torch.Generator,
    probabilities: Callable[[], Tensor],
    schedule: str = "constant",
    update_site=None,
    score: Callable[[Tensor, Tensor], dict[str, float]] = log_loss,
) -> list[dict]:
    """:func:`minibatch_steps` in batches of 1024 for ``budget`` seconds of its own work (a :class:`Clock`),
    ``probabilities()`` (the predicted means for counts) scored by ``score`` against the test labels ten times along
    the way and at the end: the history."""
    clock, history = Clock(), []

    def evaluate(steps: int, epochs: int, loss: Tensor | None) -> None:
        clock.evaluate(history, probabilities, data.test_y, score, adam_steps=steps)

    minibatch_steps(
        model,
        objective,
        optimizer,
        data.train_x,
        targets,
        budget,
        generator,
        clock,
        evaluate,
        schedule=schedule,
        update_site=update_site,
    )
    return history


def _evidence_steps(model, mll, learning_rate: float) -> Iterator[int]:
    """Adam on the negative evidence ``-mll(model(train_x), train_y)`` of the model's training data; yields the step
    count after each step, as long as the caller asks."""
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    model.train()
    step = 0
    while True:
        optimizer.zero_grad()
        loss = -mll(model(model.variational_strategy.train_inputs), model.variational_strategy.train_targets)
        loss.backward()
        optimizer.step()
        step += 1
        yield step


def evidence_loop(
    model, mll, learning_rate: float, budget: float, clock: Clock, probabilities: Callable[[], Tensor], labels: Tensor
) -> list[dict]:
    """The plain GPyTorch loop, Adam on the whole-data evidence, until ``clock`` (started by the caller) passes
    ``budget`` seconds; ``probabilities()`` scored against ``labels`` after the first step, ten times along the way
    and after the last step: the history."""
    history: list[dict] = []
    next_evaluation = 0.0
    for step in _evidence_steps(model, mll, learning_rate):
        if clock.elapsed() >= next_evaluation or clock.elapsed() >= budget:
            clock.evaluate(history, probabilities, labels, optimizer_steps=step)
            next_evaluation = clock.elapsed() + budget / 10
        if clock.elapsed() >= budget:
            break
    return history
