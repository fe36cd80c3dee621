r"""A Gibbs sampler for the exact GP-ALPS posterior (GP-ALPS App. D), the ground truth for small problems.

The model (GP-ALPS eq. 2) at the :math:`n` training inputs, with the latent values :math:`\mathbf X` ``(n, m)``
under the exact GP prior :math:`\mathbf x_j \sim \mathcal N(\mathbf 0, \mathbf K_j)`:

.. math::
    y_{ti} = \sum_j H_{ij} b_j x_{tj} + \epsilon_{ti}, \quad \epsilon_{ti} \sim \mathcal N(0, \sigma_i^2), \quad
    b_j \sim \operatorname{Bern}(\theta_j), \quad H_{ij} \sim \mathcal N(0, s_{ij}),

and only the observed entries of :math:`\mathbf Y` (a mask) enter the likelihood. Kernel hyperparameters and noise
variances are fixed. One sweep updates, in turn,

1. for each latent :math:`j`, the block :math:`(b_j, \mathbf x_j)`: first :math:`b_j` from
   :math:`p(b_j \mid \mathbf Y, \mathbf H, \mathbf X_{-j}, \mathbf b_{-j})` **with** :math:`\mathbf x_j`
   **marginalised** (:func:`gate_log_odds`), then :math:`\mathbf x_j` from its exact conditional given :math:`b_j`
   (:func:`latent_conditional`; the prior when :math:`b_j = 0`). GP-ALPS App. D.3 conditions :math:`b_j` on
   :math:`\mathbf x_j`; but while a gate is off, :math:`\mathbf x_j` is a draw from the prior that almost never
   fits the data, so that chain hardly ever switches a gate back on. Marginalising :math:`\mathbf x_j` makes the
   block a collapsed Gibbs step with the same stationary distribution that mixes far better.
2. each row :math:`\mathbf h_i` of :math:`\mathbf H` from its Bayesian linear regression on the observed entries of
   output :math:`i` (GP-ALPS App. D.2, :func:`mixing_conditional`).

Work in float64: :math:`O(n^3)` per latent and sweep (a Cholesky of
:math:`\mathbf B = \mathbf I + \mathbf W^{1/2} \mathbf K_j \mathbf W^{1/2}`, Rasmussen & Williams eq. 3.26, which
never inverts :math:`\mathbf K_j`, so rank-deficient kernels such as ``CosineKernel`` work).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import gpytorch
import torch
from torch import Tensor

from ..core.validation import check_count, check_nonnegative
from .alps import GPALPS, noise_variances

__all__ = [
    "GibbsSamples",
    "gate_log_odds",
    "gibbs_sample",
    "gibbs_sample_model",
    "latent_conditional",
    "mixing_conditional",
]

_F64 = torch.float64


class GibbsSamples(NamedTuple):
    """Draws kept after burn-in, ``S`` of them, and the gates' posterior probabilities.

    * ``gates``: ``bool (S, m)``; ``mixing``: :math:`\\mathbf H`, ``(S, p, m)``; ``latents``: :math:`\\mathbf X`,
      ``(S, n, m)``.
    * ``activation_frequencies``: the fraction of kept draws with each gate on, ``(m,)``.
    * ``activation_probabilities``: the Rao–Blackwellised estimate, the average of the conditional probabilities
      :math:`p(b_j = 1 \\mid \\text{rest})` of the kept sweeps, ``(m,)`` (lower variance, same limit).
    """

    gates: Tensor
    mixing: Tensor
    latents: Tensor
    activation_frequencies: Tensor
    activation_probabilities: Tensor


class _Conditioned(NamedTuple):
    """Pieces of the latent's conditional shared by the gate's log odds, the moments and the draw."""

    sqrt_w: Tensor  # shape: (n,)
    g: Tensor  # shape: (n,)
    chol_b: Tensor  # shape: (n, n)
    mean: Tensor  # shape: (n,)


def _condition(kernel: Tensor, residual: Tensor, observed: Tensor, weights: Tensor, noise: Tensor) -> _Conditioned:
    r"""With :math:`w_t = \sum_i o_{ti} h_i^2 / \sigma_i^2` and :math:`g_t = \sum_i o_{ti} h_i r_{ti} /
    \sigma_i^2`, the conditional of :math:`\mathbf x` is :math:`\mathcal N(\boldsymbol\Sigma \mathbf g,
    \boldsymbol\Sigma)`, :math:`\boldsymbol\Sigma = (\mathbf K^{-1} + \mathbf W)^{-1} = \mathbf K - \mathbf K
    \mathbf W^{1/2} \mathbf B^{-1} \mathbf W^{1/2} \mathbf K`."""
    mask = observed.to(kernel.dtype)
    w = (mask * weights.square() / noise).sum(-1)
    g = torch.where(observed, weights * residual / noise, 0.0).sum(-1)  # unobserved residuals may be NaN
    sqrt_w = w.sqrt()
    b_matrix = torch.eye(len(w), dtype=kernel.dtype, device=kernel.device) + sqrt_w[:, None] * kernel * sqrt_w
    chol_b = torch.linalg.cholesky(b_matrix)
    kg = kernel @ g
    solved = torch.cholesky_solve((sqrt_w * kg)[:, None], chol_b)[:, 0]
    mean = kg - kernel @ (sqrt_w * solved)
    return _Conditioned(sqrt_w, g, chol_b, mean)


def latent_conditional(
    kernel: Tensor, residual: Tensor, observed: Tensor, weights: Tensor, noise: Tensor
) -> tuple[Tensor, Tensor]:
    r"""Mean and covariance of :math:`p(\mathbf x_j \mid \mathbf Y, \mathbf H, \mathbf X_{-j}, \mathbf b,
    b_j = 1)` (GP-ALPS App. D.1 for one latent): Bayesian linear regression of the residual
    :math:`r_{ti} = y_{ti} - \sum_{k \ne j} H_{ik} b_k x_{tk}` on :math:`\mathbf x_j` with weights
    :math:`h_i = H_{ij}`,

    .. math::
        \boldsymbol\Sigma = (\mathbf K_j^{-1} + \mathbf W)^{-1}, \quad \boldsymbol\mu = \boldsymbol\Sigma \mathbf g,
        \quad W_{tt} = \sum_{i \text{ obs.}} \frac{h_i^2}{\sigma_i^2}, \quad
        g_t = \sum_{i \text{ obs.}} \frac{h_i r_{ti}}{\sigma_i^2},

    computed as :math:`\mathbf K_j - \mathbf K_j \mathbf W^{1/2} \mathbf B^{-1} \mathbf W^{1/2} \mathbf K_j`.

    :param kernel: :math:`\mathbf K_j`, ``(n, n)``.
    :param residual: ``(n, p)`` (any value where not observed).
    :param observed: ``bool (n, p)``.
    :param weights: :math:`\mathbf h = \mathbf H_{:, j}`, ``(p,)``.
    :param noise: :math:`\boldsymbol\sigma^2`, ``(p,)``.
    :returns: ``(n,)`` and ``(n, n)``.
    """
    pieces = _condition(kernel, residual, observed, weights, noise)
    root = torch.linalg.solve_triangular(pieces.chol_b, pieces.sqrt_w[:, None] * kernel, upper=False)
    return pieces.mean, kernel - root.mT @ root


def gate_log_odds(
    kernel: Tensor, residual: Tensor, observed: Tensor, weights: Tensor, noise: Tensor, prior_activation: Tensor
) -> Tensor:
    r"""The log odds of :math:`p(b_j = 1 \mid \mathbf Y, \mathbf H, \mathbf X_{-j}, \mathbf b_{-j})` with
    :math:`\mathbf x_j \sim \mathcal N(\mathbf 0, \mathbf K_j)` integrated out:

    .. math::
        \log\frac{\theta_j}{1 - \theta_j} + \log\frac{\mathcal N(\mathbf r_o \mid \mathbf 0, \mathbf A \mathbf K_j
        \mathbf A^\top + \mathbf D)}{\mathcal N(\mathbf r_o \mid \mathbf 0, \mathbf D)}
        = \log\frac{\theta_j}{1 - \theta_j} + \tfrac12 \mathbf g^\top \boldsymbol\mu - \tfrac12 \log|\mathbf B|,

    with :math:`\mathbf r_o` the observed residuals, :math:`\mathbf A` the map :math:`\mathbf x_j \mapsto (h_i
    x_{tj})_{(t, i) \text{ obs.}}` and :math:`\mathbf D` the noise (matrix determinant lemma and Woodbury; arguments
    as in :func:`latent_conditional`, ``prior_activation`` :math:`\theta_j` a scalar tensor).
    """
    return _log_odds(_condition(kernel, residual, observed, weights, noise), prior_activation)


def _log_odds(pieces: _Conditioned, prior_activation: Tensor) -> Tensor:
    log_det = 2 * pieces.chol_b.diagonal().log().sum()
    prior = torch.log(prior_activation) - torch.log1p(-prior_activation)
    return prior + 0.5 * (pieces.g @ pieces.mean) - 0.5 * log_det


def _draw_latent(
    kernel: Tensor, kernel_root: Tensor, pieces: _Conditioned, generator: torch.Generator | None
) -> Tensor:
    r"""A draw from :math:`\mathcal N(\boldsymbol\mu, \boldsymbol\Sigma)` by Matheron's rule: with
    :math:`\mathbf f \sim \mathcal N(\mathbf 0, \mathbf K)` and :math:`\boldsymbol\xi \sim \mathcal N(\mathbf 0,
    \mathbf I)`, :math:`\mathbf x = \mathbf f + \mathbf K \mathbf W^{1/2} \mathbf B^{-1} (\mathbf W^{-1/2}
    \mathbf g - \mathbf W^{1/2} \mathbf f - \boldsymbol\xi)` (pseudo-observations :math:`\mathbf W^{-1} \mathbf g`
    with noise :math:`\mathbf W^{-1}`; rows with :math:`w_t = 0` carry none)."""
    size = (kernel.shape[0],)
    prior_draw = kernel_root @ torch.randn(size, generator=generator, dtype=kernel.dtype, device=kernel.device)
    xi = torch.randn(size, generator=generator, dtype=kernel.dtype, device=kernel.device)
    has_data = pieces.sqrt_w > 0
    scaled_g = torch.where(has_data, pieces.g / torch.where(has_data, pieces.sqrt_w, 1.0), 0.0)
    rhs = scaled_g - pieces.sqrt_w * prior_draw - xi * has_data
    solved = torch.cholesky_solve(rhs[:, None], pieces.chol_b)[:, 0]
    return prior_draw + kernel @ (pieces.sqrt_w * solved)


def mixing_conditional(
    latents: Tensor, gates: Tensor, targets: Tensor, observed: Tensor, noise: Tensor, prior_variance: Tensor
) -> tuple[Tensor, Tensor]:
    r"""Mean and covariance of each row :math:`\mathbf h_i` of :math:`p(\mathbf H \mid \mathbf X, \mathbf Y,
    \mathbf b)` (GP-ALPS App. D.2): Bayesian linear regression of the observed :math:`y_{ti}` on the features
    :math:`\boldsymbol\phi_t = \mathbf x_t \circ \mathbf b`,

    .. math::
        \mathbf S_i = \Bigl(\operatorname{diag}(\mathbf s_i)^{-1} + \frac{1}{\sigma_i^2} \sum_{t \text{ obs.}}
        \boldsymbol\phi_t \boldsymbol\phi_t^\top\Bigr)^{-1}, \quad
        \mathbf m_i = \mathbf S_i \frac{1}{\sigma_i^2} \sum_{t \text{ obs.}} \boldsymbol\phi_t y_{ti}.

    :param latents: :math:`\mathbf X`, ``(n, m)``; ``gates``: ``(m,)`` (0/1); ``targets``, ``observed``:
        ``(n, p)``; ``noise``: ``(p,)``; ``prior_variance``: :math:`s_{ij}`, ``(p, m)``.
    :returns: ``(p, m)`` and ``(p, m, m)``.
    """
    features = latents * gates  # shape: (n, m)
    mask = observed.to(latents.dtype).mT  # shape: (p, n)
    filled = torch.where(observed, targets, 0.0).mT  # shape: (p, n)
    precision = torch.einsum("pn,nj,nk->pjk", mask / noise[:, None], features, features)
    precision = precision + torch.diag_embed(1 / prior_variance)
    covariance = torch.cholesky_inverse(torch.linalg.cholesky(precision))
    mean = (covariance @ ((filled * mask / noise[:, None]) @ features)[..., None])[..., 0]
    return mean, covariance


def _check(name: str, tensor: Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}.")


class _GibbsProblem(NamedTuple):
    """The sampler's fixed inputs, validated and in float64."""

    kernels: Tensor  # K_j with the jitter, (m, n, n)
    roots: Tensor  # their Cholesky factors, for prior draws, (m, n, n)
    targets: Tensor  # Y, (n, p), NaN where missing
    observed: Tensor  # bool (n, p)
    noise: Tensor  # sigma^2, (p,)
    prior_activation: Tensor  # theta_j, (m,)
    prior_variance: Tensor  # s_ij, (p, m)


