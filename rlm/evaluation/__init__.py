"""Benchmarking depth settings: long-context tasks, depth sweeps, statistics and reports (`rlm eval`)."""
