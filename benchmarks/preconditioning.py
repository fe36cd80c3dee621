r"""Preconditioned IterGP at learnt-scale kernels: products with K to converge, with and without the preconditioner.

IterGP's CG actions are the preconditioned residuals :math:`\mathbf M^{-1} \mathbf r` with :math:`\mathbf M = \mathbf L
\mathbf L^\top + \mathbf W^{-1}` (``core/preconditioner.py``): :math:`\mathbf L` ``(N C, r)`` a partial pivoted
Cholesky factor of the kernel (:math:`k = \lceil r / C \rceil` pivots of the one kernel the classes share, so
``preconditioner_rank`` 100 is 100 pivots for a binary problem and 10 for 10 classes), applied by Woodbury. Rank 0 is
plain CG. The systems :math:`(\mathbf K + \mathbf W^{-1}) \mathbf v = \mathbf b` (``(N C, N C)``) are hardest where the
kernel is large against the noise: a large outputscale :math:`s^2` (:math:`\lambda_{\max}(\mathbf K) \approx s^2 N`
times a fraction) and a long lengthscale :math:`\ell` (fewer, larger eigenvalues) — the scales that learning tends to
give (the issue's learnt kernel: :math:`s^2 = 20.8`, :math:`\ell = 0.58`).

**Problems** (the paper's Gaussian mixture in 3-D, ``gpytorch_iterncgp.datasets.gaussian_mixture``, mixture and
sample seed 0; binary: the mixture of 2 classes, labels in {0, 1}): Laplace softmax (10 classes,
``SoftmaxLikelihood``), Laplace binary (logistic, ``LogitBernoulliLikelihood``), EP binary (probit,
``BernoulliLikelihood``), EP multi-class (10 classes, ``MultinomialProbitLikelihood``). One fixed Matérn-5/2 kernel
:math:`s^2 k_{5/2}(\cdot, \cdot; \ell)` shared by the classes, zero mean, float64.

For each problem, size :math:`N`, kernel :math:`(s^2, \ell)` and rank :math:`r`, two measurements. :math:`\mathbf K`
is evaluated and cached once per configuration, before any fit (all models of a configuration share the one covariance
object), so no fit's time holds its evaluation.

(a) **the whole fit**: ``strategy.fit(preconditioner_rank=r)`` with the strategy's defaults (CG, 5 products with
    :math:`\mathbf K` per Newton step / EP sweep, recycling all actions, ``outer_tol`` 1e-2 / ``site_tol`` 1e-4) except
    the step limit, raised to ``--laplace-steps`` Newton steps or ``--ep-sweeps`` EP sweeps, and a wall-time cap
    ``--fit-seconds`` (a callback that stops the fit). Recorded: the outer steps, the products with :math:`\mathbf K`
    by the solver (``solver_iterations``; the factor's :math:`\lceil r / C \rceil` pivot steps, each one kernel column
    per class, :math:`O(N D)`, are ``pivot_steps`` and not products), whether it converged, the wall time (and the
    preconditioner's share of it, ``preconditioner_seconds``), the trace (products, seconds and :math:`\Psi` or EP's
    counts after every step), and the final log posterior :math:`\Psi` (Laplace) or the bounded cavities of the last
    sweep and of all sweeps and the last site change (EP; a bounded cavity is a cavity precision raised to the prior's
    because the computation-aware marginal variance was too wide, and keeps EP from reporting convergence).

    Laplace also: the default stop (relative change of :math:`\mathbf a` below 1e-2) can be far from the mode in
    :math:`\Psi`, so each fit is continued from its state at ``outer_tol`` 1e-6 (same budget per step, same caps), the
    rank-100 fit is then refined to the mode (solves to ``rel_tol`` 1e-8, ``outer_tol`` 1e-8), and the row gives
    :math:`\Psi^* - \Psi` at the default stop and the products (and seconds) after which the fit's :math:`\Psi` was
    first within :data:`PSI_GAP` = 0.01 of :math:`\Psi^*`.
(b) **one solve of the final system** to relative residual ``--solve-rtol`` (1e-6), the same system for every rank:
    Laplace, the Newton system at the refined mode, :math:`(\mathbf K + \mathbf W^{-1}) \mathbf v = \mathbf K \mathbf a
    + \mathbf W^{-1} \mathbf g`; EP, the regression of the rank-100 fit's final sites, :math:`(\mathbf K +
    \tilde{\mathbf T}^{-1}) \mathbf v = \tilde{\boldsymbol\mu} - \mathbf m`. Solved by ``itergp_solve`` directly as the
    loop's first solve of a fit at rank :math:`r` runs it: no recycled actions but those the loop's preconditioning
    seeds the buffer with (unit vectors at the pivots, whose products with :math:`\mathbf K` are kernel columns, no
    product), the strategy's CG policy and projection, at most ``--solve-cap`` products, ``abs_tol`` 0; inside the
    package's ``small_operations`` as the loops run. Recorded: products with :math:`\mathbf K`, the relative residual
    reached (``reached``: to the tolerance), the seconds (building the factor included, and also given alone).

Each configuration runs its ranks one after the other in one process, in alternating order (0 first, then the largest
rank first on the next configuration), so that a neighbour's load falls on both sides alike. The ratios (rank 0 / rank
100) of the fit's products and seconds (to convergence and, Laplace, to :math:`\Psi^*` − 0.01) and of the solve's are in
each row of rank 100. ``torch.set_num_threads(--threads)`` (2); the package runs a loop's small operations on one
thread and its products with :math:`\mathbf K` on these. Writes ``results/preconditioning.json`` (rows; per run the
arguments, the machine and threads, the package's commit and a hash of its working tree) after every configuration,
and ``results/preconditioning.png``; ``--table`` prints the README's tables from the JSON.

    python -m benchmarks.preconditioning --problems laplace_binary ep_binary --fit-seconds 90 --solve-cap 1000
    python -m benchmarks.preconditioning --sizes 20000 --problems laplace_binary ep_binary --scales 5 20 \
        --lengthscales 1.0 --extra-kernels --fit-seconds 90 --solve-cap 300 --append
    python -m benchmarks.preconditioning --table
    python -m benchmarks.preconditioning --smoke --out /tmp/p                # N = 100, seconds

(``benchmarks/README.md``, section 21, lists the runs behind ``results/preconditioning.json``.)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path

if not __package__:  # run as a file, not with -m: the package imports below need the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpytorch
import torch

from benchmarks.common import add_smoke_flag, machine, peak_rss_bytes
from gpytorch_iterncgp import EPStrategy, IterNCGPStrategy, LogitBernoulliLikelihood, MultinomialProbitLikelihood
from gpytorch_iterncgp.core.recycling import ActionBuffer
from gpytorch_iterncgp.core.solver import itergp_solve
from gpytorch_iterncgp.core.threads import small_operations
from gpytorch_iterncgp.datasets import gaussian_mixture

RESULTS = Path(__file__).parent / "results"
# name -> (outer loop, classes)
PROBLEMS = {
    "laplace_softmax": ("laplace", 10),
    "laplace_binary": ("laplace", 2),
    "ep_binary": ("ep", 2),
    "ep_multiclass": ("ep", 10),
}
PSI_GAP = 0.01  # Laplace: a fit "reaches the mode" once its log posterior is within this of the refined mode's
REFERENCE_RANK = 100  # the default preconditioner_rank: its fit gives the final system of (b), its row the ratios


class Model(gpytorch.models.ApproximateGP):
    r"""Zero mean and a fixed :math:`s^2 k_{5/2}(\cdot, \cdot; \ell)` (one kernel, shared by the classes).

    ``covariance``: the kernel's (lazily evaluated) covariance at the training inputs, returned by :meth:`forward` there
    instead of a new one, so that the models of one configuration evaluate and cache :math:`\mathbf K` once (GPyTorch
    caches the evaluation on the object; a new object would evaluate it again in every fit: 45 s at N = 2·10⁴)."""

    def __init__(
        self, train_x, train_y, likelihood, strategy_class, outputscale, lengthscale, covariance=None, **options
    ):
        super().__init__(strategy_class(self, train_x, train_y, likelihood, show_progress=False, **options))
        self.train_x, self.covariance = train_x, covariance
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5))
        self.to(train_x.dtype)
        self.covar_module.outputscale = outputscale
        self.covar_module.base_kernel.lengthscale = lengthscale
        self.requires_grad_(False)

    def forward(self, x):
        same = self.covariance is not None and x.shape == self.train_x.shape and bool(torch.equal(x, self.train_x))
        covariance = self.covariance if same else self.covar_module(x)
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), covariance)


def data(num_train: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixture's training set ``(N, 3)``, labels ``(N,)`` (floats in {0, 1} for 2 classes), float64."""
    train_x, train_y, _, _ = gaussian_mixture(num_train, classes, num_classes=classes, dim=3, dtype=torch.float64)
    return train_x, train_y.double() if classes == 2 else train_y


