r"""The negative binomial likelihood of overdispersed counts, with the exponential link and a learnt dispersion.

For a mean :math:`\mu = e^f` and a dispersion :math:`r > 0`,

.. math::

    p(y \mid f) = \frac{\Gamma(y + r)}{\Gamma(r)\, y!} \Big(\frac{r}{r + \mu}\Big)^r \Big(\frac{\mu}{r + \mu}\Big)^y,
    \qquad \mathbb E[y \mid f] = \mu, \quad \operatorname{Var}[y \mid f] = \mu + \mu^2 / r,

the Poisson's mean with variance beyond it (a Poisson whose rate is Gamma-distributed about :math:`\mu`; Hilbe 2011,
ch. 8; GPstuff's ``lik_negbin``, Vanhatalo et al. 2013). :math:`r \to \infty` is the Poisson likelihood. It is
log-concave in :math:`f` for every :math:`r`, so the Laplace approximation's Newton steps apply
(:class:`~gpytorch_iterncgp.likelihoods.adapters.NegativeBinomialAdapter` has its closed-form derivatives), and
:math:`r` is learnt with the kernel by maximising the Laplace evidence.
"""

from __future__ import annotations

import torch
from gpytorch.constraints import Interval, Positive
from gpytorch.likelihoods.likelihood import _OneDimensionalLikelihood
from torch import Tensor
from torch.distributions import NegativeBinomial

__all__ = ["NegativeBinomialLikelihood"]


class NegativeBinomialLikelihood(_OneDimensionalLikelihood):
    r"""Negative binomial likelihood with the exponential link: mean :math:`e^f`, variance :math:`e^f + e^{2f} / r`.

    :meth:`forward` takes function samples ``(..., N)`` and returns torch's ``NegativeBinomial`` with
    ``total_count`` :math:`r` and logits :math:`f - \log r` (whose mean is :math:`r e^{f - \log r} = e^f`), batch
    shape ``(..., N)``.

    :param dispersion: the initial :math:`r` (default 1: variance :math:`\mu + \mu^2`, the geometric distribution).
    :param dispersion_constraint: the constraint of the raw parameter (default ``Positive`` with the ``exp``
        transform: :math:`r` learnt on the log scale).
    """

    def __init__(self, dispersion: float = 1.0, dispersion_constraint: Interval | None = None):
        super().__init__()
        constraint = Positive(transform=torch.exp, inv_transform=torch.log)
        self.register_parameter("raw_dispersion", torch.nn.Parameter(torch.zeros((), dtype=torch.float64)))
        self.register_constraint(
            "raw_dispersion", constraint if dispersion_constraint is None else dispersion_constraint
        )
        self.dispersion = dispersion

    @property
    def dispersion(self) -> Tensor:
        """:math:`r` (a scalar tensor)."""
        return self.raw_dispersion_constraint.transform(self.raw_dispersion)

    @dispersion.setter
    def dispersion(self, value: float | Tensor) -> None:
        raw = self.raw_dispersion  # (a Python float straight to its dtype, not rounded through float32)
        value = torch.as_tensor(value, dtype=raw.dtype, device=raw.device)
        self.initialize(raw_dispersion=self.raw_dispersion_constraint.inverse_transform(value))

    def forward(self, function_samples: Tensor, *args, **kwargs) -> NegativeBinomial:
        dispersion = self.dispersion.to(function_samples)
        return NegativeBinomial(total_count=dispersion, logits=function_samples - dispersion.log(), validate_args=False)
