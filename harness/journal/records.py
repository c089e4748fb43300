"""What a run records as it goes: stage transitions, model calls and executed cells.

- Stages (``StageRecords``): every transition of a stage is appended to ``events`` (append-only,
  ``seq`` strictly increasing across the journal) with its place in the run's hash chain
  (``prev_hash``, ``hash``: ``harness.journal.encoding``; no lock: see ``StageRecords``) and, in the same transaction, the
  stage's latest dict is upserted into ``stages``. ``record_event`` is usable directly as a
  ``harness.stages.tree.StageTree`` listener.
- Model calls (``ModelCallRecords``): one row per ``(run_id, call_id)`` with the request, its
  ``request_hash``, the response, usage and every attempt. A resumed run serves a call from here
  only when the hashes match; recording is idempotent and refuses a silent change.
- Cells (``CellRecords``): every executed cell's code and output, append-only.

Each reader returns dicts (JSON columns decoded, times unix seconds) in recording order; the
``*_SELECT`` statements and ``*_record`` decoders are shared with ``harness.journal.export``.

This module imports only the standard library and ``harness.journal``'s own modules.
"""
from __future__ import annotations

import json
import time
from typing import Any

from harness.journal.behind import WriteBehind
from harness.journal.encoding import dumps, loads, value_hash
from harness.journal.errors import JournalError, ModelCallConflictError
from harness.journal.schema import EVENT_INSERT, STAGE_ON_CONFLICT, STAGE_UPSERT

__all__ = ["StageRecords", "ModelCallRecords", "CellRecords", "STAGE_SELECT", "EVENT_SELECT",
           "CHAIN_SELECT", "EVENT_INSERT", "STAGE_UPSERT", "STAGE_ON_CONFLICT",
           "CALL_SELECT", "CELL_SELECT", "event_record", "call_record", "cell_record"]

#: The latest stage dicts of a run (one ``?``: the run id), in the order first recorded.
STAGE_SELECT = "SELECT stage FROM stages WHERE run_id = ? ORDER BY first_seq"
#: The events of a run, in recording order; rows for ``event_record``.
EVENT_SELECT = ("SELECT seq, stage_id, from_status, to_status, ts, stage FROM events "
                "WHERE run_id = ? ORDER BY seq")
#: The chain columns of a run's events, in recording order (for ``harness.journal.verify``).
CHAIN_SELECT = ("SELECT seq, stage_id, from_status, to_status, ts, stage, prev_hash, hash "
                "FROM events WHERE run_id = ? ORDER BY seq")
_CALL_COLUMNS = ("call_id, request_hash, request, response, usage, attempts, created_at, "
                 "response_hash")
#: The model calls of a run, in recording order; rows for ``call_record``.
CALL_SELECT = f"SELECT {_CALL_COLUMNS} FROM model_calls WHERE run_id = ? ORDER BY rowid"
#: The cells of a run, in recording order; rows for ``cell_record``.
CELL_SELECT = ("SELECT seq, stage_id, code, output, created_at FROM cells "
               "WHERE run_id = ? ORDER BY seq")


def event_record(run_id: str, row: tuple) -> dict:
    """Decode an ``EVENT_SELECT`` row: ``{"seq": int, "run_id", "stage_id", "from", "to",
    "ts": float, "stage": dict}``."""
    seq, sid, frm, to, ts, stage = row
    return {"seq": seq, "run_id": run_id, "stage_id": sid, "from": frm, "to": to, "ts": ts,
            "stage": json.loads(stage)}


def call_record(row: tuple) -> dict:
    """Decode a ``CALL_SELECT`` row: ``call_id``, ``request_hash`` (str), ``request``,
    ``response``, ``usage``, ``attempts`` (as recorded) and ``created_at`` (unix seconds)."""
    call_id, rhash, request, response, usage, attempts, created_at, resp_hash = row
    return {"call_id": call_id, "request_hash": rhash, "request": json.loads(request),
            "response": loads(response), "usage": loads(usage),
            "attempts": loads(attempts), "created_at": created_at, "response_hash": resp_hash}


def cell_record(row: tuple) -> dict:
    """Decode a ``CELL_SELECT`` row: ``seq``, ``stage_id``, ``code``, ``output`` (as recorded),
    ``created_at`` (unix seconds)."""
    seq, sid, code, out, created = row
    return {"seq": seq, "stage_id": sid, "code": code, "output": loads(out),
            "created_at": created}


