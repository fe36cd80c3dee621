"""The rows a process holds (``core.sharding``): one process is the one-rank case, whose reductions and gathers are
the identity (the tensor itself: no collective, no copy), the split of the points over the ranks, and a rank's rows
of a :class:`ShardedRowBlock` taken without a collective. Two processes' collectives: ``tests/distributed``."""

from __future__ import annotations

import gpytorch
import pytest
import torch

from gpytorch_iterncgp.core.prior import (
    IndependentPrior,
    LatentPrior,
    MultitaskPrior,
    OneLatentPrior,
    SharedKernelPrior,
)
from gpytorch_iterncgp.core.sharding import RowBlock, ShardedRowBlock, row_bounds
from gpytorch_iterncgp.distributed import ShardedKernel

DTYPE = torch.float64


def _tensor(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, dtype=DTYPE, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------
# The one-rank block: all rows, every reduction the identity.
# ---------------------------------------------------------------------------------------------------
def test_one_rank_block_holds_all_rows():
    block = RowBlock.single(7, 3)
    assert not block.is_sharded and block.process_group is None
    assert (block.start, block.stop, block.size, block.local_size, block.num_latents) == (0, 21, 21, 21, 3)
    assert block.bounds == [(0, 21)]
    assert RowBlock.single(5).size == 5 and RowBlock.single(5).num_latents == 1


@pytest.mark.parametrize(
    "method", ["local", "reduce", "gather", "own_rows", "all_rows", "own_points", "all_points", "summed", "maximum"]
)
def test_one_rank_reductions_and_gathers_return_the_tensor_itself(method):
    block = RowBlock.single(7, 3)
    tensor = _tensor(21, 4)
    assert getattr(block, method)(tensor) is tensor


def test_one_rank_norm_and_agreement_are_the_one_process_ones():
    block = RowBlock.single(10, 2)
    vector = _tensor(20)
    assert torch.equal(block.norm(vector), vector.norm())  # bit for bit: torch's own norm, not a sum of squares
    matrix = _tensor(20, 1)
    assert torch.equal(block.norm(matrix), matrix.norm())
    assert block.everywhere(True, vector) is True and block.everywhere(False, vector) is False


def test_sharded_kernel_without_shard_state_gives_the_one_rank_block():
    kernel = ShardedKernel(gpytorch.kernels.RBFKernel())  # no process group is needed to ask for its rows
    block = kernel.row_block(12, 3)
    assert type(block) is RowBlock and not block.is_sharded and block.size == block.local_size == 36


# ---------------------------------------------------------------------------------------------------
# The split of the points over the ranks.
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_points", [0, 1, 5, 101, 240])
@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_row_bounds_cover_all_points_in_contiguous_blocks_as_tensor_split(num_points, world_size):
    bounds = row_bounds(num_points, world_size)
    assert len(bounds) == world_size
    assert bounds[0][0] == 0 and bounds[-1][1] == num_points
    assert all(stop == start for (_, stop), (start, _) in zip(bounds, bounds[1:], strict=False))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    split = torch.tensor_split(torch.arange(num_points), world_size)
    assert [(int(part[0]), int(part[-1]) + 1) if len(part) else None for part in split] == [
        (start, stop) if stop > start else None for start, stop in bounds
    ]


# ---------------------------------------------------------------------------------------------------
# A rank's rows of a sharded block, taken without a collective.
# ---------------------------------------------------------------------------------------------------
def _rank_block(rank: int, num_points: int = 11, num_latents: int = 3, world_size: int = 2) -> ShardedRowBlock:
    """Rank ``rank``'s block as ``ShardedRowBlock.of_rank`` makes it (without a process group)."""
    bounds = [(start * num_latents, stop * num_latents) for start, stop in row_bounds(num_points, world_size)]
    start, stop = bounds[rank]
    return ShardedRowBlock(start, stop, num_points * num_latents, bounds, None, num_latents)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_ranks_rows_and_points_of_whole_tensors(rank):
    block = _rank_block(rank)
    assert block.is_sharded
    first, last = (0, 6) if rank == 0 else (6, 11)  # 11 points over 2 ranks: 6 and 5
    assert (block.start, block.stop, block.local_size) == (3 * first, 3 * last, 3 * (last - first))
    rows = _tensor(33, 4)
    assert torch.equal(block.local(rows), rows[3 * first : 3 * last])
    own = block.own_rows(rows)
    assert torch.equal(own, rows[3 * first : 3 * last]) and own.is_contiguous()
    assert block.own_rows(own) is own  # already this rank's rows
    columns = rows.mT.contiguous().mT  # a transposed store's view: its rows' slice is copied to a contiguous tensor
    assert block.own_rows(columns).is_contiguous() and torch.equal(block.own_rows(columns), own)
    points = _tensor(11, 3, 3)
    assert torch.equal(block.own_points(points), points[first:last])
    assert block.own_points(points[first:last]).shape == (last - first, 3, 3)
    assert block.all_rows(rows) is rows  # all rows already: no collective
    assert torch.equal(block.all_points(points), points)


def test_one_rank_of_a_sharded_block_is_all_rows():
    block = _rank_block(0, world_size=1)
    rows = _tensor(33, 2)
    assert block.local_size == block.size == 33
    assert block.own_rows(rows) is rows and block.all_rows(rows) is rows


# ---------------------------------------------------------------------------------------------------
# The prior's rows and its products by rows: in one process, its products themselves.
# ---------------------------------------------------------------------------------------------------
def _priors() -> dict[str, LatentPrior]:
    x = torch.rand(30, 2, dtype=DTYPE, generator=torch.Generator().manual_seed(3))
    kernel = gpytorch.kernels.RBFKernel().to(DTYPE)
    batch = gpytorch.kernels.RBFKernel(batch_shape=torch.Size([3])).to(DTYPE)
    batch.lengthscale = torch.tensor([0.2, 0.4, 0.8], dtype=DTYPE).view(3, 1, 1)
    multitask = gpytorch.kernels.MultitaskKernel(gpytorch.kernels.RBFKernel(), num_tasks=3, rank=1).to(DTYPE)
    normal = gpytorch.distributions.MultivariateNormal
    return {
        "single": LatentPrior.from_distribution(normal(torch.zeros(30, dtype=DTYPE), kernel(x)), 1),
        "shared": LatentPrior.from_distribution(normal(torch.zeros(30, dtype=DTYPE), kernel(x)), 3),
        "independent": LatentPrior.from_distribution(normal(torch.zeros(3, 30, dtype=DTYPE), batch(x)), 3),
        "multitask": LatentPrior.from_distribution(
            gpytorch.distributions.MultitaskMultivariateNormal(torch.zeros(30, 3, dtype=DTYPE), multitask(x)), 3
        ),
    }


LAYOUTS = {
    "single": OneLatentPrior,
    "shared": SharedKernelPrior,
    "independent": IndependentPrior,
    "multitask": MultitaskPrior,
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_process_prior_products_by_rows_are_its_products(layout):
    with torch.no_grad():
        prior = _priors()[layout]
        assert type(prior) is LAYOUTS[layout] and prior.layout == layout
        num = prior.num_latents
        assert not prior.rows.is_sharded and prior.rows.size == 30 * num
        rhs = _tensor(30 * num, 4, seed=1)
        product = prior.matmul(rhs)
        assert torch.equal(prior.matmul_by_rows(rhs), product)
        assert torch.equal(prior.matmul_by_columns(rhs, prior.rows), product)
        indices = torch.tensor([0, 4, 5, 3 * num - 1])
        assert torch.equal(prior.kernel_columns_by_rows(indices), prior.kernel_columns(indices))
        torch.testing.assert_close(prior.kernel_columns(indices), prior.data_major_covariance().to_dense()[:, indices])
        assert prior.products == 6 and prior.columns == 3 * 4 + 3 * len(indices)  # each call counted once
