"""Tests of ``gpytorch_iterncgp.laplace``."""
