r"""Stochastic expectation propagation (SEP) with inducing inputs: memory :math:`O(C M^2)` whatever :math:`N`.

The model (Hernández-Lobato & Hernández-Lobato 2016, "Scalable Gaussian process classification via expectation
propagation", AISTATS; Villacampa-Calvo & Hernández-Lobato 2017 for :math:`C` classes): :math:`C` latent processes
:math:`f_c`, each with :math:`M` inducing inputs :math:`\mathbf Z` and whitened inducing values
:math:`\mathbf z_c = \mathbf L^{-1}(\mathbf u_c - \mathbf m_{u})`, :math:`\mathbf L \mathbf L^\top = \mathbf K_{uu}`
(:class:`~gpytorch_iterncgp.sparse.dtc.WhitenedInducing`), prior :math:`\mathbf z_c \sim \mathcal N(\mathbf 0,
\mathbf I_M)`, and the FITC conditional of each latent value,

.. math::
    f_{ic} \mid \mathbf z_c \sim \mathcal N(m_{ic} + \mathbf v_i^\top \mathbf z_c,\; s_i), \qquad
    \mathbf v_i = \mathbf L^{-1}\mathbf k_{u i}, \quad s_i = k_{ii} - \|\mathbf v_i\|^2 \ (\ge 0).

**Sites.** SEP (Li, Hernández-Lobato & Turner 2015) ties the :math:`N` sites of each class into one:
:math:`q(\mathbf z_c) \propto \mathcal N(\mathbf z_c \mid \mathbf 0, \mathbf I)\,\bar t_c(\mathbf z_c)^N` with
:math:`\bar t_c(\mathbf z) = \exp(-\tfrac12 \mathbf z^\top \tilde{\boldsymbol\Lambda}_c \mathbf z / N +
\tilde{\boldsymbol\eta}_c^\top \mathbf z / N)`, so the state is :math:`\tilde{\boldsymbol\Lambda}_c` ``(M, M)`` and
:math:`\tilde{\boldsymbol\eta}_c` ``(M,)`` per class (:class:`TiedSite`). With :math:`\mathbf B_c(\phi) = \mathbf I
+ \phi\tilde{\boldsymbol\Lambda}_c` the posterior is :math:`q = \mathcal N(\mathbf B_c(1)^{-1}\tilde{\boldsymbol
\eta}_c, \mathbf B_c(1)^{-1})` and every point's cavity is the same, :math:`q_{\setminus} = \mathcal N(\phi\,
\mathbf B_c(\phi)^{-1}\tilde{\boldsymbol\eta}_c, \mathbf B_c(\phi)^{-1})` with :math:`\phi = 1 - 1/N`
(:func:`tied_gaussian`): one :math:`M \times M` Cholesky factor per class for a whole minibatch.

**Per-point sites** (:class:`PointSites`): EP with inducing inputs and the FITC conditional (Hernández-Lobato &
Hernández-Lobato 2016, before tying), one site :math:`\tau_{ic}, \nu_{ic}` per point in :math:`f`, memory
:math:`O(C N)`, for full-batch steps: :math:`q` is the prior times all the sites lifted to :math:`\mathbf z_c`, each
point's cavity :math:`q` without its own site (a rank-one change), and a step moves every site a fraction
:math:`\epsilon` to its new value (damped parallel EP). The sites are those of the first step's points in their order:
each step's batch must hold the same inputs (checked by a digest of them,
:func:`~gpytorch_iterncgp.core.state.data_fingerprint`). With :math:`M = N` inducing inputs at the data
(:math:`s_i = 0`) it is dense EP of the factorised model: for one latent, the package's dense EP.

**A step on a minibatch** :math:`\mathcal B` (:meth:`StochasticEP.step`):

1. the cavity's marginals at the batch, :math:`\mu_{ic} = m_{ic} + \mathbf v_i^\top \bar{\mathbf z}_{\setminus c}`,
   :math:`\sigma_{ic}^2 = s_i + \|\mathbf L_{\setminus c}^{-1}\mathbf v_i\|^2` (:func:`batch_marginals`);
2. the tilted moments of each point (:func:`tilted`): a :math:`C = 1` likelihood's
   (:func:`~gpytorch_iterncgp.likelihoods.tilted.tilted_moments`), or the multinomial probit's projected on the
   factorised family (:func:`~gpytorch_iterncgp.likelihoods.factorised.factorised_moments`);
3. the new site of each point in :math:`f` (R&W eq. 3.59 with the cavity given): :math:`\tau_{ic} =
   \hat\sigma_{ic}^{-2} - \sigma_{ic}^{-2}`, :math:`\nu_{ic} = \hat\mu_{ic}\hat\sigma_{ic}^{-2} - \mu_{ic}
   \sigma_{ic}^{-2}` (a negative :math:`\tau`, impossible for a log-concave likelihood in exact arithmetic, is
   clipped to 0), and through the conditional in :math:`\mathbf z_c`, with :math:`r_{ic} = 1 + \tau_{ic} s_i`: the
   rank-one precision :math:`(\tau_{ic}/r_{ic})\,\mathbf v_i \mathbf v_i^\top` and natural mean
   :math:`((\nu_{ic} - \tau_{ic} m_{ic})/r_{ic})\,\mathbf v_i` (:func:`new_sites`, :func:`lifted_sums`);
4. the tied site moves a fraction :math:`\epsilon` towards :math:`N` times the batch's average site,
   :math:`\tilde{\boldsymbol\Lambda}_c \leftarrow (1 - \epsilon)\tilde{\boldsymbol\Lambda}_c + \epsilon
   \tfrac{N}{|\mathcal B|}\sum_{i \in \mathcal B} (\tau_{ic}/r_{ic})\mathbf v_i\mathbf v_i^\top`, likewise
   :math:`\tilde{\boldsymbol\eta}_c`, with :math:`\epsilon_0 = 1` and :math:`\epsilon_t = \min(\delta,
   \max(|\mathcal B| / N, 1/(t + 1), \epsilon_{\min}))` at the :math:`t`-th step (:func:`step_fraction`): the plain
   average of the batches seen while they cover less than the data, then SEP's own :math:`|\mathcal B|/N` (each
   point's site replaces a :math:`1/N` share, Li et al. 2015), but at least :math:`\epsilon_{\min} = 1/100`, a
   memory of about a hundred steps, so that the site follows the kernel and the inducing inputs the optimiser moves
   every step (it matters past :math:`N = 100|\mathcal B|`; ``docs/design_notes.md``, stochastic EP), and at most
   the damping :math:`\delta = 1/2`: batches that cover most of the data move all sites at once, as parallel EP,
   which oscillates undamped (on iris at the outputscale dense EP learns, full batches diverged at
   :math:`\epsilon = 1` and converged at 1/2).

Step 1 is the cavity of each site kind (:meth:`InducingSite.cavity`), step 4 its move (:meth:`InducingSite.moved`);
steps 2 and 3 are shared. Steps 1-4 cost :math:`O(C(M^3 + |\mathcal B| M^2))`. Projecting each tilted
distribution in :math:`f` and moving the conditional gives the moment-matched projection in :math:`\mathbf z_c`
(the tilted distribution of :math:`(\mathbf z_c, f_{ic})` keeps the cavity's conditional of :math:`\mathbf z_c`
given :math:`f_{ic}`).

**Energy.** With the tied site held fixed in the whitened coordinates, the terms of SEP's approximation of
:math:`\log p(\mathbf y)` that involve only :math:`q`, :math:`q_\setminus` and the prior
:math:`\mathcal N(\mathbf 0, \mathbf I)` do not depend on the kernel, the mean or :math:`\mathbf Z`; what does is
:math:`\sum_i \log\hat Z_i`, :math:`\hat Z_i = \int p(y_i \mid \mathbf f_i)\, q_\setminus(\mathbf f_i)\,
d\mathbf f_i`, whose minibatch estimate :math:`\frac{N}{|\mathcal B|}\sum_{i \in \mathcal B}\log\hat Z_i` is
unbiased (:meth:`StochasticEP.log_normalizers` gives the terms, differentiable in the prior). With per-point sites
held fixed in the whitened coordinates, the same argument gives EP's energy gradient: at EP's fixed point the
energy is stationary in the sites, so the gradient of :math:`\sum_i \log\hat Z_i` is the evidence's (R&W eq. 5.27 at
:math:`M = N`). A training step evaluates the prior once: the cavities at the batch, differentiable in it, give the
energy, and detached, the step (the energy is that of the site before the step).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.state import ExtraState, data_fingerprint
from ..likelihoods.adapters import LikelihoodAdapter
from ..likelihoods.factorised import factorised_moments
from ..likelihoods.tilted import tilted_moments
from .dtc import WhitenedInducing


def column_norms(matrix: Tensor) -> Tensor:
    r""":math:`\|\mathbf a_i\|^2` for the columns of ``matrix`` ``(..., M, B)``: ``(..., B)``."""
    return (matrix * matrix).sum(-2)  # half the backward of square().sum(-2)


def along(matrix: Tensor, vector: Tensor) -> Tensor:
    r""":math:`\mathbf a_i^\top\mathbf x` for the columns of ``matrix`` ``(..., M, B)`` and ``vector`` ``(..., M)``:
    ``(..., B)``."""
    return (vector.unsqueeze(-2) @ matrix).squeeze(-2)


@dataclass
class WhitenedBatch:
    r"""The prior at a batch of :math:`B` points in the whitened inducing coordinates (module docstring):
    :math:`\mathbf m` ``(C, B)``, :math:`\mathbf V` ``(K, M, B)`` and :math:`\mathbf s` ``(K, B)`` with :math:`K = 1`
    for a kernel shared by the :math:`C` latents, :math:`K = C` for one per latent; ``inputs``: the points' inputs
    ``(B, D)`` where known (a reference, not a copy), which per-point sites check (:class:`PointSites`)."""

    mean: Tensor
    whitened_cross: Tensor
    spread: Tensor
    inputs: Tensor | None = None

    @classmethod
    def from_blocks(
        cls, mean: Tensor, inducing_covariance: Tensor, cross: Tensor, diagonal: Tensor, inputs: Tensor | None = None
    ) -> WhitenedBatch:
        r"""From :math:`\mathbf m` ``(C, B)``, :math:`\mathbf K_{uu}` ``(K, M, M)``, :math:`\mathbf K_{ub}` ``(K, M, B)``
        and :math:`\operatorname{diag}\mathbf K_{bb}` ``(K, B)``; differentiable in all of them; ``inputs``: the
        points' ``(B, D)``, if known."""
        whitened = WhitenedInducing.from_covariance(inducing_covariance).whiten(cross)
        return cls(mean, whitened, (diagonal - column_norms(whitened)).clamp_min(0), inputs)

    def detached(self) -> WhitenedBatch:
        """The same batch without gradient."""
        inputs = None if self.inputs is None else self.inputs.detach()
        return WhitenedBatch(self.mean.detach(), self.whitened_cross.detach(), self.spread.detach(), inputs)


