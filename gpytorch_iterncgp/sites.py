r"""EP's local step: cavities, tilted moments and damped site updates, for all sites at once (parallel EP).

Each likelihood factor :math:`p(y_i \mid f_i)` is replaced by a Gaussian site
:math:`t_i(f_i) \propto \exp(\tilde\nu_i f_i - \tfrac12 \tilde\tau_i f_i^2)` (natural parameters; R&W sec. 3.6).
From the current posterior marginals :math:`\mathcal N(\mu_i, \sigma_i^2)` one parallel sweep computes

.. math::
    \tau_{-i} = \sigma_i^{-2} - \tilde\tau_i, \quad \nu_{-i} = \mu_i \sigma_i^{-2} - \tilde\nu_i
    \quad \text{(cavity, R&W eq. 3.56)}, \qquad
    \tilde\tau_i^* = \hat\sigma_i^{-2} - \tau_{-i}, \quad \tilde\nu_i^* = \hat\mu_i \hat\sigma_i^{-2} - \nu_{-i}
    \quad \text{(R&W eq. 3.59)},

with :math:`(\log\hat Z_i, \hat\mu_i, \hat\sigma_i^2)` the moments of the tilted distribution
(:func:`~gpytorch_iterncgp.tilted.tilted_moments`), and moves the sites a fraction :math:`\delta` (the damping)
of the way: :math:`\tilde\tau_i \leftarrow (1 - \delta)\tilde\tau_i + \delta\tilde\tau_i^*`, likewise
:math:`\tilde\nu_i` (GPstuff's parallel EP; Minka 2001's damping). The fixed point does not depend on
:math:`\delta`.

Three cases are handled, and counted:

* **bounded cavity**: the exact cavity is the prior of :math:`f_i` conditioned on the other sites, so its precision
  is never below the prior's, :math:`\tau_{-i} \ge 1/k_{ii}`. IterGP's computation-aware marginal variance is too
  large where the solver has not yet looked (never too small), which makes :math:`\sigma_i^{-2} - \tilde\tau_i`
  too small and possibly negative. Given the prior variances, the cavity precision is raised to :math:`1/k_{ii}`
  wherever it falls below, with the cavity mean that keeps the marginal mean,
  :math:`\nu_{-i} = \mu_i (\tau_{-i} + \tilde\tau_i) - \tilde\nu_i` (equal to :math:`\mu_i\sigma_i^{-2} - \tilde\nu_i`
  where nothing is raised). With exact marginals the bound is never active, so the fixed point is exact EP's.
* **skipped**: a cavity that is not finite (a marginal variance that rounding made non-positive), or, without
  prior variances, a cavity precision :math:`\le 0`, means the marginal is wrong, not the site (Minka 2001; GPstuff
  skips such sites): the site keeps its value this sweep.
* **clipped**: a new site precision below 0 (impossible for a log-concave likelihood in exact arithmetic) is set
  to 0; its :math:`\tilde\nu_i` is kept, i.e. the site becomes the linear term :math:`\exp(\tilde\nu_i f_i)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .likelihoods import LikelihoodAdapter
from .tilted import tilted_moments


@dataclass
class SiteUpdate:
    r"""One parallel sweep's new sites and what it saw, all ``(N,)`` (``N`` sites)."""

    site_precision: Tensor  # tau tilde after damping
    site_natural_mean: Tensor  # nu tilde after damping
    cavity_precision: Tensor  # tau_{-i} from the marginals the sweep started from
    cavity_natural_mean: Tensor  # nu_{-i}
    log_normalizer: Tensor  # log Z hat_i at those cavities (0 at skipped sites)
    bounded: Tensor  # bool: cavity precision raised to the prior precision 1 / k_ii
    skipped: Tensor  # bool: cavity not finite (or not positive without a bound), site kept
    clipped: Tensor  # bool: undamped site precision below 0, set to 0
    change: float  # max_i of |tau* - tau| / max|tau*| and |nu* - nu| / max|nu*| (undamped; over updated sites)


