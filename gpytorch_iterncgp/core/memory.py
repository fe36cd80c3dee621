"""Peak memory, as the fits report it: on CUDA the largest allocation of tensors since :func:`start_peak_memory`, on a
CPU the process's peak resident memory since it started (the operating system's count: it cannot be restarted
without touching state the rest of the process may rely on)."""

from __future__ import annotations

import resource
import sys

import torch


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
