"""What every benchmark shares: the record of the machine it ran on and its load, the process's peak resident memory,
and the command-line flag of a tiny run."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
from pathlib import Path

import gpytorch
import linear_operator
import torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def machine() -> dict:
    """CPU, cores, memory, threads used and library versions, for the results' JSON."""
    try:
        import pykeops

        keops = pykeops.__version__
    except ImportError:
        keops = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": _memory_bytes(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpytorch": gpytorch.__version__,
        "linear_operator": linear_operator.__version__,
        "pykeops": keops,
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss_bytes() -> int:
    """Peak resident memory of this process since start or the last :func:`reset_peak_rss` (Linux VmHWM)."""
    return _status_bytes("VmHWM:")


def rss_bytes() -> int:
    """Resident memory of this process now (Linux VmRSS)."""
    return _status_bytes("VmRSS:")


def reset_peak_rss() -> None:
    """Restart the peak-memory count at the current resident size (Linux >= 4.0; a no-op elsewhere)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


def load_average() -> float:
    """The machine's load average over the last minute (NaN where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return math.nan


def kernel_hyperparameters(kernel: gpytorch.kernels.Kernel) -> dict[str, list[float]]:
    """Every hyperparameter of ``kernel`` by its dotted name without ``raw_`` (``base_kernel.lengthscale``,
    ``outputscale``, ``base_kernel.kernels.0.variance``), constrained values, flattened: whatever the kernel's
    structure (the estimators' ``kernel="auto"`` may choose a sum)."""
    return {
        name.replace("raw_", ""): (raw if constraint is None else constraint.transform(raw)).detach().flatten().tolist()
        for name, raw, constraint in kernel.named_parameters_and_constraints()
    }


def add_smoke_flag(parser: argparse.ArgumentParser, help: str = "tiny sizes (a functional check, seconds)") -> None:
    """``--smoke`` (``args.smoke``): the benchmark at tiny sizes, as the tests run it; ``--quick`` is the same flag."""
    parser.add_argument("--smoke", "--quick", dest="smoke", action="store_true", help=f"{help}; --quick: the same")


def write_results(path: Path, module: str, argv: list[str] | None, **fields) -> None:
    """``fields`` as JSON at ``path`` (its folder made), with :func:`machine` and the command line that ran
    (``python -m benchmarks.<module>`` and ``argv``, or the process's own arguments)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    command = f"python -m benchmarks.{module} " + " ".join(sys.argv[1:] if argv is None else argv)
    path.write_text(json.dumps({"machine": machine(), "command": command, **fields}, indent=1))
