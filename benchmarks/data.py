"""The benchmarks' data, in one container: the paper's Gaussian mixture, scikit-learn's digits and the real data sets of
:mod:`benchmarks.real_data`."""

from __future__ import annotations

import torch

from benchmarks import real_data
from benchmarks.problem import TENSORS, Data
from gpytorch_iterncgp.datasets import gaussian_mixture

__all__ = ["TENSORS", "Data", "load"]


def _digits(smoke: bool, seed: int) -> Data:
    """All 1797 of scikit-learn's digits (``smoke``: 300), a stratified 70/30 split by ``seed``, features standardised
    on the training part (float64)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    if smoke:
        x, y = x[:300], y[:300]
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.3, stratify=y, random_state=seed)
    scaler = StandardScaler().fit(x_train)
    tensors = [torch.as_tensor(a) for a in (scaler.transform(x_train), y_train, scaler.transform(x_test), y_test)]
    return Data("digits", tensors[0], tensors[1].long(), tensors[2], tensors[3].long(), 10)


def load(name: str, smoke: bool, seed: int) -> Data:
    """The data set ``name``: ``mixture<N>`` (the paper's 10-class mixture in 3-D, N training and 2000 test points,
    the samples drawn by ``seed``), ``binary<N>`` (its classes 0-4 against 5-9), ``digits``, or a real data set of
    :mod:`benchmarks.real_data` (split by ``seed``); smaller with ``smoke``."""
    if name in real_data.NAMES:
        return real_data.load(name, smoke, seed)
    if name == "digits":
        return _digits(smoke, seed)
    num_train = 200 if smoke else int(name.removeprefix("mixture").removeprefix("binary"))
    train_x, train_y, test_x, test_y = gaussian_mixture(
        num_train, 100 if smoke else 2000, sample_seed=seed, dtype=torch.float64
    )
    if name.startswith("binary"):
        return Data(name, train_x, (train_y >= 5).long(), test_x, (test_y >= 5).long(), 2)
    return Data(name, train_x, train_y, test_x, test_y, 10)
