r"""scikit-learn estimators on top of :class:`~gpytorch_iterncgp.IterNCGPStrategy`.

.. code-block:: python

    from gpytorch_iterncgp.sklearn import IterNCGPClassifier, IterNCGPPoissonRegressor

    clf = IterNCGPClassifier(random_state=0).fit(X_train, y_train)     # numpy in
    proba = clf.predict_proba(X_test)                                   # numpy out, (n, n_classes)
    proba, latent_std = clf.predict_proba(X_test, return_std=True)     # + std of the latent function(s)

    reg = IterNCGPPoissonRegressor(random_state=0).fit(X_train, counts)
    rate = reg.predict(X_test)                                          # expected counts E[y*]

Both estimators build an ``ApproximateGP`` whose prior is ``kernel`` (default ``"auto"``: the Matérn-5/2, a linear
kernel plus it, or the Matérn of warped features, chosen by the held-out log-loss or Poisson deviance of rows the
learning did not see, the Matérn alone where none are held out; ``None``: the scaled Matérn-5/2; or any GPyTorch
kernel) with the IterNCGP Laplace strategy or EP (``inference``; the classifier's default is EP),
optionally learn the kernel's hyperparameters by maximising the evidence
(:class:`~gpytorch_iterncgp.LaplaceMarginalLogLikelihood`, :class:`~gpytorch_iterncgp.EPMarginalLogLikelihood`;
L-BFGS where the evidence is exact, Adam with loose fits where it is estimated; Laplace's evidence for EP's
kernel too) of a stratified random subset of the data (``learning_subset``; by default 1000 points for 10 classes), then
fit the posterior on all the data at the learnt hyperparameters. Everything is computed in float64, on ``device``
(numpy in and out).

The estimators are a scikit-learn facade (validation, labels, numpy in and out, scikit-learn's warnings): how they
choose the inference, the solver budget, the default kernel and the strategy's options from the data is
:mod:`~gpytorch_iterncgp.learning.estimator_policy`; the regressor's likelihoods of non-integer targets are
:mod:`~gpytorch_iterncgp.likelihoods.quasi_poisson`'s.

Importing this module imports scikit-learn; ``import gpytorch_iterncgp`` does not.
"""

from __future__ import annotations

import copy
import inspect
import math
import warnings
from collections.abc import Sequence
from typing import Any

import gpytorch
import numpy as np
import torch
from gpytorch.distributions import MultivariateNormal
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.exceptions import ConvergenceWarning
from sklearn.metrics import d2_tweedie_score
from sklearn.preprocessing import StandardScaler
from sklearn.utils import check_random_state
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, validate_data

from ..core.validation import DEPRECATED, check_count, check_flag, check_nonnegative, is_string, renamed
from ..exceptions import ConvergenceWarning as PackageConvergenceWarning
from ..exceptions import NotConvergedWarning
from ..kernels.family import default_kernel, kernel_family
from ..kernels.warping import KumaraswamyWarpedKernel
from ..laplace.newton import SolverOptions
from ..learning.estimator_policy import (
    ESTIMATOR_DEFAULTS,
    FORMER_SOLVER_PARAMETERS,
    REGRESSOR_INFERENCE,
    KernelChoice,
    auto_inference,
    auto_kernel_names,
    check_parameters_apply,
    evidence_class,
    solver_settings,
)
from ..learning.fit import fit_mll
from ..learning.minibatch import MinibatchRecipe
from ..learning.recipe import LearningRecipe, LearningReport
from ..likelihoods.adapters import ExpPoissonLikelihood, LogitBernoulliLikelihood, likelihood_adapter
from ..likelihoods.multinomial_probit import MultinomialProbitLikelihood
from ..likelihoods.negative_binomial import NegativeBinomialLikelihood
from ..likelihoods.quasi_poisson import QuasiExpPoissonLikelihood, QuasiSoftplusPoissonLikelihood
from ..mlls.stochastic import StochasticEPMarginalLogLikelihood
from ..strategies.itergp import EPStrategy, IterNCGPStrategy
from ..strategies.stochastic import StochasticEPStrategy

__all__ = ["IterNCGPClassifier", "IterNCGPNegativeBinomialRegressor", "IterNCGPPoissonRegressor", "LearningReport"]

_DTYPE = torch.float64
_PREDICT_CHUNK = 4096  # test points per kernel evaluation: bounds the (chunk, N) cross-covariance in memory


# ---------------------------------------------------------------------------------------------------
# The GPyTorch model behind the estimators
# ---------------------------------------------------------------------------------------------------
class _LatentGP(gpytorch.models.ApproximateGP):
    """Prior ``mean_module(x)``, ``covar_module(x)``; IterNCGP Laplace or EP inference (module level, so it pickles)."""

    def __init__(self, train_x, train_y, likelihood, kernel, mean, strategy_type, options):
        strategy = strategy_type(self, train_x, train_y, likelihood, **options)
        super().__init__(strategy)
        self.mean_module = mean
        self.covar_module = kernel

    def forward(self, x):
        return MultivariateNormal(self.mean_module(x), self.covar_module(x))


class _SparseLatentGP(gpytorch.models.ApproximateGP):
    """Prior ``mean_module(x)``, ``covar_module(x)``; stochastic EP with inducing inputs (module level, so it pickles)."""

    def __init__(self, inducing_points, likelihood, kernel, mean, num_data):
        super().__init__(StochasticEPStrategy(self, inducing_points, likelihood, num_data=num_data))
        self.mean_module = mean
        self.covar_module = kernel

    def forward(self, x):
        return MultivariateNormal(self.mean_module(x), self.covar_module(x))


# ---------------------------------------------------------------------------------------------------
# Shared machinery
# ---------------------------------------------------------------------------------------------------
def _reemit_as_scikit_learn(caught: list[warnings.WarningMessage], limit_note: str, hint: str) -> None:
    """Warn ``caught`` again, at the line that called the estimator's ``fit``, the package's fit warnings as
    scikit-learn's ``ConvergenceWarning`` (the estimators' idiom: one category for a fit that did not converge), by
    category:

    * :class:`~gpytorch_iterncgp.ConvergenceWarning` (a fit stopped by a limit): its message, ``limit_note`` (which
      estimator parameter sets the limit) and ``hint``;
    * :class:`~gpytorch_iterncgp.NotConvergedWarning` (a fit that stalled): its message and ``hint``;
    * any other warning as it was.
    """
    for warning in caught:
        message, category = str(warning.message), warning.category
        if issubclass(category, PackageConvergenceWarning):
            message, category = message + limit_note + hint, ConvergenceWarning
        elif issubclass(category, NotConvergedWarning):
            message, category = message + hint, ConvergenceWarning
        warnings.warn(message, category, stacklevel=4)  # here, _fit_model, fit, its caller


def _step_limit_note(estimator: str, report: Any, strategy: Any) -> str:
    """Appended to the warnings where the final fit stopped at its step limit (the package's warning names the
    strategy's option): the ``solver_options`` key that sets it; ``""`` otherwise."""
    option = strategy.max_steps_option
    return f" In {estimator}, solver_options={{{option!r}: ...}} sets this limit." if report.limit == option else ""


def _param_error(estimator, name: str, expected: str, value) -> ValueError:
    return ValueError(
        f"The {name!r} parameter of {type(estimator).__name__} must be {expected}. Got {value!r} instead."
    )


