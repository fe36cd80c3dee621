r"""The bound :math:`\mathcal L_H` of sparse EP with uncertain inputs (Hernández-Lobato-style eq. S.33-S.35), and its
GPyTorch MLL, :class:`UncertainSparseEPMarginalLogLikelihood`.

For one output column :math:`\mathbf y`, inputs :math:`q(\mathbf X) = \prod_i \mathcal N(\boldsymbol\mu_i,
\operatorname{diag}\mathbf s_i)` and the EP sites :math:`(\tilde{\boldsymbol\tau}, \tilde{\boldsymbol\nu})` of
:class:`~gpytorch_iterncgp.uncertain.UncertainSparseEP`:

.. math::
    \mathcal L_H = \log\mathcal N\big(\tilde{\boldsymbol\mu} \mid \mathbf m,
        \boldsymbol\Psi_1\mathbf K_{uu}^{-1}\boldsymbol\Psi_1^\top + \boldsymbol\Lambda + \tilde{\mathbf T}^{-1}\big)
    - \tfrac12\tilde\psi_0 + \tfrac12\operatorname{tr}\big(\mathbf K_{uu}^{-1}\tilde{\boldsymbol\Psi}_2\big)
    + \sum_i \log\tilde Z_i \;\big[- \operatorname{KL}(q(\mathbf X)\,\|\,p(\mathbf X))\big],

:math:`\tilde\psi_0 = \sum_i\tilde\tau_i\psi_{0,i}`, :math:`\tilde{\boldsymbol\Psi}_2 = \sum_i\tilde\tau_i
(\boldsymbol\Psi_2)_i`. Eq. S.35 as printed has :math:`+\operatorname{KL}` and drops the factors
:math:`\tfrac12`; it stands for the expectation over :math:`q(\mathbf X)` of :math:`\mathcal L_E`'s trace term
:math:`-\tfrac12\operatorname{tr}((\mathbf K_{ff} - \mathbf Q_{ff})\tilde{\mathbf T})` (S.34) and S.33's
:math:`-\operatorname{KL}`, which is what is computed here. Since :math:`\operatorname{tr}(\mathbf K_{uu}^{-1}
(\boldsymbol\Psi_2)_i) = \langle q_{ii}\rangle = \|\mathbf V_{:,i}\|^2 + \Lambda_{ii}`, the trace terms are
:math:`-\tfrac12\sum_i\tilde\tau_i(\psi_{0,i} - \langle q_{ii}\rangle)`. The Gaussian and the site normalisers are
the EP evidence under the expected DTC prior :math:`\mathbf P` (as in
:func:`~gpytorch_iterncgp.mlls.sparse.ep_dtc_bound`, with :math:`\mathbf b = (\tilde{\boldsymbol\nu} -
\tilde{\mathbf T}\mathbf m)/\sqrt{\tilde{\boldsymbol\tau}}` so flat sites contribute nothing), in
:math:`O(M^2 N)` through :math:`\mathbf R = \mathbf I + \tilde{\mathbf T}\boldsymbol\Lambda` and
:math:`\mathbf B = \mathbf I_M + \mathbf V\tilde{\mathbf T}\mathbf R^{-1}\mathbf V^\top = \mathbf L_B\mathbf L_B^\top`:

.. math::
    \log|\mathbf I_N + \tilde{\mathbf T}^{1/2}\mathbf P\tilde{\mathbf T}^{1/2}| = \sum_i\log r_i + 2\sum_j
    \log(\mathbf L_B)_{jj}, \qquad
    \mathbf b^\top(\mathbf I_N + \tilde{\mathbf T}^{1/2}\mathbf P\tilde{\mathbf T}^{1/2})^{-1}\mathbf b =
    \sum_i \frac{b_i^2}{r_i} - \|\mathbf L_B^{-1}\mathbf V\mathbf R^{-1}(\tilde{\boldsymbol\nu} -
    \tilde{\mathbf T}\mathbf m)\|^2.

With every :math:`\mathbf s_i = \mathbf 0`, :math:`\boldsymbol\Lambda = \mathbf 0`, :math:`\boldsymbol\Psi_1 =
\mathbf K_{fu}` and :math:`\psi_0 = \operatorname{diag}\mathbf K_{ff}` at :math:`\mathbf X = \boldsymbol\mu`:
:math:`\mathcal L_H` (without the KL, infinite there) is :math:`\mathcal L_E` of eq. S.21.

As :math:`\mathcal L_E`, it is a bound up to the EP approximation of the likelihood ("\lesssim" in S.35), not a
strict one. Note that it averages the DTC *covariance* over :math:`q(\mathbf X)` inside the Gaussian
(:math:`\langle\mathbf Q_{ff}\rangle`, the prior the EP of S5 fits), not the Gaussian itself as Titsias &
Lawrence's collapsed bound does.

**Gradient.** With respect to the kernel hyperparameters, the inducing inputs, the prior mean and
:math:`q(\mathbf X)`'s means and variances (through the Ψ statistics), the sites held fixed: the Gaussian and the
site terms are stationary in the sites at the EP fixed point; the trace term is not (see
:mod:`~gpytorch_iterncgp.mlls.sparse`).
"""

