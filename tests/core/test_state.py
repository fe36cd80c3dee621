"""The outer loops' states as extra state: the saved keys, the checks of a saved dict, and the entries that earlier
versions did not save."""

from __future__ import annotations

import math

import pytest
import torch

from gpytorch_iterncgp.core.outer_loop import relative_max_change, relative_norm_change
from gpytorch_iterncgp.core.sharding import RowBlock
from gpytorch_iterncgp.core.state import CommittedState, data_fingerprint
from gpytorch_iterncgp.ep.sweeps import EPState
from gpytorch_iterncgp.laplace.newton import LaplaceState, NewtonControl
from gpytorch_iterncgp.sparse.dtc import SparseEPState

REGRESSION_KEYS = [
    "representer_weights",
    "kernel_representer_weights",
    "precision_root",
    "kernel_precision_root",
    "actions",
    "kernel_actions",
]


def _laplace_state() -> LaplaceState:
    state = LaplaceState.initial(4, torch.float64, torch.device("cpu"))
    tensors = {name: torch.randn_like(tensor) for name, tensor in state.tensors().items()}
    return LaplaceState(**tensors, log_posterior=-3.5, newton_steps=2, control=NewtonControl(0.01, True))


def _sparse_state() -> SparseEPState:
    sizes = dict(
        site_precision=(5,),
        site_natural_mean=(5,),
        posterior_cholesky=(3, 3),
        whitened_mean=(3,),
        marginal_mean=(5,),
        marginal_variance=(5,),
    )
    tensors = {name: torch.randn(shape, dtype=torch.float64) for name, shape in sizes.items()}
    return SparseEPState(**tensors, sweeps=3, solved=False)


def test_saved_keys_are_the_fields_with_a_nested_dataclass_flattened():
    extra = _laplace_state().to_extra()
    assert list(extra) == [*REGRESSION_KEYS, "log_posterior", "newton_steps", "forcing", "same_system", "gemm_columns"]
    assert (extra["forcing"], extra["same_system"]) == (0.01, True)
    ep = EPState.initial(6, torch.float64, torch.device("cpu"), num_latents=3).to_extra()
    assert list(ep) == [*REGRESSION_KEYS, "site_precision", "site_natural_mean", "sweeps", "solved", "gemm_columns"]
    assert ep["site_precision"].shape == (2, 3, 3)
    assert list(_sparse_state().to_extra())[-2:] == ["sweeps", "solved"]


@pytest.mark.parametrize("make", [_laplace_state, _sparse_state], ids=["laplace", "sparse-ep"])
def test_from_extra_restores_the_state_on_the_reference_dtype(make):
    state = make()
    extra = state.to_extra()
    restored = type(state).from_extra(extra, torch.zeros(1, dtype=torch.float32))
    for name, tensor in state.tensors().items():
        assert restored.tensors()[name].dtype == torch.float32
        assert torch.equal(restored.tensors()[name], tensor.float()), name
    assert restored.to_extra().keys() == extra.keys()
    assert {name: value for name, value in restored.to_extra().items() if not torch.is_tensor(value)} == {
        name: value for name, value in extra.items() if not torch.is_tensor(value)
    }


def test_entries_that_earlier_versions_did_not_save_take_their_defaults():
    extra = _laplace_state().to_extra()
    del extra["forcing"], extra["same_system"], extra["gemm_columns"]
    restored = LaplaceState.from_extra(extra, extra["actions"])
    assert restored.control == NewtonControl() and restored.gemm_columns == 0
    sparse = _sparse_state().to_extra()
    del sparse["solved"]
    assert SparseEPState.from_extra(sparse, sparse["whitened_mean"]).solved is True


def test_malformed_saved_states_name_their_entries():
    extra = _laplace_state().to_extra()
    with pytest.raises(ValueError, match=r"IterNCGPStrategy extra state is malformed: .* \['newton_steps'\]"):
        LaplaceState.from_extra({k: v for k, v in extra.items() if k != "newton_steps"}, extra["actions"])
    sparse = _sparse_state().to_extra()
    sparse["posterior_cholesky"] = sparse["posterior_cholesky"][:2]
    with pytest.raises(ValueError, match=r"SparseEPStrategy extra state is malformed: inconsistent shapes .*cholesky"):
        SparseEPState.from_extra(sparse, sparse["whitened_mean"])
    ep = EPState.initial(6, torch.float64, torch.device("cpu"), num_latents=3).to_extra()
    ep["site_precision"] = ep["site_precision"][:1]
    with pytest.raises(ValueError, match=r"EPStrategy extra state is malformed: inconsistent shapes .*site_precision"):
        EPState.from_extra(ep, ep["actions"])


def test_relative_changes_use_their_own_metrics():
    old, new = torch.tensor([3.0, 4.0]), torch.tensor([3.0, 2.0])
    assert relative_norm_change(new, old, RowBlock.single(len(new))) == pytest.approx(2 / 5)
    assert relative_max_change(new, old) == pytest.approx(2 / 3)
    zero = torch.zeros(2)
    assert (
        relative_norm_change(zero, zero, RowBlock.single(len(zero))) == 0.0
        and relative_norm_change(new, zero, RowBlock.single(len(new))) == math.inf
    )
    assert relative_max_change(zero, zero) == 0.0 and relative_max_change(zero, new) == math.inf


class _Counter:
    """A companion with a position (as the unit-vector policy)."""

    def __init__(self):
        self.position = 0

    def state(self) -> dict:
        return {"position": self.position}

    def load_state(self, state: dict) -> None:
        self.position = state.get("position", 0)


def test_committed_state_commits_rewinds_saves_and_loads():
    companion = _Counter()
    committed = CommittedState(SparseEPState, companion)
    fingerprint = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert not committed.is_current(fingerprint)
    state = _sparse_state()
    companion.position = 3
    committed.commit(state, fingerprint)
    assert committed.is_current(fingerprint.clone()) and not committed.is_current(fingerprint + 1)
    companion.position = 7  # an interrupted step moved it on
    committed.rewind()
    assert companion.position == 3
    data = data_fingerprint(torch.zeros(5, 1), torch.ones(5))
    extra = committed.to_extra(data)
    assert list(extra) == ["version", "state", "fingerprint", "policy", "data"] and extra["policy"] == {"position": 3}
    restored = CommittedState(SparseEPState, _Counter())
    restored.load_extra(extra, torch.zeros(1, dtype=torch.float32), 5, data, "test")
    assert restored.is_current(fingerprint.float()) and restored.companion.position == 3
    assert restored.state.site_precision.dtype == torch.float32
    with pytest.warns(UserWarning, match="belongs to other training data"):
        restored.load_extra(extra, torch.zeros(1), 5, data_fingerprint(torch.ones(5, 1), torch.ones(5)), "test")
    assert restored.state is None and restored.companion.position == 0
    assert "policy" not in CommittedState(SparseEPState).to_extra(data)
