"""A GP latent variable model for binary data: 2-D embeddings of binarised digits, beside PCA and GPyTorch's
Gaussian Bayesian GPLVM.

Data: scikit-learn's bundled 8 x 8 digits, a stratified subset of 600 images (``--smoke``: 100), pixels binarised
(intensity > 8 of 16); pixels on in fewer than 5 % or more than 95 % of the subset's images are dropped (the
models share one constant prior mean, so a nearly constant column would only cost its GP a large offset).

Three 2-D embeddings of the same binary matrix Y (N x P):

* **PCA** (scikit-learn) of Y;
* **GPyTorch's ``BayesianGPLVM``** (Titsias & Lawrence 2010 with a *Gaussian* likelihood, as in GPyTorch's GPLVM
  tutorial): ``VariationalLatentVariable`` q(X) from PCA, P batched GPs with a constant mean and an RBF-ARD kernel,
  25 inducing inputs, Adam on ``VariationalELBO``;
* **EP GP-LVM** (:class:`~gpytorch_iterncgp.gplvm.EPLatentVariableModel`): the same q(X) and prior N(0, I), the
  *probit* likelihood ``BernoulliLikelihood`` with one EP per pixel column under the expected DTC prior of 25
  inducing inputs, Adam on the bound L_H (eq. S.33-S.35); both GP-LVMs start from the same PCA.

The number reported is the 5-nearest-neighbour accuracy of the digit labels in each 2-D space (scikit-learn's
``KNeighborsClassifier(5)``, 5-fold stratified cross-validation on the embedding): how well each embedding keeps the
digits apart. The table goes to the terminal and to ``binary_gplvm_digits.json``, the scatter plots to
``binary_gplvm_digits.png``.

    python examples/binary_gplvm_digits.py            # about 5 minutes on one (shared) core
    python examples/binary_gplvm_digits.py --smoke    # seconds
"""

from __future__ import annotations

import json

import _common
import gpytorch
import matplotlib.pyplot as plt
import numpy as np
import torch
from gpytorch.models.gplvm import BayesianGPLVM, VariationalLatentVariable
from gpytorch.variational import CholeskyVariationalDistribution, VariationalStrategy
from sklearn.datasets import load_digits
from sklearn.decomposition import PCA
from sklearn.model_selection import StratifiedKFold, cross_val_score, train_test_split
from sklearn.neighbors import KNeighborsClassifier
from tqdm.auto import tqdm

from gpytorch_iterncgp.gplvm import EPLatentVariableModel, pca_initialisation

NAME = "binary_gplvm_digits"
LATENT_DIM = 2
NUM_INDUCING = 25


def load(num_points: int) -> tuple[torch.Tensor, np.ndarray]:
    """A stratified subset of the digits, binarised, near-constant pixels dropped: ``(N, P)`` and the labels."""
    images, labels = load_digits(return_X_y=True)
    _, images, _, labels = train_test_split(images, labels, test_size=num_points, stratify=labels, random_state=0)
    binary = torch.tensor(images > 8, dtype=torch.float64)
    frequency = binary.mean(0)
    return binary[:, (frequency > 0.05) & (frequency < 0.95)], labels


def knn_accuracy(embedding: np.ndarray, labels: np.ndarray) -> float:
    """5-NN accuracy of the labels, 5-fold stratified cross-validation."""
    folds = StratifiedKFold(5, shuffle=True, random_state=0)
    return float(cross_val_score(KNeighborsClassifier(5), embedding, labels, cv=folds).mean())


