"""The evaluation report: statistics, tables and plots from hand-made trial records.

Every expected number is worked out by hand in the test (z = 1.959964, so
z² = 3.841459), not taken from the code under test.
"""
from __future__ import annotations

import csv
import json
import math
import statistics

import pytest
from PIL import Image

from rlm.errors import ConfigError
from rlm.evaluation import plots
from rlm.evaluation.plots import plot_series
from rlm.evaluation.labels import series_label
from rlm.evaluation.report import markdown_table, read_trials, summarize, write_report
from rlm.evaluation.stats import describe, pass_hat_k, wilson_interval

Z2 = 1.959964 ** 2  # 3.841459


def trial(task, length, method, depth, profile, i, score, failure=None, cost=0.01, tokens=100,
          wall=1.0, model="m"):
    """One trial record with the keys a sweep writes."""
    key = f"{task}/{length}/{method}/{depth}/{profile}/{model}/{i}"
    return {"key": key, "run_id": "eval-" + key, "task": task, "length": length, "seed": 0,
            "trial": i, "method": method, "depth": depth, "profile": profile, "model": model,
            "answer": "a", "expected": ["a"], "score": score, "correct": score == 1.0,
            "status": "completed", "failure": failure, "truncated": method == "base",
            "prompt_tokens": tokens - 10, "completion_tokens": 10, "tokens": tokens,
            "cost_usd": cost, "wall_s": wall, "subcalls": depth or 0,
            "max_depth_reached": depth or 0, "context_chars": 4 * length,
            "context_tokens": length, "replayed": False}


def hand_made() -> list[dict]:
    """Five cells with known outcomes (see each comment)."""
    out = []
    # niah 8k base: scores 1,1,1,0.5,0 -> 3 of 5 correct, mean score 0.7;
    # costs .01 .02 .03 .04 .10, tokens 100..400,1000, wall 1..5
    for i, (score, cost, tokens) in enumerate(
            [(1.0, .01, 100), (1.0, .02, 200), (1.0, .03, 300), (0.5, .04, 400), (0.0, .10, 1000)]):
        out.append(trial("niah_single_2", 8192, "base", None, None, i, score,
                         None if score == 1.0 else "wrong", cost, tokens, wall=float(i + 1)))
    # niah 8k rlm d0 small: 0 of 5 (2 ran out of iterations, 3 wrong)
    for i in range(5):
        out.append(trial("niah_single_2", 8192, "rlm", 0, "small", i, 0.0,
                         "max_iterations" if i < 2 else "wrong"))
    # niah 8k rlm d1 small: 5 of 5
    out += [trial("niah_single_2", 8192, "rlm", 1, "small", i, 1.0, cost=0.05) for i in range(5)]
    # niah 32k base: 1 of 2
    out += [trial("niah_single_2", 32768, "base", None, None, 0, 1.0),
            trial("niah_single_2", 32768, "base", None, None, 1, 0.0, "EndpointError")]
    # cwe 8k rlm d1 small: 1 of 1
    out.append(trial("cwe", 8192, "rlm", 1, "small", 0, 1.0, cost=0.2))
    return out


# --- statistics -------------------------------------------------------------

def test_wilson_interval_matches_hand_computed_numbers():
    # 3 of 5: p = 0.6, z²/n = 0.768292, denominator 1.768292
    # centre = (0.6 + 0.384146) / 1.768292 = 0.556546
    # half = 1.959964 * sqrt(0.6*0.4/5 + 3.841459/100) / 1.768292
    #      = 1.959964 * sqrt(0.086415) / 1.768292 = 0.325826
    low, high = wilson_interval(3, 5)
    assert (round(low, 4), round(high, 4)) == (0.2307, 0.8824)
    # 0 of 5: centre = half = 0.384146 / 1.768292, so high = 0.768292 / 1.768292
    low, high = wilson_interval(0, 5)
    assert low == 0.0 and high == pytest.approx(0.768292 / 1.768292, abs=1e-6)
    assert round(high, 4) == 0.4345
    # 5 of 5 mirrors 0 of 5
    low, high = wilson_interval(5, 5)
    assert (round(low, 4), high) == (0.5655, 1.0)
    # 1 of 2: centre 0.5, half = 1.959964 * sqrt(0.125 + 3.841459/16) / (1 + 3.841459/2)
    half = 1.959964 * math.sqrt(0.125 + Z2 / 16) / (1 + Z2 / 2)
    assert wilson_interval(1, 2) == pytest.approx((0.5 - half, 0.5 + half), abs=1e-9)
    assert round(0.5 - half, 4) == 0.0945


