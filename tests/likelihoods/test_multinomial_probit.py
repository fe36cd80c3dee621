r"""The multinomial probit likelihood and its tilted moments by nested EP, against independent references.

* the likelihood against scipy's ``quad`` over :math:`u` and, for :math:`C = 2`, the closed form
  :math:`\Phi((f_c - f_j)/\sqrt 2)`;
* nested EP for :math:`C = 2` (one probit factor: exact) against the binary probit's closed-form tilted moments
  (R&W eq. 3.58) in the difference :math:`f_c - f_j`, mapped back by Gaussian conditioning;
* nested EP against a textbook dense implementation of the same algorithm (sequential EP in
  :math:`\mathbf w = (\mathbf f, u)`, numpy, one point at a time), which it must equal to rounding;
* nested EP for :math:`C = 3` against brute-force tilted moments (tensor-product Gauss–Hermite in the whitened
  cavity coordinates, :math:`p(y \mid \mathbf f)` by the trapezoid rule over :math:`u`; its :math:`\hat Z` checked
  against scipy's bivariate normal CDF), within the accuracy that the approximation reaches;
* the dense multi-class EP reference (``reference_ep.multiclass_parallel_ep``): exact for one point and, for
  :math:`C = 2`, equal to binary probit EP in :math:`(f_1 - f_0)/\sqrt 2`; for :math:`C = 3` against Gibbs sampling
  (posterior moments) and importance sampling (evidence);
* EP's own identities: :math:`\partial\log\hat Z/\partial\mathbf m = \mathbf S^{-1}(\hat{\boldsymbol\mu} - \mathbf m)`
  and :math:`\partial\log\hat Z/\partial\mathbf S = \tfrac12\mathbf S^{-1}(\hat{\boldsymbol\Sigma} +
  \boldsymbol\delta\boldsymbol\delta^\top - \mathbf S)\mathbf S^{-1}` (they hold at the inner fixed point), and the
  invariance under adding a constant to all latent values.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gpytorch.distributions import MultitaskMultivariateNormal
from scipy import integrate, special, stats
from torch import Tensor

from gpytorch_iterncgp.likelihoods.multinomial_probit import (
    PREDICTIVE_TOL,
    InnerSites,
    MultinomialProbitLikelihood,
    _log_cdf,
    multinomial_probit_log_probabilities,
    multinomial_probit_moments,
)
from tests import reference_ep

F64 = torch.float64


def _cavities(num_points: int, num_classes: int, mean_scale: float, covariance_scale: float, seed: int):
    """Random cavities: means ``N(0, mean_scale^2)``, covariances ``covariance_scale * A A^T / C + 0.05 I``."""
    generator = torch.Generator().manual_seed(seed)
    mean = mean_scale * torch.randn(num_points, num_classes, generator=generator, dtype=F64)
    root = torch.randn(num_points, num_classes, num_classes, generator=generator, dtype=F64)
    covariance = covariance_scale * root @ root.mT / num_classes + 0.05 * torch.eye(num_classes, dtype=F64)
    targets = torch.randint(0, num_classes, (num_points,), generator=generator)
    return targets, mean, covariance


# ---------------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------------
def _quad_probability(f: np.ndarray, c: int) -> float:
    """p(y = c | f) by scipy's quad over u, split at 0."""
    d = f[c] - np.delete(f, c)

    def integrand(u):
        return math.exp(-0.5 * u * u - 0.5 * math.log(2 * math.pi) + special.log_ndtr(u + d).sum())

    options = dict(epsabs=1e-15, epsrel=1e-13, limit=200)
    return integrate.quad(integrand, -np.inf, 0, **options)[0] + integrate.quad(integrand, 0, np.inf, **options)[0]


def _binary_tilted(targets, mean, covariance):
    r"""C = 2: p(y = c | f) = Phi(d / sqrt 2), d = f_c - f_j; the tilted moments of d by R&W eq. 3.58 (probit in
    d / sqrt 2, i.e. noise variance 2), then f's by Gaussian conditioning on d."""
    n = len(targets)
    direction = torch.zeros(n, 2, dtype=F64)
    direction[torch.arange(n), targets] = 1.0
    direction[torch.arange(n), 1 - targets] = -1.0
    mean_d = (direction * mean).sum(-1)
    cov_fd = (covariance @ direction.unsqueeze(-1)).squeeze(-1)  # Cov(f, d)
    var_d = (direction * cov_fd).sum(-1)
    z = mean_d / torch.sqrt(2 + var_d)
    log_z = torch.special.log_ndtr(z)
    ratio = torch.exp(-0.5 * z**2 - 0.5 * math.log(2 * math.pi) - log_z)
    tilted_mean_d = mean_d + var_d * ratio / torch.sqrt(2 + var_d)
    tilted_var_d = var_d - var_d**2 * ratio * (z + ratio) / (2 + var_d)
    gain = cov_fd / var_d.unsqueeze(-1)  # E[f | d] = m + gain (d - mean_d)
    tilted_mean = mean + gain * (tilted_mean_d - mean_d).unsqueeze(-1)
    tilted_cov = covariance + (tilted_var_d - var_d)[:, None, None] * gain.unsqueeze(-1) * gain.unsqueeze(-2)
    return log_z, tilted_mean, tilted_cov


