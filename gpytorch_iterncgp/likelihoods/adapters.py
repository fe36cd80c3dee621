r"""Likelihoods and their derivatives: :math:`\ell(\mathbf f)`, :math:`\mathbf g = \nabla \ell` and :math:`\mathbf W = -\nabla^2 \ell`.

Three GPyTorch likelihoods that GPyTorch lacks (:class:`LogitBernoulliLikelihood`,
:class:`ExpPoissonLikelihood`, :class:`MultitaskPoissonLikelihood`), and *adapters* that give the Newton loop what it needs from any
likelihood: target validation, :math:`\ell(\mathbf f) = \sum_n \log p(y_n \mid \mathbf f_n)`, the
gradient ``(N, C)`` and the noise :math:`\mathbf W^{-1}` as a linear operator. Closed forms (R&W sec. 3.4, eq. 3.15-3.16; the softplus link's by the chain rule through :math:`\lambda = \log(1 + e^f)`):

==========================  ==========================================  ===========================================
likelihood                  :math:`g`                                   :math:`W`
==========================  ==========================================  ===========================================
Bernoulli, logit            :math:`y - \sigma(f)`                        :math:`\sigma(f)(1 - \sigma(f))`
Bernoulli, probit           :math:`s \phi(f) / \Phi(s f)`, s = 2y - 1    :math:`r (r + s f)`, :math:`r = \phi(f)/\Phi(sf)`
Poisson, exp                :math:`y - e^f`                              :math:`e^f`
Poisson, exp, C outputs     :math:`y_c - e^{f_c}` (0 where missing)      :math:`\operatorname{diag}(e^{f_c})` (0 where missing)
Poisson, softplus           :math:`(y/\lambda - 1)\lambda'`             :math:`y \lambda'^2/\lambda^2 - (y/\lambda - 1)\lambda''`
negative binomial, exp      :math:`y - (y + r) s`                        :math:`(y + r) s (1 - s)`, :math:`s = \sigma(f - \log r)`
Softmax                     :math:`\mathbf e_y - \boldsymbol\pi`         :math:`\operatorname{diag}(\boldsymbol\pi) - \boldsymbol\pi\boldsymbol\pi^\top`
multinomial probit          autograd                                     autograd; EP: nested-EP tilted moments
other                       autograd                                     autograd (:math:`C \times C` blocks)
==========================  ==========================================  ===========================================

Latent values are ``(N, C)`` tensors (data-major); :math:`C = 1` for binary and count data, :math:`C` outputs for
multi-output counts (whose prior, not likelihood, correlates them).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.likelihoods import (
    BernoulliLikelihood,
    Likelihood,
    PoissonLikelihood,
    SoftmaxLikelihood,
    StudentTLikelihood,
)
from gpytorch.likelihoods.likelihood import _OneDimensionalLikelihood
from linear_operator.operators import LinearOperator
from torch import Tensor
from torch.distributions import Bernoulli, Independent, Poisson

from .. import settings
from ..core.noise import BlockNoiseInverse, DiagonalNoiseInverse, SoftmaxPseudoInverse, project_to_zero_sum
from ..core.validation import check_count, check_nonnegative
from .multinomial_probit import PREDICTIVE_TOL, MultinomialProbitLikelihood, multinomial_probit_moments
from .negative_binomial import NegativeBinomialLikelihood
from .tilted import probit_moments, quadrature_moments

_PROBIT_TO_LOGIT = math.pi / 8  # sigma(x) ~ Phi(sqrt(pi / 8) x)
_GAUSS_HERMITE_NODES = 32  # E[sigma(f)] to ~1e-13 for sd(f) <= 1
_LOGISTIC_STEP, _LOGISTIC_RANGE = 0.5, 40.0  # trapezoid rule over the logistic variable: ~1e-13, tails e^-40


@functools.lru_cache(maxsize=8)
def _hermite_rule(num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Probabilists' Gauss–Hermite nodes and weights normalised to sum 1 (float64): E[h(Z)], Z ~ N(0, 1)."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(num_nodes)
    return nodes, weights / weights.sum()


def gaussian_expectation(function, mean: Tensor, variance: Tensor, num_nodes: int = _GAUSS_HERMITE_NODES) -> Tensor:
    r""":math:`\mathbb E[h(f)]`, :math:`f \sim \mathcal N(\mu, \sigma^2)` elementwise, by ``num_nodes``-point
    Gauss–Hermite quadrature in the dtype of ``mean`` (GPyTorch's ``GaussHermiteQuadrature1D`` keeps its nodes
    in float32, which limits it to about 1e-7).

    Exact for polynomials of degree below ``2 num_nodes``; accurate for ``h`` analytic and smooth on the scale
    of :math:`\sigma`, not for ``h`` varying on a scale much below :math:`\sigma` (see :func:`logistic_gaussian`).
    """
    nodes, weights = (torch.as_tensor(t, dtype=mean.dtype, device=mean.device) for t in _hermite_rule(num_nodes))
    std = variance.clamp_min(0).sqrt()
    return (function(mean[..., None] + std[..., None] * nodes) * weights).sum(-1)


def logistic_gaussian(mean: Tensor, variance: Tensor) -> Tensor:
    r""":math:`\mathbb E[\sigma(f)]` for :math:`f \sim \mathcal N(\mu, s^2)` elementwise, to about 1e-13.

    :math:`\sigma` is the CDF of the standard logistic distribution, so
    :math:`\mathbb E[\sigma(f)] = P(L < f) = \mathbb E_L[\Phi((\mu - L)/s)]` with :math:`L` standard logistic.
    Each form integrates a function that varies on the scale of the *other* variable, so each point uses the
    one that is smooth against its weight: for :math:`s \le 1`, 32-point Gauss–Hermite over :math:`f`;
    for :math:`s > 1`, the trapezoid rule (step 0.5 on :math:`[-40, 40]`) over :math:`L` against the logistic
    density :math:`\sigma(l)\sigma(-l)` (analytic in the strip :math:`|\operatorname{Im} l| < \pi`, so the
    error decays like :math:`e^{-2\pi^2/0.5}`). Gauss–Hermite over :math:`f` alone is not enough for the wide
    posteriors of classification: 64 nodes err by 5e-4 at :math:`s = 7` (the sigmoid is then a near-step
    on the scale of the Gaussian).

    The result is clamped to :math:`[0, 1]`: the weights sum to 1 only up to rounding, so a certain point's sum can
    exceed 1 by an ulp, which scikit-learn's metrics refuse as a probability.
    """
    std = variance.clamp_min(0).sqrt()
    narrow = std <= 1
    over_latent = gaussian_expectation(torch.sigmoid, mean, torch.where(narrow, variance, 0).clamp_min(0))
    logistic = torch.arange(-_LOGISTIC_RANGE, _LOGISTIC_RANGE + _LOGISTIC_STEP / 2, _LOGISTIC_STEP, dtype=mean.dtype)
    logistic = logistic.to(mean.device)
    density = _LOGISTIC_STEP * torch.sigmoid(logistic) * torch.sigmoid(-logistic)
    wide_std = torch.where(narrow, 1, std)[..., None]
    over_logistic = (torch.special.ndtr((mean[..., None] - logistic) / wide_std) * density).sum(-1)
    return torch.where(narrow, over_latent, over_logistic).clamp(0, 1)


_SOFTMAX_SEED = 0  # the base samples of softmax_gaussian: the same on every call, device and dtype
_SOFTMAX_CHUNK = 512  # points per block of softmax_gaussian: bounds the (points, samples, C) tensor


def _standard_normal_pairs(num_pairs: int, num_latents: int, like: Tensor) -> Tensor:
    """Fixed standard normal base samples ``(num_pairs, C)``, drawn on the CPU in float64 from a seeded generator."""
    generator = torch.Generator().manual_seed(_SOFTMAX_SEED)
    return torch.randn(num_pairs, num_latents, generator=generator, dtype=torch.float64).to(like)


def softmax_gaussian(mean: Tensor, covariance: Tensor, num_samples: int | None = None) -> Tensor:
    r""":math:`\mathbb E[\operatorname{softmax}(\mathbf f)]` for :math:`\mathbf f \sim \mathcal N(\boldsymbol\mu,
    \boldsymbol\Sigma)`, by Monte Carlo with fixed antithetic base samples, over the differences of the latents.

    The softmax is unchanged by adding one number to every latent, so only the distribution of the differences
    matters: :math:`\mathbf f` is drawn from :math:`\mathcal N(\boldsymbol\mu, \mathbf P \boldsymbol\Sigma \mathbf P)`,
    :math:`\mathbf P = \mathbf I - \mathbf 1 \mathbf 1^\top / C`, which has the same softmax distribution. A variance
    common to all classes (a kernel shared by the classes puts most of its posterior variance there) therefore
    changes nothing, as it changes nothing in the truth. With :math:`\mathbf P \boldsymbol\Sigma \mathbf P =
    \mathbf R \mathbf R^\top` (eigendecomposition, negative rounding clamped to 0) and base samples
    :math:`\mathbf z_s`,

    .. math::
        \mathbb E[\operatorname{softmax}(\mathbf f)] \approx \frac{1}{S} \sum_{s=1}^{S/2}
        \operatorname{softmax}(\boldsymbol\mu + \mathbf R \mathbf z_s) + \operatorname{softmax}(\boldsymbol\mu -
        \mathbf R \mathbf z_s).

    The base samples are the same on every call (a seeded CPU generator), so predictions are deterministic and
    equal on every device; antithetic pairs cancel the error's first-order term. Its standard error is below
    :math:`0.5 / \sqrt{S}` per probability; :math:`S` = ``settings.softmax_samples`` (1024) by default. Deterministic
    closed-form approximations were tried and dropped: the per-class probit approximation counts the common
    variance (iris test log-loss 0.33 against 0.16), and the pairwise mean-field approximation (Lu, Ie and Sha 2020)
    is too flat at the latent variances of a budgeted solve (digits: 0.78 against 0.60).

    :param mean: ``(..., C)``; :param covariance: ``(..., C, C)``.
    :param num_samples: :math:`S` (even); default ``gpytorch_iterncgp.settings.softmax_samples``.
    """
    num_samples = settings.softmax_samples.value() if num_samples is None else num_samples
    num_latents = mean.shape[-1]
    batch_shape = mean.shape[:-1]
    mean, covariance = mean.reshape(-1, num_latents), covariance.reshape(-1, num_latents, num_latents)
    centred = covariance - covariance.mean(-1, keepdim=True)
    centred = centred - centred.mean(-2, keepdim=True)
    eigenvalues, eigenvectors = torch.linalg.eigh((centred + centred.mT) / 2)
    roots = eigenvectors * eigenvalues.clamp_min(0).sqrt()[..., None, :]  # (points, C, C)
    base = _standard_normal_pairs(max(1, num_samples // 2), num_latents, mean)  # (pairs, C)
    blocks = []
    for start in range(0, len(mean), _SOFTMAX_CHUNK):
        chunk = slice(start, start + _SOFTMAX_CHUNK)
        noise = base @ roots[chunk].mT  # (points, pairs, C)
        centre = mean[chunk, None, :]
        pairs = torch.softmax(centre + noise, dim=-1) + torch.softmax(centre - noise, dim=-1)
        blocks.append(pairs.mean(-2) / 2)
    probabilities = torch.cat(blocks) if blocks else mean.clone()
    return probabilities.reshape(*batch_shape, num_latents)


class LogitBernoulliLikelihood(_OneDimensionalLikelihood):
    r"""Bernoulli likelihood with the logistic link, :math:`p(y = 1 \mid f) = \sigma(f)`; labels in {0, 1}.

    Its :meth:`marginal` integrates the link against the marginals of ``function_dist``,
    :math:`p(y = 1) = \mathbb E[\sigma(f)]`, by quadrature to about 1e-13 (:func:`logistic_gaussian`).
    """

    has_analytic_marginal = True

    def forward(self, function_samples: Tensor, *args, **kwargs) -> Bernoulli:
        return Bernoulli(logits=function_samples)

    def marginal(self, function_dist: MultivariateNormal, *args, **kwargs) -> Bernoulli:
        probabilities = logistic_gaussian(function_dist.mean, function_dist.variance)
        return Bernoulli(probs=probabilities.clamp(0, 1))


class ExpPoissonLikelihood(_OneDimensionalLikelihood):
    r"""Poisson likelihood with the exponential link, :math:`y \sim \operatorname{Poisson}(e^f)`.

    (GPyTorch's :class:`~gpytorch.likelihoods.PoissonLikelihood` uses the softplus link.)
    The expected rate under a Gaussian latent is :math:`e^{\mu + \sigma^2/2}`.
    """

    def forward(self, function_samples: Tensor, *args, **kwargs) -> Poisson:
        return Poisson(rate=function_samples.exp())


class MultitaskPoissonLikelihood(Likelihood):
    r""":math:`C` count outputs per input with the exponential link, :math:`y_{nc} \sim \operatorname{Poisson}(e^{f_{nc}})`,
    independent given the latents :math:`\mathbf f_n \in \mathbb R^C` (which a multitask prior may correlate).

    Targets are ``(N, C)``, data-major like the latents of a ``MultitaskMultivariateNormal(interleaved=True)``.
    :meth:`forward` takes function samples ``(..., N, C)`` and returns independent Poisson distributions with
    event shape ``(C,)``, so that ``log_prob`` of ``(N, C)`` targets is ``(..., N)`` (one factor per input, like
    GPyTorch's ``SoftmaxLikelihood``). For inference by :class:`~gpytorch_iterncgp.IterNCGPStrategy`, missing
    outputs may be ``NaN`` in the training targets (they contribute no likelihood factor); ``log_prob`` itself
    needs complete targets.

    :param num_tasks: :math:`C`, the number of count outputs.

    Example:
        >>> likelihood = MultitaskPoissonLikelihood(num_tasks=3)
        >>> covar_module = gpytorch.kernels.MultitaskKernel(gpytorch.kernels.RBFKernel(), num_tasks=3, rank=1)
    """

    def __init__(self, num_tasks: int):
        super().__init__()
        check_count(num_tasks, "num_tasks", minimum=1)
        self.num_tasks = int(num_tasks)

    def forward(self, function_samples: Tensor, *args, **kwargs) -> Independent:
        return Independent(Poisson(rate=function_samples.exp()), 1)


@dataclass
class LikelihoodDerivatives:
    r""":math:`\ell(\mathbf f)` (scalar), :math:`\mathbf g` ``(N, C)`` and :math:`\mathbf W^{-1}` ``(N C, N C)``."""

    log_likelihood: Tensor
    gradient: Tensor
    noise_inverse: LinearOperator


class LikelihoodAdapter:
    """What the Newton loop needs from a likelihood. Build one with :func:`likelihood_adapter`.

    :param likelihood: the GPyTorch likelihood.
    :param min_curvature: lower bound on the curvature (and on softmax probabilities), which bounds
        :math:`\\mathbf W^{-1}`; ``None``: ``sqrt(finfo(dtype).eps)`` of the latent values.
    """

    num_latents: int = 1
    zero_sum_actions: bool = (
        False  # flat along (1, ..., 1) at every point (softmax, multinomial probit): actions in range(W)
    )
    softmax: bool = False  # the softmax: W from the class probabilities (its block root needs no factorisation)
    name: str = "likelihood"
    classification: bool = False  # labels: predictive_mean gives class probabilities
    predictive_needs_blocks: bool = False  # predictive_mean takes each point's C x C latent covariance
    has_tilted_moments: bool = False  # EP with one scalar site per point (checked_tilted_moments)
    has_block_tilted_moments: bool = False  # EP with C x C site blocks (nested-EP tilted moments)

    def __init__(self, likelihood: Likelihood, min_curvature: float | None = None):
        if min_curvature is not None:
            check_nonnegative(min_curvature, "min_curvature", positive=True)
        self.likelihood = likelihood
        self.min_curvature = None if min_curvature is None else float(min_curvature)

    def _min_curvature(self, dtype: torch.dtype) -> float:
        return math.sqrt(torch.finfo(dtype).eps) if self.min_curvature is None else self.min_curvature

    # -- targets ---------------------------------------------------------------------------------
    def check_targets(self, targets: Tensor, dtype: torch.dtype) -> Tensor:
        """Validate targets ``(N,)`` and return them as a floating tensor of ``dtype``.

        :raises ValueError: naming the problem (shape, empty, NaN/inf, values outside the support).
        :raises TypeError: for a non-tensor or complex targets.
        """
        if not torch.is_tensor(targets):
            raise TypeError(f"train_targets must be a torch.Tensor, got {type(targets).__name__}.")
        if targets.is_complex():
            raise TypeError(f"train_targets must be real (bool, integer or floating point), got dtype {targets.dtype}.")
        if targets.dim() != 1:
            raise ValueError(f"train_targets must be 1-D (N,), got shape {tuple(targets.shape)}.")
        if len(targets) == 0:
            raise ValueError("train_targets is empty: at least one target is needed.")
        if targets.is_floating_point() and not bool(torch.isfinite(targets).all()):
            raise ValueError("train_targets contain NaN or inf.")
        self._check_support(targets)
        return targets.to(dtype)

    def _check_support(self, targets: Tensor) -> None:
        pass

    # -- derivatives -----------------------------------------------------------------------------
    def log_likelihood(self, latent: Tensor, targets: Tensor) -> Tensor:
        r""":math:`\ell(\mathbf f) = \sum_n \log p(y_n \mid \mathbf f_n)` for latents ``(N, C)``."""
        raise NotImplementedError

    def derivatives(self, latent: Tensor, targets: Tensor) -> LikelihoodDerivatives:
        r""":math:`\ell`, :math:`\mathbf g` and the bounded noise :math:`\mathbf W^{-1}` for the Newton loop."""
        raise NotImplementedError

    def local_terms(self, latent: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        r""":math:`\ell` (scalar), :math:`\mathbf g` ``(N, C)`` and the curvature blocks :math:`\mathbf W_n` ``(N, C, C)``.

        Unbounded (no ``min_curvature``) and differentiable with respect to ``latent`` and the likelihood's
        parameters: this is what the Laplace evidence and its gradient are built from.
        """
        raise NotImplementedError

    def project(self, vectors: Tensor) -> Tensor:
        """Projection of data-major actions ``(N C, k)`` (identity unless actions have zero class sum)."""
        return vectors

    def observed_coordinates(self, targets: Tensor) -> Tensor | None:
        r"""Data-major ``(N C,)`` mask of the latents with a likelihood factor, or ``None`` if all have one.

        Where there is none (a missing output), :math:`\mathbf g` and :math:`\mathbf W` are zero and the Newton
        step's regression has no pseudo-observation: IterGP's actions are restricted to the observed coordinates
        (the Laplace covariance is then :math:`\mathbf K - \mathbf K \mathbf P (\mathbf P \hat{\mathbf K}
        \mathbf P)^{+} \mathbf P \mathbf K` with the coordinate projection :math:`\mathbf P`, exactly).
        """
        return None

    # -- expectation propagation -------------------------------------------------------------------
    @property
    def supports_ep(self) -> bool:
        """Whether EP has tilted moments for this likelihood: scalar sites (:math:`C = 1`) or :math:`C \\times C` site
        blocks."""
        return self.has_tilted_moments or self.has_block_tilted_moments

    def checked_tilted_moments(
        self, targets: Tensor, cavity_mean: Tensor, cavity_variance: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        r"""EP's tilted moments :math:`(\log\hat Z_i, \hat\mu_i, \hat\sigma_i^2)` ``(N,)`` each, for targets and
        cavities ``(N,)`` that :func:`~gpytorch_iterncgp.likelihoods.tilted.tilted_moments` has checked and put in its
        working dtype (call that function, not this method).

        :raises TypeError: for a likelihood without scalar tilted moments (``has_tilted_moments`` is false).
        """
        raise TypeError(f"{self.name} has no tilted moments for EP's scalar sites.")

    # -- predictions -----------------------------------------------------------------------------
    def predictive_mean(self, mean: Tensor, variance: Tensor) -> Tensor:
        r""":math:`\mathbb E[y_*]` from the latent marginals: class probabilities or expected counts.

        :math:`C = 1`: ``mean`` and ``variance`` ``(N*,)``. Softmax: ``mean`` ``(N*, C)`` and each point's
        covariance ``(N*, C, C)`` (or marginal variances ``(N*, C)``, see :meth:`SoftmaxAdapter.predictive_mean`).
        """
        raise NotImplementedError(f"{type(self.likelihood).__name__} has no closed-form predictive mean here.")


def _check_class_labels(targets: Tensor, num_classes: int, name: str) -> None:
    if targets.is_floating_point() and bool((targets != targets.round()).any()):
        raise ValueError(f"{name} likelihood: labels must be integers (class indices).")
    bad = (targets < 0) | (targets >= num_classes)
    if bool(bad.any()):
        raise ValueError(
            f"{name} likelihood: labels must lie in [0, {num_classes}); found {targets[bad].unique()[:5].tolist()}."
        )


def _check_binary(targets: Tensor) -> None:
    bad = ~((targets == 0) | (targets == 1))
    if bool(bad.any()):
        raise ValueError(
            "Bernoulli likelihood: labels must be 0 or 1; found "
            f"{targets[bad].unique()[:5].tolist()} at {int(bad.sum())} position(s)."
        )


def _check_counts(targets: Tensor) -> None:
    if bool((targets < 0).any()):
        raise ValueError(f"Poisson likelihood: counts must be non-negative; found {targets[targets < 0][:5].tolist()}.")
    if targets.is_floating_point() and bool((targets != targets.round()).any()):
        bad = targets[targets != targets.round()]
        raise ValueError(f"Poisson likelihood: counts must be integers; found {bad[:5].tolist()}.")


def _monotone_limit(targets: Tensor) -> Tensor:
    r""":math:`+\infty` where :math:`y > 0`, else :math:`-\infty`: the "mode" of a likelihood monotone in :math:`f`,
    increasing for positive labels."""
    return torch.where(targets > 0, math.inf, -math.inf).to(targets)


class _DiagonalAdapter(LikelihoodAdapter):
    r""":math:`C = 1` likelihoods with closed-form per-point terms, and EP's tilted moments by the trapezoid rule at the
    tilted mode (:func:`~gpytorch_iterncgp.likelihoods.tilted.quadrature_moments`) unless a subclass has a closed form.

    The quadrature's per-likelihood parts: :attr:`quadrature_step` (the node spacing :math:`h_\ell` set by the
    strip of analyticity of the likelihood), :meth:`quadrature_log_likelihood` and :meth:`tilted_mode_limit`.
    """

    has_tilted_moments = True
    quadrature_step: float  # h_l: the trapezoid error is ~ exp(-2 pi d / h) for an integrand analytic in |Im f| < d

    def _terms(self, latent: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per point ``(N,)``: log-likelihood, gradient and curvature."""
        raise NotImplementedError

    def _log_terms(self, latent: Tensor, targets: Tensor) -> Tensor:
        return self._terms(latent, targets)[0]

    def log_likelihood(self, latent: Tensor, targets: Tensor) -> Tensor:
        return self._log_terms(latent[:, 0], targets).sum()

    def derivatives(self, latent: Tensor, targets: Tensor) -> LikelihoodDerivatives:
        log_terms, gradient, curvature = self._terms(latent[:, 0], targets)
        noise_inverse = DiagonalNoiseInverse.from_curvature(curvature, self._min_curvature(latent.dtype))
        return LikelihoodDerivatives(log_terms.sum(), gradient[:, None], noise_inverse)

    def local_terms(self, latent: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        log_terms, gradient, curvature = self._terms(latent[:, 0], targets)
        return log_terms.sum(), gradient[:, None], curvature[:, None, None]

    def checked_tilted_moments(
        self, targets: Tensor, cavity_mean: Tensor, cavity_variance: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        return quadrature_moments(self, targets, cavity_mean, cavity_variance)

    def quadrature_log_likelihood(self, latent: Tensor, targets: Tensor) -> Tensor:
        r""":math:`\log p(y \mid f)` elementwise, as the tilted quadrature sums it (shapes broadcast)."""
        return self._log_terms(latent, targets)

    def tilted_mode_limit(self, targets: Tensor, cavity_mean: Tensor, cavity_variance: Tensor, slope: Tensor) -> Tensor:
        r"""A point that the mode of the tilted density :math:`p(y \mid f)\,\mathcal N(f \mid \mu_-, \sigma_-^2)` cannot
        pass on the side of :math:`\mu_-` that ``slope`` (its log-density's slope at :math:`\mu_-`) points to: the
        likelihood's own mode :math:`\arg\max_f \log p(y \mid f)`, here :math:`\pm\infty` (a likelihood monotone in
        :math:`f`, as the Bernoulli links). Shapes ``(N,)``."""
        return _monotone_limit(targets)


class LogitBernoulliAdapter(_DiagonalAdapter):
    name = "Bernoulli (logit link)"
    classification = True
    quadrature_step = 0.6  # sigma(f) has its nearest poles at f = +-i pi

    def _check_support(self, targets: Tensor) -> None:
        _check_binary(targets)

    def _log_terms(self, latent: Tensor, targets: Tensor) -> Tensor:
        return targets * latent - torch.nn.functional.softplus(latent)

    def _terms(self, latent, targets):
        probability = torch.sigmoid(latent)
        # sigma(f) sigma(-f), not p (1 - p): the latter rounds to exactly 0 for |f| > 17 (float32) / 37 (float64).
        return self._log_terms(latent, targets), targets - probability, probability * torch.sigmoid(-latent)

    def predictive_mean(self, mean, variance):
        """:math:`\\mathbb E[\\sigma(f)]` by quadrature (:func:`logistic_gaussian`), not the probit approximation."""
        return logistic_gaussian(mean, variance)


class ProbitBernoulliAdapter(_DiagonalAdapter):
    name = "Bernoulli (probit link)"
    classification = True

    def _check_support(self, targets: Tensor) -> None:
        _check_binary(targets)

    def _log_terms(self, latent: Tensor, targets: Tensor) -> Tensor:
        return torch.special.log_ndtr((2 * targets - 1) * latent)

    def _terms(self, latent, targets):
        sign = 2 * targets - 1
        log_cdf = torch.special.log_ndtr(sign * latent)
        log_pdf = -0.5 * latent.square() - 0.5 * math.log(2 * math.pi)
        ratio = torch.exp(log_pdf - log_cdf)  # phi(f) / Phi(s f), computed in log space
        curvature = (ratio * (ratio + sign * latent)).clamp(0, 1)
        return log_cdf, sign * ratio, curvature

    def predictive_mean(self, mean, variance):
        return torch.special.ndtr(mean / torch.sqrt(1 + variance))

    def checked_tilted_moments(
        self, targets: Tensor, cavity_mean: Tensor, cavity_variance: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The closed form of R&W eq. 3.58 (:func:`~gpytorch_iterncgp.likelihoods.tilted.probit_moments`)."""
        return probit_moments(targets, cavity_mean, cavity_variance)


def _exp_poisson_log_terms(latent: Tensor, targets: Tensor) -> Tensor:
    r""":math:`\log p(y \mid f) = y f - e^f - \log y!` elementwise (exp-link Poisson)."""
    return targets * latent - latent.exp() - torch.lgamma(targets + 1)


def _exp_poisson_terms(latent: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    r"""Elementwise log-likelihood, gradient :math:`y - e^f` and curvature :math:`e^f` (exp-link Poisson)."""
    rate = latent.exp()
    return _exp_poisson_log_terms(latent, targets), targets - rate, rate


class ExpPoissonAdapter(_DiagonalAdapter):
    name = "Poisson (exp link)"
    quadrature_step = 0.3  # exp(-e^f) is bounded for |Im f| <= pi / 2

    def _check_support(self, targets: Tensor) -> None:
        _check_counts(targets)

    def _log_terms(self, latent: Tensor, targets: Tensor) -> Tensor:
        return _exp_poisson_log_terms(latent, targets)

    def _terms(self, latent, targets):
        return _exp_poisson_terms(latent, targets)

    def predictive_mean(self, mean, variance):
        return torch.exp(mean + variance / 2)

    def tilted_mode_limit(self, targets: Tensor, cavity_mean: Tensor, cavity_variance: Tensor, slope: Tensor) -> Tensor:
        r"""The likelihood's mode :math:`\log y` (:math:`y = e^f`) for :math:`y > 0`; for :math:`y = 0` (decreasing in
        :math:`f`) the tilted mode :math:`\mu_- - W_0(\sigma_-^2 e^{\mu_-})` is above
        :math:`\mu_- - \log(1 + \sigma_-^2 e^{\mu_-})` (Lambert's :math:`W_0`)."""
        own = torch.where(targets > 0, targets.clamp_min(1).log(), _monotone_limit(targets))
        lambert = cavity_mean - torch.nn.functional.softplus(cavity_mean + cavity_variance.log())
        return torch.where((targets == 0) & (slope < 0), lambert, own)


class NegativeBinomialAdapter(_DiagonalAdapter):
    r"""The negative binomial likelihood with the exp link (:class:`~.negative_binomial.NegativeBinomialLikelihood`),
    dispersion :math:`r`: with :math:`z = f - \log r` and :math:`s = \sigma(z) = \mu / (r + \mu)`,
    :math:`\log p = \log\Gamma(y + r) - \log\Gamma(r) - \log y! + y \log\sigma(z) + r \log\sigma(-z)`,
    :math:`g = y - (y + r) s`, :math:`W = (y + r) s (1 - s)`; differentiable in :math:`r` (the evidence's gradient).
    EP has no tilted moments for it here (Laplace only)."""

    name = "negative binomial (exp link)"
    has_tilted_moments = False

    def _check_support(self, targets: Tensor) -> None:
        _check_counts(targets)

    def _terms(self, latent, targets):
        dispersion = self.likelihood.dispersion.to(latent)
        logits = latent - dispersion.log()
        log_terms = (
            torch.lgamma(targets + dispersion)
            - torch.lgamma(dispersion)
            - torch.lgamma(targets + 1)
            + targets * torch.nn.functional.logsigmoid(logits)
            + dispersion * torch.nn.functional.logsigmoid(-logits)
        )
        total, share = targets + dispersion, torch.sigmoid(logits)  # s = mu / (r + mu)
        return log_terms, targets - total * share, total * share * torch.sigmoid(-logits)

    def checked_tilted_moments(
        self, targets: Tensor, cavity_mean: Tensor, cavity_variance: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        raise TypeError(f"{self.name} has no tilted moments for EP here: fit it by Laplace (IterNCGPStrategy).")

    def predictive_mean(self, mean, variance):
        r""":math:`\mathbb E[y_*] = \mathbb E[e^{f_*}] = e^{\mu + \sigma^2 / 2}`."""
        return torch.exp(mean + variance / 2)


class MultitaskPoissonAdapter(LikelihoodAdapter):
    r""":math:`C` exp-link Poisson outputs per point (:class:`MultitaskPoissonLikelihood`), targets ``(N, C)``.

    The outputs are independent given the latents, so :math:`\mathbf W` is diagonal: the exp-Poisson terms of
    :class:`ExpPoissonAdapter` elementwise on ``(N, C)``, :math:`g_{nc} = y_{nc} - e^{f_{nc}}`, :math:`w_{nc} = e^{f_{nc}}`.
    The prior couples the outputs (a ``MultitaskKernel`` or ``LCMKernel``), not the likelihood.

    A missing output (``NaN`` target) has no likelihood factor: :math:`\ell` omits it and :math:`g_{nc} = w_{nc} = 0`
    there, so the exact Laplace posterior of that latent is the prior's, conditioned on the other outputs through the
    prior's correlations. The Newton loop's regression has no pseudo-observation there: IterGP's actions and
    residuals are restricted to the observed coordinates (:meth:`observed_coordinates`), so the bounded noise
    :math:`1 / \text{min\_curvature}` that :class:`DiagonalNoiseInverse` puts at those entries is never used.
    """

    name = "multitask Poisson (exp link)"

    def __init__(self, likelihood: MultitaskPoissonLikelihood, min_curvature: float | None = None):
        super().__init__(likelihood, min_curvature)
        self.num_latents = likelihood.num_tasks

    def check_targets(self, targets: Tensor, dtype: torch.dtype) -> Tensor:
        """Validate counts ``(N, C)`` (``NaN``: a missing output) and return them as a floating tensor of ``dtype``.

        :raises ValueError: for another shape, no targets, inf, or observed counts that are negative or fractional.
        :raises TypeError: for a non-tensor or complex targets.
        """
        if not torch.is_tensor(targets):
            raise TypeError(f"train_targets must be a torch.Tensor, got {type(targets).__name__}.")
        if targets.is_complex():
            raise TypeError(f"train_targets must be real (integer or floating point), got dtype {targets.dtype}.")
        if targets.dim() != 2 or targets.shape[-1] != self.num_latents:
            raise ValueError(
                f"{type(self.likelihood).__name__}(num_tasks={self.num_latents}) needs train_targets of shape "
                f"(N, {self.num_latents}) (NaN for a missing output), got shape {tuple(targets.shape)}."
            )
        if len(targets) == 0:
            raise ValueError("train_targets is empty: at least one target is needed.")
        if targets.is_floating_point() and bool(torch.isinf(targets).any()):
            raise ValueError("train_targets contain inf (use NaN for a missing output).")
        _check_counts(targets[~torch.isnan(targets)] if targets.is_floating_point() else targets)
        return targets.to(dtype)

    def observed_coordinates(self, targets: Tensor) -> Tensor | None:
        observed = ~torch.isnan(targets)
        return None if bool(observed.all()) else observed.reshape(-1)

    def _observed_terms(self, latent: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per output ``(N, C)``: log-likelihood, gradient and curvature, zero where the target is missing."""
        observed = ~torch.isnan(targets)
        terms = _exp_poisson_terms(latent, torch.where(observed, targets, 0))
        zero = latent.new_zeros(())
        return tuple(torch.where(observed, term, zero) for term in terms)  # type: ignore[return-value]

    def log_likelihood(self, latent: Tensor, targets: Tensor) -> Tensor:
        observed = ~torch.isnan(targets)
        log_terms = _exp_poisson_log_terms(latent, torch.where(observed, targets, 0))
        return torch.where(observed, log_terms, latent.new_zeros(())).sum()

    def derivatives(self, latent: Tensor, targets: Tensor) -> LikelihoodDerivatives:
        log_terms, gradient, curvature = self._observed_terms(latent, targets)
        noise_inverse = DiagonalNoiseInverse.from_curvature(curvature.reshape(-1), self._min_curvature(latent.dtype))
        return LikelihoodDerivatives(log_terms.sum(), gradient, noise_inverse)

    def local_terms(self, latent: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        log_terms, gradient, curvature = self._observed_terms(latent, targets)
        return log_terms.sum(), gradient, torch.diag_embed(curvature)

    def predictive_mean(self, mean, variance):
        r"""Expected counts :math:`e^{\mu_c + \sigma_c^2 / 2}` ``(N*, C)`` from the latent marginals ``(N*, C)``."""
        return torch.exp(mean + variance / 2)


def _softplus(latent: Tensor) -> Tensor:
    r""":math:`\log(1 + e^f)`; torch's default returns :math:`f` itself above 20, off by :math:`e^{-20}` = 2e-9 there."""
    return torch.nn.functional.softplus(latent, threshold=40)


def _log_softplus(latent: Tensor) -> Tensor:
    r""":math:`\log \log(1 + e^f)`, accurate where :math:`f \ll 0` (there :math:`\approx f - e^f / 2`)."""
    safe = torch.where(latent < -20, torch.zeros_like(latent), latent)
    return torch.where(latent < -20, latent - latent.exp() / 2, torch.log(_softplus(safe)))


class SoftplusPoissonAdapter(_DiagonalAdapter):
    name = "Poisson (softplus link)"
    quadrature_step = 0.6  # log(1 + e^f) has its nearest branch points at f = +-i pi

    def _check_support(self, targets: Tensor) -> None:
        _check_counts(targets)

    def _log_terms(self, latent: Tensor, targets: Tensor) -> Tensor:
        rate = _softplus(latent)
        return targets * _log_softplus(latent) - rate - torch.lgamma(targets + 1)

    def _terms(self, latent, targets):
        rate = _softplus(latent)
        log_rate = _log_softplus(latent)
        slope = torch.sigmoid(latent)  # lambda'
        bend = slope * torch.sigmoid(-latent)  # lambda''
        ratio = torch.exp(torch.nn.functional.logsigmoid(latent) - log_rate)  # lambda' / lambda
        gradient = targets * ratio - slope
        curvature = targets * ratio * (ratio - torch.sigmoid(-latent)) + bend
        log_terms = targets * log_rate - rate - torch.lgamma(targets + 1)
        return log_terms, gradient, curvature.clamp_min(0)

    def predictive_mean(self, mean, variance):
        """:math:`\\mathbb E[\\log(1 + e^f)]` by 40-point Gauss–Hermite quadrature (float64 nodes)."""
        return gaussian_expectation(torch.nn.functional.softplus, mean, variance, num_nodes=40)

    def quadrature_log_likelihood(self, latent: Tensor, targets: Tensor) -> Tensor:
        r""":math:`\log p(y \mid f)` with the rate :math:`\log(1 + e^f)` by ``logaddexp`` (torch's ``softplus`` at its
        default threshold returns :math:`f` for :math:`f > 20`, an error of :math:`e^{-20} \approx 2 \cdot 10^{-9}` in
        the rate that shows in tilted moments of large counts), and :math:`\log\log(1 + e^f) \approx f - e^f / 2`
        below :math:`f = -20`."""
        rate = torch.logaddexp(latent, torch.zeros_like(latent))
        small = latent < -20  # log log(1 + e^f) = f - e^f / 2 + O(e^2f)
        log_rate = torch.where(small, latent - latent.exp() / 2, torch.where(small, 1.0, rate).log())
        return targets * log_rate - rate - torch.lgamma(targets + 1)

    def tilted_mode_limit(self, targets: Tensor, cavity_mean: Tensor, cavity_variance: Tensor, slope: Tensor) -> Tensor:
        r"""The likelihood's mode :math:`f = y + \log(1 - e^{-y})` (where :math:`\log(1 + e^f) = y`) for :math:`y > 0`,
        :math:`-\infty` for :math:`y = 0`."""
        safe = targets.clamp_min(1)
        return torch.where(targets > 0, safe + torch.log(-torch.expm1(-safe)), _monotone_limit(targets))


def _log_softmax(latent: Tensor) -> Tensor:
    """``log_softmax`` over the last dimension as ``(f - max f) - log sum exp(f - max f)``, the sum over classes a
    product with a vector of ones: the same values, and faster than ``torch.log_softmax`` on the CPU for few classes
    (torch's reductions over a few contiguous entries are slow; ``docs/design_notes.md``), where the Newton loop
    evaluates it about a dozen times per step."""
    shifted = latent - latent.amax(dim=-1, keepdim=True)
    return shifted - (shifted.exp() @ latent.new_ones(latent.shape[-1], 1)).log_()


class SoftmaxAdapter(LikelihoodAdapter):
    r"""Softmax over :math:`C` classes: :math:`\mathbf W^{-1}` is the pseudo-inverse of Lemma A.7.

    Actions are projected to zero sum over classes, so that IterGP's covariance converges to the
    Laplace covariance :math:`(\mathbf K^{-1} + \mathbf W)^{-1}` (paper, Lemma A.7 and App. B.1). Probabilities are bounded
    below by ``min_curvature`` (default ``max(1e-6, sqrt(eps))``) inside :math:`\mathbf W^+` (saturated
    softmax outputs). Any such bound changes the Newton direction, not the mode (its fixed point is
    :math:`\mathbf a = \mathbf g`), and the covariance only where a probability is below it.
    """

    zero_sum_actions = True
    softmax = True
    name = "Softmax"
    classification = True
    predictive_needs_blocks = True

    def _min_curvature(self, dtype: torch.dtype) -> float:
        # Probabilities below 1e-6 make W⁺ so large on confidently wrong points that a few CG iterations
        # are spent on them alone; the bound changes the Newton direction, not the mode.
        return max(1e-6, super()._min_curvature(dtype)) if self.min_curvature is None else self.min_curvature

    def __init__(self, likelihood: SoftmaxLikelihood, min_curvature: float | None = None):
        super().__init__(likelihood, min_curvature)
        if likelihood.mixing_weights is not None:
            raise ValueError(
                "SoftmaxLikelihood with mixing_weights=True mixes the latent functions with a learnt C×C matrix, "
                "which IterNCGP does not support: use SoftmaxLikelihood(num_classes=C, mixing_weights=False) and "
                "one latent GP per class."
            )
        self.num_latents = likelihood.num_classes

    def _check_support(self, targets: Tensor) -> None:
        _check_class_labels(targets, self.num_latents, "Softmax")

    def log_likelihood(self, latent: Tensor, targets: Tensor) -> Tensor:
        return _log_softmax(latent).gather(-1, targets.long()[:, None]).sum()

    def _softmax_terms(self, latent: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        r"""Log-likelihood, gradient :math:`\mathbf y - \boldsymbol\pi` (one-hot :math:`\mathbf y`) and probabilities
        :math:`\boldsymbol\pi`, ``(N, C)``; the one-hot targets by indexing, never formed."""
        log_probs = _log_softmax(latent)
        probabilities = log_probs.exp()
        labels = targets.long()[:, None]
        gradient = (-probabilities).scatter_add_(-1, labels, torch.ones_like(labels, dtype=latent.dtype))
        return log_probs.gather(-1, labels).sum(), gradient, probabilities

    def derivatives(self, latent: Tensor, targets: Tensor) -> LikelihoodDerivatives:
        log_likelihood, gradient, probabilities = self._softmax_terms(latent, targets)
        noise_inverse = SoftmaxPseudoInverse.from_probabilities(probabilities, self._min_curvature(latent.dtype))
        return LikelihoodDerivatives(log_likelihood, gradient, noise_inverse)

    def local_terms(self, latent: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        log_likelihood, gradient, probabilities = self._softmax_terms(latent, targets)
        curvature = torch.diag_embed(probabilities) - probabilities[:, :, None] * probabilities[:, None, :]
        return log_likelihood, gradient, curvature

    def project(self, vectors: Tensor) -> Tensor:
        return project_to_zero_sum(vectors, self.num_latents)

    def predictive_mean(self, mean, variance):
        r"""Class probabilities :math:`\mathbb E[\operatorname{softmax}(\mathbf f)]` ``(N*, C)`` by Monte Carlo
        over the differences of the latents with fixed base samples (:func:`softmax_gaussian`).

        :param mean: latent means ``(N*, C)``.
        :param variance: each point's :math:`C \times C` latent covariance ``(N*, C, C)``
            (:meth:`~gpytorch_iterncgp.IterNCGPStrategy.marginal_latent_blocks`), or marginal variances
            ``(N*, C)``, taken as a diagonal covariance (right for independent latents only: with a kernel shared
            by the classes the latents are strongly correlated, and their common variance does not change the
            softmax).
        """
        covariance = variance if variance.dim() == mean.dim() + 1 else torch.diag_embed(variance)
        return softmax_gaussian(mean, covariance)


class AutogradAdapter(LikelihoodAdapter):
    r"""Any factorising likelihood: :math:`\mathbf g` and the :math:`C \times C` blocks of :math:`\mathbf W` by autograd.

    Uses ``likelihood.forward(f).log_prob(y)``. :math:`C` is 1 unless the likelihood has ``num_classes``
    or ``num_tasks``. Raises a ``ValueError`` if :math:`\mathbf W` is not positive semi-definite at the
    current latent values (the likelihood is not log-concave there).
    """

    name = "autograd"

    def __init__(self, likelihood: Likelihood, min_curvature: float | None = None):
        super().__init__(likelihood, min_curvature)
        self.num_latents = int(getattr(likelihood, "num_classes", None) or getattr(likelihood, "num_tasks", None) or 1)
        self.name = type(likelihood).__name__

    def _distribution(self, latent: Tensor):
        return self.likelihood.forward(latent[:, 0] if self.num_latents == 1 else latent)

    def _check_support(self, targets: Tensor) -> None:
        support = getattr(self._distribution(torch.zeros(len(targets), self.num_latents)), "support", None)
        if support is not None and not bool(support.check(targets.double()).all()):
            raise ValueError(f"{self.name}: train_targets lie outside the likelihood's support ({support}).")

    def log_likelihood(self, latent: Tensor, targets: Tensor) -> Tensor:
        return self._distribution(latent).log_prob(targets).sum()

    def local_terms(self, latent: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        with torch.enable_grad():
            if not latent.requires_grad:
                latent = latent.detach().requires_grad_(True)
            log_likelihood = self.log_likelihood(latent, targets)
            (gradient,) = torch.autograd.grad(log_likelihood, latent, create_graph=True)
            # The log-likelihood factorises over data points, so row c of every block is the
            # gradient of sum_n g_nc.
            rows = [
                torch.autograd.grad(-gradient[:, c].sum(), latent, create_graph=True)[0]
                for c in range(self.num_latents)
            ]
        return log_likelihood, gradient, torch.stack(rows, dim=-2)

    def derivatives(self, latent: Tensor, targets: Tensor) -> LikelihoodDerivatives:
        log_likelihood, gradient, curvature = (term.detach() for term in self.local_terms(latent, targets))
        if not (bool(torch.isfinite(curvature).all()) and bool(torch.isfinite(gradient).all())):
            # The Newton loop stops on it with a NumericalBreakdownWarning, as for the closed forms.
            nan = torch.full_like(gradient, math.nan)
            return LikelihoodDerivatives(log_likelihood, nan, DiagonalNoiseInverse(nan.reshape(-1)))
        min_curvature = self._min_curvature(latent.dtype)
        scale = curvature.diagonal(dim1=-2, dim2=-1).abs().max().clamp_min(1.0)
        smallest = torch.linalg.eigvalsh(curvature).min() if self.num_latents > 1 else curvature.min()
        if smallest < -1e3 * torch.finfo(latent.dtype).eps * scale:
            raise ValueError(
                f"{self.name} is not log-concave at the current latent values: W = -d²log p(y|f)/df² has an "
                f"eigenvalue {float(smallest):.3g} < 0, so Newton's method / Laplace inference cannot use it."
            )
        if self.num_latents == 1:
            noise_inverse = DiagonalNoiseInverse.from_curvature(curvature[:, 0, 0], min_curvature)
        else:
            noise_inverse = BlockNoiseInverse.from_curvature(curvature, min_curvature)
        return LikelihoodDerivatives(log_likelihood, gradient, noise_inverse)


class MultinomialProbitAdapter(AutogradAdapter):
    r"""The multinomial probit likelihood over :math:`C` classes (:class:`~.multinomial_probit.MultinomialProbitLikelihood`).

    :math:`p(y \mid \mathbf f)` depends on :math:`\mathbf f` only through its differences, so the likelihood is flat
    along :math:`\mathbf 1` at every point: IterGP's actions are projected to zero sum over the classes (as for the
    softmax), and EP's :math:`C \times C` sites have the null space :math:`\mathbf 1` (rank :math:`C - 1`). EP's tilted
    moments are nested EP (:func:`~.multinomial_probit.multinomial_probit_moments`); Laplace's derivatives come from
    autograd through the quadrature (the likelihood is log-concave).
    """

    zero_sum_actions = True
    classification = True
    predictive_needs_blocks = True
    has_block_tilted_moments = True

    def __init__(self, likelihood: MultinomialProbitLikelihood, min_curvature: float | None = None):
        super().__init__(likelihood, min_curvature)
        self.num_latents = likelihood.num_classes
        self.name = "MultinomialProbit"

    def _check_support(self, targets: Tensor) -> None:
        _check_class_labels(targets, self.num_latents, self.name)

    def project(self, vectors: Tensor) -> Tensor:
        return project_to_zero_sum(vectors, self.num_latents)

    def predictive_mean(self, mean, variance):
        r"""Class probabilities :math:`\int p(y_* = c \mid \mathbf f)\, \mathcal N(\mathbf f \mid \boldsymbol\mu,
        \boldsymbol\Sigma)\, d\mathbf f` ``(N*, C)``: for each class, the normaliser :math:`\hat Z` of nested EP with the
        predictive as its "cavity" (Riihimäki et al. 2013, sec. 5), normalised over the classes (the nested-EP
        values sum to 1 up to its approximation error, exact for :math:`C = 2`); the inner EP to
        :data:`~.multinomial_probit.PREDICTIVE_TOL`.

        :param mean: latent means ``(N*, C)``.
        :param variance: each point's latent covariance ``(N*, C, C)``, or marginal variances ``(N*, C)`` taken as a
            diagonal covariance.
        """
        covariance = variance if variance.dim() == mean.dim() + 1 else torch.diag_embed(variance)
        labels = torch.arange(self.num_latents, device=mean.device).repeat_interleave(len(mean))
        log_z = multinomial_probit_moments(
            labels, mean.repeat(self.num_latents, 1), covariance.repeat(self.num_latents, 1, 1), tol=PREDICTIVE_TOL
        )[0]
        return torch.softmax(log_z.reshape(self.num_latents, -1).mT, dim=-1)


def likelihood_adapter(likelihood: Likelihood, min_curvature: float | None = None) -> LikelihoodAdapter:
    """The adapter for a GPyTorch likelihood: closed forms where known, autograd otherwise.

    :raises TypeError: if ``likelihood`` is not a GPyTorch likelihood.
    :raises ValueError: for likelihoods that are known not to be log-concave.
    """
    if not isinstance(likelihood, Likelihood):
        raise TypeError(f"likelihood must be a gpytorch.likelihoods.Likelihood, got {type(likelihood).__name__}.")
    if isinstance(likelihood, StudentTLikelihood):
        raise ValueError(
            "StudentTLikelihood is not log-concave (its curvature turns negative for large residuals), so the "
            "Laplace approximation by Newton's method is not defined for it."
        )
    closed_forms = [
        (LogitBernoulliLikelihood, LogitBernoulliAdapter),
        (BernoulliLikelihood, ProbitBernoulliAdapter),
        (ExpPoissonLikelihood, ExpPoissonAdapter),
        (MultitaskPoissonLikelihood, MultitaskPoissonAdapter),
        (PoissonLikelihood, SoftplusPoissonAdapter),
        (SoftmaxLikelihood, SoftmaxAdapter),
        (MultinomialProbitLikelihood, MultinomialProbitAdapter),
        (NegativeBinomialLikelihood, NegativeBinomialAdapter),
    ]
    for likelihood_type, adapter_type in closed_forms:
        if type(likelihood) is likelihood_type:
            return adapter_type(likelihood, min_curvature)
    return AutogradAdapter(likelihood, min_curvature)
