r"""The training rows :func:`~gpytorch_iterncgp.fit_mll` learns on, and those it holds out: drawn without replacement,
stratified by class for classification likelihoods (every class keeps its share of the rows)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .recipe import KERNEL_CHOICE_COST, LEARNING_SUBSET_COST

__all__ = ["auto_choice_size", "auto_subset_size", "draw_rows", "held_out_rows", "holds_out_rows"]


def auto_subset_size(num_latents: int) -> int:
    r""":math:`M = \lfloor \sqrt{10^7 / C} \rfloor` (:data:`~gpytorch_iterncgp.learning.recipe.LEARNING_SUBSET_COST`)."""
    return max(2, math.isqrt(LEARNING_SUBSET_COST // num_latents))


def auto_choice_size(num_latents: int) -> int:
    r""":math:`M_c = \lfloor \sqrt{10^6 / C} \rfloor` (:data:`~gpytorch_iterncgp.learning.recipe.KERNEL_CHOICE_COST`)."""
    return max(2, math.isqrt(KERNEL_CHOICE_COST // num_latents))


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
