"""Long-context evaluation: tasks, depth sweeps, and their statistics, tables and plots."""
