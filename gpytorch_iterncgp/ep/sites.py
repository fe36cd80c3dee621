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
(:func:`~gpytorch_iterncgp.likelihoods.tilted.tilted_moments`), and moves the sites a fraction :math:`\delta` (the damping)
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

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.noise import SiteBlockNoiseInverse
from ..core.outer_loop import ratio_of_change
from ..core.sharding import RowBlock
from ..likelihoods.adapters import LikelihoodAdapter
from ..likelihoods.multinomial_probit import InnerSites, multinomial_probit_moments
from ..likelihoods.tilted import tilted_moments


@dataclass
class SiteUpdate:
    r"""One parallel sweep's new sites and what it saw: ``(N,)`` each for scalar sites (``N`` sites); for
    :math:`C \times C` site blocks (:func:`update_site_blocks`) the precisions are ``(N, C, C)`` and the natural
    means ``(N, C)``."""

    site_precision: Tensor  # tau tilde after damping
    site_natural_mean: Tensor  # nu tilde after damping
    cavity_precision: Tensor  # tau_{-i} from the marginals the sweep started from
    cavity_natural_mean: Tensor  # nu_{-i}
    log_normalizer: Tensor  # log Z hat_i at those cavities (0 at skipped sites)
    bounded: Tensor  # bool: cavity precision raised to the prior precision 1 / k_ii
    skipped: Tensor  # bool: cavity not finite (or not positive without a bound), site kept
    clipped: Tensor  # bool: undamped site precision below 0, set to 0
    change: float  # max_i of |tau* - tau| / max|tau*| and |nu* - nu| / max|nu*| (undamped; over updated sites)
    inner_sites: InnerSites | None = None  # site blocks: the nested EP's sites, for the next sweep's warm start

    @classmethod
    def of_sweep(
        cls,
        sites: tuple[Tensor, Tensor],
        cavity: tuple[Tensor, Tensor],
        log_normalizer: Tensor,
        valid: Tensor,
        bounded: Tensor,
        clipped: Tensor,
        change: float,
        inner_sites: InnerSites | None = None,
    ) -> SiteUpdate:
        r"""The update of a sweep that moved the ``valid`` sites (bool, ``(N,)``) and kept the others.

        :param sites: the damped :math:`(\tilde\tau, \tilde\nu)` after the sweep.
        :param cavity: :math:`(\tau_{-i}, \nu_{-i})` from the marginals the sweep started from.
        :param bounded: whether each cavity precision was raised to the prior precision; counted at valid sites only.
        :return: the update, whose ``skipped`` sites are those not ``valid``.
        """
        return cls(*sites, *cavity, log_normalizer, bounded & valid, ~valid, clipped, change, inner_sites)


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
    *,
    rows_block: RowBlock,
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
    :param rows_block: the points whose sites this process holds: all in one process; where sharded
        (``shard_state``) every ``(N,)`` argument and result is this rank's points, and the change is the largest over
        all ranks (one ``all_reduce``).
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
    sites = (site_precision.clone(), site_natural_mean.clone())  # updated in place at the valid sites
    clipped = torch.zeros_like(valid)
    largest = marginal_mean.new_zeros(2, 2)  # no site updated: no change
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
        largest = _damped_step(sites, valid, (target_precision, target_natural_mean), damping)
        log_normalizer[valid] = log_z
    change = _largest_change(largest, rows_block)
    return SiteUpdate.of_sweep(
        sites, (cavity_precision, cavity_natural_mean), log_normalizer, valid, bounded, clipped, change
    )