class InducingSite(ExtraState, abc.ABC):
    r"""What the steps need of a site in the whitened inducing coordinates: :attr:`precision`
    :math:`\tilde{\boldsymbol\Lambda}` ``(C, M, M)`` and :attr:`natural_mean` :math:`\tilde{\boldsymbol\eta}`
    ``(C, M)``, the sum of the sites, so that :math:`q = \mathcal N(\mathbf B^{-1}\tilde{\boldsymbol\eta},
    \mathbf B^{-1})`, :math:`\mathbf B = \mathbf I + \tilde{\boldsymbol\Lambda}`; the points' cavities; and a step's
    move. :class:`TiedSite` (SEP) and :class:`PointSites` (EP)."""

    precision: Tensor
    natural_mean: Tensor
    steps: int

    def posterior(self, batch: WhitenedBatch) -> tuple[Tensor, Tensor]:
        r"""The marginals of :math:`q` at ``batch``, ``(C, B)`` each (:func:`batch_marginals`)."""
        return batch_marginals(*tied_gaussian(self, 1.0), batch)

    @abc.abstractmethod
    def cavity(self, batch: WhitenedBatch, num_data: int) -> tuple[Tensor, Tensor]:
        r"""Each point's cavity marginals ``(C, B)``, differentiable in ``batch`` with the sites held fixed in the
        whitened coordinates."""

    @abc.abstractmethod
    def moved(
        self, batch: WhitenedBatch, precision: Tensor, natural_mean: Tensor, fraction: float, num_data: int
    ) -> InducingSite:
        r"""The site after a step whose points got the new sites :math:`\tau_{ic}`, :math:`\nu_{ic}` ``(C, B)``."""


