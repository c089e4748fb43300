"""The journal's record of the user's tool calls (schema version 4, table ``tool_calls``).

A tool is a host function the kernel's code calls (``rlm.tool``); it may act on the world (write
a ticket, send a mail), so the journal keeps the at-most-once rule of durable workflow engines:

- ``record_tool_start``: a durable ``started`` row *before* the tool is called (a second attempt
  of the same call counts one more in ``attempts``);
- ``record_tool_result``: the outcome, durable before the kernel sees it: ``done`` with the
  result (JSON) or ``failed`` with the error text;
- ``lookup_tool_call`` / ``tool_calls``: what resume and replay serve instead of calling again.
  A row still ``started`` is a call whose process died while the tool ran: it may or may not
  have taken effect.

This module imports only the standard library and ``harness.journal``'s own modules.
"""
from __future__ import annotations

import time
from typing import Any

from harness.journal.behind import WriteBehind
from harness.journal.encoding import dumps, loads
from harness.journal.errors import JournalError

__all__ = ["ToolCallRecords", "TOOL_CALL_SELECT", "tool_call_record", "TOOL_STATUSES"]

#: A tool call's statuses in the journal, in the order it goes through them.
TOOL_STATUSES = ("started", "done", "failed")

_COLUMNS = ("call_id, tool, request_hash, request, status, result, error, attempts, started_at, "
            "finished_at")
#: The tool calls of a run (one ``?``: the run id), in recording order.
TOOL_CALL_SELECT = f"SELECT {_COLUMNS} FROM tool_calls WHERE run_id = ? ORDER BY rowid"


def tool_call_record(row: tuple) -> dict:
    """Decode a ``TOOL_CALL_SELECT`` row: ``call_id``, ``tool``, ``request_hash``, ``request``
    (dict), ``status``, ``result`` (as recorded), ``error`` (str | None), ``attempts`` (int),
    ``started_at``, ``finished_at`` (unix seconds | None)."""
    call_id, tool, rhash, request, status, result, error, attempts, started, finished = row
    return {"call_id": call_id, "tool": tool, "request_hash": rhash, "request": loads(request),
            "status": status, "result": loads(result), "error": error,
            "attempts": int(attempts or 0), "started_at": started, "finished_at": finished}


class ToolCallRecords(WriteBehind):
    """The tool-call methods of ``Journal``: ``record_tool_start``, ``record_tool_result``,
    ``lookup_tool_call``, ``tool_calls``, ``tool_call_attempts``."""

    def record_tool_start(self, run_id: str, call_id: str, *, tool: str, request_hash: str,
                          request: dict) -> None:
        """Record that tool call ``call_id`` is about to be made; committed before returning.

        Args:
            run_id, call_id: the call's key (``call_id``: the tool stage's id).
            tool: the tool's name; request: ``{"tool", "args", "kwargs"}`` (JSON-able);
            request_hash: ``request_hash(request)``.
        A row already there (a resumed run calling an idempotent tool again) goes back to
        ``started`` with one more attempt and its old outcome cleared.

        Raises:
            JournalError: ``request`` is not JSON-able, or the write failed.
        """
        try:
            req = dumps(request)
        except (TypeError, ValueError) as exc:
            raise JournalError(f"tool call {call_id!r} of run {run_id!r} is not "
                               f"JSON-serializable: {exc}") from exc
        self._durable(("sql", f"record the start of tool call {call_id!r} of run {run_id!r}",
                       "INSERT INTO tool_calls (run_id, call_id, tool, request_hash, request, "
                       "status, attempts, started_at) VALUES (?, ?, ?, ?, ?, 'started', 1, ?) "
                       "ON CONFLICT (run_id, call_id) DO UPDATE SET tool = excluded.tool, "
                       "request_hash = excluded.request_hash, request = excluded.request, "
                       "status = 'started', result = NULL, error = NULL, finished_at = NULL, "
                       "attempts = tool_calls.attempts + 1, started_at = excluded.started_at",
                       (run_id, call_id, tool, request_hash, req, time.time())))

    def record_tool_result(self, run_id: str, call_id: str, *, status: str, result: Any = None,
                           error: str | None = None) -> None:
        """Record the outcome of a started tool call; committed before returning.

        Args:
            status: ``"done"`` (``result``: JSON-able) or ``"failed"`` (``error``: its text).

        Raises:
            ValueError: another ``status``. JournalError: ``result`` is not JSON-able, no such
                started call, or the write failed.
        """
        if status not in ("done", "failed"):
            raise ValueError(f"a tool call's outcome is 'done' or 'failed', got {status!r}")
        try:
            res = None if status == "failed" else dumps(result)
        except (TypeError, ValueError) as exc:
            raise JournalError(f"result of tool call {call_id!r} of run {run_id!r} is not "
                               f"JSON-serializable: {exc}") from exc
        n = self._durable(("sql", f"record the outcome of tool call {call_id!r} of run "
                           f"{run_id!r}", "UPDATE tool_calls SET status = ?, result = ?, "
                           "error = ?, finished_at = ? WHERE run_id = ? AND call_id = ?",
                           (status, res, error, time.time(), run_id, call_id)))
        if n == 0:
            raise JournalError(f"tool call {call_id!r} of run {run_id!r} has no started record "
                               "to finish")

    def lookup_tool_call(self, run_id: str, call_id: str) -> dict | None:
        """The recorded tool call ``(run_id, call_id)`` (see :func:`tool_call_record`) or None."""
        rows = self._read(f"look up tool call {call_id!r} of run {run_id!r}",
                          f"SELECT {_COLUMNS} FROM tool_calls WHERE run_id = ? AND call_id = ?",
                          (run_id, call_id))
        return tool_call_record(rows[0]) if rows else None

    def tool_calls(self, run_id: str) -> list[dict]:
        """Every recorded tool call of ``run_id``, in recording order (see
        :func:`tool_call_record`; ``[]`` for none)."""
        rows = self._read(f"read the tool calls of run {run_id!r}", TOOL_CALL_SELECT, (run_id,))
        return [tool_call_record(r) for r in rows]

    def tool_call_attempts(self, run_id: str) -> int:
        """How many times the run's tools were called over all its attempts (int): what a
        resumed run's ``max_tool_calls`` starts from."""
        rows = self._read(f"count the tool calls of run {run_id!r}",
                          "SELECT COALESCE(SUM(attempts), 0) FROM tool_calls WHERE run_id = ?",
                          (run_id,))
        return int(rows[0][0] or 0) if rows else 0
