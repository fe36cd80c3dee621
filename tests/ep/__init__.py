"""Tests of ``gpytorch_iterncgp.ep``."""
