r"""The outputscale by held-out rows, after the kernel was learnt on a subset (cross-validation of one
hyperparameter, R&W sec. 5.3), for classifiers and count models.

At the outputscale :math:`s^2` Laplace's evidence learns on thousands of points, EP's posterior is over-confident
(``docs/design_notes.md``) and Laplace's own predictive poor (the softmax's Laplace approximation;
``docs/design_notes.md``, "The held-out outputscale for Laplace too"), and EP's own estimated evidence is biased towards large outputscales by the
computation-aware cavities; on overdispersed counts the Poisson evidence learns a function rough enough to predict
new rows worse than their mean. The held-out score (:func:`~.scores.held_out_score`: log-loss, mean Poisson deviance)
measures what the model is used for. As :math:`s^2 \to 0` a model tends to its prior mean (a count model's, with its
log rate's constant mean moved to keep the prior mean rate, to the constant predictor of that rate), so the smallest
factors compare the learnt model with predicting no structure at all.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import gpytorch
import torch
from torch import Tensor

from .recipe import RECOVERABLE_ERRORS, LearningRecipe, LearningReport
from .scores import held_out_score

__all__ = ["choose_outputscale"]


class FactorLadder:
    """The outputscale factors a walk may visit: ``factors`` sorted, extended past an edge by doubling the largest or
    halving the smallest factor, at most ``extensions`` times in all; a ``start`` outside them extends them as the walk
    would have (each such step counted among the extensions)."""

    def __init__(self, factors: Sequence[float], extensions: int, start: float):
        self.grid, self.extensions = sorted(set(factors)), extensions
        while start > self.grid[-1] and self.extensions:
            self.grid.append(self.grid[-1] * 2)
            self.extensions -= 1
        while start < self.grid[0] and self.extensions:
            self.grid.insert(0, self.grid[0] / 2)
            self.extensions -= 1
        if start not in self.grid:
            self.grid = sorted([*self.grid, start])

    def neighbour(self, factor: float, downwards: bool) -> float | None:
        """The next factor below (above) ``factor``, extending the ladder where extensions are left; ``None`` past its
        end."""
        index = self.grid.index(factor) + (-1 if downwards else 1)
        if 0 <= index < len(self.grid):
            return self.grid[index]
        if not self.extensions:
            return None
        self.extensions -= 1
        self.grid.insert(max(index, 0), factor / 2 if downwards else factor * 2)
        return self.grid[max(index, 0)]


def _walk(ladder: FactorLadder, start: float, better: Callable[[float, float], bool], upwards_first: bool) -> None:
    r"""From ``start``, one way along ``ladder`` while the next factor is ``better`` than the best so far; where the first
    step is no better, the other way (``upwards_first``: upwards first).

    On a score unimodal in :math:`\log s^2` (as measured on the tabular panel and the small sets) it finds the ladder's
    minimum in two fits more than its distance from the start instead of a fit at every factor, whatever the start; a
    start near the minimum (the factor a kernel choice found on fewer rows) saves the fits in between."""
    best = start
    for downwards in (not upwards_first, upwards_first):
        origin = best
        step = ladder.neighbour(best, downwards)
        while step is not None and better(step, best):
            best = step
            step = ladder.neighbour(best, downwards)
        if best != origin:
            break


def choose_outputscale(
    kernel: gpytorch.kernels.ScaleKernel,
    build: Callable[[], gpytorch.models.ApproximateGP],
    validation_x: Tensor,
    validation_y: Tensor,
    recipe: LearningRecipe,
    report: LearningReport,
    deadline: float | None,
    tick: Callable[[], None],
    start: float | None = None,
    upwards_first: bool = True,
    log_rate_mean: gpytorch.means.ConstantMean | None = None,
) -> None:
    r"""Set ``kernel``'s outputscale :math:`s^2` to the learnt one times the factor with the smallest held-out score
    (:func:`~.scores.held_out_score`: log-loss or mean Poisson deviance) at the held-out rows ``validation_x``
    ``(V, D)``, ``validation_y`` ``(V,)``, found by a walk on the ladder of ``recipe.outputscale_factors`` (sorted;
    past its edges, the edge factor doubled or halved, at most ``recipe.outputscale_extensions`` times in all); the
    lengthscales stay.

    The walk starts at ``start`` (default: the grid's first factor, 1: the learnt outputscale), tries the next larger
    factor and goes on upwards while the score falls; where the first larger one is no better it tries the smaller ones
    the same way (``upwards_first=False``: downwards first). EP's final fit walks upwards first (at the outputscale
    Laplace's evidence learns, EP's held-out optimum lay above it on every split of the tabular panel), Laplace's
    downwards (its own predictive's optimum lies below; ``docs/design_notes.md``); a start outside the grid extends it
    (:class:`FactorLadder`), and the walk's cost is :func:`_walk`'s. Each candidate gets a cold fit of
    ``recipe.outputscale_fit_steps`` EP sweeps or Newton steps (``build()``: a new model of the final approximation on
    the learning rows sharing ``kernel``) and is scored at the held-out rows; a failed fit counts as no better. No
    candidate starts after ``deadline`` (``time.perf_counter()`` seconds); where every fit fails the factor is 1 (the
    learnt outputscale). Fills ``report``'s outputscale fields; ``tick()`` after each candidate (the progress bar).

    ``log_rate_mean``: a count model's constant prior mean :math:`m` of a log rate (exp link), shifted with each factor
    :math:`a` to :math:`m + (1 - a) s^2 / 2`, so that the prior mean rate :math:`\mathbb E[e^f] = e^{m + s^2/2}` stays
    the learnt one: the candidates then run from the learnt model (:math:`a = 1`) towards the constant predictor of that
    rate (:math:`a \to 0`) instead of towards a lower one (without the shift, a smaller :math:`s^2` lowers every
    prediction by :math:`e^{-(1 - a) s^2 / 2}`).
    """
    learnt = kernel.outputscale.detach().clone()
    learnt_mean = None if log_rate_mean is None else log_rate_mean.constant.detach().clone()
    began = time.perf_counter()

    def set_factor(factor: float) -> None:
        """The outputscale (and ``log_rate_mean``) at ``factor``."""
        with torch.no_grad():
            kernel.outputscale = learnt * factor
            if log_rate_mean is not None and learnt_mean is not None:
                log_rate_mean.constant.copy_(learnt_mean + (1 - factor) * learnt / 2)

    def score(factor: float) -> None:
        """The held-out score at ``factor`` (in ``report.outputscale_scores``; nothing where the fit fails)."""
        set_factor(factor)
        try:
            value = held_out_score(build(), validation_x, validation_y, recipe.outputscale_fit_steps)  # a cold fit
        except RECOVERABLE_ERRORS:
            return
        finally:
            tick()
        if math.isfinite(value):
            report.outputscale_scores[factor] = value

    def out_of_time() -> bool:
        return deadline is not None and time.perf_counter() >= deadline

    def better(factor: float, than: float) -> bool:
        """Scores ``factor`` (where time is left): whether its log-loss is below ``than``'s."""
        if out_of_time():
            return False
        score(factor)
        losses = report.outputscale_scores
        return factor in losses and (than not in losses or losses[factor] < losses[than])

    best = recipe.outputscale_factors[0] if start is None else start
    if not out_of_time():
        score(best)
    _walk(FactorLadder(recipe.outputscale_factors, recipe.outputscale_extensions, best), best, better, upwards_first)
    losses = report.outputscale_scores
    report.outputscale_factor = min(losses, key=losses.__getitem__) if losses else 1.0
    set_factor(report.outputscale_factor)
    report.validation_points = len(validation_x)
    report.outputscale_seconds = time.perf_counter() - began
