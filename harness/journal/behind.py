"""Which records must be durable before the harness acts, and group commit for all of them.

A record is written in one of two ways:

- **Durable** (``_durable``): committed before the call returns. These are the records the
  harness acts on after writing them, so a crash right after the act must find them: a model
  call's spend *reservation* (written before the request is sent, so caps hold across a crash:
  a resumed run counts an in-flight call at its reservation), a model call's *response*
  (written before it is handed to the kernel or the loop, as a durable workflow engine records
  a step's output before the workflow goes on: a resumed run never sends again a call whose
  reply the run had received), a run's creation, claim and finish, and every record written
  through the public methods without ``behind=True``.
- **Written behind** (``_defer``): queued in memory and committed later, in order, in one
  transaction with the others: stage transitions, executed cells, settlements and releases of
  the spend ledger. Losing the tail of these in a crash only means that a resumed run re-creates
  the transitions and re-runs the cells (which it does anyway).

Two rules keep the journal's guarantees:

1. **Order.** Two FIFO queues: the *records* (calls, cells, spend rows) and the *transitions*
   (stage events). A durable record commits in the same transaction as every record queued
   before it, so everything a run recorded before sending a model call (the replies of earlier
   calls above all: a resumed run must not send them again) is in the journal before the call
   is sent. Transitions may lag behind the reservations (they only describe the run; resume
   re-creates them): the background writer, a reader, ``flush()``, ``close()`` and a run's
   finish commit them, always in order and together with the queued records, so a run's events
   keep their ``seq`` order and hash chain, and a finished run has all of them.
2. **Nothing is lost silently.** A batch that fails to commit (disk full, locked too long) is
   put back at the head of the queue and retried; the next durable write raises the
   ``JournalError`` (so no call is sent that the journal could not reserve), and ``close()``
   logs how many records could not be written. The queue is committed at interpreter exit too
   (``atexit``; the writer is a daemon thread).

Group commit: the queues are committed by whichever writer comes first: a durable write, a
reader of this journal (which flushes first, so a process always reads what it wrote),
``flush()``, ``close()``, or the journal's background writer thread, which commits the queue at
most ``WRITE_BEHIND_SECONDS`` after a record was queued (so another process tailing the journal,
e.g. ``rlm view --live``, sees records that late at most). One writer at a time: ``_chain_lock``
is held from taking the queue to committing it. A durable record is queued too, with a slot for
its row count, and its writer then takes ``_chain_lock``: if a commit made meanwhile (by another
durable writer, or the background writer) already held it, the slot is filled and nothing is
left to do; else it commits the queue itself, with every record that arrived while it waited.
So the replies of a batch of concurrent sub-calls share one commit, or a few.

A sub-call journaled this way costs two small commits on its own path (its reservation, carrying
the previous records; its reply, carrying its settlement) instead of seven transactions; its
seven transitions go in the background writer's next batch.

Faults: every commit runs under ``harness.journal.faults.retrying`` (bounded retries through a
lost connection, a full disk, a lock); a batch is re-run whole on each attempt.

This module imports only the standard library and ``harness.journal``'s own modules.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import weakref
from typing import Any

from harness.journal import schema
from harness.journal.encoding import dumps, event_hash, run_anchor
from harness.journal.errors import JournalError
from harness.journal.store import Store

__all__ = ["WriteBehind", "WRITE_BEHIND_SECONDS"]

log = logging.getLogger("harness.journal")

#: The longest a queued record waits for the background writer (seconds).
WRITE_BEHIND_SECONDS = 0.05
#: The most records the background writer commits in one transaction.
WRITER_CHUNK = 8
_RETRY_SECONDS = 1.0
_CHAIN_RETRIES = 50

# Queued items (tuples, kind first):
#   ("event", action, (run_id, stage_id, from, to, ts, stage_json), (parent_id, kind, level))
#   ("sql", action, sql, params)
#   ("call", action, sql, params, run_id, call_id, request_hash)   a model call, checked


def _stage_json(stage: dict, path: Any) -> str:
    """A queued stage dict as JSON; a value JSON cannot encode is written as its ``repr`` and
    logged (a batch that could never be encoded would otherwise be retried forever)."""
    try:
        return dumps(stage)
    except (TypeError, ValueError) as exc:
        log.error("journal %s: stage %r is not JSON-serializable (%s); its unencodable values "
                  "are recorded as their repr", path, stage.get("id"), exc)
        return json.dumps(_encodable(stage, 0))


def _encodable(value: Any, depth: int) -> Any:
    """``value`` with every leaf JSON cannot encode replaced by its ``repr``; dicts and lists
    keep their shape (readers such as ``rlm verify`` look inside them), to a depth of 64."""
    if isinstance(value, str | int | bool | type(None)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if depth < 64 and isinstance(value, dict):
        return {str(k): _encodable(v, depth + 1) for k, v in value.items()}
    if depth < 64 and isinstance(value, list | tuple):
        return [_encodable(v, depth + 1) for v in value]
    return repr(value)[:10_000]


def _chain_conflict(exc: BaseException) -> bool:
    """Whether ``exc`` is the unique index ``events_chain`` refusing a second event with the same
    ``prev_hash``: another writer appended to the run first (retry from the journal's head)."""
    text = str(exc.__cause__ or exc)
    return "events_chain" in text or "events.run_id, events.prev_hash" in text


class _Queue:
    """This process's write-behind state of one journal (fresh after ``fork()``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[tuple] = []  # calls, cells, spend rows: before the next reservation
        self.events: list[tuple] = []  # stage transitions: may lag the reservations
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.warned = False


_OPEN: "weakref.WeakSet[WriteBehind]" = weakref.WeakSet()
_exit_lock = threading.Lock()
_exit_pid: list[int] = []


def _at_exit(journal: "WriteBehind") -> None:
    """Commit ``journal``'s queue when the interpreter exits (its writer is a daemon thread,
    which exit would stop mid-wait): registered once per process."""
    with _exit_lock:
        _OPEN.add(journal)
        if _exit_pid != [os.getpid()]:
            _exit_pid[:] = [os.getpid()]
            atexit.register(_flush_all)


def _flush_all() -> None:
    for journal in list(_OPEN):
        try:
            if not journal.closed and journal.pending:
                journal.flush()
        except Exception as exc:  # noqa: BLE001 - exit goes on; say what was lost
            log.error("journal %s: %d queued record(s) could not be written at exit: %s",
                      journal.path, journal.pending, exc)


class WriteBehind(Store):
    """The write-behind queue and group commit of ``Journal`` (see the module docstring).

    Methods for the record classes: ``_defer(item)`` (queue), ``_durable(item)`` (commit it with
    the queue, return its row count). Public: ``flush()``, ``pending`` and ``close()``.
    """

    # ---- per-process state ----------------------------------------------------------------

    def _state(self) -> tuple[threading.RLock, dict, _Queue]:
        d = self.__dict__
        if d.get("_chain_pid") != os.getpid():
            # the chain lock, the cached chain heads and the queue belong to one process: the
            # parent writes its own queue, a forked child starts empty
            d["_chain_lock"], d["_chain_heads"], d["_wb"] = threading.RLock(), {}, _Queue()
            d["_chain_pid"] = os.getpid()
        return d["_chain_lock"], d["_chain_heads"], d["_wb"]

    @property
    def _chain_lock(self) -> threading.RLock:
        """Held from taking the queue (or reading a run's chain head) to committing after it:
        the threads sharing this journal never race each other (only other processes' writers
        can, and retry)."""
        return self._state()[0]

    @property
    def _heads(self) -> dict[str, str]:
        """The last committed chain hash of each run this journal wrote."""
        return self._state()[1]

    @property
    def pending(self) -> int:
        """Records queued and not committed yet (int)."""
        q = self._state()[2]
        return len(q.items) + len(q.events)

    # ---- queueing -------------------------------------------------------------------------

    def _defer(self, item: tuple) -> None:
        """Queue ``item``; the background writer commits it within ``WRITE_BEHIND_SECONDS``
        unless a durable write or a reader takes it first. Raises ``JournalError`` once closed."""
        if self.closed:
            raise JournalError(f"journal {self.path} is closed")
        q = self._state()[2]
        with q.lock:
            (q.events if item[0] == "event" else q.items).append(item)
            if q.thread is None:
                q.thread = threading.Thread(target=self._writer, args=(q,), daemon=True,
                                            name="rlm-journal-writer")
                q.thread.start()
                _at_exit(self)
        if not q.wake.is_set():  # most calls find it set: skip the condition's lock
            q.wake.set()

    def _take(self, q: _Queue, events: bool = True,
              limit: int | None = None) -> tuple[list[tuple], list[tuple]]:
        """The queued records (and, with ``events``, transitions), at most ``limit`` of them
        (transitions first), oldest first."""
        with q.lock:
            evs: list[tuple] = []
            if events:
                n = len(q.events) if limit is None else min(limit, len(q.events))
                evs, q.events[:n] = q.events[:n], []
            n = len(q.items) if limit is None else min(max(0, limit - len(evs)), len(q.items))
            items, q.items[:n] = q.items[:n], []
        return items, evs

    def _put_back(self, q: _Queue, items: list[tuple], evs: list[tuple]) -> None:
        with q.lock:
            q.items[:0] = items
            q.events[:0] = evs

    def _durable(self, item: tuple, *, events: bool = False) -> int:
        """Commit ``item`` with every record queued before it (``events``: the queued stage
        transitions too; an event item always takes them), sharing the commit with the durable
        records other threads write at the same time (group commit, see the module docstring).
        Returns ``item``'s row count (-1: a model call already recorded with another request).

        Raises:
            JournalError: the commit failed (``JournalUnavailableError`` past the retry limit);
                ``item`` is not written, the records queued before it stay queued.
        """
        if self.closed:
            raise JournalError(f"journal {self.path} is closed")
        slot: list[int] = []
        tagged = item + (slot,)
        q = self._state()[2]
        with q.lock:
            (q.events if item[0] == "event" else q.items).append(tagged)
        try:
            with self._chain_lock:
                if not slot:  # no commit took it while this thread waited: commit the queue
                    self._commit_queue([], item[1], events or item[0] == "event")
        except BaseException:
            with q.lock:  # never written later behind the caller's back
                for queue in (q.items, q.events):
                    if any(it is tagged for it in queue):
                        queue[:] = [it for it in queue if it is not tagged]
            raise
        if not slot:  # pragma: no cover - a commit of the queue always takes it
            raise JournalError(f"journal {self.path}: a record was not committed ({item[1]})")
        return slot[0]

    def flush(self) -> None:
        """Commit every queued record now (one transaction).

        Raises:
            JournalError: the commit failed; the records stay queued.
        """
        self._commit_queue([], None, True)

    def _commit_queue(self, extra: list[tuple], action: str | None,
                      events: bool, limit: int | None = None) -> list[int]:
        """Take the queue (``events``: the transitions too; at most ``limit`` records) and
        commit it, then ``extra``, in one transaction; returns the row counts (``[]``: nothing
        to write). On failure the queue is put back and the ``JournalError`` raised."""
        with self._chain_lock:
            q = self._state()[2]
            items, evs = self._take(q, events, limit)
            batch = evs + items
            if not batch and not extra:
                return []
            try:
                counts = self._commit(batch + extra,
                                      action or f"write {len(batch)} queued record(s)")
            except BaseException:
                self._put_back(q, items, evs)
                raise
            for it, n in zip(batch, counts):
                if type(it[-1]) is list:  # a durable record's slot: its writer is done
                    it[-1].append(n)
        self._log_conflicts(batch, counts)
        return counts

    def _on_reconnect(self) -> None:
        """A new connection (``Store._on_reconnect``): chain heads are read again from the
        database (a server's crash may have lost the last commits it acknowledged)."""
        self._heads.clear()

    def _before_read(self) -> None:
        """A reader in this process sees what it wrote: commit the queue first (a failure is
        logged; the read goes on without the queued records)."""
        q = self.__dict__.get("_wb") if self.__dict__.get("_chain_pid") == os.getpid() else None
        if q is not None and (q.items or q.events):
            try:
                self.flush()
            except JournalError as exc:
                log.warning("journal %s: queued records not written before a read: %s",
                            self.path, exc)

    def _writer(self, q: _Queue) -> None:
        """The background writer: commits the queue ``WRITE_BEHIND_SECONDS`` after it fills."""
        while not q.stop.is_set():
            q.wake.wait()
            if q.stop.wait(WRITE_BEHIND_SECONDS):
                return
            q.wake.clear()
            try:
                # the stage JSON first, holding no lock; then in chunks: a sub-call's durable
                # write waits for one chunk's commit, never a whole 50 ms batch (measured:
                # ~180 records, ~5 ms holding the connection)
                self._serialize_queued(q)
                while self._commit_queue([], None, True, WRITER_CHUNK):
                    pass
            except JournalError as exc:
                if not q.warned:
                    q.warned = True
                    log.warning("journal %s: queued records could not be written (%s); retrying",
                                self.path, exc)
                q.wake.set()
                if q.stop.wait(_RETRY_SECONDS):
                    return
            except Exception:  # noqa: BLE001 - a bug must not kill the writer silently
                log.exception("journal %s: the background writer failed", self.path)
                q.wake.set()
                if q.stop.wait(_RETRY_SECONDS):
                    return

    def _serialize_queued(self, q: _Queue) -> None:
        """Serialize the stage dicts of queued transitions outside every lock, so the
        commits that follow (which hold the connection) only hash and insert."""
        with q.lock:
            raw = [it for it in q.events if type(it[2][5]) is dict]
        done = {id(it): (it[0], it[1], (*it[2][:5], _stage_json(it[2][5], self.path)), it[3])
                for it in raw}
        with q.lock:
            q.events[:] = [done.get(id(it), it) for it in q.events]

    def close(self) -> None:
        """Commit the queue, stop the background writer, then close the store. Idempotent.
        Records that still cannot be written are logged as lost (never raised)."""
        if self.closed:
            return
        if self.__dict__.get("_chain_pid") == os.getpid():
            q = self.__dict__["_wb"]
            q.stop.set()
            q.wake.set()
            try:
                self.flush()
            except JournalError as exc:
                log.error("journal %s: %d record(s) could not be written and are lost: %s",
                          self.path, len(q.items) + len(q.events), exc)
            if q.thread is not None and q.thread is not threading.current_thread():
                q.thread.join(timeout=5)
        super().close()  # type: ignore[safe-super]

    # ---- committing -----------------------------------------------------------------------

    def _commit(self, items: list[tuple], action: str) -> list[int]:
        """Write ``items`` in order in one transaction (``_chain_lock`` held); returns each
        item's row count (-1: a model call already recorded with another request). An event
        chains from the run's head; if another process appended to
        the run first, the whole batch is rolled back and retried from the new head."""
        for attempt in range(_CHAIN_RETRIES):
            heads: dict[str, str] = {}

            def work(conn: Any) -> list[int]:
                # a stage's row is written once per batch, from its last event (its first_seq
                # from its first one): an llm_query's seven transitions cost one upsert
                heads.clear()  # a retried attempt (harness.journal.faults) starts over
                latest: dict[tuple, list] = {}
                counts = [self._write_item(conn, it, heads, latest) for it in items]
                for (run_id, stage_id), (seq, ev, stage) in latest.items():
                    conn.execute(schema.STAGE_UPSERT, (run_id, stage_id, stage[0], stage[1],
                                                       ev[3], stage[2], seq, ev[4], ev[5]))
                return counts

            try:
                counts = self._transaction(action, work)
            except JournalError as exc:
                for it in items:
                    if it[0] == "event":
                        self._heads.pop(it[2][0], None)
                if not _chain_conflict(exc) or attempt == _CHAIN_RETRIES - 1:
                    raise
                continue
            self._heads.update(heads)
            return counts
        raise AssertionError("unreachable")  # pragma: no cover

    def _write_item(self, conn: Any, item: tuple, heads: dict[str, str],
                    latest: dict[tuple, list]) -> int:
        kind = item[0]
        if kind == "event":
            ev, stage = item[2], item[3]
            if type(ev[5]) is dict:  # queued unserialized (record_event(behind=True))
                ev = (*ev[:5], _stage_json(ev[5], self.path))
            run_id = ev[0]
            prev = heads.get(run_id) or self._heads.get(run_id) or self._chain_head(conn, run_id)
            digest = self._event_digest(prev, ev)
            seq = conn.execute(schema.EVENT_INSERT + " RETURNING seq",
                               (*ev, prev, digest)).fetchone()[0]
            heads[run_id] = digest
            key = (run_id, ev[1])
            first = latest.get(key)
            latest[key] = [first[0] if first else seq, ev, stage]
            return 1
        count = conn.execute(item[2], item[3]).rowcount
        if kind == "call" and not count:  # already recorded: the same request?
            row = conn.execute("SELECT request_hash FROM model_calls WHERE run_id = ? AND "
                               "call_id = ?", (item[4], item[5])).fetchone()
            if row is not None and row[0] != item[6]:
                return -1
        return count

    def _event_digest(self, prev: str | None, ev: tuple) -> str | None:
        """The chain hash of event ``ev`` after ``prev`` (a hook: the journal benchmark measures
        the chain's cost by returning None)."""
        return event_hash(prev, *ev)

    def _chain_head(self, conn: Any, run_id: str) -> str:
        """The hash a new event of ``run_id`` chains from, read inside the writing transaction:
        its latest event's, or the run's anchor for its first event."""
        head = conn.execute("SELECT hash FROM events WHERE run_id = ? ORDER BY seq DESC "
                            "LIMIT 1", (run_id,)).fetchall()
        if head and head[0][0] is not None:
            return head[0][0]
        if head:  # the run's earlier events predate the hash chain (schema version 1)
            return run_anchor(run_id, None)
        inputs = conn.execute("SELECT query, model, sub_model, max_depth, options "
                              "FROM runs WHERE run_id = ?", (run_id,)).fetchall()
        return run_anchor(run_id, tuple(inputs[0]) if inputs else None)

    def _log_conflicts(self, items: list[tuple], counts: list[int]) -> None:
        """A queued model call already recorded with another request keeps the first record
        and is logged (a durable ``record_model_call`` raises ``ModelCallConflictError``)."""
        for it, n in zip(items, counts):
            if n == -1 and type(it[-1]) is not list:  # a durable one raises instead
                log.error("journal %s: model call %r of run %r is already recorded with another "
                          "request; the first record is kept", self.path, it[5], it[4])
