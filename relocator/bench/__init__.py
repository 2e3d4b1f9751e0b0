"""Benchmarks: each measures relocator side by side with its baseline in one run."""
