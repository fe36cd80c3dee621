r"""Models with uncertain inputs trained by the sparse-EP bound :math:`\mathcal L_H` (eq. S.33-S.35):
:class:`EPLatentVariableModel`, a GP latent variable model for binary (or count) data, and
:class:`NoisyInputGPClassifier`, GP classification whose inputs carry known Gaussian noise.

Both hold a kernel (RBF with ARD lengthscales by default: closed-form Ψ statistics), a constant prior mean,
:math:`M` inducing inputs :math:`\mathbf Z` and the EP sites of every output column (buffers, so a ``state_dict``
restores the fitted posterior), and are trained by Adam on :math:`-\mathcal L_H / N` of
:class:`~gpytorch_iterncgp.mlls.uncertain.UncertainSparseEPMarginalLogLikelihood` (the sites re-converged,
warm-started, at every step). Their predictions at test inputs :math:`\mathcal N(\boldsymbol\mu_*,
\operatorname{diag}\mathbf s_*)` are the moment-matched predictive of
:func:`~gpytorch_iterncgp.sparse.uncertain_prediction.uncertain_predictive`.

**GP-LVM** (Titsias & Lawrence 2010 with EP for the likelihood; GPyTorch's ``BayesianGPLVM`` assumes Gaussian
observations): data :math:`\mathbf Y` ``(N, P)``, :math:`y_{ip} \mid f_p(\mathbf x_i)` by the likelihood (probit by
default), :math:`P` independent GPs :math:`f_p` sharing the kernel and :math:`\mathbf Z`, latent inputs
:math:`\mathbf x_i \in \mathbb R^Q` with the prior :math:`p(\mathbf X) = \mathcal N(\mathbf 0, \mathbf I)` and the
variational :math:`q(\mathbf X) = \prod_i \mathcal N(\boldsymbol\mu_i, \operatorname{diag}\mathbf s_i)`; the bound
is :math:`\sum_p \mathcal L_H^{(p)} - \operatorname{KL}(q(\mathbf X)\,\|\,p(\mathbf X))` (eq. S.33), one EP per
column sharing the expected DTC prior.

**Noisy-input classification**: the training inputs are known only as :math:`\mathcal N(\boldsymbol\mu_i,
\operatorname{diag}\mathbf s_i)` (measurement noise of known variance); :math:`q(\mathbf X)` is held fixed at that
distribution (no KL term) and only the kernel, the mean and :math:`\mathbf Z` are learned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import gpytorch
import torch
from gpytorch.distributions import MultivariateNormal
from linear_operator.operators import DiagLinearOperator
from torch import Tensor
from tqdm.auto import tqdm

from ..core.outer_loop import FitReport
from ..core.state import CommittedState, data_fingerprint
from ..core.validation import check_count, check_flag, check_nonnegative
from ..ep.sweeps import SweepOptions
from ..mlls.uncertain import UncertainSparseEPMarginalLogLikelihood
from ..sparse.dtc import WhitenedInducing
from ..sparse.psi_statistics import psi_statistics
from ..sparse.uncertain import ColumnSites, uncertain_posterior
from ..sparse.uncertain_prediction import uncertain_predictive
from ..strategies.base import replaced_options

__all__ = ["EPLatentVariableModel", "NoisyInputGPClassifier", "pca_initialisation"]


def pca_initialisation(data: Tensor, latent_dim: int) -> Tensor:
    r"""The first ``latent_dim`` principal-component scores of ``data`` ``(N, P)``, each scaled to unit variance
    (matching the prior :math:`\mathcal N(\mathbf 0, \mathbf I)`), ``(N, latent_dim)``; GPyTorch's GPLVM examples
    initialise :math:`\boldsymbol\mu` the same way (without the scaling)."""
    centred = data - data.mean(0)
    _, _, right = torch.linalg.svd(centred, full_matrices=False)
    scores = centred @ right[:latent_dim].mT
    return scores / scores.std(0).clamp_min(torch.finfo(data.dtype).tiny)


class _UncertainInputGP(gpytorch.models.GP):
    """What both models share: the kernel, the mean, the inducing inputs, the sites, training and the predictive.

    The sites of every output column are the model's committed state (a
    :class:`~gpytorch_iterncgp.core.state.CommittedState` of :class:`~gpytorch_iterncgp.sparse.uncertain.ColumnSites`,
    with the fingerprint of the parameters and :math:`q(\\mathbf X)` they were converged at), which its bound
    (:attr:`mll`) warm-starts from and commits to, and which its ``state_dict`` saves as its extra state.

    :param options: by name, the fields of :class:`~gpytorch_iterncgp.ep.sweeps.SweepOptions` (``max_sweeps``,
        ``damping``, ``site_tol``; its defaults for the others).
    """

    def __init__(
        self,
        targets: Tensor,
        likelihood: gpytorch.likelihoods.Likelihood,
        inducing_points: Tensor,
        kernel: gpytorch.kernels.Kernel | None,
        latent_prior: bool,
        learn_inducing_locations: bool,
        options: dict,
    ):
        super().__init__()
        self._committed = CommittedState(ColumnSites)  # the sites, and the parameters they were converged at
        check_flag(learn_inducing_locations, "learn_inducing_locations")
        dtype = inducing_points.dtype
        self.likelihood = likelihood
        self.mean_module = gpytorch.means.ConstantMean()
        dims = inducing_points.shape[-1]
        self.covar_module = (
            gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=dims)) if kernel is None else kernel
        )
        inducing = inducing_points.detach().clone()
        if learn_inducing_locations:
            self.inducing_points = torch.nn.Parameter(inducing)
        else:
            self.register_buffer("inducing_points", inducing)
        self.register_buffer("train_targets", targets.detach().clone())
        self.to(dtype)
        self.options = replaced_options(SweepOptions(), options, type(self).__name__)
        self._latent_prior = latent_prior
        self.last_reports: list[FitReport] = []  # of the last convergence of the sites, one per column
        _ = self.mll  # checks the likelihood and the model

    @property
    def mll(self) -> UncertainSparseEPMarginalLogLikelihood:
        """The bound :math:`\\mathcal L_H / N` this model is trained by; it commits the sites to the model's state."""
        options = dataclasses.asdict(self.options)
        return UncertainSparseEPMarginalLogLikelihood(
            self.likelihood, self, latent_prior=self._latent_prior, sites=self._committed, **options
        )

    @property
    def _num_columns(self) -> int:
        return 1 if self.train_targets.dim() == 1 else self.train_targets.shape[-1]

    @property
    def site_precision(self) -> Tensor:
        r""":math:`\tilde{\boldsymbol\tau}` of every column ``(P, N)`` (0 before a fit)."""
        return self._sites()[0]

    @property
    def site_natural_mean(self) -> Tensor:
        r""":math:`\tilde{\boldsymbol\nu}` of every column ``(P, N)`` (0 before a fit)."""
        return self._sites()[1]

    def _sites(self) -> tuple[Tensor, Tensor]:
        shape = (self._num_columns, len(self.train_targets))
        state = self._committed.state
        if state is None:  # flat sites: EP's initial state
            zeros = torch.zeros(shape, dtype=self.inducing_points.dtype, device=self.inducing_points.device)
            return zeros, zeros
        return state.site_precision.reshape(shape), state.site_natural_mean.reshape(shape)

    def train_inputs_distribution(self) -> tuple[Tensor, Tensor]:
        """Means and variances ``(N, D)`` of the training inputs' :math:`q(\\mathbf X)` (differentiable)."""
        raise NotImplementedError  # pragma: no cover - every subclass defines it

    def forward(self, x: Tensor) -> MultivariateNormal:
        """The GP prior at known inputs ``x`` ``(N, D)`` (GPyTorch's ``forward`` idiom)."""
        return MultivariateNormal(self.mean_module(x), self.covar_module(x))

    def loss(self) -> Tensor:
        r""":math:`-\mathcal L_H / N` at the current parameters (the sites re-converged, warm-started), differentiable."""
        means, variances = self.train_inputs_distribution()
        mll = self.mll
        value = -mll(means, variances, self.train_targets)
        self.last_reports = mll.last_reports
        return value

    def get_extra_state(self) -> dict:
        """The committed sites and their fingerprint, for ``state_dict()``
        (:meth:`~gpytorch_iterncgp.core.state.CommittedState.to_extra`)."""
        return self._committed.to_extra(data_fingerprint(self.train_targets))

    def set_extra_state(self, extra: dict) -> None:
        """Restore :meth:`get_extra_state` (sites of other data are discarded with a ``UserWarning``)."""
        expected = self.train_targets.numel()
        data = data_fingerprint(self.train_targets)
        self._committed.load_extra(extra, self.inducing_points, expected, data, type(self).__name__)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        # state_dicts of earlier versions hold the sites as buffers (P, N) and their fingerprint (NaN: none)
        old = [prefix + name for name in ("site_precision", "site_natural_mean", "site_fingerprint")]
        if all(key in state_dict for key in old) and prefix + "_extra_state" not in state_dict:
            precision, natural_mean, fingerprint = (state_dict.pop(key) for key in old)
            shape = self.train_targets.shape if self.train_targets.dim() == 1 else precision.shape
            sites = ColumnSites(precision.reshape(shape), natural_mean.reshape(shape))
            state_dict[prefix + "_extra_state"] = self._committed_extra(sites, fingerprint)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _committed_extra(self, sites: ColumnSites, fingerprint: Tensor) -> dict:
        """The extra state of ``sites`` converged at ``fingerprint`` (an empty or NaN one: at none)."""
        saved = CommittedState(ColumnSites)
        saved.commit(sites, fingerprint if fingerprint.numel() and not bool(fingerprint.isnan().any()) else None)
        return saved.to_extra(data_fingerprint(self.train_targets))

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        self._committed.apply(fn)
        return self

    def fit(
        self,
        num_steps: int = 200,
        lr: float = 0.05,
        show_progress: bool = True,
        callback: Callable[[int, float], None] | None = None,
    ) -> list[float]:
        r"""Maximise :math:`\mathcal L_H` by ``num_steps`` Adam steps on every parameter (learning rate ``lr``).

        :param num_steps: optimiser steps (each re-converges the EP sites, warm-started).
        :param lr: Adam's learning rate.
        :param show_progress: a tqdm bar with the loss.
        :param callback: called as ``callback(step, loss)`` after every step.

        :return: The loss :math:`-\mathcal L_H / N` before each step.
        """
        check_count(num_steps, "num_steps")
        check_nonnegative(lr, "lr", positive=True)
        check_flag(show_progress, "show_progress")
        self.train()
        optimizer = torch.optim.Adam(self.parameters(), lr=lr)
        losses = []
        bar = tqdm(range(num_steps), disable=not show_progress, desc=type(self).__name__, leave=False)
        for step in bar:
            optimizer.zero_grad()
            loss = self.loss()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if callback is not None:
                callback(step, losses[-1])
        self.eval()
        return losses

    def _posterior(self) -> tuple[Tensor, Tensor]:
        r""":math:`\mathbf L_B` ``(P, M, M)`` and :math:`\bar{\mathbf z}` ``(P, M)`` of every column at the current
        parameters: from the committed sites if they were converged at these parameters, else after re-converging them
        (warm-started)."""
        with torch.no_grad():
            means, variances = self.train_inputs_distribution()
            mll = self.mll
            prior = mll.prior(means, variances)
            fingerprint = mll.fingerprint(means, variances)
            if self._committed.is_current(fingerprint):
                parts = [
                    uncertain_posterior(prior.detached(), tau, nu)[:2]
                    for tau, nu in zip(self.site_precision, self.site_natural_mean, strict=True)
                ]
                return torch.stack([part[0] for part in parts]), torch.stack([part[1] for part in parts])
            targets = self.train_targets
            for column in targets.unsqueeze(-1).unbind(-1) if targets.dim() == 1 else targets.unbind(-1):
                mll.adapter.check_targets(column, means.dtype)
            states = mll.fit(prior, targets, fingerprint)
            self.last_reports = mll.last_reports
            return (
                torch.stack([state.posterior_cholesky for state in states]),
                torch.stack([state.whitened_mean for state in states]),
            )

    def _predict(self, means: Tensor, variances: Tensor | None) -> tuple[Tensor, Tensor]:
        """(mean, variance), each (P, N*)."""
        if not torch.is_tensor(means) or means.dim() != 2 or means.shape[-1] != self.inducing_points.shape[-1]:
            raise ValueError(
                f"test means must have shape (N*, {self.inducing_points.shape[-1]}), got "
                f"{tuple(getattr(means, 'shape', ()))}."
            )
        means = means.to(self.inducing_points)
        variances = torch.zeros_like(means) if variances is None else variances.to(means)
        cholesky, weights = self._posterior()
        with torch.no_grad():
            inducing = self.inducing_points
            statistics = psi_statistics(self.covar_module, means, variances, inducing)
            whitening = WhitenedInducing.from_covariance(self.covar_module(inducing).to_dense())
            constant = self.mean_module.constant.reshape(())
            return uncertain_predictive(statistics, whitening, constant, cholesky, weights)

    def _probabilities(self, mean: Tensor, variance: Tensor) -> Tensor:
        marginal = self.likelihood(MultivariateNormal(mean.reshape(-1), DiagLinearOperator(variance.reshape(-1))))
        if not isinstance(marginal, torch.distributions.Bernoulli):
            raise TypeError(f"predict_proba needs a Bernoulli likelihood, got {type(self.likelihood).__name__}.")
        return marginal.probs.reshape(mean.shape)


