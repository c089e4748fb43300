"""Where the journal's records are kept: the ``Store`` operations and their SQLite implementation.

The record classes (``runs``, ``records``, ``export``) are written against the few operations
named by ``Store``: run one statement (``_write1``), read rows (``_read``), run several statements
as one transaction (``_transaction``), close, check integrity. ``SQLiteStore`` implements them over
one SQLite file; ``harness.journal.pg_store.PostgresStore`` over a PostgreSQL database. Both run the
same record statements and the same DDL (``harness.journal.schema.render``); what differs per
dialect is isolated in the store: placeholders (``?`` is translated), the version stamp, the
append-only triggers and error translation.

SQLite, as configured here:

- WAL mode, ``synchronous=OFF`` (durability ``process``, the default): a committed transaction
  survives a crash of the process (SIGKILL included); an OS crash or power loss may lose the last
  transactions or damage the file. ``synchronous=FULL`` (durability ``power``): a commit waits
  for the disk and survives those too (see :func:`durability_level`). A truncated ``-wal`` file loses the commits in its cut-off tail; every commit before the cut stays
  intact and the file opens. Every transaction is short: one record, or one batch of queued
  records (``harness.journal.behind``).
- A WAL checkpoint every 4000 pages (16 MiB), the WAL trimmed to 64 MiB.
- One connection behind one ``threading.Lock`` per store, shared by all threads; a store inherited
  across ``fork()`` opens a fresh connection and lock in the child. Several processes may write
  the same file (SQLite file locks, ``BEGIN IMMEDIATE``, a busy timeout).
- A file is inspected before anything is changed: a foreign, newer or unmigratable file is
  refused untouched (``JournalSchemaError``).
- Faults under a running run (``harness.journal.faults``, ``file_guard``): a full disk, a
  lock held past the busy timeout, an I/O error are retried for up to ``retry_seconds``.
  Before each write the file's identity is checked (one ``stat``): a file removed or moved
  away under the run is restored at its path from the open connection (SQLite's backup API:
  every committed record is in the copy) and the run goes on; a file replaced by another one
  is not written: this process's copy is saved beside it and the write fails
  (``JournalUnavailableError``).

This module imports only the standard library and ``harness.journal``'s own modules.
"""
from __future__ import annotations

import logging
import os
import socket
import sqlite3
from functools import lru_cache
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, TypeVar

from harness.journal import schema
from harness.journal.errors import JournalCorruptError, JournalError
from harness.journal import file_guard
from harness.journal.faults import retry_limit, retrying, while_busy

__all__ = ["Store", "SQLiteStore", "default_journal_path", "host_name", "boot_id",
           "DURABILITY", "durability_level"]

# One logger for the whole journal package, named as before the package was split.
log = logging.getLogger("harness.journal")

_DEFAULT_STALE_AFTER = 10.0
_DEFAULT_BUSY_TIMEOUT = 30.0

# SQLite primary result codes (extended code & 0xFF), and the extended ones told apart.
_SQLITE_PERM = 3
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_SQLITE_READONLY = 8
_SQLITE_IOERR = 10
_SQLITE_CORRUPT = 11
_SQLITE_FULL = 13
_SQLITE_CANTOPEN = 14
_SQLITE_NOTADB = 26
_SQLITE_READONLY_DBMOVED = 1032
#: Failures a retry may get past (``JournalError.transient``): another writer's lock, a full
#: disk, an I/O error, a file that cannot be opened (removed with its directory).
_TRANSIENT = frozenset({_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_FULL, _SQLITE_IOERR,
                        _SQLITE_CANTOPEN})

_S = TypeVar("_S", bound="SQLiteStore")
_T = TypeVar("_T")


#: What a committed record survives, weakest first: ``process`` (a crash of the process that
#: wrote it, SIGKILL included: the default) and ``power`` (also an OS crash or a power loss).
DURABILITY = ("process", "power")


