"""Recorded model calls as chat-format training examples (the OpenAI fine-tuning shape).

An example is ``{"messages": [{"role", "content"}, ...], "metadata": {...}}``: the messages
exactly as the journal recorded them being sent (the request of the ``model_calls`` row),
then the model's reply (the recorded response's text) as the last, ``assistant``, message.
Fine-tuning formats ignore ``metadata``; it carries the example's provenance.

Which calls (:func:`call_facts`): every completed ``model_call`` stage with a recorded reply.
Its *kind* is what the call was for, read from its parent stage:

============== ==================================================================
``turn``       one turn of an RLM loop (the root's at level 0, a child's below it)
``llm_query``  a plain sub-call from a cell (``llm_query``, ``llm_query_batched``)
``fallback``   ``rlm(...)`` at the depth limit, answered as a plain completion
``compaction`` the summary of older turns when a loop's conversation was compacted
``plain``      the one call of a plain-completion run (an eval's ``base`` method)
============== ==================================================================

Per call (``per="call"``), every call is one example. Per conversation
(``per="conversation"``), the turns of one loop collapse to the calls whose messages the next
turn does not extend: usually just the loop's last call (its messages plus its reply hold the
whole conversation as sent), and, where the conversation was compacted (or otherwise
rewritten) between two turns, also the last call before each rewrite, so no turn that was
sent is lost and none is sent twice. Other kinds are one call per conversation anyway.

Order is deterministic (runs in the order given; calls by their stage ids in program order,
not by when replies came back), and an example whose messages and reply equal an earlier
one's is dropped (:func:`dedupe`). Every string is passed through the key redaction of
:class:`rlm.serve.errors.Redactor` (the server's, for API keys and bearer tokens).
"""
from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Iterable, Iterator

from rlm.training.sources import Source, identity_sha256

__all__ = ["KINDS", "PER", "call_facts", "examples_of_run", "dedupe", "redact_value"]

#: What a call was for, by the kind of its parent stage.
KINDS = {"iteration": "turn", "llm_query": "llm_query", "fallback": "fallback",
         "compaction": "compaction", "run": "plain"}
#: The ways to cut a run into examples.
PER = ("call", "conversation")

#: Rank of a stage kind among its siblings, so a path sorts in program order: a loop
#: iteration compacts, then calls the model, then runs the reply's cells, whose sub-calls come
#: after; kinds with separate ordinal counters (llm_query, fallback, child) keep a fixed order.
_RANK = {"compaction": 0, "model_call": 1, "cell": 2, "llm_query": 3, "fallback": 4,
         "child": 5, "tool": 6, "iteration": 7}
_PART = re.compile(r"^(?P<kind>[a-z_]+)-(?P<n>\d+)$")


def stage_order(stage_id: str) -> tuple:
    """A sort key of a stage id in program order: ``run/iteration-10`` after
    ``run/iteration-9``, a turn's ``model_call`` before its ``cell``'s sub-calls."""
    key = []
    for part in stage_id.split("/"):
        m = _PART.match(part)
        key.append((_RANK.get(m["kind"], 9), m["kind"], int(m["n"])) if m else (-1, part, 0))
    return tuple(key)


