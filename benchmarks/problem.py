"""The benchmarks' container of one problem (:class:`Data`), which every loader returns (:mod:`benchmarks.data`,
:mod:`benchmarks.real_data`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

TENSORS = ("train_x", "train_y", "test_x", "test_y")


@dataclass
class Data:
    """A classification problem: inputs, integer labels in ``[0, num_classes)``, and, where a benchmark fixes the kernel
    instead of learning it (:mod:`benchmarks.suite`), that kernel's lengthscale and outputscale. A count regression
    problem (:data:`benchmarks.real_data.COUNTS`) has ``num_classes`` 0 and the counts as labels."""

    name: str
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    num_classes: int
    lengthscale: float | None = None
    outputscale: float | None = None

    @property
    def num_train(self) -> int:
        return len(self.train_y)

    def to(self, device: str | torch.device) -> Data:
        """The same problem with its tensors on ``device``."""
        return dataclasses.replace(self, **{name: getattr(self, name).to(device) for name in TENSORS})
