"""The fits that ``test_sharded.py`` runs on two gloo processes and, as the reference, in one process.

Each scenario builds the same model on the same data; with ``sharded=True`` its kernel is wrapped in
:class:`~gpytorch_iterncgp.distributed.ShardedKernel`. :func:`worker` is the body of each spawned process: it runs
every scenario and saves what it computed (and any error, as text) to ``<directory>/rank<r>.pt``.
"""

from __future__ import annotations

import datetime
import io
import time
import traceback
from pathlib import Path

import gpytorch
import torch
import torch.distributed as dist

from gpytorch_iterncgp import (
    EPMarginalLogLikelihood,
    EPStrategy,
    IterNCGPStrategy,
    LaplaceMarginalLogLikelihood,
    LearningRecipe,
    MultinomialProbitLikelihood,
    fit_mll,
)
from gpytorch_iterncgp import settings as package_settings
from gpytorch_iterncgp.core.prior import LatentPrior
from gpytorch_iterncgp.distributed import ShardedKernel
from gpytorch_iterncgp.likelihoods.adapters import MultitaskPoissonLikelihood
from tests.common import (
    IterNCGPModel,
    LMCIterNCGPModel,
    MultitaskIterNCGPModel,
    binary_data,
    multiclass_data,
    multioutput_count_data,
    set_distinct_class_hyperparameters,
)

NUM_DATA = 240
NUM_CLASSES = 3
STEP_OF_SAVE = 2  # Newton steps / EP sweeps after which a state_dict is saved
FAULT_TIMEOUT = datetime.timedelta(seconds=3)  # the faulty scenario's process group: what a rank waits for another
SOLVER = {"policy": "cg", "max_solver_iterations": 5, "recycle": True, "compression_rank": 10}
UNIT_SOLVER = {**SOLVER, "policy": "unit", "max_solver_iterations": 20, "compression_rank": 30}  # 20 unit vectors
FIT_STEPS = {"laplace": 6, "ep": 4, "binary": 6, "unit": 6, "mnp": 3}  # Newton steps, EP sweeps
FIT_STEPS |= {"independent": 6, "multitask": 6, "missing": 6, "mnp_independent": 3, "mnp_multitask": 3}
FIT_STEPS |= {"independent_unit": 3, "multitask_unit": 3, "missing_unit": 3}
# the prior's layouts besides one kernel shared by the classes: one GP per class (batch [C]), correlated latents
# (MultitaskKernel), correlated counts with missing outputs (LCMKernel); Laplace with CG or unit vectors, and EP
LAYOUT_KINDS = ("independent", "independent_unit", "multitask", "multitask_unit", "missing", "missing_unit")
LAYOUT_KINDS += ("mnp_independent", "mnp_multitask")
VECTOR_KINDS = ("laplace", "binary", "unit", "ep", "mnp", *LAYOUT_KINDS)  # sharded_vectors
SHARDED_STATE_KINDS = ("laplace", "ep", "independent", "multitask")  # sharded_state: + resumption, a new kernel
COVARIANCE_PHASE_KINDS = ("laplace", "ep", "independent", "multitask", "missing")  # sharded_covariance_phase
COVARIANCE_PHASE = {"covariance_iterations": 1, "covariance_block_size": 12}  # one block after the fit
MARGINAL_REFRESH = {"marginal_iterations": 1}  # EP: one covariance-phase block for the marginals after every sweep
COLUMNS = torch.tensor([0, 7, 8, 150, 302])  # data-major indices of kernel columns (points 0, 2, 50, 100)


def num_latents(kind: str) -> int:
    """:math:`C`, the latents per point (data-major rows of the state per point)."""
    return 1 if kind in ("binary", "ep") else NUM_CLASSES


