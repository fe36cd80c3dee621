r"""The GPyTorch-facing layer: strategies that replace a ``VariationalStrategy``, so that ``likelihood(model(x))``
gives the approximate posterior's predictive. :mod:`~gpytorch_iterncgp.strategies.itergp`: Laplace and EP with IterGP's posterior;
:mod:`~gpytorch_iterncgp.strategies.sparse`: sparse EP-DTC; :mod:`~gpytorch_iterncgp.strategies.stochastic`: stochastic EP
with inducing inputs on minibatches."""
