r"""The prepared GPU run: every measurement a lent GPU is for, in one command that fits a 15-minute lease.

    PYTHONPATH=. python -m benchmarks.gpu_run --out $OUT            # on the device machine (about 11 minutes)
    python -m benchmarks.gpu_run --smoke --out /tmp/gpu_run         # tiny sizes on the CPU (the tests run it)

Steps, in order, each a child process with its own time limit (a step that fails, runs out of memory or past its
limit is recorded as such and the next one starts; :data:`STEPS`):

1. ``cuda_tests``: the test suite's CUDA tests (``pytest -k cuda``, not the slow ones: the fused products, the
   strategies and the estimators (``device="cuda"``) on the device, equal to the CPU within float tolerance);
2. ``throughput``: :mod:`benchmarks.kernel_throughput` at :math:`N = 10^5`, :math:`C \in \{1, 10\}`, the fused
   Triton path in IEEE float32 and in TF32, and the chunked GPyTorch path (target: :math:`\ge 10^{12}` kernel
   entries per second);
3. ``figure6``: :mod:`benchmarks.suite` on the paper's problem (its Figure 6, Appendix C.3: the 10-class mixture in
   3-D, :math:`N = 10^5` training and :math:`10^4` test points, the paper's fixed kernel): IterNCGP-CG with
   :math:`j \le 5` and :math:`R \in \{\infty, 10\}`, multi-class EP, SVGP over a grid of inducing points and learning
   rates (each for IterNCGP's time), and subset-of-data Laplace; accuracy, NLL and ECE against time, peak GPU memory;
4. ``stochastic_ep``: :mod:`benchmarks.scalable_ep` at :math:`10^5` points (binary and 10 classes), stochastic EP
   and SVGP each learning its kernel, test NLL against time.

Writes ``gpu_run.json`` in ``--out`` (the machine and device's name, and per step its command, exit status,
seconds, whether its limit stopped it, and the last lines of its output) with each step's own JSON and PNG beside
it (``<step>/``) and its whole output (``<step>.log``), and prints a table of the steps last. ``--smoke`` runs the
same steps at tiny sizes on the CPU (the CUDA tests' step is then only collected), so the run is known to work
before a device is lent.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import add_smoke_flag, machine

ROOT = Path(__file__).resolve().parents[1]
#: the test files with CUDA tests (each skips without a device)
CUDA_TEST_FILES = (
    "tests/core/test_kernel_products.py",
    "tests/test_foundations.py",
    "tests/strategies/test_stochastic.py",
    "tests/likelihoods/test_tilted.py",
    "tests/test_benchmarks.py",
    "tests/integrations/test_sklearn_device.py",
)


@dataclass(frozen=True)
class Step:
    """One measurement: its name, its time limit (seconds, on the device; ``smoke_limit`` at smoke size) and its
    command's arguments after ``python`` (``arguments(out, device, smoke)``, ``out`` the step's own folder)."""

    name: str
    limit: float
    smoke_limit: float
    arguments: Callable[[Path, str, bool], list[str]]


def _cuda_tests(out: Path, device: str, smoke: bool) -> list[str]:
    # (not the slow ones: the suite's smoke run on CUDA is the figure6 step's work at full size)
    command = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "not slow", "-k", "cuda"]
    command += list(CUDA_TEST_FILES)
    return [*command, "--collect-only"] if smoke else command


def _throughput(out: Path, device: str, smoke: bool) -> list[str]:
    paths = ["fused", "fused-tf32", "chunked"] if device == "cuda" else ["fused", "chunked"]
    sizes = ["2000"] if smoke else ["100000"]
    return [
        *("-m", "benchmarks.kernel_throughput", "--device", device, "--sizes", *sizes, "--classes", "1", "10"),
        *("--paths", *paths, "--repeats", "1" if smoke else "3", "--out", str(out / "kernel_throughput.json")),
    ]


def _figure6(out: Path, device: str, smoke: bool) -> list[str]:
    size = ["--smoke"] if smoke else ["--n-train", "100000", "--n-test", "10000"]
    grid = (
        [] if smoke else ["--svgp-inducing", "1000", "5000", "--svgp-lr", "0.01", "0.05", "--sod-sizes", "1000", "4000"]
    )
    return [
        *("-m", "benchmarks.suite", *size, "--datasets", "mixture", "--settings", "paper", "--device", device),
        *("--methods", "iterncgp", "ep", "svgp", "sod", *grid, "--no-keops", "--threads", "1", "--quiet"),
        *("--out", str(out)),
    ]


def _stochastic_ep(out: Path, device: str, smoke: bool) -> list[str]:
    budget = ["--smoke", "--datasets", "binary100000", "--budget", "1"] if smoke else ["--budget", "60"]
    return ["-m", "benchmarks.scalable_ep", *budget, "--device", device, "--out", str(out)]


#: the steps in the order they run; the limits add up to 11 minutes on the device
STEPS = (
    Step("cuda_tests", 90.0, 120.0, _cuda_tests),
    Step("throughput", 90.0, 120.0, _throughput),
    Step("figure6", 300.0, 300.0, _figure6),
    Step("stochastic_ep", 180.0, 180.0, _stochastic_ep),
)


def run_step(step: Step, out: Path, device: str, smoke: bool) -> dict:
    """Run ``step`` in a child process (the repository's root as its working folder and on its path) within its
    limit; its output goes to ``out / f"{step.name}.log"``. Returns what :func:`main` records."""
    folder = out / step.name
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, *step.arguments(folder, device, smoke)]
    limit = step.smoke_limit if smoke else step.limit
    log = out / f"{step.name}.log"
    start = time.perf_counter()
    timed_out = False
    with log.open("w") as stream:
        try:
            returncode = subprocess.run(
                command, cwd=ROOT, stdout=stream, stderr=subprocess.STDOUT, timeout=limit, env=_environment()
            ).returncode
        except subprocess.TimeoutExpired:
            returncode, timed_out = None, True
    lines = log.read_text(errors="replace").splitlines()
    return {
        "step": step.name,
        "command": " ".join(["python", *command[1:]]),
        "limit_seconds": limit,
        "seconds": time.perf_counter() - start,
        "returncode": returncode,
        "timed_out": timed_out,
        "tail": lines[-15:],
    }


def _environment() -> dict:
    """The child's environment: this one, with the repository's root on ``PYTHONPATH``."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH", "")]))
    return environment


