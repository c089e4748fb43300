"""Bookkeeping for RLM runs: stages, the budget accountant, the journal, replay."""
