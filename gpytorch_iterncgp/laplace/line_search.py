r"""The log posterior of the Newton loop, its damped step (a backtracking line search) and its convergence test, for
:class:`~gpytorch_iterncgp.laplace.newton.DampedNewton`.

With :math:`\mathbf f = \mathbf m + \mathbf K \mathbf a`,

.. math::
    \Psi(\mathbf f) = \ell(\mathbf f) - \tfrac12 (\mathbf f - \mathbf m)^\top \mathbf a
    = \log p(\mathbf y \mid \mathbf f) - \tfrac12 \mathbf a^\top \mathbf K \mathbf a ,

evaluated from :math:`\mathbf a` and :math:`\mathbf K \mathbf a` (no product with :math:`\mathbf K`); its slope along a
step and the first-order condition :math:`\mathbf a = \nabla \log p(\mathbf y \mid \mathbf f)` likewise. Vectors are
held by the rows of a :class:`~gpytorch_iterncgp.core.sharding.RowBlock` (all in one process); sums and norms are
the block's (``all_reduce`` where sharded), so every rank takes the same steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.sharding import RowBlock
from ..likelihoods.adapters import LikelihoodAdapter, LikelihoodDerivatives

# Halvings that only bring an overflowing candidate back to a finite log posterior are free down to this step
# size, so that a long first step from the prior that overflows (an exponential link) is damped, not rejected.
_OVERFLOW_MIN_STEP_SIZE = 2.0**-60


@dataclass
class Point:
    r"""A point :math:`\mathbf f = \mathbf m + \mathbf K \mathbf a` of the Newton iteration and :math:`\Psi` there."""

    weights: Tensor  # a
    kernel_weights: Tensor  # K a
    log_posterior: float  # Psi


class LogPosterior:
    r""":math:`\Psi` at points :math:`\mathbf a` of the Newton iteration, its slopes, and the damped step between two
    points (:meth:`damped_step`).

    :param adapter: the likelihood's derivatives.
    :param prior_mean: :math:`\mathbf m`, data-major ``(N C,)`` (the rows of ``rows_block``).
    :param targets: the targets of those points.
    :param rows_block: the rows of the vectors this process holds.
    :param min_step_size: the smallest step size tried, relative to the largest at which :math:`\Psi` is finite.
    """

    def __init__(
        self,
        adapter: LikelihoodAdapter,
        prior_mean: Tensor,
        targets: Tensor,
        rows_block: RowBlock,
        min_step_size: float,
    ):
        self.adapter, self.prior_mean, self.targets, self.rows_block = adapter, prior_mean, targets, rows_block
        self.min_step_size = min_step_size
        self._cached: tuple[Tensor, LikelihoodDerivatives] | None = None

    def latent_of(self, kernel_weights: Tensor) -> Tensor:
        """:math:`\\mathbf m + \\mathbf K \\mathbf a`, ``(N, C)``."""
        return (self.prior_mean + kernel_weights).reshape(-1, self.adapter.num_latents)

    def point(self, weights: Tensor, kernel_weights: Tensor) -> Point:
        r""":math:`\Psi(\mathbf f) = \ell(\mathbf f) - \tfrac12 \mathbf a^\top \mathbf K \mathbf a` at :math:`\mathbf a`."""
        block = self.rows_block
        log_likelihood = float(block.summed(self.adapter.log_likelihood(self.latent_of(kernel_weights), self.targets)))
        return Point(weights, kernel_weights, log_likelihood - 0.5 * float(block.summed(kernel_weights @ weights)))

    def derivatives(self, kernel_weights: Tensor) -> LikelihoodDerivatives:
        """The likelihood's derivatives at :math:`\\mathbf m + \\mathbf K \\mathbf a` (one point cached)."""
        if self._cached is None or self._cached[0] is not kernel_weights:
            self._cached = (kernel_weights, self.adapter.derivatives(self.latent_of(kernel_weights), self.targets))
        return self._cached[1]

    def slope(self, point: Point, direction: Tensor) -> float:
        r""":math:`\mathrm d\Psi(\mathbf a + t \boldsymbol\delta)/\mathrm dt` at ``point``, with ``direction`` :math:`= \mathbf K \boldsymbol\delta`.

        :math:`\nabla_{\mathbf a} \Psi = \mathbf K (\mathbf g - \mathbf a)`, so the slope is
        :math:`(\mathbf K \boldsymbol\delta)^\top (\mathbf g - \mathbf a)`: no product with :math:`\mathbf K`.
        """
        gradient = self.derivatives(point.kernel_weights).gradient.reshape(-1)
        return float(self.rows_block.summed(direction @ (gradient - point.weights)))

    def warm_start(self, weights: Tensor, kernel_weights: Tensor) -> Point:
        r"""Scale representer weights :math:`\mathbf a` kept across a change of :math:`\mathbf K`.

        :math:`\mathbf m + \mathbf K_{\text{new}} \mathbf a` can be far worse than the prior after a large
        hyperparameter step (e.g. overflow of an exponential link); keep the best of :math:`\alpha \mathbf a`,
        :math:`\alpha \in \{1, \tfrac12, \dots, 2^{-10}, 0\}` by the log posterior (no product with K).
        """
        best = self.point(0 * weights, 0 * kernel_weights)
        for scale in [2.0**-k for k in range(11)]:
            candidate = self.point(scale * weights, scale * kernel_weights)
            if math.isfinite(candidate.log_posterior) and candidate.log_posterior > best.log_posterior:
                best = candidate
        return best

    def damped_step(self, current: Point, proposal: Point) -> tuple[float, Point, float]:
        r"""Halve the step from ``current`` towards ``proposal`` until :math:`\Psi` does not decrease.

        A candidate is accepted if its :math:`\Psi` is not below the current one (up to rounding), or if
        :math:`\Psi` still increases at the candidate along the step: :math:`\Psi` is concave in
        :math:`\mathbf a` (a log-concave likelihood plus a Gaussian prior), so a non-negative slope at the
        end of the step means :math:`\Psi` rose all along it. The second test decides where the change of
        :math:`\Psi` is below the rounding of :math:`\Psi` itself (large counts: sum terms far larger than
        :math:`\Psi`), where comparing values depends on the CPU's rounding.
        ``min_step_size`` counts from the largest step at which :math:`\Psi` is finite.

        :return: the step size (0: rejected), the new point, and :math:`\Psi` at the full step.
        """
        eps = torch.finfo(current.weights.dtype).eps
        step_size, first_finite, candidate = 1.0, None, proposal
        direction = proposal.kernel_weights - current.kernel_weights
        while True:
            finite = math.isfinite(candidate.log_posterior)
            if finite and (
                candidate.log_posterior >= current.log_posterior - 100 * eps * max(1.0, abs(current.log_posterior))
                or self.slope(candidate, direction) >= 0
            ):
                return step_size, candidate, proposal.log_posterior
            if first_finite is None and finite:
                first_finite = step_size
            step_size /= 2
            floor = _OVERFLOW_MIN_STEP_SIZE if first_finite is None else first_finite * self.min_step_size
            if step_size < floor:
                return 0.0, current, proposal.log_posterior
            candidate = self.point(
                current.weights + step_size * (proposal.weights - current.weights),
                current.kernel_weights + step_size * direction,
            )

    def first_order_condition(self, point: Point, tolerance: float) -> bool:
        r"""Whether :math:`\|\nabla \log p(\mathbf y \mid \mathbf f) - \mathbf a\| \le \text{tolerance}\,\|\mathbf a\|`.

        :math:`\mathbf a = \nabla \log p(\mathbf y \mid \mathbf f)` is the first-order condition of the mode (the
        fixed point of Newton's iteration); checking it costs no product with :math:`\mathbf K`.
        """
        gradient = self.derivatives(point.kernel_weights).gradient.reshape(-1)
        block = self.rows_block
        return float(block.norm(gradient - point.weights)) <= tolerance * float(block.norm(point.weights))

    def converged(
        self,
        new: Point,
        step_size: float,
        full_psi: float,
        proposed_change: float,
        predicted_gain: float,
        solved: bool,
        outer_tol: float,
    ) -> bool:
        r"""Whether Newton's loop has converged after a damped step of ``step_size`` to ``new``, the full step's
        :math:`\Psi` ``full_psi``, its relative change of :math:`\mathbf a` ``proposed_change`` and its
        ``predicted_gain`` in :math:`\Psi`; ``solved``: IterGP solved the step's system.

        * The full (undamped) Newton step changes :math:`\mathbf a` by at most ``outer_tol``, promises to gain at most
          ``outer_tol`` in :math:`\Psi` (half the Newton decrement: where :math:`\mathbf a` is large, a change of 1%
          can still gain nats, as preconditioned solves at large outputscales showed) and was a real Newton step:
          IterGP solved its system, or :math:`\mathbf a = \nabla \log p(\mathbf y \mid \mathbf f)` holds to
          ``outer_tol``. An incomplete solve can barely move far from the mode; without this check such steps would
          be reported as converged.
        * Or a solved Newton step promises a gain in :math:`\Psi` (half the Newton decrement) below the
          resolution of :math:`\Psi`: nothing is left to gain, however tight ``outer_tol`` is (a relative change
          of :math:`\mathbf a` at rounding level depends on the CPU's rounding). ``outer_tol = 0`` turns this off
          (run every step).
        * Or, when ``outer_tol`` is below what rounding allows, the full step was rejected, changes :math:`\Psi`
          only at rounding level and :math:`\mathbf a = \nabla \log p(\mathbf y \mid \mathbf f)` holds to
          :math:`\sqrt{\epsilon}` (a residual stalled by rounding).
        """
        eps = torch.finfo(new.weights.dtype).eps
        root_eps = math.sqrt(eps)
        scale = max(1.0, abs(new.log_posterior))
        if (
            proposed_change <= outer_tol
            and predicted_gain <= max(outer_tol, eps * scale)
            and (solved or self.first_order_condition(new, outer_tol))
        ):
            return True
        if outer_tol > 0 and solved and step_size > 0 and predicted_gain <= eps * scale:
            return True
        return (
            step_size == 0.0
            and abs(full_psi - new.log_posterior) <= root_eps * scale
            and self.first_order_condition(new, root_eps)
        )
