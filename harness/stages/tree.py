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

import logging
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from harness.errors import IllegalTransition
from harness.stages.model import (ROOT_ID, TERMINAL, TRANSITIONS, Kind, Stage, Status,  # noqa: F401
                                 Usage, _has_usage, _SETTABLE)
from harness.stages.scope import StageScope, cancel_open

__all__ = [
    "Status", "TERMINAL", "TRANSITIONS", "Kind", "Stage", "Usage", "StageTree", "StageScope",
    "Listener", "cancel_open",
]

log = logging.getLogger(__name__)

Listener = Callable[[dict], None]


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

    def _locked(self) -> threading.Lock:
        if self._notifying == threading.get_ident():
            raise RuntimeError("a StageTree listener must not call back into the same tree")
        return self._lock

    def _emit(self, make_event: Callable[[], dict], undo: Callable[[], dict]) -> None:
        """Deliver the event ``make_event()`` builds to every listener; on failure undo and
        compensate. Lock held. Without listeners nothing is built (a sub-call makes several
        changes; each event would copy its stage)."""
        if not self._listeners:
            return
        event = make_event()
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
        if type(kind) is not Kind:
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

            self._emit(lambda: self._event("created", stage, None, Status.pending, now), undo)
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
        if type(expected) is not Status:
            expected = Status(expected)
        if type(new) is not Status:
            new = Status(new)
        if fields and not _SETTABLE.issuperset(fields):
            bad = set(fields) - _SETTABLE
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

            self._emit(lambda: self._event("transition", stage, old_status, new, now), undo)
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

            self._emit(lambda: self._event("usage", stage, stage.status, stage.status,
                                           self._clock()), undo)
            return stage._copy()

    def stage(self, parent_id: str | None = None, kind: Kind | str | None = None,
              level: int = 0, *, model: str | None = None, meta: dict | None = None,
              existing: Stage | None = None, start: bool = True) -> "StageScope":
        """A ``with`` block that is one stage: the only way the harness moves stages.

        On entry the stage is created (or ``existing``, a pending stage created earlier so that
        its ordinal follows program order, is taken over) and, unless ``start=False``, moved to
        ``running``. On exit the outcome of the block decides its terminal status:

        ==============================================  ===================================
        how the block ended                             terminal status
        ==============================================  ===================================
        normally                                        ``completed`` (or what
                                                        :meth:`StageScope.finish` asked for)
        :class:`~harness.errors.BudgetExceeded`         ``budget_exceeded``
        ``KeyboardInterrupt``, a ``CancelledError``     ``cancelled``
        any other exception                             ``failed``
        ==============================================  ===================================

        ``error`` is set to the exception's text; evidence and meta set on the scope inside the
        block are written with the terminal transition. The exception always propagates. A
        stage still ``pending`` at exit (``start=False`` and :meth:`StageScope.start` never
        called) goes straight to its terminal status; ``pending -> completed`` is not a legal
        transition, so a normal exit from a never-started stage ends ``cancelled``.

        The one tolerated case: the stage is already terminal when the block exits (the run
        ended around it, e.g. :func:`cancel_open` at the wall cap). Terminal statuses are
        absorbing, so that exit changes nothing; every other failure to record raises.

        Returns:
            a :class:`StageScope` context manager; ``scope.id`` is the stage id (str).
        Raises:
            IllegalTransition, KeyError: as :meth:`new_stage` / :meth:`transition`.
        """
        if existing is None:
            if kind is None:
                raise TypeError("stage() needs a kind, or an existing pending stage")
            existing = self.new_stage(parent_id, kind, level, model=model, meta=meta)
        return StageScope(self, existing, start)

    # ------------------------------------------------------------------ queries

    def get(self, stage_id: str) -> Stage:
        """A copy of the stage with this id. Raises ``KeyError`` if unknown."""
        with self._locked():
            try:
                return self._stages[stage_id]._copy()
            except KeyError:
                raise KeyError(f"unknown stage {stage_id!r}") from None

    def status(self, stage_id: str) -> Status:
        """The current :class:`Status` of the stage with this id (no copy of the stage is made).

        Raises ``KeyError`` if unknown."""
        with self._locked():
            try:
                return self._stages[stage_id].status
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

    def max_level(self) -> int:
        """Highest ``level`` of any stage (int); 0 for an empty tree."""
        with self._locked():
            return max((s.level for s in self._stages.values()), default=0)

    def render(self, root_id: str | None = None, *, now: float | None = None,
               max_level: int | None = None, note: str = "") -> str:
        """Plain-text tree (``rlm show``); see :func:`harness.stages.render.render_tree`.

        Args:
            root_id: subtree to render (str); the whole tree by default.
            now: wall clock used for running stages (epoch seconds); the tree's clock by default.
            max_level: omit stages whose ``level`` is above this (int | None).
            note: text added to the first line (what its totals cover).
        """
        from harness.stages.render import render_tree
        return render_tree(self.run_id, self.all(), now=self._clock() if now is None else now,
                           root_id=root_id, max_level=max_level, note=note)

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

