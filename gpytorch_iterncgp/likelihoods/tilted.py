r"""Tilted moments for expectation propagation (EP): :math:`\log \hat Z_i`, :math:`\hat\mu_i`, :math:`\hat\sigma_i^2`.

EP (Minka 2001; Rasmussen & Williams 2006, R&W sec. 3.6) replaces each likelihood factor by a Gaussian site.
A site update needs the zeroth, first and second moments of the *tilted* distribution of one latent value,

.. math::
    \hat q_i(f) = \hat Z_i^{-1}\, p(y_i \mid f)\, \mathcal N(f \mid \mu_{-i}, \sigma_{-i}^2), \qquad
    \hat Z_i = \int p(y_i \mid f)\, \mathcal N(f \mid \mu_{-i}, \sigma_{-i}^2)\, df,

where :math:`\mathcal N(\mu_{-i}, \sigma_{-i}^2)` is the cavity (R&W eq. 3.56-3.57). :func:`tilted_moments` returns
:math:`(\log\hat Z_i, \hat\mu_i, \hat\sigma_i^2)` for every point at once, for the package's :math:`C = 1` likelihoods
(the adapters with ``has_tilted_moments``; each picks its rule in ``checked_tilted_moments``):

* **probit** (:class:`~gpytorch_iterncgp.likelihoods.adapters.ProbitBernoulliAdapter`): closed form, R&W eq. 3.58
  (:func:`probit_moments`);
* **logit**, **Poisson with exp link**, **Poisson with softplus link**: quadrature at the tilted mode
  (:func:`quadrature_moments`), with the likelihood's own node spacing, log-density and bracket of the mode
  (:class:`QuadratureLikelihood`).

This module sits below :mod:`~gpytorch_iterncgp.likelihoods.adapters`: it knows the adapters only through the two
protocols :class:`TiltedLikelihood` and :class:`QuadratureLikelihood`.

All are computed in float64 (float32 on devices without float64, e.g. Apple's MPS) whatever the input dtype, and
returned in the input dtype and on the input device: the work is :math:`O(N \times \text{nodes})`, small beside one
product with the kernel matrix, and large counts need float64 to form :math:`\log p(y \mid f)` differences.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

_LOG_2PI = math.log(2 * math.pi)
_TAIL = 40.0  # the quadrature interval ends where the tilted density is e^-40 (4e-18) of its peak
_SEARCH_RATIO = 1.25  # geometric search for the interval's ends, in units of the width at the mode
_WIDTH_STEP = 0.7  # node spacing at most 0.7 widths at the mode: trapezoid error ~ 2 exp(-2 pi^2 / 0.7^2) ~ 6e-18
_MIN_NODES, _MAX_NODES = 33, 8193
_CHUNK = 1 << 21  # points x nodes per block of the quadrature (16 MiB of float64)
_NEWTON_STEPS = 200


class TiltedLikelihood(Protocol):
    r"""What :func:`tilted_moments` needs of a likelihood adapter."""

    has_tilted_moments: bool  # EP with one scalar site per point: checked_tilted_moments is defined

    def check_targets(self, targets: Tensor, dtype: torch.dtype) -> Tensor:
        """Validated targets ``(N,)`` as a floating tensor of ``dtype``."""
        ...

    def checked_tilted_moments(
        self, targets: Tensor, cavity_mean: Tensor, cavity_variance: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        r""":math:`(\log\hat Z_i, \hat\mu_i, \hat\sigma_i^2)` ``(N,)`` each for checked inputs in the working dtype."""
        ...


class QuadratureLikelihood(Protocol):
    r"""The per-likelihood parts of :func:`tilted_mode` and :func:`quadrature_moments` (a log-concave :math:`C = 1`
    likelihood)."""

    # Node spacing at most this many units of f, set by the likelihood's strip of analyticity: the trapezoid error is
    # ~ exp(-2 pi d / h) for an integrand analytic and bounded in |Im f| < d.
    quadrature_step: float

    def _terms(self, latent: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        r"""Elementwise :math:`\log p(y \mid f)`, gradient :math:`g` and curvature :math:`W`."""
        ...

    def quadrature_log_likelihood(self, latent: Tensor, targets: Tensor) -> Tensor:
        r""":math:`\log p(y \mid f)` elementwise, in the form the quadrature sums."""
        ...

    def tilted_mode_limit(self, targets: Tensor, cavity_mean: Tensor, cavity_variance: Tensor, slope: Tensor) -> Tensor:
        r"""A point the tilted mode cannot pass on the side of :math:`\mu_-` that ``slope`` :math:`= \psi'(\mu_-)`
        points to (:math:`\pm\infty` for none)."""
        ...


def _working_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def _check_cavity(cavity_mean: Tensor, cavity_variance: Tensor, num_points: int) -> None:
    for name, value in (("cavity_mean", cavity_mean), ("cavity_variance", cavity_variance)):
        if not torch.is_tensor(value) or not value.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {type(value).__name__}.")
        if value.shape != (num_points,):
            raise ValueError(f"{name} must have shape ({num_points},) like the targets, got {tuple(value.shape)}.")
    if not bool(torch.isfinite(cavity_mean).all()):
        bad = (~torch.isfinite(cavity_mean)).nonzero()[:5, 0].tolist()
        raise ValueError(f"cavity_mean is NaN or infinite at point(s) {bad}.")
    invalid = ~(torch.isfinite(cavity_variance) & (cavity_variance > 0))
    if bool(invalid.any()):
        bad = invalid.nonzero()[:5, 0].tolist()
        values = cavity_variance[invalid][:5].tolist()
        raise ValueError(
            f"cavity_variance must be positive and finite; got {values} at point(s) {bad} "
            f"({int(invalid.sum())} in all). EP must skip sites whose cavity precision is not positive."
        )


def tilted_moments(
    adapter: TiltedLikelihood, targets: Tensor, cavity_mean: Tensor, cavity_variance: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Moments of the tilted distributions :math:`p(y_i \mid f)\,\mathcal N(f \mid \mu_{-i}, \sigma_{-i}^2)`.

    :param adapter: a :math:`C = 1` likelihood adapter from :func:`~gpytorch_iterncgp.likelihoods.adapters.likelihood_adapter`
        with ``has_tilted_moments`` (probit, logit, Poisson exp or softplus link); its ``checked_tilted_moments``
        computes the moments from the checked inputs in the working dtype.
    :param targets: ``(N,)`` labels in {0, 1} or counts.
    :param cavity_mean: :math:`\mu_{-i}`, ``(N,)``.
    :param cavity_variance: :math:`\sigma_{-i}^2`, ``(N,)``, positive and finite.
    :returns: :math:`\log\hat Z_i`, :math:`\hat\mu_i`, :math:`\hat\sigma_i^2`, each ``(N,)`` in the dtype and on the
        device of ``cavity_mean``.
    :raises ValueError: for a cavity variance that is not positive and finite (a negative cavity precision: EP's
        sweep must skip that site), a non-finite cavity mean, mismatched shapes or targets outside the support.
    :raises TypeError: for a likelihood without tilted moments here (softmax, autograd likelihoods).
    """
    if not adapter.has_tilted_moments:
        raise TypeError(
            f"tilted moments are implemented for the probit, logit, Poisson (exp) and Poisson (softplus) likelihoods; "
            f"got {type(adapter).__name__}."
        )
    if not (torch.is_tensor(cavity_mean) and torch.is_tensor(cavity_variance)):
        raise TypeError(
            f"cavity_mean and cavity_variance must be tensors (N,), got {type(cavity_mean).__name__} and "
            f"{type(cavity_variance).__name__}."
        )
    dtype, device = cavity_mean.dtype, cavity_mean.device
    work = _working_dtype(device)
    y = adapter.check_targets(targets, work).to(device)
    _check_cavity(cavity_mean, cavity_variance, len(y))
    mean, variance = cavity_mean.to(work), cavity_variance.to(work)
    moments = adapter.checked_tilted_moments(y, mean, variance)
    return tuple(m.to(dtype) for m in moments)  # type: ignore[return-value]


