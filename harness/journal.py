"""The journal: an append-only record of runs, stage transitions, model calls and cells.

One SQLite file (WAL mode, ``synchronous=NORMAL``) holds everything resume and replay need:

- ``runs``: one row per run with its owner (pid, host) and heartbeat, so a crashed run (status
  ``running`` but heartbeat older than ``stale_after`` seconds, or owner process gone from this
  host) can be told apart from a live one.
- ``stages``: the latest JSON of every stage, keyed ``(run_id, stage_id)``.
- ``events``: every stage transition, append-only, in recording order (``seq``).
- ``model_calls``: every model request and response keyed ``(run_id, call_id)`` with the
  request's hash, so a resumed run can serve a call from the journal only when the request matches.
- ``cells``: every executed cell's code and output, append-only.

Durability: every write is its own short transaction. With WAL and ``synchronous=NORMAL`` a
committed transaction survives a crash of the process (SIGKILL included); a power loss may lose the
last transactions but never corrupts the file. A process killed mid-transaction loses only that
transaction. A truncated ``-wal`` file loses the commits in its cut-off tail (not yet checkpointed
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

This module imports only the standard library: it knows nothing of models or kernels.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from harness.errors import HarnessError

__all__ = [
    "SCHEMA_VERSION",
    "APPLICATION_ID",
    "Journal",
    "JournalError",
    "JournalSchemaError",
    "JournalCorruptError",
    "RunExistsError",
    "UnknownRunError",
    "ModelCallConflictError",
    "Heartbeat",
    "default_journal_path",
    "request_hash",
]

log = logging.getLogger(__name__)

#: The schema version this code writes, stored in ``PRAGMA user_version``.
SCHEMA_VERSION = 1
#: ``PRAGMA application_id`` of an rlm journal ("RLMJ"), so a foreign SQLite file is recognised.
APPLICATION_ID = 0x524C4D4A

_DEFAULT_STALE_AFTER = 10.0
_DEFAULT_BUSY_TIMEOUT = 30.0

# SQLite primary result codes (extended code & 0xFF).
_SQLITE_PERM = 3
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_SQLITE_READONLY = 8
_SQLITE_IOERR = 10
_SQLITE_CORRUPT = 11
_SQLITE_FULL = 13
_SQLITE_CANTOPEN = 14
_SQLITE_NOTADB = 26


# --------------------------------------------------------------------------------------------
# Errors


class JournalError(HarnessError):
    """The journal could not be opened, read or written.

    The message names the journal file, says what happened (not a database, damaged, disk full,
    read-only, locked, ...) and what to do about it. The underlying ``sqlite3`` exception, if any,
    is chained as ``__cause__``. The CLI exits 2 for it: it is a problem of the journal path
    or its file system, not of the run.
    """

    exit_code = 2


class JournalSchemaError(JournalError):
    """The file's schema version is one this code cannot use.

    Raised for a journal written by a newer version of this code (upgrade the code, or use another
    journal path), for an unversioned (version 0) or foreign SQLite file that is not an rlm journal,
    and for an older version with no migration path. The file is left unchanged.

    Attributes:
        path: the journal file.
        found: the file's ``user_version``.
        supported: the version this code writes (``SCHEMA_VERSION``).
    """

    def __init__(self, message: str, *, path: Path, found: int, supported: int) -> None:
        super().__init__(message)
        self.path = path
        self.found = found
        self.supported = supported


class JournalCorruptError(JournalError):
    """The file is not a SQLite database, or is damaged beyond SQLite's own recovery."""


class RunExistsError(JournalError):
    """``create_run`` was given a run id the journal already holds."""


class UnknownRunError(JournalError):
    """The run id is not in the journal."""


class ModelCallConflictError(JournalError):
    """A model call id was recorded twice with different request hashes.

    The journal keeps the first record; callers detect divergence with ``lookup_model_call``
    before recording.
    """


# --------------------------------------------------------------------------------------------
# Module functions


def default_journal_path() -> Path:
    """Return the default journal file path (a ``Path``; nothing is created).

    ``$RLM_JOURNAL`` if set and non-empty, else ``$XDG_DATA_HOME/rlm/journal.sqlite3``, else
    ``~/.local/share/rlm/journal.sqlite3``.
    """
    env = os.environ.get("RLM_JOURNAL")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "rlm" / "journal.sqlite3"


def request_hash(request: dict) -> str:
    """Return the sha256 hex digest (64 lowercase hex chars) of ``request`` as canonical JSON.

    Canonical JSON: keys sorted, no whitespace (``separators=(",", ":")``), ``ensure_ascii=False``,
    encoded as UTF-8. Two requests hash equal iff their JSON forms are equal (so ``1`` and ``1.0``
    differ, as do tuples and lists never: both encode as arrays).

    Raises:
        TypeError: ``request`` holds a value JSON cannot encode.
    """
    text = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=_json_default)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    if isinstance(obj, bytes):
        return obj.decode("utf-8", errors="replace")
    raise TypeError(f"{type(obj).__name__} is not JSON-serializable: {obj!r:.200}")


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host and is not a zombie. Unsure means alive."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, under another user
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        state = data[data.rindex(b")") + 2:data.rindex(b")") + 3]
    except (OSError, ValueError):  # no /proc (macOS): trust os.kill
        return True
    return state not in (b"Z", b"X")  # killed but not yet reaped is dead


