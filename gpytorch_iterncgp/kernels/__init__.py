r"""Kernels of the package's own, wrapping GPyTorch's: :mod:`.sharded` (``ShardedKernel``, the kernel products of a
fit split by rows over the processes of a ``torch.distributed`` process group; public as
``gpytorch_iterncgp.distributed``), :mod:`.additive` (``FirstOrderAdditiveKernel``, a sum of kernels of one feature
each in the memory of one) and :mod:`.warping` (``KumaraswamyWarpedKernel``, a kernel of inputs warped by a learnt
monotone map per feature); and :mod:`.family`, the estimators' default kernel and the candidates of
``kernel="auto"`` (:func:`~gpytorch_iterncgp.kernels.family.kernel_family`)."""
