"""Fit a generated context to a token budget by searching its number of units.

A task generator builds a context from an integer number of units (haystack sentences,
words, documents, list items); tokens grow about linearly with units. :func:`fit` counts
the o200k_base tokens of a build exactly and rescales the unit count proportionally
(a secant step through the origin) until the count is within 1% of the target, or no
better unit count exists; it keeps the closest build. Counting is exact every time
(tiktoken encodes about 2 million tokens per second here, so even 1M-token contexts take
a fraction of a second per count).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from rlm.models.tokens import count_tokens

__all__ = ["Built", "fit", "context_text"]


class Built(NamedTuple):
    """One generated sample before sizing is recorded.

    ``context`` is a string or a list of strings; ``template`` is the full plain-completion
    prompt with the literal ``{context}`` as the only placeholder.
    """

    context: str | list[str]
    query: str
    expected: list[str]
    template: str


def context_text(context: str | list[str]) -> str:
    """The text whose tokens are counted: a list context is its items joined by newlines."""
    return context if isinstance(context, str) else "\n".join(context)


def fit(build: Callable[[int], Built], target: int, guess: int, minimum: int = 1,
        tolerance: float = 0.01, max_rounds: int = 8) -> tuple[Built, int]:
    """Build with the unit count whose context is closest to ``target`` tokens.

    Args:
        build: deterministic ``units -> Built``.
        target: wanted context size, tokens (o200k_base).
        guess: first unit count to try; minimum: smallest allowed unit count.
    Returns:
        ``(built, tokens)`` for the closest build found.
    """
    tried: dict[int, tuple[Built, int]] = {}
    units = max(minimum, guess)
    for _ in range(max_rounds):
        built = build(units)
        tokens = count_tokens(context_text(built.context))
        tried[units] = (built, tokens)
        if abs(tokens - target) <= tolerance * target:
            break
        step = round(units * target / max(tokens, 1))
        if step == units:
            step += 1 if tokens < target else -1
        step = max(minimum, step)
        if step in tried:
            break
        units = step
    return min(tried.values(), key=lambda bt: abs(bt[1] - target))
