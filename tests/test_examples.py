"""The example scripts run end to end in their small ``--smoke`` versions and write their figures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = [
    "binary_classification",
    "poisson_regression",
    "multiclass",
    "hyperparameters",
    "sklearn_quickstart",
    "ep_vs_laplace",
    "alps_square_wave",
    "binary_gplvm_digits",
    "noisy_inputs",
]


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_smoke(name, tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / f"{name}.py"), "--smoke", "--quiet", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{name} failed:\n{result.stdout}\n{result.stderr}"
    figure = tmp_path / f"{name}.png"
    assert figure.is_file() and figure.stat().st_size > 10_000, f"{name} did not write {figure}"
    assert "Traceback" not in result.stderr
