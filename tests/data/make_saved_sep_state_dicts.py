"""Writes ``saved_sep_state_dicts.pt``: state_dicts of stochastic-EP models trained a few minibatch steps, and their
predictions, saved by the package as it was before the strategy owned ``num_data`` and before per-point sites kept
their inputs' digest (commit 9d4e93b), so that ``tests/test_saved_state_dicts.py`` can check that they still load and
predict the same. It ran with that version's loop (the objective moved the site; the strategy took no ``num_data``):
it records how the file was made and does not run against later versions. Run from the repository root at that commit:
``python tests/data/make_saved_sep_state_dicts.py``.
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from gpytorch_iterncgp import StochasticEPMarginalLogLikelihood  # noqa: E402
from tests.saved_models import SEP_CASES, build_sep, prediction_inputs, sep_data  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    saved = {}
    for name in SEP_CASES:
        model, (x, y) = build_sep(name), sep_data(name)
        likelihood = model.variational_strategy.likelihood
        mll = StochasticEPMarginalLogLikelihood(likelihood, model, num_data=len(x))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
        model.train()
        batches = [torch.arange(len(x))] * 5 if name == "sep-points-probit" else list(torch.arange(len(x)).split(10))
        for rows in batches:
            optimizer.zero_grad()
            (-mll(model(x[rows]), y[rows])).backward()
            optimizer.step()
        model.eval()
        mean, variance = model.variational_strategy.marginal_latent(prediction_inputs())
        saved[name] = {"state_dict": model.state_dict(), "mean": mean.detach(), "variance": variance.detach()}
    torch.save(saved, pathlib.Path(__file__).with_name("saved_sep_state_dicts.pt"))


if __name__ == "__main__":
    main()
