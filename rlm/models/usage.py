"""A reply's usage as counts the caps can trust, from any provider.

A provider's reported figure is taken only when it is a finite number >= 0 (:func:`amount`,
:func:`count`): a negative count or cost would lower what the caps see. A reply that reports
no usage, misses a field, or reports zeros for a non-empty exchange is counted locally with
tiktoken (:class:`UsageCounter`), marked estimated, and warned about once per client.
"""
from __future__ import annotations

import logging
import math
import threading

log = logging.getLogger("rlm")

__all__ = ["amount", "count", "UsageCounter"]


def amount(v) -> float | None:
    """A figure of a reply's usage (a token count, a cost in USD): a finite number >= 0,
    else None (absent or not such a number: counted locally, or no cost reported)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return None
    return float(v)


def count(v) -> int | None:
    """A token count of a reply's usage (:func:`amount`, whole), else None."""
    a = amount(v)
    return None if a is None else int(a)


class UsageCounter:
    """Settles the token counts of one client's replies; warns once when it has to count.

    Args:
        label: how the warning names the endpoint (its base URL).
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self._lock = threading.Lock()
        self.warned = False

    def settle(self, messages: list[dict], raw: str, reasoning: str, pt: int | None,
               ct: int | None) -> tuple[int, int, bool]:
        """``(prompt_tokens, completion_tokens, estimated)`` for a reply whose reported counts
        are ``pt``/``ct`` (None: not reported). No usage, a field missing, or zeros for a
        non-empty exchange mean nothing was reported: the missing counts are tiktoken's
        (o200k_base) of ``messages`` and of the reply's ``raw`` text plus its ``reasoning``."""
        if pt is None or ct is None or (not pt and not ct and (raw or reasoning)):
            pt, ct = self._estimate(messages, raw, reasoning, pt, ct)
            return pt, ct, True
        return int(pt), int(ct), False

    def _estimate(self, messages: list[dict], raw: str, reasoning: str, pt, ct) -> tuple[int, int]:
        from rlm.models.tokens import count_messages, count_tokens
        with self._lock:
            warn, self.warned = not self.warned, True
        if warn:
            log.warning("model endpoint %s sent no token usage: counting prompt and completion "
                        "tokens locally with tiktoken; usage and cost are estimates, and every "
                        "cap is enforced on them", self.label)
        if pt is None or (not pt and not ct):
            pt = count_messages(messages)
        if ct is None or not ct:
            ct = count_tokens(raw) + count_tokens(reasoning)
        return int(pt), int(ct)
