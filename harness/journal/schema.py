"""The journal's schema: its version, its tables and the migrations from older versions.

One schema for both stores: the DDL below and every migration are written once and rendered for
the store's dialect (``render``: column types, the sequence key, append-only triggers); the record
statements are shared too (``harness.journal.store`` translates placeholders). A PostgreSQL journal
keeps the two numbers below in a one-row-per-key table ``rlm_meta`` instead of the SQLite header.

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
  when the process died;
- ``tool_calls`` (version 4): every call of a user's host tool, keyed ``(run_id, call_id)``
  (the tool stage's id): written ``started`` before the tool is called, then ``done`` with its
  result or ``failed`` with its error, so resume and replay serve it instead of calling again.

Versions: 1 (runs, stages, events, model_calls, cells); 2 adds ``spend``; 3 adds the
tamper-evident hash chain (``events.prev_hash``, ``events.hash``, and the
unique index ``events_chain`` on ``(run_id, prev_hash)`` that keeps each chain linear), the hash of
every model call's response (``model_calls.response_hash``) and the owner's boot id
(``runs.owner_boot``); 4 adds ``tool_calls``.

To change the schema: write ``_migrate_<v>_to_<v+1>(conn)`` (plain SQL both stores accept, or
``execute_script(conn, render(ddl, dialect_of(conn)))``), register it as ``_MIGRATIONS[v]`` and
bump ``SCHEMA_VERSION``. The functions here read ``SCHEMA_VERSION`` and
``_MIGRATIONS`` from this module at call time (the tests patch them).

This module imports only the standard library and ``harness.journal.errors``.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any, Callable

from harness.journal.errors import JournalSchemaError

__all__ = ["SCHEMA_VERSION", "APPLICATION_ID", "inspect", "is_current", "check", "upgrade",
           "render", "dialect_of", "execute_script", "EVENT_INSERT", "STAGE_UPSERT",
           "STAGE_ON_CONFLICT"]

#: The schema version this code writes, stored in ``PRAGMA user_version``.
SCHEMA_VERSION = 4
#: ``PRAGMA application_id`` of an rlm journal ("RLMJ"), so a foreign SQLite file is recognised.
APPLICATION_ID = 0x524C4D4A

_SCHEMA_V1 = """
CREATE TABLE runs (
    {rowid}
    run_id       TEXT PRIMARY KEY,
    created_at   {real} NOT NULL,             -- unix seconds
    updated_at   {real} NOT NULL,             -- unix seconds, last change of this row but heartbeats
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
    heartbeat_at {real},                      -- unix seconds
    finished_at  {real}                       -- unix seconds
);
CREATE INDEX runs_by_created ON runs(created_at);

CREATE TABLE stages (
    run_id     TEXT NOT NULL,
    stage_id   TEXT NOT NULL,
    parent_id  TEXT,
    kind       TEXT,
    status     TEXT,
    level      INTEGER,
    first_seq  BIGINT NOT NULL,             -- events.seq of the first event seen: list order
    updated_ts {real} NOT NULL,               -- ts of the event that wrote this row
    stage      TEXT NOT NULL,               -- JSON: the latest stage dict
    PRIMARY KEY (run_id, stage_id)
) {without_rowid};

CREATE TABLE events (
    seq         {seq},        -- strictly increasing: rows are never deleted
    run_id      TEXT NOT NULL,
    stage_id    TEXT NOT NULL,
    from_status TEXT,                       -- NULL for the creation event
    to_status   TEXT NOT NULL,
    ts          {real} NOT NULL,              -- unix seconds
    stage       TEXT NOT NULL               -- JSON: the stage dict after the transition
);
CREATE INDEX events_by_run ON events(run_id, seq);
{append_only:events};

CREATE TABLE model_calls (
    {rowid}
    run_id       TEXT NOT NULL,
    call_id      TEXT NOT NULL,
    request_hash TEXT NOT NULL,
    request      TEXT NOT NULL,             -- JSON
    response     TEXT,                      -- JSON
    usage        TEXT,                      -- JSON
    attempts     TEXT,                      -- JSON
    created_at   {real} NOT NULL,             -- unix seconds
    PRIMARY KEY (run_id, call_id)
);