def probit_moments(targets: Tensor, cavity_mean: Tensor, cavity_variance: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    r"""Closed-form tilted moments for the probit likelihood :math:`\Phi(s f)`, :math:`s = 2y - 1` (R&W eq. 3.58):

    .. math::
        z = \frac{s\mu_-}{\sqrt{1 + \sigma_-^2}}, \quad \log\hat Z = \log\Phi(z), \quad
        \hat\mu = \mu_- + \frac{s\sigma_-^2 \rho}{\sqrt{1 + \sigma_-^2}}, \quad
        \hat\sigma^2 = \sigma_-^2 - \frac{\sigma_-^4 \rho (z + \rho)}{1 + \sigma_-^2},

    with :math:`\rho = \mathcal N(z)/\Phi(z) = \exp(\log\mathcal N(z) - \log\Phi(z))` in log space
    (``torch.special.log_ndtr``), so that it stays finite for :math:`z \ll 0` (where :math:`\rho \approx -z`).
    For :math:`z \to -\infty` the factor :math:`\rho(z + \rho) \to 1` is formed with a relative rounding error of
    about :math:`z^2 \epsilon`, i.e. 4e-13 at :math:`z = -40` in float64. Shapes ``(N,)``.
    """
    sign = 2 * targets - 1
    root = torch.sqrt(1 + cavity_variance)
    z = sign * cavity_mean / root
    log_cdf = torch.special.log_ndtr(z)
    ratio = torch.exp(-0.5 * z.square() - 0.5 * _LOG_2PI - log_cdf)
    mean = cavity_mean + sign * cavity_variance * ratio / root
    variance = cavity_variance - cavity_variance.square() * ratio * (z + ratio) / (1 + cavity_variance)
    return log_cdf, mean, variance


def tilted_mode(
    adapter: QuadratureLikelihood, targets: Tensor, cavity_mean: Tensor, cavity_variance: Tensor
) -> tuple[Tensor, Tensor]:
    r"""Mode :math:`\hat f` and width :math:`s = (W(\hat f) + 1/\sigma_-^2)^{-1/2}` of each tilted density.

    :math:`\psi(f) = \log p(y \mid f) - (f - \mu_-)^2/(2\sigma_-^2)` is strictly concave (log-concave likelihood), so
    :math:`\psi'(f) = g(f) - (f - \mu_-)/\sigma_-^2` (the adapter's closed-form gradient :math:`g` and curvature
    :math:`W`) has one root. It lies between :math:`\mu_-` and :math:`\mu_- + \sigma_-^2 g(\mu_-)` (as
    :math:`\psi'' \le -1/\sigma_-^2`), and between :math:`\mu_-` and the adapter's ``tilted_mode_limit`` (the
    likelihood's own mode; for the Poisson exp link with :math:`y = 0`,
    :math:`\mu_- - W_0(\sigma_-^2 e^{\mu_-}) \ge \mu_- - \log(1 + \sigma_-^2 e^{\mu_-})`, Lambert's :math:`W_0`). Newton's method on :math:`\psi'` inside that bracket, bisecting where a step would leave
    it or fails to halve the step before (a safeguarded Newton method, as ``rtsafe`` of Press et al.,
    *Numerical Recipes*), converges from any cavity; iterations stop when every Newton step is below
    :math:`10^{-10} s`. Shapes ``(N,)``.
    """
    terms = adapter._terms

    def slope_and_curvature(f: Tensor) -> tuple[Tensor, Tensor]:
        _, gradient, curvature = terms(f, targets)
        return gradient - (f - cavity_mean) / cavity_variance, curvature + 1 / cavity_variance

    slope, _ = slope_and_curvature(cavity_mean)
    far = cavity_mean + cavity_variance * slope
    limit = adapter.tilted_mode_limit(targets, cavity_mean, cavity_variance, slope)
    far = torch.where(slope > 0, torch.minimum(far, limit), torch.maximum(far, limit))
    low, high = torch.minimum(cavity_mean, far), torch.maximum(cavity_mean, far)
    mode = cavity_mean.clone()
    previous = high - low  # the step before: Newton steps must halve it (Press et al., Numerical Recipes, rtsafe)
    for _ in range(_NEWTON_STEPS):
        slope, curvature = slope_and_curvature(mode)
        low = torch.where(slope > 0, torch.maximum(low, mode), low)
        high = torch.where(slope < 0, torch.minimum(high, mode), high)
        step = slope / curvature
        candidate = mode + step
        # False for NaN (an overflowing exp far out) and for slow steps, which bisect instead
        newton = (candidate >= low) & (candidate <= high) & (2 * step.abs() <= previous)
        mode_next = torch.where(newton, candidate, (low + high) / 2)
        width = curvature.rsqrt()
        done = (slope == 0) | (newton & (step.abs() <= 1e-10 * width)) | (high - low <= 1e-10 * width)
        previous = torch.where(done, previous, (mode_next - mode).abs())
        mode = torch.where(done, mode, mode_next)
        if bool(done.all()):
            break
    _, curvature = slope_and_curvature(mode)
    return mode, curvature.rsqrt()


def quadrature_moments(
    adapter: QuadratureLikelihood, targets: Tensor, cavity_mean: Tensor, cavity_variance: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Tilted moments by the trapezoid rule on a grid fitted to each tilted density, in log space.

    With :math:`\psi` as in :func:`tilted_mode`, its mode :math:`\hat f` and width :math:`s`,

    .. math::
        \log\hat Z = \psi(\hat f) - \tfrac12\log(2\pi\sigma_-^2) + \log \sum_k h\, e^{\psi(f_k) - \psi(\hat f)}, \quad
        \hat\mu = \hat f + \sum_k w_k t_k, \quad \hat\sigma^2 = \sum_k w_k (t_k - \hat\mu + \hat f)^2,

    :math:`t_k = f_k - \hat f`, :math:`w = \operatorname{softmax}_k(\psi(f_k))` (logsumexp accumulation).
    The nodes :math:`f_k` are equally spaced (step :math:`h`) over the interval where
    :math:`\psi \ge \psi(\hat f) - 40`; its ends are found by a geometric search outwards from :math:`\hat f` in steps
    of :math:`1.25^j s`, capped at :math:`\sqrt{80}\,\sigma_-` (where :math:`\psi'' \le -1/\sigma_-^2` guarantees
    the drop). For a smooth integrand decaying at both ends the trapezoid rule converges geometrically, with error
    about :math:`e^{-2\pi d / h}` for an integrand analytic in the strip :math:`|\operatorname{Im} f| < d`, so
    :math:`h \le \min(0.7 s, h_\ell)`: 0.7 widths at the mode, and the adapter's ``quadrature_step`` :math:`h_\ell`
    = 0.6 (logit, softplus: poles or branch points of the link at :math:`\pm i\pi`) or 0.3 (exp: :math:`e^{-e^f}` is
    bounded for :math:`|\operatorname{Im} f| \le \pi/2`). The number of nodes is the largest any point of the batch needs
    (between 33 and 8193; beyond that, for logit cavities wider than sd ~ 2000, the step grows and accuracy drops).

    Why not Gauss–Hermite at the mode: when the cavity is much wider than the likelihood's scale (logit or
    Poisson with :math:`\sigma_- \gtrsim 3`) the tilted density is a Gaussian cut off by a soft wall of width
    ~1 (e.g. :math:`\mathcal N(0, 100^2)\,\sigma(f)`), its width at the mode is tens of units, and Gauss–Hermite
    nodes that far apart step over the wall (errors of both rules against adaptive quadrature:
    ``docs/design_notes.md``).
    Shapes ``(N,)``.
    """
    mode, width = tilted_mode(adapter, targets, cavity_mean, cavity_variance)
    peak_likelihood = adapter.quadrature_log_likelihood(mode, targets)
    offset = mode - cavity_mean

    def drop(t: Tensor, rows: slice = slice(None)) -> Tensor:
        """:math:`\\psi(\\hat f + t) - \\psi(\\hat f)` for offsets ``t`` ``(n, k)``, without cancelling the Gaussian."""
        y, variance = targets[rows, None], cavity_variance[rows, None]
        likelihood = adapter.quadrature_log_likelihood(mode[rows, None] + t, y) - peak_likelihood[rows, None]
        return likelihood - t * (2 * offset[rows, None] + t) / (2 * variance)

    # the interval: where psi first falls 40 below its peak, searching outwards geometrically
    cap = math.sqrt(2 * _TAIL) * cavity_variance.sqrt()
    ratio = float((cap / width).detach().max().clamp_min(1))
    num_search = max(1, math.ceil(math.log(ratio) / math.log(_SEARCH_RATIO)) + 1)
    factors = _SEARCH_RATIO ** torch.arange(num_search, dtype=mode.dtype, device=mode.device)
    distances = torch.minimum(width[:, None] * factors, cap[:, None])  # (N, J), last column = cap
    distances = torch.cat([distances, cap[:, None]], dim=1)
    reach = []
    for direction in (-1.0, 1.0):
        below = drop(direction * distances) < -_TAIL
        below[:, -1] = True
        first = below.to(torch.int8).argmax(dim=1)
        reach.append(distances.gather(1, first[:, None])[:, 0])
    left, right = reach
    step_bound = torch.clamp(_WIDTH_STEP * width, max=adapter.quadrature_step)
    needed = float(((left + right) / step_bound).detach().max())
    num_nodes = int(min(max(math.ceil(needed) + 1, _MIN_NODES), _MAX_NODES))
    step = (left + right) / (num_nodes - 1)
    grid = torch.linspace(0, 1, num_nodes, dtype=mode.dtype, device=mode.device)

    log_z, centre, spread = [], [], []
    chunk = max(1, _CHUNK // num_nodes)
    for start in range(0, len(mode), chunk):
        rows = slice(start, start + chunk)
        t = -left[rows, None] + (left + right)[rows, None] * grid  # (n, K)
        log_density = drop(t, rows)
        log_sum = torch.logsumexp(log_density, dim=1)
        weights = torch.exp(log_density - log_sum[:, None])
        first = (weights * t).sum(1)
        log_z.append(log_sum + step[rows].log())
        centre.append(first)
        spread.append((weights * (t - first[:, None]).square()).sum(1))
    log_integral, shift, variance = torch.cat(log_z), torch.cat(centre), torch.cat(spread)
    log_partition = peak_likelihood - offset.square() / (2 * cavity_variance) - 0.5 * (_LOG_2PI + cavity_variance.log())
    return log_partition + log_integral, mode + shift, variance