from __future__ import annotations

import math

import gpytorch
import torch
from gpytorch.mlls import MarginalLogLikelihood
from torch import Tensor

from ..core.outer_loop import FitReport
from ..core.state import CommittedState, parameter_fingerprint
from ..core.validation import check_count
from ..ep.sweeps import SweepOptions
from ..exceptions import NonFiniteEvidenceError
from ..likelihoods.adapters import LikelihoodAdapter, likelihood_adapter
from ..sparse.dtc import SparseEPState
from ..sparse.uncertain import ColumnSites, UncertainDTCPrior, UncertainSparseEP, psi_statistics
from ..strategies.base import converge, replaced_options
from .itergp import log_prior
from .sparse import ep_dtc_bound

__all__ = ["UncertainSparseEPMarginalLogLikelihood", "gaussian_kl", "uncertain_ep_bound"]


def uncertain_ep_bound(
    prior: UncertainDTCPrior,
    adapter: LikelihoodAdapter,
    targets: Tensor,
    site_precision: Tensor,
    site_natural_mean: Tensor,
) -> Tensor:
    r""":math:`\mathcal L_H` without the KL term (eq. S.35; module docstring) at fixed sites, differentiable in ``prior``:
    :func:`~gpytorch_iterncgp.mlls.sparse.ep_dtc_bound` under the expected DTC prior.

    :param prior: the expected DTC prior, built *with* gradients (:meth:`UncertainDTCPrior.from_statistics
        <gpytorch_iterncgp.uncertain.UncertainDTCPrior.from_statistics>`).
    :param adapter: the likelihood (:math:`C = 1`, with tilted moments).
    :param targets: ``(N,)``.
    :param site_precision: :math:`\tilde{\boldsymbol\tau}` ``(N,)``.
    :param site_natural_mean: :math:`\tilde{\boldsymbol\nu}` ``(N,)``.

    :return: A scalar; NaN only if the sites are not at a fixed point (a cavity precision :math:`\le 0`).
    """
    return ep_dtc_bound(prior, adapter, targets, site_precision, site_natural_mean)


def gaussian_kl(means: Tensor, variances: Tensor) -> Tensor:
    r""":math:`\operatorname{KL}(q(\mathbf X)\,\|\,\mathcal N(\mathbf 0, \mathbf I)) = \tfrac12\sum_{i,d}
    (s_{id} + \mu_{id}^2 - 1 - \log s_{id})`, the :math:`-\operatorname{KL}` of eq. S.33 for the GP-LVM prior.

    :param means: ``(N, D)``.
    :param variances: ``(N, D)``, positive.

    :raises ValueError: for a variance :math:`\le 0` (the KL is infinite: a known input has no prior term).
    """
    if not bool((variances > 0).all()):
        raise ValueError(
            "gaussian_kl: KL(q(X) || N(0, I)) is infinite for input variances <= 0; a latent input needs a positive "
            "variance (parametrise it through softplus), a known input no prior term (latent_prior=False)."
        )
    return 0.5 * (variances + means.square() - 1 - variances.log()).sum()


