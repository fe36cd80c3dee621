r"""The paper's synthetic multi-class problem (Appendix C.3), for examples, benchmarks and tests.

A mixture of :math:`C` Gaussians in :math:`D` dimensions: class means uniform in :math:`[-1, 1]^D`,
covariances :math:`\mathbf V \operatorname{diag}(\boldsymbol\lambda) \mathbf V^\top` with :math:`\mathbf V`
the eigenvectors of :math:`\mathbf A \mathbf A^\top` (:math:`\mathbf A` uniform in :math:`[0, 1]^{D \times D}`)
and :math:`\lambda_d` uniform in :math:`[0.001, 0.1]`. The mixture is fixed by ``mixture_seed``; the samples
drawn from it by ``sample_seed`` (one per run), with equally many points per class.
"""

from __future__ import annotations

import torch
from torch import Tensor


def gaussian_mixture(
    num_train: int,
    num_test: int,
    num_classes: int = 10,
    dim: int = 3,
    mixture_seed: int = 0,
    sample_seed: int | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Training and test sets ``(train_x (N, D), train_y (N,), test_x (N*, D), test_y (N*,))``, shuffled.

    :param num_train: :math:`N`, a multiple of ``num_classes`` (the paper: :math:`10^5`).
    :param num_test: :math:`N_*`, a multiple of ``num_classes`` (the paper: :math:`10^4`).
    :param mixture_seed: fixes the class means and covariances (the same for every run).
    :param sample_seed: the seed of this run's samples; default ``mixture_seed``.
    :param dtype: of the inputs; default ``torch.get_default_dtype()``.
    :raises ValueError: if a size is not a positive multiple of ``num_classes``.
    """
    for name, size in (("num_train", num_train), ("num_test", num_test)):
        if size <= 0 or size % num_classes:
            raise ValueError(f"{name}={size} must be a positive multiple of num_classes={num_classes}.")
    generator = torch.Generator().manual_seed(mixture_seed)
    means = 2 * torch.rand(num_classes, dim, generator=generator, dtype=torch.float64) - 1
    matrices = torch.rand(num_classes, dim, dim, generator=generator, dtype=torch.float64)
    _, eigenvectors = torch.linalg.eigh(matrices @ matrices.mT)
    eigenvalues = 0.001 + (0.1 - 0.001) * torch.rand(num_classes, dim, generator=generator, dtype=torch.float64)
    roots = eigenvectors * eigenvalues.sqrt()[:, None, :]  # covariance = root @ root^T
    samples = torch.Generator().manual_seed(mixture_seed if sample_seed is None else sample_seed)

    def sample(num: int) -> tuple[Tensor, Tensor]:
        per_class = num // num_classes
        noise = torch.randn(num_classes, per_class, dim, generator=samples, dtype=torch.float64)
        inputs = (means[:, None, :] + noise @ roots.mT).reshape(-1, dim)
        labels = torch.arange(num_classes).repeat_interleave(per_class)
        order = torch.randperm(len(labels), generator=samples)
        return inputs[order].to(dtype or torch.get_default_dtype()), labels[order]

    return (*sample(num_train), *sample(num_test))
