"""The shared core: the settings, the evidence's cost and its gradients at extremes, and the
one-way import graph."""

from __future__ import annotations

import ast
import math
import pathlib
import warnings

import gpytorch
import pytest
import torch

import gpytorch_iterncgp
from gpytorch_iterncgp import LaplaceMarginalLogLikelihood, LogitBernoulliLikelihood, settings
from gpytorch_iterncgp.core.prior import LatentPrior
from gpytorch_iterncgp.exceptions import NumericalBreakdownWarning
from tests import reference
from tests.common import IterNCGPModel, binary_data

PACKAGE = pathlib.Path(gpytorch_iterncgp.__file__).parent


# ---------------------------------------------------------------------------------------------------
# The evidence: its own regime setting, its cost, finite gradients at extreme outputscales.
# ---------------------------------------------------------------------------------------------------
def _count_products(monkeypatch) -> list[int]:
    calls = []
    original = LatentPrior.matmul

    def counting(self, rhs):
        calls.append(rhs.shape[-1])
        return original(self, rhs)

    monkeypatch.setattr(LatentPrior, "matmul", counting)
    return calls


def test_exact_evidence_costs_no_products_beyond_the_strategys_fit(monkeypatch):
    x, y = binary_data(100, seed=3)
    likelihood = LogitBernoulliLikelihood()
    model = IterNCGPModel(x, y, likelihood)
    mll = LaplaceMarginalLogLikelihood(likelihood, model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    model.train()
    calls = _count_products(monkeypatch)
    for _ in range(3):
        optimizer.zero_grad()
        function_dist = model(x)  # the fit: renews K S, K a after the optimizer step, then Newton steps
        fitted = len(calls)
        assert fitted == model.variational_strategy.last_report.kernel_products > 0
        loss = -mll(function_dist, y)
        loss.backward()
        assert len(calls) == fitted  # the exact regime multiplies by no K of the strategy's
        calls.clear()
        optimizer.step()


def test_evidence_regime_is_its_own_setting_not_max_cholesky_size(monkeypatch):
    x, y = binary_data(60, seed=4)
    likelihood = LogitBernoulliLikelihood()
    model = IterNCGPModel(x, y, likelihood, max_solver_iterations=None, outer_tol=1e-10, abs_tol=1e-10, rel_tol=1e-12)
    mll = LaplaceMarginalLogLikelihood(likelihood, model)
    model.train()
    kernel = model.covar_module(x).to_dense().detach()
    expected, _ = reference.laplace_evidence(kernel, torch.zeros(60, dtype=x.dtype), y, "logit", 1)
    with torch.no_grad(), gpytorch.settings.max_cholesky_size(0):  # what `import botorch` and others change
        value = float(mll(model(x), y)) * 60
    assert abs(value - expected) <= 1e-10 * abs(expected)  # dense: exact (SLQ would be off by ~1e-4)
    model(x)  # fitted: the products below are the evidence's own
    calls = _count_products(monkeypatch)
    with torch.no_grad(), gpytorch.settings.max_cholesky_size(10**6):
        mll(model(x), y)
    assert not calls  # dense
    with torch.no_grad(), settings.exact_evidence_size(10):
        mll(model(x), y)
    assert calls  # matrix-free: products with K


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize(("dtype", "outputscale"), [(torch.float32, 1e3), (torch.float32, 1e4), (torch.float64, 1e4)])
@pytest.mark.parametrize("likelihood_type", [gpytorch.likelihoods.BernoulliLikelihood, LogitBernoulliLikelihood])
def test_evidence_gradients_are_finite_on_separable_data_at_extreme_outputscales(
    likelihood_type, dtype, outputscale, exact
):
    """W = p(1 - p) rounded to 0 for |f| > 17 (float32) / 37 (float64), and sqrt at 0 has an infinite slope: the
    matrix-free regime gave a finite loss with NaN gradients here."""
    x = torch.linspace(0, 1, 100, dtype=dtype)[:, None]
    y = (x[:, 0] > 0.5).to(dtype)
    likelihood = likelihood_type()
    model = IterNCGPModel(x, y, likelihood, outputscale=outputscale)
    mll = LaplaceMarginalLogLikelihood(likelihood, model, exact=exact)
    model.train()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        if dtype == torch.float32:  # the residual reaches the kernel's rounding (s² eps): IterGP says so, expected
            warnings.simplefilter("ignore", NumericalBreakdownWarning)
        loss = -mll(model(x), y)
        loss.backward()
    assert math.isfinite(float(loss.detach()))
    gradients = [parameter.grad for parameter in model.parameters()]
    assert all(gradient is not None and bool(torch.isfinite(gradient).all()) for gradient in gradients)
    # the confident points have a curvature of e^-|f| and less: the regime the fix is about
    assert float(model.variational_strategy.mode.detach().abs().max()) > 15


# ---------------------------------------------------------------------------------------------------
# Chunked products use no deprecated GPyTorch feature.
# ---------------------------------------------------------------------------------------------------
def test_chunked_products_emit_no_deprecation_warning():
    x = torch.rand(50, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(torch.float64)
    rhs = torch.randn(50, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    distribution = gpytorch.distributions.MultivariateNormal(torch.zeros(50, dtype=torch.float64), kernel(x))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        with (
            settings.dense_kernel_limit(0),
            settings.kernel_chunk_bytes(7 * 50 * 8),
            settings.fused_kernel_products(False),
        ):
            product = LatentPrior.from_distribution(distribution, 1).matmul(rhs)
    torch.testing.assert_close(product, kernel(x).to_dense() @ rhs, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# Imports run one way: from the GPyTorch-facing layer down to the linear algebra.
# ---------------------------------------------------------------------------------------------------
# The subpackages from the bottom up; within each, its modules from the bottom up (a set holds peers, which must not
# import each other). A module imports only from a lower subpackage, or from a lower group of its own.
LAYERS: list[tuple[str, list[set[str]]]] = [
    ("", [{"settings", "exceptions", "datasets"}]),
    (
        "core",
        [
            {"validation", "triton_kernels", "state", "threads", "memory", "deferred"},
            {"noise", "precision", "kernel_products", "policies", "sharding"},
            {"recycling", "prior", "covariance"},
            {"solver", "outer_loop", "preconditioner"},
        ],
    ),
    ("kernels", [{"sharded", "additive", "warping"}, {"family"}]),
    (
        "likelihoods",
        [{"multinomial_probit", "tilted", "negative_binomial"}, {"adapters", "factorised"}, {"quasi_poisson"}],
    ),
    ("laplace", [{"line_search"}, {"newton"}]),
    ("ep", [{"sites"}, {"regression"}, {"sweeps"}]),
    ("sparse", [{"psi_statistics"}, {"dtc"}, {"uncertain", "uncertain_prediction", "stochastic"}]),
    ("strategies", [{"saved_state"}, {"base"}, {"predictive"}, {"itergp", "sparse", "stochastic"}]),
    ("mlls", [{"itergp"}, {"sparse", "stochastic"}, {"uncertain"}]),
    (
        "learning",
        [
            {"thresholds"},
            {"recipe", "scale", "scores"},
            {"rows", "learner", "outputscale", "minibatch", "optimisers"},
            {"estimator_policy"},
            {"kernel_choice"},
            {"baseline"},
            {"fit"},
        ],
    ),
    ("models", [{"alps", "gplvm"}, {"alps_gibbs"}]),
    ("integrations", [{"sklearn", "botorch"}]),
    # The public paths: thin modules that re-export what users import (and the package's own __init__).
    ("", [{"alps", "gplvm", "sklearn", "botorch", "uncertain", "distributed", "__init__"}]),
]


def _rank(module: str) -> tuple[int, int]:
    """(layer, group) of a dotted module path below the package, e.g. ``core.solver``."""
    package, _, name = module.rpartition(".")
    for layer, (layer_package, groups) in enumerate(LAYERS):
        for group, names in enumerate(groups):
            if layer_package == package and name in names:
                return layer, group
    raise AssertionError(f"{module} belongs to no layer of LAYERS")


# Imports from a higher layer, each inside a function (run at the call, never at import), with the reason.
CALLS_UP = {
    # BoTorch's fit_gpytorch_mll calls the model's custom_fit, which the evidence sets; it runs the learner above
    ("mlls.itergp", "learning.fit"),
}


def _package_imports(path: pathlib.Path, at_import: bool = False) -> set[str]:
    """The package modules that ``path`` imports, as dotted paths below the package (``at_import``: only those
    imported when the module is, outside its functions)."""
    package = path.parent.relative_to(PACKAGE).parts
    tree = ast.parse(path.read_text())
    in_functions = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for inner in ast.walk(node)
    }
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 1 and not (at_import and id(node) in in_functions):
            base = list(package[: len(package) - (node.level - 1)])
            if node.module:
                names.add(".".join([*base, node.module]))
            else:
                names.update(".".join([*base, alias.name]) for alias in node.names)
    return {name for name in names if (PACKAGE / (name.replace(".", "/") + ".py")).exists()}


def test_modules_import_only_lower_layers():
    modules = {".".join(path.relative_to(PACKAGE).with_suffix("").parts) for path in PACKAGE.rglob("*.py")}
    subpackage_inits = {module for module in modules if module.endswith(".__init__")}
    for module in modules - subpackage_inits:
        path = PACKAGE / (module.replace(".", "/") + ".py")
        for imported in _package_imports(path):
            if (module, imported) in CALLS_UP:
                assert imported not in _package_imports(path, at_import=True), f"{module} imports {imported} at import"
                continue
            assert _rank(imported) < _rank(module), f"{module} imports {imported} (same or higher layer)"
    for init in subpackage_inits:  # a subpackage's __init__ only documents it: importing it costs nothing
        assert not _package_imports(PACKAGE / (init.replace(".", "/") + ".py")), init


MAX_CLASS_LINES, MAX_FUNCTION_LINES = 300, 80


def test_no_class_over_300_lines_and_no_function_over_80():
    """Classes and functions (docstrings included) split along their ideas where they grow past these sizes."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            limit = (
                MAX_CLASS_LINES
                if isinstance(node, ast.ClassDef)
                else MAX_FUNCTION_LINES
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                else None
            )
            if limit is not None and node.end_lineno - node.lineno + 1 > limit:
                too_long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    assert not too_long, too_long


def test_public_api_is_what_users_call():
    """The top level lists what a user calls; building blocks stay in their modules."""
    for name in gpytorch_iterncgp.__all__:
        assert getattr(gpytorch_iterncgp, name).__doc__, name
    for internal in ("itergp_solve", "ActionBuffer", "virtual_solver_run", "DiagonalNoiseInverse", "LatentPrior"):
        assert internal not in gpytorch_iterncgp.__all__
    assert {"IterNCGPStrategy", "LaplaceMarginalLogLikelihood", "settings"} <= set(gpytorch_iterncgp.__all__)
    assert (PACKAGE / "py.typed").exists()


# ---------------------------------------------------------------------------------------------------
# Devices: a fit on the GPU is the fit on the CPU (skipped without CUDA).
# ---------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_fit_equals_cpu_fit(dtype):
    x, y = binary_data(80, dtype=dtype, seed=5)
    options = dict(max_solver_iterations=None, outer_tol=1e-6, abs_tol=1e-8, rel_tol=1e-8)
    cpu = IterNCGPModel(x, y, LogitBernoulliLikelihood(), **options)
    cuda = IterNCGPModel(x.cuda(), y.cuda(), LogitBernoulliLikelihood().cuda(), **options).cuda()
    cpu.variational_strategy.fit()
    cuda.variational_strategy.fit()
    test_x = torch.rand(7, 2, dtype=dtype, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        mean, variance = cpu.variational_strategy.marginal_latent(test_x)
        cuda_mean, cuda_variance = cuda.variational_strategy.marginal_latent(test_x.cuda())
    # float32: the solver stops at numerical breakdown after other iterations on each device (1.4e-3 on an H100)
    tolerance = 5e-3 if dtype == torch.float32 else 1e-8
    torch.testing.assert_close(cuda_mean.cpu(), mean, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(cuda_variance.cpu(), variance, rtol=tolerance, atol=tolerance)


def test_every_warning_of_the_package_is_a_numerical_warning():
    """One hierarchy (``exceptions.py``): ``filterwarnings(category=NumericalWarning)`` silences all of them, but the
    one about the model rather than the numbers, ``WorseThanConstantWarning``, a ``UserWarning`` (as GPyTorch's
    ``GPInputWarning``)."""
    from linear_operator.utils.warnings import NumericalWarning

    from gpytorch_iterncgp import exceptions, uncertain

    warning_classes = [
        value
        for module in (exceptions, uncertain)
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, Warning)
    ]
    assert uncertain.MonteCarloPsiWarning in warning_classes
    about_the_model = [cls for cls in warning_classes if not issubclass(cls, NumericalWarning)]
    assert about_the_model == [exceptions.WorseThanConstantWarning], about_the_model
    assert issubclass(exceptions.WorseThanConstantWarning, UserWarning)


def test_the_library_cites_no_section_of_the_benchmarks_notebook():
    """The library's docstrings and comments cite papers, stable pages (``docs/design_notes.md`` by topic) and files,
    never the benchmarks notebook or its section numbers, which shift as it grows."""
    cited = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in PACKAGE.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "benchmarks/README" in line or "benchmarks §" in line
    ]
    assert not cited, cited
