"""Laplace versus EP versus SVGP: calibration of GP classification on two real binary data sets.

Three approximations of the same GP classifier (zero mean, Matérn-3/2 kernel with one lengthscale, probit
likelihood ``BernoulliLikelihood``):

* **Laplace**: :class:`~gpytorch_iterncgp.IterNCGPStrategy` (Newton to the mode, curvature there);
* **EP**: :class:`~gpytorch_iterncgp.EPStrategy` (parallel damped sweeps, moments matched);
* **SVGP**: GPyTorch's ``VariationalStrategy`` with a ``CholeskyVariationalDistribution`` over 100 inducing points
  (k-means centres of the training inputs, then learned), trained by Adam on ``VariationalELBO``.

Both strategies use *complete* solves (``policy="unit", max_solver_iterations=None``, tolerances 0: every
Newton step and every EP sweep is solved exactly, like a Cholesky), converged tightly (Newton to a relative
change of 1e-8, EP to a site change of 1e-6, damping 0.8): on these small sets the comparison is of the
approximations, not of the solver budget. The script checks that both converged.

Data (bundled with scikit-learn; fixed, seeded, stratified splits):

* breast cancer: 569 points, 30 features standardised on the training set, 70 % / 30 % train / test (398 / 171);
* digits: all 1797 images, label "digit >= 5", 64 pixel intensities scaled to [0, 1] (divided by 16),
  600 train / 1197 test. The training set is kept at 600 because complete solves cost O(N³) per Newton step
  and EP sweep, and hyperparameter learning re-converges them at every optimiser step; the large test set
  makes NLL and ECE estimates more reliable.

Two settings per data set:

* **fixed**: the *same* kernel for all three methods, lengthscale 3 and outputscale 10 (breast cancer: as in the
  package's dense references; digits: lengthscale 3 ≈ the median distance between two scaled images, 3.07). The
  point is calibration at equal hyperparameters. SVGP learns only its variational parameters and inducing points
  (800 Adam steps, lr 0.02).
* **learned**: lengthscale and outputscale learned by each method's own objective (Laplace evidence, EP evidence,
  ELBO), from the same start (lengthscale = median distance between training inputs, outputscale 1), with the same
  budget of 40 Adam steps (lr 0.1, log-parametrised) on the hyperparameters. Between two hyperparameter steps the
  strategies re-converge their posterior (warm-started); SVGP's analogue is 10 Adam steps on its variational
  parameters (after the same warm-up as in the fixed setting). On breast cancer the objectives have a long ridge
  towards larger lengthscale and outputscale together (nearly separable data) along which they change little; 40
  steps do not reach its end, for any of the three.

Reported per method and setting: test accuracy, test NLL (mean negative log predictive probability), ECE
(top-label, 15 equal-width bins; ``torchmetrics`` if installed), the fit's wall time, and the same metrics
for the "probit of the latent mean alone", Φ(μ), which ignores the latent variance: Laplace's mean is good,
its variance is the problem. The table goes to the terminal and to ``ep_vs_laplace.json`` next to the figure
``ep_vs_laplace.png`` (reliability diagrams for the fixed kernel, test NLL per method and setting).

    python examples/ep_vs_laplace.py            # about 2.5 minutes on one (shared) CPU core
    python examples/ep_vs_laplace.py --smoke    # subsets, few steps: seconds
"""

from __future__ import annotations

import json

import _common
import gpytorch
import matplotlib.pyplot as plt
import numpy as np
import torch
from gpytorch.variational import CholeskyVariationalDistribution, VariationalStrategy
from sklearn.cluster import KMeans
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from tqdm.auto import tqdm

from gpytorch_iterncgp import EPMarginalLogLikelihood, EPStrategy, IterNCGPStrategy, LaplaceMarginalLogLikelihood

try:
    from torchmetrics.functional.classification import multiclass_calibration_error
except ImportError:  # pragma: no cover - the small function below computes the same number
    multiclass_calibration_error = None

NAME = "ep_vs_laplace"
DATASETS = ("breast cancer", "digits")
METHODS = ("Laplace", "EP", "SVGP")
SETTINGS = ("fixed", "learned")
FIXED_KERNEL = {"breast cancer": (3.0, 10.0), "digits": (3.0, 10.0)}  # (lengthscale, outputscale)
NUM_BINS = 15
NUM_INDUCING = 100
LEARNING_RATE = 0.1
COLORS = {"Laplace": "tab:orange", "EP": "tab:blue", "SVGP": "tab:green"}

