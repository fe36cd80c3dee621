r"""The multinomial probit likelihood and its tilted moments by nested expectation propagation.

The multinomial probit likelihood (Girolami & Rogers 2006; Riihimäki, Jylänki & Vehtari 2013, "Nested expectation
propagation for Gaussian process classification with a multinomial probit likelihood", JMLR 14:75-109) of
class :math:`y = c` given the :math:`C` latent values :math:`\mathbf f = (f_0, \dots, f_{C-1})` is

.. math::
    p(y = c \mid \mathbf f) = \int \mathcal N(u \mid 0, 1) \prod_{j \ne c} \Phi(u + f_c - f_j)\, du,

the probability that :math:`f_c + \epsilon_c` is the largest of the :math:`f_j + \epsilon_j` for independent
standard normal :math:`\epsilon_j` (:math:`u = \epsilon_c`). For :math:`C = 2` it is the binary probit
:math:`\Phi((f_c - f_{j}) / \sqrt 2)`.

* :class:`MultinomialProbitLikelihood`: the GPyTorch likelihood, :math:`p(y \mid \mathbf f)` by adaptive
  Gauss–Hermite quadrature over :math:`u` (:func:`multinomial_probit_log_probabilities`).
* :func:`multinomial_probit_moments`: the tilted moments that multi-class EP needs, by *nested* EP (Riihimäki et
  al. 2013, the nested EP section and appendix A).
"""

from __future__ import annotations

import functools
import math
from typing import Literal, NamedTuple, overload

import gpytorch
import numpy as np
import torch
from torch import Tensor
from torch.distributions import Categorical

from ..core.validation import check_count, check_nonnegative

__all__ = [
    "PREDICTIVE_TOL",
    "InnerSites",
    "MultinomialProbitLikelihood",
    "multinomial_probit_log_probabilities",
    "multinomial_probit_moments",
]

_LOG_2PI = math.log(2 * math.pi)
# Gauss-Hermite nodes of the likelihood's integral over u, centred at the integrand's mode and scaled by its width
# (log p(y | f) to about 1e-13 absolute; docs/design_notes.md).
_LIKELIHOOD_NODES = 64
_MODE_STEPS = 60
#: the inner EP's tolerance where only :math:`\log\hat Z` is used (predictive probabilities): at EP's fixed point the
#: normaliser is stationary in the sites (R&W sec. 3.6), so sites converged to a change :math:`\delta` leave it off by
#: :math:`O(\delta^2)`, below rounding here (``docs/design_notes.md``)
PREDICTIVE_TOL = 1e-6


def _working_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