def data(kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training inputs, targets and test inputs (float64)."""
    if kind in ("laplace", "unit", "mnp") or kind.startswith(("independent", "multitask", "mnp_")):
        x, y = multiclass_data(NUM_DATA, NUM_CLASSES, dim=2, seed=1)
    elif kind.startswith("missing"):  # (N, C) counts, a fifth of them NaN, on [0, 1]
        x, y = multioutput_count_data(NUM_DATA, NUM_CLASSES, seed=1, missing=0.2)
    else:  # binary EP, and binary Laplace
        x, y = binary_data(NUM_DATA, dim=2, seed=1)
    test = torch.rand(13, x.shape[-1], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return x, y, test


def model(kind: str, sharded: bool, process_group=None, shard_state: bool = False) -> IterNCGPModel:
    """Softmax Laplace (``"laplace"``, one kernel shared by the classes), binary probit EP (``"ep"``) or binary probit
    Laplace (``"binary"``), CG with recycling; softmax Laplace with unit-vector actions (``"unit"``, 20 per Newton
    step, recycled and compressed to 30); multinomial probit EP (``"mnp"``, C x C sites). The other layouts of the
    prior (:data:`LAYOUT_KINDS`): softmax Laplace with one GP per class (``"independent"``, a batch [C] kernel with
    its own lengthscale, outputscale and mean per class), with correlated latents (``"multitask"``,
    ``MultitaskKernel`` of rank 2), and multi-output Poisson counts, a fifth of them missing (``"missing"``, NaN
    targets, ``LCMKernel`` of two RBF kernels), by CG or with unit vectors (``"..._unit"``, as ``"unit"``);
    multinomial probit EP with one GP per class or correlated latents (``"mnp_independent"``, ``"mnp_multitask"``).
    ``shard_state``: the wrapper holds the solver's state by rows too."""
    x, y, _ = data(kind)
    options = UNIT_SOLVER if kind.endswith("_unit") else SOLVER
    if kind.startswith("mnp_"):  # multinomial probit EP with one GP per class or correlated latents
        options = {**options, "strategy_class": EPStrategy}
    softmax = gpytorch.likelihoods.SoftmaxLikelihood(num_classes=NUM_CLASSES, mixing_weights=False)
    probit = MultinomialProbitLikelihood(num_classes=NUM_CLASSES)
    if kind in ("independent", "independent_unit", "mnp_independent"):  # one GP per class, batch [C], each its own
        likelihood = probit if kind.startswith("mnp_") else softmax  # lengthscale, outputscale and mean
        built = IterNCGPModel(
            x, y, likelihood, kernel="matern", batch_classes=NUM_CLASSES, constant_mean=0.0, **options
        )
        set_distinct_class_hyperparameters(built)
    elif kind in ("multitask", "multitask_unit", "mnp_multitask"):  # correlated latents: MultitaskKernel, K_x ⊗ B
        likelihood = probit if kind.startswith("mnp_") else softmax
        built = MultitaskIterNCGPModel(x, y, likelihood, num_tasks=NUM_CLASSES, rank=2, **options)
    elif kind in ("missing", "missing_unit"):  # correlated counts, missing outputs (NaN: no likelihood factor)
        likelihood = MultitaskPoissonLikelihood(num_tasks=NUM_CLASSES)  # LCMKernel: sum_q K_q ⊗ B_q, q = 1, 2
        built = MultitaskIterNCGPModel(x, y, likelihood, num_tasks=NUM_CLASSES, kernel="lcm", rank=1, **options)
    elif kind == "mnp":
        likelihood = MultinomialProbitLikelihood(num_classes=NUM_CLASSES)
        built = IterNCGPModel(x, y, likelihood, kernel="matern", strategy_class=EPStrategy, **SOLVER)
    elif kind == "unit":
        likelihood = gpytorch.likelihoods.SoftmaxLikelihood(num_classes=NUM_CLASSES, mixing_weights=False)
        built = IterNCGPModel(x, y, likelihood, kernel="matern", lengthscale=0.3, outputscale=4.0, **UNIT_SOLVER)
    elif kind == "laplace":
        likelihood = gpytorch.likelihoods.SoftmaxLikelihood(num_classes=NUM_CLASSES, mixing_weights=False)
        built = IterNCGPModel(x, y, likelihood, kernel="matern", lengthscale=0.3, outputscale=4.0, **SOLVER)
    elif kind == "binary":
        built = IterNCGPModel(x, y, gpytorch.likelihoods.BernoulliLikelihood(), kernel="matern", **SOLVER)
    else:
        likelihood = gpytorch.likelihoods.BernoulliLikelihood()
        built = IterNCGPModel(x, y, likelihood, kernel="matern", strategy_class=EPStrategy, **SOLVER)
    if sharded:
        built.covar_module = ShardedKernel(built.covar_module, process_group=process_group, shard_state=shard_state)
    return built


def fit(built: IterNCGPModel, kind: str, steps: int, callback=None):
    strategy = built.variational_strategy
    if isinstance(strategy, IterNCGPStrategy):
        return strategy.fit(max_newton_steps=steps, callback=callback)
    return strategy.fit(max_sweeps=steps, callback=callback)


def summary(built: IterNCGPModel, kind: str) -> dict[str, torch.Tensor]:
    """The mode (Laplace) or site parameters (EP), the posterior mean and variance at the test inputs, the evidence."""
    strategy = built.variational_strategy
    x, y, test = data(kind)
    with torch.no_grad():
        mean, variance = strategy.marginal_latent(test)
    built.train()
    laplace = isinstance(strategy, IterNCGPStrategy)
    mll_class = LaplaceMarginalLogLikelihood if laplace else EPMarginalLogLikelihood
    evidence = mll_class(strategy.likelihood, built)(built(x), y).detach()
    fitted = strategy.mode if laplace else torch.cat([site.reshape(-1) for site in strategy.sites])
    return {"fitted": fitted.detach(), "mean": mean, "variance": variance, "evidence": evidence}


def state_dict_bytes(built: IterNCGPModel) -> bytes:
    buffer = io.BytesIO()
    torch.save(built.state_dict(), buffer)
    return buffer.getvalue()


def load(built: IterNCGPModel, saved: bytes) -> IterNCGPModel:
    built.load_state_dict(torch.load(io.BytesIO(saved), weights_only=True))
    return built


def fit_saving(built: IterNCGPModel, kind: str) -> bytes:
    """Fit to the end, saving the state_dict after :data:`STEP_OF_SAVE` steps; returns it."""
    saved = {}

    def save(step, state):
        if step.step == STEP_OF_SAVE:
            saved["state_dict"] = state_dict_bytes(built)

    fit(built, kind, FIT_STEPS[kind], callback=save)
    return saved["state_dict"]


def products(rank: int) -> dict[str, torch.Tensor]:
    """Products K R of sharded kernels through the fits' dispatch, cached and fused (``dense_kernel_limit`` 0),
    for one kernel (C = 1) and independent kernels per class (batch [3])."""
    generator = torch.Generator().manual_seed(3)
    x = torch.rand(101, 2, generator=generator, dtype=torch.float64)
    rhs = torch.randn(101 * 3, 4, generator=generator, dtype=torch.float64)
    out = {}
    for batch in (None, 3):
        shape = torch.Size([batch]) if batch else torch.Size([])
        kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(batch_shape=shape), batch_shape=shape).double()
        sharded = ShardedKernel(kernel)
        mean = torch.zeros(*shape, 101, dtype=torch.float64)
        for limit in (None, 0):
            with torch.no_grad(), package_settings.fused_kernel_backend("eager"):
                distribution = gpytorch.distributions.MultivariateNormal(mean, sharded(x))
                prior = LatentPrior.from_distribution(distribution, batch or 3)
                if limit is None:
                    product = prior.matmul(rhs)
                else:
                    with package_settings.dense_kernel_limit(limit):
                        product = prior.matmul(rhs)
            out[f"product_{batch}_{limit}"] = product
            out[f"bytes_{batch}_{limit}"] = torch.tensor(prior.covariance.evaluate_kernel().bytes_sent)
            with torch.no_grad():  # the columns that sparse actions take, from the rows of each rank
                out[f"columns_{batch}_{limit}"] = prior.kernel_columns(COLUMNS)
    # correlated outputs: a multitask kernel (3 rows per point), its products by points
    multitask = ShardedKernel(multitask_kernel())
    distribution = gpytorch.distributions.MultitaskMultivariateNormal(
        torch.zeros(101, 3, dtype=torch.float64), multitask(x), interleaved=True
    )
    with torch.no_grad():
        out["product_multitask"] = LatentPrior.from_distribution(distribution, 3).matmul(rhs)
    return out


