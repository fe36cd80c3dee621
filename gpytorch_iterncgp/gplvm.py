"""The GP-LVM and the noisy-input classifier, by their public path (:mod:`.models.gplvm`)."""

from .models.gplvm import EPLatentVariableModel, NoisyInputGPClassifier, pca_initialisation

__all__ = ["EPLatentVariableModel", "NoisyInputGPClassifier", "pca_initialisation"]