class _FeatureScaling:
    """The features as the kernel sees them: standardised by ``scaler_`` (``standardize``), as float64 tensors on
    ``device``, and the fitted kernel's lengthscales back in the features' units."""

    device: Any
    standardize: Any
    kernel: Any
    kernel_: gpytorch.kernels.Kernel
    n_features_in_: int
    scaler_: StandardScaler | None

    @property
    def _device(self) -> torch.device:
        """``device`` as a ``torch.device`` (validated by :meth:`_validate_params`)."""
        return torch.device(self.device)

    def _standardized(self, X: np.ndarray, fit: bool = False) -> np.ndarray:
        """``X`` as the kernel sees it: centred and scaled to unit variance by ``scaler_`` (fitted on ``X`` where
        ``fit``; constant features are centred only), or as given where ``scaler_`` is ``None``."""
        if fit:
            standardize = self.standardize
            if standardize == "auto":
                standardize = not isinstance(self.kernel, gpytorch.kernels.Kernel)
            self.scaler_ = StandardScaler().fit(X) if standardize else None
        return X if self.scaler_ is None else self.scaler_.transform(X)

    def _feature_lengthscales(self) -> np.ndarray | None:
        r"""The fitted kernel's lengthscales in the units of the features given to ``fit``, ``(D,)``: where the kernel
        has one lengthscale (or one per feature) on the features themselves, :math:`\ell_d` times the feature's
        standard deviation (``scaler_.scale_``); ``None`` for kernels with several (additive) or none on the features
        (warped)."""
        lengthscales = [
            module.lengthscale
            for module in self.kernel_.modules()
            if isinstance(module, gpytorch.kernels.Kernel) and module.has_lengthscale
        ]
        warped = any(isinstance(module, KumaraswamyWarpedKernel) for module in self.kernel_.modules())
        num_features = self.n_features_in_
        if warped or len(lengthscales) != 1 or lengthscales[0].numel() not in (1, num_features):
            return None
        values = np.broadcast_to(lengthscales[0].detach().cpu().numpy().reshape(-1), (num_features,))
        return values * (1.0 if self.scaler_ is None else self.scaler_.scale_)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """A float64 copy of ``array`` on ``device`` (never sharing the caller's memory, which may be read-only)."""
        return torch.tensor(array, dtype=_DTYPE, device=self._device)


class _FittedPredictions(_FeatureScaling):
    """What a fitted estimator computes at new inputs (the latents' posterior, in chunks) and at its training data (the
    evidence)."""

    model_: Any
    likelihood_: Any
    inference_: str

    def _validated_test_inputs(self, X) -> torch.Tensor:
        check_is_fitted(self)
        X = validate_data(self, X, dtype=np.float64, reset=False)
        return self._tensor(self._standardized(X))

    def _chunked(self, function, inputs: torch.Tensor) -> list[torch.Tensor]:
        """``function`` on rows of ``inputs`` in chunks; each output concatenated over the chunks."""
        self.model_.eval()
        with torch.no_grad():
            pieces = [
                function(inputs[start : start + _PREDICT_CHUNK]) for start in range(0, len(inputs), _PREDICT_CHUNK)
            ]
        if isinstance(pieces[0], tuple):
            return [torch.cat(parts) for parts in zip(*pieces, strict=True)]
        return [torch.cat(pieces)]

    def _latent(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent mean and variance ``(n, C)``."""
        mean, variance = self._chunked(self.model_.variational_strategy.marginal_latent, inputs)
        return mean, variance

    def predict_latent(self, X):
        """Posterior mean and standard deviation of the latent function(s) at ``X``.

        The standard deviation includes IterNCGP's computational uncertainty (the solver's error of
        having stopped early).

        :return: ``(mean, std)``, each ``(n,)`` for one latent function (binary classification, counts)
            or ``(n, n_classes)`` for multi-class (softmax) classification.
        """
        mean, variance = self._latent(self._validated_test_inputs(X))
        if mean.shape[-1] == 1:
            mean, variance = mean[:, 0], variance[:, 0]
        return mean.cpu().numpy(), variance.sqrt().cpu().numpy()

    def log_marginal_likelihood(self) -> float:
        """The Laplace (or, with ``inference_ == "ep"``, EP) approximation of :math:`\\log p(\\mathbf y \\mid \\mathbf X,
        \\theta)` at the fitted hyperparameters (exact, or estimated by stochastic Lanczos quadrature above
        ``gpytorch_iterncgp.settings.exact_evidence_size``; see :class:`~gpytorch_iterncgp.LaplaceMarginalLogLikelihood`
        and :class:`~gpytorch_iterncgp.EPMarginalLogLikelihood`)."""
        check_is_fitted(self)
        if self.inference_ == "sparse_ep":
            raise NotImplementedError(
                "log_marginal_likelihood() is the Laplace or EP evidence; stochastic EP (inference='sparse_ep') learns "
                "by its energy's gradient on minibatches and keeps no estimate of log p(y | X): use inference='ep'."
            )
        strategy = self.model_.variational_strategy
        mll = evidence_class(strategy)(self.likelihood_, self.model_)
        training = self.model_.training
        self.model_.train()  # the posterior at the training inputs, all N C latents (the prior has N if shared)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)  # the matrix-free regime's probe vectors: the same value on every call
                value = mll(self.model_(strategy.train_inputs), strategy.train_targets)
        finally:
            self.model_.train(training)
        return float(value) * strategy.num_data - float(mll.log_prior().detach())  # the evidence alone, without priors


class _Kernels:
    """The kernel a fit starts with: a copy of the one given, the default Matérn, or with ``kernel="auto"`` the
    family's candidates to choose among."""

    kernel: Any

    @property
    def _auto_kernel(self) -> bool:
        """``kernel="auto"``: the kernel chosen by
        :func:`~gpytorch_iterncgp.learning.estimator_policy.auto_kernel_names`'s rule."""
        return is_string(self.kernel, "auto")

    def _given_kernel(self, num_features: int) -> gpytorch.kernels.Kernel:
        """A float64 copy of the ``kernel`` given (fitted in place of it), or the default Matérn for ``None`` and for
        ``"auto"`` where it does not choose (:func:`~gpytorch_iterncgp.learning.estimator_policy.auto_kernel_names`)."""
        if isinstance(self.kernel, gpytorch.kernels.Kernel):
            return copy.deepcopy(self.kernel).to(_DTYPE)
        return default_kernel(num_features)

    def _starting_kernels(
        self, num_features: int, names: Sequence[str]
    ) -> tuple[gpytorch.kernels.Kernel, dict[str, gpytorch.kernels.Kernel] | None]:
        """The kernel the model starts with (the first of the family's ``names``, else :meth:`_given_kernel`) and the
        candidates ``fit_mll`` chooses among (``None`` for fewer than two names); only these are built."""
        family = kernel_family(num_features, names=names) if names else {}
        kernel = family[names[0]] if names else self._given_kernel(num_features)
        return kernel, ({name: family[name] for name in names} if len(names) > 1 else None)

    def _kernel_batch_shape(self) -> torch.Size:
        """The batch shape of the prior mean: the user's kernel's (one GP per class), ``[]`` otherwise."""
        return self.kernel.batch_shape if isinstance(self.kernel, gpytorch.kernels.Kernel) else torch.Size([])


