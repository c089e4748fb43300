"""The value checks of the option registry (``Option.check``): each takes a value and returns
what is wrong with it (str), or None when it is fine."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["http_url", "sub_http_url", "run_id", "price_file", "prompt_profile", "patterns",
           "placement"]


def http_url(v: Any, key_hint: str = "--api-key or the provider's API key variable"
             ) -> str | None:
    """None for an http(s) URL the client can send to (a host, a valid port and address), else
    what is wrong with it (RFC 3986 syntax through ``urllib.parse``; dotted numbers must be an
    IPv4 address). ``key_hint``: where the message says the endpoint's key goes instead of
    into the URL."""
    import ipaddress
    import re
    from urllib.parse import urlsplit
    bad = f"must be an http:// or https:// URL such as http://127.0.0.1:8000/v1, got {v!r}"
    if not isinstance(v, str) or not v.startswith(("http://", "https://")) \
            or any(c.isspace() or ord(c) < 32 for c in v):
        return bad
    try:
        parts = urlsplit(v)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
        host = parts.hostname
    except ValueError as exc:
        return f"{bad} ({exc})"
    if not host:
        return f"{bad} (no host)"
    if parts.username is not None or parts.password is not None or parts.query:
        # a URL is journaled, logged and shown in errors: a secret in it would be too
        return (f"must not carry credentials or a query string (they would be journaled and "
                f"shown in errors): give the key with {key_hint}, got {_masked_url(v)!r}")
    if parts.port == 0:
        return f"{bad} (port 0)"
    if ":" not in host and "" in host.rstrip(".").split("."):
        return f"{bad} ({host!r} has an empty label)"
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"{bad} ({host} is not an IPv4 address)"
    return None


def sub_http_url(v: Any) -> str | None:
    """:func:`http_url` for the sub-call endpoint (``sub_base_url``), whose key has a place
    of its own to be given in (``RLM_SUB_API_KEY``, ``sub_api_key=``)."""
    return http_url(v, key_hint="RLM_SUB_API_KEY (or sub_api_key=)")


def _masked_url(v: str) -> str:
    """``v`` with any password and query replaced by ``***`` (for an error message)."""
    import re
    v = re.sub(r"(//[^/@:]*):[^/@]*@", r"\1:***@", v)
    return re.sub(r"\?.*$", "?***", v)


def run_id(v: Any) -> str | None:
    if not isinstance(v, str):
        return f"must be a string, got {type(v).__name__} {v!r}"
    if not v.strip():
        return "must not be empty"
    if len(v) > 200 or any(ord(c) < 32 or ord(c) == 127 for c in v):
        return "must be at most 200 printable characters"
    return None


#: The smallest window compaction works in (tokens): a system prompt of either profile is about
#: 700-1,300 tokens, and a compacted conversation needs room for it, the task, a summary and a
#: turn.
MIN_CONTEXT_WINDOW = 2048


def context_window(v: Any) -> str | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < MIN_CONTEXT_WINDOW:
        return (f"must be 0 (compaction off) or at least {MIN_CONTEXT_WINDOW:,} tokens, got "
                f"{v!r}: a smaller window cannot hold the system prompt and a turn, so every "
                "turn would be compacted and still not fit")
    return None


def price_file(v: Any) -> str | None:
    if not isinstance(v, (str, os.PathLike)):
        return f"must be a path, got {type(v).__name__} {v!r}"
    if not str(v).strip():
        return "is empty: give the path of a JSON price file"
    return None


def prompt_profile(v: Any) -> str | None:
    from rlm.prompting.prompts import PROFILES
    if v in PROFILES or Path(str(v)).expanduser().is_file():
        return None
    what = "a directory" if Path(str(v)).expanduser().is_dir() else "no such file"
    return (f"must be one of {', '.join(PROFILES)}, or a template file's path; "
            f"{str(v)!r} is none of these ({what})")


def patterns(v: Any) -> str | None:
    if isinstance(v, str) or (isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)):
        return None
    return f"must be a glob pattern or a list of them, got {v!r}"


def placement(v: Any) -> str | None:
    """What is wrong with a ``--kernels`` placement (:func:`kernels.provider.placement_error`),
    or None."""
    from kernels.provider import placement_error
    return placement_error(v)
