"""How the journal turns values into JSON text, and the hash that identifies a model request.

- ``request_hash(request)``: the public, canonical sha256 of a request dict; a resumed run serves
  a model call from the journal only when the hashes match.
- ``dumps(value)`` / ``loads(text)``: the compact JSON text stored in the journal's JSON columns
  (options, usage, error, stage dicts, model-call request/response/usage/attempts, cell output).
  ``dumps`` also accepts ``Path`` (as ``str``), ``set``/``frozenset`` (as a list sorted by
  ``repr``) and ``bytes`` (decoded as UTF-8, undecodable bytes replaced).

Text UTF-8 cannot encode (lone surrogates) follows the one text policy of :mod:`harness.text`
in both: it becomes U+FFFD, so the journal never fails to store a value.

This module imports only the standard library and :mod:`harness.text`.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from harness.text import clean_text

__all__ = ["request_hash", "dumps", "loads"]


def request_hash(request: dict) -> str:
    """Return the sha256 hex digest (64 lowercase hex chars) of ``request`` as canonical JSON.

    Canonical JSON: keys sorted, no whitespace (``separators=(",", ":")``), ``ensure_ascii=False``,
    encoded as UTF-8. Two requests hash equal iff their JSON forms are equal (so ``1`` and ``1.0``
    differ, as do tuples and lists never: both encode as arrays).

    Raises:
        TypeError: ``request`` holds a value JSON cannot encode.
    """
    text = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(clean_text(text).encode("utf-8")).hexdigest()


def dumps(value: Any) -> str:
    """Return ``value`` as compact JSON text (``str``, non-ASCII kept as is).

    Raises:
        TypeError: ``value`` holds an object JSON cannot encode (other than ``Path``, ``set``,
            ``frozenset`` and ``bytes``, which are converted).
        ValueError: ``value`` contains a circular reference.
    """
    return clean_text(json.dumps(value, ensure_ascii=False, separators=(",", ":"),
                                 default=_json_default))


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    if isinstance(obj, bytes):
        return obj.decode("utf-8", errors="replace")
    raise TypeError(f"{type(obj).__name__} is not JSON-serializable: {obj!r:.200}")


def loads(text: str | None) -> Any:
    """Return the value of JSON ``text``, or ``None`` for ``None`` (an SQL ``NULL`` column)."""
    return None if text is None else json.loads(text)
