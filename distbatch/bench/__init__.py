"""Benchmarks: distbatch against the transports users compare it with, measured in one run."""
