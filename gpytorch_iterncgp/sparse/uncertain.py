r"""Sparse EP for uncertain inputs (Hernández-Lobato-style sec. S5): EP-DTC when the inputs are
:math:`\mathbf x_i \sim q(\mathbf x_i) = \mathcal N(\boldsymbol\mu_i, \operatorname{diag}\mathbf s_i)`.

The DTC prior covariance :math:`\mathbf Q_{ff} = \mathbf K_{fu}\mathbf K_{uu}^{-1}\mathbf K_{uf}` of
:mod:`.dtc` is replaced by its expectation under the factorised :math:`q(\mathbf X)` (eq. S.6), written with
the Ψ statistics of :mod:`.psi_statistics` (:math:`\boldsymbol\Psi_1` ``(N, M)``, per-point
:math:`(\boldsymbol\Psi_2)_i` ``(M, M)``):

.. math::
    \mathbf P = \langle \mathbf Q_{ff} \rangle_{q(\mathbf X)}
    = \boldsymbol\Psi_1 \mathbf K_{uu}^{-1} \boldsymbol\Psi_1^\top + \boldsymbol\Lambda
    = \mathbf V^\top \mathbf V + \boldsymbol\Lambda, \qquad
    \Lambda_{ii} = \operatorname{tr}\big(\mathbf K_{uu}^{-1} (\boldsymbol\Psi_2)_i\big)
    - (\boldsymbol\Psi_1)_i^\top \mathbf K_{uu}^{-1} (\boldsymbol\Psi_1)_i \ge 0

(off the diagonal the :math:`\mathbf x_i` are independent, so the expectation factorises; :math:`\Lambda_{ii}` is
:math:`\operatorname{tr}(\mathbf K_{uu}^{-1}\operatorname{Cov}_q \mathbf k_u(\mathbf x_i))`, the "diagonal matrix
:math:`\boldsymbol\Lambda`" of eq. S.35), with :math:`\mathbf L\mathbf L^\top = \mathbf K_{uu} + \epsilon\bar k
\mathbf I` (jittered as in :class:`~gpytorch_iterncgp.sparse.dtc.WhitenedInducing`) and :math:`\mathbf V =
\mathbf L^{-1}\boldsymbol\Psi_1^\top` ``(M, N)``. This is the prior of eq. S.22: low rank plus diagonal.

**Posterior** of the sites :math:`\tilde{\mathbf T} = \operatorname{diag}\tilde{\boldsymbol\tau}`,
:math:`\tilde{\boldsymbol\nu}` (eq. S.22-S.23, with a prior mean :math:`\mathbf m`): write :math:`\mathbf f =
\mathbf m + \mathbf V^\top\mathbf z + \mathbf e`, :math:`\mathbf z \sim \mathcal N(\mathbf 0, \mathbf I_M)`,
:math:`\mathbf e \sim \mathcal N(\mathbf 0, \boldsymbol\Lambda)`. With :math:`r_i = 1 + \tilde\tau_i\Lambda_{ii}`,
:math:`\mathbf W = \tilde{\mathbf T}\mathbf R^{-1}` (the precision of :math:`\mathbf e + ` site noise) and
:math:`\mathbf B = \mathbf I_M + \mathbf V\mathbf W\mathbf V^\top = \mathbf L_B\mathbf L_B^\top`,

.. math::
    \boldsymbol\Sigma = \hat{\boldsymbol\Psi}\,\mathbf B^{-1}\hat{\boldsymbol\Psi}^\top + \hat{\boldsymbol\Lambda},
    \quad \hat{\boldsymbol\Psi} = \mathbf R^{-1}\mathbf V^\top, \quad
    \hat{\boldsymbol\Lambda} = \boldsymbol\Lambda\mathbf R^{-1}, \qquad
    \boldsymbol\mu = \mathbf m + \hat{\boldsymbol\Psi}\bar{\mathbf z}
    + \boldsymbol\Lambda\mathbf R^{-1}(\tilde{\boldsymbol\nu} - \tilde{\mathbf T}\mathbf m),
    \quad \bar{\mathbf z} = \mathbf B^{-1}\mathbf V\mathbf R^{-1}(\tilde{\boldsymbol\nu} - \tilde{\mathbf T}\mathbf m),

the factorisation :math:`\boldsymbol\Sigma = \hat{\boldsymbol\Psi}\mathbf R^\top\mathbf R\hat{\boldsymbol\Psi}^\top
+ \hat{\boldsymbol\Lambda}` of eq. S.25 with :math:`\mathbf R^\top\mathbf R = \mathbf B^{-1}` (whitened inducing
coordinates). :func:`uncertain_posterior` computes it in :math:`O(M^2 N)` (:math:`\mathbf R = \mathbf I`: the
prior; :math:`\boldsymbol\Lambda = \mathbf 0`: exactly :func:`~gpytorch_iterncgp.sparse.dtc.dtc_posterior`).

**Sequential rank-one updates** (eq. S.26-S.32; :func:`sequential_sweep`): a change
:math:`(\Delta\tilde\tau_i, \Delta\tilde\nu_i)` of site :math:`i` updates the factors in :math:`O(M^2)`:

.. math::
    \hat\lambda_{ii} \leftarrow \frac{\hat\lambda_{ii}}{1 + \Delta\tilde\tau_i\hat\lambda_{ii}}, \quad
    \hat{\boldsymbol\psi}_i \leftarrow \frac{\hat{\boldsymbol\psi}_i}{1 + \Delta\tilde\tau_i\hat\lambda_{ii}}
    \ \text{(S.26-S.27)}, \qquad
    \mathbf G \leftarrow \mathbf G - \delta_i\, \mathbf G\hat{\boldsymbol\psi}_i\hat{\boldsymbol\psi}_i^\top\mathbf G,
    \quad \delta_i = \frac{\Delta\tilde\tau_i}{1 + \Delta\tilde\tau_i s_{ii}} \ \text{(S.28-S.29)},

with :math:`\mathbf G = \mathbf R^\top\mathbf R` kept as a matrix (S.29 re-factorises the same update by an
:math:`O(M^3)` Cholesky; the product itself is all the sweep uses) and :math:`s_{ii}` the old marginal variance.
The mean is kept as :math:`\boldsymbol\mu = \boldsymbol\omega + \hat{\boldsymbol\Psi}\boldsymbol\gamma` (S.30); from
:math:`\boldsymbol\mu^{new} = \boldsymbol\mu + (\Delta\tilde\nu_i - \Delta\tilde\tau_i\mu_i)\mathbf s_i^{new}`
(S.16) and :math:`\mathbf s_i^{new} = \hat{\boldsymbol\Psi}^{new}\mathbf G^{new}\hat{\boldsymbol\psi}_i^{new} +
\hat\lambda_{ii}^{new}\mathbf e_i`, with :math:`\kappa = \Delta\tilde\nu_i - \Delta\tilde\tau_i\mu_i`,

.. math::
    \boldsymbol\gamma^{new} = \boldsymbol\gamma + \kappa\,\mathbf G^{new}\hat{\boldsymbol\psi}_i^{new}, \qquad
    \omega_i^{new} = \omega_i + (\hat{\boldsymbol\psi}_i - \hat{\boldsymbol\psi}_i^{new})^\top\boldsymbol\gamma
    + \kappa\,\hat\lambda_{ii}^{new}

(S.31-S.32 as printed do not type-check, e.g. :math:`\boldsymbol\gamma^{new} = \hat{\boldsymbol\Psi}^{new}
\boldsymbol\gamma + \dots` is :math:`N`-dimensional; these are the updates they stand for). Every sweep ends with
the :math:`O(M^2 N)` recomputation of :func:`uncertain_posterior` from the sites (as R&W Alg. 3.5 recomputes
:math:`\boldsymbol\Sigma` after a sweep), which also bounds the drift of the rank-one updates.

**Parallel sweeps** (:class:`UncertainSparseEP`, the default) update every site from the same marginals with
:func:`~gpytorch_iterncgp.ep.sites.update_sites`, as :class:`~gpytorch_iterncgp.sparse.dtc.SparseEP` does; both
schedules have the same fixed point (EP's moment matching at every site under the prior :math:`\mathbf P`).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from ..core.outer_loop import EPSweep, LoopStatus, OuterStep
from ..core.sharding import RowBlock
from ..core.state import ExtraState
from ..ep.sites import update_sites
from ..likelihoods.adapters import LikelihoodAdapter
from .dtc import DTCPrior, SparseEP, SparseEPState, WhitenedInducing
from .psi_statistics import MonteCarloPsiWarning, PsiStatistics, psi_statistics

__all__ = [
    "ColumnSites",
    "MonteCarloPsiWarning",
    "PsiStatistics",
    "RankOneFactors",
    "SequentialSweep",
    "UncertainDTCPrior",
    "UncertainSparseEP",
    "psi_statistics",
    "sequential_sweep",
    "uncertain_posterior",
]


@dataclass
class UncertainDTCPrior(DTCPrior):
    r"""The expected DTC prior :math:`\mathcal N(\mathbf m, \mathbf V^\top\mathbf V + \boldsymbol\Lambda)` of
    uncertain inputs (module docstring): ``mean`` :math:`\mathbf m` ``(N,)``, ``diagonal`` :math:`\psi_0 =
    \langle\operatorname{diag}\mathbf K_{ff}\rangle` ``(N,)``, ``cholesky`` :math:`\mathbf L` ``(M, M)``,
    ``whitened_cross`` :math:`\mathbf V = \mathbf L^{-1}\boldsymbol\Psi_1^\top` ``(M, N)`` and ``spread``
    :math:`\operatorname{diag}\boldsymbol\Lambda` ``(N,)``.

    A :class:`~gpytorch_iterncgp.sparse.dtc.DTCPrior` whose :attr:`dtc_variance` is the prior marginal variance
    :math:`\langle q_{ii}\rangle = \|\mathbf V_{:,i}\|^2 + \Lambda_{ii}`; with ``spread`` 0 it is the DTC prior.
    """

    spread: Tensor = field(kw_only=True)

    @classmethod
    def from_statistics(cls, mean: Tensor, statistics: PsiStatistics, inducing_covariance: Tensor) -> UncertainDTCPrior:
        r"""From :math:`\mathbf m` ``(N,)``, the Ψ statistics and :math:`\mathbf K_{uu}` ``(M, M)``, differentiably.

        :math:`\Lambda_{ii} = \langle \mathbf K_{uu}^{-1}, (\boldsymbol\Psi_2)_i - (\boldsymbol\Psi_1)_i
        (\boldsymbol\Psi_1)_i^\top\rangle_F` (the covariance is formed first: no cancellation between two
        :math:`O(k)` terms), clamped at 0 against rounding; :math:`O(M^3 + N M^2)`.

        :raises ValueError: for statistics with batch dimensions or shapes that disagree.
        """
        psi0, psi1, psi2 = statistics
        num_points, num_inducing = psi1.shape[-2:] if psi1.dim() >= 2 else (-1, -1)
        shapes_ok = (
            psi1.dim() == 2
            and psi0.shape == (num_points,)
            and psi2.shape == (num_points, num_inducing, num_inducing)
            and mean.shape == (num_points,)
            and inducing_covariance.shape == (num_inducing, num_inducing)
        )
        if not shapes_ok:
            raise ValueError(
                "UncertainDTCPrior needs un-batched statistics psi0 (N,), psi1 (N, M), psi2 (N, M, M), mean (N,) and "
                f"K_uu (M, M); got {tuple(psi0.shape)=}, {tuple(psi1.shape)=}, {tuple(psi2.shape)=}, "
                f"{tuple(mean.shape)=}, {tuple(inducing_covariance.shape)=}."
            )
        whitening = WhitenedInducing.from_covariance(inducing_covariance)
        whitened_cross = whitening.whiten(psi1.mT)
        precision = whitening.precision()
        spread = torch.einsum("mk,nmk->n", precision, statistics.cross_covariance()).clamp_min(0)
        return cls(mean, psi0, whitening.cholesky, whitened_cross, spread=spread)

    def detached(self) -> UncertainDTCPrior:
        """The same prior without autograd history (for the EP fit; the bound is differentiated at fixed sites)."""
        return UncertainDTCPrior(
            self.mean.detach(),
            self.diagonal.detach(),
            self.cholesky.detach(),
            self.whitened_cross.detach(),
            spread=self.spread.detach(),
        )

    @property
    def dtc_variance(self) -> Tensor:
        r""":math:`\langle q_{ii}\rangle = \|\mathbf V_{:, i}\|^2 + \Lambda_{ii}`, ``(N,)``."""
        return self.whitened_cross.square().sum(0) + self.spread

    def independent_variance(self) -> Tensor:
        r""":math:`\operatorname{diag}\boldsymbol\Lambda` ``(N,)``."""
        return self.spread


@dataclass
class ColumnSites(ExtraState):
    r"""The committed state of an uncertain-input model (:class:`~gpytorch_iterncgp.core.state.CommittedState`): the
    EP sites :math:`\tilde{\boldsymbol\tau}, \tilde{\boldsymbol\nu}` of its output columns, ``(N,)`` each for one
    output, ``(P, N)`` for :math:`P` columns sharing the expected DTC prior."""

    site_precision: Tensor
    site_natural_mean: Tensor

    saved_by = "UncertainSparseEPMarginalLogLikelihood"

    @classmethod
    def expected_shapes(cls, saved: dict[str, Tensor]) -> dict[str, tuple[int, ...]]:
        """Both of the shape of ``site_precision``."""
        shape = tuple(saved["site_precision"].shape)
        return {"site_precision": shape, "site_natural_mean": shape}

    def num_latent_values(self) -> int:
        """:math:`N P`, one site per point and column."""
        return self.site_precision.numel()


def uncertain_posterior(
    prior: UncertainDTCPrior, site_precision: Tensor, site_natural_mean: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""The posterior of the sites under the expected DTC prior (module docstring), differentiable in ``prior``.

    :param site_precision: :math:`\tilde{\boldsymbol\tau} \ge 0` ``(N,)``; ``site_natural_mean``:
        :math:`\tilde{\boldsymbol\nu}` ``(N,)``.
    :return: :math:`\mathbf L_B` ``(M, M)``, :math:`\bar{\mathbf z}` ``(M,)``, the marginal means and variances
        ``(N,)``.
    """
    return prior.posterior(site_precision, site_natural_mean)