def test_wilson_interval_edges_and_bad_counts():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    # a wider z gives a wider interval
    assert wilson_interval(3, 5, z=2.575829)[0] < wilson_interval(3, 5)[0]
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(6, 5)
    with pytest.raises(ValueError, match="n=-1"):
        wilson_interval(0, -1)


def test_wilson_interval_holds_the_proportion_for_every_count():
    # 4 of 4 once gave a high of 0.9999999999999999 < 1.0, and the plot's error bar below
    # the point came out negative (matplotlib refuses it); check every count up to 60
    for n in range(1, 61):
        for s in range(n + 1):
            low, high = wilson_interval(s, n)
            assert 0.0 <= low <= s / n <= high <= 1.0, (s, n, low, high)
    assert wilson_interval(4, 4)[1] == 1.0


def test_pass_hat_k_matches_hand_computed_numbers():
    # c=3, n=5: C(3,2)/C(5,2) = 3/10, C(3,3)/C(5,3) = 1/10, C(3,5) = 0
    assert pass_hat_k(3, 5, 1) == pytest.approx(0.6)
    assert pass_hat_k(3, 5, 2) == pytest.approx(3 / 10)
    assert pass_hat_k(3, 5, 3) == pytest.approx(1 / 10)
    assert pass_hat_k(3, 5, 5) == 0.0
    # c=8, n=10, k=5: C(8,5)/C(10,5) = 56/252
    assert pass_hat_k(8, 10, 5) == pytest.approx(56 / 252)
    assert pass_hat_k(5, 5, 5) == 1.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_hat_k(2, 2, 3)
    with pytest.raises(ValueError, match="k >= 1"):
        pass_hat_k(2, 2, 0)


def test_describe_mean_median_and_interpolated_p90():
    # sorted 1,2,3,4,10: mean 20/5 = 4; median 3;
    # p90 at position (5-1)*0.9 = 3.6 -> 4 + 0.6 * (10 - 4) = 7.6
    got = describe([10, 2, 4, 1, 3])
    assert got["mean"] == pytest.approx(4.0)
    assert got["median"] == pytest.approx(3.0)
    assert got["p90"] == pytest.approx(7.6)
    assert got["p90"] == pytest.approx(
        statistics.quantiles([1, 2, 3, 4, 10], n=10, method="inclusive")[8])
    # even count: median between the middle two; p90 at 0.9*3 = 2.7 -> 3 + 0.7*(4-3)
    got = describe([1, 2, 3, 4])
    assert (got["median"], got["p90"]) == (pytest.approx(2.5), pytest.approx(3.7))
    assert describe([5.0]) == {"mean": 5.0, "median": 5.0, "p90": 5.0}
    assert describe([]) == {"mean": None, "median": None, "p90": None}


# --- summary rows -------------------------------------------------------------

def _cells(rows):
    return [(r["task"], r["length"], r["series"]) for r in rows]


def test_summarize_gives_exact_accuracies_intervals_and_pass_k():
    rows = summarize(hand_made())
    assert _cells(rows) == [
        ("cwe", 8192, "rlm d1 small"),
        ("niah_single_2", 8192, "base"),
        ("niah_single_2", 8192, "rlm d0 small"),
        ("niah_single_2", 8192, "rlm d1 small"),
        ("niah_single_2", 32768, "base")]
    cwe, base, d0, d1, base32 = rows

    assert (base["n"], base["correct"], base["accuracy"]) == (5, 3, 0.6)
    assert (round(base["ci_low"], 4), round(base["ci_high"], 4)) == (0.2307, 0.8824)
    assert base["mean_score"] == pytest.approx(0.7)  # (1+1+1+0.5+0)/5
    assert [base[f"pass^{k}"] for k in (1, 2, 3, 5)] == pytest.approx([0.6, 0.3, 0.1, 0.0])
    assert base["pass^10"] is None  # k > n
    assert base["failures"] == {"wrong": 2}
    assert base["truncated"] == 5
    # costs .01 .02 .03 .04 .10: mean .04, median .03, p90 .04 + 0.6*.06 = .076
    assert (base["cost_usd_mean"], base["cost_usd_median"], base["cost_usd_p90"]) == (
        pytest.approx(0.04), pytest.approx(0.03), pytest.approx(0.076))
    assert base["tokens_p90"] == pytest.approx(760.0)  # 400 + 0.6 * 600
    assert base["wall_s_median"] == pytest.approx(3.0)

    assert (d0["accuracy"], d0["ci_low"], round(d0["ci_high"], 4)) == (0.0, 0.0, 0.4345)
    assert d0["failures"] == {"max_iterations": 2, "wrong": 3}
    assert d0["pass^1"] == 0.0

    assert (d1["accuracy"], round(d1["ci_low"], 4), d1["ci_high"]) == (1.0, 0.5655, 1.0)
    assert d1["pass^5"] == 1.0 and d1["failures"] == {}
    assert d1["max_depth_reached"] == 1 and d1["subcalls_mean"] == 1.0

    assert (base32["n"], base32["accuracy"], round(base32["ci_low"], 4)) == (2, 0.5, 0.0945)
    assert (base32["pass^2"], base32["pass^3"]) == (0.0, None)
    assert base32["failures"] == {"EndpointError": 1}

    assert (cwe["n"], cwe["accuracy"], cwe["pass^2"]) == (1, 1.0, None)