class _StochasticEPFit(_Kernels, _FeatureScaling):
    """``inference="sparse_ep"``: the estimators' fit by stochastic EP with inducing inputs on minibatches."""

    random_state: Any
    num_inducing: int
    batch_size: int
    max_time: float | None
    verbose: bool
    kernel_choice_: KernelChoice | None
    solver_budget_: dict | None
    learning_rows_: np.ndarray | None
    validation_rows_: np.ndarray | None
    fit_report_: Any

    def _fit_sparse_model(
        self,
        X: np.ndarray,
        targets: torch.Tensor,
        likelihood,
        mean,
        names: tuple[str, ...],
        why: str,
        recipe: LearningRecipe,
    ) -> None:
        """``inference="sparse_ep"``: stochastic EP with ``num_inducing`` inducing inputs at k-means centres of ``X``
        (scikit-learn's ``MiniBatchKMeans``), learnt with the kernel by :func:`~gpytorch_iterncgp.fit_mll`'s
        minibatch loop (batches of ``batch_size``, ``recipe.optimizer_steps`` steps at ``recipe.learning_rate``, or
        until ``max_time``; with no step, the kernel fixed, the loop's default steps fit the sites), after choosing it
        among the ``names`` of the family where there are several (by the held-out score of dense EP on rows of ``X``,
        :func:`~gpytorch_iterncgp.learning.fit.fit_minibatch_mll`; ``why``: the choice's reason); set the fitted
        attributes."""
        from sklearn.cluster import MiniBatchKMeans

        seed = int(check_random_state(self.random_state).randint(np.iinfo(np.int32).max))
        num_inducing = min(int(self.num_inducing), len(X))
        centres = MiniBatchKMeans(n_clusters=num_inducing, random_state=seed, n_init=1).fit(X).cluster_centers_
        kernel, candidates = self._starting_kernels(X.shape[1], names)
        model = _SparseLatentGP(self._tensor(centres), likelihood, kernel, mean, len(X))
        model = model.to(device=self._device, dtype=_DTYPE)
        if recipe.optimizer_steps == 0:  # the loop still fits the sites, for its own default steps
            for parameter in model.parameters():
                parameter.requires_grad_(False)
        steps = recipe.optimizer_steps or MinibatchRecipe.max_steps
        mll = StochasticEPMarginalLogLikelihood(likelihood, model)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            report = fit_mll(
                mll,
                data=(self._tensor(X), targets),
                max_time=self.max_time,
                recipe=MinibatchRecipe(
                    batch_size=int(self.batch_size), max_steps=steps, learning_rate=recipe.learning_rate
                ),
                seed=seed,
                show_progress=bool(self.verbose),
                kernels=candidates,
            )
        if candidates is not None:
            assert report.kernel is not None
            rows = report.kernel_scores[report.kernel]["rows"]
            self.kernel_choice_ = KernelChoice(report.kernel, names, why, report.validation_points, rows)
        self.inference_ = "sparse_ep"
        self.solver_budget_ = None
        self.learning_rows_ = self.validation_rows_ = None
        self.loss_curve_ = report.losses
        self.learning_report_ = report
        self.fit_report_ = None
        self.model_, self.likelihood_, self.kernel_ = model, likelihood, model.covar_module
        self.feature_lengthscales_ = self._feature_lengthscales()


