"""The user's tools: host functions the kernel's code may call, each call a journaled, capped
``tool`` stage (see docs/tools.md).

- :mod:`rlm.tools.spec`: :class:`Tool`, the :func:`tool` decorator, :func:`as_tools` (the
  ``tools`` option checked), :func:`prompt_lines` (what the system prompt says of them);
- :mod:`rlm.tools.host`: :class:`~rlm.tools.host.ToolHost`, serving one call or a batch.
"""
from __future__ import annotations

from rlm.tools.spec import RESERVED_NAMES, Tool, ToolError, as_tools, replay_tools, tool

__all__ = ["Tool", "ToolError", "tool", "as_tools", "replay_tools", "RESERVED_NAMES",
           "kernel_specs", "prompt_tools", "tool_records"]


def kernel_specs(tools: tuple, level: int) -> list[dict]:
    """The specs the kernel at loop ``level`` binds (its stand-ins), in order."""
    return [t.kernel_spec() for t in tools or () if t.available_at(level)]


def prompt_tools(tools: tuple, level: int) -> list[dict]:
    """What the system prompt lists of the tools at ``level``: ``{"name", "signature",
    "summary"}`` each, in order."""
    return [{"name": t.name, "signature": t.signature, "summary": t.summary}
            for t in tools or () if t.available_at(level)]


def tool_records(tools: tuple) -> list[dict]:
    """The journal's record of a run's tools (:meth:`Tool.record` each)."""
    return [t.record() for t in tools or ()]