def test_summarize_counts_a_rewritten_trial_once_and_rejects_incomplete_records():
    trials = hand_made()
    # the 32k base trial that failed is written again later, now correct
    trials.append(trial("niah_single_2", 32768, "base", None, None, 1, 1.0))
    row = summarize(trials)[-1]
    assert (row["n"], row["correct"], row["failures"]) == (2, 2, {})

    broken = dict(trials[0])
    del broken["correct"]
    with pytest.raises(ConfigError, match="lacks correct"):
        summarize([broken])


def test_series_labels():
    assert series_label({"method": "base", "depth": None, "profile": None}) == "base"
    assert series_label({"method": "rlm", "depth": 2, "profile": "general"}) == "rlm d2 general"
    row = {"method": "rlm", "depth": 1, "profile": "/tmp/prompts/mine.txt", "model": "gpt"}
    assert series_label(row) == "rlm d1 mine.txt"
    assert series_label(row, with_model=True) == "rlm d1 mine.txt · gpt"


# --- reading trials.jsonl -----------------------------------------------------

def _write_jsonl(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail, encoding="utf-8")


def test_read_trials_skips_a_torn_last_line(tmp_path, caplog):
    records = hand_made()
    path = tmp_path / "trials.jsonl"
    # a writer killed mid-line leaves half a record and no newline
    _write_jsonl(path, records, tail=json.dumps(records[0])[:37])
    assert read_trials(path) == records
    assert "torn last line" in caplog.text
    # a blank line between records is harmless
    path.write_text(json.dumps(records[0]) + "\n\n" + json.dumps(records[1]) + "\n")
    assert read_trials(path) == records[:2]


def test_read_trials_refuses_a_damaged_middle_line(tmp_path):
    path = tmp_path / "trials.jsonl"
    lines = [json.dumps(r) for r in hand_made()[:3]]
    lines[1] = lines[1][:20]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"trials\.jsonl:2: not a JSON trial record"):
        read_trials(path)
    path.write_text(json.dumps(hand_made()[0]) + "\n[1, 2]\n")
    with pytest.raises(ConfigError, match=":2: a trial record must be a JSON object"):
        read_trials(path)
    with pytest.raises(ConfigError, match="no trials file"):
        read_trials(tmp_path / "absent.jsonl")


@pytest.mark.parametrize("edit,needle", [
    ({"score": "abc"}, "score must be a number from 0 to 1"),
    ({"score": None}, "score must be a number"),
    ({"score": 7}, "score must be a number from 0 to 1"),
    ({"score": float("nan")}, "score must be a number"),
    ({"correct": "yes"}, "correct must be true exactly when score is 1"),
    ({"tokens": "many"}, "tokens must be a number >= 0"),
    ({"tokens": 10 ** 400}, "tokens must be a number >= 0"),
    ({"wall_s": -3}, "wall_s must be a number >= 0"),
    ({"length": "huge"}, "length must be a positive whole number"),
    ({"depth": "deep"}, "depth must be a whole number"),
    ({"method": "magic"}, "method must be one of base, rlm"),
    ({"task": 5}, "task must be a string")])
