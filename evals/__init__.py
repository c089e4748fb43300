"""Evaluation tasks on real data, scorers, the depth-sweep runner and benchmarks."""
