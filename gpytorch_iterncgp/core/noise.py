r"""Linear operators for the "noise" :math:`\mathbf W^{-1}` of each Newton step.

Every Newton step of the Laplace approximation is a GP regression with pseudo-targets and the
noise covariance :math:`\mathbf W^{-1}`, where :math:`\mathbf W = -\nabla^2 \log p(\mathbf y \mid
\mathbf f)` is block diagonal with one :math:`C \times C` block per data point. Vectors are
ordered data-major: entry ``n * C + c`` belongs to data point ``n`` and latent ``c``.

Four shapes of :math:`\mathbf W^{-1}` occur:

* :class:`DiagonalNoiseInverse`: :math:`C = 1` (binary classification, count regression; EP's scalar sites);
* :class:`BlockNoiseInverse`: positive definite :math:`C \times C` blocks (autograd likelihoods);
* :class:`SoftmaxPseudoInverse`: the softmax curvature
  :math:`\mathbf W_n = \operatorname{diag}(\boldsymbol\pi_n) - \boldsymbol\pi_n \boldsymbol\pi_n^\top`
  is singular, and its Moore–Penrose pseudo-inverse has the closed form of the paper's Lemma A.7;
* :class:`SiteBlockNoiseInverse`: EP's :math:`C \times C` site blocks :math:`\tilde{\mathbf T}_n` of rank at most
  :math:`C - 1` (null space :math:`\mathbf 1`), bounded pseudo-inverses as dense blocks.

Each is a :class:`NoiseOperator`: besides its products it gives the covariance phase the products with
:math:`\mathbf W` (:meth:`NoiseOperator.curvature_matmul`); the first three are :class:`FactoredNoise`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from linear_operator.operators import DiagLinearOperator, LinearOperator
from torch import Tensor


def _block_means(blocks: Tensor) -> Tensor:
    r"""The means over the last dimension (``keepdim``), as a product with :math:`\mathbf 1 / C`: on the CPU faster
    than torch's reduction over a few contiguous entries (``docs/design_notes.md``)."""
    return blocks @ blocks.new_full((blocks.shape[-1], 1), 1 / blocks.shape[-1])


class NoiseOperator:
    r"""A block-diagonal noise :math:`\mathbf W^{-1}` of the package (data-major :math:`C \times C` blocks), with the
    products the solver and the covariance phase need without linear_operator's dispatch."""

    entries_per_point: int  # C, the size of a diagonal block of W^{-1}

    def apply(self, vectors: Tensor) -> Tensor:
        r""":math:`\mathbf W^{-1} \mathbf X` for ``(n, k)`` without linear_operator's dispatch (its autograd function
        and representation tree cost about a third of the product itself for one vector of :math:`10^5` entries;
        gradients still flow through the torch operations)."""
        return self._matmul(vectors)  # type: ignore[attr-defined]

    def curvature_matmul(self) -> Callable[[Tensor], Tensor]:
        r""":math:`\mathbf V \mapsto \mathbf W \mathbf V` for ``(n, k)`` (non-batched), :math:`\mathbf W` the
        (pseudo-)inverse of this noise: the covariance phase's preconditioner
        (:func:`~gpytorch_iterncgp.core.covariance.covariance_phase`). Precomputes what it needs once.

        :return: the product as a function of ``(n, k)`` blocks of vectors.
        """
        raise NotImplementedError


