r"""A BoTorch view of an IterNCGP model: the posterior of the *latent* function, for acquisition functions.

.. code-block:: python

    from botorch.acquisition import PosteriorMean, qExpectedImprovement
    from gpytorch_iterncgp.botorch import IterNCGPBoTorchModel

    surrogate = IterNCGPBoTorchModel(model)          # an ApproximateGP with an IterNCGPStrategy or EPStrategy
    # or IterNCGPBoTorchModel(estimator)             # a fitted gpytorch_iterncgp.sklearn estimator
    acquisition = qExpectedImprovement(surrogate, best_f=surrogate.posterior(train_x).mean.max())
    values = acquisition(X)                          # X: batch x q x d; differentiable in X

``posterior(X)`` is a :class:`botorch.posteriors.GPyTorchPosterior` of the Laplace posterior of the latent
function(s) :math:`f` (the log rate of a count model, the logit or probit of a classifier) — including
IterNCGP's computational uncertainty — jointly over the ``q`` points of every batch element:

.. math::
    \mathbf m(\mathbf X_*) + \mathbf K_{*X} \mathbf a, \qquad
    \mathbf K_{**} - \mathbf K_{*X} \mathbf Q \mathbf Q^\top \mathbf K_{X*}.

Observation noise is not part of it (the likelihood is not Gaussian), so ``observation_noise=True`` is
refused. Importing this module imports BoTorch; ``import gpytorch_iterncgp`` does not.
"""

from __future__ import annotations

import torch
from botorch.models.model import Model
from botorch.models.transforms.input import AffineInputTransform
from botorch.posteriors import GPyTorchPosterior
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from torch import Tensor

from ..strategies.itergp import EPStrategy, IterNCGPStrategy

__all__ = ["IterNCGPBoTorchModel"]


