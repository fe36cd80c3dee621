"""The scikit-learn estimators, by their public path (:mod:`.integrations.sklearn`)."""

from .integrations.sklearn import IterNCGPClassifier, IterNCGPNegativeBinomialRegressor, IterNCGPPoissonRegressor

__all__ = ["IterNCGPClassifier", "IterNCGPNegativeBinomialRegressor", "IterNCGPPoissonRegressor"]
