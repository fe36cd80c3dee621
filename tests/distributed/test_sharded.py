"""ShardedKernel on two gloo processes against one process: products, fits, resumption and a failing rank.

One pair of processes (spawned once for the module, on a free localhost port, killed after
:data:`DEADLINE_SECONDS` whatever happens) runs every scenario of :mod:`tests.distributed.scenarios`; the tests
compare what each rank computed with the same computation in this process, without the wrapper.
"""

from __future__ import annotations

import io
import socket
import tempfile
import time
from pathlib import Path

import gpytorch
import pytest
import torch
import torch.multiprocessing as mp

from . import scenarios

WORLD_SIZE = 2
DEADLINE_SECONDS = 180
TOLERANCE = 1e-10


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawned(layouts: bool) -> list[dict]:
    """What each of the two processes computed (:func:`scenarios.run`; a failure of either is the fixture's error)."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    with tempfile.TemporaryDirectory() as directory:
        context = mp.start_processes(
            scenarios.worker,
            args=(WORLD_SIZE, _free_port(), directory, layouts),
            nprocs=WORLD_SIZE,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + DEADLINE_SECONDS
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the two processes did not finish within {DEADLINE_SECONDS} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
        results = [torch.load(Path(directory) / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]
    for rank, result in enumerate(results):
        assert "worker_error" not in result, f"rank {rank}:\n{result.get('worker_error')}"
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Every scenario but the prior's other layouts' state sharding, on the two processes."""
    return _spawned(layouts=False)


@pytest.fixture(scope="module")
def layout_ranks() -> list[dict]:
    """The state-sharding scenarios of the prior's other layouts (:data:`scenarios.LAYOUT_KINDS`), on two processes
    of their own: the slow tests'."""
    return _spawned(layouts=True)


@pytest.fixture
def kind_ranks(request: pytest.FixtureRequest, kind: str) -> list[dict]:
    """The processes that ran the scenarios of ``kind``: :func:`layout_ranks` or :func:`ranks`."""
    return request.getfixturevalue("layout_ranks" if kind in scenarios.LAYOUT_KINDS else "ranks")


def _kinds(kinds: tuple[str, ...]) -> list:
    """``kinds`` as parameters, those of the prior's other layouts marked slow (their processes take half a minute)."""
    return [pytest.param(kind, marks=pytest.mark.slow) if kind in scenarios.LAYOUT_KINDS else kind for kind in kinds]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=TOLERANCE * (1 + float(expected.abs().max())), msg=name)


class _SingleProcess(dict):
    """The reference, by kind: the scenario's fit in this process, without the wrapper (fitted when first read)."""

    def __missing__(self, kind: str) -> dict[str, torch.Tensor]:
        built = scenarios.model(kind, sharded=False)
        scenarios.fit_saving(built, kind)  # as the ranks fit (saving a state_dict mid-fit)
        self[kind] = scenarios.summary(built, kind)
        return self[kind]


@pytest.fixture(scope="module")
def single_process() -> _SingleProcess:
    """The reference: the scenarios' fits in this process, without the wrapper."""
    torch.set_num_threads(1)
    return _SingleProcess()


