"""Hand-made stage events for the journal's storage tests (``test_journal``, ``test_journal_pg``):
a support module, not a test module."""
from __future__ import annotations

import time

from harness.journal import Journal


def stage(run_id: str, path: str, status: str, *, kind: str = "model_call", level: int = 0,
          ordinal: int = 0, evidence=None) -> dict:
    parent = path.rsplit("/", 1)[0] if "/" in path else run_id
    return {"id": f"{run_id}/{path}", "parent_id": f"{run_id}/{parent}" if "/" in path else run_id,
            "kind": kind, "level": level, "ordinal": ordinal, "status": status, "model": "m",
            "created_at": 1.0, "started_at": None, "ended_at": None, "prompt_tokens": 10,
            "completion_tokens": 2, "cost_usd": 0.001, "error": None, "evidence": evidence,
            "meta": {"note": "ünïcode ✓"}}


def event(run_id: str, st: dict, frm, to, ts=None) -> dict:
    return {"run_id": run_id, "stage": st, "from": frm, "to": to,
            "ts": time.time() if ts is None else ts}


def lifecycle(j: Journal, run_id: str, path: str, **kw) -> list[dict]:
    """Record pending -> running -> completed for one stage; return the events sent."""
    sent = []
    for frm, to in ((None, "pending"), ("pending", "running"), ("running", "completed")):
        ev = event(run_id, stage(run_id, path, to, evidence={"text": "ok"} if to == "completed"
                                 else None, **kw), frm, to)
        j.record_event(ev)
        sent.append(ev)
    return sent
