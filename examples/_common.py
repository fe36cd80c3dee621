"""Shared helpers of the example scripts: command line, seeds, tables and figure output."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed; must precede the pyplot import in the scripts

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIGURE_DIR = Path(__file__).resolve().parent / "figures"

try:  # run from a checkout without installing the package: python examples/<name>.py
    import gpytorch_iterncgp  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))


def parse_args(
    description: str, add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    """``--smoke`` (tiny, seconds), ``--quiet`` (no progress bars; the default when the output is not a terminal),
    ``--out DIR`` (where to save the PNG),
    ``--threads N`` (torch and numpy BLAS threads, set here); ``add_arguments(parser)`` adds a script's own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true", help="run a much smaller version (a few seconds)")
    parser.add_argument(
        "--quiet",
        action="store_true",
        default=not sys.stderr.isatty(),  # output to a log file: no progress bars in it
        help="no progress bars (the default where the output is not a terminal)",
    )
    parser.add_argument("--out", type=Path, default=FIGURE_DIR, help=f"output directory (default {FIGURE_DIR})")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: the matrices are small, and on a busy 2-core machine two threads "
        "can be several times slower than one)",
    )
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    threads = max(1, min(args.threads, os.cpu_count() or 1))
    torch.set_num_threads(threads)
    try:  # numpy's BLAS (scikit-learn's baselines) gets as many threads as torch
        from threadpoolctl import threadpool_limits

        threadpool_limits(threads)
    except ImportError:
        pass
    return args


def setup(seed: int = 0) -> None:
    """Fixed seeds and double precision."""
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.float64)


def save_figure(fig, args: argparse.Namespace, name: str) -> Path:
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"saved {path}")
    return path


def print_table(header: list[str], rows: list[list], title: str | None = None) -> None:
    """A plain fixed-width table; floats with 4 significant digits."""

    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    if title:
        print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


class Timer:
    """``with Timer() as t: ...; t.seconds``."""

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        return False