def make_model(
    problem: str, train_x, train_y, outputscale: float, lengthscale: float, covariance=None, **options
) -> Model:
    """The problem's model (its likelihood and strategy) at a fixed kernel, strategy ``options`` passed on."""
    method, classes = PROBLEMS[problem]
    if method == "laplace":
        strategy = IterNCGPStrategy
        likelihood = (
            LogitBernoulliLikelihood()
            if classes == 2
            else gpytorch.likelihoods.SoftmaxLikelihood(num_classes=classes, mixing_weights=False)
        )
    else:
        strategy = EPStrategy
        likelihood = (
            gpytorch.likelihoods.BernoulliLikelihood() if classes == 2 else MultinomialProbitLikelihood(classes)
        )
    return Model(train_x, train_y, likelihood, strategy, outputscale, lengthscale, covariance, **options)


def run_fit(model: Model, rank: int, max_steps: int, seconds: float, trace: list | None = None, **options) -> dict:
    r"""Measurement (a): the whole fit at ``preconditioner_rank=rank`` within ``max_steps`` outer steps and about
    ``seconds`` of wall time (checked after each step), with its trace: after each step the solver's products so far,
    the seconds so far, and Laplace's :math:`\Psi` or EP's bounded cavities and site change. A ``trace`` passed in is
    continued (a fit continued from the model's state; ``options`` are the fit's overrides)."""
    strategy = model.variational_strategy
    start = time.perf_counter()
    stopped = {"by_time": False}
    trace = [] if trace is None else trace
    products0, seconds0 = (trace[-1][0], trace[-1][1]) if trace else (0, 0.0)

    def time_cap(record, state) -> bool:
        elapsed = time.perf_counter() - start
        products = (trace[-1][0] if trace else 0) + record.solver_iterations
        if hasattr(record, "log_posterior"):
            trace.append([products, seconds0 + elapsed, record.log_posterior])
        else:
            trace.append([products, seconds0 + elapsed, record.bounded_cavities, record.site_change])
        stopped["by_time"] = elapsed > seconds
        return stopped["by_time"]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # step limits and breakdowns show in the row
        report = strategy.fit(
            callback=time_cap, preconditioner_rank=rank, **{strategy.max_steps_option: max_steps}, **options
        )
    row = dict(
        steps=report.steps,
        solver_iterations=report.solver_iterations,
        kernel_products=report.kernel_products,
        converged=report.converged,
        stopped_by_time=stopped["by_time"],
        breakdown=report.breakdown,
        seconds=report.wall_time,
        kernel_product_seconds=report.kernel_product_seconds,
        preconditioner_seconds=getattr(report, "preconditioner_seconds", float("nan")),
        trace=trace,
    )
    assert not trace or trace[-1][0] == products0 + report.solver_iterations
    if report.method == "Laplace":
        row["log_posterior"] = report.log_posteriors[-1] if report.log_posteriors else float("nan")
    else:
        last = report.records[-1] if report.records else None
        row["bounded_cavities_last"] = last.bounded_cavities if last else 0
        row["bounded_cavities_total"] = report.bounded_cavities
        row["skipped_sites_total"] = report.skipped_sites
        row["site_change_last"] = last.site_change if last else float("nan")
    return row


