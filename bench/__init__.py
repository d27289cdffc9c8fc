"""Benchmarks that print JSON. Not tests: speed is measured here, side by side with a baseline."""
