"""The secret policy: which environment variables a process we start may see.

One module, three uses, one rule: model code never gets a credential of the host.

* **Kernels** (:func:`kernel_env`) run model-written code, so they get an allow-list:
  only :data:`KERNEL_ENV_ALLOW` passes, everything else (API keys, tokens, endpoint
  settings, journal paths) is dropped.
* **Helper processes we trust but that need no credentials**, such as the embedded
  model server (:func:`without_secrets`), get the host's environment minus every
  variable whose *name* looks like a secret (:data:`SECRET_NAME`: ``KEY``, ``TOKEN``,
  ``SECRET``, ``PASSWORD``, ``PASSWD``, ``CREDENTIAL``, ``AUTH``, any case).
* **The host's own start-up block** (:func:`hide_startup_secrets`): a kernel of a non-root
  host runs as the same user as its host (a root host runs kernels unprivileged, see
  :mod:`kernels.sandbox`) and could read the host's *initial* environment from
  ``/proc/<ppid>/environ``. That file shows the memory block the process started with,
  which changing ``os.environ`` does not touch. After the key has been read into this
  process's ``os.environ`` (Python's own copy, which the ``openai`` client uses), the
  values of :data:`STARTUP_SECRET_NAMES` are overwritten in that original block in place,
  so ``/proc`` shows ``*`` instead. On top, the host process is marked non-dumpable
  (``prctl(PR_SET_DUMPABLE, 0)``), which makes its ``/proc`` files and memory unreadable
  to other non-root processes. Linux only; elsewhere a no-op. A key given with
  ``--api-key`` is visible in the process list on any system: prefer ``OPENAI_API_KEY``.

Standard library only; imports nothing from :mod:`rlm`.
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
from typing import Mapping

__all__ = [
    "KERNEL_ENV_ALLOW", "SECRET_NAME", "STARTUP_SECRET_NAMES", "hide_startup_secrets",
    "is_secret_name", "kernel_env", "without_secrets",
]

#: A variable whose name matches this (searched anywhere in the name, any case) is a secret.
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.I)

#: Host variables passed through to kernels; everything else is dropped.
KERNEL_ENV_ALLOW = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE",
                    "TZ", "TMPDIR", "SHELL", "TERM", "PYTHONPATH", "VIRTUAL_ENV", "SYSTEMROOT",
                    "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS")

#: Set in every kernel on top of the allow-listed variables.
_KERNEL_ENV_SET = {"PYTHONUNBUFFERED": "1", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}

#: Variables whose values are blanked in the host's start-up environment block.
STARTUP_SECRET_NAMES = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "RLM_SUB_API_KEY",
                        "RLM_SERVE_API_KEY")


def is_secret_name(name: str) -> bool:
    """True if the environment variable called ``name`` is treated as a secret."""
    return SECRET_NAME.search(name) is not None


def kernel_env(extra: Mapping[str, str] | None = None,
               environ: Mapping[str, str] | None = None) -> dict:
    """The environment of a kernel (a new dict of str -> str).

    Args:
        extra: variables to set on top (trusted: the host's own settings for the kernel).
        environ: the host environment to filter; default ``os.environ``.

    Returns:
        The :data:`KERNEL_ENV_ALLOW` variables of ``environ``, plus
        ``PYTHONUNBUFFERED=1`` and ``PYDEVD_DISABLE_FILE_VALIDATION=1``, plus ``extra``.
    """
    src = os.environ if environ is None else environ
    env = {k: v for k, v in src.items() if k in KERNEL_ENV_ALLOW}
    env.update(_KERNEL_ENV_SET)
    env.update(extra or {})
    return env


def without_secrets(environ: Mapping[str, str] | None = None) -> dict:
    """``environ`` (default ``os.environ``) minus every secret-named variable (a new dict)."""
    src = os.environ if environ is None else environ
    return {k: v for k, v in src.items() if not is_secret_name(k)}


_done = False


def hide_startup_secrets(names: tuple[str, ...] = STARTUP_SECRET_NAMES) -> int:
    """Overwrite the values of ``names`` in this process's start-up environment block.

    Runs once per process (later calls return 0) and also marks the process
    non-dumpable. ``os.environ`` keeps the real values.

    Args:
        names: the variable names whose values are blanked with ``*``.

    Returns:
        The number of values blanked (int); 0 off Linux, on a second call, or if the
        block cannot be located. Never raises.
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
