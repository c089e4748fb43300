"""The kernel's scratch files: creating and naming them, writing them (behind, on a thread,
for a big text), removing them, and the error for one that cannot be written (a full disk).

Every file the host writes for a kernel is a temporary file named ``rlm-ctx-*`` (with the
suffix of what it holds: ``.txt``, ``.json``, ``.blob``, ``.manifest.json``) in
``scratch_dir``, or the system's temporary directory. A file that cannot be written is
removed, and the :class:`~rlm.errors.ContextError` raised names it (an error from ``write``
names no file) and says where to free space; its ``errno`` is the OSError's (``ENOSPC``).
"""
from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import threading
from typing import Any, Callable

from rlm.errors import ContextError

#: The name every scratch file of a context starts with.
PREFIX = "rlm-ctx-"


def new_file(suffix: str, scratch_dir: str | None) -> tuple[int, str]:
    """A new, empty scratch file: ``(fd, path)``, open for writing (``tempfile.mkstemp``)."""
    return tempfile.mkstemp(prefix=PREFIX, suffix=suffix, dir=scratch_dir)


def remove(path: str) -> None:
    """Remove ``path``; never raises (a file already gone is fine)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def scratch_error(exc: OSError, path: str | None) -> ContextError:
    """The :class:`~rlm.errors.ContextError` for a context file that could not be written
    (``exc``; ``path``: the file, when the error does not name it), e.g. a full disk."""
    where = path or exc.filename2 or exc.filename
    folder = os.path.dirname(str(where)) if where else tempfile.gettempdir()
    if os.path.basename(folder) == "ctx":  # a sandboxed kernel's context directory
        folder = os.path.dirname(folder)
    if os.path.basename(folder).startswith("rlm-k-"):  # a kernel's directory, removed by now
        folder = os.path.dirname(folder)
    err = ContextError(f"could not write the context for the kernel: {exc.strerror or exc}"
                       + (f" ({where})" if where else "") + f"; free space in {folder} or "
                       "point TMPDIR at a disk with room")
    err.errno = exc.errno  # type: ignore[attr-defined]
    return err


def naming(exc: BaseException, path: str | None) -> BaseException:
    """``exc``, or for an OSError (a ``write`` on a full disk names no file) a
    :class:`~rlm.errors.ContextError` naming ``path``, the scratch file it was writing, and
    what to do (:func:`scratch_error`)."""
    if isinstance(exc, OSError):
        return scratch_error(exc, path)
    return exc


def write_file(fd: int, path: str, buf: Any) -> None:
    """Write ``buf`` (bytes-like) to the file open as ``fd`` (its name ``path``) and close it.

    Raises:
        ContextError: it could not be written (a full disk, say): the file is removed, and
        the error names it (an error from ``write`` names no file).
    """
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(buf)
    except BaseException as exc:
        remove(path)
        named = naming(exc, path)
        if named is exc:
            raise
        raise named from None


def write_new(data: bytes, suffix: str, scratch_dir: str | None) -> str:
    """Write ``data`` to a new scratch file (:func:`new_file`); returns its path.

    Raises:
        ContextError: it could not be written (:func:`write_file`; nothing is left behind).
    """
    fd, path = new_file(suffix, scratch_dir)
    write_file(fd, path, data)
    return path


def write_hashed(fd: int, path: str, text: str, data: bytes | None) -> str:
    """Write ``data`` (None: the ASCII ``text``'s own bytes, :func:`ascii_buffer`, or its
    encoding where those cannot be had) to the file open as ``fd`` (its name ``path``) and
    close it (:func:`write_file`); returns the sha256 (hex) of the bytes written. Hashing
    and writing release the GIL.

    Raises:
        ContextError: the file could not be written (it is removed), naming it.
    """
    try:
        buf = data if data is not None else ascii_buffer(text)
        if buf is None:
            buf = text.encode("ascii")
        digest = hashlib.sha256(buf).hexdigest()
    except BaseException:
        os.close(fd)
        remove(path)
        raise
    write_file(fd, path, buf)
    return digest


def ascii_buffer(text: str) -> memoryview | None:
    """The bytes CPython stores an ASCII ``str`` in, which are its UTF-8 encoding, as a
    read-only view into the string object itself (no copy), or None where they cannot be had
    that way: another Python, a ``str`` subclass, a string not in the compact ASCII layout,
    or a view whose first and last bytes are not the text's (checked every time).

    Encoding a 50 MB text copies it into 50 MB of fresh memory, and the page faults cost as
    much as the copy: 30-40 ms here, with the GIL held, taken from a caller busy importing.
    Hashing and writing this view take the GIL for neither. The view is only valid while
    ``text`` is alive: the caller keeps a reference to it.
    """
    if sys.implementation.name != "cpython" or type(text) is not str or not text.isascii():
        return None
    n = len(text)
    head = sys.getsizeof("") - 1  # a compact ASCII str: its header, then n bytes and a NUL
    if n == 0 or sys.getsizeof(text) != head + n + 1:
        return None
    import ctypes
    view = memoryview((ctypes.c_char * n).from_address(id(text) + head)).cast("B")
    k = min(n, 256)
    if view[:k] != text[:k].encode("ascii") or view[n - k:] != text[n - k:].encode("ascii"):
        return None
    return view.toreadonly()


class Behind:
    """``fn(*args)`` run on a daemon thread, its result collected later (:meth:`result`).
    Where no thread can be started, it runs at once, in the caller's thread."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, args=(fn, args), daemon=True,
                                        name="rlm-context-write")
        try:
            self._thread.start()
        except RuntimeError:  # no thread can be started now: do it here
            self._thread = None
            self._work(fn, args)

    def _work(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            self._value = fn(*args)
        except BaseException as exc:  # handed to whoever collects the result
            self._error = exc

    def result(self) -> Any:
        """Wait for the work; its return value, or the exception it raised (raised again
        on every call)."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class BlobWriter:
    """Appends converted values to one scratch file (``rlm-ctx-*.blob``, started at the first
    :meth:`add`), recording each entry's slice."""

    def __init__(self, scratch_dir: str | None) -> None:
        self.scratch_dir, self.path, self.f, self.pos = scratch_dir, None, None, 0

    def add(self, data: bytes) -> tuple[str, int]:
        """Append ``data``; returns ``(path, offset)`` of where it went (OSError on a full
        disk: name it with :func:`naming`)."""
        if self.f is None:
            fd, self.path = new_file(".blob", self.scratch_dir)
            self.f = os.fdopen(fd, "wb")
        off = self.pos
        self.f.write(data)
        self.pos += len(data)
        return self.path, off

    def close(self) -> None:
        """Close the file (flushing it: OSError on a full disk)."""
        if self.f is not None:
            f, self.f = self.f, None
            f.close()

    def discard(self) -> None:
        """Close and remove the file, if one was started; never raises."""
        try:
            self.close()
        except OSError:
            pass
        if self.path:
            remove(self.path)