def refine_mode(strategy, cap: int, seconds: float) -> tuple[float, bool]:
    r"""Laplace: continue ``strategy``'s fit towards the mode (each solve to ``rel_tol`` 1e-8, at most ``cap`` products;
    ``outer_tol`` 1e-8; about ``seconds`` of wall time) and return :math:`\Psi^*` there and whether it converged; the
    fit's own recycled actions make this cheap."""
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = strategy.fit(
            callback=lambda record, state: time.perf_counter() - start > seconds,
            max_newton_steps=30,
            max_solver_iterations=cap,
            rel_tol=1e-8,
            abs_tol=0.0,
            outer_tol=1e-8,
        )
    return strategy.state.log_posterior, report.converged


def to_reach(fit: dict, target: float) -> tuple[int | None, float | None]:
    r"""The solver's products and the seconds after the first step of ``fit`` (its trace, the default fit's steps then
    the continuation's) whose :math:`\Psi` reaches ``target`` (``None``: none did). A step of the continuation is timed
    less the continuation's preconditioner build, which one fit at ``outer_tol`` 1e-6 would not repeat."""
    for index, (products, seconds, psi) in enumerate(fit["trace"]):
        if psi >= target:
            if index >= fit["steps"]:
                seconds -= fit.get("continued", {}).get("preconditioner_seconds", 0.0)
            return int(products), seconds
    return None, None