class FactoredNoise(NoiseOperator):
    r"""A block-diagonal noise :math:`\mathbf W^{-1} = \mathbf F \mathbf F^\top` whose factor is applied to the rows of
    a few data points at a time (:meth:`whiten_rows`), so that :math:`\mathbf X \mathbf W^{-1} \mathbf X^\top =
    \sum_\text{chunks} (\mathbf X \mathbf F)(\mathbf X \mathbf F)^\top` needs only a chunk of :math:`\mathbf X
    \mathbf F` at a time and is positive semi-definite by construction."""

    centring = False  # whether F = P G with the centring P of each block: rows with zero block sums skip P

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

    def curvature_matmul(self) -> Callable[[Tensor], Tensor]:
        r""":math:`\mathbf V \mapsto \operatorname{diag}(w_n) \mathbf V`, :math:`w_n` the reciprocal of the noise's diagonal
        (0 where that is 0: a pseudo-inverse)."""
        diagonal = self.diagonal()
        inverse = torch.where(diagonal > 0, diagonal.reciprocal(), torch.zeros_like(diagonal))
        return lambda vectors: inverse[:, None] * vectors


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

    def curvature_matmul(self) -> Callable[[Tensor], Tensor]:
        r""":math:`\mathbf V \mapsto \mathbf W \mathbf V` blockwise, :math:`\mathbf W_n = \mathbf L_n \mathbf L_n^\top`."""
        cholesky = self.curvature_cholesky  # (N, C, C)

        def block_curvature(vectors: Tensor) -> Tensor:
            blocks = vectors.reshape(cholesky.shape[0], cholesky.shape[-1], vectors.shape[-1])
            return (cholesky @ (cholesky.mT @ blocks)).reshape(vectors.shape)

        return block_curvature

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

    def curvature_matmul(self) -> Callable[[Tensor], Tensor]:
        r""":math:`\mathbf V \mapsto \mathbf W \mathbf V` blockwise, :math:`\mathbf W_n = \operatorname{diag}(\boldsymbol\pi_n)
        - \boldsymbol\pi_n \boldsymbol\pi_n^\top` (Lemma A.7: the pseudo-inverse of :math:`\mathbf W_n^+`)."""
        probabilities = self.probabilities  # (N, C)

        def softmax_curvature(vectors: Tensor) -> Tensor:
            blocks = vectors.reshape(*probabilities.shape, vectors.shape[-1])
            weighted = probabilities[..., None] * blocks
            result = weighted - probabilities[..., None] * weighted.sum(-2, keepdim=True)
            return result.reshape(vectors.shape)

        return softmax_curvature

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


def block_pseudo_inverse_matmul(blocks: Tensor) -> Callable[[Tensor], Tensor]:
    r""":math:`\mathbf V \mapsto \operatorname{blockdiag}(\mathbf B_n^+) \mathbf V` for symmetric blocks
    :math:`\mathbf B_n` ``(N, C, C)`` of a data-major block-diagonal matrix, ``V`` ``(N C, k)``.

    The Moore–Penrose pseudo-inverses are formed once, in float64 (``torch.linalg.pinv``, ``hermitian``, singular
    values below :math:`10^{-10}` of each block's largest taken as zero, or below 100 times the rounding of the blocks'
    dtype where that is more: float32), and returned in the blocks' dtype.

    :param blocks: :math:`\mathbf B_n`, ``(N, C, C)``.
    :return: the product as a function of ``(N C, k)`` blocks of vectors.
    """
    # below rounding of the blocks' own dtype a singular value is zero (a float32 block's null space 1 rounds to ~1e-8)
    rtol = max(1e-10, 100 * torch.finfo(blocks.dtype).eps)
    pseudo_inverse = torch.linalg.pinv(blocks.double(), hermitian=True, rtol=rtol).to(blocks.dtype)

    def block_product(vectors: Tensor) -> Tensor:
        shaped = vectors.reshape(pseudo_inverse.shape[0], pseudo_inverse.shape[-1], vectors.shape[-1])
        return (pseudo_inverse @ shaped).reshape(vectors.shape)

    return block_product


