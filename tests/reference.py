r"""A dense exact Laplace approximation, independent of ``gpytorch_iterncgp`` (for tests only).

Rasmussen & Williams, *Gaussian Processes for Machine Learning*, Algorithms 3.1–3.4, written once for
all likelihoods in the data-major layout of the package (entry ``n * C + c`` belongs to data point ``n``
and latent ``c``; ``C = 1`` for binary and count data):

* mode finding (Alg. 3.1 / 3.3): with the symmetric square root :math:`\mathbf W^{1/2}` (a diagonal for
  ``C = 1``, an ``eigh`` of every ``C × C`` block for softmax, where :math:`\mathbf W` is singular),
  :math:`\mathbf B = \mathbf I + \mathbf W^{1/2} \mathbf K \mathbf W^{1/2} = \mathbf L \mathbf L^\top`,
  :math:`\mathbf b = \mathbf W (\mathbf f - \mathbf m) + \mathbf g`,
  :math:`\mathbf a = \mathbf b - \mathbf W^{1/2} \mathbf L^{-\top} \mathbf L^{-1} \mathbf W^{1/2} \mathbf K \mathbf b`
  (:math:`= (\mathbf I + \mathbf W \mathbf K)^{-1} \mathbf b` by Woodbury), :math:`\mathbf f = \mathbf m + \mathbf K \mathbf a`;
  optionally damped by step halving on :math:`\Psi(\mathbf f) = \ell(\mathbf f) - \tfrac12 \mathbf a^\top \mathbf K \mathbf a`;
* predictions (Alg. 3.2 / 3.4): mean :math:`\mathbf m_* + \mathbf K_{*X} \nabla \log p(\mathbf y \mid \hat{\mathbf f})`,
  covariance :math:`\mathbf K_{**} - \mathbf V^\top \mathbf V`, :math:`\mathbf V = \mathbf L^{-1} \mathbf W^{1/2} \mathbf K_{X*}`.

Closed forms of :math:`\ell`, :math:`\mathbf g` and :math:`\mathbf W` per likelihood (R&W sec. 3.4); the tests
check them against autograd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

#: (and ``"negative_binomial:r"``, the dispersion ``r`` in the name)
LIKELIHOODS = ("probit", "logit", "poisson_exp", "poisson_softplus", "softmax")


def _observed(targets: Tensor, latent: Tensor) -> tuple[Tensor, Tensor]:
    """Targets flattened to the data-major latents (``(N, C)`` counts give ``(N C,)``): the mask of observed
    entries and the targets with 0 where missing (NaN)."""
    targets = targets.reshape(latent.shape)
    observed = ~torch.isnan(targets)
    return observed, torch.where(observed, targets, 0)


def log_likelihood(latent: Tensor, targets: Tensor, likelihood: str, num_classes: int = 1) -> Tensor:
    r""":math:`\ell(\mathbf f) = \sum_n \log p(y_n \mid \mathbf f_n)` for data-major latents ``(N C,)``."""
    if likelihood == "softmax":
        logits = latent.reshape(-1, num_classes)
        return torch.log_softmax(logits, dim=-1).gather(-1, targets.long()[:, None]).sum()
    if likelihood == "probit":
        return torch.special.log_ndtr((2 * targets - 1) * latent).sum()
    if likelihood == "logit":
        return (targets * latent - torch.nn.functional.softplus(latent)).sum()
    if likelihood == "poisson_exp":  # NaN targets: missing outputs, no factor
        observed, counts = _observed(targets, latent)
        return torch.where(observed, counts * latent - latent.exp() - torch.lgamma(counts + 1), 0).sum()
    if likelihood == "poisson_softplus":
        rate = torch.nn.functional.softplus(latent)
        return (targets * rate.log() - rate - torch.lgamma(targets + 1)).sum()
    if likelihood.startswith("negative_binomial:"):  # NB(mean e^f, dispersion r), the pmf as written (Hilbe 2011)
        r, mean = _dispersion(likelihood), latent.exp()
        log_coefficient = torch.lgamma(targets + r) - math.lgamma(r) - torch.lgamma(targets + 1)
        return (log_coefficient + r * math.log(r) - (targets + r) * torch.log(r + mean) + targets * latent).sum()
    raise ValueError(likelihood)


def _dispersion(likelihood: str) -> float:
    """``r`` of ``"negative_binomial:r"``."""
    return float(likelihood.split(":", 1)[1])


def gradient_and_curvature(
    latent: Tensor, targets: Tensor, likelihood: str, num_classes: int = 1
) -> tuple[Tensor, Tensor]:
    r""":math:`\mathbf g = \nabla \ell` ``(N C,)`` and the dense :math:`\mathbf W = -\nabla^2 \ell` ``(N C, N C)``."""
    if likelihood == "softmax":
        logits = latent.reshape(-1, num_classes)
        probabilities = torch.softmax(logits, dim=-1)
        one_hot = torch.nn.functional.one_hot(targets.long(), num_classes).to(latent.dtype)
        gradient = (one_hot - probabilities).reshape(-1)
        blocks = torch.diag_embed(probabilities) - probabilities[:, :, None] * probabilities[:, None, :]
        return gradient, torch.block_diag(*blocks)
    if likelihood == "probit":
        sign = 2 * targets - 1
        log_pdf = -0.5 * latent**2 - 0.5 * math.log(2 * math.pi)
        ratio = torch.exp(log_pdf - torch.special.log_ndtr(sign * latent))  # N(f) / Phi(s f)
        gradient = sign * ratio
        curvature = ratio**2 + sign * latent * ratio  # R&W eq. (3.16)
    elif likelihood == "logit":
        probability = torch.sigmoid(latent)
        gradient = targets - probability
        curvature = probability * (1 - probability)
    elif likelihood == "poisson_exp":
        observed, counts = _observed(targets, latent)
        gradient = torch.where(observed, counts - latent.exp(), 0)
        curvature = torch.where(observed, latent.exp(), 0)
    elif likelihood.startswith("negative_binomial:"):
        r, mean = _dispersion(likelihood), latent.exp()
        gradient = targets - (targets + r) * mean / (r + mean)
        curvature = (targets + r) * r * mean / (r + mean) ** 2
    elif likelihood == "poisson_softplus":
        rate = torch.nn.functional.softplus(latent)
        slope, bend = torch.sigmoid(latent), torch.sigmoid(latent) * (1 - torch.sigmoid(latent))
        gradient = (targets / rate - 1) * slope
        curvature = targets * slope**2 / rate**2 - (targets / rate - 1) * bend
    else:
        raise ValueError(likelihood)
    return gradient, torch.diag(curvature)


def symmetric_sqrt(curvature: Tensor, num_classes: int = 1) -> Tensor:
    r"""The symmetric PSD square root of a block-diagonal :math:`\mathbf W` (blocks ``C × C`` on the diagonal)."""
    if num_classes == 1:
        return torch.diag(curvature.diagonal().clamp_min(0).sqrt())
    num = curvature.shape[0] // num_classes
    index = torch.arange(num)[:, None] * num_classes + torch.arange(num_classes)
    blocks = curvature[index[:, :, None], index[:, None, :]]  # (N, C, C)
    eigenvalues, eigenvectors = torch.linalg.eigh(blocks)
    roots = eigenvectors @ torch.diag_embed(eigenvalues.clamp_min(0).sqrt()) @ eigenvectors.mT
    roots = (roots + roots.mT) / 2
    return torch.block_diag(*roots)


@dataclass
class LaplaceReference:
    """The exact Laplace approximation at the mode ``f`` (data-major, ``(N C,)``)."""

    mode: Tensor  # f
    weights: Tensor  # a, f = m + K a
    curvature: Tensor  # W at the mode, (N C, N C)
    sqrt_curvature: Tensor  # W^{1/2}
    cholesky: Tensor  # L, B = I + W^{1/2} K W^{1/2} = L L^T
    gradient: Tensor  # g at the mode (= a at convergence)
    log_posteriors: list[float] = field(default_factory=list)  # Psi after every step (index 0: the prior mean)
    step_sizes: list[float] = field(default_factory=list)
    converged: bool = False

    def predict(self, kernel_star_train: Tensor, kernel_star_star: Tensor, mean_star: Tensor) -> tuple[Tensor, Tensor]:
        r"""Latent predictive mean ``(M C,)`` and covariance ``(M C, M C)`` at test points (R&W Alg. 3.2 / 3.4).

        :param kernel_star_train: :math:`\mathbf K_{*X}`, ``(M C, N C)`` data-major.
        :param kernel_star_star: :math:`\mathbf K_{**}`, ``(M C, M C)``.
        :param mean_star: prior mean at the test points, ``(M C,)``.
        """
        mean = mean_star + kernel_star_train @ self.gradient
        factor = torch.linalg.solve_triangular(self.cholesky, self.sqrt_curvature @ kernel_star_train.mT, upper=False)
        return mean, kernel_star_star - factor.mT @ factor


def laplace_mode(
    kernel: Tensor,
    prior_mean: Tensor,
    targets: Tensor,
    likelihood: str,
    num_classes: int = 1,
    damping: bool = True,
    max_steps: int = 200,
    tol: float = 1e-13,
) -> LaplaceReference:
    r"""Newton's method for the mode of :math:`\Psi(\mathbf f) = \ell(\mathbf f) - \tfrac12 (\mathbf f - \mathbf m)^\top \mathbf K^{-1} (\mathbf f - \mathbf m)`.

    :param kernel: dense prior covariance :math:`\mathbf K`, ``(N C, N C)`` data-major.
    :param prior_mean: :math:`\mathbf m`, ``(N C,)``.
    :param targets: ``(N,)``, or ``(N, C)`` counts for ``poisson_exp`` with ``C`` outputs (NaN: missing).
    :param likelihood: one of :data:`LIKELIHOODS`.
    :param damping: halve the step until :math:`\Psi` does not decrease (otherwise: plain Newton).
    :param tol: stop when the change of :math:`\Psi` is below ``tol * max(1, |Psi|)``.
    """
    kernel = kernel.detach()
    size = kernel.shape[0]
    eye = torch.eye(size, dtype=kernel.dtype)
    prior_mean, targets = prior_mean.detach().to(kernel.dtype), targets.detach().to(kernel.dtype)

    def psi_of(latent: Tensor, weights: Tensor) -> float:
        return float(log_likelihood(latent, targets, likelihood, num_classes)) - 0.5 * float(
            weights @ (latent - prior_mean)
        )

    weights = torch.zeros(size, dtype=kernel.dtype)
    latent = prior_mean.clone()
    psi = psi_of(latent, weights)
    history, step_sizes, converged = [psi], [], False
    for _ in range(max_steps):
        gradient, curvature = gradient_and_curvature(latent, targets, likelihood, num_classes)
        sqrt_w = symmetric_sqrt(curvature, num_classes)
        cholesky = torch.linalg.cholesky(eye + sqrt_w @ kernel @ sqrt_w)
        b = curvature @ (latent - prior_mean) + gradient
        new_weights = b - sqrt_w @ torch.cholesky_solve((sqrt_w @ (kernel @ b))[:, None], cholesky)[:, 0]
        new_latent = prior_mean + kernel @ new_weights
        new_psi = psi_of(new_latent, new_weights)
        step = 1.0
        if damping:
            direction_w, direction_f = new_weights - weights, new_latent - latent
            while not (new_psi >= psi - 1e-14 * max(1.0, abs(psi))) and step > 2.0**-40:
                step /= 2
                new_weights, new_latent = weights + step * direction_w, latent + step * direction_f
                new_psi = psi_of(new_latent, new_weights)
        change = abs(new_psi - psi)
        weights, latent, psi = new_weights, new_latent, new_psi
        history.append(psi)
        step_sizes.append(step)
        if not math.isfinite(psi):
            break
        if change <= tol * max(1.0, abs(psi)) and step == 1.0:
            converged = True
            break
    gradient, curvature = gradient_and_curvature(latent, targets, likelihood, num_classes)
    sqrt_w = symmetric_sqrt(curvature, num_classes)
    cholesky = torch.linalg.cholesky(eye + sqrt_w @ kernel @ sqrt_w)
    return LaplaceReference(latent, weights, curvature, sqrt_w, cholesky, gradient, history, step_sizes, converged)


def data_major(blocks: Tensor, shared_classes: int | None = None) -> Tensor:
    r"""A data-major ``(N C, M C)`` matrix from per-class kernels ``(C, N, M)``, or :math:`\mathbf K \otimes \mathbf I_C`
    from one ``(N, M)`` kernel shared by ``shared_classes`` classes (or the kernel itself for ``C = 1``)."""
    if blocks.dim() == 2:
        classes = shared_classes or 1
        return torch.kron(blocks, torch.eye(classes, dtype=blocks.dtype))
    classes, rows, cols = blocks.shape
    out = blocks.new_zeros(rows * classes, cols * classes)
    for c in range(classes):
        out[c::classes, c::classes] = blocks[c]
    return out


def gp_regression(
    kernel: Tensor,
    noise: float,
    targets: Tensor,
    prior_mean: Tensor,
    kernel_star_train: Tensor,
    kernel_star_star: Tensor,
    mean_star: Tensor,
) -> tuple[Tensor, Tensor]:
    r"""Exact GP regression posterior: :math:`\mathbf m_* + \mathbf K_{*X} (\mathbf K + \sigma^2 \mathbf I)^{-1} (\mathbf y - \mathbf m)`
    and :math:`\mathbf K_{**} - \mathbf K_{*X} (\mathbf K + \sigma^2 \mathbf I)^{-1} \mathbf K_{X*}` (R&W Alg. 2.1)."""
    cholesky = torch.linalg.cholesky(kernel + noise * torch.eye(kernel.shape[0], dtype=kernel.dtype))
    alpha = torch.cholesky_solve((targets - prior_mean)[:, None], cholesky)[:, 0]
    factor = torch.linalg.solve_triangular(cholesky, kernel_star_train.mT, upper=False)
    return mean_star + kernel_star_train @ alpha, kernel_star_star - factor.mT @ factor


def laplace_evidence(
    kernel: Tensor, prior_mean: Tensor, targets: Tensor, likelihood: str, num_classes: int = 1
) -> tuple[float, LaplaceReference]:
    r"""The Laplace evidence :math:`\log q(\mathbf y) = \ell(\hat{\mathbf f}) - \tfrac12 \mathbf a^\top \mathbf K \mathbf a
    - \tfrac12 \log |\mathbf I + \mathbf W^{1/2} \mathbf K \mathbf W^{1/2}|` (R&W eq. 3.32) at the mode of :func:`laplace_mode`.

    The log-determinant is a dense ``slogdet`` with the symmetric block root :math:`\mathbf W^{1/2}`, so for
    softmax it includes the term that R&W's Algorithm 3.3 (line 12) leaves out. In float64.
    """
    kernel, prior_mean, targets = kernel.detach().double(), prior_mean.detach().double(), targets.detach().double()
    result = laplace_mode(kernel, prior_mean, targets, likelihood, num_classes)
    size = kernel.shape[0]
    fit = float(log_likelihood(result.mode, targets, likelihood, num_classes))
    quadratic = float(result.weights @ kernel @ result.weights)
    system = torch.eye(size, dtype=kernel.dtype) + result.sqrt_curvature @ kernel @ result.sqrt_curvature
    sign, log_det = torch.linalg.slogdet(system)
    assert float(sign) > 0
    return fit - 0.5 * quadratic - 0.5 * float(log_det), result


def gaussian_log_marginal(kernel: Tensor, prior_mean: Tensor, targets: Tensor, noise: Tensor) -> Tensor:
    r"""Exact GP regression evidence :math:`\log \mathcal N(\mathbf y; \mathbf m, \mathbf K + \sigma^2 \mathbf I)` (R&W eq. 2.30),
    differentiable in ``kernel``, ``prior_mean`` and ``noise``."""
    covariance = kernel + noise * torch.eye(kernel.shape[0], dtype=kernel.dtype)
    cholesky = torch.linalg.cholesky(covariance)
    residual = (targets - prior_mean)[:, None]
    alpha = torch.cholesky_solve(residual, cholesky)
    return (
        -0.5 * (residual * alpha).sum()
        - cholesky.diagonal().log().sum()
        - 0.5 * kernel.shape[0] * math.log(2 * math.pi)
    )