# --------------------------------------------------------------------------------------------
# Schema and migrations

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


#: ``_MIGRATIONS[v]`` upgrades a journal from version ``v`` to ``v + 1`` inside the open
#: transaction. Add one entry per schema change and bump ``SCHEMA_VERSION``.
_MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {0: _migrate_0_to_1}


# --------------------------------------------------------------------------------------------
# Heartbeat


class Heartbeat:
    """A daemon thread that refreshes a run's heartbeat every ``interval`` seconds.

    Calling the object (or ``stop()``) stops the thread and waits for it (at most ``timeout``
    seconds); calling it again does nothing. The thread stops by itself when the journal reports
    that this process no longer owns the run (another process claimed it, or it was finished):
    ``lost`` is then set. Transient journal errors are logged and retried at the next tick.
    """

    def __init__(self, journal: Journal, run_id: str, interval: float) -> None:
        self.run_id = run_id
        self.interval = interval
        self.lost = threading.Event()
        self._journal = journal
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"rlm-heartbeat-{run_id}",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                owned = self._journal.heartbeat(self.run_id)
            except JournalError as exc:
                if self._journal.closed:
                    return
                log.warning("heartbeat for run %s failed (will retry): %s", self.run_id, exc)
                continue
            if not owned:
                log.warning("run %s is no longer owned by this process (pid %d); heartbeat "
                            "stopped", self.run_id, os.getpid())
                self.lost.set()
                return

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the heartbeat thread and wait up to ``timeout`` seconds for it to end."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        try:
            self._journal._heartbeats.remove(self)
        except ValueError:
            pass

    __call__ = stop


# --------------------------------------------------------------------------------------------
# The journal


