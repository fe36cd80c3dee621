"""``core/memory.py``'s retained allocations, counted in the operating system's page faults (Linux with glibc only).

A block of 64 MiB is above glibc's largest mmap threshold: by default each allocation of it maps fresh pages and
faults every one of them in (16 384 pages of 4 KiB) when it is written. Inside ``retained_allocations`` the freed
block stays in the heap, and the next one of the same size writes the same pages with (almost) no fault. Measured in
a new process's main thread (glibc's arenas of other threads, as pytest-xdist's, map blocks past 64 MiB whatever the
thresholds), after a first block has grown the heap.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpytorch_iterncgp.core.memory import _glibc

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _glibc() is None, reason="glibc's mallopt (Linux) only"
)

PAGES = 2**23 * 8 // 4096  # a float64 block of 2**23 numbers: 64 MiB

MEASUREMENT = textwrap.dedent(
    """
    import json, resource, torch
    from gpytorch_iterncgp.core.memory import retained_allocations

    def faults():  # minor page faults while a 64 MiB block is written, after one of the same size was freed
        first = torch.ones(2**23, dtype=torch.float64)
        del first
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        second = torch.ones(2**23, dtype=torch.float64)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    default = [faults() for _ in range(4)]  # glibc's own thresholds, before any retained block
    with retained_allocations():
        with retained_allocations():  # nested: as one
            faults()  # the heap grows to hold the block
            retained = [faults() for _ in range(4)]
    print(json.dumps({"default": default, "retained": retained}))
    """
)


def _steady_faults() -> dict[str, list[int]]:
    """The page faults of four second blocks in a new process, first with glibc's own thresholds (``"default"``),
    then inside ``retained_allocations`` (``"retained"``)."""
    result = subprocess.run(
        [sys.executable, "-c", MEASUREMENT],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_freed_large_block_is_reused_inside():
    """Inside (nested blocks): each second block faults in under a tenth of its pages; before, with glibc's own
    behaviour, at least half of them."""
    faults = _steady_faults()
    assert max(faults["retained"]) < PAGES // 10, faults
    assert min(faults["default"]) > PAGES // 2, faults