def _gibbs_problem(
    kernels: Tensor,
    targets: Tensor,
    noise: Tensor,
    prior_activation: float | Tensor,
    mixing_prior_variance: float | Tensor,
    jitter: float,
) -> _GibbsProblem:
    """:func:`gibbs_sample`'s arguments checked, in float64 on the device of ``targets``, the priors broadcast to
    ``(m,)`` and ``(p, m)``, and ``jitter`` times the mean of each diagonal added to the kernels.

    :raises ValueError: for shapes that do not fit, priors or noise out of range, or infinite targets.
    """
    if kernels.dim() != 3 or kernels.shape[-1] != kernels.shape[-2]:
        raise ValueError(f"kernels must have shape (m, n, n), got {tuple(kernels.shape)}.")
    num_latents, num_points = kernels.shape[:2]
    if targets.dim() != 2 or targets.shape[0] != num_points:
        raise ValueError(
            f"targets must have shape (n, p) with n = {num_points} (the kernels' size), got {tuple(targets.shape)}."
        )
    num_outputs = targets.shape[1]
    options: dict[str, Any] = dict(dtype=_F64, device=targets.device)
    kernels, targets = kernels.detach().to(**options), targets.detach().to(**options)
    noise = torch.as_tensor(noise).detach().to(**options)
    _check("noise", noise, (num_outputs,))
    theta = torch.broadcast_to(torch.as_tensor(prior_activation, **options), (num_latents,))
    prior_variance = torch.broadcast_to(torch.as_tensor(mixing_prior_variance, **options), (num_outputs, num_latents))
    if not bool(((theta > 0) & (theta < 1)).all()):
        raise ValueError(f"prior_activation must lie strictly between 0 and 1, got {prior_activation!r}.")
    if not bool((prior_variance > 0).all()) or not bool((noise > 0).all()):
        raise ValueError("mixing_prior_variance and noise must be positive.")
    observed = ~torch.isnan(targets)
    if bool(torch.isinf(targets).any()):
        raise ValueError("targets contain inf: mark missing outputs with NaN.")
    scale = kernels.diagonal(dim1=-2, dim2=-1).mean(-1)
    kernels = kernels + (jitter * scale)[:, None, None] * torch.eye(num_points, **options)
    roots = torch.linalg.cholesky(kernels)
    return _GibbsProblem(kernels, roots, targets, observed, noise, theta, prior_variance)


