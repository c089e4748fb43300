"""Argument types the command-line parsers share (argparse ``type=`` callables)."""
from __future__ import annotations

import argparse

__all__ = ["whole_number"]


def whole_number(low: int, high: int | None = None, what: str = "a whole number"):
    """An argparse ``type``: the argument as an int in ``[low, high]`` (no upper bound when
    ``high`` is None), else an ``ArgumentTypeError`` naming the range and the value given."""
    span = f"from {low} to {high}" if high is not None else f">= {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {what} {span}, got {text!r}")
        return value
    return parse