def multitask_kernel() -> gpytorch.kernels.MultitaskKernel:
    """Three correlated outputs, task covariance B = F F^T + diag(v) with fixed F and v (GPyTorch draws both at
    random)."""
    kernel = gpytorch.kernels.MultitaskKernel(gpytorch.kernels.RBFKernel(), num_tasks=3, rank=1).double()
    kernel.task_covar_module.covar_factor.data = torch.tensor([[1.0], [-0.5], [0.3]], dtype=torch.float64)
    kernel.task_covar_module.var = torch.tensor([0.5, 0.2, 0.1], dtype=torch.float64)
    return kernel


def run(rank: int, directory: Path, layouts: bool = False) -> dict:
    """Every scenario on this rank; with ``layouts``, instead, only the state-sharding scenarios of the prior's other
    layouts (:data:`LAYOUT_KINDS`: the slow tests' share), without, all the others."""
    if layouts:
        return layout_scenarios(layouts=True)
    results: dict = products(rank)
    for kind in ("laplace", "ep"):
        built = model(kind, sharded=True)
        results[f"{kind}_saved"] = fit_saving(built, kind)
        results[kind] = summary(built, kind)
        report = built.variational_strategy.last_report
        # the solver's products, the ShardedKernel's calls less those of the preconditioner's factor (kernel columns)
        results[f"{kind}_products"] = (
            report.kernel_products,
            built.covar_module.products - report.preconditioner_products,
        )
        # a state_dict of one process after STEP_OF_SAVE steps, resumed on the two
        single = model(kind, sharded=False)
        saved = fit_saving(single, kind)
        resumed = load(model(kind, sharded=True), saved)
        fit(resumed, kind, FIT_STEPS[kind] - STEP_OF_SAVE)
        results[f"{kind}_resumed"] = summary(resumed, kind)
    results["buffer"] = buffer_products()
    results |= layout_scenarios(layouts=False)
    results["covariance_phase_rows"] = covariance_phase_rows(rank)
    for shard_state in (False, True):
        results[f"fit_mll_{shard_state}"] = learnt_by_fit_mll(sharded=True, shard_state=shard_state)
    results["operator_prior"] = operator_prior_refused()
    results["mismatch"] = mismatch(rank)
    results["fault"] = fault(rank, directory)
    return results


