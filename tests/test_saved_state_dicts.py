"""state_dicts saved by an earlier version of the package (before its subpackage layout) still load: the fresh model
predicts what the saved one did, without refitting."""

from __future__ import annotations

import pathlib

import pytest
import torch

from tests.saved_models import CASES, build, prediction_inputs

SAVED = pathlib.Path(__file__).parent / "data" / "saved_state_dicts.pt"


@pytest.mark.parametrize("name", CASES)
def test_saved_state_dict_loads_and_predicts_without_refit(name):
    saved = torch.load(SAVED, weights_only=True)[name]
    model = build(name)
    model.load_state_dict(saved["state_dict"])
    model.eval()
    strategy = model.variational_strategy
    assert strategy._is_current(), "the loaded state belongs to the loaded hyperparameters"
    mean, variance = strategy.marginal_latent(prediction_inputs())
    assert strategy.last_report is None, "loading and predicting must not refit"
    # The same arithmetic on the same tensors; a tolerance only for another machine's BLAS.
    torch.testing.assert_close(mean, saved["mean"], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(variance, saved["variance"], rtol=1e-9, atol=1e-12)
