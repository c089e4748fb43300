"""Export: everything a journal holds about one run, as JSON Lines (``rlm export``, archives).

One JSON object per line, each with a ``"type"``, in this order: the run (``"run"``, the run
record of ``harness.journal.runs``), its stages (``"stage"``), events (``"event"``), model calls
(``"model_call"``), cells (``"cell"``) and tool calls (``"tool_call"``), each the dict the
corresponding ``Journal`` reader returns plus ``"type"`` and ``"run_id"``. All records are read in one transaction, so the export is
a consistent snapshot even while the run is still writing.

This module imports only the standard library and ``harness.journal``'s own modules.
"""
from __future__ import annotations

import json
from typing import IO, Any, Iterator

from harness.journal.errors import UnknownRunError
from harness.journal.records import (
    CALL_SELECT,
    CELL_SELECT,
    EVENT_SELECT,
    STAGE_SELECT,
    call_record,
    cell_record,
    event_record,
)
from harness.journal.runs import RUN_SELECT, run_record
from harness.journal.store import Store
from harness.journal.tool_calls import TOOL_CALL_SELECT, tool_call_record

__all__ = ["JsonlExport"]


class JsonlExport(Store):
    """The export method of ``Journal``: ``export_jsonl``."""

    def export_jsonl(self, run_id: str, fp: IO[str]) -> int:
        """Write everything about ``run_id`` to the text stream ``fp``, one JSON object per line.

        Lines in order: the run (``"type": "run"``, with ``"totals"``: what it spent over
        every attempt, ``Journal.spend_totals``), its stages (``"stage"``), events
        (``"event"``), model calls (``"model_call"``), cells (``"cell"``) and tool calls
        (``"tool_call"``), each a dict as
        returned by the corresponding reader plus ``"type"`` and ``"run_id"``. The records are read
        in one transaction, so the export is a consistent snapshot.

        Returns:
            the number of lines written.

        Raises:
            UnknownRunError: the journal has no run ``run_id``.
            JournalError: the read failed.
        """
        def read(conn: Any) -> list[list[tuple]]:
            return [conn.execute(sql, (run_id,)).fetchall()
                    for sql in (RUN_SELECT + " WHERE run_id = ?", STAGE_SELECT, EVENT_SELECT,
                                CALL_SELECT, CELL_SELECT, TOOL_CALL_SELECT)]

        run_row, stage_rows, event_rows, call_rows, cell_rows, tool_rows = self._transaction(
            f"export run {run_id!r}", read, immediate=False)
        if not run_row:
            raise UnknownRunError(f"no run {run_id!r} in journal {self.path}")

        totals = self.spend_totals(run_id)  # over every attempt, as every view counts them
        now = self.journal_now()  # liveness on the journal's clock (harness.journal.runs)

        def records() -> Iterator[dict]:
            yield {"type": "run", **run_record(run_row[0], now, self.stale_after,
                                               self._host, self._boot), "totals": totals}
            for (stage,) in stage_rows:
                yield {"type": "stage", "run_id": run_id, "stage": json.loads(stage)}
            for row in event_rows:
                yield {"type": "event", **event_record(run_id, row)}
            for row in call_rows:
                yield {"type": "model_call", "run_id": run_id, **call_record(row)}
            for row in cell_rows:
                cell = cell_record(row)
                # "seq" first, then "run_id": the key order the export has always written.
                yield {"type": "cell", "seq": cell["seq"], "run_id": run_id, **cell}
            for row in tool_rows:
                yield {"type": "tool_call", "run_id": run_id, **tool_call_record(row)}

        n = 0
        for record in records():
            fp.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += 1
        return n
