r"""The GPyTorch-facing layer: :class:`IterNCGPStrategy` (Laplace) and :class:`EPStrategy` (expectation
propagation) replace a ``VariationalStrategy``; both are an IterGP strategy (:class:`_IterGPStrategy`) with their own outer loop.

.. code-block:: python

    class Model(gpytorch.models.ApproximateGP):
        def __init__(self, train_x, train_y, likelihood):
            strategy = IterNCGPStrategy(self, train_x, train_y, likelihood, policy="cg")
            super().__init__(strategy)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5))

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    model = Model(train_x, train_y, likelihood)
    report = model.variational_strategy.fit()
    model.eval()
    latent = model(test_x)   # Laplace posterior incl. computational uncertainty

The posterior at inputs :math:`\mathbf X_*` is

.. math::
    \mathbf m(\mathbf X_*) + \mathbf K_{*X} \mathbf a, \qquad
    \mathbf K_{**} - \mathbf K_{*X} \mathbf Q \mathbf Q^\top \mathbf K_{X*},

where :math:`\mathbf a` are the representer weights of the (approximate) mode and
:math:`\mathbf C = \mathbf Q \mathbf Q^\top` is IterGP's approximate precision: the covariance is wider than
the exact Laplace covariance by exactly the error of having stopped the solver early.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from linear_operator.operators import LinearOperator, MatmulLinearOperator
from torch import Tensor

from ..core.memory import retained_allocations
from ..core.policies import Policy, UnitVectorPolicy, make_policy
from ..core.precision import LowRankPrecision
from ..core.preconditioner import KernelPreconditioning, LowRankKernelFactor
from ..core.prior import LatentPrior
from ..core.sharding import RowBlock, RowShardedKernel
from ..core.solver import IterGPOptions, RegressionState
from ..core.state import fingerprint_matches, parameter_fingerprint
from ..ep.sweeps import EPOptions, EPState, ExpectationPropagation
from ..laplace.newton import DampedNewton, LaplaceState, SolverOptions
from .base import exact_regime
from .predictive import PredictiveStrategy, warn_lost_variance


class _IterGPStrategy(PredictiveStrategy):
    r"""What IterNCGP (Laplace) and EP share: an outer loop of GP regressions solved by IterGP with a policy, and the
    posterior of such a regression for predictions.

    A subclass sets :attr:`_state_type` (a :class:`~gpytorch_iterncgp.core.solver.RegressionState`), its options
    (:attr:`_options_type`) and its outer loop (:attr:`_loop_type`); the posterior at inputs :math:`\mathbf X_*` is
    :math:`\mathbf m(\mathbf X_*) + \mathbf K_{*X} \mathbf a` and
    :math:`\mathbf K_{**} - \mathbf K_{*X} \mathbf Q \mathbf Q^\top \mathbf K_{X*}` for either.

    :param policy: ``"cg"``, ``"unit"`` or a :class:`Policy`; its position is committed with the state.
    :param seed: seed of the unit-vector policy's random order.
    :param options: by name, the fields of the subclass's options dataclass (:attr:`_options_type`:
        :class:`~gpytorch_iterncgp.SolverOptions`, :class:`~gpytorch_iterncgp.ep.sweeps.EPOptions`), its defaults for
        the others; :meth:`fit` overrides them by the same names.
    (The other parameters: :class:`~gpytorch_iterncgp.strategies.base.OuterLoopStrategy`.)
    """

    _state_type: Any = RegressionState
    _options_type: Any = IterGPOptions  # the dataclass of the strategy's options (every constructor keyword option)
    _loop_type: Any = None  # the outer loop: (prior, adapter, targets, options, policy) -> OuterLoop
    options: SolverOptions | EPOptions

    def __init__(
        self, model, train_inputs, train_targets, likelihood, policy: str | Policy = "cg", *, seed: int = 0, **kwargs
    ):
        made = make_policy(policy, seed)  # its position is committed with the state (the companion)
        super().__init__(model, train_inputs, train_targets, likelihood, companion=made, **kwargs)
        # the last fit's preconditioning and the fingerprint of the hyperparameters it was built at
        self._preconditioning: tuple[Tensor, KernelPreconditioning] | None = None
        # model(train_x)'s prior for the evidence (kernel matrix evaluated with its graph) and its fingerprint
        self._evidence_prior: tuple[Tensor, LatentPrior] | None = None

    @property
    def policy(self) -> Policy:
        """The policy of every solve; its position is committed with the state."""
        return self._committed.companion  # type: ignore[return-value]

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self._committed.companion = policy

    def _loose_fit_options(self) -> dict[str, Any]:
        """A loose fit in train mode where the evidence is estimated: at most the options' ``train_fit_steps`` steps
        (within the step limit), at most ``train_compression_rank`` recycled actions, no covariance phase
        (:class:`~gpytorch_iterncgp.core.outer_loop.TrainModeFits`)."""
        options = self.options
        steps = options.train_fit_steps
        if steps is None or exact_regime(self):
            return {}
        rank, current = options.train_compression_rank, options.compression_rank
        limit = getattr(options, self.max_steps_option)
        return {
            self.max_steps_option: steps if limit is None else min(steps, limit),
            "compression_rank": current if rank is None else min(rank, current or rank),
            "covariance_iterations": 0,
        }

    def _rows_block(self) -> RowBlock:
        """The rows of the state's matrices this process holds: this rank's where a
        :class:`~gpytorch_iterncgp.distributed.ShardedKernel` with ``shard_state`` holds them by rows; all of them
        otherwise (one process, or state replicated: :meth:`RowBlock.single`)."""
        sharded = next((module for module in self.model.modules() if isinstance(module, RowShardedKernel)), None)
        if sharded is None:
            return RowBlock.single(self.num_data, self.num_latents)
        return sharded.row_block(self.num_data, self.num_latents)

    def _state_to_save(self) -> Any:
        r"""The committed state with all rows of :math:`\mathbf Q`, :math:`\mathbf K \mathbf Q`, :math:`\mathbf S` and
        :math:`\mathbf K \mathbf S`: gathered where a :class:`~gpytorch_iterncgp.distributed.ShardedKernel` with
        ``shard_state`` holds them by rows (so ``state_dict()`` is a collective there, and loads into any number of
        processes)."""
        return self._committed.state.with_full_rows(self._rows_block())

    # -- fitting ---------------------------------------------------------------------------------
    def train_prior(self) -> LatentPrior:
        """The model's prior at the training inputs (with gradients where autograd records them): the evidence's of
        the last ``model(train_x)`` in train mode where the hyperparameters are unchanged (:meth:`evidence_prior`), a
        new one otherwise."""
        held = self._evidence_prior
        if held is not None and fingerprint_matches(self._fingerprint(), held[0]):
            return held[1]
        return self._new_train_prior()

    def _new_train_prior(self) -> LatentPrior:
        """A new prior at the training inputs (its kernel matrix not evaluated yet)."""
        return LatentPrior.from_distribution(self.model.forward(self.train_inputs), self.num_latents)

    def _fingerprint(self) -> Tensor:
        return parameter_fingerprint(self._fingerprint_tensors(), self.train_inputs)

    def _hold_evidence_prior(self) -> None:
        r"""``model(train_x)`` in train mode with autograd on: a new prior at the training inputs, its kernel matrix
        evaluated once with its graph where products would cache it (:meth:`LatentPrior.cache_kernel`), held for the
        fit that follows (which reads its values) and the evidence (which differentiates it, :meth:`evidence_prior`),
        so that one evaluation of :math:`\mathbf K` serves both."""
        prior = self._new_train_prior()
        self._evidence_prior = (self._fingerprint(), prior) if prior.cache_kernel() else None

    def evidence_prior(self) -> LatentPrior:
        """The prior the evidence differentiates: :meth:`train_prior`, which is then no longer held (a second evidence
        at the same hyperparameters evaluates its own: the graph of the first is freed by its backward pass)."""
        prior = self.train_prior()
        self._evidence_prior = None
        return prior

    def _prior_for_fit(self) -> LatentPrior:
        """:meth:`train_prior`, checked, where a
        :class:`~gpytorch_iterncgp.distributed.ShardedKernel` holds the state by rows, that its covariance is that
        kernel's evaluation.

        :raises ValueError: where the model holds a ``ShardedKernel(..., shard_state=True)`` but ``forward`` returns a
            covariance built from it (a sum of Kronecker products, an indexed batch): its products are not split by
            rows, so the loops would hold all rows while the policy and the predictions take this rank's.
        """
        prior = self.train_prior()
        if self._rows_block().is_sharded and not prior.rows.is_sharded:
            raise ValueError(
                "ShardedKernel(..., shard_state=True) holds the state by rows only as the model's covariance itself "
                "(forward returns the distribution of covar_module(x)), but this model's forward returns a "
                f"{type(prior.covariance).__name__} built from it, whose products are not split by rows. Wrap the "
                "kernel whose evaluation forward returns (e.g. an LCMKernel instead of a sum of Kronecker products "
                "built in forward), or use shard_state=False."
            )
        return prior

    def _make_loop(self, prior: LatentPrior, options: Any) -> Any:
        r"""The subclass's :attr:`_loop_type` for ``prior`` and ``options``, with the policy prepared for this data.

        Unit-vector actions solved to full rank (``max_solver_iterations=None``) read every column of
        :math:`\mathbf K`: the kernel matrix is evaluated once for the fit and its columns read
        (:meth:`~gpytorch_iterncgp.core.prior.LatentPrior.cache_kernel`, within ``settings.dense_kernel_limit``), not
        evaluated one per solver iteration."""
        self._prepare_loop()
        if isinstance(self.policy, UnitVectorPolicy) and options.max_solver_iterations is None:
            prior.cache_kernel()
        loop = self._loop_type(prior, self.adapter, self.train_targets, options, self.policy)
        fingerprint = self._fingerprint()
        if self._preconditioning is not None and fingerprint_matches(fingerprint, self._preconditioning[0]):
            loop.preconditioning.adopt(self._preconditioning[1])
        self._preconditioning = (fingerprint, loop.preconditioning)
        return loop

    def kernel_factor(self) -> LowRankKernelFactor | None:
        r"""The low-rank factor of :math:`\mathbf K` that preconditioned the last fit's solves, where the
        hyperparameters are still those it was built at and its rank the options' ``preconditioner_rank``
        (``None`` otherwise, or where none was built): the same
        kernel matrix, so that another fit (the final one after a loose one, a prediction's) and the matrix-free
        evidences (:func:`~gpytorch_iterncgp.mlls.itergp.evidence_kernel_factor`) take it instead of building it
        again (:math:`k` sequential kernel columns, :func:`~gpytorch_iterncgp.core.preconditioner.pivoted_cholesky_factor`).
        """
        if self._preconditioning is None:
            return None
        fingerprint, preconditioning = self._preconditioning
        if preconditioning.rank != self.options.preconditioner_rank:
            return None
        if not fingerprint_matches(self._fingerprint(), fingerprint):
            return None
        return preconditioning.built_factor

    def _prepare_loop(self) -> None:
        """The policy prepared for this data (its size, the latents, the observed coordinates)."""
        observed = self.adapter.observed_coordinates(self.train_targets)
        # only the keywords that apply (a custom Policy need not know them)
        missing: dict[str, Any] = {} if observed is None else {"observed": observed}
        rows_block = self._rows_block()  # the residuals' rows the policy is called with, where held by rows
        if rows_block.is_sharded:
            parameters = inspect.signature(self.policy.prepare).parameters
            if "rows" not in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
                raise TypeError(
                    f"{type(self.policy).__name__}.prepare takes no 'rows': with ShardedKernel(..., shard_state=True) "
                    "the policy is called with this process's rows of the residual only; accept "
                    "rows=(start, stop) in prepare (see Policy.prepare), or use shard_state=False."
                )
            missing["rows"] = (rows_block.start, rows_block.stop)
        self.policy.prepare(self.num_data, self.num_latents, self.adapter.zero_sum_actions, **missing)

    # -- the posterior ---------------------------------------------------------------------------
    def joint_prior(self, inputs: Tensor) -> tuple[Tensor, LinearOperator, LinearOperator]:
        r"""The prior at ``inputs`` ``(..., q, D)`` jointly with the training inputs, for :math:`C = 1`, lazily.

        :return: the prior mean ``(..., q)``, the cross-covariance :math:`\mathbf K_{*X}` ``(..., q, N)`` and the
            covariance :math:`\mathbf K_{**}` ``(..., q, q)``. With the state's :math:`[\mathbf a, \mathbf Q]`
            the posterior is :math:`\mathbf m_* + \mathbf K_{*X}\mathbf a`,
            :math:`\mathbf K_{**} - (\mathbf K_{*X}\mathbf Q)(\mathbf K_{*X}\mathbf Q)^\top`; only the blocks used are
            evaluated.
        """
        if self.num_latents != 1:
            raise ValueError("joint_prior is for one latent function (C = 1); use the strategy's forward for C > 1.")
        num_train = self.num_data
        batch_shape = inputs.shape[:-2]
        joint = torch.cat([self.train_inputs.expand(*batch_shape, *self.train_inputs.shape), inputs], dim=-2)
        prior = self.model.forward(joint)
        covariance = prior.lazy_covariance_matrix
        return (
            prior.mean[..., num_train:],
            covariance[..., num_train:, :num_train],
            covariance[..., num_train:, num_train:],
        )

    @property
    def approximate_precision(self) -> LowRankPrecision:
        r""":math:`\mathbf C = \mathbf Q \mathbf Q^\top \approx (\mathbf K + \mathbf W^{-1})^{-1}` (EP: :math:`\tilde{\mathbf T}^{-1}`), ``(N C, N C)``
        (:math:`\mathbf Q` gathered where the state holds it by rows: a collective)."""
        return LowRankPrecision(self._rows_block().all_rows(self.ensure_fitted().precision_root))

    @retained_allocations()
    def _posterior_parts(self, inputs: Tensor) -> tuple[Tensor, Tensor, LatentPrior]:
        r"""Posterior mean ``(N* C,)``, :math:`\mathbf K_{*X} \mathbf Q` ``(N* C, r)`` and the prior at ``inputs``.

        Where the state holds :math:`\mathbf Q` by rows (``shard_state``), rank :math:`p` multiplies the
        cross-covariance's columns of its training points, :math:`\mathbf K_{*, \mathcal I_p} [\mathbf a, \mathbf
        Q]_{\mathcal I_p}`, and one ``all_reduce`` sums them (:meth:`LatentPrior.matmul_by_columns`).
        """
        at_training_inputs = inputs.shape == self.train_inputs.shape and bool(torch.equal(inputs, self.train_inputs))
        if self.training and at_training_inputs and torch.is_grad_enabled():
            self._hold_evidence_prior()
        state = self.ensure_fitted()
        num_train = self.num_data
        rows_block = self._rows_block()
        if self.training and at_training_inputs:
            prior = self._new_train_prior()
            mean = prior.mean.reshape(-1) + rows_block.all_rows(state.kernel_representer_weights)
            return mean, rows_block.all_rows(state.kernel_precision_root), prior
        full = LatentPrior.from_distribution(
            self.model.forward(torch.cat([self.train_inputs, inputs], dim=-2)), self.num_latents
        )
        test_prior = full.block(slice(num_train, None), slice(num_train, None))
        cross = full.block(slice(num_train, None), slice(None, num_train))
        weights = [rows_block.own_rows(state.representer_weights)[:, None], rows_block.own_rows(state.precision_root)]
        product = cross.matmul_by_columns(torch.cat(weights, dim=-1), rows_block)
        mean = test_prior.mean.reshape(-1) + product[:, 0]
        return mean, product[:, 1:], test_prior

    def forward(self, inputs: Tensor, prior: bool = False, **kwargs) -> MultivariateNormal:
        """The posterior over the latent function(s) at ``inputs`` (``(N*, D)``).

        :return: ``MultivariateNormal`` (C = 1) or interleaved ``MultitaskMultivariateNormal`` (``N* × C``);
            with ``prior=True`` the model's prior.
        """
        if prior:
            return self.model.forward(inputs, **kwargs)
        inputs = self._check_test_inputs(inputs)
        mean, root, test_prior = self._posterior_parts(inputs)
        covariance = test_prior.data_major_covariance() + MatmulLinearOperator(root, root.mT.neg())
        if self.num_latents == 1:
            return MultivariateNormal(mean, covariance)
        return MultitaskMultivariateNormal(mean.reshape(-1, self.num_latents), covariance, interleaved=True)

    def marginal_latent(self, inputs: Tensor) -> tuple[Tensor, Tensor]:
        r"""Posterior mean and variance of the latents at ``inputs``, each ``(N*, C)``, without forming covariances.

        The variance is :math:`k(x, x) - \|\mathbf Q^\top \mathbf K_{X x}\|^2`, clamped at 0. Where it is below
        ``100 eps`` times the prior variance it is dominated by rounding (cancellation; e.g. float32 with an
        outputscale of 1e8), and a ``NumericalWarning`` says so.
        """
        inputs = self._check_test_inputs(inputs)
        mean, root, test_prior = self._posterior_parts(inputs)
        prior_variance = test_prior.diagonal()
        variance = prior_variance - root.square().sum(-1)
        warn_lost_variance(variance, prior_variance)
        variance = variance.clamp_min(0)
        return mean.reshape(-1, self.num_latents), variance.reshape(-1, self.num_latents)

    def marginal_latent_blocks(self, inputs: Tensor) -> tuple[Tensor, Tensor]:
        r"""Posterior mean ``(N*, C)`` and each test point's :math:`C \times C` latent covariance ``(N*, C, C)``.

        Block :math:`n` of the posterior covariance :math:`\mathbf K_{**} - (\mathbf K_{*X}\mathbf Q)
        (\mathbf K_{*X}\mathbf Q)^\top` (data-major): the prior block of point :math:`n` minus
        :math:`\mathbf r_n \mathbf r_n^\top`, where :math:`\mathbf r_n` ``(C, r)`` are the rows
        :math:`nC, \dots, nC + C - 1` of :math:`\mathbf K_{*X}\mathbf Q`. Memory :math:`O(N_* C r)`; no
        :math:`N_* \times N_*` matrix is formed. The diagonals are :meth:`marginal_latent`'s variances (clamped at 0,
        with its ``NumericalWarning``); the blocks are symmetrised, not clamped (see :func:`softmax_gaussian`).
        With a kernel shared by the classes the latents of one point are strongly correlated a posteriori,
        which the softmax's predictive (:meth:`predictive_mean`) needs.
        """
        inputs = self._check_test_inputs(inputs)
        mean, root, test_prior = self._posterior_parts(inputs)
        num = self.num_latents
        rows = root.reshape(-1, num, root.shape[-1])
        covariance = test_prior.point_blocks() - rows @ rows.mT
        covariance = (covariance + covariance.mT) / 2
        prior_variance = test_prior.diagonal()
        variance = covariance.diagonal(dim1=-2, dim2=-1)
        warn_lost_variance(variance.reshape(-1), prior_variance)
        covariance.diagonal(dim1=-2, dim2=-1).clamp_(min=0)
        return mean.reshape(-1, num), covariance


class IterNCGPStrategy(_IterGPStrategy):
    r"""Laplace inference by damped Newton steps solved with IterGP (IterNCGP), for an ``ApproximateGP``.

    :param model: the ``ApproximateGP`` that owns this strategy (pass ``self`` in its ``__init__``); its
        ``forward`` defines the prior. ``batch_shape=[C]`` means one GP per class, no batch shape with
        :math:`C > 1` classes means one kernel shared by all classes, and an interleaved
        ``MultitaskMultivariateNormal`` (``MultitaskKernel``, ``LCMKernel``: :math:`\sum_q \mathbf K_q \otimes
        \mathbf B_q`, a linear model of coregionalisation) correlated latents.
    :param train_inputs: :math:`\mathbf X`, shape ``(N, D)`` (or ``(N,)``).
    :param train_targets: :math:`\mathbf y`, shape ``(N,)``: labels in {0, 1} (Bernoulli), class indices in
        :math:`[0, C)` (softmax), non-negative integer counts (Poisson); ``(N, C)`` counts for
        :class:`~gpytorch_iterncgp.likelihoods.adapters.MultitaskPoissonLikelihood` (``NaN``: a missing output).
    :param likelihood: a GPyTorch likelihood: ``BernoulliLikelihood`` (probit), :class:`LogitBernoulliLikelihood`,
        ``PoissonLikelihood`` (softplus), :class:`ExpPoissonLikelihood`,
        ``SoftmaxLikelihood(num_classes=C, mixing_weights=False)``,
        :class:`~gpytorch_iterncgp.likelihoods.adapters.MultitaskPoissonLikelihood`, or any log-concave likelihood (autograd).
    :param policy: ``"cg"`` (conjugate gradients), ``"unit"`` (subset of data) or a :class:`Policy`.
    :param max_newton_steps: the default limit of Newton steps per :meth:`fit` (``None``: none, the fit runs until it
        converges or stalls; a limit that stops a fit raises a :class:`~gpytorch_iterncgp.ConvergenceWarning`).
    :param max_time: seconds per :meth:`fit`, checked after every Newton step (``None``: no limit).
    :param max_solver_iterations: IterGP iterations (products with :math:`\mathbf K`) per Newton step;
        ``None``: until ``abs_tol``/``rel_tol``.
    :param compression_rank: :math:`R`, the number of recycled actions kept between Newton steps
        (``None``: all).
    :param recycle: recycle actions across Newton steps (Algorithm 3); otherwise every step starts afresh.
    :param outer_tol: stop when the relative change of the representer weights is below it.
    :param abs_tol: IterGP stops when the residual norm is below ``max(abs_tol, rel_tol * ||b||)``.
    :param rel_tol: see ``abs_tol``.
    :param min_curvature: lower bound on :math:`\mathbf W` (and on softmax probabilities), bounding the noise
        :math:`\mathbf W^{-1}`; default ``sqrt(eps)`` of the dtype.
    :param seed: seed of the unit-vector policy's random order.
    :param show_progress: show a tqdm progress bar in :meth:`fit`.
    :param covariance_iterations: products with :math:`\mathbf K` that every :meth:`fit` spends on the posterior
        covariance after its Newton steps (the covariance phase, :mod:`~gpytorch_iterncgp.core.covariance`: block Lanczos
        on :math:`\mathbf K + \mathbf W^{-1}` preconditioned by :math:`\mathbf W`, from the curvature's columns at
        random data points). Once the mode has converged the predictive variance still carries most of the
        computational uncertainty; these actions remove it where the predictions need it. They enlarge
        :math:`\mathbf C` only (not the recycled actions): the covariance stays at least the exact Laplace
        covariance, shrinks with every block, and is exact once the actions span the space. ``0``: no phase (the
        paper's method); the default, 5 (``docs/design_notes.md``, "Laplace's final fit spends 5 products on the
        covariance"): at learnt kernels it narrows
        the predictive where the Newton steps' actions left it wide; more blocks barely changed it).
    :param covariance_block_size: actions per product in the covariance phase (the start block takes the
        :math:`C` latents of ``covariance_block_size // C`` data points). Memory: :math:`\mathbf Q` and
        :math:`\mathbf K \mathbf Q` grow by up to ``covariance_iterations * covariance_block_size`` columns of
        :math:`N C` values each.
    """

    _state_type = LaplaceState
    _options_type = SolverOptions
    _loop_type = DampedNewton
    max_steps_option = "max_newton_steps"
    options: SolverOptions

    def _check_fit(self, options: SolverOptions, prior: LatentPrior) -> None:
        """:class:`UserWarning` for an ``outer_tol`` below what the prior's dtype resolves."""
        resolution = 10 * torch.finfo(prior.dtype).eps
        if 0 < options.outer_tol < resolution:
            warnings.warn(
                f"outer_tol={options.outer_tol:g} is below what {prior.dtype} resolves (10 eps = {resolution:.2g}): "
                "the relative change of the representer weights stays at rounding level above it, so the fit "
                "will likely stall or run to its limit without reporting convergence. Use float64 or a larger "
                "outer_tol.",
                UserWarning,
                stacklevel=3,
            )

    @property
    def mode(self) -> Tensor:
        r"""The (approximate) posterior mode :math:`\hat{\mathbf f} = \mathbf m + \mathbf K \mathbf a`, ``(N, C)``."""
        state = self.ensure_fitted()
        with torch.no_grad():
            mean = self.train_prior().mean
        kernel_weights = self._rows_block().all_rows(state.kernel_representer_weights)  # (gathered where by rows)
        return mean + kernel_weights.reshape(-1, self.num_latents)


class EPStrategy(_IterGPStrategy):
    r"""Expectation propagation (EP) with every sweep's GP regression solved by IterGP, for an ``ApproximateGP``.

    A drop-in for ``VariationalStrategy`` and :class:`IterNCGPStrategy`, with the same ``fit()``, predictions
    (``model(x)``, :meth:`marginal_latent`, :meth:`predictive_mean`), report, callback, interruption and
    ``state_dict``. EP matches the moments of each likelihood factor's tilted distribution instead of the curvature
    at the mode: for classification its predictive variances are much better calibrated than Laplace's
    (Kuss & Rasmussen 2005; Nickisch & Rasmussen 2008). Parallel sweeps with damping (see :mod:`~gpytorch_iterncgp.ep.sweeps`); the
    posterior is :math:`\mathbf m + \mathbf K \mathbf a`, :math:`\mathbf K - \mathbf K \mathbf Q \mathbf Q^\top
    \mathbf K` with :math:`\mathbf Q \mathbf Q^\top \approx (\mathbf K + \tilde{\mathbf T}^{-1})^{-1}`.

    With a complete solve (``policy="unit", max_solver_iterations=None``, or CG run to ``abs_tol``/``rel_tol``)
    this is exact EP. With an incomplete solve the marginal variances include the computational uncertainty (too
    wide, never too narrow); cavity precisions are bounded below by the prior precision :math:`1/k_{ii}`, which the
    exact cavity always satisfies (counted in the report, see :mod:`~gpytorch_iterncgp.ep.sites`), and the recycled actions make later
    sweeps more complete; convergence is reported only when no cavity was bounded.

    :param model: the ``ApproximateGP`` that owns this strategy (pass ``self`` in its ``__init__``).
    :param train_inputs: :math:`\mathbf X`, ``(N, D)`` (or ``(N,)``).
    :param train_targets: :math:`\mathbf y`, ``(N,)``: labels in {0, 1}, class indices, or non-negative integer
        counts.
    :param likelihood: ``BernoulliLikelihood`` (probit, closed-form moments), :class:`LogitBernoulliLikelihood`,
        ``PoissonLikelihood`` (softplus) or :class:`ExpPoissonLikelihood` (moments by quadrature), or
        :class:`MultinomialProbitLikelihood` for :math:`C` classes (one latent GP per class, a multitask model like
        the softmax's; :math:`C \times C` site blocks, tilted moments by nested EP, Riihimäki et al. 2013).
    :param policy: ``"cg"``, ``"unit"`` or a :class:`Policy`.
    :param max_sweeps: the default limit of EP sweeps per :meth:`fit` (``None``: none, the fit runs until it
        converges or stalls; a limit that stops a fit raises a :class:`~gpytorch_iterncgp.ConvergenceWarning`).
    :param max_time: seconds per :meth:`fit`, checked after every sweep (``None``: no limit).
    :param max_solver_iterations: IterGP iterations (products with :math:`\mathbf K`) per sweep; ``None``: until
        ``abs_tol``/``rel_tol``.
    :param compression_rank: :math:`R`, recycled actions kept between sweeps (``None``: all).
    :param recycle: recycle actions across sweeps; otherwise every sweep starts afresh.
    :param damping: :math:`\delta \in (0, 1]`, the fraction of the way each sweep moves the sites (1: undamped).
    :param site_tol: converged when the largest relative change of the site parameters a sweep proposes is below it
        (and the solve met its tolerance, with no cavity bounded and no site skipped).
    :param abs_tol: IterGP stops when the residual norm is below ``max(abs_tol, rel_tol * ||b||)``.
    :param rel_tol: see ``abs_tol``.
    :param min_curvature: lower bound on the site precisions in the regression's noise (default ``sqrt(eps)``).
    :param seed: seed of the unit-vector policy's random order.
    :param show_progress: show a tqdm progress bar in :meth:`fit`.
    :param covariance_iterations: products with :math:`\mathbf K` that every :meth:`fit` spends on the posterior
        covariance of the final sites' regression (the covariance phase, as for :class:`IterNCGPStrategy`); they
        narrow the predictive marginals towards those of exact EP for these sites, never below them. ``0``: none.
    :param covariance_block_size: actions per product in the covariance phase.
    :param marginal_iterations: products with :math:`\mathbf K` (covariance-phase blocks) spent on the marginals
        *during* the sweeps, after every ``marginal_every``-th sweep; their actions join the recycled ones
        (:meth:`.ExpectationPropagation.refine_marginals`). They move the sites towards exact EP's at the cost of a
        larger buffer; ``0``: none.
    :param marginal_every: sweeps between those refreshes.
    :param bounded_point_actions: at most this many actions a sweep (one per point, :math:`C - 1` per point for
        :math:`C` classes; at least one point) go to points whose cavity it bounded (largest site precision first):
        their unit vectors, with their kernel columns (no product with :math:`\mathbf K`), so that no later sweep
        bounds them (the variance there is at most that of the point observed alone). ``0``: none. Each is a column
        of the recycled actions, which every later sweep's virtual solver run pays for.
    :param marginal_tol: converged also where a sweep moved the posterior marginals at the training points by at most
        this, their mean Kullback–Leibler divergence from the marginals it updated from per latent value (nats;
        :func:`~gpytorch_iterncgp.ep.sweeps.marginal_divergence`), with a complete solve and no site skipped, even
        while some cavities are bounded or the sites still move by more than ``site_tol``: what predictions and
        the evidence are made of has settled (the default, 1e-3: parallel EP converges linearly, so the marginals
        are within a small multiple of it of EP's fixed point; 10-class EP at learnt kernels reaches it in 20
        sweeps, where the sites' test alone ran past 40). ``None``: the sites' test alone, exact EP's fixed point
        to ``site_tol`` (what the dense references compare at).
    """

    _state_type = EPState
    _options_type = EPOptions
    _loop_type = ExpectationPropagation
    max_steps_option = "max_sweeps"
    options: EPOptions

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not self.adapter.supports_ep:
            raise TypeError(
                f"EPStrategy needs a likelihood with tilted moments: BernoulliLikelihood (probit), "
                f"LogitBernoulliLikelihood, PoissonLikelihood, ExpPoissonLikelihood or MultinomialProbitLikelihood "
                f"(multi-class); got {type(self.likelihood).__name__}. Use IterNCGPStrategy (Laplace) for other "
                "likelihoods."
            )

    @property
    def sites(self) -> tuple[Tensor, Tensor]:
        r"""The site parameters :math:`(\tilde{\boldsymbol\tau}, \tilde{\boldsymbol\nu})`, ``(N,)`` each, or for the
        multinomial probit the blocks :math:`\tilde{\mathbf T}_i` ``(N, C, C)`` and :math:`\tilde{\boldsymbol\nu}_i`
        ``(N, C)`` (fits first if needed)."""
        state, rows_block = self.ensure_fitted(), self._rows_block()  # (gathered where held by rows: a collective)
        return rows_block.all_points(state.site_precision), rows_block.all_points(state.site_natural_mean)
