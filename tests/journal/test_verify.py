"""``rlm verify`` over a tamper-evident journal, on both stores: a journal written by a real run
verifies clean, and each edit an attacker with database access might make (triggers dropped
first) makes ``verify`` fail and name the event."""
from __future__ import annotations

import sqlite3
import time

import pytest
from conftest import API_KEY, MODEL, repl, script

from harness.journal import Journal
from harness.journal.verify import verify_journal, verify_run, violation_rate


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    """``(journal spec, raw(sql, params))`` for each store; ``raw`` runs SQL on the journal
    directly, as an attacker would."""
    if request.param == "sqlite":
        path = str(tmp_path / "j.sqlite3")

        def raw(statement: str, params: tuple = ()) -> list:
            con = sqlite3.connect(path, isolation_level=None)
            try:
                return con.execute(statement, params).fetchall()
            finally:
                con.close()
        return path, raw, "sqlite"
    url = request.getfixturevalue("pg_url")
    import psycopg

    def raw(statement: str, params: tuple = ()) -> list:
        with psycopg.connect(url, autocommit=True) as c:
            cur = c.execute(statement.replace("?", "%s"), params)
            return cur.fetchall() if cur.description else []
    return url, raw, "postgresql"


@pytest.fixture
def recorded(store, scripted):
    """A real run (kernel, a sub-call, FINAL) journaled in ``store``; its run id."""
    from rlm import completion
    spec, raw, dialect = store
    srv = scripted(script([repl("x = llm_query('hi')", "print(x)"), repl("FINAL('done')")],
                          sub=lambda req: "sub-answer"))
    res = completion("ctx", query="q", model=MODEL, base_url=srv.base_url, api_key=API_KEY,
                     journal=spec, run_id="run-1")
    assert res.status == "completed", res.reason
    return "run-1"


def _unlock(raw, dialect: str) -> None:
    if dialect == "sqlite":
        for t in ("events_no_update", "events_no_delete"):
            raw(f"DROP TRIGGER {t}")
    else:
        raw("DROP TRIGGER events_no_update ON events")


def _verdict(spec: str, run_id: str):
    with Journal(spec) as j:
        return verify_run(j, run_id)


def _seq(raw, run_id: str, kind: str, to: str) -> int:
    rows = raw("SELECT seq, stage FROM events WHERE run_id = ? AND to_status = ? ORDER BY seq",
               (run_id, to))
    return next(seq for seq, st in rows if f'"kind":"{kind}"' in st)


def test_a_real_run_verifies_clean(store, recorded):
    spec, raw, _ = store
    with Journal(spec) as j:
        verdicts = verify_journal(j)
    assert [v.ok for v in verdicts] == [True] and violation_rate(verdicts) == 0.0
    assert verdicts[0].events > 10


def test_changed_response_is_caught(store, recorded):
    spec, raw, _ = store
    call = raw("SELECT call_id FROM model_calls WHERE run_id = ? ORDER BY rowid", (recorded,))[0][0]
    raw("UPDATE model_calls SET response = ? WHERE call_id = ?",
        ('{"text":"forged","model":"m"}', call))
    v = _verdict(spec, recorded)
    assert not v.ok and "response" in v.first.message and call in v.first.message
    # forging the response hash too is caught by the chained event's evidence
    from harness.journal.encoding import value_hash
    raw("UPDATE model_calls SET response_hash = ? WHERE call_id = ?",
        (value_hash({"text": "forged", "model": "m"}), call))
    v = _verdict(spec, recorded)
    assert not v.ok and "differs from the response its completed event" in v.first.message
    completed = [s for s, st in raw("SELECT seq, stage FROM events WHERE stage_id = ? AND "
                                    "to_status = 'completed'", (call,))]
    assert v.first.seq == completed[-1]


def test_dropped_event_is_caught(store, recorded):
    spec, raw, dialect = store
    _unlock(raw, dialect)
    if dialect == "postgresql":
        raw("DROP TRIGGER IF EXISTS events_no_truncate ON events")
    seqs = [r[0] for r in raw("SELECT seq FROM events WHERE run_id = ? ORDER BY seq", (recorded,))]
    raw("DELETE FROM events WHERE seq = ?", (seqs[5],))
    v = _verdict(spec, recorded)
    assert not v.ok and v.first.seq == seqs[6] and "chain broken" in v.first.message


def test_reordered_events_are_caught(store, recorded):
    spec, raw, dialect = store
    _unlock(raw, dialect)
    seqs = [r[0] for r in raw("SELECT seq FROM events WHERE run_id = ? ORDER BY seq", (recorded,))]
    a, b = seqs[3], seqs[4]
    raw("UPDATE events SET seq = -1 WHERE seq = ?", (a,))
    raw("UPDATE events SET seq = ? WHERE seq = ?", (a, b))
    raw("UPDATE events SET seq = ? WHERE seq = -1", (b,))
    v = _verdict(spec, recorded)
    assert not v.ok and v.first.seq == a


