"""Tests of ``gpytorch_iterncgp.core``."""
