"""Peak memory, as the fits report it: on CUDA the largest allocation of tensors since :func:`start_peak_memory`, on a
CPU the process's peak resident memory since it started (the operating system's count: it cannot be restarted
without touching state the rest of the process may rely on); and :func:`retained_allocations`, the C library's
large blocks kept in the process while the package computes."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import resource
import sys
from collections.abc import Iterator

import torch

from .. import settings

#: glibc's ``mallopt`` parameters (``malloc.h``)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: within :func:`retained_allocations`: blocks up to this many bytes come from the heap, and the heap keeps this much
#: free memory at its top
_RETAINED_BYTES = 2**30
#: after it: where glibc's own dynamic thresholds settle once large blocks have been freed (``DEFAULT_MMAP_THRESHOLD_MAX``
#: on 64-bit, and twice that for trimming)
_SETTLED_MMAP_BYTES, _SETTLED_TRIM_BYTES = 2**25, 2**26
_depth = 0  # nesting of retained_allocations


def start_peak_memory(device: torch.device) -> None:
    """Restart CUDA's count of the peak allocation on ``device`` (nothing on a CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """On CUDA ``torch.cuda.max_memory_allocated(device)``; on a CPU the process's peak resident set size (``getrusage``:
    kibibytes on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The process's C library where it is glibc (``mallopt`` and ``malloc_trim``), else ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        library = ctypes.CDLL(None)
        library.mallopt.argtypes, library.malloc_trim.argtypes = [ctypes.c_int, ctypes.c_int], [ctypes.c_size_t]
        return library if library.gnu_get_libc_version() else None
    except (AttributeError, OSError):
        return None


@contextlib.contextmanager
def retained_allocations() -> Iterator[None]:
    r"""Keep freed large blocks in the process while the block runs (glibc on Linux, with
    :class:`~gpytorch_iterncgp.settings.retain_allocations` on; otherwise nothing).

    glibc serves a block above its mmap threshold (at most 32 MiB) by mapping fresh pages and unmaps it when it is
    freed, so every :math:`N \times N` temporary of a kernel's evaluation, its gradient or a dense solve past
    :math:`N \approx 2000` in float64 pays the page faults of all its pages, each time (on banana's learning at
    3162 rows, 23 s of system time in a 48 s fit; ``docs/design_notes.md``). Within the block, blocks up to 1 GiB come
    from the heap, which keeps its free memory, so the next temporary of the same size reuses those pages. On leaving
    the outermost such block the thresholds are set where glibc's own adjustment settles after large frees (32 MiB
    and 64 MiB) and ``malloc_trim`` returns the free memory to the system. Process-wide while it lasts, like the C
    library's own state; nested blocks are one.
    """
    global _depth
    library = _glibc() if settings.retain_allocations.on() else None
    if library is None:
        yield
        return
    if _depth == 0:
        library.mallopt(_M_MMAP_THRESHOLD, _RETAINED_BYTES)
        library.mallopt(_M_TRIM_THRESHOLD, _RETAINED_BYTES)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            library.mallopt(_M_MMAP_THRESHOLD, _SETTLED_MMAP_BYTES)
            library.mallopt(_M_TRIM_THRESHOLD, _SETTLED_TRIM_BYTES)
            library.malloc_trim(0)
