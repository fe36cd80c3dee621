"""Every benchmark command that writes a results file runs at its smoke size and writes it (the command as its
docstring gives it, in a process of its own, with ``--out`` in a temporary folder). The scripts with checks of their
numbers have them in ``tests/test_benchmarks.py``; here only that each command still runs against today's package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SLOW = pytest.mark.slow

# (module, arguments before --out, what --out names: a folder or a file)
COMMANDS = [
    pytest.param("budget", ["--smoke"], "folder", marks=SLOW, id="budget"),  # 21 s on one core
    ("ep_budget", ["--smoke"], "folder"),
    pytest.param("predictive_rule", ["--smoke"], "folder", marks=SLOW, id="predictive_rule"),  # 43 s on one core
    ("sparse_ep_scale", ["--smoke"], "folder"),
    ("kernel_throughput", ["--sizes", "400", "--classes", "1", "2", "--repeats", "1", "--paths", "dense"], "file"),
    (
        "outside_products",
        ["--n-train", "200", "--policies", "cg", "--ranks", "inf", "--paths", "dense", "--steps", "2"],
        "file",
    ),
]


def _run(module: str, arguments: list[str], timeout: float) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    command = [sys.executable, "-m", f"benchmarks.{module}", *arguments]
    return subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    ("module", "arguments", "out"),
    COMMANDS,
    ids=[command[0] if isinstance(command, tuple) else command.id for command in COMMANDS],
)
def test_benchmark_command_runs_at_its_smoke_size_and_writes_json(module, arguments, out, tmp_path):
    target = tmp_path / "results" if out == "folder" else tmp_path / f"{module}.json"
    result = _run(module, [*arguments, "--out", str(target)], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    written = sorted(target.glob("*.json")) if out == "folder" else [target]
    assert written, f"{module} wrote no JSON file to {target}"
    for path in written:
        json.loads(path.read_text())  # a whole JSON document
