"""The budget: caps, the accountant, the price table."""