@dataclass
class TiedSite(InducingSite):
    r"""SEP's tied site (module docstring): :math:`\tilde{\boldsymbol\Lambda}` ``(C, M, M)``, symmetric positive
    semi-definite, and :math:`\tilde{\boldsymbol\eta}` ``(C, M)``, :math:`N` times the average site in the whitened
    inducing coordinates; ``steps``: the minibatch steps taken."""

    precision: Tensor
    natural_mean: Tensor
    steps: int = 0

    saved_by = "StochasticEPStrategy"

    @classmethod
    def flat(cls, num_latents: int, num_inducing: int, like: Tensor) -> TiedSite:
        """No information yet: :math:`q` is the prior."""
        zeros = like.new_zeros(num_latents, num_inducing)
        return cls(like.new_zeros(num_latents, num_inducing, num_inducing), zeros)

    @classmethod
    def expected_shapes(cls, saved: dict[str, Tensor]) -> dict[str, tuple[int, ...]]:
        """``(C, M, M)`` and ``(C, M)``, from ``natural_mean``."""
        num_latents, num_inducing = saved["natural_mean"].shape
        return {"precision": (num_latents, num_inducing, num_inducing), "natural_mean": (num_latents, num_inducing)}

    def cavity(self, batch: WhitenedBatch, num_data: int) -> tuple[Tensor, Tensor]:
        r"""Each point's cavity marginals ``(C, B)``, differentiable in ``batch`` with the site held fixed in the
        whitened coordinates: one cavity :math:`q_\setminus` for all, :math:`\phi = 1 - 1/N`."""
        with torch.no_grad():
            cholesky, mean = tied_gaussian(self, 1.0 - 1.0 / num_data)
        return batch_marginals(cholesky, mean, batch)

    def moved(
        self, batch: WhitenedBatch, precision: Tensor, natural_mean: Tensor, fraction: float, num_data: int
    ) -> TiedSite:
        r"""The tied site a ``fraction`` of the way towards :math:`N` times the average of the batch's new sites
        :math:`\tau_{ic}`, :math:`\nu_{ic}` ``(C, B)`` lifted to :math:`\mathbf z_c` (module docstring, step 4)."""
        lifted_precision, lifted_natural_mean = lifted_sums(batch, precision, natural_mean)
        scale = fraction * num_data / precision.shape[-1]
        return TiedSite(
            (1 - fraction) * self.precision + scale * lifted_precision,
            (1 - fraction) * self.natural_mean + scale * lifted_natural_mean,
            self.steps + 1,
        )


