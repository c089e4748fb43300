"""``rlm verify``: check a journal's runs after the fact instead of believing them.

For each run, from one consistent snapshot of the journal (either store):

1. **chain**: the first event's ``prev_hash`` is the run's anchor (its inputs: query, models,
   depth, options with the context's sha256); every event's ``prev_hash`` is the previous event's
   ``hash`` and its ``hash`` covers its own columns. A changed, dropped, inserted or reordered
   event breaks the chain at that event.
2. **transitions**: every status change of a stage is a legal transition of
   ``harness.stages.model.TRANSITIONS`` from the status the stage was in (a terminal status is never
   left); a creation event (``from`` = null) starts a stage (again, on resume); the ``stages``
   table agrees with each stage's latest event (so a stage set back to ``running`` there, or a
   dropped last event, is caught).
3. **evidence**: every completed stage carries its evidence: a model call its response (and a
   ``model_calls`` row whose response, response hash and request hash match), a cell its code and
   output (and a ``cells`` row), a child, fallback or ``llm_query`` its answer, a completed run
   its answer set by an executed ``FINAL`` cell.
4. **usage**: a finished run's recorded token and cost totals equal the sum over its stages; a
   live model call's stage usage equals its ``model_calls`` usage.
5. **caps**: recorded totals stay within the run's budget caps, beyond them by at most the one
   call that was in flight when the cap was reached (the accountant admits on reservations).
6. **replayed calls**: a call served from the journal has its recorded call, whose request hash
   matches its request.
7. **record**: every stage, call and run record has the shape the harness writes (a field of
   the wrong type, as an edited or foreign journal may hold, is reported, never a crash).

``verify_run`` returns a ``Verdict`` (violations in event order, each naming its event's ``seq``
when there is one); ``verify_journal`` checks every run. This module imports only the standard
library and ``harness``'s bookkeeping modules.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable

from harness.budget.caps import CAPS
from harness.journal.encoding import event_hash, loads, request_hash, run_anchor, value_hash
from harness.journal.records import CALL_SELECT, CELL_SELECT, CHAIN_SELECT, call_record, cell_record
from harness.stages.model import TERMINAL, TRANSITIONS, Status

__all__ = ["Violation", "Verdict", "verify_run", "verify_journal", "violation_rate"]

_RUN_INPUTS = ("SELECT query, model, sub_model, max_depth, options, status, usage "
               "FROM runs WHERE run_id = ?")
_STAGE_ROWS = "SELECT stage_id, status, stage FROM stages WHERE run_id = ? ORDER BY first_seq"
_ANSWER_KINDS = ("child", "fallback", "llm_query", "compaction")  # compaction: its summary
_EPS = 1e-9


@dataclass(frozen=True)
class Violation:
    """One thing wrong with a run: ``check`` (chain, transition, evidence, usage, caps, replay,
    stages), the event's ``seq`` (``None`` when no single event is at fault) and a message."""

    check: str
    seq: int | None
    message: str

    def __str__(self) -> str:
        where = f"event {self.seq}" if self.seq is not None else "run"
        return f"{where}: [{self.check}] {self.message}"


@dataclass
class Verdict:
    """The result of verifying one run: ``ok`` when ``violations`` is empty."""

    run_id: str
    events: int = 0
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def first(self) -> Violation | None:
        """The first violation in event order (those naming no event last)."""
        if not self.violations:
            return None
        return min(self.violations, key=lambda v: (v.seq is None, v.seq or 0))

    def summary(self) -> str:
        if self.ok:
            return f"{self.run_id}: ok ({self.events} events)"
        return (f"{self.run_id}: VIOLATED ({len(self.violations)} violation(s); first bad "
                f"{self.first})")


def _snapshot(journal: Any, run_id: str) -> tuple:
    def read(conn: Any) -> tuple:
        return tuple(conn.execute(sql, (run_id,)).fetchall()
                     for sql in (_RUN_INPUTS, CHAIN_SELECT, _STAGE_ROWS, CALL_SELECT, CELL_SELECT))
    return journal._transaction(f"verify run {run_id!r}", read, immediate=False)


def verify_run(journal: Any, run_id: str) -> Verdict:
    """Check one run of ``journal`` (a ``harness.journal.Journal``); see the module docstring.

    Raises:
        UnknownRunError: the journal holds neither a run record nor events for ``run_id``.
    """
    from harness.journal.errors import UnknownRunError
    run_rows, event_rows, stage_rows, call_rows, cell_rows = _snapshot(journal, run_id)
    if not run_rows and not event_rows:
        raise UnknownRunError(f"no run {run_id!r} in journal {journal.path}")
    verdict = Verdict(run_id, events=len(event_rows))
    out = verdict.violations
    run = run_rows[0] if run_rows else None
    _check_chain(run_id, run, event_rows, out)
    try:
        latest = _check_transitions(event_rows, stage_rows, out)
        calls = {c["call_id"]: c for c in map(call_record, call_rows)}
        cells = [cell_record(r) for r in cell_rows]
        options = loads(run[4]) if run is not None else None
        plain = isinstance(options, dict) and bool(options.get("plain"))
        _check_evidence(latest, calls, cells, out, plain=plain)
        if run is not None:
            _check_usage_and_caps(run, latest, calls, out)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
        # A record whose JSON parses but not into the shape the harness writes (a field of
        # the wrong type): the run is malformed, which is a finding, not a crash of verify.
        out.append(Violation("record", None, f"a record does not have the shape the harness "
                             f"writes ({type(exc).__name__}: {exc}); the journal was altered "
                             f"or written by another program"))
    return verdict


