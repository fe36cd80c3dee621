"""``core/memory.py``'s retained allocations, counted in the operating system's page faults (Linux with glibc only).

A block of 64 MiB is above glibc's largest mmap threshold: by default each allocation of it maps fresh pages and
faults every one of them in (16 384 pages of 4 KiB) when it is written. Inside ``retained_allocations`` the freed
block stays in the heap, and the next one of the same size writes the same pages with (almost) no fault.
"""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from gpytorch_iterncgp import settings
from gpytorch_iterncgp.core.memory import _glibc, retained_allocations

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _glibc() is None, reason="glibc's mallopt (Linux) only"
)

NUMBERS = 2**23  # float64: 64 MiB
PAGES = NUMBERS * 8 // 4096


def _faults_of_a_second_block() -> int:
    """Minor page faults while a 64 MiB block is written, after one of the same size was written and freed."""
    first = torch.ones(NUMBERS, dtype=torch.float64)
    del first
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    second = torch.ones(NUMBERS, dtype=torch.float64)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del second
    return faults


def test_a_freed_large_block_is_reused_inside_and_returned_outside():
    """Inside (nested too): the second block faults in under a tenth of its pages; after the outermost block and
    with the setting off, glibc's own behaviour: it faults in at least half of them."""
    with retained_allocations():
        with retained_allocations():
            inner = _faults_of_a_second_block()
        after_inner = _faults_of_a_second_block()  # still inside the outer block
    outside = _faults_of_a_second_block()
    with settings.retain_allocations(False), retained_allocations():
        switched_off = _faults_of_a_second_block()
    assert inner < PAGES // 10 and after_inner < PAGES // 10
    assert outside > PAGES // 2 and switched_off > PAGES // 2
