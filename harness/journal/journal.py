"""``Journal``: the one class callers use, assembled from the record classes over SQLite.

Each group of methods lives with the records it writes::

    Journal
      RunRecords        runs.py      create_run, claim_run, heartbeat, start_heartbeat,
                                     finish_run, get_run, list_runs
      StageRecords      records.py   record_event, stages, events
      ModelCallRecords  records.py   record_model_call, lookup_model_call, model_calls
      CellRecords       records.py   record_cell, cells
      SpendRecords      spend.py     record_spend, spend (the spend ledger: reservations
                                     before sending, settlements, releases)
      JsonlExport       export.py    export_jsonl
      SQLiteStore       store.py     the file, its connection and lock, close, integrity_check

This module imports only the standard library and ``harness.journal``'s own modules.
"""
from __future__ import annotations

from harness.journal.export import JsonlExport
from harness.journal.records import CellRecords, ModelCallRecords, StageRecords
from harness.journal.runs import RunRecords
from harness.journal.spend import SpendRecords
from harness.journal.store import SQLiteStore

__all__ = ["Journal"]


class Journal(RunRecords, StageRecords, ModelCallRecords, CellRecords, SpendRecords, JsonlExport,
              SQLiteStore):
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

    def __repr__(self) -> str:
        return f"Journal({str(self.path)!r}{', closed' if self._closed else ''})"
