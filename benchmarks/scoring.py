"""How the benchmarks that learn their kernels score a method: test log-loss and accuracy (mean Poisson deviance for
counts) against the method's own wall time, the evaluations not counted, and a run's score at a time and its spread
over seeds."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

#: the smallest probability a log-loss takes the logarithm of: float64's machine epsilon, where
#: ``sklearn.metrics.log_loss`` clips, so that every benchmark's log-loss is scikit-learn's
PROBABILITY_FLOOR = torch.finfo(torch.float64).eps


def log_loss(probabilities: Tensor, labels: Tensor) -> dict[str, float]:
    """Test NLL (mean negative log probability of the true class, clamped at :data:`PROBABILITY_FLOOR`) and accuracy;
    ``probabilities`` ``(N*, C)``, or ``(N*,)`` for :math:`p(y = 1)`. Every benchmark scores by this function or by
    ``sklearn.metrics.log_loss``, which agree."""
    if probabilities.dim() == 1:
        probabilities = torch.stack([1 - probabilities, probabilities], dim=-1)
    probabilities = probabilities.double()
    labels = labels.long().to(probabilities.device)
    true_class = probabilities.gather(-1, labels[:, None])[:, 0].clamp_min(PROBABILITY_FLOOR)
    accuracy = (probabilities.argmax(-1) == labels).double().mean()
    return {"nll": float(-true_class.log().mean()), "accuracy": float(accuracy)}


def poisson_deviance(means: Tensor, counts: Tensor) -> dict[str, float]:
    """Mean Poisson deviance of the predicted means ``(N*,)`` (clipped at 1e-12) against the test counts
    (scikit-learn's ``mean_poisson_deviance``)."""
    from sklearn.metrics import mean_poisson_deviance

    predicted = means.detach().double().clamp_min(1e-12).cpu().numpy()
    return {"deviance": float(mean_poisson_deviance(counts.double().cpu().numpy(), predicted))}


class Clock:
    """Wall time of a method's own work: :meth:`evaluate` blocks (the evaluations) are not counted."""

    def __init__(self) -> None:
        self.start, self.paused_seconds = time.perf_counter(), 0.0

    def elapsed(self) -> float:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the work queued so far, not only launched
        return time.perf_counter() - self.start - self.paused_seconds

    def evaluate(
        self,
        history: list[dict],
        predictions: Callable[[], Tensor],
        labels: Tensor,
        score: Callable[[Tensor, Tensor], dict[str, float]] = log_loss,
        **extra,
    ) -> dict:
        """Score ``predictions()`` against ``labels`` by ``score`` (:func:`log_loss` of class probabilities, or
        :func:`poisson_deviance` of predicted means) into ``history``, the time spent not counted."""
        now, tic = self.elapsed(), time.perf_counter()
        with torch.no_grad():
            entry = {"time": now, **score(predictions(), labels), **extra}
        history.append(entry)
        self.paused_seconds += time.perf_counter() - tic
        return entry


def nll_at(run: dict, seconds: float, metric: str = "nll") -> float:
    """The run's test NLL (or another ``metric`` of its history) at its last evaluation within ``seconds`` (5% grace:
    a run of a 120 s budget is scored at about 120.1 s; NaN if none)."""
    entries = [entry for entry in run["history"] if entry["time"] <= 1.05 * seconds]
    return entries[-1][metric] if entries else math.nan


def spread(values: list[float]) -> dict:
    """Mean, (population) standard deviation and count of the values that are not NaN."""
    values = [value for value in values if not math.isnan(value)]
    if not values:
        return {"mean": math.nan, "std": math.nan, "n": 0}
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "n": len(values)}
