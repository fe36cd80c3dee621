r""":class:`StochasticEPStrategy`: stochastic EP with inducing inputs (:mod:`~gpytorch_iterncgp.sparse.stochastic`),
trained with SVGP's loop on minibatches.

.. code-block:: python

    class Model(gpytorch.models.ApproximateGP):
        def __init__(self, inducing_points, likelihood):
            super().__init__(StochasticEPStrategy(self, inducing_points, likelihood))
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5))

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    model = Model(train_x[:200].clone(), likelihood)
    mll = StochasticEPMarginalLogLikelihood(likelihood, model, num_data=len(train_y))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model.train()
    for x_batch, y_batch in loader:
        optimizer.zero_grad()
        loss = -mll(model(x_batch), y_batch)  # SEP's energy at the cavities; moves the tied site
        loss.backward()
        optimizer.step()
    model.eval()
    probabilities = likelihood(model(test_x)).probs
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gpytorch
import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from linear_operator.operators import DiagLinearOperator
from torch import Tensor

from ..core.validation import check_flag, check_inputs
from ..likelihoods.adapters import likelihood_adapter
from ..likelihoods.factorised import factorised_probabilities
from ..sparse.stochastic import InducingSite, PointSites, SEPStepRecord, StochasticEP, TiedSite, WhitenedBatch
from .base import attach_to_model
from .predictive import LatentPredictions


class StochasticEPStrategy(LatentPredictions, gpytorch.Module):
    r"""Stochastic expectation propagation (SEP) with :math:`M` inducing inputs and the FITC conditional, for an
    ``ApproximateGP`` trained on minibatches like GPyTorch's SVGP: memory :math:`O(C M^2)` and
    :math:`O(C(M^3 + B M^2))` per minibatch of :math:`B` points, whatever the number of data :math:`N`
    (Hernández-Lobato & Hernández-Lobato 2016; Villacampa-Calvo & Hernández-Lobato 2017 for :math:`C` classes).

    The state is one tied site per latent process in the whitened inducing coordinates (:class:`~gpytorch_iterncgp.sparse.stochastic.TiedSite`),
    saved in the ``state_dict``; :class:`~gpytorch_iterncgp.StochasticEPMarginalLogLikelihood` moves it on each
    training minibatch and returns SEP's energy, whose gradient learns the kernel, the mean and the inducing inputs.

    In eval mode ``model(x)`` is the posterior :math:`q(\mathbf f(\mathbf x))`, independent per point and per
    latent: a ``MultivariateNormal`` with a diagonal covariance for :math:`C = 1`, a ``MultitaskMultivariateNormal``
    ``(N*, C)`` for :math:`C` classes; ``likelihood(model(x))`` is its predictive. In training mode, once an
    objective has told the strategy :math:`N`, it is each point's cavity instead, the distribution SEP's energy
    integrates against (as SVGP's training output is the :math:`q` its ELBO integrates against): for the tied site
    :math:`q` with one point's share :math:`1/N` of the site removed.

    ``sites="points"`` keeps one site per training point and latent instead (EP-FITC, memory :math:`O(C N)`), for
    full-batch training: every step on all :math:`N` training points in the same order. With the inducing inputs at
    the training inputs it is the dense EP of the factorised model.

    :param model: the ``ApproximateGP`` that owns this strategy (pass ``self``); its ``forward`` returns the prior, a
        ``MultivariateNormal`` without batch (one kernel; for :math:`C` classes shared by them) or with batch
        ``[C]`` (one GP per class).
    :param inducing_points: :math:`\mathbf Z`, ``(M, D)`` shared by the latents, or ``(C, M, D)``, one set per latent
        (as GPyTorch's batched inducing points; for :math:`C` classes with a kernel per class, :math:`M` each at the cost
        of :math:`M` shared ones: the prior's blocks are per class either way).
    :param likelihood: ``BernoulliLikelihood`` (probit), :class:`~gpytorch_iterncgp.LogitBernoulliLikelihood`, a
        Poisson likelihood, or :class:`~gpytorch_iterncgp.MultinomialProbitLikelihood` for :math:`C` classes.
    :param learn_inducing_locations: register :math:`\mathbf Z` as a parameter (else a buffer).
    :param sites: ``"tied"`` (SEP, minibatches) or ``"points"`` (EP, full batches).
    :raises TypeError: for a likelihood without tilted moments (softmax) or a ``model`` that is not a module.
    :raises ValueError: for another ``sites``.
    """

    #: the site of each ``sites`` choice
    SITES: dict[str, type[TiedSite] | type[PointSites]] = {"tied": TiedSite, "points": PointSites}

    def __init__(
        self,
        model: gpytorch.models.ApproximateGP,
        inducing_points: Tensor,
        likelihood: gpytorch.likelihoods.Likelihood,
        learn_inducing_locations: bool = True,
        sites: str = "tied",
    ):
        super().__init__()
        attach_to_model(self, model, likelihood)
        self.adapter = likelihood_adapter(likelihood)
        StochasticEP(self.adapter, 1)  # refuses likelihoods without tilted moments
        check_flag(learn_inducing_locations, "learn_inducing_locations")
        if sites not in self.SITES:
            raise ValueError(f"sites must be one of {sorted(self.SITES)}, got {sites!r}.")
        inducing = self._check_inducing(inducing_points).detach().clone()
        if learn_inducing_locations:
            self.register_parameter("inducing_points", torch.nn.Parameter(inducing))
        else:
            self.register_buffer("inducing_points", inducing)
        self.site: InducingSite = self.SITES[sites].flat(self.num_latents, inducing.shape[-2], inducing)
        #: :math:`N`, set by the objective (:class:`~gpytorch_iterncgp.StochasticEPMarginalLogLikelihood`)
        self.num_data: int | None = None
        # the last training output, its whitened batch and its cavities
        self._last: tuple[Any, WhitenedBatch, tuple[Tensor, Tensor]] | None = None

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
        autograd records them): :math:`\mathbf m` ``(C, B)``, :math:`\mathbf V` and :math:`\mathbf s` per kernel.

        :raises ValueError: for inputs of another number of features, or a prior of another batch shape.
        """
        inputs = check_inputs(inputs, "inputs", device=self.inducing_points.device)
        if inputs.shape[-1] != self.inducing_points.shape[-1]:
            raise ValueError(
                f"inputs have {inputs.shape[-1]} features but the inducing points {self.inducing_points.shape[-1]}."
            )
        num = self.num_inducing
        inducing = self.inducing_points
        inputs = inputs.to(inducing).expand(*inducing.shape[:-2], -1, -1)  # one copy per set of inducing inputs
        distribution = self.model.forward(torch.cat([inducing, inputs], dim=-2))
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
        mean = distribution.mean[..., num:].expand(self.num_latents, -1)
        return WhitenedBatch.from_blocks(
            mean,
            covariance[..., :num, :num].to_dense(),
            covariance[..., :num, num:].to_dense(),
            covariance[..., num:, num:].diagonal(dim1=-1, dim2=-2),
        )

    # -- the posterior ---------------------------------------------------------------------------
    def _distribution(self, mean: Tensor, variance: Tensor) -> MultivariateNormal:
        """Independent marginals ``(C, B)`` as GPyTorch's distribution of the model's output."""
        if self.num_latents == 1:
            return MultivariateNormal(mean[0], DiagLinearOperator(variance[0]))
        return MultitaskMultivariateNormal.from_batch_mvn(MultivariateNormal(mean, DiagLinearOperator(variance)))

    def forward(self, inputs: Tensor, prior: bool = False, **kwargs) -> MultivariateNormal:
        r"""The posterior marginals at ``inputs`` ``(B, D)``, or in training mode the points' cavities (class
        docstring); ``prior=True``: the model's prior. A training output is remembered with its whitened batch for the
        next :class:`~gpytorch_iterncgp.StochasticEPMarginalLogLikelihood` call."""
        if prior:
            return self.model.forward(inputs, **kwargs)
        batch = self.whitened_batch(inputs)
        num_data = self.num_data if self.training else None  # None: the posterior, else the cavities
        marginals = self.site.posterior(batch) if num_data is None else self.site.cavity(batch, num_data)
        output = self._distribution(*marginals)
        self._last = None if num_data is None else (output, batch, marginals)
        return output

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
    def training_batch(self, output: Any) -> tuple[WhitenedBatch, tuple[Tensor, Tensor]]:
        """The whitened batch of ``output``, the last output of ``model(x)`` in training mode, and its points'
        cavity marginals ``(C, B)`` each, differentiable in the prior.

        :raises RuntimeError: for any other output (compute ``mll(model(x_batch), y_batch)`` in training mode).
        """
        if self._last is None or self._last[0] is not output:
            raise RuntimeError(
                "StochasticEPMarginalLogLikelihood needs the output of the model's last call in training mode: call "
                "model.train() and compute mll(model(x_batch), y_batch) for each minibatch."
            )
        return self._last[1], self._last[2]

    def step(self, output: Any, targets: Tensor, moments: tuple[Tensor, Tensor, Tensor] | None = None) -> SEPStepRecord:
        """Move the site on the minibatch of a training ``output`` (:meth:`StochasticEP.step
        <gpytorch_iterncgp.sparse.stochastic.StochasticEP.step>`) from the cavities the output holds; ``moments``: the
        tilted moments at them, if computed (:func:`~gpytorch_iterncgp.sparse.stochastic.tilted`)."""
        batch, cavity = self.training_batch(output)  # a training output: num_data is set
        loop = StochasticEP(self.adapter, int(self.num_data or 0))
        self.site, record = loop.step(self.site, batch, targets, cavity, moments)
        return record

    # -- state_dict, copies and devices ---------------------------------------------------------
    def __getstate__(self) -> dict:
        """For ``copy.deepcopy`` and ``pickle`` (keeping the best model while training, say): everything but the last
        training output, whose tensors belong to that step's autograd graph (a copy starts without one, as after
        ``model.eval()``)."""
        return {**self.__dict__, "_last": None}

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
