"""The estimator page (``docs/user_guide/estimator.md``) states each parameter's default beside its name in its table
(`` `name` (`default`) ``): every such default is the constructors' (read from their signatures), and every
constructor parameter but the deprecated ones has a row."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

pytest.importorskip("sklearn")

from gpytorch_iterncgp.core.validation import DEPRECATED  # noqa: E402
from gpytorch_iterncgp.sklearn import (  # noqa: E402
    IterNCGPClassifier,
    IterNCGPNegativeBinomialRegressor,
    IterNCGPPoissonRegressor,
)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "user_guide" / "estimator.md"
#: `` `name` (`default` `` or `` `name` (2 ``: a name, then its default as a literal in code or a bare number
STATED = re.compile(r"`(?P<name>\w+)` \((?:`(?P<code>[^`]+)`|(?P<number>[-+0-9.e]+)[),:;])")


def _first_cells() -> list[str]:
    """The first cell of each row of the page's parameter table."""
    return [line.split("|")[1] for line in PAGE.read_text().splitlines() if line.startswith("| `")]


def _defaults(estimator) -> dict:
    return {name: p.default for name, p in inspect.signature(estimator.__init__).parameters.items() if name != "self"}


def test_the_estimator_pages_stated_defaults_are_the_constructors():
    stated = {}
    for cell in _first_cells():
        for match in STATED.finditer(cell):
            stated[match["name"]] = ast.literal_eval(match["code"] or match["number"])
    assert {"standardize", "inference", "solver_options", "optimizer_steps", "train_fit_steps"} <= set(stated)
    for estimator in (IterNCGPClassifier, IterNCGPPoissonRegressor, IterNCGPNegativeBinomialRegressor):
        defaults = _defaults(estimator)
        for name, value in stated.items():
            assert defaults[name] == value, f"{estimator.__name__}({name}=...) defaults to {defaults[name]!r}"


def test_every_current_parameter_has_a_row():
    named = {name for cell in _first_cells() for name in re.findall(r"`(\w+)`", cell)}
    for estimator in (IterNCGPClassifier, IterNCGPPoissonRegressor):
        current = {name for name, value in _defaults(estimator).items() if value != DEPRECATED}
        sparse = {"num_inducing", "batch_size"}  # stochastic EP's, on its own page (scalable_ep.md)
        assert current - sparse <= named, f"no row for {sorted(current - sparse - named)}"
