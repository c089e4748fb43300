"""How the kernel reads its context file: UTF-8 text, a JSON document, or a *bundle*.

:func:`load_context` reads each (called by :func:`kernels.runtime.bind`). A bundle is a
many-file context.

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
        ValueError: a slice is not UTF-8 or not JSON, or a key is there twice.
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
            if key in out:  # the host writes each key once: never let one replace another
                raise ValueError(f"the context's manifest has the key {key!r} twice")
            out[key] = json.loads(data) if kind == "json" else data.decode("utf-8")
            del data
    finally:
        for h in handles.values():
            h.close()
    return out


def load_context(path: str, fmt: str, size: int | None = None):
    """Read the context file written by the host: ``fmt`` is ``"text"``, ``"json"`` or
    ``"bundle"`` (a many-file context's manifest: :func:`read_bundle`).

    ``size``: the bytes the host loaded from the file (a user's file read in place), or None.

    Returns the text (str), the decoded JSON value, or the bundle's dict. Raises OSError if
    a file cannot be read, ValueError if it is not UTF-8 (text) or not JSON (json),
    ContextChanged if a file changed since the host loaded it (another size).
    """
    if fmt == "bundle":
        return read_bundle(path)
    if fmt == "json":
        with open(path, "rb") as f:
            data = f.read()
        _check_size(path, len(data), size)
        return json.loads(data)  # the host wrote it clean (see rlm.context.load)
    return read_text(path, size)


def _check_size(path: str, got: int, size: int | None) -> None:
    if size is not None and got != size:
        raise ContextChanged(f"context file {path} changed since it was loaded ({got} bytes "
                             f"now, {size} then)")


def read_text(path: str, size: int | None = None) -> str:
    """The UTF-8 text of the file at ``path``, exactly (no newline translation, a BOM kept).

    The file is memory-mapped and decoded in one pass: its bytes are copied once, into the
    ``str``, not first into a ``bytes`` buffer (a 50 MB context loads in about half the time
    of a buffered read). An empty file, or one that cannot be mapped, is read plainly.

    ``size``: the bytes expected (the host's reading of a user's file), or None.

    Raises:
        OSError: the file cannot be opened or read. ValueError (UnicodeDecodeError): it is
        not UTF-8. ContextChanged: it does not hold ``size`` bytes.
    """
    import mmap
    with open(path, "rb") as f:
        try:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (ValueError, OSError):  # empty, or not mappable (a pipe, some filesystems)
            data = f.read()
            _check_size(path, len(data), size)
            return data.decode("utf-8")
        with m:
            _check_size(path, len(m), size)
            return str(m, "utf-8")