class StageRecords(WriteBehind):
    """The stage methods of ``Journal``: ``record_event``, ``stages``, ``events``.

    The hash chain needs no lock across processes: the unique index ``events_chain`` on
    ``(run_id, prev_hash)`` lets each hash be chained from once, so of two writers appending to
    one run (threads, or processes and hosts) the second one's insert fails and it retries from
    the journal's new head. Each journal remembers the head of the runs it writes (``_heads``),
    so the usual append is one insert; a head made stale by another writer costs one retry.
    """

    def record_event(self, event: dict, *, behind: bool = False) -> None:
        """Record one stage transition: upsert the stage's latest row and append the event, in
        ONE transaction. Usable directly as a StageTree listener.

        Args:
            event: ``{"run_id": str, "stage": dict, "from": str | None, "to": str, "ts": float}``;
                ``stage`` is the JSON-able stage dict after the transition, with at least ``id``
                (and usually ``parent_id``, ``kind``, ``level``, ``status``). ``from`` is
                ``None`` for the creation event. ``ts`` is unix seconds.
            behind: queue it (written behind: committed with the next durable record, a read,
                ``flush()`` or within ``WRITE_BEHIND_SECONDS``; see ``harness.journal.behind``)
                instead of committing it before returning.

        The stage row is only overwritten by an event whose ``ts`` is not older than the one that
        wrote it, so listener calls that arrive out of order cannot roll a stage back.

        Raises:
            JournalError: the event lacks a key, its stage is not JSON-able, or the write failed
                (for ``behind``: only the first two, and a closed journal).
        """
        try:
            run_id = event["run_id"]
            stage = event["stage"]
            stage_id = stage["id"]
            to_status = event["to"]
            ts = float(event["ts"])
            from_status = event.get("from")
        except (KeyError, TypeError, ValueError) as exc:
            raise JournalError(f"malformed stage event (needs run_id, stage.id, to, ts): "
                               f"{exc!r}; event: {event!r:.300}") from exc
        if behind:
            # written behind: the stage dict (a copy the listener owns) is serialized when
            # its batch commits, on the background writer, off the sub-call's own path
            self._defer(("event", "record queued events",
                         (run_id, stage_id, from_status, to_status, ts, stage),
                         (stage.get("parent_id"), stage.get("kind"), stage.get("level"))))
            return
        try:
            stage_json = dumps(stage)
        except (TypeError, ValueError) as exc:
            raise JournalError(f"stage {stage_id!r} of run {run_id!r} is not JSON-serializable: "
                               f"{exc}") from exc
        self._durable(("event", f"record event {stage_id!r} -> {to_status!r} of run {run_id!r}",
                       (run_id, stage_id, from_status, to_status, ts, stage_json),
                       (stage.get("parent_id"), stage.get("kind"), stage.get("level"))))

    def record_event_behind(self, event: dict) -> None:
        """``record_event(event, behind=True)``: the StageTree listener of a run (its
        transitions are written behind; see ``harness.journal.behind``)."""
        self.record_event(event, behind=True)

    def stages(self, run_id: str) -> list[dict]:
        """Return the latest dict of every stage of ``run_id``, in the order first recorded
        (``[]`` for an unknown run)."""
        rows = self._read(f"read the stages of run {run_id!r}", STAGE_SELECT, (run_id,))
        return [json.loads(r[0]) for r in rows]

    def events(self, run_id: str) -> list[dict]:
        """Return every recorded transition of ``run_id`` in recording order (``[]`` if none).

        Each is ``{"seq": int, "run_id", "stage_id", "from", "to", "ts": float, "stage": dict}``;
        ``seq`` increases strictly across the whole journal.
        """
        rows = self._read(f"read the events of run {run_id!r}", EVENT_SELECT, (run_id,))
        return [event_record(run_id, r) for r in rows]