def redact_value(value: Any, redact: Any) -> Any:
    """``value`` (JSON-like) with ``redact(text)`` applied to every string in it."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, list):
        return [redact_value(v, redact) for v in value]
    if isinstance(value, dict):
        return {k: redact_value(v, redact) for k, v in value.items()}
    return value


def call_facts(stages: list[dict], calls: list[dict]) -> list[dict]:
    """The completed model calls of one run that have a recorded reply, in program order.

    Args:
        stages: the run's stage dicts (``Journal.stages``); calls: its model-call records
            (``Journal.model_calls``).
    Returns:
        dicts ``{"stage_id", "kind", "level", "conversation", "turn", "request", "reply"}``:
        ``kind`` as in :data:`KINDS`; ``conversation`` the loop's stage id (``run`` or a
        ``.../child-N``) for a turn, else the call's own id; ``turn`` the iteration's ordinal
        (0 for other kinds); ``reply`` the response text.
    """
    by_id = {s["id"]: s for s in stages}
    recorded = {c["call_id"]: c for c in calls}
    out = []
    for s in stages:
        rec = recorded.get(s["id"])
        if s.get("kind") != "model_call" or s.get("status") != "completed" or rec is None:
            continue
        response = rec.get("response")
        reply = response.get("text") if isinstance(response, dict) else None
        if not isinstance(reply, str):
            continue
        parent = by_id.get(s.get("parent_id") or "", {})
        kind = KINDS.get(parent.get("kind"), str(parent.get("kind")))
        turn = kind == "turn"
        out.append({"stage_id": s["id"], "kind": kind, "level": int(s.get("level") or 0),
                    "conversation": (parent.get("parent_id") or "run") if turn else s["id"],
                    "turn": int(parent.get("ordinal") or 0) if turn else 0,
                    "request": rec.get("request") or {}, "reply": reply})
    out.sort(key=lambda c: stage_order(c["stage_id"]))
    return out


def _extends(later: list[dict], earlier: list[dict], reply: str) -> bool:
    """Whether ``later``'s messages start with ``earlier``'s plus its reply (the next turn of
    an unchanged conversation)."""
    head = list(earlier) + [{"role": "assistant", "content": reply}]
    return len(later) > len(head) and later[:len(head)] == head


def conversation_ends(facts: list[dict]) -> list[dict]:
    """The calls that end a conversation (see the module doc): of each loop's turns, those
    the next turn does not extend; every call of another kind. Program order kept."""
    turns: dict[str, list[dict]] = {}
    for c in facts:
        if c["kind"] == "turn":
            turns.setdefault(c["conversation"], []).append(c)
    keep = set()
    for seq in turns.values():
        seq.sort(key=lambda c: c["turn"])
        for a, b in zip(seq, seq[1:] + [None]):
            if b is None or not _extends(b["request"].get("messages") or [],
                                         a["request"].get("messages") or [], a["reply"]):
                keep.add(a["stage_id"])
    return [c for c in facts if c["kind"] != "turn" or c["stage_id"] in keep]


def _metadata(src: Source, c: dict, run: dict, version: str, covers: int) -> dict:
    """The provenance of one example (see docs/training.md, "Provenance")."""
    trial = src.trial or {}
    identity = trial.get("identity") if isinstance(trial.get("identity"), dict) else {}
    req = c["request"]
    meta = {
        "run_id": src.run_id, "stage_id": c["stage_id"], "kind": c["kind"],
        "level": c["level"], "conversation": c["conversation"], "turns": covers,
        "model": req.get("model"), "max_tokens": req.get("max_tokens"),
        "temperature": req.get("temperature"), "run_status": run.get("status"),
        "harness_version": identity.get("harness") or version,
    }
    if src.trial is not None:
        meta["trial"] = {k: trial.get(k) for k in ("key", "task", "length", "seed", "trial",
                                                   "method", "depth", "profile", "score",
                                                   "correct")}
        meta["trial"]["identity_sha256"] = identity_sha256(trial.get("identity"))
    return meta


def examples_of_run(journal: Any, src: Source, *, per: str = "call",
                    levels: Iterable[int] | None = None, kinds: Iterable[str] | None = None,
                    redact: Any = None, version: str = "") -> Iterator[dict]:
    """The chat examples of one run, in program order.

    Args:
        journal: an open :class:`harness.journal.Journal` holding ``src.run_id``.
        per: ``"call"`` or ``"conversation"`` (:data:`PER`).
        levels, kinds: keep only calls at these levels (0 the root) / of these kinds
            (:data:`KINDS` values); None keeps all.
        redact: ``text -> text`` applied to every string of the messages and metadata.
        version: the harness version named when the trial records none.
    Yields:
        ``{"messages": [...], "metadata": {...}}`` dicts.
    """
    run = journal.get_run(src.run_id) or {}
    facts = call_facts(journal.stages(src.run_id), journal.model_calls(src.run_id))
    covers = {c["stage_id"]: 1 for c in facts}
    if per == "conversation":
        ends = conversation_ends(facts)
        for c in ends:
            if c["kind"] == "turn":
                covers[c["stage_id"]] = 1 + sum(
                    1 for m in c["request"].get("messages") or [] if m.get("role") == "assistant")
        facts = ends
    levels = None if levels is None else set(levels)
    kinds = None if kinds is None else set(kinds)
    for c in facts:
        if (levels is not None and c["level"] not in levels) or \
                (kinds is not None and c["kind"] not in kinds):
            continue
        messages = [dict(m) for m in c["request"].get("messages") or []]
        messages.append({"role": "assistant", "content": c["reply"]})
        example = {"messages": messages,
                   "metadata": _metadata(src, c, run, version, covers[c["stage_id"]])}
        yield redact_value(example, redact) if redact is not None else example


def dedupe(examples: Iterable[dict]) -> tuple[list[dict], int]:
    """``(examples without repeats, how many were dropped)``: an example whose messages
    (reply included) equal an earlier one's is dropped, the first kept."""
    seen: set[str] = set()
    kept, dropped = [], 0
    for ex in examples:
        digest = hashlib.sha256(json.dumps(ex["messages"], sort_keys=True, ensure_ascii=False)
                                .encode("utf-8")).hexdigest()
        if digest in seen:
            dropped += 1
            continue
        seen.add(digest)
        kept.append(ex)
    return kept, dropped
