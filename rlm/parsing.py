"""Parsing model replies: fenced code blocks to run, and FINAL written in prose."""
from __future__ import annotations

import re

# ```repl / ```python / ```py fences; the closing fence may be missing at the end of a reply.
_FENCE = re.compile(r"```[ \t]*(repl|python|py|python3)[ \t]*\n(.*?)(?:\n```|\Z)", re.DOTALL | re.IGNORECASE)
_PROSE_FINAL = re.compile(r"\bFINAL(?:_VAR)?\s*\(", re.DOTALL)


def code_blocks(reply: str) -> list[str]:
    """The code of every ```repl (or ```python) block in ``reply``, in order."""
    return [m.group(2).strip("\n") for m in _FENCE.finditer(reply or "") if m.group(2).strip()]


def prose_final(reply: str) -> bool:
    """True if ``reply`` writes FINAL(...)/FINAL_VAR(...) outside any code block."""
    outside = _FENCE.sub("", reply or "")
    return bool(_PROSE_FINAL.search(outside))