def _dense_nested_ep(c: int, m: np.ndarray, S: np.ndarray, sweeps: int = 60):
    """Textbook sequential EP in w = (f, u) (Riihimaki et al. 2013, appendix A): posterior recomputed by matrix
    inversion before each site update, log Z as the EP normaliser A(post) - A(prior) + sum_j [log Zhat_j + A(cavity_j)
    - A(marginal_j)], A(m, V) = m^T V^-1 m / 2 + log|V| / 2. One point, numpy."""
    C = len(m)
    others = [j for j in range(C) if j != c]
    B = np.zeros((C - 1, C + 1))
    for k, j in enumerate(others):
        B[k, C], B[k, c], B[k, j] = 1.0, 1.0, -1.0
    m0 = np.append(m, 0.0)
    V0 = np.zeros((C + 1, C + 1))
    V0[:C, :C], V0[C, C] = S, 1.0
    P0 = np.linalg.inv(V0)
    tau, nu = np.zeros(C - 1), np.zeros(C - 1)

    def post():
        V = np.linalg.inv(P0 + B.T @ np.diag(tau) @ B)
        return V @ (P0 @ m0 + B.T @ nu), V

    def cavity(k, mu, V):
        vi, mi = B[k] @ V @ B[k], B[k] @ mu
        vc = 1 / (1 / vi - tau[k])
        return vi, mi, vc, vc * (mi / vi - nu[k])

    for _ in range(sweeps):
        for k in range(C - 1):
            _, _, vc, mc = cavity(k, *post())
            z = mc / math.sqrt(1 + vc)
            rho = math.exp(-0.5 * z * z - 0.5 * math.log(2 * math.pi) - special.log_ndtr(z))
            m_hat = mc + vc * rho / math.sqrt(1 + vc)
            v_hat = vc - vc**2 * rho * (z + rho) / (1 + vc)
            tau[k], nu[k] = 1 / v_hat - 1 / vc, m_hat / v_hat - mc / vc
    mu, V = post()

    def log_normaliser(mean, cov):
        return 0.5 * mean @ np.linalg.solve(cov, mean) + 0.5 * np.linalg.slogdet(cov)[1]

    log_z = log_normaliser(mu, V) - log_normaliser(m0, V0)
    for k in range(C - 1):
        vi, mi, vc, mc = cavity(k, mu, V)
        log_z += special.log_ndtr(mc / math.sqrt(1 + vc)) + 0.5 * mc**2 / vc + 0.5 * math.log(vc)
        log_z -= 0.5 * mi**2 / vi + 0.5 * math.log(vi)
    return log_z, mu[:C], V[:C, :C], tau, nu


def _quadrature_tilted(c: int, m: Tensor, S: Tensor, nodes: int = 40, step: float = 0.4, reach: float = 12.0):
    r"""Brute-force tilted moments for C = 3: Gauss–Hermite (``nodes`` per axis) in the whitened cavity coordinates
    f = m + L x, with p(y = c | f) by the trapezoid rule over u in [-reach, reach] (``step``; its error is below
    exp(-2 pi^2 sigma^2 / step^2) ~ 1e-17 for the integrand's width sigma >= 1/sqrt 3)."""
    x, w = np.polynomial.hermite_e.hermegauss(nodes)
    x, w = torch.tensor(x), torch.tensor(w / w.sum())
    grid = torch.stack(torch.meshgrid(x, x, x, indexing="ij"), -1).reshape(-1, 3)
    weight = (w[:, None, None] * w[None, :, None] * w[None, None, :]).reshape(-1)
    f = m + grid @ torch.linalg.cholesky(S).mT
    u = torch.arange(-reach, reach + step / 2, step, dtype=F64)
    others = [j for j in range(3) if j != c]
    d = f[:, c : c + 1] - f[:, others]  # (M, 2)
    log_integrand = (
        -0.5 * u**2 - 0.5 * math.log(2 * math.pi) + torch.special.log_ndtr(u[:, None] + d[:, None, :]).sum(-1)
    )
    likelihood = step * log_integrand.exp().sum(-1)
    mass = weight * likelihood
    z = mass.sum()
    mean = mass @ f / z
    centred = f - mean
    return z.log().item(), mean, (centred * mass[:, None]).mT @ centred / z


