"""Inside a gateway kernel: the bind cell's entry point.

:func:`bind` is what :meth:`kernels.gateway.kernel.GatewayKernel.bind_cell` calls: it installs
the courier (:mod:`kernels.gateway.courier`) as the runtime's bridge connection, pulls the
context by hash (:mod:`kernels.gateway.fetch`) and then binds the runtime as a local kernel's
bind cell does (:func:`kernels.runtime.bind`).
"""
from __future__ import annotations

from kernels import runtime as rt
from kernels.gateway.courier import CourierSocket, install
from kernels.gateway import relay
from kernels.gateway.fetch import resolve_context


def bind(token: str, context_ref: str | None, fmt: str = "text", size: int | None = None,
         checked: bool = False, tools: list | None = None) -> str:
    """Bind this gateway kernel to one RLM instance: as :func:`kernels.runtime.bind`, with the
    bridge over the stdin channel and the context fetched from the host when ``context_ref``
    is a remote reference (:func:`kernels.gateway.fetch.resolve_context`). Returns what
    :func:`kernels.runtime.bind` returns; raises what it raises, and CourierError."""
    from ipykernel.kernelbase import Kernel as _IPK
    install(_IPK.instance())
    rt._Socket = CourierSocket  # sealed by bind(): restored after every cell
    path = resolve_context(context_ref, fmt, token) if context_ref else None
    # the bridge address a process the cell starts uses: the kernel's relay (the kernel's own
    # process ignores it and uses the courier)
    return rt.bind(relay.start(), token, path, fmt, size, checked=checked, tools=tools)
