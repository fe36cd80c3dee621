r"""Argument checks shared by every layer: one rule, one message, each naming the argument and the fix."""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor


def _refuse_bool(value, name: str) -> None:
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a number, got {value!r}.")


#: the default of a renamed parameter's old name (scikit-learn's deprecation idiom): not given
DEPRECATED = "deprecated"


def is_string(value: Any, text: str) -> bool:
    """Whether an argument is the string ``text`` (``"auto"``, :data:`DEPRECATED`), whatever else it may be: an
    array's or a tensor's ``==`` would compare elementwise."""
    return isinstance(value, str) and value == text


def renamed(owner: str, old: str, new: str, old_value: Any, new_value: Any, new_default: Any, stacklevel: int) -> Any:
    """The value of a parameter renamed from ``old`` to ``new``: ``new_value``, or ``old_value`` with a
    ``FutureWarning`` where the old name was given (it is not :data:`DEPRECATED`). It keeps working for one release.

    :param owner: the function or class, for the messages.
    :param new_default: the new name's default: the old name is refused beside a new name given another value.
    :param stacklevel: of the warning, counted from this function (2: its caller's caller).
    :raises ValueError: where both names are given.
    """
    if is_string(old_value, DEPRECATED):
        return new_value
    if not (new_value is new_default or (isinstance(new_value, (str, int, float)) and new_value == new_default)):
        raise ValueError(f"{owner}: {old}= is the deprecated name of {new}=; give {new}= alone.")
    warnings.warn(
        f"{owner}: {old}= is deprecated and will be removed in a future release; it is now {new}=.",
        FutureWarning,
        stacklevel=stacklevel,
    )
    return old_value


def check_count(value, name: str, minimum: int = 0, allow_none: bool = False) -> None:
    """An integer ``>= minimum`` (``None`` too, if ``allow_none``); ``True``/``False`` are not counts.

    :raises ValueError: naming ``name``, the bound and the value.
    """
    if value is None and allow_none:
        return
    _refuse_bool(value, name)
    if not isinstance(value, numbers.Integral) or value < minimum:
        bound = "a non-negative integer" if minimum == 0 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {bound}{' or None' if allow_none else ''}, got {value!r}.")


def check_nonnegative(value, name: str, positive: bool = False) -> None:
    """A finite real number ``>= 0`` (``> 0`` if ``positive``).

    :raises ValueError: naming ``name`` and the value.
    """
    _refuse_bool(value, name)
    ok = isinstance(value, numbers.Real) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        kind = "a positive" if positive else "a non-negative"
        raise ValueError(f"{name} must be {kind} finite number, got {value!r}.")


def check_flag(value, name: str) -> None:
    """``True`` or ``False``.

    :raises TypeError: naming ``name`` and the value.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}.")


def check_seed(value) -> None:
    """An integer seed.

    :raises TypeError: for anything else (``True`` included).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"seed must be an integer, got {value!r}.")


def check_inputs(inputs: Tensor, name: str, device: torch.device | None = None) -> Tensor:
    """Validate inputs ``(N, D)`` or ``(N,)`` and return them as ``(N, D)``.

    :param device: the device they must be on (checked before any value is read).
    :raises TypeError: not a tensor, or not floating point (integer inputs).
    :raises ValueError: wrong shape, no points or no features, NaN/inf, or on another device than ``device``.
    """
    if not torch.is_tensor(inputs):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(inputs).__name__}.")
    if not inputs.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (float32 or float64), got dtype {inputs.dtype}.")
    if inputs.dim() == 1:
        inputs = inputs.unsqueeze(-1)
    if inputs.dim() != 2:
        raise ValueError(f"{name} must have shape (N, D) or (N,), got {tuple(inputs.shape)}.")
    if inputs.shape[0] == 0:
        raise ValueError(f"{name} is empty (shape {tuple(inputs.shape)}): at least one point is needed.")
    if inputs.shape[1] == 0:
        raise ValueError(f"{name} has no features (shape {tuple(inputs.shape)}): D must be at least 1.")
    if device is not None and inputs.device != device:
        raise ValueError(f"{name} are on {inputs.device} but the model's training data on {device}.")
    if not bool(torch.isfinite(inputs).all()):
        raise ValueError(f"{name} contains NaN or inf.")
    return inputs
