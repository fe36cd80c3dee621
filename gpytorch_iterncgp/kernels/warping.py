r""":class:`KumaraswamyWarpedKernel`: a kernel on inputs warped feature by feature by a learnt monotone map, the input
warping of Snoek, Swersky, Zemel & Adams (2014, "Input warping for Bayesian optimization of non-stationary
functions"), there by the Beta CDF, here by the Kumaraswamy CDF, which has the Beta's shapes (identity, concave,
convex, sigmoid, inverse sigmoid) and a closed form (as BoTorch's ``Warp`` input transform).

The warping is part of the kernel, so that a model's kernel can be chosen among candidates with and without it
(:func:`~gpytorch_iterncgp.fit_mll`'s ``kernels=``) on the same inputs, and its two concentrations per feature are
learnt by the evidence with the kernel's other hyperparameters.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from gpytorch.constraints import Interval, Positive
from gpytorch.kernels import Kernel
from linear_operator import to_dense
from torch import Tensor

__all__ = ["KumaraswamyWarpedKernel"]


class KumaraswamyWarpedKernel(Kernel):
    r"""``base_kernel`` on the inputs warped feature by feature,

    .. math::

        k(\mathbf x, \mathbf x') = k_{\text{base}}(w(\mathbf x), w(\mathbf x')), \qquad
        w_d(x) = F(u_d(x); a_d, b_d) = 1 - \bigl(1 - u_d(x)^{a_d}\bigr)^{b_d},

    :math:`F` the Kumaraswamy CDF with concentrations :math:`a_d, b_d > 0` (learnt; :math:`a_d = b_d = 1` is the
    identity on :math:`u`), and :math:`u_d(x) = \Phi(x)`, the standard normal CDF, for standardised features
    (``unit_cube=False``: their bulk spread over :math:`(0, 1)`, their tails compressed towards the ends), or
    :math:`u_d(x) = x` for features already in :math:`[0, 1]` (``unit_cube=True``, BoTorch's normalised inputs).
    :math:`F` is evaluated in log space, :math:`w = -\operatorname{expm1}(b \log(-\operatorname{expm1}(a \log u)))`
    with :math:`\log \Phi` by ``torch.special.log_ndtr``, so that inputs far in the tails keep finite gradients.

    .. code-block:: python

        covar_module = ScaleKernel(KumaraswamyWarpedKernel(MaternKernel(nu=2.5), num_dims=train_x.shape[-1]))

    :param base_kernel: the kernel of the warped inputs ``(..., n, D)``.
    :param num_dims: :math:`D`, the number of features (one pair of concentrations each).
    :param unit_cube: whether the inputs are already in :math:`[0, 1]` (then clamped to it) instead of standardised.
    :param concentration_constraint: of :math:`a_d, b_d` (default: GPyTorch's ``Positive``).
    :raises ValueError: for ``num_dims`` < 1; inputs with another number of features, when evaluated.
    """

    def __init__(
        self,
        base_kernel: Kernel,
        num_dims: int,
        unit_cube: bool = False,
        concentration_constraint: Interval | None = None,
        **kwargs: Any,
    ):
        if isinstance(num_dims, bool) or not isinstance(num_dims, int) or num_dims < 1:
            raise ValueError(f"KumaraswamyWarpedKernel: num_dims must be a positive int (features), got {num_dims!r}.")
        super().__init__(batch_shape=base_kernel.batch_shape, **kwargs)
        self.base_kernel = base_kernel
        self.num_dims = num_dims
        self.unit_cube = unit_cube
        # log u(x) of the last inputs: the products and kernel columns of one fit evaluate the kernel at the same
        # training inputs many times (w(x) itself, which depends on the concentrations too, is computed each time)
        self._last_log_u = _LastInputs()
        shape = (*self.batch_shape, 1, num_dims)
        for name in ("concentration1", "concentration0"):  # a_d, b_d (torch.distributions' names)
            constraint = Positive() if concentration_constraint is None else copy.deepcopy(concentration_constraint)
            raw = torch.nn.Parameter(constraint.inverse_transform(torch.ones(shape)))
            self.register_parameter(f"raw_{name}", raw)
            self.register_constraint(f"raw_{name}", constraint)

    @property
    def concentration1(self) -> Tensor:
        """:math:`a` ``(*batch, 1, D)``."""
        return self.raw_concentration1_constraint.transform(self.raw_concentration1)

    @concentration1.setter
    def concentration1(self, value: Tensor | float) -> None:
        self._set_concentration("concentration1", value)

    @property
    def concentration0(self) -> Tensor:
        """:math:`b` ``(*batch, 1, D)``."""
        return self.raw_concentration0_constraint.transform(self.raw_concentration0)

    @concentration0.setter
    def concentration0(self, value: Tensor | float) -> None:
        self._set_concentration("concentration0", value)

    def _set_concentration(self, name: str, value: Tensor | float) -> None:
        raw = getattr(self, f"raw_{name}")
        value = torch.as_tensor(value, dtype=raw.dtype, device=raw.device)
        self.initialize(**{f"raw_{name}": getattr(self, f"raw_{name}_constraint").inverse_transform(value)})

    def warp(self, x: Tensor) -> Tensor:
        r""":math:`w(\mathbf x)` ``(..., n, D)`` of inputs ``(..., n, D)``, each entry in :math:`[0, 1]`.

        :raises ValueError: for inputs whose last dimension is not :math:`D`.
        """
        if x.shape[-1] != self.num_dims:
            raise ValueError(
                f"KumaraswamyWarpedKernel: inputs have {x.shape[-1]} features, the kernel warps num_dims="
                f"{self.num_dims}; build it with num_dims={x.shape[-1]} (or select the features with active_dims)."
            )
        a, b = self.concentration1, self.concentration0
        tiny = torch.finfo(x.dtype).tiny
        log_u = self._last_log_u.get(x)
        if log_u is None:
            log_u = x.clamp(tiny, 1.0).log() if self.unit_cube else torch.special.log_ndtr(x)
            self._last_log_u.put(x, log_u)
        one_minus_power = (-torch.expm1(a * log_u)).clamp_min(tiny)  # 1 - u^a
        return -torch.expm1(b * one_minus_power.log())

    def forward(self, x1: Tensor, x2: Tensor, diag: bool = False, **params: Any) -> Tensor:
        """The base kernel ``(..., n1, n2)`` (``(..., n1)`` with ``diag``) of the warped inputs."""
        warped1 = self.warp(x1)
        warped2 = warped1 if x2 is x1 else self.warp(x2)
        return to_dense(self.base_kernel.forward(warped1, warped2, diag=diag, **params))

    @property
    def is_stationary(self) -> bool:
        """``False``: stationary in the warped inputs, not in the inputs."""
        return False


class _LastInputs:
    """Values computed of the last two input tensors given, kept while they are unchanged: a kernel is evaluated
    between its inputs and one other block at a time (the rows of a product, the points of kernel columns), so the
    input that recurs stays while the others replace each other.

    An input matches a later one that is the same view of the same memory (data pointer, shape, strides, dtype,
    device) at the same version (no in-place change since), whichever tensor object it is (kernels are called on
    slices of their inputs): nothing is compared by value, so nothing waits for an accelerator. An entry holds its
    input, so that the memory is not reused meanwhile. Inputs that require gradients are never kept."""

    size = 2

    def __init__(self) -> None:
        self.entries: list[tuple[Tensor, int, Tensor]] = []  # the most recently used last

    def __getstate__(self) -> dict[str, Any]:  # a copy or a pickle of the kernel starts empty
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.entries = []

    def get(self, x: Tensor) -> Tensor | None:
        """The value kept for ``x``, or ``None``."""
        if x.requires_grad:
            return None
        for index, (kept, version, value) in enumerate(self.entries):
            same = (
                x.data_ptr() == kept.data_ptr()
                and x.shape == kept.shape
                and x.stride() == kept.stride()
                and x.dtype == kept.dtype
                and x.device == kept.device
                and x._version == version
            )
            if same:
                self.entries.append(self.entries.pop(index))
                return value
        return None

    def put(self, x: Tensor, value: Tensor) -> None:
        """Keep ``value`` for ``x``, in place of the least recently used."""
        if not (x.requires_grad or value.requires_grad):
            self.entries = [*self.entries[1 - self.size :], (x, x._version, value)]
