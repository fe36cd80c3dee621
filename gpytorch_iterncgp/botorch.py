"""The BoTorch model, by its public path (:mod:`.integrations.botorch`)."""

from .integrations.botorch import IterNCGPBoTorchModel

__all__ = ["IterNCGPBoTorchModel"]
