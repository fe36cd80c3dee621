r"""Poisson likelihoods for non-negative real targets (rates, averages): the Poisson quasi-likelihood.

For a rate :math:`\lambda = \lambda(f) > 0` and a target :math:`y \ge 0`, not necessarily an integer,

.. math::

    \log p(y \mid f) = y \log\lambda - \lambda - \log\Gamma(y + 1),

the Poisson log-probability with :math:`\log y!` extended by :math:`\log\Gamma(y+1)`. It is not a normalised density in
:math:`y`, but as a function of :math:`f` it is the Poisson log-likelihood's, with the same gradient
:math:`(y/\lambda - 1)\lambda'` and the same log-concavity in :math:`f` for the exp and softplus links: regression of
rates or averages by a Poisson GLM (McCullagh & Nelder 1989, ch. 9), as scikit-learn's ``PoissonRegressor`` accepts
non-integer targets. The Laplace approximation needs only this function of :math:`f` and its derivatives; the
package's EP tilted moments (:mod:`~gpytorch_iterncgp.likelihoods.tilted`) are those of integer counts, so the
estimators fit these likelihoods by Laplace.

:class:`QuasiExpPoissonLikelihood` (:math:`\lambda = e^f`) and :class:`QuasiSoftplusPoissonLikelihood`
(:math:`\lambda = \log(1 + e^f)`) differ from :class:`~gpytorch_iterncgp.ExpPoissonLikelihood` and GPyTorch's
``PoissonLikelihood`` only in the support of their distribution (:class:`NonNegativePoisson`), so the adapters
(:func:`~gpytorch_iterncgp.likelihoods.adapters.likelihood_adapter`) accept non-integer targets; their derivatives are
taken by autograd.
"""

from __future__ import annotations

import torch
from gpytorch.likelihoods import PoissonLikelihood
from torch import Tensor
from torch.distributions import Poisson, constraints

from .adapters import ExpPoissonLikelihood

__all__ = ["NonNegativePoisson", "QuasiExpPoissonLikelihood", "QuasiSoftplusPoissonLikelihood"]


class NonNegativePoisson(Poisson):
    r"""``torch.distributions.Poisson`` whose support is every real :math:`y \ge 0`: ``log_prob(y)`` is the
    quasi-likelihood :math:`y \log\lambda - \lambda - \log\Gamma(y + 1)`, elementwise, in the shape of ``y``
    broadcast with the rate's."""

    support = constraints.nonnegative  # type: ignore[assignment]  # wider than Poisson's integer support


class QuasiExpPoissonLikelihood(ExpPoissonLikelihood):
    r"""Exp-link Poisson quasi-likelihood for targets :math:`y \ge 0` (rates, averages):
    :math:`\log p(y \mid f) = y f - e^f - \log\Gamma(y + 1)`.

    :meth:`forward` takes function samples ``(..., N)`` and returns a :class:`NonNegativePoisson` of rate :math:`e^f`
    with batch shape ``(..., N)``. For integer counts it equals :class:`~gpytorch_iterncgp.ExpPoissonLikelihood`
    (whose closed-form derivatives are then used; here they are taken by autograd).
    """

    def forward(self, function_samples: Tensor, *args, **kwargs) -> NonNegativePoisson:
        return NonNegativePoisson(function_samples.exp(), validate_args=False)


class QuasiSoftplusPoissonLikelihood(PoissonLikelihood):
    r"""Softplus-link Poisson quasi-likelihood for targets :math:`y \ge 0` (rates, averages):
    :math:`\log p(y \mid f) = y \log\lambda - \lambda - \log\Gamma(y + 1)` with :math:`\lambda = \log(1 + e^f)`.

    :meth:`forward` takes function samples ``(..., N)`` and returns a :class:`NonNegativePoisson` of rate
    :math:`\lambda` with batch shape ``(..., N)``. For integer counts it equals GPyTorch's ``PoissonLikelihood``
    (whose closed-form derivatives are then used; here they are taken by autograd).
    """

    def forward(self, function_samples: Tensor, *args, **kwargs) -> NonNegativePoisson:
        return NonNegativePoisson(torch.nn.functional.softplus(function_samples), validate_args=False)
