r"""The outer loop: damped Newton's method as a sequence of GP regressions (paper, Algorithm 1).

With :math:`\mathbf f = \mathbf m + \mathbf K \mathbf a`, step :math:`i` computes
:math:`\mathbf W_i = \mathbf W(\mathbf f_i)`, the pseudo-targets
:math:`\hat{\mathbf y}_i = \mathbf f_i + \mathbf W_i^{-1} \mathbf g(\mathbf f_i)` and solves the regression
:math:`(\mathbf K + \mathbf W_i^{-1}) \mathbf v_i = \hat{\mathbf y}_i - \mathbf m` with IterGP, recycling
the actions of the earlier steps. The candidate :math:`\mathbf f_{i+1} = \mathbf m + \mathbf K \mathbf v_i`
is accepted if it increases the log posterior

.. math::
    \Psi(\mathbf f) = \ell(\mathbf f) - \tfrac12 (\mathbf f - \mathbf m)^\top \mathbf a ,

otherwise the step is halved, :math:`\mathbf a \leftarrow \mathbf a_i + \alpha (\mathbf v_i - \mathbf a_i)`,
:math:`\alpha = \tfrac12, \tfrac14, \dots` (damping; the undamped iteration diverges outside benign
settings, SPEC.md). :math:`\mathbf K \mathbf v_i` comes from the solver's buffers, so :math:`\Psi` costs no
product with :math:`\mathbf K`. The loop stops when
:math:`\|\mathbf a_{i+1} - \mathbf a_i\| \le \text{outer\_tol} \, \|\mathbf a_i\|` for the full step, provided
that step was a real Newton step (IterGP solved its system, or :math:`\mathbf a = \nabla \log p(\mathbf y \mid
\mathbf f)`, the first-order condition of the mode, holds to ``outer_tol``).

Each completed step is handed to ``commit`` with everything the next step needs (including the forcing
term that scales IterGP's tolerances), so a fit interrupted after it, and resumed, repeats an
uninterrupted fit exactly.

After the loop, a virtual solver run at :math:`\mathbf W(\hat{\mathbf f})` over all buffered actions makes the
approximate precision :math:`\mathbf C = \mathbf Q \mathbf Q^\top` that of the final mode (no product with
:math:`\mathbf K`), so that the posterior covariance is :math:`\mathbf K - \mathbf K \mathbf C \mathbf K`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from tqdm.auto import tqdm

from .likelihoods import LikelihoodAdapter
from .policies import Policy
from .prior import LatentPrior
from .recycling import ActionBuffer, virtual_solver_run
from .solver import NumericalBreakdownWarning, itergp_solve


@dataclass
class SolverOptions:
    """Settings of the Newton loop and of IterGP (see :class:`~gpytorch_iterncgp.IterNCGPStrategy`)."""

    max_newton_steps: int = 20
    max_solver_iterations: int | None = 5
    outer_tol: float = 1e-2
    abs_tol: float = 1e-5
    rel_tol: float = 1e-5
    compression_rank: int | None = None
    recycle: bool = True
    min_step_size: float = 2.0**-10

    def validate(self) -> None:
        """:raises ValueError: naming the option that is out of range (or not a number; ``True`` is not a count)."""
        for name in (
            "max_newton_steps",
            "max_solver_iterations",
            "compression_rank",
            "outer_tol",
            "abs_tol",
            "rel_tol",
        ):
            if isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}.")
        if not (isinstance(self.max_newton_steps, int) and self.max_newton_steps >= 0):
            raise ValueError(f"max_newton_steps must be a non-negative integer, got {self.max_newton_steps!r}.")
        if self.max_solver_iterations is not None and not (
            isinstance(self.max_solver_iterations, int) and self.max_solver_iterations >= 1
        ):
            raise ValueError(
                f"max_solver_iterations must be a positive integer or None, got {self.max_solver_iterations!r}."
            )
        if self.compression_rank is not None and not (
            isinstance(self.compression_rank, int) and self.compression_rank >= 1
        ):
            raise ValueError(f"compression_rank must be a positive integer or None, got {self.compression_rank!r}.")
        for name in ("outer_tol", "abs_tol", "rel_tol"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a non-negative number, got {value!r}.")
        if not 0 < self.min_step_size <= 1:
            raise ValueError(f"min_step_size must lie in (0, 1], got {self.min_step_size!r}.")


@dataclass
class LaplaceState:
    r"""Where the Newton loop stands; all a fitted model needs to predict and to continue.

    ``n = N C`` (data-major), ``r`` the rank of :math:`\mathbf C`, ``B`` the number of buffered actions.
    """

    representer_weights: Tensor  # a, (n,): f = m + K a
    kernel_representer_weights: Tensor  # K a, (n,)
    precision_root: Tensor  # Q, (n, r): C = Q Q^T
    kernel_precision_root: Tensor  # K Q, (n, r)
    actions: Tensor  # S, (n, B)
    kernel_actions: Tensor  # K S, (n, B)
    log_posterior: float = -math.inf
    newton_steps: int = 0
    # Scales IterGP's tolerances in the next step (tightened after a rejected step): part of the state, so
    # that a fit resumed from it (same object or a loaded state_dict) repeats an uninterrupted fit exactly.
    forcing: float = 1.0
    # The last step was rejected: W is unchanged, and the next solve continues the same system with all its
    # actions (no compression, which would throw away the progress of the rejected solve; with R = 10 and
    # j <= 5 on the 10-class mixture at N = 10^4 every later step was rejected at Psi = -8181 otherwise).
    same_system: bool = False

    @classmethod
    def initial(cls, size: int, dtype: torch.dtype, device: torch.device) -> LaplaceState:
        """The prior: :math:`\\mathbf a = \\mathbf 0`, no actions."""
        zeros = torch.zeros(size, dtype=dtype, device=device)
        empty = torch.zeros(size, 0, dtype=dtype, device=device)
        return cls(zeros, zeros.clone(), empty, empty.clone(), empty.clone(), empty.clone())

    def tensors(self) -> dict[str, Tensor]:
        return {name: getattr(self, name) for name in TENSOR_FIELDS}


TENSOR_FIELDS = (
    "representer_weights",
    "kernel_representer_weights",
    "precision_root",
    "kernel_precision_root",
    "actions",
    "kernel_actions",
)


@dataclass
class NewtonStep:
    """One Newton step as recorded in the :class:`FitReport`."""

    step: int
    log_posterior: float
    step_size: float  # 1 (full step), 1/2, 1/4, ... (damped) or 0 (rejected)
    solver_iterations: int
    residual_norm: float
    relative_change: float
    kernel_products: int
    kernel_product_seconds: float = 0.0  # wall time of this step's products with K


@dataclass
class FitReport:
    """What a call of :meth:`~gpytorch_iterncgp.IterNCGPStrategy.fit` did."""

    newton_steps: int = 0
    solver_iterations: int = 0
    kernel_products: int = 0  # calls of the kernel matmul
    kernel_columns: int = 0  # vectors multiplied by K in those calls
    kernel_product_seconds: float = 0.0  # wall time spent in those calls (the rest of wall_time is everything else)
    converged: bool = False
    breakdown: bool = False
    stopped_by_callback: bool = False
    wall_time: float = 0.0
    steps: list[NewtonStep] = field(default_factory=list)

    @property
    def log_posteriors(self) -> list[float]:
        return [step.log_posterior for step in self.steps]

    @property
    def residual_norms(self) -> list[float]:
        return [step.residual_norm for step in self.steps]

    @property
    def step_sizes(self) -> list[float]:
        return [step.step_size for step in self.steps]

    def __str__(self) -> str:
        last = self.steps[-1] if self.steps else None
        return (
            f"IterNCGP fit: {self.newton_steps} Newton steps, {self.solver_iterations} solver iterations, "
            f"{self.kernel_products} products with K ({self.kernel_product_seconds:.2f}s), converged={self.converged}, breakdown={self.breakdown}, "
            f"log posterior={last.log_posterior if last else float('nan'):.6g}, "
            f"residual={last.residual_norm if last else float('nan'):.3g}, {self.wall_time:.2f}s"
        )


def _log_posterior(adapter, latent, targets, weights, kernel_weights) -> float:
    return float(adapter.log_likelihood(latent, targets)) - 0.5 * float(kernel_weights @ weights)


def _relative_change(new: Tensor, old: Tensor) -> float:
    change, norm = float((new - old).norm()), float(old.norm())
    return change / norm if norm > 0 else (0.0 if change == 0 else math.inf)


def _warm_start(adapter, targets, latent_of, weights, kernel_weights) -> tuple[Tensor, Tensor]:
    r"""Scale representer weights :math:`\mathbf a` kept across a change of :math:`\mathbf K`.

    :math:`\mathbf m + \mathbf K_{\text{new}} \mathbf a` can be far worse than the prior after a large
    hyperparameter step (e.g. overflow of an exponential link); keep the best of :math:`\alpha \mathbf a`,
    :math:`\alpha \in \{1, \tfrac12, \dots, 2^{-10}, 0\}` by the log posterior (no product with K).
    """
    best, best_psi = 0.0, _log_posterior(adapter, latent_of(0 * kernel_weights), targets, 0 * weights, 0 * weights)
    for scale in [2.0**-k for k in range(11)]:
        psi = _log_posterior(
            adapter, latent_of(scale * kernel_weights), targets, scale * weights, scale * kernel_weights
        )
        if math.isfinite(psi) and psi > best_psi:
            best, best_psi = scale, psi
    return best * weights, best * kernel_weights


_OVERFLOW_MIN_STEP_SIZE = 2.0**-60


def _damped_step(adapter, targets, latent_of, weights, kernel_weights, psi, result, min_step_size):
    r"""Halve the Newton step until the log posterior does not decrease; step size 0 if none does.

    ``min_step_size`` counts from the largest step at which :math:`\Psi` is finite: halvings that only bring
    an overflowing candidate (e.g. an exponential link far along a long first step from the prior, counts
    ~1e6) back to a finite :math:`\Psi` are free, down to ``2**-60``. Without this the step was rejected
    and the fit stopped at the prior with "no step ... increases the log posterior".

    :return: step size, new weights, new kernel weights, new log posterior, and the log posterior of the
        full step.
    """
    eps = torch.finfo(weights.dtype).eps
    step_size = 1.0
    first_finite = None  # the largest step size with a finite log posterior
    new_weights, new_kernel_weights = result.representer_weights, result.kernel_representer_weights
    full_psi = None
    while True:
        new_psi = _log_posterior(adapter, latent_of(new_kernel_weights), targets, new_weights, new_kernel_weights)
        full_psi = new_psi if full_psi is None else full_psi
        if new_psi >= psi - 100 * eps * max(1.0, abs(psi)) and math.isfinite(new_psi):
            return step_size, new_weights, new_kernel_weights, new_psi, full_psi
        if first_finite is None and math.isfinite(new_psi):
            first_finite = step_size
        step_size /= 2
        floor = _OVERFLOW_MIN_STEP_SIZE if first_finite is None else first_finite * min_step_size
        if step_size < floor:
            return 0.0, weights, kernel_weights, psi, full_psi
        new_weights = weights + step_size * (result.representer_weights - weights)
        new_kernel_weights = kernel_weights + step_size * (result.kernel_representer_weights - kernel_weights)


def _satisfies_first_order_condition(weights: Tensor, derivatives: Callable, tolerance: float) -> bool:
    r"""Whether :math:`\|\nabla \log p(\mathbf y \mid \mathbf f) - \mathbf a\| \le \text{tolerance}\,\|\mathbf a\|`.

    :math:`\mathbf a = \nabla \log p(\mathbf y \mid \mathbf f)` is the first-order condition of the mode (the
    fixed point of Newton's iteration); checking it costs no product with :math:`\mathbf K`.

    :param derivatives: returns the likelihood's derivatives at the current point (computed only if needed).
    """
    gradient = derivatives().gradient.reshape(-1)
    return float((gradient - weights).norm()) <= tolerance * float(weights.norm())


def run_newton(
    prior: LatentPrior,
    adapter: LikelihoodAdapter,
    targets: Tensor,
    state: LaplaceState,
    options: SolverOptions,
    policy: Policy,
    commit: Callable[[LaplaceState], None],
    callback: Callable[[NewtonStep, LaplaceState], bool | None] | None = None,
    show_progress: bool = True,
) -> FitReport:
    """Run damped Newton steps from ``state``; hand every completed step's state to ``commit``.

    :param prior: the GP prior at the training inputs (its matmul is the one product with K).
    :param adapter: the likelihood's derivatives.
    :param targets: validated targets ``(N,)``.
    :param state: where to start (:meth:`LaplaceState.initial` for the prior).
    :param options: tolerances and limits.
    :param policy: IterGP's policy (already prepared for the problem size).
    :param commit: receives the state after every completed step and after the final update of the
        precision, so an interrupted fit leaves the last completed step behind.
    :param callback: called after every step with its record and the state; returning ``True`` stops.
    :param show_progress: show a tqdm progress bar.
    """
    start_time = time.perf_counter()
    products_before, columns_before, seconds_before = prior.products, prior.columns, prior.product_seconds
    prior_mean = prior.mean.reshape(-1)
    num_latents = adapter.num_latents
    report = FitReport()
    num_data = len(prior_mean) // num_latents
    action_space_dimension = num_data * (num_latents - 1) if adapter.zero_sum_actions else num_data * num_latents

    def latent_of(kernel_weights: Tensor) -> Tensor:
        return (prior_mean + kernel_weights).reshape(-1, num_latents)

    weights, kernel_weights = state.representer_weights, state.kernel_representer_weights
    if state.newton_steps > 0 and state.log_posterior == -math.inf:  # K changed since these weights
        weights, kernel_weights = _warm_start(adapter, targets, latent_of, weights, kernel_weights)
    psi = _log_posterior(adapter, latent_of(kernel_weights), targets, weights, kernel_weights)
    cached = None  # (kernel weights, likelihood derivatives there): computed once per point

    def derivatives_at(kernel_weights: Tensor):
        nonlocal cached
        if cached is None or cached[0] is not kernel_weights:
            cached = (kernel_weights, adapter.derivatives(latent_of(kernel_weights), targets))
        return cached[1]

    forcing = state.forcing  # scales the inner tolerances; tightened after a step that did not increase psi
    same_system = state.same_system  # the last step was rejected: compress only once W changes
    buffer = ActionBuffer.from_tensors(state.actions, state.kernel_actions)
    progress = tqdm(total=options.max_newton_steps, desc="IterNCGP", disable=not show_progress, leave=False)
    try:
        for _ in range(options.max_newton_steps):
            products_at_step, seconds_at_step = prior.products, prior.product_seconds
            derivatives = derivatives_at(kernel_weights)
            noise_inverse = derivatives.noise_inverse
            gradient_step = noise_inverse.matmul(derivatives.gradient.reshape(-1, 1))[:, 0]
            if not (bool(torch.isfinite(gradient_step).all()) and math.isfinite(float(derivatives.log_likelihood))):
                warnings.warn(
                    "IterNCGP: the likelihood's gradient or curvature is not finite at the current latent values; "
                    "stopping with the posterior of the last completed Newton step.",
                    NumericalBreakdownWarning,
                    stacklevel=3,
                )
                report.breakdown = True
                break
            if not options.recycle:
                buffer = ActionBuffer.empty(len(prior_mean), prior_mean.dtype, prior_mean.device)
                policy.reset()
            rhs = kernel_weights + gradient_step  # pseudo-targets minus prior mean
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", NumericalBreakdownWarning)
                result = itergp_solve(
                    prior.matmul,
                    noise_inverse,
                    rhs,
                    buffer,
                    policy,
                    project=adapter.project if adapter.zero_sum_actions else None,
                    max_iterations=options.max_solver_iterations,
                    abs_tol=options.abs_tol * forcing,
                    rel_tol=options.rel_tol * forcing,
                    compression_rank=None if same_system else options.compression_rank,
                    action_space_dimension=action_space_dimension,
                    keep=(weights, kernel_weights),
                )
            for warning in caught:
                warnings.warn(warning.message, warning.category, stacklevel=3)
            report.breakdown |= result.breakdown
            buffer = result.buffer

            step_size, new_weights, new_kernel_weights, new_psi, full_psi = _damped_step(
                adapter, targets, latent_of, weights, kernel_weights, psi, result, options.min_step_size
            )
            relative_change = _relative_change(new_weights, weights)
            proposed_change = _relative_change(result.representer_weights, weights)
            weights, kernel_weights, psi = new_weights, new_kernel_weights, new_psi
            # Converged when the full (undamped) Newton step changes a by at most outer_tol and was a real Newton
            # step: IterGP solved its system, or a = grad log p(y|f) holds to outer_tol. Or, when outer_tol is
            # below what rounding allows, when the full step changes the log posterior only at rounding level and
            # a = grad log p(y|f) holds to sqrt(eps) (Psi is flat at the mode: a change of sqrt(eps)|Psi| alone
            # leaves f uncertain to ~eps^(1/4)). An incomplete solve can barely move far from the mode; without
            # these checks such steps were reported as converged. Unit-vector actions, one iteration per step:
            # exp-link Poisson, 32 points, after one step with the mode 90% off (the action hit a point with zero
            # residual: nothing moved); probit, 21 points, after 32 steps through the rounding rule, 0.6% off.
            # CG, one iteration per step: softplus Poisson, 15 points, lengthscale 2, after 8 steps, 0.05% off (CG
            # stagnating). Solves at full rank with a residual stalled by rounding: softmax, 36 points, unit
            # actions, R = 3, after 4 steps through the rounding rule, 0.05% off. With a small iteration budget
            # on a large problem certifying convergence can take a few more Newton steps than the relative change
            # alone (the 10-class example, R = infinity: 38 instead of 32).
            root_eps = math.sqrt(torch.finfo(weights.dtype).eps)
            first_order = functools.partial(
                _satisfies_first_order_condition, weights, functools.partial(derivatives_at, kernel_weights)
            )
            converged = (
                proposed_change <= options.outer_tol and (result.converged or first_order(options.outer_tol))
            ) or (step_size == 0.0 and abs(full_psi - psi) <= root_eps * max(1.0, abs(psi)) and first_order(root_eps))
            stuck = False
            if not converged and step_size == 0.0:
                if not options.recycle or (result.iterations == 0 and forcing < 1e-10):
                    stuck = True
                else:
                    # The direction was too inexact: the next step solves the same system further (recycled
                    # actions) and to a tighter tolerance.
                    forcing = max(forcing * 1e-2, 1e-12)
            elif not converged and step_size == 1.0:
                forcing = 1.0
            same_system = step_size == 0.0
            state = LaplaceState(
                weights,
                kernel_weights,
                result.precision.root_tensor,
                result.kernel_precision_root,
                buffer.actions.value,
                buffer.kernel_actions.value,
                psi,
                state.newton_steps + 1,
                forcing,
                same_system,
            )
            commit(state)
            record = NewtonStep(
                step=state.newton_steps,
                log_posterior=psi,
                step_size=step_size,
                solver_iterations=result.iterations,
                residual_norm=result.residual_norm,
                relative_change=relative_change,
                kernel_products=prior.products - products_at_step,
                kernel_product_seconds=prior.product_seconds - seconds_at_step,
            )
            report.steps.append(record)
            report.newton_steps += 1
            report.solver_iterations += result.iterations
            progress.update(1)
            progress.set_postfix(log_posterior=f"{psi:.5g}", residual=f"{result.residual_norm:.2g}")
            if callback is not None and callback(record, state):
                report.stopped_by_callback = True
                break
            if converged:
                report.converged = True
                break
            if stuck:
                warnings.warn(
                    "IterNCGP: no step along the Newton direction increases the log posterior; stopping.",
                    NumericalBreakdownWarning,
                    stacklevel=3,
                )
                break
    finally:
        progress.close()

    if report.newton_steps > 0:
        # The precision of the final mode: a virtual solver run at W(f) over every buffered action. The
        # buffer itself is kept as the loop left it (not the re-weighted one of this run), so that a later
        # fit() continues exactly as if this one had not stopped here.
        final = derivatives_at(kernel_weights)
        if bool(torch.isfinite(final.noise_inverse.diagonal()).all()):
            virtual = virtual_solver_run(buffer, final.noise_inverse)
            state = dataclasses.replace(
                state, precision_root=virtual.precision_root, kernel_precision_root=virtual.kernel_precision_root
            )
            commit(state)
    report.kernel_products = prior.products - products_before
    report.kernel_columns = prior.columns - columns_before
    report.kernel_product_seconds = prior.product_seconds - seconds_before
    report.wall_time = time.perf_counter() - start_time
    return report
