"""Keep the API key out of reach of kernel code.

Kernels get a scrubbed environment, but a kernel runs as the same user as its
host and could read the host's *initial* environment from ``/proc/<ppid>/environ``.
That file shows the memory block the process started with, which changing
``os.environ`` does not touch. After the key has been read into this process's
``os.environ`` (Python's own copy, which the ``openai`` client uses), we overwrite
the value in that original block in place, so ``/proc`` shows ``*`` instead.
On top, the host process is marked non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``),
which makes its ``/proc`` files and memory unreadable to other non-root processes.

Linux only; elsewhere these are no-ops. A key given with ``--api-key`` is visible
in the process list on any system: prefer the ``OPENAI_API_KEY`` variable.
"""
from __future__ import annotations

import ctypes
import sys

#: Variables whose values are blanked in the startup environment block.
SECRET_NAMES = ("OPENAI_API_KEY",)

_done = False


def hide_startup_secrets(names: tuple[str, ...] = SECRET_NAMES) -> int:
    """Overwrite the values of ``names`` in this process's startup environment block.

    Returns the number of values blanked. ``os.environ`` keeps the real values.
    """
    global _done
    if _done or not sys.platform.startswith("linux"):
        return 0
    _done = True
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2:].split()
        # proc(5): env_start and env_end are fields 50 and 51 (1-based; field 3 is fields[0])
        start, end = int(fields[47]), int(fields[48])
    except (OSError, ValueError, IndexError):
        return 0
    if not start or end <= start:
        return 0
    try:
        block = ctypes.string_at(start, end - start)
    except Exception:
        return 0
    count = 0
    for name in names:
        prefix = name.encode() + b"="
        pos = 0
        while True:
            i = block.find(prefix, pos)
            if i < 0:
                break
            if i == 0 or block[i - 1] == 0:
                vstart = i + len(prefix)
                vend = block.find(b"\0", vstart)
                vend = len(block) if vend < 0 else vend
                if vend > vstart:
                    ctypes.memset(start + vstart, ord("*"), vend - vstart)
                    count += 1
            pos = i + len(prefix)
    _set_nondumpable()
    return count


def _set_nondumpable() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_DUMPABLE = 4
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except Exception:
        pass
