r"""Sparse EP under the DTC prior of inducing inputs: :mod:`.dtc` (EP-DTC), :mod:`.uncertain` (uncertain inputs),
:mod:`.psi_statistics` (kernel expectations under Gaussian inputs) and :mod:`.uncertain_prediction` (the predictive
at uncertain test inputs)."""
