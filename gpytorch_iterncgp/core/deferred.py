r"""Tensor fields formed when first read: :class:`DeferredTensor` and :func:`deferred`.

The solver's results and states carry matrices that cost more to form than the step that defines them and that most
readers never need: :math:`\mathbf Q` and :math:`\mathbf K \mathbf Q` of a Newton step's state (:math:`O(N C B r)`
each), and the coefficients :math:`\mathbf E = \mathbf L^{-\top}` of a root given by its Cholesky factor
(:math:`O(B^3)`, where the solver needs only :math:`\mathbf E \mathbf E^\top \mathbf x`, two triangular solves).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor


class DeferredTensor:
    r"""A data descriptor for a tensor field that may be given as a function computing it: the function runs on first
    read, and its result replaces it. Installed on :class:`~gpytorch_iterncgp.core.solver.RegressionState` for
    :math:`\mathbf Q` and :math:`\mathbf K \mathbf Q`, and on :class:`~gpytorch_iterncgp.core.recycling.ImplicitRoot`
    for :math:`\mathbf E`; pass a function with :func:`deferred`.

    The Newton loop leaves :math:`\mathbf Q` and :math:`\mathbf K \mathbf Q` of each step's state unformed
    (:math:`O(N C B r)` each, more than the step's products with :math:`\mathbf K` on a cached kernel once the buffer
    holds a few hundred actions): only a callback or a prediction during the fit reads them, and the final state gets
    its own from :meth:`~gpytorch_iterncgp.laplace.newton.DampedNewton.finalize`.
    """

    def __init__(self, name: str):
        self.name, self.slot = name, f"_deferred_{name}"

    def __get__(self, instance: object | None, owner: type) -> Tensor:
        if instance is None:
            raise AttributeError(self.name)  # a required field: no class-level default
        value = instance.__dict__[self.slot]
        if not torch.is_tensor(value):
            value = instance.__dict__[self.slot] = value()
        return value

    def __set__(self, instance: object, value: Tensor | Callable[[], Tensor]) -> None:
        instance.__dict__[self.slot] = value

    def is_formed(self, instance: object) -> bool:
        """Whether ``instance``'s field holds its tensor (read, or given as one) rather than the function."""
        return torch.is_tensor(instance.__dict__[self.slot])

    def stored(self, instance: object) -> Tensor:
        """``instance``'s field as stored, its tensor or the function forming it (:func:`deferred`), without forming
        it: to pass it on to another instance's field."""
        return cast(Tensor, instance.__dict__[self.slot])


def deferred(compute: Callable[[], Tensor]) -> Tensor:
    """``compute`` as the value of a :class:`DeferredTensor` field (typed as the tensor it will give when read)."""
    return cast(Tensor, compute)