@dataclass
class PointSites(InducingSite):
    r"""One site per training point and latent, :math:`\tau_{ic}` and :math:`\nu_{ic}` ``(C, N)`` in :math:`f`
    (``site_precision``, ``site_natural_mean``): EP-FITC's state for full-batch steps (module docstring), memory
    :math:`O(C N)`; ``precision`` and ``natural_mean`` are their sum lifted to :math:`\mathbf z_c` at the last step's
    prior, which predictions use. Every step is on all :math:`N` points, in their order: ``inputs_digest`` is the
    :func:`~gpytorch_iterncgp.core.state.data_fingerprint` of the inputs of the steps so far (``""``: none known, as
    before the first step or in a state saved before it was kept), and a batch whose inputs have another digest (other
    points, or the same in another order) is refused. Before the first step the sites are ``(C, 0)``: none yet."""

    precision: Tensor
    natural_mean: Tensor
    site_precision: Tensor
    site_natural_mean: Tensor
    steps: int = 0
    inputs_digest: str = ""

    saved_by = "StochasticEPStrategy"
    optional_entries = frozenset({"inputs_digest"})  # not saved before it was kept

    @classmethod
    def flat(cls, num_latents: int, num_inducing: int, like: Tensor) -> PointSites:
        """No sites yet: :math:`q` is the prior."""
        tied = TiedSite.flat(num_latents, num_inducing, like)
        none = like.new_zeros(num_latents, 0)
        return cls(tied.precision, tied.natural_mean, none, none.clone())

    @classmethod
    def expected_shapes(cls, saved: dict[str, Tensor]) -> dict[str, tuple[int, ...]]:
        """Those of :class:`TiedSite`, and ``(C, N)`` for the sites, from ``site_precision``."""
        sites = tuple(saved["site_precision"].shape)
        return {**TiedSite.expected_shapes(saved), "site_precision": sites, "site_natural_mean": sites}

    def _sites(self, batch: WhitenedBatch) -> tuple[Tensor, Tensor, str]:
        r"""The sites :math:`\tau_{ic}, \nu_{ic}` ``(C, N)`` of ``batch``'s points (zeros before the first step) and
        the digest of its inputs (``""`` where it holds none).

        :raises ValueError: for a batch of another size, or of other inputs than the steps so far.
        """
        count, size = self.site_precision.shape[-1], batch.mean.shape[-1]
        digest = "" if batch.inputs is None else data_fingerprint(batch.inputs)
        if count == 0:
            zeros = batch.mean.detach().new_zeros(batch.mean.shape)
            return zeros, zeros, digest
        if count != size:
            raise ValueError(
                f"per-point sites need every step on all {count} training points, in their order; got a batch of "
                f"{size}. Use the tied site (sites='tied') for minibatches."
            )
        if digest and self.inputs_digest and digest != self.inputs_digest:
            raise ValueError(
                f"per-point sites need every step on the same {count} training points, in their order; this batch's "
                "inputs differ from the earlier steps' (other points, or the same points shuffled). Pass the training "
                "inputs in their order, or use the tied site (sites='tied') for minibatches."
            )
        return self.site_precision, self.site_natural_mean, digest

    def cavity(self, batch: WhitenedBatch, num_data: int) -> tuple[Tensor, Tensor]:
        r"""Each point's cavity marginals ``(C, N)``: :math:`q` without the point's own site, a rank-one change in
        :math:`\mathbf z_c` (Sherman–Morrison), differentiable in ``batch`` with the sites held fixed in the whitened
        coordinates. With :math:`\mathbf w_i` the detached :math:`\mathbf v_i`, :math:`\lambda_i, \eta_i` its lifted
        site (:func:`lifted_sums`), :math:`c_i = \mathbf v_i^\top\boldsymbol\Sigma\mathbf w_i` and :math:`d_i =
        \mathbf w_i^\top\boldsymbol\Sigma\mathbf w_i`: mean :math:`m_i + \mathbf v_i^\top\bar{\mathbf z} + c_i
        (\lambda_i\mathbf w_i^\top\bar{\mathbf z} - \eta_i)/(1 - \lambda_i d_i)` and variance :math:`s_i +
        \mathbf v_i^\top\boldsymbol\Sigma\mathbf v_i + \lambda_i c_i^2/(1 - \lambda_i d_i)`."""
        site_precision, site_natural_mean, _ = self._sites(batch)
        fixed = batch.detached()
        with torch.no_grad():
            ratio = 1 + site_precision * fixed.spread
            lift_precision = site_precision / ratio  # lambda_i (C, N)
            lift_natural_mean = (site_natural_mean - site_precision * fixed.mean) / ratio  # eta_i
            summed = TiedSite(*lifted_sums(fixed, site_precision, site_natural_mean))  # q's sites, summed
            cholesky, mean = tied_gaussian(summed, 1.0)
        projected = torch.linalg.solve_triangular(cholesky, batch.whitened_cross, upper=False)  # (C, M, N)
        fixed_projected = projected.detach()
        shared = (projected * fixed_projected).sum(-2)  # c_i
        denominator = 1 - lift_precision * column_norms(fixed_projected)  # 1 - lambda_i d_i
        fixed_along = along(fixed.whitened_cross, mean)  # w_i' z
        cavity_mean = (
            batch.mean
            + along(batch.whitened_cross, mean)
            + shared * (lift_precision * fixed_along - lift_natural_mean) / denominator
        )
        cavity_variance = batch.spread + column_norms(projected) + lift_precision * shared.square() / denominator
        return cavity_mean, cavity_variance

    def moved(
        self, batch: WhitenedBatch, precision: Tensor, natural_mean: Tensor, fraction: float, num_data: int
    ) -> PointSites:
        r"""Every point's site a ``fraction`` of the way to its new :math:`\tau_{ic}`, :math:`\nu_{ic}` ``(C, N)``
        (damped parallel EP), and their sum lifted at ``batch``; the digest of ``batch``'s inputs kept (the earlier
        one where it holds none)."""
        old_precision, old_natural_mean, digest = self._sites(batch)
        site_precision = (1 - fraction) * old_precision + fraction * precision
        site_natural_mean = (1 - fraction) * old_natural_mean + fraction * natural_mean
        summed = lifted_sums(batch, site_precision, site_natural_mean)
        return PointSites(*summed, site_precision, site_natural_mean, self.steps + 1, digest or self.inputs_digest)


