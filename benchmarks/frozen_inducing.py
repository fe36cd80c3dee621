r"""What holds the minibatch fits back at :math:`N = 10^6`: stop one group of parameters and watch the test NLL.

    python -m benchmarks.frozen_inducing --seeds 0 4                   # binary mixture, N = 10^6 (about 4 minutes a seed)
    python -m benchmarks.frozen_inducing --smoke                       # tiny sizes, seconds

Each method of :mod:`benchmarks.scalable_ep` (``sep``: stochastic EP; ``svgp``: GPyTorch's SVGP) runs GPyTorch's
plain loop (Adam 0.01, batches of 1024, ``-mll(model(x_b), y_b)``) for ``--steps`` steps. From that state (the
model and Adam's moments) it goes on for ``--more`` steps on the same batches four ways: every parameter learning
(``all``), the inducing inputs stopped (``inducing``), the kernel and the mean stopped (``kernel_mean``), or all three
stopped (``inducing_kernel_mean``: SEP's site, SVGP's variational parameters still move). Test NLL after 50, 100,
200 and 300 of them (and after the last). Writes ``results/frozen_inducing.json`` (with the machine).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpytorch
import torch

from benchmarks.common import add_smoke_flag, machine
from benchmarks.data import Data, load
from benchmarks.scalable_ep import SEPModel
from benchmarks.scoring import log_loss
from benchmarks.svgp import SVGPModel, svgp_probabilities
from gpytorch_iterncgp import StochasticEPMarginalLogLikelihood

RESULTS = Path(__file__).resolve().parent / "results"
#: the parameters each variant stops, by the end of their names
STOPPED = {
    "all": (),
    "inducing": ("inducing_points",),
    "kernel_mean": ("raw_constant", "raw_outputscale", "raw_lengthscale"),
    "inducing_kernel_mean": ("inducing_points", "raw_constant", "raw_outputscale", "raw_lengthscale"),
}


def build(method: str, data: Data, seed: int):
    """The model, its objective and Adam (learning rate 0.01), as :mod:`benchmarks.scalable_ep` starts them."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood().to(data.train_x)
    num_data = len(data.train_y)
    if method == "sep":
        model = SEPModel(data, 200, likelihood, generator)
        objective = StochasticEPMarginalLogLikelihood(likelihood, model)
    else:
        model = SVGPModel(data, 200, generator)
        objective = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=num_data)
    return model, objective, torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.01)


def test_nll(method: str, model, data: Data) -> float:
    """The method's own predictive's test NLL (:mod:`benchmarks.scalable_ep`)."""
    model.eval()
    with torch.no_grad():
        if method == "sep":
            strategy = model.variational_strategy
            probabilities = torch.cat([strategy.predictive_probabilities(x) for x in data.test_x.split(4096)])
        else:
            probabilities = svgp_probabilities(model, data.test_x, 2)
    model.train()
    return log_loss(probabilities, data.test_y)["nll"]


def steps(
    method: str, model, objective, optimizer, data: Data, count: int, generator: torch.Generator, scores=()
) -> list[float]:
    """``count`` steps of the plain loop on random batches of 1024; the test NLL after each step in ``scores``."""
    targets, nlls, done = data.train_y.to(data.train_x), [], 0
    model.train()
    while done < count:
        for rows in torch.randperm(len(targets), generator=generator).split(1024):
            optimizer.zero_grad()
            output = model(data.train_x[rows])
            loss = -objective(output, targets[rows])
            if loss.requires_grad:  # something still learns (SEP's site moves either way)
                loss.backward()
                optimizer.step()
            if method == "sep":
                model.variational_strategy.update_site(output, targets[rows])
            done += 1
            if done in scores:
                nlls.append(test_nll(method, model, data))
            if done == count:
                break
    return nlls


def run(method: str, data: Data, seed: int, first: int, more: int) -> dict:
    """The trained state after ``first`` steps, then each variant of :data:`STOPPED` for ``more`` steps."""
    model, objective, optimizer = build(method, data, seed)
    steps(method, model, objective, optimizer, data, first, torch.Generator().manual_seed(seed))
    state, moments = model.state_dict(), optimizer.state_dict()
    scored_after = sorted({s for s in (50, 100, 200, 300) if s <= more} | {more})
    result = {"trained": test_nll(method, model, data), "scored_after": scored_after}
    for variant, stopped in STOPPED.items():
        model, objective, optimizer = build(method, data, seed)
        model.load_state_dict(state)
        optimizer.load_state_dict(moments)
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(not name.endswith(stopped))
        generator = torch.Generator().manual_seed(1000 + seed)  # the same batches for every variant
        result[variant] = steps(method, model, objective, optimizer, data, more, generator, result["scored_after"])
        print(f"{method:>5} seed {seed} {variant:>21}: {result[variant]}", flush=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="binary1000000")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 4])
    parser.add_argument("--steps", type=int, default=1700, help="steps before the variants (about 60 s here)")
    parser.add_argument("--more", type=int, default=300)
    add_smoke_flag(parser, "tiny data, seconds")
    parser.add_argument("--out", type=Path, default=RESULTS / "frozen_inducing.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    first, more = (5, 10) if args.smoke else (args.steps, args.more)
    output: dict = {"machine": machine(), "dataset": args.dataset, "steps": first, "runs": []}
    for seed in args.seeds:
        data = load(args.dataset, args.smoke, seed)
        for method in ("sep", "svgp"):
            output["runs"].append({"method": method, "seed": seed, **run(method, data, seed, first, more)})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(output, indent=1))
    return output


if __name__ == "__main__":
    main(sys.argv[1:])
