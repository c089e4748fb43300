"""Run records: create, claim (to resume), keep alive, finish and read the runs of a journal.

A run row has an owner (host name, pid and the host's boot id, so one journal can be shared by
many hosts) and a heartbeat (unix seconds). A run whose status is ``running`` counts as *crashed*
when its heartbeat is older than ``stale_after`` seconds (:func:`stale`), or when its owner ran on this host and
that process is gone or the host has rebooted since (so a run killed a moment ago can be resumed
at once); a crashed run can be claimed from any host. ``claim_run`` takes over only such a run, or a
finished one; a live owner's run is never taken, and of several concurrent claimers exactly one
wins. ``Heartbeat`` keeps a run's heartbeat fresh from a daemon thread.

The run record as read (``get_run``, ``list_runs``, the export's first line) is a dict of the
``runs`` columns (``run_id``, ``created_at``, ``updated_at``, ``status``, ``query``, ``model``,
``sub_model``, ``max_depth``, ``options``, ``answer``, ``usage``, ``error``, ``owner_pid``,
``owner_host``, ``heartbeat_at``, ``finished_at``; JSON columns decoded, times unix seconds) plus
``state``: the status, or ``"crashed"``, and ``heartbeat_age``: seconds since the last heartbeat of
a ``running`` run, on the journal's clock (None otherwise).

Liveness never compares two machines' clocks: heartbeats are written, and judged stale, on one
clock, the journal's (:func:`now_sql`). A PostgreSQL journal shared by many hosts uses the
database server's clock (``statement_timestamp()``) both to stamp a heartbeat and as the "now" it is compared
with, so a host whose clock runs minutes ahead or behind neither sees a live run as crashed nor is
seen so. A SQLite journal lives on one machine: its clock is that machine's (:func:`_clock`).

This module imports only the standard library and ``harness.journal``'s own modules.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Protocol

from harness.journal.encoding import dumps, loads
from harness.journal.errors import JournalError, RunExistsError, UnknownRunError
from harness.journal.behind import WriteBehind


class HeartbeatTarget(Protocol):
    """What a :class:`Heartbeat` needs of its journal (:class:`harness.journal.journal.Journal`
    is one): ``heartbeat(run_id) -> bool`` (False once this process no longer owns the run),
    ``closed`` and the list of live heartbeats it stops on close."""

    closed: bool
    _heartbeats: list

    def heartbeat(self, run_id: str) -> bool: ...

__all__ = ["Heartbeat", "RunRecords", "RUN_SELECT", "run_record", "now_sql", "stale"]

log = logging.getLogger("harness.journal")

_RUN_COLUMNS = ("run_id", "created_at", "updated_at", "status", "query", "model",
                "sub_model", "max_depth", "options", "answer", "usage", "error", "owner_pid",
                "owner_host", "heartbeat_at", "finished_at", "owner_boot")
#: Selects the columns ``run_record`` decodes; append a ``WHERE`` / ``ORDER BY`` clause.
RUN_SELECT = "SELECT " + ", ".join(_RUN_COLUMNS) + " FROM runs"


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


def _owner_dead(pid: int | None, host: str | None, this_host: str, boot: str | None = None,
                this_boot: str = "") -> bool:
    """True only if the owner ran on this host and its process is gone, or the host rebooted
    since (another boot id); pid reuse, another pid namespace or any doubt count as alive: then
    only heartbeat staleness decides."""
    if host != this_host or pid is None:
        return False
    if boot and this_boot and boot != this_boot:
        return True
    return pid != os.getpid() and not _pid_alive(pid)


def _clock() -> float:
    """This machine's clock (unix seconds, ``time.time()``): the clock of a SQLite journal's
    heartbeats and of the times a run record only reports (``updated_at``)."""
    return time.time()

#: A PostgreSQL journal's "now", in unix seconds, on the database server's clock (one instant
#: for the whole statement).
_PG_NOW = "CAST(EXTRACT(EPOCH FROM statement_timestamp()) AS DOUBLE PRECISION)"


def now_sql(store: Any, at: float | None = None) -> str:
    """The SQL expression of "now" (unix seconds) on the clock ``store``'s heartbeats are kept
    by: the database server's for PostgreSQL, this machine's (a literal: ``at``, default
    :func:`_clock`) for SQLite."""
    if getattr(store, "dialect", "sqlite") == "postgresql":
        return _PG_NOW
    return repr(float(_clock() if at is None else at))


def stale(heartbeat_at: float | None, now: float, stale_after: float) -> bool:
    """Whether a heartbeat stamped ``heartbeat_at`` is stale at ``now`` (both on the journal's
    clock, :func:`now_sql`): older than ``stale_after`` seconds, or missing. The one place reads
    decide it; ``claim_run`` says the same in SQL."""
    return heartbeat_at is None or now - heartbeat_at > stale_after


def run_record(row: tuple, now: float, stale_after: float, this_host: str,
               this_boot: str = "") -> dict:
    """Decode one ``RUN_SELECT`` row into the run record described in the module docstring.

    ``now`` (unix seconds, on the journal's clock: :func:`now_sql`) and ``stale_after``
    (seconds) decide whether a ``running`` run has gone stale; ``this_host`` is the host name
    of the reading process.
    """
    run = dict(zip(_RUN_COLUMNS, row))
    for key in ("options", "usage", "error"):
        run[key] = loads(run[key])
    state = run["status"]
    beat = run["heartbeat_at"]
    run["heartbeat_age"] = (None if beat is None or state != "running"
                            else max(0.0, now - beat))
    if state == "running" and (stale(beat, now, stale_after)
                               or _owner_dead(run["owner_pid"], run["owner_host"], this_host,
                                              run["owner_boot"], this_boot)):
        state = "crashed"
    run["state"] = state
    return run


class Heartbeat:
    """A daemon thread that refreshes a run's heartbeat every ``interval`` seconds.

    Calling the object (or ``stop()``) stops the thread and waits for it (at most ``timeout``
    seconds); calling it again does nothing. The thread stops by itself when the journal reports
    that this process no longer owns the run (another process claimed it, or it was finished):
    ``lost`` is then set. Transient journal errors are logged and retried at the next tick.
    """

    def __init__(self, journal: HeartbeatTarget, run_id: str, interval: float) -> None:
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


class RunRecords(WriteBehind):
    """The run methods of ``Journal``: ``create_run``, ``claim_run``, ``heartbeat``,
    ``start_heartbeat``, ``finish_run``, ``get_run``, ``list_runs``."""

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
        try:
            options_json = dumps(options or {})
        except (TypeError, ValueError) as exc:
            raise JournalError(f"run {run_id!r}: options are not JSON-serializable: {exc}") from exc
        now = now_sql(self)  # created and first heartbeat at one instant, on the journal's clock
        self._write1(
            f"create run {run_id!r}",
            "INSERT INTO runs (run_id, created_at, updated_at, status, query, model, "
            "sub_model, max_depth, options, owner_pid, owner_host, owner_boot, heartbeat_at) "
            f"VALUES (?, {now}, {now}, 'running', ?, ?, ?, ?, ?, ?, ?, ?, {now})",
            (run_id, query, model, sub_model, int(max_depth), options_json,
             os.getpid(), self._host, self._boot),
            on_duplicate=lambda: RunExistsError(
                f"run {run_id!r} already exists in journal {self.path}; resume it "
                f"(claim_run) or choose another run id"))

    def claim_run(self, run_id: str) -> bool:
        """Take ownership of an existing run to resume it; atomic across threads and processes.

        Succeeds only if the run is not ``running``, or its heartbeat is older than
        ``stale_after`` seconds, or its owner ran on this host and that process no longer exists
        (so a run killed a moment ago can be resumed at once): then the run's owner becomes this
        process (pid, host), its status ``running``, its heartbeat now and ``finished_at`` is
        cleared. A run whose owner is alive (fresh heartbeat, process present) is never taken.
        Of several concurrent claimers exactly one wins. A finished run (``completed``,
        ``failed``, ...) can be claimed too: deciding whether to resume it or return its recorded
        answer is the caller's job (check ``get_run`` first).

        Returns:
            ``True`` if this process now owns the run, ``False`` if it is running and fresh.

        Raises:
            UnknownRunError: the journal has no run ``run_id``.
            JournalError: the write failed.
        """
        now, clock = _clock(), now_sql(self)  # stamped and judged on the journal's clock
        changed = self._write1(
            f"claim run {run_id!r}",
            "UPDATE runs SET status = 'running', owner_pid = ?, owner_host = ?, owner_boot = ?, "
            f"heartbeat_at = {clock}, updated_at = ?, finished_at = NULL WHERE run_id = ? AND "
            f"(status != 'running' OR heartbeat_at IS NULL OR heartbeat_at < {clock} - ?)",
            (os.getpid(), self._host, self._boot, now, run_id, self.stale_after))
        if changed:
            return True
        rows = self._read(f"claim run {run_id!r}", "SELECT status, owner_pid, owner_host, "
                          "heartbeat_at, owner_boot FROM runs WHERE run_id = ?", (run_id,))
        if not rows:
            raise UnknownRunError(f"no run {run_id!r} in journal {self.path}")
        status, pid, host, beat, boot = rows[0]
        if status != "running" or not _owner_dead(pid, host, self._host, boot, self._boot):
            return False
        # The owner died on this host before its heartbeat went stale: compare-and-set on the
        # row as read, so of several claimers only the first one changes it.
        return bool(self._write1(
            f"claim run {run_id!r}",
            "UPDATE runs SET owner_pid = ?, owner_host = ?, owner_boot = ?, "
            f"heartbeat_at = {now_sql(self)}, updated_at = ?, finished_at = NULL WHERE "
            "run_id = ? AND status = 'running' AND owner_pid = ? AND owner_host = ? AND "
            "heartbeat_at IS ?",
            (os.getpid(), self._host, self._boot, now, run_id, pid, host, beat)))

    def release_run(self, record: dict) -> bool:
        """Give back a run this process claimed (:meth:`claim_run`) but did not start: its
        status, owner, heartbeat and end time become those of ``record`` (the run as read
        before the claim, from :meth:`get_run`), so it can be resumed again at once.

        Returns:
            ``True`` if released; ``False`` if this process no longer owns the run.
        Raises:
            JournalError: the write failed.
        """
        return bool(self._write1(
            f"release run {record['run_id']!r}",
            "UPDATE runs SET status = ?, owner_pid = ?, owner_host = ?, heartbeat_at = ?, "
            "finished_at = ?, updated_at = ? WHERE run_id = ? AND owner_pid = ? "
            "AND owner_host = ?",
            (record.get("status"), record.get("owner_pid"), record.get("owner_host"),
             record.get("heartbeat_at"), record.get("finished_at"), _clock(),
             record["run_id"], os.getpid(), self._host)))

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
            f"UPDATE runs SET heartbeat_at = {now_sql(self)} WHERE run_id = ? AND "
            "status = 'running' AND owner_pid = ? AND owner_host = ?",
            (run_id, os.getpid(), self._host)))

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
        hb = Heartbeat(self, run_id, interval)  # type: ignore[arg-type]  # self is a Journal
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
            usage_json = None if usage is None else dumps(usage)
            error_json = None if error is None else dumps(error)
        except (TypeError, ValueError) as exc:
            raise JournalError(f"run {run_id!r}: usage or error is not JSON-serializable: "
                               f"{exc}") from exc
        now = _clock()
        # with every record queued before it, so a finished run's records are all there
        changed = self._durable((
            "sql", f"finish run {run_id!r}",
            "UPDATE runs SET status = ?, answer = ?, usage = ?, error = ?, finished_at = ?, "
            "updated_at = ? WHERE run_id = ?",
            (status, answer, usage_json, error_json, now, now, run_id)), events=True)
        if not changed:
            raise UnknownRunError(f"no run {run_id!r} in journal {self.path}")

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
        rows = self._read(f"read run {run_id!r}", self._select_now() + " WHERE run_id = ?",
                          (run_id,))
        if not rows:
            return None
        return run_record(rows[0][:-1], rows[0][-1],
                          self.stale_after if stale_after is None else stale_after, self._host,
                          self._boot)

    def list_runs(self, limit: int = 50, *, stale_after: float | None = None) -> list[dict]:
        """Return up to ``limit`` run records, newest (by ``created_at``) first, as ``get_run``."""
        rows = self._read("list runs", self._select_now() + " ORDER BY created_at DESC, "
                          "rowid DESC LIMIT ?", (int(limit),))
        stale = self.stale_after if stale_after is None else stale_after
        return [run_record(r[:-1], r[-1], stale, self._host, self._boot) for r in rows]

    def _select_now(self) -> str:
        """``RUN_SELECT`` with the journal's "now" (:func:`now_sql`) as a last column, read in
        the same statement as the heartbeats it judges."""
        return RUN_SELECT.replace(" FROM runs", f", {now_sql(self)} FROM runs")

    def journal_now(self) -> float:
        """"Now" on the journal's clock (unix seconds): the database server's for PostgreSQL,
        this machine's for SQLite (:func:`now_sql`). Raises ``JournalError``."""
        if getattr(self, "dialect", "sqlite") != "postgresql":
            return float(_clock())
        return float(self._read("read the journal's clock", f"SELECT {_PG_NOW}", ())[0][0])