def test_read_trials_names_the_line_of_a_record_unfit_for_the_report(tmp_path, edit, needle):
    """A hand-edited or foreign record is refused with its line and what to do, not a
    traceback from the tables (or a mean score of 3.5)."""
    records = hand_made()[:3]
    records[1] = dict(records[1], **edit)
    path = tmp_path / "trials.jsonl"
    # json.dumps writes NaN and 10**400 as they are; Python's reader takes them back
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"trials\.jsonl:2: " + needle + ".*fix or delete"):
        read_trials(path)


# --- the report files ---------------------------------------------------------

EXPECTED_FILES = {"summary.md", "summary.csv", "summary.json", "accuracy_vs_length.png",
                  "cost_vs_depth.png", "accuracy_vs_cost.png"}
SERIES = ["base", "rlm d0 small", "rlm d1 small"]


def test_write_report_from_the_jsonl_alone(tmp_path):
    _write_jsonl(tmp_path / "trials.jsonl", hand_made(), tail='{"key": "half a rec')
    paths = write_report(tmp_path)
    assert set(paths) == EXPECTED_FILES
    assert all(p.parent == tmp_path and p.stat().st_size > 0 for p in paths.values())

    with (tmp_path / "summary.csv").open(newline="") as f:
        table = list(csv.DictReader(f))
    assert [(r["task"], r["length"], r["series"]) for r in table] == [
        (t, str(n), s) for t, n, s in _cells(summarize(hand_made()))]
    base = table[1]
    assert (base["n"], base["correct"], base["accuracy"]) == ("5", "3", "0.6")
    assert round(float(base["ci_low"]), 4) == 0.2307 and base["pass^2"] == "0.3"
    assert base["pass^10"] == "" and base["depth"] == "" and base["failures"] == "wrong=2"
    assert table[2]["failures"] == "max_iterations=2;wrong=3"

    doc = json.loads((tmp_path / "summary.json").read_text())
    assert doc["trials"] == 18
    row = doc["rows"][1]
    assert (row["accuracy"], row["depth"], row["failures"]) == (0.6, None, {"wrong": 2})
    assert row["cost_usd_p90"] == pytest.approx(0.076)

    md = (tmp_path / "summary.md").read_text().splitlines()
    header = next(line for line in md if line.startswith("| task"))
    assert header == ("| task | length | method | n | accuracy [95% CI] | mean score | pass^1 | "
                      "pass^2 | pass^3 | pass^5 | median cost (USD) | median tokens | "
                      "median wall (s) | failures |")
    assert ("| niah_single_2 | 8k | base | 5 | 0.60 [0.23, 0.88] | 0.70 | 0.60 | 0.30 | 0.10 "
            "| 0.00 | 0.03 | 300 | 3.0 | wrong 2 |") in md
    assert ("| niah_single_2 | 32k | base | 2 | 0.50 [0.09, 0.91] | 0.50 | 0.50 | 0.00 | – "
            "| – | 0.01 | 100 | 1.0 | EndpointError 1 |") in md
    assert sum(line.startswith("| niah_single_2 |") or line.startswith("| cwe |")
               for line in md) == 5

    for name in ("accuracy_vs_length.png", "accuracy_vs_cost.png"):
        assert plot_series(paths[name]) == SERIES
    assert plot_series(paths["cost_vs_depth.png"]) == [
        "cwe small", "niah_single_2 base", "niah_single_2 small"]


def test_write_report_needs_trials(tmp_path):
    (tmp_path / "trials.jsonl").write_text("")
    with pytest.raises(ConfigError, match="no trials to report"):
        write_report(tmp_path)


def test_markdown_names_the_model_when_models_are_mixed():
    trials = hand_made() + [trial("cwe", 8192, "rlm", 1, "small", 0, 0.0, "wrong", model="big")]
    md = markdown_table(summarize(trials))
    assert "| task | length | method | model | n |" in md
    assert "| cwe | 8k | rlm d1 small | big | 1 | 0.00 [0.00, 0.79] |" in md


# --- plots ----------------------------------------------------------------------

def _valid_png(path):
    assert path.stat().st_size > 0
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


def _labelled(lines):
    return [line.get_label() for line in lines if not line.get_label().startswith("_")]


