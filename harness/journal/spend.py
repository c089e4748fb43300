"""The spend ledger: every model call's reservation, written before the call is sent, then its
settlement or release. Append-only (schema version 2, table ``spend``).

Caps belong to the logical run, over all its attempts. A process can die with calls in flight:
their requests reached the provider (and may be billed) but no response was recorded. Because the
reservation is journaled *before* the request is sent, a resumed run finds it with neither a
settlement nor a release, and counts it at its reservation (an upper bound of what it can cost).

- ``record_spend``: append one row (``reserved``, ``settled`` or ``released``).
- ``spend``: the run's reservations folded into one record each, ready for
  ``harness.budget.accountant.Accountant.carry_over``. Model calls recorded without a ledger row (a journal
  written before version 2) count at their recorded usage.
- ``spend_totals`` (:func:`fold_spend`): what the run spent over every attempt, counted as its
  caps count it. Every view of a run's totals (``rlm show``, ``rlm view``, ``rlm runs``, the
  export) reads them here, so they agree after a resume.

This module imports only the standard library and ``harness.journal``'s own modules.
"""
from __future__ import annotations

import json
import time
from typing import Any

from harness.journal.encoding import dumps, loads
from harness.journal.errors import JournalError
from harness.journal.behind import WriteBehind

__all__ = ["SpendRecords", "SPEND_EVENTS", "fold_spend"]

#: The ledger's events, in the order one reservation goes through them.
SPEND_EVENTS = ("reserved", "settled", "released")

_SPEND_SELECT = ("SELECT reservation, call_id, event, model, calls, prompt_tokens, "
                 "completion_tokens, cost_usd, detail FROM spend WHERE run_id = ? ORDER BY seq")
_CALLS_SELECT = "SELECT call_id, request, usage FROM model_calls WHERE run_id = ? ORDER BY rowid"


# cost is added in the accountant's unit (10**-12 USD), so these totals equal what a resumed
# run's accountant carries over, to the last digit
_PUSD = 10 ** 12


def fold_spend(records: Any) -> dict:
    """Totals of ``records`` (what :meth:`SpendRecords.spend` returns): a settled call at its
    settled usage, a call left open (in flight when its attempt died) at its reservation, a
    released one not at all: the count a resumed run's caps start from.

    Returns:
        ``{"calls", "prompt_tokens", "completion_tokens", "total_tokens", "cost_usd",
        "open"}`` (ints; cost a float in USD; ``open``: calls counted at their reservation).
    """
    calls = pt = ct = pusd = opened = 0
    for rec in records:
        state = rec.get("state")
        if state not in ("settled", "open"):
            continue
        use = (rec.get("settled") if state == "settled" else rec.get("reserved")) or {}
        opened += state == "open"
        calls += int(use.get("calls", 1) or 0)
        pt += int(use.get("prompt_tokens") or 0)
        ct += int(use.get("completion_tokens") or 0)
        pusd += round(float(use.get("cost_usd") or 0.0) * _PUSD)
    return {"calls": calls, "prompt_tokens": pt, "completion_tokens": ct,
            "total_tokens": pt + ct, "cost_usd": pusd / _PUSD, "open": opened}