class ModelCallRecords(WriteBehind):
    """The model-call methods of ``Journal``: ``record_model_call``, ``lookup_model_call``,
    ``model_calls``."""

    def record_model_call(self, run_id: str, call_id: str, *, request_hash: str, request: dict,
                          response: Any, usage: Any, attempts: Any,
                          replace: bool = False, behind: bool = False) -> bool:
        """Record one model call (request, response, usage, every attempt).

        Args:
            run_id, call_id: the call's key; ``call_id`` is its deterministic stage id.
            request_hash: ``request_hash(request)`` (sha256 hex). The response's own hash
                (``value_hash(response)``) is stored with it as ``response_hash``.
            request, response, usage, attempts: JSON-able values, stored as JSON.
            replace: overwrite an existing record of ``(run_id, call_id)``. For a resumed run
                that went live after a divergence (its calls from that point on supersede the
                recorded ones, so a later replay follows what the run really did). Default
                ``False``: a recorded call is never silently changed.
            behind: queue it (written behind, see ``harness.journal.behind``) and return
                ``True``; a conflict found when it is committed is logged, not raised. Without
                it (what a run does: a reply is in the journal before anything acts on it)
                the call is committed before this returns, in one commit with the other
                durable records written at the same time (group commit).

        Returns:
            ``True`` if recorded; ``False`` if the same ``(run_id, call_id)`` was already recorded
            with the same ``request_hash`` and ``replace`` is false (the first record is kept:
            recording is idempotent).

        Raises:
            ModelCallConflictError: the call id is recorded with a different request hash and
                ``replace`` is false.
            JournalError: a value is not JSON-able, or the write failed.
        """
        try:
            values = (dumps(request), dumps(response), dumps(usage), dumps(attempts))
        except (TypeError, ValueError) as exc:
            raise JournalError(f"model call {call_id!r} of run {run_id!r} is not "
                               f"JSON-serializable: {exc}") from exc
        on_conflict = ("DO UPDATE SET request_hash = excluded.request_hash, "
                       "request = excluded.request, response = excluded.response, "
                       "usage = excluded.usage, attempts = excluded.attempts, "
                       "created_at = excluded.created_at, response_hash = excluded.response_hash"
                       if replace else "DO NOTHING")
        item = ("call", f"record model call {call_id!r} of run {run_id!r}",
                "INSERT INTO model_calls (run_id, call_id, request_hash, request, response, "
                "usage, attempts, created_at, response_hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                f"ON CONFLICT (run_id, call_id) {on_conflict}",
                (run_id, call_id, request_hash, *values, time.time(), value_hash(response)),
                run_id, call_id, request_hash)
        if behind:
            self._defer(item)
            return True
        if self._durable(item) > 0:
            return True
        existing = self._read("look up a model call",
                              "SELECT request_hash FROM model_calls WHERE run_id = ? AND "
                              "call_id = ?", (run_id, call_id))
        if existing and existing[0][0] != request_hash:
            raise ModelCallConflictError(
                f"model call {call_id!r} of run {run_id!r} is already recorded with request hash "
                f"{existing[0][0][:12]}..., not {request_hash[:12]}...: the run diverged from its "
                f"journal; the journal keeps the first record (pass replace=True to supersede it)")
        return False

    def lookup_model_call(self, run_id: str, call_id: str) -> dict | None:
        """Return the recorded call ``(run_id, call_id)`` or ``None``.

        The dict has ``request_hash`` (str), ``request``, ``response``, ``usage``, ``attempts``
        (as recorded), plus ``call_id`` and ``created_at`` (unix seconds).
        """
        rows = self._read(f"look up model call {call_id!r} of run {run_id!r}",
                          f"SELECT {_CALL_COLUMNS} FROM model_calls "
                          f"WHERE run_id = ? AND call_id = ?", (run_id, call_id))
        return call_record(rows[0]) if rows else None

    def model_calls(self, run_id: str) -> list[dict]:
        """Return every recorded model call of ``run_id`` in recording order (dicts as
        ``lookup_model_call``)."""
        rows = self._read(f"read the model calls of run {run_id!r}", CALL_SELECT, (run_id,))
        return [call_record(r) for r in rows]


class CellRecords(WriteBehind):
    """The cell methods of ``Journal``: ``record_cell``, ``cells``."""

    def record_cell(self, run_id: str, stage_id: str, code: str, output: Any, *,
                    behind: bool = False) -> None:
        """Append one executed cell: its ``code`` (str) and JSON-able ``output`` (stdout, result,
        error, ...). A re-executed cell (resume, replay) appends another row. ``behind``: queue
        it (written behind, see ``harness.journal.behind``).

        Raises:
            JournalError: ``output`` is not JSON-able, or the write failed.
        """
        try:
            output_json = dumps(output)
        except (TypeError, ValueError) as exc:
            raise JournalError(f"output of cell {stage_id!r} of run {run_id!r} is not "
                               f"JSON-serializable: {exc}") from exc
        item = ("sql", f"record cell {stage_id!r} of run {run_id!r}",
                "INSERT INTO cells (run_id, stage_id, code, output, created_at) "
                "VALUES (?, ?, ?, ?, ?)", (run_id, stage_id, code, output_json, time.time()))
        if behind:
            self._defer(item)
        else:
            self._durable(item)

    def cells(self, run_id: str) -> list[dict]:
        """Return every recorded cell of ``run_id`` in recording order: dicts with ``seq``,
        ``stage_id``, ``code``, ``output``, ``created_at`` (unix seconds)."""
        rows = self._read(f"read the cells of run {run_id!r}", CELL_SELECT, (run_id,))
        return [cell_record(r) for r in rows]