# ---------------------------------------------------------------------------------------------------
# The likelihood
# ---------------------------------------------------------------------------------------------------
def test_likelihood_matches_quad_and_sums_to_one():
    """Measured: |p - quad| <= 3e-16 over C = 2..6, f ~ N(0, 3^2); the class probabilities sum to 1 within 3e-16
    (before the Categorical normalises them). Asserted 1e-12 and 1e-13."""
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for num_classes in range(2, 7):
        f = 3 * torch.randn(4, num_classes, generator=generator, dtype=F64)
        log_p = multinomial_probit_log_probabilities(f)
        assert torch.logsumexp(log_p, -1).abs().max() < 1e-13
        for row, row_log_p in zip(f.numpy(), log_p, strict=True):
            for c in range(num_classes):
                worst = max(worst, abs(math.exp(row_log_p[c]) - _quad_probability(row, c)))
    assert worst < 1e-12, worst


def test_likelihood_keeps_relative_accuracy_for_improbable_classes():
    r"""C = 2: p(y = c | f) = Phi((f_c - f_j) / sqrt 2) exactly; the adaptive rule keeps log p to rounding even where
    p is 1e-200 (measured 1.4e-14 relative in log p). C = 3 with one class far behind (p ~ 6e-19): log p against quad
    of the integrand rescaled near its peak (measured equal to rounding)."""
    d = torch.tensor([-40.0, -20.0, -5.0, -1.0, 0.0, 1.0, 5.0, 20.0], dtype=F64)
    f = torch.stack([torch.zeros_like(d), d], -1)  # class 1 leads class 0 by d
    log_p = multinomial_probit_log_probabilities(f)
    exact = torch.special.log_ndtr(d / math.sqrt(2))
    assert ((log_p[:, 1] - exact).abs() / exact.abs().clamp_min(1)).max() < 1e-12
    assert ((log_p[:, 0] - torch.special.log_ndtr(-d / math.sqrt(2))).abs() / exact.abs().clamp_min(1)).max() < 1e-12

    row = np.array([-8.0, 2.0, 3.0])  # class 0 is 10 and 11 behind: p ~ 1e-23
    peak = 5.5  # log of the integrand is concave; rescaling by its value near the peak keeps quad's relative accuracy
    d0 = row[0] - row[1:]
    scale = stats.norm.logpdf(peak) + stats.norm.logcdf(peak + d0).sum()
    value = integrate.quad(
        lambda u: math.exp(stats.norm.logpdf(u) + stats.norm.logcdf(u + d0).sum() - scale),
        -np.inf,
        np.inf,
        epsabs=1e-15,
        epsrel=1e-13,
        points=None,
        limit=200,
    )[0]
    log_p0 = multinomial_probit_log_probabilities(torch.tensor(row))[0].item()
    assert log_p0 < -40 and abs(log_p0 - (math.log(value) + scale)) < 1e-10


def test_likelihood_is_shaped_like_gpytorch_softmax_and_differentiable():
    likelihood = MultinomialProbitLikelihood(num_classes=4)
    assert likelihood.num_classes == 4
    f = torch.randn(2, 3, 4, dtype=F64, requires_grad=True)  # (samples, N, C)
    conditional = likelihood(f)
    assert isinstance(conditional, torch.distributions.Categorical)
    assert conditional.batch_shape == (2, 3) and conditional.probs.shape == (2, 3, 4)
    labels = torch.randint(0, 4, (2, 3))
    assert torch.autograd.gradcheck(
        lambda g: likelihood(g).log_prob(labels), (f,), eps=1e-6, atol=1e-7, rtol=1e-6
    )  # the gradient of the quadrature (mode and width held fixed) is the quadrature of the gradient
    # float32 in, float32 out, equal to float64 to float32's precision
    f32 = f.detach().float().requires_grad_()
    probs32 = likelihood(f32).probs
    assert probs32.dtype == torch.float32
    assert (probs32.double() - conditional.probs.detach()).abs().max() < 1e-6
    probs32[..., 0].sum().backward()
    assert f32.grad is not None and torch.isfinite(f32.grad).all()
    # adding a constant to every latent value changes nothing
    assert (likelihood(f.detach() + 7.0).probs - conditional.probs.detach()).abs().max() < 1e-13
    # the marginal: the base class's Monte Carlo over a MultitaskMultivariateNormal (N, C)
    mean = torch.randn(5, 4, dtype=F64)
    marginal = likelihood(MultitaskMultivariateNormal(mean, torch.eye(20, dtype=F64)))
    assert marginal.probs.shape[-2:] == (5, 4) and torch.allclose(marginal.probs.sum(-1), torch.ones((), dtype=F64))


