"""IterNCGP for GPyTorch: Laplace inference for non-conjugate GPs by Newton steps solved with IterGP.

Tatzel, Wenger, Schneider, Hennig: "Accelerating Non-Conjugate Gaussian Processes By Trading Off
Computation For Uncertainty". See ``SPEC.md`` for the algorithm in plain notation.
"""

from .evidence import (
    IllConditionedKernelWarning,
    LaplaceMarginalLogLikelihood,
    dense_laplace_mode,
    exact_laplace_evidence,
)
from .likelihoods import ExpPoissonLikelihood, LikelihoodAdapter, LogitBernoulliLikelihood, likelihood_adapter
from .newton import FitReport, LaplaceState, NewtonStep, SolverOptions
from .noise import BlockNoiseInverse, DiagonalNoiseInverse, SoftmaxPseudoInverse
from .policies import ConjugateGradientPolicy, Policy, UnitVectorPolicy
from .precision import LowRankPrecision
from .prior import dense_kernel_limit
from .recycling import ActionBuffer, virtual_solver_run
from .solver import IterGPResult, NumericalBreakdownWarning, itergp_solve
from .strategy import IterNCGPStrategy

__version__ = "0.1.0"

__all__ = [
    "ActionBuffer",
    "BlockNoiseInverse",
    "ConjugateGradientPolicy",
    "DiagonalNoiseInverse",
    "ExpPoissonLikelihood",
    "FitReport",
    "IllConditionedKernelWarning",
    "IterGPResult",
    "IterNCGPStrategy",
    "LaplaceMarginalLogLikelihood",
    "LaplaceState",
    "LikelihoodAdapter",
    "LogitBernoulliLikelihood",
    "LowRankPrecision",
    "NewtonStep",
    "NumericalBreakdownWarning",
    "Policy",
    "SoftmaxPseudoInverse",
    "SolverOptions",
    "UnitVectorPolicy",
    "dense_kernel_limit",
    "dense_laplace_mode",
    "exact_laplace_evidence",
    "itergp_solve",
    "likelihood_adapter",
    "virtual_solver_run",
]
