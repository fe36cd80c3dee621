"""state_dicts saved by an earlier version of the package (before its subpackage layout; for stochastic EP, before the
strategy owned ``num_data``) still load: the fresh model predicts what the saved one did, without refitting."""

from __future__ import annotations

import pathlib

import pytest
import torch

from gpytorch_iterncgp import StochasticEPMarginalLogLikelihood
from tests.saved_models import CASES, SEP_CASES, build, build_sep, prediction_inputs, sep_data

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


SAVED_SEP = pathlib.Path(__file__).parent / "data" / "saved_sep_state_dicts.pt"


@pytest.mark.parametrize("name", SEP_CASES)
def test_saved_stochastic_ep_state_dict_loads_and_trains_on(name):
    """A stochastic-EP state saved before the strategy owned ``num_data`` (and before per-point sites kept their
    inputs' digest) loads and predicts what it did; training goes on from it (per-point sites then keep the digest
    and refuse shuffled inputs)."""
    saved = torch.load(SAVED_SEP, weights_only=True)[name]
    x, y = sep_data(name)
    model = build_sep(name, num_data=len(x))
    model.load_state_dict(saved["state_dict"])
    model.eval()
    strategy = model.variational_strategy
    steps = strategy.site.steps
    with torch.no_grad():
        mean, variance = strategy.marginal_latent(prediction_inputs())
    torch.testing.assert_close(mean, saved["mean"], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(variance, saved["variance"], rtol=1e-9, atol=1e-12)
    model.train()
    output = model(x)
    StochasticEPMarginalLogLikelihood(strategy.likelihood, model)(output, y).backward()
    strategy.update_site(output, y)
    assert strategy.site.steps == steps + 1
    if name == "sep-points-probit":
        with pytest.raises(ValueError, match="sites='tied'"):
            model(x.flip(0))
