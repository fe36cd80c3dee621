"""The committed state of an outer-loop strategy in ``state_dict`` and across devices."""

from __future__ import annotations

from typing import Any

import gpytorch
from torch import Tensor

from ..core.state import CommittedState, data_fingerprint


class SavedCommittedState(gpytorch.Module):
    """A mixin of :class:`~gpytorch_iterncgp.strategies.base.OuterLoopStrategy`: its committed state (a
    :class:`~gpytorch_iterncgp.core.state.CommittedState`) saved by ``state_dict()`` as the module's extra state,
    restored by ``load_state_dict()`` for the same training data, and moved with the module by ``.to()``,
    ``.double()`` and the like."""

    # the strategy's: its committed state and training data (their sizes num_data and num_latents)
    _committed: CommittedState
    train_inputs: Tensor
    train_targets: Tensor

    def _state_to_save(self) -> Any:
        """The committed state (not ``None``) as :meth:`get_extra_state` saves it; itself here."""
        return self._committed.state

    def get_extra_state(self) -> dict:
        """The committed state for ``state_dict()``: tensors, numbers and strings only (``weights_only`` loadable).

        Holds the state of the last completed step (also when saved inside a ``fit`` callback), the fingerprint of
        the hyperparameters it belongs to, the companion's position, and a hash of the training data
        (:meth:`CommittedState.to_extra <gpytorch_iterncgp.core.state.CommittedState.to_extra>`).
        """
        saved = None if self._committed.state is None else self._state_to_save()
        return self._committed.to_extra(data_fingerprint(self.train_inputs, self.train_targets), saved)

    def set_extra_state(self, extra: dict) -> None:
        """Restore :meth:`get_extra_state`.

        A state saved for other training data (another size, or a different hash) is discarded with a
        ``UserWarning``: the hyperparameters still load, and the next ``fit()`` or prediction starts from the
        prior instead of predicting with weights fitted to other data.

        :raises ValueError: if the saved state is malformed (missing entries, shapes that disagree).
        """
        data = data_fingerprint(self.train_inputs, self.train_targets)
        self._committed.load_extra(
            extra, self.train_inputs, self.num_data * self.num_latents, data, type(self).__name__
        )

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._committed.apply(fn)
        return self