@functools.lru_cache(maxsize=4)
def _hermite_rule(num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Probabilists' Gauss–Hermite nodes and log-weights normalised to sum 1: E[h(Z)], Z ~ N(0, 1)."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(num_nodes)
    return nodes, np.log(weights / weights.sum())


#: below this argument :func:`_log_cdf` takes ``torch.special.log_ndtr`` (``erfc`` underflows near -37 in float64)
_FAR_TAIL = {torch.float64: -30.0, torch.float32: -10.0}


def _log_cdf(x: Tensor) -> Tensor:
    r""":math:`\log\Phi(x) = \log\operatorname{erfc}(-x/\sqrt 2) - \log 2`, relative error about :math:`10^{-15}`
    (``erfc`` keeps its relative accuracy in the lower tail, where ``torch.special.ndtr`` does not), faster than
    ``torch.special.log_ndtr`` on a CPU, which it calls only for the far tail, where
    ``erfc`` underflows."""
    far = _FAR_TAIL.get(x.dtype, -10.0)
    result = torch.special.erfc(x.clamp_min(far) * -math.sqrt(0.5)).log() - math.log(2)
    beyond = x < far
    if bool(beyond.any()):
        result = torch.where(beyond, torch.special.log_ndtr(x), result)
    return result


def _mills_ratio(x: Tensor) -> Tensor:
    r""":math:`\rho(x) = \mathcal N(x) / \Phi(x)` in log space: finite for :math:`x \ll 0`, where it is about
    :math:`-x`."""
    return torch.exp(-0.5 * x.square() - 0.5 * _LOG_2PI - _log_cdf(x))


# ---------------------------------------------------------------------------------------------------
# The likelihood
# ---------------------------------------------------------------------------------------------------
def _integrand_mode(
    differences: Tensor, mask: Tensor, slopes: Tensor | float = 1.0, tolerance: float = 1e-9
) -> tuple[Tensor, Tensor]:
    r"""Mode :math:`\hat u` and width :math:`(-h''(\hat u))^{-1/2}` of
    :math:`h(u) = -u^2/2 + \sum_{j \ne c} \log\Phi(b_j u + d_j)`, :math:`d_j = f_c - f_j` and :math:`b_j = 1` for the
    likelihood (other :math:`d_j, b_j > 0` for :mod:`~gpytorch_iterncgp.likelihoods.factorised`).

    :math:`h` is strictly concave (:math:`h'' \le -1`) and :math:`h'(u) = -u + \sum_j b_j \rho(b_j u + d_j)` with the
    decreasing Mills ratio :math:`\rho`, so the mode lies in :math:`[0, \sum_j b_j \rho(d_j)]`; Newton's method inside
    that bracket, bisecting where a step would leave it, until every step is below ``tolerance`` widths (a mode off
    by a small part of the width still gives a valid quadrature rule, a little less accurate). ``differences``
    ``(..., C, C)`` (row :math:`c`, column :math:`j`), ``mask`` is 0 on the diagonal, ``slopes`` :math:`b`
    broadcasts with them; returns ``(..., C)`` each.
    """
    low = torch.zeros(differences.shape[:-1], dtype=differences.dtype, device=differences.device)
    high = (slopes * _mills_ratio(differences) * mask).sum(-1)
    mode = high / 2
    for _ in range(_MODE_STEPS):
        x = slopes * mode.unsqueeze(-1) + differences
        ratio = _mills_ratio(x)
        slope = -mode + (slopes * ratio * mask).sum(-1)
        curvature = 1 + (slopes * slopes * ratio * (x + ratio) * mask).sum(-1)  # -h'' >= 1
        low = torch.where(slope > 0, mode, low)
        high = torch.where(slope < 0, mode, high)
        candidate = mode + slope / curvature
        inside = (candidate > low) & (candidate < high)
        step = torch.where(inside, candidate, (low + high) / 2) - mode
        mode = mode + step
        if not bool((step.abs() > tolerance * curvature.rsqrt()).any()):
            break
    x = slopes * mode.unsqueeze(-1) + differences
    ratio = _mills_ratio(x)
    curvature = 1 + (slopes * slopes * ratio * (x + ratio) * mask).sum(-1)
    return mode, curvature.rsqrt()


def multinomial_probit_log_probabilities(function_values: Tensor, num_nodes: int = _LIKELIHOOD_NODES) -> Tensor:
    r""":math:`\log p(y = c \mid \mathbf f)` for every class :math:`c`, by adaptive Gauss–Hermite quadrature in
    :math:`u`.

    With :math:`h_c(u) = \log\mathcal N(u \mid 0, 1) + \sum_{j \ne c} \log\Phi(u + f_c - f_j)`, its mode
    :math:`\hat u_c` and width :math:`s_c = (-h_c''(\hat u_c))^{-1/2}`, and the probabilists' Gauss–Hermite rule
    :math:`(x_k, w_k)` for :math:`\mathcal N(0, 1)`,

    .. math::
        \log p(y = c \mid \mathbf f) = \log s_c + \tfrac12 \log 2\pi
        + \operatorname{logsumexp}_k \bigl(\log w_k + h_c(\hat u_c + s_c x_k) + x_k^2 / 2\bigr),

    all in log space (:func:`_log_cdf`), so that improbable classes keep their relative accuracy (about
    :math:`10^{-13}` absolute in :math:`\log p`; ``docs/design_notes.md``). The mode and width are found without
    gradient; the gradient flows through the integrand (any shift and scale give a valid rule). Work :math:`O(C^2 \cdot \text{nodes})` per point, in float64.

    :param function_values: :math:`\mathbf f`, ``(..., C)`` with :math:`C \ge 2`.
    :returns: ``(..., C)`` log-probabilities in the dtype of ``function_values``.
    """
    dtype = function_values.dtype
    f = function_values.to(_working_dtype(function_values.device))
    num_classes = f.shape[-1]
    differences = f.unsqueeze(-1) - f.unsqueeze(-2)  # [..., c, j] = f_c - f_j
    mask = 1 - torch.eye(num_classes, dtype=f.dtype, device=f.device)
    with torch.no_grad():
        mode, width = _integrand_mode(differences.detach(), mask)
    nodes, log_weights = (torch.as_tensor(a, dtype=f.dtype, device=f.device) for a in _hermite_rule(num_nodes))
    u = mode.unsqueeze(-1) + width.unsqueeze(-1) * nodes  # (..., C, nodes)
    log_cdf = _log_cdf(u.unsqueeze(-1) + differences.unsqueeze(-2))  # (..., C, nodes, C)
    log_integrand = -0.5 * u.square() - 0.5 * _LOG_2PI + (log_cdf * mask.unsqueeze(-2)).sum(-1)
    terms = log_weights + log_integrand + 0.5 * nodes.square()
    log_p = width.log() + 0.5 * _LOG_2PI + torch.logsumexp(terms, dim=-1)
    return log_p.to(dtype)


class MultinomialProbitLikelihood(gpytorch.likelihoods.Likelihood):
    r"""Multinomial probit likelihood for :math:`C`-class GP classification (Riihimäki et al. 2013):

    .. math::
        p(y = c \mid \mathbf f) = \int \mathcal N(u \mid 0, 1) \prod_{j \ne c} \Phi(u + f_c - f_j)\, du .

    The :math:`C` latent functions enter only through their differences (adding a constant to all of them changes
    nothing). Shaped like GPyTorch's :class:`~gpytorch.likelihoods.SoftmaxLikelihood` without mixing weights:
    ``likelihood(f)`` for latent values ``f`` of shape ``(..., N, C)`` (data-major, a
    :class:`~gpytorch.distributions.MultitaskMultivariateNormal`'s event shape) is a
    :class:`torch.distributions.Categorical` with batch shape ``(..., N)``; ``likelihood(function_dist)`` is the
    base class's Monte Carlo marginal. Probabilities by :func:`multinomial_probit_log_probabilities`; EP's tilted
    moments by :func:`multinomial_probit_moments`.

    :param num_classes: :math:`C \ge 2`.
    :raises ValueError: for a ``num_classes`` that is not an integer :math:`\ge 2`.
    """

    def __init__(self, num_classes: int) -> None:
        check_count(num_classes, "num_classes", minimum=2)
        super().__init__()
        self.num_classes = int(num_classes)

    def forward(self, function_samples: Tensor, *args, **kwargs) -> Categorical:
        r""":math:`p(y \mid \mathbf f)` for ``function_samples`` ``(..., N, C)``: a ``Categorical`` over ``(..., N)``.

        :raises ValueError: if the last dimension is not ``num_classes``.
        """
        if function_samples.dim() < 1 or function_samples.shape[-1] != self.num_classes:
            raise ValueError(
                f"function_samples must have shape (..., N, {self.num_classes}) (one latent value per class, "
                f"data-major), got {tuple(function_samples.shape)}."
            )
        return Categorical(logits=multinomial_probit_log_probabilities(function_samples))


# ---------------------------------------------------------------------------------------------------
# Tilted moments by nested EP
# ---------------------------------------------------------------------------------------------------
class InnerSites(NamedTuple):
    r"""The inner EP's Gaussian sites :math:`\exp(-\tfrac12 \tilde\tau_{ik} s_{ik}^2 + \tilde\nu_{ik} s_{ik})` in
    :math:`s_{ik} = u_i + f_{ic} - f_{ij_k}` (:math:`c = y_i`; :math:`j_0 < j_1 < \dots` the other classes in
    increasing order), each ``(N, C - 1)``: the inner sites of Riihimäki et al. (2013), appendix A, in their natural
    parameters. Pass them back to :func:`multinomial_probit_moments` to warm-start the next outer sweep."""

    precision: Tensor
    natural_mean: Tensor


def _check_targets(targets: Tensor, num_points: int, num_classes: int, device: torch.device) -> Tensor:
    if not torch.is_tensor(targets) or targets.dtype == torch.bool or targets.is_complex():
        raise TypeError(f"targets must be a tensor of class indices (N,), got {type(targets).__name__}.")
    if targets.shape != (num_points,):
        raise ValueError(
            f"targets must have shape ({num_points},) like cavity_mean's rows, got {tuple(targets.shape)}."
        )
    values = targets.to(torch.float64)
    invalid = ~(torch.isfinite(values) & (values == values.round()) & (values >= 0) & (values < num_classes))
    if bool(invalid.any()):
        bad = invalid.nonzero()[:5, 0].tolist()
        raise ValueError(
            f"targets must be class indices in {{0, ..., {num_classes - 1}}}; got {values[invalid][:5].tolist()} at "
            f"point(s) {bad}."
        )
    return targets.to(device=device, dtype=torch.long)


def _check_cavity(mean: Tensor, covariance: Tensor) -> None:
    for name, value in (("cavity_mean", mean), ("cavity_covariance", covariance)):
        if not torch.is_tensor(value) or not value.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {type(value).__name__}.")
    if mean.dim() != 2 or mean.shape[1] < 2:
        raise ValueError(f"cavity_mean must have shape (N, C) with C >= 2 classes, got {tuple(mean.shape)}.")
    num_points, num_classes = mean.shape
    if covariance.shape != (num_points, num_classes, num_classes):
        raise ValueError(
            f"cavity_covariance must have shape ({num_points}, {num_classes}, {num_classes}) like cavity_mean "
            f"(N, C), got {tuple(covariance.shape)}."
        )
    if not bool(torch.isfinite(mean).all()):
        bad = (~torch.isfinite(mean).all(-1)).nonzero()[:5, 0].tolist()
        raise ValueError(f"cavity_mean is NaN or infinite at point(s) {bad}.")
    work = covariance.to(_working_dtype(covariance.device))
    finite = torch.isfinite(work).flatten(1).all(-1)
    scale = work.abs().flatten(1).amax(-1)
    eps = torch.finfo(covariance.dtype).eps
    symmetric = ((work - work.mT).abs().flatten(1).amax(-1) <= 100 * eps * scale) & finite
    _, info = torch.linalg.cholesky_ex(
        torch.where(symmetric[:, None, None], work, torch.eye(num_classes, dtype=work.dtype, device=work.device))
    )
    invalid = ~symmetric | (info != 0)
    if bool(invalid.any()):
        bad = invalid.nonzero()[:5, 0].tolist()
        raise ValueError(
            f"cavity_covariance must be finite, symmetric and positive definite; it is not at point(s) {bad} "
            f"({int(invalid.sum())} in all). EP must skip (or damp) the site updates of points whose cavity "
            f"precision is not positive definite."
        )


def _check_sites(sites: InnerSites, num_points: int, num_classes: int) -> None:
    if not (isinstance(sites, tuple) and len(sites) == 2 and all(torch.is_tensor(s) for s in sites)):
        raise TypeError("sites must be InnerSites(precision, natural_mean), two tensors (N, C - 1).")
    for name, value in zip(("precision", "natural_mean"), sites, strict=True):
        if value.shape != (num_points, num_classes - 1):
            raise ValueError(
                f"sites.{name} must have shape ({num_points}, {num_classes - 1}) (N, C - 1), got {tuple(value.shape)}."
            )
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"sites.{name} is NaN or infinite.")
    if bool((sites[0] < 0).any()):
        raise ValueError("sites.precision must be non-negative (the probit factors are log-concave).")


