"""Tests of ``gpytorch_iterncgp.strategies``."""
