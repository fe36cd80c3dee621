"""Tests of ``gpytorch_iterncgp.sparse``."""
