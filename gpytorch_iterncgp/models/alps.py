r"""GP-ALPS: multi-output GPs that select their own latent processes, trained by variational inference.

Berkovich, Perim & Bruinsma, "GP-ALPS: Automatic Latent Process Selection for Multi-Output Gaussian Process
Models" (GP-ALPS eq. 2): :math:`m` latent GPs, each switched on or off by a Bernoulli gate, mixed linearly into
:math:`p` outputs,

.. math::
    x_j \sim \mathcal{GP}(0, k_j), \quad b_j \sim \operatorname{Bern}(\theta_j), \quad
    H_{ij} \sim \mathcal N(0, s_{ij}), \quad
    \mathbf f(t) = \mathbf H(\mathbf x(t) \circ \mathbf b), \quad y_i(t) \sim \mathcal N(f_i(t), \sigma_i^2).

Each of the :math:`2^m` gate patterns is a model class; the posterior over :math:`\mathbf b` selects the latent
processes the data need.

* :class:`GPALPS`: the model and its variational posterior (GP-ALPS App. C.1)
  :math:`q(\mathbf X, \mathbf X^z, \mathbf H, \mathbf b) = p(\mathbf X \mid \mathbf X^z) q(\mathbf X^z)
  q(\mathbf H, \mathbf b)`: one GPyTorch :class:`~gpytorch.variational.VariationalStrategy` per latent (whitened,
  full Cholesky :math:`q(\mathbf X^z_j)`), a Gaussian :math:`q(\mathbf H)` factorised over entries and one gate
  probability :math:`\sigma(\rho_j)` per latent. ``model(t)`` returns the marginals :math:`q(x_j(t_k))` as a
  :class:`torch.distributions.Normal` of batch shape ``(n, m)`` (data-major): all that the expected
  log-likelihood needs, since the latents are independent under :math:`q`.
* :class:`GPALPSELBO`: the evidence lower bound of GP-ALPS App. C, divided by ``num_data`` like GPyTorch's
  :class:`~gpytorch.mlls.VariationalELBO`, so that it trains on mini-batches.

Three variational families for :math:`q(\mathbf H, \mathbf b)` (``variational_family``; the default
``"spike_and_slab"`` is the one that selected the right latents most often in ``benchmarks/alps_family.py``):

* ``"concrete"`` (GP-ALPS App. C, the paper's scheme, kept to reproduce it): :math:`q(\mathbf H) q(\mathbf b)`
  with Concrete (relaxed Bernoulli, Maddison et al. 2017) gates in prior and posterior; the ELBO by reparametrised
  Monte Carlo.
* ``"bernoulli"``: :math:`q(\mathbf H) q(\mathbf b)` with Bernoulli gates, the model's own. Because
  :math:`f_i(t)` is a sum over latents of products of independent factors, the expected log-likelihood is a closed
  form in the first two moments of :math:`W_{ij} = H_{ij} b_j` (:func:`expected_log_likelihood_moments`): the
  ELBO of the unrelaxed model, without sampling.
* ``"spike_and_slab"`` (the default): :math:`q(\mathbf b) \prod_j q(\mathbf H_{:j} \mid b_j)` with
  :math:`q(\mathbf H_{:j} \mid b_j = 0) = p(\mathbf H_{:j})` (the paired mean field of Titsias & Lázaro-Gredilla
  2011, "Spike and slab variational inference for multi-task and multiple kernel learning", inside the paper's
  structured mean field :math:`q(\mathbf H, \mathbf b)` of App. C.1), and likewise :math:`q(\mathbf X^z_j \mid
  b_j = 0) = p(\mathbf X^z_j)`. Same closed form (:math:`\mathbf x_j` enters the likelihood only when
  :math:`b_j = 1`); the KLs of :math:`\mathbf H_{:j}` and :math:`\mathbf X^z_j` count only when the gate is on,
  so closing a gate refunds both (otherwise an unneeded latent shrinks :math:`q(\mathbf x_j)` to 0, pays its KL
  whatever the gate, and the gate loses most of its Occam penalty). The ELBO is then linear in each gate
  probability apart from the gate's own KL: :meth:`GPALPSELBO.update_gates` maximises it in closed form. It can
  represent what the true posterior does with an unneeded latent (keep some mass on :math:`b_j = 1` with
  :math:`\mathbf H_{:j}` near 0), which the fully factorised families cannot.

The noise variances :math:`\sigma_i^2` live in a :class:`~gpytorch.likelihoods.MultitaskGaussianLikelihood` with
``rank=0`` (one variance per output). Missing outputs are ``NaN`` in the targets and are left out of the likelihood.

Example:
    >>> model = GPALPS([gpytorch.kernels.RBFKernel() for _ in range(3)], inducing_points=torch.rand(20, 1),
    ...                num_outputs=2)
    >>> likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, rank=0)
    >>> elbo = GPALPSELBO(likelihood, model, num_data=len(t))
    >>> loss = -elbo(model(t), Y)  # t: (n, D); Y: (n, 2), NaN where an output is missing
    >>> model.activation_probabilities()  # (3,)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import gpytorch
import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.kernels import Kernel
from gpytorch.variational import CholeskyVariationalDistribution, VariationalStrategy
from linear_operator.operators import DiagLinearOperator
from torch import Tensor
from torch.distributions import Normal, RelaxedBernoulli
from torch.nn import functional as F

from ..core.validation import check_count, check_flag, check_nonnegative

__all__ = [
    "VARIATIONAL_FAMILIES",
    "ELBOTerms",
    "GPALPS",
    "GPALPSELBO",
    "expected_log_likelihood",
    "expected_log_likelihood_moments",
    "noise_variances",
]

VARIATIONAL_FAMILIES = ("concrete", "bernoulli", "spike_and_slab")

_LOG_2PI = math.log(2 * math.pi)
# Floor on the marginal variances q(x_j(t)) before the square root of the Normal's scale (its gradient is infinite
# at 0); GPyTorch's jitter keeps them far above it.
_MIN_VARIANCE = 1e-12
# Clip of the gate logits set by GPALPSELBO.update_gates: probabilities 1e-13 from 0 and 1.
_MAX_GATE_LOGIT = 30.0


class _LatentProcess(gpytorch.models.ApproximateGP):
    """One latent GP :math:`x_j \\sim \\mathcal{GP}(0, k_j)` with its whitened SVGP posterior."""

    def __init__(self, kernel: Kernel, inducing_points: Tensor):
        distribution = CholeskyVariationalDistribution(inducing_points.shape[-2])
        strategy = VariationalStrategy(self, inducing_points, distribution, learn_inducing_locations=True)
        super().__init__(strategy)
        self.covar_module = kernel

    def forward(self, x: Tensor) -> MultivariateNormal:
        covariance = self.covar_module(x)
        return MultivariateNormal(torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device), covariance)


def _as_prior_tensor(value, shape: tuple[int, ...], name: str, open_unit: bool) -> Tensor:
    """A scalar or a tensor broadcastable to ``shape``, every entry in (0, 1) (``open_unit``) or positive."""
    tensor = torch.as_tensor(value, dtype=torch.float64)
    try:
        tensor = torch.broadcast_to(tensor, shape).clone()
    except RuntimeError:
        raise ValueError(
            f"{name} must be a scalar or broadcastable to shape {shape}, got shape {tuple(tensor.shape)}."
        ) from None
    if open_unit and not bool(((tensor > 0) & (tensor < 1)).all()):
        raise ValueError(f"{name} must lie strictly between 0 and 1, got {value!r}.")
    if not open_unit and not bool(((tensor > 0) & torch.isfinite(tensor)).all()):
        raise ValueError(f"{name} must be positive and finite, got {value!r}.")
    return tensor


def noise_variances(likelihood: gpytorch.likelihoods.MultitaskGaussianLikelihood) -> Tensor:
    r"""The per-output noise variances :math:`\sigma_i^2`, ``(p,)``, of a rank-0 multitask Gaussian likelihood:
    ``task_noises`` plus the global ``noise`` (each where the likelihood has it).

    :raises TypeError: not a :class:`~gpytorch.likelihoods.MultitaskGaussianLikelihood`.
    :raises ValueError: ``rank != 0`` (correlated noise across outputs is not part of GP-ALPS eq. 2).
    """
    if not isinstance(likelihood, gpytorch.likelihoods.MultitaskGaussianLikelihood):
        raise TypeError(
            "GP-ALPS needs one noise variance per output: pass "
            "gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=p, rank=0), "
            f"got {type(likelihood).__name__}."
        )
    if likelihood.rank != 0:
        raise ValueError(
            f"GP-ALPS has independent output noises: the likelihood needs rank=0, got rank={likelihood.rank}."
        )
    parts = [likelihood.task_noises] if likelihood.has_task_noise else []
    parts += [likelihood.noise] if likelihood.has_global_noise else []
    shape = (likelihood.num_tasks,)
    return torch.stack([torch.broadcast_to(part.reshape(-1), shape) for part in parts]).sum(0)


class GPALPS(gpytorch.models.GP):
    r"""GP-ALPS (GP-ALPS eq. 2) with its variational posterior (GP-ALPS App. C.1).

    Use it when several outputs share a handful of latent processes and you want the data to choose which of the
    candidate latents (each a kernel, e.g. one periodicity or one input feature) are needed: the posterior gate
    probabilities (:meth:`activation_probabilities`) select them. With all gates fixed on and :math:`\mathbf H`
    fixed it is GPyTorch's linear model of coregionalisation (:class:`~gpytorch.variational.LMCVariationalStrategy`).

    Variational posterior, all learnable parameters:

    * :math:`q(\mathbf X^z_j) = \mathcal N(\mathbf m_j, \mathbf S_j)` at the inducing inputs :math:`\mathbf Z_j`
      (learnable too), one :class:`~gpytorch.variational.CholeskyVariationalDistribution` per latent in GPyTorch's
      *whitened* :class:`~gpytorch.variational.VariationalStrategy` (``latent_processes[j]``);
    * :math:`q(H_{ij}) = \mathcal N(\mu_{ij}, \exp \lambda_{ij})`: ``mixing_mean`` and ``mixing_log_variance``,
      ``(p, m)``;
    * the gates, logits ``gate_logits`` :math:`\rho_j`, ``(m,)``: the posterior probability of gate :math:`j` is
      :math:`\sigma(\rho_j)`. With ``variational_family="concrete"``, :math:`q(b_j) = \operatorname{Concrete}
      (\rho_j, \tau)`, the relaxed Bernoulli at the fixed temperature :math:`\tau` (buffer ``temperature``); with
      ``"bernoulli"`` and ``"spike_and_slab"``, :math:`q(b_j) = \operatorname{Bern}(\sigma(\rho_j))`, and under
      ``"spike_and_slab"`` ``mixing_mean`` and ``mixing_log_variance`` are those of :math:`q(H_{ij} \mid b_j = 1)`
      (:math:`q(H_{ij} \mid b_j = 0)` is the prior).

    Which family: ``"spike_and_slab"``, the default, because it selects the right latents most often when trained
    by Adam as in the examples (``benchmarks/alps_family.py``: square waves and periodic mixtures, the examples'
    and others, several seeds each, ``benchmarks/results/alps_family.json``). Its optimum is the closest to
    the exact posterior, and its ELBO, a closed form, has noise-free gradients and compares restarts exactly; but
    from some initialisations Adam ends in a local optimum that drops a weakly supported latent (the bilinear
    :math:`H_{ij} x_j` has a saddle at 0), so compare a few restarts by their ELBO (with :math:`q(\mathbf X^z_j)`
    gated as well, which closing a gate refunds, the square wave of GP-ALPS §4.1 keeps all its harmonics from each
    of 3 initialisations tried). ``"concrete"`` is the paper's scheme, selectable by name to reproduce it: its KL
    between relaxed gates is that of two logistic densities of the gate's logit,
    :math:`\approx |\rho_j - \operatorname{logit}\theta_j| - 2` for confident gates, whatever :math:`\tau` (prior
    and posterior share it), not the Bernoulli KL it relaxes (which it bounds from above, and which is at most
    :math:`-\log\min(\theta_j, 1 - \theta_j)`); that linear cost holds gates that the data need visibly below 1.

    Prior: :math:`\theta_j` (buffer ``prior_activation``, ``(m,)``) and :math:`s_{ij}` (buffer
    ``mixing_prior_variance``, ``(p, m)``). The kernels keep their own hyperparameters (learnt unless frozen).

    :param latent_kernels: :math:`m` GPyTorch kernels, one per latent process (non-batched).
    :param inducing_points: ``(M, D)`` shared by all latents (one tied parameter), or ``(m, M, D)``, one set per
        latent. Its dtype is the model's dtype.
    :param num_outputs: :math:`p`.
    :param prior_activation: :math:`\theta_j`, a scalar or ``(m,)``, in (0, 1).
    :param mixing_prior_variance: :math:`s_{ij}`, a scalar, ``(m,)`` (per latent) or ``(p, m)``, positive.
    :param temperature: :math:`\tau` of the Concrete prior and posterior of the gates (Maddison et al. 2017 use
        :math:`\tau \le 1`; lower is closer to Bernoulli and noisier in its gradients). Used by ``"concrete"``
        only.
    :param initial_activation: :math:`\sigma(\rho_j)` at initialisation; starting with the gates on lets every
        latent see the data before the ELBO switches the unneeded ones off.
    :param initial_mixing_std: standard deviation of the random initial ``mixing_mean`` (drawn with
        ``torch.randn``, seed it with ``torch.manual_seed``), relative to :math:`\sqrt{s_{ij}}`; a zero mean would
        start at the saddle point :math:`\mathbf H = 0`, :math:`\mathbf m_j = 0`.
    :param variational_family: ``"spike_and_slab"`` (the default), ``"concrete"`` (GP-ALPS App. C, the
        paper's) or ``"bernoulli"`` (above and in the module docstring).
    """

    def __init__(
        self,
        latent_kernels: Sequence[Kernel],
        inducing_points: Tensor,
        num_outputs: int,
        prior_activation: float | Tensor = 0.5,
        mixing_prior_variance: float | Tensor = 1.0,
        temperature: float = 0.5,
        initial_activation: float = 0.9,
        initial_mixing_std: float = 1.0,
        variational_family: str = "spike_and_slab",
    ):
        super().__init__()
        if variational_family not in VARIATIONAL_FAMILIES:
            raise ValueError(f"variational_family must be one of {VARIATIONAL_FAMILIES}, got {variational_family!r}.")
        self.variational_family = variational_family
        kernels = list(latent_kernels)
        if not kernels or not all(isinstance(kernel, Kernel) for kernel in kernels):
            raise ValueError(
                "latent_kernels must be a non-empty sequence of gpytorch.kernels.Kernel, one per latent process, "
                f"got {[type(kernel).__name__ for kernel in kernels]}."
            )
        num_latents = len(kernels)
        check_count(num_outputs, "num_outputs", minimum=1)
        check_nonnegative(temperature, "temperature", positive=True)
        check_nonnegative(initial_mixing_std, "initial_mixing_std")
        if not 0 < initial_activation < 1:
            raise ValueError(f"initial_activation must lie strictly between 0 and 1, got {initial_activation!r}.")
        if not torch.is_tensor(inducing_points) or not inducing_points.is_floating_point():
            raise ValueError("inducing_points must be a floating-point tensor of shape (M, D) or (m, M, D).")
        shared = inducing_points.dim() == 2
        if not (shared or (inducing_points.dim() == 3 and inducing_points.shape[0] == num_latents)):
            raise ValueError(
                f"inducing_points must have shape (M, D), shared by the latents, or (m, M, D) with m = "
                f"{num_latents} (the number of latent_kernels), got {tuple(inducing_points.shape)}."
            )
        if inducing_points.shape[-2] == 0 or not bool(torch.isfinite(inducing_points).all()):
            raise ValueError("inducing_points must hold at least one point and no NaN or inf.")
        dtype, device = inducing_points.dtype, inducing_points.device
        per_latent = inducing_points.expand(num_latents, *inducing_points.shape[-2:])
        self.latent_processes = torch.nn.ModuleList(
            [_LatentProcess(kernel, per_latent[j].clone()) for j, kernel in enumerate(kernels)]
        ).to(dtype=dtype, device=device)  # the kernels too: the inducing points set the model's dtype
        if shared:  # one parameter, registered in every strategy: the latents keep sharing it while it is learnt
            tied = torch.nn.Parameter(inducing_points.detach().clone())
            for strategy in self.strategies():
                strategy.inducing_points = tied
        self.num_latents, self.num_outputs = num_latents, num_outputs

        shape = (num_outputs, num_latents)
        theta = _as_prior_tensor(prior_activation, (num_latents,), "prior_activation", open_unit=True)
        variance = _as_prior_tensor(mixing_prior_variance, shape, "mixing_prior_variance", open_unit=False)
        options: dict[str, Any] = dict(dtype=dtype, device=device)
        self.register_buffer("prior_activation", theta.to(**options))
        self.register_buffer("mixing_prior_variance", variance.to(**options))
        self.register_buffer("temperature", torch.tensor(float(temperature), **options))
        std = initial_mixing_std * self.mixing_prior_variance.sqrt()
        self.mixing_mean = torch.nn.Parameter(std * torch.randn(shape, **options))
        self.mixing_log_variance = torch.nn.Parameter(self.mixing_prior_variance.log().clone())
        logit = math.log(initial_activation / (1 - initial_activation))
        self.gate_logits = torch.nn.Parameter(torch.full((num_latents,), logit, **options))

    # ------------------------------------------------------------------------------------------------
    # The variational posterior
    # ------------------------------------------------------------------------------------------------
    def strategies(self) -> list[VariationalStrategy]:
        r"""Each latent's GPyTorch variational strategy: its inducing inputs and :math:`q(\mathbf X^z_j)`."""
        return [cast(VariationalStrategy, process.variational_strategy) for process in self.latent_processes]

    def kernels(self) -> list[Kernel]:
        """The latents' kernels :math:`k_j`."""
        return [cast(Kernel, process.covar_module) for process in self.latent_processes]

    def forward(self, inputs: Tensor) -> Normal | MultitaskMultivariateNormal:
        r"""In training mode the latents' marginals (:meth:`latent_marginals`, what :class:`GPALPSELBO` takes); in
        eval mode the predictive of the outputs :math:`\mathbf f(t)` (:meth:`predict`'s mean and variance, a
        ``MultitaskMultivariateNormal`` of shape ``(n, p)`` with a diagonal covariance), so that
        ``likelihood(model(t))`` is GPyTorch's predictive of the observations, the noise of a
        ``MultitaskGaussianLikelihood`` added.

        :param inputs: :math:`\mathbf t`, ``(n, D)`` (or ``(n,)`` for :math:`D = 1`), the model's dtype.
        """
        if self.training:
            return self.latent_marginals(inputs)
        mean, variance = self.predict(inputs)
        covariance = DiagLinearOperator(variance.reshape(-1).clamp_min(_MIN_VARIANCE))  # interleaved: (t, output)
        return MultitaskMultivariateNormal(mean, covariance, interleaved=True)

    def latent_marginals(self, inputs: Tensor) -> Normal:
        r"""The marginals of :math:`q(\mathbf X) = \int p(\mathbf X \mid \mathbf X^z) q(\mathbf X^z)\,
        d\mathbf X^z` at ``inputs`` (GP-ALPS App. C.2): :math:`q(x_j(t_k)) = \mathcal N(d_{kj}, v_{kj})`, each
        latent's SVGP predictive marginal.

        :param inputs: :math:`\mathbf t`, ``(n, D)`` (or ``(n,)`` for :math:`D = 1`), the model's dtype.
        :returns: a :class:`torch.distributions.Normal` of batch shape ``(n, m)``: ``mean`` :math:`d` and
            ``variance`` :math:`v`.
        """
        inputs = self._check_inputs(inputs)
        means, variances = [], []
        for process in self.latent_processes:
            marginal = process(inputs)
            means.append(marginal.mean)
            variances.append(marginal.variance)
        mean, variance = torch.stack(means, -1), torch.stack(variances, -1)  # shape: (n, m)
        return Normal(mean, variance.clamp_min(_MIN_VARIANCE).sqrt(), validate_args=False)

    def _check_inputs(self, inputs: Tensor) -> Tensor:
        reference = self.mixing_mean
        if not torch.is_tensor(inputs) or not inputs.is_floating_point():
            raise ValueError("inputs must be a floating-point tensor of shape (n, D).")
        if inputs.dim() == 1:
            inputs = inputs.unsqueeze(-1)
        num_features = self.strategies()[0].inducing_points.shape[-1]
        if inputs.dim() != 2 or inputs.shape[-1] != num_features:
            raise ValueError(
                f"inputs must have shape (n, D) with D = {num_features} (the inducing points' dimension), "
                f"got {tuple(inputs.shape)}."
            )
        if inputs.dtype != reference.dtype or inputs.device != reference.device:
            raise ValueError(
                f"inputs are {inputs.dtype} on {inputs.device} but the model is {reference.dtype} on "
                f"{reference.device}: call model.to(inputs) (and the likelihood too) or convert the inputs."
            )
        if not bool(torch.isfinite(inputs).all()):
            raise ValueError("inputs contain NaN or inf.")
        return inputs

    def kl_latents(self) -> Tensor:
        r""":math:`\sum_j \mathrm{KL}[q(\mathbf X^z_j) \,\|\, p(\mathbf X^z_j)]` (GP-ALPS App. C.4), each term
        GPyTorch's :meth:`~gpytorch.variational.VariationalStrategy.kl_divergence` (whitened: against
        :math:`\mathcal N(\mathbf 0, \mathbf I)`, the same value). Under ``"spike_and_slab"``
        :math:`\sum_j \sigma(\rho_j) \mathrm{KL}_j`: there :math:`q(\mathbf X^z_j)` is
        :math:`q(\mathbf X^z_j \mid b_j = 1)` and :math:`q(\mathbf X^z_j \mid b_j = 0) = p(\mathbf X^z_j)` (the
        chain rule of the KL, as for :math:`\mathbf H_{:j}` in :meth:`kl_mixing`)."""
        divergence = torch.stack([strategy.kl_divergence() for strategy in self.strategies()])
        if self.variational_family == "spike_and_slab":
            divergence = divergence * self.activation_probabilities()
        return divergence.sum()

    def mixing_distribution(self) -> Normal:
        r""":math:`q(\mathbf H)`, a :class:`~torch.distributions.Normal` of batch shape ``(p, m)``."""
        return Normal(self.mixing_mean, (0.5 * self.mixing_log_variance).exp())

    def kl_mixing(self) -> Tensor:
        r"""The mixing weights' part of :math:`\mathrm{KL}[q(\mathbf H, \mathbf b) \,\|\, p(\mathbf H, \mathbf b)]`.
        With :math:`\mathrm{KL}_{ij} = \tfrac12 \bigl(\log(s_{ij} / s^H_{ij}) + (s^H_{ij} + (m^H_{ij})^2) / s_{ij}
        - 1\bigr)` (GP-ALPS App. C.5): :math:`\sum_{ij} \mathrm{KL}_{ij}`, or, under ``"spike_and_slab"``,
        :math:`\sum_j \sigma(\rho_j) \sum_i \mathrm{KL}_{ij}` (the chain rule of the KL, since
        :math:`q(\mathbf H_{:j} \mid b_j = 0) = p(\mathbf H_{:j})`)."""
        return self._kl_mixing(self.mixing_mean, self.mixing_log_variance)

    def _kl_mixing(self, mean: Tensor, log_variance: Tensor) -> Tensor:
        prior = Normal(torch.zeros_like(mean), self.mixing_prior_variance.sqrt())
        divergence = torch.distributions.kl_divergence(Normal(mean, (0.5 * log_variance).exp()), prior)
        if self.variational_family == "spike_and_slab":
            divergence = divergence * self.activation_probabilities()
        return divergence.sum()

    def kl_gates(self) -> Tensor:
        r""":math:`\sum_j \mathrm{KL}[\operatorname{Bern}(q_j) \,\|\, \operatorname{Bern}(\theta_j)] = \sum_j
        \bigl(q_j \log(q_j / \theta_j) + (1 - q_j) \log((1 - q_j) / (1 - \theta_j))\bigr)`, :math:`q_j =
        \sigma(\rho_j)`: the gates' KL of ``"bernoulli"`` and ``"spike_and_slab"``, in closed form
        (:math:`\log q_j = -\operatorname{softplus}(-\rho_j)` keeps confident gates exact)."""
        probability = self.activation_probabilities()
        log_on, log_off = -F.softplus(-self.gate_logits), -F.softplus(self.gate_logits)
        theta = self.prior_activation
        on = probability * (log_on - theta.log())
        return (on + (1 - probability) * (log_off - torch.log1p(-theta))).sum()

    def gate_distribution(self) -> RelaxedBernoulli:
        r""":math:`q(\mathbf b) = \prod_j \operatorname{Concrete}(b_j; \rho_j, \tau)`, batch shape ``(m,)``."""
        return RelaxedBernoulli(self.temperature, logits=self.gate_logits)

    def gate_prior(self) -> RelaxedBernoulli:
        r"""The relaxed prior :math:`\prod_j \operatorname{Concrete}(b_j; \operatorname{logit}\theta_j, \tau)`
        (GP-ALPS App. C.1), the same temperature as :math:`q(\mathbf b)`."""
        return RelaxedBernoulli(self.temperature, probs=self.prior_activation)

    # ------------------------------------------------------------------------------------------------
    # What a user reads
    # ------------------------------------------------------------------------------------------------
    def activation_probabilities(self) -> Tensor:
        r"""The posterior probability of each gate, :math:`q(b_j = 1) = \sigma(\rho_j)`, ``(m,)``."""
        return torch.sigmoid(self.gate_logits)

    def selected_latents(self) -> Tensor:
        """The selected model: the latents whose activation probability exceeds 1/2, ``bool (m,)``."""
        return self.activation_probabilities() > 0.5

    def mixing_posterior(self) -> tuple[Tensor, Tensor]:
        r"""Means and variances of :math:`q(\mathbf H)`, ``(p, m)`` each."""
        return self.mixing_mean, self.mixing_log_variance.exp()

    def predict(
        self,
        inputs: Tensor,
        num_samples: int = 256,
        likelihood: gpytorch.likelihoods.MultitaskGaussianLikelihood | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        r"""Predictive mean and variance of the outputs at ``inputs``.

        Monte Carlo over :math:`S` draws of :math:`\mathbf H \sim q(\mathbf H)` and of *hard* gates
        :math:`b_j \sim \operatorname{Bern}(\sigma(\rho_j))` (the model's gates are binary; the Concrete relaxation
        is a training device), the Gaussian over :math:`\mathbf x(t)` in closed form: given
        :math:`(\mathbf H, \mathbf b)`, :math:`f_i(t)` has mean :math:`\sum_j H_{ij} b_j d_j(t)` and variance
        :math:`\sum_j H_{ij}^2 b_j v_j(t)`; the mixture's moments follow by the laws of total expectation and
        variance.

        :param inputs: ``(n, D)``.
        :param num_samples: :math:`S`.
        :param likelihood: if given, its noise variances :math:`\sigma_i^2` are added (predicting :math:`y`, not
            :math:`f`).
        :param generator: for reproducible draws.
        :returns: ``mean`` and ``variance``, ``(n, p)`` each.
        """
        check_count(num_samples, "num_samples", minimum=1)
        with torch.no_grad():
            latent = self.latent_marginals(inputs)
            mixing = self.mixing_distribution()
            noise = torch.randn((num_samples, *mixing.batch_shape), generator=generator, **_like(inputs))
            weights = mixing.mean + mixing.stddev * noise  # shape: (S, p, m)
            uniform = torch.rand((num_samples, self.num_latents), generator=generator, **_like(inputs))
            weights = weights * (uniform < self.activation_probabilities()).to(inputs.dtype).unsqueeze(-2)
            mean = torch.einsum("spm,nm->snp", weights, latent.mean)
            variance = torch.einsum("spm,nm->snp", weights.square(), latent.variance)
            total_mean = mean.mean(0)
            total_variance = (variance + mean.square()).mean(0) - total_mean.square()
            total_variance = total_variance.clamp_min(0)
            if likelihood is not None:
                total_variance = total_variance + noise_variances(likelihood)
        return total_mean, total_variance


def _like(tensor: Tensor) -> dict[str, Any]:
    return dict(dtype=tensor.dtype, device=tensor.device)


def expected_log_likelihood(
    latent: Normal, weights: Tensor, targets: Tensor, noise: Tensor, observed: Tensor | None = None
) -> Tensor:
    r"""The Gaussian expectation over :math:`\mathbf x_t \sim q(\mathbf x_t)` of the log-likelihood, in closed form
    given the gated mixing weights :math:`\mathbf W = \mathbf H \operatorname{diag}(\mathbf b)` (GP-ALPS App. C.2):

    .. math::
        \mathbb E_{q(\mathbf x_t)} \log \mathcal N(\mathbf y_t \mid \mathbf W \mathbf x_t, \operatorname{diag}
        \boldsymbol\sigma^2) = \sum_{i \text{ observed}} \Bigl[\log \mathcal N(y_{ti} \mid (\mathbf W \mathbf
        d_t)_i, \sigma_i^2) - \frac{\sum_j W_{ij}^2 v_{tj}}{2 \sigma_i^2}\Bigr].

    :param latent: :math:`q(\mathbf x_t)`, batch shape ``(n, m)`` (``mean`` :math:`d`, ``variance`` :math:`v`).
    :param weights: :math:`\mathbf W`, ``(S, p, m)`` (one per sample of :math:`(\mathbf H, \mathbf b)`).
    :param targets: ``(n, p)``; entries where ``observed`` is False are ignored (may be NaN).
    :param noise: :math:`\boldsymbol\sigma^2`, ``(p,)``.
    :param observed: ``bool (n, p)``; default: the non-NaN entries of ``targets``.
    :returns: ``(S, n)``, the expectation per sample and data point.
    """
    if observed is None:
        observed = ~torch.isnan(targets)
    filled = torch.where(observed, targets, torch.zeros_like(targets))  # NaN * 0 would poison the gradients
    mean = torch.einsum("spm,nm->snp", weights, latent.mean)
    variance = torch.einsum("spm,nm->snp", weights.square(), latent.variance)
    terms = ((filled - mean).square() + variance) / noise + noise.log() + _LOG_2PI
    return -0.5 * (terms * observed.to(terms.dtype)).sum(-1)


def expected_log_likelihood_moments(
    latent: Normal,
    weight_mean: Tensor,
    weight_variance: Tensor,
    targets: Tensor,
    noise: Tensor,
    observed: Tensor | None = None,
) -> Tensor:
    r"""The expected log-likelihood over :math:`q(\mathbf x_t) q(\mathbf W)` in closed form, for gated weights
    :math:`W_{ij} = H_{ij} b_j` independent across :math:`j` within each output :math:`i` (and independent of
    :math:`\mathbf x_t`), from their means :math:`\omega_{ij} = \mathbb E W_{ij}` and variances
    :math:`\gamma_{ij} = \operatorname{Var} W_{ij}`. With :math:`\bar f_{ti} = \sum_j \omega_{ij} d_{tj}` and

    .. math::
        \operatorname{Var} f_{ti} = \sum_j \operatorname{Var}(W_{ij} x_{tj}) = \sum_j \bigl((\gamma_{ij} +
        \omega_{ij}^2) v_{tj} + \gamma_{ij} d_{tj}^2\bigr), \qquad
        \mathbb E \log p(\mathbf y_t \mid \cdot) = -\frac12 \sum_{i \text{ observed}} \Bigl[\log(2\pi\sigma_i^2)
        + \frac{(y_{ti} - \bar f_{ti})^2 + \operatorname{Var} f_{ti}}{\sigma_i^2}\Bigr]

    (GP-ALPS App. C.2 with the expectation over :math:`(\mathbf H, \mathbf b)` taken exactly: the Gaussian
    log-likelihood is quadratic in :math:`f_{ti}`). For Bernoulli gates with :math:`q_j = \sigma(\rho_j)` and
    :math:`H_{ij} \sim \mathcal N(\mu_{ij}, s^H_{ij})` given :math:`b_j = 1`: :math:`\omega_{ij} = q_j \mu_{ij}`,
    :math:`\gamma_{ij} = q_j s^H_{ij} + q_j (1 - q_j) \mu_{ij}^2`.

    :param latent: :math:`q(\mathbf x_t)`, batch shape ``(n, m)`` (``mean`` :math:`d`, ``variance`` :math:`v`).
    :param weight_mean: :math:`\boldsymbol\omega`, ``(p, m)``.
    :param weight_variance: :math:`\boldsymbol\gamma`, ``(p, m)``, non-negative.
    :param targets: ``(n, p)``; entries where ``observed`` is False are ignored (may be NaN).
    :param noise: :math:`\boldsymbol\sigma^2`, ``(p,)``.
    :param observed: ``bool (n, p)``; default: the non-NaN entries of ``targets``.
    :returns: ``(n,)``, the expectation per data point.
    """
    if observed is None:
        observed = ~torch.isnan(targets)
    filled = torch.where(observed, targets, torch.zeros_like(targets))
    mean, variance = latent.mean, latent.variance  # shape: (n, m)
    output_mean = mean @ weight_mean.mT  # shape: (n, p)
    output_variance = variance @ (weight_variance + weight_mean.square()).mT + mean.square() @ weight_variance.mT
    terms = ((filled - output_mean).square() + output_variance) / noise + noise.log() + _LOG_2PI
    return -0.5 * (terms * observed.to(terms.dtype)).sum(-1)


def _scale_gradient(tensor: Tensor, scale: Tensor) -> Tensor:
    """``tensor`` itself, whose gradient is multiplied by ``scale`` (broadcast) on the way back."""
    if not (tensor.requires_grad and torch.is_grad_enabled()):  # e.g. under torch.no_grad()
        return tensor
    copy = tensor.clone()
    copy.register_hook(lambda gradient: gradient * scale)
    return copy


class ELBOTerms(NamedTuple):
    """The parts of the ELBO (GP-ALPS App. C.1), unscaled: the expected log-likelihood is summed over the batch."""

    expected_log_likelihood: Tensor
    kl_latents: Tensor
    kl_mixing: Tensor
    kl_gates: Tensor


class GPALPSELBO(gpytorch.mlls.MarginalLogLikelihood):
    r"""The evidence lower bound of GP-ALPS (GP-ALPS App. C), per data point:

    .. math::
        \frac{1}{n} \mathcal L = \frac{1}{|B|} \sum_{t \in B} \mathbb E_{q(\mathbf H, \mathbf b)}
        \mathbb E_{q(\mathbf x_t)} \log p(\mathbf y_t \mid \mathbf x_t, \mathbf H, \mathbf b)
        - \frac{1}{n}\Bigl(\mathrm{KL}[q(\mathbf X^z) \| p(\mathbf X^z)] + \mathrm{KL}[q(\mathbf H, \mathbf b) \|
        p(\mathbf H, \mathbf b)]\Bigr),

    divided by ``num_data`` :math:`n` like GPyTorch's :class:`~gpytorch.mlls.VariationalELBO` (and, like it, plus
    the log-priors registered on the model's and likelihood's hyperparameters, divided by :math:`n`), so that a
    mini-batch :math:`B` gives an unbiased estimate.

    Missing outputs (``NaN``) are left out. :math:`\mathrm{KL}[q(\mathbf X^z) \| p(\mathbf X^z)]` and the mixing
    weights' KL are analytic (:meth:`GPALPS.kl_latents`, :meth:`GPALPS.kl_mixing`). The rest depends on the model's
    ``variational_family``:

    * ``"concrete"`` (GP-ALPS App. C.2–C.3): the expected log-likelihood by :math:`S` reparametrised draws of
      :math:`\mathbf H \sim q(\mathbf H)` and of the Concrete gates :math:`\mathbf b \sim q(\mathbf b)`, the
      expectation over :math:`\mathbf x_t` in closed form (:func:`expected_log_likelihood`);
      :math:`\mathrm{KL}[q(\mathbf b) \| p(\mathbf b)] = \mathbb E_q[\log q(\mathbf b) - \log p(\mathbf b)]` with
      :math:`p(\mathbf b)` the relaxed prior of the same temperature, by the same :math:`S` draws, evaluated in the
      logit space of the Concrete (:class:`~torch.distributions.LogitRelaxedBernoulli`, Maddison et al. 2017,
      App. C): the sigmoid is a bijection, so the KL is the same and the Jacobians cancel, and densities near
      :math:`b = 0, 1` do not round off.
    * ``"bernoulli"`` and ``"spike_and_slab"``: no sampling. The expected log-likelihood in closed form over
      :math:`\mathbf x_t`, :math:`\mathbf H` and the Bernoulli gates (:func:`expected_log_likelihood_moments`),
      the gates' KL analytic (:meth:`GPALPS.kl_gates`); ``num_samples`` and ``generator`` are not used.

    :param likelihood: :class:`~gpytorch.likelihoods.MultitaskGaussianLikelihood` with ``num_tasks=p``, ``rank=0``.
    :param model: the :class:`GPALPS`.
    :param num_data: :math:`n`, the number of training points.
    :param num_samples: :math:`S`, the draws of :math:`(\mathbf H, \mathbf b)` per evaluation (``"concrete"``).
    :param natural_slab_gradients: under ``"spike_and_slab"``, divide the gradients of the slab's parameters
        (``mixing_mean``, ``mixing_log_variance`` of latent :math:`j`) by :math:`\sigma(\rho_j)` on the way back;
        the ELBO's value is unchanged. Every term that depends on the slab carries the factor :math:`\sigma(\rho_j)`,
        and so does the Fisher information of :math:`q(b_j) q(\mathbf H_{:j} \mid b_j)` in the slab's parameters
        (:math:`q(\mathbf H_{:j} \mid b_j = 0)` does not depend on them): this is the natural-gradient correction
        for that factor. It changes no stationary point (a positive diagonal rescaling), but without it a gate that
        drops early freezes its slab (its gradients vanish with :math:`\sigma(\rho_j)`, and Adam's running
        second moments still remember the large early ones), and the gate cannot come back.
    """

    def __init__(
        self,
        likelihood: gpytorch.likelihoods.MultitaskGaussianLikelihood,
        model: GPALPS,
        num_data: int,
        num_samples: int = 8,
        natural_slab_gradients: bool = True,
    ):
        if not isinstance(model, GPALPS):
            raise TypeError(f"GPALPSELBO needs a GPALPS model, got {type(model).__name__}.")
        noise_variances(likelihood)  # checks the type and the rank
        if likelihood.num_tasks != model.num_outputs:
            raise ValueError(
                f"The likelihood has num_tasks={likelihood.num_tasks} but the model num_outputs="
                f"{model.num_outputs}: build MultitaskGaussianLikelihood(num_tasks={model.num_outputs}, rank=0)."
            )
        check_count(num_data, "num_data", minimum=1)
        check_count(num_samples, "num_samples", minimum=1)
        super().__init__(likelihood, model)
        check_flag(natural_slab_gradients, "natural_slab_gradients")
        self.num_data, self.num_samples = num_data, num_samples
        self.natural_slab_gradients = natural_slab_gradients

    def _check_targets(self, latent: Normal, targets: Tensor) -> Tensor:
        if not isinstance(latent, Normal) or latent.batch_shape[-1:] != (self.model.num_latents,):
            raise ValueError(
                "GPALPSELBO expects model(t), the latent marginals (a Normal of batch shape (n, m)), as its first "
                f"argument, got {type(latent).__name__}."
            )
        num_points, num_outputs = latent.batch_shape[0], self.model.num_outputs
        if not torch.is_tensor(targets) or targets.shape != (num_points, num_outputs):
            shape = tuple(targets.shape) if torch.is_tensor(targets) else type(targets).__name__
            raise ValueError(
                f"targets must have shape (n, p) = ({num_points}, {num_outputs}): one row per input of model(t) "
                f"and one column per output (NaN where missing), got {shape}."
            )
        if targets.dtype != latent.mean.dtype:
            raise ValueError(f"targets are {targets.dtype} but the model is {latent.mean.dtype}: convert them.")
        if bool(torch.isinf(targets).any()):
            raise ValueError("targets contain inf: mark missing outputs with NaN.")
        return targets

    def terms(self, latent: Normal, targets: Tensor, generator: torch.Generator | None = None) -> ELBOTerms:
        r"""The ELBO's parts (GP-ALPS App. C.2–C.5), each unscaled; the expected log-likelihood summed over the
        batch (and, under ``"concrete"``, averaged over the :math:`S` draws).

        :param latent: ``model(t)``, batch shape ``(n, m)``.
        :param targets: ``(n, p)``, ``NaN`` where missing.
        :param generator: for reproducible draws (default: torch's global generator).
        """
        targets = self._check_targets(latent, targets)
        model: GPALPS = self.model
        options = _like(latent.mean)
        noise = noise_variances(self.likelihood).to(**options)
        if model.variational_family != "concrete":
            probability = model.activation_probabilities()
            mixing_mean: Tensor = model.mixing_mean
            mixing_log_variance: Tensor = model.mixing_log_variance
            if model.variational_family == "spike_and_slab" and self.natural_slab_gradients:
                mixing_mean = _scale_gradient(mixing_mean, 1 / probability.detach())
                mixing_log_variance = _scale_gradient(mixing_log_variance, 1 / probability.detach())
            mixing_variance = mixing_log_variance.exp()
            weight_mean = probability * mixing_mean  # E[H_ij b_j], shape: (p, m)
            weight_variance = probability * (mixing_variance + (1 - probability) * mixing_mean.square())
            ell = expected_log_likelihood_moments(latent, weight_mean, weight_variance, targets, noise)
            kl_mixing = model._kl_mixing(mixing_mean, mixing_log_variance)
            return ELBOTerms(ell.sum(), model.kl_latents(), kl_mixing, model.kl_gates())
        # reparametrised draws: H = mu + s * eps, and the Concrete's logit z = (rho + log u - log(1 - u)) / tau,
        # LogitRelaxedBernoulli.rsample's formula with its clamping of u, here with an optional generator
        mixing = model.mixing_distribution()
        eps = torch.randn((self.num_samples, *mixing.batch_shape), generator=generator, **options)
        mixing_sample = mixing.mean + mixing.stddev * eps  # shape: (S, p, m)
        posterior, prior = model.gate_distribution().base_dist, model.gate_prior().base_dist
        uniform = torch.rand((self.num_samples, model.num_latents), generator=generator, **options)
        tiny = torch.finfo(uniform.dtype).tiny
        uniform = uniform.clamp(tiny, 1 - torch.finfo(uniform.dtype).eps)
        logits = (posterior.logits + uniform.log() - (-uniform).log1p()) / posterior.temperature  # shape: (S, m)
        gates = torch.sigmoid(logits)
        ell = expected_log_likelihood(latent, mixing_sample * gates.unsqueeze(-2), targets, noise)
        kl_gates = (posterior.log_prob(logits) - prior.log_prob(logits)).sum(-1).mean(0)
        return ELBOTerms(ell.sum(-1).mean(0), model.kl_latents(), model.kl_mixing(), kl_gates)

    @torch.no_grad()
    def update_gates(self, latent: Normal, targets: Tensor, step_size: float = 1.0) -> Tensor:
        r"""Coordinate ascent on the gate logits :math:`\rho_j` (``"bernoulli"`` and ``"spike_and_slab"``), one
        latent after the other, everything else held fixed; an alternative to taking them in the gradient optimiser.

        With Bernoulli gates the ELBO is *linear* in :math:`q_j = \sigma(\rho_j)` apart from the gate's own KL: in
        :func:`expected_log_likelihood_moments`, :math:`(y - \bar f)^2 + \operatorname{Var} f` contains
        :math:`q_j^2 \mu_{ij}^2 d_{tj}^2` twice with opposite signs, and under ``"spike_and_slab"`` the KLs of
        :math:`\mathbf H_{:j}` and :math:`\mathbf X^z_j` carry the factor :math:`q_j`. So
        :math:`\mathcal L(q_j) = \text{const} + q_j C_j - \mathrm{KL}[\operatorname{Bern}(q_j) \|
        \operatorname{Bern}(\theta_j)]`, maximised at :math:`\rho_j^* = \operatorname{logit}\theta_j + C_j`,
        with (Titsias & Lázaro-Gredilla 2011, the update of :math:`q(b_j)` of their spike and slab mean field)

        .. math::
            C_j = \sum_{t, i \text{ observed}} \frac{r_{tij} \mu_{ij} d_{tj} - \tfrac12 (s^H_{ij} + \mu_{ij}^2)
            (v_{tj} + d_{tj}^2)}{\sigma_i^2} - \bigl[\textstyle\sum_i \mathrm{KL}_{ij}^H +
            \mathrm{KL}[q(\mathbf X^z_j) \| p(\mathbf X^z_j)]\bigr]_{\text{spike and slab}},

        :math:`r_{tij} = y_{ti} - \sum_{k \ne j} q_k \mu_{ik} d_{tk}` the residual without latent :math:`j`. On a
        mini-batch :math:`B` the sum over :math:`t` is scaled by :math:`n / |B|` and the step damped,
        :math:`\rho_j \leftarrow (1 - \eta) \rho_j + \eta \rho_j^*`: the stochastic natural-gradient step of
        Hoffman et al. 2013 (stochastic variational inference) for the Bernoulli's natural parameter
        :math:`\rho_j`; :math:`\eta = 1` on the full data is exact coordinate ascent, which never lowers the ELBO.

        Why: a gradient optimiser moves a gate by :math:`\partial \mathcal L / \partial \rho_j \propto q_j(1 - q_j)
        C_j / n`, and Adam divides that by the root of its running second moment, which remembers the large
        gradients of the first steps: the gates of unneeded latents stall where the early transient left them
        although :math:`C_j` is large and negative. Take ``gate_logits`` out of the optimiser and call this after
        each step. The logits are clipped to :math:`\pm 30` (probabilities :math:`10^{-13}` from 0 or 1), which
        keeps the slab's natural gradients (:math:`1 / q_j`) finite.

        :param latent: ``model(t)`` on the (mini-)batch, batch shape ``(|B|, m)``.
        :param targets: ``(|B|, p)``, ``NaN`` where missing.
        :param step_size: :math:`\eta \in (0, 1]`.
        :returns: the new activation probabilities, ``(m,)``.
        :raises ValueError: under ``"concrete"`` (its gate KL is not that of a Bernoulli), or a bad ``step_size``.
        """
        model: GPALPS = self.model
        if model.variational_family == "concrete":
            raise ValueError(
                'update_gates needs Bernoulli gates: variational_family="bernoulli" or "spike_and_slab", got '
                '"concrete" (train its gate logits with the gradient optimiser).'
            )
        if not 0 < step_size <= 1:
            raise ValueError(f"step_size must lie in (0, 1], got {step_size!r}.")
        targets = self._check_targets(latent, targets)
        observed = ~torch.isnan(targets)
        precision = observed.to(targets.dtype) / noise_variances(self.likelihood).to(targets.dtype)  # shape: (n, p)
        filled = torch.where(observed, targets, torch.zeros_like(targets))
        mean, variance = latent.mean.detach(), latent.variance.detach()  # shape: (n, m)
        slab_mean, slab_variance = model.mixing_posterior()
        scale = self.num_data / latent.batch_shape[0]
        penalty = torch.zeros(model.num_latents, **_like(mean))
        if model.variational_family == "spike_and_slab":
            prior = Normal(torch.zeros_like(slab_mean), model.mixing_prior_variance.sqrt())
            kl_mixing = torch.distributions.kl_divergence(Normal(slab_mean, slab_variance.sqrt()), prior).sum(0)
            kl_latents = torch.stack([strategy.kl_divergence() for strategy in model.strategies()])
            penalty = kl_mixing + kl_latents
        prior_logit = model.prior_activation.log() - torch.log1p(-model.prior_activation)
        logits = model.gate_logits.detach().clone()
        prediction = mean @ (torch.sigmoid(logits) * slab_mean).mT  # shape: (n, p)
        for j in range(model.num_latents):
            contribution = mean[:, j : j + 1] * (torch.sigmoid(logits[j]) * slab_mean[:, j])  # shape: (n, p)
            residual = filled - prediction + contribution
            fit = residual * mean[:, j : j + 1] * slab_mean[:, j]
            spread = (
                0.5
                * (variance[:, j : j + 1] + mean[:, j : j + 1].square())
                * (slab_variance[:, j] + slab_mean[:, j].square())
            )
            gain = scale * ((fit - spread) * precision).sum() - penalty[j]
            target = (prior_logit[j] + gain).clamp(-_MAX_GATE_LOGIT, _MAX_GATE_LOGIT)
            logits[j] = ((1 - step_size) * logits[j] + step_size * target).clamp(-_MAX_GATE_LOGIT, _MAX_GATE_LOGIT)
            prediction = prediction - contribution + mean[:, j : j + 1] * (torch.sigmoid(logits[j]) * slab_mean[:, j])
        model.gate_logits.copy_(logits)
        return torch.sigmoid(logits)

    def forward(self, latent: Normal, targets: Tensor, generator: torch.Generator | None = None, **kwargs) -> Tensor:
        """The ELBO divided by ``num_data`` (a scalar); ``-elbo(model(t), Y)`` is the loss.

        :param latent: ``model(t)``, batch shape ``(n, m)``.
        :param targets: ``(n, p)``, ``NaN`` where an output is missing.
        :param generator: for reproducible draws (default: torch's global generator).
        """
        terms = self.terms(latent, targets, generator=generator)
        batch_size = latent.batch_shape[0]
        value = terms.expected_log_likelihood / batch_size
        value = value - (terms.kl_latents + terms.kl_mixing + terms.kl_gates) / self.num_data
        for _, module, prior, closure, _ in self.named_priors():
            value = value + prior.log_prob(closure(module)).sum() / self.num_data
        return value
