"""The quickstart of the README runs: fit, eval-mode posterior, GPyTorch's own predictive."""

import gpytorch
import torch

from tests.common import IterNCGPModel, binary_data


def test_quickstart_binary_probit():
    train_x, train_y = binary_data(num_data=40)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = IterNCGPModel(train_x, train_y, likelihood)
    report = model.variational_strategy.fit()
    assert report.steps >= 1 and report.kernel_products == report.solver_iterations + report.covariance_products
    model.eval()
    latent = model(torch.rand(7, 2, dtype=torch.float64))
    probs = likelihood(latent).probs
    assert probs.shape == (7,) and bool(((probs > 0) & (probs < 1)).all())
