"""A SQLite journal file removed, moved away or replaced under a running run.

SQLite keeps writing to the file it opened, whatever happens to its name: a journal removed
(``rm journal.sqlite3*``) or moved away under a run would take every later record with it,
unseen. So before each write the store checks, with one ``stat``, that the file at its path is
the one it opened (``st_dev``, ``st_ino``):

- **gone** (removed, or moved away): the open connection still reads the whole database through
  its open files, so SQLite's backup API copies it (every committed record) to a new file, which
  is linked at the path (never over a file another process put there meanwhile); the store
  reopens it and goes on, with a warning. ``-wal``/``-shm`` files left at the path belong to the
  old database and are removed first; the old connection is closed before the new file has
  them (closing a WAL connection removes those names).
- **replaced** by another file: nothing of this run is written into it. This process's copy is
  saved beside it (``NAME.saved-PID``) and every later write raises the same
  ``JournalUnavailableError``, which names the copy.

A failure to check or restore (the directory unwritable, the disk full) is a transient
``JournalError``: the write is retried (``harness.journal.faults``).

This module imports only the standard library and ``harness.journal``'s own modules.
"""
from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path
from typing import Any

from harness.journal.errors import JournalError, JournalUnavailableError

__all__ = ["identity", "checked"]

log = logging.getLogger("harness.journal")


def identity(path: Path) -> tuple[int, int]:
    """``(st_dev, st_ino)`` of ``path``: which file is there. Raises ``OSError``."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def checked(store: Any) -> sqlite3.Connection:
    """The connection ``store`` (a ``SQLiteStore``, its lock held) writes through, once the file
    at its path is checked to be the one it writes; a removed file is restored first.

    Raises:
        JournalUnavailableError: the file was replaced by another one (now and after).
        JournalError: transient: the file could not be checked or restored.
    """
    conn = store._connection()
    if store._detached is not None:
        raise store._detached
    if store.read_only or store._ident is None:
        return conn
    if store._restored is not None:  # restored, but the reopen failed: try it again
        return store._reopen()
    try:
        now = identity(store.path)
    except FileNotFoundError:
        return _restore(store)
    except OSError as exc:
        raise _transient(f"cannot check journal {store.path}: {exc.strerror or exc}") from exc
    if now != store._ident:
        raise _replaced(store)
    return conn


def _restore(store: Any) -> sqlite3.Connection:
    """Copy the open connection's database to a new file at the path and reopen it."""
    old, path = store._conn, store.path
    tmp = path.with_name(f"{path.name}.restoring-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in (Path(f"{path}-wal"), Path(f"{path}-shm")):
            stale.unlink(missing_ok=True)
        _copy(old, tmp)
        old.close()  # before the new file's -wal exists: closing unlinks that name
        os.link(tmp, path)  # never over a file another process created meanwhile
        store._ident, store._restored = identity(path), old
    except (OSError, sqlite3.Error) as exc:
        raise _transient(f"journal {path} was removed under the run and could not be "
                         f"restored yet: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    log.warning("journal %s was removed while this process was writing it; it was restored "
                "from the open connection with every record committed so far", path)
    return store._reopen()


def _replaced(store: Any) -> JournalUnavailableError:
    """Save this process's copy beside the file now at the path; stop writing; say so."""
    path = store.path
    saved = path.with_name(f"{path.name}.saved-{os.getpid()}")
    try:
        _copy(store._conn, saved)
        where = f"this process's copy, with every record it committed, is saved as {saved}"
    except (OSError, sqlite3.Error) as exc:
        where = f"its copy could not be saved ({exc})"
    store._detached = JournalUnavailableError(
        f"journal {path} was replaced by another file while this run was writing it; nothing "
        f"more is written there and the run stops: {where}. Put that copy back at {path} (or "
        f"point RLM_JOURNAL at it) and resume the run.")
    return store._detached


def _copy(conn: sqlite3.Connection, target: Path) -> None:
    """Copy ``conn``'s whole database to a new file ``target`` (SQLite's backup API)."""
    dst = sqlite3.connect(str(target))
    try:
        conn.backup(dst)
    finally:
        dst.close()


def _transient(message: str) -> JournalError:
    err = JournalError(message)
    err.transient = True
    return err
