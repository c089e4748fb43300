"""Which recorded model call stands for a new one when a cell's sub-calls came in another order.

Stage ids are the path of a stage plus its ordinal under its parent, given in the order the
stages were made (``run/iteration-0/cell-0/llm_query-3/model_call-0``). A cell that makes its
sub-calls from threads, a process pool or ``asyncio`` makes them in an order the scheduler
decides, so the same cell, run again, can give ``llm_query-3`` the request that was
``llm_query-5`` before. :class:`SiblingMatch` maps each plain-completion sub-call stage of a
re-run (an ``llm_query`` or ``fallback`` segment of a call id, :data:`SUBCALL_KINDS`) to a
recorded sibling of the same kind under the same parent, decided by its call's request:

* its own ordinal first, when that recorded sibling holds this very request (the common case:
  nothing moved) and no other stage took it;
* else the first recorded sibling of its kind, in ordinal order, holding this request and not
  taken.

A match needs the same request hash, so requests that differ are never mixed up; identical
requests are interchangeable. Each recorded sibling stands for one new stage at most; later
calls inside a matched stage (a schema-checked fallback's retries) follow the mapping. A stage
matched to nothing keeps its own ordinal, so what follows is the plain lookup by id: a
divergence, or a call the journal does not hold.

Bookkeeping only: reads the journal, imports nothing from ``rlm`` or ``kernels``.
"""
from __future__ import annotations

import re
import threading
from typing import Any

__all__ = ["SUBCALL_KINDS", "SiblingMatch"]

#: The stage kinds of a cell's sub-calls matched as a set (``harness.stages.model.Kind``
#: values): the plain completions, whose one request is all that decides their answer. A
#: ``child`` is not: its first request shows its context's size, not its text, so children
#: of one cell with contexts of one size would look alike; children keep their ordinals.
SUBCALL_KINDS = ("llm_query", "fallback")
_SUBCALL = re.compile(r"(%s)-\d+" % "|".join(SUBCALL_KINDS))


class SiblingMatch:
    """The mapping of one re-run's sub-call stages onto a recorded run's. Thread-safe.

    Args:
        journal: the journal holding the recorded run (``lookup_model_call``, ``model_calls``).
        run_id: the recorded run (str).
        strict: a replay (every call is recorded). In a resume (False) a stage whose own
            ordinal holds no record keeps it (its call goes live and is recorded there).
    """

    def __init__(self, journal: Any, run_id: str, strict: bool = True) -> None:
        self.journal, self.run_id, self.strict = journal, run_id, strict
        self._map: dict[tuple[str, str], str] = {}  # (recorded parent, new seg) -> recorded seg
        self._taken: set[tuple[str, str]] = set()  # (recorded parent, recorded seg)
        self._hashes: dict[str, str] | None = None  # recorded call id -> request hash
        self._siblings: dict[tuple[str, str], list[str]] = {}  # (parent, kind) -> segs
        self._lock = threading.Lock()

    def recorded_id(self, call_id: str) -> str:
        """``call_id`` with every sub-call stage decided so far mapped (str)."""
        with self._lock:
            return "/".join(self._walk(call_id.split("/"))[0])

    def find(self, call_id: str, req_hash: str) -> dict | None:
        """The recorded call that stands for ``call_id`` (the journal's record, see
        ``Journal.lookup_model_call``), or None when the journal holds none for it.

        The record returned may hold another request than ``req_hash`` (a divergence: the
        caller compares); one of a sibling is returned only when it holds ``req_hash``.
        """
        with self._lock:
            segs, pending = self._walk(call_id.split("/"))
            rec, missing = None, False
            if pending is not None:
                segs, rec, missing = self._decide(segs, pending, req_hash)
            rid = "/".join(segs)
        if rec is not None or missing:
            return rec
        rec = self.journal.lookup_model_call(self.run_id, rid)
        if rec is None and rid != call_id:
            # a call a resumed run made live inside a matched stage is recorded under its own id
            raw = self.journal.lookup_model_call(self.run_id, call_id)
            if raw is not None and raw.get("request_hash") == req_hash:
                return raw
        return rec

    def _walk(self, segs: list[str]) -> tuple[list[str], tuple[int, str, str] | None]:
        """``segs`` with the decided sub-call segments mapped, and the first undecided one as
        ``(index, recorded parent, segment)`` (or None). The caller holds the lock."""
        out: list[str] = []
        pending = None
        for i, seg in enumerate(segs):
            if i < len(segs) - 1 and _SUBCALL.fullmatch(seg):
                parent = "/".join(out)
                got = self._map.get((parent, seg))
                if got is None:
                    got = seg
                    if pending is None:
                        pending = (i, parent, seg)
                out.append(got)
            else:
                out.append(seg)
        return out, pending

    def _decide(self, segs: list[str], pending: tuple[int, str, str],
                req_hash: str) -> tuple[list[str], dict | None, bool]:
        """Map the undecided sub-call stage ``pending`` (see the module docstring); returns
        ``segs`` with its choice, the record of its own ordinal when that was read and chosen
        (else None), and whether the journal holds nothing for it: its own ordinal stands for
        another stage and no sibling matched. The caller holds the lock."""
        i, parent, seg = pending
        if (parent, seg) not in self._taken:
            rec = self.journal.lookup_model_call(self.run_id, "/".join(segs))
            if rec is not None and rec.get("request_hash") == req_hash:
                return self._claim(segs, i, parent, seg, seg), rec, False
            if rec is None and not self.strict:
                # not recorded: a resume sends it live, recorded under its own id, so it must
                # not take a sibling's record that the stage still to come needs
                return self._claim(segs, i, parent, seg, seg), None, False
        hashes = self._index()
        kind = seg.rsplit("-", 1)[0]
        for cand in self._siblings.get((parent, kind), ()):
            if cand == seg or (parent, cand) in self._taken:
                continue
            rid = "/".join(segs[:i] + [cand] + segs[i + 1:])
            if hashes.get(rid) == req_hash:
                return self._claim(segs, i, parent, seg, cand), None, False
        # matched to nothing: it keeps its own ordinal, unless another stage stands for it
        if (parent, seg) not in self._taken:
            return self._claim(segs, i, parent, seg, seg), None, False
        return segs, None, True

    def _claim(self, segs: list[str], i: int, parent: str, seg: str, cand: str) -> list[str]:
        self._map[(parent, seg)] = cand
        self._taken.add((parent, cand))
        return segs[:i] + [cand] + segs[i + 1:]

    def _index(self) -> dict[str, str]:
        """The recorded calls' request hashes, and every parent's sub-call stages by kind in
        ordinal order (read from the journal once)."""
        if self._hashes is None:
            hashes: dict[str, str] = {}
            seen: dict[tuple[str, str], set] = {}
            for rec in self.journal.model_calls(self.run_id):
                cid = rec["call_id"]
                hashes[cid] = rec["request_hash"]
                segs = cid.split("/")
                for i, seg in enumerate(segs[:-1]):
                    m = _SUBCALL.fullmatch(seg)
                    if m:
                        key = ("/".join(segs[:i]), m.group(1))
                        if seg not in seen.setdefault(key, set()):
                            seen[key].add(seg)
                            self._siblings.setdefault(key, []).append(seg)
            for segs_ in self._siblings.values():
                segs_.sort(key=lambda s: int(s.rsplit("-", 1)[1]))
            self._hashes = hashes
        return self._hashes