class GaussianGPLVM(BayesianGPLVM):
    """GPyTorch's Bayesian GPLVM (its tutorial's model): P batched SVGPs on a shared variational q(X)."""

    def __init__(self, data: torch.Tensor, initial_means: torch.Tensor):
        num_points, num_outputs = data.shape
        self.batch_shape = torch.Size([num_outputs])
        generator = torch.Generator().manual_seed(0)
        inducing = initial_means[torch.randperm(num_points, generator=generator)[:NUM_INDUCING]]
        inducing = inducing.expand(num_outputs, -1, -1).clone()
        q_u = CholeskyVariationalDistribution(NUM_INDUCING, batch_shape=self.batch_shape)
        q_f = VariationalStrategy(self, inducing, q_u, learn_inducing_locations=True)
        prior_x = gpytorch.priors.NormalPrior(torch.zeros(num_points, LATENT_DIM), torch.ones(num_points, LATENT_DIM))
        latent = VariationalLatentVariable(num_points, num_outputs, LATENT_DIM, initial_means.clone(), prior_x)
        super().__init__(latent, q_f)
        self.mean_module = gpytorch.means.ConstantMean(batch_shape=self.batch_shape)
        self.covar_module = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(ard_num_dims=LATENT_DIM, batch_shape=self.batch_shape),
            batch_shape=self.batch_shape,
        )

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def run_gaussian_gplvm(data: torch.Tensor, initial_means: torch.Tensor, steps: int, quiet: bool) -> np.ndarray:
    """GPyTorch's Bayesian GPLVM, full batch, Adam (lr 0.01) on the ELBO, as in its tutorial."""
    model = GaussianGPLVM(data, initial_means)
    likelihood = gpytorch.likelihoods.GaussianLikelihood(batch_shape=model.batch_shape)
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=len(data))
    optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=0.01)
    model.train()
    likelihood.train()
    for _ in tqdm(range(steps), desc="BayesianGPLVM (Gaussian): Adam on the ELBO", disable=quiet, leave=False):
        optimizer.zero_grad()
        loss = -mll(model(model.sample_latent_variable()), data.mT).sum()
        loss.backward()
        optimizer.step()
    return model.X.q_mu.detach().numpy()


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    _common.setup(0)
    num_points, ep_steps, gaussian_steps = (100, 10, 100) if args.smoke else (600, 250, 2000)
    data, labels = load(num_points)
    initial_means = pca_initialisation(data, LATENT_DIM)
    embeddings, seconds = {}, {}

    with _common.Timer() as timer:
        embeddings["PCA"] = PCA(LATENT_DIM).fit_transform(data.numpy())
    seconds["PCA"] = timer.seconds

    with _common.Timer() as timer:
        embeddings["Gaussian BayesianGPLVM (GPyTorch)"] = run_gaussian_gplvm(
            data.float(), initial_means.float(), gaussian_steps, args.quiet
        )
    seconds["Gaussian BayesianGPLVM (GPyTorch)"] = timer.seconds

    with _common.Timer() as timer:
        model = EPLatentVariableModel(
            data, LATENT_DIM, NUM_INDUCING, initial_means=initial_means, damping=0.9, site_tol=1e-3
        )
        losses = model.fit(num_steps=ep_steps, lr=0.05, show_progress=not args.quiet)
        embeddings["EP GP-LVM (probit)"] = model.embedding().numpy()
    seconds["EP GP-LVM (probit)"] = timer.seconds
    assert all(report.converged for report in model.last_reports), "EP did not converge in some column"
    probabilities = model.predict_proba(model.embedding(), model.latent_variances().detach())
    train_nll = float(-torch.distributions.Bernoulli(probs=probabilities).log_prob(data).mean())

    accuracy = {name: knn_accuracy(embedding, labels) for name, embedding in embeddings.items()}
    _common.print_table(
        ["embedding", "5-NN accuracy", "seconds"],
        [[name, accuracy[name], seconds[name]] for name in embeddings],
        title=f"2-D embeddings of {len(data)} binarised digits ({data.shape[1]} pixels)",
    )
    print(
        f"EP GP-LVM: -L_H / N from {losses[0]:.4f} to {losses[-1]:.4f} in {ep_steps} steps; reconstruction NLL per "
        f"pixel at the embedding {train_nll:.4f}"
    )

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for axis, (name, embedding) in zip(axes, embeddings.items(), strict=True):
        scatter = axis.scatter(embedding[:, 0], embedding[:, 1], c=labels, cmap="tab10", s=9, vmin=-0.5, vmax=9.5)
        axis.set_title(f"{name}\n5-NN accuracy {accuracy[name]:.3f}")
        axis.set_xticks([])
        axis.set_yticks([])
    figure.colorbar(scatter, ax=axes, ticks=range(10), label="digit")
    _common.save_figure(figure, args, NAME)

    summary = {
        "num_points": len(data),
        "num_pixels": int(data.shape[1]),
        "latent_dim": LATENT_DIM,
        "num_inducing": NUM_INDUCING,
        "ep_steps": ep_steps,
        "gaussian_gplvm_steps": gaussian_steps,
        "knn_accuracy": accuracy,
        "seconds": seconds,
        "ep_loss_first_last": [losses[0], losses[-1]],
        "ep_reconstruction_nll_per_pixel": train_nll,
        "smoke": args.smoke,
    }
    json_path = args.out / f"{NAME}.json"
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"saved {json_path}")


if __name__ == "__main__":
    main()
