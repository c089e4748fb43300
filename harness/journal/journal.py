"""``Journal``: the one class callers use, assembled from the record classes over a store.

Each group of methods lives with the records it writes::

    Journal
      RunRecords        runs.py      create_run, claim_run, heartbeat, start_heartbeat,
                                     finish_run, get_run, list_runs
      StageRecords      records.py   record_event, stages, events
      ModelCallRecords  records.py   record_model_call, lookup_model_call, model_calls
      CellRecords       records.py   record_cell, cells
      SpendRecords      spend.py     record_spend, spend (the spend ledger: reservations
                                     before sending, settlements, releases)
      ToolCallRecords   tool_calls.py  record_tool_start, record_tool_result, lookup_tool_call,
                                     tool_calls, tool_call_attempts (the user's tool calls)
      JsonlExport       export.py    export_jsonl
    SQLiteJournal = Journal + SQLiteStore      (store.py: a file path)
    PostgresJournal = Journal + PostgresStore  (pg_store.py: a postgresql:// URL)

``Journal(spec)`` picks the store from ``spec``: a ``postgresql://`` / ``postgres://`` URL opens
the PostgreSQL journal, anything else is a SQLite file path (``None``: ``$RLM_JOURNAL``, which may
be a URL too, else the default file). Both are instances of ``Journal``.

This module imports only the standard library and ``harness.journal``'s own modules.
"""
from __future__ import annotations

import os
from typing import Any

from harness.journal.export import JsonlExport
from harness.journal.pg_store import PostgresStore, is_postgres_url
from harness.journal.records import CellRecords, ModelCallRecords, StageRecords
from harness.journal.runs import RunRecords
from harness.journal.spend import SpendRecords
from harness.journal.store import SQLiteStore, Store
from harness.journal.tool_calls import ToolCallRecords

__all__ = ["Journal", "SQLiteJournal", "PostgresJournal"]


class Journal(RunRecords, StageRecords, ModelCallRecords, CellRecords, SpendRecords,
              ToolCallRecords, JsonlExport, Store):
    """An append-only journal of runs, in one SQLite file or one PostgreSQL database.
    Thread-safe; multi-process safe (and, on PostgreSQL, multi-host safe).

    Args:
        path: the journal: a SQLite file (``str`` or ``Path``; parent directories are created)
            or a ``postgresql://user@host/db`` URL; ``None`` means ``$RLM_JOURNAL`` (a path or
            URL), else ``default_journal_path()``.
        stale_after: seconds after which a ``running`` run whose heartbeat has not been refreshed
            counts as crashed (``get_run``'s ``state``, ``claim_run``). Default 10.
        busy_timeout: seconds a write waits for another process's lock before failing. Default 30.
        retry_seconds: seconds an operation is retried through a transient fault of the
            database under a run (a lost connection, a full disk, a lock, a removed file);
            ``None``: ``$RLM_JOURNAL_RETRY_SECONDS``, else 30; ``0``: one attempt
            (``harness.journal.faults``).

    Raises:
        JournalCorruptError: the file is not a SQLite database, or is damaged.
        JournalSchemaError: the file's (database's) schema version is newer than this code knows,
            or it is not an rlm journal; nothing is modified.
        JournalError: the file or its directory cannot be created, opened or written (read-only,
            disk full, locked for longer than ``busy_timeout``); the server cannot be reached.
            Under a run, a transient fault that outlasts ``retry_seconds`` raises its subclass
            ``JournalUnavailableError`` (CLI exit code 9).

    All timestamps are unix seconds (``float``, ``time.time()``). All methods raise
    ``JournalError`` (or a subclass) on a storage failure, never a driver's own error, and
    ``JournalError`` after ``close()``. Use as a context manager to close it.
    """

    def __new__(cls, path: Any = None, **kwargs: Any) -> "Journal":
        if cls is Journal:
            spec = path if path is not None else os.environ.get("RLM_JOURNAL") or None
            cls = PostgresJournal if is_postgres_url(spec) else SQLiteJournal
        return super().__new__(cls)

    def __repr__(self) -> str:
        return f"Journal({str(self.path)!r}{', closed' if self._closed else ''})"


class SQLiteJournal(Journal, SQLiteStore):
    """The journal in one SQLite file (see ``Journal``)."""


class PostgresJournal(Journal, PostgresStore):
    """The journal in one PostgreSQL database (see ``Journal``)."""

    def __init__(self, path: Any = None, **kwargs: Any) -> None:
        PostgresStore.__init__(self, path if path is not None else os.environ["RLM_JOURNAL"],
                               **kwargs)