@dataclass
class RankOneFactors:
    r"""The factors of eq. S.25 and S.30 that the sequential updates carry (module docstring):
    :math:`\operatorname{diag}\hat{\boldsymbol\Lambda}` ``(N,)``, :math:`\hat{\boldsymbol\Psi}` ``(N, M)``,
    :math:`\mathbf G = \mathbf R^\top\mathbf R` ``(M, M)``, :math:`\boldsymbol\omega` ``(N,)``,
    :math:`\boldsymbol\gamma` ``(M,)``."""

    spread: Tensor
    cross: Tensor
    gram: Tensor
    offset: Tensor
    weights: Tensor

    @classmethod
    def from_sites(cls, prior: UncertainDTCPrior, site_precision: Tensor, site_natural_mean: Tensor) -> RankOneFactors:
        """The factors of the posterior of these sites, from :func:`uncertain_posterior` (no gradient)."""
        with torch.no_grad():
            cholesky, whitened_mean, _, _ = uncertain_posterior(prior, site_precision, site_natural_mean)
            ratio = 1 + site_precision * prior.spread
            residual = (site_natural_mean - site_precision * prior.mean) / ratio
            return cls(
                prior.spread / ratio,
                prior.whitened_cross.mT / ratio[:, None],
                torch.cholesky_inverse(cholesky),
                prior.mean + prior.spread * residual,
                whitened_mean.clone(),
            )

    def covariance(self) -> Tensor:
        r""":math:`\boldsymbol\Sigma = \hat{\boldsymbol\Psi}\mathbf G\hat{\boldsymbol\Psi}^\top + \hat{\boldsymbol\Lambda}`
        ``(N, N)``, dense (for checks)."""
        return self.cross @ self.gram @ self.cross.mT + torch.diag(self.spread)

    def mean(self) -> Tensor:
        r""":math:`\boldsymbol\mu = \boldsymbol\omega + \hat{\boldsymbol\Psi}\boldsymbol\gamma` ``(N,)``."""
        return self.offset + self.cross @ self.weights

    def marginal(self, index: int) -> tuple[Tensor, Tensor]:
        r""":math:`(\mu_i, s_{ii})` in :math:`O(M^2)`."""
        row = self.cross[index]
        return self.offset[index] + row @ self.weights, row @ (self.gram @ row) + self.spread[index]

    def update(self, index: int, precision_change: Tensor, natural_mean_change: Tensor) -> None:
        r"""Change site ``index`` by :math:`(\Delta\tilde\tau_i, \Delta\tilde\nu_i)` in place: eq. S.26-S.32 as in the
        module docstring, :math:`O(M^2)`."""
        row = self.cross[index].clone()
        mean, variance = self.marginal(index)
        projected = self.gram @ row
        delta = precision_change / (1 + precision_change * variance)
        self.gram -= delta * torch.outer(projected, projected)
        shrink = 1 / (1 + precision_change * self.spread[index])
        new_row = shrink * row
        new_spread = shrink * self.spread[index]
        kappa = natural_mean_change - precision_change * mean
        self.offset[index] += (row - new_row) @ self.weights + kappa * new_spread
        self.weights += kappa * (self.gram @ new_row)
        self.cross[index] = new_row
        self.spread[index] = new_spread


