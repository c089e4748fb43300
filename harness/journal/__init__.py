"""The journal: an append-only record of runs, stage transitions, model calls and cells.

One SQLite file (WAL mode), or one PostgreSQL database shared by many
hosts (``Journal("postgresql://...")``, ``pg_store.py``), holds everything resume, replay and
``harness.journal.verify`` need; both stores share the schema and the record statements. Every event
carries its place in its run's hash chain (``prev_hash``, ``hash``), anchored to the run's inputs:

- ``runs``: one row per run with its owner (pid, host) and heartbeat, so a crashed run (status
  ``running`` but heartbeat older than ``stale_after`` seconds, or owner process gone from this
  host) can be told apart from a live one.
- ``stages``: the latest JSON of every stage, keyed ``(run_id, stage_id)``.
- ``events``: every stage transition, append-only, in recording order (``seq``).
- ``model_calls``: every model request and response keyed ``(run_id, call_id)`` with the
  request's hash, so a resumed run can serve a call from the journal only when the request matches.
- ``cells``: every executed cell's code and output, append-only.
- ``spend``: the spend ledger, append-only: each model call's reservation (written before the call
  is sent), then its settlement or release, so a resumed run starts from what every earlier
  attempt spent, in-flight calls of a killed process included.

Durability: what the harness acts on (a spend reservation before its call is sent, a model
call's response before it is handed on, a run's creation and end) commits before the call
returns, together with everything queued before it, concurrent ones sharing one commit; a run's
other records (transitions, cells, settlements) are written behind, in order, by group commit
(``behind.py``). A fault of the database under a run (lost connection, full disk, lock, removed
file) is retried for a bounded time (``faults.py``), then raises ``JournalUnavailableError``.
A committed transaction survives a crash of the process (SIGKILL included); at durability
``power`` (``synchronous=FULL``) also an OS crash or power loss (``store.durability_level``). A
process killed mid-transaction loses only that transaction. A truncated ``-wal`` file loses the commits in its cut-off tail (not yet checkpointed
into the main file); every commit before the cut stays intact and the file opens. A main file
damaged beyond that raises ``JournalCorruptError`` naming the file and what to do.

Concurrency: one ``Journal`` object is safe to share between threads: one SQLite connection
behind a ``threading.Lock``. Measured against one connection per thread (``python -m
evals.bench_journal --compare-connections``, 2 loaded cores): throughput within run-to-run noise
of each other (16 threads: 340-440 us per stage either way), but a worst-case stage latency of
0.07-0.2 s instead of 0.5-1.3 s (per-thread connections contend on SQLite's file lock, whose busy
handler sleeps and can starve a thread), and one connection (file descriptor, page cache) per
journal instead of one per fan-out thread. Several processes may write the same file at once
(SQLite file locks, ``BEGIN IMMEDIATE``, a busy timeout). A ``Journal`` inherited across
``fork()`` opens a fresh connection and lock in the child.

Where things are (each module's docstring says more)::

    journal.py   Journal: the class callers use, assembled from the classes below
    runs.py      run records: create, claim, heartbeat (Heartbeat), finish, read; owner liveness
    records.py   stage transitions (events, stages), model calls, cells
    behind.py    the write-behind queue and group commit; which records are durable first
    faults.py    bounded retries through the database's faults (reconnect, full disk, lock)
    file_guard.py  a SQLite file removed, moved or replaced under a run: restored or saved
    spend.py     the spend ledger (record_spend, spend)
    export.py    export_jsonl: one run as JSON Lines
    store.py     Store (the operations the records need) and SQLiteStore (file, WAL, lock, fork,
                 error translation); default_journal_path, host_name, boot_id
    pg_store.py  PostgresStore: the same over psycopg 3 (placeholders, rlm_meta, triggers)
    schema.py    SCHEMA_VERSION, APPLICATION_ID, the tables, the migrations between versions
    encoding.py  request_hash, the hash chain (run_anchor, event_hash) and the JSON text
    errors.py    JournalError and its subclasses

This package imports only the standard library and ``harness.errors``: it knows nothing of models
or kernels.
"""
from __future__ import annotations

from harness.journal.encoding import request_hash
from harness.journal.errors import (
    JournalCorruptError,
    JournalError,
    JournalSchemaError,
    JournalUnavailableError,
    ModelCallConflictError,
    RunExistsError,
    UnknownRunError,
)
from harness.journal.journal import Journal
from harness.journal.runs import Heartbeat
from harness.journal.schema import APPLICATION_ID, SCHEMA_VERSION
from harness.journal.store import Store, default_journal_path

__all__ = [
    "SCHEMA_VERSION",
    "APPLICATION_ID",
    "Journal",
    "JournalError",
    "JournalSchemaError",
    "JournalUnavailableError",
    "JournalCorruptError",
    "RunExistsError",
    "UnknownRunError",
    "ModelCallConflictError",
    "Heartbeat",
    "Store",
    "default_journal_path",
    "request_hash",
]
