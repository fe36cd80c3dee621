r"""The estimators on real tabular data beside what practitioners use instead: the default kernel and ``kernel="auto"``
(chosen by the evidence) against LogisticRegression, HistGradientBoosting and SVGP, several splits, in one run.

    python -m benchmarks.tabular                                  # the panel, splits 0 1 2 (hours on 2 cores)
    python -m benchmarks.tabular --datasets phoneme doctor_visits --seeds 0 1
    python -m benchmarks.tabular --smoke                          # tiny, seconds (the tests run it)

Data: :data:`benchmarks.real_data.TABULAR` (nine classification sets) and :data:`benchmarks.real_data.COUNTS` (two
count sets), and on request :data:`benchmarks.real_data.LARGE` (two sets where the estimators use stochastic EP),
80/20 splits by the seed, features standardised on the training part. Methods, one after the other on
``--threads`` threads:

* ``estimator``: ``IterNCGPClassifier(kernel=None, random_state=seed)`` (``IterNCGPPoissonRegressor`` for counts): the
  Matérn alone, the other parameters at their defaults;
* ``estimator_auto``: the same with ``kernel="auto"`` (a kernel of
  :data:`gpytorch_iterncgp.learning.estimator_policy.AUTO_KERNELS`, by the held-out score:
  :func:`gpytorch_iterncgp.learning.estimator_policy.auto_kernel_names`); the chosen kernel, why, and every
  candidate's selection scores are recorded;
* ``estimator_negbin``, ``estimator_negbin_auto`` (counts): ``IterNCGPNegativeBinomialRegressor`` with the Matérn
  alone and with ``kernel="auto"``; the learnt dispersion is recorded;
* ``estimator_matern_ard``, ``estimator_linear+matern``, ``estimator_linear+matern_ard``: the estimator with that
  kernel of the family (``estimator`` is ``"matern"``'s), learnt as the default is: each candidate's own test score,
  so that the rules of choice (BIC, the evidence, the held-out score: ``estimator_auto``'s recorded scores) compare
  on the test set (the summary's ``rules``);
* ``constant``: the constant predictor, which ignores the inputs: the training rows' class frequencies (their mean
  count for counts); a model above its score predicts worse than knowing nothing about the inputs;
* ``logistic``, ``boosting``: scikit-learn's ``LogisticRegression`` and ``HistGradientBoostingClassifier``
  (:func:`benchmarks.gpytorch_door.run_sklearn`); for counts ``PoissonRegressor`` and
  ``HistGradientBoostingRegressor(loss="poisson")`` (their defaults, 1000 iterations for the GLM, early stopping);
* ``gpc`` (on request only, ``--methods gpc``: :math:`O(N^3)` a step): scikit-learn's
  ``GaussianProcessClassifier(ConstantKernel() * RBF(1.0))``, its learnt lengthscale and outputscale recorded;
* ``svgp``: GPyTorch's SVGP learning its kernel (100 inducing inputs per latent, Adam at 0.01, batches of 1024; for
  counts the Poisson likelihood of the exponential link, :func:`benchmarks.svgp.run_svgp`) for ``--budget`` seconds,
  scored at the seconds ``estimator_auto`` took (``estimator_negbin_auto`` where run: equal time) and at the end.

Scores: test log-loss and accuracy (classification), mean Poisson deviance (counts; scikit-learn's
``mean_poisson_deviance`` of the predicted means), and seconds. Writes ``results/tabular.json`` (with the machine)
and ``results/tabular.png``, and prints a table per data set: mean ± standard deviation over the splits.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import add_smoke_flag, write_results
from benchmarks.data import Data, load
from benchmarks.gpytorch_door import run_sklearn
from benchmarks.real_data import COUNTS, LARGE, MID_SIZE, TABULAR
from benchmarks.scoring import log_loss, nll_at, poisson_deviance, spread
from benchmarks.svgp import run_svgp
from gpytorch_iterncgp.kernels.family import kernel_family
from gpytorch_iterncgp.sklearn import IterNCGPClassifier, IterNCGPNegativeBinomialRegressor, IterNCGPPoissonRegressor

RESULTS = Path(__file__).resolve().parent / "results"
#: the estimator with each kernel of the family but the default (``estimator``), by the kernel's name
FAMILY = {f"estimator_{name}": name for name in kernel_family(1) if name != "matern"}
#: the family's kernels by the method that fits each
KERNEL_METHODS = {"matern": "estimator", **{name: method for method, name in FAMILY.items()}}
CLASSIFICATION_METHODS = ("estimator", "estimator_auto", *FAMILY, "constant", "logistic", "boosting", "svgp")
#: the negative binomial regressor (overdispersed counts), with the Matérn alone and with ``kernel="auto"``
NEGATIVE_BINOMIAL = {"estimator_negbin": None, "estimator_negbin_auto": "auto"}
COUNT_METHODS = ("estimator", "estimator_auto", *FAMILY, *NEGATIVE_BINOMIAL, "constant", "poisson", "boosting", "svgp")
#: classification methods run only where ``--methods`` names them
ON_REQUEST = ("gpc",)
#: the estimators SVGP is scored at the seconds of (equal time): the last of these a run fits
EQUAL_TIME_METHODS = ("estimator_auto", "estimator_negbin_auto")


def _estimator(
    data: Data, seed: int, kernel: str | None, negative_binomial: bool = False, learning_subset: int | str = "auto"
) -> dict:
    """The package's estimator with its defaults and ``kernel`` (``None``: the Matérn alone, ``"auto"``, or a name of the
    family), for counts the Poisson or (``negative_binomial``) the negative binomial regressor; its scores, seconds,
    kernel (and the negative binomial's dispersion)."""
    counts = data.num_classes == 0
    regressor = IterNCGPNegativeBinomialRegressor if negative_binomial else IterNCGPPoissonRegressor
    estimator_type = regressor if counts else IterNCGPClassifier
    if kernel not in (None, "auto"):
        kernel = kernel_family(data.train_x.shape[1])[kernel]
    estimator = estimator_type(kernel=kernel, learning_subset=learning_subset, random_state=seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        estimator.fit(data.train_x.numpy(), data.train_y.numpy())
        seconds = time.perf_counter() - start
    report = estimator.learning_report_
    return {
        "seconds": seconds,
        "inference": estimator.inference_,
        "kernel": report.kernel,
        "kernel_choice": None if estimator.kernel_choice_ is None else str(estimator.kernel_choice_),
        "kernel_scores": report.kernel_scores,
        "dispersion": getattr(estimator, "dispersion_", None),
        # the learning as it ended: the last and least -evidence / M (Adam's estimates where M C > 1000), and the
        # held-out log-loss at the outputscale factor chosen (classifiers learnt on a subset)
        "learning": {
            "rows": report.data_points,
            "last_loss": report.losses[-1] if report.losses else None,
            "least_loss": min(report.losses) if report.losses else None,
            "outputscale_factor": report.outputscale_factor,
            "held_out": report.outputscale_scores.get(report.outputscale_factor),
            "seconds": report.seconds,
        },
        "warnings": sorted({warning.category.__name__ for warning in caught}),
        **_test_score(estimator, data),
    }


def _test_score(estimator, data: Data) -> dict:
    """The fitted estimator's test log-loss and accuracy, or mean Poisson deviance for counts."""
    if data.num_classes == 0:
        return _deviance(estimator.predict(data.test_x.numpy()), data.test_y)
    return _log_loss(estimator.predict_proba(data.test_x.numpy()), data.test_y)


def _log_loss(probabilities: np.ndarray, labels: torch.Tensor) -> dict:
    return log_loss(torch.as_tensor(probabilities), labels)


def _deviance(means: np.ndarray, counts: torch.Tensor) -> dict:
    return poisson_deviance(torch.as_tensor(means), counts)


def _count_baseline(data: Data, method: str, seed: int) -> dict:
    """scikit-learn's ``PoissonRegressor`` or ``HistGradientBoostingRegressor(loss="poisson")``; scores, seconds."""
    from sklearn.ensemble import HistGradientBoostingRegressor
    from sklearn.linear_model import PoissonRegressor

    model = (
        PoissonRegressor(max_iter=1000)
        if method == "poisson"
        else HistGradientBoostingRegressor(loss="poisson", early_stopping=True, random_state=seed)
    )
    start = time.perf_counter()
    model.fit(data.train_x.numpy(), data.train_y.numpy())
    seconds = time.perf_counter() - start
    return {
        "label": type(model).__name__,
        "seconds": seconds,
        **_deviance(model.predict(data.test_x.numpy()), data.test_y),
    }


def _constant(data: Data) -> dict:
    """The constant predictor of the training rows (class frequencies, or the mean count): its test score."""
    if data.num_classes == 0:
        return {
            "label": "mean count",
            "seconds": 0.0,
            **poisson_deviance(
                torch.full_like(data.test_y, float(data.train_y.double().mean()), dtype=torch.float64), data.test_y
            ),
        }
    frequencies = torch.bincount(data.train_y, minlength=data.num_classes).double() / len(data.train_y)
    return {
        "label": "class frequencies",
        "seconds": 0.0,
        **log_loss(frequencies.expand(len(data.test_y), -1), data.test_y),
    }


def _gpc(data: Data, seed: int) -> dict:
    """scikit-learn's ``GaussianProcessClassifier(ConstantKernel() * RBF(1.0))`` (one-vs-rest for several classes):
    its scores, seconds and learnt kernel (the first estimator's, one-vs-rest)."""
    from sklearn.gaussian_process import GaussianProcessClassifier
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel

    model = GaussianProcessClassifier(ConstantKernel() * RBF(1.0), random_state=seed)
    start = time.perf_counter()
    model.fit(data.train_x.numpy(), data.train_y.numpy())
    seconds = time.perf_counter() - start
    fitted = model.base_estimator_
    kernel = (fitted.estimators_[0] if hasattr(fitted, "estimators_") else fitted).kernel_
    return {
        "label": "GaussianProcessClassifier(ConstantKernel() * RBF(1.0))",
        "seconds": seconds,
        "lengthscale": float(kernel.k2.length_scale),
        "outputscale": float(kernel.k1.constant_value),
        **_log_loss(model.predict_proba(data.test_x.numpy()), data.test_y),
    }


def run_method(
    data: Data, method: str, seed: int, budget: float, equal_time: float | None, learning_subset: int | str = "auto"
) -> dict:
    """One method on one split: its scores and seconds (SVGP: scored at ``equal_time`` seconds and at the end); the
    estimators learn on ``learning_subset`` rows."""
    if method in NEGATIVE_BINOMIAL:
        return _estimator(data, seed, NEGATIVE_BINOMIAL[method], True, learning_subset)
    if method.startswith("estimator"):
        kernel = "auto" if method == "estimator_auto" else FAMILY.get(method)
        return _estimator(data, seed, kernel, learning_subset=learning_subset)
    if method == "constant":
        return _constant(data)
    if method == "gpc":
        return _gpc(data, seed)
    if method == "svgp":
        latents = data.num_classes if data.num_classes > 2 else 1
        run = run_svgp(data, 100 * latents, 0.01, budget, seed)
        last = run["history"][-1]
        metric = "deviance" if data.num_classes == 0 else "nll"
        at = math.nan if equal_time is None else nll_at(run, equal_time, metric)
        scores = {metric: last[metric], **({} if metric == "deviance" else {"accuracy": last["accuracy"]})}
        return {
            "label": run["label"],
            "seconds": last["time"],
            **scores,
            f"{metric}_at_equal_time": at,
            "equal_time": equal_time,
        }
    if data.num_classes == 0:
        return _count_baseline(data, method, seed)
    run = run_sklearn(data, method, seed)
    (entry,) = run["history"]
    return {"label": run["label"], "seconds": entry["time"], "nll": entry["nll"], "accuracy": entry["accuracy"]}


def summary(rows: list[dict]) -> dict:
    """Per data set and method: mean ± sd of the score (test NLL, or deviance for counts), the accuracy and the
    seconds over the splits; and per data set whether ``estimator_auto``'s mean score is at or below the lower of
    the two scikit-learn baselines', and below SVGP's at equal time."""
    result: dict[str, dict] = {}
    for name in sorted({row["dataset"] for row in rows}):
        chosen = [row for row in rows if row["dataset"] == name]
        metric = "deviance" if chosen[0]["counts"] else "nll"
        methods = {method: [row["methods"][method] for row in chosen] for method in chosen[0]["methods"]}
        entry = {
            method: {
                metric: spread([run[metric] for run in runs]),
                "seconds": spread([run["seconds"] for run in runs]),
                **({} if metric == "deviance" else {"accuracy": spread([run["accuracy"] for run in runs])}),
            }
            for method, runs in methods.items()
        }
        if "svgp" in methods:
            at_equal_time = f"{metric}_at_equal_time"
            entry["svgp"][at_equal_time] = spread([run[at_equal_time] for run in methods["svgp"]])
        if "estimator_auto" in methods and all(name in methods for name in ("estimator", *FAMILY)):
            entry["estimator_auto"]["rules"] = _rules(chosen, metric)
        baselines = [entry[m][metric]["mean"] for m in ("logistic", "boosting", "poisson") if m in entry]
        for method in ("estimator", "estimator_auto"):
            if method in entry and baselines:
                entry[method]["at_or_below_baselines"] = entry[method][metric]["mean"] <= min(baselines)
            if method in entry and "constant" in methods:  # on every split: never worse than ignoring the inputs
                pairs = zip(methods[method], methods["constant"], strict=True)
                entry[method]["below_constant"] = all(run[metric] < constant[metric] for run, constant in pairs)
        result[name] = {"metric": metric, "methods": entry}
    return result


def _rules(rows: list[dict], metric: str) -> dict:
    """Per rule of choice (each of ``estimator_auto``'s selection scores, the default kernel ``matern``, and the best
    on the test set, ``oracle``): the kernel each split would have chosen, and the mean ± sd over the splits of the
    test score of the estimator with that kernel (``estimator`` for ``matern``, ``estimator_<name>`` otherwise)."""
    rules: dict[str, dict] = {}
    for rule in ("bic", "evidence", "held_out", "matern", "oracle"):
        kernels, scores = [], []
        for row in rows:
            tested = {name: row["methods"][method][metric] for name, method in KERNEL_METHODS.items()}
            scored = {
                name: score
                for name, score in row["methods"]["estimator_auto"]["kernel_scores"].items()
                if score["error"] is None
            }
            if rule in ("matern", "oracle"):
                kernels.append("matern" if rule == "matern" else min(tested, key=tested.__getitem__))
            elif scored and all(score[rule] is not None for score in scored.values()):
                kernels.append(min(scored, key=lambda name: scored[name][rule]))
            else:
                break
            scores.append(tested[kernels[-1]])
        if len(kernels) == len(rows):
            rules[rule] = {"kernels": kernels, metric: spread(scores)}
    return rules


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    figure, axes = plt.subplots(1, len(names), figsize=(2.6 * len(names), 3.4), squeeze=False)
    for axis, name in zip(axes[0], names, strict=True):
        entry = results[name]
        methods = list(entry["methods"])
        means = [entry["methods"][m][entry["metric"]]["mean"] for m in methods]
        errors = [entry["methods"][m][entry["metric"]]["std"] for m in methods]
        axis.bar(range(len(methods)), means, yerr=errors, color=[f"C{i}" for i in range(len(methods))])
        axis.set_xticks(range(len(methods)), methods, rotation=60, fontsize=7)
        axis.set_title(name, fontsize=9)
        axis.set_ylabel("test " + ("Poisson deviance" if entry["metric"] == "deviance" else "log-loss"), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--datasets", nargs="+", default=[*TABULAR, *COUNTS], choices=[*TABULAR, *COUNTS, *LARGE, *MID_SIZE, "chess"]
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        choices=sorted({*CLASSIFICATION_METHODS, *COUNT_METHODS, *ON_REQUEST}),
        help="default: all that apply to each data set",
    )
    parser.add_argument("--budget", type=float, default=240.0, help="SVGP's seconds")
    parser.add_argument("--threads", type=int, default=1)
    add_smoke_flag(parser, "300 training rows a set (150 learnt on, so kernel='auto' has rows to choose by), SVGP 2 s")
    parser.add_argument("--out", type=Path, default=RESULTS / "tabular.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.budget = min(args.budget, 2.0)
    learning_subset = 150 if args.smoke else "auto"
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.datasets:
        for seed in args.seeds:
            data = load(name, args.smoke, seed)
            counts = data.num_classes == 0
            allowed = COUNT_METHODS if counts else (*CLASSIFICATION_METHODS[:-1], *ON_REQUEST, "svgp")
            methods, equal_time = {}, None
            chosen = [m for m in allowed if (m not in ON_REQUEST and args.methods is None) or m in (args.methods or ())]
            for method in chosen:  # (SVGP last)
                methods[method] = run_method(data, method, seed, args.budget, equal_time, learning_subset)
                if method in EQUAL_TIME_METHODS:
                    equal_time = methods[method]["seconds"]
            rows.append(
                {"dataset": name, "seed": seed, "counts": counts, "num_train": data.num_train, "methods": methods}
            )
            score = "deviance" if counts else "nll"
            print(
                f"{name} split {seed}: "
                + ", ".join(f"{m} {r[score]:.4f} ({r['seconds']:.0f} s)" for m, r in methods.items()),
                flush=True,
            )
            write_results(args.out, "tabular", argv, rows=rows, summary=summary(rows))  # (after every split)
    results = summary(rows)
    plot(results, args.out.with_suffix(".png"))
    return {"rows": rows, "summary": results}


if __name__ == "__main__":
    main()
