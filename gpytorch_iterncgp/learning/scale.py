r"""The variables :func:`~gpytorch_iterncgp.fit_mll` optimises: each positive hyperparameter on the log scale,
whatever constraint the model gives it.

GPyTorch's ``Positive`` and ``GreaterThan(b)`` constraints map a raw parameter :math:`r` to :math:`v = b + T(r)` with
:math:`T` softplus by default; an Adam step of a fixed size in :math:`r` is then a step of that size in :math:`v` once
:math:`v` is large, so an outputscale of hundreds takes hundreds of steps. On :math:`\phi = \log(v - b)` the same step
is a fixed *relative* change, whatever :math:`T` is (the estimators' default kernel parametrises by :math:`T = \exp`,
where :math:`\phi = r`). Parameters without such a constraint (means, mixing weights, ``Interval`` bounds) are
optimised as they are.
"""

from __future__ import annotations

from collections.abc import Iterable

import gpytorch
import torch
from torch import Tensor

__all__ = ["LogScale", "trainable_parameters"]


def trainable_parameters(modules: Iterable[gpytorch.Module]) -> list[Tensor]:
    """Every parameter of ``modules`` with ``requires_grad``, each once (the model's and its likelihood's, as GPyTorch's
    loop takes ``mll.parameters()``; a likelihood that is the model's submodule is not counted twice)."""
    return list({id(p): p for module in modules for p in module.parameters() if p.requires_grad}.values())


class LogScale:
    r"""Optimisation variables for ``parameters`` of ``modules``: :math:`\phi = \log(v - b)` for a parameter under a
    ``GreaterThan(b)`` constraint (``Positive``: :math:`b = 0`), the parameter itself otherwise.

    :meth:`push` writes the variables into the parameters (before an evaluation); :meth:`pull_gradients` turns the
    parameters' gradients into the variables' by the chain rule,
    :math:`\partial L / \partial \phi = \partial L / \partial r \cdot (v - b) / T'(r)`.

    :param modules: the modules that hold them (their ``named_parameters_and_constraints``): the model, and its
        likelihood where that is not the model's submodule.
    :param parameters: the parameters to optimise (those with ``requires_grad``).
    """

    def __init__(self, modules: Iterable[gpytorch.Module], parameters: Iterable[Tensor]):
        parameters = list(parameters)
        wanted = {id(parameter) for parameter in parameters}
        self.entries: list[tuple[Tensor, object, Tensor]] = []  # (raw parameter, constraint or None, variable)
        seen: set[int] = set()
        named = (entry for module in modules for entry in module.named_parameters_and_constraints())
        for _, raw, constraint in named:
            if id(raw) not in wanted or id(raw) in seen:
                continue
            seen.add(id(raw))
            positive = isinstance(constraint, gpytorch.constraints.GreaterThan) and constraint.enforced
            if not positive or _is_exp(constraint):
                self.entries.append((raw, None, raw))  # optimised as it is (exp: already the log scale)
                continue
            with torch.no_grad():
                excess = constraint.transform(raw) - constraint.lower_bound.to(raw)
                variable = excess.clamp_min(torch.finfo(raw.dtype).tiny).log().requires_grad_(True)
            self.entries.append((raw, constraint, variable))
        for raw in parameters:  # parameters outside named_parameters_and_constraints (none in GPyTorch modules)
            if id(raw) not in seen:
                seen.add(id(raw))
                self.entries.append((raw, None, raw))

    @property
    def variables(self) -> list[Tensor]:
        """What the optimiser updates, one per parameter."""
        return [variable for _, _, variable in self.entries]

    def push(self) -> None:
        r"""Set every log-scaled parameter from its variable: :math:`r = T^{-1}(b + e^\phi)`."""
        with torch.no_grad():
            for raw, constraint, variable in self.entries:
                if constraint is not None:
                    value = constraint.lower_bound.to(raw) + variable.exp()  # type: ignore[attr-defined]
                    raw.copy_(constraint.inverse_transform(value))  # type: ignore[attr-defined]

    def pull_gradients(self) -> None:
        """The variables' gradients from the parameters' (after ``backward``)."""
        for raw, constraint, variable in self.entries:
            if constraint is None or raw.grad is None:
                continue
            point = raw.detach().clone().requires_grad_(True)
            with torch.enable_grad():
                (slope,) = torch.autograd.grad(constraint.transform(point).sum(), point)  # type: ignore[attr-defined]
            excess = variable.detach().exp()
            variable.grad = raw.grad * excess / slope.clamp_min(torch.finfo(slope.dtype).tiny)
            raw.grad = None  # the next backward starts afresh (the optimiser zeroes the variables only)


def _is_exp(constraint: object) -> bool:
    """Whether the constraint's transform is ``exp`` with lower bound 0 (the raw parameter is then the log scale)."""
    transform = getattr(constraint, "_transform", None)
    lower = getattr(constraint, "lower_bound", None)
    return transform is torch.exp and lower is not None and bool((lower == 0).all())
