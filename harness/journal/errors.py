"""The journal's exceptions, one class per thing a caller may want to tell apart.

Every failure of the journal is a ``JournalError`` (a ``harness.errors.HarnessError``), never a
bare ``sqlite3`` error: the store translates those (``harness.journal.store``) and chains the
original as ``__cause__``. The subclasses below narrow down what happened::

    JournalError                 the file cannot be opened, read or written (CLI exit code 2)
    +-- JournalUnavailableError  the database failed under a running run and stayed down past
    |                            the retry limit (CLI exit code 9; resume once it is back)
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
    "JournalUnavailableError",
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
    #: Whether the failure may pass by itself (a lost connection, a full disk, a lock held by
    #: another process, a file removed under the run): the store then retries the operation
    #: for up to its ``retry_seconds`` (``harness.journal.faults``). Set by the store's error
    #: translation; ``False`` for everything a retry cannot fix (a damaged file, a constraint).
    transient = False


class JournalUnavailableError(JournalError):
    """The journal's database failed while a run was writing it, and was still failing after
    the store's bounded retries (``harness.journal.faults``: ``retry_seconds``, 30 s by default).

    The message says what failed last (connection lost, disk full, locked, removed) and what to
    do. The run stops here: every call it sent was reserved in the journal first, and the
    records still queued are lost with the process, which only means that a resumed run runs
    those cells and in-flight calls again. ``rlm resume RUN_ID`` continues it once the database
    is back. The CLI exits 9 for it: the journal failed, not the input.

    Attributes:
        seconds: how long the store kept retrying (float, seconds).
    """

    exit_code = 9
    transient = False  # the retries are spent: an outer retry must not start over

    def __init__(self, message: str, *, seconds: float = 0.0) -> None:
        super().__init__(message)
        self.seconds = seconds


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
