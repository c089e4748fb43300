"""Resume and replay from the journal: which recorded model call may stand in for a new one.

A run is re-driven from its start; every model call asks :meth:`Replay.lookup` first. A call
whose id (its deterministic stage id) and request hash match the journal is served from it: not
sent, not paid again. What happens otherwise depends on the mode:

* **resume** (``strict=False``): a call the journal does not hold goes live; a call whose request
  differs is a *divergence*, handled by the policy: ``"stop"`` raises
  :class:`~harness.errors.DivergenceError` (nothing served for it), ``"live"`` records the
  divergence and sends this and every later call live.
* **replay** (``strict=True``): every call must be in the journal with the same request; anything
  else is a divergence (a finished run re-executes with zero model calls). A call the recorded
  run *refused* (its stage ended ``budget_exceeded`` with the refusal in ``meta.refused``) is
  refused again with the same :class:`~harness.errors.BudgetExceeded`, so a budget-stopped run
  replays to the same end.

The stored request is hashed again on lookup, so a journal edited after the fact is caught too.

The plain-completion sub-calls one cell makes (its ``llm_query`` and depth-limit fallback
stages) are matched as a *set* (:class:`harness.replay_match.SiblingMatch`): their ordinals
follow the order the cell made them in, which threads, process pools and ``asyncio`` leave to
chance, so a sub-call whose own ordinal holds another request is served the recorded sibling of
its kind with the same request (each recorded one serves once). Requests that differ are never
matched; a request the cell's recorded set does not hold is a divergence as before.

This module is bookkeeping only: it imports nothing from ``rlm`` or ``kernels``.
"""
from __future__ import annotations

import threading
from typing import Any

from harness.errors import BudgetExceeded, DivergenceError, RunActiveError, RunMismatchError
from harness.journal import request_hash
from harness.replay_match import SiblingMatch

__all__ = ["Replay", "RECORDED_STATES", "REPLAYABLE_STATES", "POLICIES", "check_same_run",
           "begin_resume", "replay_target"]

#: Journal states for which a run id returns the recorded result instead of running again.
#: ``failed``/``cancelled``/``crashed``/``interrupted`` runs are resumed instead (a retried
#: workflow step continues where it stopped).
RECORDED_STATES = ("completed", "budget_exceeded")

#: Journal states a finished run may be replayed from.
REPLAYABLE_STATES = ("completed", "failed", "budget_exceeded")

#: Divergence policies of a resume: stop with a report, or go live from the diverging call.
POLICIES = ("stop", "live")