def curvature_matmul(noise_inverse: LinearOperator, num_latents: int) -> Callable[[Tensor], Tensor]:
    r""":math:`\mathbf V \mapsto \mathbf W \mathbf V` for the (pseudo-)inverse :math:`\mathbf W` of the noise
    :math:`\mathbf W^{-1}` ``(n, n)``, block diagonal with :math:`C \times C` blocks (data-major).

    The package's noise operators give it in closed form (:meth:`NoiseOperator.curvature_matmul`);
    any other block-diagonal noise by pseudo-inverses of its blocks in float64, read off by products with
    :math:`C` unit vectors per block (:func:`block_pseudo_inverse_matmul`).

    :param noise_inverse: :math:`\mathbf W^{-1}`, ``(n, n)``.
    :param num_latents: :math:`C`.
    :return: the product as a function of ``(n, k)`` blocks of vectors.
    """
    if isinstance(noise_inverse, NoiseOperator):
        return noise_inverse.curvature_matmul()
    size = noise_inverse.shape[-1]
    selector = torch.eye(num_latents, dtype=noise_inverse.dtype, device=noise_inverse.device).repeat(
        size // num_latents, 1
    )
    blocks = noise_inverse.matmul(selector).reshape(size // num_latents, num_latents, num_latents)
    return block_pseudo_inverse_matmul(blocks)


class SiteBlockNoiseInverse(NoiseOperator, LinearOperator):
    r"""EP's noise for :math:`C \times C` site blocks: the bounded pseudo-inverses :math:`\tilde{\mathbf T}_n^+` of the
    site precisions, stored as dense blocks (size ``(..., N C, N C)``, data-major).

    A site block of the multinomial probit likelihood depends on the latents only through their differences, so
    :math:`\tilde{\mathbf T}_n` has rank at most :math:`C - 1` and the null space :math:`\mathbf 1`. With its
    eigendecomposition :math:`\tilde{\mathbf T}_n = \mathbf V_n \boldsymbol\Lambda_n \mathbf V_n^\top` on
    :math:`\mathbf 1^\perp` (:math:`\mathbf V_n` ``(C, C - 1)``),

    .. math::
        \tilde{\mathbf T}_n^+ = \mathbf V_n \max(\boldsymbol\Lambda_n, \lambda_{\min})^{-1} \mathbf V_n^\top,

    the eigenvalues bounded below by ``min_precision`` :math:`\lambda_{\min}` (:meth:`from_site_spectrum`), so that a
    flat site adds a bounded noise rather than an infinite one. Products are batched :math:`C \times C` products,
    :math:`O(N C^2)` per column. The blocks are singular (null space :math:`\mathbf 1`), so there is no solve.

    :param blocks: :math:`\tilde{\mathbf T}_n^+`, shape ``(..., N, C, C)``.
    """

    def __init__(self, blocks: Tensor):
        super().__init__(blocks)
        self.blocks = blocks

    @property
    def entries_per_point(self) -> int:  # type: ignore[override]
        return self.blocks.shape[-1]

    @classmethod
    def from_site_spectrum(
        cls, eigenvalues: Tensor, eigenvectors: Tensor, min_precision: float
    ) -> SiteBlockNoiseInverse:
        r"""Build from the site blocks' spectrum on :math:`\mathbf 1^\perp`.

        :param eigenvalues: :math:`\boldsymbol\Lambda_n`, ``(..., N, C - 1)``.
        :param eigenvectors: :math:`\mathbf V_n`, ``(..., N, C, C - 1)``, orthonormal columns orthogonal to
            :math:`\mathbf 1`.
        :param min_precision: :math:`\lambda_{\min} > 0`, the lower bound of the eigenvalues.
        :return: the operator with blocks :math:`\mathbf V_n \max(\boldsymbol\Lambda_n, \lambda_{\min})^{-1}
            \mathbf V_n^\top`.
        """
        return cls((eigenvectors / eigenvalues.clamp_min(min_precision).unsqueeze(-2)) @ eigenvectors.mT)

    def _size(self) -> torch.Size:
        *batch, num_data, num_latents, _ = self.blocks.shape
        return torch.Size((*batch, num_data * num_latents, num_data * num_latents))

    def _matmul(self, rhs: Tensor) -> Tensor:
        num_data, num_latents = self.blocks.shape[-3:-1]
        vector = rhs.dim() == 1
        columns = rhs.unsqueeze(-1) if vector else rhs
        shaped = columns.reshape(*columns.shape[:-2], num_data, num_latents, columns.shape[-1])
        result = torch.matmul(self.blocks, shaped)
        result = result.reshape(*result.shape[:-3], num_data * num_latents, result.shape[-1])
        return result.squeeze(-1) if vector else result

    def _transpose_nonbatch(self) -> LinearOperator:
        return self.__class__(self.blocks.mT)

    def _diagonal(self) -> Tensor:
        return self.blocks.diagonal(dim1=-2, dim2=-1).flatten(-2)

    def _expand_batch(self, batch_shape: torch.Size) -> LinearOperator:
        return self.__class__(self.blocks.expand(*batch_shape, *self.blocks.shape[-3:]))

    def curvature_matmul(self) -> Callable[[Tensor], Tensor]:
        r""":math:`\mathbf V \mapsto \operatorname{blockdiag}(\tilde{\mathbf T}_n^{++}) \mathbf V`: the site blocks
        again (with :math:`\lambda_{\min}` for the eigenvalues below it), by pseudo-inverses of the dense blocks in
        float64 (:func:`block_pseudo_inverse_matmul`)."""
        return block_pseudo_inverse_matmul(self.blocks)


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
