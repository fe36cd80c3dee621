"""The API page's glossary (``docs/api/index.md``) says where each name is used: every name is a parameter of every
place its row lists (a strategy's options, ``fit_mll``'s dense door, ``LearningRecipe``, the estimators'
constructors, the keys of the estimators' ``solver_options``), and every former name still works there with a ``FutureWarning`` (tested where each is renamed)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from gpytorch_iterncgp import EPStrategy, IterNCGPStrategy, LearningRecipe
from gpytorch_iterncgp.learning.fit import fit_dense_mll

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| `(?P<name>\w+)` \|(?P<meaning>[^|]+)\|(?P<where>[^|]+)\|(?P<former>[^|]*)\|$")


def glossary() -> list[dict[str, str]]:
    """The glossary's rows: name, meaning, where, former name."""
    text = (ROOT / "docs" / "api" / "index.md").read_text()
    section = text.split("## Glossary", 1)[1].split("\n## ", 1)[0]
    return [match.groupdict() for line in section.splitlines() if (match := ROW.match(line))]


def parameters(place: str) -> set[str]:
    """The parameter names of a place the glossary names."""
    if place in ("IterNCGPStrategy", "EPStrategy"):
        strategy = IterNCGPStrategy if place == "IterNCGPStrategy" else EPStrategy
        return {field.name for field in dataclasses.fields(strategy._options_type)}
    if place == "fit_mll":
        return set(inspect.signature(fit_dense_mll).parameters)
    if place == "LearningRecipe":
        return {field.name for field in dataclasses.fields(LearningRecipe)}
    if place == "estimators":
        pytest.importorskip("sklearn")
        from gpytorch_iterncgp.sklearn import (
            IterNCGPClassifier,
            IterNCGPNegativeBinomialRegressor,
            IterNCGPPoissonRegressor,
        )

        names = [set(estimator().get_params()) for estimator in (IterNCGPClassifier, IterNCGPPoissonRegressor)]
        return names[0] & names[1] & set(IterNCGPNegativeBinomialRegressor().get_params())
    if place == "solver_options":
        from gpytorch_iterncgp.learning.estimator_policy import solver_option_names

        return set(solver_option_names("laplace")) | set(solver_option_names("ep"))
    raise AssertionError(f"the glossary names a place the test does not know: {place!r}")


def test_every_glossary_name_is_a_parameter_where_the_glossary_says():
    rows = glossary()
    assert len(rows) >= 15
    assert len({row["name"] for row in rows}) == len(rows)  # one row per name
    for row in rows:
        places = [place.strip().strip("`") for place in row["where"].split(",")]
        for place in places:
            assert row["name"] in parameters(place), f"{row['name']} is not a parameter of {place}"