class _IterNCGPEstimator(_FittedPredictions, _StochasticEPFit, BaseEstimator):
    """Parameters, validation, model construction and hyperparameter learning shared by the estimators."""

    _links: tuple[str, ...] = ()
    # fitted attributes whose type depends on the inference (set in fit)
    solver_budget_: dict | None
    kernel_choice_: KernelChoice | None
    learning_rows_: np.ndarray | None
    validation_rows_: np.ndarray | None
    fit_report_: Any

    def __init__(
        self,
        kernel=ESTIMATOR_DEFAULTS.kernel,
        *,
        standardize="auto",
        link=None,
        inference=ESTIMATOR_DEFAULTS.inference,
        solver_options=None,
        optimizer_steps=ESTIMATOR_DEFAULTS.optimizer_steps,
        learning_rate=ESTIMATOR_DEFAULTS.learning_rate,
        train_fit_steps=SolverOptions.train_fit_steps,
        learning_subset=ESTIMATOR_DEFAULTS.learning_subset,
        num_inducing=ESTIMATOR_DEFAULTS.num_inducing,
        batch_size=MinibatchRecipe.batch_size,
        max_time=None,
        random_state=None,
        device="cpu",
        verbose=False,
        learning_fit_steps=DEPRECATED,
        optimize_hyperparameters=DEPRECATED,
        policy=DEPRECATED,
        max_newton_steps=DEPRECATED,
        max_solver_iterations=DEPRECATED,
        compression_rank=DEPRECATED,
        preconditioner_rank=DEPRECATED,
        covariance_iterations=DEPRECATED,
        recycle=DEPRECATED,
        outer_tol=DEPRECATED,
        solver_tol=DEPRECATED,
    ):
        self.kernel = kernel
        self.standardize = standardize
        self.link = link
        self.inference = inference
        self.solver_options = solver_options
        self.optimizer_steps = optimizer_steps
        self.learning_rate = learning_rate
        self.train_fit_steps = train_fit_steps
        self.learning_subset = learning_subset
        self.num_inducing = num_inducing
        self.batch_size = batch_size
        self.max_time = max_time
        self.random_state = random_state
        self.device = device
        self.verbose = verbose
        self.learning_fit_steps = learning_fit_steps
        self.optimize_hyperparameters = optimize_hyperparameters
        self.policy = policy
        self.max_newton_steps = max_newton_steps
        self.max_solver_iterations = max_solver_iterations
        self.compression_rank = compression_rank
        self.preconditioner_rank = preconditioner_rank
        self.covariance_iterations = covariance_iterations
        self.recycle = recycle
        self.outer_tol = outer_tol
        self.solver_tol = solver_tol

    @property
    def _link(self) -> str:
        """``link``, where ``None`` is the estimator's default (the first of its links)."""
        return self._links[0] if self.link is None else self.link

    # -- parameters ------------------------------------------------------------------------------
    def _check(self, check, name: str, *args, **kwargs) -> None:
        """Run a check of :mod:`gpytorch_iterncgp.core.validation` on a parameter; its error in scikit-learn's words."""
        try:
            check(getattr(self, name), name, *args, **kwargs)
        except (TypeError, ValueError) as error:
            raise ValueError(f"The {name!r} parameter of {type(self).__name__} is invalid: {error}") from error

    def _validate_params(self) -> None:
        if not (self.kernel is None or isinstance(self.kernel, gpytorch.kernels.Kernel) or self._auto_kernel):
            raise _param_error(self, "kernel", "a gpytorch.kernels.Kernel, 'auto' or None", self.kernel)
        if self.link is not None and self.link not in self._links:
            raise _param_error(self, "link", f"a str among {set(self._links)} or None", self.link)
        if not is_string(self.optimizer_steps, "auto"):
            self._check(check_count, "optimizer_steps")
        self._check(check_count, "train_fit_steps", minimum=1)
        if not is_string(self.learning_fit_steps, DEPRECATED):
            self._check(check_count, "learning_fit_steps", minimum=1)
        if isinstance(self.learning_subset, str):
            if self.learning_subset != "auto":
                raise _param_error(self, "learning_subset", "'auto', None or an integer >= 2", self.learning_subset)
        else:
            self._check(check_count, "learning_subset", minimum=2, allow_none=True)
        if self.inference not in ("auto", "laplace", "ep", "sparse_ep"):
            raise _param_error(self, "inference", "a str among {'auto', 'laplace', 'ep', 'sparse_ep'}", self.inference)
        self._check(check_count, "num_inducing", minimum=1)
        self._check(check_count, "batch_size", minimum=1)
        if not is_string(self.learning_rate, "auto"):
            self._check(check_nonnegative, "learning_rate", positive=True)
        if self.max_time is not None:
            self._check(check_nonnegative, "max_time")
        if not (isinstance(self.standardize, bool) or is_string(self.standardize, "auto")):
            raise _param_error(self, "standardize", "True, False or 'auto'", self.standardize)
        self._check(check_flag, "verbose")
        if not is_string(self.optimize_hyperparameters, DEPRECATED):
            self._check(check_flag, "optimize_hyperparameters")
        self._check_device()

    def _check_device(self) -> None:
        """:raises ValueError: for a ``device`` torch does not know, or a CUDA device where none is available."""
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as error:
            raise _param_error(self, "device", "a torch device such as 'cpu' or 'cuda'", self.device) from error
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"The 'device' parameter of {type(self).__name__} is {self.device!r}, but torch finds no CUDA device "
                "(torch.cuda.is_available() is False): use device='cpu', or a CUDA build of torch on a machine with "
                "a GPU."
            )

    def _solver_settings(self, seed: int, num_points: int, num_latents: int, inference: str) -> tuple[dict, dict]:
        """The solver budget and the strategy's keyword arguments of this estimator's ``solver_options`` (and
        deprecated solver parameters), for ``num_points`` of ``num_latents`` latent values each
        (:func:`~gpytorch_iterncgp.learning.estimator_policy.solver_settings`)."""
        name = type(self).__name__
        train_fit_steps = renamed(
            name,
            "learning_fit_steps",
            "train_fit_steps",
            self.learning_fit_steps,
            self.train_fit_steps,
            SolverOptions.train_fit_steps,
            stacklevel=5,
        )
        former = {parameter: getattr(self, parameter) for parameter in FORMER_SOLVER_PARAMETERS}
        return solver_settings(
            name,
            self.solver_options,
            former,
            inference,
            num_points,
            num_latents,
            seed=seed,
            train_fit_steps=int(train_fit_steps),
            show_progress=bool(self.verbose),
            stacklevel=5,
        )

    def _learning_settings(self, inference: str) -> tuple[int, float]:
        """The learning's optimiser steps and learning rate in use: ``"auto"`` is the dense learning's
        (:class:`~gpytorch_iterncgp.LearningRecipe`'s ``optimizer_steps`` and ``learning_rate``) or, under
        ``"sparse_ep"``, the minibatch loop's (:class:`~gpytorch_iterncgp.MinibatchRecipe`'s ``max_steps`` and
        ``learning_rate``); the deprecated ``optimize_hyperparameters=False`` is ``optimizer_steps=0`` (a
        ``FutureWarning``).

        :raises ValueError: for ``optimize_hyperparameters`` beside an ``optimizer_steps`` given.
        """
        steps = self.optimizer_steps
        if not is_string(self.optimize_hyperparameters, DEPRECATED):
            name = type(self).__name__
            if not is_string(steps, "auto"):
                raise ValueError(
                    f"{name}: optimize_hyperparameters= is deprecated; give optimizer_steps= alone (0: no learning)."
                )
            warnings.warn(
                f"{name}: optimize_hyperparameters= is deprecated and will be removed in a future release; "
                "optimizer_steps=0 learns no hyperparameter (and 'auto', the default, learns them).",
                FutureWarning,
                stacklevel=4,
            )
            steps = "auto" if self.optimize_hyperparameters else 0
        sparse = inference == "sparse_ep"
        if is_string(steps, "auto"):
            steps = MinibatchRecipe.max_steps if sparse else LearningRecipe.optimizer_steps
        rate = self.learning_rate
        if is_string(rate, "auto"):
            rate = MinibatchRecipe.learning_rate if sparse else LearningRecipe.learning_rate
        return int(steps), float(rate)

    # -- fitting ---------------------------------------------------------------------------------
    def _convergence_hint(self, num_points: int, inference: str) -> str:
        """Appended to the fit's ``ConvergenceWarning``: nothing here (the classifier names a faster inference)."""
        return ""

    def _fit_model(self, X: np.ndarray, targets: torch.Tensor, likelihood, mean, inference: str) -> None:
        """Build the model, then :func:`~gpytorch_iterncgp.fit_mll`: learn the hyperparameters (optional; on
        ``learning_subset`` rows, stratified by class for classifiers) and fit the Laplace or EP (``inference``) posterior on all
        the data; set the fitted attributes. The learning's and the final fit's ``ConvergenceWarning`` are
        scikit-learn's.

        :raises ValueError: for a parameter the inference does not use, set away from its default.
        """
        X = self._standardized(X, fit=True)
        defaults = {name: p.default for name, p in inspect.signature(type(self).__init__).parameters.items()}
        check_parameters_apply(
            type(self).__name__, self.get_params(deep=False), defaults, inference, self.inference, len(X)
        )
        likelihood = likelihood.to(device=self._device, dtype=_DTYPE)  # its parameters, if any (not the model's)
        steps, rate = self._learning_settings(inference)
        learn = steps > 0
        num_latents = likelihood_adapter(likelihood).num_latents
        recipe = LearningRecipe(optimizer_steps=steps, learning_rate=rate)
        names, why = (
            auto_kernel_names(
                inference,
                learn,
                len(X),
                num_latents,
                self.learning_subset,
                recipe.min_validation_points,
                recipe.held_out_fraction,
            )
            if self._auto_kernel
            else ((), "")
        )
        self.kernel_choice_ = KernelChoice(names[0], names, why) if names else None
        if inference == "sparse_ep":
            self._fit_sparse_model(X, targets, likelihood, mean, names, why, recipe)
            return
        seed = int(check_random_state(self.random_state).randint(np.iinfo(np.int32).max))
        train_x = self._tensor(X)
        # kernel="auto": the model starts with the first candidate; fit_mll learns each, keeps the best held-out one
        kernel, candidates = self._starting_kernels(X.shape[1], names)
        self.inference_ = inference
        budget, options = self._solver_settings(seed, len(X), num_latents, inference)
        self.solver_budget_ = budget
        strategy_type = EPStrategy if inference == "ep" else IterNCGPStrategy
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # probe vectors of the matrix-free evidence, random actions
            model = _LatentGP(train_x, targets, likelihood, kernel, mean, strategy_type, options)
            model = model.to(device=self._device, dtype=_DTYPE)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                report = fit_mll(
                    evidence_class(model.variational_strategy)(likelihood, model),
                    max_time=self.max_time,
                    recipe=recipe,
                    learning_subset=self.learning_subset
                    if self.learning_subset in (None, "auto")
                    else int(self.learning_subset),
                    seed=seed,
                    show_progress=bool(self.verbose),
                    kernels=candidates,
                )
        limit_note = _step_limit_note(type(self).__name__, report.fit_report, model.variational_strategy)
        _reemit_as_scikit_learn(caught, limit_note, self._convergence_hint(len(X), inference))
        self.learning_rows_ = None if report.learning_rows is None else np.asarray(report.learning_rows)
        self.validation_rows_ = None if report.validation_rows is None else np.asarray(report.validation_rows)
        self.loss_curve_ = report.losses
        self.learning_report_ = report
        if candidates is not None:
            assert report.kernel is not None
            self.kernel_choice_ = KernelChoice(report.kernel, names, why, report.validation_points)
        self.fit_report_ = report.fit_report
        self.fit_report_.budget = budget
        self.model_, self.likelihood_, self.kernel_ = model, likelihood, model.covar_module
        self.feature_lengthscales_ = self._feature_lengthscales()