COMPLETE = dict(policy="unit", max_solver_iterations=None, abs_tol=0.0, rel_tol=0.0, show_progress=False)
STRATEGIES = {
    "Laplace": (IterNCGPStrategy, LaplaceMarginalLogLikelihood, dict(outer_tol=1e-8, max_newton_steps=100)),
    # damping 0.8 (default 0.5): the fixed point does not depend on it (tests/ep/test_ep.py), half the sweeps here
    "EP": (EPStrategy, EPMarginalLogLikelihood, dict(site_tol=1e-6, max_sweeps=500, damping=0.8)),
}


def _log_positive() -> gpytorch.constraints.Positive:
    """Log-parametrised hyperparameters: Adam's steps are relative (as in ``hyperparameters.py``)."""
    return gpytorch.constraints.Positive(transform=torch.exp, inv_transform=torch.log)


def _kernel(lengthscale: float, outputscale: float) -> gpytorch.kernels.ScaleKernel:
    kernel = gpytorch.kernels.ScaleKernel(
        gpytorch.kernels.MaternKernel(nu=1.5, lengthscale_constraint=_log_positive()),
        outputscale_constraint=_log_positive(),
    )
    kernel.base_kernel.lengthscale = lengthscale
    kernel.outputscale = outputscale
    return kernel


class StrategyModel(gpytorch.models.ApproximateGP):
    """Zero mean, scaled Matérn-3/2; ``strategy_class`` (Laplace or EP) replaces the variational strategy."""

    def __init__(self, strategy_class, train_x, train_y, likelihood, lengthscale, outputscale, **options):
        super().__init__(strategy_class(self, train_x, train_y, likelihood, **options))
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = _kernel(lengthscale, outputscale)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


class SVGPModel(gpytorch.models.ApproximateGP):
    """GPyTorch's SVGP: whitened ``VariationalStrategy``, Cholesky variational distribution, learned inducing points."""

    def __init__(self, inducing_points, lengthscale, outputscale):
        distribution = CholeskyVariationalDistribution(inducing_points.shape[0])
        strategy = VariationalStrategy(self, inducing_points, distribution, learn_inducing_locations=True)
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = _kernel(lengthscale, outputscale)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


# -- data and metrics ------------------------------------------------------------------------------


def load(name: str, smoke: bool, seed: int = 0):
    """Train and test inputs and {0, 1} labels (float64 tensors), split and scaled as the docstring says."""
    if name == "breast cancer":
        data = load_breast_cancer()
        x, y = data.data, data.target.astype(float)
        split = dict(test_size=0.3)
    else:
        data = load_digits()
        x, y = data.data / 16.0, (data.target >= 5).astype(float)
        split = dict(train_size=600)
    if smoke:  # a stratified subset of 200 points, half of it for training
        x, _, y, _ = train_test_split(x, y, train_size=200, random_state=seed, stratify=y)
        split = dict(test_size=0.5)
    x_train, x_test, y_train, y_test = train_test_split(x, y, random_state=seed, stratify=y, **split)
    if name == "breast cancer":
        scaler = StandardScaler().fit(x_train)
        x_train, x_test = scaler.transform(x_train), scaler.transform(x_test)
    return [torch.as_tensor(a, dtype=torch.float64) for a in (x_train, y_train, x_test, y_test)]