class EPLatentVariableModel(_UncertainInputGP):
    r"""A GP latent variable model for binary (or count) data: the GP-LVM of Titsias & Lawrence (2010) with an EP
    approximation of a non-Gaussian likelihood per output column (module docstring).

    Use it where GPyTorch's ``BayesianGPLVM`` would be used but the observations are binary (probit or logit
    likelihood) or counts (Poisson): e.g. a 2-D embedding of binarised images.

    Example:
        >>> model = EPLatentVariableModel(binary_data, latent_dim=2, num_inducing=30)  # (N, P) in {0, 1}
        >>> model.fit(num_steps=200)
        >>> embedding = model.embedding()                      # (N, 2): the means of q(X)
        >>> probabilities = model.predict_proba(embedding)     # (N, P): P(y = 1) at those latent points

    :param data: :math:`\mathbf Y` ``(N, P)`` (or ``(N,)``), floating point, in the likelihood's support.
    :param latent_dim: :math:`Q`.
    :param num_inducing: :math:`M`; the inducing inputs start at a random subset of the initial means.
    :param likelihood: default ``BernoulliLikelihood()`` (probit); any likelihood with tilted moments.
    :param kernel: default ``ScaleKernel(RBFKernel(ard_num_dims=Q))`` (closed-form Ψ statistics).
    :param initial_means: :math:`\boldsymbol\mu` ``(N, Q)`` to start from (default: :func:`pca_initialisation`).
    :param initial_variance: the initial :math:`s_{iq}` (all equal).
    :param seed: the seed of the inducing inputs' subset.
    :param options: the EP sweeps' options by name (:class:`~gpytorch_iterncgp.ep.sweeps.SweepOptions`).
    """

    def __init__(
        self,
        data: Tensor,
        latent_dim: int = 2,
        num_inducing: int = 30,
        likelihood: gpytorch.likelihoods.Likelihood | None = None,
        kernel: gpytorch.kernels.Kernel | None = None,
        initial_means: Tensor | None = None,
        initial_variance: float = 0.1,
        seed: int = 0,
        **options: Any,
    ):
        if not torch.is_tensor(data) or not data.is_floating_point() or data.dim() not in (1, 2) or len(data) < 2:
            raise ValueError(
                f"data must be a floating-point tensor (N, P) with N >= 2 (cast labels with .double()), got "
                f"{type(data).__name__} {tuple(getattr(data, 'shape', ()))}."
            )
        check_count(latent_dim, "latent_dim", minimum=1)
        check_count(num_inducing, "num_inducing", minimum=1)
        check_nonnegative(initial_variance, "initial_variance", positive=True)
        columns = data.unsqueeze(-1) if data.dim() == 1 else data
        if initial_means is None:
            if latent_dim > min(columns.shape):
                raise ValueError(
                    f"latent_dim = {latent_dim} exceeds what PCA of data {tuple(columns.shape)} gives; pass "
                    "initial_means or a smaller latent_dim."
                )
            initial_means = pca_initialisation(columns, latent_dim)
        if initial_means.shape != (len(data), latent_dim):
            raise ValueError(
                f"initial_means must have shape (N, latent_dim) = {(len(data), latent_dim)}, got "
                f"{tuple(initial_means.shape)}."
            )
        generator = torch.Generator().manual_seed(seed)
        subset = torch.randperm(len(data), generator=generator)[: min(num_inducing, len(data))]
        inducing = initial_means[subset].to(data)
        if num_inducing > len(data):
            extra = torch.randn(num_inducing - len(data), latent_dim, generator=generator, dtype=data.dtype)
            inducing = torch.cat([inducing, extra.to(data)])
        super().__init__(
            data,
            gpytorch.likelihoods.BernoulliLikelihood() if likelihood is None else likelihood,
            inducing,
            kernel,
            latent_prior=True,
            learn_inducing_locations=True,
            options=options,
        )
        self.q_mu = torch.nn.Parameter(initial_means.detach().to(data).clone())
        self.q_log_variance = torch.nn.Parameter(
            torch.full_like(self.q_mu, float(torch.tensor(initial_variance).log()))
        )

    def latent_means(self) -> Tensor:
        r""":math:`\boldsymbol\mu` ``(N, Q)``, the means of :math:`q(\mathbf X)` (differentiable)."""
        return self.q_mu

    def latent_variances(self) -> Tensor:
        r""":math:`\mathbf s = \exp(\text{q\_log\_variance})` ``(N, Q)``, the variances of :math:`q(\mathbf X)`."""
        return self.q_log_variance.exp()

    def embedding(self) -> Tensor:
        """The learned embedding: the means of :math:`q(\\mathbf X)`, ``(N, Q)``, detached."""
        return self.q_mu.detach().clone()

    def train_inputs_distribution(self) -> tuple[Tensor, Tensor]:
        return self.latent_means(), self.latent_variances()

    def predict_latent(self, latent_means: Tensor, latent_variances: Tensor | None = None) -> tuple[Tensor, Tensor]:
        r"""Moment-matched mean and variance of every output's latent :math:`f_p` at latent points
        :math:`\mathcal N(\boldsymbol\mu_*, \operatorname{diag}\mathbf s_*)` (known points if ``latent_variances``
        is None), ``(N*, P)`` each (:func:`~gpytorch_iterncgp.sparse.uncertain_prediction.uncertain_predictive`)."""
        mean, variance = self._predict(latent_means, latent_variances)
        return mean.mT, variance.mT

    def predict_proba(self, latent_means: Tensor, latent_variances: Tensor | None = None) -> Tensor:
        r""":math:`P(y_p = 1)` ``(N*, P)`` at those latent points: the likelihood's marginal of the moment-matched
        latent (probit: :math:`\Phi(\mathbb E f / \sqrt{1 + \operatorname{Var} f})`)."""
        return self._probabilities(*self.predict_latent(latent_means, latent_variances))