def _root(precision: Tensor) -> Tensor:
    """Square roots of site precisions, at least sqrt(tiny) (1e-154): finite gradients for zero sites."""
    return precision.clamp_min(torch.finfo(precision.dtype).tiny).sqrt()


def _inner_posterior(
    prior_covariance: Tensor, precision: Tensor, natural_mean: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Posterior over :math:`\mathbf t` (prior :math:`\mathcal N(\mathbf 0, \mathbf K)`, sites
    :math:`(\tilde{\boldsymbol\tau}, \tilde{\boldsymbol\nu})`) as R&W Algorithm 3.5 forms it: with
    :math:`\mathbf M = \mathbf I + \tilde{\mathbf S}^{1/2}\mathbf K\tilde{\mathbf S}^{1/2} = \mathbf L\mathbf L^\top`,
    :math:`\boldsymbol\Sigma = \mathbf K - \mathbf V^\top \mathbf V`, :math:`\mathbf V = \mathbf L^{-1}
    \tilde{\mathbf S}^{1/2} \mathbf K`, :math:`\boldsymbol\mu = \boldsymbol\Sigma \tilde{\boldsymbol\nu}`.
    Returns :math:`(\boldsymbol\Sigma, \boldsymbol\mu, \mathbf L)`, batched."""
    root = _root(precision)
    eye = torch.eye(precision.shape[-1], dtype=precision.dtype, device=precision.device)
    cholesky = torch.linalg.cholesky(eye + root.unsqueeze(-1) * prior_covariance * root.unsqueeze(-2))
    v = torch.linalg.solve_triangular(cholesky, root.unsqueeze(-1) * prior_covariance, upper=False)
    covariance = prior_covariance - v.mT @ v
    covariance = (covariance + covariance.mT) / 2
    mean = (covariance @ natural_mean.unsqueeze(-1)).squeeze(-1)
    return covariance, mean, cholesky


def _probit_site(offset: Tensor, cavity_mean: Tensor, cavity_variance: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    r"""Site matching the moments of :math:`\Phi(a + t)\,\mathcal N(t \mid m, v)` (R&W eq. 3.58 and 3.59):
    with :math:`z = (a + m)/\sqrt{1 + v}`, :math:`\rho = \mathcal N(z)/\Phi(z)`, :math:`q = \rho(z + \rho)`,
    :math:`\tilde\tau = q / (1 + v(1 - q))`, :math:`\tilde\nu = (q m + \rho\sqrt{1 + v}) / (1 + v(1 - q))`
    (the differences :math:`1/\hat\sigma^2 - 1/v` and :math:`\hat\mu/\hat\sigma^2 - m/v` in closed form, free of
    cancellation). Returns :math:`(\log\Phi(z), \tilde\tau, \tilde\nu)`."""
    root = torch.sqrt(1 + cavity_variance)
    z = (offset + cavity_mean) / root
    log_cdf = torch.special.log_ndtr(z)
    ratio = torch.exp(-0.5 * z.square() - 0.5 * _LOG_2PI - log_cdf)
    q = (ratio * (z + ratio)).clamp(0, 1)
    denominator = 1 + cavity_variance * (1 - q)
    return log_cdf, q / denominator, (q * cavity_mean + ratio * root) / denominator


def _cavity(variance: Tensor, mean: Tensor, precision: Tensor, natural_mean: Tensor) -> tuple[Tensor, Tensor]:
    r"""Cavity :math:`(m_{-j}, v_{-j})` of a site from the marginal :math:`\mathcal N(\mu, \sigma^2)`:
    :math:`v_{-j} = \sigma^2 / (1 - \tilde\tau\sigma^2)`, :math:`m_{-j} = v_{-j}(\mu/\sigma^2 - \tilde\nu)`
    (R&W eq. 3.56; positive, as the probit sites' precisions are non-negative)."""
    cavity_variance = variance / (1 - precision * variance).clamp_min(torch.finfo(variance.dtype).tiny)
    return cavity_variance * (mean / variance - natural_mean), cavity_variance


class _InnerPrior(NamedTuple):
    r"""The inner EP's problem for each point (Riihimäki et al. 2013, appendix A): :math:`\mathbf s = \mathbf B
    \mathbf w \sim \mathcal N(\mathbf a, \mathbf K)`, with :math:`\mathbf D` the rows :math:`(\mathbf e_c - \mathbf
    e_{j_k})^\top`, :math:`c = y_i`, :math:`j_0 < j_1 < \dots` the other classes."""

    offset: Tensor  # a = D m (a_k = m_c - m_{j_k}), (N, C - 1)
    cross_covariance: Tensor  # G = S D^T, (N, C, C - 1)
    covariance: Tensor  # K = 1 + D S D^T, (N, C - 1, C - 1)


def _inner_prior(targets: Tensor, mean: Tensor, covariance: Tensor) -> _InnerPrior:
    r"""The prior of :math:`\mathbf s` for cavities :math:`\mathcal N(\mathbf m_i, \mathbf S_i)`.

    :param targets: :math:`y_i`, ``(N,)`` long.
    :param mean: :math:`\mathbf m_i`, ``(N, C)``.
    :param covariance: :math:`\mathbf S_i`, ``(N, C, C)``.
    """
    num_classes = mean.shape[-1]
    index = torch.arange(num_classes - 1, device=mean.device)
    others = index + (index.unsqueeze(0) >= targets.unsqueeze(1)).long()  # (N, C - 1)
    eye = torch.eye(num_classes, dtype=mean.dtype, device=mean.device)
    differences = eye[targets].unsqueeze(1) - eye[others]  # D, (N, C - 1, C)
    offset = (differences @ mean.unsqueeze(-1)).squeeze(-1)  # a_j = m_c - m_j
    cross_covariance = covariance @ differences.mT  # G = S D^T, (N, C, C - 1)
    return _InnerPrior(offset, cross_covariance, 1 + differences @ cross_covariance)  # K = 1 + D S D^T


def _initial_sites(sites: InnerSites | None, offset: Tensor) -> tuple[Tensor, Tensor]:
    r"""The inner EP's first sites :math:`(\tilde{\boldsymbol\tau}, \tilde{\boldsymbol\nu}')`, ``(N, C - 1)`` each, in
    the offset :math:`\mathbf t = \mathbf s - \mathbf a` (:math:`\tilde{\boldsymbol\nu}' = \tilde{\boldsymbol\nu} -
    \tilde{\boldsymbol\tau} \odot \mathbf a`): the given ``sites`` (in :math:`\mathbf s`), else zero sites.

    :param offset: :math:`\mathbf a`, ``(N, C - 1)``, in the working dtype.
    """
    if sites is None:
        precision = torch.zeros(offset.shape, dtype=offset.dtype, device=offset.device)
        return precision, torch.zeros_like(precision)
    num_points, num_sites = offset.shape
    _check_sites(sites, num_points, num_sites + 1)
    precision = sites.precision.to(device=offset.device, dtype=offset.dtype)
    return precision, sites.natural_mean.to(device=offset.device, dtype=offset.dtype) - precision * offset


class _InnerEP(NamedTuple):
    r"""The inner EP's final sites (in :math:`\mathbf t`) and posterior over :math:`\mathbf t`, with the Cholesky factor
    :math:`\mathbf L` of :math:`\mathbf M = \mathbf I + \tilde{\mathbf S}^{1/2}\mathbf K\tilde{\mathbf S}^{1/2}`."""

    precision: Tensor  # tau, (N, C - 1)
    natural: Tensor  # nu' = nu - tau * a, (N, C - 1)
    covariance: Tensor  # Sigma_t, (N, C - 1, C - 1)
    mean: Tensor  # mu_t, (N, C - 1)
    cholesky: Tensor  # L, (N, C - 1, C - 1)


def _inner_sweep(
    offset: Tensor, precision: Tensor, natural: Tensor, post_mean: Tensor, post_cov: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    r"""One sequential sweep of the inner EP over the :math:`C - 1` sites, batched over the points: each site from
    its cavity (R&W eq. 3.56) by probit moment matching (R&W eq. 3.58), then a rank-one update of the posterior
    (Riihimäki et al. 2013, appendix A). Updates are out of place (one-hot), so that autograd can differentiate
    through the sweeps.

    :param offset: :math:`\mathbf a`, ``(N, C - 1)``.
    :param precision: :math:`\tilde{\boldsymbol\tau}`, ``(N, C - 1)``; ``natural``: :math:`\tilde{\boldsymbol\nu}'`.
    :param post_mean: :math:`\boldsymbol\mu_t`, ``(N, C - 1)``; ``post_cov``: :math:`\boldsymbol\Sigma_t`,
        ``(N, C - 1, C - 1)``.
    :return: the new sites, mean and covariance, and each point's largest site change :math:`\max_j(|\Delta\tilde\tau_j|\,
        \sigma_j^2, |\Delta\tilde\nu_j|\,\sigma_j)` ``(N,)``.
    """
    num_sites = offset.shape[-1]
    unit = torch.eye(num_sites, dtype=offset.dtype, device=offset.device)
    change = torch.zeros(offset.shape[:-1], dtype=offset.dtype, device=offset.device)
    for k in range(num_sites):
        variance = post_cov[:, k, k]
        cav_mean, cav_var = _cavity(variance, post_mean[:, k], precision[:, k], natural[:, k])
        _, new_precision, new_natural = _probit_site(offset[:, k], cav_mean, cav_var)
        delta_precision = new_precision - precision[:, k]
        delta_natural = new_natural - natural[:, k]
        change = torch.maximum(
            change, torch.maximum(delta_precision.abs() * variance, delta_natural.abs() * variance.sqrt())
        )
        precision = precision + delta_precision.unsqueeze(-1) * unit[k]
        natural = natural + delta_natural.unsqueeze(-1) * unit[k]
        column = post_cov[:, :, k]  # rank-one update of the posterior by the site's change
        denominator = 1 + delta_precision * variance
        shift = (delta_natural - delta_precision * post_mean[:, k]) / denominator
        post_mean = post_mean + column * shift.unsqueeze(-1)
        scaled = column * (-delta_precision / denominator).unsqueeze(-1)
        post_cov = torch.addcmul(post_cov, column.unsqueeze(-1), scaled.unsqueeze(-2))  # one pass, no outer product
    return precision, natural, post_mean, post_cov, change


def _inner_ep(
    prior: Tensor, offset: Tensor, precision: Tensor, natural: Tensor, max_iterations: int, tol: float
) -> _InnerEP:
    r"""Inner EP sweeps (:func:`_inner_sweep`) from the given sites, each followed by a fresh factorisation
    (:func:`_inner_posterior`: no drift from the rank-one updates), until every site changes by at most ``tol`` or
    after ``max_iterations`` sweeps. The points are independent problems: each one stops sweeping once its own sites
    have converged, so a sweep costs in proportion to the points still moving (updates out of place, through
    ``index_put``, so that autograd still differentiates through them).

    :param prior: :math:`\mathbf K`, ``(N, C - 1, C - 1)``; ``offset``: :math:`\mathbf a`, ``(N, C - 1)``.
    :param precision: :math:`\tilde{\boldsymbol\tau}`, ``(N, C - 1)``; ``natural``: :math:`\tilde{\boldsymbol\nu}'`.
    """
    post_cov, post_mean, cholesky = _inner_posterior(prior, precision, natural)
    active = torch.arange(len(offset), device=offset.device)
    for _ in range(max_iterations):
        if not len(active):
            break
        swept = _inner_sweep(offset[active], precision[active], natural[active], post_mean[active], post_cov[active])
        sites, change = swept[:2], swept[-1]
        factors = _inner_posterior(prior[active], *sites)
        precision, natural = (
            whole.index_put((active,), part) for whole, part in zip((precision, natural), sites, strict=True)
        )
        post_cov, post_mean, cholesky = (
            whole.index_put((active,), part)
            for whole, part in zip((post_cov, post_mean, cholesky), factors, strict=True)
        )
        active = active[change.detach() > tol]
    return _InnerEP(precision, natural, post_cov, post_mean, cholesky)


def _inner_log_normaliser(offset: Tensor, inner: _InnerEP) -> Tensor:
    r""":math:`\log\hat Z_i`, ``(N,)``: the inner EP's normaliser (R&W eq. 3.65 for the inner problem, as in
    Riihimäki et al. 2013, appendix A) at the final sites and their cavities :math:`\mathcal N(t_j \mid m_{-j},
    v_{-j})`,

    .. math::
        \log\hat Z_i = \sum_{j \ne c}\Bigl[\log\Phi\Bigl(\frac{a_j + m_{-j}}{\sqrt{1 + v_{-j}}}\Bigr)
        + \frac{m_{-j}^2}{2 v_{-j}} + \frac12\log v_{-j} - \frac{\mu_{t,j}^2}{2\Sigma_{t,jj}}
        - \frac12\log\Sigma_{t,jj}\Bigr] - \sum_k \log L_{kk} + \frac12 \tilde{\boldsymbol\nu}'^\top\boldsymbol\mu_t.

    :param offset: :math:`\mathbf a`, ``(N, C - 1)``.
    """
    variance = inner.covariance.diagonal(dim1=-2, dim2=-1)
    cav_mean, cav_var = _cavity(variance, inner.mean, inner.precision, inner.natural)
    log_cdf, _, _ = _probit_site(offset, cav_mean, cav_var)
    per_site = (
        log_cdf
        + 0.5 * cav_mean.square() / cav_var
        + 0.5 * cav_var.log()
        - 0.5 * inner.mean.square() / variance
        - 0.5 * variance.log()
    )
    log_determinant = inner.cholesky.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    return per_site.sum(-1) - log_determinant + 0.5 * (inner.natural * inner.mean).sum(-1)


def _tilted_moments(
    mean: Tensor, covariance: Tensor, cross_covariance: Tensor, inner: _InnerEP
) -> tuple[Tensor, Tensor]:
    r"""The :math:`\mathbf f`-marginal of the inner posterior, by Gaussian conditioning of :math:`\mathbf f` on
    :math:`\mathbf s`:

    .. math::
        \hat{\boldsymbol\mu}_i = \mathbf m_i + \mathbf G(\tilde{\boldsymbol\nu}' - \tilde{\boldsymbol\tau} \odot
        \boldsymbol\mu_t), \qquad
        \hat{\boldsymbol\Sigma}_i = \mathbf S_i - \mathbf G\tilde{\mathbf S}^{1/2}\mathbf M^{-1}
        \tilde{\mathbf S}^{1/2}\mathbf G^\top .

    :param mean: :math:`\mathbf m_i`, ``(N, C)``; ``covariance``: :math:`\mathbf S_i`, ``(N, C, C)``.
    :param cross_covariance: :math:`\mathbf G = \mathbf S \mathbf D^\top`, ``(N, C, C - 1)``.
    :return: :math:`\hat{\boldsymbol\mu}_i` ``(N, C)`` and :math:`\hat{\boldsymbol\Sigma}_i` ``(N, C, C)``.
    """
    shift = (cross_covariance @ (inner.natural - inner.precision * inner.mean).unsqueeze(-1)).squeeze(-1)
    tilted_mean = mean + shift
    w = torch.linalg.solve_triangular(
        inner.cholesky, _root(inner.precision).unsqueeze(-1) * cross_covariance.mT, upper=False
    )
    tilted_cov = covariance - w.mT @ w
    return tilted_mean, (tilted_cov + tilted_cov.mT) / 2


def _no_points(
    mean: Tensor, covariance: Tensor, dtype: torch.dtype, return_sites: bool
) -> tuple[Tensor, Tensor, Tensor] | tuple[Tensor, Tensor, Tensor, InnerSites]:
    """The result for zero points: empty tensors of the right shapes."""
    result = (mean.new_zeros(0).to(dtype), mean.to(dtype), covariance.to(dtype))
    if return_sites:
        zeros = mean.new_zeros(0, mean.shape[-1] - 1).to(dtype)
        return (*result, InnerSites(zeros, zeros.clone()))
    return result


@overload
def multinomial_probit_moments(
    targets: Tensor,
    cavity_mean: Tensor,
    cavity_covariance: Tensor,
    *,
    max_iterations: int = ...,
    tol: float = ...,
    sites: InnerSites | None = ...,
    return_sites: Literal[False] = ...,
) -> tuple[Tensor, Tensor, Tensor]: ...


@overload
def multinomial_probit_moments(
    targets: Tensor,
    cavity_mean: Tensor,
    cavity_covariance: Tensor,
    *,
    max_iterations: int = ...,
    tol: float = ...,
    sites: InnerSites | None = ...,
    return_sites: Literal[True],
) -> tuple[Tensor, Tensor, Tensor, InnerSites]: ...


def multinomial_probit_moments(
    targets: Tensor,
    cavity_mean: Tensor,
    cavity_covariance: Tensor,
    *,
    max_iterations: int = 50,
    tol: float = 1e-10,
    sites: InnerSites | None = None,
    return_sites: bool = False,
) -> tuple[Tensor, Tensor, Tensor] | tuple[Tensor, Tensor, Tensor, InnerSites]:
    r"""Tilted moments of :math:`p(y_i \mid \mathbf f_i)\,\mathcal N(\mathbf f_i \mid \mathbf m_i, \mathbf S_i)` for the
    multinomial probit likelihood, by nested EP (Riihimäki, Jylänki & Vehtari 2013, JMLR 14:75-109; the inner
    EP of their appendix A).

    **Augmentation** (the paper's auxiliary variable :math:`u`). With :math:`c = y_i` and
    :math:`\mathbf w = (\mathbf f, u) \in \mathbb R^{C+1}`, the tilted distribution is the :math:`\mathbf f`-marginal
    of

    .. math::
        \hat Z_i^{-1}\, \mathcal N\bigl(\mathbf w \mid (\mathbf m_i, 0), \operatorname{blockdiag}(\mathbf S_i, 1)\bigr)
        \prod_{j \ne c} \Phi(\mathbf b_j^\top \mathbf w), \qquad \mathbf b_j = \mathbf e_u + \mathbf e_c - \mathbf e_j,

    and the *inner* EP approximates each probit factor by a Gaussian site in the scalar
    :math:`s_j = \mathbf b_j^\top \mathbf w`, :math:`\tilde t_j(s_j) = \tilde Z_j \exp(-\tfrac12 \tilde\tau_j s_j^2 +
    \tilde\nu_j s_j)`, by closed-form 1-D probit moment matching (R&W eq. 3.58).

    **Computation.** The factors depend on :math:`\mathbf w` only through :math:`\mathbf s = \mathbf B \mathbf w \in
    \mathbb R^{C-1}` (rows :math:`\mathbf b_j^\top`), whose prior is :math:`\mathcal N(\mathbf a, \mathbf K)`,
    :math:`a_j = m_c - m_j`, :math:`K_{jl} = 1 + (\mathbf e_c - \mathbf e_j)^\top \mathbf S (\mathbf e_c - \mathbf
    e_l)`; the inner EP runs there, on the offset :math:`\mathbf t = \mathbf s - \mathbf a` (prior mean zero: no
    cancellation for large means), sequentially over the :math:`C - 1` sites and batched over the :math:`N` points, with
    rank-one posterior updates (their appendix A) and a fresh Cholesky factorisation after each sweep. Sweeps stop when
    every site changes by less than ``tol`` (:math:`|\Delta\tilde\tau|\,\sigma^2` and :math:`|\Delta\tilde\nu|\,
    \sigma`, :math:`\sigma^2` the site's marginal variance) or after ``max_iterations``. Gaussian conditioning of
    :math:`\mathbf f` on :math:`\mathbf s` then gives the tilted mean and covariance (``_tilted_moments``), and
    :math:`\log\hat Z_i` is the inner EP's normaliser (R&W eq. 3.65 for the inner problem, as in their appendix A;
    ``_inner_log_normaliser``).

    For :math:`C = 2` there is one factor and the result is exact (binary probit in :math:`f_c - f_j` with
    variance-2 noise). For :math:`C > 2` it approximates the tilted moments (Riihimäki et al. report nested EP's
    posteriors very close to MCMC's; errors against quadrature and sweep counts: ``docs/design_notes.md``). Inner
    sweeps converge linearly. Computed in float64 (float32 on Apple's MPS).

    :param targets: ``(N,)`` class indices (integer, or floating point with integer values) in :math:`\{0, \dots,
        C - 1\}`.
    :param cavity_mean: :math:`\mathbf m_i`, ``(N, C)``, :math:`C \ge 2`.
    :param cavity_covariance: :math:`\mathbf S_i`, ``(N, C, C)``, symmetric positive definite.
    :param max_iterations: inner EP sweeps at most (Riihimäki et al. run one per outer update once warm-started).
    :param tol: inner convergence tolerance (dimensionless, see above); 0 runs all ``max_iterations``.
    :param sites: :class:`InnerSites` to start from (warm start, e.g. the previous outer sweep's), else zero sites.
    :param return_sites: also return the final :class:`InnerSites` (in :math:`s`, for the next warm start).
    :returns: ``(log_Z (N,), mean (N, C), covariance (N, C, C))`` in the dtype of ``cavity_mean`` (and the sites if
        ``return_sites``).
    :raises ValueError: for mismatched shapes, non-finite means, a cavity covariance that is not symmetric positive
        definite (naming the points), targets outside the classes, or invalid ``sites``.
    :raises TypeError: for arguments that are not tensors.
    """
    _check_cavity(cavity_mean, cavity_covariance)
    check_count(max_iterations, "max_iterations", minimum=1)
    check_nonnegative(tol, "tol")
    dtype, device = cavity_mean.dtype, cavity_mean.device
    work = _working_dtype(device)
    num_points, num_classes = cavity_mean.shape
    y = _check_targets(targets, num_points, num_classes, device)
    mean, covariance = cavity_mean.to(work), cavity_covariance.to(work)
    covariance = (covariance + covariance.mT) / 2
    if num_points == 0:
        return _no_points(mean, covariance, dtype, return_sites)
    offset, cross_covariance, prior = _inner_prior(y, mean, covariance)
    precision, natural = _initial_sites(sites, offset)
    inner = _inner_ep(prior, offset, precision, natural, max_iterations, tol)
    log_z = _inner_log_normaliser(offset, inner)
    tilted_mean, tilted_cov = _tilted_moments(mean, covariance, cross_covariance, inner)
    result = (log_z.to(dtype), tilted_mean.to(dtype), tilted_cov.to(dtype))
    if return_sites:
        return (*result, InnerSites(inner.precision.to(dtype), (inner.natural + inner.precision * offset).to(dtype)))
    return result
