r"""Recycling and compression of actions across Newton steps (paper, Algorithm 3).

The solver keeps the actions :math:`\mathbf S` (``(N C, B)``) and their kernel products
:math:`\mathbf T = \mathbf K \mathbf S` across Newton steps. When the noise :math:`\mathbf W^{-1}`
changes, a *virtual solver run* turns them into an initial precision for the new system without a
single product with :math:`\mathbf K`:

.. math::
    \mathbf M = \mathbf S^\top (\mathbf T + \mathbf W^{-1} \mathbf S) = \mathbf S^\top \hat{\mathbf K} \mathbf S
    = \mathbf U \boldsymbol\Lambda \mathbf U^\top, \qquad
    \mathbf S \leftarrow \mathbf S \mathbf U_R,\quad \mathbf T \leftarrow \mathbf T \mathbf U_R,\quad
    \mathbf Q = \mathbf S \mathbf U_R \boldsymbol\Lambda_R^{-1/2},

keeping the top :math:`R` eigenpairs (compression). Then :math:`\mathbf C_0 = \mathbf Q \mathbf Q^\top
= \mathbf S (\mathbf S^\top \hat{\mathbf K} \mathbf S)^{-1} \mathbf S^\top` (for :math:`R = B`), and the
residual of :math:`\mathbf v_0 = \mathbf C_0 \mathbf b` is orthogonal to :math:`\operatorname{span}(\mathbf S)`
(Proposition A.4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from linear_operator.operators import LinearOperator
from torch import Tensor

from .precision import ColumnStore


@dataclass
class ActionBuffer:
    r"""Actions :math:`\mathbf S` and kernel products :math:`\mathbf T = \mathbf K \mathbf S`, each ``(N C, B)``.

    Actions are stored with unit norm; both grow by one column per solver iteration.
    """

    actions: ColumnStore
    kernel_actions: ColumnStore

    @classmethod
    def from_tensors(cls, actions: Tensor, kernel_actions: Tensor) -> ActionBuffer:
        return cls(ColumnStore(actions), ColumnStore(kernel_actions))

    @classmethod
    def empty(cls, size: int, dtype: torch.dtype, device: torch.device) -> ActionBuffer:
        empty = torch.zeros(size, 0, dtype=dtype, device=device)
        return cls.from_tensors(empty, empty.clone())

    @property
    def size(self) -> int:
        """The number of actions :math:`B`."""
        return self.actions.size

    def append(self, action: Tensor, kernel_action: Tensor) -> None:
        self.actions.append(action)
        self.kernel_actions.append(kernel_action)


@dataclass
class VirtualRun:
    r"""The result of a virtual solver run: re-weighted buffer and the root of :math:`\mathbf C_0`."""

    buffer: ActionBuffer
    precision_root: Tensor  # Q, (N C, r)
    kernel_precision_root: Tensor  # K Q, (N C, r)


def virtual_solver_run(
    buffer: ActionBuffer,
    noise_inverse: LinearOperator,
    compression_rank: int | None = None,
    relative_eigenvalue_tolerance: float | None = None,
    keep: tuple[Tensor, Tensor] | None = None,
) -> VirtualRun:
    r"""Algorithm 3: the initial precision for a new noise :math:`\mathbf W^{-1}`, with no product with :math:`\mathbf K`.

    :param buffer: actions and kernel products ``(N C, B)`` from earlier solves with the *same* kernel.
    :param noise_inverse: the new :math:`\mathbf W^{-1}`, ``(N C, N C)``.
    :param compression_rank: :math:`R`, the number of eigenpairs kept (``None``: all).
    :param relative_eigenvalue_tolerance: eigenvalues :math:`\lambda \le \epsilon \lambda_1` are dropped
        (numerically dependent actions); default ``1000 * finfo(dtype).eps``.
    :param keep: a direction and its kernel product, ``((N C,), (N C,))``, that compression must not
        drop: the top :math:`R - 1` eigen-directions are kept, plus this one. The Newton loop passes the
        current representer weights :math:`\mathbf a`, so that the initial solution
        :math:`\mathbf C_0 \mathbf b` is never worse than (a multiple of) :math:`\mathbf a`.
    :return: the re-weighted buffer (at most :math:`R` columns, unit-norm actions), :math:`\mathbf Q`
        and :math:`\mathbf K \mathbf Q`.
    """
    if keep is not None and compression_rank is not None and float(keep[0].norm()) > 0:
        compressed = virtual_solver_run(
            buffer, noise_inverse, max(compression_rank - 1, 0), relative_eigenvalue_tolerance
        )
        norm = keep[0].norm()
        compressed.buffer.append(keep[0] / norm, keep[1] / norm)
        return virtual_solver_run(compressed.buffer, noise_inverse, None, relative_eigenvalue_tolerance)
    actions, kernel_actions = buffer.actions.value, buffer.kernel_actions.value
    if buffer.size == 0:
        return VirtualRun(buffer, actions, kernel_actions)
    dtype = actions.dtype
    if relative_eigenvalue_tolerance is None:
        relative_eigenvalue_tolerance = 1000 * torch.finfo(dtype).eps
    # The Gram matrix S^T K̂ S and its eigendecomposition in float64 (float32 eigh fails on it).
    noisy_actions = kernel_actions + noise_inverse.matmul(actions)
    gram = actions.double().mT @ noisy_actions.double()
    gram = (gram + gram.mT) / 2
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    eigenvalues, eigenvectors = eigenvalues.flip(-1), eigenvectors.flip(-1)
    rank = int((eigenvalues > relative_eigenvalue_tolerance * eigenvalues[0].clamp_min(0)).sum())
    if eigenvalues[0] <= 0:
        rank = 0
    if compression_rank is not None:
        rank = min(rank, compression_rank)
    eigenvalues, eigenvectors = eigenvalues[:rank], eigenvectors[:, :rank]
    # The re-weighting itself in the working dtype: O(N C B r), the bulk of this function's cost.
    eigenvectors = eigenvectors.to(dtype)
    new_actions = actions @ eigenvectors
    new_kernel_actions = kernel_actions @ eigenvectors
    inverse_sqrt = eigenvalues.rsqrt().to(dtype)
    precision_root = new_actions * inverse_sqrt
    kernel_precision_root = new_kernel_actions * inverse_sqrt
    norms = new_actions.norm(dim=0).clamp_min(torch.finfo(dtype).tiny)
    new_buffer = ActionBuffer.from_tensors(new_actions / norms, new_kernel_actions / norms)
    return VirtualRun(new_buffer, precision_root, kernel_precision_root)
