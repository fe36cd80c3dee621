r"""The training rows :func:`~gpytorch_iterncgp.fit_mll` learns on, and those it holds out: drawn without replacement,
stratified by class for classification likelihoods (every class keeps its share of the rows)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .thresholds import KERNEL_CHOICE_COST, LEARNING_SUBSET_COST

__all__ = [
    "auto_choice_size",
    "auto_learning_size",
    "auto_subset_size",
    "draw_rows",
    "held_out_rows",
    "holds_out_rows",
]


def auto_subset_size(num_latents: int) -> int:
    r""":math:`M = \lfloor \sqrt{10^7 / C} \rfloor` (:data:`~gpytorch_iterncgp.learning.thresholds.LEARNING_SUBSET_COST`)."""
    return max(2, math.isqrt(LEARNING_SUBSET_COST // num_latents))


def auto_choice_size(num_latents: int) -> int:
    r""":math:`M_c = \lfloor \sqrt{10^6 / C} \rfloor` (:data:`~gpytorch_iterncgp.learning.thresholds.KERNEL_CHOICE_COST`)."""
    return max(2, math.isqrt(KERNEL_CHOICE_COST // num_latents))


def auto_learning_size(num_data: int, num_latents: int, minimum: int, held_out_fraction: float) -> int | None:
    r"""The learning rows of ``learning_subset="auto"`` out of ``num_data`` (``None``: all of them, nothing held out).

    :math:`M = \lfloor \sqrt{10^7 / C} \rfloor` (:func:`auto_subset_size`) where that leaves at least ``minimum``
    rows out; otherwise, where ``held_out_fraction`` of the rows (rounded up) is at least ``minimum``, all the others:
    rows are held out even where the data would fit in the learning subset, so that the outputscale is chosen, and the
    learnt hyperparameters checked against a constant predictor, on rows the evidence did not see (a lengthscale that
    interpolates the learning rows is not kept unseen). Smaller data: :math:`M` rows where :math:`M < N`, else all.

    :param num_data: :math:`N`; ``num_latents``: :math:`C`.
    :param minimum: the fewest held-out rows a choice is made on (``LearningRecipe.min_validation_points``).
    :param held_out_fraction: ``LearningRecipe.held_out_fraction``.
    """
    size = auto_subset_size(num_latents)
    if holds_out_rows(num_data, size, minimum):
        return size
    held_out = math.ceil(held_out_fraction * num_data)
    if held_out >= max(minimum, 1) and num_data - held_out >= 2:
        return num_data - held_out
    return size if size < num_data else None


def holds_out_rows(num_data: int, learning_size: int | None, minimum: int) -> bool:
    """Whether learning on ``learning_size`` of ``num_data`` rows (``None``: all) leaves rows to validate on: at least
    ``minimum`` (and one) outside the learning rows, as :func:`held_out_rows` asks."""
    return learning_size is not None and num_data - min(learning_size, num_data) >= max(minimum, 1)


def draw_rows(candidates: Tensor, size: int, labels: Tensor | None, generator: torch.Generator) -> Tensor:
    """``size`` of the ``candidates`` (row indices ``(n,)``), sorted; stratified by ``labels`` ``(n,)`` (each class
    gets its share, rounded by largest remainders) unless ``None``.

    :raises ValueError: for ``size`` larger than the candidates.
    """
    if size > len(candidates):
        raise ValueError(f"cannot draw {size} rows out of {len(candidates)}.")
    if labels is None:
        chosen = candidates[torch.randperm(len(candidates), generator=generator)[:size]]
        return chosen.sort().values
    classes, counts = labels.unique(return_counts=True)
    quota = counts.double() * size / len(candidates)
    take = quota.floor().long()
    remainder_order = (quota - take).argsort(descending=True, stable=True)
    take[remainder_order[: size - int(take.sum())]] += 1
    parts = []
    for label, number in zip(classes, take.tolist(), strict=True):
        members = candidates[labels == label]
        parts.append(members[torch.randperm(len(members), generator=generator)[:number]])
    return torch.cat(parts).sort().values


def held_out_rows(
    num_data: int, learning_rows: Tensor, labels: Tensor | None, minimum: int, generator: torch.Generator
) -> Tensor | None:
    """Rows outside ``learning_rows`` to validate on: as many as the learning rows (or all the others), stratified by
    ``labels`` ``(num_data,)``; ``None`` where fewer than ``minimum`` are left."""
    outside = torch.ones(num_data, dtype=torch.bool)
    outside[learning_rows] = False
    rest = outside.nonzero()[:, 0]
    if not holds_out_rows(num_data, len(learning_rows), minimum):
        return None
    if len(rest) <= len(learning_rows):
        return rest
    return draw_rows(rest, len(learning_rows), None if labels is None else labels[rest], generator)
