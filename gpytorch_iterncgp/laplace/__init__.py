r"""The Laplace approximation: damped Newton's method as an outer loop over the core (paper, Alg. 1)."""