def layout_scenarios(layouts: bool) -> dict:
    """The state-sharding scenarios (:func:`sharded_state`, :func:`sharded_covariance_phase`,
    :func:`sharded_vectors`) of the kinds in :data:`LAYOUT_KINDS` (``layouts``) or of the others."""
    results = {}
    for kinds, scenario, suffix in (
        (SHARDED_STATE_KINDS, sharded_state, "sharded_state"),
        (COVARIANCE_PHASE_KINDS, sharded_covariance_phase, "covariance_phase"),
        (VECTOR_KINDS, sharded_vectors, "vectors"),
    ):
        for kind in kinds:
            if (kind in LAYOUT_KINDS) == layouts:
                results[f"{kind}_{suffix}"] = scenario(kind)
    return results


def learnt_by_fit_mll(sharded: bool, shard_state: bool = False) -> dict[str, torch.Tensor]:
    """``fit_mll`` on softmax Laplace (one kernel shared by the classes) learning on a stratified subset of 150 of the
    240 points (the exact regime: L-BFGS, 4 iterations), then the final fit: the learnt kernel, the mode and the
    posterior at the test inputs."""
    built = model("laplace", sharded=sharded, shard_state=shard_state)
    mll = LaplaceMarginalLogLikelihood(built.variational_strategy.likelihood, built)
    report = fit_mll(mll, learning_subset=150, seed=0, recipe=LearningRecipe(optimizer_steps=4))
    _, _, test = data("laplace")
    with torch.no_grad():
        mean, variance = built.variational_strategy.marginal_latent(test)
    parameters = torch.cat([p.detach().reshape(-1) for p in built.covar_module.parameters()])
    return {
        "parameters": parameters,
        "mode": built.variational_strategy.mode,
        "mean": mean,
        "variance": variance,
        "rows": torch.tensor(report.learning_rows),
        "evaluations": torch.tensor(report.evaluations),
    }