def _update_gates_and_latents(
    problem: _GibbsProblem, gates: Tensor, mixing: Tensor, latents: Tensor, generator: torch.Generator | None
) -> Tensor:
    r"""Step 1 of the sweep (module docstring), in place: for each latent :math:`j`, :math:`b_j` from its conditional
    with :math:`\mathbf x_j` marginalised (:func:`gate_log_odds`), then :math:`\mathbf x_j` from its conditional given
    :math:`b_j` (:func:`latent_conditional`, drawn by Matheron's rule), or from the prior when :math:`b_j = 0`.

    :param gates: :math:`\mathbf b`, ``(m,)`` (0/1, float64), updated in place.
    :param mixing: :math:`\mathbf H`, ``(p, m)``.
    :param latents: :math:`\mathbf X`, ``(n, m)``, updated in place.
    :return: :math:`p(b_j = 1 \mid \text{rest})` of this sweep, ``(m,)``.
    """
    options: dict[str, Any] = dict(dtype=_F64, device=latents.device)
    num_points, num_latents = latents.shape
    probabilities = torch.empty(num_latents, **options)
    for j in range(num_latents):
        others = gates.clone()
        others[j] = 0
        residual = problem.targets - latents @ (mixing * others).mT
        pieces = _condition(problem.kernels[j], residual, problem.observed, mixing[:, j], problem.noise)
        probabilities[j] = torch.sigmoid(_log_odds(pieces, problem.prior_activation[j]))
        gates[j] = (torch.rand((), generator=generator, **options) < probabilities[j]).to(_F64)
        if gates[j] > 0:
            latents[:, j] = _draw_latent(problem.kernels[j], problem.roots[j], pieces, generator)
        else:
            latents[:, j] = problem.roots[j] @ torch.randn(num_points, generator=generator, **options)
    return probabilities