class Replay:
    """Serves recorded model calls of one run, by call id and request hash. Thread-safe.

    Args:
        journal: a :class:`harness.journal.Journal` holding the run.
        run_id: the run whose calls are served (str).
        strict: ``True`` for replay (every call must be recorded), ``False`` for resume.
        policy: ``"stop"`` or ``"live"`` (see the module docstring); ignored when strict.

    Attributes:
        served: model calls served from the journal so far (int); ``tools_served``: tool calls.
        live_from: the first call id sent live after a divergence under ``"live"`` (or None).
        divergences: ``[{"call_id", "recorded_hash", "new_hash"}]`` found so far.
    """

    def __init__(self, journal: Any, run_id: str, *, strict: bool, policy: str = "stop") -> None:
        if policy not in POLICIES:
            raise ValueError(f"divergence policy must be one of {POLICIES}, got {policy!r}")
        self.journal, self.run_id, self.strict, self.policy = journal, run_id, strict, policy
        self.served = 0
        self.tools_served = 0
        self._tools_taken: set[str] = set()  # recorded tool calls served (each serves once)
        self._tool_rows: list[dict] | None = None  # the recorded run's, read when first needed
        self.live_from: str | None = None
        self.divergences: list[dict] = []
        self._lock = threading.Lock()
        self._refusals: dict[str, dict] | None = None
        self._matching = SiblingMatch(journal, run_id, strict=strict)

    def lookup(self, call_id: str, req_hash: str) -> dict | None:
        """The recorded call to serve for ``call_id`` whose request hashes to ``req_hash``.

        Returns:
            the journal's record (``response``, ``usage``, ... see
            ``Journal.lookup_model_call``), or ``None``: send this call live.
        Raises:
            BudgetExceeded: strict, and the recorded run refused this call (it does again).
            DivergenceError: strict and the call is not recorded; or the recorded request
                differs and the policy is ``"stop"`` (or strict).
        """
        if self.live_from is not None and self.policy == "live":
            return None
        rec = self._matching.find(call_id, req_hash)
        if rec is None:
            refused = self.refusal(self._matching.recorded_id(call_id)) if self.strict else None
            if refused is not None:
                raise BudgetExceeded(refused.get("cap", "?"), refused.get("limit", 0),
                                     refused.get("used", 0), refused.get("requested", 0))
            if self.strict:
                raise DivergenceError(self._not_recorded(f"call {call_id}"))
            return None
        stored = rec.get("request")
        stored_hash = request_hash(stored) if isinstance(stored, dict) else rec["request_hash"]
        if rec["request_hash"] == req_hash and stored_hash == req_hash:
            with self._lock:
                self.served += 1
            return rec
        with self._lock:
            self.divergences.append({"call_id": call_id, "recorded_hash": stored_hash,
                                     "new_hash": req_hash})
            if self.policy == "live" and not self.strict:
                self.live_from = self.live_from or call_id
                return None
        # a replay (strict) checks the run as recorded: there is nothing to go on with live
        advice = ("The recorded run is unchanged; a replay cannot pass this point." if self.strict
                  else "Resume with --on-divergence live to continue live from this point.")
        raise DivergenceError(
            f"divergence at call {call_id}: the request differs from the one recorded in run "
            f"{self.run_id} (a non-deterministic cell, or a changed prompt or model). "
            f"Nothing was served from the journal for it. {advice}")

    def _not_recorded(self, what: str, why: str = "") -> str:
        """The message for a call a replay needs and the journal does not hold: a run that
        ended before it was answered (a failed run: the endpoint down, say) stopped there, and
        resuming is what finishes it; a completed run took another path this time."""
        rec = self.journal.get_run(self.run_id) or {}
        state = rec.get("state")
        if state in REPLAYABLE_STATES and state not in RECORDED_STATES:  # failed: resumable
            error = rec.get("error")
            reason = error if isinstance(error, str) else (error or {}).get("reason", "")
            return (f"replay: {what} is not in the journal of run {self.run_id}: the run ended "
                    f"{state}" + (f" ({reason})" if reason else "") + " before it was answered, "
                    f"so a replay cannot pass this point{why}; to finish the run, resume it: "
                    f"`rlm resume {self.run_id}`")
        return (f"replay: {what} is not in the journal of run {self.run_id}; the run took a "
                f"different path{why}")

    def tool_call(self, call_id: str, req_hash: str) -> dict | None:
        """The recorded tool call to serve for ``call_id`` whose request hashes to ``req_hash``
        (the journal's record: ``status`` ``done``, ``failed`` or ``started``, ``result``,
        ``error``, ...), or None: the journal does not hold it (a resume makes the call).

        A recorded call of another request is a divergence, as for a model call: raised under
        ``"stop"`` (and always in a replay); under ``"live"`` the call is made again. A replay
        never calls a tool: a call the journal does not hold raises too.

        Raises:
            BudgetExceeded: strict, and the recorded run refused this call (it does again).
            DivergenceError: as above.
        """
        rec = self.journal.lookup_tool_call(self.run_id, call_id)
        same = rec is not None and self._tool_ok(rec, req_hash)
        if same and self._take_tool(call_id):
            with self._lock:
                self.tools_served += rec["status"] != "started"
            return rec
        sibling = self._tool_sibling(call_id, req_hash)
        if sibling is not None:
            return sibling
        if rec is None:
            refused = self.refusal(call_id) if self.strict else None
            if refused is not None:
                raise BudgetExceeded(refused.get("cap", "?"), refused.get("limit", 0),
                                     refused.get("used", 0), refused.get("requested", 0))
            if self.strict:
                raise DivergenceError(self._not_recorded(f"tool call {call_id}",
                                                         " (a replay never calls a tool)"))
            return None
        if same:  # served already, to a sibling: the cell made this call more often than then
            raise DivergenceError(
                f"divergence at tool call {call_id} ({rec['tool']}): the cell makes this call "
                f"more often than the recorded run {self.run_id} did. Nothing was served from "
                "the journal for it.")
        with self._lock:
            self.divergences.append({"call_id": call_id, "recorded_hash": rec["request_hash"],
                                     "new_hash": req_hash})
            if self.policy == "live" and not self.strict:
                self.live_from = self.live_from or call_id
                return None
        raise DivergenceError(
            f"divergence at tool call {call_id} ({rec['tool']}): its arguments differ from the "
            f"ones recorded in run {self.run_id}. Nothing was served from the journal for it. "
            + ("The recorded run is unchanged; a replay cannot pass this point." if self.strict
               else "Resume with --on-divergence live to call it with the new arguments."))

    @staticmethod
    def _tool_ok(rec: dict, req_hash: str) -> bool:
        return rec["request_hash"] == req_hash and request_hash(rec["request"]) == req_hash

    def _take_tool(self, call_id: str) -> bool:
        """Mark the recorded tool call ``call_id`` served; False if it was already."""
        with self._lock:
            if call_id in self._tools_taken:
                return False
            self._tools_taken.add(call_id)
            return True

    def _tool_sibling(self, call_id: str, req_hash: str) -> dict | None:
        """A finished recorded tool call of the same cell with the same request, not served
        yet: the tool calls one cell makes from threads or processes get their ordinals in
        the order they happen to arrive, so they are matched as a set (as its plain
        sub-calls are), each recorded call serving once."""
        parent = call_id.rsplit("/", 1)[0]
        with self._lock:
            if self._tool_rows is None:
                self._tool_rows = list(self.journal.tool_calls(self.run_id))
            rows = self._tool_rows
        for rec in rows:
            cid = rec["call_id"]
            if (cid.rsplit("/", 1)[0] == parent and cid.rsplit("/", 1)[-1].startswith("tool-")
                    and rec["status"] in ("done", "failed") and self._tool_ok(rec, req_hash)
                    and self._take_tool(cid)):
                with self._lock:
                    self.tools_served += 1
                return rec
        return None

    def refusal(self, call_id: str) -> dict | None:
        """How the recorded run refused ``call_id`` (``{"cap", "limit", "used", "requested"}``),
        or None if it did not."""
        with self._lock:
            if self._refusals is None:
                self._refusals = {}
                for st in self.journal.stages(self.run_id):
                    refused = (st.get("meta") or {}).get("refused")
                    if st.get("status") == "budget_exceeded" and isinstance(refused, dict):
                        self._refusals[st.get("id")] = refused
            return self._refusals.get(call_id)


