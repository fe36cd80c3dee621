r"""Marginal log likelihoods for learning hyperparameters, in GPyTorch's ``mll(output, target)`` idiom:
:mod:`~gpytorch_iterncgp.mlls.itergp` (Laplace's and EP's evidence), :mod:`~gpytorch_iterncgp.mlls.sparse` (the EP-DTC bound), :mod:`~gpytorch_iterncgp.mlls.uncertain` (the bound with
uncertain inputs)."""