def tied_gaussian(site: InducingSite, fraction: float) -> tuple[Tensor, Tensor]:
    r"""The Gaussian :math:`\mathcal N(\phi\mathbf B(\phi)^{-1}\tilde{\boldsymbol\eta}, \mathbf B(\phi)^{-1})`,
    :math:`\mathbf B(\phi) = \mathbf I + \phi\tilde{\boldsymbol\Lambda}`, of the prior times the tied site to the
    power :math:`\phi N`: the posterior for :math:`\phi = 1`, the cavity for :math:`\phi = 1 - 1/N`.

    :return: the Cholesky factor of :math:`\mathbf B(\phi)` ``(C, M, M)`` and the mean ``(C, M)``.
    """
    precision = site.precision
    eye = torch.eye(precision.shape[-1], dtype=precision.dtype, device=precision.device)
    cholesky = torch.linalg.cholesky(eye + fraction * (precision + precision.mT) / 2)
    mean = torch.cholesky_solve(fraction * site.natural_mean.unsqueeze(-1), cholesky).squeeze(-1)
    return cholesky, mean


class _ColumnQuadraticForms(torch.autograd.Function):
    r""":math:`\mathbf a_i^\top\mathbf S\mathbf a_i` for the columns of :math:`\mathbf A` ``(K, M, B)`` and a
    symmetric :math:`\mathbf S` ``(C, M, M)`` held fixed: ``(C, B)`` (:math:`K` is 1 or :math:`C`) from one product
    :math:`\mathbf S\mathbf A`, which is also the gradient, :math:`2\mathbf S\mathbf a_i` per unit of output.
    Autograd through :math:`\|\mathbf L^{-1}\mathbf a_i\|^2` would take two triangular solves instead."""

    @staticmethod
    def forward(ctx, matrix: Tensor, symmetric: Tensor) -> Tensor:
        product = symmetric @ matrix
        ctx.save_for_backward(product)
        ctx.matrix_shape = matrix.shape
        return (matrix * product).sum(-2)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (product,) = ctx.saved_tensors
        return (2 * product * grad.unsqueeze(-2)).sum_to_size(ctx.matrix_shape), None


