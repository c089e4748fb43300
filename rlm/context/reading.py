"""Reading one input of a single-file context (a file, a device, a pipe, stdin), before it
is converted: stat and refuse, read up to the cap (``--max-context-bytes``), decompress, and
refuse what is empty or binary. The steps :func:`rlm.context.load.load_context` takes for
one file before :mod:`rlm.context.formats` converts it.
"""
from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from rlm.context import formats
from rlm.context.walk import not_regular, open_regular
from rlm.errors import ContextError

#: The UTF-8 byte order mark.
BOM = b"\xef\xbb\xbf"


@dataclass
class Read:
    """One file (or stdin) as read for a single-file context, before it is converted."""

    path: str  # as given; "-" for stdin
    source: str  # as messages name it: the path, or "<stdin>"
    name: str  # the file's name (lower case, without its compression suffix once decompressed)
    comp: str | None  # its compression suffix (".gz"), or None
    data: bytes
    regular: bool = False  # a regular file (read in place by the kernel when it can be)
    stamp: tuple | None = None  # its (size, mtime_ns) as read


def blank(text: str | bytes) -> bool:
    """True if ``text`` is empty or only whitespace; stops at the first other character
    (``strip()`` would copy a whole context that ends in a newline)."""
    return not text or text.isspace()


def check_bytes(data: bytes, source: str) -> None:
    """Refuse ``data`` that is empty (or only whitespace) or binary (NUL bytes in its first
    64 KiB, unless it starts with a UTF-16 byte order mark).

    Raises:
        ContextError: empty or binary, naming ``source``.
    """
    if blank(data):
        raise ContextError(f"context {source} is empty; give a file with the text to work on")
    if b"\x00" in data[:65536] and not data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ContextError(f"context {source} looks binary (it contains NUL bytes); "
                           "give a text or .json file (convert office files to text first)")


def read_capped(f, limit: int, source: str, *, sized: bool, early: bool) -> bytes:
    """All of ``f`` (a binary file object: a file, a device, a pipe, stdin), refusing more than
    ``limit`` bytes. ``sized``: a regular file already checked against ``limit`` by its size,
    read in one buffer; otherwise it is read in chunks and never past ``limit + 1`` bytes.
    ``early``: check the first chunk for NUL bytes before reading on (for sources with no
    size, which may never end).

    Raises:
        ContextError: over ``limit``, or binary at its start (``early``).
    """
    from rlm.context.sources import _CHUNK, _human
    if sized:
        data = f.read()  # one buffer of the file's size
        if len(data) <= limit:  # (it may have grown since its size was checked)
            return data
    else:
        chunks: list[bytes] = []
        total = 0
        while total <= limit:
            chunk = f.read(min(_CHUNK, limit + 1 - total))
            if not chunk:
                return b"".join(chunks)
            if early and not chunks and not blank(chunk):
                check_bytes(chunk, source)
            chunks.append(chunk)
            total += len(chunk)
    raise ContextError(f"context {source} holds more than --max-context-bytes {limit:,} "
                       f"({_human(limit)}): reading stopped there. Give a smaller input, or "
                       "raise --max-context-bytes")


def read_stdin(limit: int) -> Read:
    """All of stdin, up to ``limit`` bytes (given up at once when its first bytes are binary).

    Raises:
        ContextError: over ``limit``, or binary at its start.
    """
    data = read_capped(sys.stdin.buffer, limit, "<stdin>", sized=False, early=True)
    return Read("-", "<stdin>", "", None, data)


def read_file(path: str, limit: int) -> Read:
    """Stat a file and refuse it (not there, a directory, not a regular file, over
    ``limit``), then read it in one buffer, checked unchanged since its size was taken. A FIFO,
    a device or a socket is refused before it is opened (a FIFO would block the host, a device
    may never end): a stream is given on stdin (``--context -``). A symlink is read where it
    leads (the user named it). On a root host started through sudo whose kernels run as
    another user, a file the user who ran sudo may not read is refused
    (:func:`rlm.context.sources.confining_user`).

    Raises:
        ContextError: an empty path, a missing file, a directory, a FIFO, device or socket,
            over ``limit``, a file that cannot be read (or that the user who ran sudo may not
            read) or that changed while it was read.
    """
    from rlm.context.sources import _too_big, confining_user, not_the_users, shown_path
    p = _existing_file(path)
    comp = formats.split_suffixes(p.name)[1]
    try:
        st = p.stat()
        not_regular(st.st_mode, shown_path(path))
        user = confining_user()
        if user is not None:
            from kernels.sandbox import _readable
            if not _readable(str(p), user, {}):
                raise ContextError(f"context file {shown_path(path)} is "
                                   f"{not_the_users(user)}; run rlm as that user, or give "
                                   "a file it may read")
        if st.st_size > limit:
            raise _too_big([(p.name, st.st_size)], limit, path)
        with open_regular(str(p), shown_path(path)) as f:
            data = read_capped(f, limit, path, sized=True, early=False)
            stamp = stamp_of(os.fstat(f.fileno()))
    except OSError as exc:
        raise ContextError(f"cannot read context file {path}: {exc.strerror}") from None
    if stamp != stamp_of(st) or stamp[0] != len(data):
        raise ContextError(f"context file {shown_path(path)} changed while it was read; run "
                           "again once nothing writes to it")
    return Read(path, path, p.name, comp, data, True, stamp)


def _existing_file(path: str) -> Path:
    """``path`` as a :class:`~pathlib.Path`, once it is known to be there and not a directory.

    Raises:
        ContextError: an empty path, a missing file, or a directory.
    """
    from rlm.context.sources import not_found
    if not path:
        raise ContextError("the context path is empty: give a file, a directory or '-' "
                           "for stdin")
    p = Path(path)
    if not p.exists():
        raise not_found(path)
    if p.is_dir():
        from rlm.context.sources import shown_path
        raise ContextError(f"context path is a directory, not a file: {shown_path(path)}")
    return p


def decompress(read: Read, limit: int) -> None:
    """Refuse an empty input; decompress a compressed one (in ``read``: its data and name),
    refusing to grow past ``limit``; then refuse a binary one (unless its format reads
    bytes: PDF).

    Raises:
        ContextError: empty, binary, corrupt, or decompressing past ``limit``.
    """
    from rlm.context.sources import _too_big
    if blank(read.data):
        check_bytes(read.data, read.source)
    if read.comp:
        try:
            read.data = formats.decompress(read.data, read.comp, read.source, limit)
        except formats.TooBig:
            raise _too_big([(read.name, limit)], limit, read.path, unfinished=read.name) from None
        read.name = formats.split_suffixes(read.name)[0]
    if not formats.format_of(read.name).binary:
        check_bytes(read.data, read.source)


def stamp_of(st: os.stat_result) -> tuple:
    """``(size, mtime_ns)``: what tells a file changed since it was read."""
    return st.st_size, st.st_mtime_ns
