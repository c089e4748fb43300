"""The kernel provider seam: what the host needs of a kernel, wherever it runs.

Two providers satisfy :class:`KernelLike`: ``local`` (:class:`kernels.kernel.Kernel`, a
sandboxed ipykernel on this host) and ``gateway`` (:class:`kernels.gateway.kernel.GatewayKernel`,
a kernel on a Jupyter Kernel Gateway or Enterprise Gateway). A run places its root's kernel and
its children's separately (:class:`Placement`, from the ``--kernels`` option), so for example
the root stays local while a wide fan-out of children runs on a gateway's hosts.

Calls back to the host go over each provider's own channel: a local kernel's over the bridge's
Unix socket, a gateway kernel's over its stdin channel (:mod:`kernels.gateway.serve`); both end
in the same dispatch (:class:`kernels.bridge.BridgeServer`), so what the host decides (depth,
caps, journal, replay) does not depend on where a kernel runs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from kernels.gateway import DEFAULT_KERNELSPEC
from kernels.protocol import bind_code

#: The providers (``--kernels`` values).
PROVIDERS = ("local", "gateway")


@runtime_checkable
class KernelLike(Protocol):
    """What the run tree, its loops, sessions and the pool call on a kernel.

    Attributes:
        sandbox_mode: how it runs (``"bwrap"``, ``"none"``, ``"gateway"``; ``""`` before start).
        limits_mode: how a sandboxed local kernel is bounded (``"cgroup"``, ``"rlimit"``), or
            ``""`` (not sandboxed here, or a gateway kernel: its host decides).
        pid: the process id the bridge registration names (a local kernel's top process; a
            gateway kernel's is :data:`kernels.gateway.serve.GATEWAY_PID`).
    """

    sandbox_mode: str
    limits_mode: str

    @property
    def pid(self) -> int: ...

    def start(self) -> "KernelLike":
        """Start it and wait until it answers; returns self. Raises RuntimeError."""

    def execute(self, code: str, timeout: float | None = None,
                user_expressions: dict | None = None, *, stop=None, grace: float = 3.0,
                on_interrupt=None, extend=None) -> tuple[Any, dict]:
        """Run one cell: ``(CellResult, user expressions)``. Raises KernelDied."""

    def interrupt(self) -> None:
        """Interrupt the running cell."""

    def is_alive(self) -> bool:
        """Started, not shut down, not seen dead."""

    def shutdown(self) -> None:
        """End it now. Idempotent."""

    def begin_shutdown(self) -> Callable[[], None] | None:
        """End it in two halves (see :meth:`kernels.kernel.Kernel.begin_shutdown`)."""

    def share_file(self, path: str, fmt: str = "text", move: bool = False) -> str:
        """What the bind cell names for the context file ``path`` (a path or a reference)."""

    def share_socket(self, path: str) -> str:
        """The bridge address the kernel uses."""


@dataclass(frozen=True)
class Placement:
    """Where a run's kernels run.

    Attributes:
        root: the root's provider (``"local"`` or ``"gateway"``).
        children: the children's provider.
        gateway_url: the gateway's URL ("" when no kernel runs on one).
        kernelspec: the kernelspec gateway kernels start.
    """

    root: str = "local"
    children: str = "local"
    gateway_url: str = ""
    kernelspec: str = DEFAULT_KERNELSPEC

    @property
    def uses_gateway(self) -> bool:
        """Whether any kernel runs on the gateway."""
        return "gateway" in (self.root, self.children)

    def provider(self, level: int) -> str:
        """The provider of a kernel at ``level`` (0: the root)."""
        return self.root if level == 0 else self.children


def placement_error(value: Any) -> str | None:
    """Why ``value`` is not a ``--kernels`` value (the end of an error message), or None."""
    try:
        parse_placement(value)
    except ValueError as exc:
        return str(exc)
    return None


def parse_placement(value: Any, gateway_url: str | None = None,
                    kernelspec: str = DEFAULT_KERNELSPEC) -> Placement:
    """The :class:`Placement` a ``--kernels`` value names: ``local``, ``gateway``, or roles
    ``root=P,children=P`` (a role not named stays ``local``). The URL is ``gateway_url``, else
    ``$JUPYTER_GATEWAY_URL``.

    Raises:
        ValueError: an unknown provider or role, or a gateway placement without a URL.
    """
    text = str(value or "local").strip()
    roles = {"root": "local", "children": "local"}
    if "=" not in text:
        roles = {"root": text, "children": text}
    else:
        for part in text.split(","):
            role, _, prov = part.partition("=")
            role = role.strip()
            if role not in roles:
                raise ValueError(f"must name roles root= and children=, not {role!r}")
            roles[role] = prov.strip()
    for prov in roles.values():
        if prov not in PROVIDERS:
            raise ValueError(f"must be local, gateway or root=...,children=..., not {prov!r}")
    from kernels.gateway.client import URL_VAR
    url = gateway_url or os.environ.get(URL_VAR, "")
    return Placement(root=roles["root"], children=roles["children"], gateway_url=url,
                     kernelspec=kernelspec or DEFAULT_KERNELSPEC)


def kernel_factory(placement: Placement, level: int, spec=None) -> Callable[[], KernelLike]:
    """A function that makes (not starts) a kernel for ``level`` under ``placement``.

    A gateway kernel's client takes its token from ``$JUPYTER_GATEWAY_AUTH_TOKEN`` (never an
    option or an argument, so never in argv, a journal or an error message).

    Raises:
        ValueError: the placement needs a gateway and names no URL.
    """
    if placement.provider(level) == "local":
        from kernels.kernel import Kernel
        return lambda: Kernel(sandbox=spec)
    if not placement.gateway_url:
        raise ValueError("--kernels gateway needs the gateway's URL: pass --gateway-url URL "
                         "or set $JUPYTER_GATEWAY_URL")
    from kernels.gateway.client import TOKEN_VAR, GatewayClient
    from kernels.gateway.kernel import GatewayKernel
    client = GatewayClient(placement.gateway_url, os.environ.get(TOKEN_VAR, ""))
    return lambda: GatewayKernel(client, placement.kernelspec, spec=spec)


def bind_cell(kernel: KernelLike, bridge, token: str, context_path: str | None, fmt: str,
              size: int | None = None, checked: bool = False,
              tools: list | None = None) -> str:
    """The cell that binds ``kernel`` to one RLM instance (Python source): the kernel's own
    (a gateway kernel's :meth:`~kernels.gateway.kernel.GatewayKernel.bind_cell`), else
    :func:`kernels.protocol.bind_code` with the bridge's socket as the kernel reaches it."""
    own = getattr(kernel, "bind_cell", None)
    if own is not None:
        return own(bridge, token, context_path, fmt, size, checked, tools)
    return bind_code(kernel.share_socket(bridge.path), token, context_path, fmt, size,
                     checked=checked, tools=tools)


class PlacedPool:
    """A run's kernel pools by role: the root's and, when children run elsewhere, theirs.

    Args:
        root: the :class:`kernels.pool.KernelPool` of the root's kernels (and the children's
            when ``children`` is None).
        children: the pool of the children's kernels, or None.
    """

    def __init__(self, root, children=None) -> None:
        self.root, self.children = root, children

    @property
    def started(self) -> int:
        """Kernels started over both pools' lives (int)."""
        return self.root.started + (self.children.started if self.children else 0)

    def _of(self, level: int):
        return self.children if level > 0 and self.children is not None else self.root

    def acquire(self, level: int = 0) -> KernelLike:
        """A started kernel for ``level`` (0: the root). Raises RuntimeError as the pool does."""
        k = self._of(level).acquire()
        k._rlm_level = level  # which pool takes it back
        return k

    def release(self, k: KernelLike) -> None:
        """Shut ``k`` down through the pool it came from. Never raises."""
        self._of(getattr(k, "_rlm_level", 0)).release(k)

    def close(self) -> None:
        """Close both pools (see :meth:`kernels.pool.KernelPool.close`)."""
        self.root.close()
        if self.children is not None:
            self.children.close()
