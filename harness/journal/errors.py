"""The journal's exceptions, one class per thing a caller may want to tell apart.

Every failure of the journal is a ``JournalError`` (a ``harness.errors.HarnessError``), never a
bare ``sqlite3`` error: the store translates those (``harness.journal.store``) and chains the
original as ``__cause__``. The subclasses below narrow down what happened::

    JournalError                 the file cannot be opened, read or written (CLI exit code 2)
    +-- JournalSchemaError       the file's schema version is one this code cannot use
    +-- JournalCorruptError      not a SQLite database, or damaged beyond recovery
    +-- RunExistsError           create_run with a run id already in the journal
    +-- UnknownRunError          a run id that is not in the journal
    +-- ModelCallConflictError   one model call id recorded with two request hashes

This module imports only the standard library and ``harness.errors``.
"""
from __future__ import annotations

from pathlib import Path

from harness.errors import HarnessError

__all__ = [
    "JournalError",
    "JournalSchemaError",
    "JournalCorruptError",
    "RunExistsError",
    "UnknownRunError",
    "ModelCallConflictError",
]


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
