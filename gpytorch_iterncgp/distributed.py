"""The multi-process path on ``torch.distributed``: :class:`ShardedKernel` splits the kernel products of a fit by rows
over the processes of a process group (``docs/distributed.md``)."""

from .kernels.sharded import ShardedKernel

__all__ = ["ShardedKernel"]