def durability_level(value: str | None = None) -> str:
    """The journal's durability level: ``value``, else ``$RLM_JOURNAL_DURABILITY``, else
    ``"process"`` (one of :data:`DURABILITY`).

    ``process``: SQLite ``synchronous=OFF`` in WAL mode, PostgreSQL ``synchronous_commit=off``:
    a commit is written to the OS (SQLite) or the server before the call returns, so it
    survives the writing process's crash; an OS crash or power loss may lose the last commits
    (and, for SQLite, may damage the file: ``rlm verify`` says so). ``power``: SQLite
    ``synchronous=FULL``, PostgreSQL ``synchronous_commit=on``: every commit waits for the disk
    (an fsync each; measured about 1-5 ms a commit on this kind of disk, against 22 us).

    Raises:
        JournalError: any other value (naming the allowed ones).
    """
    level = value if value is not None else os.environ.get("RLM_JOURNAL_DURABILITY") or "process"
    if level not in DURABILITY:
        raise JournalError(f"journal durability {level!r}: use one of {', '.join(DURABILITY)} "
                           "(--journal-durability or RLM_JOURNAL_DURABILITY)")
    return level


def host_name() -> str:
    """This host's name as a run owner: ``$RLM_HOST`` if set (containers sharing a host name,
    tests posing as several hosts), else ``socket.gethostname()``."""
    return os.environ.get("RLM_HOST") or socket.gethostname()


@lru_cache(maxsize=1)
def _kernel_boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # no /proc (macOS): unknown, so a reboot is never inferred
        return ""


def boot_id() -> str:
    """This host's boot id (``$RLM_BOOT_ID``, else the kernel's, else ``""``): an owner recorded
    with this host name but another boot id is gone (the host rebooted since)."""
    return os.environ.get("RLM_BOOT_ID") or _kernel_boot_id()


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


class Store(ABC):
    """The operations the journal's record classes need from a store.

    Attributes every store sets:
        path: the journal's location (a ``Path``), named in every error message.
        stale_after: seconds after which a ``running`` run whose heartbeat was not refreshed
            counts as crashed.
        busy_timeout: seconds a write waits for another writer's lock before failing.
        retry_seconds: seconds an operation is retried through a transient fault
            (``harness.journal.faults``; 0: one attempt).
        _gave_up: the last operation spent the retry limit; the next ones try once.
        _host: this host's name (``host_name()``), recorded as a run's owner host.
        _boot: this host's boot id (``boot_id()``), recorded with it.
        _heartbeats: the running ``Heartbeat`` threads, stopped by ``close()``.
        dialect: ``"sqlite"`` or ``"postgresql"``.

    ``action`` arguments are short phrases (``"create run 'r1'"``) that an error message reads
    as "cannot <action>". Every operation raises ``JournalError`` (or a subclass) on failure and
    after ``close()``, never a driver's own exception.
    """

    path: Path
    stale_after: float
    busy_timeout: float
    retry_seconds: float = 30.0
    _gave_up: bool = False
    _host: str
    _boot: str = ""
    _heartbeats: list[Any]
    dialect: str = "sqlite"

    def _on_reconnect(self) -> None:
        """Called when the store opened a new connection under a run (a reconnect, a restored
        file): state cached from the old one (the chain heads of ``behind``) is dropped.
        Nothing by default."""

    def _before_read(self) -> None:
        """Called before every read: a store that queues writes commits them here (the
        journal's write-behind queue, ``harness.journal.behind``), so a process reads what it
        wrote. Nothing by default."""

    @abstractmethod
    def _write1(self, action: str, sql: str, params: tuple,
                on_duplicate: Callable[[], JournalError] | None = None) -> int:
        """Run one writing statement in its own transaction; return the number of rows changed.

        ``on_duplicate``: if given, a unique-key violation raises the ``JournalError`` it returns
        (e.g. ``RunExistsError``) instead of the generic translation.
        """

    @abstractmethod
    def _read(self, action: str, sql: str, params: tuple) -> list[tuple]:
        """Run one reading statement; return its rows as tuples (``[]`` if none)."""

    @abstractmethod
    def _transaction(self, action: str, work: Callable[[Any], _T], *,
                     immediate: bool = True) -> _T:
        """Run ``work(conn)`` as one transaction and return its result.

        ``conn`` has ``execute(sql, params)`` returning a cursor (``.fetchall()``,
        ``.lastrowid``). Committed when ``work`` returns, rolled back if it raises (the exception
        propagates; a driver error as ``JournalError``). ``immediate``: take the write lock at
        the start (for writes); ``False`` for a consistent read snapshot.
        """

    @property
    @abstractmethod
    def closed(self) -> bool:
        """``True`` after ``close()``."""

    @abstractmethod
    def close(self) -> None:
        """Stop the heartbeat threads and release the store. Idempotent."""

    @abstractmethod
    def integrity_check(self, *, quick: bool = False) -> list[str]:
        """Check the whole store; return the problems found (``[]`` if sound)."""


