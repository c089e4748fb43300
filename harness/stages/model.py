"""The stage data model: statuses and their one transition table, kinds, :class:`Stage` and
:class:`Usage`. See :mod:`harness.stages.tree` for the tree that moves stages through the table.

Pure standard library; imports nothing from ``rlm`` or ``kernels``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

__all__ = ["Status", "TERMINAL", "TRANSITIONS", "Kind", "ROOT_ID", "Stage", "Usage"]


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
    compaction = "compaction"  # older turns replaced by a summary (rlm.core.compaction)
    tool = "tool"  # one call of a user's host tool (rlm.tools), under the cell that made it

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

        ``meta`` and ``evidence`` are copied (one level).
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
            # one level copied: a journal may serialize this dict later (written behind)
            "evidence": dict(self.evidence) if type(self.evidence) is dict else self.evidence,
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
        # the same as ``dataclasses.replace(self, meta=dict(self.meta))``, without re-running
        # ``__init__`` field by field (the tree hands out a copy on every change)
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.meta = dict(self.meta)
        return new


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
