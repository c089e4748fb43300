"""The journal's durability level (``--journal-durability``), and how the write-behind queue
keeps a sub-call's own commits short: stage JSON made off the connection, the background writer
committing in chunks, and one event per model call fewer (its usage set with its end)."""
from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.journal import Journal, JournalError
from harness.journal import behind
from harness.journal.verify import verify_run
from harness.stages.tree import Kind, StageTree, Status

from conftest import REPO, clean_env
from journal_events import event, stage


def _synchronous(j: Journal) -> int:
    return j._conn.execute("PRAGMA synchronous").fetchone()[0]


def test_levels_set_sqlites_synchronous(tmp_path, monkeypatch):
    """process -> OFF (0): the commit reaches the OS, enough for a killed process; power ->
    FULL (2): an fsync each. The variable applies when no level is given; a bad one is named."""
    monkeypatch.delenv("RLM_JOURNAL_DURABILITY", raising=False)
    with Journal(tmp_path / "a.sqlite3") as j:
        assert j.durability == "process" and _synchronous(j) == 0
    with Journal(tmp_path / "b.sqlite3", durability="power") as j:
        assert j.durability == "power" and _synchronous(j) == 2
    monkeypatch.setenv("RLM_JOURNAL_DURABILITY", "power")
    with Journal(tmp_path / "c.sqlite3") as j:
        assert _synchronous(j) == 2
    with Journal(tmp_path / "d.sqlite3", durability="process") as j:  # the argument wins
        assert _synchronous(j) == 0
    for bad in ("fast", "POWER", ""):
        monkeypatch.setenv("RLM_JOURNAL_DURABILITY", bad)
        if bad == "":  # unset in effect: the default
            with Journal(tmp_path / "e.sqlite3") as j:
                assert j.durability == "process"
            continue
        with pytest.raises(JournalError, match="use one of process, power"):
            Journal(tmp_path / f"{bad}.sqlite3")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_the_cli_refuses_an_unknown_level_before_anything_runs(tmp_path, how):
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("some text", encoding="utf-8")
    args = [sys.executable, "-m", "rlm", "run", "--context", str(ctx), "--query", "q",
            "--base-url", "http://127.0.0.1:9/v1", "--api-key", "k", "--model", "m",
            "--journal", str(tmp_path / "j.sqlite3")]
    env = clean_env()
    if how == "flag":
        args += ["--journal-durability", "disk"]
    else:
        env["RLM_JOURNAL_DURABILITY"] = "disk"
    p = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert "process" in p.stderr and "power" in p.stderr, p.stderr


def test_the_background_writer_commits_in_chunks_in_order(tmp_path, monkeypatch):
    """A burst of queued transitions is committed by the writer in transactions of at most
    WRITER_CHUNK records (a sub-call's durable commit waits for one chunk at most), all of
    them, in order, their hash chain whole."""
    sizes: list[int] = []
    real = behind.WriteBehind._commit

    def counting(self, items, action):
        if action.startswith("write "):
            sizes.append(len(items))
        return real(self, items, action)

    monkeypatch.setattr(behind.WriteBehind, "_commit", counting)
    with Journal(tmp_path / "j.sqlite3") as j:
        j.create_run("r", query="q", model="m")
        for i in range(100):
            st = stage("r", f"s{i}", "pending")
            j.record_event(event("r", st, None, "pending", ts=float(i + 1)), behind=True)
        deadline = time.monotonic() + 10
        while j.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert j.pending == 0
        assert sizes and max(sizes) <= behind.WRITER_CHUNK and sum(sizes) == 100, sizes
        evs = j.events("r")
        assert [e["stage_id"] for e in evs] == [f"r/s{i}" for i in range(100)]
        verdict = verify_run(j, "r")
        assert verdict.events == 100 and verdict.ok, verdict.violations


def test_a_queued_stage_that_cannot_be_encoded_is_written_as_text(tmp_path, caplog):
    """Serialized when its batch commits (off the caller's path), a stage holding a value
    JSON cannot encode is written with that value's repr and logged, and the records queued
    after it are written too (the queue is never stuck on it)."""
    with Journal(tmp_path / "j.sqlite3") as j:
        j.create_run("r", query="q", model="m")
        bad = stage("r", "bad", "pending")
        bad["evidence"] = {"code": "x = 1", "output": object()}
        bad["note"] = object()
        with caplog.at_level(logging.ERROR, logger="harness.journal"):
            j.record_event(event("r", bad, None, "pending"), behind=True)
            j.record_event(event("r", stage("r", "good", "pending"), None, "pending"),
                           behind=True)
            j.flush()
        got = {e["stage_id"]: e for e in j.events("r")}
        assert set(got) == {"r/bad", "r/good"}
        kept = got["r/bad"]["stage"]
        assert kept["evidence"]["code"] == "x = 1"  # only the unencodable leaves become text
        assert "object object at" in kept["evidence"]["output"] and "object at" in kept["note"]
        assert isinstance(kept["meta"], dict) and kept["meta"] == bad["meta"]
        assert "not JSON-serializable" in caplog.text
        assert verify_run(j, "r").events == 2  # a reader of the record still reads it


def _tree_events():
    seen: list[dict] = []
    tree = StageTree("r", listeners=[seen.append])
    return tree, seen


def test_a_model_calls_usage_rides_on_its_last_transition():
    """A model call's stage makes three transitions (created, running, completed), the last
    carrying its usage, not a fourth "usage" event in between."""
    tree, seen = _tree_events()
    with tree.stage(None, Kind.run, 0) as run:
        with tree.stage(run.id, Kind.model_call, 0) as st:
            st.usage_on_exit(120, 7, 0.25)
    mine = [e for e in seen if e["stage"]["id"] == st.id]
    assert [(e["from"], e["to"]) for e in mine] == [
        (None, "pending"), ("pending", "running"), ("running", "completed")]
    last = mine[-1]["stage"]
    assert (last["prompt_tokens"], last["completion_tokens"], last["calls"],
            last["cost_usd"]) == (120, 7, 1, 0.25)
    assert tree.rollup(run.id).cost_usd == 0.25


def test_usage_of_a_call_cancelled_in_flight_is_still_counted():
    """The run ended around the call (its stage already cancelled): its usage is added as
    before, so what it cost is not lost."""
    tree, seen = _tree_events()
    with tree.stage(None, Kind.run, 0) as run:
        with tree.stage(run.id, Kind.model_call, 0) as st:
            tree.transition(st.id, Status.running, Status.cancelled, error="run ended")
            st.usage_on_exit(50, 5, 0.5)
    assert tree.get(st.id).status is Status.cancelled
    assert (tree.get(st.id).prompt_tokens, tree.get(st.id).cost_usd) == (50, 0.5)
    assert any(e["event"] == "usage" and e["stage"]["id"] == st.id for e in seen)
    with pytest.raises(ValueError):
        st.usage_on_exit(-1, 0, 0.0)