class NoisyInputGPClassifier(_UncertainInputGP):
    r"""GP classification (or count regression) whose training inputs are known only up to Gaussian noise of known
    variance, :math:`\mathbf x_i \sim \mathcal N(\boldsymbol\mu_i, \operatorname{diag}\mathbf s_i)` (module
    docstring); the test inputs may be uncertain too.

    Use it where the inputs are measurements with a known error (sensor noise, estimated positions): ignoring the
    noise makes the classifier overconfident wherever the noise blurs the class boundary.

    Example:
        >>> model = NoisyInputGPClassifier(x_means, x_variances, labels, num_inducing=20)
        >>> model.fit(num_steps=100)
        >>> probabilities = model.predict_proba(test_means, test_variances)   # (N*,)

    :param train_means: :math:`\boldsymbol\mu` ``(N, D)``.
    :param train_variances: :math:`\mathbf s \ge 0` ``(N, D)`` (0: a known input).
    :param train_targets: ``(N,)`` labels in {0, 1} (or counts for a Poisson likelihood).
    :param likelihood: default ``BernoulliLikelihood()`` (probit).
    :param inducing_points: :math:`\mathbf Z` ``(M, D)``, or an int :math:`M` (a random subset of ``train_means``).
    :param kernel: default ``ScaleKernel(RBFKernel(ard_num_dims=D))``.
    :param learn_inducing_locations: learn :math:`\mathbf Z` (else a buffer).
    :param seed: the seed of the inducing inputs' subset.
    :param options: the EP sweeps' options by name (:class:`~gpytorch_iterncgp.ep.sweeps.SweepOptions`).
    """

    def __init__(
        self,
        train_means: Tensor,
        train_variances: Tensor,
        train_targets: Tensor,
        likelihood: gpytorch.likelihoods.Likelihood | None = None,
        inducing_points: Tensor | int = 20,
        kernel: gpytorch.kernels.Kernel | None = None,
        learn_inducing_locations: bool = True,
        seed: int = 0,
        **options: Any,
    ):
        for name, value in (("train_means", train_means), ("train_variances", train_variances)):
            if not torch.is_tensor(value) or not value.is_floating_point() or value.dim() != 2:
                raise ValueError(
                    f"{name} must be a floating-point tensor (N, D), got {type(value).__name__} "
                    f"{tuple(getattr(value, 'shape', ()))}."
                )
        if train_variances.shape != train_means.shape:
            raise ValueError(
                f"train_variances must have the shape of train_means (one variance per coordinate), got "
                f"{tuple(train_variances.shape)=} and {tuple(train_means.shape)=}."
            )
        invalid = ~(torch.isfinite(train_variances) & (train_variances >= 0))
        if bool(invalid.any()):
            raise ValueError(
                f"train_variances must be finite and >= 0 (variances of the input noise), got "
                f"{train_variances[invalid][:5].tolist()} ({int(invalid.sum())} in all)."
            )
        if not torch.is_tensor(train_targets) or train_targets.shape != (len(train_means),):
            raise ValueError(
                f"train_targets must have shape (N,) = ({len(train_means)},), got "
                f"{tuple(getattr(train_targets, 'shape', ()))}."
            )
        if isinstance(inducing_points, int) and not isinstance(inducing_points, bool):
            check_count(inducing_points, "inducing_points", minimum=1)
            generator = torch.Generator().manual_seed(seed)
            subset = torch.randperm(len(train_means), generator=generator)[:inducing_points]
            inducing_points = train_means[subset]
        if not torch.is_tensor(inducing_points) or inducing_points.dim() != 2:
            raise ValueError(f"inducing_points must be an int or a tensor (M, D), got {inducing_points!r}.")
        if inducing_points.shape[-1] != train_means.shape[-1]:
            raise ValueError(
                f"inducing_points have {inducing_points.shape[-1]} features but train_means {train_means.shape[-1]}."
            )
        super().__init__(
            train_targets.to(train_means),
            gpytorch.likelihoods.BernoulliLikelihood() if likelihood is None else likelihood,
            inducing_points.to(train_means),
            kernel,
            latent_prior=False,
            learn_inducing_locations=learn_inducing_locations,
            options=options,
        )
        self.register_buffer("train_means", train_means.detach().clone())
        self.register_buffer("train_variances", train_variances.detach().clone())

    def train_inputs_distribution(self) -> tuple[Tensor, Tensor]:
        return self.train_means, self.train_variances

    def predict_latent(self, means: Tensor, variances: Tensor | None = None) -> tuple[Tensor, Tensor]:
        r"""Moment-matched mean and variance of the latent at test inputs :math:`\mathcal N(\boldsymbol\mu_*,
        \operatorname{diag}\mathbf s_*)` (known inputs if ``variances`` is None), ``(N*,)`` each
        (:func:`~gpytorch_iterncgp.sparse.uncertain_prediction.uncertain_predictive`)."""
        mean, variance = self._predict(means, variances)
        return mean[0], variance[0]

    def predict_proba(self, means: Tensor, variances: Tensor | None = None) -> Tensor:
        r""":math:`P(y_* = 1)` ``(N*,)``: the likelihood's marginal of the moment-matched latent (probit:
        :math:`\Phi(\mathbb E f_* / \sqrt{1 + \operatorname{Var} f_*})`)."""
        return self._probabilities(*self.predict_latent(means, variances))
