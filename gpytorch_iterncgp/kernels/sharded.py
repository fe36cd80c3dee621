r""":class:`ShardedKernel`: a GPyTorch kernel whose products with the training data are shared by the processes of a
``torch.distributed`` process group, each evaluating its block of rows (:mod:`gpytorch_iterncgp.core.sharding`).

The idiom is GPyTorch's ``MultiDeviceKernel`` (Wang et al. 2019), which splits the rows of :math:`\mathbf K` over
the GPUs of one process; here they are split over processes (``torchrun``), so that they may be on several
machines, and the blocks are assembled by ``torch.distributed.all_gather``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from gpytorch.kernels import Kernel
from torch import Tensor

from ..core.sharding import RowShardedKernel, ShardedKernelMatrix

__all__ = ["ShardedKernel"]

_BASE = "sharded_kernel."  # the wrapped kernel's attribute: a name no GPyTorch kernel uses for a child


def _drop_base_prefix(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``state_dict`` hook: the wrapped kernel's entries under the wrapper's own prefix (``covar_module.raw_...``, as
    in a model without the wrapper)."""
    for key in [key for key in state_dict if key.startswith(prefix + _BASE)]:
        state_dict[prefix + key[len(prefix + _BASE) :]] = state_dict.pop(key)


def _add_base_prefix(state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook: the entries saved without the wrapper (or by :func:`_drop_base_prefix`) given
    to the wrapped kernel."""
    for key in [key for key in state_dict if key.startswith(prefix) and not key.startswith(prefix + _BASE)]:
        state_dict[prefix + _BASE + key[len(prefix) :]] = state_dict.pop(key)


class ShardedKernel(RowShardedKernel):
    r"""``base_kernel`` with its products by rows over the ranks of a ``torch.distributed`` process group.

    Every process (``torchrun --nproc-per-node P script.py``; each calls
    ``torch.distributed.init_process_group()``) builds the same model on the same data with its kernel wrapped:

    .. code-block:: python

        self.covar_module = ShardedKernel(ScaleKernel(MaternKernel(nu=1.5)))

    Fitting with :class:`~gpytorch_iterncgp.IterNCGPStrategy` or :class:`~gpytorch_iterncgp.EPStrategy` then
    splits each product :math:`\mathbf K \mathbf R` by rows: rank :math:`p` of :math:`P` evaluates its
    :math:`\lceil N / P \rceil` rows (the fused RBF / Matérn tiles of :mod:`~gpytorch_iterncgp.core.kernel_products`
    above :class:`~gpytorch_iterncgp.settings.dense_kernel_limit`, its cached rows of :math:`\mathbf K` below), and
    one ``all_gather`` gives every rank the whole product, bit for bit the same; the rest of the fit is replicated,
    so every rank holds the same posterior (that of one process, up to the order of the reductions within a row
    block); with ``shard_state`` the solver's state is held by rows too (the recycled actions, :math:`\mathbf Q`,
    :math:`\mathbf K \mathbf Q`, and every vector of the Newton or EP loop and of IterGP). Predictions'
    cross-covariance products are split by test points in the same way (with ``shard_state`` by training points:
    each rank's columns times its rows of the state, summed by ``all_reduce``).

    The entries, the diagonal and whatever needs gradients (hyperparameter learning, a dense evidence) are
    ``base_kernel``'s own, evaluated on every rank. ``state_dict()`` holds ``base_kernel``'s entries under this
    kernel's own name, so that it loads into the same model without the wrapper, and vice versa.

    :param base_kernel: the kernel.
    :param process_group: the ranks that share the products (default: torch.distributed's default group).
    :param shard_state: hold the solver's state by rows as well (:class:`~gpytorch_iterncgp.IterNCGPStrategy`,
        :class:`~gpytorch_iterncgp.EPStrategy`): the recycled actions :math:`\mathbf S`, :math:`\mathbf K \mathbf S`,
        the precision roots :math:`\mathbf Q`, :math:`\mathbf K \mathbf Q` (also the final ones that predictions use,
        and through a covariance phase), the representer weights :math:`\mathbf a`, :math:`\mathbf K \mathbf a`, the
        Newton loop's mode, gradient, curvature blocks and right-hand side, EP's sites and marginals, and IterGP's
        residual, actions and directions: each rank :math:`\lceil N / P \rceil C` rows of them (its points), inner
        products and norms by ``all_reduce``, each product's right-hand side gathered once. ``state_dict()`` is then a
        collective (every rank calls it; it gathers them). The wrapper must then be the model's covariance kernel
        (``forward`` returns the distribution of its evaluation): a fit refuses a covariance built in ``forward`` from
        its entries (e.g. a sum of Kronecker products), whose products are not split by rows.
    :raises TypeError: if ``shard_state`` is not a bool.
    :raises RuntimeError: when a product is taken before ``torch.distributed.init_process_group()``.
    """

    def __init__(self, base_kernel: Kernel, process_group: dist.ProcessGroup | None = None, shard_state: bool = False):
        super().__init__()
        if not isinstance(shard_state, bool):
            raise TypeError(f"shard_state must be True or False, got {shard_state!r}.")
        self.shard_state = shard_state
        if not isinstance(base_kernel, Kernel):
            raise TypeError(f"ShardedKernel wraps a gpytorch Kernel, got {type(base_kernel).__name__}.")
        self.sharded_kernel = base_kernel
        self.process_group = process_group
        # collective products: gathered (of the training data, or predictions' cross-covariances by test points) and,
        # with shard_state, predictions' cross-covariance columns summed by all_reduce
        self.products = 0
        # bytes of those products this rank sent: its gathered rows to each other rank; for an all_reduce of k numbers
        # its operand, k times the element size (what the backend moves per rank depends on its algorithm)
        self.bytes_sent = 0
        self._register_state_dict_hook(_drop_base_prefix)
        self._register_load_state_dict_pre_hook(_add_base_prefix)

    @property
    def base_kernel(self) -> Kernel:
        """The wrapped kernel (as ``MultiDeviceKernel.base_kernel``)."""
        return self.sharded_kernel

    def num_outputs_per_input(self, x1: Tensor, x2: Tensor) -> Any:
        return self.base_kernel.num_outputs_per_input(x1, x2)

    def prediction_strategy(self, *args: Any, **kwargs: Any) -> Any:
        return self.base_kernel.prediction_strategy(*args, **kwargs)

    def _needs_gradients(self, x1: Tensor, x2: Tensor) -> bool:
        if not torch.is_grad_enabled():
            return False
        return x1.requires_grad or x2.requires_grad or any(p.requires_grad for p in self.base_kernel.parameters())

    def forward(self, x1: Tensor, x2: Tensor, diag: bool = False, last_dim_is_batch: bool = False, **params: Any):
        """A :class:`~gpytorch_iterncgp.core.sharding.ShardedKernelMatrix`; ``base_kernel``'s own evaluation for the
        diagonal, with ``last_dim_is_batch``, or where gradients are recorded."""
        if diag or last_dim_is_batch or self._needs_gradients(x1, x2):
            return self.base_kernel(x1, x2, diag=diag, last_dim_is_batch=last_dim_is_batch, **params)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ShardedKernel: torch.distributed is not initialised; call torch.distributed.init_process_group() in "
                "every process (launched by torchrun) before fitting, or use the wrapped kernel (.base_kernel) in a "
                "single process."
            )
        return ShardedKernelMatrix(x1, x2, self.base_kernel, self.process_group, self._record, **params)

    def _record(self, sent: int) -> None:
        self.products += 1
        self.bytes_sent += sent