def _damped_step(sites: tuple[Tensor, Tensor], valid: Tensor, targets: tuple[Tensor, Tensor], damping: float) -> Tensor:
    r"""Move the ``valid`` rows of ``sites`` (precision, natural mean; updated in place) a fraction ``damping`` of the
    way to ``targets`` (given for those rows only).

    :return: for the precision and the natural mean, the largest undamped difference :math:`\max_i |t_i - s_i|` and
        the largest target :math:`\max_i |t_i|`, ``(2, 2)`` (:func:`_largest_change` makes the change of them).
    """
    largest = []
    for site, target in zip(sites, targets, strict=True):
        old = site[valid]
        largest.append(torch.stack([(target - old).abs().max(), target.abs().max()]))
        site[valid] = old + damping * (target - old)
    return torch.stack(largest)


def _largest_change(largest: Tensor, rows_block: RowBlock) -> float:
    r"""The largest relative undamped change of the sites, :math:`\max(\max_i |t_i - s_i| / \max_i |t_i|)` over the
    precision and the natural mean (:func:`~gpytorch_iterncgp.core.outer_loop.ratio_of_change`), from
    :func:`_damped_step`'s ``(2, 2)`` maxima; their maxima over the ranks where the sites are held by rows."""
    change = 0.0
    for difference, scale in rows_block.maximum(largest).tolist():
        change = max(change, ratio_of_change(difference, scale))
    return change