class SequentialSweep(NamedTuple):
    """What :func:`sequential_sweep` returns: the new sites ``(N,)`` each, the factors after the last update, the
    largest relative site change proposed and the number of skipped sites (non-finite cavities)."""

    site_precision: Tensor
    site_natural_mean: Tensor
    factors: RankOneFactors
    change: float
    skipped: int


def sequential_sweep(
    prior: UncertainDTCPrior,
    adapter: LikelihoodAdapter,
    targets: Tensor,
    site_precision: Tensor,
    site_natural_mean: Tensor,
    damping: float = 1.0,
    order: Tensor | None = None,
    active: Tensor | None = None,
) -> SequentialSweep:
    r"""One sequential EP sweep with the rank-one updates of eq. S.26-S.32 (module docstring), :math:`O(M^2 N)`.

    Each site in turn takes its cavity from the current marginal :math:`(\mu_i, s_{ii})` (bounded below by the prior
    precision :math:`1/\langle q_{ii}\rangle`), its tilted moments and a damped update
    (:func:`~gpytorch_iterncgp.ep.sites.update_sites` on that one site), and the factors are updated before the next.

    :param order: the sites to visit, in order (default ``0, ..., N-1``).
    :param active: sites to update (default: all); others are skipped.
    :return: a :class:`SequentialSweep`; its factors are for checks against their dense recomputation.
    """
    with torch.no_grad():
        tau, nu = site_precision.detach().clone(), site_natural_mean.detach().clone()
        factors = RankOneFactors.from_sites(prior, tau, nu)
        prior_variance = prior.dtc_variance.detach()
        visits = torch.arange(len(tau)) if order is None else order
        change, skipped = 0.0, 0
        for index in visits.tolist():
            if active is not None and not bool(active[index]):
                continue
            mean, variance = factors.marginal(index)
            sl = slice(index, index + 1)
            update = update_sites(
                adapter,
                targets[sl],
                mean[None],
                variance[None],
                tau[sl],
                nu[sl],
                damping,
                prior_variance[sl],
                rows_block=RowBlock.single(1),
            )
            if bool(update.skipped[0]):
                skipped += 1
                continue
            change = max(change, update.change)
            precision_change = update.site_precision[0] - tau[index]
            natural_mean_change = update.site_natural_mean[0] - nu[index]
            factors.update(index, precision_change, natural_mean_change)
            tau[index], nu[index] = update.site_precision[0], update.site_natural_mean[0]
        return SequentialSweep(tau, nu, factors, change, skipped)


