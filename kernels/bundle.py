"""A many-file context as the kernel reads it: a *bundle*.

The host (:mod:`rlm.context.sources`) writes a manifest, JSON ``{"version": 1, "entries": [...]}``,
each entry ``[key, file, offset, length, kind]``: the value of ``context[key]`` is the
``length`` bytes at ``offset`` of ``file`` (UTF-8), as text (``kind`` ``"text"``) or as JSON
(``"json"``, written clean by the host: see :mod:`harness.text`). ``file`` is the user's own
file (UTF-8 text is read in place, never copied through the host) or the host's scratch file
of converted values. A kernel running as another user reads a manifest rewritten for it
(:func:`kernels.sandbox.share_bundle`).

Standard library only: imported inside every kernel by :mod:`kernels.runtime`, and by the host.
"""
from __future__ import annotations

import json

#: Where the file of an entry is (the host rewrites it when it shares the bundle).
FILE = 1


class ContextChanged(RuntimeError):
    """A context file the host loaded changed before the kernel read it: the kernel would
    hold other text than the run's journal records (the host reports it as bad input)."""


def read_bundle(manifest: str) -> dict:
    """The context a manifest describes: a dict of key -> value, in the manifest's order.

    Raises:
        OSError: a file cannot be read. ContextChanged: a file changed since it was loaded.
        ValueError: a slice is not UTF-8 or not JSON.
    """
    with open(manifest, "rb") as f:
        entries = json.loads(f.read())["entries"]
    out, handles = {}, {}
    try:
        for key, src, offset, length, kind in entries:
            f = handles.get(src)
            if f is None:
                if len(handles) > 8:  # user files are read once: do not keep them open
                    for h in handles.values():
                        h.close()
                    handles.clear()
                f = handles[src] = open(src, "rb")
            f.seek(offset)
            data = f.read(length)
            if len(data) != length:
                raise ContextChanged(f"context file {src} changed since it was loaded "
                                   f"({len(data)} of {length} bytes at offset {offset})")
            out[key] = json.loads(data) if kind == "json" else data.decode("utf-8")
            del data
    finally:
        for h in handles.values():
            h.close()
    return out