class SpendRecords(WriteBehind):
    """The spend-ledger methods of ``Journal``: ``record_spend``, ``spend``,
    ``spend_totals``."""

    def record_spend(self, run_id: str, call_id: str, reservation: str, event: str, *,
                     model: str | None = None, calls: int = 0, prompt_tokens: int = 0,
                     completion_tokens: int = 0, cost_usd: float = 0.0,
                     detail: Any = None, behind: bool = False) -> None:
        """Append one ledger row, committed before returning (with every record queued before it)
        unless ``behind``.

        Args:
            run_id, call_id: the run and the model call's stage id.
            reservation: the reservation's id, unique over every attempt (str).
            event: ``"reserved"`` (write it before sending: the amounts held), ``"settled"``
                (the amounts charged) or ``"released"`` (nothing charged).
            model: the model name; calls, prompt_tokens, completion_tokens (ints) and
                cost_usd (float, USD): the amounts of this event.
            detail: JSON-able extra (the estimate behind a reservation).
            behind: queue it (written behind, see ``harness.journal.behind``): for settlements
                and releases. A reservation must be durable before its call is sent: never
                pass ``behind`` for one.

        Raises:
            ValueError: an unknown ``event``.
            JournalError: ``detail`` is not JSON-able, or the write failed.
        """
        if event not in SPEND_EVENTS:
            raise ValueError(f"spend event must be one of {SPEND_EVENTS}, got {event!r}")
        try:
            detail_json = None if detail is None else dumps(detail)
        except (TypeError, ValueError) as exc:
            raise JournalError(f"spend detail of call {call_id!r} of run {run_id!r} is not "
                               f"JSON-serializable: {exc}") from exc
        if behind and event == "reserved":
            raise ValueError("a reservation is written before its call is sent: it cannot be "
                             "written behind")
        item = (
            "sql", f"record the {event} spend of call {call_id!r} of run {run_id!r}",
            "INSERT INTO spend (run_id, call_id, reservation, event, model, calls, "
            "prompt_tokens, completion_tokens, cost_usd, detail, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (run_id, call_id, reservation, event, model, int(calls), int(prompt_tokens),
             int(completion_tokens), float(cost_usd), detail_json, time.time()))
        if behind:
            self._defer(item)
        else:
            self._durable(item)

    def spend(self, run_id: str) -> list[dict]:
        """Every reservation of ``run_id`` over all its attempts, folded, in recording order.

        Each is ``{"reservation", "call_id", "model", "state", "reserved", "settled",
        "estimate"}``: ``state`` is ``"settled"``, ``"released"`` or ``"open"`` (reserved and
        then nothing: the process died with the call in flight); ``reserved`` and ``settled`` are
        ``{"calls", "prompt_tokens", "completion_tokens", "cost_usd"}`` (``settled`` None unless
        settled); ``estimate`` is the reservation's detail (``{}`` if none). A recorded model call
        of the run with no ledger row at all (written before schema version 2) comes as a
        settled record of its recorded usage, reservation id ``"model_call:<call_id>"``.
        """
        def read(conn: Any) -> tuple[list, list]:
            return (conn.execute(_SPEND_SELECT, (run_id,)).fetchall(),
                    conn.execute(_CALLS_SELECT, (run_id,)).fetchall())

        rows, calls = self._transaction(f"read the spend of run {run_id!r}", read,
                                        immediate=False)
        out: dict[str, dict] = {}
        ledgered: set[str] = set()
        for resv, call_id, event, model, n, pt, ct, cost, detail in rows:
            ledgered.add(call_id)
            amounts = {"calls": n, "prompt_tokens": pt, "completion_tokens": ct,
                       "cost_usd": cost}
            rec = out.get(resv)
            if rec is None:
                rec = out[resv] = {"reservation": resv, "call_id": call_id, "model": model,
                                   "state": "open", "reserved": None, "settled": None,
                                   "estimate": {}}
            if event == "reserved":
                rec["reserved"] = amounts
                rec["estimate"] = loads(detail) or {}
                rec["model"] = rec["model"] or model
            elif rec["state"] == "open":  # the first settlement or release closes it
                rec["state"] = event
                if event == "settled":
                    rec["settled"] = amounts
        for call_id, request, usage in calls:
            if call_id in ledgered:
                continue
            u = loads(usage) or {}
            try:
                model = (json.loads(request) or {}).get("model")
            except (TypeError, ValueError):
                model = None
            out[f"model_call:{call_id}"] = {
                "reservation": f"model_call:{call_id}", "call_id": call_id, "model": model,
                "state": "settled", "reserved": None, "estimate": {},
                "settled": {"calls": 1, "prompt_tokens": int(u.get("prompt_tokens") or 0),
                            "completion_tokens": int(u.get("completion_tokens") or 0),
                            "cost_usd": float(u.get("cost_usd") or 0.0)}}
        return list(out.values())

    def spend_totals(self, run_id: str) -> dict:
        """What ``run_id`` spent over every attempt (:func:`fold_spend` of :meth:`spend`):
        the one source of a run's totals for every view.

        Raises:
            JournalError: the read failed.
        """
        return fold_spend(self.spend(run_id))
