r"""Marginal log likelihoods for learning hyperparameters, in GPyTorch's ``mll(output, target)`` idiom:
:mod:`.itergp` (Laplace's and EP's evidence), :mod:`.sparse` (the EP-DTC bound), :mod:`.uncertain` (the bound with
uncertain inputs)."""
