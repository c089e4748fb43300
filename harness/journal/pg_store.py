"""The ``Store`` over a PostgreSQL database (psycopg 3): one journal shared by many hosts.

``Journal("postgresql://user@host:5432/db")`` (or ``postgres://``) opens one. The record
statements and the DDL are the SQLite store's (``harness.journal.schema``, ``records``, ``runs``);
this module holds only what PostgreSQL does differently:

- placeholders: ``?`` becomes ``%s`` and ``IS ?`` becomes ``IS NOT DISTINCT FROM %s``;
- an event and its stage row are one statement (a data-modifying ``WITH``), one round trip;
- the schema version lives in the table ``rlm_meta`` (``user_version``, ``application_id``);
  creating or migrating the schema holds a transaction-level advisory lock, so concurrent
  openers (several hosts starting at once) create it once;
- append-only ``events`` and ``cells`` are enforced by triggers (``UPDATE``, ``DELETE`` and
  ``TRUNCATE`` raise);
- driver errors become ``JournalError`` naming the server (never the password);
- a lost connection (the server restarted, a network cut) is opened again: every operation
  runs under ``harness.journal.faults.retrying``, so a statement that failed on a connection
  the server dropped is re-run, whole, on a new one once the server answers again (for up to
  ``retry_seconds``); a lock timeout, a serialization failure or a server out of disk space is
  retried the same way. Only the first connection is not retried: a server that cannot be
  reached when the journal is opened is an error at once;
- durability as SQLite's WAL mode: ``synchronous_commit = off`` for the journal's session, so a
  committed write survives the crash of the writing process (SIGKILL included) at once and a
  crash of the server after its WAL writer's next flush (~0.2 s), without an fsync wait per
  write; ``options=-csynchronous_commit%3Don`` in the URL waits for the disk on every commit.

One connection (autocommit; explicit ``BEGIN`` for transactions) behind one ``threading.Lock``,
shared by all threads; a store inherited across ``fork()`` opens a fresh connection in the child.
The tables live in the connection's ``current_schema()`` (pass ``options=-csearch_path=NAME`` in
the URL to keep several journals in one database).

This module imports only the standard library, psycopg (at open time) and ``harness.journal``.
"""
from __future__ import annotations

import os
import re
import threading
from functools import lru_cache
from typing import Any, Callable, TypeVar

from harness.journal import schema
from harness.journal.errors import JournalError
from harness.journal.faults import retry_limit, retrying

from harness.journal.store import (durability_level, 
    _DEFAULT_BUSY_TIMEOUT,
    _DEFAULT_STALE_AFTER,
    Store,
    boot_id,
    host_name,
    log,
)

__all__ = ["PostgresStore", "is_postgres_url", "redact"]

_T = TypeVar("_T")
_SCHEMA_LOCK = 0x524C4D4A  # advisory lock key held while creating or migrating the schema
# SQLSTATE classes a retry cannot get past although psycopg raises them as OperationalError:
# bad credentials (28), a database that does not exist (3D)
_NOT_TRANSIENT = ("28", "3D")


def is_postgres_url(spec: Any) -> bool:
    """Whether ``spec`` names a PostgreSQL journal (``postgresql://`` or ``postgres://``)."""
    return isinstance(spec, str) and spec.startswith(("postgresql://", "postgres://"))


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and ``path``)."""
    return re.sub(r"^(postgres(?:ql)?://[^:/@]*):[^@]*@", r"\1:***@", url)


@lru_cache(maxsize=256)
def _sql(statement: str) -> str:
    """A record statement (``?`` placeholders) in psycopg's paramstyle."""
    return (statement.replace("%", "%%").replace(" IS ?", " IS NOT DISTINCT FROM ?")
            .replace("?", "%s"))


class _Conn:
    """A psycopg connection seen through the record statements' dialect: ``execute(sql,
    params)`` translates placeholders and returns the cursor (``fetchall``, ``fetchone``)."""

    dialect = "postgresql"

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def execute(self, statement: str, params: tuple = ()) -> Any:
        return self.raw.execute(_sql(statement), params)


