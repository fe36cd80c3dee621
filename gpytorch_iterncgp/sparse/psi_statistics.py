r"""Ψ statistics: expectations of a kernel under Gaussian inputs :math:`\mathbf x_i \sim \mathcal N(\boldsymbol\mu_i,
\operatorname{diag}\mathbf s_i)` (Titsias & Lawrence 2010; the :math:`q(\mathbf X)` of Hernández-Lobato-style eq. S.6).

For :math:`N` uncertain inputs and :math:`M` inducing inputs :math:`\mathbf z_m`, per data point,

.. math::
    \psi_{0,i} = \mathbb E\, k(\mathbf x_i, \mathbf x_i), \qquad
    (\boldsymbol\Psi_1)_{im} = \mathbb E\, k(\mathbf x_i, \mathbf z_m), \qquad
    (\boldsymbol\Psi_2)_{imm'} = \mathbb E\, k(\mathbf z_m, \mathbf x_i)\, k(\mathbf x_i, \mathbf z_{m'}),

shapes ``(N,)``, ``(N, M)`` and ``(N, M, M)`` (the per-point :math:`\boldsymbol\Psi_2` of S.35 are these
blocks; :math:`\tilde{\boldsymbol\Psi}_2 = \sum_i \tilde\tau_i (\boldsymbol\Psi_2)_i`).

**Closed forms.** ``ScaleKernel(RBFKernel(ard_num_dims=D))`` (or a bare ``RBFKernel``, ARD or not) with
:math:`k(\mathbf x, \mathbf x') = \sigma^2 \exp(-\tfrac12\sum_d (x_d - x'_d)^2/\ell_d^2)`:

.. math::
    \psi_{0,i} = \sigma^2, \qquad
    (\boldsymbol\Psi_1)_{im} = \sigma^2 \prod_d \Big(1 + \frac{s_{id}}{\ell_d^2}\Big)^{-1/2}
        \exp\Big(-\frac{(\mu_{id} - z_{md})^2}{2(\ell_d^2 + s_{id})}\Big),

.. math::
    (\boldsymbol\Psi_2)_{imm'} = \sigma^4 \prod_d \Big(1 + \frac{2 s_{id}}{\ell_d^2}\Big)^{-1/2}
        \exp\Big(-\frac{(z_{md} - z_{m'd})^2}{4\ell_d^2} - \frac{(\mu_{id} - \bar z_{mm'd})^2}{\ell_d^2 + 2 s_{id}}\Big),
    \quad \bar{\mathbf z}_{mm'} = \tfrac12(\mathbf z_m + \mathbf z_{m'}),

and ``LinearKernel`` (ARD or not; optionally scaled) with :math:`k(\mathbf x, \mathbf x') = \sigma^2
\sum_d v_d x_d x'_d`:

.. math::
    \psi_{0,i} = \sigma^2 \sum_d v_d (\mu_{id}^2 + s_{id}), \quad
    (\boldsymbol\Psi_1)_{im} = \sigma^2 \sum_d v_d \mu_{id} z_{md}, \quad
    (\boldsymbol\Psi_2)_{imm'} = (\boldsymbol\Psi_1)_{im} (\boldsymbol\Psi_1)_{im'}
        + \sigma^4 \sum_d s_{id} v_d^2 z_{md} z_{m'd}.

The RBF forms are evaluated in log space; :math:`\boldsymbol\Psi_2` costs :math:`O(N M^2 D)` time and
:math:`O(N M^2 + N M D)` memory (the quadratic form is expanded into matrix products).

**Monte Carlo** for any other GPyTorch kernel: :math:`\mathbf x_i^{(s)} = \boldsymbol\mu_i + \sqrt{\mathbf s_i}
\odot \boldsymbol\epsilon^{(s)}`, :math:`S` = ``num_samples`` draws from ``generator``, and sample averages of
``kernel(x, x, diag=True)``, ``kernel(x, Z)`` and its outer products (the reparametrisation keeps them
differentiable in every argument). Its error is :math:`O(S^{-1/2})`, not rounding: ``method="auto"`` says so with a
:class:`MonteCarloPsiWarning`; ``method="monte_carlo"`` asks for it explicitly (no warning).

Inputs may carry leading batch dimensions (``means`` ``(..., N, D)``, ``inducing_points`` ``(..., M, D)``) that
broadcast with each other and the kernel's ``batch_shape``; the kernel's ``active_dims`` are honoured as in
``kernel(x)``.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch
from gpytorch.kernels import Kernel, LinearKernel, RBFKernel, ScaleKernel
from torch import Tensor

from ..exceptions import MonteCarloPsiWarning

__all__ = ["MonteCarloPsiWarning", "PsiStatistics", "psi_statistics"]

_METHODS = ("auto", "closed_form", "monte_carlo")
_DEFAULT_SAMPLES = 10_000
_CHUNK = 1 << 22  # samples x points x inducing inputs per block of the Monte Carlo estimate


class PsiStatistics(NamedTuple):
    r""":math:`\psi_0` ``(..., N)``, :math:`\boldsymbol\Psi_1` ``(..., N, M)``, :math:`\boldsymbol\Psi_2` ``(..., N, M, M)``."""

    psi0: Tensor
    psi1: Tensor
    psi2: Tensor

    def cross_covariance(self) -> Tensor:
        r""":math:`\operatorname{Cov}_q \mathbf k_u(\mathbf x_i) = (\boldsymbol\Psi_2)_i - (\boldsymbol\Psi_1)_i
        (\boldsymbol\Psi_1)_i^\top` ``(..., N, M, M)``, formed first (no cancellation between two :math:`O(k)` terms
        later)."""
        return self.psi2 - self.psi1.unsqueeze(-1) * self.psi1.unsqueeze(-2)


def _check_arguments(kernel: Kernel, means: Tensor, variances: Tensor, inducing_points: Tensor) -> None:
    if not isinstance(kernel, Kernel):
        raise TypeError(f"kernel must be a gpytorch.kernels.Kernel, got {type(kernel).__name__}.")
    for name, value in (("means", means), ("variances", variances), ("inducing_points", inducing_points)):
        if not torch.is_tensor(value) or not value.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {type(value).__name__}.")
        if value.dim() < 2:
            raise ValueError(f"{name} must have shape (..., rows, D), got {tuple(value.shape)}.")
        if value.dtype != means.dtype or value.device != means.device:
            raise TypeError(
                f"{name} is {value.dtype} on {value.device} but means are {means.dtype} on {means.device}: "
                "use one dtype and device."
            )
    if variances.shape != means.shape:
        raise ValueError(
            f"variances must have the shape of means (diagonal S_i per point), got {tuple(variances.shape)=} and "
            f"{tuple(means.shape)=}."
        )
    if inducing_points.shape[-1] != means.shape[-1]:
        raise ValueError(f"inducing_points have {inducing_points.shape[-1]} features but means have {means.shape[-1]}.")
    for name, value in (("means", means), ("inducing_points", inducing_points)):
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"{name} contain NaN or infinite values.")
    invalid = ~(torch.isfinite(variances) & (variances >= 0))
    if bool(invalid.any()):
        raise ValueError(
            f"variances must be finite and >= 0 (they are the diagonals of the input covariances S_i); got "
            f"{variances[invalid][:5].tolist()} ({int(invalid.sum())} in all). Parametrise them through a positive "
            "transform (e.g. softplus) or clamp them at 0."
        )
    for parameter in kernel.parameters():
        if parameter.dtype != means.dtype or parameter.device != means.device:
            raise TypeError(
                f"The kernel's parameters are {parameter.dtype} on {parameter.device} but means are {means.dtype} on "
                f"{means.device}: call kernel.to(means) first."
            )
        break


def _select(kernel: Kernel, *tensors: Tensor) -> tuple[Tensor, ...]:
    """The columns ``kernel(x)`` would use (its ``active_dims``)."""
    if kernel.active_dims is None:
        return tensors
    index = kernel.active_dims.to(tensors[0].device)
    return tuple(tensor.index_select(-1, index) for tensor in tensors)


def _closed_form_parts(kernel: Kernel) -> tuple[Tensor | None, Kernel] | None:
    """(outputscale or None, base kernel) if a closed form exists, else None."""
    scale: Tensor | None = None
    base = kernel
    if isinstance(kernel, ScaleKernel):
        scale, base = kernel.outputscale, kernel.base_kernel
    if type(base) in (RBFKernel, LinearKernel):  # exact types: subclasses may change the formula
        return scale, base
    return None


def _rbf(scale: Tensor | None, kernel: RBFKernel, means: Tensor, variances: Tensor, inducing: Tensor) -> PsiStatistics:
    squared_lengthscale = kernel.lengthscale.square()  # (*k, 1, D or 1)
    variance = torch.ones((), dtype=means.dtype, device=means.device) if scale is None else scale
    variance = variance[..., None]  # (*k, 1)
    # psi0: sigma^2 for every point
    psi0 = variance.expand(*torch.broadcast_shapes(variance.shape[:-1], means.shape[:-2]), means.shape[-2])
    # psi1: (..., N, M)
    length1 = squared_lengthscale.unsqueeze(-2) + variances.unsqueeze(-2)  # (..., N, 1, D)
    difference = means.unsqueeze(-2) - inducing.unsqueeze(-3)  # (..., N, M, D)
    log_psi1 = -0.5 * (difference.square() / length1).sum(-1) - 0.5 * torch.log1p(variances / squared_lengthscale).sum(
        -1, keepdim=True
    )
    psi1 = variance[..., None] * log_psi1.exp()
    # psi2: (..., N, M, M). With a = 1 / (l^2 + 2 s_i) and the square of mu - (z_m + z_m') / 2 expanded, every term is
    # a product of (N, D) and (M, D) factors: O(N M^2) memory instead of O(N M^2 D). Inputs are centred first (the
    # statistics are shift invariant), so the expansion cancels no large terms.
    centre = inducing.detach().mean(-2, keepdim=True)
    means, inducing = means - centre, inducing - centre
    inducing_difference = inducing.unsqueeze(-2) - inducing.unsqueeze(-3)  # (..., M, M, D)
    inducing_term = -(inducing_difference.square() / (4 * squared_lengthscale.unsqueeze(-2))).sum(-1)
    weights = (squared_lengthscale + 2 * variances).reciprocal()  # (..., N, D)
    linear = (weights * means) @ inducing.mT  # (..., N, M): sum_d a mu z_m
    square = weights @ inducing.square().mT  # (..., N, M): sum_d a z_m^2
    cross = (inducing.unsqueeze(-3) * weights.unsqueeze(-2)) @ inducing.unsqueeze(-3).mT  # (..., N, M, M)
    quadratic = (
        (weights * means.square()).sum(-1)[..., None, None]
        - linear.unsqueeze(-1)
        - linear.unsqueeze(-2)
        + 0.25 * (square.unsqueeze(-1) + square.unsqueeze(-2) + 2 * cross)
    )
    log_psi2 = (
        inducing_term.unsqueeze(-3)
        - quadratic
        - 0.5 * torch.log1p(2 * variances / squared_lengthscale).sum(-1)[..., None, None]
    )
    psi2 = variance.square()[..., None, None] * log_psi2.exp()
    return PsiStatistics(psi0, psi1, psi2)


def _linear(
    scale: Tensor | None, kernel: LinearKernel, means: Tensor, variances: Tensor, inducing: Tensor
) -> PsiStatistics:
    weights = kernel.variance  # (*k, 1, D or 1): k(x, x') = sum_d v_d x_d x'_d
    if scale is not None:
        weights = weights * scale[..., None, None]
    psi0 = (weights * (means.square() + variances)).sum(-1)
    psi1 = (means * weights) @ inducing.mT  # (..., N, M)
    weighted = inducing * weights  # (..., M, D): rows sigma^2 v * z_m
    # sum_d s_id (v_d z_md)(v_d z_m'd): (..., N, M, M)
    spread = torch.einsum("...nd,...md,...kd->...nmk", variances, weighted, weighted)
    psi2 = psi1.unsqueeze(-1) * psi1.unsqueeze(-2) + spread
    return PsiStatistics(psi0, psi1, psi2)


def _safe_sqrt(values: Tensor) -> Tensor:
    """sqrt with gradient 0 (not inf, hence NaN) at 0."""
    positive = values > 0
    return torch.where(positive, torch.where(positive, values, 1).sqrt(), 0)


def _monte_carlo(
    kernel: Kernel, means: Tensor, variances: Tensor, inducing: Tensor, num_samples: int, generator
) -> PsiStatistics:
    batch = torch.broadcast_shapes(means.shape[:-2], inducing.shape[:-2])
    num_points, num_inducing = means.shape[-2], inducing.shape[-2]
    means = means.expand(*batch, *means.shape[-2:])
    scales = _safe_sqrt(variances).expand(*batch, *variances.shape[-2:])
    inducing = inducing.expand(*batch, *inducing.shape[-2:])
    chunk = max(1, _CHUNK // max(1, math.prod(batch) * num_points * num_inducing))
    psi0 = means.new_zeros(())
    psi1 = means.new_zeros(())
    psi2 = means.new_zeros(())
    for start in range(0, num_samples, chunk):
        size = min(chunk, num_samples - start)
        noise = torch.randn(
            (size, *means.shape), generator=generator, dtype=means.dtype, device=means.device
        )  # (S, ..., N, D)
        samples = means + scales * noise
        cross = kernel(samples, inducing.expand(size, *inducing.shape)).to_dense()  # (S, ..., N, M)
        psi0 = psi0 + kernel(samples, samples, diag=True).sum(0)
        psi1 = psi1 + cross.sum(0)
        psi2 = psi2 + torch.einsum("s...nm,s...nk->...nmk", cross, cross)
    return PsiStatistics(psi0 / num_samples, psi1 / num_samples, psi2 / num_samples)


def psi_statistics(
    kernel: Kernel,
    means: Tensor,
    variances: Tensor,
    inducing_points: Tensor,
    method: str = "auto",
    num_samples: int | None = None,
    generator: torch.Generator | None = None,
) -> PsiStatistics:
    r"""The Ψ statistics of ``kernel`` for inputs :math:`\mathbf x_i \sim \mathcal N(\boldsymbol\mu_i,
    \operatorname{diag}\mathbf s_i)` (module docstring), differentiable in the kernel's hyperparameters, the
    inducing inputs, the means and the variances.

    Example:
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2)).double()
        >>> psi0, psi1, psi2 = psi_statistics(kernel, mu, s, z)  # (N,), (N, M), (N, M, M)

    :param kernel: any GPyTorch kernel; closed forms for ``RBFKernel`` and ``LinearKernel``, bare or in a
        ``ScaleKernel``, Monte Carlo otherwise.
    :param means: :math:`\boldsymbol\mu_i`, ``(..., N, D)``.
    :param variances: :math:`\mathbf s_i \ge 0`, the diagonals of the input covariances, ``(..., N, D)``; 0 is a known
        input (then the statistics are the kernel's own values).
    :param inducing_points: :math:`\mathbf Z`, ``(..., M, D)``.
    :param method: ``"auto"`` (closed form if there is one, else Monte Carlo with a :class:`MonteCarloPsiWarning`),
        ``"closed_form"`` (an error if there is none) or ``"monte_carlo"`` (always, silently).
    :param num_samples: Monte Carlo draws (default 10 000); ignored by the closed forms.
    :param generator: the ``torch.Generator`` of the Monte Carlo draws (default: torch's global one).

    :return: :class:`PsiStatistics` ``(psi0, psi1, psi2)``: ``(..., N)``, ``(..., N, M)``, ``(..., N, M, M)``, in the
        dtype and on the device of ``means``.

    :raises ValueError: negative or non-finite variances, NaN means or inducing inputs, disagreeing shapes, an unknown
        ``method``, or ``method="closed_form"`` for a kernel without one.
    :raises TypeError: mixed dtypes or devices (kernel parameters included).
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}.")
    _check_arguments(kernel, means, variances, inducing_points)
    parts = _closed_form_parts(kernel)
    if parts is not None and method != "monte_carlo":
        scale, base = parts
        means, variances, inducing_points = _select(kernel, means, variances, inducing_points)
        if isinstance(base, RBFKernel):
            return _rbf(scale, base, means, variances, inducing_points)
        assert isinstance(base, LinearKernel)
        return _linear(scale, base, means, variances, inducing_points)
    if method == "closed_form":
        raise ValueError(
            f"psi_statistics has closed forms for RBFKernel and LinearKernel (bare or in a ScaleKernel), not for "
            f"{type(kernel).__name__}; use method='auto' or 'monte_carlo'."
        )
    if num_samples is None:
        num_samples = _DEFAULT_SAMPLES
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}.")
    if method == "auto":
        warnings.warn(
            f"psi_statistics: no closed form for {type(kernel).__name__}; using a Monte Carlo estimate with "
            f"{num_samples} samples (relative error ~ 1/sqrt(num_samples)). Pass method='monte_carlo' to silence.",
            MonteCarloPsiWarning,
            stacklevel=2,
        )
    return _monte_carlo(kernel, means, variances, inducing_points, num_samples, generator)