# ---------------------------------------------------------------------------------------------------
# Classifier
# ---------------------------------------------------------------------------------------------------
class IterNCGPClassifier(ClassifierMixin, _IterNCGPEstimator):
    r"""Gaussian process classification by IterNCGP: the Laplace approximation (Newton steps) or expectation
    propagation (EP sweeps), each step's GP regression solved by IterGP.

    Binary: one latent function, Bernoulli likelihood with the ``link`` (``"logit"`` or ``"probit"``).
    Multi-class (more than two labels): one latent function per class and one kernel shared by all classes, with the
    softmax likelihood (the multi-class logit link) under Laplace, or the multinomial probit (Riihimäki et al. 2013)
    under EP; ``link="probit"`` with Laplace is refused there.
    Labels can be of any type; they are mapped to ``classes_`` (sorted) as scikit-learn does.

    :param kernel: ``"auto"`` (default), ``None`` or a GPyTorch kernel (not fitted in place: a deep copy is fitted
        and stored as ``kernel_``; with ``batch_shape=[n_classes]``, one independent GP per class). ``None``:
        :func:`~gpytorch_iterncgp.learning.estimator_policy.default_kernel`, ``ScaleKernel(MaternKernel(nu=2.5))``,
        lengthscale :math:`\sqrt{D}`, outputscale 1 (meant for standardised features). ``"auto"``: that Matérn, a
        linear kernel plus it, or the Matérn of the features warped by a learnt monotone map each (``"linear+matern"``
        and ``"warped_matern"`` of :func:`~gpytorch_iterncgp.kernels.family.kernel_family`), each learnt by
        type-II maximum likelihood on :math:`\lfloor\sqrt{10^6/C}\rfloor` of the learning rows and chosen by the
        log-loss (counts: the Poisson deviance) of the held-out rows, the chosen one then learnt on all the learning
        rows (:func:`~gpytorch_iterncgp.fit_mll`'s ``kernels=`` with ``select_by="held_out"``; why, and its cost:
        ``docs/design_notes.md``, "``kernel="auto"`` is the estimators' default"); under ``"sparse_ep"`` each is
        learnt by dense EP on :math:`\lfloor\sqrt{10^6/C}\rfloor` rows and scored on as many others, and stochastic
        EP learns the chosen one; the Matérn alone,
        fitted exactly as ``None``, where nothing is held out to choose by (data within the learning subset) or nothing
        is learnt (:func:`~gpytorch_iterncgp.learning.estimator_policy.auto_kernel_names`).
        ``kernel_choice_`` says which and why; the candidates' scores are in ``learning_report_`` (``kernel``,
        ``kernel_scores``).
    :param standardize: ``True``: centre the features and scale them to unit variance on the training rows before the
        kernel sees them (scikit-learn's ``StandardScaler``, kept as ``scaler_`` and applied to every later ``X``; a
        constant feature is centred only), as the package's kernels' initial lengthscales assume: features on any
        scale then fit as standardised ones do. ``False``: the features as given. ``"auto"`` (default): ``True`` for
        the package's kernels (``kernel="auto"`` or ``None``), ``False`` for a GPyTorch kernel of your own (its
        hyperparameters in the features' units).
    :param link: ``"logit"`` (default, also ``None``) or ``"probit"``: binary data's link (multi-class data: see
        above).
    :param inference: ``"laplace"``, ``"ep"``, ``"sparse_ep"`` (stochastic EP with inducing inputs on minibatches,
        see ``num_inducing``) or ``"auto"`` (default:
        :func:`~gpytorch_iterncgp.learning.estimator_policy.auto_inference`: dense EP,
        :data:`~gpytorch_iterncgp.learning.estimator_policy.CLASSIFIER_INFERENCE`, chosen by measurement,
        ``benchmarks/learned.py`` and ``benchmarks/sklearn_defaults.py``, up to :math:`1.5 \cdot 10^4` points and, for
        :math:`C > 2` classes, :math:`N C \le 8 \cdot 10^4` and :math:`N C^3 \le 4 \cdot 10^7`, then stochastic EP,
        ``benchmarks/auto_switch.py``). EP matches the moments of each
        likelihood factor instead of the curvature at the mode: better calibrated predictive probabilities, at the
        cost of tilted moments per sweep (nested EP for the multinomial probit). A parameter the inference in use
        does not read (the dense solver's and learning's under ``"sparse_ep"``, ``num_inducing`` and ``batch_size``
        under dense inference), set away from its default, is refused with a ``ValueError``. The hyperparameters are learnt on
        Laplace's evidence (:class:`~gpytorch_iterncgp.LaplaceMarginalLogLikelihood`) for either inference
        (:attr:`LearningRecipe.evidence <gpytorch_iterncgp.learning.recipe.LearningRecipe.evidence>`: its Newton fits
        converge in a few steps where EP's sweeps take tens, and EP's posterior at Laplace's kernel predicts as well
        as at its own, ``docs/design_notes.md``), and the posterior at them is EP's. Where the kernel was learnt on a subset, the
        outputscale is then chosen among the learnt one times ``outputscale_factors``, and past the grid's edge while
        the edge wins (``outputscale_extensions``; :class:`~gpytorch_iterncgp.LearningRecipe`), by the log-loss of
        held-out training rows (``validation_rows_``: the learnt outputscale can be far from the predictive's best). This is
        :func:`~gpytorch_iterncgp.fit_mll`'s recipe; what was used is ``inference_`` and ``learning_report_``.
    :param solver_options: the dense solver's options (``inference`` ``"laplace"`` or ``"ep"``), a dict by the names
        of the strategy's options (:class:`~gpytorch_iterncgp.SolverOptions` for Laplace, EP's ``EPOptions``;
        :func:`~gpytorch_iterncgp.learning.estimator_policy.solver_option_names`), each replacing the estimator's
        choice for that option alone; ``None`` (default): the estimator's choices. What a practitioner tunes here:

        * ``"policy"``: IterGP's actions, ``"cg"`` (conjugate gradients), ``"unit"`` (a random subset of the data per
          iteration, seeded by ``random_state``), a :class:`~gpytorch_iterncgp.Policy`, or ``"auto"`` (the default):
          ``"unit"`` where ``"max_solver_iterations"`` ``"auto"`` solves exactly (below), ``"cg"`` otherwise.
        * ``"max_solver_iterations"``: IterGP iterations (products with the kernel matrix) per Newton step (EP
          sweep); ``None``: until the residual is below the tolerances. ``"auto"`` (the default):
          :func:`~gpytorch_iterncgp.learning.estimator_policy.solver_budget`'s rule. With :math:`N C` latent values
          (:math:`C = 1` for binary data, the number of classes otherwise), :math:`N C \le`
          :data:`~gpytorch_iterncgp.learning.thresholds.EXACT_SOLVE_SIZE` (1000): the **exact posterior**, every
          solve taking unit-vector actions until the approximate precision :math:`\mathbf C` has full rank (the
          posterior mean *and* covariance without computational uncertainty; the first Newton step costs :math:`N C`
          products with the kernel matrix, later steps and refits reuse the recycled actions). Above it: CG, at most
          :data:`~gpytorch_iterncgp.learning.estimator_policy.DEFAULT_SOLVER_ITERATIONS` iterations per Newton step
          (the predictive variance then includes the computational uncertainty of the stopped solver); binary EP past
          :data:`~gpytorch_iterncgp.learning.thresholds.EP_POINTS_PER_BUDGET` (10 000) points:
          :data:`~gpytorch_iterncgp.learning.estimator_policy.DEFAULT_SOLVER_ITERATIONS` per sweep for every 10 000
          points, rounded up (its cavities take the marginal variances; with fewer the sweeps diverged at 2·10⁴
          binary points). What was used is ``solver_budget_``.
        * ``"abs_tol"``, ``"rel_tol"``: IterGP stops a step where the residual norm is below
          ``max(abs_tol, rel_tol * ||b||)``; the estimator's are 1e-5 (0 for the exact solves above).
        * ``"max_newton_steps"`` (Laplace), ``"max_sweeps"`` (EP): the most steps of a fit; ``None`` (the default):
          until it converges, or stalls with a warning.
        * ``"outer_tol"`` (Laplace: the representer weights' relative change), ``"site_tol"`` and ``"marginal_tol"``
          (EP: the sites' largest change, the marginals' mean movement in nats per latent value, 1e-3, and 1e-5
          with the exact solves, ``EXACT_MARGINAL_TOL``): when a fit has converged.
        * ``"compression_rank"`` (recycled actions kept between steps, ``None``: all), ``"preconditioner_rank"`` (the
          low-rank factor of the kernel that preconditions CG, :mod:`~gpytorch_iterncgp.core.preconditioner`, 0:
          none), ``"recycle"``, ``"covariance_iterations"`` (blocks of the covariance phase after the final fit,
          :mod:`gpytorch_iterncgp.core.covariance`: Laplace's 5, EP's 0; not run while the hyperparameters are
          learnt, run in the held-out outputscale choice's fits).

        A key that is no option of the inference's strategy is refused, naming its options; ``train_fit_steps``,
        the seed and the progress bar are the estimator's own parameters (``train_fit_steps``, ``random_state``,
        ``verbose``).
    :param optimizer_steps: ``"auto"`` (default): 25 under dense inference (:class:`~gpytorch_iterncgp.LearningRecipe`),
        2000 minibatch steps under ``"sparse_ep"`` (:class:`~gpytorch_iterncgp.MinibatchRecipe`'s ``max_steps``);
        ``0``: the kernel's hyperparameters are not learnt (the posterior is fitted at the kernel given; stochastic EP
        still runs its default steps, for the sites). Otherwise the hyperparameters are learnt by maximising
        Laplace's evidence (type-II maximum likelihood, as scikit-learn's ``GaussianProcessClassifier``; for EP too,
        which then fits at them). Where the evidence is exact and deterministic (:math:`N C \le`
        ``gpytorch_iterncgp.settings.exact_evidence_size``, 1000): the **maximum number of L-BFGS iterations**
        (strong-Wolfe line search; it stops earlier when the gradient or the change of the evidence vanishes, and
        may evaluate the evidence up to 1.25 times per iteration). Above it (log-determinant estimated
        stochastically, where a line search is unreliable): the number of Adam steps. Every evaluation
        continues the posterior from the previous one (mode or sites, and the recycled actions). Under
        ``"sparse_ep"``: the minibatch loop's steps (Adam on SEP's energy, ``max_time`` may stop it earlier).
    :param learning_rate: Adam's learning rate: ``"auto"`` (default): 0.2 under dense inference (above
        ``exact_evidence_size`` only; L-BFGS takes unit steps scaled by its line search), 0.01 under ``"sparse_ep"``
        (annealed by :class:`~gpytorch_iterncgp.MinibatchRecipe`'s cosine schedule).
    :param train_fit_steps: with Adam, the Newton steps (EP sweeps) each evaluation of the evidence runs on from
        the previous posterior (the strategy's option of that name; at most its ``train_compression_rank``, 20,
        recycled actions are kept): the posterior follows the hyperparameters loosely, and the final fit
        converges it. L-BFGS refits whole at each evaluation (its line search needs converged
        values).
    :param learning_subset: the number of training points the hyperparameters are learnt on: a random subset, drawn
        with ``random_state`` and stratified by class (every class keeps its share), whose evidence is maximised before
        the posterior is fitted on all the data at the learnt hyperparameters (subset-of-data type-II maximum likelihood,
        R&W §8.3.3). ``"auto"`` (default): :math:`M = \lfloor \sqrt{10^7 / C} \rfloor` points
        (:data:`~gpytorch_iterncgp.learning.thresholds.LEARNING_SUBSET_COST`: 1000 points for 10 classes, 3162 for binary data), chosen by measurement (``docs/design_notes.md``, "Subset-of-data learning"): each
        evidence evaluation costs :math:`O(M^2 C)` instead of :math:`O(N^2 C)`, and at :math:`N = 5000` the kernel
        learnt on 1000 points predicted better on average over data seeds than those learnt on 500 or 2000. Data
        within :math:`M` plus 100 rows: all but a fifth of the rows, the fifth held out (``validation_rows_``) where it
        is at least 100 rows (:func:`~gpytorch_iterncgp.learning.rows.auto_learning_size`), else all the rows.
        ``None``: all the data, nothing held out. The rows used are ``learning_rows_``.
    :param num_inducing: ``inference="sparse_ep"`` only: the inducing inputs of stochastic EP
        (:class:`~gpytorch_iterncgp.StochasticEPStrategy`), started at k-means centres of ``X`` and learnt with the
        kernel; ``inference="sparse_ep"`` runs :func:`~gpytorch_iterncgp.fit_mll`'s minibatch loop (Adam on SEP's
        energy, ``optimizer_steps`` steps at ``learning_rate``, annealed by
        :class:`~gpytorch_iterncgp.MinibatchRecipe`'s schedule) until its steps or ``max_time``, with memory
        :math:`O(C M^2)` whatever :math:`N`; it has no ``log_marginal_likelihood()``.
    :param batch_size: ``inference="sparse_ep"`` only: points per minibatch.
    :param max_time: seconds for learning the hyperparameters (``None``: no limit); learning stops after the evidence
        evaluation running when they have passed, keeping the best hyperparameters seen, and the final fit follows.
    :param random_state: seeds the unit-vector policy and the probe vectors of the matrix-free evidence
        (the global torch RNG is left as it was).
    :param device: where the model's tensors live and the fit and predictions compute (a torch device: ``"cpu"``,
        ``"cuda"``, ``"cuda:1"``, as skorch's estimators take it); inputs and outputs stay numpy arrays. Float64 on
        every device. A CUDA device torch cannot find is refused at ``fit``.
    :param verbose: a progress bar per phase: learning, the outputscale, the final fit
        (:func:`~gpytorch_iterncgp.fit_mll`).
    :param learning_fit_steps: the deprecated name of ``train_fit_steps`` (a ``FutureWarning``).
    :param optimize_hyperparameters: deprecated (a ``FutureWarning``): ``False`` is ``optimizer_steps=0``.
    :param policy: deprecated (a ``FutureWarning``), as are ``max_newton_steps``, ``max_solver_iterations``,
        ``compression_rank``, ``preconditioner_rank``, ``covariance_iterations``, ``recycle``, ``outer_tol`` and
        ``solver_tol``: each is the ``solver_options`` key of its name, but ``max_newton_steps`` and ``outer_tol`` are
        EP's ``"max_sweeps"`` and ``"site_tol"`` (with ``"marginal_tol": None``) under EP and ``solver_tol`` is
        ``"abs_tol"`` and ``"rel_tol"``.

    Fitted attributes: ``classes_``, ``n_classes_``, ``n_features_in_`` (``feature_names_in_``), ``scaler_`` (the
    fitted ``StandardScaler``, or ``None`` where ``standardize=False``), ``feature_lengthscales_`` (``(D,)``: the fitted
    kernel's lengthscales in the units of the features given, where it has one or one per feature on them; ``None``
    otherwise), ``inference_``
    (``"laplace"``, ``"ep"`` or ``"sparse_ep"``), ``model_`` (the GPyTorch ``ApproximateGP``; ``model_.variational_strategy`` is the
    :class:`~gpytorch_iterncgp.IterNCGPStrategy` or :class:`~gpytorch_iterncgp.EPStrategy`), ``likelihood_``, ``kernel_`` (the fitted kernel),
    ``kernel_choice_`` (with ``kernel="auto"``: a :class:`~gpytorch_iterncgp.learning.estimator_policy.KernelChoice`,
    the kernel's name, the candidates, why and on how many held-out points, ``str()`` a sentence; ``None`` otherwise),
    ``learning_rows_`` (the rows of ``X`` the hyperparameters were learnt on, or ``None``: all), ``validation_rows_``
    (the rows held out from learning, where the kernel was learnt on a subset: the outputscale and the kernel are
    chosen on them and the learnt model is checked against a constant predictor, with a
    :class:`~gpytorch_iterncgp.WorseThanConstantWarning` where it predicts them worse; or ``None``),
    ``fit_report_`` (the final :class:`~gpytorch_iterncgp.FitReport`, its ``budget`` the ``solver_budget_``), ``learning_report_`` (a :class:`LearningReport`: the kernel choice, evidence evaluations, seconds in fits, evidence and gradients, why it stopped, the outputscale's factor and the check against a constant predictor; its text says them), ``loss_curve_`` (``-evidence / n``
    at every evaluation of the evidence: L-BFGS iterations and line-search trials, or Adam steps), ``solver_budget_`` (a dict: the ``policy``, ``max_solver_iterations`` and ``solver_tol``
    (both tolerances) the estimator's rule gave the strategy, ``exact``: whether every solve ran to full rank, and the ``rule`` that chose them).
    """

    _links = ("logit", "probit")

    def _convergence_hint(self, num_points: int, inference: str) -> str:
        """Where dense EP was asked for past :func:`~gpytorch_iterncgp.learning.estimator_policy.auto_inference`'s
        switch, the inference ``"auto"`` would pick."""
        if inference == "ep" and auto_inference(num_points, self.n_classes_) == "sparse_ep":
            return (
                f" With {num_points} training points of {self.n_classes_} classes, inference='auto' picks 'sparse_ep' "
                "(stochastic EP with inducing inputs): faster here, and dense EP's computation-aware sweeps can "
                "diverge at this size."
            )
        return ""

    def fit(self, X, y):
        """Fit the Laplace or EP posterior (and, optionally, the kernel hyperparameters) to ``X`` ``(n, d)``, ``y``
        ``(n,)``."""
        self._validate_params()
        X, y = validate_data(self, X, y, dtype=np.float64)
        check_classification_targets(y)
        self.classes_, encoded = np.unique(y, return_inverse=True)
        self.n_classes_ = len(self.classes_)
        if self.n_classes_ < 2:
            raise ValueError(
                f"{type(self).__name__} requires samples of at least 2 classes in the data; got 1 class "
                f"({self.classes_[0]!r})."
            )
        inference = self.inference
        if inference == "auto":
            inference = auto_inference(len(X), self.n_classes_)
        if self.n_classes_ == 2:
            likelihood = (
                LogitBernoulliLikelihood() if self._link == "logit" else gpytorch.likelihoods.BernoulliLikelihood()
            )
        elif inference in ("ep", "sparse_ep"):
            likelihood = MultinomialProbitLikelihood(num_classes=self.n_classes_)
        elif self._link == "probit":
            raise ValueError(
                f"Laplace's multi-class likelihood is the softmax, not a probit; y has {self.n_classes_} classes. Use "
                "link='logit' (softmax), or inference='ep' (multinomial probit)."
            )
        else:
            likelihood = gpytorch.likelihoods.SoftmaxLikelihood(num_classes=self.n_classes_, mixing_weights=False)
        targets = self._tensor(encoded)
        mean = gpytorch.means.ZeroMean(batch_shape=self._kernel_batch_shape())
        self._fit_model(X, targets, likelihood, mean, inference)
        return self

    def predict_proba(self, X, return_std=False):
        """Predictive class probabilities ``(n, n_classes)``, columns in the order of ``classes_``.

        Binary probit: exact :math:`\\Phi(\\mu / \\sqrt{1 + \\sigma^2})`; binary logit:
        :math:`\\mathbb E[\\sigma(f)]` by quadrature (to about 1e-13); multi-class:
        :math:`\\mathbb E[\\operatorname{softmax}(\\mathbf f)]` by Monte Carlo with fixed base samples under each
        point's full :math:`C \\times C` latent covariance (see :meth:`~gpytorch_iterncgp.IterNCGPStrategy.predictive_mean`).
        The latent posterior includes the computational uncertainty of a stopped solver.

        :param return_std: also return the standard deviation of the latent function(s): ``(n,)`` for
            binary, ``(n, n_classes)`` for multi-class data (see :meth:`predict_latent` for the mean too).
        :return: ``proba`` or ``(proba, latent_std)``.
        """
        inputs = self._validated_test_inputs(X)
        strategy = self.model_.variational_strategy
        if return_std:

            def function(x):
                if self.n_classes_ == 2:
                    mean, variance = (t[:, 0] for t in strategy.marginal_latent(x))
                    return strategy.adapter.predictive_mean(mean, variance), variance.sqrt()
                mean, covariance = strategy.marginal_latent_blocks(x)
                std = covariance.diagonal(dim1=-2, dim2=-1).sqrt()
                return strategy.adapter.predictive_mean(mean, covariance), std

            probabilities, std = self._chunked(function, inputs)
        else:
            (probabilities,) = self._chunked(strategy.predictive_probabilities, inputs)
        probabilities = probabilities.cpu().numpy()
        if self.n_classes_ == 2:
            probabilities = np.stack([1 - probabilities, probabilities], axis=1)
        if return_std:
            return probabilities, std.cpu().numpy()
        return probabilities

    def predict(self, X):
        """The most probable class of each row of ``X`` (labels from ``classes_``)."""
        probabilities = self.predict_proba(X)
        return self.classes_[np.argmax(probabilities, axis=1)]

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        # multi-class data: the softmax (Laplace, link "logit") or the multinomial probit (EP)
        # ("auto" picks EP or stochastic EP for a classifier, never Laplace: auto_inference)
        tags.classifier_tags.multi_class = self._link != "probit" or self.inference != "laplace"
        return tags