class SQLiteStore(Store):
    """The ``Store`` over one SQLite file. Thread-safe; multi-process safe.

    Args:
        path: the file (``str`` or ``Path``); ``None`` means ``default_journal_path()``. Parent
            directories are created. ``":memory:"`` is refused.
        stale_after: seconds (``float``) before a silent ``running`` run counts as crashed.
        busy_timeout: seconds (``float``) a write waits for another process's lock.
        retry_seconds: seconds (``float``) an operation is retried through a transient fault
            (full disk, lock, I/O error); ``None``: ``$RLM_JOURNAL_RETRY_SECONDS``, else 30.
        durability: ``"process"`` or ``"power"``; None: ``$RLM_JOURNAL_DURABILITY``, else
            ``"process"`` (:func:`durability_level`).
        read_only: open an existing journal for reading only (a file or directory this
            process may not write, a read-only mount): SQLite's ``mode=ro``, and where the
            WAL index cannot be created beside it, ``immutable=1`` (SQLite's URI parameters:
            the file is then taken as unchanging while open). Nothing is created or migrated;
            a write raises ``JournalError`` ("read-only").

    Raises:
        JournalCorruptError: the file is not a SQLite database, or is damaged.
        JournalSchemaError: the file is not an rlm journal or has an unusable schema version;
            the file is not modified.
        JournalError: the file or its directory cannot be created, opened or written.

    The hooks ``_open`` (a new configured connection), ``_locked`` (the lock guarding it) and
    ``_connection`` (the connection to use) are what a variant overrides, e.g. the benchmark's
    one-connection-per-thread store in ``evals.bench_journal``.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *,
                 stale_after: float = _DEFAULT_STALE_AFTER,
                 busy_timeout: float = _DEFAULT_BUSY_TIMEOUT, read_only: bool = False,
                 retry_seconds: float | None = None, durability: str | None = None) -> None:
        if path is not None and str(path) == ":memory:":
            raise JournalError("an in-memory journal is not supported (resume needs a file); "
                               "pass a file path, e.g. in a temporary directory")
        self.path = Path(path).expanduser() if path is not None else default_journal_path()
        self.stale_after = float(stale_after)
        self.busy_timeout = float(busy_timeout)
        self.retry_seconds = retry_limit(retry_seconds)
        self.durability = durability_level(durability)
        self._lock = threading.Lock()
        self._closed = False
        self._heartbeats = []
        self._ident: tuple[int, int] | None = None  # (st_dev, st_ino) of the file written
        self._detached: JournalError | None = None  # set once the file was replaced
        self._restored: sqlite3.Connection | None = None  # the closed connection, until reopened
        self._orphans: list[sqlite3.Connection] = []  # connections inherited across fork()
        self._host = host_name()
        self._boot = boot_id()
        self._pid = os.getpid()
        self.read_only = bool(read_only)
        if self.read_only:
            if not self.path.is_file():
                raise JournalError(f"no journal file at {self.path} to read")
            self._conn = self._open_read_only()
            return
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
        self._ident = file_guard.identity(self.path)

    def cap_wait(self, seconds: float | None) -> None:
        """Bound how long one statement waits for another process's lock: ``seconds`` (at
        least 50 ms) while the journal's retries run out, so their limit holds and a run that
        stopped for the journal exits without waiting on the lock again; None: the store's
        ``busy_timeout``."""
        wait = self.busy_timeout if seconds is None else min(self.busy_timeout,
                                                               max(0.05, seconds))
        try:
            self._conn.execute(f"PRAGMA busy_timeout = {int(wait * 1000)}")
        except (sqlite3.Error, AttributeError):
            pass  # closed, or not open yet: nothing waits on it

    # ---- opening: inspect, refuse or migrate, configure -----------------------------------

    def _open(self) -> sqlite3.Connection:
        """Open, check and configure a new connection to ``path`` (see the module docstring)."""
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
                version, app_id, tables = schema.inspect(conn)
            except BaseException:
                _rollback(conn)
                raise
            conn.execute("COMMIT")
            if not schema.is_fresh(version, app_id, tables):
                schema.check(self.path, version, app_id, tables)
            mode = while_busy(lambda: conn.execute("PRAGMA journal_mode = WAL").fetchone()[0],
                              self.busy_timeout)
            if str(mode).lower() != "wal":
                log.warning("journal %s could not switch to WAL mode (got %r); concurrent "
                            "readers will block writers", self.path, mode)
            # "process": a commit is handed to the OS (no fsync), which is all a crash of this
            # process needs; measured 36 -> 22 us a commit against NORMAL. "power": FULL, an
            # fsync per commit, for a commit that must outlive an OS crash or a power loss.
            conn.execute("PRAGMA synchronous = "
                         + ("OFF" if self.durability == "process" else "FULL"))
            # Checkpoint (and fsync) every 4000 WAL pages (16 MiB) instead of SQLite's 1000:
            # measured 20-30% less amortised cost per stage; a big WAL is trimmed to 64 MiB.
            conn.execute("PRAGMA wal_autocheckpoint = 4000")
            conn.execute("PRAGMA journal_size_limit = 67108864")
            if not schema.is_current(version, app_id):
                self._upgrade(conn)
        except BaseException as exc:
            conn.close()
            if isinstance(exc, sqlite3.Error):
                raise self._translate(exc, "open the journal") from exc
            raise
        return conn

    def _open_read_only(self) -> sqlite3.Connection:
        """A reading connection to the existing file (see ``read_only``); the schema checked
        as in ``_open``, never changed."""
        from urllib.parse import quote
        uri = "file:" + quote(str(self.path.resolve()))
        conn = None
        for params in ("?mode=ro", "?mode=ro&immutable=1"):
            try:
                conn = sqlite3.connect(uri + params, uri=True, timeout=self.busy_timeout,
                                       isolation_level=None, check_same_thread=False)
                version, app_id, tables = schema.inspect(conn)
                break
            except sqlite3.Error as exc:
                if conn is not None:
                    conn.close()
                    conn = None
                code = getattr(exc, "sqlite_errorcode", None)
                if params.endswith("immutable=1") or not isinstance(code, int) \
                        or code & 0xFF != _SQLITE_CANTOPEN:
                    raise self._translate(exc, "open the journal for reading") from exc
        assert conn is not None
        if schema.is_fresh(version, app_id, tables):
            conn.close()
            raise JournalError(f"{self.path} holds no journal (an empty database)")
        try:
            schema.check(self.path, version, app_id, tables)
            if not schema.is_current(version, app_id):
                raise JournalError(f"journal {self.path} has an older schema, which only a "
                                   "writable open upgrades; copy it somewhere writable to read it")
        except BaseException:
            conn.close()
            raise
        return conn

    def _upgrade(self, conn: sqlite3.Connection) -> None:
        """Create or migrate the schema in one write transaction (concurrent openers are safe:
        the second one sees the first one's result)."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            start = schema.upgrade(conn, self.path)
            conn.execute("COMMIT")
        except BaseException:
            _rollback(conn)
            raise
        if start is not None:
            log.info("migrated journal %s from schema version %d to %d", self.path, start,
                     schema.SCHEMA_VERSION)

    # ---- the connection, its lock, fork() and close() -------------------------------------

    def _locked(self) -> threading.Lock:
        """The lock guarding the connection (a fresh one after ``fork()``)."""
        if self._pid != os.getpid():
            self._after_fork()
        return self._lock

    def _connection(self) -> sqlite3.Connection:
        """The connection to use, under ``_locked()``. Raises ``JournalError`` once closed."""
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
            self._ident = file_guard.identity(self.path)
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

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- the Store operations -------------------------------------------------------------

    def _write1(self, action: str, sql: str, params: tuple,
                on_duplicate: Callable[[], JournalError] | None = None) -> int:
        """One statement in its own (autocommit) transaction; returns the rowcount. Retried
        through transient faults (``harness.journal.faults``)."""
        def once() -> int:
            with self._locked():
                conn = self._writable()
                try:
                    return conn.execute(sql, params).rowcount
                except sqlite3.IntegrityError as exc:
                    if on_duplicate is None:
                        raise self._translate(exc, action) from exc
                    raise on_duplicate() from exc
                except sqlite3.Error as exc:
                    raise self._translate(exc, action) from exc
        return retrying(self, action, once)

    def _read(self, action: str, sql: str, params: tuple) -> list[tuple]:
        """One reading statement; its rows (``fetchall()``)."""
        self._before_read()

        def once() -> list[tuple]:
            with self._locked():
                conn = self._connection()
                try:
                    return conn.execute(sql, params).fetchall()
                except sqlite3.Error as exc:
                    raise self._translate(exc, action) from exc
        return retrying(self, action, once)

    def _transaction(self, action: str, work: Callable[[sqlite3.Connection], _T], *,
                     immediate: bool = True) -> _T:
        """``BEGIN [IMMEDIATE]``, ``work(conn)``, ``COMMIT``, holding the lock; rolled back on any
        exception, a ``sqlite3`` error raised as the ``JournalError`` for ``action``. A
        transient fault re-runs the whole transaction (``harness.journal.faults``)."""
        if not immediate:
            self._before_read()

        def once() -> _T:
            with self._locked():
                conn = self._writable() if immediate else self._connection()
                try:
                    conn.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
                    result = work(conn)
                    conn.execute("COMMIT")
                except BaseException as exc:
                    _rollback(conn)
                    if isinstance(exc, sqlite3.Error):
                        raise self._translate(exc, action) from exc
                    raise
                return result
        return retrying(self, action, once)

    def _writable(self) -> sqlite3.Connection:
        """The connection to write through, under ``_locked()``, once the file at ``path`` is
        checked to be the one it writes (``harness.journal.file_guard``: a removed file is
        restored first, a replaced one raises ``JournalUnavailableError``)."""
        return file_guard.checked(self)

    def _reopen(self) -> sqlite3.Connection:
        """Open the restored file (``file_guard``); a failure is retried at the next write."""
        self._conn = self._open()
        self._restored = None
        self._on_reconnect()
        return self._conn

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

    # ---- error translation ----------------------------------------------------------------

    def _translate(self, exc: sqlite3.Error, action: str) -> JournalError:
        """The ``JournalError`` (or ``JournalCorruptError``) saying that ``action`` failed with
        ``exc``, why (from SQLite's result code or message) and what to do; not raised here."""
        err = self._describe(exc, action)
        code = getattr(exc, "sqlite_errorcode", None)
        primary = code & 0xFF if isinstance(code, int) else None
        # a lock, a full disk, an I/O error may pass; a file moved away is restored next time
        err.transient = (primary in _TRANSIENT or code == _SQLITE_READONLY_DBMOVED) \
            and not isinstance(err, JournalCorruptError)
        return err

    def _describe(self, exc: sqlite3.Error, action: str) -> JournalError:
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
                f"cannot {action}: journal {path} is locked by another connection ({text}; a "
                f"statement waits up to {self.busy_timeout:g} s, some are refused at once). "
                f"Another process may be stuck holding it; retry, or stop that process.")
        if primary == _SQLITE_IOERR:
            return JournalError(
                f"cannot {action}: I/O error on journal {path} ({text}). Check the disk and the "
                f"file system it lives on.")
        name = getattr(exc, "sqlite_errorname", type(exc).__name__)
        return JournalError(f"cannot {action} in journal {path}: {text} ({name})")


def _rollback(conn: sqlite3.Connection) -> None:
    """Roll back ``conn``'s open transaction, if any; a failure to do so is ignored."""
    try:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
    except sqlite3.Error:  # the transaction may already be rolled back (e.g. SQLITE_FULL)
        pass
