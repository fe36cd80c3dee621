r"""Sparse EP-DTC: expectation propagation under the DTC prior of :math:`M` inducing inputs (Sparse EP-DTC, sec. S3).

The inducing inputs :math:`\mathbf Z` define the deterministic training conditional (Sparse EP-DTC, eq. S.7-S.8)
with prior :math:`\mathbf f \sim \mathcal N(\mathbf m, \mathbf Q_{ff})`, :math:`\mathbf Q_{ff} = \mathbf K_{fu}
\mathbf K_{uu}^{-1} \mathbf K_{uf}`. With the sites :math:`\tilde{\mathbf T} = \operatorname{diag}(\tilde\tau_i)`,
:math:`\tilde{\boldsymbol\nu}` the posterior (eq. S.10-S.12, with a prior mean) is

.. math::
    \boldsymbol\Sigma = \mathbf K_{fu} (\mathbf K_{uu} + \mathbf K_{uf} \tilde{\mathbf T} \mathbf K_{fu})^{-1}
    \mathbf K_{uf}, \qquad
    \boldsymbol\mu = \mathbf m + \boldsymbol\Sigma (\tilde{\boldsymbol\nu} - \tilde{\mathbf T} \mathbf m)

(:math:`\boldsymbol\mu = \boldsymbol\Sigma(\mathbf Q_{ff}^{-1}\mathbf m + \tilde{\boldsymbol\nu})` and
:math:`\boldsymbol\Sigma \mathbf Q_{ff}^{-1} = \mathbf I - \boldsymbol\Sigma \tilde{\mathbf T}`). It is computed in
the whitened form: :math:`\mathbf L \mathbf L^\top = \mathbf K_{uu} + \epsilon \bar k \mathbf I`,
:math:`\mathbf V = \mathbf L^{-1} \mathbf K_{uf}` (:math:`M \times N`, so :math:`\mathbf Q_{ff} = \mathbf V^\top
\mathbf V`), :math:`\mathbf B = \mathbf I_M + \mathbf V \tilde{\mathbf T} \mathbf V^\top = \mathbf L_B
\mathbf L_B^\top`; then :math:`\boldsymbol\Sigma = \mathbf V^\top \mathbf B^{-1} \mathbf V`, the marginal
variances are the squared column norms of :math:`\mathbf L_B^{-1}\mathbf V` and :math:`\boldsymbol\mu = \mathbf m +
\mathbf V^\top \bar{\mathbf z}` with :math:`\bar{\mathbf z} = \mathbf B^{-1}\mathbf V(\tilde{\boldsymbol\nu} -
\tilde{\mathbf T}\mathbf m)`, the posterior mean of the whitened inducing values :math:`\mathbf z = \mathbf L^{-1}
(\mathbf u - \mathbf m_u)` (posterior covariance :math:`\mathbf B^{-1}`). One sweep costs one :math:`M \times M`
Cholesky and :math:`O(M^2 N)`; :math:`\mathbf V` is computed once per fit (per kernel).

**Jitter.** :math:`\epsilon` is ``linear_operator.settings.cholesky_jitter`` of the dtype (1e-8 in float64, 1e-6
in float32), taken *relative* to :math:`\bar k`, the mean of :math:`\operatorname{diag}\mathbf K_{uu}`, so that it
does not depend on the outputscale. It perturbs :math:`\mathbf Q_{ff}` by :math:`O(\epsilon \bar k)`: with
:math:`M = N` inducing inputs at the data, EP-DTC is dense EP to about that relative accuracy.

**Sweeps.** Parallel damped sweeps (GPstuff's parallel EP): every site from the same posterior marginals by
:func:`~gpytorch_iterncgp.ep.sites.update_sites`, with the cavity precisions bounded below by the DTC prior
precisions :math:`1/q_{ii}` (the exact cavity is never wider than the prior; inactive up to rounding here, since
the DTC marginals are exact for the DTC prior). A point with :math:`q_{ii} \le \epsilon_{mach} k_{ii}` (far from
every inducing input) has :math:`f_i = m_i` under the DTC prior: its site cannot change the posterior, it is
kept flat and not updated (counted in neither ``skipped`` nor ``bounded``). The fixed point does not depend on the
damping; it is the fixed point of the sequential updates of eq. S.13-S.16 (not implemented here: a sequential
sweep of rank-one Cholesky updates costs the same :math:`O(M^2 N)` but cannot be batched).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from dataclasses import dataclass

import torch
from linear_operator import settings as linop_settings
from torch import Tensor

from ..core.outer_loop import EPSweep, LoopStatus, OuterStep, sites_progressed
from ..core.sharding import RowBlock
from ..core.state import ExtraState
from ..ep.sites import update_sites
from ..likelihoods.adapters import LikelihoodAdapter


@dataclass
class WhitenedInducing:
    r"""The whitened inducing space of the DTC family (module docstring): :math:`\mathbf L` with :math:`\mathbf L
    \mathbf L^\top = \mathbf K_{uu} + \epsilon \bar k \mathbf I`, the coordinates :math:`\mathbf z = \mathbf L^{-1}
    (\mathbf u - \mathbf m_u) \sim \mathcal N(\mathbf 0, \mathbf I_M)` a priori, and in them the system
    :math:`\mathbf B = \mathbf I_M + \mathbf V \tilde{\mathbf T} \mathbf R^{-1} \mathbf V^\top` of Gaussian sites and the
    posterior :math:`q(\mathbf z) = \mathcal N(\bar{\mathbf z}, \mathbf B^{-1})`.

    EP-DTC (:class:`SparseEP`), its uncertain-input variant (:mod:`~gpytorch_iterncgp.sparse.uncertain`), both bounds
    (:mod:`~gpytorch_iterncgp.mlls.sparse`, :mod:`~gpytorch_iterncgp.mlls.uncertain`) and the predictions
    (:class:`~gpytorch_iterncgp.SparseEPStrategy`, :mod:`~gpytorch_iterncgp.sparse.uncertain_prediction`) all work in
    it. The sites may be those of any subset of the points (a minibatch): :meth:`whiten` takes the cross-covariance
    of any batch of points, :meth:`system_cholesky` any sites with their whitened cross-covariances.

    :param cholesky: :math:`\mathbf L` ``(M, M)``.
    """

    cholesky: Tensor

    @classmethod
    def from_covariance(cls, inducing_covariance: Tensor) -> WhitenedInducing:
        r"""From :math:`\mathbf K_{uu}` ``(M, M)``, jittered by :math:`\epsilon \bar k` (module docstring).

        :raises ValueError: if even the jittered :math:`\mathbf K_{uu}` is not positive definite (duplicate inducing
            inputs with a very long lengthscale, or non-finite kernel values).
        """
        dtype = inducing_covariance.dtype
        scale = inducing_covariance.diagonal(dim1=-2, dim2=-1).mean()
        jitter = linop_settings.cholesky_jitter.value(dtype) * scale
        eye = torch.eye(inducing_covariance.shape[-1], dtype=dtype, device=inducing_covariance.device)
        cholesky, info = torch.linalg.cholesky_ex(inducing_covariance + jitter * eye)
        if bool(info.any()):
            raise ValueError(
                "EP-DTC: K_uu (the kernel at the inducing points) is not positive definite even with a relative "
                f"jitter of {linop_settings.cholesky_jitter.value(dtype):g}; remove duplicate inducing points or raise "
                "linear_operator.settings.cholesky_jitter."
            )
        return cls(cholesky)

    def whiten(self, cross: Tensor) -> Tensor:
        r""":math:`\mathbf V = \mathbf L^{-1}\mathbf K_{u*}`: the whitened cross-covariance of a batch of points,
        ``(M, N*)`` for ``cross`` ``(M, N*)`` (or batched ``(..., M, K)``)."""
        return torch.linalg.solve_triangular(self.cholesky, cross, upper=False)

    def whiten_symmetric(self, matrices: Tensor) -> Tensor:
        r""":math:`\mathbf L^{-1}\mathbf C\mathbf L^{-\top}` for symmetric ``matrices`` :math:`\mathbf C` ``(..., M, M)``."""
        return self.whiten(self.whiten(matrices).mT)

    def precision(self) -> Tensor:
        r""":math:`(\mathbf L\mathbf L^\top)^{-1}` ``(M, M)``, the jittered :math:`\mathbf K_{uu}^{-1}`."""
        return torch.cholesky_inverse(self.cholesky)

    @staticmethod
    def system_cholesky(whitened_cross: Tensor, site_precision: Tensor, ratio: Tensor | None = None) -> Tensor:
        r""":math:`\mathbf L_B` ``(M, M)``, the Cholesky factor of :math:`\mathbf B = \mathbf I_M + \mathbf V
        \tilde{\mathbf T}\mathbf R^{-1}\mathbf V^\top`: B from the site precisions :math:`\tilde{\boldsymbol\tau} \ge 0`
        ``(N,)`` at points of whitened cross-covariance :math:`\mathbf V` ``(M, N)`` (:meth:`whiten`), with
        ``ratio`` :math:`r_i = 1 + \tilde\tau_i s_i` ``(N,)`` for a prior with independent variances :math:`\mathbf s`
        (``None``: :math:`\mathbf R = \mathbf I`, the DTC prior)."""
        root = site_precision.sqrt()
        if ratio is not None:  # sqrt(tau) / sqrt(r), not sqrt(tau / r): the latter's slope is infinite at tau = 0
            root = root / ratio.sqrt()
        rooted = whitened_cross * root
        eye = torch.eye(len(whitened_cross), dtype=whitened_cross.dtype, device=whitened_cross.device)
        return torch.linalg.cholesky(rooted @ rooted.mT + eye)

    @classmethod
    def posterior(
        cls,
        prior_mean: Tensor,
        whitened_cross: Tensor,
        site_precision: Tensor,
        site_natural_mean: Tensor,
        spread: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        r"""The posterior of Gaussian sites under a whitened low-rank prior with an independent part: the prior
        :math:`\mathbf f \sim \mathcal N(\mathbf m, \mathbf V^\top \mathbf V + \operatorname{diag}(\mathbf s))`, the
        sites :math:`\tilde{\boldsymbol\tau}, \tilde{\boldsymbol\nu}` ``(N,)``. With :math:`r_i = 1 + \tilde\tau_i s_i`,
        :math:`\mathbf B = \mathbf L_B \mathbf L_B^\top` (:meth:`system_cholesky`), :math:`\bar{\mathbf z} =
        \mathbf B^{-1} \mathbf V \mathbf R^{-1}(\tilde{\boldsymbol\nu} - \tilde{\mathbf T}\mathbf m)`, the marginal means
        :math:`\mathbf m + \mathbf R^{-1}\mathbf V^\top \bar{\mathbf z} + \mathbf s \odot \mathbf R^{-1}
        (\tilde{\boldsymbol\nu} - \tilde{\mathbf T}\mathbf m)` and variances :math:`s_i / r_i + \|(\mathbf L_B^{-1}
        \mathbf V)_{:, i}\|^2 / r_i^2`. The DTC prior is :math:`\mathbf s = \mathbf 0` (module docstring,
        :math:`\mathbf R = \mathbf I` exactly); uncertain inputs add the spread of their expected prior
        (:mod:`~gpytorch_iterncgp.sparse.uncertain`). Differentiable in the prior.

        :return: :math:`\mathbf L_B` ``(M, M)``, :math:`\bar{\mathbf z}` ``(M,)``, the marginal means and variances
            ``(N,)``.
        """
        ratio = 1 + site_precision * spread  # r_i
        cholesky = cls.system_cholesky(whitened_cross, site_precision, ratio)
        projected = torch.linalg.solve_triangular(cholesky, whitened_cross, upper=False)  # L_B^{-1} V
        residual = (site_natural_mean - site_precision * prior_mean) / ratio  # R^{-1}(nu - T m)
        inner = projected @ residual
        whitened_mean = torch.linalg.solve_triangular(cholesky.mT, inner[:, None], upper=True)[:, 0]
        mean = prior_mean + (whitened_cross.mT @ whitened_mean) / ratio + spread * residual
        variance = spread / ratio + projected.square().sum(0) / ratio.square()
        return cholesky, whitened_mean, mean, variance


def inducing_cholesky(inducing_covariance: Tensor) -> Tensor:
    r""":math:`\mathbf L` of :meth:`WhitenedInducing.from_covariance` (see there)."""
    return WhitenedInducing.from_covariance(inducing_covariance).cholesky


@dataclass
class DTCPrior:
    r"""The DTC prior at the training inputs: :math:`\mathbf m` ``(N,)``, :math:`\operatorname{diag}\mathbf K_{ff}`
    ``(N,)``, :math:`\mathbf L` ``(M, M)`` and :math:`\mathbf V = \mathbf L^{-1}\mathbf K_{uf}` ``(M, N)``.

    Also the product counter of :func:`~gpytorch_iterncgp.core.outer_loop.run_outer_loop` (EP-DTC makes no products with
    the :math:`N \times N` kernel: the counts stay 0).
    """

    mean: Tensor
    diagonal: Tensor
    cholesky: Tensor
    whitened_cross: Tensor
    products: int = 0
    columns: int = 0
    product_seconds: float = 0.0
    products_aside: int = 0
    columns_aside: int = 0
    product_seconds_aside: float = 0.0

    @classmethod
    def from_blocks(cls, mean: Tensor, diagonal: Tensor, inducing_covariance: Tensor, cross: Tensor) -> DTCPrior:
        """From :math:`\\mathbf m`, :math:`\\operatorname{diag}\\mathbf K_{ff}`, :math:`\\mathbf K_{uu}` and :math:`\\mathbf K_{uf}`."""
        whitening = WhitenedInducing.from_covariance(inducing_covariance)
        return cls(mean, diagonal, whitening.cholesky, whitening.whiten(cross))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the prior is computed in."""
        return self.mean.dtype

    @property
    def whitening(self) -> WhitenedInducing:
        r"""The whitened inducing space of :math:`\\mathbf L`."""
        return WhitenedInducing(self.cholesky)

    def independent_variance(self) -> Tensor:
        r"""The prior's independent variances :math:`\\mathbf s` ``(N,)`` beside :math:`\\mathbf V^\\top\\mathbf V`: 0 here
        (:class:`~gpytorch_iterncgp.sparse.uncertain.UncertainDTCPrior`: :math:`\\operatorname{diag}\\boldsymbol\\Lambda`)."""
        return torch.zeros_like(self.mean)

    def posterior(self, site_precision: Tensor, site_natural_mean: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        r"""The posterior of the sites ``(N,)`` under this prior (:meth:`WhitenedInducing.posterior`): :math:`\\mathbf L_B`
        ``(M, M)``, :math:`\\bar{\\mathbf z}` ``(M,)``, the marginal means and variances ``(N,)``; differentiable."""
        spread = self.independent_variance()
        return WhitenedInducing.posterior(self.mean, self.whitened_cross, site_precision, site_natural_mean, spread)

    def detached(self) -> DTCPrior:
        """The same prior without autograd history (for the EP fit; the bounds are differentiated at fixed sites)."""
        return DTCPrior(
            self.mean.detach(), self.diagonal.detach(), self.cholesky.detach(), self.whitened_cross.detach()
        )

    @property
    def dtc_variance(self) -> Tensor:
        r""":math:`q_{ii} = \|\mathbf V_{:, i}\|^2`, ``(N,)``."""
        return self.whitened_cross.square().sum(0)


def dtc_posterior(
    prior: DTCPrior, site_precision: Tensor, site_natural_mean: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""The posterior of the sites under the DTC prior (module docstring; :meth:`DTCPrior.posterior`),
    differentiable in ``prior``.

    :return: :math:`\mathbf L_B` ``(M, M)``, :math:`\bar{\mathbf z}` ``(M,)``, the marginal means and variances ``(N,)``.
    """
    return prior.posterior(site_precision, site_natural_mean)


@dataclass
class SparseEPState(ExtraState):
    r"""Where the EP-DTC loop stands: the sites ``(N,)``, their posterior in the whitened inducing space
    (:math:`\mathbf L_B` ``(M, M)``, :math:`\bar{\mathbf z}` ``(M,)``; module docstring) and its marginals at the
    training inputs ``(N,)``."""

    site_precision: Tensor
    site_natural_mean: Tensor
    posterior_cholesky: Tensor  # L_B, B = I + V T V^T
    whitened_mean: Tensor  # z bar = B^{-1} V (nu - tau m)
    marginal_mean: Tensor
    marginal_variance: Tensor
    sweeps: int = 0
    solved: bool = True  # the posterior tensors belong to these sites and the current kernel / inducing inputs

    saved_by = "SparseEPStrategy"
    optional_entries = frozenset({"solved"})  # not saved by the first versions

    @classmethod
    def expected_shapes(cls, saved: dict[str, Tensor]) -> dict[str, tuple[int, ...]]:
        r"""``(N,)`` for the sites and marginals, ``(M, M)`` and ``(M,)`` for :math:`\mathbf L_B` and
        :math:`\bar{\mathbf z}`; ``N`` from ``site_precision``, ``M`` from ``whitened_mean``."""
        size, rank = (saved["site_precision"].numel(),), (saved["whitened_mean"].numel(),)
        return {
            "site_precision": size,
            "site_natural_mean": size,
            "posterior_cholesky": rank + rank,
            "whitened_mean": rank,
            "marginal_mean": size,
            "marginal_variance": size,
        }


class SparseEP:
    r"""Parallel damped EP under the DTC prior (see the module docstring); an outer loop for
    :func:`~gpytorch_iterncgp.core.outer_loop.run_outer_loop`.

    :param prior: the DTC prior at the training inputs (for the current kernel and inducing inputs).
    :param adapter: a :math:`C = 1` likelihood with tilted moments.
    :param targets: validated targets ``(N,)``.
    :param damping: :math:`\delta \in (0, 1]`, the fraction of the way each sweep moves the sites.
    :param site_tol: converged when the largest relative site change a sweep proposes is below it (and no site was
        skipped).
    """

    name = "EP-DTC"
    step_name = "sweeps"
    stall_advice = "Sweeps that oscillate need a smaller damping."

    def made_progress(self, reference: EPSweep, record: EPSweep) -> bool:
        """The stall rule's test (:func:`~gpytorch_iterncgp.core.outer_loop.sites_progressed`)."""
        return sites_progressed(reference, record, self.site_tol)

    def __init__(self, prior: DTCPrior, adapter: LikelihoodAdapter, targets: Tensor, damping: float, site_tol: float):
        if adapter.num_latents != 1:
            raise ValueError("EP-DTC is for one latent function (C = 1).")
        self.prior, self.adapter, self.targets = prior, adapter, targets
        self.damping, self.site_tol = damping, site_tol
        dtc_variance = prior.dtc_variance
        self.active = dtc_variance > torch.finfo(dtc_variance.dtype).eps * prior.diagonal
        self.prior_variance = dtc_variance[self.active]

    def posterior(self, site_precision: Tensor, site_natural_mean: Tensor, sweeps: int) -> SparseEPState:
        """The state of these sites (their posterior under the loop's prior: :meth:`DTCPrior.posterior`)."""
        parts = self.prior.posterior(site_precision, site_natural_mean)
        return SparseEPState(site_precision, site_natural_mean, *parts, sweeps=sweeps, solved=True)

    def initial_state(self) -> SparseEPState:
        """The prior: every site flat."""
        zeros = torch.zeros_like(self.prior.mean)
        return self.posterior(zeros, zeros.clone(), 0)

    def renew(self, state: SparseEPState) -> SparseEPState:
        """``state`` after a change of the kernel or the inducing inputs: the sites are kept (a warm start), the
        posterior is recomputed by the next :meth:`steps`."""
        return dataclasses.replace(state, solved=False)

    def finalize(self, state: SparseEPState) -> SparseEPState:
        """The posterior of the committed sites (recomputed if :meth:`renew` left it stale and no sweep ran)."""
        return state if state.solved else self.posterior(state.site_precision, state.site_natural_mean, state.sweeps)

    def steps(self, state: SparseEPState) -> Generator[OuterStep, None, None]:
        """Parallel EP-DTC sweeps from ``state`` until converged (the driver limits their number)."""
        active = self.active
        if not state.solved:
            state = self.finalize(state)
        while True:
            update = update_sites(
                self.adapter,
                self.targets[active],
                state.marginal_mean[active],
                state.marginal_variance[active],
                state.site_precision[active],
                state.site_natural_mean[active],
                self.damping,
                self.prior_variance,
                rows_block=RowBlock.single(int(active.sum())),
            )
            precision, natural_mean = state.site_precision.clone(), state.site_natural_mean.clone()
            precision[active], natural_mean[active] = update.site_precision, update.site_natural_mean
            state = self.posterior(precision, natural_mean, state.sweeps + 1)
            skipped = int(update.skipped.sum())
            record = EPSweep(
                step=state.sweeps,
                site_change=update.change,
                damping=self.damping,
                skipped_sites=skipped,
                bounded_cavities=int(update.bounded.sum()),
                clipped_sites=int(update.clipped.sum()),
                solver_iterations=0,
                residual_norm=0.0,
            )
            status = LoopStatus.CONVERGED if skipped == 0 and update.change <= self.site_tol else LoopStatus.CONTINUE
            yield OuterStep(record, state, status)
            if status is not LoopStatus.CONTINUE:
                return
