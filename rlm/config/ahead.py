"""How many kernels to start ahead of a run, from its options (cheap: imported by ``import rlm``'s
:func:`rlm.completion` and the CLI before anything heavy)."""
from __future__ import annotations

from typing import Any

__all__ = ["kernels_ahead"]


def kernels_ahead(options: dict) -> int:
    """Kernels (int) to start ahead of a run given these options (``max_depth``, ``pool_size``):
    the root's, plus its pool's when its children get kernels. A value that is not a plain int
    counts as its default (the run's own validation reports it)."""
    from kernels.pool import pool_size_for

    def _int(name: str, default: Any) -> Any:
        value = options.get(name, default)
        return value if isinstance(value, int) and not isinstance(value, bool) else default
    return 1 + pool_size_for(_int("max_depth", 1), _int("pool_size", None))
