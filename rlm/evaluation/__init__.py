"""Evaluation of depth settings: long-context tasks, sweeps, statistics and reports."""
