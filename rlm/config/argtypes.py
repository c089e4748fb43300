"""Argument types the command-line parsers share (argparse ``type=`` callables)."""
from __future__ import annotations

import argparse

__all__ = ["whole_number", "number_between"]


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


def number_between(low: float, high: float, what: str):
    """An argparse ``type``: the argument as a finite float in ``[low, high]``, else an
    ``ArgumentTypeError`` saying ``must be {what} from {low} to {high}`` and the value given."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not low <= value <= high:  # also refuses NaN
            raise argparse.ArgumentTypeError(f"must be {what} from {low:g} to {high:g}, got {text!r}")
        return value
    return parse
