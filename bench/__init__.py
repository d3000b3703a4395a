"""Benchmarks (not tests): accuracy comparisons and cost measurements."""