def renewed(built: IterNCGPModel, kind: str) -> dict[str, torch.Tensor]:
    """A fitted model's posterior after its outputscale changes to 3 (a multitask kernel: its task covariance's
    factor is multiplied by 1.3) and it fits 2 more steps (the recycled actions' products renewed for the new kernel
    first)."""
    kernel = built.covar_module.base_kernel if isinstance(built.covar_module, ShardedKernel) else built.covar_module
    if isinstance(kernel, gpytorch.kernels.MultitaskKernel):
        with torch.no_grad():
            kernel.task_covar_module.covar_factor.mul_(1.3)
    else:
        kernel.outputscale = 3.0
    fit(built, kind, 2)
    return summary(built, kind)


def buffer_data() -> tuple[torch.Tensor, ...]:
    """Actions ``S`` ``(303, 6)`` (101 points x 3 latents; the first three sum to zero over each point), ``T = A S``
    for a symmetric ``A``, and the Cholesky factors ``(101, 3, 3)`` of curvature blocks."""
    generator = torch.Generator().manual_seed(4)
    actions = torch.randn(303, 6, generator=generator, dtype=torch.float64)
    actions[:, :3] -= actions[:, :3].reshape(101, 3, 3).mean(1, keepdim=True).expand(101, 3, 3).reshape(303, 3)
    root = torch.randn(303, 303, generator=generator, dtype=torch.float64)
    factor = torch.randn(101, 3, 3, generator=generator, dtype=torch.float64)
    blocks = factor @ factor.mT + torch.eye(3, dtype=torch.float64)
    return actions, (root + root.mT) @ actions, torch.linalg.cholesky(blocks)


def buffer_products() -> dict[str, torch.Tensor]:
    """The action buffer's reductions with its rows split over the ranks (3 latents per point): S^T x, S c and T c,
    S^T T, S^T S, S^T W^{-1} S for block noise (whitened rows) and for a dense noise (gathered columns), and whether
    the actions sum to zero per point."""
    from linear_operator.operators import DenseLinearOperator

    from gpytorch_iterncgp.core.noise import BlockNoiseInverse
    from gpytorch_iterncgp.core.recycling import ActionBuffer, noise_gram
    from gpytorch_iterncgp.core.sharding import ShardedRowBlock

    actions, kernel_actions, cholesky = buffer_data()
    block = ShardedRowBlock.of_rank(101, 3, None)
    buffer = ActionBuffer.from_tensors(actions, kernel_actions, block)
    noise = BlockNoiseInverse(block.own_points(cholesky))  # this rank's blocks, as the solver holds W
    vector = torch.linspace(-1, 1, 303, dtype=torch.float64)
    combined = torch.stack(buffer.combine(torch.arange(6, dtype=torch.float64)), -1)  # this rank's rows
    centred = ActionBuffer.from_tensors(actions[:, :3], kernel_actions[:, :3], block)
    return {
        "rows": torch.tensor(buffer.actions.value.shape),
        "transpose_matmul": buffer.transpose_matmul(block.local(vector)),
        "combine_rows": torch.tensor(combined.shape),
        "combine": block.gather(combined),
        "kernel_gram": buffer.kernel_gram(),
        "action_gram": buffer.action_gram(),
        "noise_gram_block": noise_gram(buffer, noise),
        "noise_gram_dense": noise_gram(buffer, DenseLinearOperator(noise.to_dense())),
        "zero_sums": torch.tensor([centred.zero_block_sums(3), buffer.zero_block_sums(3)]),
    }


