"""PNG plots of a sweep's summary rows, drawn with matplotlib.

Figures are built as :class:`matplotlib.figure.Figure` objects without pyplot,
so nothing needs a display and no global backend is switched (PNG output goes
through Agg). Each PNG carries the names of its series as JSON in its
"Description" text chunk; :func:`plot_series` reads them back.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import Formatter, LogLocator, MaxNLocator, NullFormatter

from rlm.evaluation.labels import format_length, series_label, series_order

#: The PNG text chunk holding ``{"series": [label, ...]}``.
METADATA_KEY = "Description"
MARKERS = "osD^vP*Xhp<>"


def write_plots(out_dir: Path, rows: list[dict]) -> dict[str, Path]:
    """Draw the three plots of ``rows`` (from ``report.summarize``) into ``out_dir``.

    Returns {file name: path} for accuracy_vs_length.png, cost_vs_depth.png and
    accuracy_vs_cost.png.
    """
    drawn = {}
    for name, draw in (("accuracy_vs_length.png", accuracy_vs_length),
                       ("cost_vs_depth.png", cost_vs_depth),
                       ("accuracy_vs_cost.png", accuracy_vs_cost)):
        drawn[name] = Path(out_dir) / name
        draw(rows, drawn[name])
    return drawn


def accuracy_vs_length(rows: list[dict], path: Path) -> Figure:
    """Accuracy against context length, one subplot per task.

    Each series ("base", "rlm d1 small", ...) is a marker per length with its 95% Wilson
    interval as an error bar, joined by a line across lengths; the series sit side by side
    at each length so their bars do not hide one another, and one length reads as well as
    several. The lengths are evenly spaced categories labelled in tokens. Saves a PNG at
    ``path``; returns the Figure.
    """
    with_model = _mixed_models(rows)
    series = _series(rows, with_model)
    colours = _colours(series)
    tasks = _unique(r["task"] for r in rows)
    fig, axes = _grid(len(tasks))
    step = min(0.12, 0.6 / max(len(series), 1))
    for ax, task in zip(axes, tasks):
        lengths = sorted({r["length"] for r in rows if r["task"] == task})
        slot = {n: i for i, n in enumerate(lengths)}
        for i, label in enumerate(series):
            points = sorted((r["length"], r["accuracy"], r["ci_low"], r["ci_high"]) for r in rows
                            if r["task"] == task and series_label(r, with_model) == label)
            if not points:
                continue
            offset = (i - (len(series) - 1) / 2) * step
            x = [slot[n] + offset for n, *_ in points]
            acc = [a for _, a, _, _ in points]
            err = [[a - lo for _, a, lo, _ in points], [hi - a for _, a, _, hi in points]]
            ax.errorbar(x, acc, yerr=err, fmt="-" + MARKERS[i % len(MARKERS)],
                        color=colours[label], label=label, capsize=3, markersize=5,
                        linewidth=1.2, elinewidth=1.2)
        ax.set_xticks(range(len(lengths)), [format_length(n) for n in lengths])
        ax.set_xlim(-0.5, len(lengths) - 0.5)
        ax.set(title=task, ylim=(-0.03, 1.03), xlabel="context length (tokens)",
               ylabel="accuracy (bars: 95% Wilson interval)")
    _legend(fig, axes)
    _save(fig, path, series)
    return fig


def cost_vs_depth(rows: list[dict], path: Path) -> Figure:
    """Mean cost per trial (USD) against recursion depth, one line per (task, profile).

    The mean pools every length of the cell, weighted by trials. When no trial
    cost anything (local models), mean tokens per trial are drawn instead and
    the axis label says so. Base runs are a dashed horizontal line per task.
    Saves a PNG at ``path``; returns the Figure.
    """
    measure, ylabel = _cost_measure(rows)
    with_model = _mixed_models(rows)
    tasks = _unique(r["task"] for r in rows)
    task_colour = _colours(tasks)
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    series, values = [], []
    for (task, profile, model), cells in _pool(rows, measure).items():
        label = f"{task} {'base' if profile is None else profile}" + (
            f" · {model}" if with_model else "")
        depths = sorted(cells)
        ys = [cells[d] for d in depths]
        if profile is None:
            ax.axhline(ys[0], color=task_colour[task], linestyle="--", label=label)
        else:
            ax.plot(depths, ys, marker=MARKERS[len(series) % len(MARKERS)],
                    color=task_colour[task], label=label)
        series.append(label)
        values += ys
    depths = sorted({r["depth"] for r in rows if r["depth"] is not None})
    ax.set_xticks(depths or [0])
    _cost_axis(ax, "y", values, measure)
    ax.set(xlabel="recursion depth (max_depth)", ylabel=ylabel,
           title="cost per trial by depth (dashed: base)")
    _legend(fig, [ax])
    _save(fig, path, series)
    return fig


def accuracy_vs_cost(rows: list[dict], path: Path) -> Figure:
    """Accuracy against mean cost per trial (USD; tokens when nothing cost money).

    One point per summary row; colour and marker tell the series apart. Saves a
    PNG at ``path``; returns the Figure.
    """
    measure, xlabel = _cost_measure(rows)
    with_model = _mixed_models(rows)
    series = _series(rows, with_model)
    colours = _colours(series)
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    xs_all = []
    for i, label in enumerate(series):
        points = [(r[f"{measure}_mean"], r["accuracy"]) for r in rows
                  if series_label(r, with_model) == label and r[f"{measure}_mean"] is not None]
        xs, ys = zip(*points) if points else ((), ())
        ax.scatter(xs, ys, color=colours[label], marker=MARKERS[i % len(MARKERS)], label=label)
        xs_all += xs
    _cost_axis(ax, "x", xs_all, measure)
    ax.set(xlabel=xlabel, ylabel="accuracy", ylim=(-0.03, 1.03),
           title="accuracy against cost (one point per task and length)")
    _legend(fig, [ax])
    _save(fig, path, series)
    return fig


def plot_series(path: Path) -> list[str]:
    """The series names stored in a PNG written here (its "Description" text chunk).

    Raises ValueError when the file has no such chunk (not one of these plots).
    """
    from PIL import Image

    with Image.open(path) as image:
        text = dict(getattr(image, "text", None) or image.info)
    if METADATA_KEY not in text:
        raise ValueError(f"{path} has no {METADATA_KEY!r} text chunk naming its series")
    return list(json.loads(text[METADATA_KEY])["series"])


def _cost_measure(rows: list[dict]) -> tuple[str, str]:
    """("cost_usd", label) unless every cost is 0 or missing; then tokens."""
    if any(r["cost_usd_mean"] for r in rows):
        return "cost_usd", "mean cost per trial (USD)"
    return "tokens", "mean tokens per trial (all costs were 0 USD)"


def _cost_axis(ax, which: str, values: list[float], measure: str) -> None:
    """Scale and ticks of a cost axis (``which``: ``"x"`` or ``"y"``) holding ``values``
    (USD or tokens): log when they span a factor of 10 or more (ticks at 1, 2, 5 per decade
    over at most two decades, else at each decade), linear with at most 6 ticks otherwise,
    and short labels ("$0.002", "2.25k") with no minor labels, so labels never run into
    one another (matplotlib's own log labels of a narrow range do)."""
    axis = ax.xaxis if which == "x" else ax.yaxis
    positive = [v for v in values if v and v > 0]
    if positive and max(positive) / min(positive) >= 10:
        (ax.set_xscale if which == "x" else ax.set_yscale)("log")
        decades = math.log10(max(positive) / min(positive))
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades <= 2
                                          else (1.0,), numticks=12))
        axis.set_minor_formatter(NullFormatter())
    else:
        axis.set_major_locator(MaxNLocator(nbins=5))
    axis.set_major_formatter(_CostFormatter(measure == "cost_usd"))