class UncertainSparseEP(SparseEP):
    r"""EP under the expected DTC prior of uncertain inputs (module docstring); an outer loop for
    :func:`~gpytorch_iterncgp.core.outer_loop.run_outer_loop`, with :class:`~gpytorch_iterncgp.sparse.dtc.SparseEPState`
    states (:math:`\mathbf L_B`, :math:`\bar{\mathbf z}` of :func:`uncertain_posterior`).

    :param prior: the expected DTC prior (for the current kernel, inducing inputs and :math:`q(\mathbf X)`).
    :param adapter: a :math:`C = 1` likelihood with tilted moments.
    :param targets: validated targets ``(N,)``.
    :param damping: :math:`\delta \in (0, 1]`.
    :param site_tol: converged when the largest relative site change a sweep proposes is below it.
    :param schedule: ``"parallel"`` (every site from the same marginals, GPstuff's parallel EP) or
        ``"sequential"`` (:func:`sequential_sweep`, the rank-one updates of eq. S.26-S.32).
    """

    name = "EP-DTC (uncertain inputs)"

    def __init__(
        self,
        prior: UncertainDTCPrior,
        adapter: LikelihoodAdapter,
        targets: Tensor,
        damping: float,
        site_tol: float,
        schedule: str = "parallel",
    ):
        if schedule not in ("parallel", "sequential"):
            raise ValueError(f"schedule must be 'parallel' or 'sequential', got {schedule!r}.")
        super().__init__(prior, adapter, targets, damping, site_tol)
        self.uncertain_prior, self.schedule = prior, schedule

    def steps(self, state: SparseEPState) -> Generator[OuterStep, None, None]:
        """Sweeps from ``state`` until converged (the driver limits their number)."""
        if self.schedule == "parallel":
            yield from super().steps(state)
            return
        while True:
            sweep = sequential_sweep(
                self.uncertain_prior,
                self.adapter,
                self.targets,
                state.site_precision,
                state.site_natural_mean,
                self.damping,
                active=self.active,
            )
            state = self.posterior(sweep.site_precision, sweep.site_natural_mean, state.sweeps + 1)
            record = EPSweep(
                step=state.sweeps,
                site_change=sweep.change,
                damping=self.damping,
                skipped_sites=sweep.skipped,
                bounded_cavities=0,
                clipped_sites=0,
                solver_iterations=0,
                residual_norm=0.0,
            )
            status = (
                LoopStatus.CONVERGED if sweep.skipped == 0 and sweep.change <= self.site_tol else LoopStatus.CONTINUE
            )
            yield OuterStep(record, state, status)
            if status is not LoopStatus.CONTINUE:
                return
