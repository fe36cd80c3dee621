"""core/threads.py: the loops' small operations on one thread, large ones and everything after on the caller's."""

from __future__ import annotations

import pytest
import torch

from gpytorch_iterncgp.core.threads import PARALLEL_WORK, large_operation, small_operations


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_small_operations_run_on_one_thread_and_restore(two_threads):
    with small_operations():
        assert torch.get_num_threads() == 1
        with small_operations():  # nested: as the outermost
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
        with large_operation(PARALLEL_WORK):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with large_operation(PARALLEL_WORK - 1):
            assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_the_callers_threads_are_back_after_an_exception(two_threads):
    with pytest.raises(KeyboardInterrupt), small_operations():
        raise KeyboardInterrupt
    assert torch.get_num_threads() == 2
    with large_operation(10 * PARALLEL_WORK):  # outside small_operations: nothing changes
        assert torch.get_num_threads() == 2


def test_a_fit_runs_its_steps_on_one_thread_and_leaves_the_callers(two_threads, monkeypatch):
    import gpytorch

    from gpytorch_iterncgp import EPStrategy
    from gpytorch_iterncgp.ep import sweeps
    from tests.common import IterNCGPModel, binary_data

    seen = []
    update_sites = sweeps.update_sites

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return update_sites(*args, **kwargs)

    monkeypatch.setattr(sweeps, "update_sites", recording)
    x, y = binary_data(40, seed=0)
    model = IterNCGPModel(x, y, gpytorch.likelihoods.BernoulliLikelihood(), strategy_class=EPStrategy)
    model.variational_strategy.fit(show_progress=False)
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == 2
