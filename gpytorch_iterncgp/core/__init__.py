r"""The shared core: one GP regression :math:`(\mathbf K + \mathbf W^{-1}) \mathbf v = \mathbf b` solved by IterGP.

Every outer loop of the package (Laplace's Newton steps, EP's sweeps) is a sequence of such regressions over this
core: the prior and its products with :math:`\mathbf K` (:mod:`.prior`, :mod:`.kernel_products`,
:mod:`.triton_kernels`), the noise operators :math:`\mathbf W^{-1}` (:mod:`.noise`), IterGP and its policies
(:mod:`.solver`, :mod:`.policies`, :mod:`.precision`), recycling across steps (:mod:`.recycling`, paper Alg. 3),
the covariance phase (:mod:`.covariance`), products split by rows over ``torch.distributed`` ranks
(:mod:`.sharding`), the driver every outer loop runs under (:mod:`.outer_loop`) and the
argument checks (:mod:`.validation`). Nothing here knows a likelihood.
"""
