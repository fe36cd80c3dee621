r"""The predictive of sparse EP at *uncertain* test inputs :math:`\mathbf x_* \sim \mathcal N(\boldsymbol\mu_*,
\operatorname{diag}\mathbf s_*)`, moment-matched (Girard et al. 2003; Titsias & Lawrence 2010, sec. 3.3).

The EP posterior of :mod:`gpytorch_iterncgp.sparse.uncertain` lives in the whitened inducing space: with :math:`\mathbf u = \mathbf L
\mathbf z` (:math:`\mathbf L\mathbf L^\top = \mathbf K_{uu}`, jittered as in
:class:`~gpytorch_iterncgp.sparse.dtc.WhitenedInducing`), :math:`q(\mathbf z) = \mathcal N(\bar{\mathbf z},
\mathbf B^{-1})`, :math:`\mathbf B = \mathbf L_B\mathbf L_B^\top` (eq. S.22-S.25). At a *known* test input the
predictive of the latent is the variational (exact-conditional) one of
:class:`~gpytorch_iterncgp.strategies.sparse.SparseEPStrategy`: with :math:`\mathbf v(\mathbf x) = \mathbf L^{-1}
\mathbf k_u(\mathbf x)`,

.. math::
    m(\mathbf x) = m_0 + \mathbf v^\top\bar{\mathbf z}, \qquad
    v(\mathbf x) = k(\mathbf x, \mathbf x) - \mathbf v^\top\mathbf v + \mathbf v^\top\mathbf B^{-1}\mathbf v.

At an uncertain one, the laws of total expectation and variance over :math:`q(\mathbf x_*)` give the first two
moments of :math:`f_*` exactly, in terms of the Ψ statistics of :math:`\mathbf x_*` (:mod:`.psi_statistics`;
:math:`\tilde{\boldsymbol\psi}_1 = \mathbf L^{-1}\boldsymbol\psi_1`, :math:`\tilde{\mathbf C} = \mathbf L^{-1}
(\boldsymbol\Psi_2 - \boldsymbol\psi_1\boldsymbol\psi_1^\top)\mathbf L^{-\top}`, the whitened covariance of
:math:`\mathbf k_u(\mathbf x_*)`):

.. math::
    \mathbb E f_* = m_0 + \tilde{\boldsymbol\psi}_1^\top\bar{\mathbf z}, \qquad
    \operatorname{Var} f_* = \underbrace{\psi_0 - \operatorname{tr}(\mathbf K_{uu}^{-1}\boldsymbol\Psi_2)}_{
        \mathbb E[k_{**} - q_{**}]}
    + \operatorname{tr}\big(\mathbf B^{-1}\mathbf L^{-1}\boldsymbol\Psi_2\mathbf L^{-\top}\big)
    + \bar{\mathbf z}^\top\tilde{\mathbf C}\bar{\mathbf z},

(:math:`\mathbb E_{\mathbf x}\, v(\mathbf x)` plus :math:`\operatorname{Var}_{\mathbf x}\, m(\mathbf x) =
\bar{\mathbf z}^\top\tilde{\mathbf C}\bar{\mathbf z}`), i.e. with :math:`\boldsymbol\mu_u = \mathbf L\bar{\mathbf
z}`, :math:`\boldsymbol\Sigma_u = \mathbf L\mathbf B^{-1}\mathbf L^\top`: :math:`\psi_0 - \operatorname{tr}
(\mathbf K_{uu}^{-1}\boldsymbol\Psi_2) + \operatorname{tr}(\mathbf K_{uu}^{-1}(\boldsymbol\Sigma_u +
\boldsymbol\mu_u\boldsymbol\mu_u^\top)\mathbf K_{uu}^{-1}\boldsymbol\Psi_2) - (\mathbb E f_* - m_0)^2`, Titsias &
Lawrence's predictive with EP's :math:`q(\mathbf u)`. It is computed as

.. math::
    \operatorname{Var} f_* = \psi_0 - \|\tilde{\boldsymbol\psi}_1\|^2 - \operatorname{tr}\tilde{\mathbf C}
    + \|\mathbf L_B^{-1}\tilde{\boldsymbol\psi}_1\|^2 + \operatorname{tr}(\mathbf B^{-1}\tilde{\mathbf C})
    + \bar{\mathbf z}^\top\tilde{\mathbf C}\bar{\mathbf z},

so that at :math:`\mathbf s_* = \mathbf 0` (:math:`\tilde{\mathbf C} = \mathbf 0`) it is the known-input
predictive term by term. The distribution of :math:`f_*` is not Gaussian (a mixture over :math:`\mathbf x_*`); the
output probability is the likelihood's marginal of the moment-matched Gaussian, e.g. for the probit
:math:`\Phi(\mathbb E f_* / \sqrt{1 + \operatorname{Var} f_*})`. Cost: :math:`O(N_* M^3 + P N_* M^2)` for
:math:`P` output columns sharing the kernel and the inducing inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dtc import WhitenedInducing
from .psi_statistics import PsiStatistics

__all__ = ["uncertain_predictive"]


def uncertain_predictive(
    statistics: PsiStatistics,
    whitening: WhitenedInducing,
    prior_mean: Tensor | float,
    posterior_cholesky: Tensor,
    whitened_mean: Tensor,
) -> tuple[Tensor, Tensor]:
    r"""Mean and variance of the latent :math:`f_*` at test inputs :math:`\mathcal N(\boldsymbol\mu_*,
    \operatorname{diag}\mathbf s_*)` under the sparse EP posterior :math:`q(\mathbf z) = \mathcal N(\bar{\mathbf z},
    (\mathbf L_B\mathbf L_B^\top)^{-1})` (module docstring), for :math:`P` output columns at once.

    :param statistics: the Ψ statistics of the test inputs, un-batched: ``(N*,)``, ``(N*, M)``, ``(N*, M, M)``
        (:func:`~gpytorch_iterncgp.sparse.psi_statistics.psi_statistics` of the model's kernel).
    :param whitening: the whitened inducing space of the model's :math:`\mathbf K_{uu}` (as for its training prior).
    :param prior_mean: the constant prior mean :math:`m_0` (a number or a 0-d tensor).
    :param posterior_cholesky: :math:`\mathbf L_B` ``(M, M)`` or ``(P, M, M)`` (``SparseEPState.posterior_cholesky``).
    :param whitened_mean: :math:`\bar{\mathbf z}` ``(M,)`` or ``(P, M)`` (``SparseEPState.whitened_mean``).

    :return: ``(mean, variance)``, each ``(N*,)`` for an unbatched posterior, ``(P, N*)`` for ``P`` columns; the
        variance is clamped at 0 against rounding.

    :raises ValueError: for shapes that disagree.
    """
    psi0, psi1, _ = statistics
    num_inducing = whitening.cholesky.shape[-1]
    batched = whitened_mean.dim() == 2
    cholesky_b = posterior_cholesky if batched else posterior_cholesky.unsqueeze(0)
    weights = whitened_mean if batched else whitened_mean.unsqueeze(0)
    if (
        weights.dim() != 2
        or weights.shape[-1] != num_inducing
        or cholesky_b.shape != (len(weights), *2 * [num_inducing])
    ):
        raise ValueError(
            f"posterior_cholesky must be (M, M) or (P, M, M) and whitened_mean (M,) or (P, M) with M = "
            f"{num_inducing} inducing points; got {tuple(posterior_cholesky.shape)=} and {tuple(whitened_mean.shape)=}."
        )
    if psi1.dim() != 2 or psi1.shape[-1] != num_inducing:
        raise ValueError(f"the statistics must be un-batched with psi1 (N*, {num_inducing}), got {tuple(psi1.shape)}.")
    cross = whitening.whiten(psi1.mT)  # (M, N*): L^-1 psi1
    whitened = whitening.whiten_symmetric(statistics.cross_covariance())  # (N*, M, M): L^-1 C L^-T
    projected = torch.linalg.solve_triangular(cholesky_b, cross.expand(len(weights), -1, -1), upper=False)
    inverse = torch.cholesky_inverse(cholesky_b)  # (P, M, M): B^-1
    mean = prior_mean + weights @ cross  # (P, N*)
    lost = psi0 - cross.square().sum(0) - whitened.diagonal(dim1=-2, dim2=-1).sum(-1)  # E[k** - q**], (N*,)
    variance = (
        lost
        + projected.square().sum(-2)
        + torch.einsum("pmk,nmk->pn", inverse, whitened)
        + torch.einsum("pm,nmk,pk->pn", weights, whitened, weights)
    ).clamp_min(0)
    if not batched:
        return mean[0], variance[0]
    return mean, variance
