"""The one text policy: what happens to text Python can hold but UTF-8 cannot encode.

A Python ``str`` may hold *surrogate code points* (U+D800..U+DFFF) that are not characters:
half of an emoji cut in two by slicing UTF-16 data, a ``"\\ud83d"`` escape in a JSON file,
undecodable bytes kept by ``surrogateescape`` (file names, ``sys.argv``). UTF-8 cannot encode
them, so every boundary that writes text (a file, a socket, SQLite, the terminal) would fail.

The policy, applied at every boundary (context file and its hash, model requests and replies,
kernel cell output and errors, bridge messages, the answer, the journal, ``--json``, stdout):
**a surrogate pair written as two code points becomes the character it encodes; every other
surrogate becomes U+FFFD (the replacement character)**. Text without surrogates is returned
unchanged (the same object), so the policy costs one scan.

Standard library only; imported by every layer (the host and the in-kernel runtime).
"""
from __future__ import annotations

import codecs
import re
import sys
from typing import Any

__all__ = ["ERRORS", "REPLACEMENT", "clean", "clean_text", "has_surrogates", "printable",
           "protect_streams"]

#: The codec error handler :func:`protect_streams` installs (``codecs.lookup_error(ERRORS)``).
ERRORS = "rlm.text"

#: What a lone surrogate becomes.
REPLACEMENT = "\ufffd"


def has_surrogates(text: str) -> bool:
    """True if ``text`` holds a surrogate code point (so UTF-8 cannot encode it).

    O(1) for ASCII and Latin-1 text (CPython stores those one byte per character, and a
    surrogate needs two); else one UTF-8 encode (about 5 ms per MB).
    """
    if text.isascii() or sys.getsizeof(text) < 2 * len(text):
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def clean_text(text: str) -> str:
    """``text`` with the policy applied: pairs joined, lone surrogates replaced by U+FFFD.

    Returns ``text`` itself when it holds no surrogate. Never raises for a ``str``.
    """
    if not has_surrogates(text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def clean(value: Any) -> Any:
    """``value`` with :func:`clean_text` applied to every string in it (JSON-like values).

    Strings, and the keys and items of dicts, lists and tuples (recursively), are cleaned;
    anything else is returned as is. A container without a surrogate anywhere is returned
    unchanged (the same object); otherwise a cleaned copy (tuples become lists).
    """
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, dict):
        out = {}
        changed = False
        for k, v in value.items():
            k2, v2 = clean(k), clean(v)
            changed = changed or k2 is not k or v2 is not v
            out[k2] = v2
        return out if changed else value
    if isinstance(value, (list, tuple)):
        items = [clean(v) for v in value]
        if any(a is not b for a, b in zip(items, value)):
            return items
        return value
    return value


def _on_encode_error(exc: UnicodeError) -> tuple[str | bytes, int]:
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    bad = exc.object[exc.start:exc.end]
    if (exc.encoding or "").lower().replace("-", "").replace("_", "") in ("utf8", "utf8sig"):
        # the policy: pairs joined, lone surrogates U+FFFD (as bytes: the UTF-8 encoder
        # takes only ASCII text back from an error handler)
        return clean_text(bad).encode("utf-8"), exc.end
    return "?" * len(bad), exc.end  # an encoding that cannot hold the character


codecs.register_error(ERRORS, _on_encode_error)


def protect_streams(*streams: Any) -> None:
    """Make text streams (default ``sys.stdout``, ``sys.stderr``) apply the policy on write.

    A UTF-8 stream writes a lone surrogate as U+FFFD; a stream in another encoding writes
    ``?`` for what it cannot encode. Streams that cannot be reconfigured are left alone.
    """
    for stream in streams or (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors=ERRORS)
        except Exception:
            pass


#: What :func:`printable` escapes: C0 controls but tab and newline, DEL, C1 controls, and the
#: bidirectional embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069).
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` safe to show on a terminal: every control character but tab and newline (the
    escape sequences that move the cursor, clear the screen, set the window title or write
    to the clipboard start with one), and every bidirectional override (which reorders what
    is shown), written as its Python escape (``\\x1b``, ``\\u202e``). Other text, all of
    Unicode's printable characters, is unchanged (the same object when nothing is escaped).

    For the views that show a human what a model or a user wrote (``rlm show``, ``rlm runs``);
    not for an answer printed as the command's output, which is data.
    """
    if text.isprintable():
        return text
    return _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], text)
