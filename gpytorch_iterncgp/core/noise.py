r"""Linear operators for the "noise" :math:`\mathbf W^{-1}` of each Newton step.

Every Newton step of the Laplace approximation is a GP regression with pseudo-targets and the
noise covariance :math:`\mathbf W^{-1}`, where :math:`\mathbf W = -\nabla^2 \log p(\mathbf y \mid
\mathbf f)` is block diagonal with one :math:`C \times C` block per data point. Vectors are
ordered data-major: entry ``n * C + c`` belongs to data point ``n`` and latent ``c``.

Three shapes of :math:`\mathbf W^{-1}` occur:

* :class:`DiagonalNoiseInverse`: :math:`C = 1` (binary classification, count regression);
* :class:`BlockNoiseInverse`: positive definite :math:`C \times C` blocks (autograd likelihoods);
* :class:`SoftmaxPseudoInverse`: the softmax curvature
  :math:`\mathbf W_n = \operatorname{diag}(\boldsymbol\pi_n) - \boldsymbol\pi_n \boldsymbol\pi_n^\top`
  is singular, and its Moore–Penrose pseudo-inverse has the closed form of the paper's Lemma A.7.
"""

from __future__ import annotations

import torch
from linear_operator.operators import DiagLinearOperator, LinearOperator
from torch import Tensor


def _block_means(blocks: Tensor) -> Tensor:
    r"""The means over the last dimension (``keepdim``), as a product with :math:`\mathbf 1 / C`: on the CPU faster
    than torch's reduction over a few contiguous entries (``docs/design_notes.md``)."""
    return blocks @ blocks.new_full((blocks.shape[-1], 1), 1 / blocks.shape[-1])


class FactoredNoise:
    r"""A block-diagonal noise :math:`\mathbf W^{-1} = \mathbf F \mathbf F^\top` whose factor is applied to the rows of
    a few data points at a time (:meth:`whiten_rows`), so that :math:`\mathbf X \mathbf W^{-1} \mathbf X^\top =
    \sum_\text{chunks} (\mathbf X \mathbf F)(\mathbf X \mathbf F)^\top` needs only a chunk of :math:`\mathbf X
    \mathbf F` at a time and is positive semi-definite by construction."""

    entries_per_point: int  # the size of a diagonal block of W^{-1}; chunks hold whole blocks
    centring = False  # whether F = P G with the centring P of each block: rows with zero block sums skip P

    def apply(self, vectors: Tensor) -> Tensor:
        r""":math:`\mathbf W^{-1} \mathbf X` for ``(n, k)`` without linear_operator's dispatch (its autograd function
        and representation tree cost about a third of the product itself for one vector of :math:`10^5` entries;
        gradients still flow through the torch operations)."""
        return self._matmul(vectors)  # type: ignore[attr-defined]

    def whiten_rows(self, rows: Tensor, start: int, centred: bool = False) -> Tensor:
        r""":math:`\mathbf X \mathbf F` ``(k, m)`` for rows :math:`\mathbf X` ``(k, m)`` holding the entries
        ``start .. start + m`` (whole blocks) of ``k`` vectors; non-batched operators only. ``centred``: every block of
        every row sums to zero (to rounding), so a factor with :attr:`centring` leaves out :math:`\mathbf P`."""
        raise NotImplementedError


class DiagonalNoiseInverse(FactoredNoise, DiagLinearOperator):
    r"""Diagonal noise :math:`\mathbf W^{-1} = \operatorname{diag}(1 / w_n)` (size ``(..., N, N)``).

    :param noise_diagonal: :math:`1 / w_n`, shape ``(..., N)``.
    """

    @classmethod
    def from_curvature(cls, curvature: Tensor, min_curvature: float) -> DiagonalNoiseInverse:
        r"""Build :math:`\mathbf W^{-1}` from the curvature :math:`w_n \ge 0`, shape ``(..., N)``.

        The curvature is bounded below by ``min_curvature`` so that :math:`\mathbf W^{-1}` stays finite
        where the likelihood is flat (logit and softplus links in their tails): such points get a
        noise of at most ``1 / min_curvature`` and have almost no influence on the regression.
        """
        return cls(curvature.clamp_min(min_curvature).reciprocal())

    entries_per_point = 1

    def whiten_rows(self, rows: Tensor, start: int, centred: bool = False) -> Tensor:
        r""":math:`\mathbf X \operatorname{diag}(w^{-1/2})` (the noise is non-negative: :math:`1 / w_n`, :math:`w_n \ge 0`)."""
        return rows * self._diag[start : start + rows.shape[-1]].sqrt()