def _draw_mixing(problem: _GibbsProblem, gates: Tensor, latents: Tensor, generator: torch.Generator | None) -> Tensor:
    r"""Step 2 of the sweep: a draw of :math:`\mathbf H` ``(p, m)`` from :func:`mixing_conditional` (GP-ALPS App. D.2),
    one row :math:`\mathbf h_i` per output."""
    mean, covariance = mixing_conditional(
        latents, gates, problem.targets, problem.observed, problem.noise, problem.prior_variance
    )
    num_outputs, num_latents = mean.shape
    noise_draw = torch.randn(num_outputs, num_latents, 1, generator=generator, dtype=_F64, device=latents.device)
    return mean + (torch.linalg.cholesky(covariance) @ noise_draw)[..., 0]


def _gibbs_samples(kept: list[tuple[Tensor, Tensor, Tensor, Tensor]], dtype: torch.dtype) -> GibbsSamples:
    """The kept sweeps' ``(gates, mixing, latents, gate probabilities)`` stacked into :class:`GibbsSamples`."""
    kept_gates, kept_mixing, kept_latents, kept_probabilities = zip(*kept, strict=True)
    gate_draws = torch.stack(kept_gates)
    return GibbsSamples(
        gates=gate_draws.bool(),
        mixing=torch.stack(kept_mixing).to(dtype),
        latents=torch.stack(kept_latents).to(dtype),
        activation_frequencies=gate_draws.mean(0).to(dtype),
        activation_probabilities=torch.stack(kept_probabilities).mean(0).to(dtype),
    )


