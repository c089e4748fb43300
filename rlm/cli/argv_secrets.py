"""The values of secret flags (``--api-key``, ``--upstream-api-key``) taken out of this
process's own command line once read, so ``/proc/<pid>/cmdline`` and ``ps`` no longer show them."""
from __future__ import annotations

import sys

__all__ = ["SECRET_FLAGS", "hide_secret_flags", "secret_spans"]


#: Flags whose value is a secret: hidden from this process's command line once read
#: (:func:`hide_secret_flags`). ``rlm run``/``resume``/``eval`` ``--api-key``, ``rlm serve``
#: ``--api-key`` (its clients' key) and ``--upstream-api-key``.
SECRET_FLAGS = ("--api-key", "--upstream-api-key")


def secret_spans(args: list[str]) -> list[tuple[int, int, int]]:
    """Where the values of :data:`SECRET_FLAGS` are in ``args`` (a command line's words):
    ``(word, start, end)`` character spans. A flag is matched as argparse matches it (the
    whole name or a prefix of it, ``--flag VALUE`` or ``--flag=VALUE``); a lone ``--`` ends
    the flags."""
    spans = []
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--":
            break
        name, eq, _ = word.partition("=")
        if len(name) > 2 and name.startswith("--") and \
                any(flag.startswith(name) for flag in SECRET_FLAGS):
            if eq:
                spans.append((i, len(name) + 1, len(word)))
            elif i + 1 < len(args):
                spans.append((i + 1, 0, len(args[i + 1])))
                i += 1
        i += 1
    return [s for s in spans if s[2] > s[1]]


def hide_secret_flags() -> int:
    """Overwrite, with ``x``, the values of :data:`SECRET_FLAGS` in this process's command line:
    the memory ``/proc/<pid>/cmdline`` and ``ps`` show (the kernel's ``arg_start``..``arg_end``,
    written in place), and Python's copies ``sys.argv`` and ``sys.orig_argv`` (which tracebacks,
    the OpenTelemetry process resource and the like read). Call it once the arguments have been
    copied for parsing: what argparse reads is not changed. Returns how many values were
    hidden in the process's memory (0 off Linux, or when it cannot be located). Never raises.

    The key is then visible for the interpreter's start-up only (tens of milliseconds, before
    any kernel starts); the provider's variable (``OPENAI_API_KEY``, ``ANTHROPIC_API_KEY``,
    ``RLM_SERVE_API_KEY``) never is.
    """
    for name in ("argv", "orig_argv"):
        words = getattr(sys, name, None)
        if isinstance(words, list) and all(isinstance(w, str) for w in words):
            for i, start, end in secret_spans(words):
                words[i] = words[i][:start] + "x" * (end - start) + words[i][end:]
    if not sys.platform.startswith("linux"):
        return 0
    try:
        import ctypes
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2:].split()
        # proc(5): arg_start and arg_end are fields 48 and 49 (1-based; field 3 is fields[0])
        start, end = int(fields[45]), int(fields[46])
        if not start or end <= start:
            return 0
        block = ctypes.string_at(start, end - start)
        words, offsets, pos = [], [], 0
        for raw in block.split(b"\0"):
            words.append(raw.decode("latin-1"))  # one character per byte: offsets stay
            offsets.append(pos)
            pos += len(raw) + 1
        spans = secret_spans(words)
        for i, a, b in spans:
            ctypes.memset(start + offsets[i] + a, ord("x"), b - a)
        return len(spans)
    except Exception:  # noqa: BLE001 - no /proc, an old kernel: nothing to hide from
        return 0