def test_terminal_stage_set_back_to_running_is_caught(store, recorded):
    spec, raw, dialect = store
    seq = _seq(raw, recorded, "cell", "completed")
    sid = raw("SELECT stage_id FROM events WHERE seq = ?", (seq,))[0][0]
    raw("UPDATE stages SET status = 'running' WHERE stage_id = ?", (sid,))
    v = _verdict(spec, recorded)
    assert not v.ok and "stages table says running" in v.first.message and sid in v.first.message
    # and in the append-only log itself: the event's status edited
    _unlock(raw, dialect)
    raw("UPDATE stages SET status = 'completed' WHERE stage_id = ?", (sid,))
    raw("UPDATE events SET to_status = 'running' WHERE seq = ?", (seq,))
    v = _verdict(spec, recorded)
    assert not v.ok and v.first.seq == seq


def test_illegal_transition_appended_through_the_api_is_caught(store, recorded):
    spec, raw, _ = store
    seq = _seq(raw, recorded, "cell", "completed")
    stage_json = raw("SELECT stage FROM events WHERE seq = ?", (seq,))[0][0]
    import json
    st = json.loads(stage_json)
    st["status"] = "running"
    with Journal(spec) as j:  # the chain is intact: the event is legal storage, illegal history
        j.record_event({"run_id": recorded, "stage": st, "from": "completed", "to": "running",
                        "ts": time.time()})
        v = verify_run(j, recorded)
    assert not v.ok and "terminal status completed left" in v.first.message


@pytest.mark.parametrize("field,value", [("meta", "a string"), ("evidence", ["a", "list"]),
                                         ("usage", "12 tokens"), ("meta", 7)])
def test_a_record_of_the_wrong_shape_is_a_finding_not_a_crash(store, recorded, cli, field,
                                                               value):
    """A stage recorded with a field of another type (as an edited or foreign journal may hold)
    is reported by ``rlm verify`` with exit 8; the command never fails with an internal error."""
    import json
    spec, raw, _ = store
    seq = _seq(raw, recorded, "model_call", "completed")
    st = json.loads(raw("SELECT stage FROM events WHERE seq = ?", (seq,))[0][0])
    st[field] = value
    with Journal(spec) as j:
        j.record_event({"run_id": recorded, "stage": st, "from": "completed",
                        "to": "completed", "ts": time.time()})
    r = cli("verify", "--all", "--journal", spec)
    assert r.rc == 8 and "VIOLATED" in r.stdout + r.stderr, (r.stdout, r.stderr)
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr


def test_cli_verify_names_the_first_bad_event(store, recorded, cli):
    spec, raw, _ = store
    r = cli("verify", "--all", "--journal", spec)
    assert r.rc == 0 and "violation rate: 0.0000" in r.stdout, r.stderr
    raw("UPDATE runs SET query = 'another question'")
    r = cli("verify", recorded, "--journal", spec)
    first = raw("SELECT min(seq) FROM events WHERE run_id = ?", (recorded,))[0][0]
    assert r.rc == 8 and f"event {first}" in r.stderr and "run's inputs" in r.stderr, r.stderr


def test_concurrent_writers_of_one_run_keep_one_linear_chain(store):
    """Two journals (two connections, as two processes or hosts would have) and four threads
    append to one run at once: the chain index makes the losers retry, the chain stays whole."""
    import threading
    spec, raw, _ = store
    journals = [Journal(spec), Journal(spec)]
    journals[0].create_run("r", query="q", model="m")
    barrier = threading.Barrier(4)

    def append(t: int) -> None:
        jj = journals[t % 2]
        barrier.wait()
        for i in range(25):
            sid = f"r/s{t}-{i}"
            jj.record_event({"run_id": "r", "stage": {"id": sid, "kind": "iteration",
                                                      "status": "pending"},
                             "from": None, "to": "pending", "ts": time.time()})
    threads = [threading.Thread(target=append, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    v = verify_run(journals[0], "r")
    assert v.events == 100 and [x for x in v.violations if x.check == "chain"] == []
    for jj in journals:
        jj.close()


def test_stage_rows_hold_their_columns_on_both_stores(store):
    from test_journal import lifecycle
    spec, raw, _ = store
    with Journal(spec) as j:
        j.create_run("r", query="q", model="m")
        lifecycle(j, "r", "s", level=2)
    assert raw("SELECT stage_id, parent_id, kind, status, level FROM stages") == [
        ("r/s", "r", "model_call", "completed", 2)]
