"""Where a run's kernels run: the pools built from the ``--kernels`` placement.

The root's kernel and the children's come from the providers the placement names
(:mod:`kernels.provider`): a local root adopts the kernels started ahead of the run
(:func:`kernels.pool.head_start`); a gateway root leaves them (they are shut down). Children
placed apart from the root get a pool of their own, which keeps the run's idle kernels.
"""
from __future__ import annotations

from kernels.pool import KernelPool, drop_head_start, take_head_start
from kernels.provider import Placement, PlacedPool, kernel_factory, parse_placement
from rlm.config.options import Options
from rlm.errors import ConfigError


def placement_of(options: Options) -> Placement:
    """The run's :class:`~kernels.provider.Placement`. Raises ConfigError for a bad value."""
    try:
        placement = parse_placement(options.kernels, options.gateway_url,
                                    options.gateway_kernelspec)
        if placement.uses_gateway:
            kernel_factory(placement, 0 if placement.root == "gateway" else 1)
    except ValueError as exc:
        raise ConfigError(str(exc) if str(exc).startswith("--") else f"--kernels {exc}") from None
    return placement


def make_pools(options: Options, sandbox, pool_size: int, adopt_head: bool) -> PlacedPool:
    """The run's kernel pools (see the module's text). Raises ConfigError as
    :func:`placement_of`."""
    placement = placement_of(options)
    local_root = placement.root == "local"
    head = None
    if adopt_head:
        if local_root:
            head = take_head_start(sandbox)
        else:
            drop_head_start()
    together = placement.root == placement.children
    root = KernelPool(pool_size if together else 0, head=head, sandbox=sandbox,
                      factory=kernel_factory(placement, 0, sandbox))
    if together:
        return PlacedPool(root)
    return PlacedPool(root, KernelPool(pool_size, sandbox=sandbox,
                                       factory=kernel_factory(placement, 1, sandbox)))
