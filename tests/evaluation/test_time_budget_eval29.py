"""``rlm eval --time-budget`` (rlm/evaluation/time_budget.py): breadth first, trials started
only while their cell's measured time fits, running ones cancelled at the budget, the report
written, what was left said, and the same command continuing where it stopped."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import pytest

from rlm.errors import ConfigError
from rlm.evaluation.time_budget import TimeBudget, breadth_first, parse_duration
from test_eval_sweep import (TASKS, check_records, env_with_factory, grid_args, read_jsonl,
                             responder, rlm_cli)


@pytest.mark.parametrize("text,seconds", [("90m", 5400), ("1h30m", 5400), ("2h", 7200),
                                          ("45s", 45), ("5400", 5400), ("1.5h", 5400),
                                          ("1d", 86400)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "ninety", "90x", "m90", "-5", "0", "1h-5m", "nan", "inf",
                                  "10000000000h", "1000000000000"])
def test_bad_durations_are_clear_errors(text):
    with pytest.raises(ConfigError, match="time-budget"):
        parse_duration(text)


@dataclass
class Spec:
    task: str
    length: int
    trial: int
    method: str = "rlm"

    def axes(self) -> list:
        return [self.task, self.length, 0, self.trial, self.method, 1, "small", "m"]


def test_breadth_first_gives_every_cell_its_first_trial_before_any_its_second():
    grid = [Spec(t, n, i) for n in (8000, 36000) for i in range(3) for t in ("a", "b")]
    order = breadth_first(grid)
    assert [s.trial for s in order] == [0] * 4 + [1] * 4 + [2] * 4
    assert [(s.task, s.length) for s in order[:4]] == [("a", 8000), ("b", 8000),
                                                       ("a", 36000), ("b", 36000)]


def test_a_cell_is_estimated_from_its_own_trials_only():
    budget = TimeBudget(100, recorded=[
        {"task": "a", "length": 8000, "method": "rlm", "depth": 1, "profile": "small",
         "model": "m", "wall_s": 30.0},
        {"task": "a", "length": 8000, "method": "rlm", "depth": 1, "profile": "small",
         "model": "m", "wall_s": 50.0},
        {"task": "b", "length": 8000, "method": "rlm", "depth": 1, "profile": "small",
         "model": "m", "wall_s": 200.0, "failure": "cancelled"}])  # teaches nothing
    assert budget.estimate(Spec("a", 8000, 2)) == 40.0
    assert budget.estimate(Spec("b", 8000, 0)) is None  # no trial of its own yet
    budget.record({"task": "z", "length": 8000, "method": "rlm", "depth": 1,
                   "profile": "small", "model": "m", "wall_s": 5000.0})
    assert budget.admit(Spec("b", 8000, 0))  # another cell's 5,000 s say nothing of this one
    assert budget.admit(Spec("a", 8000, 2))
    budget.record({"task": "c", "length": 8000, "method": "rlm", "depth": 1,
                   "profile": "small", "model": "m", "wall_s": 150.0})
    assert not budget.admit(Spec("c", 8000, 1))  # 150 s do not fit in the 100 left
    assert "1 trial(s) in 1 cell(s) were not started" in budget.left_summary()
    # a cell refused its trial 1: no cell starts its trial 2, a cheap trial 1 still does
    assert not budget.admit(Spec("a", 8000, 2)) and budget.admit(Spec("a", 8000, 1))


def test_the_summary_names_only_what_happened():
    budget = TimeBudget(100)
    assert budget.left_summary() == ""  # nothing left, nothing cancelled: nothing to say
    budget.cancelled = 1
    text = budget.left_summary()
    assert "1 running trial(s) were cancelled" in text and "not started" not in text, text
    assert ": ;" not in text and "Run the same command again" in text


def test_a_sweep_stops_at_its_budget_and_the_same_command_continues(scripted, tmp_path):
    srv = scripted(responder, latency=0.5)
    out, journal = tmp_path / "out", tmp_path / "j.sqlite3"
    args = grid_args(srv, out, journal, 2) + ["--concurrency", "1"]
    total = 2 * len(TASKS) * 3
    t0 = time.monotonic()
    res = rlm_cli(args + ["--time-budget", "4s"], env_with_factory())
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stderr
    assert "time budget" in res.stderr and "not started" in res.stderr, res.stderr
    assert "Run the same command again" in res.stderr
    done = read_jsonl(out / "trials.jsonl")
    assert 1 <= len(done) < total, len(done)
    # breadth first: no cell has its second trial while another cell lacks its first
    rounds = Counter(r["trial"] for r in done)
    assert rounds[1] == 0 or rounds[0] == len(TASKS) * 3, rounds
    assert f"{len(done)} trials" in (out / "summary.md").read_text()
    assert took < 4 + 25, took  # the budget, the start-up and the report
    sent = len(srv.requests)
    again = rlm_cli(args + ["--time-budget", "10m"], env_with_factory())
    assert again.returncode == 0, again.stderr
    assert "not started" not in again.stderr
    check_records(read_jsonl(out / "trials.jsonl"), n=2)  # each trial once
    # every trial's calls: easy 1 per method, hard base/d0 1 and d1 2; a call in flight when
    # the budget cancelled its trial had no reply to journal and is sent again
    assert len(srv.requests) <= 2 * (3 + 4) + 1 and sent < len(srv.requests)


def test_a_budget_that_ends_before_any_trial_finishes_leaves_them_for_the_next_run(scripted,
                                                                                   tmp_path):
    """No trial finished in the budget: not a bad-input error (exit 0), the trials left are
    named, nothing is reported yet, and the same command continues."""
    srv = scripted(responder, latency=6.0)
    out, journal = tmp_path / "out", tmp_path / "j.sqlite3"
    args = grid_args(srv, out, journal, 1) + ["--concurrency", "1", "--tasks", TASKS[0]]
    res = rlm_cli(args + ["--time-budget", "1s"], env_with_factory())
    assert res.returncode == 0, res.stderr
    assert "no trials to report" not in res.stderr
    assert "Run the same command again" in res.stderr, res.stderr
    assert not (out / "summary.md").exists()
    again = rlm_cli(args, env_with_factory())
    assert again.returncode == 0, again.stderr
    assert (out / "summary.md").exists() and read_jsonl(out / "trials.jsonl")