def batch_marginals(cholesky: Tensor, mean: Tensor, batch: WhitenedBatch) -> tuple[Tensor, Tensor]:
    r"""The marginals of :math:`f_{ic}` under :math:`\mathcal N(\bar{\mathbf z}_c, \mathbf L_c^{-\top}\mathbf
    L_c^{-1})` and the conditional: means :math:`m_{ic} + \mathbf v_i^\top\bar{\mathbf z}_c` and variances
    :math:`s_i + \mathbf v_i^\top(\mathbf L_c\mathbf L_c^\top)^{-1}\mathbf v_i`, ``(C, B)`` each; differentiable
    in ``batch`` (the Gaussian held fixed). The variances come from the explicit covariance, one product with the
    batch instead of a triangular solve forward and another backward, and are as accurate as the solves
    (``docs/design_notes.md``).

    :param cholesky: :math:`\mathbf L_c` ``(C, M, M)``; ``mean``: :math:`\bar{\mathbf z}_c` ``(C, M)``
        (:func:`tied_gaussian`).
    """
    covariance = torch.cholesky_inverse(cholesky.detach())  # (C, M, M)
    quadratic = _ColumnQuadraticForms.apply(batch.whitened_cross, covariance)  # v_i' (L L')^-1 v_i
    return batch.mean + along(batch.whitened_cross, mean), batch.spread + quadratic


