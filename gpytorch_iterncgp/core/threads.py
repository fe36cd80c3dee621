r"""Threads for the outer loops: their many small operations on one thread, the products with K on the caller's.

An outer loop (a Newton step, an EP sweep) runs hundreds of small tensor operations per step beside a few products
with the kernel matrix. Each operation that PyTorch runs on several threads is an OpenMP parallel region whose threads
wait for each other at its end; on a machine where another process keeps the cores busy, a waiting thread spins
while the one it waits for is descheduled, and the loop slows down by an order of magnitude
(``benchmarks/busy_machine.py``). :func:`small_operations` runs a block on one intra-op thread and puts the
caller's count back afterwards; inside it, :func:`large_operation` gives an operation of at least
:data:`PARALLEL_WORK` multiply-adds (a product with K) the caller's threads back. ``torch.set_num_threads`` is global
to the process: the caller's setting holds again when the block ends, also after an exception.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

__all__ = ["PARALLEL_WORK", "large_operation", "small_operations"]

#: the work (multiply-adds) from which an operation inside :func:`small_operations` runs on the caller's threads
PARALLEL_WORK = 10**7

_caller_threads: ContextVar[int | None] = ContextVar("caller_threads", default=None)


@contextlib.contextmanager
def small_operations() -> Iterator[None]:
    """Run the block on one intra-op thread (nested blocks: as the outermost)."""
    threads = torch.get_num_threads()
    if threads == 1 or _caller_threads.get() is not None:
        yield
        return
    token = _caller_threads.set(threads)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _caller_threads.reset(token)


@contextlib.contextmanager
def large_operation(work: int) -> Iterator[None]:
    """Inside :func:`small_operations`, run an operation of ``work`` multiply-adds on the caller's threads if
    ``work >= PARALLEL_WORK``; elsewhere nothing changes."""
    threads = _caller_threads.get()
    if threads is None or work < PARALLEL_WORK:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(1)