def test_sharded_products_equal_the_dense_product(ranks):
    """K R through the fits' dispatch (cached rows; fused tiles) and the kernel columns of sparse actions, gathered on
    both ranks, against GPyTorch's dense K; one kernel, one per class (batch [3]), and a multitask kernel."""
    generator = torch.Generator().manual_seed(3)
    x = torch.rand(101, 2, generator=generator, dtype=torch.float64)
    rhs = torch.randn(101 * 3, 4, generator=generator, dtype=torch.float64)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    with torch.no_grad():
        dense = kernel(x).to_dense()
    expected = {None: (dense @ rhs.reshape(101, 12)).reshape(303, 4)}
    per_class = rhs.reshape(101, 3, 4).permute(1, 0, 2)
    expected[3] = (dense @ per_class).permute(1, 0, 2).reshape(303, 4)  # the same kernel in each batch entry
    for result in ranks:
        for batch in (None, 3):
            for limit in (None, 0):
                _assert_close(result[f"product_{batch}_{limit}"], expected[batch], f"batch {batch}, limit {limit}")
                # each rank sends its padded block of ceil(101 / 2) points x 3 latents x 4 columns, float64, once
                assert int(result[f"bytes_{batch}_{limit}"]) == 51 * 12 * 8 * (WORLD_SIZE - 1)
                columns = torch.zeros(303, len(scenarios.COLUMNS), dtype=torch.float64)  # K ⊗ I_3, data-major
                for column, index in enumerate(scenarios.COLUMNS.tolist()):
                    columns[index % 3 :: 3, column] = dense[:, index // 3]
                _assert_close(result[f"columns_{batch}_{limit}"], columns, f"columns, batch {batch}, limit {limit}")
        multitask = scenarios.multitask_kernel()
        with torch.no_grad():
            _assert_close(result["product_multitask"], multitask(x).to_dense() @ rhs, "multitask")


@pytest.mark.parametrize("kind", ["laplace", "ep"])
def test_two_processes_fit_the_single_process_posterior(ranks, single_process, kind):
    """Softmax Laplace (IterNCGPStrategy) and binary EP (EPStrategy), CG with recycling and compression: the mode
    (sites), the posterior mean and variance at test inputs and the evidence of each rank equal one process's."""
    for result in ranks:
        for name, expected in single_process[kind].items():
            _assert_close(result[kind][name], expected, f"{kind} {name}")
        fit_products, gathered = result[f"{kind}_products"]
        # every product of the fit, and the prediction's, was sharded (besides the preconditioner's kernel columns)
        assert gathered == fit_products + 1 > 1


@pytest.mark.parametrize("kind", ["laplace", "ep"])
def test_state_dicts_move_between_two_processes_and_one(ranks, single_process, kind):
    """A state_dict saved mid-fit on two processes resumes in one, and one saved in one process resumes on two: both
    end where the uninterrupted single-process fit ends."""
    resumed = scenarios.load(scenarios.model(kind, sharded=False), ranks[0][f"{kind}_saved"])
    scenarios.fit(resumed, kind, scenarios.FIT_STEPS[kind] - scenarios.STEP_OF_SAVE)
    for name, expected in single_process[kind].items():
        _assert_close(scenarios.summary(resumed, kind)[name], expected, f"{kind} {name}, resumed in one process")
        for result in ranks:
            _assert_close(result[f"{kind}_resumed"][name], expected, f"{kind} {name}, resumed on two processes")


def test_fit_mll_on_two_processes_learns_what_one_process_learns(ranks):
    """``fit_mll`` with a ``ShardedKernel`` (state replicated, or held by rows): both ranks draw the same rows and learn
    the kernel, the mode and the predictions of one process."""
    single = scenarios.learnt_by_fit_mll(sharded=False)
    for result in ranks:
        for shard_state in (False, True):
            learnt = result[f"fit_mll_{shard_state}"]
            assert torch.equal(learnt["rows"], single["rows"]) and int(learnt["evaluations"]) >= 2
            for name in ("parameters", "mode", "mean", "variance"):  # L-BFGS amplifies the reductions' rounding
                torch.testing.assert_close(learnt[name], single[name], rtol=1e-7, atol=1e-9, msg=name)


def test_a_failing_rank_makes_the_other_fail_within_the_timeout(ranks, single_process):
    """Rank 1 raises (KeyboardInterrupt) after two Newton steps and stays alive without taking part: rank 0 fails with
    the error naming the timeout instead of waiting forever, keeps the state of its last completed step, and that
    state resumes in one process to the uninterrupted fit's posterior."""
    failed, waiting = ranks[1]["fault"], ranks[0]["fault"]
    assert failed["error"].startswith("KeyboardInterrupt")
    assert waiting["error"] is not None and "could not gather" in waiting["error"], waiting["error"]
    assert "timeout=" in waiting["error"]
    assert waiting["newton_steps"] == failed["newton_steps"] == scenarios.STEP_OF_SAVE
    resumed = scenarios.load(scenarios.model("laplace", sharded=False), waiting["saved"])
    assert resumed.variational_strategy.state.newton_steps == scenarios.STEP_OF_SAVE
    scenarios.fit(resumed, "laplace", scenarios.FIT_STEPS["laplace"] - scenarios.STEP_OF_SAVE)
    for name, expected in single_process["laplace"].items():
        _assert_close(scenarios.summary(resumed, "laplace")[name], expected, f"laplace {name}, resumed after a fault")


def test_the_action_buffers_reductions_over_row_blocks_equal_the_dense_products(ranks):
    """An action buffer whose rows are split over the two ranks (51 and 50 points x 3 latents): S^T x, S c, T c (each
    rank's rows of them, gathered here) and the Gram matrices (the noise's from each rank's blocks of W^{-1}, block
    noise whitened by rows and a dense noise by its product) against the dense products of all rows."""
    actions, kernel_actions, cholesky = scenarios.buffer_data()
    from gpytorch_iterncgp.core.noise import BlockNoiseInverse

    noise = BlockNoiseInverse(cholesky).to_dense()
    vector = torch.linspace(-1, 1, 303, dtype=torch.float64)
    coefficients = torch.arange(6, dtype=torch.float64)
    expected = {
        "transpose_matmul": actions.mT @ vector,
        "combine": torch.stack([actions @ coefficients, kernel_actions @ coefficients], -1),
        "kernel_gram": actions.mT @ kernel_actions,
        "action_gram": actions.mT @ actions,
        "noise_gram_block": actions.mT @ noise @ actions,
        "noise_gram_dense": actions.mT @ noise @ actions,
    }
    for rank, result in enumerate(ranks):
        buffer = result["buffer"]
        assert buffer["rows"].tolist() == [(51 - rank) * 3, 6]
        assert buffer["combine_rows"].tolist() == [(51 - rank) * 3, 2]
        for name, value in expected.items():
            _assert_close(buffer[name], value, name)
        assert buffer["zero_sums"].tolist() == [True, False]


@pytest.mark.parametrize("kind", _kinds(scenarios.SHARDED_STATE_KINDS))
def test_sharded_state_holds_each_ranks_rows_and_fits_the_single_process_posterior(kind_ranks, single_process, kind):
    """``ShardedKernel(..., shard_state=True)``, softmax Laplace (one kernel shared by the classes, one GP per class,
    and correlated latents by a MultitaskKernel) and binary EP: after every Newton step (EP sweep) each rank holds its
    120 points' rows of the recycled actions S and K S (of 240 points), and the posterior (mode or sites, mean and
    variance at test inputs, evidence) is the same on both ranks, bit for bit, and equals one process's, also after a
    change of outputscale (of the task covariance for the MultitaskKernel; S gathered by column blocks for the renewed
    K S); its state_dict (gathered, all rows) resumes in one process, and one process's resumes with state sharding,
    both to the uninterrupted fit's posterior."""
    rows = scenarios.NUM_DATA // WORLD_SIZE * scenarios.num_latents(kind)
    for result in kind_ranks:
        state = result[f"{kind}_sharded_state"]
        assert len(state["shapes"]) > scenarios.STEP_OF_SAVE  # steps taken (Laplace converges after 5 of 6)
        for actions, kernel_actions, *_ in state["shapes"]:
            assert actions == kernel_actions and actions[0] == rows and actions[1] > 0
        assert state["final_shape"][0] == state["resumed_shape"][0] == state["renewed_shape"][0] == rows
        for name, expected in single_process[kind].items():
            _assert_close(state["summary"][name], expected, f"{kind}, sharded state: {name}")
            _assert_close(state["resumed"][name], expected, f"{kind}, sharded state: {name}, resumed on two")
    reference = scenarios.model(kind, sharded=False)  # the fit continued after a change of kernel
    scenarios.fit(reference, kind, scenarios.FIT_STEPS[kind])
    for name, expected in scenarios.renewed(reference, kind).items():
        for result in kind_ranks:
            _assert_close(result[f"{kind}_sharded_state"]["renewed"][name], expected, f"{kind} {name}, new kernel")
    for name, value in kind_ranks[0][f"{kind}_sharded_state"]["summary"].items():  # all_reduce: one result on all ranks
        assert torch.equal(value, kind_ranks[1][f"{kind}_sharded_state"]["summary"][name]), name
    saved = torch.load(io.BytesIO(kind_ranks[0][f"{kind}_sharded_state"]["saved"]), weights_only=True)
    extra = next(value for key, value in saved.items() if key.endswith("_extra_state"))
    assert extra["state"]["actions"].shape[0] == WORLD_SIZE * rows  # gathered on save
    resumed = scenarios.load(scenarios.model(kind, sharded=False), kind_ranks[0][f"{kind}_sharded_state"]["saved"])
    scenarios.fit(resumed, kind, scenarios.FIT_STEPS[kind] - scenarios.STEP_OF_SAVE)
    for name, expected in single_process[kind].items():
        _assert_close(
            scenarios.summary(resumed, kind)[name], expected, f"{kind}, sharded state: {name}, resumed in one"
        )


@pytest.mark.parametrize("kind", _kinds(scenarios.SHARDED_STATE_KINDS))
def test_sharded_state_holds_the_final_precision_root_by_rows(kind_ranks, single_process, kind):
    """``shard_state=True``: the final Q and K Q (formed at the end of the fit, used by every prediction) are held by
    rows like S and K S: each rank's 120 points' rows (of 240) after every step, at the end of the fit, after a
    change of kernel and after resuming; the predictions from them (cross-covariance columns of each rank's points,
    summed over the ranks) equal one process's (test_sharded_state_holds_each_ranks_rows_...). The final state_dict
    holds all 240 points' rows (gathered on save) and predicts in one process, without refitting, the same
    posterior."""
    rows = scenarios.NUM_DATA // WORLD_SIZE * scenarios.num_latents(kind)
    for result in kind_ranks:
        state = result[f"{kind}_sharded_state"]
        for shapes in [*state["shapes"], state["final_shapes"], state["renewed_shapes"], state["resumed_shapes"]]:
            actions, kernel_actions, root, kernel_root = shapes
            assert actions[0] == kernel_actions[0] == root[0] == kernel_root[0] == rows, shapes
            assert root == kernel_root and root[1] > 0
    saved = torch.load(io.BytesIO(kind_ranks[0][f"{kind}_sharded_state"]["final_saved"]), weights_only=True)
    extra = next(value for key, value in saved.items() if key.endswith("_extra_state"))
    assert extra["state"]["precision_root"].shape[0] == extra["state"]["kernel_precision_root"].shape[0]
    assert extra["state"]["precision_root"].shape[0] == WORLD_SIZE * rows
    loaded = scenarios.load(scenarios.model(kind, sharded=False), kind_ranks[0][f"{kind}_sharded_state"]["final_saved"])
    for name, expected in single_process[kind].items():
        _assert_close(scenarios.summary(loaded, kind)[name], expected, f"{kind}, final state_dict: {name}, in one")
    assert loaded.variational_strategy.last_report is None  # predicted from the saved state, not refitted


@pytest.mark.parametrize("kind", _kinds(scenarios.COVARIANCE_PHASE_KINDS))
def test_sharded_state_with_a_covariance_phase_fits_the_single_process_posterior(kind_ranks, kind):
    """``shard_state=True`` and a covariance phase after the fit (EP: and one block for the marginals after every
    sweep, whose directions join the recycled actions), run on each rank's rows of Q, K Q: each rank holds its rows of
    the enlarged Q and K Q, and the posterior equals one process's; softmax Laplace with a shared kernel, one GP per
    class and correlated latents, binary EP, and correlated counts with missing outputs (the phase's directions on
    the observed coordinates, masked by each rank's rows). A prediction at the 13 test inputs is one product, an
    all_reduce of 13 C (r + 1) numbers, counted with the 8 bytes of each (float64)."""
    reference = scenarios.with_covariance_phase(scenarios.model(kind, sharded=False))
    scenarios.fit(reference, kind, scenarios.FIT_STEPS[kind])
    expected_rank = reference.variational_strategy.state.precision_root.shape[-1]
    latents = scenarios.num_latents(kind)
    rows = scenarios.NUM_DATA // WORLD_SIZE * latents
    for result in kind_ranks:
        phase = result[f"{kind}_covariance_phase"]
        assert [shape[0] for shape in phase["shapes"]] == [rows] * 4
        assert phase["shapes"][2] == phase["shapes"][3] == (rows, expected_rank)
        for name, expected in scenarios.summary(reference, kind).items():
            _assert_close(phase["summary"][name], expected, f"{kind}, covariance phase: {name}")
        assert phase["counted"] == (1, 13 * latents * (expected_rank + 1) * 8)


def test_the_covariance_phase_on_rows_equals_the_phase_in_one_process(ranks):
    """The covariance phase given each rank's rows of Q, K Q (101 points x 3 latents: 153 and 150 rows, an uneven
    split) returns that rank's rows of the enlarged Q, K Q of the same phase in one process (3 blocks of 9 actions,
    18 directions added after the zero-sum projection), within 1e-10."""
    from gpytorch_iterncgp.core.covariance import covariance_phase
    from gpytorch_iterncgp.core.sharding import RowBlock, row_bounds

    kernel, noise, root, kernel_root, project = scenarios.covariance_phase_data()
    expected = covariance_phase(
        lambda vectors: kernel @ vectors, noise, root, kernel_root, 3, 3, 9,
        project=project, action_space_dimension=202, seed=5, rows_block=RowBlock.single(101, 3),
    )  # fmt: skip
    assert expected.added == 18
    for (start, stop), result in zip(row_bounds(101, WORLD_SIZE), ranks, strict=True):
        phase = result["covariance_phase_rows"]
        assert phase["added"] == expected.added
        assert phase["root"].shape == phase["kernel_root"].shape == (3 * (stop - start), root.shape[-1] + 18)
        _assert_close(phase["root"], expected.precision_root[3 * start : 3 * stop], "Q's rows")
        _assert_close(phase["kernel_root"], expected.kernel_precision_root[3 * start : 3 * stop], "K Q's rows")


@pytest.mark.parametrize("kind", _kinds(scenarios.VECTOR_KINDS))
def test_sharded_state_holds_the_outer_loops_vectors_by_rows(kind_ranks, kind):
    """``shard_state=True``: softmax and binary Laplace, CG with recycling and compression, softmax Laplace with
    unit-vector actions (each on the rank holding its coordinate, its kernel columns by rows), binary probit EP and
    multinomial probit EP (C x C sites); and the prior's other layouts, by CG and by unit vectors: one GP per class
    (a batch [3] kernel: each rank's rows of each class's columns), correlated latents (MultitaskKernel: the columns
    are products with one-hot vectors), correlated counts with missing outputs (LCMKernel; NaN targets: the actions,
    the unit vectors among them, on the observed coordinates of each rank's rows only), and multinomial probit EP with
    one GP per class or correlated latents. After every Newton step or sweep and at the end of the fit each rank holds its
    rows of a and K a (and its points' sites) only, 120 of 240 points, and at the end its rows of the loop's vectors
    (Laplace: a, K a, the mode f, the gradient, W^{-1}, an operator of its rows' size built from its points' curvature
    blocks; EP: a, K a, the sites, the marginals and the right-hand side) equal the same rows of one process's fit
    within 1e-10, and so do the mode (sites), the predictions at test inputs and the evidence, with as many products
    with K as in one process, each one collective of the ShardedKernel. The state_dict saved by
    the two processes after two steps (all rows) resumes in one process to the uninterrupted fit's vectors."""
    from gpytorch_iterncgp.core.sharding import row_bounds

    latents = scenarios.num_latents(kind)
    reference = scenarios.model(kind, sharded=False)
    scenarios.fit(reference, kind, scenarios.FIT_STEPS[kind])
    expected = scenarios.loop_vectors(reference)
    size = scenarios.NUM_DATA * latents
    assert expected["noise_shape"].tolist() == [size, size]
    products = reference.variational_strategy.last_report.kernel_products
    for result in kind_ranks:  # as many products with K as one process (each a collective), no second one
        assert tuple(result[f"{kind}_vectors"]["products"]) == (products, products), kind
    resumed = scenarios.load(scenarios.model(kind, sharded=False), kind_ranks[0][f"{kind}_vectors"]["saved"])
    scenarios.fit(resumed, kind, scenarios.FIT_STEPS[kind] - scenarios.STEP_OF_SAVE)
    resumed_vectors = scenarios.loop_vectors(resumed)
    for (start, stop), result in zip(row_bounds(scenarios.NUM_DATA, WORLD_SIZE), kind_ranks, strict=True):
        held, count = result[f"{kind}_vectors"], (stop - start) * latents
        assert count == scenarios.NUM_DATA // WORLD_SIZE * latents
        assert len(held["shapes"]) > scenarios.STEP_OF_SAVE + 1
        for shapes in held["shapes"]:  # a, K a (, sites): this rank's rows (points) only
            assert shapes[:2] == [(count,), (count,)] and all(shape[0] * latents == count for shape in shapes[2:])
        assert held["final"]["noise_shape"].tolist() == [count, count]
        for name, value in expected.items():
            if name == "noise_shape":
                continue
            # data-major vectors by rows, point-major tensors (sites, C x C marginals) by points
            part = value[start * latents : stop * latents] if value.shape[0] == size else value[start:stop]
            assert held["final"][name].shape == part.shape, name
            _assert_close(held["final"][name], part, f"{kind} {name}, rank's rows")
    for name, value in expected.items():
        _assert_close(resumed_vectors[name].double(), value.double(), f"{kind} {name}, resumed in one process")
    for name, value in scenarios.summary(reference, kind).items():  # mode or sites, predictions, evidence
        for result in kind_ranks:
            _assert_close(result[f"{kind}_vectors"]["summary"][name], value, f"{kind} {name}, two processes")


def test_a_sharded_kernel_inside_a_covariance_built_in_forward_is_refused_with_shard_state(ranks):
    """A linear model of coregionalisation built in ``forward`` as a sum of Kronecker products of a wrapped batch
    kernel's entries: its products are not split by rows, so with ``shard_state=True`` the loops would hold all rows
    while the policy and the predictions take this rank's (CG ran replicated, with no sharded product; with unit
    vectors rank 1 stopped on a zero action while rank 0 waited for it). The fit refuses it on both ranks, naming the
    fix, before any product."""
    for result in ranks:
        error = result["operator_prior"]
        assert error is not None and "SumLinearOperator built from it" in error, error
        assert "LCMKernel" in error and "shard_state=False" in error and error.endswith("(0 products)")


def test_ranks_with_different_data_fail_naming_the_fix(ranks):
    for result in ranks:
        assert result["mismatch"] is not None and "same model on the same data" in result["mismatch"]


@pytest.mark.slow
def test_distributed_example_runs_on_two_processes(tmp_path):
    """``torchrun --nproc-per-node 2 examples/distributed_classification.py --smoke`` (gloo) ends with rank 0's
    state_dict loaded into a single-process model with the same posterior means, and its figure."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(_free_port()),
    ]
    script = [str(root / "examples" / "distributed_classification.py"), "--smoke", "--quiet", "--out", str(tmp_path)]
    result = subprocess.run(command + script, cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    difference = float(result.stdout.split("max |difference of posterior means| ")[1].split()[0])
    assert difference < 1e-10
    assert (tmp_path / "distributed_classification.png").stat().st_size > 10_000


@pytest.mark.slow
def test_distributed_benchmark_smoke_run_writes_results(tmp_path):
    """``benchmarks/distributed.py --smoke``: four configurations, the same fit and covariance phase in each (as many
    products), and each of the two ranks sends its rows of one action's product: 500 points x 10 classes in float32,
    in the phase as many per column multiplied."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "distributed.py", "--smoke", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=root / "benchmarks", capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    saved = json.loads((tmp_path / "distributed.json").read_text())
    assert saved["machine"]["cpu_count"] >= 1
    one, _, two, sharded_state = saved["configurations"]
    assert two["processes"] == 2 and two["bytes_sent_per_product"] == 500 * 10 * 4
    for other in (two, sharded_state):
        assert other["fit_products"] == one["fit_products"] > 0 and other["newton_steps"] == one["newton_steps"]
        assert other["phase_products"] == one["phase_products"] > 0
        assert other["phase_columns"] == one["phase_columns"]
    assert two["phase_bytes_sent"] == two["phase_columns"] * 500 * 10 * 4
    assert (tmp_path / "distributed.png").stat().st_size > 10_000