def shapes_of(state) -> list[tuple[int, ...]]:
    """The shapes of a regression state's S, K S, Q and K Q (the rows this rank holds, and the columns)."""
    names = ("actions", "kernel_actions", "precision_root", "kernel_precision_root")
    return [tuple(getattr(state, name).shape) for name in names]


def sharded_state(kind: str) -> dict:
    """Softmax Laplace or binary EP with the solver's matrices held by rows (``shard_state=True``): the posterior, the
    shapes of S, K S, Q, K Q the rank holds after each step and at the end of the fit, state_dicts after
    :data:`STEP_OF_SAVE` steps and at the end (gathered), and a single process's state_dict resumed here."""
    built = model(kind, sharded=True, shard_state=True)
    shapes: list = []
    saved = {}

    def record(step, state):
        shapes.append(shapes_of(state))
        if step.step == STEP_OF_SAVE:
            saved["state_dict"] = state_dict_bytes(built)

    fit(built, kind, FIT_STEPS[kind], callback=record)
    out: dict = {"summary": summary(built, kind), "shapes": shapes, "saved": saved["state_dict"]}
    out["final_shape"] = tuple(built.variational_strategy.state.actions.shape)
    out["final_shapes"] = shapes_of(built.variational_strategy.state)
    out["final_saved"] = state_dict_bytes(built)
    out["renewed"] = renewed(built, kind)
    out["renewed_shape"] = tuple(built.variational_strategy.state.actions.shape)
    out["renewed_shapes"] = shapes_of(built.variational_strategy.state)
    single = fit_saving(model(kind, sharded=False), kind)
    resumed = load(model(kind, sharded=True, shard_state=True), single)
    fit(resumed, kind, FIT_STEPS[kind] - STEP_OF_SAVE)
    out["resumed"] = summary(resumed, kind)
    out["resumed_shape"] = tuple(resumed.variational_strategy.state.actions.shape)
    out["resumed_shapes"] = shapes_of(resumed.variational_strategy.state)
    return out


def loop_vectors(built: IterNCGPModel) -> dict[str, torch.Tensor]:
    """The outer loop's vectors at the end of a fit, as the loop holds them (this rank's rows or points with
    ``shard_state``, all of them in one process): ``a``, ``K a`` and the shape of the noise ``W^{-1}``; Laplace: the
    mode ``f = m + K a``, the gradient ``g(f)`` and the diagonal of ``W^{-1}`` built from the curvature blocks at
    ``f``; EP: the sites, the marginals the next sweep starts from and the right-hand side of the sites' regression."""
    strategy = built.variational_strategy
    with torch.no_grad():
        loop = strategy._make_loop(strategy.train_prior(), strategy.options)
        state = strategy.state.with_own_rows(loop.rows_block)
        if isinstance(strategy, EPStrategy):
            mean, variance = loop.marginals(state)
            noise, rhs = loop.noise(state.site_precision, state.site_natural_mean, loop.rows_block)
            return {
                "weights": state.representer_weights,
                "kernel_weights": state.kernel_representer_weights,
                "site_precision": state.site_precision,
                "site_natural_mean": state.site_natural_mean,
                "marginal_mean": mean,
                "marginal_variance": variance,
                "rhs": rhs,
                "noise_shape": torch.tensor(noise.shape),
            }
        derivatives = loop.objective.derivatives(state.kernel_representer_weights)
        return {
            "weights": state.representer_weights,
            "kernel_weights": state.kernel_representer_weights,
            "mode": loop.objective.latent_of(state.kernel_representer_weights).reshape(-1),
            "gradient": derivatives.gradient.reshape(-1),
            "noise_diagonal": derivatives.noise_inverse.diagonal(),
            "noise_shape": torch.tensor(derivatives.noise_inverse.shape),
        }


