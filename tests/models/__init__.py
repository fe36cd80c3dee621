"""Tests of ``gpytorch_iterncgp.models``."""
