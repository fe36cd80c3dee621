"""IterNCGP for GPyTorch: Laplace (Newton steps) and expectation propagation (EP sweeps) for non-conjugate GPs,
every step a GP regression solved by IterGP.

Tatzel, Wenger, Schneider, Hennig: "Accelerating Non-Conjugate Gaussian Processes By Trading Off
Computation For Uncertainty" (Algorithms 1-3). What users call is listed in ``__all__``; the building
blocks (IterGP, the noise operators, recycling, the outer-loop driver) live in their modules
(``gpytorch_iterncgp.solver``, ``.noise``, ``.recycling``, ``.outer_loop``, ...).
"""

from . import settings
from .ep import EPState
from .evidence import EPMarginalLogLikelihood, LaplaceMarginalLogLikelihood
from .exceptions import NonFiniteEvidenceError, NotConvergedWarning, NumericalBreakdownWarning
from .likelihoods import ExpPoissonLikelihood, LogitBernoulliLikelihood, MultitaskPoissonLikelihood
from .multinomial_probit import MultinomialProbitLikelihood
from .newton import LaplaceState, SolverOptions
from .outer_loop import EPSweep, FitReport, NewtonStep
from .policies import ConjugateGradientPolicy, Policy, UnitVectorPolicy
from .sparse_ep import SparseEPState
from .sparse_evidence import SparseEPMarginalLogLikelihood
from .sparse_strategy import SparseEPStrategy
from .strategy import EPStrategy, IterNCGPStrategy

__version__ = "0.1.0"

__all__ = [
    "ConjugateGradientPolicy",
    "EPMarginalLogLikelihood",
    "EPState",
    "EPStrategy",
    "EPSweep",
    "ExpPoissonLikelihood",
    "FitReport",
    "IterNCGPStrategy",
    "LaplaceMarginalLogLikelihood",
    "LaplaceState",
    "LogitBernoulliLikelihood",
    "MultinomialProbitLikelihood",
    "MultitaskPoissonLikelihood",
    "NewtonStep",
    "NonFiniteEvidenceError",
    "NotConvergedWarning",
    "NumericalBreakdownWarning",
    "Policy",
    "SolverOptions",
    "SparseEPMarginalLogLikelihood",
    "SparseEPState",
    "SparseEPStrategy",
    "UnitVectorPolicy",
    "settings",
]