class PostgresStore(Store):
    """The ``Store`` over one PostgreSQL database. Thread-safe; multi-process and multi-host safe.

    Args:
        url: ``postgresql://[user[:password]@]host[:port]/dbname[?param=value...]`` (libpq).
        stale_after: seconds before a silent ``running`` run counts as crashed.
        busy_timeout: seconds a statement waits for a lock (``lock_timeout``) and for the
            connection (``connect_timeout``) before failing.
        retry_seconds: seconds an operation is retried (reconnecting) through a lost
            connection or another transient fault; ``None``: ``$RLM_JOURNAL_RETRY_SECONDS``,
            else 30 (``harness.journal.faults``).

    Raises:
        JournalSchemaError: the database holds tables but is not an rlm journal, or an unusable
            schema version; nothing is modified.
        JournalError: psycopg is not installed, or the server cannot be reached or used.
    """

    dialect = "postgresql"

    def __init__(self, url: str, *, stale_after: float = _DEFAULT_STALE_AFTER,
                 busy_timeout: float = _DEFAULT_BUSY_TIMEOUT,
                 retry_seconds: float | None = None, durability: str | None = None) -> None:
        self.url = url
        self.durability = durability_level(durability)
        self.path = redact(url)  # type: ignore[assignment]  # named in messages like a path
        self.stale_after = float(stale_after)
        self.busy_timeout = float(busy_timeout)
        self.retry_seconds = retry_limit(retry_seconds)
        self._lock = threading.Lock()
        self._closed = False
        self._heartbeats = []
        self._host = host_name()
        self._boot = boot_id()
        self._pid = os.getpid()
        try:
            import psycopg  # noqa: F401
        except ImportError as exc:
            raise JournalError(
                "a PostgreSQL journal needs psycopg 3: pip install 'rlm-kernels[postgres]' "
                "(or psycopg[binary])") from exc
        self._conn = self._open()

    # ---- opening --------------------------------------------------------------------------

    def _open(self) -> _Conn:
        import psycopg
        try:
            raw = psycopg.connect(self.url, autocommit=True,
                                  connect_timeout=max(1, int(self.busy_timeout)))
        except psycopg.Error as exc:
            raise self._translate(exc, "connect to the journal") from exc
        conn = _Conn(raw)
        try:
            raw.execute(f"SET lock_timeout = {int(self.busy_timeout * 1000)}")
            if "synchronous_commit" not in self.url:
                # "process" (the default): a commit survives the client's crash (SIGKILL
                # included) at once, the server's crash after its WAL writer flushes (~0.2 s);
                # no fsync wait per write. "power" (or options=-csynchronous_commit%3Don in
                # the URL) waits for the disk on every commit.
                raw.execute("SET synchronous_commit = "
                            + ("off" if self.durability == "process" else "on"))
            raw.execute("SET client_min_messages = warning")
            self._run(conn, "open the journal", self._check_schema, immediate=True)
        except BaseException:
            raw.close()
            raise
        return conn

    def _check_schema(self, conn: _Conn) -> None:
        version, app_id, tables = schema.inspect(conn)
        if schema.is_fresh(version, app_id, tables) or not schema.is_current(version, app_id):
            if not schema.is_fresh(version, app_id, tables):
                schema.check(self.path, version, app_id, tables)  # type: ignore[arg-type]
            conn.execute("SELECT pg_advisory_xact_lock(?)", (_SCHEMA_LOCK,))
            start = schema.upgrade(conn, self.path)  # type: ignore[arg-type]
            if start is not None:
                log.info("migrated journal %s from schema version %d to %d", self.path, start,
                         schema.SCHEMA_VERSION)

    # ---- the connection, its lock, fork() and close() -------------------------------------

    def _connection(self) -> _Conn:
        if self._pid != os.getpid():
            self._lock = threading.Lock()
            self._heartbeats = []
            self._pid = os.getpid()
            if not self._closed:
                self._conn = self._open()  # the parent's socket is left alone
        if self._closed:
            raise JournalError(f"journal {self.path} is closed")
        raw = self._conn.raw
        if raw.closed or raw.broken:  # the server dropped it: open a new one (or fail, transient)
            raw.close()
            self._conn = self._open()
            self._on_reconnect()
            log.warning("journal %s: connected again", self.path)
        return self._conn

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        for hb in list(self._heartbeats):
            hb.stop()
        if self._pid != os.getpid():
            self._closed = True
            return
        with self._lock:
            self._closed = True
            try:
                self._conn.raw.close()
            except Exception:  # pragma: no cover - close failures are not actionable
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- the Store operations -------------------------------------------------------------

    def _write1(self, action: str, sql: str, params: tuple,
                on_duplicate: Callable[[], JournalError] | None = None) -> int:
        import psycopg

        def once() -> int:
            with self._lock:
                conn = self._connection()
                try:
                    return conn.execute(sql, params).rowcount
                except psycopg.errors.UniqueViolation as exc:
                    if on_duplicate is None:
                        raise self._translate(exc, action) from exc
                    raise on_duplicate() from exc
                except psycopg.Error as exc:
                    raise self._translate(exc, action) from exc
        return retrying(self, action, once)

    def _read(self, action: str, sql: str, params: tuple) -> list[tuple]:
        import psycopg
        self._before_read()

        def once() -> list[tuple]:
            with self._lock:
                conn = self._connection()
                try:
                    return conn.execute(sql, params).fetchall()
                except psycopg.Error as exc:
                    raise self._translate(exc, action) from exc
        return retrying(self, action, once)

    def _transaction(self, action: str, work: Callable[[Any], _T], *,
                     immediate: bool = True) -> _T:
        if not immediate:
            self._before_read()

        def once() -> _T:
            with self._lock:
                return self._run(self._connection(), action, work, immediate=immediate)
        return retrying(self, action, once)

    def _run(self, conn: _Conn, action: str, work: Callable[[Any], _T], *,
             immediate: bool) -> _T:
        """``BEGIN``, ``work(conn)``, ``COMMIT``; a read (``immediate=False``) is one
        ``REPEATABLE READ`` snapshot. Rolled back on any exception."""
        import psycopg
        try:
            conn.raw.execute("BEGIN" if immediate else
                             "BEGIN ISOLATION LEVEL REPEATABLE READ")
            result = work(conn)
            conn.raw.execute("COMMIT")
        except BaseException as exc:
            try:
                conn.raw.execute("ROLLBACK")
            except psycopg.Error:
                pass
            if isinstance(exc, psycopg.Error):
                raise self._translate(exc, action) from exc
            raise
        return result

    def integrity_check(self, *, quick: bool = False) -> list[str]:
        """The server keeps its own data consistent; this checks that every table the schema
        needs is there. Returns the problems found (``[]`` if sound)."""
        rows = self._read("check the journal's integrity",
                          "SELECT table_name FROM information_schema.tables WHERE "
                          "table_schema = current_schema()", ())
        have = {r[0] for r in rows}
        return [f"table {t} is missing" for t in ("runs", "stages", "events", "model_calls",
                                                  "cells", "rlm_meta") if t not in have]

    # ---- error translation ----------------------------------------------------------------

    def _translate(self, exc: Exception, action: str) -> JournalError:
        import psycopg
        err = self._describe(exc, action)
        state = getattr(exc, "sqlstate", None) or ""
        # a dropped connection, a server starting or shutting down, a lock timeout, a full
        # disk (class 53), a serialization failure or deadlock (class 40) may pass
        err.transient = (isinstance(exc, (psycopg.OperationalError,
                                          psycopg.errors.TransactionRollback))
                         and not state.startswith(_NOT_TRANSIENT))
        return err

    def _describe(self, exc: Exception, action: str) -> JournalError:
        import psycopg
        if len(action) > 200:
            action = action[:197] + "..."
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, psycopg.errors.LockNotAvailable):  # an OperationalError too
            return JournalError(
                f"cannot {action}: journal {self.path} stayed locked for more than "
                f"{self.busy_timeout:g} s ({text}); retry, or stop the session holding it.")
        if isinstance(exc, psycopg.OperationalError):
            return JournalError(
                f"cannot {action}: PostgreSQL journal {self.path} is unreachable or refused the "
                f"connection ({text}). Check the server, the URL in --journal / RLM_JOURNAL and "
                f"the credentials (a password can come from ~/.pgpass or PGPASSWORD).")
        if isinstance(exc, psycopg.errors.InsufficientPrivilege):
            return JournalError(
                f"cannot {action}: the user of journal {self.path} lacks a privilege ({text}); "
                f"grant it or use another database.")
        name = getattr(exc, "sqlstate", None) or type(exc).__name__
        return JournalError(f"cannot {action} in journal {self.path}: {text} ({name})")