class UncertainSparseEPMarginalLogLikelihood(MarginalLogLikelihood):
    r"""The bound :math:`\mathcal L_H` (eq. S.35; module docstring), divided by :math:`N`, for a GP whose inputs are
    uncertain: noisy-input classification (known :math:`q(\mathbf X)`, ``latent_prior=False``) or a latent variable
    model (learned :math:`q(\mathbf X)` with the prior :math:`p(\mathbf X) = \mathcal N(\mathbf 0, \mathbf I)`,
    ``latent_prior=True``).

    The ``model`` is any ``gpytorch.models.GP`` with a ``covar_module``, ``inducing_points`` ``(M, D)`` and
    optionally a ``mean_module`` (``ZeroMean`` or ``ConstantMean``: their expectation under :math:`q(\mathbf X)` is
    the constant). Every call computes the Ψ statistics (closed form for RBF and linear kernels; see
    :func:`~gpytorch_iterncgp.sparse.psi_statistics.psi_statistics`), re-converges the EP sites for the current parameters
    (warm-started from the committed sites: :attr:`sites`, and :attr:`last_reports`), commits them with the
    fingerprint of the parameters and :math:`q(\mathbf X)` they belong to (a
    :class:`~gpytorch_iterncgp.core.state.CommittedState` of :class:`~gpytorch_iterncgp.sparse.uncertain.ColumnSites`,
    the model's own where it passes one), then evaluates :math:`\mathcal L_H` at those sites with gradients for the
    kernel, the inducing inputs, the mean and the input means and variances (sites fixed). Targets ``(N, P)`` are
    :math:`P` outputs sharing :math:`q(\mathbf X)` and the prior (the sum over columns of eq. S.33): one EP per column.

    Example:
        >>> mll = UncertainSparseEPMarginalLogLikelihood(likelihood, model, latent_prior=True)
        >>> loss = -mll(model.input_means, model.input_variances, train_y)
        >>> loss.backward()

    :param likelihood: a :math:`C = 1` likelihood with tilted moments (probit, logit, Poisson).
    :param model: the GP (see above).
    :param latent_prior: subtract :math:`\operatorname{KL}(q(\mathbf X)\,\|\,\mathcal N(\mathbf 0, \mathbf I))`.
    :param schedule: ``"parallel"`` or ``"sequential"`` (rank-one updates, eq. S.26-S.32).
    :param psi_method: ``method`` of :func:`~gpytorch_iterncgp.sparse.psi_statistics.psi_statistics`.
    :param num_samples: its Monte Carlo draws (kernels without a closed form).
    :param sites: where the sites are committed (a model's, which saves them); default one of its own.
    :param options: by name, the fields of :class:`~gpytorch_iterncgp.ep.sweeps.SweepOptions` (its defaults for the
        others: ``max_sweeps``, ``damping``, ``site_tol``).
    """

    def __init__(
        self,
        likelihood,
        model,
        latent_prior: bool = False,
        schedule: str = "parallel",
        psi_method: str = "auto",
        num_samples: int | None = None,
        sites: CommittedState | None = None,
        **options,
    ):
        super().__init__(likelihood, model)
        for attribute in ("covar_module", "inducing_points"):
            if not hasattr(model, attribute):
                raise TypeError(
                    f"UncertainSparseEPMarginalLogLikelihood needs a model with a `{attribute}` (covar_module: the "
                    "kernel; inducing_points: (M, D))."
                )
        self.adapter = likelihood_adapter(likelihood)
        if not self.adapter.has_tilted_moments:
            raise TypeError(
                f"UncertainSparseEPMarginalLogLikelihood needs a likelihood with tilted moments (probit, logit, "
                f"Poisson), got {type(likelihood).__name__}."
            )
        if not isinstance(latent_prior, bool):
            raise TypeError(f"latent_prior must be True or False, got {latent_prior!r}.")
        self.options: SweepOptions = replaced_options(SweepOptions(), options, type(self).__name__)
        # at least one sweep (the sites follow every call); None: until the sites converge or stall
        check_count(self.options.max_sweeps, "max_sweeps", minimum=1, allow_none=True)
        if schedule not in ("parallel", "sequential"):
            raise ValueError(f"schedule must be 'parallel' or 'sequential', got {schedule!r}.")
        self.latent_prior, self.schedule, self.psi_method, self.num_samples = (
            latent_prior,
            schedule,
            psi_method,
            num_samples,
        )
        self.committed = CommittedState(ColumnSites) if sites is None else sites
        self.last_reports: list[FitReport] = []

    @property
    def sites(self) -> tuple[Tensor, Tensor] | None:
        """The committed sites, ``(N,)`` each (or ``(P, N)`` for :math:`P` output columns); ``None`` before a fit."""
        state = self.committed.state
        return None if state is None else (state.site_precision, state.site_natural_mean)

    def fingerprint(self, input_means: Tensor, input_variances: Tensor) -> Tensor:
        """What the sites depend on: every parameter of the model and :math:`q(\\mathbf X)`, flattened
        (:func:`~gpytorch_iterncgp.core.state.parameter_fingerprint`)."""
        return parameter_fingerprint([*self.model.parameters(), input_means, input_variances], input_means)

    def prior(self, input_means: Tensor, input_variances: Tensor) -> UncertainDTCPrior:
        """The expected DTC prior at the current parameters, with gradients."""
        model = self.model
        inducing = model.inducing_points
        statistics = psi_statistics(
            model.covar_module, input_means, input_variances, inducing, self.psi_method, self.num_samples
        )
        mean_module = getattr(model, "mean_module", None)
        if mean_module is None or isinstance(mean_module, gpytorch.means.ZeroMean):
            mean = torch.zeros_like(statistics.psi0)
        elif isinstance(mean_module, gpytorch.means.ConstantMean):
            mean = mean_module.constant.reshape(()).expand_as(statistics.psi0)
        else:
            raise TypeError(
                f"The expectation of {type(mean_module).__name__} under q(X) is not implemented; use ZeroMean or "
                "ConstantMean."
            )
        return UncertainDTCPrior.from_statistics(mean, statistics, model.covar_module(inducing).to_dense())

    def fit(self, prior: UncertainDTCPrior, targets: Tensor, fingerprint: Tensor | None = None) -> list[SparseEPState]:
        """Converge the sites of every output column under ``prior`` (one EP per column, the prior shared),
        warm-started from :attr:`sites`; commits them (for the parameters of ``fingerprint``; ``None``: for none)
        and sets :attr:`last_reports`.

        :param prior: the expected DTC prior (its autograd history is not used).
        :param targets: validated targets ``(N,)`` or ``(N, P)``.
        :param fingerprint: :meth:`fingerprint` of the parameters ``prior`` was computed at.

        :return: The fitted state of each column.
        """
        fixed = prior.detached()
        columns = targets.unsqueeze(-1) if targets.dim() == 1 else targets
        warm, options = None, self.options
        if self.sites is not None and self.sites[0].reshape(-1, len(targets)).shape == columns.mT.shape:
            warm = tuple(site.reshape(columns.mT.shape).to(targets) for site in self.sites)
        states, reports = [], []
        for column in range(columns.shape[-1]):
            loop = UncertainSparseEP(
                fixed, self.adapter, columns[:, column], options.damping, options.site_tol, self.schedule
            )
            start = loop.initial_state() if warm is None else loop.posterior(warm[0][column], warm[1][column], 0)
            with torch.no_grad():
                state, report = converge(loop, start, fixed, options.max_sweeps, stacklevel=3)
            states.append(state)
            reports.append(report)
        precision = torch.stack([state.site_precision for state in states])
        natural_mean = torch.stack([state.site_natural_mean for state in states])
        sites = (precision[0], natural_mean[0]) if targets.dim() == 1 else (precision, natural_mean)
        self.committed.commit(ColumnSites(*sites), fingerprint)
        self.last_reports = reports
        return states

    def forward(self, input_means: Tensor, input_variances: Tensor, target: Tensor, **kwargs) -> Tensor:
        """:math:`\\mathcal L_H / N` at the current parameters (after re-converging the sites), summed over the
        output columns of ``target``.

        :param input_means: :math:`\\boldsymbol\\mu` ``(N, D)``.
        :param input_variances: :math:`\\mathbf s \\ge 0` ``(N, D)`` (0: a known input).
        :param target: ``(N,)``, or ``(N, P)`` for :math:`P` outputs sharing :math:`q(\\mathbf X)` (eq. S.33's sum over
            columns; the GP-LVM).

        :raises ValueError: for targets whose first dimension is not ``N`` (or outside the likelihood's support).
        :raises NonFiniteEvidenceError: if the bound is not finite (e.g. sites that did not converge).
        """
        if not torch.is_tensor(target) or target.dim() not in (1, 2) or input_means.dim() != 2:
            raise ValueError(
                f"target must have shape (N,) or (N, P) for input_means (N, D); got "
                f"{tuple(getattr(target, 'shape', ()))} and {tuple(input_means.shape)=}."
            )
        columns = target.unsqueeze(-1) if target.dim() == 1 else target
        targets = torch.stack(
            [self.adapter.check_targets(columns[:, j], input_means.dtype) for j in range(columns.shape[-1])], -1
        )
        if len(targets) != len(input_means):
            raise ValueError(f"target has {len(targets)} rows but input_means {len(input_means)}: one per point.")
        targets = targets[:, 0] if target.dim() == 1 else targets
        prior = self.prior(input_means, input_variances)
        states = self.fit(prior, targets, self.fingerprint(input_means, input_variances))
        columns = targets.unsqueeze(-1) if targets.dim() == 1 else targets
        bound = sum(
            (
                uncertain_ep_bound(prior, self.adapter, columns[:, j], state.site_precision, state.site_natural_mean)
                for j, state in enumerate(states)
            ),
            torch.zeros((), dtype=input_means.dtype, device=input_means.device),
        )
        if self.latent_prior:
            bound = bound - gaussian_kl(input_means, input_variances)
        bound = bound + log_prior(self).to(bound)
        if not math.isfinite(float(bound.detach())):
            raise NonFiniteEvidenceError(
                f"{type(self).__name__}: the bound is {float(bound.detach())} at the current parameters (EP sites "
                "that did not converge, or an overflow of the likelihood); lower the learning rate, raise max_sweeps "
                "or the damping's strength, or bound the hyperparameters with constraints."
            )
        return bound / len(targets)
