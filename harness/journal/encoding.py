"""How the journal turns values into JSON text, and the hash that identifies a model request.

- ``request_hash(request)``: the public, canonical sha256 of a request dict; a resumed run serves
  a model call from the journal only when the hashes match.
- ``value_hash(value)``: the same canonical sha256 of any JSON value (a model call's response).
- ``run_anchor(...)`` and ``event_hash(...)``: the tamper-evident hash chain of a run's events.
  The first event's ``prev_hash`` is the run's anchor: the sha256 of its inputs (run id, query,
  models, depth and the recorded options, which hold the context's sha256), or of the run id
  alone when the journal has no run record for it. Every event's ``hash`` covers its
  ``prev_hash`` and all of its columns, so changing, dropping or reordering an event breaks the
  chain at that event.
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

__all__ = ["request_hash", "value_hash", "run_anchor", "event_hash", "dumps", "loads"]


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


def value_hash(value: Any) -> str:
    """``request_hash`` for any JSON value (``None`` included)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def run_anchor(run_id: str, inputs: tuple | None) -> str:
    """The hash a run's first event chains from.

    ``inputs``: ``(query, model, sub_model, max_depth, options_json)`` as stored in ``runs``, or
    ``None`` for a run the journal holds no record of.
    """
    if inputs is None:
        return value_hash({"run_id": run_id})
    query, model, sub_model, max_depth, options_json = inputs
    return value_hash({"run_id": run_id, "query": query, "model": model, "sub_model": sub_model,
                       "max_depth": max_depth, "options": loads(options_json)})


def event_hash(prev_hash: str, run_id: str, stage_id: str, from_status: str | None,
               to_status: str, ts: float, stage_json: str) -> str:
    """The chain hash of one event: sha256 over ``prev_hash`` and the event's stored columns,
    each text length-prefixed (``len:text``, ``-`` for null; ``ts`` as ``repr``), so no two
    events encode alike. (Length prefixes rather than JSON: escaping the stage JSON again cost
    ~60 us per event.)"""
    text = "\n".join((prev_hash, _field(run_id), _field(stage_id), _field(from_status),
                      _field(to_status), repr(float(ts)), _field(stage_json)))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _field(value: str | None) -> str:
    return "-" if value is None else f"{len(value)}:{value}"


def dumps(value: Any) -> str:
    """Return ``value`` as compact JSON text (``str``, non-ASCII kept as is).

    Raises:
        TypeError: ``value`` holds an object JSON cannot encode (other than ``Path``, ``set``,
            ``frozenset`` and ``bytes``, which are converted).
        ValueError: ``value`` contains a circular reference.
    """
    return clean_text(_ENCODER.encode(value))


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    if isinstance(obj, bytes):
        return obj.decode("utf-8", errors="replace")
    raise TypeError(f"{type(obj).__name__} is not JSON-serializable: {obj!r:.200}")


#: ``json.dumps(..., ensure_ascii=False, separators=(",", ":"), default=_json_default)`` built
#: once: ``json.dumps`` with any non-default argument builds a new encoder on every call (a third
#: of the cost of encoding a stage dict). ``JSONEncoder.encode`` keeps no state between calls.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=_json_default)


def loads(text: str | None) -> Any:
    """Return the value of JSON ``text``, or ``None`` for ``None`` (an SQL ``NULL`` column)."""
    return None if text is None else json.loads(text)
