"""Writes ``saved_state_dicts.pt``: state_dicts of fitted models and their predictions, saved by the package as it
was before the subpackage layout (commit fa5c678), so that ``tests/test_saved_state_dicts.py`` can check that they
still load and predict the same. Run from the repository root: ``python tests/data/make_saved_state_dicts.py``.
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from tests.saved_models import CASES, build, prediction_inputs  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    saved = {}
    for name in CASES:
        model = build(name)
        model.variational_strategy.fit()
        model.eval()
        mean, variance = model.variational_strategy.marginal_latent(prediction_inputs())
        saved[name] = {"state_dict": model.state_dict(), "mean": mean, "variance": variance}
    torch.save(saved, pathlib.Path(__file__).with_name("saved_state_dicts.pt"))


if __name__ == "__main__":
    main()