@pytest.mark.parametrize("num_classes", [1, 0, 2.5, True, None])
def test_likelihood_refuses_bad_num_classes(num_classes):
    with pytest.raises(ValueError, match="num_classes"):
        MultinomialProbitLikelihood(num_classes)


def test_likelihood_refuses_latents_of_the_wrong_width():
    with pytest.raises(ValueError, match=r"\(\.\.\., N, 3\)"):
        MultinomialProbitLikelihood(3)(torch.randn(5, 4))


# ---------------------------------------------------------------------------------------------------
# Nested EP: exact cases and the same algorithm written densely
# ---------------------------------------------------------------------------------------------------
def test_two_classes_are_exact():
    """One probit factor: the inner EP is exact after one update. Against R&W eq. 3.58 in the difference, over
    moderate, wide and confident (right and wrong, z to -20, log Z to -155) cavities: measured 6e-14 (log Z relative,
    mean per sd, covariance per sd_i sd_j); asserted 1e-10. (Both forms lose about z^2 eps relative accuracy in the
    tilted variance where z << 0: 2e-10 at z = -48.)"""
    parts = [_cavities(20, 2, scale, width, seed) for seed, (scale, width) in enumerate([(1, 1), (3, 10), (10, 0.1)])]
    targets, mean, covariance = (torch.cat(column) for column in zip(*parts, strict=True))
    mean[-3:] = torch.tensor([[15.0, -15.0], [-12.0, 12.0], [0.0, 25.0]], dtype=F64)  # |z| to ~20
    log_z, tilted_mean, tilted_cov = multinomial_probit_moments(targets, mean, covariance)
    ref_log_z, ref_mean, ref_cov = _binary_tilted(targets, mean, covariance)
    sd = ref_cov.diagonal(dim1=-2, dim2=-1).sqrt()
    assert ((log_z - ref_log_z).abs() / ref_log_z.abs().clamp_min(1)).max() < 1e-10
    assert ((tilted_mean - ref_mean).abs() / sd).max() < 1e-10
    assert ((tilted_cov - ref_cov).abs() / (sd.unsqueeze(-1) * sd.unsqueeze(-2))).max() < 1e-10


@pytest.mark.parametrize("num_classes", [3, 4, 6])
def test_batched_nested_ep_equals_the_dense_textbook_algorithm(num_classes):
    """The s-space, batched, rank-one-updated inner EP and the textbook one in w = (f, u): measured <= 2e-12 in log Z,
    moments and sites (measured 3e-12); asserted 1e-9."""
    targets, mean, covariance = _cavities(6, num_classes, 2.0, 3.0, seed=num_classes)
    log_z, tilted_mean, tilted_cov, sites = multinomial_probit_moments(targets, mean, covariance, return_sites=True)
    assert isinstance(sites, InnerSites) and sites.precision.shape == (6, num_classes - 1)
    for i in range(6):
        ref = _dense_nested_ep(int(targets[i]), mean[i].numpy(), covariance[i].numpy())
        ours = (log_z[i], tilted_mean[i], tilted_cov[i], sites.precision[i], sites.natural_mean[i])
        for value, expected in zip(ours, ref, strict=True):
            assert np.abs(value.numpy() - expected).max() < 1e-9


# ---------------------------------------------------------------------------------------------------
# Nested EP against brute-force quadrature (C = 3)
# ---------------------------------------------------------------------------------------------------
# regime -> (mean scale, covariance scale, seed, tolerances on |log Z error|, mean error per tilted sd, covariance
# error per tilted sd_i sd_j). Tolerances: twice the worst over 40 other random cavities of each regime (measured
# with this reference, whose own error at 40 nodes per axis is below 1e-11 against 64), so that they are no fit to the
# three cases drawn here. The errors are nested EP's own: its dense textbook form agrees with it to 3e-12.
# Measured over the 40: worst (median) | on the three cases here, worst.
REGIMES = {
    # typical cavities: 1.1e-2 (1.7e-3), 4.2e-3 (3.5e-4), 3.8e-2 (2.5e-3) | 8.1e-3, 3.5e-3, 2.2e-2
    "moderate": (1.0, 1.0, 0, (2e-2, 1e-2, 8e-2)),
    # wide cavities (variances to ~15), weak means, the largest errors: 2.0e-2 (2.8e-3), 8.0e-3 (5.9e-4),
    # 7.4e-2 (5.7e-3) | 4.2e-3, 2.3e-3, 9.1e-3
    "wide": (1.0, 4.0, 1, (4e-2, 1.6e-2, 1.5e-1)),
    # the observed class leads by 5 to 8 (z ~ 3 to 8), the tilted distribution nearly the cavity: 4.2e-4, 8.3e-4,
    # 2.1e-3 (medians below 1e-5) | 3.4e-5, 5.2e-5, 9.3e-5
    "confident": (None, 0.3, 2, (1e-3, 2e-3, 5e-3)),
    # the observed class trails by 2 to 3, small Z and large corrections: 3.1e-3 (5.9e-4), 1.8e-3 (1.3e-4),
    # 7.2e-3 (5.2e-4) | 1.2e-3, 3.4e-4, 6.4e-4
    "misclassified": (None, 0.3, 3, (7e-3, 4e-3, 1.5e-2)),
}