def test_accuracy_vs_length_draws_points_and_interval_bars_per_series(tmp_path):
    path = tmp_path / "acc.png"
    rows = summarize(hand_made())
    fig = plots.accuracy_vs_length(rows, path)
    _valid_png(path)
    assert plot_series(path) == SERIES
    cwe, niah = fig.axes[:2]
    assert (cwe.get_title(), niah.get_title()) == ("cwe", "niah_single_2")
    assert [c.get_label() for c in cwe.containers] == ["rlm d1 small"]
    assert [c.get_label() for c in niah.containers] == SERIES  # one error bar set per series
    assert not niah.collections or all(  # no shaded bands, only the bars' line collections
        type(c).__name__ == "LineCollection" for ax in fig.axes for c in ax.collections)
    # the lengths are evenly spaced categories, labelled in tokens
    assert [t.get_text() for t in niah.get_xticklabels()] == ["8k", "32k"]
    # the base series: accuracies 0.6 and 0.5 at the two lengths, bars from its Wilson interval
    base = niah.containers[0]
    line = base.lines[0]
    assert list(line.get_ydata()) == [0.6, 0.5]
    xs = list(line.get_xdata())
    assert xs[1] - xs[0] == pytest.approx(1.0) and -0.5 < xs[0] < 0.5
    (bars,) = base.lines[2]
    want = [r for r in rows if r["task"] == "niah_single_2" and r["method"] == "base"]
    got = sorted((round(seg[0][1], 6), round(seg[1][1], 6)) for seg in bars.get_segments())
    assert got == sorted((round(r["ci_low"], 6), round(r["ci_high"], 6)) for r in want)


def test_accuracy_vs_length_draws_cells_whose_interval_rounds_past_the_point(tmp_path):
    # 4 of 4 and 0 of 4 beside the hand-made cells: a full-marks cell's bar goes from its low
    # end up to 1.0 exactly (before the fix matplotlib raised on a negative error bar)
    trials = hand_made() + [trial("cwe", 32768, "rlm", 1, "small", i, 1.0) for i in range(4)]
    trials += [trial("cwe", 32768, "base", None, None, i, 0.0, "wrong") for i in range(4)]
    path = tmp_path / "acc.png"
    fig = plots.accuracy_vs_length(summarize(trials), path)
    _valid_png(path)
    cwe = next(ax for ax in fig.axes if ax.get_title() == "cwe")
    bars = {c.get_label(): [(round(seg[0][1], 4), round(seg[1][1], 4))
                            for seg in c.lines[2][0].get_segments()] for c in cwe.containers}
    # rlm d1 small: 1 of 1 at 8k, 4 of 4 at 32k; base: 0 of 4 at 32k
    assert bars == {"rlm d1 small": [(0.2065, 1.0), (0.5101, 1.0)], "base": [(0.0, 0.4899)]}


def test_cost_vs_depth_plots_usd_or_tokens_when_nothing_cost_money(tmp_path):
    path = tmp_path / "cost.png"
    fig = plots.cost_vs_depth(summarize(hand_made()), path)
    _valid_png(path)
    ax = fig.axes[0]
    assert _labelled(ax.get_lines()) == plot_series(path) == [
        "cwe small", "niah_single_2 base", "niah_single_2 small"]
    assert "USD" in ax.get_ylabel() and "tokens" not in ax.get_ylabel()
    # niah base pools 8k (mean .04 over 5) and 32k (mean .01 over 2): (0.2+0.02)/7
    base = ax.get_lines()[1]
    assert base.get_linestyle() == "--"
    assert base.get_ydata()[0] == pytest.approx(0.22 / 7)
    niah = ax.get_lines()[2]
    assert list(niah.get_xdata()) == [0, 1]
    assert list(niah.get_ydata()) == pytest.approx([0.01, 0.05])

    free = [dict(t, cost_usd=0.0) for t in hand_made()]
    fig = plots.cost_vs_depth(summarize(free), path)
    _valid_png(path)
    assert "tokens" in fig.axes[0].get_ylabel()


def test_accuracy_vs_cost_puts_one_point_per_row(tmp_path):
    path = tmp_path / "scatter.png"
    rows = summarize(hand_made())
    fig = plots.accuracy_vs_cost(rows, path)
    _valid_png(path)
    ax = fig.axes[0]
    assert plot_series(path) == SERIES
    assert [c.get_label() for c in ax.collections] == SERIES
    assert sum(len(c.get_offsets()) for c in ax.collections) == len(rows) == 5


def test_plot_series_refuses_a_png_without_series(tmp_path):
    path = tmp_path / "plain.png"
    Image.new("RGB", (4, 4)).save(path)
    with pytest.raises(ValueError, match="no 'Description'"):
        plot_series(path)