def derive(rows: list[dict]) -> list[dict]:
    r"""Each row's derived numbers from its measurements (in place): Laplace's :math:`\Psi^* - \Psi` at the default stop
    and products and seconds to :math:`\Psi^*` − :data:`PSI_GAP` (else the products and seconds of the whole trace, a
    lower bound), and in the rows of :data:`REFERENCE_RANK` the ratios rank 0 / rank 100."""
    by_key = {_key(row): row for row in rows}
    for row in rows:
        fit = row["fit"]
        if row["method"] == "laplace":
            fit["psi_gap"] = row["mode_log_posterior"] - fit["log_posterior"]
            fit["products_to_gap"], fit["seconds_to_gap"] = to_reach(fit, row["mode_log_posterior"] - PSI_GAP)
            fit["trace_products"], fit["trace_seconds"] = fit["trace"][-1][:2] if fit["trace"] else (0, 0.0)
    for row in rows:
        zero = by_key.get(_key(row)[:4] + (0,))
        if row["rank"] != REFERENCE_RANK or zero is None:
            continue
        fits, solves = (zero["fit"], row["fit"]), (zero["solve"], row["solve"])
        row["ratios"] = dict(
            fit_products=_ratio(fits[0]["solver_iterations"], fits[1]["solver_iterations"]),
            fit_seconds=_ratio(fits[0]["seconds"], fits[1]["seconds"]),
            solve_products=_ratio(solves[0]["products"], solves[1]["products"]),
            solve_seconds=_ratio(solves[0]["seconds"], solves[1]["seconds"]),
        )
        if row["method"] == "laplace":  # (rank 0 short of the mode: its whole trace, a lower bound of the ratio)
            row["ratios"].update(
                fit_products_to_gap=_ratio(
                    fits[0]["products_to_gap"] or fits[0]["trace_products"], fits[1]["products_to_gap"] or math.nan
                ),
                fit_seconds_to_gap=_ratio(
                    fits[0]["seconds_to_gap"] or fits[0]["trace_seconds"], fits[1]["seconds_to_gap"] or math.nan
                ),
            )
    return rows


def final_system(strategy) -> dict:
    r"""The system of ``strategy``'s fitted state: ``noise`` (:math:`\mathbf W^{-1}` or :math:`\tilde{\mathbf T}^{-1}`)
    and ``rhs`` ``(N C,)``, with the ``strategy`` and the ``prior`` (:math:`\mathbf K` evaluated and cached here, so
    that no solve pays for it)."""
    prior = strategy._prior_for_fit()
    loop = strategy._make_loop(prior, strategy.options)
    state = strategy.state
    if isinstance(strategy, EPStrategy):
        noise, rhs = loop.noise(state.site_precision, state.site_natural_mean, loop.rows_block)
    else:
        derivatives = loop.objective.derivatives(state.kernel_representer_weights)
        noise = derivatives.noise_inverse
        rhs = state.kernel_representer_weights + noise.matmul(derivatives.gradient.reshape(-1, 1))[:, 0]
    loop.kernel_matmul(torch.zeros_like(rhs)[:, None])
    return dict(strategy=strategy, prior=prior, noise=noise, rhs=rhs)


