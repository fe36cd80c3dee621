"""Test-wide settings."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    """The tests' matrices are small: one thread is faster, and far faster when other processes share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
