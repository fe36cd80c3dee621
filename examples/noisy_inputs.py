"""GP classification with noisy inputs of known variance: the noise-aware classifier against one that ignores it.

A 1-D binary problem: true inputs x ~ U(-3, 3), labels y ~ Bernoulli(Φ(f(x))) with f(x) = 3 sin(2x); each input is
observed as x_obs = x + ε, ε ~ N(0, s) with a *known* per-point variance s, half the points precise (s = 0.01) and
half noisy (s = 0.36), in training and test sets alike (400 train, 2000 test; ``--smoke``: 60 / 200).

Two classifiers, both :class:`~gpytorch_iterncgp.gplvm.NoisyInputGPClassifier` (probit likelihood, RBF kernel, 20
inducing inputs learned, sparse EP trained by the bound L_H, 150 Adam steps at lr 0.05, the same start):

* **noise-aware**: q(X) = N(x_obs, s) at training (the expected DTC prior of the Ψ statistics) and the
  moment-matched predictive at test inputs N(x_obs, s);
* **noise-ignoring**: the same model with s = 0 everywhere (sparse EP-DTC on the observed inputs as if exact).

Reported: test NLL (mean negative log predictive probability of the test labels), accuracy, and both split by
precise / noisy test inputs; the table goes to the terminal and to ``noisy_inputs.json``, the predictive curves to
``noisy_inputs.png``.

    python examples/noisy_inputs.py            # about a minute on one core
    python examples/noisy_inputs.py --smoke    # seconds
"""

from __future__ import annotations

import json

import _common
import matplotlib.pyplot as plt
import torch

from gpytorch_iterncgp.gplvm import NoisyInputGPClassifier

NAME = "noisy_inputs"
VARIANCES = (0.01, 0.36)
NUM_INDUCING = 20


def latent(x: torch.Tensor) -> torch.Tensor:
    return 3 * torch.sin(2 * x)


def make_data(num: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """True inputs, observed inputs (N, 1), their known variances (N, 1) and labels (N,)."""
    truth = 6 * torch.rand(num, 1, generator=generator) - 3
    variances = torch.tensor(VARIANCES)[torch.arange(num) % 2][:, None]
    observed = truth + variances.sqrt() * torch.randn(num, 1, generator=generator)
    probability = torch.distributions.Normal(0.0, 1.0).cdf(latent(truth[:, 0]))
    labels = (torch.rand(num, generator=generator) < probability).double()
    return {"truth": truth, "observed": observed, "variances": variances, "labels": labels}


def evaluate(probabilities: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(test NLL, accuracy)."""
    nll = -torch.distributions.Bernoulli(probs=probabilities.clamp(1e-12, 1 - 1e-12)).log_prob(labels).mean()
    return float(nll), float(((probabilities > 0.5).double() == labels).double().mean())


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    _common.setup(0)
    num_train, num_test, steps = (60, 200, 15) if args.smoke else (400, 2000, 150)
    generator = torch.Generator().manual_seed(0)
    train, test = make_data(num_train, generator), make_data(num_test, generator)
    inducing = torch.linspace(-3, 3, NUM_INDUCING)[:, None]

    models, rows, summary = {}, [], {}
    for name, aware in (("noise-aware", True), ("noise-ignoring", False)):
        train_variances = train["variances"] if aware else torch.zeros_like(train["variances"])
        test_variances = test["variances"] if aware else None
        model = NoisyInputGPClassifier(
            train["observed"], train_variances, train["labels"], inducing_points=inducing, site_tol=1e-4
        )
        with _common.Timer() as timer:
            losses = model.fit(num_steps=steps, lr=0.05, show_progress=not args.quiet)
        assert all(report.converged for report in model.last_reports), f"{name}: EP did not converge"
        probabilities = model.predict_proba(test["observed"], test_variances)
        nll, accuracy = evaluate(probabilities, test["labels"])
        split = {}
        for label, variance in zip(("precise", "noisy"), VARIANCES, strict=True):
            chosen = test["variances"][:, 0] == variance
            split[label] = evaluate(probabilities[chosen], test["labels"][chosen])
        models[name] = model
        rows.append([name, nll, accuracy, split["precise"][0], split["noisy"][0], timer.seconds])
        summary[name] = {
            "test_nll": nll,
            "test_accuracy": accuracy,
            "test_nll_precise_inputs": split["precise"][0],
            "test_nll_noisy_inputs": split["noisy"][0],
            "test_accuracy_precise_inputs": split["precise"][1],
            "test_accuracy_noisy_inputs": split["noisy"][1],
            "loss_first_last": [losses[0], losses[-1]],
            "lengthscale": float(model.covar_module.base_kernel.lengthscale.detach().reshape(-1)[0]),
            "outputscale": float(model.covar_module.outputscale.detach()),
            "seconds": timer.seconds,
        }
    _common.print_table(
        ["classifier", "test NLL", "accuracy", "NLL precise", "NLL noisy", "seconds"],
        rows,
        title=f"{num_train} training / {num_test} test inputs, input noise variances {VARIANCES} (known)",
    )

    grid = torch.linspace(-3.5, 3.5, 300)[:, None]
    figure, axis = plt.subplots(figsize=(8, 4.2))
    axis.plot(grid, torch.distributions.Normal(0.0, 1.0).cdf(latent(grid[:, 0])), "k--", lw=1, label="true P(y=1 | x)")
    aware, ignoring = models["noise-aware"], models["noise-ignoring"]
    axis.plot(grid, aware.predict_proba(grid), color="tab:blue", label="noise-aware, exact test input")
    axis.plot(
        grid,
        aware.predict_proba(grid, torch.full_like(grid, VARIANCES[1])),
        color="tab:blue",
        ls=":",
        label=f"noise-aware, test input variance {VARIANCES[1]}",
    )
    axis.plot(grid, ignoring.predict_proba(grid), color="tab:red", label="noise-ignoring")
    noisy = train["variances"][:, 0] == VARIANCES[1]
    for chosen, marker, label in ((~noisy, "o", "precise inputs"), (noisy, "x", "noisy inputs")):
        axis.scatter(
            train["observed"][chosen, 0],
            train["labels"][chosen] * 1.06 - 0.03,
            marker=marker,
            s=10,
            color="0.5",
            label=f"training labels ({label})",
        )
    axis.set_xlabel("observed input")
    axis.set_ylabel("P(y = 1)")
    axis.set_title(
        f"test NLL: noise-aware {summary['noise-aware']['test_nll']:.3f}, "
        f"noise-ignoring {summary['noise-ignoring']['test_nll']:.3f}"
    )
    axis.legend(fontsize=7, loc="center right")
    _common.save_figure(figure, args, NAME)

    summary.update(
        {"num_train": num_train, "num_test": num_test, "steps": steps, "variances": VARIANCES, "smoke": args.smoke}
    )
    json_path = args.out / f"{NAME}.json"
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"saved {json_path}")


if __name__ == "__main__":
    main()
