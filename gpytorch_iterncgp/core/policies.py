r"""Policies: how IterGP chooses its next action :math:`\mathbf s_j`.

A policy maps the current residual :math:`\mathbf r_{j-1} = \mathbf b - \hat{\mathbf K} \mathbf v_{j-1}`
(shape ``(N C,)``, data-major) to an action of the same shape. The solver normalises the action,
projects it (softmax: onto :math:`\operatorname{range}(\mathbf W)`) and makes it
:math:`\hat{\mathbf K}`-conjugate to the previous ones.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .validation import check_seed


class Policy:
    """Base class. Subclasses implement :meth:`__call__`; stateful ones also :meth:`reset`."""

    #: whether the actions depend on the residual (then the solver's preconditioner is built and applied to it first)
    uses_residual = True

    def prepare(
        self,
        num_data: int,
        num_latents: int,
        zero_sum_actions: bool,
        observed: Tensor | None = None,
        rows: tuple[int, int] | None = None,
    ) -> None:
        """Called by the solver before use with the problem's size.

        :param num_data: :math:`N`.
        :param num_latents: :math:`C`.
        :param zero_sum_actions: whether actions are projected to zero sum over the classes of each
            point (softmax), so that only :math:`C - 1` independent directions exist per point.
        :param observed: data-major ``(N C,)`` mask of the latent coordinates with a likelihood factor (actions
            are zero elsewhere: missing outputs); ``None``: all.
        :param rows: the data-major rows ``[start, stop)`` of the residuals and actions this process holds where the
            solver's vectors are held by rows (``ShardedKernel(..., shard_state=True)``: the policy is called with
            them and returns them); ``None``: all rows. Passed only where not ``None``.
        """

    def reset(self) -> None:
        """Forget the actions taken so far (called when the solver drops its action buffer)."""

    def __call__(self, residual: Tensor) -> Tensor:
        r"""The next action for ``residual`` ``(N C,)``: :math:`\mathbf M^{-1} \mathbf r` where the solver has a
        preconditioner :math:`\mathbf M \approx \hat{\mathbf K}` (:mod:`~gpytorch_iterncgp.core.preconditioner`), the
        residual :math:`\mathbf r` itself otherwise."""
        raise NotImplementedError

    def next_actions(self, count: int, residual: Tensor) -> Tensor | None:
        """The next ``count`` actions at once, as columns ``(N C, count)`` (those ``count`` calls would return, the
        policy advanced past them), for a policy whose actions do not depend on the residual (:attr:`uses_residual`
        false): the solver then takes them as one block (:func:`~gpytorch_iterncgp.core.solver.itergp_solve`).
        ``None`` (the default): one action per call.

        :param residual: the current residual ``(N C,)`` (its rows, dtype and device).
        """
        return None

    def state(self) -> dict:
        """What a saved model needs to continue the same sequence of actions."""
        return {}

    def load_state(self, state: dict) -> None:
        """Inverse of :meth:`state`."""


class ConjugateGradientPolicy(Policy):
    r"""CG: the action is the (preconditioned) residual, :math:`\mathbf s_j = \mathbf M^{-1} \mathbf r_{j-1}`.

    With :math:`\hat{\mathbf K}`-conjugation this is the method of (preconditioned) conjugate gradients; its posterior
    mean after :math:`j` iterations is the PCG iterate.
    """

    def __call__(self, residual: Tensor) -> Tensor:
        return residual


class UnitVectorPolicy(Policy):
    r"""Unit vectors :math:`\mathbf s_j = \mathbf e_{k_j}`: a subset of the data (partial Cholesky).

    Visits data points in a fixed order (a seeded random permutation, or ``order``), and for each
    point its latent coordinates ``n * C + c`` one after the other (all but the last when the actions
    have zero sum over classes, whose last coordinate is then redundant; none of a missing output). After all
    coordinates it starts over; with recycling and compression the dropped directions are thereby revisited.

    The random order depends only on ``seed`` and :math:`N` (a CPU ``torch.Generator``, independent of the
    global random state and of the device), so it is reproducible.

    :param order: distinct data point indices in the order to visit them (default: random with ``seed``);
        a subset of the data is allowed.
    :param seed: seed of the random order, an integer.
    :raises TypeError: for a non-integer ``seed`` or ``order`` (fractional indices are not truncated).
    :raises ValueError: for an ``order`` that is not 1-D, is empty or repeats an index (a repeated unit vector
        lies in the span of the earlier ones and breaks the solver down).
    """

    uses_residual = False

    def __init__(self, order: Tensor | None = None, seed: int = 0):
        check_seed(seed)
        if order is not None:
            order = torch.as_tensor(order)
            if order.numel() == 0:
                raise ValueError("UnitVectorPolicy: order must be a non-empty 1-D list, got an empty one.")
            if order.is_floating_point() or order.is_complex() or order.dtype == torch.bool:
                raise TypeError(f"UnitVectorPolicy: order must hold integer data indices, got dtype {order.dtype}.")
            order = order.to(torch.long)
            if order.dim() != 1 or len(order) == 0:
                raise ValueError(
                    f"UnitVectorPolicy: order must be a non-empty 1-D list, got shape {tuple(order.shape)}."
                )
            if len(order.unique()) != len(order):
                raise ValueError("UnitVectorPolicy: order repeats a data index; every index may appear once.")
        self.order = order
        self.seed = int(seed)
        self.position = 0
        self._coordinates: Tensor | None = None
        self._first_row = 0  # the data-major index of the first row of the residuals it is called with

    def prepare(
        self,
        num_data: int,
        num_latents: int,
        zero_sum_actions: bool,
        observed: Tensor | None = None,
        rows: tuple[int, int] | None = None,
    ) -> None:
        self._first_row = 0 if rows is None else rows[0]
        if self.order is None:
            generator = torch.Generator().manual_seed(self.seed)
            order = torch.randperm(num_data, generator=generator)
        else:
            order = self.order
            if order.min() < 0 or order.max() >= num_data:
                raise ValueError(
                    f"UnitVectorPolicy: order must hold data indices in [0, {num_data}); found "
                    f"{order[(order < 0) | (order >= num_data)][:5].tolist()}."
                )
        latents_used = num_latents - 1 if (zero_sum_actions and num_latents > 1) else num_latents
        coordinates = (order[:, None] * num_latents + torch.arange(latents_used)).flatten()
        self._coordinates = coordinates if observed is None else coordinates[observed.cpu()[coordinates]]

    def reset(self) -> None:
        self.position = 0

    def __call__(self, residual: Tensor) -> Tensor:
        if self._coordinates is None:
            raise RuntimeError("UnitVectorPolicy.prepare must be called before use.")
        coordinate = self._coordinates[self.position % len(self._coordinates)] - self._first_row
        self.position += 1
        action = torch.zeros_like(residual)
        if 0 <= int(coordinate) < len(residual):  # (held by rows: only the rank holding it)
            action[coordinate] = 1.0
        return action

    def next_actions(self, count: int, residual: Tensor) -> Tensor | None:
        if self._coordinates is None:
            raise RuntimeError("UnitVectorPolicy.prepare must be called before use.")
        steps = torch.arange(self.position, self.position + count)
        coordinates = self._coordinates[steps % len(self._coordinates)] - self._first_row
        self.position += count
        held = (coordinates >= 0) & (coordinates < len(residual))  # (held by rows: only the rank holding it)
        actions = residual.new_zeros(len(residual), count)
        columns = torch.arange(count)[held]
        actions[coordinates[held].to(residual.device), columns.to(residual.device)] = 1.0
        return actions

    def state(self) -> dict:
        return {"position": self.position}

    def load_state(self, state: dict) -> None:
        position = state.get("position", 0)
        self.position = int(position.item() if torch.is_tensor(position) else position)


POLICIES = {"cg": ConjugateGradientPolicy, "unit": UnitVectorPolicy}


def make_policy(policy: str | Policy, seed: int = 0) -> Policy:
    """A policy from its name (``"cg"`` or ``"unit"``, any case) or a :class:`Policy` instance.

    :raises ValueError: for an unknown name. :raises TypeError: for anything else, or a non-integer ``seed``.
    """
    check_seed(seed)
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and policy.lower() in POLICIES:
        return UnitVectorPolicy(seed=seed) if policy.lower() == "unit" else ConjugateGradientPolicy()
    if isinstance(policy, str):
        raise ValueError(f"Unknown policy {policy!r}: use 'cg', 'unit' or a gpytorch_iterncgp.Policy instance.")
    raise TypeError(f"policy must be 'cg', 'unit' or a gpytorch_iterncgp.Policy instance, got {type(policy).__name__}.")