def gibbs_sample(
    kernels: Tensor,
    targets: Tensor,
    noise: Tensor,
    prior_activation: float | Tensor = 0.5,
    mixing_prior_variance: float | Tensor = 1.0,
    num_samples: int = 1000,
    burn_in: int = 200,
    generator: torch.Generator | None = None,
    jitter: float = 1e-8,
) -> GibbsSamples:
    r"""Gibbs sampling from :math:`p(\mathbf X, \mathbf H, \mathbf b \mid \mathbf Y)` (GP-ALPS App. D; the sweep in
    the module docstring). Starts with all gates on, :math:`\mathbf H` from its prior, :math:`\mathbf X = 0`.

    :param kernels: :math:`\mathbf K_j` at the training inputs, ``(m, n, n)``; ``jitter`` times the mean of each
        diagonal is added (it is part of the prior the sampler targets) so that the prior draws' Cholesky exists.
    :param targets: :math:`\mathbf Y`, ``(n, p)``, ``NaN`` where missing.
    :param noise: :math:`\boldsymbol\sigma^2`, ``(p,)``.
    :param prior_activation: :math:`\theta_j`, scalar or ``(m,)``, in (0, 1).
    :param mixing_prior_variance: :math:`s_{ij}`, scalar, ``(m,)`` or ``(p, m)``.
    :param num_samples: sweeps kept; ``burn_in``: sweeps discarded first.
    :param generator: a :class:`torch.Generator` for reproducible chains (default: torch's global one).
    :returns: :class:`GibbsSamples`, in the dtype of ``targets``.
    """
    check_count(num_samples, "num_samples", minimum=1)
    check_count(burn_in, "burn_in")
    check_nonnegative(jitter, "jitter")
    problem = _gibbs_problem(kernels, targets, noise, prior_activation, mixing_prior_variance, jitter)
    options: dict[str, Any] = dict(dtype=_F64, device=targets.device)
    num_outputs, num_latents = problem.prior_variance.shape
    gates = torch.ones(num_latents, **options)
    mixing = problem.prior_variance.sqrt() * torch.randn(num_outputs, num_latents, generator=generator, **options)
    latents = torch.zeros(problem.targets.shape[0], num_latents, **options)
    kept = []  # (gates, mixing, latents, gate probabilities) of the sweeps after burn-in
    for sweep in range(burn_in + num_samples):
        probabilities = _update_gates_and_latents(problem, gates, mixing, latents, generator)
        mixing = _draw_mixing(problem, gates, latents, generator)
        if sweep >= burn_in:
            kept.append((gates.clone(), mixing.clone(), latents.clone(), probabilities))
    return _gibbs_samples(kept, targets.dtype)


def gibbs_sample_model(
    model: GPALPS,
    likelihood: gpytorch.likelihoods.MultitaskGaussianLikelihood,
    inputs: Tensor,
    targets: Tensor,
    **options,
) -> GibbsSamples:
    r""":func:`gibbs_sample` with the kernels, priors :math:`\theta_j, s_{ij}` and noise variances of a
    :class:`~gpytorch_iterncgp.alps.GPALPS` model and its likelihood (their current values, held fixed).

    :param inputs: ``(n, D)``; ``targets``: ``(n, p)``, ``NaN`` where missing; ``options``: passed on.
    """
    if targets.dim() != 2 or targets.shape[1] != model.num_outputs:
        raise ValueError(
            f"targets must have shape (n, p) with p = {model.num_outputs} (the model's outputs), "
            f"got {tuple(targets.shape)}."
        )
    with torch.no_grad():
        inputs = model._check_inputs(inputs)
        kernels = torch.stack([kernel(inputs).to_dense() for kernel in model.kernels()])
        noise = noise_variances(likelihood)
    return gibbs_sample(
        kernels,
        targets,
        noise,
        prior_activation=model.prior_activation,
        mixing_prior_variance=model.mixing_prior_variance,
        **options,
    )
