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

from collections.abc import Callable

import gpytorch
import torch
from gpytorch.distributions import MultivariateNormal
from linear_operator.operators import DiagLinearOperator
from torch import Tensor
from tqdm.auto import tqdm

from ..core.state import fingerprint_matches, parameter_fingerprint
from ..core.validation import check_count, check_flag, check_nonnegative
from ..ep.sweeps import SweepOptions
from ..mlls.uncertain import UncertainSparseEPMarginalLogLikelihood
from ..sparse.dtc import WhitenedInducing
from ..sparse.psi_statistics import psi_statistics
from ..sparse.uncertain import uncertain_posterior
from ..sparse.uncertain_prediction import uncertain_predictive

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
    """What both models share: the kernel, the mean, the inducing inputs, the sites, training and the predictive."""

    def __init__(
        self,
        targets: Tensor,
        likelihood: gpytorch.likelihoods.Likelihood,
        inducing_points: Tensor,
        kernel: gpytorch.kernels.Kernel | None,
        latent_prior: bool,
        learn_inducing_locations: bool,
        damping: float,
        site_tol: float,
        max_sweeps: int,
    ):
        super().__init__()
        check_flag(learn_inducing_locations, "learn_inducing_locations")
        dtype = inducing_points.dtype
        columns = targets.unsqueeze(-1) if targets.dim() == 1 else targets
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
        # the EP sites of every column (P, N); flat (0) is EP's initial state
        self.register_buffer("site_precision", torch.zeros(columns.shape[-1], columns.shape[0], dtype=dtype))
        self.register_buffer("site_natural_mean", torch.zeros(columns.shape[-1], columns.shape[0], dtype=dtype))
        self.to(dtype)
        # the parameters at which the sites were last converged (NaN: never): predictions reuse them when unchanged
        self.register_buffer("site_fingerprint", torch.full((0,), float("nan"), dtype=dtype))
        mll = UncertainSparseEPMarginalLogLikelihood(
            self.likelihood, self, latent_prior=latent_prior, damping=damping, site_tol=site_tol, max_sweeps=max_sweeps
        )
        object.__setattr__(self, "_mll", mll)  # not a submodule: the MLL holds this model (no cycle in state_dict)

    @property
    def mll(self) -> UncertainSparseEPMarginalLogLikelihood:
        """The bound :math:`\\mathcal L_H / N` this model is trained by (it keeps the last sites it converged)."""
        return self._mll  # type: ignore[return-value]

    def train_inputs_distribution(self) -> tuple[Tensor, Tensor]:
        """Means and variances ``(N, D)`` of the training inputs' :math:`q(\\mathbf X)` (differentiable)."""
        raise NotImplementedError  # pragma: no cover - every subclass defines it

    def forward(self, x: Tensor) -> MultivariateNormal:
        """The GP prior at known inputs ``x`` ``(N, D)`` (GPyTorch's ``forward`` idiom)."""
        return MultivariateNormal(self.mean_module(x), self.covar_module(x))

    def loss(self) -> Tensor:
        r""":math:`-\mathcal L_H / N` at the current parameters (the sites re-converged, warm-started), differentiable."""
        self.mll.sites = (self.site_precision, self.site_natural_mean)
        means, variances = self.train_inputs_distribution()
        value = -self.mll(means, variances, self.train_targets)
        self._store_sites()
        return value

    def _fingerprint(self) -> Tensor:
        """Every parameter and the training inputs' distribution, flattened (what the sites depend on), in the
        sites' dtype (:func:`~gpytorch_iterncgp.core.state.parameter_fingerprint`)."""
        means, variances = self.train_inputs_distribution()
        return parameter_fingerprint([*self.parameters(), means, variances], self.site_precision)

    def _sites_are_current(self) -> bool:
        """Whether the stored sites were converged at the current parameters."""
        return fingerprint_matches(self._fingerprint(), self.site_fingerprint)

    def _store_sites(self) -> None:
        assert self.mll.sites is not None
        with torch.no_grad():
            self.site_precision.copy_(self.mll.sites[0].reshape(self.site_precision.shape))
            self.site_natural_mean.copy_(self.mll.sites[1].reshape(self.site_natural_mean.shape))
            self.site_fingerprint = self._fingerprint()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        key = prefix + "site_fingerprint"
        if key in state_dict:  # its length is the number of parameters' entries, known only once they exist
            self.site_fingerprint = torch.empty_like(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

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
        parameters: from the stored sites if they were converged at these parameters, else after re-converging them
        (warm-started)."""
        with torch.no_grad():
            means, variances = self.train_inputs_distribution()
            self.mll.sites = (self.site_precision, self.site_natural_mean)
            prior = self.mll.prior(means, variances)
            if self._sites_are_current():
                parts = [
                    uncertain_posterior(prior.detached(), tau, nu)[:2]
                    for tau, nu in zip(self.site_precision, self.site_natural_mean, strict=True)
                ]
                return torch.stack([part[0] for part in parts]), torch.stack([part[1] for part in parts])
            targets = self.train_targets
            for column in targets.unsqueeze(-1).unbind(-1) if targets.dim() == 1 else targets.unbind(-1):
                self.mll.adapter.check_targets(column, means.dtype)
            states = self.mll.fit(prior, targets)
            self._store_sites()
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
            statistics = psi_statistics(
                self.covar_module, means, variances, inducing, self.mll.psi_method, self.mll.num_samples
            )
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
    :param damping: EP damping :math:`\delta \in (0, 1]`
        (:class:`~gpytorch_iterncgp.mlls.uncertain.UncertainSparseEPMarginalLogLikelihood`).
    :param site_tol: EP converged when no site moves by more than this (relative).
    :param max_sweeps: most EP sweeps per call.
    :param seed: the seed of the inducing inputs' subset.
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
        damping: float = SweepOptions.damping,
        site_tol: float = 1e-4,
        max_sweeps: int = 100,
        seed: int = 0,
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
            damping=damping,
            site_tol=site_tol,
            max_sweeps=max_sweeps,
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
    :param damping: EP damping :math:`\delta \in (0, 1]`
        (:class:`~gpytorch_iterncgp.mlls.uncertain.UncertainSparseEPMarginalLogLikelihood`).
    :param site_tol: EP converged when no site moves by more than this (relative).
    :param max_sweeps: most EP sweeps per call.
    :param seed: the seed of the inducing inputs' subset.
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
        damping: float = SweepOptions.damping,
        site_tol: float = 1e-6,
        max_sweeps: int = 200,
        seed: int = 0,
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
            damping=damping,
            site_tol=site_tol,
            max_sweeps=max_sweeps,
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
