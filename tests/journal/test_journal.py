"""Tests of harness.journal: round-trips, ownership, schema versions, damage, concurrency, crashes."""
from __future__ import annotations

import hashlib
import io
import json
import logging
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import harness.journal.schema as journal_mod
from harness.errors import HarnessError
from harness.journal import (
    APPLICATION_ID,
    SCHEMA_VERSION,
    Journal,
    JournalCorruptError,
    JournalError,
    JournalSchemaError,
    ModelCallConflictError,
    RunExistsError,
    UnknownRunError,
    default_journal_path,
    request_hash,
)

from journal_events import event, lifecycle, stage  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[2]


# ---- helpers ---------------------------------------------------------------------------------


def raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(str(path), isolation_level=None, timeout=30)


def sub_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture
def jpath(tmp_path: Path) -> Path:
    return tmp_path / "journal.sqlite3"


@pytest.fixture
def j(jpath: Path):
    with Journal(jpath) as journal:
        yield journal


# ---- paths -----------------------------------------------------------------------------------


def test_default_path_env_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("RLM_JOURNAL", str(tmp_path / "x" / "j.db"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_journal_path() == tmp_path / "x" / "j.db"
    monkeypatch.delenv("RLM_JOURNAL")
    assert default_journal_path() == tmp_path / "xdg" / "rlm" / "journal.sqlite3"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_journal_path() == tmp_path / "home" / ".local/share/rlm/journal.sqlite3"


def test_default_path_is_used_and_parents_created(monkeypatch, tmp_path):
    target = tmp_path / "deep" / "er" / "journal.sqlite3"
    monkeypatch.setenv("RLM_JOURNAL", str(target))
    with Journal() as jj:
        jj.create_run("r", query="q", model="m")
        assert jj.path == target
    assert target.is_file()
    with Journal(target) as again:
        assert again.get_run("r")["query"] == "q"


# ---- round-trips -----------------------------------------------------------------------------


def test_run_round_trip_and_finish(j):
    opts = {"max_iterations": 7, "caps": {"cost": 0.5}, "name": "données"}
    before = time.time()
    j.create_run("r1", query="what?", model="big", sub_model="small", max_depth=2, options=opts)
    run = j.get_run("r1")
    assert run["run_id"] == "r1" and run["query"] == "what?"
    assert (run["model"], run["sub_model"], run["max_depth"]) == ("big", "small", 2)
    assert run["options"] == opts
    assert run["status"] == run["state"] == "running"
    assert run["owner_pid"] == os.getpid() and run["owner_host"]
    assert before <= run["created_at"] == run["heartbeat_at"] <= time.time()
    assert run["answer"] is None and run["finished_at"] is None

    j.finish_run("r1", status="completed", answer="42",
                 usage={"prompt_tokens": 10, "cost_usd": 0.01}, error=None)
    run = j.get_run("r1")
    assert run["status"] == run["state"] == "completed"
    assert run["answer"] == "42" and run["usage"] == {"prompt_tokens": 10, "cost_usd": 0.01}
    assert run["finished_at"] >= run["created_at"]

    j.create_run("r2", query="q", model="m")
    j.finish_run("r2", status="failed", error={"type": "EndpointError", "message": "boom"})
    assert j.get_run("r2")["error"] == {"type": "EndpointError", "message": "boom"}
    assert j.get_run("nope") is None


def test_create_run_twice_is_refused_and_keeps_first(j):
    j.create_run("r", query="first", model="m")
    with pytest.raises(RunExistsError, match="already exists") as info:
        j.create_run("r", query="second", model="m")
    assert isinstance(info.value, JournalError) and isinstance(info.value, HarnessError)
    assert j.get_run("r")["query"] == "first"


def test_finish_run_validation(j):
    j.create_run("r", query="q", model="m")
    with pytest.raises(ValueError):
        j.finish_run("r", status="running")
    with pytest.raises(UnknownRunError):
        j.finish_run("missing", status="completed")


def test_list_runs_newest_first_with_limit(j):
    for i in range(5):
        j.create_run(f"r{i}", query="q", model="m")
    assert [r["run_id"] for r in j.list_runs()] == ["r4", "r3", "r2", "r1", "r0"]
    assert [r["run_id"] for r in j.list_runs(limit=2)] == ["r4", "r3"]
    assert all(r["state"] == "running" for r in j.list_runs())


def test_events_and_stages_round_trip(j):
    j.create_run("r", query="q", model="m")
    sent = lifecycle(j, "r", "iteration-0", kind="iteration")
    sent += lifecycle(j, "r", "iteration-0/model_call-0", ordinal=0)
    evs = j.events("r")
    assert len(evs) == 6
    for got, want in zip(evs, sent):
        assert got["stage"] == want["stage"] and got["ts"] == want["ts"]
        assert (got["from"], got["to"], got["run_id"]) == (want["from"], want["to"], "r")
        assert got["stage_id"] == want["stage"]["id"]
    assert evs[0]["from"] is None
    seqs = [e["seq"] for e in evs]
    assert seqs == sorted(seqs) and len(set(seqs)) == 6

    stages = j.stages("r")
    assert [s["id"] for s in stages] == ["r/iteration-0", "r/iteration-0/model_call-0"]
    assert all(s["status"] == "completed" for s in stages)
    assert stages[1] == sent[-1]["stage"]
    assert j.events("other") == [] and j.stages("other") == []


def test_events_are_append_only(j, jpath):
    j.create_run("r", query="q", model="m")
    lifecycle(j, "r", "a")
    first = j.events("r")
    lifecycle(j, "r", "b")
    assert j.events("r")[:3] == first  # later writes never touch earlier events
    j.record_cell("r", "c", "x", None)
    con = raw(jpath)
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        con.execute("UPDATE events SET to_status = 'failed'")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        con.execute("DELETE FROM events")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        con.execute("DELETE FROM cells")
    con.close()
    assert len(j.events("r")) == 6 and len(j.cells("r")) == 1


def test_out_of_order_event_does_not_roll_stage_back(j):
    j.create_run("r", query="q", model="m")
    t = time.time()
    j.record_event(event("r", stage("r", "s", "completed"), "running", "completed", ts=t + 1))
    j.record_event(event("r", stage("r", "s", "running"), "pending", "running", ts=t))
    assert j.stages("r")[0]["status"] == "completed"
    assert [e["to"] for e in j.events("r")] == ["completed", "running"]  # both kept, as recorded


def test_record_event_is_one_transaction(j, jpath):
    """If the stage upsert fails, the event row (written first) must not remain."""
    j.create_run("r", query="q", model="m")
    con = raw(jpath)
    con.execute("CREATE TRIGGER boom BEFORE INSERT ON stages WHEN NEW.stage_id = 'r/bad' "
                "BEGIN SELECT RAISE(ABORT, 'injected failure'); END")
    con.close()
    with pytest.raises(JournalError, match="injected failure"):
        j.record_event(event("r", stage("r", "bad", "pending"), None, "pending"))
    assert j.events("r") == [] and j.stages("r") == []
    lifecycle(j, "r", "good")
    assert len(j.events("r")) == 3


def test_record_event_rejects_malformed_and_non_json(j):
    j.create_run("r", query="q", model="m")
    with pytest.raises(JournalError, match="malformed"):
        j.record_event({"run_id": "r", "stage": {"no_id": 1}, "to": "pending", "ts": 1.0})
    bad = stage("r", "s", "pending")
    bad["evidence"] = object()
    with pytest.raises(JournalError, match="not JSON-serializable"):
        j.record_event(event("r", bad, None, "pending"))
    assert j.events("r") == []


def test_model_call_round_trip(j):
    j.create_run("r", query="q", model="m")
    req = {"model": "m", "messages": [{"role": "user", "content": "héllo"}], "max_tokens": 5}
    h = request_hash(req)
    attempts = [{"n": 1, "error": "429"}, {"n": 2, "ok": True}]
    assert j.record_model_call("r", "r/iteration-0/model_call-0", request_hash=h, request=req,
                               response={"text": "hi"}, usage={"prompt_tokens": 3},
                               attempts=attempts) is True
    j.record_model_call("r", "r/iteration-0/model_call-1", request_hash="x" * 64,
                        request={"a": 1}, response=None, usage=None, attempts=[])
    got = j.lookup_model_call("r", "r/iteration-0/model_call-0")
    assert got["request_hash"] == h and got["request"] == req
    assert got["response"] == {"text": "hi"} and got["usage"] == {"prompt_tokens": 3}
    assert got["attempts"] == attempts
    assert j.lookup_model_call("r", "missing") is None
    assert j.lookup_model_call("other", "r/iteration-0/model_call-0") is None
    assert [c["call_id"] for c in j.model_calls("r")] == ["r/iteration-0/model_call-0",
                                                          "r/iteration-0/model_call-1"]


def test_model_call_same_id_idempotent_or_conflict(j):
    j.create_run("r", query="q", model="m")
    req = {"p": 1}
    j.record_model_call("r", "c", request_hash=request_hash(req), request=req,
                        response="first", usage={}, attempts=[])
    assert j.record_model_call("r", "c", request_hash=request_hash(req), request=req,
                               response="second", usage={}, attempts=[]) is False
    with pytest.raises(ModelCallConflictError, match="diverged"):
        j.record_model_call("r", "c", request_hash=request_hash({"p": 2}), request={"p": 2},
                            response="third", usage={}, attempts=[])
    assert j.lookup_model_call("r", "c")["response"] == "first"
    assert len(j.model_calls("r")) == 1
    # a resumed run that went live after a divergence supersedes the record on purpose
    assert j.record_model_call("r", "c", request_hash=request_hash({"p": 2}), request={"p": 2},
                               response="live", usage={"n": 1}, attempts=[1],
                               replace=True) is True
    got = j.lookup_model_call("r", "c")
    assert (got["request"], got["response"], got["usage"], got["attempts"]) == (
        {"p": 2}, "live", {"n": 1}, [1])
    assert got["request_hash"] == request_hash({"p": 2}) and len(j.model_calls("r")) == 1


def test_request_hash_is_canonical():
    a = {"b": [1, 2, {"z": "é", "a": None}], "a": 1.5}
    b = {"a": 1.5, "b": [1, 2, {"a": None, "z": "é"}]}
    assert request_hash(a) == request_hash(b)
    canonical = '{"a":1.5,"b":[1,2,{"a":null,"z":"é"}]}'
    assert request_hash(a) == hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    assert request_hash(a) != request_hash({**a, "a": 1.6})


def test_cells_round_trip(j):
    j.create_run("r", query="q", model="m")
    j.record_cell("r", "r/iteration-0/cell-0", "print(len(context))", {"stdout": "10\n"})
    j.record_cell("r", "r/iteration-0/cell-0", "print(len(context))", {"stdout": "10\n"})
    j.record_cell("r", "r/iteration-1/cell-0", "x = 1/0", {"error": "ZeroDivisionError"})
    cells = j.cells("r")
    assert [c["stage_id"] for c in cells] == ["r/iteration-0/cell-0"] * 2 + ["r/iteration-1/cell-0"]
    assert cells[2]["code"] == "x = 1/0" and cells[2]["output"] == {"error": "ZeroDivisionError"}
    assert cells[0]["seq"] < cells[1]["seq"] < cells[2]["seq"]


def test_export_jsonl_contains_every_record(j):
    j.create_run("r", query="q", model="m", options={"k": "v"})
    j.create_run("other", query="q", model="m")
    lifecycle(j, "r", "iteration-0", kind="iteration")
    lifecycle(j, "r", "iteration-0/model_call-0")
    lifecycle(j, "other", "x")
    for i in range(2):
        req = {"i": i}
        j.record_model_call("r", f"c{i}", request_hash=request_hash(req), request=req,
                            response={"t": i}, usage={"n": i}, attempts=[])
        j.record_cell("r", f"cell{i}", f"print({i})", {"stdout": f"{i}\n"})
    j.finish_run("r", status="completed", answer="done")
    buf = io.StringIO()
    n = j.export_jsonl("r", buf)
    lines = buf.getvalue().splitlines()
    assert n == len(lines) == 1 + 2 + 6 + 2 + 2
    recs = [json.loads(line) for line in lines]
    assert [r["type"] for r in recs] == (["run"] + ["stage"] * 2 + ["event"] * 6
                                         + ["model_call"] * 2 + ["cell"] * 2)
    assert all(r["run_id"] == "r" for r in recs)
    run = {k: v for k, v in recs[0].items() if k not in ("type", "totals")}
    fresh = j.get_run("r")
    assert run == fresh
    assert recs[0]["totals"] == j.spend_totals("r")  # over every attempt, as the views say
    assert [r["stage"] for r in recs[1:3]] == j.stages("r")
    assert [{k: v for k, v in r.items() if k != "type"} for r in recs[3:9]] == j.events("r")
    assert [{k: v for k, v in r.items() if k not in ("type", "run_id")}
            for r in recs[9:11]] == j.model_calls("r")
    assert [{k: v for k, v in r.items() if k not in ("type", "run_id")}
            for r in recs[11:13]] == j.cells("r")
    with pytest.raises(UnknownRunError):
        j.export_jsonl("missing", io.StringIO())


# ---- heartbeat, state, claim -----------------------------------------------------------------


def age_heartbeat(path: Path, run_id: str, seconds: float) -> None:
    con = raw(path)
    con.execute("UPDATE runs SET heartbeat_at = ? WHERE run_id = ?", (time.time() - seconds, run_id))
    con.close()


def test_stale_heartbeat_shows_crashed_fresh_shows_running(j, jpath):
    j.create_run("r", query="q", model="m")
    assert j.get_run("r")["state"] == "running"
    age_heartbeat(jpath, "r", 30)
    run = j.get_run("r")
    assert run["status"] == "running" and run["state"] == "crashed"
    assert j.list_runs()[0]["state"] == "crashed"
    assert j.get_run("r", stale_after=60)["state"] == "running"
    assert j.heartbeat("r") is True
    assert j.get_run("r")["state"] == "running"
    j.finish_run("r", status="interrupted")
    age_heartbeat(jpath, "r", 30)
    assert j.get_run("r")["state"] == "interrupted"  # only running runs can look crashed


def test_claim_refuses_fresh_takes_stale(j, jpath):
    j.create_run("r", query="q", model="m")
    with Journal(jpath) as other:
        assert other.claim_run("r") is False
        assert j.get_run("r")["state"] == "running"
        con = raw(jpath)
        con.execute("UPDATE runs SET owner_pid = 1, owner_host = 'elsewhere', heartbeat_at = ? "
                    "WHERE run_id = 'r'", (time.time() - 60,))
        con.close()
        assert j.get_run("r")["state"] == "crashed"
        assert other.claim_run("r") is True
        run = other.get_run("r")
        assert (run["owner_pid"], run["owner_host"]) == (os.getpid(), socket_host())
        assert run["state"] == "running" and time.time() - run["heartbeat_at"] < 5
        assert other.claim_run("r") is False  # now fresh again
        with pytest.raises(UnknownRunError):
            other.claim_run("missing")


def socket_host() -> str:
    import socket
    return socket.gethostname()


OWNER = r"""
import os, sys, time
from harness.journal import Journal
j = Journal(sys.argv[1])
j.create_run(sys.argv[2], query="q", model="m")
print("ready", flush=True)
if sys.argv[3] == "exit":
    os._exit(0)  # dies without finishing the run: a crash
time.sleep(120)
"""


def test_dead_owner_on_this_host_is_crashed_at_once(j, jpath):
    p = subprocess.run([sys.executable, "-c", OWNER, str(jpath), "r", "exit"], env=sub_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "ready", p.stderr
    run = j.get_run("r")
    assert run["status"] == "running" and time.time() - run["heartbeat_at"] < j.stale_after
    assert run["owner_pid"] != os.getpid()
    assert run["state"] == "crashed"  # no need to wait stale_after seconds
    assert j.claim_run("r") is True
    run = j.get_run("r")
    assert run["owner_pid"] == os.getpid() and run["state"] == "running"
    assert j.claim_run("r") is False


def test_dead_owner_claim_has_one_winner(jpath):
    Journal(jpath).close()
    p = subprocess.run([sys.executable, "-c", OWNER, str(jpath), "r", "exit"], env=sub_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "ready", p.stderr
    journals = [Journal(jpath) for _ in range(8)]
    barrier = threading.Barrier(len(journals))
    results = []

    def claim(jj):
        barrier.wait()
        results.append(jj.claim_run("r"))

    threads = [threading.Thread(target=claim, args=(jj,)) for jj in journals]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for jj in journals:
        jj.close()
    assert sorted(results) == [False] * 7 + [True]


def test_live_owner_then_killed_unreaped(jpath):
    j = Journal(jpath, stale_after=600)  # only the process check can call it crashed
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(jpath), "r", "sleep"],
                            env=sub_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        assert j.get_run("r")["state"] == "running"
        assert j.claim_run("r") is False  # its owner is alive: never taken
        proc.kill()  # not reaped yet: a zombie still has a pid
        deadline = time.time() + 5
        while j.get_run("r")["state"] != "crashed":
            assert time.time() < deadline, "a killed, unreaped owner never looked crashed"
            time.sleep(0.01)
        assert j.claim_run("r") is True
    finally:
        proc.kill()
        proc.wait()
        j.close()


def test_dead_pid_on_another_host_is_judged_by_heartbeat_only(j, jpath):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    j.create_run("r", query="q", model="m")
    con = raw(jpath)
    con.execute("UPDATE runs SET owner_pid = ?, owner_host = 'another-host' WHERE run_id = 'r'",
                (int(dead),))
    con.close()
    assert j.get_run("r")["state"] == "running"
    assert j.claim_run("r") is False
    age_heartbeat(jpath, "r", 60)
    assert j.get_run("r")["state"] == "crashed"
    assert j.claim_run("r") is True


def test_claim_interrupted_run_clears_finished_at(j):
    j.create_run("r", query="q", model="m")
    j.finish_run("r", status="interrupted", error="Ctrl-C")
    assert j.get_run("r")["finished_at"] is not None
    assert j.claim_run("r") is True
    run = j.get_run("r")
    assert run["status"] == "running" and run["finished_at"] is None


def test_claim_is_atomic_exactly_one_winner(jpath):
    with Journal(jpath) as j:
        j.create_run("r", query="q", model="m")
    age_heartbeat(jpath, "r", 60)
    journals = [Journal(jpath) for _ in range(8)]
    barrier = threading.Barrier(len(journals))
    results = []

    def claim(jj):
        barrier.wait()
        results.append(jj.claim_run("r"))

    threads = [threading.Thread(target=claim, args=(jj,)) for jj in journals]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for jj in journals:
        jj.close()
    assert sorted(results) == [False] * 7 + [True]


def test_heartbeat_only_refreshes_own_running_run(j, jpath):
    j.create_run("r", query="q", model="m")
    con = raw(jpath)
    con.execute("UPDATE runs SET owner_pid = owner_pid + 1 WHERE run_id = 'r'")
    con.close()
    assert j.heartbeat("r") is False
    assert j.heartbeat("missing") is False
    with pytest.raises(JournalError, match="not a running run owned by this process"):
        j.start_heartbeat("r")


def test_start_heartbeat_keeps_run_alive_and_stops(jpath):
    with Journal(jpath, stale_after=0.5) as j:
        j.create_run("r", query="q", model="m")
        stop = j.start_heartbeat("r", interval=0.05)
        time.sleep(0.9)  # longer than stale_after: only the thread keeps it fresh
        assert j.get_run("r")["state"] == "running"
        stop()
        last = j.get_run("r")["heartbeat_at"]
        time.sleep(0.7)
        run = j.get_run("r")
        assert run["heartbeat_at"] == last and run["state"] == "crashed"
        with pytest.raises(ValueError):
            j.start_heartbeat("r", interval=1.0)  # >= stale_after


def test_heartbeat_thread_notices_lost_ownership(j, jpath):
    j.create_run("r", query="q", model="m")
    hb = j.start_heartbeat("r", interval=0.05)
    con = raw(jpath)
    con.execute("UPDATE runs SET owner_pid = owner_pid + 1 WHERE run_id = 'r'")
    con.close()
    assert hb.lost.wait(5)
    hb()


def test_close_stops_heartbeats_and_refuses_use(jpath):
    j = Journal(jpath)
    j.create_run("r", query="q", model="m")
    hb = j.start_heartbeat("r", interval=0.05)
    j.close()
    assert not hb._thread.is_alive()
    j.close()  # idempotent
    with pytest.raises(JournalError, match="closed"):
        j.get_run("r")


# ---- schema versions -------------------------------------------------------------------------


def test_new_file_gets_current_version(jpath):
    Journal(jpath).close()
    con = raw(jpath)
    assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
    assert con.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    con.close()


def test_empty_file_is_initialised(jpath):
    jpath.touch()
    with Journal(jpath) as j:
        j.create_run("r", query="q", model="m")
        assert j.get_run("r")


def test_newer_version_is_refused_untouched(jpath):
    with Journal(jpath) as j:
        j.create_run("r", query="q", model="m")
    con = raw(jpath)
    con.execute("PRAGMA user_version = 7")
    con.close()
    before = jpath.read_bytes()
    with pytest.raises(JournalSchemaError) as info:
        Journal(jpath)
    msg = str(info.value)
    assert "version 7" in msg and f"({SCHEMA_VERSION})" in msg and str(jpath) in msg
    assert "Upgrade" in msg
    assert (info.value.found, info.value.supported) == (7, SCHEMA_VERSION)
    assert jpath.read_bytes() == before


def test_fake_v0_file_is_refused_untouched(jpath):
    """An unversioned (user_version 0) SQLite file with tables, e.g. a prototype journal."""
    con = raw(jpath)
    con.execute("CREATE TABLE runs (id TEXT PRIMARY KEY, blob TEXT)")
    con.execute("INSERT INTO runs VALUES ('old', 'x')")
    con.close()
    before = jpath.read_bytes()
    with pytest.raises(JournalSchemaError) as info:
        Journal(jpath)
    msg = str(info.value)
    assert "not an rlm journal" in msg and "schema version 0" in msg and str(jpath) in msg
    assert "Move the file aside" in msg
    assert info.value.found == 0
    assert jpath.read_bytes() == before
    con = raw(jpath)
    assert con.execute("SELECT * FROM runs").fetchall() == [("old", "x")]
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # not even WAL-switched
    con.close()


def test_older_version_is_migrated(jpath, monkeypatch, caplog):
    with Journal(jpath) as j:
        j.create_run("r", query="q", model="m")
        lifecycle(j, "r", "s")

    cur = SCHEMA_VERSION

    def v1_to_v2(conn):
        conn.execute("ALTER TABLE runs ADD COLUMN labels TEXT")

    monkeypatch.setattr(journal_mod, "SCHEMA_VERSION", cur + 1)
    monkeypatch.setitem(journal_mod._MIGRATIONS, cur, v1_to_v2)
    with caplog.at_level(logging.INFO, logger="harness.journal"):
        with Journal(jpath) as j:
            assert j.get_run("r")["query"] == "q" and len(j.events("r")) == 3
    assert f"from schema version {cur} to {cur + 1}" in caplog.text
    con = raw(jpath)
    assert con.execute("PRAGMA user_version").fetchone()[0] == cur + 1
    assert "labels" in [r[1] for r in con.execute("PRAGMA table_info(runs)")]
    con.close()
    monkeypatch.undo()
    with pytest.raises(JournalSchemaError, match=rf"version {cur + 1}, newer .* \({cur}\)"):
        Journal(jpath)


def test_older_version_without_migration_is_refused(jpath, monkeypatch):
    Journal(jpath).close()
    cur = SCHEMA_VERSION
    monkeypatch.setattr(journal_mod, "SCHEMA_VERSION", cur + 2)
    monkeypatch.setitem(journal_mod._MIGRATIONS, cur, lambda conn: None)  # no cur+1 -> cur+2
    with pytest.raises(JournalSchemaError, match="no migration"):
        Journal(jpath)
    con = raw(jpath)
    assert con.execute("PRAGMA user_version").fetchone()[0] == cur  # rolled back, untouched
    con.close()


def _first_open(path, start, errors) -> None:
    try:
        start.wait()
        with Journal(path, busy_timeout=5, retry_seconds=0) as jj:
            jj.get_run("x")
    except Exception as exc:  # pragma: no cover - reported by the test
        errors.put(repr(exc))


@pytest.mark.parametrize("kind,rounds", [("threads", 150), ("processes", 30)])
def test_concurrent_first_open_creates_schema_once(tmp_path, kind, rounds):
    # Openers of one new file at the same moment raced on switching it to WAL, which SQLite
    # refuses at once (no busy wait): "database is locked" in about 1 round in 150 for threads
    # and 1 in 7 for processes (Ray workers of a sweep or of rollouts). Many new files, each
    # opened by 4 openers released together.
    import queue
    ctx = multiprocessing.get_context("fork")
    make, Barrier, errors = ((threading.Thread, threading.Barrier, queue.Queue())
                             if kind == "threads" else (ctx.Process, ctx.Barrier, ctx.Queue()))
    for i in range(rounds):
        start = Barrier(4)
        openers = [make(target=_first_open, args=(tmp_path / f"j{i}.sqlite3", start, errors))
                   for _ in range(4)]
        for o in openers:
            o.start()
        for o in openers:
            o.join()
    failed = []
    while not errors.empty():
        failed.append(errors.get())
    assert failed == []


# ---- damaged, foreign and unwritable files ---------------------------------------------------


def test_non_sqlite_file_gives_clear_error(jpath):
    jpath.write_text("this is a log file, not a database\n" * 200)
    before = jpath.read_bytes()
    with pytest.raises(JournalCorruptError) as info:
        Journal(jpath)
    msg = str(info.value)
    assert str(jpath) in msg and "not a SQLite database" in msg and "RLM_JOURNAL" in msg
    assert isinstance(info.value.__cause__, sqlite3.DatabaseError)
    assert jpath.read_bytes() == before


def test_damaged_main_file_gives_clear_error(jpath):
    with Journal(jpath) as j:
        for i in range(300):
            j.create_run(f"r{i}", query="q" * 500, model="m")
    data = bytearray(jpath.read_bytes())
    page = 4096
    assert len(data) > 10 * page
    data[2 * page:] = os.urandom(len(data) - 2 * page)  # everything past page 2 is garbage
    jpath.write_bytes(bytes(data))
    with pytest.raises(JournalCorruptError) as info:
        with Journal(jpath) as j:
            j.list_runs(limit=1000)
    assert str(jpath) in str(info.value) and "damaged" in str(info.value)
    assert ".recover" in str(info.value)


def test_destroyed_schema_page_gives_clear_error(jpath):
    with Journal(jpath) as j:
        j.create_run("r", query="q", model="m")
    data = bytearray(jpath.read_bytes())
    data[100:4096] = b"\xff" * (4096 - 100)  # page 1 after the header: sqlite_master
    jpath.write_bytes(bytes(data))
    with pytest.raises(JournalCorruptError, match="damaged"):
        with Journal(jpath) as j:
            j.get_run("r")


def test_disk_full_gives_clear_error(jpath):
    # one attempt (retry_seconds=0): the retries through a disk that fills up under a run are
    # tests/faults/test_journal_faults_jrnl.py's
    j = Journal(jpath, retry_seconds=0)
    j.create_run("r", query="q", model="m")
    pages = j._conn.execute("PRAGMA page_count").fetchone()[0]
    j._conn.execute(f"PRAGMA max_page_count = {pages + 1}")  # SQLite then reports SQLITE_FULL
    with pytest.raises(JournalError, match="is full") as info:
        j.record_cell("r", "s", "x", {"stdout": "y" * 200_000})
    assert "RLM_JOURNAL" in str(info.value)
    with pytest.raises(JournalError, match="is full"):
        j.record_event(event("r", stage("r", "s", "pending", evidence="z" * 200_000), None,
                             "pending"))
    assert j.events("r") == [] and j.cells("r") == []
    j.close()


def test_read_only_gives_clear_error(j):
    j.create_run("r", query="q", model="m")
    j._conn.execute("PRAGMA query_only = ON")  # SQLite then reports SQLITE_READONLY
    with pytest.raises(JournalError, match="read-only") as info:
        j.finish_run("r", status="completed")
    assert str(j.path) in str(info.value) and not isinstance(info.value, JournalCorruptError)


def test_unusable_paths_give_clear_errors(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(JournalError, match="cannot create the directory"):
        Journal(tmp_path / "afile" / "sub" / "j.sqlite3")
    with pytest.raises(JournalError, match="is a directory"):
        Journal(tmp_path)
    with pytest.raises(JournalError, match="in-memory"):
        Journal(":memory:")


# ---- concurrency -----------------------------------------------------------------------------


def test_sixteen_threads_two_hundred_events_each(j):
    j.create_run("r", query="q", model="m")
    n_threads, n_events = 16, 200
    barrier = threading.Barrier(n_threads)
    errors = []

    def writer(t):
        try:
            barrier.wait()
            for i in range(n_events):
                st = stage("r", f"t{t}/s{i}", "pending", ordinal=i)
                st["meta"] = {"thread": t, "i": i}
                j.record_event(event("r", st, None, "pending"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    evs = j.events("r")
    assert len(evs) == n_threads * n_events
    assert {(e["stage"]["meta"]["thread"], e["stage"]["meta"]["i"]) for e in evs} == {
        (t, i) for t in range(n_threads) for i in range(n_events)}
    seqs = [e["seq"] for e in evs]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    for t in range(n_threads):  # each thread's events appear in its program order
        mine = [e["stage"]["meta"]["i"] for e in evs if e["stage"]["meta"]["thread"] == t]
        assert mine == list(range(n_events))
    assert len(j.stages("r")) == n_threads * n_events
    assert j.integrity_check() == []


WRITER = r"""
import sys, time
from pathlib import Path
from harness.journal import Journal, request_hash
path, name, n, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
j = Journal(path)
j.create_run(name, query="q", model="m")
(go.parent / f"ready-{name}").touch()
while not go.exists():
    time.sleep(0.005)
other = go.parent / ("half-p1" if name == "p0" else "half-p0")
for i in range(n):
    if i == n // 2:  # rendezvous: neither finishes before the other has started
        (go.parent / f"half-{name}").touch()
        while not other.exists():
            time.sleep(0.001)
    st = {"id": f"{name}/s{i}", "parent_id": name, "kind": "llm_query", "level": 0,
          "ordinal": i, "status": "pending", "meta": {"i": i}}
    j.record_event({"run_id": name, "stage": st, "from": None, "to": "pending",
                    "ts": time.time()})
    if i % 4 == 0:
        req = {"i": i, "who": name}
        j.record_model_call(name, f"{name}/c{i}", request_hash=request_hash(req), request=req,
                            response={"text": str(i)}, usage={}, attempts=[])
j.finish_run(name, status="completed", answer=str(n))
j.close()
print("ok")
"""


def test_two_processes_write_the_same_file(jpath, tmp_path):
    Journal(jpath).close()
    go = tmp_path / "go"
    n = 300
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(jpath), f"p{k}", str(n),
                               str(go)], env=sub_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in range(2)]
    with Journal(jpath) as j:
        j.create_run("parent", query="q", model="m")
        deadline = time.time() + 60
        while not all((tmp_path / f"ready-p{k}").exists() for k in range(2)):
            assert time.time() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.01)
        go.touch()
        for i in range(n):  # the parent writes at the same time
            lifecycle(j, "parent", f"s{i}") if i % 10 == 0 else j.record_cell(
                "parent", f"c{i}", "x", {"i": i})
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            assert out.strip() == "ok"
        for k in range(2):
            name = f"p{k}"
            evs = j.events(name)
            assert [e["stage"]["meta"]["i"] for e in evs] == list(range(n))
            assert len(j.model_calls(name)) == n // 4
            assert j.get_run(name)["state"] == "completed"
            assert j.get_run(name)["owner_pid"] == procs[k].pid
        s0 = [e["seq"] for e in j.events("p0")]
        s1 = [e["seq"] for e in j.events("p1")]
        assert s0[0] < s1[-1] and s1[0] < s0[-1]  # the two processes' writes interleaved
        assert len(j.events("parent")) == 3 * (n // 10)
        assert len(j.cells("parent")) == n - n // 10
        assert j.integrity_check() == []


def test_journal_inherited_across_fork(jpath):
    ctx = multiprocessing.get_context("fork")
    with Journal(jpath) as j:
        j.create_run("r", query="q", model="m")
        parent_conn = j._conn

        def child():
            for i in range(50):
                j.record_event(event("r", stage("r", f"child{i}", "pending"), None, "pending"))
            j.record_cell("r", "child", "pid", {"pid": os.getpid(),
                                                "own_connection": j._conn is not parent_conn})

        # Fork while another thread of the parent holds the journal's lock, as a fan-out
        # thread mid-write would: the child must not inherit the held lock (it would hang).
        j._lock.acquire()
        try:
            p = ctx.Process(target=child)
            p.start()
            p.join(30)
        finally:
            j._lock.release()
            if p.is_alive():  # hung on the inherited lock: the bug this test guards against
                p.kill()
                p.join()
        assert p.exitcode == 0
        for i in range(50):
            j.record_event(event("r", stage("r", f"parent{i}", "pending"), None, "pending"))
        ids = {e["stage_id"] for e in j.events("r")}
        assert ids == {f"r/child{i}" for i in range(50)} | {f"r/parent{i}" for i in range(50)}
        assert j.cells("r")[0]["output"] == {"pid": p.pid, "own_connection": True}
        assert j._conn is parent_conn
        assert j.integrity_check() == []


# ---- crashes and torn writes -----------------------------------------------------------------


LOOP_WRITER = r"""
import sys, time
from harness.journal import Journal, request_hash
path, start = sys.argv[1], int(sys.argv[2])
j = Journal(path)
i = start
while True:
    rid = f"run-{i}"
    j.create_run(rid, query="q" * 300, model="m")
    for frm, to in ((None, "pending"), ("pending", "running"), ("running", "completed")):
        st = {"id": f"{rid}/call", "parent_id": rid, "kind": "model_call", "level": 0,
              "ordinal": 0, "status": to, "evidence": "e" * 500}
        j.record_event({"run_id": rid, "stage": st, "from": frm, "to": to, "ts": time.time()})
    req = {"i": i, "pad": "p" * 1000}
    j.record_model_call(rid, f"{rid}/call", request_hash=request_hash(req), request=req,
                        response={"text": str(i)}, usage={"n": i}, attempts=[{"n": 1}])
    j.record_cell(rid, f"{rid}/cell", "print(1)", {"stdout": "1\n"})
    j.finish_run(rid, status="completed", answer=str(i))
    print(i, flush=True)
    i += 1
"""


def check_complete(j: Journal, i: int) -> None:
    rid = f"run-{i}"
    run = j.get_run(rid)
    assert run is not None, rid
    assert run["status"] == "completed" and run["answer"] == str(i)
    assert [e["to"] for e in j.events(rid)] == ["pending", "running", "completed"]
    assert j.lookup_model_call(rid, f"{rid}/call")["response"] == {"text": str(i)}
    assert len(j.cells(rid)) == 1


def test_sigkill_mid_write_keeps_committed_runs(jpath):
    Journal(jpath).close()
    acknowledged: list[int] = []
    start = 0
    for round_ in range(3):  # kill the writer three times at arbitrary points
        proc = subprocess.Popen([sys.executable, "-c", LOOP_WRITER, str(jpath), str(start)],
                                env=sub_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        target = 40 + 17 * round_
        seen = []
        for line in proc.stdout:
            seen.append(int(line))
            if len(seen) >= target:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
        acknowledged += seen
        with Journal(jpath) as j:
            assert j.integrity_check() == []
            for i in acknowledged:
                check_complete(j, i)
            # the run being written when the kill landed may be partial, never corrupt
            start = max(int(r["run_id"].split("-")[1]) for r in j.list_runs(limit=10)) + 1
            j.create_run(f"after-{round_}", query="q", model="m")  # writable: no stale lock
    assert len(acknowledged) == 40 + 57 + 74


IN_TXN_WRITER = r"""
import sys, time
from harness.journal import Journal
j = Journal(sys.argv[1])
j.create_run("committed", query="q", model="m")
conn = j._conn
conn.execute("PRAGMA cache_size = 8")        # tiny cache: uncommitted pages spill into the WAL
conn.execute("BEGIN IMMEDIATE")
for i in range(3000):
    conn.execute("INSERT INTO events (run_id, stage_id, from_status, to_status, ts, stage) "
                 "VALUES ('uncommitted', ?, NULL, 'pending', 0, ?)", (f"s{i}", "x" * 2000))
print("in-transaction", flush=True)
time.sleep(60)
"""


def test_sigkill_inside_open_transaction(jpath):
    proc = subprocess.Popen([sys.executable, "-c", IN_TXN_WRITER, str(jpath)], env=sub_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "in-transaction", proc.stderr.read()
    wal = Path(str(jpath) + "-wal")
    assert wal.stat().st_size > 1_000_000  # uncommitted frames really hit the WAL
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    with Journal(jpath, busy_timeout=5) as j:
        assert j.integrity_check() == []
        assert j.get_run("committed")["query"] == "q"
        assert j.events("uncommitted") == []
        j.create_run("next", query="q", model="m")  # the dead writer's lock is gone
        lifecycle(j, "next", "s")
        assert len(j.events("next")) == 3


WAL_WRITER = r"""
import os, signal, sys, time
from harness.journal import Journal
j = Journal(sys.argv[1])
for i in range(int(sys.argv[2])):
    rid = f"b{i}"
    j.create_run(rid, query="q" * 200, model="m")
    for frm, to in ((None, "pending"), ("pending", "running"), ("running", "completed")):
        st = {"id": f"{rid}/s", "parent_id": rid, "kind": "cell", "level": 0, "ordinal": 0,
              "status": to, "evidence": "e" * 300}
        j.record_event({"run_id": rid, "stage": st, "from": frm, "to": to, "ts": time.time()})
print(os.path.getsize(sys.argv[1] + "-wal"), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # die without closing: the WAL is never checkpointed
"""


def test_truncated_wal_keeps_earlier_runs(jpath):
    with Journal(jpath) as j:  # phase A: committed and checkpointed into the main file
        for i in range(30):
            j.create_run(f"a{i}", query="q", model="m")
            lifecycle(j, f"a{i}", "s")
    assert not Path(str(jpath) + "-wal").exists() or os.path.getsize(str(jpath) + "-wal") == 0
    n_b = 20
    proc = subprocess.run([sys.executable, "-c", WAL_WRITER, str(jpath), str(n_b)],
                          env=sub_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    wal = Path(str(jpath) + "-wal")
    size = wal.stat().st_size
    assert size > 50_000 and int(proc.stdout) == size
    with open(wal, "r+b") as f:
        f.truncate(size // 2 + 123)  # cut mid-frame
    with Journal(jpath) as j:
        assert j.integrity_check() == []
        for i in range(30):
            assert j.get_run(f"a{i}") is not None
            assert [e["to"] for e in j.events(f"a{i}")] == ["pending", "running", "completed"]
        present = [i for i in range(n_b) if j.get_run(f"b{i}") is not None]
        k = len(present)
        assert present == list(range(k))  # what survives is a prefix of the commits
        assert 0 < k < n_b  # some of the WAL survived, the torn tail did not
        for i in range(k - 1):
            assert len(j.events(f"b{i}")) == 3
        j.create_run("c", query="q", model="m")
        assert j.get_run("c")


# ---- layering --------------------------------------------------------------------------------


def test_harness_journal_imports_no_rlm_or_kernels():
    code = ("import sys, harness.journal; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('rlm', 'kernels')]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], env=sub_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---- write-behind: what is durable before the harness acts -------------------------------------


def _committed(jpath, sql: str, params: tuple = ()) -> list[tuple]:
    """What another connection (another process, after a crash) can read now."""
    con = sqlite3.connect(str(jpath))
    try:
        return con.execute(sql, params).fetchall()
    finally:
        con.close()


def _queue_one_call(j: Journal, run_id: str, i: int) -> None:
    """What a run queues for one model call after its reservation: transitions, the call, the
    settlement."""
    call_id = f"it/model_call-{i}"
    st = stage(run_id, call_id, "pending")
    for frm, to in ((None, "pending"), ("pending", "running"), ("running", "completed")):
        j.record_event(event(run_id, dict(st, status=to), frm, to), behind=True)
    req = {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}
    j.record_model_call(run_id, call_id, request_hash=request_hash(req), request=req,
                        response={"text": f"a{i}"}, usage={}, attempts=[], behind=True)
    j.record_spend(run_id, call_id, f"r{i}", "settled", model="m", calls=1, behind=True)
    j.record_cell(run_id, f"it/cell-{i}", "print(1)", {"output": "1"}, behind=True)


def test_a_reservation_commits_every_record_queued_before_it(jpath, monkeypatch):
    import harness.journal.behind as behind
    monkeypatch.setattr(behind, "WRITE_BEHIND_SECONDS", 30.0)  # only the reservation commits
    with Journal(jpath) as j:
        j.create_run("wb", query="q", model="m")
        _queue_one_call(j, "wb", 0)
        assert j.pending == 6
        # queued, not committed: a crash now would lose them (and only re-send that call)
        assert _committed(jpath, "SELECT count(*) FROM events WHERE run_id='wb'") == [(0,)]
        assert _committed(jpath, "SELECT count(*) FROM model_calls WHERE run_id='wb'") == [(0,)]
        # the next call's reservation is durable, and carries every record queued before it:
        # call 0's reply is in the journal before call 1 is sent
        j.record_spend("wb", "it/model_call-1", "r1", "reserved", model="m", calls=1)
        assert _committed(jpath, "SELECT call_id FROM model_calls WHERE run_id='wb'") == [
            ("it/model_call-0",)]
        assert _committed(jpath, "SELECT count(*) FROM cells WHERE run_id='wb'") == [(1,)]
        # in the order recorded: the settlement of call 0 before the reservation of call 1
        assert _committed(jpath, "SELECT reservation, event FROM spend WHERE run_id='wb' "
                                 "ORDER BY seq") == [("r0", "settled"), ("r1", "reserved")]
        # the transitions may lag; the run's finish commits them, in order
        assert j.pending == 3
        assert _committed(jpath, "SELECT count(*) FROM events WHERE run_id='wb'") == [(0,)]
        j.finish_run("wb", status="completed", answer="a")
        assert j.pending == 0
        assert _committed(jpath, "SELECT to_status FROM events WHERE run_id='wb' "
                                 "ORDER BY seq") == [("pending",), ("running",), ("completed",)]
        with pytest.raises(ValueError, match="before its call is sent"):
            j.record_spend("wb", "it/model_call-1", "r1", "reserved", behind=True)


def test_queued_records_reach_the_file_on_their_own_and_readers_see_them(jpath):
    from harness.journal.verify import verify_run
    with Journal(jpath) as j:
        j.create_run("wb", query="q", model="m")
        _queue_one_call(j, "wb", 0)
        # the background writer commits the queue within WRITE_BEHIND_SECONDS
        deadline = time.monotonic() + 10
        while (_committed(jpath, "SELECT count(*) FROM events WHERE run_id='wb'") != [(3,)]
               and time.monotonic() < deadline):
            time.sleep(0.01)
        assert _committed(jpath, "SELECT count(*) FROM events WHERE run_id='wb'") == [(3,)]
        _queue_one_call(j, "wb", 1)
        # a reader in the same process sees what it queued
        assert [e["stage_id"] for e in j.events("wb")][-1] == "wb/it/model_call-1"
        assert len(j.model_calls("wb")) == 2
        j.finish_run("wb", status="completed", answer="a")
        # written in batches, the hash chain is the same as one transaction per event
        verdict = verify_run(j, "wb")
        assert verdict.events == 6
        assert [v for v in verdict.violations if v.check == "chain"] == []


def test_a_failed_batch_is_kept_and_the_next_reservation_fails(jpath, caplog):
    j = Journal(jpath, busy_timeout=0.2, retry_seconds=0)  # a lock outlasting every retry
    try:
        j.create_run("wb", query="q", model="m")
        _queue_one_call(j, "wb", 0)
        j.flush()
        _queue_one_call(j, "wb", 1)
        blocker = sqlite3.connect(str(jpath), isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        try:
            with pytest.raises(JournalError, match="locked"):
                j.record_spend("wb", "it/model_call-2", "r2", "reserved", model="m", calls=1)
            assert j.pending == 6  # nothing queued is lost: no call may be sent now
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        j.record_spend("wb", "it/model_call-2", "r2", "reserved", model="m", calls=1)
        # the reservation carried the records that had failed to commit
        assert _committed(jpath, "SELECT call_id FROM model_calls WHERE run_id='wb' "
                                 "ORDER BY rowid") == [("it/model_call-0",), ("it/model_call-1",)]
        assert [c["call_id"] for c in j.model_calls("wb")] == ["it/model_call-0",
                                                              "it/model_call-1"]
        assert len(j.events("wb")) == 6
    finally:
        j.close()


def test_close_commits_the_queue(jpath, monkeypatch):
    import harness.journal.behind as behind
    monkeypatch.setattr(behind, "WRITE_BEHIND_SECONDS", 30.0)
    j = Journal(jpath)
    j.create_run("wb", query="q", model="m")
    _queue_one_call(j, "wb", 0)
    j.close()
    assert _committed(jpath, "SELECT count(*) FROM events WHERE run_id='wb'") == [(3,)]
    with pytest.raises(JournalError, match="closed"):
        j.record_event(event("wb", stage("wb", "x", "pending"), None, "pending"), behind=True)


def test_interpreter_exit_commits_the_queue(jpath):
    # a script that queues records and ends without closing its journal
    code = ("import harness.journal.behind as b; b.WRITE_BEHIND_SECONDS = 30.0\n"
            "from harness.journal import Journal\n"
            f"j = Journal({str(jpath)!r}); j.create_run('wb', query='q', model='m')\n"
            "st = {'id': 'wb/x', 'parent_id': 'wb', 'kind': 'cell', 'level': 0, 'status': 'pending'}\n"
            "j.record_event({'run_id': 'wb', 'stage': st, 'from': None, 'to': 'pending', "
            "'ts': 1.0}, behind=True)\n"
            "assert j.pending == 1\n")
    r = subprocess.run([sys.executable, "-c", code], env=sub_env(), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert _committed(jpath, "SELECT stage_id FROM events WHERE run_id='wb'") == [("wb/x",)]


def test_a_queued_call_that_conflicts_keeps_the_first_record_and_is_logged(j, caplog):
    j.create_run("wb", query="q", model="m")
    first = {"model": "m", "messages": [{"role": "user", "content": "one"}]}
    other = {"model": "m", "messages": [{"role": "user", "content": "two"}]}
    assert j.record_model_call("wb", "c1", request_hash=request_hash(first), request=first,
                               response={"text": "a"}, usage={}, attempts=[])
    # the same request again, queued: idempotent, nothing logged
    j.record_model_call("wb", "c1", request_hash=request_hash(first), request=first,
                        response={"text": "a"}, usage={}, attempts=[], behind=True)
    with caplog.at_level(logging.ERROR, logger="harness.journal"):
        j.flush()
    assert not [r for r in caplog.records if "another request" in r.getMessage()]
    # another request under the same id, queued: the first record is kept, the conflict logged
    j.record_model_call("wb", "c1", request_hash=request_hash(other), request=other,
                        response={"text": "b"}, usage={}, attempts=[], behind=True)
    with caplog.at_level(logging.ERROR, logger="harness.journal"):
        j.flush()
    assert any("'c1'" in r.getMessage() and "another request" in r.getMessage()
               for r in caplog.records)
    assert j.lookup_model_call("wb", "c1")["request_hash"] == request_hash(first)
    with pytest.raises(ModelCallConflictError):  # written durably, it raises instead
        j.record_model_call("wb", "c1", request_hash=request_hash(other), request=other,
                            response={"text": "b"}, usage={}, attempts=[])


def _open_journal_files(path) -> int:
    """How many of this process's file descriptors are the journal file or its WAL."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += target.startswith(str(path))
    return n


def test_runs_close_the_journal_they_open(scripted, tmp_path):
    # each run opened the journal from its path and never closed it: one writer thread and
    # two file handles more per run, until a long-lived process (rlm serve) ran out of files
    import threading

    import rlm
    from conftest import API_KEY, MODEL, repl, script
    from rlm.api import replay, resume
    srv = scripted(script([repl("FINAL('ok')")] * 40))
    path = tmp_path / "j.sqlite3"
    o = dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL, journal=str(path))
    rlm.completion("warm up", "q", **o)
    threads = len(threading.enumerate())
    for i in range(4):
        res = rlm.completion(f"context {i}", "q", **o)
        assert res.status == "completed"
        assert replay(res.run_id, journal=str(path), context=f"context {i}").status == "completed"
        assert resume(res.run_id, journal=str(path)).answer == "ok"
    with rlm.RLM(**o) as r:
        for i in range(3):
            r.completion(f"again {i}", "q")
    # no growth: a journal left open keeps a writer thread per run (16 runs here); threads that
    # come and go (the scripted server's request threads) may be fewer or more for a moment
    deadline = time.monotonic() + 10
    while len(threading.enumerate()) > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(threading.enumerate()) <= threads, [t.name for t in threading.enumerate()]
    assert not any(t.name == "rlm-journal-writer" for t in threading.enumerate())
    assert _open_journal_files(path) == 0
    # the records were all written before the journal was closed
    with Journal(path) as j:
        runs = j.list_runs(limit=100)
    assert len(runs) == 8 and {r["state"] for r in runs} == {"completed"}


def test_a_journal_object_is_used_and_left_open(scripted, tmp_path):
    # documented ("a path, a postgresql:// URL, False or a Journal"), but a Journal object
    # was taken for a path: TypeError
    import rlm
    from conftest import API_KEY, MODEL, repl, script
    from rlm.api import replay
    srv = scripted(script([repl("FINAL('ok')")] * 4))
    with Journal(tmp_path / "j.sqlite3") as j:
        res = rlm.completion("ctx", "q", base_url=srv.base_url, api_key=API_KEY, model=MODEL,
                             journal=j)
        assert res.status == "completed" and not j.closed
        assert j.get_run(res.run_id)["state"] == "completed"
        assert replay(res.run_id, journal=j, context="ctx").replayed_calls == 1
        assert not j.closed


def test_a_listener_that_raises_changes_nothing_in_the_run_or_its_journal(scripted, tmp_path,
                                                                          caplog):
    # it rolled the stage change back and sent the journal a rollback it could not write:
    # "NOT NULL constraint failed: events.to_status", the run crashed with no events kept
    import rlm
    from conftest import API_KEY, MODEL, repl, script
    srv = scripted(script([repl("FINAL(str(len(context)))")] * 2))
    seen: list[str] = []

    def listener(event):
        seen.append(event["event"])
        if len(seen) in (1, 5):
            raise ValueError("a listener's own bug")
    o = dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL)
    with Journal(tmp_path / "j.sqlite3") as j, caplog.at_level("DEBUG", logger="rlm"):
        plain = rlm.completion("some context", "q", journal=j, run_id="plain", **o)
        res = rlm.completion("some context", "q", journal=j, run_id="watched",
                             listeners=[listener], **o)
        assert (res.status, res.answer) == ("completed", "12")
        events = j.events("watched")
        assert len(events) == len(j.events("plain")) == len(seen) > 5
        assert "rollback" not in seen
        assert [e["to"] for e in events] == [e["to"] for e in j.events("plain")]
        assert j.get_run("watched")["state"] == "completed"
    warned = [r for r in caplog.records if "a listener's own bug" in r.getMessage()]
    assert [r.levelname for r in warned] == ["WARNING", "DEBUG"], warned
    assert plain.status == "completed"


def _finished_run(scripted, path, run_id="ro-run"):
    import rlm
    from conftest import API_KEY, MODEL, repl, script
    srv = scripted(script([repl("FINAL(context.upper())")]))
    res = rlm.completion("read me", "q", base_url=srv.base_url, api_key=API_KEY, model=MODEL,
                         journal=str(path), run_id=run_id)
    assert res.answer == "READ ME"
    return res


def test_a_journal_this_process_may_not_write_is_read_read_only(scripted, tmp_path,
                                                                 monkeypatch):
    # every reading command failed on such a journal: "unable to open database file"
    from rlm.config import records
    from rlm.api import replay
    path = tmp_path / "j.sqlite3"
    _finished_run(scripted, path)
    with Journal(path, read_only=True) as j:
        assert j.read_only and j.get_run("ro-run")["state"] == "completed"
        assert len(j.events("ro-run")) > 5
        with pytest.raises(JournalError, match="read-only"):
            j.create_run("new-run", query="q", model="m")
    monkeypatch.setattr(records, "_writable", lambda p: False)
    j = records.open_journal(str(path), must_exist=True)
    try:
        assert j.read_only and [r["run_id"] for r in j.list_runs()] == ["ro-run"]
    finally:
        j.close()
    assert replay("ro-run", journal=str(path), context="read me").answer == "READ ME"
    monkeypatch.setattr(records, "_writable", lambda p: True)
    j = records.open_journal(str(path), must_exist=True)
    try:
        assert not j.read_only
    finally:
        j.close()


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


def test_reading_commands_work_on_a_read_only_mount(scripted, tmp_path, cli):
    # the case in the field: a journal archived on a read-only filesystem (the WAL index
    # cannot be created beside it either)
    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem needs root")
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if not _mount("-t", "tmpfs", "tmpfs", str(mnt)):
        pytest.skip("cannot mount a tmpfs here")
    try:
        path = mnt / "j.sqlite3"
        _finished_run(scripted, path)
        assert _mount("-o", "remount,ro", str(mnt))
        for args in (["runs"], ["show", "ro-run"], ["verify", "ro-run"], ["export", "ro-run"],
                     ["view", "ro-run", "-o", str(tmp_path / "v.html")]):
            r = cli(*args, "--journal", str(path))
            assert r.rc == 0 and "Traceback" not in r.stderr, (args, r.stderr)
            assert "ro-run" in r.stdout + r.stderr or args[0] == "view", (args, r.stdout)
        assert (tmp_path / "v.html").stat().st_size > 1000
        r = cli("replay", "ro-run", "--journal", str(path), "--context", "-", input="read me")
        assert r.rc == 0 and r.stdout.strip() == "READ ME", r.stderr
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
