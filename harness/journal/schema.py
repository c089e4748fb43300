"""The journal's schema: its version, its tables and the migrations from older versions.

A journal file carries two numbers in its SQLite header:

- ``PRAGMA application_id`` = ``APPLICATION_ID`` (``0x524C4D4A``, "RLMJ"): marks an rlm journal,
  so a foreign SQLite file is recognised and refused;
- ``PRAGMA user_version`` = the schema version the file was written with (``SCHEMA_VERSION``).

Opening a file (``harness.journal.store.SQLiteStore``) reads both with ``inspect`` and refuses,
through ``check``, anything it cannot use *before changing a byte*; then ``upgrade`` creates the
schema in an empty file, or migrates an older one, inside the caller's write transaction.

Tables (times are unix seconds, ``REAL``; JSON columns hold compact UTF-8 JSON text):

- ``runs``: one row per run, with its owner (pid, host) and heartbeat;
- ``stages``: the latest JSON of every stage, keyed ``(run_id, stage_id)``;
- ``events``: every stage transition, append-only (triggers refuse UPDATE and DELETE), ``seq``
  strictly increasing;
- ``model_calls``: every model request and response, keyed ``(run_id, call_id)``, with the
  request's hash;
- ``cells``: every executed cell's code and output, append-only (triggers as for ``events``);
- ``spend`` (version 2): the spend ledger, append-only (triggers as for ``events``): every
  reservation of a model call, written *before* the call is sent, then its settlement or release,
  so a resumed run knows what its earlier attempts spent, including calls that were in flight
  when the process died.

Versions: 1 (runs, stages, events, model_calls, cells); 2 adds ``spend``.

To change the schema: write ``_migrate_<v>_to_<v+1>(conn)``, register it as
``_MIGRATIONS[v]`` and bump ``SCHEMA_VERSION``. The functions here read ``SCHEMA_VERSION`` and
``_MIGRATIONS`` from this module at call time (the tests patch them).

This module imports only the standard library and ``harness.journal.errors``.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Callable

from harness.journal.errors import JournalSchemaError

__all__ = ["SCHEMA_VERSION", "APPLICATION_ID", "inspect", "is_current", "check", "upgrade"]

#: The schema version this code writes, stored in ``PRAGMA user_version``.
SCHEMA_VERSION = 2
#: ``PRAGMA application_id`` of an rlm journal ("RLMJ"), so a foreign SQLite file is recognised.
APPLICATION_ID = 0x524C4D4A

_SCHEMA_V1 = """
CREATE TABLE runs (
    run_id       TEXT PRIMARY KEY,
    created_at   REAL NOT NULL,             -- unix seconds
    updated_at   REAL NOT NULL,             -- unix seconds, last change of this row but heartbeats
    status       TEXT NOT NULL,             -- running, completed, failed, interrupted, ...
    query        TEXT,
    model        TEXT,
    sub_model    TEXT,
    max_depth    INTEGER NOT NULL,
    options      TEXT NOT NULL,             -- JSON object
    answer       TEXT,
    usage        TEXT,                      -- JSON
    error        TEXT,                      -- JSON
    owner_pid    INTEGER,
    owner_host   TEXT,
    heartbeat_at REAL,                      -- unix seconds
    finished_at  REAL                       -- unix seconds
);
CREATE INDEX runs_by_created ON runs(created_at);

CREATE TABLE stages (
    run_id     TEXT NOT NULL,
    stage_id   TEXT NOT NULL,
    parent_id  TEXT,
    kind       TEXT,
    status     TEXT,
    level      INTEGER,
    first_seq  INTEGER NOT NULL,            -- events.seq of the first event seen: list order
    updated_ts REAL NOT NULL,               -- ts of the event that wrote this row
    stage      TEXT NOT NULL,               -- JSON: the latest stage dict
    PRIMARY KEY (run_id, stage_id)
) WITHOUT ROWID;