def _check_chain(run_id: str, run: tuple | None, rows: list[tuple], out: list) -> None:
    prev = run_anchor(run_id, tuple(run[:5]) if run is not None else None)
    for seq, sid, frm, to, ts, stage, prev_hash, digest in rows:
        if digest is None:
            out.append(Violation("chain", seq, f"stage {sid}: event carries no hash (written "
                                 f"before schema version 3, or its hash was erased)"))
            return
        if prev_hash != prev:
            what = ("does not start from the run's inputs (query, options, context hash)"
                    if prev == run_anchor(run_id, tuple(run[:5]) if run else None)
                    and seq == rows[0][0] else "does not follow the previous event (an event "
                    "before it was dropped, inserted or reordered)")
            out.append(Violation("chain", seq, f"stage {sid}: hash chain broken: {what}"))
            return
        if event_hash(prev_hash, run_id, sid, frm, to, ts, stage) != digest:
            out.append(Violation("chain", seq, f"stage {sid}: event content changed after it "
                                 f"was recorded (hash mismatch)"))
            return
        prev = digest


def _check_transitions(rows: list[tuple], stage_rows: list[tuple], out: list) -> dict:
    """Walk each stage's events; return ``{stage_id: (seq, stage dict)}`` of its latest event."""
    status: dict[str, str] = {}
    latest: dict[str, tuple[int, float, dict]] = {}
    for seq, sid, frm, to, ts, stage_json, _p, _h in rows:
        try:
            stage = json.loads(stage_json)
        except ValueError:
            out.append(Violation("transition", seq, f"stage {sid}: stage JSON unreadable"))
            continue
        if to not in Status.__members__:
            out.append(Violation("transition", seq, f"stage {sid}: unknown status {to!r}"))
        elif frm is None:
            pass  # creation, or re-creation by a resumed attempt
        elif sid not in status:
            out.append(Violation("transition", seq, f"stage {sid}: {frm} -> {to} before the "
                                 f"stage was created"))
        elif frm != status[sid]:
            out.append(Violation("transition", seq, f"stage {sid}: event says {frm} -> {to} but "
                                 f"the stage was {status[sid]}"))
        elif frm == to and Status(to) not in TERMINAL:
            pass  # a field update of a live stage (usage, evidence), not a status change
        elif Status(frm) in TERMINAL:
            out.append(Violation("transition", seq, f"stage {sid}: terminal status {frm} left "
                                 f"for {to}"))
        elif Status(to) not in TRANSITIONS[Status(frm)]:
            out.append(Violation("transition", seq, f"stage {sid}: illegal transition "
                                 f"{frm} -> {to}"))
        status[sid] = to
        prior = latest.get(sid)
        if prior is None or ts >= prior[1]:
            latest[sid] = (seq, ts, stage)
    for sid, row_status, row_json in stage_rows:
        if sid not in latest:
            out.append(Violation("stages", None, f"stage {sid} is in the stages table but has "
                                 f"no events (its events were dropped)"))
            continue
        seq, _ts, stage = latest[sid]
        if row_status != stage.get("status") or loads(row_json) != stage:
            out.append(Violation("stages", seq, f"stage {sid}: stages table says {row_status} "
                                 f"but its latest event says {stage.get('status')}"))
    return {sid: (seq, stage) for sid, (seq, _ts, stage) in latest.items()}


