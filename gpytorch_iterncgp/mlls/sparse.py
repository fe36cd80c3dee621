r"""The variational EP-DTC bound :math:`\mathcal L_E` (Sparse EP-DTC, eq. S.21) for learning hyperparameters and
inducing inputs with :class:`~gpytorch_iterncgp.SparseEPStrategy`.

.. math::
    \mathcal L_E = \log \mathcal N(\tilde{\boldsymbol\mu} \mid \mathbf m, \mathbf Q_{ff} + \tilde{\mathbf T}^{-1})
    - \tfrac12 \operatorname{tr}\big((\mathbf K_{ff} - \mathbf Q_{ff}) \tilde{\mathbf T}\big) + \sum_i \log \tilde Z_i

with :math:`\tilde{\boldsymbol\mu} = \tilde{\mathbf T}^{-1}\tilde{\boldsymbol\nu}` and :math:`\tilde Z_i` the site
normalisers of the EP-DTC fixed point (eq. S.21 with its typos read as :math:`-\tfrac12\log|\tilde\Sigma|` in
S.20 and :math:`+\sum_i \log\tilde Z_i` in S.21). As in :func:`~gpytorch_iterncgp.mlls.itergp.ep_evidence`, the first
and last terms are written with :math:`\mathbf b = (\tilde{\boldsymbol\nu} - \tilde{\mathbf T}\mathbf m) /
\sqrt{\tilde{\boldsymbol\tau}}`, so that flat sites contribute nothing; in :math:`O(M^2 N)` by the matrix
determinant lemma and Woodbury through :math:`\mathbf B = \mathbf I_M + \mathbf V\tilde{\mathbf T}\mathbf V^\top =
\mathbf L_B\mathbf L_B^\top` (:math:`\mathbf V = \mathbf L^{-1}\mathbf K_{uf}`):

.. math::
    \log|\mathbf I_N + \tilde{\mathbf T}^{1/2}\mathbf Q_{ff}\tilde{\mathbf T}^{1/2}| = 2\sum_j \log (\mathbf L_B)_{jj},
    \qquad \mathbf b^\top(\mathbf I_N + \tilde{\mathbf T}^{1/2}\mathbf Q_{ff}\tilde{\mathbf T}^{1/2})^{-1}\mathbf b =
    \mathbf b^\top\mathbf b - \|\mathbf L_B^{-1}\mathbf V(\tilde{\boldsymbol\nu} - \tilde{\mathbf T}\mathbf m)\|^2.

**Gradient.** Differentiable with respect to the kernel and mean hyperparameters and the inducing inputs with the
sites held fixed. The first and last terms are the EP evidence of the DTC prior, stationary in the sites at the
EP-DTC fixed point; the trace term is not (it is linear in :math:`\tilde{\boldsymbol\tau}`), so this gradient
differs from the total derivative of the re-converged bound by
:math:`-\tfrac12\sum_i (k_{ii} - q_{ii})\, d\tilde\tau_i/d\theta`, which vanishes as :math:`\mathbf Q_{ff} \to
\mathbf K_{ff}` (the same fixed-site gradient GPstuff uses).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..likelihoods.adapters import LikelihoodAdapter
from ..sparse.dtc import DTCPrior, SparseEPState, WhitenedInducing
from ..strategies.sparse import SparseEPStrategy
from .itergp import _StrategyEvidence, ep_site_terms


def ep_dtc_bound(
    prior: DTCPrior, adapter: LikelihoodAdapter, targets: Tensor, site_precision: Tensor, site_natural_mean: Tensor
) -> Tensor:
    r""":math:`\mathcal L_E` (eq. S.21; module docstring) at fixed sites, differentiable in ``prior``; under the
    expected DTC prior of uncertain inputs (an :class:`~gpytorch_iterncgp.sparse.uncertain.UncertainDTCPrior`, with
    its independent variances :math:`\boldsymbol\Lambda`) it is :math:`\mathcal L_H` without the KL term
    (:func:`~gpytorch_iterncgp.mlls.uncertain.uncertain_ep_bound`): with :math:`r_i = 1 + \tilde\tau_i\Lambda_{ii}`
    (1 for the DTC prior) the log-determinant gains :math:`\sum_i \log r_i` and the quadratic form divides by
    :math:`\mathbf R`, both through :math:`\mathbf B` of
    :meth:`WhitenedInducing.system_cholesky <gpytorch_iterncgp.sparse.dtc.WhitenedInducing.system_cholesky>`.

    :param prior: the DTC prior at the training inputs, built *with* gradients
        (:meth:`SparseEPStrategy.dtc_prior <gpytorch_iterncgp.SparseEPStrategy.dtc_prior>`).
    :param site_precision: :math:`\tilde{\boldsymbol\tau}` ``(N,)``; ``site_natural_mean``: :math:`\tilde{\boldsymbol\nu}`.
    :return: A scalar; NaN only if the sites are not at a fixed point (a cavity precision :math:`\le 0`).
    """
    tau, nu = site_precision.detach(), site_natural_mean.detach()
    cross, mean, spread = prior.whitened_cross, prior.mean, prior.independent_variance()
    positive = tau > 0
    ratio = 1 + tau * spread  # r_i
    residual = torch.where(positive, nu - tau * mean, 0.0)  # sqrt(tau) b
    cholesky = WhitenedInducing.system_cholesky(cross, tau, ratio)
    whitened = torch.linalg.solve_triangular(cholesky, (cross @ (residual / ratio))[:, None], upper=False)[:, 0]
    quadratic = (residual.square() / (torch.where(positive, tau, 1) * ratio)).sum() - whitened.square().sum()
    log_det = 2 * cholesky.diagonal().log().sum() + ratio.log().sum()
    trace = (tau * (prior.diagonal - prior.dtc_variance)).sum()
    with torch.no_grad():
        _, _, marginal_mean, marginal_variance = prior.detached().posterior(tau, nu)
    site_terms = ep_site_terms(adapter, targets, marginal_mean, marginal_variance, tau, nu)
    return -0.5 * log_det - 0.5 * quadratic - 0.5 * trace + site_terms


class SparseEPMarginalLogLikelihood(_StrategyEvidence):
    r"""The EP-DTC lower bound :math:`\mathcal L_E` of :math:`\log p(\mathbf y \mid \mathbf X, \theta)` (eq. S.21),
    divided by :math:`N`, for a model whose ``variational_strategy`` is a :class:`~gpytorch_iterncgp.SparseEPStrategy`.

    In the usual GPyTorch loop (``loss = -mll(model(train_x), train_y)``); every call re-converges the sites for the
    current hyperparameters and inducing inputs (warm-started), then evaluates :func:`ep_dtc_bound` in
    :math:`O(M^2 N)`. Gradients with respect to the kernel, the mean and the inducing inputs with the sites held fixed
    (see the module docstring for what that leaves out).

    :param likelihood: the strategy's likelihood.
    :param model: the ``ApproximateGP`` with a ``SparseEPStrategy``.
    """

    _strategy_type = SparseEPStrategy

    def __init__(self, likelihood, model):
        super().__init__(likelihood, model)

    def _train_prior(self, strategy: SparseEPStrategy) -> DTCPrior:
        """The DTC prior at the training inputs, with gradients."""
        return strategy.dtc_prior()

    def _fitted_mean(self, state: SparseEPState, prior: DTCPrior) -> Tensor:
        return state.marginal_mean

    def forward(self, function_dist, target: Tensor, **kwargs) -> Tensor:
        """The bound per data point of the training data.

        :raises ValueError: if ``function_dist`` is not ``model(train_x)`` at the current hyperparameters, or
            ``target`` is not the training targets.
        :raises NonFiniteEvidenceError: if the bound is not finite (e.g. sites that did not converge).
        """
        strategy, targets, state, prior, _ = self._checked_call(function_dist, target)
        bound = ep_dtc_bound(prior, strategy.adapter, targets, state.site_precision, state.site_natural_mean)
        return self._per_point(bound, strategy.num_data)