CREATE TABLE events (
    seq         INTEGER PRIMARY KEY,        -- strictly increasing: rows are never deleted
    run_id      TEXT NOT NULL,
    stage_id    TEXT NOT NULL,
    from_status TEXT,                       -- NULL for the creation event
    to_status   TEXT NOT NULL,
    ts          REAL NOT NULL,              -- unix seconds
    stage       TEXT NOT NULL               -- JSON: the stage dict after the transition
);
CREATE INDEX events_by_run ON events(run_id, seq);
CREATE TRIGGER events_no_update BEFORE UPDATE ON events
    BEGIN SELECT RAISE(ABORT, 'journal events are append-only'); END;
CREATE TRIGGER events_no_delete BEFORE DELETE ON events
    BEGIN SELECT RAISE(ABORT, 'journal events are append-only'); END;

CREATE TABLE model_calls (
    run_id       TEXT NOT NULL,
    call_id      TEXT NOT NULL,
    request_hash TEXT NOT NULL,
    request      TEXT NOT NULL,             -- JSON
    response     TEXT,                      -- JSON
    usage        TEXT,                      -- JSON
    attempts     TEXT,                      -- JSON
    created_at   REAL NOT NULL,             -- unix seconds
    PRIMARY KEY (run_id, call_id)
);

CREATE TABLE cells (
    seq        INTEGER PRIMARY KEY,         -- strictly increasing: rows are never deleted
    run_id     TEXT NOT NULL,
    stage_id   TEXT NOT NULL,
    code       TEXT NOT NULL,
    output     TEXT,                        -- JSON
    created_at REAL NOT NULL                -- unix seconds
);
CREATE INDEX cells_by_run ON cells(run_id, seq);
CREATE TRIGGER cells_no_update BEFORE UPDATE ON cells
    BEGIN SELECT RAISE(ABORT, 'journal cells are append-only'); END;
CREATE TRIGGER cells_no_delete BEFORE DELETE ON cells
    BEGIN SELECT RAISE(ABORT, 'journal cells are append-only'); END;
"""


def _migrate_0_to_1(conn: sqlite3.Connection) -> None:
    """Version 0 is an empty file: create the v1 schema."""
    for statement in _SCHEMA_V1.split(";\n"):
        if statement.strip():
            conn.execute(statement)


_SPEND_V2 = """
CREATE TABLE spend (
    seq               INTEGER PRIMARY KEY,  -- strictly increasing: rows are never deleted
    run_id            TEXT NOT NULL,
    call_id           TEXT NOT NULL,        -- the model call's stage id
    reservation       TEXT NOT NULL,        -- unique over every attempt of every run
    event             TEXT NOT NULL,        -- reserved (before sending), settled, released
    model             TEXT,
    calls             INTEGER NOT NULL,
    prompt_tokens     INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cost_usd          REAL NOT NULL,
    detail            TEXT,                 -- JSON: the estimate behind a reservation
    created_at        REAL NOT NULL         -- unix seconds
);
CREATE INDEX spend_by_run ON spend(run_id, seq);
CREATE TRIGGER spend_no_update BEFORE UPDATE ON spend
    BEGIN SELECT RAISE(ABORT, 'journal spend is append-only'); END;
CREATE TRIGGER spend_no_delete BEFORE DELETE ON spend
    BEGIN SELECT RAISE(ABORT, 'journal spend is append-only'); END;
