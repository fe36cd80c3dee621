"""Tests of ``gpytorch_iterncgp.integrations``."""
