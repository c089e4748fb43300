"""Bounded retries of the journal's operations through its database's faults.

A run writes its journal all along, and the database under it can fail for a while and come
back: a PostgreSQL server restarted (the connection is gone), a disk that filled up and was
freed, a lock another process held too long, a SQLite file removed under the run. Each store
marks such a failure ``transient`` when it translates it (``JournalError.transient``); every
operation of a store (one statement, one read, one transaction) then runs under
:func:`retrying`:

- the first attempt is made without tenacity's machinery (most operations need one);
- a transient failure is retried with exponential backoff and jitter (0.05 s doubling to 1 s)
  for up to the store's ``retry_seconds`` (:data:`RETRY_SECONDS` by default, or
  ``$RLM_JOURNAL_RETRY_SECONDS``); the store reconnects, or restores a removed file, before an
  attempt (``pg_store``, ``store``);
- past the limit the operation raises :class:`~harness.journal.errors.JournalUnavailableError`
  naming the last failure, and the store gives up waiting: until an operation succeeds again,
  each one makes a single attempt, so a run that stops for it does not wait the limit again
  for every record it tries to write on its way out.

An operation is a whole transaction, re-run from its start on each attempt (a failed one was
rolled back), so a retry never writes half of a batch. Nothing is retried that a retry cannot
fix (a damaged file, a constraint, a closed journal).

This module imports only the standard library, tenacity (on the first fault) and
``harness.journal.errors``.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, TypeVar

from harness.journal.errors import JournalError, JournalUnavailableError

__all__ = ["RETRY_SECONDS", "ENV_VAR", "retry_limit", "retrying", "transient", "while_busy"]

log = logging.getLogger("harness.journal")

#: How long (seconds) an operation is retried through a transient fault by default.
RETRY_SECONDS = 30.0
#: The environment variable that sets it for every journal this process opens.
ENV_VAR = "RLM_JOURNAL_RETRY_SECONDS"

_T = TypeVar("_T")


def retry_limit(value: float | None = None) -> float:
    """The retry limit in seconds: ``value`` if given, else ``$RLM_JOURNAL_RETRY_SECONDS``,
    else :data:`RETRY_SECONDS`. ``0`` means one attempt only.

    Raises:
        JournalError: a negative value, or an environment value that is not a number.
    """
    if value is None:
        raw = os.environ.get(ENV_VAR, "").strip()
        if not raw:
            return RETRY_SECONDS
        try:
            value = float(raw)
        except ValueError:
            raise JournalError(f"{ENV_VAR}={raw!r} is not a number of seconds; set it to "
                               f"e.g. 30, or unset it") from None
    value = float(value)
    if not value >= 0:  # also refuses NaN
        raise JournalError(f"the journal's retry limit must be 0 or more seconds, got {value!r}")
    return value


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a journal failure a retry may get past."""
    return isinstance(exc, JournalError) and exc.transient


def retrying(store: Any, action: str, once: Callable[[], _T]) -> _T:
    """``once()`` (one attempt of ``action`` on ``store``), retried through transient faults.

    ``store`` has ``path``, ``retry_seconds`` and ``_gave_up`` (a bool this sets when the
    limit was spent and clears on the next success).

    Raises:
        JournalUnavailableError: still failing after ``store.retry_seconds``.
        JournalError: a failure that is not transient, raised as it is.
    """
    try:
        result = once()
    except JournalError as exc:
        if not exc.transient:
            raise
        first = exc
    else:
        if store._gave_up:
            store._gave_up = False
            _cap_wait(store, None)
            log.warning("journal %s: writable again", store.path)
        return result
    return _retry_after(store, action, once, first)


def _retry_after(store: Any, action: str, once: Callable[[], _T], first: JournalError) -> _T:
    limit = 0.0 if store._gave_up else store.retry_seconds
    t0 = time.monotonic()
    if limit > 0:
        log.warning("%s (retrying for up to %g s)", first, limit)
    # tenacity is imported on the first fault only: it imports asyncio (70 ms), which a run
    # whose journal never fails does not need
    from tenacity import (Retrying, retry_if_exception, stop_after_delay, wait_exponential,
                          wait_random)
    pending = [first]

    def attempt() -> _T:
        if pending:  # the first attempt, already made
            raise pending.pop()
        # one attempt's own wait (SQLite's busy timeout) ends with the limit, not past it
        _cap_wait(store, max(0.0, limit - (time.monotonic() - t0)))
        return once()

    try:
        result = Retrying(stop=stop_after_delay(limit),
                          wait=wait_exponential(multiplier=0.05, max=1.0) + wait_random(0, 0.05),
                          retry=retry_if_exception(transient), reraise=True)(attempt)
    except JournalError as exc:
        if not exc.transient:
            raise
        store._gave_up = True
        _cap_wait(store, 0.0)  # the single attempts from now on do not wait either
        waited = time.monotonic() - t0
        raise JournalUnavailableError(
            "the journal stayed unavailable"
            + (f" for {waited:.1f} s (the limit is {limit:g} s: {ENV_VAR})" if limit > 0 else
               "")
            + f": {exc} The run stops here; every call it sent was reserved in the journal "
            f"first. Once the journal is back, continue it with `rlm resume RUN_ID` "
            f"(`rlm runs` lists it).", seconds=waited) from exc
    if limit > 0:
        log.warning("journal %s: back after %.1f s (%s)", store.path, time.monotonic() - t0,
                    action)
    store._gave_up = False
    _cap_wait(store, None)
    return result


def while_busy(statement: Callable[[], _T], seconds: float) -> _T:
    """``statement()``, run again every 10 ms for up to ``seconds`` while SQLite answers
    "database is locked" (``sqlite3.OperationalError``, SQLITE_BUSY) at once.

    Some statements get that answer without waiting out the busy timeout: ``PRAGMA
    journal_mode = WAL`` on a new file while another connection switches it too (measured
    with 4 openers of one new file released together: about 1 round in 150 for threads, 1 in
    7 for processes, such as the Ray workers of a sweep).

    Raises:
        sqlite3.Error: any other failure, or still busy after ``seconds``.
    """
    import sqlite3
    deadline = time.monotonic() + seconds
    while True:
        try:
            return statement()
        except sqlite3.OperationalError as exc:
            code = getattr(exc, "sqlite_errorcode", None)
            if code is None or code & 0xFF != 5 or time.monotonic() >= deadline:  # 5: BUSY
                raise
        time.sleep(0.01)


def _cap_wait(store: Any, seconds: float | None) -> None:
    """Bound the wait inside one attempt to ``seconds`` (None: the store's own), for stores
    whose attempts wait by themselves (``cap_wait``: SQLite's busy timeout)."""
    cap = getattr(store, "cap_wait", None)
    if cap is not None:
        cap(seconds)
