r"""A dense expectation propagation (EP), independent of ``gpytorch_iterncgp`` (for tests only).

Rasmussen & Williams, *Gaussian Processes for Machine Learning* (R&W), sec. 3.6, with zero prior mean, in
plain float64 (torch for the linear algebra, scipy for the 1-D integrals). Labels are the package's:
:math:`y \in \{0, 1\}` for Bernoulli (:math:`s = 2y - 1` is R&W's label), counts for Poisson.

* Tilted moments of :math:`p(y_i \mid f)\,\mathcal N(f \mid \mu_{-i}, \sigma_{-i}^2)`:
  closed form for probit (R&W eq. 3.58, :func:`probit_moments`) and brute-force adaptive quadrature
  (``scipy.integrate.quad`` on the normalised tilted density, split at its mode) for any of the four
  likelihoods (:func:`quad_moments`).
* Sequential EP with rank-one updates of :math:`\boldsymbol\Sigma` (R&W Algorithm 3.5) and parallel
  damped EP (every site from the same posterior, then one recomputation), both returning an
  :class:`EPResult`: sites :math:`\tilde\tau, \tilde\nu`, posterior mean/covariance, cavities, and the EP log
  marginal likelihood (R&W eq. 3.65 in the numerically stable form of GPML's ``infEP``).
* Predictions for probit (R&W Algorithm 3.6) and the hyperparameter gradient of the EP evidence with the
  sites held fixed (R&W sec. 5.5.2, eq. 5.27).
* Multi-class EP for the multinomial probit likelihood (:func:`multiclass_parallel_ep`, :math:`C \times C` site
  blocks, data-major :math:`NC \times NC` prior); unlike the rest, its tilted moments are the package's nested EP
  (:func:`gpytorch_iterncgp.likelihoods.multinomial_probit.multinomial_probit_moments`). And an independent check of it: Gibbs
  sampling of the augmented model (:func:`multiclass_gibbs`).
* Factorised multi-class EP (:func:`factorised_parallel_ep`, :func:`factorised_predict`): one site per point and
  class, :math:`C` independent GPs, each point's tilted distribution projected on the factorised family (the
  package's :func:`gpytorch_iterncgp.likelihoods.factorised.factorised_moments`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from scipy import integrate, optimize, special
from torch import Tensor

LIKELIHOODS = ("probit", "logit", "poisson_exp", "poisson_softplus")


# ---------------------------------------------------------------------------------------------------
# Likelihoods (numpy, scalar f) and tilted moments
# ---------------------------------------------------------------------------------------------------
def _log_softplus(f: float) -> float:
    return (
        f - math.exp(f) / 2
        if f < -30
        else math.log(math.log1p(math.exp(f)) if f < 30 else f + math.log1p(math.exp(-f)))
    )


def log_likelihood(f: float, y: float, likelihood: str) -> float:
    r""":math:`\log p(y \mid f)` for one point."""
    if likelihood == "probit":
        return float(special.log_ndtr((2 * y - 1) * f))
    if likelihood == "logit":
        return float(-np.logaddexp(0.0, -(2 * y - 1) * f))
    if likelihood == "poisson_exp":
        return y * f - math.exp(f) - math.lgamma(y + 1)
    if likelihood == "poisson_softplus":
        rate = float(np.logaddexp(0.0, f))
        return (y * _log_softplus(f) if y > 0 else 0.0) - rate - math.lgamma(y + 1)
    raise ValueError(likelihood)


def _gradient(f: float, y: float, likelihood: str) -> float:
    r""":math:`\partial \log p(y \mid f) / \partial f` (R&W eq. 3.15-3.16 for the Bernoulli links)."""
    if likelihood == "probit":
        sign = 2 * y - 1
        return sign * math.exp(-0.5 * f * f - 0.5 * math.log(2 * math.pi) - float(special.log_ndtr(sign * f)))
    if likelihood == "logit":
        return y - float(special.expit(f))
    if likelihood == "poisson_exp":
        return y - math.exp(f)
    if likelihood == "poisson_softplus":
        ratio = math.exp(-float(np.logaddexp(0.0, -f)) - _log_softplus(f)) if y > 0 else 0.0  # lambda' / lambda
        return y * ratio - float(special.expit(f))
    raise ValueError(likelihood)


def probit_moments(y: Tensor, mean: Tensor, variance: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    r"""R&W eq. 3.58: :math:`z = s\mu/\sqrt{1+\sigma^2}`, :math:`\log Z = \log\Phi(z)`,
    :math:`\hat\mu = \mu + s\sigma^2 \mathcal N(z)/(\Phi(z)\sqrt{1+\sigma^2})`,
    :math:`\hat\sigma^2 = \sigma^2 - \sigma^4 \mathcal N(z)(z + \mathcal N(z)/\Phi(z))/((1+\sigma^2)\Phi(z))`."""
    sign = 2 * y - 1
    root = torch.sqrt(1 + variance)
    z = sign * mean / root
    log_cdf = torch.special.log_ndtr(z)
    ratio = torch.exp(-0.5 * z**2 - 0.5 * math.log(2 * math.pi) - log_cdf)
    return log_cdf, mean + sign * variance * ratio / root, variance - variance**2 * ratio * (z + ratio) / (1 + variance)


def quad_moments(y: float, mean: float, variance: float, likelihood: str) -> tuple[float, float, float]:
    r""":math:`(\log Z, \hat\mu, \hat\sigma^2)` of :math:`p(y \mid f)\mathcal N(f \mid \mu, \sigma^2)` by adaptive quadrature.

    The log density :math:`\psi(f) = \log p(y \mid f) - (f - \mu)^2 / (2\sigma^2)` is concave; its mode comes from
    Brent's method, its width :math:`s` from a finite-difference curvature, and the interval from stepping out
    until :math:`\psi` is 60 below its maximum on each side. ``quad`` then integrates :math:`e^{\psi - \psi(\hat f)}`
    times :math:`1, (f - \hat f), (f - \hat f)^2` over the interval split at the mode and at :math:`\pm s, \pm 10 s`.
    """
    sd = math.sqrt(variance)

    def psi(f: float) -> float:
        return log_likelihood(f, y, likelihood) - (f - mean) ** 2 / (2 * variance)

    def slope(f: float) -> float:
        return _gradient(f, y, likelihood) - (f - mean) / variance

    # the mode: the root of the decreasing psi', bracketed by stepping out from the cavity mean
    lo, hi, width = mean, mean, sd
    while slope(lo) < 0:
        lo -= width
        width *= 2
    width = sd
    while slope(hi) > 0:
        hi += width
        width *= 2
    mode = optimize.brentq(slope, lo, hi, xtol=1e-300, rtol=4 * np.finfo(float).eps, maxiter=2000) if lo < hi else mean
    peak = psi(mode)
    scale = sd
    for _ in range(2):  # the tilted width 1/sqrt(-psi''(mode)) by central differences of psi'
        h = 1e-4 * scale
        scale = min(sd, 1 / math.sqrt(max((slope(mode - h) - slope(mode + h)) / (2 * h), 1e-300)))

    def reach(direction: float) -> float:
        distance = scale
        while psi(mode + direction * distance) - peak > -60:
            distance *= 1.5
        return distance

    left, right = reach(-1.0), reach(1.0)
    points = [p for p in (-10 * scale, -scale, 0.0, scale, 10 * scale) if -left < p < right]

    def integral(power: int) -> float:
        def integrand(t: float) -> float:
            return math.exp(psi(mode + t) - peak) * t**power

        with warnings.catch_warnings():  # quad warns that 1e-13 is at the edge of float64 rounding
            warnings.simplefilter("ignore", integrate.IntegrationWarning)
            return integrate.quad(integrand, -left, right, points=points, epsabs=0.0, epsrel=1e-13, limit=2000)[0]

    z0, z1, z2 = integral(0), integral(1), integral(2)
    centre = z1 / z0
    log_z = peak + math.log(z0) - 0.5 * math.log(2 * math.pi * variance)
    return log_z, mode + centre, z2 / z0 - centre**2


def tilted_moments(y: Tensor, mean: Tensor, variance: Tensor, likelihood: str) -> tuple[Tensor, Tensor, Tensor]:
    """Tilted moments for vectors: probit in closed form (eq. 3.58), the rest (and ``"probit_quad"``) by
    :func:`quad_moments`."""
    if likelihood == "probit":
        return probit_moments(y, mean, variance)
    name = "probit" if likelihood == "probit_quad" else likelihood
    rows = [quad_moments(float(a), float(b), float(c), name) for a, b, c in zip(y, mean, variance, strict=True)]
    log_z, tilted_mean, tilted_var = (torch.tensor(column, dtype=torch.float64) for column in zip(*rows, strict=True))
    return log_z, tilted_mean, tilted_var


# ---------------------------------------------------------------------------------------------------
# EP
# ---------------------------------------------------------------------------------------------------
@dataclass
class EPResult:
    site_precision: Tensor  # tau tilde (N,)
    site_natural_mean: Tensor  # nu tilde (N,)
    mean: Tensor  # posterior mean (N,)
    covariance: Tensor  # posterior covariance (N, N)
    cavity_precision: Tensor  # tau_{-i} at the end (N,)
    cavity_natural_mean: Tensor  # nu_{-i} at the end (N,)
    log_marginal_likelihood: Tensor  # log Z_EP
    sweeps: int
    converged: bool


def posterior(kernel: Tensor, site_precision: Tensor, site_natural_mean: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    r"""R&W Alg. 3.5, lines 13-15: :math:`\mathbf L = \operatorname{chol}(\mathbf I + \tilde{\mathbf S}^{1/2}\mathbf K
    \tilde{\mathbf S}^{1/2})`, :math:`\mathbf V = \mathbf L^{-1}\tilde{\mathbf S}^{1/2}\mathbf K`,
    :math:`\boldsymbol\Sigma = \mathbf K - \mathbf V^\top\mathbf V`, :math:`\boldsymbol\mu = \boldsymbol\Sigma\tilde{\boldsymbol\nu}`.
    Returns :math:`(\boldsymbol\mu, \boldsymbol\Sigma, \mathbf L)`."""
    root = site_precision.sqrt()
    n = len(kernel)
    chol = torch.linalg.cholesky(torch.eye(n, dtype=kernel.dtype) + root[:, None] * kernel * root[None, :])
    v = torch.linalg.solve_triangular(chol, root[:, None] * kernel, upper=False)
    covariance = kernel - v.mT @ v
    return covariance @ site_natural_mean, covariance, chol


def _cavities(mean: Tensor, covariance: Tensor, tau: Tensor, nu: Tensor) -> tuple[Tensor, Tensor]:
    variance = covariance.diagonal()
    return 1 / variance - tau, mean / variance - nu


def log_marginal_likelihood(
    kernel: Tensor, tau: Tensor, nu: Tensor, tau_cav: Tensor, nu_cav: Tensor, log_z: Tensor
) -> Tensor:
    r"""R&W eq. 3.65 in GPML ``infEP``'s stable form (zero prior mean):

    .. math::
        -\log Z_{EP} = \sum \log \operatorname{diag}\mathbf L - \sum \log \hat Z_i - \tfrac12\tilde\nu^\top\Sigma\tilde\nu
        - \tfrac12 \nu_-^\top\frac{\tilde\tau/\tau_- \cdot \nu_- - 2\tilde\nu}{\tilde\tau + \tau_-}
        + \tfrac12\sum\frac{\tilde\nu^2}{\tau_- + \tilde\tau} - \tfrac12\sum\log(1 + \tilde\tau/\tau_-).
    """
    _, covariance, chol = posterior(kernel, tau, nu)
    negative = (
        chol.diagonal().log().sum()
        - log_z.sum()
        - nu @ covariance @ nu / 2
        - nu_cav @ ((tau / tau_cav * nu_cav - 2 * nu) / (tau + tau_cav)) / 2
        + (nu**2 / (tau_cav + tau)).sum() / 2
        - torch.log1p(tau / tau_cav).sum() / 2
    )
    return -negative


Moments = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]


def _moments_for(likelihood: str) -> Moments:
    return lambda y, m, v: tilted_moments(y, m, v, likelihood)


def _finish(kernel, y, tau, nu, moments: Moments, sweeps, converged) -> EPResult:
    mean, covariance, _ = posterior(kernel, tau, nu)
    tau_cav, nu_cav = _cavities(mean, covariance, tau, nu)
    log_z, _, _ = moments(y, nu_cav / tau_cav, 1 / tau_cav)
    lml = log_marginal_likelihood(kernel, tau, nu, tau_cav, nu_cav, log_z)
    return EPResult(tau, nu, mean, covariance, tau_cav, nu_cav, lml, sweeps, converged)


def sequential_ep(
    kernel: Tensor, y: Tensor, likelihood: str = "probit", tol: float = 1e-13, max_sweeps: int = 200
) -> EPResult:
    r"""R&W Algorithm 3.5: site by site, :math:`\boldsymbol\Sigma \leftarrow \boldsymbol\Sigma -
    ((\Delta\tilde\tau_i)^{-1} + \Sigma_{ii})^{-1}\mathbf s_i\mathbf s_i^\top`, :math:`\boldsymbol\mu = \boldsymbol\Sigma\tilde{\boldsymbol\nu}`;
    :math:`\boldsymbol\Sigma, \boldsymbol\mu` recomputed after each sweep. Stops when the sites change by less than ``tol``."""
    moments = _moments_for(likelihood)
    n = len(y)
    tau, nu = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    covariance, mean = kernel.clone(), torch.zeros(n, dtype=torch.float64)
    for sweep in range(1, max_sweeps + 1):
        old_tau, old_nu = tau.clone(), nu.clone()
        for i in range(n):
            tau_cav = 1 / covariance[i, i] - tau[i]
            nu_cav = mean[i] / covariance[i, i] - nu[i]
            _, mu_hat, var_hat = moments(y[i : i + 1], (nu_cav / tau_cav)[None], (1 / tau_cav)[None])
            delta = 1 / var_hat[0] - tau_cav - tau[i]
            tau[i] = tau[i] + delta
            nu[i] = mu_hat[0] / var_hat[0] - nu_cav
            column = covariance[:, i].clone()
            covariance = covariance - column[:, None] * column[None, :] / (1 / delta + column[i])
            mean = covariance @ nu
        mean, covariance, _ = posterior(kernel, tau, nu)
        change = max(float((tau - old_tau).abs().max()), float((nu - old_nu).abs().max()))
        if change < tol:
            return _finish(kernel, y, tau, nu, moments, sweep, True)
    return _finish(kernel, y, tau, nu, moments, max_sweeps, False)


def parallel_ep(
    kernel: Tensor,
    y: Tensor,
    likelihood: str = "probit",
    damping: float = 0.5,
    tol: float = 1e-13,
    max_sweeps: int = 2000,
) -> EPResult:
    r"""Parallel EP: every site from the same posterior, :math:`\tilde\tau \leftarrow (1-\delta)\tilde\tau + \delta\tilde\tau^*`
    (likewise :math:`\tilde\nu`), then :math:`\boldsymbol\Sigma, \boldsymbol\mu` recomputed (R&W Alg. 3.5, lines 13-15).
    ``damping`` is :math:`\delta`."""
    moments = _moments_for(likelihood)
    n = len(y)
    tau, nu = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    mean, covariance = torch.zeros(n, dtype=torch.float64), kernel.clone()
    for sweep in range(1, max_sweeps + 1):
        tau_cav, nu_cav = _cavities(mean, covariance, tau, nu)
        _, mu_hat, var_hat = moments(y, nu_cav / tau_cav, 1 / tau_cav)
        new_tau, new_nu = 1 / var_hat - tau_cav, mu_hat / var_hat - nu_cav
        step_tau, step_nu = damping * (new_tau - tau), damping * (new_nu - nu)
        tau, nu = tau + step_tau, nu + step_nu
        mean, covariance, _ = posterior(kernel, tau, nu)
        if max(float(step_tau.abs().max()), float(step_nu.abs().max())) < tol:
            return _finish(kernel, y, tau, nu, moments, sweep, True)
    return _finish(kernel, y, tau, nu, moments, max_sweeps, False)


def probit_predict(kernel: Tensor, cross: Tensor, diagonal: Tensor, result: EPResult) -> tuple[Tensor, Tensor, Tensor]:
    r"""R&W Algorithm 3.6: :math:`\mathbf z = \tilde{\mathbf S}^{1/2}\mathbf L^\top\backslash(\mathbf L\backslash
    \tilde{\mathbf S}^{1/2}\mathbf K\tilde{\boldsymbol\nu})`, :math:`\bar f_* = \mathbf k_*^\top(\tilde{\boldsymbol\nu} - \mathbf z)`,
    :math:`\mathbf v = \mathbf L\backslash\tilde{\mathbf S}^{1/2}\mathbf k_*`, :math:`\mathbb V[f_*] = k(\mathbf x_*, \mathbf x_*) -
    \mathbf v^\top\mathbf v`, :math:`\bar\pi_* = \Phi(\bar f_*/\sqrt{1 + \mathbb V[f_*]})`.

    :param cross: :math:`\mathbf K_{X*}` ``(N, N*)``; :param diagonal: :math:`k(\mathbf x_*, \mathbf x_*)` ``(N*,)``.
    Returns latent means, latent variances and class-1 probabilities ``(N*,)``.
    """
    latent_mean, latent_variance = latent_predict(
        kernel, cross, diagonal, result.site_precision, result.site_natural_mean
    )
    return latent_mean, latent_variance, torch.special.ndtr(latent_mean / torch.sqrt(1 + latent_variance))


def latent_predict(kernel: Tensor, cross: Tensor, diagonal: Tensor, tau: Tensor, nu: Tensor) -> tuple[Tensor, Tensor]:
    """The latent means and variances of :func:`probit_predict` for sites ``tau``, ``nu`` ``(N,)``."""
    root = tau.sqrt()
    _, _, chol = posterior(kernel, tau, nu)
    inner = torch.linalg.solve_triangular(chol, (root * (kernel @ nu))[:, None], upper=False)
    z = root * torch.linalg.solve_triangular(chol.mT, inner, upper=True)[:, 0]
    v = torch.linalg.solve_triangular(chol, root[:, None] * cross, upper=False)
    return cross.mT @ (nu - z), diagonal - (v**2).sum(0)


def evidence_gradient(kernel: Tensor, kernel_derivative: Tensor, result: EPResult) -> Tensor:
    r""":math:`\partial\log Z_{EP}/\partial\theta` with the sites fixed (R&W eq. 5.27):
    :math:`\tfrac12\operatorname{tr}((\mathbf b\mathbf b^\top - \tilde{\mathbf S}^{1/2}\mathbf B^{-1}\tilde{\mathbf S}^{1/2})
    \partial\mathbf K/\partial\theta)`, :math:`\mathbf b = (\mathbf I - \tilde{\mathbf S}^{1/2}\mathbf B^{-1}\tilde{\mathbf S}^{1/2}\mathbf K)
    \tilde{\boldsymbol\nu}`, :math:`\mathbf B = \mathbf I + \tilde{\mathbf S}^{1/2}\mathbf K\tilde{\mathbf S}^{1/2}`."""
    root = result.site_precision.sqrt()
    _, _, chol = posterior(kernel, result.site_precision, result.site_natural_mean)
    r = root[:, None] * torch.cholesky_inverse(chol) * root[None, :]  # S^1/2 B^-1 S^1/2 = (K + S^-1)^-1
    b = result.site_natural_mean - r @ (kernel @ result.site_natural_mean)
    return 0.5 * ((torch.outer(b, b) - r) * kernel_derivative).sum()


# ---------------------------------------------------------------------------------------------------
# Multi-class EP (multinomial probit), dense, with the package's nested-EP tilted moments
# ---------------------------------------------------------------------------------------------------
@dataclass
class MulticlassEPResult:
    site_precision: Tensor  # T_i, (N, C, C) blocks, positive semi-definite (the 1-vector in their null space)
    site_natural_mean: Tensor  # nu_i, (N, C)
    mean: Tensor  # posterior mean (N, C)
    covariance: Tensor  # posterior covariance (NC, NC), data-major
    log_marginal_likelihood: Tensor  # log Z_EP
    sweeps: int
    converged: bool


def _log_normaliser(mean: Tensor, covariance: Tensor) -> Tensor:
    r""":math:`A(\mathbf m, \mathbf V) = \tfrac12\mathbf m^\top\mathbf V^{-1}\mathbf m + \tfrac12\log|\mathbf V|`, batched."""
    chol = torch.linalg.cholesky(covariance)
    whitened = torch.linalg.solve_triangular(chol, mean.unsqueeze(-1), upper=False).squeeze(-1)
    return 0.5 * whitened.square().sum(-1) + chol.diagonal(dim1=-2, dim2=-1).log().sum(-1)


def multiclass_posterior(
    kernel: Tensor, site_precision: Tensor, site_natural_mean: Tensor, prior_mean: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    r""":math:`\boldsymbol\Sigma = (\mathbf K^{-1} + \mathbf T)^{-1} = \mathbf K(\mathbf I + \mathbf T\mathbf K)^{-1}`
    (:math:`\mathbf T` block diagonal, singular) and :math:`\boldsymbol\mu = \boldsymbol\Sigma(\mathbf K^{-1}\mathbf m
    + \boldsymbol\nu)`; ``kernel`` ``(NC, NC)`` and ``prior_mean`` :math:`\mathbf m` ``(NC,)`` (default 0)
    data-major. Returns the mean ``(N, C)`` and the covariance ``(NC, NC)``."""
    n, c = site_natural_mean.shape
    blocks = torch.block_diag(*site_precision)
    eye = torch.eye(n * c, dtype=kernel.dtype)
    covariance = torch.linalg.solve((eye + blocks @ kernel).mT, kernel.mT).mT
    covariance = (covariance + covariance.mT) / 2
    natural = site_natural_mean.reshape(-1)
    if prior_mean is not None:
        natural = natural + torch.linalg.solve(kernel, prior_mean)
    return (covariance @ natural).reshape(n, c), covariance


def _multiclass_cavities(mean, covariance, site_precision, site_natural_mean):
    n, c = mean.shape
    index = torch.arange(n)
    marginal = covariance.reshape(n, c, n, c)[index, :, index, :]  # (N, C, C) blocks
    marginal_precision = torch.linalg.inv(marginal)
    cavity_precision = marginal_precision - site_precision
    cavity_covariance = torch.linalg.inv(cavity_precision)
    cavity_covariance = (cavity_covariance + cavity_covariance.mT) / 2
    natural = (marginal_precision @ mean.unsqueeze(-1)).squeeze(-1) - site_natural_mean
    return marginal, (cavity_covariance @ natural.unsqueeze(-1)).squeeze(-1), cavity_covariance


def multiclass_log_marginal_likelihood(kernel, y, site_precision, site_natural_mean, prior_mean=None) -> Tensor:
    r"""The EP normaliser (R&W eq. 3.65 for :math:`C \times C` site blocks):
    :math:`\log Z_{EP} = A(\boldsymbol\mu, \boldsymbol\Sigma) - A(\mathbf 0, \mathbf K) + \sum_i [\log\hat Z_i
    + A(\mathbf m_{-i}, \mathbf S_{-i}) - A(\boldsymbol\mu_i, \boldsymbol\Sigma_{ii})]`, with :math:`\log\hat Z_i` the
    nested-EP tilted normaliser at the cavities."""
    from gpytorch_iterncgp.likelihoods.multinomial_probit import multinomial_probit_moments

    mean, covariance = multiclass_posterior(kernel, site_precision, site_natural_mean, prior_mean)
    marginal, cavity_mean, cavity_covariance = _multiclass_cavities(mean, covariance, site_precision, site_natural_mean)
    log_z, _, _ = multinomial_probit_moments(y, cavity_mean, cavity_covariance)
    zero = torch.zeros(len(kernel), dtype=kernel.dtype) if prior_mean is None else prior_mean
    return (
        _log_normaliser(mean.reshape(-1), covariance)
        - _log_normaliser(zero, kernel)
        + (log_z + _log_normaliser(cavity_mean, cavity_covariance) - _log_normaliser(mean, marginal)).sum()
    )


def multiclass_parallel_ep(
    kernel: Tensor,
    y: Tensor,
    num_classes: int,
    damping: float = 0.5,
    tol: float = 1e-10,
    max_sweeps: int = 500,
    prior_mean: Tensor | None = None,
) -> MulticlassEPResult:
    r"""Parallel damped EP for the multinomial probit likelihood with :math:`C \times C` site blocks (Riihimäki et al.
    2013's outer EP, here parallel): from the posterior :math:`\mathcal N(\boldsymbol\mu, \boldsymbol\Sigma)` every
    point's cavity :math:`\mathbf S_{-i} = (\boldsymbol\Sigma_{ii}^{-1} - \mathbf T_i)^{-1}`, :math:`\mathbf m_{-i} =
    \mathbf S_{-i}(\boldsymbol\Sigma_{ii}^{-1}\boldsymbol\mu_i - \boldsymbol\nu_i)`; the tilted moments by
    :func:`~gpytorch_iterncgp.likelihoods.multinomial_probit.multinomial_probit_moments` (inner sites warm-started from the previous
    sweep); the sites :math:`\mathbf T_i^* = \hat{\boldsymbol\Sigma}_i^{-1} - \mathbf S_{-i}^{-1}`,
    :math:`\boldsymbol\nu_i^* = \hat{\boldsymbol\Sigma}_i^{-1}\hat{\boldsymbol\mu}_i - \mathbf S_{-i}^{-1}\mathbf m_{-i}`
    damped, :math:`\mathbf T \leftarrow (1 - \delta)\mathbf T + \delta\mathbf T^*` (likewise :math:`\boldsymbol\nu`),
    then the posterior recomputed. Prior :math:`\mathcal N(\mathbf m, \mathbf K)` (``prior_mean`` ``(NC,)``, default
    0), ``kernel`` ``(NC, NC)``
    data-major (index :math:`nC + c`); ``y`` ``(N,)`` class indices. Stops when the sites change by less than ``tol``.
    """
    from gpytorch_iterncgp.likelihoods.multinomial_probit import multinomial_probit_moments

    n, c = len(y), num_classes
    precision = torch.zeros(n, c, c, dtype=kernel.dtype)
    natural = torch.zeros(n, c, dtype=kernel.dtype)
    mean, covariance = multiclass_posterior(kernel, precision, natural, prior_mean)
    inner = None
    for sweep in range(1, max_sweeps + 1):
        _, cavity_mean, cavity_covariance = _multiclass_cavities(mean, covariance, precision, natural)
        _, tilted_mean, tilted_cov, inner = multinomial_probit_moments(
            y, cavity_mean, cavity_covariance, sites=inner, return_sites=True
        )
        tilted_precision = torch.linalg.inv(tilted_cov)
        cavity_precision = torch.linalg.inv(cavity_covariance)
        new_precision = tilted_precision - cavity_precision
        new_precision = (new_precision + new_precision.mT) / 2
        new_natural = (tilted_precision @ tilted_mean.unsqueeze(-1) - cavity_precision @ cavity_mean.unsqueeze(-1))[
            ..., 0
        ]
        step_precision, step_natural = damping * (new_precision - precision), damping * (new_natural - natural)
        precision, natural = precision + step_precision, natural + step_natural
        mean, covariance = multiclass_posterior(kernel, precision, natural, prior_mean)
        if max(float(step_precision.abs().max()), float(step_natural.abs().max())) < tol:
            lml = multiclass_log_marginal_likelihood(kernel, y, precision, natural, prior_mean)
            return MulticlassEPResult(precision, natural, mean, covariance, lml, sweep, True)
    lml = multiclass_log_marginal_likelihood(kernel, y, precision, natural, prior_mean)
    return MulticlassEPResult(precision, natural, mean, covariance, lml, max_sweeps, False)


def multiclass_gibbs(
    kernel: Tensor, y: Tensor, num_classes: int, chains: int = 2000, burn_in: int = 200, draws: int = 300, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""Posterior moments of the multinomial probit GP by Gibbs sampling in the augmented model (Albert & Chib 1993;
    Girolami & Rogers 2006): :math:`\mathbf z_i = \mathbf f_i + \boldsymbol\epsilon_i`, :math:`\boldsymbol\epsilon_i
    \sim \mathcal N(\mathbf 0, \mathbf I)`, :math:`y_i = \arg\max_j z_{ij}`. Alternates
    :math:`\mathbf f \mid \mathbf z \sim \mathcal N(\mathbf K(\mathbf K + \mathbf I)^{-1}\mathbf z, \mathbf K -
    \mathbf K(\mathbf K + \mathbf I)^{-1}\mathbf K)` and, coordinate by coordinate, truncated normals
    :math:`z_{iy_i} > \max_{j \ne y_i} z_{ij}` and :math:`z_{ij} < z_{iy_i}` (inverse-CDF sampling from the tail side).
    Many short independent chains, vectorised. Returns the posterior mean ``(N, C)`` and covariance ``(NC, NC)`` and
    their Monte Carlo standard errors (from the spread of the chains' own averages), same shapes."""
    generator = torch.Generator().manual_seed(seed)
    n, c = len(y), num_classes
    dtype = kernel.dtype
    eye = torch.eye(n * c, dtype=dtype)
    gain = torch.linalg.solve(kernel + eye, kernel).mT  # K (K + I)^-1
    conditional = kernel - gain @ kernel
    root = torch.linalg.cholesky((conditional + conditional.mT) / 2 + 1e-12 * eye)
    observed = torch.nn.functional.one_hot(y, c).bool()  # (N, C)

    def uniform(shape):
        return torch.rand(shape, generator=generator, dtype=dtype).clamp(1e-300, 1 - 1e-16)

    f = torch.zeros(chains, n, c, dtype=dtype)
    z = torch.where(observed, 1.0, -1.0).to(dtype).expand(chains, n, c).clone()
    total = torch.zeros(chains, n * c, dtype=dtype)
    outer = torch.zeros(chains, n * c, n * c, dtype=dtype)
    for step in range(burn_in + draws):
        # z | f: the observed class above the others' maximum, then each other class below it
        others_max = torch.where(observed, -math.inf, z).amax(-1)  # (chains, N)
        f_obs = f[observed.expand(chains, n, c)].reshape(chains, n)
        lower = others_max - f_obs  # z_obs - f_obs > lower: -Phi^-1(U Phi(-lower)) from the upper tail
        z_obs = f_obs - torch.special.ndtri(uniform((chains, n)) * torch.special.ndtr(-lower))
        z = torch.where(observed, z_obs.unsqueeze(-1), z)
        upper = z_obs.unsqueeze(-1) - f  # z_j - f_j < upper
        z_other = f + torch.special.ndtri(uniform((chains, n, c)) * torch.special.ndtr(upper))
        z = torch.where(observed, z, z_other)
        # f | z
        noise = torch.randn(chains, n * c, generator=generator, dtype=dtype)
        f = (z.reshape(chains, -1) @ gain.mT + noise @ root.mT).reshape(chains, n, c)
        if step >= burn_in:
            flat = f.reshape(chains, -1)
            total += flat
            outer += flat.unsqueeze(-1) * flat.unsqueeze(-2)
    chain_mean, chain_second = total / draws, outer / draws
    mean = chain_mean.mean(0)
    covariance = chain_second.mean(0) - torch.outer(mean, mean)
    chain_cov = chain_second - chain_mean.unsqueeze(-1) * chain_mean.unsqueeze(-2)
    mean_error = chain_mean.std(0) / math.sqrt(chains)
    covariance_error = chain_cov.std(0) / math.sqrt(chains)
    return mean.reshape(n, c), covariance, mean_error.reshape(n, c), covariance_error


# ---------------------------------------------------------------------------------------------------
# Factorised multi-class EP: one site per point and class, C independent dense GPs
# ---------------------------------------------------------------------------------------------------
def factorised_parallel_ep(
    kernels: Tensor, y: Tensor, damping: float = 0.5, tol: float = 1e-12, max_sweeps: int = 2000
) -> tuple[Tensor, Tensor, bool]:
    r"""Parallel damped EP for the multinomial probit with a posterior that factorises over the classes
    (Villacampa-Calvo & Hernández-Lobato 2017 without inducing points): class :math:`c`'s posterior is R&W Alg. 3.5's
    (:func:`posterior`) for its kernel and its sites :math:`\tilde\tau_{ic}, \tilde\nu_{ic}`; each point's cavity is
    the product of the classes' cavities, and its tilted distribution is projected on the factorised family (the
    package's :func:`~gpytorch_iterncgp.likelihoods.factorised.factorised_moments`, checked against scipy in
    ``tests/likelihoods/test_factorised.py``). Zero prior mean.

    :param kernels: :math:`\mathbf K_c` ``(C, N, N)``; ``y``: ``(N,)`` class indices.
    :returns: the sites :math:`\tilde\tau`, :math:`\tilde\nu` ``(C, N)`` and whether they converged.
    """
    from gpytorch_iterncgp.likelihoods.factorised import factorised_moments

    num_classes, n, _ = kernels.shape
    tau, nu = torch.zeros(num_classes, n, dtype=kernels.dtype), torch.zeros(num_classes, n, dtype=kernels.dtype)
    for _ in range(max_sweeps):
        cavities = [_cavities(*posterior(kernels[c], tau[c], nu[c])[:2], tau[c], nu[c]) for c in range(num_classes)]
        tau_cav = torch.stack([precision for precision, _ in cavities])
        nu_cav = torch.stack([natural for _, natural in cavities])
        _, mu_hat, var_hat = factorised_moments(y, (nu_cav / tau_cav).mT, (1 / tau_cav).mT)
        new_tau, new_nu = 1 / var_hat.mT - tau_cav, mu_hat.mT / var_hat.mT - nu_cav
        step_tau, step_nu = damping * (new_tau - tau), damping * (new_nu - nu)
        tau, nu = tau + step_tau, nu + step_nu
        if max(float(step_tau.abs().max()), float(step_nu.abs().max())) < tol:
            return tau, nu, True
    return tau, nu, False


def factorised_predict(kernels: Tensor, cross: Tensor, diagonal: Tensor, tau: Tensor, nu: Tensor):
    r"""Each class's latent posterior at test points (:func:`latent_predict` per class): ``cross``
    :math:`\mathbf K_{c,X*}` ``(C, N, N*)``, ``diagonal`` ``(C, N*)``; returns means and variances ``(C, N*)``."""
    predictions = [latent_predict(kernels[c], cross[c], diagonal[c], tau[c], nu[c]) for c in range(len(kernels))]
    return torch.stack([mean for mean, _ in predictions]), torch.stack([variance for _, variance in predictions])