def _regime_cavities(regime: str, count: int = 3):
    scale, width, seed, _ = REGIMES[regime]
    targets, mean, covariance = _cavities(count, 3, scale or 1.0, width, seed)
    if regime in ("confident", "misclassified"):
        generator = torch.Generator().manual_seed(seed + 100)
        lead = torch.rand(count, generator=generator, dtype=F64)
        lead = 5 + 3 * lead if regime == "confident" else -2 - lead
        mean = 0.3 * mean
        mean[torch.arange(count), targets] += lead
    return targets, mean, covariance


@pytest.mark.parametrize("regime", list(REGIMES))
def test_three_classes_match_brute_force_quadrature(regime):
    targets, mean, covariance = _regime_cavities(regime)
    log_z, tilted_mean, tilted_cov = multinomial_probit_moments(targets, mean, covariance)
    tol_z, tol_mean, tol_cov = REGIMES[regime][3]
    for i in range(len(targets)):
        c = int(targets[i])
        ref_log_z, ref_mean, ref_cov = _quadrature_tilted(c, mean[i], covariance[i])
        # the reference itself: Z = P(s + eps > 0), s = B w ~ N(a, K), a bivariate normal CDF
        others = [j for j in range(3) if j != c]
        diff = np.zeros((2, 3))
        diff[:, c], diff[[0, 1], others] = 1.0, -1.0
        cdf = stats.multivariate_normal(np.zeros(2), 1 + np.eye(2) + diff @ covariance[i].numpy() @ diff.T).cdf(
            diff @ mean[i].numpy()
        )
        assert abs(math.log(cdf) - ref_log_z) < 1e-7
        sd = ref_cov.diagonal().sqrt()
        assert abs(log_z[i].item() - ref_log_z) < tol_z
        assert ((tilted_mean[i] - ref_mean).abs() / sd).max() < tol_mean
        assert ((tilted_cov[i] - ref_cov).abs() / torch.outer(sd, sd)).max() < tol_cov


# ---------------------------------------------------------------------------------------------------
# Identities, invariances, dtypes, warm starts, validation
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("num_classes", "covariance_scale"), [(3, 1.0), (6, 4.0), (11, 15.0)])
def test_the_predictive_tolerance_leaves_log_z_at_the_converged_value(num_classes, covariance_scale):
    """``log Zhat`` is stationary in the inner sites at their fixed point: sites converged to PREDICTIVE_TOL give the
    normaliser of sites converged to 1e-13 to second order, here to 1e-9 whatever the classes and widths (the sites
    themselves differ by more: the tolerance does stop the sweeps earlier)."""
    targets, mean, covariance = _cavities(200, num_classes, 2.0, covariance_scale, seed=num_classes)
    loose = multinomial_probit_moments(targets, mean, covariance, tol=PREDICTIVE_TOL, return_sites=True)
    tight = multinomial_probit_moments(targets, mean, covariance, tol=1e-13, max_iterations=200, return_sites=True)
    torch.testing.assert_close(loose[0], tight[0], rtol=0, atol=1e-9)
    assert float((loose[3].precision - tight[3].precision).abs().max()) > 1e-9


def test_log_z_gradients_are_the_tilted_moments():
    r"""At the inner fixed point log Zhat is stationary in the sites, so its derivatives in the cavity are those of a
    Gaussian normaliser: d/dm = S^-1 (mu - m), d/dS = S^-1 (Sigma + delta delta^T - S) S^-1 / 2. By autograd through
    the sweeps; measured 5e-14; asserted 1e-8."""
    targets, mean, covariance = _cavities(8, 4, 2.0, 2.0, seed=7)
    mean.requires_grad_()
    covariance.requires_grad_()
    log_z, tilted_mean, tilted_cov = multinomial_probit_moments(targets, mean, covariance)
    grad_mean, grad_cov = torch.autograd.grad(log_z.sum(), (mean, covariance))
    precision = torch.linalg.inv(covariance.detach())
    delta = (tilted_mean - mean).detach()
    assert (grad_mean - (precision @ delta.unsqueeze(-1)).squeeze(-1)).abs().max() < 1e-8
    outer = tilted_cov.detach() + delta.unsqueeze(-1) * delta.unsqueeze(-2)
    expected = 0.5 * precision @ (outer - covariance.detach()) @ precision
    assert ((grad_cov + grad_cov.mT) / 2 - expected).abs().max() < 1e-8


