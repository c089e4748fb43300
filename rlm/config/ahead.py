"""How many kernels to start ahead of a run, from its options (cheap: imported by ``import rlm``'s
:func:`rlm.completion` and the CLI before anything heavy)."""
from __future__ import annotations

from typing import Any, Mapping

__all__ = ["kernels_ahead", "sandbox_of"]


def kernels_ahead(options: dict) -> int:
    """Kernels (int) to start ahead of a run given these options (``max_depth``, ``pool_size``,
    ``kernels``): the root's, plus its pool's when its children get kernels; none when the root's
    kernel runs on a gateway, only the root's when its children's do (``kernels``: only local
    kernels start ahead). A value that is not a
    plain int counts as its default (the run's own validation reports it)."""
    from kernels.pool import pool_size_for
    from kernels.provider import parse_placement
    try:
        placed = parse_placement(options.get("kernels"), "-")
        if placed.root != "local":
            return 0
        if placed.children != "local":
            return 1  # the children's pool is on the gateway
    except ValueError:
        pass  # the run's validation says what is wrong with it

    def _int(name: str, default: Any) -> Any:
        value = options.get(name, default)
        return value if isinstance(value, int) and not isinstance(value, bool) else default
    return 1 + pool_size_for(_int("max_depth", 1), _int("pool_size", None))


def sandbox_of(options: Mapping[str, Any]):
    """The :class:`kernels.bwrap.SandboxSpec` of a run with these options (``sandbox``,
    ``kernel_network``, ``kernel_memory_mb``, ``kernel_processes``, ``kernel_disk_mb``,
    ``kernel_seed``); a
    value of the wrong type counts as its default (the run's own validation reports it)."""
    from kernels.bwrap import MODES, SandboxSpec
    base = SandboxSpec()

    def pick(name: str, default: Any, kind: type) -> Any:
        value = options.get(name)
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        return value if ok else default
    mode = options.get("sandbox")
    disk = pick("kernel_disk_mb", base.disk_mb, int)
    return SandboxSpec(mode=mode if mode in MODES else None,
                       network=pick("kernel_network", base.network, bool),
                       memory_mb=pick("kernel_memory_mb", base.memory_mb, int),
                       processes=pick("kernel_processes", base.processes, int),
                       disk_mb=disk, file_mb=disk, seed=pick("kernel_seed", base.seed, int))
