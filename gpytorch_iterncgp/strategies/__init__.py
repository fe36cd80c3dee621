r"""The GPyTorch-facing layer: strategies that replace a ``VariationalStrategy``, so that ``likelihood(model(x))``
gives the approximate posterior's predictive. :mod:`.itergp`: Laplace and EP with IterGP's posterior;
:mod:`.sparse`: sparse EP-DTC."""