@pytest.mark.parametrize("shift", [5.0, -300.0, 1e4])
def test_a_common_shift_of_the_cavity_means_only_shifts_the_tilted_mean(shift):
    """The inner EP runs in offsets from the cavity mean, so even a shift of 1e4 (which rounds the means by 2e-12)
    leaves log Z and the covariance unchanged to 3e-13 and shifts the mean by the constant to 2e-12 (measured);
    asserted 1e-13 + 1e-14 |shift|."""
    targets, mean, covariance = _cavities(10, 4, 2.0, 2.0, seed=11)
    log_z, tilted_mean, tilted_cov = multinomial_probit_moments(targets, mean, covariance)
    log_z2, tilted_mean2, tilted_cov2 = multinomial_probit_moments(targets, mean + shift, covariance)
    tol = 1e-13 + 1e-14 * abs(shift)
    assert (log_z2 - log_z).abs().max() < tol
    assert (tilted_mean2 - shift - tilted_mean).abs().max() < tol
    assert (tilted_cov2 - tilted_cov).abs().max() < tol


def test_float32_and_float_targets():
    """float32 cavities are promoted to float64 inside and the results returned in float32: measured 6e-8 relative
    to the float64 run (the inputs' rounding); asserted 1e-5."""
    targets, mean, covariance = _cavities(10, 3, 1.0, 1.0, seed=13)
    reference = multinomial_probit_moments(targets, mean, covariance)
    result = multinomial_probit_moments(targets.double(), mean.float(), covariance.float())
    assert all(r.dtype == torch.float32 for r in result)
    for value, expected in zip(result, reference, strict=True):
        assert (value.double() - expected).abs().max() < 1e-5 * max(1.0, expected.abs().max().item())


