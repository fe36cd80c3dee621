"""The estimators' ``device``: where the model lives and computes; numpy in and out on every device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")
from sklearn.datasets import make_classification  # noqa: E402

from gpytorch_iterncgp.sklearn import IterNCGPClassifier, IterNCGPPoissonRegressor  # noqa: E402

# N C = 600 > 1000 / 2: CG with the solver budget, recycling, the preconditioner and the covariance phase all run
OPTIONS = dict(random_state=0, optimizer_steps=3)


def _three_classes():
    return make_classification(
        n_samples=200, n_features=3, n_informative=3, n_redundant=0, n_classes=3, n_clusters_per_class=1, random_state=1
    )


def _counts():
    generator = np.random.default_rng(2)
    x = generator.normal(size=(150, 2))
    return x, generator.poisson(np.exp(0.5 * x[:, 0]))


def test_device_cpu_is_the_default_and_everything_stays_numpy():
    x, y = _three_classes()
    default = IterNCGPClassifier(inference="laplace", **OPTIONS).fit(x, y)
    explicit = IterNCGPClassifier(inference="laplace", device=torch.device("cpu"), **OPTIONS).fit(x, y)
    assert IterNCGPClassifier().get_params()["device"] == "cpu"
    assert next(default.model_.parameters()).device.type == "cpu"
    np.testing.assert_array_equal(default.predict_proba(x), explicit.predict_proba(x))
    mean, std = default.predict_latent(x[:5])
    assert isinstance(mean, np.ndarray) and isinstance(std, np.ndarray) and mean.shape == (5, 3)


@pytest.mark.parametrize("device", ["gpu", "cuda:x", 3.5])
def test_a_device_torch_does_not_know_is_refused_naming_the_parameter(device):
    with pytest.raises(ValueError, match="'device' parameter of IterNCGPClassifier must be a torch device"):
        IterNCGPClassifier(device=device).fit(np.zeros((4, 1)), np.array([0, 1, 0, 1]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is available here")
def test_cuda_without_a_gpu_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"torch.cuda.is_available\(\) is False\): use device='cpu'"):
        IterNCGPPoissonRegressor(device="cuda").fit(np.zeros((4, 1)), np.array([0, 1, 2, 1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("inference", ["laplace", "ep"])
def test_estimators_on_cuda_equal_the_cpu_ones(inference):
    """Float64 on both: the same fit to rounding (the random draws are the CPU generator's on both devices)."""
    x, y = _three_classes()
    on_cpu = IterNCGPClassifier(inference=inference, **OPTIONS).fit(x, y)
    on_cuda = IterNCGPClassifier(inference=inference, device="cuda", **OPTIONS).fit(x, y)
    assert next(on_cuda.model_.parameters()).device.type == "cuda"
    np.testing.assert_allclose(on_cuda.predict_proba(x), on_cpu.predict_proba(x), rtol=1e-6, atol=1e-8)
    counts_x, counts = _counts()
    cpu_counts = IterNCGPPoissonRegressor(**OPTIONS).fit(counts_x, counts)
    cuda_counts = IterNCGPPoissonRegressor(device="cuda", **OPTIONS).fit(counts_x, counts)
    np.testing.assert_allclose(cuda_counts.predict(counts_x), cpu_counts.predict(counts_x), rtol=1e-6)