# ---------------------------------------------------------------------------------------------------
# C x C site blocks for likelihoods of C latent values that are flat along 1 (multinomial probit)
# ---------------------------------------------------------------------------------------------------
def zero_sum_basis(num_classes: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    r"""An orthonormal basis :math:`\mathbf B` ``(C, C - 1)`` of :math:`\mathbf 1^\perp`, the zero-sum vectors."""
    centred = torch.eye(num_classes, dtype=dtype, device=device) - 1.0 / num_classes
    basis, _ = torch.linalg.qr(centred[:, :-1])
    return basis


def site_block_spectrum(site_precision: Tensor, basis: Tensor) -> tuple[Tensor, Tensor]:
    r"""Eigenvalues ``(N, C - 1)`` and eigenvectors ``(N, C, C - 1)`` of the site blocks :math:`\tilde{\mathbf T}_i`
    ``(N, C, C)`` on :math:`\mathbf 1^\perp` (``basis`` from :func:`zero_sum_basis`); :math:`\mathbf 1` is their null
    space."""
    values, rotations = torch.linalg.eigh(basis.mT @ site_precision @ basis)
    return values, basis @ rotations


def site_block_noise(
    site_precision: Tensor, site_natural_mean: Tensor, prior_mean: Tensor, min_precision: float, basis: Tensor
) -> tuple[SiteBlockNoiseInverse, Tensor]:
    r"""The regression that :math:`C \times C` sites define: the noise :math:`\tilde{\mathbf T}^+` (blocks
    :math:`\tilde{\mathbf T}_i^+`, a :class:`~gpytorch_iterncgp.core.noise.SiteBlockNoiseInverse` of size
    ``(N C, N C)``) and right-hand sides :math:`\tilde{\mathbf T}_i^+ (\tilde{\boldsymbol\nu}_i - \tilde{\mathbf T}_i
    \mathbf m_i)` ``(N, C)``.

    The pseudo-inverse on :math:`\mathbf 1^\perp` with the site's eigenvalues bounded below by ``min_precision``
    (as the :math:`C = 1` loop bounds :math:`\tilde\tau_i`): exact wherever every eigenvalue is above it, and a flat
    site contributes nothing. With IterGP's actions restricted to zero sum per point, the solve gives the posterior
    :math:`(\mathbf K^{-1} + \tilde{\mathbf T})^{-1}` of singular sites (the argument of the paper's Lemma A.7 for
    the softmax).

    :param site_precision: :math:`\tilde{\mathbf T}_i`, ``(N, C, C)``.
    :param site_natural_mean: :math:`\tilde{\boldsymbol\nu}_i`, ``(N, C)``.
    :param prior_mean: :math:`\mathbf m_i`, ``(N, C)``.
    :param min_precision: the lower bound of the sites' eigenvalues on :math:`\mathbf 1^\perp`.
    :param basis: :math:`\mathbf B` ``(C, C - 1)`` from :func:`zero_sum_basis`.
    :return: the noise operator and the right-hand sides ``(N, C)``.
    """
    values, vectors = site_block_spectrum(site_precision, basis)
    noise = SiteBlockNoiseInverse.from_site_spectrum(values, vectors, min_precision)
    offset = site_natural_mean - (site_precision @ prior_mean.unsqueeze(-1)).squeeze(-1)
    return noise, (noise.blocks @ offset.unsqueeze(-1)).squeeze(-1)


def _symmetric(matrices: Tensor) -> Tensor:
    return (matrices + matrices.mT) / 2


def _inverse(matrices: Tensor) -> tuple[Tensor, Tensor]:
    """Inverses of symmetric positive definite ``(..., C, C)`` and whether each was (NaN where not)."""
    cholesky, info = torch.linalg.cholesky_ex(_symmetric(matrices))
    ok = (info == 0) & torch.isfinite(matrices).flatten(-2).all(-1)
    eye = torch.eye(matrices.shape[-1], dtype=matrices.dtype, device=matrices.device)
    inverse = torch.cholesky_inverse(torch.where(ok[..., None, None], cholesky, eye))
    return torch.where(ok[..., None, None], inverse, torch.nan), ok


def block_cavities(
    marginal_mean: Tensor,
    marginal_covariance: Tensor,
    site_precision: Tensor,
    site_natural_mean: Tensor,
    prior_covariance: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Cavities of :math:`C \times C` sites: precisions :math:`\boldsymbol\Lambda_{-i} = \boldsymbol\Sigma_{ii}^{-1} -
    \tilde{\mathbf T}_i` ``(N, C, C)``, natural means :math:`\boldsymbol\nu_{-i} = (\boldsymbol\Lambda_{-i} +
    \tilde{\mathbf T}_i)\boldsymbol\mu_i - \tilde{\boldsymbol\nu}_i` ``(N, C)``, and which were bounded ``(N,)``.

    The bound generalises the scalar one (:func:`cavities`): the exact cavity precision is at least the prior's,
    :math:`\boldsymbol\Lambda_{-i} \succeq \mathbf K_{ii}^{-1}`. With :math:`\mathbf K_{ii} = \mathbf L\mathbf L^\top`,
    the eigenvalues of :math:`\mathbf L^\top\boldsymbol\Lambda_{-i}\mathbf L` below 1 are raised to 1, keeping the
    marginal mean. A point counts as bounded when an eigenvalue was below :math:`1 - \sqrt{\epsilon}` (along
    :math:`\mathbf 1` the sites carry no information, so equality holds there up to rounding).
    """
    marginal_precision, _ = _inverse(marginal_covariance)
    cavity_precision = marginal_precision - site_precision
    bounded = torch.zeros(marginal_mean.shape[:-1], dtype=torch.bool, device=marginal_mean.device)
    if prior_covariance is not None:
        root = torch.linalg.cholesky(_symmetric(prior_covariance))
        values, vectors = torch.linalg.eigh(_symmetric(root.mT @ cavity_precision @ root))
        bounded = values.amin(-1) < 1 - math.sqrt(torch.finfo(values.dtype).eps)
        raised = (vectors * values.clamp_min(1).unsqueeze(-2)) @ vectors.mT
        eye = torch.eye(root.shape[-1], dtype=root.dtype, device=root.device)
        inverse_root = torch.linalg.solve_triangular(root, eye, upper=False)
        cavity_precision = torch.where(
            bounded[..., None, None], inverse_root.mT @ raised @ inverse_root, cavity_precision
        )
    natural_mean = ((cavity_precision + site_precision) @ marginal_mean.unsqueeze(-1)).squeeze(-1) - site_natural_mean
    return _symmetric(cavity_precision), natural_mean, bounded


def update_site_blocks(
    targets: Tensor,
    marginal_mean: Tensor,
    marginal_covariance: Tensor,
    site_precision: Tensor,
    site_natural_mean: Tensor,
    damping: float,
    prior_covariance: Tensor | None = None,
    inner_sites: InnerSites | None = None,
    *,
    rows_block: RowBlock,
) -> SiteUpdate:
    r"""One parallel EP sweep over :math:`C \times C` multinomial probit sites (Riihimäki et al. 2013, outer EP).

    From each point's marginal :math:`\mathcal N(\boldsymbol\mu_i, \boldsymbol\Sigma_{ii})`: the cavity
    (:func:`block_cavities`), the tilted moments :math:`(\hat Z_i, \hat{\boldsymbol\mu}_i, \hat{\boldsymbol\Sigma}_i)`
    by nested EP (:func:`~gpytorch_iterncgp.likelihoods.multinomial_probit.multinomial_probit_moments`, its inner sites warm-started from
    ``inner_sites``), and the undamped sites :math:`\tilde{\mathbf T}_i^* = \mathbf P(\hat{\boldsymbol\Sigma}_i^{-1} -
    \boldsymbol\Lambda_{-i})\mathbf P`, :math:`\tilde{\boldsymbol\nu}_i^* = \mathbf P(\hat{\boldsymbol\Sigma}_i^{-1}
    \hat{\boldsymbol\mu}_i - \boldsymbol\nu_{-i})`, with :math:`\mathbf P = \mathbf I - \mathbf 1\mathbf 1^\top / C`
    (the likelihood is flat along :math:`\mathbf 1`, so the exact sites lie in :math:`\mathbf 1^\perp`; the projection
    removes rounding). Eigenvalues of :math:`\tilde{\mathbf T}_i^*` below 0 are set to 0 (clipped; counted when below
    :math:`-\sqrt{\epsilon}` times the tilted precision's largest eigenvalue). Damping, skipping and the change as
    in :func:`update_sites`; shapes ``(N, C, C)`` and ``(N, C)`` for the sites and cavities, ``(N,)`` for the rest.
    The update's ``inner_sites`` are the nested EP's sites for the next sweep's warm start. With a sharded
    ``rows_block`` (sites held by rows) every argument and result is of this rank's points, and the change the largest
    over all ranks.
    """
    num_classes = marginal_mean.shape[-1]
    basis = zero_sum_basis(num_classes, marginal_mean.dtype, marginal_mean.device)
    projector = basis @ basis.mT
    cavity_precision, cavity_natural_mean, bounded = block_cavities(
        marginal_mean, marginal_covariance, site_precision, site_natural_mean, prior_covariance
    )
    cavity_covariance, positive = _inverse(cavity_precision)
    valid = positive & torch.isfinite(cavity_natural_mean).all(-1)
    log_normalizer = torch.zeros(marginal_mean.shape[:-1], dtype=marginal_mean.dtype, device=marginal_mean.device)
    sites = (site_precision.clone(), site_natural_mean.clone())  # updated in place at the valid sites
    clipped = torch.zeros_like(valid)
    largest = marginal_mean.new_zeros(2, 2)  # no site updated: no change
    if bool(valid.any()):
        covariance = cavity_covariance[valid]
        mean = (covariance @ cavity_natural_mean[valid].unsqueeze(-1)).squeeze(-1)
        warm = (
            None if inner_sites is None else InnerSites(inner_sites.precision[valid], inner_sites.natural_mean[valid])
        )
        log_z, tilted_mean, tilted_covariance, found = multinomial_probit_moments(
            targets[valid], mean, covariance, sites=warm, return_sites=True
        )
        tilted_precision, _ = _inverse(tilted_covariance)
        target_precision = projector @ _symmetric(tilted_precision - cavity_precision[valid]) @ projector
        target_natural_mean = (
            projector
            @ ((tilted_precision @ tilted_mean.unsqueeze(-1)).squeeze(-1) - cavity_natural_mean[valid]).unsqueeze(-1)
        ).squeeze(-1)
        values, vectors = site_block_spectrum(target_precision, basis)
        scale = torch.linalg.eigvalsh(tilted_precision).abs().amax(-1)
        clipped[valid] = values.amin(-1) < -math.sqrt(torch.finfo(values.dtype).eps) * scale
        target_precision = (vectors * values.clamp_min(0).unsqueeze(-2)) @ vectors.mT
        largest = _damped_step(sites, valid, (target_precision, target_natural_mean), damping)
        log_normalizer[valid] = log_z
        inner_sites = (
            InnerSites(*(found.precision.new_zeros(len(valid), num_classes - 1) for _ in range(2)))
            if inner_sites is None
            else InnerSites(inner_sites.precision.clone(), inner_sites.natural_mean.clone())
        )
        inner_sites.precision[valid], inner_sites.natural_mean[valid] = found.precision, found.natural_mean
    change = _largest_change(largest, rows_block)
    return SiteUpdate.of_sweep(
        sites, (cavity_precision, cavity_natural_mean), log_normalizer, valid, bounded, clipped, change, inner_sites
    )


def site_roots(site_precision: Tensor, site_natural_mean: Tensor, prior_mean: Tensor) -> tuple[Tensor, Tensor]:
    r"""Square roots of the sites and the whitened offsets of the regression they define, for the evidence.

    Blocks :math:`\mathbf R_i` ``(N, C, C)`` with :math:`\mathbf R_i\mathbf R_i^\top = \tilde{\mathbf T}_i`, the
    offsets :math:`\mathbf c = \mathbf R^+(\tilde{\boldsymbol\nu} - \tilde{\mathbf T}\mathbf m)` ``(N C,)`` (data-major)
    . Scalar sites (``site_precision`` ``(N,)``):
    :math:`R_i = \sqrt{\tilde\tau_i}`. Blocks: :math:`\mathbf R_i = \mathbf U_i \operatorname{diag}(\boldsymbol
    \lambda_i)^{1/2}` from the spectrum on :math:`\mathbf 1^\perp` (:func:`site_block_spectrum`), padded with a zero
    column. Directions with :math:`\lambda \le \epsilon\max\lambda` (flat sites) get :math:`R = 0` and :math:`c = 0`:
    a flat site contributes nothing.
    """
    if site_precision.dim() == 1:
        positive = site_precision > 0
        root = site_precision.clamp_min(0).sqrt()
        safe = torch.where(positive, root, 1)
        offsets = torch.where(positive, (site_natural_mean - site_precision * prior_mean) / safe, 0.0)
        return root[:, None, None], offsets
    num_classes = site_precision.shape[-1]
    basis = zero_sum_basis(num_classes, site_precision.dtype, site_precision.device)
    values, vectors = site_block_spectrum(site_precision, basis)
    inverse = site_block_pseudo_inverse(values)
    root_values = torch.where(inverse > 0, values, 0).sqrt()
    inverse_root = inverse.sqrt()
    padding = vectors.new_zeros(*vectors.shape[:-1], 1)
    roots = torch.cat([vectors * root_values.unsqueeze(-2), padding], dim=-1)
    offset = site_natural_mean - (site_precision @ prior_mean.unsqueeze(-1)).squeeze(-1)
    offsets = torch.cat([inverse_root * (vectors.mT @ offset.unsqueeze(-1)).squeeze(-1), padding[..., 0, :]], dim=-1)
    return roots, offsets.reshape(-1)


def site_block_pseudo_inverse(values: Tensor) -> Tensor:
    r""":math:`1/\lambda` for the site eigenvalues ``values`` above :math:`\epsilon \max|\lambda|`, else 0 (flat
    directions)."""
    finfo = torch.finfo(values.dtype)
    kept = values > finfo.eps * values.abs().amax().clamp_min(finfo.tiny)
    return torch.where(kept, torch.where(kept, values, 1).reciprocal(), 0)
