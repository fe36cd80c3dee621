"""Tests of ``gpytorch_iterncgp.kernels``."""
