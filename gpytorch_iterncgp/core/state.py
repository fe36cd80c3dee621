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

:class:`CommittedState` is the one component that holds such a state for a model: the state of the last completed
step, the *fingerprint* of the parameters it was fitted at (:func:`parameter_fingerprint`), the position of a stateful
companion (a policy) at that step; it commits, rewinds, tells whether the state is current, and saves and loads all
of it as one extra-state dict (as GPyTorch's ``_VariationalStrategy`` keeps its variational distribution in a
module of its own).
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self, TypeGuard, cast

import torch
from torch import Tensor

#: the version of the extra-state dict this package writes (:meth:`CommittedState.to_extra`); a newer one is refused
#: on load, an older one (or none: the first versions) is read with its optional entries missing
STATE_VERSION = 2

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

    def num_latent_values(self) -> int:
        """The number of latent values the state belongs to (:math:`N C`): the length of its first tensor field."""
        return getattr(self, self.tensor_fields()[0]).shape[0]

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


def data_fingerprint(*tensors: Tensor) -> str:
    """A hash of the training data (rounded to float32, so a float32 copy of float64 data matches).

    :param tensors: the training data, e.g. the inputs ``(N, D)`` and the targets ``(N,)`` or ``(N, P)``.
    :return: the SHA-256 hex digest of the tensors' shapes and values.
    """
    digest = hashlib.sha256()
    for tensor in tensors:
        values = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
        digest.update(str(tuple(values.shape)).encode())
        digest.update(values.numpy().tobytes())
    return digest.hexdigest()


def parameter_fingerprint(tensors: Iterable[Tensor], like: Tensor) -> Tensor:
    """The values a fitted state depends on, detached and flattened into one vector.

    :param tensors: the parameters (and any other tensors the fit depends on), of any shapes.
    :param like: the dtype and device of the fingerprint.
    :return: a copy of all their entries, ``(sum of their sizes,)`` (empty without tensors).
    """
    parts = [tensor.detach().reshape(-1).to(like) for tensor in tensors]
    if not parts:
        return like.new_zeros(0)
    return torch.cat(parts).clone()


def fingerprint_matches(fingerprint: Tensor, committed: Tensor | None) -> bool:
    """Whether ``fingerprint`` equals the ``committed`` one exactly (``None``: nothing committed).

    :param fingerprint: the current parameters' :func:`parameter_fingerprint`.
    :param committed: that of the parameters the committed state was fitted at.
    """
    if committed is None:
        return False
    return fingerprint.shape == committed.shape and bool(torch.equal(fingerprint, committed))


class Companion(Protocol):
    """What moves with the state and is committed beside it (a :class:`~gpytorch_iterncgp.core.policies.Policy`)."""

    def state(self) -> dict:  # pragma: no cover - a protocol
        """Its position, a dict of numbers."""
        ...

    def load_state(self, state: dict) -> None:  # pragma: no cover - a protocol
        """Inverse of :meth:`state`."""
        ...