def test_warm_start_is_a_fixed_point_and_converges_from_the_previous_sites():
    """The converged sites passed back return the same moments after one sweep; sites from a neighbouring cavity
    (as in the next outer EP sweep) converge to the cold start's result, and after one sweep are closer than a cold
    single sweep."""
    targets, mean, covariance = _cavities(12, 5, 2.0, 2.0, seed=17)
    *cold, sites = multinomial_probit_moments(targets, mean, covariance, return_sites=True)
    again = multinomial_probit_moments(targets, mean, covariance, sites=sites, max_iterations=1)
    for value, expected in zip(again, cold, strict=True):
        assert (value - expected).abs().max() < 1e-10
    moved = mean + 0.1 * torch.randn(mean.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    reference = multinomial_probit_moments(targets, moved, covariance)
    warm = multinomial_probit_moments(targets, moved, covariance, sites=sites)
    for value, expected in zip(warm, reference, strict=True):
        assert (value - expected).abs().max() < 1e-9
    warm1 = multinomial_probit_moments(targets, moved, covariance, sites=sites, max_iterations=1, tol=0)
    cold1 = multinomial_probit_moments(targets, moved, covariance, max_iterations=1, tol=0)
    assert (warm1[2] - reference[2]).abs().max() < 0.1 * (cold1[2] - reference[2]).abs().max()


def test_invalid_inputs_are_refused_with_the_points_named():
    targets, mean, covariance = _cavities(6, 3, 1.0, 1.0, seed=19)
    bad = covariance.clone()
    bad[4] = torch.diag(torch.tensor([1.0, -1.0, 1.0], dtype=F64))
    with pytest.raises(ValueError, match=r"positive definite.*\[4\].*skip"):
        multinomial_probit_moments(targets, mean, bad)
    asymmetric = covariance.clone()
    asymmetric[2, 0, 1] += 0.1
    with pytest.raises(ValueError, match=r"symmetric.*\[2\]"):
        multinomial_probit_moments(targets, mean, asymmetric)
    nan_mean = mean.clone()
    nan_mean[3, 1] = math.nan
    with pytest.raises(ValueError, match=r"cavity_mean is NaN.*\[3\]"):
        multinomial_probit_moments(targets, nan_mean, covariance)
    with pytest.raises(ValueError, match=r"cavity_covariance must have shape \(6, 3, 3\)"):
        multinomial_probit_moments(targets, mean, covariance[:, :2, :2])
    with pytest.raises(ValueError, match=r"C >= 2"):
        multinomial_probit_moments(targets, mean[:, :1], covariance[:, :1, :1])
    with pytest.raises(ValueError, match=r"class indices in \{0, \.\.\., 2\}.*\[1\]"):
        multinomial_probit_moments(torch.tensor([0, 3, 1, 2, 0, 1]), mean, covariance)
    with pytest.raises(ValueError, match=r"class indices.*\[5\]"):
        multinomial_probit_moments(torch.tensor([0.0, 1, 1, 2, 0, 1.5]), mean, covariance)
    with pytest.raises(ValueError, match=r"targets must have shape \(6,\)"):
        multinomial_probit_moments(targets[:5], mean, covariance)
    with pytest.raises(TypeError, match="targets"):
        multinomial_probit_moments(targets.bool(), mean, covariance)
    with pytest.raises(TypeError, match="cavity_mean"):
        multinomial_probit_moments(targets, mean.numpy(), covariance)
    with pytest.raises(ValueError, match="max_iterations"):
        multinomial_probit_moments(targets, mean, covariance, max_iterations=0)
    zeros = torch.zeros(6, 2, dtype=F64)
    with pytest.raises(ValueError, match=r"sites.precision must have shape \(6, 2\)"):
        multinomial_probit_moments(targets, mean, covariance, sites=InnerSites(zeros[:, :1], zeros))
    with pytest.raises(ValueError, match="non-negative"):
        multinomial_probit_moments(targets, mean, covariance, sites=InnerSites(zeros - 1, zeros))


def test_no_points():
    log_z, mean, covariance, sites = multinomial_probit_moments(
        torch.zeros(0, dtype=torch.long), torch.zeros(0, 3), torch.zeros(0, 3, 3), return_sites=True
    )
    assert log_z.shape == (0,) and mean.shape == (0, 3) and covariance.shape == (0, 3, 3)
    assert sites.precision.shape == (0, 2) and log_z.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------
# The dense multi-class EP reference (tests/reference_ep.py)
# ---------------------------------------------------------------------------------------------------
def _toy_kernel(num_classes: int) -> Tensor:
    """Six points on a line, RBF (variance 3, lengthscale 1), independent classes: K = k(X, X) (x) I_C, data-major."""
    x = torch.tensor([-2.0, -1.2, -0.3, 0.4, 1.1, 2.0], dtype=F64)
    return torch.kron(3.0 * torch.exp(-0.5 * (x[:, None] - x[None, :]) ** 2), torch.eye(num_classes, dtype=F64))


def test_multiclass_ep_is_exact_for_one_point_and_is_binary_probit_ep_for_two_classes():
    """One point: the site is the tilted minus the prior, so EP's posterior and evidence are the tilted moments
    (measured 1e-15). C = 2: p(y | f) = Phi(g), g = (f_1 - f_0)/sqrt 2 with prior kernel k, so EP with 2 x 2 site
    blocks is binary probit EP in g (measured 2e-11 in log Z_EP, g's posterior mean and covariance); asserted 1e-8."""
    prior = torch.tensor([[2.0, 0.3, 0.1], [0.3, 1.0, 0.2], [0.1, 0.2, 1.5]], dtype=F64)
    single = reference_ep.multiclass_parallel_ep(prior, torch.tensor([1]), 3, damping=1.0, tol=1e-12)
    log_z, mean, covariance = multinomial_probit_moments(torch.tensor([1]), torch.zeros(1, 3, dtype=F64), prior[None])
    assert single.converged and abs(single.log_marginal_likelihood - log_z[0]) < 1e-10
    assert (single.mean[0] - mean[0]).abs().max() < 1e-10 and (single.covariance - covariance[0]).abs().max() < 1e-10

    y = torch.tensor([0, 0, 1, 1, 0, 1])
    multi = reference_ep.multiclass_parallel_ep(_toy_kernel(2), y, 2, damping=0.5, tol=1e-11)
    kernel = _toy_kernel(1)
    binary = reference_ep.parallel_ep(kernel, y.double(), "probit", damping=0.5, tol=1e-12)
    difference = torch.kron(torch.eye(6, dtype=F64), torch.tensor([[-1.0, 1.0]], dtype=F64)) / math.sqrt(2)
    assert multi.converged and abs(multi.log_marginal_likelihood - binary.log_marginal_likelihood) < 1e-8
    assert (difference @ multi.mean.reshape(-1) - binary.mean).abs().max() < 1e-8
    assert (difference @ multi.covariance @ difference.mT - binary.covariance).abs().max() < 1e-8


def test_multiclass_ep_posterior_matches_gibbs_sampling():
    r"""N = 6, C = 3. Gibbs sampling of the augmented model (2000 chains x 300 draws after 200 of burn-in; Monte Carlo
    standard errors 0.5% of a posterior sd for means, 0.4% of a variance). EP against it, measured: means within
    0.9% of a posterior sd, variances within 1.7% (EP's slightly smaller, as usual), covariances within 1.7% of
    sd_i sd_j. Asserted 3%, 5% and 5% (the measured EP error plus more than 4 Monte Carlo standard errors)."""
    y = torch.tensor([0, 0, 1, 1, 2, 0])
    kernel = _toy_kernel(3)
    ep = reference_ep.multiclass_parallel_ep(kernel, y, 3, damping=0.5, tol=1e-10)
    assert ep.converged
    mean, covariance, _, _ = reference_ep.multiclass_gibbs(kernel, y, 3, chains=2000, burn_in=200, draws=300)
    sd = covariance.diagonal().sqrt()
    assert ((ep.mean.reshape(-1) - mean.reshape(-1)).abs() / sd).max() < 0.03
    assert ((ep.covariance.diagonal() - covariance.diagonal()).abs() / sd**2).max() < 0.05
    assert ((ep.covariance - covariance).abs() / torch.outer(sd, sd)).max() < 0.05


def test_multiclass_ep_evidence_matches_importance_sampling():
    r"""log Z by importance sampling (40000 draws from the EP posterior with its covariance inflated by 1.2, p(y | f)
    by the trapezoid rule over u): -6.760 +- 0.003 (measured); EP's log Z_EP = -6.781, 2% off, the size of nested EP's
    tilted log Z errors. Asserted 0.05."""
    y = torch.tensor([0, 0, 1, 1, 2, 0])
    kernel = _toy_kernel(3)
    ep = reference_ep.multiclass_parallel_ep(kernel, y, 3, damping=0.5, tol=1e-10)
    draws, dim = 40000, 18
    proposal = torch.linalg.cholesky(1.2 * ep.covariance)
    noise = torch.randn(draws, dim, generator=torch.Generator().manual_seed(0), dtype=F64)
    f = ep.mean.reshape(-1) + noise @ proposal.mT
    log_q = -0.5 * noise.square().sum(-1) - proposal.diagonal().log().sum()
    prior = torch.linalg.cholesky(kernel)
    log_prior = (
        -0.5 * torch.linalg.solve_triangular(prior, f.mT, upper=False).square().sum(0) - prior.diagonal().log().sum()
    )
    step, u = 0.4, torch.arange(-12.0, 12.2, 0.4, dtype=F64)
    latent = f.reshape(draws, 6, 3)
    chosen = latent.gather(-1, y.expand(draws, 6).unsqueeze(-1))  # f_{i y_i}
    others = latent.masked_fill(torch.nn.functional.one_hot(y, 3).bool(), -math.inf)  # Phi(u + inf) = 1 at j = y_i
    log_terms = torch.special.log_ndtr(u[:, None, None, None] + chosen - others).sum(-1)  # (u, draws, N)
    log_likelihood = (
        torch.logsumexp(-0.5 * u[:, None, None] ** 2 + log_terms, 0) + math.log(step / math.sqrt(2 * math.pi))
    ).sum(-1)
    log_weight = log_prior + log_likelihood - log_q
    log_z = torch.logsumexp(log_weight, 0) - math.log(draws)
    assert abs(float(ep.log_marginal_likelihood) - float(log_z)) < 0.05


@pytest.mark.parametrize(
    "dtype, low, tolerance, gradient_tolerance",
    [(torch.float64, -60.0, 1e-14, 1e-12), (torch.float32, -25.0, 1e-6, 5e-4)],
)
def test_log_cdf_is_scipys_log_ndtr_with_its_derivative(dtype, low, tolerance, gradient_tolerance):
    """The quadratures' log Phi (erfc in the body, log_ndtr in the far tail) and its derivative phi / Phi, against
    scipy over the body, both sides of the switch to the far tail, and the upper tail."""
    x = torch.linspace(low, 40.0, 20001, dtype=dtype, requires_grad=True)
    value = _log_cdf(x)
    (gradient,) = torch.autograd.grad(value.sum(), x)
    reference = special.log_ndtr(x.detach().double().numpy())
    reference_gradient = np.exp(-0.5 * x.detach().double().numpy() ** 2 - reference) / math.sqrt(2 * math.pi)
    scale = np.maximum(1.0, np.abs(reference))  # measured: 4e-16 and 2e-13 (float64), 2e-7 and 8e-5 (float32)
    assert np.max(np.abs(value.detach().double().numpy() - reference) / scale) < tolerance
    gradient_scale = np.maximum(1.0, np.abs(reference_gradient))
    assert np.max(np.abs(gradient.double().numpy() - reference_gradient) / gradient_scale) < gradient_tolerance