CREATE TABLE cells (
    seq        {seq},         -- strictly increasing: rows are never deleted
    run_id     TEXT NOT NULL,
    stage_id   TEXT NOT NULL,
    code       TEXT NOT NULL,
    output     TEXT,                        -- JSON
    created_at {real} NOT NULL                -- unix seconds
);
CREATE INDEX cells_by_run ON cells(run_id, seq);
{append_only:cells}
"""

#: Version 3: the hash chain of every run's events, model-call response hashes, owner boot ids.
_SCHEMA_V3 = """
ALTER TABLE runs ADD COLUMN owner_boot TEXT;
ALTER TABLE events ADD COLUMN prev_hash TEXT;
ALTER TABLE events ADD COLUMN hash TEXT;
ALTER TABLE model_calls ADD COLUMN response_hash TEXT;
CREATE UNIQUE INDEX events_chain ON events(run_id, prev_hash)
"""

_SQLITE_TOKENS = {"{real}": "REAL", "{seq}": "INTEGER PRIMARY KEY", "{rowid}": "",
                  "{without_rowid}": "WITHOUT ROWID"}
# PostgreSQL: ``rowid`` is an ordinary identity column, so statements ordering by SQLite's rowid
# read the same on both stores.
_PG_TOKENS = {"{real}": "DOUBLE PRECISION",
              "{seq}": "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
              "{rowid}": "rowid BIGINT GENERATED BY DEFAULT AS IDENTITY UNIQUE,",
              "{without_rowid}": ""}

_PG_APPEND_ONLY_FN = (
    "CREATE OR REPLACE FUNCTION rlm_append_only() RETURNS trigger LANGUAGE plpgsql AS $f$ "
    "BEGIN RAISE EXCEPTION 'journal % are append-only', TG_TABLE_NAME; END $f$")


# The statements that append to the chain, shared by both stores.
#: Appends one event (8 parameters: run id, stage id, from, to, ts, stage JSON, prev hash, hash).
EVENT_INSERT = ("INSERT INTO events (run_id, stage_id, from_status, to_status, ts, stage, "
                "prev_hash, hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?)")
#: What a stage row becomes on a later event: only an event not older than the row's writes it.
STAGE_ON_CONFLICT = ("ON CONFLICT (run_id, stage_id) DO UPDATE SET parent_id = excluded.parent_id, "
                     "kind = excluded.kind, status = excluded.status, level = excluded.level, "
                     "updated_ts = excluded.updated_ts, stage = excluded.stage "
                     "WHERE excluded.updated_ts >= stages.updated_ts")
#: Upserts a stage's latest row (run id, stage id, parent id, kind, status, level, first seq,
#: ts, stage JSON).
STAGE_UPSERT = ("INSERT INTO stages (run_id, stage_id, parent_id, kind, status, level, "
                "first_seq, updated_ts, stage) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                + STAGE_ON_CONFLICT)

def _append_only(table: str, dialect: str) -> str:
    """The triggers that refuse UPDATE and DELETE (and TRUNCATE) on ``table``."""
    if dialect == "sqlite":
        return (f"CREATE TRIGGER {table}_no_update BEFORE UPDATE ON {table}\n"
                f"    BEGIN SELECT RAISE(ABORT, 'journal {table} are append-only'); END;\n"
                f"CREATE TRIGGER {table}_no_delete BEFORE DELETE ON {table}\n"
                f"    BEGIN SELECT RAISE(ABORT, 'journal {table} are append-only'); END")
    return (f"{_PG_APPEND_ONLY_FN};\n"
            f"CREATE TRIGGER {table}_no_update BEFORE UPDATE OR DELETE ON {table} "
            f"FOR EACH ROW EXECUTE FUNCTION rlm_append_only();\n"
            f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION rlm_append_only()")


def render(ddl: str, dialect: str) -> str:
    """``ddl`` written once, rendered for ``dialect`` (``"sqlite"`` or ``"postgresql"``)."""
    for token, value in (_SQLITE_TOKENS if dialect == "sqlite" else _PG_TOKENS).items():
        ddl = ddl.replace(token, value)
    for table in ("events", "cells", "spend"):
        ddl = ddl.replace("{append_only:%s}" % table, _append_only(table, dialect))
    return ddl


def dialect_of(conn: Any) -> str:
    """The dialect of a store connection: ``"sqlite"`` for ``sqlite3``, else its ``dialect``."""
    return "sqlite" if isinstance(conn, sqlite3.Connection) else conn.dialect


def execute_script(conn: Any, script: str) -> None:
    """Run the ``;``-and-newline separated statements of ``script`` on ``conn``."""
    for statement in script.split(";\n"):
        if statement.strip():
            conn.execute(statement)


#: Version 2: the append-only spend ledger.
_SPEND_V2 = """
CREATE TABLE spend (
    seq               {seq},  -- strictly increasing: rows are never deleted
    run_id            TEXT NOT NULL,
    call_id           TEXT NOT NULL,        -- the model call's stage id
    reservation       TEXT NOT NULL,        -- unique over every attempt of every run
    event             TEXT NOT NULL,        -- reserved (before sending), settled, released
    model             TEXT,
    calls             INTEGER NOT NULL,
    prompt_tokens     BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    cost_usd          {real} NOT NULL,
    detail            TEXT,                 -- JSON: the estimate behind a reservation
    created_at        {real} NOT NULL         -- unix seconds
);
CREATE INDEX spend_by_run ON spend(run_id, seq);
{append_only:spend}
"""


#: Version 4: the user's tool calls (one row per call, updated from started to its result).
_TOOLS_V4 = """
CREATE TABLE tool_calls (
    {rowid}
    run_id       TEXT NOT NULL,
    call_id      TEXT NOT NULL,             -- the tool stage's id
    tool         TEXT NOT NULL,
    request_hash TEXT NOT NULL,             -- request_hash({tool, args, kwargs})
    request      TEXT NOT NULL,             -- JSON {tool, args, kwargs}
    status       TEXT NOT NULL,             -- started (before the call), done, failed
    result       TEXT,                      -- JSON: the tool's result (done)
    error        TEXT,                      -- the tool's "Type: message" (failed)
    attempts     INTEGER NOT NULL,          -- times the tool was called for this row
    started_at   {real} NOT NULL,             -- unix seconds, the latest attempt's start
    finished_at  {real},                      -- unix seconds
    PRIMARY KEY (run_id, call_id)
)
"""


def _migrate_0_to_1(conn: Any) -> None:
    """Version 0 is an empty journal: create the v1 schema."""
    execute_script(conn, render(_SCHEMA_V1, dialect_of(conn)))


def _migrate_1_to_2(conn: Any) -> None:
    """Version 2 adds the append-only ``spend`` ledger (reservations before sending, then
    settlements). A version-1 journal has none: its runs resume from the spend of their
    ``model_calls`` (see ``SpendRecords.spend``)."""
    execute_script(conn, render(_SPEND_V2, dialect_of(conn)))


def _migrate_2_to_3(conn: Any) -> None:
    """Add the hash chain, response hashes and owner boot ids (older events stay unchained)."""
    execute_script(conn, render(_SCHEMA_V3, dialect_of(conn)))


def _migrate_3_to_4(conn: Any) -> None:
    """Add ``tool_calls`` (a journal of version 3 has no tool calls)."""
    execute_script(conn, render(_TOOLS_V4, dialect_of(conn)))


#: ``_MIGRATIONS[v]`` upgrades a journal from version ``v`` to ``v + 1`` inside the open
#: transaction. Add one entry per schema change and bump ``SCHEMA_VERSION``.
_MIGRATIONS: dict[int, Callable[[Any], None]] = {0: _migrate_0_to_1, 1: _migrate_1_to_2,
                                                 2: _migrate_2_to_3, 3: _migrate_3_to_4}


def inspect(conn: sqlite3.Connection) -> tuple[int, int, list[str]]:
    """Read a file's identity without changing it.

    Returns:
        ``(user_version, application_id, tables)``: two ints and the sorted names of the file's
        own tables (SQLite's internal ``sqlite_*`` tables left out).

    Raises:
        sqlite3.Error: the file cannot be read (the caller translates it).
    """
    if dialect_of(conn) != "sqlite":
        tables = [r[0] for r in conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = "
            "current_schema() ORDER BY table_name", ()).fetchall()]
        meta: dict = {}
        if "rlm_meta" in tables:
            meta = dict(conn.execute("SELECT key, value FROM rlm_meta", ()).fetchall())
            tables.remove("rlm_meta")
        return int(meta.get("user_version", 0)), int(meta.get("application_id", 0)), tables
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    app_id = conn.execute("PRAGMA application_id").fetchone()[0]
    tables = [r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' "
        "AND name NOT LIKE 'sqlite_%' ORDER BY name")]
    return version, app_id, tables


def _stamp(conn: Any) -> None:
    """Write ``SCHEMA_VERSION`` and ``APPLICATION_ID`` where the dialect keeps them."""
    if dialect_of(conn) == "sqlite":
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        return
    conn.execute("CREATE TABLE IF NOT EXISTS rlm_meta (key TEXT PRIMARY KEY, value BIGINT)", ())
    for key, value in (("user_version", SCHEMA_VERSION), ("application_id", APPLICATION_ID)):
        conn.execute("INSERT INTO rlm_meta (key, value) VALUES (?, ?) ON CONFLICT (key) "
                     "DO UPDATE SET value = excluded.value", (key, value))


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
            f"{path} is a database but not an rlm journal (schema version {version}, "
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
    _stamp(conn)
    return None if fresh or start == SCHEMA_VERSION else start
