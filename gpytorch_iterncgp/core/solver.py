r"""IterGP: a probabilistic linear solver for :math:`\hat{\mathbf K} \mathbf v = \mathbf b` (paper, Algorithm 2).

:math:`\hat{\mathbf K} = \mathbf K + \mathbf W^{-1}` (``(N C, N C)``, data-major). Starting from the
virtual solver run over recycled actions (Algorithm 3), each iteration

.. math::
    \mathbf r &= \mathbf b - \hat{\mathbf K} \mathbf v, \quad \mathbf s = \text{policy}(\mathbf r), \quad
    \mathbf t = \mathbf K \mathbf s \ \text{(the one product with } \mathbf K\text{)}, \\
    \mathbf d &= \mathbf s - \mathbf Q \mathbf Q^\top \hat{\mathbf K} \mathbf s, \quad
    \eta = \mathbf d^\top \hat{\mathbf K} \mathbf d, \quad
    \mathbf Q \leftarrow [\mathbf Q, \mathbf d / \sqrt\eta], \quad
    \mathbf v \leftarrow \mathbf v + \mathbf d \, (\mathbf d^\top \mathbf r) / \eta .

:math:`\mathbf v`, :math:`\mathbf Q` and :math:`\mathbf d` lie in :math:`\operatorname{span}(\mathbf S)`,
so :math:`\mathbf K \mathbf v` and :math:`\mathbf K \mathbf Q` are tracked from :math:`\mathbf T = \mathbf K
\mathbf S` and every iteration multiplies by :math:`\mathbf K` exactly once. The conjugation is done twice
(classical Gram–Schmidt with re-orthogonalisation in the :math:`\hat{\mathbf K}` inner product), which
needs no further product with :math:`\mathbf K`.

Tracking :math:`\mathbf K \mathbf d` this way divides its rounding errors by :math:`\sqrt{\eta / \mathbf s^\top
\hat{\mathbf K} \mathbf s}`. An action with less than 1% of its energy outside :math:`\operatorname{span}(\mathbf S)`
(e.g. a unit vector that a recycled direction already covers) is therefore replaced by its new part
:math:`\mathbf d`, whose product with :math:`\mathbf K` the next iteration computes afresh, and an action entirely
in the span is skipped; each product with :math:`\mathbf K` counts as an iteration.

The policy sees the residual preconditioned by :math:`\mathbf M^{-1} \approx \hat{\mathbf K}^{-1}` where the outer
loop gives a preconditioner (:mod:`~gpytorch_iterncgp.core.preconditioner`): CG's actions are then those of
preconditioned CG, and a preconditioned residual already in :math:`\operatorname{span}(\mathbf S)` is followed by the
plain one.

An action with few non-zero entries (a unit vector, or one projected to zero sum over a point's classes) needs no
product: :math:`\mathbf K \mathbf s` is a combination of the kernel columns at its support, :math:`O(N D)` each
(``kernel_columns``, e.g. :meth:`~gpytorch_iterncgp.core.prior.LatentPrior.kernel_columns`). It still counts as the iteration's
product with :math:`\mathbf K`.

**By rows** (:func:`itergp_solve`). Where ``buffer`` is held by rows (its ``rows_block``, ``shard_state``), so is
every ``(n,)`` vector: ``rhs``, ``keep``, the residual, the actions, the result's :math:`\mathbf v` and :math:`\mathbf
K \mathbf v` are this rank's rows ``(|I_p| C,)``; ``noise_inverse`` is this rank's blocks ``(|I_p| C, |I_p| C)``;
``kernel_matmul`` and ``kernel_columns`` map to this rank's rows (``LatentPrior.matmul_by_rows``: the action's rows
gathered once for its product); the policy sees this rank's rows of the residual. Inner products and norms are
``all_reduce`` sums of a number. Without a block (one process) this is the one-process computation, unchanged.

**A first block** (:func:`itergp_solve`). Where no tolerance is set (``abs_tol`` and ``rel_tol`` 0: the exact budget),
``buffer`` is empty, :math:`\mathbf b \ne \mathbf 0`, there is no preconditioner and the policy gives its actions
without the residual (:meth:`Policy.next_actions`: unit vectors), no iteration decides anything the next could change:
the next :math:`\min(\text{limit}, n)` actions are taken at once (:func:`_first_block`: one call of the kernel's
columns, one Cholesky factor of :math:`\mathbf S^\top \hat{\mathbf K} \mathbf S`), each counted as an iteration; the
precision and weights are those of the same actions taken one by one, to rounding.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Self

import torch
from linear_operator.operators import LinearOperator
from torch import Tensor

from .. import settings
from ..exceptions import BufferLimitWarning, NumericalBreakdownWarning
from .deferred import DeferredTensor, deferred
from .noise import NoiseOperator
from .policies import Policy
from .precision import LowRankPrecision
from .recycling import ActionBuffer, ImplicitRoot, virtual_solver_run
from .sharding import RowBlock
from .state import ExtraState
from .validation import check_count, check_flag, check_nonnegative

# An action with less than this fraction of its energy s^T K̂ s outside the span of the earlier actions is
# replaced by that new part (see itergp_solve); with less than 1000 eps, it counts as linearly dependent.
NEARLY_DEPENDENT = 1e-2
# A conjugated direction keeping less than this fraction of its K̂-energy is conjugated once more (DGKS criterion,
# kappa = 1/sqrt(2) on norms).
REORTHOGONALIZE = 0.5


@dataclass
class IterGPResult(ImplicitRoot):
    r"""What one IterGP solve returns. Shapes use :math:`n = N C` and :math:`r` = rank of :math:`\mathbf C`.

    The buffer :math:`\mathbf S`, :math:`\mathbf K \mathbf S` ``(n, B)`` and the coefficients :math:`\mathbf E` ``(B, r)`` of
    :math:`\mathbf Q = \mathbf S \mathbf E` (:class:`~gpytorch_iterncgp.core.recycling.ImplicitRoot`: :attr:`precision_root` and
    :attr:`kernel_precision_root` form :math:`\mathbf Q` and :math:`\mathbf K \mathbf Q` when read).
    """

    representer_weights: Tensor  # v, (n,)
    kernel_representer_weights: Tensor  # K v, (n,)
    iterations: int  # products with K, including those of skipped or replaced (nearly dependent) actions
    residual_norm: float
    breakdown: bool
    # The system was solved: the residual met the tolerance, or C has full rank (exact in exact arithmetic).
    converged: bool = False

    @property
    def precision(self) -> LowRankPrecision:
        r""":math:`\mathbf C = \mathbf Q \mathbf Q^\top`, ``(n, n)`` (forms :math:`\mathbf Q`)."""
        return LowRankPrecision(self.precision_root)

    def deferred_roots(self) -> tuple[Tensor, Tensor]:
        r""":math:`\mathbf Q` and :math:`\mathbf K \mathbf Q` for a :class:`RegressionState`, formed when first read:
        this rank's rows of them where the buffer is held by rows (:attr:`local_precision_root`, no collective), as
        :math:`\mathbf S` and :math:`\mathbf K \mathbf S` are."""
        return deferred(lambda: self.local_precision_root), deferred(lambda: self.local_kernel_precision_root)


@dataclass
class IterGPOptions:
    """IterGP's budget and tolerances in each outer step (Newton step, EP sweep), and what it keeps between steps."""

    max_solver_iterations: int | None = 5  # products with K per step; None: until abs_tol/rel_tol
    abs_tol: float = 1e-5
    rel_tol: float = 1e-5
    compression_rank: int | None = None  # R, recycled actions kept between steps (None: all)
    recycle: bool = True  # recycle actions across steps (paper, Algorithm 3)
    # r, the columns of the preconditioner's low-rank factor of K (core.preconditioner); 0: no preconditioner
    preconditioner_rank: int = 100

    def validate(self) -> None:
        """:raises ValueError: naming the option that is out of range (or not a number; ``True`` is not a count)."""
        check_count(self.max_solver_iterations, "max_solver_iterations", minimum=1, allow_none=True)
        check_count(self.compression_rank, "compression_rank", minimum=1, allow_none=True)
        check_count(self.preconditioner_rank, "preconditioner_rank")
        for name in ("abs_tol", "rel_tol"):
            check_nonnegative(getattr(self, name), name)
        check_flag(self.recycle, "recycle")


