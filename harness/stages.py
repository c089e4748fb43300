"""Stages: every unit of work in a run, their status table and the in-memory stage tree.

A *stage* is one unit of work (the run, a loop iteration, a model call, an executed cell, an
``llm_query``, a child RLM, a fallback completion). Its status moves through the single table
:data:`TRANSITIONS`; a transition is compare-and-set against the expected prior status; terminal
statuses are absorbing; an illegal transition raises :class:`~harness.errors.IllegalTransition`
and changes nothing (neither the tree nor any listener, e.g. the journal, hears of it).

Stage ids are deterministic: ``"run"`` for the root, ``f"{parent_id}/{kind}-{ordinal}"`` below
it, where ``ordinal`` counts the stages of that kind under that parent in submission order. The
same program with the same model responses therefore produces the same ids, which is what replay
and resume key on.

Listener events
---------------
Listeners are callables taking one ``dict``. They are called while the tree's lock is held, so
the order in which listeners see events is exactly the order in which the changes happened.
Every event has the keys ``event``, ``run_id``, ``stage`` (``Stage.to_dict()`` after the change),
``from``, ``to`` (status values as ``str``; ``from`` is ``None`` on creation) and ``ts`` (wall
clock, epoch seconds). ``event`` is one of:

* ``"created"``: a new pending stage (``from`` ``None``, ``to`` ``"pending"``);
* ``"transition"``: a status change;
* ``"usage"``: token/cost counters of a stage were increased (``from == to``);
* ``"rollback"``: compensation, see below.

**Listener failure rolls the change back.** If a listener raises, the change is undone in memory
(the stage is removed again, or its status and fields restored), every listener that had already
received the event is sent a ``"rollback"`` event whose ``stage`` is the restored state (``stage``
is the removed stage and ``to`` is ``None`` for an undone creation), and the listener's exception
propagates to the caller. Errors raised by listeners while handling a rollback are logged and
suppressed, so the original error is the one the caller sees. Put the journal first in the listener
list: then a journal that fails to write means memory is rolled back and no other listener has
seen the change, so the journal never disagrees with memory.

Listeners must not call back into the same tree (the lock is not re-entrant); doing so raises
``RuntimeError`` instead of deadlocking.

This module is pure standard library and imports nothing from ``rlm`` or ``kernels``.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterable, Mapping, Sequence

from harness.errors import IllegalTransition

__all__ = [
    "Status", "TERMINAL", "TRANSITIONS", "Kind", "Stage", "Usage", "StageTree", "Listener",
]

log = logging.getLogger(__name__)

Listener = Callable[[dict], None]


class Status(str, Enum):
    """Status of a stage. The value is the lower-case name (``Status.running == "running"``)."""

    pending = "pending"
    running = "running"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"
    budget_exceeded = "budget_exceeded"

    def __str__(self) -> str:  # "running", not "Status.running"
        return self.value

    @property
    def terminal(self) -> bool:
        """``True`` for an absorbing status (no transition leaves it)."""
        return self in TERMINAL


#: Absorbing statuses: once a stage is in one of these, no transition leaves it.
TERMINAL: frozenset[Status] = frozenset(
    {Status.completed, Status.failed, Status.cancelled, Status.budget_exceeded})

#: The one transition table: ``TRANSITIONS[a]`` is the set of statuses reachable from ``a``.
#: Terminal statuses map to the empty set.
TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.pending: frozenset(
        {Status.running, Status.cancelled, Status.budget_exceeded, Status.failed}),
    Status.running: frozenset(
        {Status.completed, Status.failed, Status.cancelled, Status.budget_exceeded}),
    Status.completed: frozenset(),
    Status.failed: frozenset(),
    Status.cancelled: frozenset(),
    Status.budget_exceeded: frozenset(),
}
assert set(TRANSITIONS) == set(Status), "every status needs a row in TRANSITIONS"
assert all(not TRANSITIONS[s] for s in TERMINAL), "terminal statuses must be absorbing"


class Kind(str, Enum):
    """Kind of work a stage stands for. The value is used in stage ids (``run/iteration-0``)."""

    run = "run"
    iteration = "iteration"
    model_call = "model_call"
    cell = "cell"
    llm_query = "llm_query"
    child = "child"
    fallback = "fallback"

    def __str__(self) -> str:
        return self.value


ROOT_ID = "run"

# Fields ``transition(**fields)`` may set. Identity fields (id, parent, kind, level, ordinal),
# status and created_at are not settable; status only moves through the table.
_SETTABLE = frozenset({
    "model", "started_at", "ended_at", "prompt_tokens", "completion_tokens", "calls",
    "cost_usd", "error", "evidence", "meta",
})


@dataclass
class Stage:
    """One unit of work.

    Attributes:
        id: deterministic path id, ``"run"`` or ``f"{parent_id}/{kind}-{ordinal}"`` (str).
        parent_id: id of the parent stage, ``None`` for the run (str | None).
        kind: what the stage is (:class:`Kind`).
        level: recursion level of the loop the stage belongs to; the root loop is 0 (int).
        ordinal: index among the parent's stages of the same kind, in submission order (int).
        status: current :class:`Status`.
        model: model name for model-calling stages (str | None).
        created_at, started_at, ended_at: wall clock, epoch seconds (float | None).
            ``started_at`` is set on the transition to ``running``, ``ended_at`` on the
            transition to a terminal status, unless given explicitly.
        prompt_tokens, completion_tokens: the stage's *own* token counts (int, tokens).
        calls: the stage's own number of model calls (int).
        cost_usd: the stage's own cost (float, USD).
        error: error text for failed/cancelled/budget_exceeded stages (str | None).
        evidence: JSON-able proof of the outcome: the model reply text, the cell output, the
            child's answer.
        meta: free-form JSON-able dict.
    """

    id: str
    parent_id: str | None
    kind: Kind
    level: int
    ordinal: int
    status: Status = Status.pending
    model: str | None = None
    created_at: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    calls: int = 0
    cost_usd: float = 0.0
    error: str | None = None
    evidence: Any = None
    meta: dict = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        """``prompt_tokens + completion_tokens`` (int, tokens)."""
        return self.prompt_tokens + self.completion_tokens

    @property
    def seconds(self) -> float | None:
        """Elapsed wall seconds from start to end (float), ``None`` unless both are set."""
        if self.started_at is None or self.ended_at is None:
            return None
        return self.ended_at - self.started_at

    def to_dict(self) -> dict:
        """JSON-able dict of all fields; ``kind`` and ``status`` as their string values.

        ``meta`` is copied (one level); ``evidence`` is included as is.
        """
        return {
            "id": self.id,
            "parent_id": self.parent_id,
            "kind": self.kind.value,
            "level": self.level,
            "ordinal": self.ordinal,
            "status": self.status.value,
            "model": self.model,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "calls": self.calls,
            "cost_usd": self.cost_usd,
            "error": self.error,
            "evidence": self.evidence,
            "meta": dict(self.meta) if self.meta else {},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Stage":
        """Rebuild a stage from :meth:`to_dict` output. Unknown keys are ignored."""
        return cls(
            id=d["id"],
            parent_id=d.get("parent_id"),
            kind=Kind(d["kind"]),
            level=int(d.get("level", 0)),
            ordinal=int(d.get("ordinal", 0)),
            status=Status(d.get("status", Status.pending.value)),
            model=d.get("model"),
            created_at=d.get("created_at"),
            started_at=d.get("started_at"),
            ended_at=d.get("ended_at"),
            prompt_tokens=int(d.get("prompt_tokens", 0) or 0),
            completion_tokens=int(d.get("completion_tokens", 0) or 0),
            calls=int(d.get("calls", 0) or 0),
            cost_usd=float(d.get("cost_usd", 0.0) or 0.0),
            error=d.get("error"),
            evidence=d.get("evidence"),
            meta=dict(d.get("meta") or {}),
        )

    def _copy(self) -> "Stage":
        return dataclasses.replace(self, meta=dict(self.meta))


@dataclass
class Usage:
    """Aggregated model usage.

    Attributes:
        prompt_tokens, completion_tokens: tokens (int).
        calls: model calls (int).
        cost_usd: cost (float, USD).
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    calls: int = 0
    cost_usd: float = 0.0

    @property
    def total_tokens(self) -> int:
        """``prompt_tokens + completion_tokens`` (int, tokens)."""
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: "Usage") -> "Usage":
        if not isinstance(other, Usage):
            return NotImplemented
        return Usage(self.prompt_tokens + other.prompt_tokens,
                     self.completion_tokens + other.completion_tokens,
                     self.calls + other.calls,
                     self.cost_usd + other.cost_usd)

    def to_dict(self) -> dict:
        """``{prompt_tokens, completion_tokens, total_tokens, calls, cost_usd}``."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "calls": self.calls,
            "cost_usd": self.cost_usd,
        }

    def _add_stage(self, s: Stage) -> None:
        self.prompt_tokens += s.prompt_tokens
        self.completion_tokens += s.completion_tokens
        self.calls += s.calls
        self.cost_usd += s.cost_usd


def _has_usage(s: Stage) -> bool:
    return bool(s.calls or s.prompt_tokens or s.completion_tokens or s.cost_usd)


class StageTree:
    """The stages of one run, behind one lock.

    Args:
        run_id: id of the run (str); included in every listener event.
        listeners: callables receiving event dicts (see the module docstring), called under the
            lock in registration order. A listener that raises rolls the change back.
        clock: wall clock returning epoch seconds (float); ``time.time`` by default.

    All methods are thread-safe. Stages returned by the tree are *copies*: mutating them does not
    change the tree; the only way to change a stage is :meth:`transition` / :meth:`add_usage`.
    """

    def __init__(self, run_id: str, listeners: Sequence[Listener] = (), *,
                 clock: Callable[[], float] = time.time) -> None:
        self.run_id = run_id
        self._listeners: list[Listener] = list(listeners)
        self._clock = clock
        self._lock = threading.Lock()
        self._notifying: int | None = None  # thread id while listeners run (re-entrancy guard)
        self._stages: dict[str, Stage] = {}  # insertion order == creation order
        self._children: dict[str, list[str]] = {}
        self._next_ordinal: dict[tuple[str, Kind], int] = {}

    # ------------------------------------------------------------------ listeners

    def add_listener(self, listener: Listener) -> None:
        """Append a listener (called after the existing ones)."""
        with self._locked():
            self._listeners.append(listener)

    def _locked(self) -> threading.Lock:
        if self._notifying == threading.get_ident():
            raise RuntimeError("a StageTree listener must not call back into the same tree")
        return self._lock

    def _emit(self, event: dict, undo: Callable[[], dict]) -> None:
        """Deliver ``event`` to every listener; on failure undo and compensate. Lock held."""
        if not self._listeners:
            return
        self._notifying = threading.get_ident()
        try:
            for i, listener in enumerate(self._listeners):
                try:
                    listener(event)
                except BaseException:
                    rollback = undo()
                    for earlier in self._listeners[:i]:
                        try:
                            earlier(rollback)
                        except Exception:  # the original error is the one to report
                            log.exception("StageTree listener failed while handling a rollback")
                    raise
        finally:
            self._notifying = None

    def _event(self, kind: str, stage: Stage, frm: Status | None, to: Status | None,
               ts: float) -> dict:
        return {
            "event": kind,
            "run_id": self.run_id,
            "stage": stage.to_dict(),
            "from": frm.value if frm is not None else None,
            "to": to.value if to is not None else None,
            "ts": ts,
        }

    # ------------------------------------------------------------------ mutation

    def new_stage(self, parent_id: str | None, kind: Kind | str, level: int,
                  model: str | None = None, meta: dict | None = None, *,
                  ordinal: int | None = None) -> Stage:
        """Create a pending stage and emit a ``"created"`` event.

        Args:
            parent_id: id of an existing stage, or ``None`` for the root (which must have kind
                ``run`` and gets id ``"run"``; only one root per tree).
            kind: :class:`Kind` or its string value.
            level: recursion level (int, root loop 0, >= 0).
            model: model name (str | None).
            meta: JSON-able dict stored on the stage (copied).
            ordinal: explicit ordinal (int >= 0) instead of the next free one for
                ``(parent_id, kind)``; later automatic ordinals continue after the highest used.

        Returns:
            A copy of the new :class:`Stage`, id ``f"{parent_id}/{kind}-{ordinal}"``.

        Raises:
            KeyError: unknown ``parent_id``.
            ValueError: bad kind/parent combination, negative level/ordinal, duplicate id.
            Exception: whatever a listener raised (the stage is then not created).
        """
        kind = Kind(kind)
        if level < 0:
            raise ValueError(f"level must be >= 0, got {level}")
        if ordinal is not None and ordinal < 0:
            raise ValueError(f"ordinal must be >= 0, got {ordinal}")
        with self._locked():
            if parent_id is None:
                if kind is not Kind.run:
                    raise ValueError(f"only a stage of kind 'run' may have no parent, got {kind}")
                if ROOT_ID in self._stages:
                    raise ValueError("this tree already has a root stage 'run'")
                sid, ordn = ROOT_ID, 0 if ordinal is None else ordinal
                key = None
            else:
                if kind is Kind.run:
                    raise ValueError("a stage of kind 'run' must be the root (parent_id=None)")
                if parent_id not in self._stages:
                    raise KeyError(f"unknown parent stage {parent_id!r}")
                key = (parent_id, kind)
                nxt = self._next_ordinal.get(key, 0)
                ordn = nxt if ordinal is None else ordinal
                sid = f"{parent_id}/{kind.value}-{ordn}"
                if sid in self._stages:
                    raise ValueError(f"duplicate stage id {sid!r}")
            now = self._clock()
            stage = Stage(id=sid, parent_id=parent_id, kind=kind, level=level, ordinal=ordn,
                          model=model, created_at=now, meta=dict(meta) if meta else {})
            self._stages[sid] = stage
            self._children[sid] = []
            if parent_id is not None:
                self._children[parent_id].append(sid)
            prev_next = None
            if key is not None:
                prev_next = self._next_ordinal.get(key)
                self._next_ordinal[key] = max(prev_next or 0, ordn + 1)

            def undo() -> dict:
                del self._stages[sid]
                del self._children[sid]
                if parent_id is not None:
                    self._children[parent_id].remove(sid)
                if key is not None:
                    if prev_next is None:
                        self._next_ordinal.pop(key, None)
                    else:
                        self._next_ordinal[key] = prev_next
                return self._event("rollback", stage, Status.pending, None, self._clock())

            self._emit(self._event("created", stage, None, Status.pending, now), undo)
            return stage._copy()

    def transition(self, stage_id: str, expected: Status | str, new: Status | str,
                   **fields: Any) -> Stage:
        """Compare-and-set the status of a stage, optionally setting fields in the same step.

        Args:
            stage_id: id of the stage (str).
            expected: the status the caller believes the stage is in.
            new: the status to move to; must be in ``TRANSITIONS[expected]``.
            **fields: stage fields to set together with the status: ``model``, ``started_at``,
                ``ended_at``, ``prompt_tokens``, ``completion_tokens``, ``calls``, ``cost_usd``,
                ``error``, ``evidence``, ``meta`` (replaces the dict). ``started_at`` is set to
                now on ``-> running`` and ``ended_at`` on a terminal status unless given.

        Returns:
            A copy of the stage after the change.

        Raises:
            IllegalTransition: the current status is not ``expected``, or ``expected -> new`` is
                not in :data:`TRANSITIONS`. Nothing changes, no listener is called.
            KeyError: unknown stage id. TypeError: a field that cannot be set.
            Exception: whatever a listener raised; the change is then rolled back (see module
                docstring).
        """
        expected = Status(expected)
        new = Status(new)
        bad = set(fields) - _SETTABLE
        if bad:
            raise TypeError(f"transition() cannot set {sorted(bad)}; settable: {sorted(_SETTABLE)}")
        with self._locked():
            stage = self._stages.get(stage_id)
            if stage is None:
                raise KeyError(f"unknown stage {stage_id!r}")
            if stage.status is not expected:
                raise IllegalTransition(
                    f"stage {stage_id!r}: expected status {expected.value!r} but it is "
                    f"{stage.status.value!r} (wanted -> {new.value!r})")
            if new not in TRANSITIONS[expected]:
                allowed = ", ".join(sorted(s.value for s in TRANSITIONS[expected])) or "nothing"
                raise IllegalTransition(
                    f"stage {stage_id!r}: {expected.value!r} -> {new.value!r} is not allowed "
                    f"({expected.value!r} may go to: {allowed})")
            now = self._clock()
            if new is Status.running and "started_at" not in fields:
                fields["started_at"] = now
            if new in TERMINAL and "ended_at" not in fields:
                fields["ended_at"] = now
            if "meta" in fields:
                fields["meta"] = dict(fields["meta"] or {})
            old = {name: getattr(stage, name) for name in fields}
            old_status = stage.status
            for name, value in fields.items():
                setattr(stage, name, value)
            stage.status = new

            def undo() -> dict:
                for name, value in old.items():
                    setattr(stage, name, value)
                stage.status = old_status
                return self._event("rollback", stage, new, old_status, self._clock())

            self._emit(self._event("transition", stage, old_status, new, now), undo)
            return stage._copy()

    def add_usage(self, stage_id: str, prompt_tokens: int, completion_tokens: int,
                  cost_usd: float, calls: int = 1) -> Stage:
        """Add to a stage's own counters (for model-call stages) and emit a ``"usage"`` event.

        Allowed in any status (a call in flight when its stage was cancelled still cost money).

        Args:
            prompt_tokens, completion_tokens: tokens to add (int >= 0).
            cost_usd: USD to add (float >= 0).
            calls: model calls to add (int >= 0), 1 by default.

        Returns:
            A copy of the stage after the change.
        """
        if prompt_tokens < 0 or completion_tokens < 0 or cost_usd < 0 or calls < 0:
            raise ValueError("usage to add must be non-negative")
        with self._locked():
            stage = self._stages.get(stage_id)
            if stage is None:
                raise KeyError(f"unknown stage {stage_id!r}")
            old = (stage.prompt_tokens, stage.completion_tokens, stage.calls, stage.cost_usd)
            stage.prompt_tokens += prompt_tokens
            stage.completion_tokens += completion_tokens
            stage.calls += calls
            stage.cost_usd += cost_usd

            def undo() -> dict:
                (stage.prompt_tokens, stage.completion_tokens, stage.calls,
                 stage.cost_usd) = old
                return self._event("rollback", stage, stage.status, stage.status, self._clock())

            self._emit(self._event("usage", stage, stage.status, stage.status, self._clock()),
                       undo)
            return stage._copy()

    # ------------------------------------------------------------------ queries

    def get(self, stage_id: str) -> Stage:
        """A copy of the stage with this id. Raises ``KeyError`` if unknown."""
        with self._locked():
            try:
                return self._stages[stage_id]._copy()
            except KeyError:
                raise KeyError(f"unknown stage {stage_id!r}") from None

    def __contains__(self, stage_id: object) -> bool:
        with self._locked():
            return stage_id in self._stages

    def __len__(self) -> int:
        with self._locked():
            return len(self._stages)

    def children(self, stage_id: str) -> list[Stage]:
        """Copies of the direct children of ``stage_id``, in creation order."""
        with self._locked():
            if stage_id not in self._children:
                raise KeyError(f"unknown stage {stage_id!r}")
            return [self._stages[c]._copy() for c in self._children[stage_id]]

    def all(self) -> list[Stage]:
        """Copies of all stages, in creation order."""
        with self._locked():
            return [s._copy() for s in self._stages.values()]

    def _subtree(self, stage_id: str) -> Iterable[Stage]:
        stack = [stage_id]
        while stack:
            sid = stack.pop()
            yield self._stages[sid]
            stack.extend(reversed(self._children[sid]))

    def rollup(self, stage_id: str) -> Usage:
        """Usage of ``stage_id`` itself plus all its descendants (:class:`Usage`)."""
        with self._locked():
            if stage_id not in self._stages:
                raise KeyError(f"unknown stage {stage_id!r}")
            total = Usage()
            for s in self._subtree(stage_id):
                total._add_stage(s)
            return total

    def usage_by_model(self) -> dict[str, Usage]:
        """Own usage of all stages grouped by ``model`` (``"unknown"`` when ``None``); stages
        without usage are skipped."""
        out: dict[str, Usage] = {}
        with self._locked():
            for s in self._stages.values():
                if _has_usage(s):
                    out.setdefault(s.model or "unknown", Usage())._add_stage(s)
        return out

    def usage_by_level(self) -> dict[int, Usage]:
        """Own usage of all stages grouped by ``level`` (int); stages without usage skipped."""
        out: dict[int, Usage] = {}
        with self._locked():
            for s in self._stages.values():
                if _has_usage(s):
                    out.setdefault(s.level, Usage())._add_stage(s)
        return dict(sorted(out.items()))

    def counts_by_kind(self) -> dict[str, int]:
        """Number of stages per kind, keyed by the kind's string value."""
        out: dict[str, int] = {}
        with self._locked():
            for s in self._stages.values():
                out[s.kind.value] = out.get(s.kind.value, 0) + 1
        return out

    def counts_by_status(self) -> dict[str, int]:
        """Number of stages per status, keyed by the status's string value."""
        out: dict[str, int] = {}
        with self._locked():
            for s in self._stages.values():
                out[s.status.value] = out.get(s.status.value, 0) + 1
        return out

    def max_level(self) -> int:
        """Highest ``level`` of any stage (int); 0 for an empty tree."""
        with self._locked():
            return max((s.level for s in self._stages.values()), default=0)

    def render(self, root_id: str | None = None, *, now: float | None = None,
               max_level: int | None = None) -> str:
        """Plain-text tree, two spaces of indentation per generation.

        The first line gives totals for the subtree (stages, calls, tokens, USD). Each node line
        shows: id tail, kind, status, level, tokens and cost *rolled up over its subtree*, and
        seconds (end - start; now - start while running; ``-`` if not started).

        Args:
            root_id: subtree to render (str); the whole tree by default.
            now: wall clock used for running stages (epoch seconds); the tree's clock by default.
            max_level: omit stages whose ``level`` is above this (int | None).
        """
        with self._locked():
            if not self._stages:
                return f"run {self.run_id}: (no stages)"
            if now is None:
                now = self._clock()
            roots = ([root_id] if root_id is not None else
                     [sid for sid, s in self._stages.items() if s.parent_id is None
                      or s.parent_id not in self._stages])
            for r in roots:
                if r not in self._stages:
                    raise KeyError(f"unknown stage {r!r}")
            # post-order rollups for the subtrees rendered
            roll: dict[str, Usage] = {}

            def rollup(sid: str) -> Usage:
                order: list[str] = []
                stack = [sid]
                while stack:
                    x = stack.pop()
                    order.append(x)
                    stack.extend(self._children[x])
                for x in reversed(order):
                    u = Usage()
                    u._add_stage(self._stages[x])
                    for c in self._children[x]:
                        u = u + roll[c]
                    roll[x] = u
                return roll[sid]

            total = Usage()
            n = 0
            for r in roots:
                total = total + rollup(r)
                n += sum(1 for _ in self._subtree(r))
            lines = [f"run {self.run_id}: {n} stages, {total.calls} calls, "
                     f"{total.total_tokens} tokens "
                     f"({total.prompt_tokens} in / {total.completion_tokens} out), "
                     f"${total.cost_usd:.6f}"]
            for r in roots:
                base = r.count("/")
                stack = [r]
                while stack:
                    sid = stack.pop()
                    s = self._stages[sid]
                    if max_level is not None and s.level > max_level:
                        continue
                    u = roll[sid]
                    if s.started_at is None:
                        secs = "-"
                    else:
                        end = s.ended_at if s.ended_at is not None else now
                        secs = f"{end - s.started_at:.2f}s"
                    tail = sid.rsplit("/", 1)[-1]
                    indent = "  " * (sid.count("/") - base)
                    model = f" {s.model}" if s.model else ""
                    lines.append(
                        f"{indent}{tail} [{s.kind.value}] {s.status.value} L{s.level}{model} "
                        f"tok={u.total_tokens} ${u.cost_usd:.6f} {secs}")
                    stack.extend(reversed(self._children[sid]))
            return "\n".join(lines)

    # ------------------------------------------------------------------ persistence

    def snapshot(self) -> list[dict]:
        """``Stage.to_dict()`` of every stage, in creation order (parents before children)."""
        with self._locked():
            return [s.to_dict() for s in self._stages.values()]

    @classmethod
    def from_records(cls, run_id: str, records: Iterable[Mapping[str, Any]],
                     listeners: Sequence[Listener] = (), *,
                     clock: Callable[[], float] = time.time) -> "StageTree":
        """Rebuild a tree from stage dicts (e.g. a journal's latest record per stage).

        Records may come in any order; a later record with the same id replaces an earlier one.
        Ordinal counters are restored so that new stages continue after the recorded ones.
        No listener events are emitted for the rebuilt stages.

        Raises:
            ValueError: a record whose parent is missing, or a second root.
        """
        tree = cls(run_id, listeners, clock=clock)
        latest: dict[str, Stage] = {}
        for rec in records:
            st = Stage.from_dict(rec)
            latest[st.id] = st
        ordered = sorted(latest.values(),
                         key=lambda s: (s.id.count("/"),
                                        s.created_at if s.created_at is not None else 0.0,
                                        s.kind.value, s.ordinal))
        for st in ordered:
            if st.parent_id is None:
                if ROOT_ID in tree._stages or st.id != ROOT_ID:
                    raise ValueError(f"bad root record {st.id!r}")
            elif st.parent_id not in tree._stages:
                raise ValueError(f"stage {st.id!r} has a missing parent {st.parent_id!r}")
            tree._stages[st.id] = st
            tree._children[st.id] = []
            if st.parent_id is not None:
                tree._children[st.parent_id].append(st.id)
                key = (st.parent_id, st.kind)
                tree._next_ordinal[key] = max(tree._next_ordinal.get(key, 0), st.ordinal + 1)
        # creation order for the children lists and the stage dict
        for sid, kids in tree._children.items():
            kids.sort(key=lambda c: (tree._stages[c].created_at or 0.0,))
        tree._stages = dict(sorted(
            tree._stages.items(),
            key=lambda kv: (kv[1].created_at if kv[1].created_at is not None else 0.0,
                            kv[0].count("/"))))
        return tree
