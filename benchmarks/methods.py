r"""The methods the benchmark suite compares, each on a :class:`~benchmarks.data.Data` problem with a fixed Matérn-3/2
kernel (its ``lengthscale`` and ``outputscale``).

Every method reports a *history*: after each of its natural units of work (a Newton step, a number of Adam
steps, a subset size) the test accuracy, NLL and ECE, stamped with the method's own wall time so far (the
evaluations themselves are not counted). All methods turn latent marginals (mean, variance) into class
probabilities with one rule, :math:`\mathbb E[\operatorname{softmax}(\mathbf f)]` under independent marginals (a
diagonal covariance; ``SoftmaxAdapter.predictive_mean``), so the comparison is between posteriors, not between
predictive rules. (``results/suite.json`` was measured with the earlier rule, the probit approximation
:math:`\operatorname{softmax}(\mu / \sqrt{1 + \pi \sigma^2 / 8})`.)

* :func:`run_iterncgp`: IterNCGP (CG or unit-vector actions, recycling, compression rank R), its time in
  products with K and everything else, and the size of its buffers.
* :func:`run_ep`: multi-class EP (multinomial probit, :math:`C \times C` sites, nested EP), with the package's
  predictive for that likelihood (nested EP's normaliser under each point's :math:`C \times C` covariance).
* :func:`run_svgp`: the SVGP baseline (:class:`benchmarks.svgp.SVGPModel`: learnt inducing locations, one set of
  U / C per class, Adam, mini-batches) with the fixed kernel, for a wall-clock budget.
* :func:`run_sod_laplace`: exact Laplace (Rasmussen & Williams, Algorithms 3.3 and 3.4, damped) on a random
  subset of the training data; with the whole training set it is the exact (dense) Laplace approximation.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field

import gpytorch
import torch
from torch import Tensor
from torchmetrics.classification import MulticlassCalibrationError

from benchmarks.common import peak_rss_bytes, reset_peak_rss, rss_bytes
from benchmarks.data import Data
from benchmarks.loops import minibatch_steps
from benchmarks.scoring import log_loss
from benchmarks.svgp import SVGPModel, svgp_marginals
from gpytorch_iterncgp import IterNCGPStrategy
from gpytorch_iterncgp.likelihoods.adapters import likelihood_adapter
from gpytorch_iterncgp.settings import dense_kernel_limit


def fixed_kernel(problem: Data, keops: bool = False) -> gpytorch.kernels.ScaleKernel:
    """Matérn-3/2 with the problem's lengthscale and outputscale, not trained (GPyTorch's or its KeOps version)."""
    base = gpytorch.kernels.keops.MaternKernel(nu=1.5) if keops else gpytorch.kernels.MaternKernel(nu=1.5)
    kernel = gpytorch.kernels.ScaleKernel(base).to(problem.train_x)  # first, so the values are not rounded
    kernel.base_kernel.lengthscale = problem.lengthscale
    kernel.outputscale = problem.outputscale
    return kernel.requires_grad_(False)


def softmax_likelihood(num_classes: int) -> gpytorch.likelihoods.SoftmaxLikelihood:
    return gpytorch.likelihoods.SoftmaxLikelihood(num_classes=num_classes, mixing_weights=False)


def class_probabilities(mean: Tensor, variance: Tensor, num_classes: int) -> Tensor:
    r""":math:`\mathbb E[\operatorname{softmax}(\mathbf f)]` under independent marginals, ``(N*, C)``."""
    return likelihood_adapter(softmax_likelihood(num_classes)).predictive_mean(mean, variance)


def classification_metrics(probabilities: Tensor, labels: Tensor, num_classes: int) -> dict[str, float]:
    """Accuracy, mean negative log predictive probability, and ECE (torchmetrics, 15 bins, L1)."""
    ece = MulticlassCalibrationError(num_classes=num_classes, n_bins=15, norm="l1")
    scores = log_loss(probabilities, labels)
    return {"accuracy": scores["accuracy"], "nll": scores["nll"], "ece": float(ece(probabilities.float(), labels))}


@dataclass
class Recorder:
    """History of test metrics against the method's own wall time, excluding the evaluations.

    ``peak_rss`` is the largest resident memory seen during the method's work: it is read before each
    evaluation and the count is restarted after it, so the evaluations' own memory is not charged.
    ``baseline_rss`` is the resident memory when the recorder was made (interpreter, libraries, data).
    """

    problem: Data
    start: float = field(default_factory=time.perf_counter)
    baseline_rss: int = field(default_factory=rss_bytes)
    evaluation_seconds: float = 0.0
    peak_rss: int = 0
    history: list[dict] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start - self.evaluation_seconds

    def record(self, marginals, likelihood=None, **extra) -> dict:
        """Evaluate ``marginals()`` (a callable giving the test latent mean and variance) and log the metrics.

        ``likelihood``: the adapter whose ``predictive_mean`` maps the marginals to class probabilities (and whose
        probabilities at the mean are the plug-in); default the softmax, under independent marginals.
        """
        now = self.elapsed()
        self.peak_rss = max(self.peak_rss, peak_rss_bytes())
        tic = time.perf_counter()
        num_classes, labels = self.problem.num_classes, self.problem.test_y
        with torch.no_grad():
            mean, variance = marginals()
            if likelihood is None:
                probabilities = class_probabilities(mean, variance, num_classes)
                plug_in = classification_metrics(torch.softmax(mean, dim=-1), labels, num_classes)
            else:
                probabilities = likelihood.predictive_mean(mean, variance)
                at_mean = likelihood.likelihood(mean).probs
                plug_in = classification_metrics(at_mean, labels, num_classes)
        entry = {"time": now, **classification_metrics(probabilities, labels, num_classes)}
        # softmax of the latent mean alone (the variance ignored): separates the quality of the posterior mean
        # from the calibration its variance brings.
        entry.update({f"plug_in_{name}": value for name, value in plug_in.items()}, **extra)
        self.history.append(entry)
        self.evaluation_seconds += time.perf_counter() - tic
        reset_peak_rss()
        return entry


# -- IterNCGP ------------------------------------------------------------------------------------------------
def _evaluation_steps(limit: int = 10_000) -> frozenset[int]:
    """Newton steps after which the test set is evaluated: 1-6, then about 20% apart (and the final state)."""
    steps, step = set(range(1, 7)), 6
    while step < limit:
        step = math.ceil(step * 1.2)
        steps.add(step)
    return frozenset(steps)


EVALUATION_STEPS = _evaluation_steps()


class IterNCGPModel(gpytorch.models.ApproximateGP):
    """C latent GPs sharing one fixed Matérn-3/2 kernel (one N × C product per solver iteration); softmax and
    IterNCGP (Laplace) unless told otherwise."""

    def __init__(self, problem: Data, keops: bool, strategy_class=IterNCGPStrategy, likelihood=None, **options):
        likelihood = likelihood or softmax_likelihood(problem.num_classes)
        strategy = strategy_class(self, problem.train_x, problem.train_y, likelihood, **options)
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = fixed_kernel(problem, keops)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _test_products(state, cross_kernel: Tensor, num_classes: int) -> Tensor:
    r""":math:`\mathbf K_{*X}[\mathbf a, \mathbf Q]` per class for a shared kernel (:math:`\mathbf K = \mathbf K_x \otimes
    \mathbf I_C`, data-major columns): ``(N*, C, 1 + r)``."""
    num_train = cross_kernel.shape[-1]
    columns = torch.cat([state.representer_weights[:, None], state.precision_root], dim=-1)  # (N C, 1 + r)
    return (cross_kernel @ columns.reshape(num_train, -1)).reshape(len(cross_kernel), num_classes, -1)


def shared_kernel_marginals(state, cross_kernel: Tensor, prior_variance: float, num_classes: int):
    r"""Latent marginals at test points from IterNCGP's state and a dense cross kernel ``(N*, N)``.

    Mean :math:`\mathbf K_{*X} \mathbf a`, variance :math:`k_{**} - \|\mathbf Q^\top \mathbf K_{X*}\|^2` per
    class, for a shared kernel, as ``IterNCGPStrategy.marginal_latent`` computes them.
    """
    product = _test_products(state, cross_kernel, num_classes)
    variance = (prior_variance - product[..., 1:].square().sum(-1)).clamp_min(0)
    return product[..., 0], variance


def shared_kernel_blocks(state, cross_kernel: Tensor, prior_variance: float, num_classes: int):
    r"""Each test point's latent mean ``(N*, C)`` and :math:`C \times C` covariance :math:`k_{**}\mathbf I -
    \mathbf R\mathbf R^\top` ``(N*, C, C)`` (:math:`\mathbf R` its rows of :math:`\mathbf K_{*X}\mathbf Q`) for a
    shared kernel, as ``EPStrategy.marginal_latent_blocks`` computes them."""
    product = _test_products(state, cross_kernel, num_classes)
    rows = product[..., 1:]
    return product[..., 0], prior_variance * torch.eye(num_classes, dtype=product.dtype) - rows @ rows.mT


def buffer_bytes(state) -> dict[str, int]:
    """Bytes of the solver state: actions S and K S (the recycling buffer), Q and K Q, a and K a."""
    sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in state.tensors().items()}
    return {
        "buffer_columns": int(state.actions.shape[-1]),
        "precision_rank": int(state.precision_root.shape[-1]),
        "buffer_bytes": sizes.get("actions", 0) + sizes.get("kernel_actions", 0),
        "state_bytes": sum(sizes.values()),
    }


def _fit_and_record(problem: Data, model, test_posterior, describe, kernel_path: str, evaluate=True, adapter=None):
    """Fit ``model``'s strategy, evaluating after the outer steps in ``EVALUATION_STEPS`` and at the end.

    ``test_posterior(state, cross_kernel)`` gives the test marginals from the dense cross kernel (in chunks of test
    points, evaluated anew each time: no memory kept); ``describe(record)`` the entries to log per outer step;
    ``adapter`` the predictive rule (:meth:`Recorder.record`). Without ``evaluate`` only the final state is
    evaluated, through the strategy's own products (KeOps or chunks; for sizes where the dense cross kernel does
    not fit).
    """
    strategy = model.variational_strategy
    dense_kernel = fixed_kernel(problem)

    def marginals_of(state):
        parts = [
            test_posterior(state, dense_kernel(test_x, problem.train_x).to_dense())
            for test_x in problem.test_x.split(2048)
        ]
        return tuple(torch.cat(part) for part in zip(*parts, strict=True))

    recorder = Recorder(problem)
    totals = {"products": 0, "product_seconds": 0.0}
    last: dict = {}

    def callback(record, state):
        totals["products"] += record.kernel_products
        totals["product_seconds"] += record.kernel_product_seconds
        last.update(step=record.step, **describe(record), **totals)
        if evaluate and record.step in EVALUATION_STEPS:
            recorder.record(lambda: marginals_of(state), adapter, **last)
        else:
            recorder.peak_rss = max(recorder.peak_rss, peak_rss_bytes())

    reset_peak_rss()
    cuda = problem.train_x.is_cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats(problem.train_x.device)
    recorder.start, recorder.baseline_rss = time.perf_counter(), rss_bytes()
    limit = dense_kernel_limit(0 if kernel_path == "chunked" else dense_kernel_limit.value())
    with torch.no_grad(), warnings.catch_warnings(), limit:
        warnings.simplefilter("ignore", gpytorch.utils.warnings.NumericalWarning)
        report = strategy.fit(callback=callback)
        fit_seconds = recorder.elapsed()
        final = (
            (lambda: marginals_of(strategy.state)) if evaluate else (lambda: strategy.marginal_latent(problem.test_x))
        )
        recorder.record(final, adapter, final=True, **last)
    return report, {
        "history": recorder.history,
        "fit_seconds": fit_seconds,
        "product_seconds": report.kernel_product_seconds,
        "other_seconds": fit_seconds - report.kernel_product_seconds,
        "products": report.kernel_products,
        "solver_iterations": report.solver_iterations,
        "converged": report.converged,
        "peak_rss_bytes": recorder.peak_rss,
        "baseline_rss_bytes": recorder.baseline_rss,
        # the device's peak (tensors only) during the fit and evaluations
        "cuda_peak_bytes": torch.cuda.max_memory_allocated(problem.train_x.device) if cuda else None,
        **buffer_bytes(strategy.state),
    }


def run_iterncgp(
    problem: Data,
    policy: str = "cg",
    compression_rank: int | None = None,
    max_solver_iterations: int = 5,
    max_newton_steps: int = 20,
    kernel_path: str = "keops",
    evaluate: bool = True,
    show_progress: bool = False,
    **strategy_options,
) -> dict:
    """Fit IterNCGP, evaluating on the test set along the way (from a dense cross kernel, not timed).

    :param kernel_path: products with K by ``"keops"`` (KeOps Matérn), ``"chunked"`` (GPyTorch's kernel in row
        chunks, K never formed) or ``"dense"`` (K evaluated once and cached: the package's default below
        ``dense_kernel_limit``).
    :param evaluate: evaluate after the Newton steps in ``EVALUATION_STEPS`` and at the end; otherwise only at
        the end, through ``IterNCGPStrategy.marginal_latent``.
    :param strategy_options: further ``IterNCGPStrategy`` options (e.g. ``preconditioner_rank``).
    :return: ``history`` (per Newton step: time, metrics, products, time in products), the fit report's
        totals, buffer sizes and the peak resident memory of the fit.
    """
    model = IterNCGPModel(
        problem,
        kernel_path == "keops",
        policy=policy,
        max_solver_iterations=max_solver_iterations,
        compression_rank=compression_rank,
        max_newton_steps=max_newton_steps,
        outer_tol=1e-3,
        min_curvature=1e-6,
        covariance_iterations=0,  # the paper's method (Alg. 2): the Newton steps' actions alone
        show_progress=show_progress,
        **strategy_options,
    )

    def test_posterior(state, cross_kernel):
        return shared_kernel_marginals(state, cross_kernel, problem.outputscale, problem.num_classes)

    report, result = _fit_and_record(
        problem, model, test_posterior, lambda step: {"log_posterior": step.log_posterior}, kernel_path, evaluate
    )
    return {**result, "newton_steps": report.steps}


# -- EP (multinomial probit) ---------------------------------------------------------------------------------
def run_ep(
    problem: Data,
    max_sweeps: int = 60,
    max_solver_iterations: int = 5,
    compression_rank: int | None = None,
    damping: float = 0.5,
    kernel_path: str = "dense",
    covariance_iterations: int = 0,
    show_progress: bool = False,
    **ep_options,
) -> dict:
    """Multi-class EP (``EPStrategy`` with the multinomial probit: :math:`C \times C` sites, nested EP, CG with
    recycling), evaluated like :func:`run_iterncgp` with the likelihood's own predictive (nested EP's normaliser
    under each test point's :math:`C \times C` covariance); ``covariance_iterations`` blocks of the covariance phase
    after the sweeps (``gpytorch_iterncgp.core.covariance``)."""
    from gpytorch_iterncgp import EPStrategy, MultinomialProbitLikelihood

    likelihood = MultinomialProbitLikelihood(problem.num_classes)
    model = IterNCGPModel(
        problem,
        kernel_path == "keops",
        strategy_class=EPStrategy,
        likelihood=likelihood,
        policy="cg",
        max_solver_iterations=max_solver_iterations,
        compression_rank=compression_rank,
        max_sweeps=max_sweeps,
        damping=damping,
        site_tol=1e-3,
        covariance_iterations=covariance_iterations,
        show_progress=show_progress,
        **ep_options,
    )

    def test_posterior(state, cross_kernel):
        return shared_kernel_blocks(state, cross_kernel, problem.outputscale, problem.num_classes)

    def describe(sweep):
        return {"site_change": sweep.site_change, "bounded_cavities": sweep.bounded_cavities}

    adapter = likelihood_adapter(likelihood)
    report, result = _fit_and_record(problem, model, test_posterior, describe, kernel_path, adapter=adapter)
    return {**result, "sweeps": report.steps}


# -- SVGP ----------------------------------------------------------------------------------------------------
def fixed_kernel_svgp(problem: Data, num_inducing: int, generator: torch.Generator) -> SVGPModel:
    """The SVGP baseline (:class:`benchmarks.svgp.SVGPModel`) for the suite's C > 2 classes with the problem's fixed
    kernel and a zero mean, U / C inducing inputs per class started at distinct training inputs while U <= N."""
    mean = gpytorch.means.ZeroMean(batch_shape=torch.Size([problem.num_classes]))
    return SVGPModel(problem, num_inducing, generator, mean, fixed_kernel(problem), disjoint_starts=True)


def run_svgp(
    problem: Data,
    num_inducing: int,
    learning_rate: float,
    budget_seconds: float,
    batch_size: int = 1024,
    evaluations: int = 20,
    seed: int = 0,
) -> dict:
    """:func:`fixed_kernel_svgp`, Adam on the ELBO in mini-batches for ``budget_seconds`` of wall time
    (:func:`benchmarks.loops.minibatch_steps`). The test set is evaluated ``evaluations`` times, evenly in time, and
    after the last step.
    """
    generator = torch.Generator().manual_seed(seed)
    model = fixed_kernel_svgp(problem, num_inducing, generator)
    likelihood = softmax_likelihood(problem.num_classes).to(problem.train_x)
    objective = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=problem.num_train)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=learning_rate)

    def marginals():
        model.eval()
        mean, variance = svgp_marginals(model, problem.test_x)
        model.train()
        return mean, variance

    def evaluate(steps: int, epochs: int, loss: Tensor | None) -> None:
        elbo = {} if loss is None else {"elbo": -loss.item()}
        recorder.record(marginals, adam_steps=steps, epochs=epochs, **elbo)

    reset_peak_rss()
    recorder = Recorder(problem)
    steps, epochs = minibatch_steps(
        model,
        objective,
        optimizer,
        problem.train_x,
        problem.train_y,
        budget_seconds,
        generator,
        recorder,
        evaluate,
        batch_size=batch_size,
        evaluations=evaluations,
    )
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "history": recorder.history,
        "fit_seconds": recorder.history[-1]["time"],
        "adam_steps": steps,
        "epochs": epochs,
        "peak_rss_bytes": recorder.peak_rss,
        "baseline_rss_bytes": recorder.baseline_rss,
        "state_bytes": parameter_bytes,
    }


# -- exact Laplace on a subset of the data (R&W Algorithms 3.3 and 3.4) -----------------------------------------
def _softmax_laplace_factors(kernel: Tensor, probabilities: Tensor) -> tuple[Tensor, Tensor]:
    r""":math:`\mathbf E_c = \mathbf D_c^{1/2}(\mathbf I + \mathbf D_c^{1/2}\mathbf K\mathbf D_c^{1/2})^{-1}
    \mathbf D_c^{1/2}` ``(C, n, n)`` and the Cholesky factor of :math:`\sum_c \mathbf E_c` ``(n, n)``."""
    root = probabilities.mT.sqrt()  # (C, n)
    eye = torch.eye(len(kernel), dtype=kernel.dtype, device=kernel.device)
    factor = torch.linalg.cholesky(eye + root[:, :, None] * kernel * root[:, None, :])
    blocks = root[:, :, None] * torch.cholesky_inverse(factor) * root[:, None, :]
    sum_factor = torch.linalg.cholesky(blocks.sum(0) + 1e-12 * eye)
    return blocks, sum_factor


def softmax_laplace(kernel: Tensor, labels: Tensor, num_classes: int, max_steps: int = 100, tol: float = 1e-8):
    r"""Exact Laplace mode for a softmax likelihood and C latents sharing the kernel ``(n, n)``.

    Rasmussen & Williams Algorithm 3.3 with step halving on :math:`\Psi(\mathbf a) = \log p(\mathbf y \mid
    \mathbf f) - \frac12 \mathbf a^\top \mathbf f` (undamped Newton can diverge). Returns the latent mode
    ``(n, C)``, the factors at the mode and the number of Newton steps.
    """
    targets = torch.nn.functional.one_hot(labels, num_classes).to(kernel)
    latent = torch.zeros_like(targets)
    weights = torch.zeros_like(targets)

    def log_posterior(weights, latent):
        return float((targets * torch.log_softmax(latent, -1)).sum() - 0.5 * (weights * latent).sum())

    psi = log_posterior(weights, latent)
    steps = 0
    for _ in range(max_steps):
        steps += 1
        probabilities = torch.softmax(latent, -1)
        blocks, sum_factor = _softmax_laplace_factors(kernel, probabilities)
        curvature_times_latent = probabilities * latent - probabilities * (probabilities * latent).sum(-1, True)
        rhs = curvature_times_latent + targets - probabilities  # W f + grad log p(y | f)
        corrected = (blocks @ (kernel @ rhs).mT[:, :, None])[..., 0].mT  # (n, C): E_c K b_c
        shared = torch.cholesky_solve(corrected.sum(-1, keepdim=True), sum_factor)  # (n, 1)
        proposal = rhs - corrected + (blocks @ shared)[..., 0].mT
        step = 1.0
        while True:
            candidate = weights + step * (proposal - weights)
            candidate_latent = kernel @ candidate
            candidate_psi = log_posterior(candidate, candidate_latent)
            if candidate_psi >= psi - 1e-12 * abs(psi) or step < 2.0**-30:
                break
            step /= 2
        change = float((candidate - weights).norm()) / max(1.0, float(candidate.norm()))
        weights, latent, psi = candidate, candidate_latent, candidate_psi
        if change <= tol:
            break
    probabilities = torch.softmax(latent, -1)
    blocks, sum_factor = _softmax_laplace_factors(kernel, probabilities)
    return latent, targets - probabilities, blocks, sum_factor, steps


def softmax_laplace_marginals(cross_kernel, prior_variance, gradient, blocks, sum_factor):
    r"""R&W Algorithm 3.4 for the marginals: mean :math:`\mathbf k_*^\top(\mathbf y_c - \boldsymbol\pi_c)`,
    variance :math:`k_{**} - \mathbf k_*^\top \mathbf E_c \mathbf k_* + \|\mathbf M^{-1}\mathbf E_c
    \mathbf k_*\|^2` per class; ``cross_kernel`` is ``(n, N*)``, results ``(N*, C)``."""
    mean = cross_kernel.mT @ gradient
    projected = blocks @ cross_kernel  # (C, n, N*)
    reduction = (cross_kernel * projected).sum(-2)  # (C, N*)
    correction = torch.linalg.solve_triangular(sum_factor, projected, upper=False).square().sum(-2)
    return mean, (prior_variance - reduction + correction).mT.clamp_min(0)


def run_sod_laplace(problem: Data, subset_size: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> dict:
    """Exact Laplace (Cholesky) on ``subset_size`` random training points; the whole set: exact Laplace."""
    generator = torch.Generator().manual_seed(seed)
    subset_size = min(subset_size, problem.num_train)
    index = torch.randperm(problem.num_train, generator=generator)[:subset_size]
    kernel_function = fixed_kernel(problem).to(dtype)
    train_x = problem.train_x[index].to(dtype)
    reset_peak_rss()
    recorder = Recorder(problem)
    with torch.no_grad():
        kernel = kernel_function(train_x).to_dense()
        _, gradient, blocks, sum_factor, steps = softmax_laplace(kernel, problem.train_y[index], problem.num_classes)
    fit_seconds = recorder.elapsed()
    del kernel

    def marginals():
        means, variances = [], []
        for test_x in problem.test_x.to(dtype).split(2048):
            cross = kernel_function(train_x, test_x).to_dense()
            mean, variance = softmax_laplace_marginals(cross, problem.outputscale, gradient, blocks, sum_factor)
            means.append(mean)
            variances.append(variance)
        return torch.cat(means), torch.cat(variances)

    recorder.record(marginals, subset_size=subset_size, newton_steps=steps)
    return {
        "history": recorder.history,
        "fit_seconds": fit_seconds,
        "subset_size": subset_size,
        "newton_steps": steps,
        "peak_rss_bytes": recorder.peak_rss,
        "baseline_rss_bytes": recorder.baseline_rss,
        "state_bytes": (blocks.numel() + sum_factor.numel() + gradient.numel()) * blocks.element_size(),
        "dense_bytes_estimate": int(subset_size**2 * (problem.num_classes + 2) * blocks.element_size()),
    }


__all__ = [
    "run_iterncgp",
    "run_sod_laplace",
    "run_svgp",
]
