"""Test-wide settings."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    """The tests' matrices are small: one thread is faster, and far faster when other processes share the cores
    (pytest-xdist workers, or other jobs: spinning threads of one process then stall the others). Torch's and the
    BLAS libraries numpy and scikit-learn call into (threadpoolctl, a scikit-learn dependency)."""
    from threadpoolctl import threadpool_limits

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with threadpool_limits(limits=1):
        yield
    torch.set_num_threads(threads)
