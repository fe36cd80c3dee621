"""Learn kernel hyperparameters with the Laplace evidence, and compare with scikit-learn.

Breast cancer (binary, logit link, 30 features) and digits (10 classes, softmax, 64 features), both
bundled with scikit-learn. The lengthscale and outputscale of a scaled RBF kernel are learnt by Adam
on ``-LaplaceMarginalLogLikelihood`` (exact regime for breast cancer, matrix-free for digits, where
N C exceeds ``max_cholesky_size``), and compared with scikit-learn's ``GaussianProcessClassifier``
with its optimizer on and the same kernel family (ConstantKernel * RBF; one-vs-rest for digits).

    python examples/hyperparameters.py            # a few minutes on 2 CPU cores (mostly scikit-learn)
    python examples/hyperparameters.py --smoke    # a few seconds
"""

from __future__ import annotations

import math

import _common
import gpytorch
import matplotlib.pyplot as plt
import numpy as np
import torch
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.gaussian_process import GaussianProcessClassifier
from sklearn.gaussian_process.kernels import RBF, ConstantKernel
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from tqdm.auto import tqdm

from gpytorch_iterncgp import IterNCGPStrategy, LaplaceMarginalLogLikelihood, LogitBernoulliLikelihood


def _log_positive() -> gpytorch.constraints.Positive:
    return gpytorch.constraints.Positive(transform=torch.exp, inv_transform=torch.log)


class Model(gpytorch.models.ApproximateGP):
    """Scaled RBF kernel shared by all classes, zero mean, IterNCGP inference."""

    def __init__(self, train_x, train_y, likelihood, lengthscale, quiet):
        # compression_rank bounds the recycled actions: every optimizer step adds a few, and without a
        # bound the virtual solver run over all of them would dominate the cost of a step.
        strategy = IterNCGPStrategy(
            self,
            train_x,
            train_y,
            likelihood,
            max_solver_iterations=10,
            compression_rank=64,
            show_progress=False,
            outer_tol=1e-3,
        )
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ZeroMean()
        # Log-parametrised hyperparameters: Adam's steps are then relative, so an outputscale of a few
        # hundred (as scikit-learn finds for breast cancer) is reached in tens of steps, not thousands.
        self.covar_module = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(lengthscale_constraint=_log_positive()),
            outputscale_constraint=_log_positive(),
        )
        self.covar_module.base_kernel.lengthscale = lengthscale
        self.covar_module.outputscale = 1.0

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def load(name: str, smoke: bool, seed: int = 0):
    data = load_breast_cancer() if name == "breast cancer" else load_digits()
    x, y = data.data, data.target
    # 600 digits keep scikit-learn's ten one-vs-rest GPCs (O(N³) each, per L-BFGS step) to under a minute.
    limit = 300 if smoke else (600 if name == "digits" else len(y))
    x, y = x[:limit], y[:limit]
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.3, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(x_train)
    x_train, x_test = scaler.transform(x_train), scaler.transform(x_test)
    return [torch.as_tensor(a) for a in (x_train, x_test, y_train, y_test)]


