"""IterNCGPClassifier as a scikit-learn estimator, next to scikit-learn's GaussianProcessClassifier.

Breast cancer (569 points, 30 features, binary) and 1000 digits (64 features, 10 classes), both bundled
with scikit-learn, standardised, 70/30 split. Both classifiers use a scaled Matérn-5/2 kernel whose
lengthscale and outputscale they learn from the Laplace evidence: IterNCGP by Adam (25 steps; for the
digits a softmax over 10 classes with one shared kernel and the matrix-free evidence; once more with
``solver_options={"compression_rank": 50}``), scikit-learn by L-BFGS (one-vs-rest for the digits: ten binary GPs, each with its
own hyperparameters). The table gives test accuracy, log-loss and fit time; the figure the reliability
diagrams (confidence against accuracy). numpy's BLAS gets ``--threads`` threads like torch.

    python examples/sklearn_quickstart.py            # a few minutes on 2 CPU cores
    python examples/sklearn_quickstart.py --smoke    # a few seconds
"""

from __future__ import annotations

import math

import _common
import matplotlib.pyplot as plt
import numpy as np
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.gaussian_process import GaussianProcessClassifier
from sklearn.gaussian_process.kernels import ConstantKernel, Matern
from sklearn.metrics import accuracy_score, log_loss
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from gpytorch_iterncgp.sklearn import IterNCGPClassifier


def load(name: str, smoke: bool, seed: int = 0):
    data = load_breast_cancer() if name == "breast cancer" else load_digits()
    x, y = data.data, data.target
    # 1000 digits keep scikit-learn's ten one-vs-rest GPCs (O(N³) each, per L-BFGS step) to about a minute.
    limit = 200 if smoke else (1000 if name == "digits" else len(y))
    return train_test_split(x[:limit], y[:limit], test_size=0.3, random_state=seed, stratify=y[:limit])


def classifiers(num_features: int, smoke: bool) -> dict:
    sklearn_kernel = ConstantKernel(1.0, (1e-3, 1e4)) * Matern(math.sqrt(num_features), (1e-2, 1e3), nu=2.5)
    return {
        # default kernel ScaleKernel(MaternKernel(nu=2.5)), lengthscale sqrt(D), outputscale 1; 25 Adam steps
        "IterNCGPClassifier()": IterNCGPClassifier(optimizer_steps=3 if smoke else 25, random_state=0),
        # at most 50 recycled actions kept: bounded cost per Adam step, more computational uncertainty
        'IterNCGPClassifier(solver_options={"compression_rank": 50})': IterNCGPClassifier(
            solver_options={"compression_rank": 50}, optimizer_steps=3 if smoke else 25, random_state=0
        ),
        # --smoke: scikit-learn's kernel stays fixed (its L-BFGS takes half a minute even on 175 digits)
        "sklearn GaussianProcessClassifier": GaussianProcessClassifier(
            sklearn_kernel, optimizer=None if smoke else "fmin_l_bfgs_b", random_state=0
        ),
    }


def reliability(probs: np.ndarray, y: np.ndarray, bins: int = 10):
    """Mean confidence and accuracy of the top class per confidence bin (bins with data only)."""
    confidence, correct = probs.max(1), probs.argmax(1) == y
    edges = np.linspace(0, 1, bins + 1)
    index = np.clip(np.digitize(confidence, edges) - 1, 0, bins - 1)
    used = [b for b in range(bins) if np.any(index == b)]
    return [confidence[index == b].mean() for b in used], [correct[index == b].mean() for b in used]


def main():
    args = _common.parse_args(__doc__.splitlines()[0])
    threadpool_limits(args.threads)  # numpy's BLAS (scikit-learn) gets as many threads as torch: a fair race
    rows = []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, name in zip(axes, ("breast cancer", "digits"), strict=True):
        x_train, x_test, y_train, y_test = load(name, args.smoke)
        for label, classifier in classifiers(x_train.shape[1], args.smoke).items():
            pipeline = make_pipeline(StandardScaler(), classifier)
            with _common.Timer() as timer:
                pipeline.fit(x_train, y_train)
            probs = pipeline.predict_proba(x_test)
            classes = pipeline.classes_
            accuracy = accuracy_score(y_test, classes[probs.argmax(1)])
            rows.append([name, label, len(y_train), accuracy, log_loss(y_test, probs, labels=classes), timer.seconds])
            if not args.quiet:
                print(f"{name}: {label} done in {timer.seconds:.1f} s")
            confidence, hits = reliability(probs, np.searchsorted(classes, y_test))
            ax.plot(confidence, hits, "o-", label=label)
        ax.plot([0, 1], [0, 1], "k:", lw=1)
        ax.set_title(f"{name}: reliability (test)")
        ax.set_xlabel("confidence of the predicted class")
        ax.set_ylabel("accuracy")
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
    _common.print_table(
        ["data", "classifier", "N train", "test acc", "test log-loss", "fit seconds"],
        rows,
        title="Scaled Matérn-5/2 kernel, hyperparameters from the Laplace evidence",
    )
    fig.tight_layout()
    _common.save_figure(fig, args, "sklearn_quickstart")


if __name__ == "__main__":
    main()