class _CostFormatter(Formatter):
    """Tick labels of a cost axis, as short as the tick's value allows: dollars
    (``$0.0025``), tokens with ``k``/``M`` (``2.25k``, ``1.5M``)."""

    def __init__(self, usd: bool) -> None:
        self.usd = usd

    def __call__(self, x: float, pos: int | None = None) -> str:
        unit, suffix = ((1e6, "M") if abs(x) >= 1e6 else (1e3, "k") if abs(x) >= 1e3
                        else (1.0, ""))
        if self.usd:
            unit, suffix = 1.0, ""
        text = f"{x / unit:.8f}".rstrip("0").rstrip(".")  # ticks are round numbers
        return ("$" if self.usd else "") + (text if text not in ("", "-0") else "0") + suffix


def _pool(rows: list[dict], measure: str) -> dict[tuple, dict]:
    """{(task, profile, model): {depth: trial-weighted mean of measure}}; base: depth -1."""
    sums: dict[tuple, dict] = {}
    for r in rows:
        if r[f"{measure}_mean"] is None:
            continue
        profile = None if r["method"] == "base" else Path(str(r["profile"] or "rlm")).name
        depth = -1 if r["method"] == "base" else r["depth"]
        cell = sums.setdefault((r["task"], profile, r["model"]), {}).setdefault(depth, [0.0, 0])
        cell[0] += r[f"{measure}_mean"] * r["n"]
        cell[1] += r["n"]
    return {key: {d: total / n for d, (total, n) in cells.items()} for key, cells in sums.items()}


def _grid(count: int) -> tuple[Figure, list]:
    cols = min(3, max(count, 1))
    nrows = math.ceil(max(count, 1) / cols)
    fig = Figure(figsize=(4.2 * cols + 2.5, 3.4 * nrows), layout="constrained")
    axes = list(fig.subplots(nrows, cols, squeeze=False).ravel())
    for extra in axes[count:]:
        fig.delaxes(extra)
    return fig, axes[:count]


def _legend(fig: Figure, axes: list) -> None:
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside right upper", fontsize=8)


def _save(fig: Figure, path: Path, series: list[str]) -> None:
    fig.savefig(path, format="png", dpi=110,
                metadata={METADATA_KEY: json.dumps({"series": series})})


def _colours(labels: list[str]) -> dict[str, tuple]:
    cmap = colormaps["tab10" if len(labels) <= 10 else "tab20"]
    return {label: cmap(i % cmap.N) for i, label in enumerate(labels)}


def _series(rows: list[dict], with_model: bool) -> list[str]:
    """Series names, base first, then by depth, profile and model."""
    return _unique(series_label(r, with_model) for r in sorted(rows, key=series_order))


def _mixed_models(rows: list[dict]) -> bool:
    return len({r["model"] for r in rows}) > 1


def _unique(values) -> list:
    return list(dict.fromkeys(values))