def check_same_run(record: dict, query: str | None, context_sha256: str) -> None:
    """A run id names one question about one context: refuse to reuse it for another.

    Args:
        record: the run's journal record (``Journal.get_run``).
        query: the query given now (str | None); ``context_sha256``: the context's hash now.
    Raises:
        RunMismatchError: the query or the context differs from the recorded ones.
    """
    if (record.get("query") or "") != (query or ""):
        raise RunMismatchError(f"run id {record['run_id']!r} was recorded with another query "
                               f"({record.get('query')!r}); a new question needs a new run id")
    want = (record.get("options") or {}).get("context_sha256")
    if want and context_sha256 != want:
        raise RunMismatchError(f"run id {record['run_id']!r} was recorded with another context "
                               "(sha256 differs): resuming it needs the context it ran with, "
                               "and a new context needs a new run id")


def begin_resume(journal: Any, record: dict, policy: str = "stop") -> Replay | None:
    """Decide what a known run id means now, and claim the run when it is to be resumed.

    Args:
        journal: the journal holding ``record``; ``record``: from ``Journal.get_run``.
        policy: the divergence policy of the resume (``"stop"`` | ``"live"``).
    Returns:
        ``None`` when the run finished with a recorded result (state in
        :data:`RECORDED_STATES`: return that, run nothing); else a :class:`Replay` serving its
        recorded calls, the run now owned by this process.
    Raises:
        RunActiveError: the run is still running (fresh heartbeat), or another process
            claimed it first.
    """
    run_id = record["run_id"]
    if record["state"] in RECORDED_STATES:
        return None
    if record["state"] == "running":
        age = record.get("heartbeat_age") or 0.0  # on the journal's clock, not this host's
        raise RunActiveError(
            f"run {run_id} is still running (pid {record.get('owner_pid')} on "
            f"{record.get('owner_host')}, heartbeat {age:.0f} s ago); wait for it "
            "to finish, or resume it once its heartbeat is stale")
    if not journal.claim_run(run_id):
        now = journal.get_run(run_id) or {}
        raise RunActiveError(f"run {run_id} was already resumed by {now.get('owner_host')} "
                             f"(pid {now.get('owner_pid')}): another process claimed it first")
    return Replay(journal, run_id, strict=False, policy=policy)


def replay_target(record: dict) -> None:
    """Check that a run may be replayed (it finished).

    Raises:
        RunActiveError: the run has not finished (resume it instead).
    """
    if record["state"] not in REPLAYABLE_STATES:
        raise RunActiveError(f"run {record['run_id']} is {record['state']}; only a finished run "
                             "can be replayed (resume it with `rlm resume`)")


def same_answer(record: dict, answer: str | None) -> bool:
    """Whether a replay's ``answer`` (str | None) is the one ``record`` (a journal run record)
    holds. A budget-stopped run recorded before budget stops kept no partial but executed
    ``FINAL`` stored the model's last reply as its answer; replaying it now gives None, which
    is the same run, not a divergence."""
    if answer == record.get("answer"):
        return True
    return answer is None and record.get("state") == "budget_exceeded"
