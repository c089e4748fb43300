"""Loading a context from a file, stdin or a Python value, and describing it.

A context is a ``str``, a ``list`` (of str or JSON-like items) or a JSON-like
``dict``. Files: ``.json`` is parsed as JSON; anything else is text. Text must
decode with the given encoding (UTF-8 by default, a BOM is dropped); bad input
is refused with a message that says what to do:

- a missing path or a directory: ``ContextError``
- an empty file (or only whitespace): ``ContextError``
- a binary file (NUL bytes in the first 64 KiB): ``ContextError``
- bytes that do not decode: ``ContextError`` naming the byte offset and
  suggesting ``--encoding latin-1`` (or the file's real encoding)

Text UTF-8 cannot encode (a lone surrogate: a ``"\ud83d"`` escape in a JSON file, half
an emoji in a Python value) follows the one text policy of :mod:`harness.text`: it
becomes U+FFFD in the context the kernel sees and in the context's hash, and the run goes on.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.text import clean, clean_text

from .errors import ContextError
from .tokens import estimate_tokens


@dataclass
class LoadedContext:
    """A context ready for a kernel.

    Attributes:
        value: the context (str, list or dict).
        fmt: ``"text"`` or ``"json"``: how the kernel reads ``path``.
        path: a file the kernel can read the context from (may be the user's own file).
        owned: True if ``path`` is a temporary file of ours (delete after binding).
        source: where it came from (path, ``"-"`` for stdin, ``"<value>"``).
    """

    value: Any
    fmt: str
    path: str | None
    owned: bool
    source: str
    encoding: str = "utf-8"
    _sha256: str | None = None

    @property
    def sha256(self) -> str:
        """sha256 of the context (text as UTF-8, JSON canonicalised); computed once."""
        if self._sha256 is None:
            import hashlib
            blob = self.value if isinstance(self.value, str) else json.dumps(
                self.value, sort_keys=True, ensure_ascii=False)
            self._sha256 = hashlib.sha256(blob.encode("utf-8")).hexdigest()
        return self._sha256

    def discard(self) -> None:
        """Remove the temporary file, if this context wrote one."""
        if self.owned and self.path:
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _check_bytes(data: bytes, source: str) -> None:
    if not data.strip():
        raise ContextError(f"context {source} is empty; give a file with the text to work on")
    if b"\x00" in data[:65536]:
        raise ContextError(f"context {source} looks binary (it contains NUL bytes); "
                           "give a text or .json file (convert PDFs/office files to text first)")


def _decode(data: bytes, source: str, encoding: str) -> str:
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise ContextError(
            f"context {source} is not valid {encoding} (byte {exc.start}: {data[exc.start:exc.start+4]!r}); "
            "re-run with --encoding latin-1 (or the file's real encoding)") from None
    except LookupError:
        raise ContextError(f"unknown encoding {encoding!r}") from None
    text = clean_text(text)  # some codecs (utf-7...) can decode to lone surrogates
    return text[1:] if text.startswith("\ufeff") else text


def load_context(source: Any, *, encoding: str = "utf-8", is_json: bool | None = None,
                 scratch_dir: str | None = None) -> LoadedContext:
    """Load a context from a path (str/Path), ``"-"`` (stdin), or a Python value.

    Args:
        source: a path, ``"-"``, a :class:`pathlib.Path`, or the context itself
            (a str that is not an existing path is NOT treated as a path: pass a
            ``Path`` to be explicit; the CLI always passes paths).
        encoding: text encoding of files and stdin.
        is_json: force JSON parsing (True) or text (False); default by suffix ``.json``.
    Raises:
        ContextError: missing, empty, binary, undecodable or malformed JSON input.
    """
    if isinstance(source, Path) or (isinstance(source, str) and source == "-"):
        loaded = _load_file(str(source), encoding, is_json, scratch_dir)
        loaded.encoding = encoding
        return loaded
    if isinstance(source, (list, dict)):
        if not source:
            raise ContextError(f"context is an empty {type(source).__name__}; give the data to work on")
        try:
            json.dumps(source)
        except (TypeError, ValueError) as exc:
            raise ContextError(f"context must be JSON-like (str, list, dict): {exc}") from None
        return _write(clean(source), "json", "<value>", scratch_dir)
    if isinstance(source, bytes):
        _check_bytes(source, "<bytes>")
        source = _decode(source, "<bytes>", encoding)
    if isinstance(source, str):
        if not source.strip():
            raise ContextError("context is empty; give the text to work on")
        return _write(clean_text(source), "text", "<value>", scratch_dir)
    raise ContextError(f"context must be a str, list, dict or Path, not {type(source).__name__}")


def _load_file(path: str, encoding: str, is_json: bool | None, scratch_dir: str | None) -> LoadedContext:
    if path == "-":
        data = sys.stdin.buffer.read()
        source = "<stdin>"
    else:
        p = Path(path)
        if not p.exists():
            raise ContextError(f"context file not found: {path}")
        if p.is_dir():
            raise ContextError(f"context path is a directory, not a file: {path}")
        try:
            data = p.read_bytes()
        except OSError as exc:
            raise ContextError(f"cannot read context file {path}: {exc.strerror}") from None
        source = path
    _check_bytes(data, source)
    want_json = is_json if is_json is not None else source.lower().endswith(".json")
    text = _decode(data, source, encoding)
    if want_json:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ContextError(f"context {source} is not valid JSON (line {exc.lineno}, "
                               f"column {exc.colno}: {exc.msg})") from None
        if not isinstance(value, (str, list, dict)):
            raise ContextError(f"context {source} holds a JSON {type(value).__name__}; a JSON "
                               "context must be a string, a list or an object")
        if not value or (isinstance(value, str) and not value.strip()):
            raise ContextError(f"context {source} is an empty JSON {type(value).__name__}; "
                               "give the data to work on")
        cleaned = clean(value)  # "\ud83d" escapes decode to lone surrogates
        if isinstance(cleaned, str):
            return _write(cleaned, "text", source, scratch_dir)
        if path != "-" and cleaned is value and encoding.lower().replace("-", "") in ("utf8", "utf8sig"):
            return LoadedContext(value, "json", os.path.abspath(path), False, source)
        return _write(cleaned, "json", source, scratch_dir)
    if path != "-" and encoding.lower().replace("-", "") == "utf8" and not text.startswith("\ufeff") \
            and len(text.encode("utf-8")) == len(data):
        return LoadedContext(text, "text", os.path.abspath(path), False, source)
    return _write(text, "text", source, scratch_dir)


def _write(value: Any, fmt: str, source: str, scratch_dir: str | None) -> LoadedContext:
    import tempfile
    fd, path = tempfile.mkstemp(prefix="rlm-ctx-", suffix=".json" if fmt == "json" else ".txt",
                                dir=scratch_dir)
    with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
        if fmt == "json":
            json.dump(value, f, ensure_ascii=False)
        else:
            f.write(value)
    return LoadedContext(value, fmt, path, True, source)


def describe(value: Any) -> dict:
    """Metadata about a context for the system prompt (never the content itself).

    Returns ``{"type", "chars", "tokens_estimate", "items", "item_chars"}``;
    ``item_chars`` lists each item's length for lists (first 50) and dicts (by key).
    """
    if isinstance(value, str):
        n = len(value)
        return {"type": "str", "chars": n, "tokens_estimate": estimate_tokens(n)}
    if isinstance(value, list):
        lens = [len(x) if isinstance(x, str) else len(json.dumps(x, ensure_ascii=False)) for x in value]
        n = sum(lens)
        return {"type": "list", "chars": n, "tokens_estimate": estimate_tokens(n),
                "items": len(value), "item_chars": lens[:50]}
    if isinstance(value, dict):
        lens = {str(k): len(v) if isinstance(v, str) else len(json.dumps(v, ensure_ascii=False))
                for k, v in value.items()}
        n = sum(lens.values())
        keys = list(lens)[:50]
        return {"type": "dict", "chars": n, "tokens_estimate": estimate_tokens(n),
                "items": len(value), "item_chars": {k: lens[k] for k in keys}}
    s = str(value)
    return {"type": type(value).__name__, "chars": len(s), "tokens_estimate": estimate_tokens(len(s))}
