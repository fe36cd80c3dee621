r"""Tilted moments of the multinomial probit likelihood under a factorised cavity, for EP whose sites factorise
over the classes.

Scalable multi-class EP (Villacampa-Calvo & Hernández-Lobato 2017, "Scalable multi-class Gaussian process
classification using expectation propagation", ICML) approximates the posterior of :math:`C` independent latent
processes by a Gaussian that factorises over the classes; each point's cavity is then a product of :math:`C`
independent Gaussians :math:`\mathcal N(f_j \mid \mu_j, \sigma_j^2)`. Here with the package's multinomial probit
likelihood (:mod:`~gpytorch_iterncgp.likelihoods.multinomial_probit`) instead of their robust-max. Integrating out
:math:`f_j`, :math:`j \ne c = y`, and writing :math:`w = u + f_c \sim \mathcal N(\mu_c, 1 + \sigma_c^2)`, the tilted
normaliser is one-dimensional:

.. math::
    \hat Z = \int \mathcal N(w \mid \mu_c, 1 + \sigma_c^2) \prod_{j \ne c} \Phi\Bigl(\frac{w - \mu_j}
    {\sqrt{1 + \sigma_j^2}}\Bigr)\, dw
    = \mathbb E_{t \sim \mathcal N(0, 1)} \prod_{j \ne c} \Phi(a_j + b_j t), \quad
    a_j = \frac{\mu_c - \mu_j}{s_j}, \; b_j = \frac{\sqrt{1 + \sigma_c^2}}{s_j}, \; s_j = \sqrt{1 + \sigma_j^2},

computed by Gauss–Hermite quadrature at the integrand's mode in log space, as the likelihood itself
(:func:`~gpytorch_iterncgp.likelihoods.multinomial_probit.multinomial_probit_log_probabilities`). It is the
predictive probability of :math:`y` under the independent marginals. The moments follow from the derivatives of
:math:`\log\hat Z` (Minka 2001; Seeger 2005, "Expectation propagation for exponential families"):
:math:`\hat\mu_j = \mu_j + \sigma_j^2 \alpha_j`, :math:`\hat\sigma_j^2 = \sigma_j^2 - \sigma_j^4(\alpha_j^2 -
2\beta_j)` with :math:`\alpha = \partial\log\hat Z/\partial\boldsymbol\mu`, :math:`\beta = \partial\log\hat Z /
\partial\boldsymbol\sigma^2`, by automatic differentiation through the quadrature. The work is :math:`O(C \cdot
\text{nodes})` per point, against nested EP's :math:`O(C^3)` per inner sweep for a full :math:`C \times C` cavity.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core.validation import check_count
from .multinomial_probit import (
    _LIKELIHOOD_NODES,
    _check_targets,
    _hermite_rule,
    _integrand_mode,
    _log_cdf,
    _working_dtype,
)

_LOG_2PI = math.log(2 * math.pi)
# the mode to this many widths: the moments move far less than the 64-node rule's own error (docs/design_notes.md)
_MODE_TOLERANCE = 1e-3
_CHUNK = 1 << 21  # points x nodes x classes per block of the predictive's quadrature (16 MiB of float64)
_MAX_RULE_NODES = 256  # numpy's Gauss–Hermite weights underflow past 370 nodes; 256 is the benchmarks' reference


def _check_marginals(cavity_mean: Tensor, cavity_variance: Tensor) -> None:
    for name, value in (("cavity_mean", cavity_mean), ("cavity_variance", cavity_variance)):
        if not torch.is_tensor(value) or not value.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {type(value).__name__}.")
    if cavity_mean.dim() != 2 or cavity_mean.shape[1] < 2:
        raise ValueError(f"cavity_mean must have shape (N, C) with C >= 2 classes, got {tuple(cavity_mean.shape)}.")
    if cavity_variance.shape != cavity_mean.shape:
        raise ValueError(
            f"cavity_variance must have the shape of cavity_mean {tuple(cavity_mean.shape)}, got "
            f"{tuple(cavity_variance.shape)}."
        )
    invalid = ~(torch.isfinite(cavity_mean) & torch.isfinite(cavity_variance) & (cavity_variance > 0)).all(-1)
    if bool(invalid.any()):
        bad = invalid.nonzero()[:5, 0].tolist()
        raise ValueError(
            f"the cavity must have finite means and positive finite variances; it has not at point(s) {bad} "
            f"({int(invalid.sum())} in all). EP must skip the sites of points whose cavity precision is not positive."
        )


def factorised_log_normalizer(
    targets: Tensor, cavity_mean: Tensor, cavity_variance: Tensor, num_nodes: int = _LIKELIHOOD_NODES
) -> Tensor:
    r""":math:`\log\hat Z_i` (module docstring), differentiable in the cavity.

    :param targets: ``(N,)`` class indices in :math:`\{0, \dots, C - 1\}`.
    :param cavity_mean: :math:`\mu_{ij}`, ``(N, C)``; ``cavity_variance``: :math:`\sigma_{ij}^2`, ``(N, C)``, positive.
    :param num_nodes: Gauss–Hermite nodes of the integral over :math:`u`, centred at its integrand's mode and scaled
        by its width (``docs/design_notes.md`` on the count), 1 to 256.
    :returns: ``(N,)`` in the dtype of ``cavity_mean`` (computed in float64).
    """
    check_count(num_nodes, "num_nodes", minimum=1)
    if num_nodes > _MAX_RULE_NODES:
        raise ValueError(
            f"num_nodes must be at most {_MAX_RULE_NODES} (numpy's Gauss–Hermite weights underflow past 370), "
            f"got {num_nodes}."
        )
    _check_marginals(cavity_mean, cavity_variance)
    dtype = cavity_mean.dtype
    num_points, num_classes = cavity_mean.shape
    y = _check_targets(targets, num_points, num_classes, cavity_mean.device)
    work = _working_dtype(cavity_mean.device)
    mean, variance = cavity_mean.to(work), cavity_variance.to(work)
    scale = (1 + variance).sqrt()  # s_j
    own_mean = mean.gather(-1, y[:, None])  # mu_c (N, 1)
    own_scale = scale.gather(-1, y[:, None])  # sqrt(1 + sigma_c^2)
    offsets, slopes = (own_mean - mean) / scale, own_scale / scale  # a_j, b_j (N, C)
    mask = torch.ones_like(mean).scatter_(-1, y[:, None], 0.0)
    with torch.no_grad():
        mode, width = _integrand_mode(offsets.detach(), mask, slopes.detach(), _MODE_TOLERANCE)
    nodes, log_weights = (torch.as_tensor(a, dtype=work, device=mean.device) for a in _hermite_rule(num_nodes))
    t = mode.unsqueeze(-1) + width.unsqueeze(-1) * nodes  # (N, nodes)
    log_cdf = _log_cdf(offsets.unsqueeze(-2) + slopes.unsqueeze(-2) * t.unsqueeze(-1))  # (N, nodes, C)
    log_integrand = -0.5 * t.square() - 0.5 * _LOG_2PI + (log_cdf * mask.unsqueeze(-2)).sum(-1)
    terms = log_weights + log_integrand + 0.5 * nodes.square()
    return (width.log() + 0.5 * _LOG_2PI + torch.logsumexp(terms, dim=-1)).to(dtype)


def factorised_moments(
    targets: Tensor, cavity_mean: Tensor, cavity_variance: Tensor, num_nodes: int = _LIKELIHOOD_NODES
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Tilted moments of :math:`p(y_i \mid \mathbf f_i) \prod_j \mathcal N(f_{ij} \mid \mu_{ij}, \sigma_{ij}^2)`
    projected on the factorised family: :math:`\log\hat Z_i` and each class's :math:`\hat\mu_{ij} = \mu_{ij} +
    \sigma_{ij}^2\alpha_{ij}`, :math:`\hat\sigma_{ij}^2 = \sigma_{ij}^2 - \sigma_{ij}^4(\alpha_{ij}^2 - 2\beta_{ij})`
    (module docstring), from one pass of the quadrature and one backward pass through it for :math:`\alpha, \beta`.

    Where the cavity requires gradient, :math:`\log\hat Z_i` is differentiable in it with the same :math:`\alpha,
    \beta` as gradient (its first-order expansion at the cavity: the same value, no second backward pass through
    the quadrature), so that an objective built from it costs nothing more; the moments are without gradient.

    :param targets: ``(N,)`` class indices.
    :param cavity_mean: ``(N, C)``; ``cavity_variance``: ``(N, C)``, positive.
    :param num_nodes: the quadrature's nodes (:func:`factorised_log_normalizer`).
    :returns: ``(log_Z (N,), mean (N, C), variance (N, C))`` in the dtype of ``cavity_mean``.
    :raises ValueError: for mismatched shapes, non-finite means, non-positive variances or targets outside the
        classes.
    """
    work, dtype = _working_dtype(cavity_mean.device), cavity_mean.dtype
    mean = cavity_mean.detach().to(work).requires_grad_(True)
    variance = cavity_variance.detach().to(work).requires_grad_(True)
    with torch.enable_grad():  # also under no_grad: alpha and beta are derivatives
        log_z = factorised_log_normalizer(targets, mean, variance, num_nodes)
        alpha, beta = torch.autograd.grad(log_z.sum(), (mean, variance))
    log_z, mean, variance = log_z.detach(), mean.detach(), variance.detach()
    tilted_mean = mean + variance * alpha
    tilted_variance = variance - variance.square() * (alpha.square() - 2 * beta)
    if torch.is_grad_enabled() and (cavity_mean.requires_grad or cavity_variance.requires_grad):
        shift = (alpha * (cavity_mean.to(work) - mean)).sum(-1) + (beta * (cavity_variance.to(work) - variance)).sum(-1)
        log_z = log_z + shift  # zero, with gradient alpha and beta
    return log_z.to(dtype), tilted_mean.to(dtype), tilted_variance.to(dtype)


def factorised_probabilities(mean: Tensor, variance: Tensor) -> Tensor:
    r"""The multinomial probit's predictive class probabilities under independent Gaussian latents,
    :math:`p(y = c) = \hat Z(c)` (module docstring) for every class :math:`c`: exact up to the quadrature, in
    :math:`O(C^2 \cdot \text{nodes})` per point, and normalised to sum to 1.

    :param mean: ``(N, C)``; ``variance``: ``(N, C)``, positive.
    :returns: ``(N, C)``. Computed in blocks of points, so that memory does not grow with :math:`N`.
    """
    num_classes = mean.shape[-1]
    chunk = max(1, _CHUNK // (num_classes * num_classes * _LIKELIHOOD_NODES))  # points per block of the quadrature
    pieces = []
    for block_mean, block_variance in zip(mean.split(chunk), variance.split(chunk), strict=True):
        num_points = len(block_mean)
        labels = torch.arange(num_classes, device=mean.device).repeat_interleave(num_points)
        log_z = factorised_log_normalizer(
            labels, block_mean.repeat(num_classes, 1), block_variance.repeat(num_classes, 1)
        )
        pieces.append(torch.softmax(log_z.reshape(num_classes, num_points).mT, dim=-1))
    return torch.cat(pieces)
