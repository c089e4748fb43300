"""Contexts made of many files: a directory, several paths, a glob, or a mapping whose values
are paths, loaded as a ``dict`` of relative path -> value (see :mod:`rlm.context.formats`).

Which files (a walk never follows directory symlinks):

- only what the user named: a symlink whose target resolves (``os.path.realpath``) outside
  the named roots (each directory, each glob's fixed prefix, each file named) is not read,
  nor a FIFO, a socket or a device (directly or through a symlink), a broken symlink or a
  symlink loop; a symlinked directory is not walked. Each is listed with its reason
  (:data:`OUTSIDE` and the like). A file named itself in a list of paths may be a symlink
  to anywhere (the user named it), but must be a regular file;
- hidden files and directories (``.git``, ``.venv``, ``.env``), ``__pycache__``,
  ``node_modules`` and virtual environments (a directory holding ``pyvenv.cfg``) are left out;
- ``.gitignore`` files inside the walked tree are honoured (``pathspec``, git's rules);
- ``include`` keeps only keys matching one of its patterns, ``exclude`` drops matches
  (gitignore-style patterns on the relative path: ``*.py``, ``docs/``, ``src/**/test_*``);
- files that are not text are skipped and listed with their size and why, never dropped
  silently; what rules left out is counted in the metadata too (a directory once, not every
  file in it), and so is a second key for the same file (an inside symlink to it);
- on a root host started through sudo whose kernels run as another user, a file the user
  who ran sudo (``SUDO_UID``) may not read is not read either
  (:func:`kernels.sandbox.starting_user`).

Every entry a walk meets ends up as a key, or listed: among the rules' counts, or among the
paths not read (``unread``, with the reason of each).

Keys are relative to the directory (one directory), the glob's fixed prefix (one glob), or
the common parent of all given paths (several), with ``/`` separators, in sorted order.

Large contexts stay cheap: a UTF-8 text file is checked and hashed in 1 MiB chunks and not
copied; the kernel reads it in place. Other files (decompressed, re-encoded, parsed) are
converted one at a time into one scratch file. The host never holds the whole context, and
the context's sha256 is computed while streaming.
"""
from __future__ import annotations

import codecs
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.text import clean

from rlm.context import formats
from rlm.context.files import BlobWriter, naming, write_new
from rlm.context.listing import _ignored_text, describe_files  # noqa: F401  (re-exported)
from rlm.errors import ContextError

from rlm.context.walk import open_regular
from rlm.context.walk import (_CHUNK, _MAGIC, Bundle, DEFAULT_MAX_BYTES,  # noqa: F401
                             _kind, collect, confining_user, key_text, not_found,
                             not_the_users, shown_path)


def check_unique(keys: list) -> None:
    """Refuse a many-file context two of whose keys are the same text (str keys).

    Raises:
        ContextError: naming the key; a value would otherwise replace another's silently.
    """
    seen: set = set()
    for k in keys:
        if k in seen:
            raise ContextError(f"two entries of the context have the key {k!r} (names that "
                               "differ only in bytes that are not UTF-8 are keyed with \\xHH "
                               "escapes, see docs/contexts.md); give them distinct keys")
        seen.add(k)