# ---------------------------------------------------------------------------------------------------
# Poisson regressor
# ---------------------------------------------------------------------------------------------------
class IterNCGPPoissonRegressor(RegressorMixin, _IterNCGPEstimator):
    r"""Gaussian process regression of counts by IterNCGP: :math:`y \sim \operatorname{Poisson}(\lambda(f(x)))`.

    ``link="exp"`` (default, also ``None``): :math:`\lambda = e^f`; ``link="softplus"``: :math:`\lambda = \log(1 + e^f)`.
    The prior mean of :math:`f` is a constant, started at :math:`\lambda^{-1}(\bar y)` and learnt with the
    kernel (unless ``optimizer_steps=0``). Targets must be non-negative; non-integer ones (rates,
    averages) are accepted as scikit-learn's ``PoissonRegressor`` does, with the Poisson quasi-likelihood
    :math:`y \log\lambda - \lambda - \log\Gamma(y + 1)` (:class:`~gpytorch_iterncgp.QuasiExpPoissonLikelihood`,
    :class:`~gpytorch_iterncgp.QuasiSoftplusPoissonLikelihood`; derivatives by autograd instead of the closed form).

    ``predict`` gives the expected count :math:`\mathbb E[y_*]` (:math:`e^{\mu + \sigma^2/2}` for the exp
    link, Gauss–Hermite quadrature for softplus); ``predict(X, return_std=True)`` also the standard
    deviation of the latent :math:`f` (log rate for the exp link), as scikit-learn's
    ``GaussianProcessRegressor`` returns that of its latent function; :meth:`predict_latent` gives both
    moments of :math:`f`. ``score`` is :math:`D^2`, the fraction of Poisson deviance explained (as in
    ``PoissonRegressor``).

    Parameters and fitted attributes as :class:`IterNCGPClassifier` (without ``classes_``); ``inference="auto"`` is
    Laplace here, and ``inference="ep"`` needs integer counts (EP's tilted moments are the Poisson likelihood's).
    """

    _links: tuple[str, ...] = ("exp", "softplus")

    def fit(self, X, y):
        """Fit the Laplace posterior (and, optionally, hyperparameters) to ``X`` ``(n, d)`` and counts ``y`` ``(n,)``."""
        self._validate_params()
        X, y = validate_data(self, X, y, dtype=np.float64, y_numeric=True)
        if np.any(y < 0):
            raise ValueError(
                f"Some value(s) of y are negative (min {y.min():g}): {type(self).__name__} models non-negative "
                "counts with a Poisson likelihood."
            )
        integer = bool(np.all(y == np.round(y)))
        inference = REGRESSOR_INFERENCE if self.inference == "auto" else self.inference
        likelihood = self._count_likelihood(integer, inference)
        # Prior mean of f: the inverse link of the (smoothed) mean count.
        rate = max(float(y.mean()), 0.5 / len(y))
        offset = math.log(rate) if self._link == "exp" else rate + math.log(-math.expm1(-rate))
        mean = gpytorch.means.ConstantMean(batch_shape=self._kernel_batch_shape()).to(_DTYPE)
        with torch.no_grad():
            mean.constant.fill_(offset)
        self._fit_model(X, self._tensor(y), likelihood, mean, inference)
        return self

    def _count_likelihood(self, integer: bool, inference: str) -> gpytorch.likelihoods.Likelihood:
        """The Poisson likelihood of the ``link``; for non-integer targets its quasi-likelihood (Laplace only).

        :raises ValueError: for non-integer targets under EP.
        """
        if inference in ("ep", "sparse_ep") and not integer:
            raise ValueError(
                f"{type(self).__name__}(inference='ep') needs integer counts (EP's tilted moments are those of the "
                "Poisson likelihood); y has non-integer values. Use inference='laplace' (the quasi-likelihood)."
            )
        if self._link == "exp":
            return ExpPoissonLikelihood() if integer else QuasiExpPoissonLikelihood()
        return gpytorch.likelihoods.PoissonLikelihood() if integer else QuasiSoftplusPoissonLikelihood()

    def _predictive_mean(self, mean: torch.Tensor, variance: torch.Tensor) -> torch.Tensor:
        closed_form = ExpPoissonLikelihood() if self._link == "exp" else gpytorch.likelihoods.PoissonLikelihood()
        return likelihood_adapter(closed_form).predictive_mean(mean, variance)

    def predict(self, X, return_std=False):
        """Expected counts :math:`\\mathbb E[y_*]` ``(n,)``; with ``return_std`` also the latent std ``(n,)``."""
        inputs = self._validated_test_inputs(X)
        mean, variance = self._latent(inputs)
        expected = self._predictive_mean(mean[:, 0], variance[:, 0]).cpu().numpy()
        if return_std:
            return expected, variance[:, 0].sqrt().cpu().numpy()
        return expected

    def score(self, X, y, sample_weight=None):
        """:math:`D^2`: the fraction of Poisson deviance explained by ``predict(X)`` (1 is best)."""
        return d2_tweedie_score(y, self.predict(X), sample_weight=sample_weight, power=1)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.positive_only = True
        return tags