def _check_evidence(latest: dict, calls: dict, cells: list[dict], out: list,
                    plain: bool = False) -> None:
    """Every completed stage has its evidence. ``plain``: a plain-completion run (``rlm eval``'s
    base method, no kernel), whose answer is its one model call's reply, not a FINAL cell's."""
    cell_ids = {c["stage_id"] for c in cells}
    finals: set[str] = set()
    for _s, st in latest.values():
        ev = st.get("evidence")
        if st.get("kind") == "cell" and st.get("status") == "completed" and isinstance(ev, dict) \
                and ev.get("final") is not None:
            finals.add(str(ev["final"]))
            check = ev.get("check")
            if isinstance(check, dict) and check.get("ok") and check.get("answer") is not None:
                finals.add(str(check["answer"]))  # a checked answer: its canonical form
    for sid, (seq, st) in latest.items():
        kind, ev, done = st.get("kind"), st.get("evidence"), st.get("status") == "completed"
        meta = st.get("meta")
        replayed = isinstance(meta, dict) and bool(meta.get("replayed"))
        if kind == "model_call" and (done or replayed):
            call = calls.get(sid)
            if done and ev is None:
                out.append(Violation("evidence", seq, f"model call {sid} completed without "
                                     f"its response"))
            elif call is None:
                out.append(Violation("replay" if replayed else "evidence", seq,
                                     f"model call {sid} has no recorded request and response"))
            else:
                _check_call(sid, seq, st, call, replayed, out)
        elif not done:
            continue
        elif kind == "cell":
            if not isinstance(ev, dict) or "code" not in ev or "output" not in ev:
                out.append(Violation("evidence", seq, f"cell {sid} completed without its code "
                                     f"and output"))
            elif sid not in cell_ids:
                out.append(Violation("evidence", seq, f"cell {sid} has no recorded cell"))
        elif kind in _ANSWER_KINDS and ev is None:
            out.append(Violation("evidence", seq, f"{kind} {sid} completed without its answer"))
        elif kind == "run" and plain:
            replies = {str(m["evidence"]) for _s, m in latest.values()
                       if m.get("kind") == "model_call" and m.get("status") == "completed"}
            if ev is None or str(ev) not in replies:
                out.append(Violation("evidence", seq, f"plain run {sid} completed with an "
                                     f"answer no completed model call replied"))
        elif kind == "run" and (ev is None or str(ev) not in finals):
            out.append(Violation("evidence", seq, f"run {sid} completed with an answer no "
                                 f"executed FINAL cell set"))


def _check_call(sid: str, seq: int, st: dict, call: dict, replayed: bool, out: list) -> None:
    check = "replay" if replayed else "evidence"
    if request_hash(call["request"]) != call["request_hash"]:
        out.append(Violation(check, seq, f"model call {sid}: recorded request does not match "
                             f"its request hash"))
    elif call.get("response_hash") is not None and \
            value_hash(call["response"]) != call["response_hash"]:
        out.append(Violation(check, seq, f"model call {sid}: recorded response does not match "
                             f"its response hash"))
    elif st.get("status") == "completed" and \
            (call["response"] or {}).get("text", "") != st.get("evidence"):
        out.append(Violation(check, seq, f"model call {sid}: recorded response differs from "
                             f"the response its completed event carries"))
    elif not replayed and st.get("status") == "completed" and call.get("usage"):
        u = call["usage"]
        if (u.get("prompt_tokens"), u.get("completion_tokens")) != \
                (st.get("prompt_tokens"), st.get("completion_tokens")):
            out.append(Violation("usage", seq, f"model call {sid}: stage usage "
                                 f"{st.get('prompt_tokens')}+{st.get('completion_tokens')} tokens "
                                 f"differs from the recorded call's"))


def _check_usage_and_caps(run: tuple, latest: dict, calls: dict, out: list) -> None:
    status, usage, options = run[5], loads(run[6]), loads(run[4]) or {}
    stages = [st for _s, st in latest.values()]
    tokens = sum((st.get("prompt_tokens") or 0) + (st.get("completion_tokens") or 0)
                 for st in stages)
    cost = sum(st.get("cost_usd") or 0.0 for st in stages)
    if status != "running" and isinstance(usage, dict) and "total_tokens" in usage:
        if usage.get("total_tokens") != tokens or abs((usage.get("cost_usd") or 0.0) - cost) > _EPS:
            out.append(Violation("usage", None, f"recorded run usage ({usage.get('total_tokens')} "
                                 f"tokens, ${usage.get('cost_usd') or 0:.6f}) does not equal the "
                                 f"sum over its stages ({tokens} tokens, ${cost:.6f})"))
    # Caps hold over the logical run (every attempt): its recorded calls, each id once.
    spent = [c.get("usage") or {} for c in calls.values()]
    budget = options.get("budget") or {}
    for cap in CAPS:
        if cap.per_call is None:  # not counted in calls (the wall clock)
            continue
        amounts = [cap.per_call(u) for u in spent]
        value, slack = sum(amounts), (max(amounts + [0]) if cap.slack else 0)
        limit = budget.get(cap.field)
        if limit is not None and value > limit + slack + _EPS:
            out.append(Violation("caps", None, f"{cap.field} = {limit} exceeded: {value} "
                                 f"{cap.unit} recorded, more than one in-flight call beyond "
                                 "the cap"))


def verify_journal(journal: Any, run_ids: Iterable[str] | None = None) -> list[Verdict]:
    """Verify ``run_ids`` (default: every run the journal holds, oldest first)."""
    if run_ids is None:
        rows = journal._read("list runs to verify",
                             "SELECT run_id FROM runs ORDER BY created_at, rowid", ())
        run_ids = [r[0] for r in rows]
    return [verify_run(journal, rid) for rid in run_ids]


def violation_rate(verdicts: list[Verdict]) -> float:
    """Runs with any violation / runs checked (0.0 for none checked)."""
    return sum(not v.ok for v in verdicts) / len(verdicts) if verdicts else 0.0
