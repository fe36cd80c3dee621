r"""Global settings, as context managers in GPyTorch's idiom: subclasses of ``gpytorch.settings``' own value contexts
and feature flags.

.. code-block:: python

    with gpytorch_iterncgp.settings.exact_evidence_size(5000):
        loss = -mll(model(train_x), train_y)     # dense evidence up to N C = 5000

Each is a class with a ``value()`` classmethod and a context manager that sets it for the ``with`` block.
Options that belong to one model (tolerances, budgets, the policy) are constructor arguments of
:class:`~gpytorch_iterncgp.IterNCGPStrategy`, not settings.
"""

from __future__ import annotations

from gpytorch.settings import _feature_flag, _value_context

__all__ = [
    "dense_kernel_limit",
    "exact_evidence_size",
    "fused_kernel_backend",
    "fused_kernel_products",
    "kernel_chunk_bytes",
    "recycled_buffer_limit",
    "retain_allocations",
    "softmax_samples",
]


class exact_evidence_size(_value_context):
    r"""Largest :math:`N C` for which :class:`~gpytorch_iterncgp.LaplaceMarginalLogLikelihood` is dense (default 1000).

    Up to it the log-determinant and the Newton step of the evidence use the dense kernel matrix (exact,
    :math:`O((N C)^3)`); above it, products with :math:`\mathbf K` only (CG and stochastic Lanczos quadrature).
    Independent of ``gpytorch.settings.max_cholesky_size``, which other libraries (BoTorch) change globally.
    """

    _global_value = 1000


class dense_kernel_limit(_value_context):
    r"""Largest dense kernel matrix, in bytes, that a product with :math:`\mathbf K` may evaluate and cache (4 GiB).

    A GPyTorch ``LazyEvaluatedKernelTensor`` evaluates and caches the whole :math:`N \times M` kernel on its
    first product: fast (one BLAS call per product) while it fits in memory. Above this limit, products run
    over row chunks of ``kernel_chunk_bytes`` each, so the dense matrix is never formed (and each product
    re-evaluates the kernel). KeOps kernels never form the matrix and are never chunked. Chunking applies
    where no gradient is recorded (fits, predictions).
    """

    _global_value = 4 * 2**30


class recycled_buffer_limit(_value_context):
    r"""Largest recycled-action buffer, in bytes, that a solve keeps (4 GiB): its actions and their kernel
    products, :math:`2 N C B` numbers for :math:`B` actions of :math:`N C` latent values.

    Recycling keeps every action of earlier solves unless ``compression_rank`` is set; EP's sweeps add their CG
    actions and unit vectors at bounded points, so at large :math:`N C` the buffer can outgrow the machine (10 classes
    at :math:`N = 2 \cdot 10^4` passed 20 GB). A solve whose buffer, with its own new actions, would pass this limit
    compresses it first to the largest rank that fits (:func:`~gpytorch_iterncgp.virtual_solver_run`, the top
    eigen-directions), with a :class:`~gpytorch_iterncgp.exceptions.BufferLimitWarning`. The count is of all
    :math:`N C` rows, also where they are sharded (every rank compresses alike). The covariance phase
    (:mod:`~gpytorch_iterncgp.core.covariance`) stops where the posterior's precision root :math:`\mathbf Q` and
    :math:`\mathbf K \mathbf Q` would pass it, with the same warning.
    """

    _global_value = 4 * 2**30


class kernel_chunk_bytes(_value_context):
    """Bytes of kernel matrix evaluated at once in a chunked product (256 MiB); see :class:`dense_kernel_limit`."""

    _global_value = 2**28


class fused_kernel_products(_feature_flag):
    r"""Multiply by stationary kernels without forming them, where products would otherwise be chunked (on).

    Above :class:`dense_kernel_limit`, and where no gradient is recorded, a product with the kernel matrix of
    an RBF or Matérn (:math:`\nu \in \{\tfrac12, \tfrac32, \tfrac52\}`) kernel, ARD or not, optionally inside
    a ``ScaleKernel``, runs fused: a Triton kernel on CUDA, a ``torch.compile``\ d blocked loop on CPU (see
    :class:`fused_kernel_backend`). Any other kernel keeps the chunked GPyTorch product.
    """

    _default = True


class fused_kernel_backend(_value_context):
    """How a fused product runs: ``"auto"`` (default: ``"triton"`` on CUDA, ``"compile"`` on CPU),
    ``"triton"`` (on CPU tensors only in Triton's interpreter, ``TRITON_INTERPRET=1``), ``"compile"``
    (``torch.compile`` of the blocked loop; falls back to ``"eager"`` with a ``PerformanceWarning`` if it
    cannot compile) or ``"eager"`` (the same blocked loop, uncompiled)."""

    _global_value = "auto"


class retain_allocations(_feature_flag):
    r"""Keep the C library's freed large blocks in the process during the package's fits, ``fit_mll`` and predictions
    (on): glibc otherwise returns each block above 32 MiB to the system when it is freed and faults its pages in anew
    on the next allocation, which at a few thousand points costs a third or more of a fit's time
    (:func:`~gpytorch_iterncgp.core.memory.retained_allocations`). Off: glibc's own behaviour throughout."""

    _default = True


class softmax_samples(_value_context):
    r"""Monte Carlo samples (antithetic pairs count two) of the softmax predictive
    :math:`\mathbb E[\operatorname{softmax}(\mathbf f)]` per test point (1024): standard error below
    :math:`0.5/\sqrt{S}` per probability. The base samples are fixed, so predictions are deterministic."""

    _global_value = 1024
