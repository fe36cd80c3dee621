"""Multi-class GP classification with IterNCGP: the paper's 10-class Gaussian mixture in 3-D.

Paper, Section 5.2 / Appendix C.3, scaled down to a laptop: 2000 training and 2000 test points, a softmax
likelihood over C = 10 latent GPs that share one Matérn-3/2 kernel (K = K_x ⊗ I_C, one N × C product per
solver iteration), CG actions with at most 5 solver iterations per Newton step and recycling, without
(R = ∞) and with compression (R = 10). After every Newton step (fit callback) the predictive probabilities
(probit approximation over the latent marginals, computational uncertainty included) give accuracy, NLL and
ECE (15 bins) on the training and test sets; the fit's wall time excludes these evaluations.

Hyperparameters: lengthscale 0.3 / outputscale 5, where the posterior moves far from the prior and the
damping of the Newton steps matters, and the paper's 0.05 / 0.05, where it barely leaves the prior.

    python examples/multiclass.py [--smoke] [--quiet] [--out DIR] [--threads N]
"""

from __future__ import annotations

import time
import warnings

import _common
import gpytorch
import matplotlib.pyplot as plt
import torch
from torchmetrics.classification import MulticlassCalibrationError

from gpytorch_iterncgp import IterNCGPStrategy
from gpytorch_iterncgp.datasets import gaussian_mixture

NAME = "multiclass"
NUM_CLASSES = 10
# Softmax W^+ has entries ~ 1/pi: with the default bound on pi (sqrt(eps) = 1.5e-8 in float64) saturated
# probabilities make the Newton systems so ill-conditioned that 5 CG iterations per step give steps the
# damping rejects; bounding pi below by 1e-6 keeps the mode (g = a there) and makes every run converge.
MIN_CURVATURE = 1e-6


class Model(gpytorch.models.ApproximateGP):
    """Zero-mean GPs for the C class latents, one Matérn-3/2 kernel shared by all classes."""

    def __init__(self, train_x, train_y, likelihood, lengthscale, outputscale, **options):
        strategy = IterNCGPStrategy(self, train_x, train_y, likelihood, **options)
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5))
        self.covar_module.base_kernel.lengthscale = lengthscale
        self.covar_module.outputscale = outputscale

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def metrics(probs, labels) -> dict:
    ece = MulticlassCalibrationError(num_classes=NUM_CLASSES, n_bins=15, norm="l1")
    return {
        "acc": float((probs.argmax(-1) == labels).double().mean()),
        "nll": float(-probs[torch.arange(len(labels)), labels].clamp_min(1e-300).log().mean()),
        "ece": float(ece(probs.float(), labels)),
    }


def run(config, data, quiet):
    """One IterNCGP run; the callback records the metrics after every Newton step."""
    train_x, train_y, test_x, test_y = data
    likelihood = gpytorch.likelihoods.SoftmaxLikelihood(num_classes=NUM_CLASSES, mixing_weights=False)
    model = Model(
        train_x,
        train_y,
        likelihood,
        config["lengthscale"],
        config["outputscale"],
        policy="cg",
        max_solver_iterations=5,
        compression_rank=config["rank"],
        recycle=True,
        max_newton_steps=config["steps"],
        outer_tol=1e-3,
        min_curvature=MIN_CURVATURE,
        show_progress=not quiet,
    )
    strategy = model.variational_strategy
    history = []
    products = 0
    evaluation_time = 0.0
    start = time.perf_counter()

    def callback(step, state):
        nonlocal products, evaluation_time
        tic = time.perf_counter()
        products += step.kernel_products
        # In training mode predictions at the training inputs reuse K Q from the solver: no product with K.
        train = metrics(strategy.predictive_probabilities(train_x), train_y)
        test = metrics(strategy.predictive_probabilities(test_x), test_y)
        record = {
            "step": step.step,
            "products": products,
            "log_posterior": step.log_posterior,
            "step_size": step.step_size,
        }
        record.update({f"train_{k}": v for k, v in train.items()})
        record.update({f"test_{k}": v for k, v in test.items()})
        record["time"] = tic - start - evaluation_time  # the fit's own wall time so far
        history.append(record)
        evaluation_time += time.perf_counter() - tic

    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = strategy.fit(callback=callback)
    with torch.no_grad():  # how much of the prior variance is left, and the plug-in predictive without it
        mean, variance = strategy.marginal_latent(test_x)
        plug_in = metrics(torch.softmax(mean, dim=-1), test_y)
    diagnostics = (
        f"latent variance at the test points: {float(variance.mean()):.3g} (prior {config['outputscale']:g}), "
        f"precision rank {strategy.state.precision_root.shape[-1]} of {strategy.state.precision_root.shape[0]}; "
        f"plug-in softmax(mean) without the variance: test NLL {plug_in['nll']:.4g}, ECE {plug_in['ece']:.4g}"
    )
    if report.converged:
        status = "converged"
    elif caught:
        status = "stopped: " + str(caught[-1].message).removeprefix("IterNCGP: ").removesuffix("; stopping.")
    else:
        status = f"stopped after max_newton_steps={config['steps']}"
    return history, report, status, diagnostics