def table(steps: list[dict]) -> str:
    """One line per step: name, outcome, seconds of its limit."""
    lines = ["step            outcome      seconds (limit)"]
    for entry in steps:
        outcome = (
            "timed out" if entry["timed_out"] else ("ok" if entry["returncode"] == 0 else f"exit {entry['returncode']}")
        )
        lines.append(f"{entry['step']:<15} {outcome:<12} {entry['seconds']:7.1f} ({entry['limit_seconds']:.0f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the results' folder (on the device machine: $OUT)")
    parser.add_argument("--steps", nargs="+", default=[step.name for step in STEPS], choices=[s.name for s in STEPS])
    parser.add_argument("--device", default=None, help="default: cuda where available, else cpu")
    add_smoke_flag(parser, "tiny sizes on the CPU, every step (the CUDA tests only collected)")
    args = parser.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": machine(), "device": device, "smoke": args.smoke, "steps": []}
    for step in STEPS:
        if step.name not in args.steps:
            continue
        results["steps"].append(run_step(step, args.out, device, args.smoke))
        (args.out / "gpu_run.json").write_text(json.dumps(results, indent=1))  # (after every step)
        print(f"{step.name}: {results['steps'][-1]['seconds']:.0f} s", flush=True)
    print(table(results["steps"]))
    return results


if __name__ == "__main__":
    outcome = main()
    sys.exit(0 if all(entry["returncode"] == 0 for entry in outcome["steps"]) else 1)