def nll_and_accuracy(probs: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Mean negative log predictive probability of the true class, and accuracy; probs (N, C)."""
    true_class = np.clip(probs[np.arange(len(y)), y], 1e-12, 1)
    return float(-np.log(true_class).mean()), float((probs.argmax(1) == y).mean())


def learn(name, x_train, y_train, x_test, y_test, steps, quiet):
    num_classes = int(y_train.max()) + 1
    if num_classes == 2:
        likelihood, targets = LogitBernoulliLikelihood(), y_train.double()
    else:
        likelihood = gpytorch.likelihoods.SoftmaxLikelihood(num_classes=num_classes, mixing_weights=False)
        targets = y_train
    model = Model(x_train, targets, likelihood, lengthscale=math.sqrt(x_train.shape[1]), quiet=quiet)
    mll = LaplaceMarginalLogLikelihood(likelihood, model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    losses = []
    model.train()
    with _common.Timer() as timer:
        for _ in tqdm(range(steps), desc=f"{name}: Adam", disable=quiet, leave=False):
            optimizer.zero_grad()
            loss = -mll(model(x_train), targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        evidence = mll(model(x_train), targets).item() * len(targets)
        probs = model.variational_strategy.predictive_probabilities(x_test).numpy()
        # The same predictions without the latent variance: the mode's own class probabilities.
        mean, _ = model.variational_strategy.marginal_latent(x_test)
        plug_in = (torch.sigmoid(mean[:, 0]) if num_classes == 2 else torch.softmax(mean, -1)).numpy()
    if num_classes == 2:
        probs, plug_in = (np.stack([1 - p, p], axis=1) for p in (probs, plug_in))
    nll, accuracy = nll_and_accuracy(probs, y_test.numpy())
    plug_in_nll, _ = nll_and_accuracy(plug_in, y_test.numpy())
    hypers = (model.covar_module.base_kernel.lengthscale.item(), model.covar_module.outputscale.item())
    return dict(
        losses=losses,
        evidence=evidence,
        nll=nll,
        plug_in_nll=plug_in_nll,
        accuracy=accuracy,
        hypers=hypers,
        seconds=timer.seconds,
    )


def sklearn_baseline(x_train, y_train, x_test, y_test):
    kernel = ConstantKernel(1.0, (1e-3, 1e4)) * RBF(math.sqrt(x_train.shape[1]), (1e-2, 1e3))
    with _common.Timer() as timer:
        classifier = GaussianProcessClassifier(kernel, random_state=0).fit(x_train.numpy(), y_train.numpy())
    probs = classifier.predict_proba(x_test.numpy())
    nll, accuracy = nll_and_accuracy(probs, y_test.numpy())

    if len(np.unique(y_train)) == 2:
        fitted = classifier.kernel_
        hypers = (fitted.k2.length_scale, fitted.k1.constant_value)
        evidence = classifier.log_marginal_likelihood_value_
    else:  # one-vs-rest: one binary GP per class, no joint evidence
        hypers, evidence = ("per class", "per class"), float("nan")

    return dict(evidence=evidence, nll=nll, accuracy=accuracy, hypers=hypers, seconds=timer.seconds)


def main():
    args = _common.parse_args(__doc__.splitlines()[0])
    _common.setup(0)
    steps = 5 if args.smoke else 80
    rows, curves = [], {}
    for name in ("breast cancer", "digits"):
        x_train, x_test, y_train, y_test = load(name, args.smoke)
        ours = learn(name, x_train, y_train, x_test, y_test, steps, args.quiet)
        theirs = sklearn_baseline(x_train, y_train, x_test, y_test)
        curves[name] = ours["losses"]
        for method, result in (("IterNCGP + Laplace evidence (Adam)", ours), ("sklearn GPC (L-BFGS)", theirs)):
            lengthscale, outputscale = result["hypers"]
            rows.append(
                [
                    name,
                    method,
                    lengthscale,
                    outputscale,
                    result["evidence"],
                    result["accuracy"],
                    result["nll"],
                    result.get("plug_in_nll", "-"),
                    result["seconds"],
                ]
            )
    _common.print_table(
        [
            "data",
            "method",
            "lengthscale",
            "outputscale",
            "log evidence",
            "test acc",
            "test NLL",
            "NLL of the mode",
            "seconds",
        ],
        rows,
        title="Learnt hyperparameters (scaled RBF kernel)",
    )
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, (name, losses) in zip(axes, curves.items(), strict=True):
        ax.plot(np.arange(1, len(losses) + 1), losses)
        ax.set_title(f"{name}: training loss")
        ax.set_xlabel("Adam step")
        ax.set_ylabel("−log evidence / N")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    _common.save_figure(fig, args, "hyperparameters")


if __name__ == "__main__":
    main()