class BlockNoiseInverse(FactoredNoise, LinearOperator):
    r"""Block-diagonal noise :math:`\mathbf W^{-1}` with positive definite :math:`C \times C` blocks.

    Stores the Cholesky factors :math:`\mathbf L_n` of the curvature blocks
    :math:`\mathbf W_n = \mathbf L_n \mathbf L_n^\top` and multiplies by batched triangular solves,
    :math:`O(N C^2)` per column. Size ``(..., N C, N C)``, data-major.

    :param curvature_cholesky: :math:`\mathbf L_n`, shape ``(..., N, C, C)``, lower triangular.
    """

    def __init__(self, curvature_cholesky: Tensor):
        super().__init__(curvature_cholesky)
        self.curvature_cholesky = curvature_cholesky

    @classmethod
    def from_curvature(cls, curvature: Tensor, min_curvature: float) -> BlockNoiseInverse:
        r"""Build from curvature blocks :math:`\mathbf W_n`, shape ``(..., N, C, C)``.

        ``min_curvature`` is added to every block's diagonal (a bound on :math:`\|\mathbf W^{-1}\|`).

        :raises ValueError: if a block is not positive definite after that shift.
        """
        eye = torch.eye(curvature.shape[-1], dtype=curvature.dtype, device=curvature.device)
        cholesky, info = torch.linalg.cholesky_ex(curvature + min_curvature * eye)
        if bool((info > 0).any()):
            raise ValueError(
                "The likelihood's curvature W = -d²log p(y|f)/df² has a block that is not positive definite "
                f"at the current latent values (data point {int((info > 0).nonzero()[0, -1])}): "
                "the likelihood is not log-concave there."
            )
        return cls(cholesky)

    def _size(self) -> torch.Size:
        *batch, num_data, num_latents, _ = self.curvature_cholesky.shape
        return torch.Size((*batch, num_data * num_latents, num_data * num_latents))

    def _matmul(self, rhs: Tensor) -> Tensor:
        num_data, num_latents = self.curvature_cholesky.shape[-3:-1]
        blocks = rhs.reshape(*rhs.shape[:-2], num_data, num_latents, rhs.shape[-1])
        result = torch.cholesky_solve(blocks, self.curvature_cholesky)
        return result.reshape(*result.shape[:-3], num_data * num_latents, rhs.shape[-1])

    def _transpose_nonbatch(self) -> LinearOperator:
        return self

    @property
    def entries_per_point(self) -> int:  # type: ignore[override]
        return self.curvature_cholesky.shape[-1]

    def whiten_rows(self, rows: Tensor, start: int, centred: bool = False) -> Tensor:
        r""":math:`\mathbf X \mathbf L^{-\top}` (:math:`\mathbf W^{-1} = \mathbf L^{-\top} \mathbf L^{-1}`), by one batched
        triangular solve over the chunk's points."""
        size = self.entries_per_point
        points = self.curvature_cholesky[start // size : (start + rows.shape[-1]) // size]  # (m, C, C)
        blocks = rows.reshape(rows.shape[0], len(points), size).permute(1, 2, 0)  # (m, C, k)
        solved = torch.linalg.solve_triangular(points, blocks, upper=False)  # L^{-1} X^T per point
        return solved.permute(2, 0, 1).reshape(rows.shape)

    def _diagonal(self) -> Tensor:
        eye = torch.eye(self.curvature_cholesky.shape[-1], dtype=self.dtype, device=self.device)
        inverse_cholesky = torch.linalg.solve_triangular(self.curvature_cholesky, eye, upper=False)
        # (L^{-T} L^{-1})_{cc} = sum_k (L^{-1})_{kc}^2
        return inverse_cholesky.square().sum(-2).flatten(-2)

    def _expand_batch(self, batch_shape: torch.Size) -> LinearOperator:
        return self.__class__(self.curvature_cholesky.expand(*batch_shape, *self.curvature_cholesky.shape[-3:]))


class SoftmaxPseudoInverse(FactoredNoise, LinearOperator):
    r"""Pseudo-inverse of the softmax curvature, :math:`\mathbf W^+` (paper, Lemma A.7).

    Per data point, with class probabilities :math:`\boldsymbol\pi_n` and the centring projection
    :math:`\mathbf P = \mathbf I - \mathbf 1 \mathbf 1^\top / C`,

    .. math::
        \mathbf W_n^+ = \mathbf P \operatorname{diag}(\boldsymbol\pi_n)^{-1} \mathbf P,

    applied in :math:`O(C)` per point and column. :math:`\mathbf W_n` has the null space
    :math:`\mathbf 1` (adding a constant to all logits of a point changes nothing), which
    :math:`\mathbf W_n^+` maps to zero. Size ``(..., N C, N C)``, data-major.

    Probabilities are used as given; :meth:`from_probabilities` bounds them away from zero so that
    saturated softmax outputs (:math:`\pi \to 0`) do not overflow :math:`\operatorname{diag}(\pi)^{-1}`.

    :param probabilities: :math:`\boldsymbol\pi`, shape ``(..., N, C)``.
    """

    def __init__(self, probabilities: Tensor):
        super().__init__(probabilities)
        self.probabilities = probabilities

    @classmethod
    def from_probabilities(cls, probabilities: Tensor, min_probability: float) -> SoftmaxPseudoInverse:
        """Build from softmax probabilities ``(..., N, C)``, bounded below by ``min_probability``."""
        return cls(probabilities.clamp_min(min_probability))

    def _size(self) -> torch.Size:
        *batch, num_data, num_classes = self.probabilities.shape
        return torch.Size((*batch, num_data * num_classes, num_data * num_classes))

    def _matmul(self, rhs: Tensor) -> Tensor:
        num_data, num_classes = self.probabilities.shape[-2:]
        if rhs.mT.is_contiguous():  # columns stored as rows (a vector, or S from the buffer): work in that layout
            blocks = rhs.mT.reshape(*rhs.shape[:-2], rhs.shape[-1], num_data, num_classes)
            blocks = (blocks - _block_means(blocks)) / self.probabilities.unsqueeze(-3)
            blocks.sub_(_block_means(blocks))
            return blocks.reshape(*blocks.shape[:-2], num_data * num_classes).mT
        blocks = rhs.reshape(*rhs.shape[:-2], num_data, num_classes, rhs.shape[-1])
        blocks = blocks - blocks.mean(dim=-2, keepdim=True)
        blocks = blocks / self.probabilities.unsqueeze(-1)
        blocks = blocks - blocks.mean(dim=-2, keepdim=True)
        return blocks.reshape(*blocks.shape[:-3], num_data * num_classes, rhs.shape[-1])

    @property
    def entries_per_point(self) -> int:  # type: ignore[override]
        return self.probabilities.shape[-1]

    centring = True

    def whiten_rows(self, rows: Tensor, start: int, centred: bool = False) -> Tensor:
        r""":math:`\mathbf X \mathbf P \operatorname{diag}(\boldsymbol\pi)^{-1/2}` (:math:`\mathbf W^+ = \mathbf F \mathbf F^\top`
        with :math:`\mathbf F = \mathbf P \operatorname{diag}(\boldsymbol\pi)^{-1/2}`): centre each point's block (unless
        ``centred``: IterGP's projected actions), then scale it. The class means are one matrix-vector product over the
        chunk made contiguous (faster than over the strided chunk)."""
        num_classes = self.entries_per_point
        probabilities = self.probabilities[start // num_classes : (start + rows.shape[-1]) // num_classes]
        if centred:
            scaled = rows.reshape(rows.shape[0], len(probabilities), num_classes) * probabilities.rsqrt()
            return scaled.view(rows.shape)
        blocks = rows.contiguous().view(-1, num_classes)
        centred_rows = (blocks - _block_means(blocks)).view(rows.shape[0], len(probabilities), num_classes)
        return centred_rows.mul_(probabilities.rsqrt()).view(rows.shape)

    def _transpose_nonbatch(self) -> LinearOperator:
        return self

    def _diagonal(self) -> Tensor:
        # (P D^{-1} P)_{cc} = (1 - 2/C) / pi_c + sum_k (1 / pi_k) / C^2
        num_classes = self.probabilities.shape[-1]
        inverse = self.probabilities.reciprocal()
        diagonal = (1 - 2 / num_classes) * inverse + inverse.sum(-1, keepdim=True) / num_classes**2
        return diagonal.flatten(-2)

    def _expand_batch(self, batch_shape: torch.Size) -> LinearOperator:
        return self.__class__(self.probabilities.expand(*batch_shape, *self.probabilities.shape[-2:]))


def project_to_zero_sum(vectors: Tensor, num_latents: int) -> Tensor:
    r"""Project data-major vectors ``(N C, k)`` onto :math:`\operatorname{range}(\mathbf W)` of a softmax.

    Subtracts, for every data point, the mean over its :math:`C` classes: :math:`\mathbf s_n \leftarrow
    \mathbf P \mathbf s_n`. Restricting IterGP's actions to this range makes its covariance converge to
    the Laplace covariance instead of the over-confident one of the plain pseudo-inverse noise.
    """
    if vectors.shape[-1] == 1 and vectors.is_contiguous():  # one vector: each point's classes are contiguous
        blocks = vectors.view(-1, num_latents)
        return (blocks - _block_means(blocks)).view(vectors.shape)
    blocks = vectors.reshape(-1, num_latents, vectors.shape[-1])
    return (blocks - blocks.mean(dim=-2, keepdim=True)).reshape(vectors.shape)