class IterNCGPBoTorchModel(Model):
    r"""A :class:`botorch.models.model.Model` whose posterior is the latent posterior of an IterNCGP model.

    :param model: a GPyTorch ``ApproximateGP`` whose ``variational_strategy`` is an
        :class:`~gpytorch_iterncgp.IterNCGPStrategy` or :class:`~gpytorch_iterncgp.EPStrategy`, or a fitted
        :class:`~gpytorch_iterncgp.sklearn.IterNCGPClassifier` / ``IterNCGPPoissonRegressor`` (its ``model_``;
        where it standardised the features, its ``scaler_`` is applied to ``X`` first, as ``estimator_transform``, so
        that ``X`` is in the features' own units). It is fitted on demand (as for any prediction of the strategy) and not changed
        otherwise.

    ``num_outputs`` is the number of latent functions :math:`C` (1 for binary classification and counts).
    With :math:`C = 1` the posterior of a ``batch × q × d`` input is computed for all batch elements at
    once (one cross-covariance of shape ``batch × q × N``); with :math:`C > 1` (softmax) it is a
    ``MultitaskMultivariateNormal`` (``batch × q × C``) built one batch element at a time.
    """

    def __init__(self, model) -> None:
        super().__init__()
        scaler = None
        if not isinstance(model, torch.nn.Module) and hasattr(model, "model_"):
            scaler = getattr(model, "scaler_", None)  # a fitted scikit-learn estimator of gpytorch_iterncgp.sklearn
            model = model.model_
        strategy = getattr(model, "variational_strategy", None)
        if not isinstance(strategy, (IterNCGPStrategy, EPStrategy)):
            raise TypeError(
                "IterNCGPBoTorchModel needs a GPyTorch model whose variational_strategy is an IterNCGPStrategy or "
                "EPStrategy "
                f"(or a fitted gpytorch_iterncgp.sklearn estimator), got {type(model).__name__}."
            )
        self.model = model
        # the estimator's standardisation (X - mean) / scale, BoTorch's affine transform applied before any
        # input_transform of this model's (not as one: BoTorch would look for transformed training inputs)
        self.estimator_transform: AffineInputTransform | None = None
        if scaler is not None:
            train_x = strategy.train_inputs
            coefficient, offset = (torch.as_tensor(v, dtype=train_x.dtype) for v in (scaler.scale_, scaler.mean_))
            self.estimator_transform = AffineInputTransform(len(coefficient), coefficient=coefficient, offset=offset)

    @property
    def strategy(self) -> IterNCGPStrategy | EPStrategy:
        return self.model.variational_strategy

    @property
    def num_outputs(self) -> int:
        return self.strategy.num_latents

    @property
    def batch_shape(self) -> torch.Size:
        return torch.Size([])

    def posterior(
        self,
        X: Tensor,
        output_indices: list[int] | None = None,
        observation_noise: bool | Tensor = False,
        posterior_transform=None,
        **kwargs,
    ) -> GPyTorchPosterior:
        """The joint latent posterior at ``X`` (``batch × q × d``, or ``q × d``), differentiable in ``X``.

        :param output_indices: latent functions to keep (``C > 1``); default all.
        :param observation_noise: must be ``False``: there is no Gaussian observation noise to add.
        :param posterior_transform: applied to the posterior (e.g. ``ScalarizedPosteriorTransform``).
        """
        if observation_noise is not False:
            raise NotImplementedError(
                "IterNCGPBoTorchModel is the posterior of the latent function; a non-Gaussian likelihood has no "
                "observation noise to add (observation_noise must be False)."
            )
        if X.dim() < 2:
            raise ValueError(f"X must have shape batch x q x d or q x d, got {tuple(X.shape)}.")
        self.eval()
        strategy = self.strategy
        train_x = strategy.train_inputs
        if X.shape[-1] != train_x.shape[-1]:
            raise ValueError(f"X has {X.shape[-1]} features but the model's training inputs have {train_x.shape[-1]}.")
        if self.estimator_transform is not None:
            X = self.estimator_transform.to(X)(X)
        X = self.transform_inputs(X).to(dtype=train_x.dtype, device=train_x.device)
        if strategy.num_latents == 1:
            distribution = self._single_latent(X)
        else:
            distribution = self._multi_latent(X, output_indices)
        posterior = GPyTorchPosterior(distribution)
        if posterior_transform is not None:
            posterior = posterior_transform(posterior)
        return posterior

    def _single_latent(self, X: Tensor) -> MultivariateNormal:
        r""":math:`C = 1`, all batch elements at once: prior at ``[X_train; X_b]``, then the IterNCGP correction."""
        strategy = self.strategy
        state = strategy.ensure_fitted()  # refits if the hyperparameters changed
        root = strategy.approximate_precision.root_tensor  # Q, all rows (gathered where the state holds them by rows)
        weights = torch.cat([strategy._rows_block().all_rows(state.representer_weights)[:, None], root], dim=-1)
        prior_mean, cross_covariance, test_prior = strategy.joint_prior(X)
        product = cross_covariance.matmul(weights)  # K_{*X} [a, Q]: (batch, q, 1 + r)
        mean = prior_mean + product[..., 0]
        correction = product[..., 1:]
        test_covariance = test_prior.to_dense() - correction @ correction.mT
        return MultivariateNormal(mean, test_covariance)

    def _multi_latent(self, X: Tensor, output_indices: list[int] | None) -> MultivariateNormal:
        """``C > 1``: the strategy's joint posterior (interleaved, data-major) per batch element, stacked."""
        num_latents = self.strategy.num_latents
        batch_shape, q = X.shape[:-2], X.shape[-2]
        means, covariances = [], []
        for x in X.reshape(-1, q, X.shape[-1]):
            latent = self.model(x)  # eval mode: MultitaskMultivariateNormal (q, C), interleaved
            means.append(latent.mean)
            covariances.append(latent.lazy_covariance_matrix.to_dense())
        mean = torch.stack(means).reshape(*batch_shape, q, num_latents)
        covariance = torch.stack(covariances).reshape(*batch_shape, q * num_latents, q * num_latents)
        if output_indices is not None:
            outputs = torch.as_tensor(output_indices, device=X.device)
            index = (torch.arange(q, device=X.device)[:, None] * num_latents + outputs).reshape(-1)
            mean = mean[..., outputs]
            covariance = covariance[..., index[:, None], index[None, :]]
            if len(output_indices) == 1:
                return MultivariateNormal(mean[..., 0], covariance)
        return MultitaskMultivariateNormal(mean, covariance, interleaved=True)
