"""Benchmarking depth settings (``rlm eval``): long-context tasks (:mod:`.tasks`), sweeps of
methods and depths over them (:mod:`.sweep`), and their statistics, tables and plots
(:mod:`.stats`, :mod:`.report`, :mod:`.plots`)."""
