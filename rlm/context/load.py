"""Loading a context from a file, several files, stdin or a Python value, and describing it.

A context is a ``str``, a ``list`` (of str or JSON-like items) or a JSON-like
``dict``. A single file is read by the format its suffix names in
:data:`rlm.context.formats.FORMATS` (``.json`` parsed as JSON, ``.jsonl``, ``.csv``, ...;
compressed files decompressed first); anything else is text (the reading steps:
:mod:`rlm.context.reading`). A directory, a glob, a list of paths, or a mapping with
``Path`` values becomes a dict of relative path -> value (:mod:`rlm.context.sources`).
Text is UTF-8, or its encoding is detected (``charset-normalizer``) unless one is given.
Bad input is refused with a message that says what to do:

- a missing path, a glob that matches nothing: ``ContextError``
- an empty file (or only whitespace), a directory with no text files: ``ContextError``
- a binary file (NUL bytes in the first 64 KiB): ``ContextError`` (in a directory:
  skipped and listed in the metadata)
- bytes that decode with no encoding (or not with the given one): ``ContextError``
  naming the byte offset and suggesting ``--encoding``
- more than ``max_bytes`` of text: ``ContextError`` naming the biggest contributors

Text UTF-8 cannot encode (a lone surrogate: a ``"\ud83d"`` escape in a JSON file, half
an emoji in a Python value) follows the one text policy of :mod:`harness.text`: it
becomes U+FFFD in the context the kernel sees and in the context's hash, and the run goes on.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.text import clean, clean_text

from rlm.context import files, formats, reading
from rlm.errors import ContextError
from rlm.models.tokens import estimate_tokens


@dataclass
class LoadedContext:
    """A context ready for a kernel.

    Attributes:
        value: the context (str, list or dict); None for a ``bundle`` (read it with
            :meth:`read_value`: the host does not hold a many-file context).
        fmt: ``"text"``, ``"json"`` or ``"bundle"``: how the kernel reads ``path``.
        path: a file the kernel can read the context from (may be the user's own file);
            give it to a kernel with :meth:`share`.
        owned: True if ``path`` is a temporary file of ours (delete after binding; moved to
            a kernel that runs as another user, and written again when needed: :meth:`share`).
        source: where it came from (path, ``"-"`` for stdin, ``"<value>"``).
    """

    value: Any
    fmt: str
    path: str | None
    owned: bool
    source: str
    encoding: str = "utf-8"
    _sha256: str | None = None
    #: precomputed :func:`describe` output (bundles, detected encodings); None: describe(value)
    meta: dict | None = None
    #: more temporary files to delete with ``path`` (a bundle's converted data)
    extra_files: list = field(default_factory=list)
    #: how to load it again (many-file contexts): sources, include, exclude, max_bytes
    spec: dict | None = None
    #: ``path`` was given away to a kernel (see :meth:`share`): the host has no file now
    _given: bool = False
    #: the file's writing and hashing still under way on a thread
    #: (:class:`rlm.context.files.Behind`), or None
    _behind: Any = None
    #: ``(size, mtime_ns)`` of the user's own file when the kernel reads it in place (not
    #: ``owned``): checked again before the kernel is given it (:meth:`share`), and the size
    #: by the kernel as it reads, so the text the kernel sees is the text the journal hashed
    stamp: tuple | None = None

    @property
    def sha256(self) -> str:
        """sha256 of the context (text as UTF-8, JSON canonicalised); computed once (a text
        context written by the host is hashed while its file is written).

        Raises:
            ContextError: the context's file, written on a thread, could not be written.
        """
        self.settle()
        if self._sha256 is None:
            blob = self.value if isinstance(self.value, str) else json.dumps(
                self.value, sort_keys=True, ensure_ascii=False)
            self._sha256 = hashlib.sha256(blob.encode("utf-8")).hexdigest()
        return self._sha256

    @property
    def writing(self) -> bool:
        """True while :attr:`path` is still being written (and hashed) on a thread: a big text
        context's file is written behind, so the caller's own set-up (imports, building the
        model client) overlaps it. :meth:`settle` waits for it; :meth:`share` and
        :attr:`sha256` do so themselves."""
        return self._behind is not None

    def settle(self) -> None:
        """Wait until the file at :attr:`path` is whole (a no-op once it is).

        Raises:
            ContextError: it could not be written (it is removed; a full disk, say), naming
            the file. Raised again on every later call.
        """
        behind = self._behind
        if behind is not None:
            self._sha256 = behind.result()
            self._behind = None

    def read_value(self) -> Any:
        """The context's value; a bundle is read from its files (as the kernel does)."""
        if self.value is None and self.fmt == "bundle" and self.path:
            from kernels.bundle import read_bundle
            return read_bundle(self.path)
        return self.value

    def share(self, kernel: Any) -> str | None:
        """The path ``kernel`` reads this context from (None: no file).

        ``kernel.share_file(path, fmt, move)`` (:meth:`kernels.kernel.Kernel.share_file`) gives
        a kernel running as another user its private copy. A temporary file of ours with the
        value in memory is *moved* there rather than copied: the host never reads it again,
        and a later call (a restarted kernel) first writes the file again from the value.

        Raises:
            ContextError: the file could not be written, copied or moved (a full disk,
            say), or a file the user who ran sudo may not read would have been copied for
            the kernel (:func:`kernels.sandbox.share_file`), naming the file.
        """
        if not self.path:
            return None
        self.settle()
        self.check_unchanged()
        try:
            movable = self.owned and self.fmt in ("text", "json") and self.value is not None
            if not movable:
                return self._share_unmoved(kernel)
            if self._given:
                self._rewrite()
                self.settle()
            dest = kernel.share_file(self.path, self.fmt, True)
        except PermissionError as exc:  # not the user's to give (sudo), or not ours to copy
            raise ContextError(f"cannot give the kernel context file {exc.filename}: "
                               f"{exc.strerror}") from None
        except OSError as exc:  # the kernel's private copy, on a full disk say
            raise files.scratch_error(exc, None) from None
        if dest != self.path:  # the kernel's own file now (whatever is at path is not ours)
            self._given = True
        return dest

    def _share_unmoved(self, kernel: Any) -> str:
        """The user's own file (or a bundle) for ``kernel``; a private copy of the user's
        file is checked against :attr:`stamp` once made (a file rewritten while it was
        copied, at the same size, would otherwise reach the kernel unnoticed)."""
        dest = kernel.share_file(self.path, self.fmt)
        if dest != self.path:
            self.check_unchanged()
        return dest

    def check_unchanged(self) -> None:
        """For the user's own file read in place (:attr:`stamp`): check it still has the size
        and modification time it had when it was loaded and hashed.

        Raises:
            ContextError: it changed (or is gone) since: the kernel would not see the text
            the run's journal records.
        """
        if self.stamp is None:
            return
        try:
            now = reading.stamp_of(os.stat(self.path))
        except OSError:
            now = None
        if now != self.stamp:
            raise ContextError(f"context file {self.path} changed since it was loaded (its "
                               "size or modification time differs): the kernel would not see "
                               "the text the run's journal records; run again once nothing "
                               "writes to it")

    def _rewrite(self) -> None:
        """Write :attr:`value` to a new temporary file (the same bytes as the first time),
        next to the one given away, and make it :attr:`path`."""
        again = _write(self.value, self.fmt, self.source, os.path.dirname(self.path) or None)
        self.path, self._given, self._behind = again.path, False, again._behind

    def discard(self) -> None:
        """Remove the temporary files, if this context wrote any (not one given to a kernel).
        Waits for a write still under way (a failed one has removed its file); never raises."""
        try:
            self.settle()
        except (OSError, ContextError):
            pass
        if self.owned and self.path:
            for p in [*([] if self._given else [self.path]), *self.extra_files]:
                try:
                    os.unlink(p)
                except OSError:
                    pass


def _decode(data: bytes, source: str, encoding: str | None) -> tuple[str, str | None]:
    return formats.decode(data, source, encoding)


def _paths(source: Any) -> list | None:
    """The paths of a many-file context given as a list/tuple of paths, else None."""
    if isinstance(source, (list, tuple)) and source and all(
            isinstance(x, os.PathLike) for x in source):
        return list(source)
    return None


def load_context(source: Any, *, encoding: str | None = None, is_json: bool | None = None,
                 scratch_dir: str | None = None, include: list | None = None,
                 exclude: list | None = None, max_bytes: int | None = None) -> LoadedContext:
    """Load a context from a path (str/Path), ``"-"`` (stdin), paths, or a Python value.

    Args:
        source: a path, ``"-"``, a :class:`pathlib.Path` (a file, a directory, or a glob
            such as ``Path("logs/*.log.gz")``), a list of ``Path``, a mapping whose values
            may be ``Path`` (read as files), or the context itself (a str that is not an
            existing path is NOT treated as a path: pass a ``Path`` to be explicit; the
            CLI always passes paths).
        encoding: text encoding of files and stdin; None or ``"auto"``: UTF-8, else detected.
        is_json: force JSON parsing (True) or text (False); default by suffix ``.json``.
        include, exclude: gitignore-style patterns on the relative paths of a many-file context.
        max_bytes: cap on the context's text in bytes (default 2,000,000,000).
    Raises:
        ContextError: missing, empty, binary, undecodable, malformed or too big input.
    """
    from rlm.context import sources
    enc = encoding or "auto"
    paths = _paths(source)
    if paths is None and isinstance(source, Path) and str(source) != "-":
        p = str(source)
        if os.path.isdir(p) or (not os.path.exists(p) and sources._MAGIC.search(p)):
            paths = [source]
    if paths is not None:
        walk, _base, origin = sources.collect(paths, include, exclude)
        return _bundle(walk.files, origin, enc, max_bytes, scratch_dir, walk.ignored, {
            "sources": [os.path.abspath(os.path.expanduser(str(x))) for x in paths],
            "include": include or None, "exclude": exclude or None, "max_bytes": max_bytes},
            unread=walk.unread, renamed=walk.renamed)
    if isinstance(source, dict) and any(isinstance(v, os.PathLike) for v in source.values()):
        items = [(sources.key_text(str(k)), Path(v) if isinstance(v, os.PathLike) else v)
                 for k, v in source.items()]
        sources.check_unique([k for k, _ in items])
        for k, v in items:
            if isinstance(v, Path) and not v.is_file():
                raise sources.not_found(v, f" (key {k!r})")
        return _bundle(items, f"a mapping of {len(items)} keys", enc, max_bytes, scratch_dir, {},
                       None)
    if isinstance(source, Path) or (type(source) is str and source == "-"):
        loaded = _load_file(str(source), enc, is_json, scratch_dir, max_bytes)
        loaded.encoding = enc
        return loaded
    if isinstance(source, (list, dict)):
        if not source:
            raise ContextError(f"context is an empty {type(source).__name__}; give the data to work on")
        try:  # before clean(): a circular value is refused here, not by a RecursionError
            blob = json.dumps(source, ensure_ascii=False)
            cleaned = clean(source)
        except (TypeError, ValueError) as exc:
            raise ContextError(f"context must be JSON-like (str, list, dict): {exc}") from None
        except RecursionError:
            raise ContextError("context is nested too deeply to hand to a kernel; flatten "
                               "it, or give it as text") from None
        return _write(cleaned, "json", "<value>", scratch_dir, blob if cleaned is source else None)
    if isinstance(source, bytes):
        reading.check_bytes(source, "<bytes>")
        raw = source
        source, detected = _decode(raw, "<bytes>", encoding)
        if reading.blank(source):
            raise ContextError("context is empty; give the text to work on")
        # bytes read as UTF-8 (no BOM, no other encoding found) are the text's own encoding
        same = formats.is_utf8(encoding) and detected is None and not raw.startswith(b"\xef\xbb\xbf")
        ctx = _write_text(source, "<value>", scratch_dir, raw if same else None)
        if detected:  # told to the model, as for a file
            ctx.meta = describe(ctx.value)
            ctx.meta["note"] = f"It holds text decoded from bytes as {detected} (detected)."
        return ctx
    if isinstance(source, str):
        if type(source) is not str:  # a subclass: its own text, not what its methods say
            source = str.__str__(source)
        if reading.blank(source):
            raise ContextError("context is empty; give the text to work on")
        return _write_text(source, "<value>", scratch_dir)
    raise ContextError(f"context must be a str, list, dict or Path, not {type(source).__name__}")


class Literal(str):
    """A str that is its own context, whatever it looks like: ``"-"`` is not stdin, and a
    path, a glob or a device name is text, never opened (:func:`load_value`)."""

    __slots__ = ()


def _no_paths(value: Any, depth: int = 0) -> bool:
    """True if ``value`` (str, list, dict) holds no path object at any depth (JSON data)."""
    if isinstance(value, os.PathLike):
        return False
    if depth > 200 or not isinstance(value, (list, dict)):
        return True
    items = value.values() if isinstance(value, dict) else value
    return all(_no_paths(x, depth + 1) for x in items)


def load_value(value: Any, *, scratch_dir: str | None = None,
               max_bytes: int | None = None) -> LoadedContext:
    """Load a context handed over as a value by someone who is not the host's user: a cell's
    ``rlm(...)``/``rlm_batched(...)`` argument, a serve client's ``context`` or messages.

    A str is the context's own text whatever it looks like (``"-"``, ``"/etc/passwd"``,
    ``"/dev/zero"``, a FIFO's path, a glob); a list or dict is JSON data. Nothing here opens a
    file, a device, a FIFO or standard input: only :func:`load_context`, given a ``Path`` or
    ``"-"`` by the host's user, does.

    Raises:
        ContextError: the value is not a str, list or dict, holds a path object, is empty or
            too big (as :func:`load_context`).
    """
    if isinstance(value, str):
        return load_context(Literal(value), scratch_dir=scratch_dir, max_bytes=max_bytes)
    if isinstance(value, (list, dict)) and _no_paths(value):
        return load_context(value, scratch_dir=scratch_dir, max_bytes=max_bytes)
    raise ContextError(f"a context passed as a value must be a str, a list or a JSON object, "
                       f"not {type(value).__name__}")


def _bundle(items: list, origin: str, enc: str, max_bytes, scratch_dir, ignored: dict,
            spec: dict | None, unread: list | None = None,
            renamed: dict | None = None) -> LoadedContext:
    from rlm.context import sources
    b = sources.build(items, origin=origin, encoding=enc, max_bytes=max_bytes,
                      scratch_dir=scratch_dir, ignored=ignored, unread=unread, renamed=renamed)
    ctx = LoadedContext(None, "bundle", b.manifest, True, origin, enc, b.sha256, meta=b.meta,
                        extra_files=[b.blob] if b.blob else [], spec=spec)
    return ctx


def _load_file(path: str, encoding: str, is_json: bool | None, scratch_dir: str | None,
               max_bytes: int | None = None) -> LoadedContext:
    """One file, or stdin (``"-"``), as a context, in steps: stat and refuse, read (up to
    the cap), decompress, convert by its format (:data:`rlm.context.formats.FORMATS`; JSON
    by :func:`_load_json`), then hash and hand over (:func:`_hand_over`).

    Raises:
        ContextError: an empty path, a missing file, a directory, an empty, binary,
            undecodable, malformed or too big input, or a file that changed while read.
    """
    from rlm.context.sources import DEFAULT_MAX_BYTES
    limit = DEFAULT_MAX_BYTES if max_bytes is None else int(max_bytes)
    read = reading.read_stdin(limit) if path == "-" else reading.read_file(path, limit)
    reading.decompress(read, limit)
    fmt = _format(read.name, is_json)
    if fmt is formats.JSON:
        return _load_json(read, encoding, scratch_dir)
    conv = formats.convert(read.name, read.data, read.source, encoding, fmt=fmt)
    return _hand_over(read, conv, encoding, scratch_dir)


def _format(name: str, is_json: bool | None) -> formats.Format:
    """The format to read the file ``name`` as: by its suffix (:func:`formats.format_of`),
    or forced: JSON (``is_json`` True), or not JSON (False: a ``.json`` file is text)."""
    if is_json:
        return formats.JSON
    fmt = formats.format_of(name)
    return formats.TEXT if is_json is False and fmt is formats.JSON else fmt


def _load_json(read: reading.Read, encoding: str | None, scratch_dir: str | None) -> LoadedContext:
    """A JSON file's value (:func:`formats.parse_json`): a JSON string is a text context;
    a list or an object is read by the kernel from the user's own file when its bytes are
    that value's UTF-8 JSON (a regular file, not compressed, no BOM, no text to clean),
    else from a scratch file.

    Raises:
        ContextError: not JSON, a JSON scalar, an empty value, or a scratch file that could
            not be written.
    """
    text, detected = _decode(read.data, read.source, encoding)
    value = formats.parse_json(text, read.source)
    if not value or (isinstance(value, str) and reading.blank(value)):
        raise ContextError(f"context {read.source} is an empty JSON {type(value).__name__}; "
                           "give the data to work on")
    try:
        cleaned = clean(value)  # "\ud83d" escapes decode to lone surrogates
    except RecursionError:  # json's own limit is a little deeper than clean()'s
        raise formats.unparsable(read.source, "JSON", RecursionError()) from None
    if isinstance(cleaned, str):
        return _write_text(cleaned, read.source, scratch_dir)
    if read.regular and not read.comp and cleaned is value and detected is None \
            and not read.data.startswith(reading.BOM) and formats.is_utf8(encoding):
        return LoadedContext(value, "json", os.path.abspath(read.path), False, read.source,
                             stamp=read.stamp)
    return _write(cleaned, "json", read.source, scratch_dir)


def _hand_over(read: reading.Read, conv: formats.Converted, encoding: str | None,
               scratch_dir: str | None) -> LoadedContext:
    """A converted file as a context for the kernel: refused when empty; the plain UTF-8
    text of a regular file is read by the kernel in place (:func:`_in_place`); anything
    else is written to a scratch file, with a note on what it holds when it was converted.

    Raises:
        ContextError: nothing in it, or a scratch file that could not be written.
    """
    if conv.kind != "text" and not conv.value:
        what = "keys" if isinstance(conv.value, dict) else conv.kind
        raise ContextError(f"context {read.source} is empty (no {what}); give the data to "
                           "work on")
    if conv.kind == "text" and reading.blank(conv.value):
        raise ContextError(f"context {read.source} is empty; give a file with the text to "
                           "work on")
    if conv.kind == "text" and not conv.notes and read.regular and not read.comp \
            and formats.is_utf8(encoding) and not read.data.startswith(reading.BOM):
        return _in_place(read, conv.value)
    ctx = (_write_text(conv.value, read.source, scratch_dir) if conv.kind == "text"
           else _write(conv.value, "json", read.source, scratch_dir))
    if conv.notes or conv.kind != "text":
        what = formats.describe_kind(conv.kind, phrase=True)
        name = os.path.basename(read.path) or read.source
        ctx.meta = describe(conv.value)
        ctx.meta["note"] = f"It holds {what} read from {name}" + (
            f" ({'; '.join(conv.notes)})" if conv.notes else "") + "."
        if "listing" in ctx.meta:  # a dict's listing is the prompt's whole text (TOML)
            ctx.meta["listing"] += " " + ctx.meta["note"]
    return ctx


def _in_place(read: reading.Read, text: str) -> LoadedContext:
    """The user's own file for the kernel to read: its bytes are the text's UTF-8 encoding,
    hashed from them (behind, on a thread, when big: like a file the host writes)."""
    ctx = LoadedContext(text, "text", os.path.abspath(read.path), False, read.source,
                        stamp=read.stamp)
    if len(read.data) >= _WRITE_BEHIND:
        ctx._behind = files.Behind(_sha256_hex, read.data)
    else:
        ctx._sha256 = _sha256_hex(read.data)
    return ctx


#: From this size (bytes, or characters of an ASCII text) a text context's file is written and
#: hashed behind, on a thread (:class:`rlm.context.files.Behind`), so that the caller's own
#: set-up overlaps it.
_WRITE_BEHIND = 1 << 20


def _write_text(text: str, source: str, scratch_dir: str | None,
                data: bytes | None = None) -> LoadedContext:
    """Write a text context to a temporary file for the kernel, hashing it on the way.

    The file holds the text's UTF-8 bytes, hashed (sha256, for
    :attr:`LoadedContext.sha256`) when they are written (:func:`files.write_hashed`). A big
    one (from :data:`_WRITE_BEHIND`) is written behind, on a thread: this returns at once and
    :meth:`LoadedContext.settle` (called by :meth:`~LoadedContext.share` and
    :attr:`~LoadedContext.sha256`) waits for it. A big ASCII text, the common case, is
    not encoded at all: its own bytes are written (:func:`files.ascii_buffer`).
    A text UTF-8 cannot encode (a lone surrogate) follows the text policy of
    :mod:`harness.text` (U+FFFD in the file, the value and the hash); text without one is
    kept as the very object given (no copy).

    Args:
        text: the context (str). data: its UTF-8 encoding, if the caller has it already
            (bytes given by the user that decoded as UTF-8 without a BOM).
    Raises:
        ContextError: the file could not be written (it is removed; a full disk, say); for a
        file written behind, raised by :meth:`LoadedContext.settle` instead.
    """
    if data is None and not (len(text) >= _WRITE_BEHIND and text.isascii()):
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            text = clean_text(text)
            data = text.encode("utf-8")
    fd, path = files.new_file(".txt", scratch_dir)
    ctx = LoadedContext(text, "text", path, True, source)
    if len(text if data is None else data) >= _WRITE_BEHIND:
        ctx._behind = files.Behind(files.write_hashed, fd, path, text, data)
    else:
        ctx._sha256 = files.write_hashed(fd, path, text, data)
    return ctx


def _sha256_hex(data: bytes) -> str:
    """The sha256 of ``data``, hex."""
    return hashlib.sha256(data).hexdigest()


def _write(value: Any, fmt: str, source: str, scratch_dir: str | None,
           blob: str | None = None) -> LoadedContext:
    """Write a context to a temporary file for the kernel: text (:func:`_write_text`) or
    JSON (``fmt`` ``"json"``; ``blob``: ``value`` already serialised, else it is here, in one
    pass of the C encoder, and written with one ``write``).

    Raises:
        ContextError: the file could not be written (:func:`files.write_file`).
    """
    if fmt == "text":
        return _write_text(value, source, scratch_dir)
    data = (json.dumps(value, ensure_ascii=False) if blob is None else blob).encode("utf-8")
    path = files.write_new(data, ".json", scratch_dir)
    return LoadedContext(value, fmt, path, True, source)


def describe(value: Any) -> dict:
    """Metadata about a context for the system prompt (never the content itself).

    Returns ``{"type", "chars", "tokens_estimate", "items", "item_chars"}``;
    ``item_chars`` lists each item's length for lists (first 50) and dicts (by key).
    A dict also gets ``listing`` (see :func:`rlm.context.sources.describe_files`); a
    :class:`LoadedContext` returns its precomputed metadata when it has some.
    """
    if isinstance(value, LoadedContext):
        return value.meta if value.meta is not None else describe(value.value)
    if isinstance(value, str):
        n = len(value)
        return {"type": "str", "chars": n, "tokens_estimate": estimate_tokens(n)}
    if isinstance(value, list):
        lens = [len(x) if isinstance(x, str) else len(json.dumps(x, ensure_ascii=False)) for x in value]
        n = sum(lens)
        return {"type": "list", "chars": n, "tokens_estimate": estimate_tokens(n),
                "items": len(value), "item_chars": lens[:50]}
    if isinstance(value, dict):
        from rlm.context.sources import describe_files
        info = {str(k): ("text", len(v)) if isinstance(v, str) else
                ("list" if isinstance(v, list) else "dict" if isinstance(v, dict) else "json",
                 len(json.dumps(v, ensure_ascii=False))) for k, v in value.items()}
        return describe_files(info)
    s = str(value)
    return {"type": type(value).__name__, "chars": len(s), "tokens_estimate": estimate_tokens(len(s))}
