"""Sparse EP with uncertain inputs, by its public path: Ψ statistics (:mod:`.sparse.psi_statistics`), the EP loop
(:mod:`.sparse.uncertain`) and its bound (:mod:`.mlls.uncertain`)."""

from .mlls.uncertain import UncertainSparseEPMarginalLogLikelihood
from .sparse.psi_statistics import MonteCarloPsiWarning, PsiStatistics, psi_statistics
from .sparse.uncertain import UncertainDTCPrior, UncertainSparseEP, uncertain_posterior

__all__ = [
    "MonteCarloPsiWarning",
    "PsiStatistics",
    "UncertainDTCPrior",
    "UncertainSparseEP",
    "UncertainSparseEPMarginalLogLikelihood",
    "psi_statistics",
    "uncertain_posterior",
]
