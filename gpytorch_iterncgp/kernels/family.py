r"""The estimators' kernels for standardised features: the default Matérn (:func:`default_kernel`) and the family
``kernel="auto"`` chooses from (:func:`kernel_family`), every positive hyperparameter on the log scale
(:func:`log_positive`). The choice among them is :mod:`gpytorch_iterncgp.learning.kernel_choice`'s, the rule of which
ones the estimators choose among :mod:`gpytorch_iterncgp.learning.estimator_policy`'s."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import gpytorch
import torch
from gpytorch.kernels import Kernel

from .additive import FirstOrderAdditiveKernel
from .warping import KumaraswamyWarpedKernel

__all__ = ["default_kernel", "kernel_family", "log_positive"]


def log_positive() -> gpytorch.constraints.Positive:
    """Positivity by ``exp``: the optimiser works on log-hyperparameters (an outputscale of hundreds is reached
    quickly, and the evidence is closer to quadratic there)."""
    return gpytorch.constraints.Positive(transform=torch.exp, inv_transform=torch.log)


def default_kernel(num_features: int, dtype: torch.dtype = torch.float64) -> gpytorch.kernels.Kernel:
    r"""The estimators' default prior: ``ScaleKernel(MaternKernel(nu=2.5))``, lengthscale :math:`\sqrt{D}`,
    outputscale 1, for :math:`D` ``num_features``.

    Both hyperparameters are log-parametrised (``Positive(transform=exp)``). :math:`\sqrt{D}` is the
    typical distance scale of standardised features in :math:`D` dimensions.

    Why this kernel: Matérn-5/2 (twice differentiable sample paths) is the usual default of GP practice
    (R&W sec. 4.2; Snoek et al. 2012), less prone than the RBF to over-smoothing and to ill-conditioning at long
    lengthscales; one isotropic lengthscale, because two hyperparameters are well determined by the evidence of a
    few hundred labels, while automatic relevance determination (a lengthscale per feature) lets the
    evidence overfit (on scikit-learn's small data sets ARD raised the evidence and worsened the test log-loss;
    ``docs/design_notes.md``). The estimators take ``kernel=`` for anything else.

    :param num_features: :math:`D`.
    :param dtype: of the kernel's parameters (the estimators compute in float64).
    :return: a new kernel, with batch shape ``[]`` (one kernel shared by all latent functions).
    """
    kernel = gpytorch.kernels.ScaleKernel(
        gpytorch.kernels.MaternKernel(nu=2.5, lengthscale_constraint=log_positive()),
        outputscale_constraint=log_positive(),
    ).to(dtype)
    # values as tensors of the kernel's dtype: a Python float would be rounded through torch's default float32
    kernel.base_kernel.lengthscale = torch.tensor(math.sqrt(num_features), dtype=dtype)
    kernel.outputscale = torch.tensor(1.0, dtype=dtype)
    return kernel


def kernel_family(
    num_features: int, dtype: torch.dtype = torch.float64, names: Sequence[str] | None = None
) -> dict[str, Kernel]:
    r"""The estimators' candidate kernels (``kernel="auto"``) for :math:`D` standardised features, each new, every
    positive hyperparameter log-parametrised (:func:`~.estimator_policy.log_positive`), batch shape ``[]``:

    * ``"matern"``: :func:`~.estimator_policy.default_kernel`, :math:`s^2 k_{5/2}(\lVert x - x' \rVert / \ell)`, one
      lengthscale :math:`\ell = \sqrt D` (the estimators' default);
    * ``"matern_ard"``: :math:`s^2 k_{5/2}(r)`, :math:`r^2 = \sum_d (x_d - x'_d)^2 / \ell_d^2`, one lengthscale per
      feature (automatic relevance determination, R&W sec. 5.1), each :math:`\sqrt D`: the evidence lengthens those of
      irrelevant features;
    * ``"linear+matern"``: :math:`s^2 (\sigma^2 x^\top x' + k_{5/2}(\lVert x - x' \rVert / \ell))` with
      :math:`\sigma^2 = 1 / D` (a prior variance :math:`\sigma^2 \lVert x \rVert^2 \approx 1` of the linear part,
      as the Matérn's, at standardised features): a linear decision function (Bayesian linear regression on the
      features, R&W sec. 2.1) plus a smooth non-linear correction (the sum of kernels, Duvenaud et al. 2013);
    * ``"linear+matern_ard"``: the same with the ARD Matérn;
    * ``"warped_matern"``: :math:`s^2 k_{5/2}(\lVert w(x) - w(x') \rVert / \ell)`, the Matérn of the features warped
      one by one by a learnt monotone map :math:`w_d = F(\Phi(x_d); a_d, b_d)`, :math:`F` the Kumaraswamy CDF
      (:class:`~gpytorch_iterncgp.kernels.warping.KumaraswamyWarpedKernel`, Snoek et al. 2014), starting at
      :math:`a_d = b_d = 1` (:math:`w_d = \Phi(x_d)`, uniform for normal features) with :math:`\ell = \sqrt{D / 12}`
      (the standard deviation of a uniform feature is :math:`1 / \sqrt{12}`): for skewed and heavy-tailed features,
      whose tails would otherwise dominate the distances;
    * ``"additive"``: :math:`s^2 \sum_d v_d k_{5/2}(\lvert x_d - x'_d \rvert / \ell_d)`, a weight and a lengthscale per
      feature (the first-order additive kernel of Duvenaud, Nickisch & Rasmussen 2011,
      :class:`~gpytorch_iterncgp.kernels.additive.FirstOrderAdditiveKernel`), starting at :math:`v_d = 1 / D`,
      :math:`\ell_d = 1`: a sum of functions of one feature each, which the Matérn of all of them learns slowly
      (and the ARD Matérn's products cannot write as a sum).

    The sums are written under one ``ScaleKernel`` (the same family as :math:`\sigma^2 x^\top x' + s^2 k_{5/2}`), so
    that a classifier learnt on a subset gets :func:`~gpytorch_iterncgp.fit_mll`'s outputscale phase whatever the
    candidate, as the Matérn kernels do.

    :param num_features: :math:`D`.
    :param dtype: of the kernels' parameters (the estimators compute in float64).
    :param names: build only these (in the order above); ``None``: all.
    :return: ``{name: kernel}`` in the order above.
    :raises ValueError: for a name not in the family.
    """
    builders: dict[str, Callable[[], Kernel]] = {
        "matern": lambda: default_kernel(num_features, dtype),
        "matern_ard": lambda: _scaled(_matern(num_features, ard=True), num_features, dtype),
        "linear+matern": lambda: _scaled(_linear() + _matern(num_features, ard=False), num_features, dtype),
        "linear+matern_ard": lambda: _scaled(_linear() + _matern(num_features, ard=True), num_features, dtype),
        "warped_matern": lambda: _scaled(
            _warped(_matern(num_features, ard=False), num_features), num_features, dtype, math.sqrt(num_features / 12)
        ),
        "additive": lambda: _scaled(_additive(num_features), num_features, dtype, lengthscale=1.0),
    }
    unknown = sorted(set(names or ()) - set(builders))
    if unknown:
        raise ValueError(f"kernel_family has no kernel {unknown[0]!r}; its kernels are {list(builders)}.")
    return {name: build() for name, build in builders.items() if names is None or name in names}


def _matern(num_features: int, ard: bool) -> gpytorch.kernels.MaternKernel:
    """Matérn-5/2 with a log-positive lengthscale, one per feature where ``ard``."""
    return gpytorch.kernels.MaternKernel(
        nu=2.5, ard_num_dims=num_features if ard else None, lengthscale_constraint=log_positive()
    )


def _warped(base: Kernel, num_features: int) -> KumaraswamyWarpedKernel:
    """``base`` of the Kumaraswamy-warped normal CDFs of the features, log-positive concentrations."""
    return KumaraswamyWarpedKernel(base, num_features, concentration_constraint=log_positive())


def _additive(num_features: int) -> FirstOrderAdditiveKernel:
    """A log-positive weight times a Matérn-5/2 of one feature, for each of ``num_features``."""
    weighted = gpytorch.kernels.ScaleKernel(_matern(1, ard=False), outputscale_constraint=log_positive())
    return FirstOrderAdditiveKernel(weighted, num_features)


def _linear() -> gpytorch.kernels.LinearKernel:
    """:math:`\\sigma^2 x^\\top x'` with a log-positive variance."""
    return gpytorch.kernels.LinearKernel(variance_constraint=log_positive())


def _scaled(
    base: Kernel, num_features: int, dtype: torch.dtype, lengthscale: float | None = None
) -> gpytorch.kernels.ScaleKernel:
    r"""``ScaleKernel(base)``: outputscale 1, every Matérn lengthscale ``lengthscale`` (default :math:`\sqrt D`),
    every linear variance and inner outputscale :math:`1 / D` (tensors of ``dtype``, so they are not rounded through
    float32)."""
    kernel = gpytorch.kernels.ScaleKernel(base, outputscale_constraint=log_positive()).to(dtype)
    kernel.outputscale = torch.tensor(1.0, dtype=dtype)
    lengthscale = math.sqrt(num_features) if lengthscale is None else lengthscale
    for module in kernel.modules():
        if isinstance(module, gpytorch.kernels.MaternKernel):
            module.lengthscale = torch.tensor(lengthscale, dtype=dtype)
        elif isinstance(module, gpytorch.kernels.LinearKernel):
            module.variance = torch.tensor(1.0 / num_features, dtype=dtype)
        elif isinstance(module, gpytorch.kernels.ScaleKernel) and module is not kernel:
            module.outputscale = torch.tensor(1.0 / num_features, dtype=dtype)
    return kernel
