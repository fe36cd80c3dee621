"""Learning the hyperparameters of a GPyTorch model with an IterNCGP or EP strategy: :func:`fit.fit_mll` (at
``gpytorch_iterncgp.fit_mll``), the recipe and its report (:mod:`.recipe`), the rows it learns on (:mod:`.rows`), the
model it learns with (:mod:`.learner`), a classifier's outputscale by held-out rows (:mod:`.outputscale`), the kernel
chosen among candidates by the evidence (:mod:`.kernel_choice`: ``fit_mll(kernels=...)``, the estimators'
``kernel="auto"``), and how the scikit-learn estimators choose their inference, solver budget, kernel and strategy
options (:mod:`.estimator_policy`)."""
