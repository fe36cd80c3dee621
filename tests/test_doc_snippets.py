"""Every ```python block of ``README.md`` and ``docs/**/*.md`` runs, so the documentation's snippets cannot rot.

Each page's blocks run in order in one namespace (a page's first blocks make the data its later ones use), in this
process with a timeout per page; the global state a snippet may change (torch's default dtype and random number
generator, linear_operator's and GPyTorch's settings, which importing BoTorch changes) is restored afterwards. A block
that is deliberately not runnable (a GPU, ``torchrun``, hours of computation) is fenced as ```python notest, or
preceded by the line ``<!-- notest -->``; pages whose snippets take more than a few seconds are listed in ``SLOW``.
"""

from __future__ import annotations

import re
import signal
import warnings
from pathlib import Path

import pytest
import torch

from tests.common import settings_snapshot

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120
SLOW: set[str] = {"docs/user_guide/hyperparameters.md"}  # pages (relative paths) whose snippets are marked slow (9 s)
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
NOTEST_COMMENT = "<!-- notest -->"
OPTIONAL_PACKAGES = {"botorch"}  # a page whose snippets import a missing optional extra is skipped


def code_blocks(text: str) -> list[tuple[int, str, bool]]:
    """The fenced blocks of a Markdown text whose language is ``python``: (first line number, code, runnable)."""
    lines = text.splitlines()
    blocks = []
    index = 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if match is None:
            index += 1
            continue
        fence, info = match["fence"], match["info"].strip().split()
        end = index + 1
        while end < len(lines) and not (
            lines[end].strip().startswith(fence) and lines[end].strip().strip(fence[0]) == ""
        ):
            end += 1
        if info and info[0] == "python":
            previous = next((line.strip() for line in reversed(lines[:index]) if line.strip()), "")
            runnable = "notest" not in info[1:] and previous != NOTEST_COMMENT
            indent = len(match["indent"])
            code = "\n".join(line[indent:] for line in lines[index + 1 : end])
            blocks.append((index + 2, code, runnable))
        index = end + 1
    return blocks


def pages() -> list[Path]:
    docs = ROOT / "docs"
    skipped = (docs / "_build", docs / "auto_tutorials", docs / "api" / "generated")
    found = [ROOT / "README.md"] + sorted(
        path for path in docs.rglob("*.md") if not any(path.is_relative_to(folder) for folder in skipped)
    )
    return [path for path in found if any(runnable for _, _, runnable in code_blocks(path.read_text()))]


def _timeout(signum, frame):
    raise TimeoutError(f"a page's snippets ran longer than {TIMEOUT_S} s")


def _param(path: Path):
    name = str(path.relative_to(ROOT))
    marks = [pytest.mark.slow] if name in SLOW else []
    return pytest.param(path, id=name, marks=marks)


def test_code_blocks_finds_runnable_and_notest_blocks():
    text = (
        "intro\n```python\nx = 1\n```\n\n```bash\nls\n```\n"
        "```python notest\ny = 2\n```\n<!-- notest -->\n\n```python\nz = 3\n```\n"
        "````markdown\n```python\ninner = 4\n```\n````\n- item\n\n  ```python\n  w = 5\n  ```\n"
    )
    assert code_blocks(text) == [(3, "x = 1", True), (10, "y = 2", False), (15, "z = 3", False), (25, "w = 5", True)]


@pytest.mark.parametrize("path", [_param(path) for path in pages()])
def test_page_snippets_run(path: Path):
    blocks = [(line, code) for line, code, runnable in code_blocks(path.read_text()) if runnable]
    namespace: dict = {"__name__": "__doc_snippet__"}
    settings = settings_snapshot()
    dtype = torch.get_default_dtype()
    previous_handler = signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(TIMEOUT_S)
    try:
        with torch.random.fork_rng(), warnings.catch_warnings():
            torch.manual_seed(0)
            for line, code in blocks:
                try:
                    exec(compile(code, f"{path.relative_to(ROOT)}:{line}", "exec"), namespace)
                except ModuleNotFoundError as error:
                    if error.name not in OPTIONAL_PACKAGES:
                        raise
                    pytest.skip(f"{path.relative_to(ROOT)} needs {error.name} (an optional extra)")
                except Exception as error:
                    raise AssertionError(f"the block at {path.relative_to(ROOT)}:{line} failed: {error!r}") from error
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous_handler)
        torch.set_default_dtype(dtype)
        for (setting, attribute), value in settings.items():
            setattr(setting, attribute, value)
