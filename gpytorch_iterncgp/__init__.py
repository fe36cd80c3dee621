"""IterNCGP for GPyTorch: Laplace (Newton steps) and expectation propagation (EP sweeps) for non-conjugate GPs,
every step a GP regression solved by IterGP.

Tatzel, Wenger, Schneider, Hennig: "Accelerating Non-Conjugate Gaussian Processes By Trading Off
Computation For Uncertainty" (Algorithms 1-3). What users call is listed in ``__all__``. The subpackages are the
layers, each importing only from those below it: :mod:`.core` (IterGP, the noise operators, recycling, the
outer-loop driver, the prior's products), :mod:`.likelihoods`, the outer loops :mod:`.laplace` and :mod:`.ep`,
:mod:`.sparse` (EP-DTC), :mod:`.strategies` (the GPyTorch-facing layer), :mod:`.mlls`, :mod:`.learning` (:func:`fit_mll`), :mod:`.models` (GP-LVM,
GP-ALPS), :mod:`.kernels` (``ShardedKernel`` for several processes, at ``gpytorch_iterncgp.distributed``) and
:mod:`.integrations` (scikit-learn, BoTorch; also at ``gpytorch_iterncgp.sklearn`` and ``.botorch``).
"""

from . import settings
from .core.outer_loop import EPSweep, FitReport, NewtonStep
from .core.policies import ConjugateGradientPolicy, Policy, UnitVectorPolicy
from .ep.sweeps import EPState
from .exceptions import (
    BufferLimitWarning,
    ConvergenceWarning,
    EstimatedEvidenceWarning,
    ExplicitGradientWarning,
    NonFiniteEvidenceError,
    NotConvergedWarning,
    NumericalBreakdownWarning,
    WorseThanConstantWarning,
)
from .laplace.newton import LaplaceState, SolverOptions
from .learning.fit import fit_mll
from .learning.minibatch import MinibatchRecipe
from .learning.recipe import LearningRecipe, LearningReport
from .likelihoods.adapters import ExpPoissonLikelihood, LogitBernoulliLikelihood, MultitaskPoissonLikelihood
from .likelihoods.multinomial_probit import MultinomialProbitLikelihood
from .likelihoods.negative_binomial import NegativeBinomialLikelihood
from .likelihoods.quasi_poisson import QuasiExpPoissonLikelihood, QuasiSoftplusPoissonLikelihood
from .mlls.itergp import EPMarginalLogLikelihood, LaplaceMarginalLogLikelihood
from .mlls.sparse import SparseEPMarginalLogLikelihood
from .mlls.stochastic import StochasticEPMarginalLogLikelihood
from .models.alps import GPALPS, GPALPSELBO
from .models.gplvm import EPLatentVariableModel, NoisyInputGPClassifier
from .sparse.dtc import SparseEPState
from .strategies.itergp import EPStrategy, IterNCGPStrategy
from .strategies.sparse import SparseEPStrategy
from .strategies.stochastic import StochasticEPStrategy

__version__ = "0.1.0"

__all__ = [
    "BufferLimitWarning",
    "ConjugateGradientPolicy",
    "ConvergenceWarning",
    "EPMarginalLogLikelihood",
    "EPState",
    "EPStrategy",
    "EPSweep",
    "EstimatedEvidenceWarning",
    "ExplicitGradientWarning",
    "ExpPoissonLikelihood",
    "EPLatentVariableModel",
    "FitReport",
    "GPALPS",
    "GPALPSELBO",
    "IterNCGPStrategy",
    "LaplaceMarginalLogLikelihood",
    "LaplaceState",
    "LearningRecipe",
    "MinibatchRecipe",
    "LearningReport",
    "LogitBernoulliLikelihood",
    "MultinomialProbitLikelihood",
    "MultitaskPoissonLikelihood",
    "NegativeBinomialLikelihood",
    "NewtonStep",
    "NoisyInputGPClassifier",
    "NonFiniteEvidenceError",
    "NotConvergedWarning",
    "NumericalBreakdownWarning",
    "Policy",
    "QuasiExpPoissonLikelihood",
    "QuasiSoftplusPoissonLikelihood",
    "SolverOptions",
    "SparseEPMarginalLogLikelihood",
    "SparseEPState",
    "SparseEPStrategy",
    "StochasticEPMarginalLogLikelihood",
    "StochasticEPStrategy",
    "UnitVectorPolicy",
    "WorseThanConstantWarning",
    "fit_mll",
    "settings",
]
