r"""Which predictive rule, on one softmax Laplace posterior: the package's against the approximations.

    python -m benchmarks.predictive_rule             # N = 5000, float32, about a minute here (one thread)
    python -m benchmarks.predictive_rule --smoke     # N = 500 (--quick: the same)

The suite's 10-class mixture (``suite.load_problem``: Matérn-3/2, lengthscale 0.3, outputscale 5 shared by the
classes, 2000 test points), ``IterNCGPStrategy`` with CG (j <= 5, <= 60 Newton steps) and ``covariance_iterations=10``.
On the posterior it holds, the test NLL of

* ``package``: ``predictive_probabilities``, :math:`\mathbb E[\operatorname{softmax}(\mathbf f)]` under each test
  point's full :math:`C \times C` covariance, 1024 antithetic samples;
* ``reference``: the same expectation with :math:`2^{15}` samples (the exact predictive of this posterior, to Monte
  Carlo error);
* ``independent``: the expectation under the per-class marginals (the off-diagonal covariance dropped);
* ``probit``: :math:`\operatorname{softmax}(\boldsymbol\mu / \sqrt{1 + \pi \boldsymbol\sigma^2 / 8})`;
* ``plug_in``: :math:`\operatorname{softmax}(\boldsymbol\mu)`, the variance ignored;

and the mean marginal variance and mean variance of the latents' differences from their class mean
(:math:`\mathbf P \boldsymbol\Sigma \mathbf P`, :math:`\mathbf P = \mathbf I - \mathbf 1 \mathbf 1^\top / C`: the
part of the covariance the softmax sees). Writes ``results/predictive_rule.json`` (with the machine).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks import methods
from benchmarks.common import add_smoke_flag, machine
from benchmarks.scoring import log_loss
from benchmarks.suite import load_problem
from gpytorch_iterncgp import IterNCGPStrategy
from gpytorch_iterncgp.likelihoods.adapters import softmax_gaussian

RESULTS = Path(__file__).resolve().parent / "results"


def test_nll(probabilities: torch.Tensor, labels: torch.Tensor) -> float:
    return log_loss(probabilities, labels)["nll"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="the package's predictive rule against approximations")
    add_smoke_flag(parser, "N = 500")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    num_train = 500 if args.smoke else 5000
    problem = load_problem("mixture", "sensible", num_train, 2000, 0)
    problem.train_x, problem.test_x = problem.train_x.float(), problem.test_x.float()
    model = methods.IterNCGPModel(
        problem, False, IterNCGPStrategy, policy="cg", max_solver_iterations=5, max_newton_steps=60,
        outer_tol=1e-3, covariance_iterations=10, show_progress=False,
    )  # fmt: skip
    tic = time.perf_counter()
    model.variational_strategy.fit()
    fit_seconds = time.perf_counter() - tic
    model.eval()
    strategy, labels = model.variational_strategy, problem.test_y
    with torch.no_grad():
        mean, blocks = strategy.marginal_latent_blocks(problem.test_x)
        variance = blocks.diagonal(dim1=-2, dim2=-1)
        centring = torch.eye(problem.num_classes, dtype=blocks.dtype) - 1 / problem.num_classes
        rules = {
            "package": strategy.predictive_probabilities(problem.test_x),
            "reference": softmax_gaussian(mean.double(), blocks.double(), num_samples=2**15),
            "independent": softmax_gaussian(mean.double(), torch.diag_embed(variance).double(), num_samples=2**13),
            "probit": torch.softmax(mean / (1 + math.pi * variance / 8).sqrt(), dim=-1),
            "plug_in": torch.softmax(mean, dim=-1),
        }
        difference_variance = (centring @ blocks @ centring).diagonal(dim1=-2, dim2=-1).mean()
    results = {
        "machine": machine(),
        "command": "python -m benchmarks.predictive_rule" + (" --smoke" if args.smoke else ""),
        "num_train": num_train,
        "fit_seconds": fit_seconds,
        "test_nll": {name: test_nll(probabilities, labels) for name, probabilities in rules.items()},
        "max_abs_package_minus_reference": float((rules["package"].double() - rules["reference"]).abs().max()),
        "mean_marginal_variance": float(variance.mean()),
        "mean_difference_variance": float(difference_variance),
        "prior_variance": problem.outputscale,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"predictive_rule{'_smoke' if args.smoke else ''}.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({key: value for key, value in results.items() if key != "machine"}, indent=1))
    return results


if __name__ == "__main__":
    main()
