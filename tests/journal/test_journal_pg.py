"""The journal test suite against a real PostgreSQL server (started once per session by the
``pg_server`` fixture): the store-agnostic tests of ``test_journal`` run again here with ``jpath``
a PostgreSQL URL (a fresh schema per test), plus what only a server can show (append-only
enforced by triggers, schema versioning in ``rlm_meta``)."""
from __future__ import annotations

import time

import psycopg
import pytest
import test_journal as tj
from journal_events import lifecycle

from harness.journal import Journal, JournalError, JournalSchemaError, SCHEMA_VERSION
from harness.journal import schema as journal_mod

# Every test of test_journal that uses the journal only through its API (the others open the
# SQLite file directly: WAL, corruption, disk full, file permissions, fork of a file handle...).
_SHARED = [
    "test_run_round_trip_and_finish", "test_create_run_twice_is_refused_and_keeps_first",
    "test_finish_run_validation", "test_list_runs_newest_first_with_limit",
    "test_events_and_stages_round_trip", "test_out_of_order_event_does_not_roll_stage_back",
    "test_record_event_rejects_malformed_and_non_json", "test_model_call_round_trip",
    "test_model_call_same_id_idempotent_or_conflict", "test_cells_round_trip",
    "test_export_jsonl_contains_every_record", "test_dead_owner_on_this_host_is_crashed_at_once",
    "test_dead_owner_claim_has_one_winner", "test_claim_interrupted_run_clears_finished_at",
    "test_start_heartbeat_keeps_run_alive_and_stops", "test_close_stops_heartbeats_and_refuses_use",
    "test_sixteen_threads_two_hundred_events_each", "test_two_processes_write_the_same_file",
    "test_sigkill_mid_write_keeps_committed_runs",
]
for _name in _SHARED:
    globals()[_name] = getattr(tj, _name)


@pytest.fixture
def jpath(pg_url):
    return pg_url


@pytest.fixture
def j(pg_url):
    with Journal(pg_url) as journal:
        yield journal


def sql(url: str, statement: str, params: tuple = ()) -> list:
    with psycopg.connect(url, autocommit=True) as c:
        cur = c.execute(statement, params)
        return cur.fetchall() if cur.description else []


def test_url_opens_the_postgres_store_and_env_selects_it(pg_url, monkeypatch):
    monkeypatch.setenv("RLM_JOURNAL", pg_url)
    with Journal() as jj:
        assert type(jj).__name__ == "PostgresJournal" and isinstance(jj, Journal)
        jj.create_run("r", query="q", model="m")
    with Journal(pg_url) as again:
        assert again.get_run("r")["query"] == "q"


def test_events_and_cells_are_append_only_in_the_database(j, pg_url):
    j.create_run("r", query="q", model="m")
    lifecycle(j, "r", "s")
    j.record_cell("r", "r/s", "print(1)", {"stdout": "1"})
    for statement in ("UPDATE events SET to_status = 'failed'", "DELETE FROM events",
                      "TRUNCATE events", "UPDATE cells SET code = 'x'", "DELETE FROM cells"):
        with pytest.raises(psycopg.Error, match="append-only"):
            sql(pg_url, statement)
    assert len(j.events("r")) == 3 and len(j.cells("r")) == 1


def test_spend_ledger_round_trip_and_append_only(j, pg_url):
    """The spend ledger (schema 2) on PostgreSQL: reservations fold with their settlement or
    release, an unsettled one stays open, and the database refuses edits."""
    j.create_run("r", query="q", model="m")
    j.record_spend("r", "r/c1", "res-1", "reserved", model="m", calls=1, prompt_tokens=100,
                   completion_tokens=50, cost_usd=0.25, detail={"estimate": 150})
    j.record_spend("r", "r/c1", "res-1", "settled", model="m", calls=1, prompt_tokens=90,
                   completion_tokens=10, cost_usd=0.125)
    j.record_spend("r", "r/c2", "res-2", "reserved", model="m", calls=1, prompt_tokens=5,
                   completion_tokens=5, cost_usd=0.5)
    first, second = j.spend("r")
    assert (first["state"], first["settled"]["prompt_tokens"], first["estimate"]) == (
        "settled", 90, {"estimate": 150})
    assert (second["state"], second["reserved"]["cost_usd"]) == ("open", 0.5)
    for statement in ("UPDATE spend SET cost_usd = 0", "DELETE FROM spend", "TRUNCATE spend"):
        with pytest.raises(psycopg.Error, match="append-only"):
            sql(pg_url, statement)
    assert len(j.spend("r")) == 2