def _human(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if round(n, 0 if unit == "bytes" else 1) < 1000 or unit == "TB":  # not "1,000.0 KB"
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1000
    return str(n)


def _too_big(sizes: list, limit: int, what: str, *,
             unfinished: str | None = None) -> ContextError:
    """The cap error naming the biggest files and top-level directories.

    ``sizes``: ``(key, bytes)`` pairs. ``unfinished``: the key of the entry whose size is
    only known to be more than the bytes given (a compressed file whose decompression was
    stopped at the cap): it, and the total, are said to be "more than" that.
    """
    total = sum(s for _, s in sizes)

    def size(k: str, n: int) -> str:
        return f"more than {_human(n)}" if k == unfinished else _human(n)

    by_dir: dict[str, list] = {}
    for k, s in sizes:
        top = k.split("/", 1)[0] + "/" if "/" in k else None
        if top:
            d = by_dir.setdefault(top, [0, 0])
            d[0] += s
            d[1] += 1
    big = sorted(sizes, key=lambda x: -x[1])[:5]
    parts = [f"{k} {size(k, s)}" for k, s in big]
    dirs = sorted(by_dir.items(), key=lambda x: -x[1][0])[:3]
    if dirs:
        parts.append("by directory: " + ", ".join(f"{d} {_human(v[0])} ({v[1]} files)"
                                                  for d, v in dirs))
    total_text = size(unfinished, total) if unfinished is not None else _human(total)
    return ContextError(f"context {what} is {total_text}, over --max-context-bytes {limit:,} "
                        f"({_human(limit)}); biggest: {'; '.join(parts)}. Leave files out with "
                        "--exclude PATTERN (or --include), or raise --max-context-bytes")


def _scan_in_place(path: str) -> tuple[int, int, int, str] | None:
    """Check a file is UTF-8 text without holding it: ``(offset, nbytes, chars, sha256)``,
    or None when it needs converting (not UTF-8, a BOM other than UTF-8's, NUL bytes)."""
    dec = codecs.getincrementaldecoder("utf-8")()
    h = hashlib.sha256()
    chars = nbytes = 0
    with open_regular(path) as f:  # a FIFO swapped in since the walk is never read
        first = f.read(_CHUNK)
        if formats.looks_binary(first) or formats._bom_encoding(first):
            return None
        off = 3 if first.startswith(codecs.BOM_UTF8) else 0
        chunk = first[off:]
        if len(first) < _CHUNK:  # small file: no thread
            h.update(chunk)
            try:
                return off, len(chunk), len(chunk) if chunk.isascii() else len(
                    chunk.decode("utf-8")), h.hexdigest()
            except UnicodeDecodeError:
                return None
        # sha256 releases the GIL: hash one chunk in a thread while this one checks it
        pool = _hash_pool()
        try:
            while chunk:
                fut = pool.submit(h.update, chunk)
                nbytes += len(chunk)
                try:
                    chars += len(chunk) if chunk.isascii() else len(dec.decode(chunk))
                finally:
                    fut.result()
                chunk = f.read(_CHUNK)
            dec.decode(b"", final=True)
        except UnicodeDecodeError:
            return None
    return off, nbytes, chars, h.hexdigest()


_POOL = None


def _hash_pool():
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor
        _POOL = ThreadPoolExecutor(1, thread_name_prefix="rlm-hash")
    return _POOL


def build(items: list, *, origin: str, encoding: str | None = None,
          max_bytes: int | None = None, scratch_dir: str | None = None,
          ignored: dict | None = None, unread: list | None = None,
          renamed: dict | None = None) -> Bundle:
    """Load ``items`` (``(key, Path)`` to read, or ``(key, value)`` given) into a bundle.

    ``ignored`` (why -> [count, examples]) and ``unread`` (``(key, reason)``: paths met and
    not read, :func:`collect`) are listed in its metadata, with the files found not to be
    text, or not to be read after all (:meth:`_Builder.add`).

    Raises:
        ContextError: nothing loadable (empty, or only files that are not text), or more
            than ``max_bytes`` of text (naming the biggest contributors).
    """
    limit = DEFAULT_MAX_BYTES if max_bytes is None else int(max_bytes)
    _check_sizes_on_disk(items, limit, origin)
    enc = None if encoding in (None, "", "auto") else encoding
    b = _Builder(origin, enc, limit, BlobWriter(scratch_dir), unread=list(unread or ()),
                 user=confining_user())
    try:
        for key, src in items:
            b.add(key, src)
        b.writer.close()
    except BaseException as exc:
        b.writer.discard()
        named = naming(exc, b.writer.path)
        if named is exc:
            raise
        raise named from None
    if not b.entries:
        _refuse_nothing_loaded(b, origin, ignored)
    check_unique([e[0] for e in b.entries])
    for new, old in (renamed or {}).items():  # (collect: two files whose keys agreed)
        if new in b.info:
            b.notes.setdefault(new, []).append(f"the file's key would be {old!r}, which "
                                               "another file has")
    manifest = _write_manifest(b, scratch_dir)
    meta = describe_files(b.info, origin=origin, skipped=b.skipped, ignored=ignored or {},
                          notes=b.notes, unread=sorted(b.unread))
    return Bundle(manifest, b.writer.path, b.digest.hexdigest(), meta, len(b.entries), origin)


def _check_sizes_on_disk(items: list, limit: int, origin: str) -> None:
    """Refuse at once files whose sizes on disk add up past ``limit`` (compressed files are
    counted as they decompress, by :class:`_Builder`)."""
    disk = [(k, os.path.getsize(v)) for k, v in items if isinstance(v, Path)
            and formats.split_suffixes(k)[1] is None]
    if sum(s for _, s in disk) > limit:
        raise _too_big(disk, limit, origin)


@dataclass
class _Builder:
    """The state of one :func:`build`: the scratch file, the manifest's entries, the
    listing's facts, and the running total and hash."""

    origin: str
    enc: str | None
    limit: int
    writer: BlobWriter
    entries: list = field(default_factory=list)        # manifest entries, in key order
    info: dict = field(default_factory=dict)           # key -> (kind, characters)
    skipped: list = field(default_factory=list)        # (key, bytes, reason): not text
    notes: dict = field(default_factory=dict)          # key -> notes of its conversion
    digest: Any = field(default_factory=hashlib.sha256)
    total: int = 0                                     # bytes loaded so far
    loaded_sizes: list = field(default_factory=list)   # (key, bytes) loaded so far
    unread: list = field(default_factory=list)         # (key, reason): not read at all
    user: Any = None                                   # whose rights bound the reading
    searchable: dict = field(default_factory=dict)     # (for kernels.sandbox._readable)

    def add(self, key: str, src: Any) -> None:
        """Load one item: a file (read in place, or converted into the scratch file; a
        file that is not text is skipped and listed) or a value given."""
        if isinstance(src, Path):
            loaded = self._read_file(key, src)
            if loaded is None:
                return
            kind, (entry, chars, value_sha, n) = loaded
        else:
            kind = "text" if isinstance(src, str) else "json"
            entry, chars, value_sha, n = _store(self.writer, key, src, kind)
        self._record(key, kind, entry, chars, value_sha, n)

    def _read_file(self, key: str, src: Path) -> tuple[str, tuple] | None:
        """``(kind, (entry, chars, sha256, bytes))`` for a file, or None: skipped."""
        path = str(src)
        why, size = self._unreadable(path)
        if why:
            self.unread.append((key, why))
            return None
        inner, comp = formats.split_suffixes(os.path.basename(path))
        scan = None
        if comp is None and formats.format_of(inner, directory=True) is formats.TEXT \
                and formats.suffix(inner) not in formats.BINARY_SUFFIXES \
                and self.enc in (None, "utf-8", "utf8"):
            scan = _scan_in_place(path)
        if scan is not None:  # UTF-8 text: the kernel reads the user's file in place
            off, n, chars, sha = scan
            # a symlink: where it led when it was checked (collect), whatever it is made
            # to point at later
            where = os.path.realpath(path) if os.path.islink(path) else os.path.abspath(path)
            return "text", ([key, where, off, n, "text"], chars, sha, n)
        conv = self._convert(key, path, size)
        if conv is None:
            return None
        if conv.notes:
            self.notes[key] = conv.notes
        return conv.kind, _store(self.writer, key, conv.value, conv.kind)

    def _unreadable(self, path: str) -> tuple[str | None, int]:
        """``(why, size)``: why the file at ``path`` is not read after all (None: it is read),
        and its size: it is no longer a regular file (a FIFO would block the reading), or
        the user who ran sudo may not read it (:func:`confining_user`)."""
        try:
            st = os.stat(path)
        except OSError as exc:
            return f"cannot be read ({exc.strerror})", 0
        why = _kind(st.st_mode)
        if why is None and self.user is not None:
            from kernels.sandbox import _readable
            if not _readable(path, self.user, self.searchable):
                why = not_the_users(self.user)
        return why, st.st_size

    def _convert(self, key: str, path: str, size: int) -> formats.Converted | None:
        """A file's converted value (:func:`rlm.context.formats.convert`), or None when it
        is not text (skipped, with its size and why).

        Raises:
            ContextError: it decompresses past the cap (naming the biggest contributors).
        """
        try:
            with open_regular(path) as f:
                data = f.read()
            return formats.convert(os.path.basename(path), data, key, self.enc,
                                   limit=self.limit - self.total, lenient=True)
        except formats.TooBig:
            raise _too_big(self.loaded_sizes + [(key, self.limit - self.total)], self.limit,
                           self.origin, unfinished=key) from None
        except formats.Unreadable as exc:
            self.skipped.append((key, size, exc.reason))
        except ContextError as exc:  # an explicit --encoding that does not fit
            self.skipped.append((key, size, str(exc).split(" (", 1)[0].replace(
                f"context {key} is ", "")))
        return None

    def _record(self, key: str, kind: str, entry: list, chars: int, value_sha: str,
                n: int) -> None:
        """Count a loaded entry against the cap and into the hash, the manifest and the
        listing.

        Raises:
            ContextError: the total is now past the cap.
        """
        self.total += n
        self.loaded_sizes.append((key, n))
        if self.total > self.limit:
            raise _too_big(self.loaded_sizes, self.limit, self.origin)
        self.digest.update(json.dumps([key, entry[4], value_sha]).encode() + b"\n")
        self.entries.append(entry)
        self.info[key] = (kind, chars)


def _refuse_nothing_loaded(b: _Builder, origin: str, ignored: dict | None) -> None:
    """Raise the ContextError for a build that loaded nothing: no files at all, or only
    files that are not text (removing the scratch file, if one was started)."""
    if b.writer.path:
        os.unlink(b.writer.path)
    skipped = b.skipped
    unread = sorted(b.unread)
    not_read = (f"{len(unread)} not read: " + ", ".join(f"{k} ({r})" for k, r in unread[:5])
                + (" ..." if len(unread) > 5 else "")) if unread else ""
    if not skipped:
        extra = "; ".join(x for x in (not_read, _ignored_text(ignored or {})) if x)
        raise ContextError(f"the context ({origin}) has no files to read" +
                           (f" ({extra})" if extra else "") + "; give a directory with text files")
    shown = ", ".join(f"{k} ({r})" for k, _, r in skipped[:5])
    raise ContextError(f"the context ({origin}) has no text files: {len(skipped)} file(s) "
                       f"skipped as not text: {shown}{' ...' if len(skipped) > 5 else ''}"
                       + (f"; {not_read}" if not_read else ""))


def _write_manifest(b: _Builder, scratch_dir: str | None) -> str:
    """Write the manifest the kernel binds from (:mod:`kernels.bundle`); returns its path.

    Raises:
        ContextError: it could not be written (the scratch file is removed too).
    """
    try:
        # ASCII: a path that is not UTF-8 keeps its surrogate escapes for the kernel's open()
        data = json.dumps({"version": 1, "entries": b.entries}).encode("ascii")
        return write_new(data, ".manifest.json", scratch_dir)
    except BaseException:
        b.writer.discard()
        raise


def _store(writer: BlobWriter, key: str, value: Any, kind: str):
    """Append ``value`` to the scratch file: ``(entry, chars, sha256, bytes)``, the entry
    ``[key, path, offset, bytes, "text" | "json"]``.

    Raises:
        ContextError: a value that is not JSON-like.
    """
    value = clean(value)  # a mapping's own values may hold lone surrogates: see harness.text
    if isinstance(value, str) and kind == "text":
        data = value.encode("utf-8")
        chars, fmt = len(value), "text"
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise ContextError(f"context value for {key!r} must be JSON-like: {exc}") from None
        data, chars, fmt = text.encode("utf-8"), len(text), "json"
    path, off = writer.add(data)
    return [key, path, off, len(data), fmt], chars, hashlib.sha256(data).hexdigest(), len(data)