def tilted(
    adapter: LikelihoodAdapter, targets: Tensor, cavity_mean: Tensor, cavity_variance: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Tilted moments of each point under a factorised cavity (module docstring, step 2): :math:`\log\hat Z_i`
    ``(B,)``, differentiable in the cavity where it requires gradient (the energy's terms), and the means and variances
    ``(C, B)`` without gradient: a :math:`C = 1` likelihood's (:func:`~gpytorch_iterncgp.likelihoods.tilted.tilted_moments`),
    or the multinomial probit's projected on the factorised family
    (:func:`~gpytorch_iterncgp.likelihoods.factorised.factorised_moments`)."""
    if adapter.num_latents == 1:
        log_z, means, variances = tilted_moments(adapter, targets, cavity_mean[0], cavity_variance[0])
        return log_z, means.detach().unsqueeze(0), variances.detach().unsqueeze(0)
    log_z, means, variances = factorised_moments(targets, cavity_mean.mT, cavity_variance.mT)
    return log_z, means.mT, variances.mT


def new_sites(
    cavity_mean: Tensor, cavity_variance: Tensor, tilted_mean: Tensor, tilted_variance: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Each point's new site in :math:`f` (module docstring, step 3): :math:`\tau_{ic}` clipped at 0,
    :math:`\nu_{ic}` and which :math:`\tau_{ic}` were clipped, ``(C, B)`` each."""
    precision = tilted_variance.reciprocal() - cavity_variance.reciprocal()
    natural_mean = tilted_mean / tilted_variance - cavity_mean / cavity_variance
    clipped = precision < 0
    return precision.clamp_min(0), natural_mean, clipped


def lifted_sums(batch: WhitenedBatch, precision: Tensor, natural_mean: Tensor) -> tuple[Tensor, Tensor]:
    r"""Sites :math:`\tau_{ic}`, :math:`\nu_{ic}` ``(C, B)`` in :math:`f` lifted through the conditional to
    :math:`\mathbf z_c` and summed over the batch (module docstring, step 3), with :math:`r_{ic} = 1 + \tau_{ic}s_i`:
    :math:`\sum_i (\tau_{ic}/r_{ic})\mathbf v_i\mathbf v_i^\top` ``(C, M, M)`` and :math:`\sum_i ((\nu_{ic} -
    \tau_{ic} m_{ic})/r_{ic})\mathbf v_i` ``(C, M)``."""
    ratio = 1 + precision * batch.spread
    cross = batch.whitened_cross
    summed_precision = (cross * (precision / ratio).unsqueeze(-2)) @ cross.mT
    summed_natural_mean = cross @ ((natural_mean - precision * batch.mean) / ratio).unsqueeze(-1)
    return summed_precision, summed_natural_mean.squeeze(-1)


#: :math:`\delta`, the largest fraction of the way a step after the first moves the tied site (module docstring)
STEP_DAMPING = 0.5
#: :math:`\epsilon_{\min}`, the smallest fraction of the way a step moves the tied site (module docstring)
STEP_FLOOR = 0.01


def step_fraction(step: int, batch_size: int, num_data: int) -> float:
    r""":math:`\epsilon_0 = 1`, :math:`\epsilon_t = \min(\delta, \max(|\mathcal B| / N, 1 / (t + 1),
    \epsilon_{\min}))` (module docstring, step 4)."""
    if step == 0:
        return 1.0
    return min(STEP_DAMPING, max(batch_size / num_data, 1.0 / (step + 1), STEP_FLOOR))


@dataclass
class SEPStepRecord:
    r"""What one minibatch step saw: the batch's mean :math:`\log\hat Z_i` at the cavity, the fraction
    :math:`\epsilon` the tied site moved, its relative change (Frobenius norms), and the clipped sites."""

    step: int
    mean_log_normalizer: float
    fraction: float
    site_change: float
    clipped_sites: int


class StochasticEP:
    r"""SEP's minibatch steps and energy terms (module docstring) for a likelihood and :math:`N` data points, on a
    :class:`TiedSite` or, for full-batch EP, :class:`PointSites`.

    :param adapter: a :math:`C = 1` likelihood with tilted moments, or the multinomial probit over :math:`C` classes.
    :param num_data: :math:`N`, the number of training points the site stands for.
    """

    def __init__(self, adapter: LikelihoodAdapter, num_data: int):
        if not (adapter.has_tilted_moments or adapter.has_block_tilted_moments):
            raise TypeError(
                f"stochastic EP needs a likelihood with tilted moments (probit, logit, Poisson, or the multinomial "
                f"probit for C classes); got {type(adapter).__name__}."
            )
        self.adapter, self.num_data = adapter, int(num_data)

    def step(
        self,
        site: InducingSite,
        batch: WhitenedBatch,
        targets: Tensor,
        cavity: tuple[Tensor, Tensor] | None = None,
        moments: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> tuple[InducingSite, SEPStepRecord]:
        r"""One step (module docstring, steps 1-4) from ``site``; ``batch`` at the points of ``targets``; ``cavity``:
        the points' cavity marginals if already computed (:meth:`InducingSite.cavity`), and ``moments`` the tilted
        moments at them (:func:`tilted`). Returns the new site and the step's record (read on the host: a
        synchronisation on a GPU; :meth:`update` skips it)."""
        new, log_z, fraction, clipped = self._step(site, batch, targets, cavity, moments)
        with torch.no_grad():
            change = float(torch.linalg.matrix_norm(new.precision - site.precision).max()) / max(
                float(torch.linalg.matrix_norm(new.precision).max()), math.ulp(1.0)
            )
        record = SEPStepRecord(new.steps, float(log_z.mean()), fraction, change, int(clipped.sum()))
        return new, record

    def update(
        self,
        site: InducingSite,
        batch: WhitenedBatch,
        targets: Tensor,
        cavity: tuple[Tensor, Tensor] | None = None,
        moments: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> InducingSite:
        """The site after :meth:`step`, without its record: no value is read on the host."""
        return self._step(site, batch, targets, cavity, moments)[0]

    def _step(
        self,
        site: InducingSite,
        batch: WhitenedBatch,
        targets: Tensor,
        cavity: tuple[Tensor, Tensor] | None,
        moments: tuple[Tensor, Tensor, Tensor] | None,
    ) -> tuple[InducingSite, Tensor, float, Tensor]:
        r"""Steps 1-4: the new site, :math:`\log\hat Z_i` ``(B,)``, :math:`\epsilon`, and the clipped sites
        ``(C, B)``."""
        with torch.no_grad():
            batch = batch.detached()
            cavity_mean, cavity_variance = site.cavity(batch, self.num_data) if cavity is None else cavity
            cavity_mean, cavity_variance = cavity_mean.detach(), cavity_variance.detach()
            if moments is None:
                moments = tilted(self.adapter, targets, cavity_mean, cavity_variance)
            log_z, tilted_mean, tilted_variance = moments
            precision, natural_mean, clipped = new_sites(cavity_mean, cavity_variance, tilted_mean, tilted_variance)
            fraction = step_fraction(site.steps, len(targets), self.num_data)
            new = site.moved(batch, precision, natural_mean, fraction, self.num_data)
        return new, log_z, fraction, clipped

    def log_normalizers(self, site: InducingSite, batch: WhitenedBatch, targets: Tensor) -> Tensor:
        r""":math:`\log\hat Z_i` ``(B,)`` at the cavities of ``site`` (held fixed), differentiable in ``batch``: the
        terms of the energy that depend on the prior (module docstring)."""
        return tilted(self.adapter, targets, *site.cavity(batch, self.num_data))[0]

    def posterior_marginals(self, site: InducingSite, batch: WhitenedBatch) -> tuple[Tensor, Tensor]:
        """The posterior's marginals of the latents at ``batch`` ``(C, B)`` each (the predictive's latent part)."""
        return site.posterior(batch)
