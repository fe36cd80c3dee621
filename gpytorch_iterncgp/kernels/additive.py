r""":class:`FirstOrderAdditiveKernel`: the first-order additive kernel of Duvenaud, Nickisch & Rasmussen (2011,
"Additive Gaussian processes"), :math:`k(\mathbf x, \mathbf x') = \sum_{d=1}^{D} k_d(x_d, x'_d)`, a sum of
one-dimensional kernels, the :math:`d`-th seeing only feature :math:`d`, each with its own hyperparameters.

GPyTorch's ``AdditiveStructureKernel`` (deprecated) evaluates a batch of :math:`D` matrices :math:`n_1 \times n_2`,
and ``AdditiveKernel`` of :math:`D` kernels with ``active_dims=(d,)``, evaluated with gradients, keeps the
intermediates of every term in the autograd graph: memory :math:`O(D\, n_1 n_2)`. This kernel evaluates one term at a
time into one matrix and, where gradients are recorded, evaluates each term under non-reentrant activation
checkpointing (Chen et al. 2016, "Training deep nets with sublinear memory cost"): the backward pass saves only the
feature's column of the inputs and recomputes the term, so that memory is :math:`O(n_1 n_2)` whatever :math:`D`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from gpytorch.kernels import Kernel
from linear_operator import to_dense
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = ["FirstOrderAdditiveKernel"]


class FirstOrderAdditiveKernel(Kernel):
    r""":math:`k(\mathbf x, \mathbf x') = \sum_{d=1}^{D} k_d(x_d, x'_d)`, :math:`k_d` a copy of ``base_kernel``
    (its own hyperparameters) of feature :math:`d` alone.

    .. code-block:: python

        # a weight and a lengthscale per feature, one outputscale for the sum
        self.covar_module = ScaleKernel(FirstOrderAdditiveKernel(ScaleKernel(MaternKernel(nu=2.5)), num_dims=D))

    The kernels are ``base_kernels[d]``; with ``active_dims`` on this kernel, :math:`d` counts the active features.

    :param base_kernel: a kernel of one-dimensional inputs (no ``active_dims``, ``ard_num_dims`` None or 1, in it
        and in every kernel it holds); its batch shape is this kernel's.
    :param num_dims: :math:`D`, the number of features (of active features, with ``active_dims``).
    :raises TypeError: if ``base_kernel`` is not a GPyTorch kernel.
    :raises ValueError: if ``num_dims`` is not a positive int, or ``base_kernel`` is not one of one-dimensional inputs.
    """

    def __init__(self, base_kernel: Kernel, num_dims: int, **kwargs: Any):
        if not isinstance(base_kernel, Kernel):
            raise TypeError(f"base_kernel must be a gpytorch Kernel, got {type(base_kernel).__name__}.")
        if isinstance(num_dims, bool) or not isinstance(num_dims, int) or num_dims < 1:
            raise ValueError(f"num_dims must be a positive int (the number of features), got {num_dims!r}.")
        for name, module in base_kernel.named_modules():
            if not isinstance(module, Kernel):
                continue
            where = f"base_kernel.{name}" if name else "base_kernel"
            if module.active_dims is not None:
                raise ValueError(
                    f"{where} has active_dims={module.active_dims.tolist()}: the base kernel sees one feature; "
                    "build it without active_dims (set active_dims on the FirstOrderAdditiveKernel instead)."
                )
            if getattr(module, "ard_num_dims", None) not in (None, 1):
                raise ValueError(
                    f"{where} has ard_num_dims={module.ard_num_dims}: the base kernel sees one feature; "
                    "build it with ard_num_dims=None (each feature's copy has its own lengthscale)."
                )
        super().__init__(batch_shape=base_kernel.batch_shape, **kwargs)
        self.base_kernels = torch.nn.ModuleList(copy.deepcopy(base_kernel) for _ in range(num_dims))

    @property
    def is_stationary(self) -> bool:
        """Whether every feature's kernel is stationary."""
        return all(kernel.is_stationary for kernel in self.base_kernels)

    def _needs_gradients(self, x1: Tensor, x2: Tensor) -> bool:
        if not torch.is_grad_enabled():
            return False
        return x1.requires_grad or x2.requires_grad or any(p.requires_grad for p in self.parameters())

    def forward(self, x1: Tensor, x2: Tensor, diag: bool = False, **params: Any) -> Tensor:
        r""":math:`\sum_d k_d(x_{1, d}, x_{2, d})`, dense.

        Where gradients are recorded, each term is checkpointed: the backward pass recomputes it from the feature's
        columns of ``x1`` and ``x2``.

        :param x1: ``(..., n1, D)``.
        :param x2: ``(..., n2, D)``.
        :param diag: the diagonal alone (``x1`` is ``x2``).
        :return: ``(..., n1, n2)``; with ``diag``, ``(..., n1)``.
        :raises ValueError: if the inputs do not have :math:`D` features (active features, with ``active_dims``).
        """
        num_dims = len(self.base_kernels)
        if x1.shape[-1] != num_dims or x2.shape[-1] != num_dims:
            raise ValueError(
                f"FirstOrderAdditiveKernel of num_dims={num_dims} features got inputs of {x1.shape[-1]} and "
                f"{x2.shape[-1]} features; build it with num_dims equal to the number of (active) features."
            )
        params.pop("last_dim_is_batch", None)  # GPyTorch's Kernel.__call__ passes it (False); the base kernels' own

        def term(kernel: Kernel, x1d: Tensor, x2d: Tensor) -> Tensor:
            return to_dense(kernel.forward(x1d, x2d, diag=diag, **params))

        checkpointed = self._needs_gradients(x1, x2)
        result: Tensor | None = None
        for d, kernel in enumerate(self.base_kernels):
            x1d, x2d = x1[..., d : d + 1], x2[..., d : d + 1]
            if checkpointed:  # the kernels draw no random numbers: no RNG state to restore
                value = checkpoint(term, kernel, x1d, x2d, use_reentrant=False, preserve_rng_state=False)
            else:
                value = term(kernel, x1d, x2d)
            result = value if result is None else result + value
        assert result is not None
        return result

    def _map(self, method: str, *args: Any) -> FirstOrderAdditiveKernel:
        """A copy with every feature's kernel replaced by ``kernel.method(*args)`` (GPyTorch's recursion into
        sub-kernels sets them by dotted names, which a ``ModuleList`` does not resolve)."""
        new = copy.deepcopy(self)
        new.base_kernels = torch.nn.ModuleList(getattr(kernel, method)(*args) for kernel in self.base_kernels)
        new._batch_shape = new.base_kernels[0].batch_shape
        return new

    def __getitem__(self, index: Any) -> Kernel:
        """The kernel of batch ``index`` (every feature's kernel indexed)."""
        return self if len(self.batch_shape) == 0 else self._map("__getitem__", index)

    def expand_batch(self, *sizes: Any) -> Kernel:
        """The kernel expanded to batch shape ``sizes`` (every feature's kernel expanded)."""
        return self._map("expand_batch", *sizes)
