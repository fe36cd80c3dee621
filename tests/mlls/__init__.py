"""Tests of ``gpytorch_iterncgp.mlls``."""
