r"""Expectation propagation over the core: the local step on the sites (:mod:`.sites`) and the outer loop of parallel
EP sweeps, dense or computation-aware (:mod:`.sweeps`)."""