def solve_once(system: dict, rank: int, rel_tol: float, cap: int):
    """Measurement (b): one IterGP solve of ``system`` to ``rel_tol`` (at most ``cap`` products with K) as the outer
    loop's first solve of a fit at ``preconditioner_rank=rank`` makes it: no recycled actions but those the loop's
    preconditioning seeds the buffer with (the pivots' unit vectors, no product), the strategy's policy, the loop's
    projection, ``abs_tol = 0``. Returns the row and the solver's result."""
    strategy, noise, rhs = system["strategy"], system["noise"], system["rhs"]
    with strategy.overriding(preconditioner_rank=rank) as options:
        loop = strategy._make_loop(system["prior"], options)
    preconditioning = loop.preconditioning
    adapter = strategy.adapter
    project = getattr(loop, "project", adapter.project if adapter.zero_sum_actions else None)
    loop.policy.reset()
    # as the outer loops run their solves: small operations on one thread, products with K on the caller's threads
    with small_operations(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        buffer = ActionBuffer.empty(loop.rows_block, rhs.dtype, rhs.device)
        if hasattr(preconditioning, "seeded"):
            buffer = preconditioning.seeded(buffer)
        seeded = buffer.size
        preconditioner = preconditioning.for_noise(noise)
        factor_seconds = time.perf_counter() - start
        result = itergp_solve(
            loop.kernel_matmul,
            noise,
            rhs,
            buffer,
            loop.policy,
            project=project,
            max_solver_iterations=cap,
            abs_tol=0.0,
            rel_tol=rel_tol,
            action_space_dimension=loop.action_space_dimension,
            kernel_columns=loop.kernel_columns,
            preconditioner=preconditioner,
        )
        seconds = time.perf_counter() - start
    projected = rhs if project is None else project(rhs[:, None])[:, 0]
    factor = preconditioning.factor
    row = dict(
        products=result.iterations,
        relative_residual=result.residual_norm / float(projected.norm()),
        reached=result.converged,
        breakdown=result.breakdown,
        seconds=seconds,
        factor_seconds=factor_seconds,
        pivot_steps=0 if factor is None else int(factor.columns.shape[-1]),
        seeded_actions=seeded,
    )
    return row, result


def run_configuration(problem, num_train, outputscale, lengthscale, ranks, args, reverse: bool) -> list[dict]:
    """Measurements (a) and (b) for every rank of one (problem, N, kernel), the ranks in (alternating) order."""
    method, classes = PROBLEMS[problem]
    train_x, train_y = data(num_train, classes)
    max_steps = args.laplace_steps if method == "laplace" else args.ep_sweeps
    order = sorted(ranks, reverse=reverse)
    fits, models = {}, {}
    first = make_model(problem, train_x, train_y, outputscale, lengthscale)
    with torch.no_grad():  # K evaluated and cached before any fit, for all of them
        covariance = first.covar_module(train_x)
        prior = first.variational_strategy.train_prior()
    first.covariance = covariance
    prior.matmul(torch.zeros(prior.mean.numel(), 1, dtype=train_x.dtype))
    del first, prior
    for rank in order:
        models[rank] = make_model(problem, train_x, train_y, outputscale, lengthscale, covariance)
        fits[rank] = run_fit(models[rank], rank, max_steps, args.fit_seconds)
    reference = REFERENCE_RANK if REFERENCE_RANK in models else max(ranks)

    mode, mode_converged = None, None
    if method == "laplace":
        # the default stop (outer_tol 1e-2) can be far from the mode: each fit continued at outer_tol 1e-6 (the same
        # budget per step) and the products counted until its log posterior is within PSI_GAP of the mode's
        for rank in order[::-1]:
            fits[rank]["continued"] = run_fit(
                models[rank], rank, max_steps, args.fit_seconds, trace=fits[rank]["trace"], outer_tol=1e-6
            )
            del fits[rank]["continued"]["trace"]  # (the same list as the fit's)
        mode, mode_converged = refine_mode(models[reference].variational_strategy, args.solve_cap, args.fit_seconds)
    system = final_system(models[reference].variational_strategy)
    solves = {}
    for rank in order:
        solves[rank], _ = solve_once(system, rank, args.solve_rtol, args.solve_cap)
        fits[rank]["pivot_steps"] = solves[rank]["pivot_steps"]  # the same prior and rank: the same factor
    del models, system
    rows = []
    for rank in sorted(ranks):
        row = dict(
            problem=problem,
            method=method,
            classes=classes,
            num_train=num_train,
            outputscale=outputscale,
            lengthscale=lengthscale,
            rank=rank,
            fit=fits[rank],
            solve=solves[rank],
            system_from_rank=reference,
            mode_log_posterior=mode,
            mode_converged=mode_converged,
        )
        rows.append(row)
    return derive(rows)


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def _describe(row: dict) -> str:
    fit, solve = row["fit"], row["solve"]
    status = "conv" if fit["converged"] else ("time" if fit["stopped_by_time"] else "cap ")
    extra = (
        f"Psi* - Psi {fit['psi_gap']:.2e} (0.01 after {fit['products_to_gap']} products, {fit['seconds_to_gap'] or float('nan'):.1f} s)"
        if row["method"] == "laplace"
        else f"bounded {fit['bounded_cavities_last']}/{fit['bounded_cavities_total']}"
    )
    return (
        f"{row['problem']:16s} N {row['num_train']:6d} s2 {row['outputscale']:5.1f} l {row['lengthscale']:4.2f} "
        f"r {row['rank']:3d} | fit {status} {fit['steps']:4d} steps {fit['solver_iterations']:5d} products "
        f"(+{fit['pivot_steps']} pivots) {fit['seconds']:7.1f} s {extra} | solve {solve['products']:5d} products "
        f"res {solve['relative_residual']:.1e} {solve['seconds']:6.1f} s"
    )


def plot(rows: list[dict], path: Path) -> None:
    """Products with K of the whole fit (top: Laplace to Ψ* − 0.01, EP to convergence) and of one solve to 1e-6
    (bottom) against s², one column per problem; colour the rank, line style N, marker ℓ; x where the fit did not
    get there (its products so far, a lower bound) or the solve stopped at its cap."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    problems = [name for name in PROBLEMS if any(row["problem"] == name for row in rows)]
    fig, axes = plt.subplots(2, len(problems), figsize=(4.2 * len(problems), 7.5), squeeze=False)
    colours = {0: "tab:red", 100: "tab:blue", 200: "tab:green", 400: "tab:purple"}

    def marker(lengthscale: float) -> str:
        return "o" if lengthscale < 0.5 else ("s" if lengthscale < 0.9 else "^")

    for column, name in enumerate(problems):
        mine = [row for row in rows if row["problem"] == name]
        for key in sorted({(row["num_train"], row["lengthscale"], row["rank"]) for row in mine}):
            num_train, lengthscale, rank = key
            line = sorted(
                (row for row in mine if (row["num_train"], row["lengthscale"], row["rank"]) == key),
                key=lambda row: row["outputscale"],
            )
            style = dict(
                color=colours.get(rank, "gray"),
                linestyle="-" if num_train <= 5000 else "--",
                marker=marker(lengthscale),
            )
            scales = [row["outputscale"] for row in line]
            if line[0]["method"] == "laplace":
                missed = [row["fit"]["products_to_gap"] is None for row in line]
                fit = [
                    row["fit"]["trace_products" if miss else "products_to_gap"]
                    for row, miss in zip(line, missed, strict=True)
                ]
            else:
                fit = [row["fit"]["solver_iterations"] for row in line]
                missed = [not row["fit"]["converged"] for row in line]
            solve = [row["solve"]["products"] for row in line]
            unsolved = [not row["solve"]["reached"] for row in line]
            for axis, values, misses in ((axes[0, column], fit, missed), (axes[1, column], solve, unsolved)):
                axis.plot(scales, values, **style)
                for scale, value, miss in zip(scales, values, misses, strict=True):
                    if miss:
                        axis.plot(scale, value, "x", color="black", markersize=9)
        axes[0, column].set_title(name)
        axes[1, column].set_xlabel("outputscale s²")
        for axis in axes[:, column]:
            axis.set_xscale("log")
            axis.set_yscale("log")
            axis.grid(alpha=0.3)
    axes[0, 0].set_ylabel("fit: products with K\n(Laplace: to Ψ* − 0.01; EP: to convergence)")
    axes[1, 0].set_ylabel("one solve to 1e-6: products with K")
    lengthscales = sorted({row["lengthscale"] for row in rows})
    sizes = sorted({row["num_train"] for row in rows})
    handles = [Line2D([], [], color=colours.get(rank, "gray"), label=f"rank {rank}") for rank in colours]
    handles += [Line2D([], [], color="gray", linestyle="-" if n <= 5000 else "--", label=f"N {n}") for n in sizes]
    handles += [
        Line2D([], [], color="gray", marker=marker(ell), linestyle="", label=f"ℓ {ell}") for ell in lengthscales
    ]
    handles += [Line2D([], [], color="black", marker="x", linestyle="", label="did not get there (lower bound)")]
    ranks = {row["rank"] for row in rows}
    handles = [
        handle
        for handle in handles
        if not handle.get_label().startswith("rank ") or int(handle.get_label()[5:]) in ranks
    ]
    axes[0, 0].legend(handles=handles, fontsize=7)
    fig.suptitle("Preconditioned IterGP (pivoted Cholesky + Woodbury) against plain CG, Matérn-5/2, mixture in 3-D")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--sizes", type=int, nargs="+", default=[5000])
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 5.0, 20.0], help="outputscales s²")
    parser.add_argument("--lengthscales", type=float, nargs="+", default=[0.3, 1.0])
    parser.add_argument("--extra-kernels", type=float, nargs="*", default=[20.8, 0.58], help="(s², ℓ) pairs")
    parser.add_argument("--ranks", type=int, nargs="+", default=[0, 100])
    parser.add_argument("--laplace-steps", type=int, default=300, help="max_newton_steps of (a)")
    parser.add_argument("--ep-sweeps", type=int, default=150, help="max_sweeps of (a)")
    parser.add_argument("--fit-seconds", type=float, default=120.0, help="wall-time cap of each fit (a)")
    parser.add_argument("--solve-rtol", type=float, default=1e-6)
    parser.add_argument("--solve-cap", type=int, default=1500, help="most products of the one solve (b)")
    parser.add_argument("--threads", type=int, default=2)
    add_smoke_flag(parser, "N = 100, two kernels, seconds")
    parser.add_argument("--append", action="store_true", help="add to the JSON's rows (same keys replaced)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--table", action="store_true", help="print the saved results' markdown tables, run nothing")
    args = parser.parse_args(argv)
    if args.table:
        saved = json.loads(
            (args.out / ("preconditioning_smoke.json" if args.smoke else "preconditioning.json")).read_text()
        )
        print(markdown_tables(derive(saved["rows"])))
        return saved
    if args.smoke:
        args.sizes, args.scales, args.lengthscales, args.extra_kernels = [100], [1.0, 20.0], [1.0], []
        args.ranks, args.laplace_steps, args.ep_sweeps, args.fit_seconds = [0, 100], 100, 100, 60.0
    torch.set_num_threads(args.threads)
    kernels = [(scale, length) for length in args.lengthscales for scale in args.scales]
    kernels += list(zip(args.extra_kernels[::2], args.extra_kernels[1::2], strict=True))
    name = "preconditioning_smoke" if args.smoke else "preconditioning"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}.json"
    rows: list[dict] = []
    runs: list[dict] = []
    if args.append and path.exists():
        saved = json.loads(path.read_text())
        rows, runs = saved["rows"], saved.get("runs", [])
    started = time.perf_counter()
    run = dict(
        args={key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
        machine=machine(),
        package=package_state(),
    )
    runs.append(run)
    configuration = 0
    output: dict = {}
    for problem in args.problems:
        for num_train in args.sizes:
            for outputscale, lengthscale in kernels:
                found = run_configuration(
                    problem, num_train, outputscale, lengthscale, args.ranks, args, reverse=configuration % 2 == 1
                )
                configuration += 1
                for row in found:
                    print(_describe(row), flush=True)
                keys = {_key(row) for row in found}
                rows = [row for row in rows if _key(row) not in keys] + found
                # saved after every configuration (a run stopped by a time limit keeps what it measured)
                run.update(seconds=time.perf_counter() - started, peak_rss_bytes=peak_rss_bytes())
                output = {"machine": run["machine"], "runs": runs, "rows": rows}
                path.write_text(json.dumps(output, indent=1, default=_json_number))
    plot(rows, path.with_suffix(".png"))
    return output


def markdown_tables(rows: list[dict]) -> str:
    """The README's tables from the rows: one for Laplace, one for EP; each cell lists the ranks' values in rank order
    (``0 / 100`` or ``0 / 100 / 400``), ratios are rank 0 over rank 100 (``>``: rank 0 did not get there, a lower
    bound); ``*`` not converged (step limit, or a solve at its cap), ``†`` stopped by the time cap."""
    groups: dict[tuple, dict[int, dict]] = {}
    for row in rows:
        groups.setdefault(_key(row)[:4], {})[row["rank"]] = row
    order = list(PROBLEMS)

    def joined(by_rank, value) -> str:
        return " / ".join(value(by_rank[rank]) for rank in sorted(by_rank))

    def number(value, digits=0) -> str:
        return "–" if value is None or value != value else f"{value:.{digits}f}"

    def ratio(by_rank, name, lower: bool = False) -> str:
        ratios = by_rank.get(REFERENCE_RANK, {}).get("ratios", {})
        value = number(ratios.get(name), 1)
        return ">" + value if lower and value != "–" else value

    def to_gap(row, name, digits) -> str:
        fit = row["fit"]
        if fit[f"{name}_to_gap"] is not None:
            return number(fit[f"{name}_to_gap"], digits)
        return ">" + number(fit[f"trace_{name}"], digits)  # not reached in the fit and its continuation

    def bounded(row) -> str:
        return f"{row['fit']['bounded_cavities_last']} ({row['fit']['bounded_cavities_total']})"

    def gap(row) -> str:
        value = row["fit"]["psi_gap"]
        return "–" if value is None else f"{value:.2g}"

    def converged(fit) -> str:
        return "" if fit["converged"] else ("†" if fit["stopped_by_time"] else "*")

    laplace = [
        "| problem | N | s² | ℓ | ranks | products to converge (ratio) | Ψ* − Ψ there | products to Ψ* − 0.01 (ratio) "
        "| s to Ψ* − 0.01 (ratio) | one solve: products (ratio) | one solve: s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ep = [
        "| problem | N | s² | ℓ | ranks | sweeps | products (ratio) | s (ratio) | bounded cavities, last sweep (all sweeps) "
        "| site change, last sweep | one solve: products (ratio) | one solve: s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key in sorted(groups, key=lambda key: (order.index(key[0]), key[1], key[3], key[2])):
        by_rank = groups[key]
        problem, num_train, scale, length = key
        head = f"| {problem} | {num_train} | {scale:g} | {length:g} | {joined(by_rank, lambda row: str(row['rank']))} "
        zero = by_rank.get(0)
        short = zero is not None and zero["method"] == "laplace" and zero["fit"]["products_to_gap"] is None
        reference = by_rank.get(REFERENCE_RANK)
        # rank 0 stopped unconverged where rank 100 converged: its products and seconds are a lower bound
        unfinished = zero is not None and reference is not None
        unfinished = unfinished and not zero["fit"]["converged"] and reference["fit"]["converged"]
        solve = (
            f"| {joined(by_rank, lambda row: str(row['solve']['products']) + ('' if row['solve']['reached'] else '*'))}"
            f" ({ratio(by_rank, 'solve_products', zero is not None and not zero['solve']['reached'])}) "
            f"| {joined(by_rank, lambda row: number(row['solve']['seconds'], 1))} |"
        )
        if by_rank[min(by_rank)]["method"] == "laplace":
            laplace.append(
                head + f"| {joined(by_rank, lambda row: str(row['fit']['solver_iterations']) + converged(row['fit']))} "
                f"({ratio(by_rank, 'fit_products', unfinished)}) "
                f"| {joined(by_rank, gap)} "
                f"| {joined(by_rank, lambda row: to_gap(row, 'products', 0))} "
                f"({ratio(by_rank, 'fit_products_to_gap', short)}) "
                f"| {joined(by_rank, lambda row: to_gap(row, 'seconds', 1))} "
                f"({ratio(by_rank, 'fit_seconds_to_gap', short)}) " + solve
            )
        else:
            ep.append(
                head + f"| {joined(by_rank, lambda row: str(row['fit']['steps']) + converged(row['fit']))} "
                f"| {joined(by_rank, lambda row: str(row['fit']['solver_iterations']))} "
                f"({ratio(by_rank, 'fit_products', unfinished)}) "
                f"| {joined(by_rank, lambda row: number(row['fit']['seconds'], 1))} "
                f"({ratio(by_rank, 'fit_seconds', unfinished)}) "
                f"| {joined(by_rank, bounded)} "
                f"| {joined(by_rank, lambda row: format(row['fit']['site_change_last'], '.1e'))} " + solve
            )
    return "\n".join(laplace) + "\n\n" + "\n".join(ep) + "\n"


def package_state() -> dict:
    """The commit and the hash of the package's working tree (the preconditioner is changing under uncommitted work)."""
    import hashlib
    import subprocess

    root = Path(__file__).resolve().parents[1]
    package = root / "gpytorch_iterncgp"
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.read_bytes())
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "gpytorch_iterncgp"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", []
    return dict(commit=commit, changed=[line[3:] for line in dirty if line], sha256=digest.hexdigest()[:16])


def _key(row: dict) -> tuple:
    return (row["problem"], row["num_train"], row["outputscale"], row["lengthscale"], row["rank"])


def _json_number(value):
    return float(value) if isinstance(value, torch.Tensor) else str(value)


if __name__ == "__main__":
    main()
