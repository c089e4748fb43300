"""Inside the kernel: the contexts a session adds after the first.

A session's kernel holds its first context as ``context`` (also ``context_0``); each one added
later is bound as ``context_1``, ``context_2``, ... and appended to ``contexts``, the list of all
of them in order. They are reserved names, restored after every cell like ``context``
(:mod:`kernels.runtime`). The host calls :func:`add` through
:func:`kernels.protocol.add_context_code`.
"""
from __future__ import annotations

from kernels import runtime as _rt
from kernels.bundle import load_context


def add(path: str, fmt: str, index: int, size: int | None = None) -> str:
    """Load the context at ``path`` and bind it as ``context_{index}`` and ``contexts[index]``.

    Args:
        path: the file the host shared with this kernel; ``fmt``: ``"text"``, ``"json"`` or
            ``"bundle"`` (as :func:`kernels.bundle.load_context`); ``size``: the file's size
            when the host loaded it, or None.
        index: the context's number (int >= 1; 0 is the first context, bound by
            :func:`kernels.runtime.bind`). Binding the same index again replaces it (a
            restarted kernel is given its contexts again).

    Returns a short description (str). Raises what :func:`kernels.bundle.load_context` raises,
    and ValueError for an index below 1.
    """
    if index < 1:
        raise ValueError(f"context index {index}: the first context is bound by bind()")
    if path.startswith("rlm-remote:"):  # a gateway kernel's: pulled from the host by hash
        from kernels.gateway.fetch import resolve_context
        path = resolve_context(path, fmt, _rt._CONF["token"])
    value = load_context(path, fmt, size)
    have = list(_rt.RESERVED.get("contexts") or [])
    have = (have + [None] * index)[:index] + [value] + have[index + 1:]
    _rt.RESERVED[f"context_{index}"] = value
    _rt.RESERVED["contexts"] = have
    # the restore hook repairs the registries from its sealed copy: seal the new names in
    _rt._seal()
    _rt._restore()
    return f"context_{index} bound: {type(value).__name__}"