class CommittedState:
    r"""The committed state of an outer loop, the fingerprint of the parameters it belongs to, and the position of a
    companion at that commit (module docstring).

    A model commits after every completed step (:meth:`commit`), puts the companion back after an interrupted fit
    (:meth:`rewind`), asks whether the state belongs to the current parameters (:meth:`is_current`), and saves and
    restores all of it as one extra-state dict (:meth:`to_extra`, :meth:`load_extra`)::

        {"version": STATE_VERSION, "state": state.to_extra() or None, "fingerprint": Tensor or None,
         "policy": companion position (only with a companion), "data": data_fingerprint(inputs, targets)}

    :param state_type: the :class:`ExtraState` subclass of the states.
    :param companion: an object whose position belongs to the state (``state()``, ``load_state(dict)``: a policy),
        or ``None``.
    """

    def __init__(self, state_type: type[ExtraState], companion: Companion | None = None):
        self.state_type, self.companion = state_type, companion
        self.state: Any = None  # of state_type, or None before the first commit
        self.fingerprint: Tensor | None = None  # the parameters the state belongs to
        self.companion_state: dict = {} if companion is None else companion.state()

    def is_current(self, fingerprint: Tensor) -> bool:
        """Whether a state is committed and belongs to the parameters of ``fingerprint``."""
        return self.state is not None and fingerprint_matches(fingerprint, self.fingerprint)

    def commit(self, state: Any, fingerprint: Tensor | None) -> None:
        """Make ``state`` the committed state, for the parameters of ``fingerprint`` (``None``: for none), and keep the
        companion's position."""
        self.state, self.fingerprint = state, fingerprint
        if self.companion is not None:
            self.companion_state = self.companion.state()

    def rewind(self) -> None:
        """Put the companion back to its position at the last commit (after an interrupted fit)."""
        if self.companion is not None:
            self.companion.load_state(self.companion_state)

    def reset(self, extra: Mapping) -> None:
        """Nothing committed; the companion at the position saved in ``extra`` (``{}``: its start)."""
        self.state, self.fingerprint = None, None
        self._load_companion(extra)

    def _load_companion(self, extra: Mapping) -> None:
        if self.companion is not None:
            self.companion.load_state(extra.get("policy", {}))
            self.companion_state = self.companion.state()

    def to_extra(self, data: str, saved_state: Any = None) -> dict:
        """The committed state as an extra-state dict (module docstring): tensors, numbers and strings only.

        :param data: the :func:`data_fingerprint` of the training data.
        :param saved_state: the state as saved (e.g. with all rows gathered); default the committed one.
        """
        state = self.state if saved_state is None else saved_state
        extra: dict[str, Any] = {
            "version": STATE_VERSION,
            "state": None if state is None else state.to_extra(),
            "fingerprint": self.fingerprint,
        }
        if self.companion is not None:
            extra["policy"] = dict(self.companion_state)
        extra["data"] = data
        return extra

    def load_extra(self, extra: Any, reference: Tensor, expected_size: int, data: str, saved_by: str) -> None:
        """Restore :meth:`to_extra`. A state of other training data (another number of latent values, or another
        :func:`data_fingerprint`) is discarded with a ``UserWarning``: nothing is committed then.

        :param reference: a tensor of the dtype and device to restore to (e.g. the training inputs).
        :param expected_size: the number of latent values of this model's data (:meth:`ExtraState.num_latent_values`).
        :param data: the :func:`data_fingerprint` of this model's data.
        :param saved_by: named in errors and warnings.
        :raises ValueError: if the dict is malformed (missing entries, shapes that disagree).
        """
        if not isinstance(extra, dict):
            raise ValueError(f"{saved_by} extra state must be a dict, got {type(extra).__name__}.")
        version = extra.get("version", 1)  # (the first versions wrote none)
        if not isinstance(version, int) or version > STATE_VERSION:
            raise ValueError(
                f"{saved_by} extra state has version {version!r}, newer than this package reads ({STATE_VERSION}): "
                "load it with the version of gpytorch_iterncgp that saved it, or refit."
            )
        saved = extra.get("state")
        if saved is None:
            self.reset(extra)
            return
        if not isinstance(saved, dict):
            raise ValueError(
                f"{saved_by} extra state is malformed: its state must be a dict, got {type(saved).__name__}."
            )
        state = self.state_type.from_extra(saved, reference)
        size = state.num_latent_values()
        saved_data = extra.get("data")
        if size != expected_size or (saved_data is not None and saved_data != data):
            warnings.warn(
                f"The saved {saved_by} solver state belongs to other training data ({size} latent values, this model "
                f"has {expected_size}, or different values): it is discarded, and the next fit() or prediction "
                "starts from the prior.",
                UserWarning,
                stacklevel=3,
            )
            self.reset({})
            return
        fingerprint = extra.get("fingerprint")
        self.state = state
        self.fingerprint = None if fingerprint is None else fingerprint.to(reference)
        self._load_companion(extra)

    def apply(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Apply ``fn`` (a module's ``_apply``: a device or dtype move) to every tensor held."""
        if self.state is not None:
            converted = {name: fn(tensor) for name, tensor in self.state.tensors().items()}
            self.state = dataclasses.replace(self.state, **converted)
        if self.fingerprint is not None:
            self.fingerprint = fn(self.fingerprint)