def main():
    args = _common.parse_args(__doc__.splitlines()[0])
    _common.setup(seed=0)
    num_train, num_test, steps = (300, 300, 6) if args.smoke else (2000, 2000, 40)
    data = gaussian_mixture(num_train, num_test, num_classes=NUM_CLASSES)
    configs = [
        {"label": "ℓ=0.3, s²=5, R=∞", "lengthscale": 0.3, "outputscale": 5.0, "rank": None, "steps": steps},
        {"label": "ℓ=0.3, s²=5, R=10", "lengthscale": 0.3, "outputscale": 5.0, "rank": 10, "steps": steps},
        {
            "label": "ℓ=0.05, s²=0.05, R=∞ (paper)",
            "lengthscale": 0.05,
            "outputscale": 0.05,
            "rank": None,
            "steps": steps,
        },
    ]
    histories = {}
    for config in configs:
        history, report, status, diagnostics = run(config, data, args.quiet)
        histories[config["label"]] = history
        rows = [
            [
                h["step"],
                h["products"],
                h["step_size"],
                h["log_posterior"],
                h["train_acc"],
                h["test_acc"],
                h["train_nll"],
                h["test_nll"],
                h["train_ece"],
                h["test_ece"],
                h["time"],
            ]
            for h in history
        ]
        _common.print_table(
            [
                "step",
                "products",
                "step size",
                "log posterior",
                "train acc",
                "test acc",
                "train NLL",
                "test NLL",
                "train ECE",
                "test ECE",
                "fit time [s]",
            ],
            rows,
            title=f"{config['label']}: N={num_train}, C={NUM_CLASSES}, CG, ≤5 solver iterations per Newton step "
            f"(fit {report.wall_time:.2f}s incl. evaluation)",
        )
        print(f"-> {status}; {diagnostics}")

    # -- figure -----------------------------------------------------------------------------------
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5), constrained_layout=True)
    axes = axes.flat
    colors = dict(zip(histories, ["tab:blue", "tab:orange", "tab:green"], strict=True))
    for label, history in histories.items():
        products = [h["products"] for h in history]
        ms = 3 if len(history) > 5 else 6  # short runs (the paper's setting converges at once) as visible dots
        for ax, key in zip(axes[:3], ("acc", "nll", "ece"), strict=True):
            ax.plot(products, [h[f"train_{key}"] for h in history], ".-", ms=ms, color=colors[label])
            ax.plot(products, [h[f"test_{key}"] for h in history], "x--", ms=ms, color=colors[label])
        axes[3].plot(products, [-h["log_posterior"] for h in history], ".-", ms=ms, color=colors[label])
        axes[4].plot(products, [h["time"] for h in history], ".-", ms=ms, color=colors[label])
    titles = (
        "accuracy",
        "NLL",
        "ECE (15 bins)",
        "−log posterior Ψ (mode finding)",
        "fit wall time [s] (excl. evaluation)",
    )
    for ax, title in zip(axes, titles, strict=False):
        ax.set_title(title)
        ax.set_xlabel("products with K")
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[3].set_yscale("log")
    legend = axes[5]
    legend.axis("off")
    for label, color in colors.items():
        legend.plot([], [], color=color, lw=2, label=label)
    legend.plot([], [], "k.-", label="training set")
    legend.plot([], [], "kx--", label="test set")
    legend.legend(loc="center", fontsize=11, frameon=False, title="hyperparameters, compression rank R")
    fig.suptitle(
        f"IterNCGP-CG, 10-class Gaussian mixture in 3-D (N={num_train} train, {num_test} test), softmax, shared "
        "Matérn-3/2 kernel,\n≤5 solver iterations per Newton step, recycling with compression rank R"
    )
    _common.save_figure(fig, args, NAME)


if __name__ == "__main__":
    main()