def test_claim_is_atomic_exactly_one_winner(pg_url):
    import threading
    with Journal(pg_url) as j:
        j.create_run("r", query="q", model="m")
    sql(pg_url, "UPDATE runs SET owner_host = 'elsewhere', heartbeat_at = %s", (time.time() - 60,))
    journals = [Journal(pg_url) for _ in range(8)]
    barrier, results = threading.Barrier(8), []

    def claim(jj):
        barrier.wait()
        results.append(jj.claim_run("r"))
    threads = [threading.Thread(target=claim, args=(jj,)) for jj in journals]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 7 + [True]
    for jj in journals:
        jj.close()


def test_fork_opens_its_own_connection(j):
    import os
    j.create_run("r", query="q", model="m")
    parent = j._conn
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            j.get_run("r")  # the first use in the child opens its own connection
            j.record_cell("r", "r/c", "x", {"pid": os.getpid(), "own": j._conn is not parent})
        except BaseException:
            code = 1
        os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    assert j.cells("r")[0]["output"]["own"] is True and j._conn is parent


def test_stale_heartbeat_is_crashed_and_claimable_from_another_host(j, pg_url, monkeypatch):
    j.create_run("r", query="q", model="m")
    sql(pg_url, "UPDATE runs SET owner_host = 'elsewhere', heartbeat_at = %s",
        (time.time() - 60,))
    assert j.get_run("r")["state"] == "crashed"
    assert j.claim_run("r") is True and j.claim_run("r") is False


def test_schema_version_lives_in_rlm_meta_and_newer_is_refused(pg_url):
    Journal(pg_url).close()
    meta = dict(sql(pg_url, "SELECT key, value FROM rlm_meta"))
    assert meta == {"user_version": SCHEMA_VERSION, "application_id": journal_mod.APPLICATION_ID}
    sql(pg_url, "UPDATE rlm_meta SET value = 99 WHERE key = 'user_version'")
    with pytest.raises(JournalSchemaError, match="newer"):
        Journal(pg_url)


def test_version_1_database_is_migrated(pg_url, monkeypatch):
    monkeypatch.setattr(journal_mod, "SCHEMA_VERSION", 1)
    Journal(pg_url).close()
    monkeypatch.undo()
    sql(pg_url, "INSERT INTO runs (run_id, created_at, updated_at, status, query, max_depth, "
                "options) VALUES ('r', 0, 0, 'running', 'q', 1, '{}')")
    assert "hash" not in [r[0] for r in sql(pg_url, "SELECT column_name FROM "
                                            "information_schema.columns WHERE table_name = "
                                            "'events' AND table_schema = current_schema()")]
    with Journal(pg_url) as j:
        lifecycle(j, "r", "s")
        assert j.get_run("r")["query"] == "q"
        assert j.spend("r") == []  # the spend ledger (2) came with the chain (3)
    assert dict(sql(pg_url, "SELECT key, value FROM rlm_meta"))["user_version"] == SCHEMA_VERSION


def test_foreign_database_is_refused_untouched(pg_url):
    sql(pg_url, "CREATE TABLE things (x int)")
    with pytest.raises(JournalSchemaError, match="not an rlm journal"):
        Journal(pg_url)
    assert sql(pg_url, "SELECT count(*) FROM information_schema.tables WHERE "
                       "table_schema = current_schema()") == [(1,)]


def test_unreachable_server_is_a_clear_error():
    with pytest.raises(JournalError, match="unreachable") as info:
        Journal("postgresql://u:secret@127.0.0.1:1/db", busy_timeout=2)
    assert "secret" not in str(info.value)




def test_durability_level_sets_the_sessions_synchronous_commit(pg_url, monkeypatch):
    """``process`` (the default) commits without waiting for the disk; ``power`` waits."""
    monkeypatch.delenv("RLM_JOURNAL_DURABILITY", raising=False)
    with Journal(pg_url) as jj:
        assert jj._conn.raw.execute("SHOW synchronous_commit").fetchone()[0] == "off"
    with Journal(pg_url, durability="power") as jj:
        assert jj._conn.raw.execute("SHOW synchronous_commit").fetchone()[0] == "on"
    monkeypatch.setenv("RLM_JOURNAL_DURABILITY", "power")
    with Journal(pg_url) as jj:
        assert jj._conn.raw.execute("SHOW synchronous_commit").fetchone()[0] == "on"
