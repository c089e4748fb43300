"""How an evaluation's rows are named and ordered in its tables and plots (shared by
``report.py`` and ``plots.py``)."""
from __future__ import annotations

from pathlib import Path

__all__ = ["series_label", "series_order", "format_length"]


def series_label(row: dict, with_model: bool = False) -> str:
    """The plot/table name of a row's (method, depth, profile): "base" or "rlm d1 small".

    A profile given as a file path shows as its file name. ``with_model`` appends
    " · MODEL" (for reports that mix models).
    """
    if row.get("method") == "base":
        label = "base"
    else:
        profile = row.get("profile")
        label = f"{row.get('method')} d{row.get('depth')}"
        if profile:
            label += f" {Path(str(profile)).name}"
    return f"{label} · {row.get('model')}" if with_model else label


def format_length(tokens: int) -> str:
    """A context length for people: 8192 -> "8k", 1048576 -> "1M", 32000 -> "32000"."""
    for size, suffix in ((1 << 20, "M"), (1 << 10, "k")):
        if tokens >= size and tokens % size == 0:
            return f"{tokens // size}{suffix}"
    return str(tokens)


def series_order(row: dict) -> tuple:
    """Sort key of a row's series: base first, then method, depth, profile and model."""
    depth = row["depth"] if row["depth"] is not None else -1
    return (row["method"] != "base", str(row["method"]), depth,
            str(row["profile"] or ""), str(row["model"] or ""))
