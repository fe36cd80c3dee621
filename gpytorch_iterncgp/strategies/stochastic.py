r""":class:`StochasticEPStrategy`: stochastic EP with inducing inputs (:mod:`~gpytorch_iterncgp.sparse.stochastic`),
trained with SVGP's loop on minibatches, plus one explicit call per minibatch that moves the site.

.. code-block:: python

    class Model(gpytorch.models.ApproximateGP):
        def __init__(self, inducing_points, likelihood, num_data):
            strategy = StochasticEPStrategy(self, inducing_points, likelihood, num_data=num_data)
            super().__init__(strategy)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5))

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    model = Model(train_x[:200].clone(), likelihood, num_data=len(train_y))
    mll = StochasticEPMarginalLogLikelihood(likelihood, model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model.train()
    for x_batch, y_batch in loader:
        optimizer.zero_grad()
        output = model(x_batch)  # the points' cavities, carrying the minibatch
        loss = -mll(output, y_batch)  # SEP's energy at those cavities: a pure function of the model
        loss.backward()
        optimizer.step()
        model.variational_strategy.update_site(output, y_batch)  # SEP's step from the same cavities
    model.eval()
    probabilities = likelihood(model(test_x)).probs

As with GPyTorch's ``VariationalELBO``, the objective only reads the model: computing it (a validation loss, under
``torch.no_grad()``, in training mode) moves nothing. The site moves in :meth:`StochasticEPStrategy.update_site`,
called once per minibatch after the optimiser's step with the output computed before it: the step starts from the
cavities that output holds, those the energy was computed at (the site and the prior before the step), so that the
gradient and the step share one evaluation of the model (Hernández-Lobato & Hernández-Lobato 2016).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import gpytorch
import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from linear_operator.operators import DiagLinearOperator
from torch import Tensor

from ..core.validation import check_count, check_flag, check_inputs
from ..likelihoods.adapters import likelihood_adapter
from ..likelihoods.factorised import factorised_probabilities
from ..sparse.stochastic import InducingSite, PointSites, StochasticEP, TiedSite, WhitenedBatch
from .base import attach_to_model
from .predictive import LatentPredictions


@dataclass
class TrainingCavities:
    r"""What a training output of :class:`StochasticEPStrategy` carries besides its distribution: ``batch``, the prior
    at its minibatch in the whitened inducing coordinates (:class:`~gpytorch_iterncgp.sparse.stochastic.WhitenedBatch`,
    differentiable in the kernel, the mean and the inducing inputs), and each point's cavity marginals :math:`\mu_{ic}`
    (``mean``) and :math:`\sigma_{ic}^2` (``variance``), ``(C, B)`` each, differentiable in the prior with the site
    held fixed: what SEP's energy integrates against and SEP's step starts from, at the site of the call."""

    batch: WhitenedBatch
    mean: Tensor
    variance: Tensor
    site_moved: bool = False  # update_site has stepped from these cavities (once per output)


class CavityMultivariateNormal(MultivariateNormal):
    """``model(x_batch)`` in training mode for one latent: the points' cavities, independent (a diagonal covariance),
    with :attr:`cavities`. A distribution derived from it (indexed, expanded, ...) is plain: its ``cavities`` is
    ``None``."""

    #: the minibatch and its cavities (:class:`TrainingCavities`); ``None`` on derived distributions
    cavities: TrainingCavities | None = None


class CavityMultitaskMultivariateNormal(MultitaskMultivariateNormal):
    """``model(x_batch)`` in training mode for :math:`C` latents: the points' cavities ``(B, C)``, independent, with
    :attr:`cavities` (as :class:`CavityMultivariateNormal`)."""

    #: the minibatch and its cavities (:class:`TrainingCavities`); ``None`` on derived distributions
    cavities: TrainingCavities | None = None


class StochasticEPStrategy(LatentPredictions, gpytorch.Module):
    r"""Stochastic expectation propagation (SEP) with :math:`M` inducing inputs and the FITC conditional, for an
    ``ApproximateGP`` trained on minibatches like GPyTorch's SVGP: memory :math:`O(C M^2)` and
    :math:`O(C(M^3 + B M^2))` per minibatch of :math:`B` points, whatever the number of data :math:`N`
    (Hernández-Lobato & Hernández-Lobato 2016; Villacampa-Calvo & Hernández-Lobato 2017 for :math:`C` classes).

    The state is one tied site per latent process in the whitened inducing coordinates (:class:`~gpytorch_iterncgp.sparse.stochastic.TiedSite`),
    saved in the ``state_dict``, standing for :math:`N` = ``num_data`` points. On each training minibatch
    :class:`~gpytorch_iterncgp.StochasticEPMarginalLogLikelihood` returns SEP's energy, whose gradient learns the
    kernel, the mean and the inducing inputs, and :meth:`update_site` moves the site (module docstring's loop).

    In eval mode ``model(x)`` is the posterior :math:`q(\mathbf f(\mathbf x))`, independent per point and per
    latent: a ``MultivariateNormal`` with a diagonal covariance for :math:`C = 1`, a ``MultitaskMultivariateNormal``
    ``(N*, C)`` for :math:`C` classes; ``likelihood(model(x))`` is its predictive. In training mode it is each point's
    cavity instead, the distribution SEP's energy integrates against (as SVGP's training output is the :math:`q` its
    ELBO integrates against): for the tied site :math:`q` with one point's share :math:`1/N` of the site removed. The
    training output (:class:`CavityMultivariateNormal`, :class:`CavityMultitaskMultivariateNormal`) carries its
    minibatch and cavities (:class:`TrainingCavities`), which the objective and :meth:`update_site` read from it.

    ``sites="points"`` keeps one site per training point and latent instead (EP-FITC, memory :math:`O(C N)`), for
    full-batch training: every step on all :math:`N` training points in the same order (a batch of other inputs, or
    the same shuffled, is refused). With the inducing inputs at the training inputs it is the dense EP of the factorised
    model.

    :param model: the ``ApproximateGP`` that owns this strategy (pass ``self``); its ``forward`` returns the prior, a
        ``MultivariateNormal`` without batch (one kernel; for :math:`C` classes shared by them) or with batch
        ``[C]`` (one GP per class).
    :param inducing_points: :math:`\mathbf Z`, ``(M, D)`` shared by the latents, or ``(C, M, D)``, one set per latent
        (as GPyTorch's batched inducing points; for :math:`C` classes with a kernel per class, :math:`M` each at the cost
        of :math:`M` shared ones: the prior's blocks are per class either way).
    :param likelihood: ``BernoulliLikelihood`` (probit), :class:`~gpytorch_iterncgp.LogitBernoulliLikelihood`, a
        Poisson likelihood, or :class:`~gpytorch_iterncgp.MultinomialProbitLikelihood` for :math:`C` classes.
    :param num_data: :math:`N`, the number of training points the site stands for (as ``VariationalELBO``'s
        ``num_data``).
    :param learn_inducing_locations: register :math:`\mathbf Z` as a parameter (else a buffer).
    :param sites: ``"tied"`` (SEP, minibatches) or ``"points"`` (EP, full batches).
    :raises TypeError: for a likelihood without tilted moments (softmax) or a ``model`` that is not a module.
    :raises ValueError: for a ``num_data`` that is not a positive integer, or another ``sites``.
    """

    #: the site of each ``sites`` choice
    SITES: dict[str, type[TiedSite] | type[PointSites]] = {"tied": TiedSite, "points": PointSites}

    def __init__(
        self,
        model: gpytorch.models.ApproximateGP,
        inducing_points: Tensor,
        likelihood: gpytorch.likelihoods.Likelihood,
        *,
        num_data: int,
        learn_inducing_locations: bool = True,
        sites: str = "tied",
    ):
        super().__init__()
        attach_to_model(self, model, likelihood)
        self.adapter = likelihood_adapter(likelihood)
        StochasticEP(self.adapter, 1)  # refuses likelihoods without tilted moments
        check_count(num_data, "StochasticEPStrategy: num_data (the number of training points)", minimum=1)
        #: :math:`N`, the number of training points the site stands for
        self.num_data: int = int(num_data)
        check_flag(learn_inducing_locations, "learn_inducing_locations")
        if sites not in self.SITES:
            raise ValueError(f"sites must be one of {sorted(self.SITES)}, got {sites!r}.")
        inducing = self._check_inducing(inducing_points).detach().clone()
        if learn_inducing_locations:
            self.register_parameter("inducing_points", torch.nn.Parameter(inducing))
        else:
            self.register_buffer("inducing_points", inducing)
        self.site: InducingSite = self.SITES[sites].flat(self.num_latents, inducing.shape[-2], inducing)

    def _check_inducing(self, inducing_points: Tensor) -> Tensor:
        r"""``(M, D)``, or ``(C, M, D)`` for :math:`C \ge 2` latents, validated."""
        if torch.is_tensor(inducing_points) and inducing_points.dim() == 3:
            if self.num_latents == 1 or inducing_points.shape[0] != self.num_latents:
                raise ValueError(
                    f"inducing_points of shape (C, M, D) need one set per latent of the likelihood's "
                    f"{self.num_latents} (C >= 2); got {tuple(inducing_points.shape)}. Pass (M, D) to share them."
                )
            flat = inducing_points.reshape(-1, inducing_points.shape[-1])
            return check_inputs(flat, "inducing_points").reshape(inducing_points.shape)
        return check_inputs(inducing_points, "inducing_points")

    @property
    def num_inducing(self) -> int:
        """:math:`M`, the number of inducing inputs (of each latent)."""
        return self.inducing_points.shape[-2]

    # -- the prior in whitened coordinates -------------------------------------------------------
    def whitened_batch(self, inputs: Tensor) -> WhitenedBatch:
        r"""The model's prior at ``inputs`` ``(B, D)`` in the whitened inducing coordinates (with gradients where
        autograd records them): :math:`\mathbf m` ``(C, B)``, :math:`\mathbf V` and :math:`\mathbf s` per kernel, and
        the inputs (which per-point sites check).

        :raises ValueError: for inputs of another number of features, or a prior of another batch shape.
        """
        inputs = check_inputs(inputs, "inputs", device=self.inducing_points.device)
        if inputs.shape[-1] != self.inducing_points.shape[-1]:
            raise ValueError(
                f"inputs have {inputs.shape[-1]} features but the inducing points {self.inducing_points.shape[-1]}."
            )
        num = self.num_inducing
        inducing = self.inducing_points
        points = inputs.to(inducing)
        expanded = points.expand(*inducing.shape[:-2], -1, -1)  # one copy per set of inducing inputs
        distribution = self.model.forward(torch.cat([inducing, expanded], dim=-2))
        batch_shape = tuple(distribution.batch_shape)
        if batch_shape not in ((), (self.num_latents,)) or isinstance(distribution, MultitaskMultivariateNormal):
            raise ValueError(
                f"StochasticEPStrategy needs a forward that returns a MultivariateNormal with batch_shape [] or "
                f"[{self.num_latents}] (one GP per class); got {type(distribution).__name__} with batch_shape "
                f"{list(batch_shape)}."
            )
        covariance = distribution.lazy_covariance_matrix
        if not batch_shape:
            covariance = covariance.unsqueeze(0)
        # a copy: a constant mean's output is a view of its parameter, which the optimiser changes in place before
        # update_site reads the batch
        mean = distribution.mean[..., num:].expand(self.num_latents, -1).clone()
        return WhitenedBatch.from_blocks(
            mean,
            covariance[..., :num, :num].to_dense(),
            covariance[..., :num, num:].to_dense(),
            covariance[..., num:, num:].diagonal(dim1=-1, dim2=-2),
            points,
        )

    # -- the posterior ---------------------------------------------------------------------------
    def _distribution(self, mean: Tensor, variance: Tensor) -> MultivariateNormal:
        """Independent marginals ``(C, B)`` as GPyTorch's distribution of the model's output."""
        if self.num_latents == 1:
            return MultivariateNormal(mean[0], DiagLinearOperator(variance[0]))
        return MultitaskMultivariateNormal.from_batch_mvn(MultivariateNormal(mean, DiagLinearOperator(variance)))

    def _training_output(self, cavities: TrainingCavities) -> MultivariateNormal:
        """The cavities' marginals ``(C, B)`` as the training output that carries them."""
        output: CavityMultivariateNormal | CavityMultitaskMultivariateNormal
        mean, variance = cavities.mean, cavities.variance
        if self.num_latents == 1:
            output = CavityMultivariateNormal(mean[0], DiagLinearOperator(variance[0]))
        else:
            batch = MultivariateNormal(mean, DiagLinearOperator(variance))
            output = CavityMultitaskMultivariateNormal.from_batch_mvn(batch)
        output.cavities = cavities
        return output

    def forward(self, inputs: Tensor, prior: bool = False, **kwargs) -> MultivariateNormal:
        r"""The posterior marginals at ``inputs`` ``(B, D)``, or in training mode the points' cavities carrying their
        minibatch (class docstring); ``prior=True``: the model's prior. The call keeps nothing: it does not change the
        strategy."""
        if prior:
            return self.model.forward(inputs, **kwargs)
        batch = self.whitened_batch(inputs)
        if not self.training:
            return self._distribution(*self.site.posterior(batch))
        return self._training_output(TrainingCavities(batch, *self.site.cavity(batch, self.num_data)))

    def marginal_latent(self, inputs: Tensor) -> tuple[Tensor, Tensor]:
        """Posterior means and variances at ``inputs`` ``(N*, D)``, ``(N*, C)`` each."""
        mean, variance = self.site.posterior(self.whitened_batch(inputs))
        return mean.mT, variance.mT

    def predictive_mean(self, inputs: Tensor) -> Tensor:
        r""":math:`\mathbb E[y_*]` from the factorised posterior: for :math:`C` classes the multinomial probit's exact
        predictive under independent latents (:func:`~gpytorch_iterncgp.likelihoods.factorised.factorised_probabilities`,
        a one-dimensional integral per class); otherwise the likelihood's rule
        (:meth:`LatentPredictions.predictive_mean <gpytorch_iterncgp.strategies.predictive.LatentPredictions.predictive_mean>`)."""
        if self.num_latents == 1:
            return super().predictive_mean(inputs)
        return factorised_probabilities(*self.marginal_latent(inputs))

    def marginal_latent_blocks(self, inputs: Tensor) -> tuple[Tensor, Tensor]:
        """Posterior means ``(N*, C)`` and covariances ``(N*, C, C)``: diagonal, the posterior factorises."""
        mean, variance = self.marginal_latent(inputs)
        return mean, torch.diag_embed(variance)

    # -- training --------------------------------------------------------------------------------
    def training_cavities(self, output: Any, targets: Tensor) -> TrainingCavities:
        """The minibatch and cavities that ``output``, a ``model(x_batch)`` computed in training mode, carries, checked
        against this model and the batch's ``targets``.

        :raises RuntimeError: for an output without them (computed in eval mode, the prior, a distribution derived
            from a training output or built otherwise), or with another number of latents or inducing inputs.
        :raises ValueError: for ``targets`` of another number of points than the output's.
        """
        cavities = getattr(output, "cavities", None)
        if not isinstance(cavities, TrainingCavities):
            raise RuntimeError(
                f"StochasticEPStrategy needs the output of model(x_batch) computed in training mode, which carries the "
                f"minibatch's cavities; got a {type(output).__name__} without them (an eval-mode output, the prior, or "
                f"a distribution derived from or built like the output): call model.train() and pass model(x_batch)."
            )
        shape = (cavities.mean.shape[0], cavities.batch.whitened_cross.shape[-2])
        if shape != (self.num_latents, self.num_inducing):
            raise RuntimeError(
                f"the training output is for {shape} (latents, inducing inputs); this model has "
                f"{(self.num_latents, self.num_inducing)}: pass this model's model(x_batch)."
            )
        size = cavities.mean.shape[-1]
        if not torch.is_tensor(targets) or targets.dim() == 0 or len(targets) != size:
            given = tuple(targets.shape) if torch.is_tensor(targets) else type(targets).__name__
            raise ValueError(f"the training output holds {size} points, but the targets are {given}.")
        return cavities

    def update_site(self, output: Any, targets: Tensor, moments: tuple[Tensor, Tensor, Tensor] | None = None) -> None:
        r"""SEP's step on the minibatch of a training ``output`` (:meth:`StochasticEP.step
        <gpytorch_iterncgp.sparse.stochastic.StochasticEP.step>`, steps 1-4): each point's new site from its tilted
        moments at the cavity, and the tied site a fraction :math:`\epsilon` of the way towards :math:`N` times the
        batch's average site (per-point sites: each its own).

        It starts from the cavities ``output`` carries, those of the site and the prior when ``model(x_batch)`` ran:
        call it once per output, after the optimiser's step, with the output the objective was computed at (module
        docstring), so that the energy's gradient and the step share the same cavities, as when they were one call.

        :param output: ``model(x_batch)`` computed in training mode.
        :param targets: ``y_batch`` ``(B,)``, the targets of its points.
        :param moments: the tilted moments at the output's cavities, :math:`\log\hat Z_i` ``(B,)``, the means and the
            variances ``(C, B)`` (:func:`~gpytorch_iterncgp.sparse.stochastic.tilted`), as
            :meth:`StochasticEPMarginalLogLikelihood.energy_and_moments
            <gpytorch_iterncgp.StochasticEPMarginalLogLikelihood.energy_and_moments>` returns them with the energy;
            ``None``: computed here from ``targets`` (one quadrature per point).
        :raises RuntimeError: for an output that is not a training output (:meth:`training_cavities`), or one the site
            already moved from.
        :raises ValueError: for targets of another number of points than the output's, or invalid targets.
        """
        cavities = self.training_cavities(output, targets)
        if cavities.site_moved:
            raise RuntimeError(
                "update_site already moved the site from this output's cavities: call it once per model(x_batch), "
                "and compute a new output (with the moved site) for the next step."
            )
        if moments is None:  # the quadrature's targets (with moments given, the objective checked them)
            targets = self.adapter.check_targets(targets, cavities.mean.dtype).to(cavities.mean.device)
        cavity = (cavities.mean, cavities.variance)
        self.site = StochasticEP(self.adapter, self.num_data).update(
            self.site, cavities.batch, targets, cavity, moments
        )
        cavities.site_moved = True

    # -- state_dict, copies and devices ---------------------------------------------------------
    def get_extra_state(self) -> dict:
        """The site for ``state_dict()``: tensors and numbers only."""
        return {"site": self.site.to_extra()}

    def set_extra_state(self, extra: dict) -> None:
        """Restore :meth:`get_extra_state`.

        :raises ValueError: for a malformed dict, or a site of another kind, number of latents or inducing inputs.
        """
        if not isinstance(extra, dict) or not isinstance(extra.get("site"), dict):
            raise ValueError(f"{type(self).__name__} extra state must be a dict with a 'site' dict.")
        site = type(self.site).from_extra(extra["site"], self.inducing_points)
        if site.natural_mean.shape != self.site.natural_mean.shape:
            raise ValueError(
                f"the saved site is for {tuple(site.natural_mean.shape)} (latents, inducing inputs); this model "
                f"has {tuple(self.site.natural_mean.shape)}."
            )
        self.site = site

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.site = dataclasses.replace(self.site, **{name: fn(tensor) for name, tensor in self.site.tensors().items()})
        return self