# ---------------------------------------------------------------------------------------------------
# Negative binomial regressor
# ---------------------------------------------------------------------------------------------------
class IterNCGPNegativeBinomialRegressor(IterNCGPPoissonRegressor):
    r"""Gaussian process regression of overdispersed counts by IterNCGP Laplace:
    :math:`y \sim \operatorname{NegBin}(\text{mean } e^{f(x)}, \text{dispersion } r)`, variance
    :math:`e^f + e^{2f} / r` (:class:`~gpytorch_iterncgp.NegativeBinomialLikelihood`).

    Where the counts vary more than a Poisson's mean allows (visits, claims, species counts), a Poisson likelihood
    explains the excess only by a rougher latent function, and its evidence rewards that; here the dispersion
    :math:`r` is learnt with the kernel by the Laplace evidence instead (fitted as ``dispersion_``; :math:`r \to
    \infty` is the Poisson model) (``docs/design_notes.md``, "Overdispersed counts get their own likelihood").

    Parameters, predictions (``predict`` is :math:`\mathbb E[y_*] = e^{\mu + \sigma^2/2}`, ``score`` the fraction
    of Poisson deviance explained) and fitted attributes as :class:`IterNCGPPoissonRegressor`, with ``link="exp"``
    only, integer counts and Laplace inference (``inference="auto"`` or ``"laplace"``: the package has no EP tilted
    moments for it).
    """

    _links = ("exp",)

    def _count_likelihood(self, integer: bool, inference: str) -> gpytorch.likelihoods.Likelihood:
        """:class:`~gpytorch_iterncgp.NegativeBinomialLikelihood`, its dispersion started at 1.

        :raises ValueError: for non-integer targets, or an inference other than Laplace.
        """
        if not integer:
            raise ValueError(
                f"{type(self).__name__} models integer counts; y has non-integer values. For rates or averages use "
                "IterNCGPPoissonRegressor (the Poisson quasi-likelihood)."
            )
        if inference != "laplace":
            raise ValueError(
                f"{type(self).__name__}(inference={inference!r}): the negative binomial likelihood is fitted by Laplace "
                "only (the package has no EP tilted moments for it); use inference='auto' or 'laplace'."
            )
        return NegativeBinomialLikelihood()

    def fit(self, X, y):
        """Fit the Laplace posterior, the kernel hyperparameters and the dispersion (unless ``optimizer_steps=0``)
        to ``X`` ``(n, d)`` and integer counts ``y`` ``(n,)``; ``dispersion_`` is the fitted :math:`r`."""
        super().fit(X, y)
        self.dispersion_ = float(self.likelihood_.dispersion.detach())
        return self
