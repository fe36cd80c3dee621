r"""Sparse EP under the DTC prior of inducing inputs: :mod:`~gpytorch_iterncgp.sparse.dtc` (EP-DTC), :mod:`~gpytorch_iterncgp.sparse.uncertain` (uncertain inputs),
:mod:`~gpytorch_iterncgp.sparse.psi_statistics` (kernel expectations under Gaussian inputs) and :mod:`~gpytorch_iterncgp.sparse.uncertain_prediction` (the predictive
at uncertain test inputs)."""
