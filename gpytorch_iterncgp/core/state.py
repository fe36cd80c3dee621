r"""The state of an outer loop as a module's extra state: one protocol for saving and restoring it.

Every outer loop (damped Newton, EP, EP-DTC) keeps a dataclass state that a strategy saves in its ``state_dict``
(``get_extra_state``) and restores from it (``set_extra_state``). :class:`ExtraState` is what they share:

* fields without a default are tensors (some of them derived from the others' shapes, see
  :meth:`ExtraState.expected_shapes`);
* fields with a default are Python numbers or flags, or a nested dataclass of them, whose fields are saved under
  their own names (flattened);
* :meth:`ExtraState.to_extra` gives a dict of tensors, numbers and flags (loadable with ``weights_only=True``), and
  :meth:`ExtraState.from_extra` checks such a dict and restores the state from it.

Entries added in a later version of a state (:attr:`ExtraState.optional_entries`) may be missing from a dict saved
by an earlier one; they take the field's default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeGuard, cast

import torch
from torch import Tensor

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def _has_default(field: dataclasses.Field) -> bool:
    return field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return cast(Callable[[], Any], field.default_factory)()
    return field.default


def _is_nested(value: Any) -> TypeGuard[DataclassInstance]:
    """Whether a scalar field's value is a nested dataclass (saved as its own fields)."""
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _restored_value(field: dataclasses.Field, saved: dict) -> Any:
    """The saved value of a scalar field, of its default's type; the default where an entry is missing (optional
    entries only: the required ones were checked), a nested dataclass from its fields' entries."""
    default = _default(field)
    if _is_nested(default):
        nested = {inner.name: _restored_value(inner, saved) for inner in dataclasses.fields(default)}
        return type(default)(**nested)
    return type(default)(saved.get(field.name, default))


@dataclass
class ExtraState:
    """A dataclass state that a strategy saves as its extra state (see the module docstring).

    A subclass sets :attr:`saved_by` (named in errors), declares its :attr:`optional_entries` and how its tensors'
    shapes follow from each other (:meth:`expected_shapes`).
    """

    saved_by: ClassVar[str]  # the strategy whose state_dict holds the state, named in error messages
    optional_entries: ClassVar[frozenset[str]] = frozenset()  # scalar entries that earlier versions did not save

    @classmethod
    def tensor_fields(cls) -> tuple[str, ...]:
        """The names of the tensor fields (those without a default), in field order."""
        return tuple(field.name for field in dataclasses.fields(cls) if not _has_default(field))

    @classmethod
    def scalar_entries(cls) -> tuple[str, ...]:
        """The saved names of the scalar fields, a nested dataclass's fields in its place, in field order."""
        names: list[str] = []
        for field in dataclasses.fields(cls):
            if not _has_default(field):
                continue
            default = _default(field)
            nested = dataclasses.fields(default) if _is_nested(default) else (field,)
            names.extend(inner.name for inner in nested)
        return tuple(names)

    @classmethod
    def expected_shapes(cls, saved: dict[str, Tensor]) -> dict[str, tuple[int, ...]]:
        """The shape every tensor entry of ``saved`` must have, derived from some of them (all are tensors here).

        :param saved: a dict from :meth:`to_extra` whose tensor entries are all present.
        :return: the expected shape of each tensor field, by name.
        """
        raise NotImplementedError

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor of the state, by field name (forming any that are deferred)."""
        return {name: getattr(self, name) for name in self.tensor_fields()}

    def to_extra(self) -> dict[str, Any]:
        """Tensors (cloned), numbers and flags, for a ``state_dict`` (``weights_only`` loadable); a nested dataclass
        field is saved as its own fields."""
        extra: dict[str, Any] = {name: tensor.clone() for name, tensor in self.tensors().items()}
        for field in dataclasses.fields(self):
            if not _has_default(field):
                continue
            value = getattr(self, field.name)
            extra.update(dataclasses.asdict(value) if _is_nested(value) else {field.name: value})
        return extra

    @classmethod
    def check_extra(cls, saved: dict) -> None:
        """Check a dict from :meth:`to_extra`: every tensor and required entry present, the shapes consistent.

        :raises ValueError: naming the missing or non-tensor entries, or the entries of inconsistent shapes.
        """
        required = [name for name in cls.scalar_entries() if name not in cls.optional_entries]
        missing = [name for name in cls.tensor_fields() if not torch.is_tensor(saved.get(name))]
        missing += [name for name in required if name not in saved]
        if missing:
            raise ValueError(f"{cls.saved_by} extra state is malformed: missing or non-tensor entries {missing}.")
        expected = cls.expected_shapes(saved)
        wrong = {name: tuple(saved[name].shape) for name in cls.tensor_fields() if saved[name].shape != expected[name]}
        if wrong:
            raise ValueError(f"{cls.saved_by} extra state is malformed: inconsistent shapes {wrong}.")

    @classmethod
    def from_extra(cls, saved: dict, reference: Tensor) -> Self:
        """Inverse of :meth:`to_extra`: the checked state, tensors moved to the dtype and device of ``reference``.

        :param saved: a dict from :meth:`to_extra` (possibly of an earlier version: see :attr:`optional_entries`).
        :param reference: a tensor of the dtype and device to restore to (e.g. the training inputs).
        :raises ValueError: see :meth:`check_extra`.
        """
        cls.check_extra(saved)
        values = {
            field.name: saved[field.name].to(reference) if not _has_default(field) else _restored_value(field, saved)
            for field in dataclasses.fields(cls)
        }
        return cls(**values)
