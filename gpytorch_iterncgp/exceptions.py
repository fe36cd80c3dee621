r"""Warnings and errors of the package, in linear_operator's and GPyTorch's idiom.

Every warning derives from :class:`linear_operator.utils.warnings.NumericalWarning` (a ``RuntimeWarning``), so
``warnings.filterwarnings("ignore", category=NumericalWarning)`` silences GPyTorch's and ours alike, and
each can be filtered on its own:

* :class:`NumericalBreakdownWarning`: IterGP or the outer loop stopped early on a numerical breakdown; the
  result is the posterior of the last completed step (usable, finite).
* :class:`NotConvergedWarning`: the outer loop stopped before its convergence criterion held because it could not
  progress (no step along the search direction improves the objective, or
  :data:`~gpytorch_iterncgp.core.outer_loop.STALL_STEPS` steps in a row made no progress); the message says what to
  change.
* :class:`ConvergenceWarning`: a fit stopped at a limit (``max_newton_steps``, ``max_sweeps``, ``max_time``) before
  its convergence criterion held; the message names the limit to raise. (The scikit-learn estimators raise
  scikit-learn's ``ConvergenceWarning`` instead.)
* :class:`EstimatedEvidenceWarning`: EP's evidence is estimated from an incomplete solve, whose maximiser is biased
  (towards large outputscales); :func:`~gpytorch_iterncgp.fit_mll` learns EP's hyperparameters without it.
* :class:`ExplicitGradientWarning`: the matrix-free Laplace evidence did not trust its differentiable Newton step from
  the strategy's mode (the step lowered the log posterior: the fit is far from its mode, or :math:`\mathbf B` is
  ill-conditioned), so its gradient leaves out the mode's implicit derivative; :func:`~gpytorch_iterncgp.fit_mll`
  counts such evaluations (``LearningReport.explicit_gradients``) and warns once.
* :class:`BufferLimitWarning`: the recycled solver actions would have outgrown
  :class:`~gpytorch_iterncgp.settings.recycled_buffer_limit`, so they were compressed to fit (the fit goes on, with
  less recycled information, and may need more steps), or the covariance phase's actions would have, so it stopped
  early (the predictive variances keep more computational uncertainty).
* :class:`MonteCarloPsiWarning`: the Ψ statistics of a kernel without a closed form are Monte Carlo estimates
  (:func:`~gpytorch_iterncgp.sparse.psi_statistics.psi_statistics`).

One warning is about the model, not the numbers, and is a ``UserWarning`` (as GPyTorch's ``GPInputWarning``):
:class:`WorseThanConstantWarning`, the learnt model predicts the rows held out from learning worse than a constant
predictor (:func:`~gpytorch_iterncgp.learning.baseline.check_against_constant`).

Errors: :class:`NonFiniteEvidenceError` (a ``FloatingPointError``) when the marginal likelihood cannot be
computed finitely, so an optimizer never sees a NaN loss or gradient.
"""

from __future__ import annotations

from linear_operator.utils.warnings import NumericalWarning

__all__ = [
    "BufferLimitWarning",
    "ConvergenceWarning",
    "EstimatedEvidenceWarning",
    "ExplicitGradientWarning",
    "MonteCarloPsiWarning",
    "NonFiniteEvidenceError",
    "NotConvergedWarning",
    "NumericalBreakdownWarning",
    "NumericalWarning",
    "WorseThanConstantWarning",
]


class NumericalBreakdownWarning(NumericalWarning):
    """The solver stopped early because of a numerical breakdown; its result is still usable."""


class NotConvergedWarning(NumericalWarning):
    """The outer loop stopped before it converged because it could not progress (not because of a limit)."""


class ConvergenceWarning(NumericalWarning):
    """A fit stopped at a limit (steps, time) before it converged; the result is the posterior of the last step."""


class EstimatedEvidenceWarning(NumericalWarning):
    """An evidence estimated from an incomplete solve, whose maximiser is known to be biased."""


class ExplicitGradientWarning(NumericalWarning):
    """The matrix-free Laplace evidence's gradient left out the mode's implicit derivative (R&W eq. 5.22 without eqs.
    5.23-5.24), because the Newton step it differentiates was not trusted."""


class BufferLimitWarning(NumericalWarning):
    """The recycled actions were compressed, or the covariance phase stopped, to fit the memory limit of
    ``settings.recycled_buffer_limit``."""


class MonteCarloPsiWarning(NumericalWarning):
    """The Ψ statistics of this kernel have no closed form here: they are Monte Carlo estimates."""


class WorseThanConstantWarning(UserWarning):
    """The learnt model's score on the rows held out from learning is worse than a constant predictor's (the class
    frequencies, the mean count): its hyperparameters fit the learning rows but do not predict others."""


class NonFiniteEvidenceError(FloatingPointError):
    """The marginal likelihood (or its gradient) is not finite at the current hyperparameters."""