def reliability_bins(probs: torch.Tensor, labels: torch.Tensor):
    """Top-label reliability diagram: per bin of the confidence max(p, 1 - p) (``NUM_BINS`` equal-width bins of
    [0, 1], as torchmetrics bins), the mean confidence, the accuracy and the number of points."""
    confidence = torch.maximum(probs, 1 - probs)
    correct = ((probs > 0.5) == labels.bool()).to(probs.dtype)
    edges = torch.linspace(0, 1, NUM_BINS + 1, dtype=probs.dtype)
    index = (torch.bucketize(confidence, edges, right=True) - 1).clamp(0, NUM_BINS - 1)
    counts = torch.zeros(NUM_BINS, dtype=probs.dtype).index_add_(0, index, torch.ones_like(probs))
    conf = torch.zeros(NUM_BINS, dtype=probs.dtype).index_add_(0, index, confidence) / counts.clamp_min(1)
    accuracy = torch.zeros(NUM_BINS, dtype=probs.dtype).index_add_(0, index, correct) / counts.clamp_min(1)
    return conf, accuracy, counts


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Top-label ECE with ``NUM_BINS`` equal-width bins: sum over bins of |accuracy - confidence| x fraction.

    The fallback (no torchmetrics) closes the last bin, [14/15, 1]; torchmetrics gives confidences of exactly 1
    (probabilities that round to 0 or 1) a bin of their own, which changes the ECE in the 4th digit at most here.
    """
    if multiclass_calibration_error is not None:
        both = torch.stack([1 - probs, probs], dim=-1)
        return float(multiclass_calibration_error(both, labels.long(), num_classes=2, n_bins=NUM_BINS, norm="l1"))
    conf, accuracy, counts = reliability_bins(probs, labels)
    return float((counts * (accuracy - conf).abs()).sum() / counts.sum())


def scores(mean: torch.Tensor, variance: torch.Tensor, labels: torch.Tensor) -> dict:
    """Probit predictive p(y=1) = Φ(μ / sqrt(1 + σ²)) and the plug-in Φ(μ), with their accuracy, NLL and ECE.

    The NLL is -log Φ(±z), computed with ``log_ndtr`` (no clamping of probabilities that round to 0 or 1).
    """
    sign = 2 * labels - 1
    result = {}
    for key, z in (("", mean / torch.sqrt(1 + variance)), ("mean_", mean)):
        probs = torch.special.ndtr(z)
        result[f"{key}probs"] = probs
        result[f"{key}accuracy"] = float(((probs > 0.5) == labels.bool()).double().mean())
        result[f"{key}nll"] = float(-torch.special.log_ndtr(sign * z).mean())
        result[f"{key}ece"] = expected_calibration_error(probs, labels)
    return result


def _hypers(model) -> dict:
    kernel = model.covar_module
    return {"lengthscale": kernel.base_kernel.lengthscale.item(), "outputscale": kernel.outputscale.item()}


def median_distance(x: torch.Tensor) -> float:
    distances = torch.pdist(x)
    return float(distances.median())


# -- the three methods -----------------------------------------------------------------------------


def run_strategy(method, data, hypers, steps, quiet) -> dict:
    """Laplace or EP at fixed hyperparameters (``steps`` = 0) or learned by ``steps`` Adam steps on the evidence."""
    train_x, train_y, test_x, test_y = data
    strategy_class, evidence_class, options = STRATEGIES[method]
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    model = StrategyModel(strategy_class, train_x, train_y, likelihood, *hypers, **COMPLETE, **options)
    strategy = model.variational_strategy
    losses = []
    with _common.Timer() as timer:
        if steps:
            mll = evidence_class(likelihood, model)
            optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
            model.train()
            for _ in tqdm(range(steps), desc=f"{method}: Adam on the evidence", disable=quiet, leave=False):
                optimizer.zero_grad()
                loss = -mll(model(train_x), train_y)  # model(train_x) re-converges the posterior (warm start)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        report = strategy.fit()  # converge at the final hyperparameters
    if not report.converged:
        raise RuntimeError(f"{method} did not converge: {report}")
    model.eval()
    with torch.no_grad():
        mean, variance = strategy.marginal_latent(test_x)
        result = scores(mean[:, 0], variance[:, 0], test_y)
        # the strategy's own predictive probabilities are the same probit formula
        torch.testing.assert_close(strategy.predictive_probabilities(test_x), result["probs"])
        model.train()
        result["objective"] = float(evidence_class(likelihood, model)(model(train_x), train_y)) * len(train_y)
    result.update(seconds=timer.seconds, losses=losses, report=str(report).splitlines()[0], **_hypers(model))
    return result


def run_svgp(data, hypers, steps, warmup, inner, quiet) -> dict:
    """SVGP: ``warmup`` Adam steps on the variational parameters and inducing points at the given hyperparameters;
    then (``steps`` > 0) ``steps`` Adam steps on the hyperparameters, each after ``inner`` variational steps."""
    train_x, train_y, test_x, test_y = data
    num_inducing = min(NUM_INDUCING, len(train_x) // 2)
    centres = KMeans(num_inducing, n_init=4, random_state=0).fit(train_x.numpy()).cluster_centers_
    model = SVGPModel(torch.as_tensor(centres), *hypers)
    likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    elbo = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=len(train_y))
    variational = torch.optim.Adam(model.variational_strategy.parameters(), lr=0.02)
    hyper_optimizer = torch.optim.Adam(model.covar_module.parameters(), lr=LEARNING_RATE)
    model.train()
    likelihood.train()
    losses = []

    def step(optimizer) -> float:
        optimizer.zero_grad()
        loss = -elbo(model(train_x), train_y)
        loss.backward()
        optimizer.step()
        return loss.item()

    with _common.Timer() as timer:
        for _ in tqdm(range(warmup), desc="SVGP: Adam on q(u)", disable=quiet, leave=False):
            step(variational)
        for _ in tqdm(range(steps), desc="SVGP: Adam on the ELBO", disable=quiet or not steps, leave=False):
            for _ in range(inner):
                step(variational)
            losses.append(step(hyper_optimizer))
        for _ in range(inner if steps else 0):  # q(u) for the final hyperparameters
            step(variational)
    model.eval()
    with torch.no_grad():
        latent = model(test_x)
        result = scores(latent.mean, latent.variance, test_y)
        torch.testing.assert_close(likelihood(latent).probs, result["probs"])
        model.train()
        result["objective"] = float(elbo(model(train_x), train_y)) * len(train_y)
    result.update(seconds=timer.seconds, losses=losses, num_inducing=num_inducing, **_hypers(model))
    return result


# -- main ------------------------------------------------------------------------------------------


TABLE_COLUMNS = {  # JSON key -> table header
    "lengthscale": "lengthscale",
    "outputscale": "outputscale",
    "objective": "log Z/ELBO",
    "accuracy": "test acc",
    "nll": "test NLL",
    "ece": "ECE",
    "mean_accuracy": "Φ(μ) acc",
    "mean_nll": "Φ(μ) NLL",
    "mean_ece": "Φ(μ) ECE",
    "seconds": "fit s",
}


def reliability_panel(ax, result, method, title) -> None:
    """Accuracy against mean confidence per bin: the predictive (solid) and the plug-in Φ(μ) (dashed); grey bars:
    the fraction of test points per bin (right axis)."""
    labels = result["test_y"]
    width = 1 / NUM_BINS
    conf, accuracy, counts = reliability_bins(result["probs"], labels)
    share = ax.twinx()
    share.bar(torch.arange(NUM_BINS) * width, counts / counts.sum(), width=width, align="edge", color="0.85")
    share.set_ylim(0, 3)  # the bars stay in the lower third, below the legend
    share.set_yticks([0, 0.5, 1])
    share.set_ylabel("fraction of test points", color="0.5", fontsize=8)
    share.tick_params(labelsize=7, colors="0.5")
    ax.set_zorder(share.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.plot([0, 1], [0, 1], color="k", lw=0.8, ls=":")
    for key, style, label in (("probs", "o-", "predictive"), ("mean_probs", "s--", "Φ(latent mean)")):
        conf, accuracy, counts = reliability_bins(result[key], labels)
        used = counts > 0
        ax.plot(
            conf[used],
            accuracy[used],
            style,
            color=COLORS[method],
            mfc=COLORS[method] if key == "probs" else "white",
            ms=4,
            lw=1.2,
            label=f"{label}: ECE {result[key.replace('probs', 'ece')]:.3f}, NLL "
            f"{result[key.replace('probs', 'nll')]:.3f}",
        )
    ax.set_xlim(0.45, 1.005)
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("confidence max(p, 1 - p)")
    ax.set_ylabel("accuracy")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", bbox_to_anchor=(1.0, 0.3), fontsize=7.5, framealpha=0.9)
    ax.grid(alpha=0.3)


def nll_panel(ax, results) -> None:
    """Test NLL per method (bars) and of Φ(latent mean) (black ticks), per data set and kernel setting."""
    groups = [(name, setting) for name in DATASETS for setting in SETTINGS]
    width = 0.26
    for i, method in enumerate(METHODS):
        positions = np.arange(len(groups)) + (i - 1) * width
        values = [results[name, setting, method]["nll"] for name, setting in groups]
        plug_in = [results[name, setting, method]["mean_nll"] for name, setting in groups]
        ax.bar(positions, values, width=width * 0.92, color=COLORS[method], label=method)
        ax.scatter(
            positions, plug_in, marker="_", s=160, color="k", zorder=3, label="Φ(latent mean)" if i == 0 else None
        )
        for x, v in zip(positions, values, strict=True):
            ax.text(x, 0.005, f"{v:.3f}", ha="center", va="bottom", fontsize=7, rotation=90, color="white")
    ax.set_xticks(np.arange(len(groups)), [f"{name}\n{setting} kernel" for name, setting in groups], fontsize=8)
    ax.set_ylabel("test NLL (lower is better)")
    ax.set_title("test NLL per method and setting", fontsize=10)
    ax.set_ylim(0, 1.25 * max(r["nll"] for r in results.values()))
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)


def main():
    args = _common.parse_args(__doc__.splitlines()[0])
    _common.setup(seed=0)
    steps = 4 if args.smoke else 40
    warmup, inner = (100, 5) if args.smoke else (800, 10)

    results, sizes, starts = {}, {}, {}  # results: (data set, setting, method) -> dict
    with _common.Timer() as total:
        for name in DATASETS:
            data = load(name, args.smoke)
            sizes[name] = {"train": len(data[0]), "test": len(data[2]), "features": data[0].shape[1]}
            start = starts[name] = (median_distance(data[0]), 1.0)
            for setting in SETTINGS:
                hypers, num_steps = (FIXED_KERNEL[name], 0) if setting == "fixed" else (start, steps)
                for method in METHODS:
                    if not args.quiet:
                        print(f"{name}, {setting} kernel: {method}", flush=True)
                    torch.manual_seed(0)
                    if method == "SVGP":
                        result = run_svgp(data, hypers, num_steps, warmup, inner, args.quiet)
                    else:
                        result = run_strategy(method, data, hypers, num_steps, args.quiet)
                    result["test_y"] = data[3]
                    results[name, setting, method] = result

    rows, records = [], []
    for (name, setting, method), r in results.items():
        records.append(
            {
                "data": name,
                "setting": setting,
                "method": method,
                **{k: r[k] for k in TABLE_COLUMNS},
                "objective_trace": r["losses"],  # -objective / N per hyperparameter step (learned setting)
                "fit_report": r.get("report"),
            }
        )
        rows.append([name, setting, method, *(r[k] for k in TABLE_COLUMNS)])
    _common.print_table(
        ["data", "kernel", "method", *TABLE_COLUMNS.values()],
        rows,
        title="Laplace vs EP vs SVGP, probit likelihood, Matérn-3/2. log Z/ELBO: the method's own objective at the "
        "end (log evidence, ELBO); Φ(μ): probit of the latent mean alone; fit s: incl. hyperparameter learning",
    )
    print(f"total wall time {total.seconds:.1f}s ({torch.get_num_threads()} thread(s))")

    # -- JSON next to the figure -----------------------------------------------------------------
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {
        "description": __doc__.splitlines()[0],
        "smoke": args.smoke,
        "data": sizes,
        "fixed_kernel": {
            name: dict(zip(("lengthscale", "outputscale"), v, strict=True)) for name, v in FIXED_KERNEL.items()
        },
        "learning_start": {name: {"lengthscale": v[0], "outputscale": v[1]} for name, v in starts.items()},
        "learning": {"adam_steps": steps, "learning_rate": LEARNING_RATE, "svgp_warmup": warmup, "svgp_inner": inner},
        "ece_bins": NUM_BINS,
        "ece": "top-label, equal-width bins" + (" (torchmetrics)" if multiclass_calibration_error else ""),
        "num_inducing": {name: results[name, "fixed", "SVGP"]["num_inducing"] for name in DATASETS},
        "threads": torch.get_num_threads(),
        "total_seconds": total.seconds,
        "results": records,
    }
    json_path = args.out / f"{NAME}.json"
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"saved {json_path}")

    # -- figure ----------------------------------------------------------------------------------
    fig = plt.figure(figsize=(19, 8.4), constrained_layout=True)
    grid = fig.add_gridspec(2, 4, width_ratios=[1, 1, 1, 1.25])
    for row, name in enumerate(DATASETS):
        lengthscale, outputscale = FIXED_KERNEL[name]
        for col, method in enumerate(METHODS):
            size = sizes[name]
            reliability_panel(
                fig.add_subplot(grid[row, col]),
                results[name, "fixed", method],
                method,
                f"{name} (N={size['train']}, {size['test']} test), {method}\nfixed kernel ℓ={lengthscale:g}, "
                f"s²={outputscale:g}",
            )
    nll_panel(fig.add_subplot(grid[:, 3]), results)
    fig.suptitle(
        "Reliability diagrams (15 bins) and test NLL: Laplace (IterNCGPStrategy), EP (EPStrategy), both solved "
        f"completely, and SVGP ({NUM_INDUCING} inducing points); probit likelihood, Matérn-3/2",
        fontsize=12,
    )
    _common.save_figure(fig, args, NAME)


if __name__ == "__main__":
    main()
