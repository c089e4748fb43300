"""The plain-text view of a stage tree (``rlm show``): one line per stage, usage rolled up."""
from __future__ import annotations

from typing import Iterable

from harness.stages.model import Stage, Usage

__all__ = ["render_tree"]

#: Lines of a model call's reasoning shown under it (the journal keeps all of it).
REASONING_LINES = 12
_REASONING_WIDTH = 160


def _call_notes(s: Stage) -> str:
    if s.kind.value != "model_call" or not s.meta:
        return ""
    notes = []
    if s.meta.get("usage_estimated"):
        notes.append("usage=estimated")
    if s.meta.get("finish_reason"):
        notes.append(f"finish={s.meta['finish_reason']}")
    if s.meta.get("adapted"):
        notes.append("adapted: " + ", ".join(map(str, s.meta["adapted"])))
    return (" " + " ".join(notes)) if notes else ""


def _compaction_notes(s: Stage) -> str:
    """A compaction's trigger, the request's size before and after (tokens) and the window."""
    m = s.meta or {}
    if s.kind.value != "compaction" or "before_tokens" not in m:
        return ""
    after = f"{m['after_tokens']:,}" if "after_tokens" in m else "?"
    window = (m.get("window") or {}).get("tokens")
    return (f" {m.get('trigger')}: {m['before_tokens']:,}->{after} tokens"
            + (f" of {window:,}" if window else "")
            + f", {m.get('dropped_messages', 0)} message(s) summarised")


def _tool_notes(s: Stage) -> str:
    """A tool stage's call and outcome (``search('x') -> [...]``), cut to one short line."""
    if s.kind.value != "tool" or not s.meta:
        return ""
    m = s.meta
    out = f"{m.get('call') or m.get('tool') or ''}"
    if m.get("error"):
        out += f" !! {m['error']}"
    elif "result" in m:
        out += f" -> {m['result']}"
    if m.get("replayed"):
        out += " (from the journal)"
    out = " ".join(out.split())
    return " " + (out if len(out) <= 160 else out[:157] + "...")


def _reasoning_lines(text: str, indent: str) -> list[str]:
    rows = text.strip().splitlines()
    out = [f"{indent}reasoning | {r[:_REASONING_WIDTH]}" for r in rows[:REASONING_LINES]]
    if len(rows) > REASONING_LINES:
        out.append(f"{indent}reasoning | ... ({len(rows) - REASONING_LINES} more lines, "
                   f"{len(text):,} characters in all: see `rlm export`)")
    return out


def render_tree(run_id: str, stages: Iterable[Stage], *, now: float,
                root_id: str | None = None, max_level: int | None = None,
                note: str = "") -> str:
    """Plain-text tree, two spaces of indentation per generation.

    The first line gives totals for the subtree (stages, calls, tokens, USD). Each node line
    shows: id tail, kind, status, level, tokens and cost *rolled up over its subtree*, and
    seconds (end - start; now - start while running; ``-`` if not started). A model call also
    says when its usage was estimated (the endpoint reported none), when its reply was cut
    (``finish=length``) and which request parameters were adapted, and shows its reasoning
    (never executed) on ``reasoning |`` lines below it, cut to :data:`REASONING_LINES` lines.
    A tool call shows the call, its result or error, and whether the journal served it.

    Args:
        run_id: the run's id (str); stages: the tree's stages in creation order.
        now: wall clock used for running stages (epoch seconds).
        root_id: subtree to render (str); the whole tree by default.
        max_level: omit stages whose ``level`` is above this (int | None).
        note: text added to the first line (what its totals cover, when that needs saying).
    Raises:
        KeyError: ``root_id`` is not a stage of the tree.
    """
    by_id = {s.id: s for s in stages}
    if not by_id:
        return f"run {run_id}: (no stages)"
    children: dict[str, list[str]] = {sid: [] for sid in by_id}
    for s in by_id.values():
        if s.parent_id in children:
            children[s.parent_id].append(s.id)
    roots = ([root_id] if root_id is not None else
             [sid for sid, s in by_id.items() if s.parent_id is None or s.parent_id not in by_id])
    for r in roots:
        if r not in by_id:
            raise KeyError(f"unknown stage {r!r}")
    roll: dict[str, Usage] = {}

    def rollup(sid: str) -> tuple[Usage, int]:
        order, stack = [], [sid]
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(children[x])
        for x in reversed(order):  # post-order: children first
            u = Usage()
            u._add_stage(by_id[x])
            for c in children[x]:
                u = u + roll[c]
            roll[x] = u
        return roll[sid], len(order)

    total, n = Usage(), 0
    for r in roots:
        u, k = rollup(r)
        total, n = total + u, n + k
    estimated = any(s.kind.value == "model_call" and (s.meta or {}).get("usage_estimated")
                    for s in by_id.values())
    lines = [f"run {run_id}: {n} stages, {total.calls} calls, {total.total_tokens} tokens "
             f"({total.prompt_tokens} in / {total.completion_tokens} out), ${total.cost_usd:.6f}"
             + (" (usage partly estimated: the endpoint reported none)" if estimated else "")
             + note]
    for r in roots:
        base = r.count("/")
        stack = [r]
        while stack:
            sid = stack.pop()
            s = by_id[sid]
            if max_level is not None and s.level > max_level:
                continue
            indent = "  " * (sid.count("/") - base)
            lines.append(_node_line(s, roll[sid], indent, now))
            reasoning = (s.meta or {}).get("reasoning") if s.kind.value == "model_call" else None
            if isinstance(reasoning, str) and reasoning.strip():
                lines.extend(_reasoning_lines(reasoning, indent + "    "))
            stack.extend(reversed(children[sid]))
    return "\n".join(lines)


def _node_line(s: Stage, u: Usage, indent: str, now: float) -> str:
    """One stage's line: id tail, kind, status, level, model, rolled-up tokens and cost, seconds
    (``-`` before it started; up to ``now`` while it runs) and the model call's notes."""
    if s.started_at is None:
        secs = "-"
    else:
        end = s.ended_at if s.ended_at is not None else now
        secs = f"{end - s.started_at:.2f}s"
    tail = s.id.rsplit("/", 1)[-1]
    model = f" {s.model}" if s.model else ""
    return (f"{indent}{tail} [{s.kind.value}] {s.status.value} L{s.level}{model} "
            f"tok={u.total_tokens} ${u.cost_usd:.6f} {secs}{_call_notes(s)}{_compaction_notes(s)}"
            f"{_tool_notes(s)}")