def sharded_vectors(kind: str) -> dict:
    """A fit with ``shard_state=True``: the shapes of ``a`` and ``K a`` this rank holds after every Newton step or EP
    sweep (and of EP's sites), the loop's vectors at the end (:func:`loop_vectors`), and the state_dict after
    :data:`STEP_OF_SAVE` steps (gathered) for the test to resume in one process."""
    built = model(kind, sharded=True, shard_state=True)
    shapes: list = []
    saved = {}

    def held(state) -> list[tuple[int, ...]]:
        names = ["representer_weights", "kernel_representer_weights", "site_precision", "site_natural_mean"]
        return [tuple(getattr(state, name).shape) for name in names if hasattr(state, name)]

    def record(step, state):
        shapes.append(held(state))
        if step.step == STEP_OF_SAVE:
            saved["state_dict"] = state_dict_bytes(built)

    fit(built, kind, FIT_STEPS[kind], callback=record)
    shapes.append(held(built.variational_strategy.state))
    report = built.variational_strategy.last_report
    # the solver's products, the ShardedKernel's calls less those of the preconditioner's factor (kernel columns)
    products = (report.kernel_products, built.covar_module.products - report.preconditioner_products)
    final = loop_vectors(built)
    out = {"shapes": shapes, "final": final, "saved": saved["state_dict"], "summary": summary(built, kind)}
    return {**out, "products": products}


def with_covariance_phase(built: IterNCGPModel) -> IterNCGPModel:
    """``built`` with :data:`COVARIANCE_PHASE` blocks of the covariance phase at the end of each fit (EP: and one
    block for the marginals after every sweep, :data:`MARGINAL_REFRESH`)."""
    options = built.variational_strategy.options
    for name, value in COVARIANCE_PHASE.items():
        setattr(options, name, value)
    if hasattr(options, "marginal_iterations"):
        for name, value in MARGINAL_REFRESH.items():
            setattr(options, name, value)
    return built


def sharded_covariance_phase(kind: str) -> dict:
    """A fit with state sharding and a covariance phase (on this rank's rows of Q, K Q): the posterior, the shapes of
    S, K S, Q, K Q at the end, and the products and bytes of one prediction at the test inputs (an all_reduce)."""
    built = with_covariance_phase(model(kind, sharded=True, shard_state=True))
    fit(built, kind, FIT_STEPS[kind])
    kernel = built.covar_module
    before = (kernel.products, kernel.bytes_sent)
    with torch.no_grad():
        built.variational_strategy.marginal_latent(data(kind)[2])
    counted = (kernel.products - before[0], kernel.bytes_sent - before[1])
    return {"summary": summary(built, kind), "shapes": shapes_of(built.variational_strategy.state), "counted": counted}


def covariance_phase_rows(rank: int) -> dict[str, torch.Tensor]:
    """The covariance phase run directly on this rank's rows (:func:`covariance_phase_data`, 101 points x 3 latents
    over the ranks): the rows of the enlarged Q and K Q it returns, and the number of columns added."""
    from gpytorch_iterncgp.core.covariance import covariance_phase
    from gpytorch_iterncgp.core.noise import BlockNoiseInverse
    from gpytorch_iterncgp.core.sharding import ShardedRowBlock

    kernel, noise, root, kernel_root, project = covariance_phase_data()
    block = ShardedRowBlock.of_rank(101, 3, None)
    noise = BlockNoiseInverse(block.own_points(noise.curvature_cholesky))  # this rank's blocks of W^{-1}
    phase = covariance_phase(
        lambda vectors: kernel @ vectors, noise, block.local(root), block.local(kernel_root), 3, 3, 9,
        project=project, action_space_dimension=202, seed=5, rows_block=block,
    )  # fmt: skip
    return {"root": phase.precision_root, "kernel_root": phase.kernel_precision_root, "added": phase.added}


