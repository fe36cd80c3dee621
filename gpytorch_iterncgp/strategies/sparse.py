r""":class:`SparseEPStrategy`: sparse EP-DTC (:mod:`~gpytorch_iterncgp.sparse.dtc`) as a drop-in for GPyTorch's ``VariationalStrategy``.

.. code-block:: python

    class Model(gpytorch.models.ApproximateGP):
        def __init__(self, train_x, train_y, likelihood, inducing_points):
            strategy = SparseEPStrategy(self, train_x, train_y, likelihood, inducing_points)
            super().__init__(strategy)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    model = Model(train_x, train_y, likelihood, train_x[:256].clone())
    model.variational_strategy.fit()
    mll = SparseEPMarginalLogLikelihood(likelihood, model)   # the bound L_E, eq. S.21
"""

from __future__ import annotations

import torch
from gpytorch.distributions import MultivariateNormal
from linear_operator.operators import LinearOperator, MatmulLinearOperator
from torch import Tensor

from ..core.validation import check_flag, check_inputs
from ..ep.sweeps import SweepOptions
from ..sparse.dtc import DTCPrior, SparseEP, SparseEPState, WhitenedInducing
from .predictive import PredictiveStrategy, warn_lost_variance


class SparseEPStrategy(PredictiveStrategy):
    r"""Sparse expectation propagation under the DTC prior of :math:`M` inducing inputs (EP-DTC), for an
    ``ApproximateGP``: :math:`O(M^2 N)` per sweep and :math:`O(MN)` memory, never an :math:`N \times N` matrix.

    A drop-in for ``VariationalStrategy`` (and :class:`~gpytorch_iterncgp.EPStrategy`) with the same ``fit()``,
    report, callback, interruption and ``state_dict``; the inducing inputs are a ``torch.nn.Parameter`` (learned
    by the optimiser of :class:`~gpytorch_iterncgp.SparseEPMarginalLogLikelihood`) when
    ``learn_inducing_locations``, as in GPyTorch's ``VariationalStrategy``, else a buffer.

    **Predictions** (:meth:`forward`, :meth:`marginal_latent`, :meth:`predictive_mean`) are the variational
    (Titsias) predictive of the EP-DTC posterior over the inducing values,
    :math:`q(\mathbf f_*) = \int p(\mathbf f_* \mid \mathbf u)\, q(\mathbf u)\, d\mathbf u`:

    .. math::
        \mathbf m_* + \mathbf K_{*u} \mathbf A^{-1} \mathbf K_{uf} (\tilde{\boldsymbol\nu} - \tilde{\mathbf T}\mathbf m),
        \qquad \mathbf K_{**} - \mathbf Q_{**} + \mathbf K_{*u} \mathbf A^{-1} \mathbf K_{u*},
        \qquad \mathbf A = \mathbf K_{uu} + \mathbf K_{uf} \tilde{\mathbf T} \mathbf K_{fu},

    in :math:`O(M^2 N_*)`. Not the projected ("SoR") covariance :math:`\mathbf K_{*u}\mathbf A^{-1}\mathbf K_{u*}` of
    eq. S.12 at test inputs: that one uses the exact conditional :math:`p(\mathbf f_* \mid \mathbf u)` nowhere, so its
    variance collapses to 0 away from the inducing inputs (overconfident), whereas the bound S.17-S.21 is derived with
    the exact conditional; with :math:`M = N` inducing inputs at the data this predictive is dense EP's exactly.

    :param model: the ``ApproximateGP`` that owns this strategy (pass ``self``).
    :param train_inputs: :math:`\mathbf X`, ``(N, D)`` (or ``(N,)``).
    :param train_targets: ``(N,)``: labels in {0, 1} or non-negative integer counts.
    :param likelihood: ``BernoulliLikelihood`` (probit), :class:`LogitBernoulliLikelihood`, ``PoissonLikelihood`` or
        :class:`ExpPoissonLikelihood`.
    :param inducing_points: :math:`\mathbf Z`, ``(M, D)`` (or ``(M,)``), any :math:`M \ge 1` (also :math:`M > N`).
    :param learn_inducing_locations: register :math:`\mathbf Z` as a parameter (else a buffer).
    :param max_sweeps: the default limit of sweeps per :meth:`fit` (``None``: none, until converged or stalled).
    :param max_time: seconds per :meth:`fit`, checked after every sweep (``None``: no limit).
    :param damping: :math:`\delta \in (0, 1]`, the fraction of the way each sweep moves the sites.
    :param site_tol: converged when the largest relative site change a sweep proposes is below it.
    :param show_progress: show a tqdm progress bar in :meth:`fit`.
    """

    _state_type = SparseEPState
    _options_type = SweepOptions
    max_steps_option = "max_sweeps"
    options: SweepOptions

    def __init__(
        self,
        model,
        train_inputs,
        train_targets,
        likelihood,
        inducing_points: Tensor,
        learn_inducing_locations=True,
        **kw,
    ):
        super().__init__(model, train_inputs, train_targets, likelihood, **kw)
        if not self.adapter.has_tilted_moments:
            raise TypeError(
                f"SparseEPStrategy needs a likelihood with tilted moments: BernoulliLikelihood (probit), "
                f"LogitBernoulliLikelihood, PoissonLikelihood or ExpPoissonLikelihood; got {type(likelihood).__name__}."
            )
        check_flag(learn_inducing_locations, "learn_inducing_locations")
        if torch.is_tensor(inducing_points) and inducing_points.device != self.train_inputs.device:
            raise ValueError(
                f"inducing_points are on {inducing_points.device} but train_inputs on {self.train_inputs.device}."
            )
        inducing = check_inputs(inducing_points, "inducing_points")
        if inducing.shape[-1] != self.train_inputs.shape[-1]:
            raise ValueError(
                f"inducing_points have {inducing.shape[-1]} features (shape {tuple(inducing.shape)}) but the training "
                f"inputs have {self.train_inputs.shape[-1]}: pass inducing points of shape (M, "
                f"{self.train_inputs.shape[-1]})."
            )
        inducing = inducing.detach().to(self.train_inputs.dtype).clone()
        if learn_inducing_locations:
            self.register_parameter("inducing_points", torch.nn.Parameter(inducing))
        else:
            self.register_buffer("inducing_points", inducing)

    @property
    def num_inducing(self) -> int:
        """:math:`M`, the number of inducing inputs."""
        return self.inducing_points.shape[0]

    # -- the DTC prior ---------------------------------------------------------------------------
    def _joint(self, inputs: Tensor) -> tuple[Tensor, LinearOperator, Tensor, Tensor]:
        r"""The model's prior jointly at :math:`\mathbf Z` and ``inputs``: the mean at ``inputs``, the lazy covariance
        :math:`\mathbf K_{**}`, and :math:`\mathbf L` (:math:`\mathbf K_{uu}` jittered) and
        :math:`\mathbf L^{-1}\mathbf K_{u*}` (dense, :math:`M \times N_*`)."""
        num_inducing = self.num_inducing
        distribution = self.model.forward(torch.cat([self.inducing_points, inputs], dim=-2))
        if not isinstance(distribution, MultivariateNormal) or distribution.batch_shape != torch.Size([]):
            raise ValueError("SparseEPStrategy needs a model whose forward returns a MultivariateNormal without batch.")
        covariance = distribution.lazy_covariance_matrix
        whitening = WhitenedInducing.from_covariance(covariance[:num_inducing, :num_inducing].to_dense())
        whitened = whitening.whiten(covariance[:num_inducing, num_inducing:].to_dense())
        return distribution.mean[num_inducing:], covariance[num_inducing:, num_inducing:], whitening.cholesky, whitened

    def dtc_prior(self) -> DTCPrior:
        r"""The DTC prior at the training inputs (with gradients where autograd records them): :math:`O(M^2 N)`."""
        mean, covariance, cholesky, whitened = self._joint(self.train_inputs)
        return DTCPrior(mean, covariance.diagonal(), cholesky, whitened)

    def _fingerprint_tensors(self) -> list[Tensor]:
        """The parameters of model and likelihood and the inducing inputs (also when they are a fixed buffer)."""
        return [*super()._fingerprint_tensors(), self.inducing_points]

    # -- fitting ---------------------------------------------------------------------------------
    def _prior_for_fit(self) -> DTCPrior:
        """:meth:`dtc_prior`, with the inducing inputs checked against the data's device."""
        if self.inducing_points.device != self.train_inputs.device:
            raise ValueError(
                f"inducing_points are on {self.inducing_points.device}, the data on {self.train_inputs.device}."
            )
        return self.dtc_prior()

    def _make_loop(self, prior: DTCPrior, options: SweepOptions) -> SparseEP:
        return SparseEP(prior, self.adapter, self.train_targets, options.damping, options.site_tol)

    @property
    def sites(self) -> tuple[Tensor, Tensor]:
        r"""The site parameters :math:`(\tilde{\boldsymbol\tau}, \tilde{\boldsymbol\nu})`, ``(N,)`` each (fits first if needed)."""
        state = self.ensure_fitted()
        return state.site_precision, state.site_natural_mean

    # -- the posterior ---------------------------------------------------------------------------
    def _posterior_parts(self, inputs: Tensor) -> tuple[Tensor, Tensor, Tensor, LinearOperator]:
        r"""Mean ``(N*,)``, :math:`\mathbf V_*^\top = \mathbf K_{*u}\mathbf L^{-\top}` and
        :math:`(\mathbf L_B^{-1}\mathbf V_*)^\top` ``(N*, M)``, and the lazy :math:`\mathbf K_{**}`."""
        state = self.ensure_fitted()
        mean, covariance, _, whitened = self._joint(inputs)
        projected = torch.linalg.solve_triangular(state.posterior_cholesky, whitened, upper=False)
        return mean + whitened.mT @ state.whitened_mean, whitened.mT, projected.mT, covariance

    def forward(self, inputs: Tensor, prior: bool = False, **kwargs) -> MultivariateNormal:
        r"""The EP-DTC posterior at ``inputs`` ``(N*, D)``: :math:`\mathbf K_{**} - \mathbf Q_{**} +
        \mathbf K_{*u}\mathbf A^{-1}\mathbf K_{u*}` lazily (see the class docstring); ``prior=True``: the model's prior."""
        if prior:
            return self.model.forward(inputs, **kwargs)
        inputs = self._check_test_inputs(inputs)
        mean, whitened, projected, covariance = self._posterior_parts(inputs)
        covariance = (
            covariance
            + MatmulLinearOperator(whitened, whitened.mT.neg())
            + MatmulLinearOperator(projected, projected.mT)
        )
        return MultivariateNormal(mean, covariance)

    def marginal_latent(self, inputs: Tensor) -> tuple[Tensor, Tensor]:
        r"""Posterior means and variances at ``inputs``, ``(N*, 1)`` each, in :math:`O(M^2 N_*)`:
        :math:`k_{**} - \|\mathbf V_{:,*}\|^2 + \|\mathbf L_B^{-1}\mathbf V_{:,*}\|^2`, clamped at 0 (with the
        ``NumericalWarning`` of :meth:`EPStrategy.marginal_latent <gpytorch_iterncgp.EPStrategy.marginal_latent>`)."""
        inputs = self._check_test_inputs(inputs)
        mean, whitened, projected, covariance = self._posterior_parts(inputs)
        prior_variance = covariance.diagonal()
        variance = prior_variance - whitened.square().sum(-1) + projected.square().sum(-1)
        warn_lost_variance(variance, prior_variance)
        return mean[:, None], variance.clamp_min(0)[:, None]

    def marginal_latent_blocks(self, inputs: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`marginal_latent` with the variances as ``(N*, 1, 1)`` blocks (one latent function)."""
        mean, variance = self.marginal_latent(inputs)
        return mean, variance[:, :, None]
