r"""Kernels of the package's own, wrapping GPyTorch's: :mod:`.sharded` (``ShardedKernel``, the kernel products of a
fit split by rows over the processes of a ``torch.distributed`` process group; public as
``gpytorch_iterncgp.distributed``)."""
