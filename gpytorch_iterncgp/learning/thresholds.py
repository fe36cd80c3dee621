r"""The sizes and tolerances :func:`~gpytorch_iterncgp.fit_mll` and the scikit-learn estimators decide by, in one
place, each with the measurement behind it: the learning's rows (:data:`LEARNING_SUBSET_COST`,
:data:`KERNEL_CHOICE_COST`) and threads (:data:`ONE_THREAD_LEARNING_SIZE`), the estimators' exact solves
(:data:`EXACT_SOLVE_SIZE`, :data:`EXACT_MARGINAL_TOL`), EP's solver budget (:data:`EP_POINTS_PER_BUDGET`) and the
switch to stochastic EP (:data:`SPARSE_EP_POINTS`, :data:`SPARSE_EP_LATENT_VALUES`, :data:`SPARSE_EP_NESTED_WORK`).
The rules that read them are :mod:`.rows`, :mod:`.fit` and :mod:`.estimator_policy`."""

from __future__ import annotations

from ..settings import exact_evidence_size

__all__ = [
    "EP_POINTS_PER_BUDGET",
    "EXACT_MARGINAL_TOL",
    "EXACT_SOLVE_SIZE",
    "KERNEL_CHOICE_COST",
    "LEARNING_SUBSET_COST",
    "ONE_THREAD_LEARNING_SIZE",
    "SPARSE_EP_LATENT_VALUES",
    "SPARSE_EP_NESTED_WORK",
    "SPARSE_EP_POINTS",
]

#: ``learning_subset="auto"``: the hyperparameters are learnt on a random (stratified by class, for classifiers)
#: subset of :math:`M = \lfloor \sqrt{\text{this} / C} \rfloor` points, so that a product with the subset's kernel
#: matrix costs at most this many multiply-adds :math:`M^2 C` (1000 points for 10 classes, 3162 for binary data);
#: chosen by measurement (``docs/design_notes.md``, "Subset-of-data learning").
LEARNING_SUBSET_COST = 10**7
#: ``kernel_choice_subset="auto"``: with candidate kernels, each is learnt and scored for the choice on
#: :math:`M_c = \lfloor \sqrt{\text{this} / C} \rfloor` of the learning rows (1000 for binary data, 316 for 10
#: classes), a product with their kernel matrix a tenth of the learning's; only the chosen kernel is then learnt on all
#: the learning rows (``docs/design_notes.md``, "The kernel choice learns the candidates on a subset").
KERNEL_CHOICE_COST = 10**6
#: ``max_solver_iterations="auto"``: problems with at most this many latent values :math:`N C` get the exact
#: Laplace posterior (every IterGP solve runs until :math:`\mathbf C` has full rank: at most :math:`N C` products
#: with :math:`\mathbf K` in the first Newton step, then none, as the actions are recycled). 1000 keeps a fit with
#: 25 evidence steps to seconds (:math:`O((N C)^3)` per step; ``docs/design_notes.md``). The same size as the evidence's
#: exact regime (``settings.exact_evidence_size``'s default, read at import): one number for both decisions.
EXACT_SOLVE_SIZE: int = exact_evidence_size.value()
#: EP's ``marginal_tol`` where the solves are exact (:data:`EXACT_SOLVE_SIZE`): the sweeps stop where one moved the
#: marginals by at most this many nats per latent value, a small multiple of their distance from exact EP's fixed
#: point (``docs/design_notes.md``), instead of running the sites to ``site_tol``; ``None``: the sites' test alone.
EXACT_MARGINAL_TOL: float | None = 1e-5
#: ``max_solver_iterations="auto"`` for EP with one latent value per point (measured on binary data; counts get the same
#: rule) past this many training points: the strategy's default budget per sweep
#: (:data:`~.estimator_policy.DEFAULT_SOLVER_ITERATIONS`) for every this many points
#: (rounded up). EP's cavities take the marginal variances of the stopped solve, which include its computational
#: uncertainty; with too few new actions per sweep the cavities of most points sit at the prior and the sweeps diverge
#: (``docs/design_notes.md``, "The estimators' EP budget grows with N"). Laplace's Newton steps use only the
#: mean, and multi-class EP did not need more.
EP_POINTS_PER_BUDGET = 10_000
#: ``inference="auto"`` picks stochastic EP past this many training points on a CPU, past this many latent values
#: :math:`N C` for :math:`C > 2` classes, or past this much nested EP work :math:`N C^3`: where stochastic EP became the
#: faster at a test log-loss as good as dense EP's (``benchmarks/auto_switch.py``; ``docs/design_notes.md``).
SPARSE_EP_POINTS, SPARSE_EP_LATENT_VALUES, SPARSE_EP_NESTED_WORK = 15_000, 80_000, 4 * 10**7
#: learning in the exact regime runs on one intra-op thread (:func:`~gpytorch_iterncgp.core.threads.small_operations`)
#: up to this many latent values :math:`N C`: on two threads one was the faster at 400, two at 1000
#: (``docs/design_notes.md``, "Small learning on one thread")
ONE_THREAD_LEARNING_SIZE = 500