class Journal:
    """An append-only journal of runs in one SQLite file. Thread-safe; multi-process safe.

    Args:
        path: the journal file (``str`` or ``Path``); ``None`` means ``default_journal_path()``.
            Parent directories are created.
        stale_after: seconds after which a ``running`` run whose heartbeat has not been refreshed
            counts as crashed (``get_run``'s ``state``, ``claim_run``). Default 10.
        busy_timeout: seconds a write waits for another process's lock before failing. Default 30.

    Raises:
        JournalCorruptError: the file is not a SQLite database, or is damaged.
        JournalSchemaError: the file's schema version is newer than this code knows, or it is not
            an rlm journal; the file is not modified.
        JournalError: the file or its directory cannot be created, opened or written (read-only,
            disk full, locked for longer than ``busy_timeout``).

    All timestamps are unix seconds (``float``, ``time.time()``). All methods raise
    ``JournalError`` (or a subclass) on a storage failure, never a bare ``sqlite3`` error, and
    ``JournalError`` after ``close()``. Use as a context manager to close it.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *,
                 stale_after: float = _DEFAULT_STALE_AFTER,
                 busy_timeout: float = _DEFAULT_BUSY_TIMEOUT) -> None:
        if path is not None and str(path) == ":memory:":
            raise JournalError("an in-memory journal is not supported (resume needs a file); "
                               "pass a file path, e.g. in a temporary directory")
        self.path = Path(path).expanduser() if path is not None else default_journal_path()
        self.stale_after = float(stale_after)
        self.busy_timeout = float(busy_timeout)
        self._lock = threading.Lock()
        self._closed = False
        self._heartbeats: list[Heartbeat] = []
        self._orphans: list[sqlite3.Connection] = []  # connections inherited across fork()
        self._host = socket.gethostname()
        self._pid = os.getpid()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise JournalError(
                f"cannot create the directory {self.path.parent} for journal {self.path}: "
                f"{exc.strerror or exc}; choose another path (set RLM_JOURNAL or pass a path)"
            ) from exc
        if self.path.is_dir():
            raise JournalError(f"journal path {self.path} is a directory; pass a file path such "
                               f"as {self.path / 'journal.sqlite3'}")
        self._conn = self._open()

    # ---- connection management ------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(str(self.path), timeout=self.busy_timeout,
                                   isolation_level=None, check_same_thread=False,
                                   cached_statements=64)
        except sqlite3.Error as exc:
            raise self._translate(exc, "open the journal") from exc
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
            # Inspect before changing anything: a refused file is left exactly as it was. One
            # read transaction, so a concurrent opener's schema creation is seen whole or not.
            conn.execute("BEGIN")
            try:
                version, app_id, tables = self._inspect(conn)
            except BaseException:
                self._rollback(conn)
                raise
            conn.execute("COMMIT")
            fresh = version == 0 and app_id == 0 and not tables
            if not fresh:
                self._refuse_unless_migratable(version, app_id, tables)
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                log.warning("journal %s could not switch to WAL mode (got %r); concurrent "
                            "readers will block writers", self.path, mode)
            conn.execute("PRAGMA synchronous = NORMAL")
            # Checkpoint (and fsync) every 4000 WAL pages (16 MiB) instead of SQLite's 1000:
            # measured 20-30% less amortised cost per stage; a big WAL is trimmed to 64 MiB.
            conn.execute("PRAGMA wal_autocheckpoint = 4000")
            conn.execute("PRAGMA journal_size_limit = 67108864")
            if version != SCHEMA_VERSION or app_id != APPLICATION_ID:
                self._migrate(conn)
        except BaseException as exc:
            conn.close()
            if isinstance(exc, sqlite3.Error):
                raise self._translate(exc, "open the journal") from exc
            raise
        return conn

    @staticmethod
    def _inspect(conn: sqlite3.Connection) -> tuple[int, int, list[str]]:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        tables = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' "
            "AND name NOT LIKE 'sqlite_%' ORDER BY name")]
        return version, app_id, tables

    def _migrate(self, conn: sqlite3.Connection) -> None:
        """Create or migrate the schema in one write transaction (concurrent openers are safe:
        the second one sees the first one's result)."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            version, app_id, tables = self._inspect(conn)
            fresh = version == 0 and app_id == 0 and not tables
            if not fresh:
                self._refuse_unless_migratable(version, app_id, tables)
            start = version
            while version < SCHEMA_VERSION:
                _MIGRATIONS[version](conn)
                version += 1
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            conn.execute("COMMIT")
        except BaseException:
            self._rollback(conn)
            raise
        if not fresh and start != SCHEMA_VERSION:
            log.info("migrated journal %s from schema version %d to %d", self.path, start,
                     SCHEMA_VERSION)

    def _refuse_unless_migratable(self, version: int, app_id: int, tables: list[str]) -> None:
        path = self.path
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

    def _locked(self) -> threading.Lock:
        """The lock guarding the connection (a fresh one after ``fork()``)."""
        if self._pid != os.getpid():
            self._after_fork()
        return self._lock

    def _connection(self) -> sqlite3.Connection:
        if self._closed:
            raise JournalError(f"journal {self.path} is closed")
        return self._conn

    def _after_fork(self) -> None:
        # A SQLite connection must not be used across fork(): keep the inherited one alive but
        # unused (closing it could disturb the parent's locks) and open a fresh one.
        self._lock = threading.Lock()
        self._heartbeats = []
        if not self._closed:
            conn = self._open()
            self._orphans.append(self._conn)
            self._conn = conn
        self._pid = os.getpid()

    @property
    def closed(self) -> bool:
        """``True`` after ``close()``."""
        return self._closed

    def close(self) -> None:
        """Stop this journal's heartbeat threads and close the connection. Idempotent."""
        if self._closed:
            return
        for hb in list(self._heartbeats):
            hb.stop()
        if self._pid != os.getpid():  # inherited across fork() and never used here
            self._closed = True
            return
        with self._lock:
            self._closed = True
            try:
                self._conn.close()
            except sqlite3.Error:  # pragma: no cover - close failures are not actionable
                pass

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Journal({str(self.path)!r}{', closed' if self._closed else ''})"

    # ---- error translation ----------------------------------------------------------------

    def _translate(self, exc: sqlite3.Error, action: str) -> JournalError:
        if len(action) > 200:
            action = action[:197] + "..."
        code = getattr(exc, "sqlite_errorcode", None)
        primary = code & 0xFF if isinstance(code, int) else None
        text = str(exc)
        path = self.path
        if primary == _SQLITE_NOTADB or "not a database" in text:
            return JournalCorruptError(
                f"{path} is not a SQLite database (or its header is destroyed), so it cannot be "
                f"used as the journal: {text}. If it is the wrong file, point RLM_JOURNAL or the "
                f"journal path elsewhere; if it was a journal, move it aside to start a new one.")
        if primary == _SQLITE_CORRUPT or "malformed" in text:
            return JournalCorruptError(
                f"journal {path} is damaged beyond SQLite's recovery ({text}) while trying to "
                f"{action}. Move it aside to start a new journal; to salvage its records try "
                f"`sqlite3 {path} .recover | sqlite3 recovered.sqlite3`.")
        if primary == _SQLITE_FULL or "database or disk is full" in text:
            return JournalError(
                f"cannot {action}: the disk holding journal {path} is full ({text}). Free space "
                f"there, or set RLM_JOURNAL to a file on another disk.")
        if primary == _SQLITE_READONLY or "readonly" in text:
            return JournalError(
                f"cannot {action}: journal {path} is read-only ({text}). SQLite needs write "
                f"access to the file and to its directory (for {path.name}-wal and "
                f"{path.name}-shm); fix the permissions or set RLM_JOURNAL to a writable path.")
        if primary == _SQLITE_CANTOPEN or primary == _SQLITE_PERM:
            return JournalError(
                f"cannot {action}: cannot open journal {path} ({text}). Check that its directory "
                f"exists and is writable, or set RLM_JOURNAL to another path.")
        if primary in (_SQLITE_BUSY, _SQLITE_LOCKED):
            return JournalError(
                f"cannot {action}: journal {path} stayed locked by another connection for more "
                f"than {self.busy_timeout:g} s ({text}). Another process may be stuck holding it; "
                f"retry, or stop that process.")
        if primary == _SQLITE_IOERR:
            return JournalError(
                f"cannot {action}: I/O error on journal {path} ({text}). Check the disk and the "
                f"file system it lives on.")
        name = getattr(exc, "sqlite_errorname", type(exc).__name__)
        return JournalError(f"cannot {action} in journal {path}: {text} ({name})")

    # ---- write helpers ----------------------------------------------------------------------

    def _write1(self, action: str, sql: str, params: tuple) -> int:
        """One statement in its own (autocommit) transaction; returns the rowcount."""
        with self._locked():
            conn = self._connection()
            try:
                return conn.execute(sql, params).rowcount
            except sqlite3.Error as exc:
                raise self._translate(exc, action) from exc

    def _read(self, action: str, sql: str, params: tuple) -> list[tuple]:
        with self._locked():
            conn = self._connection()
            try:
                return conn.execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                raise self._translate(exc, action) from exc

    # ---- runs ---------------------------------------------------------------------------------

    def create_run(self, run_id: str, *, query: str, model: str, sub_model: str | None = None,
                   max_depth: int = 1, options: dict | None = None) -> None:
        """Record a new run owned by this process, status ``running``, heartbeat now.

        Args:
            run_id: the run's id (``str``), unique in the journal.
            query: the user's question (``str``).
            model: the root model name; ``sub_model``: the sub-call model name or ``None``.
            max_depth: the run's maximum depth (``int``).
            options: any JSON-able settings to keep with the run (budget caps, flags).

        Raises:
            RunExistsError: the journal already holds ``run_id`` (check ``get_run`` first).
            JournalError: ``options`` is not JSON-able, or the write failed.
        """
        now = time.time()
        try:
            options_json = _dumps(options or {})
        except (TypeError, ValueError) as exc:
            raise JournalError(f"run {run_id!r}: options are not JSON-serializable: {exc}") from exc
        with self._locked():
            conn = self._connection()
            try:
                conn.execute(
                    "INSERT INTO runs (run_id, created_at, updated_at, status, query, model, "
                    "sub_model, max_depth, options, owner_pid, owner_host, heartbeat_at) "
                    "VALUES (?, ?, ?, 'running', ?, ?, ?, ?, ?, ?, ?, ?)",
                    (run_id, now, now, query, model, sub_model, int(max_depth), options_json,
                     os.getpid(), self._host, now))
            except sqlite3.IntegrityError as exc:
                raise RunExistsError(
                    f"run {run_id!r} already exists in journal {self.path}; resume it "
                    f"(claim_run) or choose another run id") from exc
            except sqlite3.Error as exc:
                raise self._translate(exc, f"create run {run_id!r}") from exc

    def claim_run(self, run_id: str) -> bool:
        """Take ownership of an existing run to resume it; atomic across threads and processes.

        Succeeds only if the run is not ``running``, or its heartbeat is older than
        ``stale_after`` seconds, or its owner ran on this host and that process no longer exists
        (so a run killed a moment ago can be resumed at once): then the run's owner becomes this
        process (pid, host), its status ``running``, its heartbeat now and ``finished_at`` is
        cleared. A run whose owner is alive (fresh heartbeat, process present) is never taken. Of several concurrent claimers exactly one wins. A
        finished run (``completed``, ``failed``, ...) can be claimed too: deciding whether to
        resume it or return its recorded answer is the caller's job (check ``get_run`` first).

        Returns:
            ``True`` if this process now owns the run, ``False`` if it is running and fresh.

        Raises:
            UnknownRunError: the journal has no run ``run_id``.
            JournalError: the write failed.
        """
        now = time.time()
        changed = self._write1(
            f"claim run {run_id!r}",
            "UPDATE runs SET status = 'running', owner_pid = ?, owner_host = ?, heartbeat_at = ?, "
            "updated_at = ?, finished_at = NULL WHERE run_id = ? AND (status != 'running' OR "
            "heartbeat_at IS NULL OR heartbeat_at < ?)",
            (os.getpid(), self._host, now, now, run_id, now - self.stale_after))
        if changed:
            return True
        rows = self._read(f"claim run {run_id!r}", "SELECT status, owner_pid, owner_host, "
                          "heartbeat_at FROM runs WHERE run_id = ?", (run_id,))
        if not rows:
            raise UnknownRunError(f"no run {run_id!r} in journal {self.path}")
        status, pid, host, beat = rows[0]
        if status != "running" or not self._owner_dead(pid, host):
            return False
        # The owner died on this host before its heartbeat went stale: compare-and-set on the
        # row as read, so of several claimers only the first one changes it.
        return bool(self._write1(
            f"claim run {run_id!r}",
            "UPDATE runs SET owner_pid = ?, owner_host = ?, heartbeat_at = ?, updated_at = ?, "
            "finished_at = NULL WHERE run_id = ? AND status = 'running' AND owner_pid = ? AND "
            "owner_host = ? AND heartbeat_at IS ?",
            (os.getpid(), self._host, now, now, run_id, pid, host, beat)))

    def heartbeat(self, run_id: str) -> bool:
        """Refresh the heartbeat of a ``running`` run this process owns.

        Returns:
            ``True`` if refreshed; ``False`` if this process no longer owns the run (another
            process claimed it) or the run is no longer ``running`` (or does not exist).

        Raises:
            JournalError: the write failed.
        """
        return bool(self._write1(
            f"refresh the heartbeat of run {run_id!r}",
            "UPDATE runs SET heartbeat_at = ? WHERE run_id = ? AND status = 'running' "
            "AND owner_pid = ? AND owner_host = ?",
            (time.time(), run_id, os.getpid(), self._host)))

    def start_heartbeat(self, run_id: str, interval: float = 2.0) -> Heartbeat:
        """Refresh ``run_id``'s heartbeat now and then every ``interval`` seconds in a daemon thread.

        Returns:
            a ``Heartbeat``: call it (no arguments) to stop the thread. ``close()`` stops it too.

        Raises:
            ValueError: ``interval`` is not positive, or ``interval >= stale_after`` (the run
                would look crashed between beats).
            JournalError: the first heartbeat failed, or this process does not own ``run_id``
                as a ``running`` run (create or claim it first).
        """
        if not 0 < interval < self.stale_after:
            raise ValueError(f"heartbeat interval must be > 0 and < stale_after "
                             f"({self.stale_after:g} s), got {interval!r}")
        if not self.heartbeat(run_id):
            raise JournalError(f"cannot keep run {run_id!r} alive: it is not a running run owned "
                               f"by this process (pid {os.getpid()}) in journal {self.path}; "
                               f"create_run or claim_run it first")
        hb = Heartbeat(self, run_id, interval)
        self._heartbeats.append(hb)
        return hb

    def finish_run(self, run_id: str, *, status: str, answer: str | None = None,
                   usage: dict | None = None, error: Any = None) -> None:
        """Record a run's end: its final ``status`` (e.g. ``"completed"``, ``"failed"``,
        ``"budget_exceeded"``, ``"interrupted"``, ``"cancelled"``), answer, usage and error.

        Args:
            status: any status but ``"running"``.
            answer: the answer text, or ``None``.
            usage: JSON-able usage totals (tokens, cost in USD, calls, seconds), or ``None``.
            error: a JSON-able error description (a message ``str`` or a dict), or ``None``.

        Raises:
            ValueError: ``status`` is empty or ``"running"``.
            UnknownRunError: the journal has no run ``run_id``.
            JournalError: ``usage``/``error`` are not JSON-able, or the write failed.
        """
        if not status or status == "running":
            raise ValueError(f"finish_run needs a final status, got {status!r}")
        try:
            usage_json = None if usage is None else _dumps(usage)
            error_json = None if error is None else _dumps(error)
        except (TypeError, ValueError) as exc:
            raise JournalError(f"run {run_id!r}: usage or error is not JSON-serializable: "
                               f"{exc}") from exc
        now = time.time()
        changed = self._write1(
            f"finish run {run_id!r}",
            "UPDATE runs SET status = ?, answer = ?, usage = ?, error = ?, finished_at = ?, "
            "updated_at = ? WHERE run_id = ?",
            (status, answer, usage_json, error_json, now, now, run_id))
        if not changed:
            raise UnknownRunError(f"no run {run_id!r} in journal {self.path}")

    # ---- stages and events ------------------------------------------------------------------

    def record_event(self, event: dict) -> None:
        """Record one stage transition: upsert the stage's latest row and append the event, in
        ONE transaction. Usable directly as a StageTree listener.

        Args:
            event: ``{"run_id": str, "stage": dict, "from": str | None, "to": str, "ts": float}``;
                ``stage`` is the JSON-able stage dict after the transition, with at least ``id``
                (and usually ``parent_id``, ``kind``, ``level``, ``status``). ``from`` is
                ``None`` for the creation event. ``ts`` is unix seconds.

        The stage row is only overwritten by an event whose ``ts`` is not older than the one that
        wrote it, so listener calls that arrive out of order cannot roll a stage back.

        Raises:
            JournalError: the event lacks a key, its stage is not JSON-able, or the write failed.
        """
        try:
            run_id = event["run_id"]
            stage = event["stage"]
            stage_id = stage["id"]
            to_status = event["to"]
            ts = float(event["ts"])
            from_status = event.get("from")
        except (KeyError, TypeError, ValueError) as exc:
            raise JournalError(f"malformed stage event (needs run_id, stage.id, to, ts): "
                               f"{exc!r}; event: {event!r:.300}") from exc
        try:
            stage_json = _dumps(stage)
        except (TypeError, ValueError) as exc:
            raise JournalError(f"stage {stage_id!r} of run {run_id!r} is not JSON-serializable: "
                               f"{exc}") from exc
        with self._locked():
            conn = self._connection()
            try:
                conn.execute("BEGIN IMMEDIATE")
                seq = conn.execute(
                    "INSERT INTO events (run_id, stage_id, from_status, to_status, ts, stage) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (run_id, stage_id, from_status, to_status, ts, stage_json)).lastrowid
                conn.execute(
                    "INSERT INTO stages (run_id, stage_id, parent_id, kind, status, level, "
                    "first_seq, updated_ts, stage) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (run_id, stage_id) DO UPDATE SET parent_id = excluded.parent_id, "
                    "kind = excluded.kind, status = excluded.status, level = excluded.level, "
                    "updated_ts = excluded.updated_ts, stage = excluded.stage "
                    "WHERE excluded.updated_ts >= stages.updated_ts",
                    (run_id, stage_id, stage.get("parent_id"), stage.get("kind"), to_status,
                     stage.get("level"), seq, ts, stage_json))
                conn.execute("COMMIT")
            except BaseException as exc:
                self._rollback(conn)
                if isinstance(exc, sqlite3.Error):
                    raise self._translate(
                        exc, f"record event {stage_id!r} -> {to_status!r} of run {run_id!r}"
                    ) from exc
                raise

    @staticmethod
    def _rollback(conn: sqlite3.Connection) -> None:
        try:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
        except sqlite3.Error:  # the transaction may already be rolled back (e.g. SQLITE_FULL)
            pass

    def stages(self, run_id: str) -> list[dict]:
        """Return the latest dict of every stage of ``run_id``, in the order first recorded
        (``[]`` for an unknown run)."""
        rows = self._read(f"read the stages of run {run_id!r}",
                          "SELECT stage FROM stages WHERE run_id = ? ORDER BY first_seq", (run_id,))
        return [json.loads(r[0]) for r in rows]

    def events(self, run_id: str) -> list[dict]:
        """Return every recorded transition of ``run_id`` in recording order (``[]`` if none).

        Each is ``{"seq": int, "run_id", "stage_id", "from", "to", "ts": float, "stage": dict}``;
        ``seq`` increases strictly across the whole journal.
        """
        rows = self._read(f"read the events of run {run_id!r}",
                          "SELECT seq, stage_id, from_status, to_status, ts, stage FROM events "
                          "WHERE run_id = ? ORDER BY seq", (run_id,))
        return [{"seq": seq, "run_id": run_id, "stage_id": sid, "from": frm, "to": to, "ts": ts,
                 "stage": json.loads(stage)} for seq, sid, frm, to, ts, stage in rows]

    # ---- model calls --------------------------------------------------------------------------

    def record_model_call(self, run_id: str, call_id: str, *, request_hash: str, request: dict,
                          response: Any, usage: Any, attempts: Any,
                          replace: bool = False) -> bool:
        """Record one model call (request, response, usage, every attempt).

        Args:
            run_id, call_id: the call's key; ``call_id`` is its deterministic stage id.
            request_hash: ``request_hash(request)`` (sha256 hex).
            request, response, usage, attempts: JSON-able values, stored as JSON.
            replace: overwrite an existing record of ``(run_id, call_id)``. For a resumed run
                that went live after a divergence (its calls from that point on supersede the
                recorded ones, so a later replay follows what the run really did). Default
                ``False``: a recorded call is never silently changed.

        Returns:
            ``True`` if recorded; ``False`` if the same ``(run_id, call_id)`` was already recorded
            with the same ``request_hash`` and ``replace`` is false (the first record is kept:
            recording is idempotent).

        Raises:
            ModelCallConflictError: the call id is recorded with a different request hash and
                ``replace`` is false.
            JournalError: a value is not JSON-able, or the write failed.
        """
        try:
            values = (_dumps(request), _dumps(response), _dumps(usage), _dumps(attempts))
        except (TypeError, ValueError) as exc:
            raise JournalError(f"model call {call_id!r} of run {run_id!r} is not "
                               f"JSON-serializable: {exc}") from exc
        on_conflict = ("DO UPDATE SET request_hash = excluded.request_hash, "
                       "request = excluded.request, response = excluded.response, "
                       "usage = excluded.usage, attempts = excluded.attempts, "
                       "created_at = excluded.created_at" if replace else "DO NOTHING")
        changed = self._write1(
            f"record model call {call_id!r} of run {run_id!r}",
            "INSERT INTO model_calls (run_id, call_id, request_hash, request, response, usage, "
            "attempts, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
            f"ON CONFLICT (run_id, call_id) {on_conflict}",
            (run_id, call_id, request_hash, *values, time.time()))
        if changed:
            return True
        existing = self._read("look up a model call",
                              "SELECT request_hash FROM model_calls WHERE run_id = ? AND "
                              "call_id = ?", (run_id, call_id))
        if existing and existing[0][0] != request_hash:
            raise ModelCallConflictError(
                f"model call {call_id!r} of run {run_id!r} is already recorded with request hash "
                f"{existing[0][0][:12]}..., not {request_hash[:12]}...: the run diverged from its "
                f"journal; the journal keeps the first record (pass replace=True to supersede it)")
        return False

    _CALL_COLUMNS = "call_id, request_hash, request, response, usage, attempts, created_at"

    @staticmethod
    def _call_row(row: tuple) -> dict:
        call_id, rhash, request, response, usage, attempts, created_at = row
        return {"call_id": call_id, "request_hash": rhash, "request": json.loads(request),
                "response": _loads(response), "usage": _loads(usage),
                "attempts": _loads(attempts), "created_at": created_at}

    def lookup_model_call(self, run_id: str, call_id: str) -> dict | None:
        """Return the recorded call ``(run_id, call_id)`` or ``None``.

        The dict has ``request_hash`` (str), ``request``, ``response``, ``usage``, ``attempts``
        (as recorded), plus ``call_id`` and ``created_at`` (unix seconds).
        """
        rows = self._read(f"look up model call {call_id!r} of run {run_id!r}",
                          f"SELECT {self._CALL_COLUMNS} FROM model_calls "
                          f"WHERE run_id = ? AND call_id = ?", (run_id, call_id))
        return self._call_row(rows[0]) if rows else None

    def model_calls(self, run_id: str) -> list[dict]:
        """Return every recorded model call of ``run_id`` in recording order (dicts as
        ``lookup_model_call``)."""
        rows = self._read(f"read the model calls of run {run_id!r}",
                          f"SELECT {self._CALL_COLUMNS} FROM model_calls WHERE run_id = ? "
                          f"ORDER BY rowid", (run_id,))
        return [self._call_row(r) for r in rows]

    # ---- cells ----------------------------------------------------------------------------------

    def record_cell(self, run_id: str, stage_id: str, code: str, output: Any) -> None:
        """Append one executed cell: its ``code`` (str) and JSON-able ``output`` (stdout, result,
        error, ...). A re-executed cell (resume, replay) appends another row.

        Raises:
            JournalError: ``output`` is not JSON-able, or the write failed.
        """
        try:
            output_json = _dumps(output)
        except (TypeError, ValueError) as exc:
            raise JournalError(f"output of cell {stage_id!r} of run {run_id!r} is not "
                               f"JSON-serializable: {exc}") from exc
        self._write1(f"record cell {stage_id!r} of run {run_id!r}",
                     "INSERT INTO cells (run_id, stage_id, code, output, created_at) "
                     "VALUES (?, ?, ?, ?, ?)", (run_id, stage_id, code, output_json, time.time()))

    def cells(self, run_id: str) -> list[dict]:
        """Return every recorded cell of ``run_id`` in recording order: dicts with ``seq``,
        ``stage_id``, ``code``, ``output``, ``created_at`` (unix seconds)."""
        rows = self._read(f"read the cells of run {run_id!r}",
                          "SELECT seq, stage_id, code, output, created_at FROM cells "
                          "WHERE run_id = ? ORDER BY seq", (run_id,))
        return [{"seq": seq, "stage_id": sid, "code": code, "output": _loads(out),
                 "created_at": created} for seq, sid, code, out, created in rows]

    # ---- reading runs -----------------------------------------------------------------------

    _RUN_COLUMNS = ("run_id", "created_at", "updated_at", "status", "query", "model",
                    "sub_model", "max_depth", "options", "answer", "usage", "error", "owner_pid",
                    "owner_host", "heartbeat_at", "finished_at")
    _RUN_SELECT = "SELECT " + ", ".join(_RUN_COLUMNS) + " FROM runs"

    def _run_row(self, row: tuple, now: float, stale_after: float) -> dict:
        run = dict(zip(self._RUN_COLUMNS, row))
        for key in ("options", "usage", "error"):
            run[key] = _loads(run[key])
        state = run["status"]
        if state == "running" and (run["heartbeat_at"] is None
                                   or now - run["heartbeat_at"] > stale_after
                                   or self._owner_dead(run["owner_pid"], run["owner_host"])):
            state = "crashed"
        run["state"] = state
        return run

    def _owner_dead(self, pid: int | None, host: str | None) -> bool:
        """True only if the owner ran on this host and its process is gone (pid reuse, another
        pid namespace or any doubt count as alive: then only heartbeat staleness decides)."""
        return (host == self._host and pid is not None and pid != os.getpid()
                and not _pid_alive(pid))

    def get_run(self, run_id: str, *, stale_after: float | None = None) -> dict | None:
        """Return the run record or ``None`` if unknown.

        Keys: the ``runs`` columns (``options``, ``usage``, ``error`` decoded from JSON; times in
        unix seconds) plus ``state``: the stored ``status``, except ``"crashed"`` for a
        ``running`` run whose heartbeat is older than ``stale_after`` seconds (default: the
        journal's ``stale_after``) or whose owner process ran on this host (same
        ``socket.gethostname()``) and no longer exists or is a zombie. A process in another pid
        namespace with the same host name would be misjudged: give containers that share a
        journal distinct host names.
        """
        rows = self._read(f"read run {run_id!r}", self._RUN_SELECT + " WHERE run_id = ?",
                          (run_id,))
        if not rows:
            return None
        return self._run_row(rows[0], time.time(),
                             self.stale_after if stale_after is None else stale_after)

    def list_runs(self, limit: int = 50, *, stale_after: float | None = None) -> list[dict]:
        """Return up to ``limit`` run records, newest (by ``created_at``) first, as ``get_run``."""
        rows = self._read("list runs", self._RUN_SELECT + " ORDER BY created_at DESC, rowid DESC "
                          "LIMIT ?", (int(limit),))
        now = time.time()
        stale = self.stale_after if stale_after is None else stale_after
        return [self._run_row(r, now, stale) for r in rows]

    # ---- export and checks --------------------------------------------------------------------

    def export_jsonl(self, run_id: str, fp: IO[str]) -> int:
        """Write everything about ``run_id`` to the text stream ``fp``, one JSON object per line.

        Lines in order: the run (``"type": "run"``), its stages (``"stage"``), events
        (``"event"``), model calls (``"model_call"``) and cells (``"cell"``), each a dict as
        returned by the corresponding reader plus ``"type"`` and ``"run_id"``. The records are read
        in one transaction, so the export is a consistent snapshot.

        Returns:
            the number of lines written.

        Raises:
            UnknownRunError: the journal has no run ``run_id``.
            JournalError: the read failed.
        """
        with self._locked():
            conn = self._connection()
            try:
                conn.execute("BEGIN")
                try:
                    run_row = conn.execute(self._RUN_SELECT + " WHERE run_id = ?",
                                           (run_id,)).fetchall()
                    stage_rows = conn.execute("SELECT stage FROM stages WHERE run_id = ? "
                                              "ORDER BY first_seq", (run_id,)).fetchall()
                    event_rows = conn.execute(
                        "SELECT seq, stage_id, from_status, to_status, ts, stage FROM events "
                        "WHERE run_id = ? ORDER BY seq", (run_id,)).fetchall()
                    call_rows = conn.execute(
                        f"SELECT {self._CALL_COLUMNS} FROM model_calls WHERE run_id = ? "
                        f"ORDER BY rowid", (run_id,)).fetchall()
                    cell_rows = conn.execute(
                        "SELECT seq, stage_id, code, output, created_at FROM cells "
                        "WHERE run_id = ? ORDER BY seq", (run_id,)).fetchall()
                finally:
                    conn.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback(conn)
                raise self._translate(exc, f"export run {run_id!r}") from exc
        if not run_row:
            raise UnknownRunError(f"no run {run_id!r} in journal {self.path}")

        def records() -> Iterator[dict]:
            yield {"type": "run", **self._run_row(run_row[0], time.time(), self.stale_after)}
            for (stage,) in stage_rows:
                yield {"type": "stage", "run_id": run_id, "stage": json.loads(stage)}
            for seq, sid, frm, to, ts, stage in event_rows:
                yield {"type": "event", "seq": seq, "run_id": run_id, "stage_id": sid,
                       "from": frm, "to": to, "ts": ts, "stage": json.loads(stage)}
            for row in call_rows:
                yield {"type": "model_call", "run_id": run_id, **self._call_row(row)}
            for seq, sid, code, out, created in cell_rows:
                yield {"type": "cell", "seq": seq, "run_id": run_id, "stage_id": sid,
                       "code": code, "output": _loads(out), "created_at": created}

        n = 0
        for record in records():
            fp.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += 1
        return n

    def integrity_check(self, *, quick: bool = False) -> list[str]:
        """Run SQLite's ``integrity_check`` (or the faster ``quick_check``) over the whole file.

        Returns:
            the problems found; ``[]`` if the file is sound.

        Raises:
            JournalCorruptError: the file is too damaged to even run the check.
        """
        pragma = "quick_check" if quick else "integrity_check"
        rows = self._read("check the journal's integrity", f"PRAGMA {pragma}", ())
        problems = [r[0] for r in rows]
        return [] if problems == ["ok"] else problems