@dataclass
class RegressionState(ExtraState):
    r"""IterGP's solution of an outer step's GP regression and the actions it keeps for the next one.

    ``n = N C`` (data-major), ``r`` the rank of :math:`\mathbf C`, ``B`` the number of buffered actions. The
    posterior of the latents is :math:`\mathbf m + \mathbf K \mathbf a` and :math:`\mathbf K - \mathbf K \mathbf Q
    \mathbf Q^\top \mathbf K` whatever the outer loop (Newton, EP) that set the regression.

    Where the loop holds its state by rows (a sharded :class:`~gpytorch_iterncgp.core.sharding.RowBlock`,
    ``shard_state``) every field holds this rank's rows, ``(|I_p| C, ...)``: the vectors :math:`\mathbf a`,
    :math:`\mathbf K \mathbf a` and the matrices :math:`\mathbf Q`, :math:`\mathbf K \mathbf Q`, :math:`\mathbf S`,
    :math:`\mathbf K \mathbf S` (all ``n`` rows after loading a ``state_dict``: readers take the block's
    ``own_rows`` or ``all_rows``).
    """

    representer_weights: Tensor  # a, (n,) or (|I_p| C,): f = m + K a
    kernel_representer_weights: Tensor  # K a, (n,) or (|I_p| C,)
    precision_root: Tensor  # Q, (n, r) or (|I_p| C, r): C = Q Q^T (may be passed as deferred(function): DeferredTensor)
    kernel_precision_root: Tensor  # K Q, (n, r) or (|I_p| C, r) (may be deferred)
    actions: Tensor  # S, (n, B) or (|I_p| C, B)
    kernel_actions: Tensor  # K S, (n, B) or (|I_p| C, B)

    saved_by = "IterGP"

    @staticmethod
    def prior_tensors(
        size: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        r"""The six tensors of the prior, in field order: :math:`\mathbf a = \mathbf 0`, no actions."""
        zeros = torch.zeros(size, dtype=dtype, device=device)
        empty = torch.zeros(size, 0, dtype=dtype, device=device)
        return zeros, zeros.clone(), empty, empty.clone(), empty.clone(), empty.clone()

    def __getstate__(self) -> dict:
        r"""For pickling: the deferred :math:`\mathbf Q` and :math:`\mathbf K \mathbf Q` formed (a function does not
        pickle)."""
        self.precision_root, self.kernel_precision_root  # noqa: B018  # reading forms them
        return self.__dict__

    def with_kernel(self, kernel_matmul: Callable[[Tensor], Tensor], rows_block: RowBlock) -> Self:
        r"""This state after a change of :math:`\mathbf K`: products renew :math:`\mathbf K \mathbf a` and
        :math:`\mathbf K \mathbf S`; :math:`\mathbf Q` (valid for the old kernel only) is dropped.

        The state and ``kernel_matmul``'s vectors are held by ``rows_block`` (``LatentPrior.matmul_by_rows``; a loaded
        state may hold all rows). The products take :math:`\lceil B / P \rceil` columns of :math:`\mathbf S` at a
        time (:math:`\mathbf a` with the first), :math:`P` the ranks of ``rows_block``: one product in one process;
        sharded, a rank so holds :math:`O(n B / P)` entries of them at any time (:math:`P` products, the same columns in
        all, each right-hand side gathered once) and keeps its rows of every field.
        """
        weights = rows_block.own_rows(self.representer_weights)[:, None]
        buffered = self.actions.shape[-1]
        width = max(1, -(-buffered // len(rows_block.bounds)))
        blocks = []
        for start in range(0, max(buffered, 1), width):  # a with the first block
            columns = rows_block.own_rows(self.actions[:, start : start + width])
            product = kernel_matmul(torch.cat([weights, columns], dim=-1) if start == 0 else columns)
            if start == 0:
                kernel_weights, product = product[:, 0], product[:, 1:]
            blocks.append(product)
        actions = rows_block.own_rows(self.actions)
        kernel_actions = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-1)  # (one product: no copy)
        empty = weights[:, :0]
        return dataclasses.replace(
            self,
            representer_weights=weights[:, 0],
            kernel_representer_weights=kernel_weights,
            actions=actions,
            kernel_actions=kernel_actions,
            precision_root=empty,
            kernel_precision_root=empty.clone(),
        )

    def with_full_rows(self, rows_block: RowBlock) -> Self:
        r"""This state with :math:`\mathbf a`, :math:`\mathbf K \mathbf a` ``(n,)``, :math:`\mathbf Q`,
        :math:`\mathbf K \mathbf Q` ``(n, r)`` and :math:`\mathbf S`, :math:`\mathbf K \mathbf S` ``(n, B)`` of all rows:
        gathered (a collective, six ``all_gather``, and one per :attr:`point_fields`, e.g. EP's sites) where
        ``rows_block`` is sharded; itself where it holds all rows (its deferred :math:`\mathbf Q`,
        :math:`\mathbf K \mathbf Q` are then not formed)."""
        if not rows_block.is_sharded:
            return self
        rows = {name: rows_block.all_rows(getattr(self, name)) for name in self.row_fields}
        points = {name: rows_block.all_points(getattr(self, name)) for name in self.point_fields}
        return dataclasses.replace(self, **rows, **points)

    # The fields held by rows where the state is (shard_state): the regression's; a subclass adds its own, and its
    # point-major fields ((N, ...): a point's entries at once, e.g. EP's sites) as point_fields.
    point_fields: ClassVar[tuple[str, ...]] = ()
    row_fields: ClassVar[tuple[str, ...]] = (
        "representer_weights",
        "kernel_representer_weights",
        "precision_root",
        "kernel_precision_root",
        "actions",
        "kernel_actions",
    )

    def with_own_rows(self, rows_block: RowBlock) -> Self:
        """This state with this rank's rows of every field in :attr:`row_fields` where it holds all rows (loaded from
        a ``state_dict``, or the prior) of a sharded ``rows_block``; itself where it holds the block's rows already
        (always in one process; its deferred :math:`\\mathbf Q`, :math:`\\mathbf K \\mathbf Q` are then not
        formed)."""
        if self.representer_weights.shape[0] == rows_block.local_size:
            return self
        rows = {name: rows_block.own_rows(getattr(self, name)) for name in self.row_fields}
        points = {name: rows_block.own_points(getattr(self, name)).clone() for name in self.point_fields}
        return dataclasses.replace(self, **rows, **points)

    @classmethod
    def expected_shapes(cls, saved: dict[str, Tensor]) -> dict[str, tuple[int, ...]]:
        r"""``(n,)`` for :math:`\mathbf a` and :math:`\mathbf K \mathbf a`, ``(n, r)`` for :math:`\mathbf Q` and
        :math:`\mathbf K \mathbf Q`, ``(n, B)`` for :math:`\mathbf S` and :math:`\mathbf K \mathbf S`; ``n`` from
        :math:`\mathbf a`, ``r`` and ``B`` from the last dimension of :math:`\mathbf Q` and :math:`\mathbf S`."""
        size = (saved["representer_weights"].numel(),)
        rank, buffered = tuple(saved["precision_root"].shape[-1:]), tuple(saved["actions"].shape[-1:])
        return {
            "representer_weights": size,
            "kernel_representer_weights": size,
            "precision_root": size + rank,
            "kernel_precision_root": size + rank,
            "actions": size + buffered,
            "kernel_actions": size + buffered,
        }


for _name in ("precision_root", "kernel_precision_root"):
    setattr(RegressionState, _name, DeferredTensor(_name))


def _bordered_coefficients(coefficients: Tensor, column: Tensor, corner: float) -> Tensor:
    """``coefficients`` ``(B, r)`` grown to ``(B + 1, r + 1)``: ``column`` ``(B,)`` above ``corner`` as the last column,
    zeros in the last row otherwise (:math:`O(B r)`)."""
    size, rank = coefficients.shape
    grown = coefficients.new_zeros(size + 1, rank + 1)
    grown[:size, :rank] = coefficients
    grown[:size, rank] = column
    grown[size, rank] = corner
    return grown


def _check_solver_arguments(noise_inverse, rhs, buffer, max_solver_iterations, abs_tol, rel_tol, compression_rank):
    if not torch.is_tensor(rhs) or rhs.dim() != 1 or not rhs.is_floating_point():
        raise ValueError(f"rhs must be a 1-D floating-point tensor (n,), got {getattr(rhs, 'shape', type(rhs))}.")
    size = rhs.shape[0]
    if tuple(noise_inverse.shape) != (size, size):
        raise ValueError(f"noise_inverse must be ({size}, {size}) to match rhs, got {tuple(noise_inverse.shape)}.")
    if buffer.actions.value.shape[0] != size or buffer.kernel_actions.value.shape != buffer.actions.value.shape:
        raise ValueError(
            f"buffer must hold actions and kernel products of shape ({size}, B) (the rows rhs holds), got "
            f"{tuple(buffer.actions.value.shape)} and {tuple(buffer.kernel_actions.value.shape)}."
        )
    if not bool(torch.isfinite(rhs).all()):
        raise ValueError("rhs contains NaN or inf.")
    check_count(max_solver_iterations, "max_solver_iterations", allow_none=True)
    check_count(compression_rank, "compression_rank", minimum=1, allow_none=True)
    check_nonnegative(abs_tol, "abs_tol")
    check_nonnegative(rel_tol, "rel_tol")


class _Conjugated(NamedTuple):
    r"""An action made :math:`\hat{\mathbf K}`-conjugate to the recycled directions,
    :math:`\mathbf d = \mathbf s - \mathbf S \mathbf c` (``n = N C``, ``B`` buffered actions)."""

    direction: Tensor  # d, (n,)
    kernel_direction: Tensor  # K d, (n,), tracked from K s and K S (no product with K)
    subtracted: Tensor  # c, (B,)
    energy: float  # eta = d^T K̂ d


def _conjugate(
    action: Tensor,
    kernel_action: Tensor,
    noisy_action: Tensor,
    action_energy: float,
    kernel_column: Tensor,
    buffer: ActionBuffer,
    root: ImplicitRoot,
    noisy: Callable[[Tensor], Tensor],
) -> _Conjugated:
    r"""Conjugate the action :math:`\mathbf s` against :math:`\mathbf Q = \mathbf S \mathbf E` in the
    :math:`\hat{\mathbf K}` inner product: :math:`\mathbf d = \mathbf s - \mathbf S \mathbf E \mathbf E^\top
    \mathbf S^\top \hat{\mathbf K} \mathbf s` (paper, Alg. 2), by classical Gram–Schmidt repeated once where the first
    pass removed more than half of the energy (:data:`REORTHOGONALIZE`; Daniel, Gragg, Kaufman & Stewart 1976).
    Where the buffer is held by rows, so are the vectors (``(|I_p| C,)``), and :math:`\eta` is an ``all_reduce``.

    :param action: :math:`\mathbf s`, ``(n,)``, unit norm.
    :param kernel_action: :math:`\mathbf K \mathbf s`, ``(n,)``.
    :param noisy_action: :math:`\mathbf W^{-1} \mathbf s`, ``(n,)``.
    :param action_energy: :math:`\mathbf s^\top \hat{\mathbf K} \mathbf s`.
    :param kernel_column: :math:`\mathbf S^\top \mathbf K \mathbf s`, ``(B,)``.
    :param buffer: :math:`\mathbf S` and :math:`\mathbf K \mathbf S`, ``(n, B)``.
    :param root: :math:`\mathbf E`, ``(B, r)`` (its products :math:`\mathbf E \mathbf E^\top \mathbf x`).
    :param noisy: :math:`\mathbf v \mapsto \mathbf W^{-1} \mathbf v` for ``(n,)`` vectors.
    :return: :math:`\mathbf d`, :math:`\mathbf K \mathbf d`, :math:`\mathbf c` and
        :math:`\eta = \mathbf d^\top \hat{\mathbf K} \mathbf d`.
    """
    direction, kernel_direction = action, kernel_action
    projected = kernel_column + buffer.transpose_matmul(noisy_action)  # S^T K̂ s
    subtracted = torch.zeros_like(projected)  # d = s - S (subtracted)
    eta = action_energy
    for _ in range(2):
        # Twice is enough (DGKS); once where little cancels, which saves three passes over S and K S. After
        # cancellation the rounding errors of d = s - S c have components in span(S) that the second pass removes.
        conjugation = root.coefficient_products(projected)  # E Q^T K̂ d
        combined, kernel_combined = buffer.combine(conjugation)  # S c, K S c
        direction = direction - combined
        kernel_direction = kernel_direction - kernel_combined
        subtracted = subtracted + conjugation
        noisy_direction = kernel_direction + noisy(direction)
        previous, eta = eta, float(buffer.rows_block.summed(direction @ noisy_direction))
        if not eta < REORTHOGONALIZE * previous:
            break
        projected = buffer.transpose_matmul(noisy_direction)  # S^T K̂ d
    return _Conjugated(direction, kernel_direction, subtracted, eta)


def _kernel_product(
    kernel_matmul: Callable[[Tensor], Tensor],
    kernel_columns: Callable[[Tensor], Tensor] | None,
    sparse_limit: int,
    rows_block: RowBlock,
) -> Callable[[Tensor], Tensor]:
    r""":math:`\mathbf s \mapsto \mathbf K \mathbf s` for ``(n,)`` actions: from the kernel columns at the support of an
    action with at most ``sparse_limit`` non-zero entries (if ``kernel_columns`` is given), else by ``kernel_matmul``.

    Held by rows of ``rows_block``: the action and its product are this rank's rows; the non-zero entries are counted
    over the ranks (an ``all_reduce``), a sparse action is gathered to find its support (the same columns on every
    rank) and ``kernel_columns`` gives this rank's rows of them.
    """

    def kernel_product(action: Tensor) -> Tensor:
        if kernel_columns is not None and int(rows_block.summed(torch.count_nonzero(action))) <= sparse_limit:
            whole = rows_block.all_rows(action)
            support = whole.nonzero()[:, 0]
            return kernel_columns(support) @ whole[support]
        return kernel_matmul(action[:, None])[:, 0]

    return kernel_product


@dataclass
class _IterGPIterations:
    r"""IterGP's iterations after the virtual solver run (paper, Alg. 2), with the iterate between them.

    The iterate is the buffer :math:`\mathbf S`, :math:`\mathbf K \mathbf S` ``(n, B)``, the coefficients
    :math:`\mathbf E` ``(B, r)`` of :math:`\mathbf Q = \mathbf S \mathbf E`, and the representer weights
    :math:`\mathbf v` and :math:`\mathbf K \mathbf v` ``(n,)``; each iteration multiplies by :math:`\mathbf K` once.
    Where the buffer is held by rows (:attr:`rows_block`) every ``(n,)`` vector is this rank's rows ``(|I_p| C,)``,
    and inner products and norms are ``all_reduce`` sums of a number, so that every rank takes the same decisions.
    """

    rhs: Tensor  # b, (n,)
    policy: Policy
    precondition: Callable[[Tensor], Tensor] | None  # r -> M^{-1} r, (n,): what the policy sees of the residual
    project: Callable[[Tensor], Tensor]  # applied to (n, k) actions and residuals
    noisy: Callable[[Tensor], Tensor]  # v -> W^{-1} v, (n,)
    kernel_product: Callable[[Tensor], Tensor]  # s -> K s, (n,)
    buffer: ActionBuffer
    root: ImplicitRoot  # E, (B, r): Q = S E, K Q = (K S) E
    weights: Tensor  # v, (n,)
    kernel_weights: Tensor  # K v, (n,)
    recycled_rank: int  # r after the virtual solver run
    iterations: int = 0  # products with K, including those of skipped or replaced actions
    breakdown: bool = False
    skipped: int = 0  # actions skipped as numerically in span(S)
    last_skipped: Tensor | None = None
    remainder: Tensor | None = None  # the new part of a nearly dependent action, taken as the next action
    # the last action came from the preconditioned residual and lay in span(S): the next one is the plain residual's
    plain_next: bool = False

    @classmethod
    def from_root(
        cls,
        rhs: Tensor,
        policy: Policy,
        precondition: Callable[[Tensor], Tensor] | None,
        project: Callable[[Tensor], Tensor],
        noise_inverse: LinearOperator,
        kernel_product: Callable[[Tensor], Tensor],
        root: ImplicitRoot,
        recycled_rank: int,
        iterations: int,
    ) -> _IterGPIterations:
        r"""The iterations from ``root`` (the virtual solver run's, or a first block's, with its buffer) and its
        solution :math:`\mathbf v = \mathbf S \mathbf E \mathbf E^\top \mathbf S^\top \mathbf b`, :math:`\mathbf K
        \mathbf v = \mathbf T \mathbf E \mathbf E^\top \mathbf S^\top \mathbf b` (no product with :math:`\mathbf K`),
        ``iterations`` already taken."""
        multiply_noise = noise_inverse.apply if isinstance(noise_inverse, NoiseOperator) else noise_inverse.matmul

        def noisy(vector: Tensor) -> Tensor:
            return multiply_noise(vector[:, None])[:, 0]  # W^{-1} v

        buffer = root.buffer
        weights, kernel_weights = buffer.combine(root.coefficient_products(buffer.transpose_matmul(rhs)))
        return cls(
            rhs,
            policy,
            precondition,
            project,
            noisy,
            kernel_product,
            buffer,
            root,
            weights=weights,
            kernel_weights=kernel_weights,
            recycled_rank=recycled_rank,
            iterations=iterations,
        )

    @property
    def rows_block(self) -> RowBlock:
        """The rows of the vectors this rank holds (the buffer's)."""
        return self.buffer.rows_block

    def run(self, tolerance: float, limit: int, full_rank: int) -> float:
        r"""Iterate until :math:`\|\mathbf r\| \le` ``tolerance``, ``limit`` iterations, :math:`\mathbf C` of rank
        ``full_rank``, or a numerical breakdown (warned).

        :return: the last (projected) residual norm :math:`\|\mathbf b - \hat{\mathbf K} \mathbf v\|`.
        """
        while True:
            residual = self.project((self.rhs - self.kernel_weights - self.noisy(self.weights))[:, None])[:, 0]
            residual_norm = float(self.rows_block.norm(residual))
            if not math.isfinite(residual_norm):
                warnings.warn("IterGP: the residual is not finite; stopping.", NumericalBreakdownWarning, stacklevel=4)
                self.breakdown = True
                return residual_norm
            if residual_norm <= tolerance or self.iterations >= limit or self.root.rank >= full_rank:
                return residual_norm
            failure = self.iterate(residual)
            if failure is not None:
                self.breakdown = True
                warnings.warn(failure, NumericalBreakdownWarning, stacklevel=4)
                return residual_norm

    def iterate(self, residual: Tensor) -> str | None:
        r"""One iteration for the residual :math:`\mathbf r` ``(n,)``: the action, its one product with
        :math:`\mathbf K`, its conjugation, then the update of :math:`\mathbf v` and :math:`\mathbf Q`, or (an action
        numerically in :math:`\operatorname{span}(\mathbf S)`) a skip, or (one mostly in it, with less than
        :data:`NEARLY_DEPENDENT` of its energy outside) its new part :math:`\mathbf d` as the next action.

        :return: ``None``, or why the solver breaks down and stops.
        """
        from_remainder = self.remainder is not None
        retried = self.plain_next  # the plain residual after a preconditioned one that lay in span(S)
        preconditioned = self.precondition is not None and self.remainder is None and not retried
        if self.remainder is not None:
            proposed = self.remainder
        else:
            proposed = self.policy(self.precondition(residual) if self.precondition and preconditioned else residual)
        self.plain_next = False
        action = self.project(proposed[:, None])[:, 0]
        self.remainder = None
        action_norm = self.rows_block.norm(action)
        if not action_norm > 0:
            return "IterGP: the policy returned a zero action; stopping."
        action = action / action_norm
        kernel_action = self.kernel_product(action)
        noisy_action = self.noisy(action)
        action_energy = float(self.rows_block.summed(action @ (kernel_action + noisy_action)))  # s^T K̂ s
        kernel_column = self.buffer.kernel_column(kernel_action)  # S^T t: the kernel Gram matrix's new column
        conjugated = _conjugate(
            action,
            kernel_action,
            noisy_action,
            action_energy,
            kernel_column,
            self.buffer,
            self.root,
            self.noisy,
        )
        # How much of the action is new: the fraction of its energy s^T K̂ s outside span(S).
        new_fraction = conjugated.energy / abs(action_energy) if action_energy else 0.0
        if not new_fraction > 1e3 * torch.finfo(self.rhs.dtype).eps:
            if preconditioned:  # M^{-1} r in span(S) (the factor's actions hold it): the plain residual next
                self.plain_next = True
                self.iterations += 1
                return None
            return self._skip(action, conjugated.energy, new_fraction, retried)
        if new_fraction < NEARLY_DEPENDENT and not from_remainder:
            # Appending it would divide the rounding errors of the tracked K d by sqrt(new_fraction): the precision
            # would lose its conjugacy and the tracked K v (so the residual IterGP reports) drift from the true one.
            # Its new part d is the next action instead, multiplied by K afresh (this product counts as an iteration).
            self.iterations += 1
            self.remainder = conjugated.direction / self.rows_block.norm(conjugated.direction)
            return None
        self._append(action, kernel_action, kernel_column, conjugated, residual)
        return None

    def _skip(self, action: Tensor, eta: float, new_fraction: float, retried: bool = False) -> str | None:
        r"""Skip an action numerically in :math:`\operatorname{span}(\mathbf S)` (its product with :math:`\mathbf K`
        counts as an iteration).

        :return: ``None``, or a breakdown where the policy repeats a skipped action (CG: the residual did not change),
            where the plain residual (``retried``) lies in the span as its preconditioned one did, or where it skips more
            actions than were recycled (unit vectors: every further one is a repeat).
        """
        self.iterations += 1
        self.skipped += 1
        repeated = retried or (self.last_skipped is not None and bool(torch.equal(action, self.last_skipped)))
        repeated = self.rows_block.everywhere(repeated, action)  # (a skip is decided on every rank alike)
        if repeated or self.skipped > self.recycled_rank:
            return (
                f"IterGP: numerical breakdown (eta = {eta:.3g}, {new_fraction:.2g} of s^T K̂ s: the action lies "
                f"numerically in the span of the previous ones) after {self.iterations} iterations; stopping with "
                "the posterior so far."
            )
        self.last_skipped = action
        return None

    def _append(
        self, action: Tensor, kernel_action: Tensor, kernel_column: Tensor, conjugated: _Conjugated, residual: Tensor
    ) -> None:
        r"""Append :math:`\mathbf s` to the buffer and update :math:`\mathbf v \leftarrow \mathbf v + \mathbf d
        (\mathbf d^\top \mathbf r) / \eta` (and :math:`\mathbf K \mathbf v`) and :math:`\mathbf Q \leftarrow
        [\mathbf Q, \mathbf d / \sqrt\eta]` (paper, Alg. 2)."""
        self.buffer.append(action, kernel_action, kernel_column)
        scale = conjugated.energy**-0.5
        step = scale * float(self.rows_block.summed(conjugated.direction @ residual))
        self.weights = self.weights + (step * scale) * conjugated.direction
        self.kernel_weights = self.kernel_weights + (step * scale) * conjugated.kernel_direction
        # the new column of Q, q = d / sqrt(eta) = [S, s] [-subtracted; 1] / sqrt(eta), as a new row and column of E
        bordered = _bordered_coefficients(self.root.root_coefficients, -conjugated.subtracted * scale, scale)
        self.root = ImplicitRoot(self.buffer, bordered)
        self.iterations += 1

    def result(self, residual_norm: float, tolerance: float, full_rank: int) -> IterGPResult:
        """The solve's result after :meth:`run` returned ``residual_norm``."""
        converged = math.isfinite(residual_norm) and (residual_norm <= tolerance or self.root.rank >= full_rank)
        return IterGPResult(
            buffer=self.buffer,
            root_coefficients=self.root.deferred_coefficients(),
            cholesky=self.root.cholesky,
            representer_weights=self.weights,
            kernel_representer_weights=self.kernel_weights,
            iterations=self.iterations,
            residual_norm=residual_norm,
            breakdown=self.breakdown,
            converged=converged,
        )


def memory_capped_rank(compression_rank: int | None, buffer: ActionBuffer, new_actions: int) -> int | None:
    r"""``compression_rank``, or where the buffer's :math:`B` actions and the solve's ``new_actions`` would pass
    :class:`~gpytorch_iterncgp.settings.recycled_buffer_limit` (actions and kernel products, :math:`2 n (B + k)`
    numbers of ``buffer``'s dtype, :math:`n = N C` of all ranks) the largest rank that leaves room for them (at least
    one), with a :class:`~gpytorch_iterncgp.exceptions.BufferLimitWarning`. The same on every rank."""
    column_bytes = 2 * buffer.num_rows * buffer.actions.rows.element_size()
    room = settings.recycled_buffer_limit.value() // column_bytes - new_actions
    if buffer.size <= room or (compression_rank is not None and compression_rank <= room):
        return compression_rank
    cap = max(int(room), 1)
    warnings.warn(
        f"The recycled solver actions ({buffer.size} of {buffer.num_rows} latent values, "
        f"{buffer.size * column_bytes / 2**30:.1f} GiB with their kernel products) would pass "
        f"settings.recycled_buffer_limit ({settings.recycled_buffer_limit.value() / 2**30:.1f} GiB): compressed to "
        f"the top {cap} directions. The fit goes on with less recycled information; set compression_rank, raise the "
        "limit where memory allows, or (for many points) use stochastic EP with inducing points.",
        BufferLimitWarning,
        stacklevel=2,
    )
    return cap


def _first_block(
    actions: Tensor,
    project: Callable[[Tensor], Tensor],
    kernel_matmul: Callable[[Tensor], Tensor],
    kernel_columns: Callable[[Tensor], Tensor] | None,
    noise_inverse: LinearOperator,
    rows_block: RowBlock,
) -> ImplicitRoot:
    r"""The first actions of a solve as one block: the buffer of ``actions`` ``(n, k)`` (projected, normalised; this
    rank's rows where held by rows) and their kernel products (the kernel's columns at their support, or one product),
    and :math:`\mathbf E` ``(k, r)`` with :math:`\mathbf Q = \mathbf S \mathbf E`, :math:`\mathbf Q^\top \hat{\mathbf K}
    \mathbf Q = \mathbf I`, as an :class:`~gpytorch_iterncgp.core.recycling.ImplicitRoot`
    (:func:`~gpytorch_iterncgp.core.recycling.virtual_solver_run`: a Cholesky factor of
    :math:`\mathbf S^\top \hat{\mathbf K} \mathbf S`, numerically dependent actions dropped). Taken one by one,
    conjugated and appended, the same actions give the same precision :math:`\mathbf C = \mathbf S (\mathbf S^\top
    \hat{\mathbf K} \mathbf S)^{-1} \mathbf S^\top` (paper, Alg. 2) and representer weights :math:`\mathbf C
    \mathbf b`, to rounding."""
    actions = project(actions)
    norms = rows_block.summed(actions.square().sum(0)).sqrt()
    actions = actions[:, norms > 0] / norms[norms > 0]
    if kernel_columns is None:
        kernel_actions = kernel_matmul(actions)
    else:
        whole = rows_block.all_rows(actions)
        support = whole.abs().sum(-1).nonzero()[:, 0]
        kernel_actions = kernel_columns(support) @ whole[support]
    block = ActionBuffer.from_tensors(actions, kernel_actions, rows_block, gemm_columns=None)  # (new actions)
    return virtual_solver_run(block, noise_inverse)


def itergp_solve(
    kernel_matmul: Callable[[Tensor], Tensor],
    noise_inverse: LinearOperator,
    rhs: Tensor,
    buffer: ActionBuffer,
    policy: Policy,
    project: Callable[[Tensor], Tensor] | None = None,
    max_solver_iterations: int | None = None,
    abs_tol: float = 1e-5,
    rel_tol: float = 1e-5,
    compression_rank: int | None = None,
    action_space_dimension: int | None = None,
    keep: tuple[Tensor, Tensor] | None = None,
    kernel_columns: Callable[[Tensor], Tensor] | None = None,
    preconditioner: Callable[[Tensor], Tensor] | None = None,
) -> IterGPResult:
    r"""Solve :math:`(\mathbf K + \mathbf W^{-1}) \mathbf v = \mathbf b` approximately, recycling ``buffer``.

    By rows where ``buffer`` is, with a first block where no iteration decides anything (the module docstring).

    :param kernel_matmul: :math:`\mathbf X \mapsto \mathbf K \mathbf X` for ``(n, k)`` inputs.
    :param noise_inverse: :math:`\mathbf W^{-1}`, ``(n, n)``.
    :param rhs: :math:`\mathbf b`, ``(n,)``.
    :param buffer: recycled actions and their kernel products (computed with the same kernel). The solver owns it:
        where the virtual run compresses nothing, the new actions are appended to ``buffer`` itself (its earlier
        columns never change); use ``result.buffer`` afterwards.
    :param policy: chooses the actions.
    :param project: projection applied to actions and residuals (softmax: zero sum per point);
        convergence is measured on the projected residual.
    :param max_solver_iterations: at most this many iterations (products with :math:`\mathbf K`); ``None``: until
        the tolerance is met (at most :math:`n`).
    :param abs_tol: stop when :math:`\|\mathbf r\| \le \max(\text{abs\_tol}, \text{rel\_tol} \|\mathbf b\|)`.
    :param rel_tol: see ``abs_tol``.
    :param compression_rank: :math:`R` for the virtual solver run (``None``: keep every action).
    :param action_space_dimension: the dimension of the space the projected actions span (default
        :math:`n`); once :math:`\mathbf C` has this rank it equals :math:`\hat{\mathbf K}^{-1}` there and the
        solver stops.
    :param keep: a direction and its kernel product that compression keeps (see
        :func:`~gpytorch_iterncgp.virtual_solver_run`).
    :param kernel_columns: data-major indices ``(k,)`` :math:`\mapsto \mathbf K_{:, \text{indices}}` ``(n, k)``; if
        given, an action with at most ``max(16, n // 64)`` non-zero entries is multiplied by these columns instead of
        ``kernel_matmul``.
    :param preconditioner: :math:`\mathbf r \mapsto \mathbf M^{-1} \mathbf r` for ``(n,)`` residuals, with
        :math:`\mathbf M \approx \hat{\mathbf K}` positive definite (on the projected space): the policy is called with
        the preconditioned residual (CG: preconditioned CG; :mod:`~gpytorch_iterncgp.core.preconditioner`). ``None``:
        the residual itself.
    :raises ValueError: for shapes that do not fit together, a non-finite right-hand side, or options out
        of range.
    """
    _check_solver_arguments(noise_inverse, rhs, buffer, max_solver_iterations, abs_tol, rel_tol, compression_rank)
    project = project or (lambda vectors: vectors)
    num_rows = buffer.num_rows  # n, whatever rows this rank holds
    rows_block = buffer.rows_block
    limit = num_rows if max_solver_iterations is None else max_solver_iterations
    full_rank = num_rows if action_space_dimension is None else action_space_dimension
    compression_rank = memory_capped_rank(compression_rank, buffer, min(limit, full_rank))
    root = virtual_solver_run(buffer, noise_inverse, compression_rank, keep=keep, spare=min(limit, 64))  # Q = S E
    rhs_norm = float(rows_block.norm(project(rhs[:, None])))
    tolerance = max(abs_tol, rel_tol * rhs_norm)
    recycled_rank, block_size = root.rank, 0
    if root.buffer.size == 0 and tolerance == 0 < rhs_norm and preconditioner is None:  # (b = 0: solved, no action)
        block = policy.next_actions(min(limit, full_rank), rhs)
        if block is not None:
            root = _first_block(block, project, kernel_matmul, kernel_columns, noise_inverse, rows_block)
            block_size = block.shape[-1]
    kernel_product = _kernel_product(kernel_matmul, kernel_columns, max(16, num_rows // 64), rows_block)
    solver = _IterGPIterations.from_root(
        rhs, policy, preconditioner, project, noise_inverse, kernel_product, root, recycled_rank, block_size
    )
    residual_norm = solver.run(tolerance, limit, full_rank)
    return solver.result(residual_norm, tolerance, full_rank)