def covariance_phase_data() -> tuple:
    """A kernel ``(303, 303)`` (RBF of 101 points, shared by 3 latents, plus a small ridge), block noise, and the
    Q, K Q of one block of the covariance phase from nothing (in one process), zero-sum actions: the start of
    :func:`covariance_phase_rows`."""
    from gpytorch_iterncgp.core.covariance import covariance_phase
    from gpytorch_iterncgp.core.noise import BlockNoiseInverse, project_to_zero_sum
    from gpytorch_iterncgp.core.sharding import RowBlock

    _, _, cholesky = buffer_data()
    x = torch.rand(101, 2, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    points = gpytorch.kernels.RBFKernel().double()
    points.lengthscale = 0.3
    with torch.no_grad():
        kernel = torch.kron(points(x).to_dense(), torch.eye(3, dtype=torch.float64))
    noise = BlockNoiseInverse(cholesky)
    project = lambda vectors: project_to_zero_sum(vectors, 3)  # noqa: E731
    empty = torch.zeros(303, 0, dtype=torch.float64)
    first = covariance_phase(
        lambda v: kernel @ v, noise, empty, empty, 3, 1, 9, project=project, seed=4, rows_block=RowBlock.single(101, 3)
    )
    return kernel, noise, first.precision_root, first.kernel_precision_root, project


def mismatch(rank: int) -> str | None:
    """Rank 1 has other training inputs than rank 0: the first product fails on both, naming the fix."""
    built = model("ep", sharded=True)
    if rank == 1:
        built.variational_strategy.train_inputs = built.variational_strategy.train_inputs + 1e-3
    try:
        fit(built, "ep", 1)
    except ValueError as error:
        return str(error)
    return None


def operator_prior_refused() -> str | None:
    """A linear model of coregionalisation built in ``forward`` (a sum of Kronecker products of a batch kernel's
    entries, :class:`~tests.common.LMCIterNCGPModel`) with that batch kernel wrapped, ``shard_state=True``, CG: its
    products are not split by rows, and the fit refuses it (the error's text), before any product; ``None`` if it
    fits (every rank then holds and computes all rows)."""
    x, y, _ = data("missing")
    mixing = torch.tensor([[1.0, 0.2], [-0.5, 0.7], [0.3, 0.4]], dtype=torch.float64)  # H, (C, Q)
    likelihood = MultitaskPoissonLikelihood(num_tasks=NUM_CLASSES)
    built = LMCIterNCGPModel(x, y, likelihood, mixing, [0.2, 0.5], **SOLVER)
    built.latent_covar_module = ShardedKernel(built.latent_covar_module, shard_state=True)
    try:
        fit(built, "missing", 1)
    except ValueError as error:
        return f"{error} ({built.latent_covar_module.products} products)"
    return None


def fault(rank: int, directory: Path) -> dict:
    """Rank 1 raises in its second Newton step and stays alive without taking part; rank 0 must fail within the
    group's timeout and keep its last committed state (saved for the test to resume in one process)."""
    group = dist.new_group(backend="gloo", timeout=FAULT_TIMEOUT)
    built = model("laplace", sharded=True, process_group=group)
    flag = directory / "rank0_failed"

    def raise_on_rank_one(step, state):
        if rank == 1 and step.step == STEP_OF_SAVE:
            raise KeyboardInterrupt  # as an OOM, a NaN check or Ctrl-C on one rank

    started = time.monotonic()
    outcome: dict = {}
    try:
        fit(built, "laplace", FIT_STEPS["laplace"], callback=raise_on_rank_one)
        outcome["error"] = None
    except BaseException as error:  # noqa: BLE001  # recorded for the test
        outcome["error"] = f"{type(error).__name__}: {error}"
    outcome["seconds"] = time.monotonic() - started
    outcome["newton_steps"] = built.variational_strategy.state.newton_steps
    outcome["saved"] = state_dict_bytes(built)
    if rank == 0:
        flag.touch()
    else:  # the failed rank stays alive, taking no part, until rank 0 has given up (at most a minute)
        deadline = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    return outcome


def worker(rank: int, world_size: int, port: int, directory: str, layouts: bool = False) -> None:
    """One process: join the gloo group on localhost, run the scenarios (:func:`run`), save the results (or the
    error)."""
    torch.set_num_threads(1)
    path = Path(directory)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )
        results = run(rank, path, layouts)
    except BaseException:  # noqa: BLE001  # reported to the test
        results = {"worker_error": traceback.format_exc()}
    torch.save(results, path / f"rank{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()