def cavities(
    marginal_mean: Tensor,
    marginal_variance: Tensor,
    site_precision: Tensor,
    site_natural_mean: Tensor,
    prior_variance: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Cavity natural parameters :math:`(\tau_{-i}, \nu_{-i})` (R&W eq. 3.56), ``(N,)`` each.

    With ``prior_variance`` :math:`k_{ii}` the precision is bounded below by :math:`1/k_{ii}` (see the module docstring).
    """
    cavity_precision = marginal_variance.reciprocal() - site_precision
    if prior_variance is not None:
        cavity_precision = torch.maximum(cavity_precision, prior_variance.reciprocal())
    return cavity_precision, marginal_mean * (cavity_precision + site_precision) - site_natural_mean


def update_sites(
    adapter: LikelihoodAdapter,
    targets: Tensor,
    marginal_mean: Tensor,
    marginal_variance: Tensor,
    site_precision: Tensor,
    site_natural_mean: Tensor,
    damping: float,
    prior_variance: Tensor | None = None,
) -> SiteUpdate:
    r"""One parallel EP sweep over all sites (see the module docstring).

    :param adapter: a :math:`C = 1` likelihood with tilted moments (probit, logit, Poisson exp/softplus).
    :param targets: ``(N,)``.
    :param marginal_mean: :math:`\mu_i`, the current posterior means ``(N,)``.
    :param marginal_variance: :math:`\sigma_i^2`, the current posterior variances ``(N,)``.
    :param site_precision: :math:`\tilde\tau_i` ``(N,)``; ``site_natural_mean``: :math:`\tilde\nu_i` ``(N,)``.
    :param damping: :math:`\delta \in (0, 1]`; 1 is undamped.
    :param prior_variance: :math:`k_{ii}` ``(N,)``, the lower bound :math:`1/k_{ii}` of the cavity precisions; ``None``:
        no bound (non-positive cavities are skipped).
    """
    cavity_precision, cavity_natural_mean = cavities(
        marginal_mean, marginal_variance, site_precision, site_natural_mean, prior_variance
    )
    bounded = (
        torch.zeros_like(marginal_mean, dtype=torch.bool)
        if prior_variance is None
        else marginal_variance.reciprocal() - site_precision < prior_variance.reciprocal()
    )
    valid = torch.isfinite(cavity_precision) & (cavity_precision > 0) & torch.isfinite(cavity_natural_mean)
    log_normalizer = torch.zeros_like(marginal_mean)
    new_precision, new_natural_mean = site_precision.clone(), site_natural_mean.clone()
    clipped = torch.zeros_like(valid)
    change = 0.0
    if bool(valid.any()):
        cavity_variance = cavity_precision[valid].reciprocal()
        log_z, tilted_mean, tilted_variance = tilted_moments(
            adapter, targets[valid], cavity_natural_mean[valid] * cavity_variance, cavity_variance
        )
        tilted_precision = tilted_variance.reciprocal()
        target_precision = tilted_precision - cavity_precision[valid]
        target_natural_mean = tilted_mean * tilted_precision - cavity_natural_mean[valid]
        clipped[valid] = target_precision < 0
        target_precision = target_precision.clamp_min(0)
        old_precision, old_natural_mean = site_precision[valid], site_natural_mean[valid]
        change = max(
            _relative_change(target_precision, old_precision), _relative_change(target_natural_mean, old_natural_mean)
        )
        new_precision[valid] = old_precision + damping * (target_precision - old_precision)
        new_natural_mean[valid] = old_natural_mean + damping * (target_natural_mean - old_natural_mean)
        log_normalizer[valid] = log_z
    return SiteUpdate(
        new_precision,
        new_natural_mean,
        cavity_precision,
        cavity_natural_mean,
        log_normalizer,
        bounded & valid,
        ~valid,
        clipped,
        change,
    )


def _relative_change(new: Tensor, old: Tensor) -> float:
    scale = float(new.abs().max())
    difference = float((new - old).abs().max())
    return difference / scale if scale > 0 else (0.0 if difference == 0 else float("inf"))
