"""The plain-text view of a stage tree (``rlm show``): one line per stage, usage rolled up."""
from __future__ import annotations

from typing import Iterable

from harness.stage_model import Stage, Usage

__all__ = ["render_tree"]


def render_tree(run_id: str, stages: Iterable[Stage], *, now: float,
                root_id: str | None = None, max_level: int | None = None) -> str:
    """Plain-text tree, two spaces of indentation per generation.

    The first line gives totals for the subtree (stages, calls, tokens, USD). Each node line
    shows: id tail, kind, status, level, tokens and cost *rolled up over its subtree*, and
    seconds (end - start; now - start while running; ``-`` if not started).

    Args:
        run_id: the run's id (str); stages: the tree's stages in creation order.
        now: wall clock used for running stages (epoch seconds).
        root_id: subtree to render (str); the whole tree by default.
        max_level: omit stages whose ``level`` is above this (int | None).
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
    lines = [f"run {run_id}: {n} stages, {total.calls} calls, {total.total_tokens} tokens "
             f"({total.prompt_tokens} in / {total.completion_tokens} out), ${total.cost_usd:.6f}"]
    for r in roots:
        base = r.count("/")
        stack = [r]
        while stack:
            sid = stack.pop()
            s = by_id[sid]
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
            lines.append(f"{indent}{tail} [{s.kind.value}] {s.status.value} L{s.level}{model} "
                         f"tok={u.total_tokens} ${u.cost_usd:.6f} {secs}")
            stack.extend(reversed(children[sid]))
    return "\n".join(lines)
