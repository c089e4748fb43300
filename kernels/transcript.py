"""Inside the kernel: ``history``, the loop's whole conversation, read from the host on demand.

When the host compacts a loop's conversation (older turns replaced by a summary so the next
request fits the model's window), nothing is lost: the full transcript stays on the host, and
``history`` fetches it over the bridge (``Op.HISTORY``) each time it is read. It is never copied
into the kernel turn by turn, so a long run costs the kernel nothing until the model asks.

Standard library only (it runs in every kernel).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

__all__ = ["History"]


class History(Sequence):
    """The loop's full conversation: a read-only sequence of ``{"role", "content"}`` dicts,
    oldest first (the system prompt, the task, then every reply and every feedback as they
    were sent before any compaction).

    Each read (``len``, an index, a slice, iteration, ``print``) asks the host once and works on
    a fresh copy: ``list(history)`` keeps one. Raises what the bridge raises (``SubcallError``
    when the host cannot answer).

    Args:
        fetch: the call that returns the transcript from the host (a list of dicts).
    """

    __slots__ = ("_fetch",)

    def __init__(self, fetch: Callable[[], list]) -> None:
        self._fetch = fetch

    def _all(self) -> list:
        return [dict(m) for m in (self._fetch() or [])]

    def __len__(self) -> int:
        return len(self._all())

    def __getitem__(self, index: Any) -> Any:
        return self._all()[index]

    def __iter__(self):
        return iter(self._all())

    # one fetch each (Sequence's own would fetch once per item)
    def __reversed__(self):
        return reversed(self._all())

    def __contains__(self, item: Any) -> bool:
        return item in self._all()

    def index(self, *args: Any) -> int:
        """The position of a message (as ``list.index``; ValueError when absent)."""
        return self._all().index(*args)

    def count(self, item: Any) -> int:
        """How many messages equal ``item`` (int)."""
        return self._all().count(item)

    def __repr__(self) -> str:
        msgs = self._all()
        chars = sum(len(str(m.get("content") or "")) for m in msgs)
        return (f"<history: {len(msgs)} messages, {chars:,} characters; index it, slice it or "
                "loop over it: each item is {'role', 'content'}>")

    def text(self, start: int = 0, stop: int | None = None) -> str:
        """Messages ``start:stop`` as one text, each headed by its role (str)."""
        return "\n\n".join(f"[{m.get('role')}]\n{m.get('content')}"
                           for m in self._all()[start:stop])
