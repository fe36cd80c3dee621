"""Tests of ``gpytorch_iterncgp.likelihoods``."""
