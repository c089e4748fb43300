"""Run options: the :class:`Options` a run tree is driven with.

(The declarative option registry lives here too; see :data:`OPTIONS`.)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from harness.budget import Budget
from harness.prices import PriceTable


@dataclass
class Options:
    """Everything a run needs to know besides its context and query.

    Attributes (units in brackets):
        model: the root model's name; ``child_model`` for child roots and
            ``sub_model`` for ``llm_query``/fallbacks default to it.
        base_url, api_key: the endpoint; None means the embedded model.
        max_iterations: loop turns per instance before the last-turn prompt.
        max_depth: kernel-bearing levels (see README "Depth").
        cell_timeout: [s] per executed block; the kernel is interrupted after it.
        max_output_chars: [characters] of cell output fed back per turn.
        max_completion_tokens: [tokens] output cap of root/child turns.
        sub_max_tokens: [tokens] output cap of ``llm_query`` and fallbacks.
        budget: the caps (cost, tokens, calls, wall seconds, concurrency...).
        pool_size: idle pre-started kernels (None: 0 at depth <= 1, else 2).
        max_kernel_restarts: restarts of one instance's kernel before it fails.
        journal: a :class:`harness.journal.Journal` or None (no journal).
        divergence: ``"stop"`` (default) or ``"live"``: what resume does when a
            recorded call's request differs from the new one.
    """

    model: str = "scripted"
    sub_model: str | None = None
    child_model: str | None = None
    base_url: str | None = None
    api_key: str | None = None
    max_iterations: int = 20
    max_depth: int = 1
    cell_timeout: float = 60.0
    max_output_chars: int = 4000
    max_completion_tokens: int = 1024
    sub_max_tokens: int = 512
    sub_prompt_chars: int = 6000
    temperature: float | None = 0.0
    budget: Budget = field(default_factory=Budget)
    prices: PriceTable | None = None
    pool_size: int | None = None
    max_kernel_restarts: int = 3
    max_attempts: int = 6
    journal: Any = None
    divergence: str = "stop"
    embedded: bool = False
    system_template: str | None = None
    on_progress: Callable[[str], None] | None = None