"""


def _migrate_1_to_2(conn: sqlite3.Connection) -> None:
    """Version 2 adds the append-only ``spend`` ledger (reservations before sending, then
    settlements). A version-1 journal has none: its runs resume from the spend of their
    ``model_calls`` (see ``SpendRecords.spend``)."""
    for statement in _SPEND_V2.split(";\n"):
        if statement.strip():
            conn.execute(statement)


#: ``_MIGRATIONS[v]`` upgrades a journal from version ``v`` to ``v + 1`` inside the open
#: transaction. Add one entry per schema change and bump ``SCHEMA_VERSION``.
_MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {0: _migrate_0_to_1,
                                                                 1: _migrate_1_to_2}


def inspect(conn: sqlite3.Connection) -> tuple[int, int, list[str]]:
    """Read a file's identity without changing it.

    Returns:
        ``(user_version, application_id, tables)``: two ints and the sorted names of the file's
        own tables (SQLite's internal ``sqlite_*`` tables left out).

    Raises:
        sqlite3.Error: the file cannot be read (the caller translates it).
    """
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    app_id = conn.execute("PRAGMA application_id").fetchone()[0]
    tables = [r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' "
        "AND name NOT LIKE 'sqlite_%' ORDER BY name")]
    return version, app_id, tables


def is_fresh(version: int, app_id: int, tables: list[str]) -> bool:
    """Whether ``inspect``'s result is an empty file (version 0, no id, no tables): one to create
    the schema in."""
    return version == 0 and app_id == 0 and not tables


def is_current(version: int, app_id: int) -> bool:
    """Whether a file with this ``user_version`` and ``application_id`` needs no ``upgrade``."""
    return version == SCHEMA_VERSION and app_id == APPLICATION_ID


def check(path: Path, version: int, app_id: int, tables: list[str]) -> None:
    """Refuse a non-empty file this code cannot use or migrate (``inspect``'s result).

    Returns ``None`` for an rlm journal of the current version or of an older one with a
    migration path from it. ``path`` only names the file in the messages.

    Raises:
        JournalSchemaError: the file is not an rlm journal (foreign or unversioned SQLite file),
            was written by a newer version of this code, or has no migration path. Its message
            says what to do; the file is never modified.
    """
    if app_id != APPLICATION_ID:
        listed = ", ".join(tables[:8]) + (", ..." if len(tables) > 8 else "")
        raise JournalSchemaError(
            f"{path} is a SQLite database but not an rlm journal (schema version {version}, "
            f"application_id {app_id:#x}, tables: {listed or 'none'}); this code writes "
            f"schema version {SCHEMA_VERSION} and cannot migrate an unversioned or foreign "
            f"file. Move the file aside, or point RLM_JOURNAL / the journal path elsewhere. "
            f"The file was not modified.",
            path=path, found=version, supported=SCHEMA_VERSION)
    if version > SCHEMA_VERSION:
        raise JournalSchemaError(
            f"journal {path} has schema version {version}, newer than the version this code "
            f"knows ({SCHEMA_VERSION}): it was written by a newer rlm-kernels. Upgrade "
            f"rlm-kernels (pip install -U rlm-kernels), or use another journal path "
            f"(RLM_JOURNAL). The file was not modified.",
            path=path, found=version, supported=SCHEMA_VERSION)
    missing = [v for v in range(version, SCHEMA_VERSION) if v not in _MIGRATIONS]
    if version < 1 or missing:
        raise JournalSchemaError(
            f"journal {path} has schema version {version} and this code (version "
            f"{SCHEMA_VERSION}) has no migration from it; move the file aside or use another "
            f"journal path (RLM_JOURNAL). The file was not modified.",
            path=path, found=version, supported=SCHEMA_VERSION)


def upgrade(conn: sqlite3.Connection, path: Path) -> int | None:
    """Create or migrate the schema; call it inside a write transaction (``BEGIN IMMEDIATE``).

    Re-inspects the file under the write lock (so of several concurrent openers the second one
    sees the first one's result), refuses it as ``check`` does, runs the migrations from the
    file's version up to ``SCHEMA_VERSION`` and stamps the header. The caller commits, or rolls
    back on any exception (the file is then unchanged).

    Returns:
        the version an existing journal was migrated from, or ``None`` if the file was empty
        (schema created) or already current.

    Raises:
        JournalSchemaError: as ``check``.
        sqlite3.Error: a statement failed (the caller translates it).
    """
    version, app_id, tables = inspect(conn)
    fresh = is_fresh(version, app_id, tables)
    if not fresh:
        check(path, version, app_id, tables)
    start = version
    while version < SCHEMA_VERSION:
        _MIGRATIONS[version](conn)
        version += 1
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    return None if fresh or start == SCHEMA_VERSION else start
