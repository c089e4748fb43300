"""What the bridge takes from the host on a kernel's behalf, bounded: frame sizes, connections,
the bytes of requests held, and who a connecting process is.

:class:`kernels.bridge.BridgeServer` decides who a connection is from *before* it reads a byte
of it (:func:`peer_chain`: the connecting process and its ancestors, from ``/proc``), counts it
against that kernel's share and the host's (:class:`Tally`), and reads a frame only once its
announced length is under the frame cap and its bytes fit the kernel's share. So a cell can
take at most its kernel's share of the host, and a process that is not one of the host's
kernels is refused with nothing read.

The caps (:class:`BridgeLimits`) are the host's: a kernel cannot see or change them. The frame
cap can be raised or lowered for a host with ``RLM_BRIDGE_MAX_FRAME_MB`` (read by the host when
a bridge starts; a kernel's environment never reaches it).
"""
from __future__ import annotations

import os
import resource
import threading
from dataclasses import dataclass
from typing import Any, Hashable

MIB = 1024 * 1024

#: The largest frame a kernel may send, bytes (64 MiB); ``RLM_BRIDGE_MAX_FRAME_MB`` overrides.
MAX_FRAME_BYTES = 64 * MIB
#: Connections one kernel (all its processes and threads together) may hold open at once.
MAX_CONNECTIONS_PER_KERNEL = 64
#: Connections every bridge of this host process may hold open at once (at most half the
#: process's descriptor limit, see :meth:`BridgeLimits.from_env`).
MAX_CONNECTIONS = 512
#: Bytes of one kernel's requests the host holds at once (being read, or served), bytes.
MAX_HELD_BYTES_PER_KERNEL = 2 * MAX_FRAME_BYTES
#: Bytes of every kernel's requests the host holds at once, bytes.
MAX_HELD_BYTES = 8 * MAX_FRAME_BYTES
#: How deep a request's JSON may nest (arrays and objects); deeper is refused.
MAX_NESTING = 100
#: The environment variable (the host's) that sets the frame cap, in MiB.
FRAME_ENV = "RLM_BRIDGE_MAX_FRAME_MB"


def mib(n: int) -> str:
    """``n`` bytes as a short text in MiB or GiB (``"64 MiB"``, ``"4 GiB"``)."""
    if n >= 1024 * MIB:
        return f"{n / (1024 * MIB):.3g} GiB"
    return f"{n / MIB:.3g} MiB"


@dataclass(frozen=True)
class BridgeLimits:
    """The caps one bridge applies (every field a positive int).

    Attributes:
        max_frame: largest frame a kernel may send, bytes.
        per_kernel: connections one kernel may hold open.
        total: connections all bridges of this process may hold open (shared: see :data:`TALLY`).
        held_per_kernel: bytes of one kernel's requests held at once.
        held_total: bytes of all kernels' requests held at once (shared).
        nesting: deepest JSON nesting of a request.
    """

    max_frame: int = MAX_FRAME_BYTES
    per_kernel: int = MAX_CONNECTIONS_PER_KERNEL
    total: int = MAX_CONNECTIONS
    held_per_kernel: int = MAX_HELD_BYTES_PER_KERNEL
    held_total: int = MAX_HELD_BYTES
    nesting: int = MAX_NESTING

    @classmethod
    def from_env(cls, environ: Any = None) -> "BridgeLimits":
        """The defaults, with the frame cap from ``RLM_BRIDGE_MAX_FRAME_MB`` when it is set (the
        bytes held scale with it) and the connection total at most half of this process's
        soft descriptor limit (``RLIMIT_NOFILE``), so connections alone cannot use up the
        descriptors the host needs for everything else.

        Raises:
            ValueError: the variable is set to something other than a positive number.
        """
        env = os.environ if environ is None else environ
        frame = MAX_FRAME_BYTES
        raw = env.get(FRAME_ENV)
        if raw:
            try:
                frame = int(float(raw) * MIB)
            except ValueError:
                frame = 0
            if frame <= 0:
                raise ValueError(f"{FRAME_ENV}={raw!r}: give the bridge's frame cap as a "
                                 "positive number of MiB (default 64)")
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        total = MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else max(
            MAX_CONNECTIONS_PER_KERNEL, min(MAX_CONNECTIONS, soft // 2))
        return cls(max_frame=frame, total=total, held_per_kernel=2 * frame,
                   held_total=max(8 * frame, MAX_HELD_BYTES))


class Tally:
    """Connections and held request bytes, per kernel and over every bridge of the process.

    Thread-safe. Each ``admit``/``hold`` that returns None must be paired with its
    ``leave``/``release``. The ``key`` names a kernel (its registration's token).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conns: dict[Hashable, int] = {}
        self._bytes: dict[Hashable, int] = {}
        self.conns = 0
        self.held = 0

    def admit(self, key: Hashable, limits: BridgeLimits) -> str | None:
        """Count one more connection of kernel ``key``; returns None, or why it is refused
        (str, nothing counted)."""
        with self._lock:
            mine = self._conns.get(key, 0)
            if mine >= limits.per_kernel:
                return (f"this kernel already holds {mine} connections to the host, the cap "
                        f"per kernel ({limits.per_kernel}); each thread or process that called "
                        "llm_query/rlm holds one: end some and try again")
            if self.conns >= limits.total:
                return (f"the host holds {self.conns} bridge connections, its cap "
                        f"({limits.total}); try again shortly")
            self._conns[key] = mine + 1
            self.conns += 1
        return None

    def leave(self, key: Hashable) -> None:
        """One connection of kernel ``key`` ended."""
        with self._lock:
            left = self._conns.get(key, 0) - 1
            if left > 0:
                self._conns[key] = left
            else:
                self._conns.pop(key, None)
            self.conns -= 1

    def hold(self, key: Hashable, n: int, limits: BridgeLimits) -> str | None:
        """Reserve ``n`` bytes for a request of kernel ``key`` before it is read; returns None,
        or why it is refused (str, nothing reserved)."""
        with self._lock:
            mine = self._bytes.get(key, 0)
            if mine + n > limits.held_per_kernel:
                return (f"the host already holds {mib(mine)} of this kernel's requests, and "
                        f"this one of {mib(n)} would pass the cap per kernel "
                        f"({mib(limits.held_per_kernel)}); wait for earlier calls to finish, "
                        "or send less at once")
            if self.held + n > limits.held_total:
                return (f"the host holds {mib(self.held)} of requests, and this one of "
                        f"{mib(n)} would pass its cap ({mib(limits.held_total)}); try again "
                        "shortly")
            self._bytes[key] = mine + n
            self.held += n
        return None

    def release(self, key: Hashable, n: int) -> None:
        """Give back ``n`` bytes held for kernel ``key``."""
        with self._lock:
            left = self._bytes.get(key, 0) - n
            if left > 0:
                self._bytes[key] = left
            else:
                self._bytes.pop(key, None)
            self.held -= n


#: The process's one tally: every bridge of a host (each run of ``rlm serve`` has its own)
#: shares the process's descriptors and memory, so they share the caps over all kernels.
TALLY = Tally()


class PeerCheckError(Exception):
    """``/proc`` could not be read to check a connecting process (not a verdict on it)."""


def peer_chain(pid: int, limit: int = 16) -> list[int]:
    """The process ``pid`` and its ancestors, nearest first (up to ``limit`` of them), from
    ``/proc/PID/stat``.

    A process that has exited ends the chain (a gone process is nobody's descendant).

    Raises:
        PeerCheckError: ``/proc`` could not be read for another reason (no ``/proc``, out of
            descriptors, refused): the caller could not be checked, which is not the same as
            an impostor.
    """
    chain: list[int] = []
    while pid > 0 and len(chain) < limit:
        chain.append(pid)
        if pid == 1:
            break
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                data = f.read()
        except (FileNotFoundError, ProcessLookupError):
            break
        except OSError as exc:
            raise PeerCheckError(f"reading /proc/{pid}/stat failed: {exc}") from None
        try:
            pid = int(data[data.rindex(b")") + 2:].split()[1])
        except (ValueError, IndexError):
            raise PeerCheckError(f"/proc/{pid}/stat could not be parsed") from None
    return chain


def nesting_over(value: Any, limit: int) -> bool:
    """True if ``value`` (decoded JSON) nests lists and dicts more than ``limit`` deep.

    Iterative, so a deep value cannot exhaust the stack; stops at the first path too deep.
    """
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            items = v.values()
        elif isinstance(v, list):
            items = v
        else:
            continue
        if depth > limit:
            return True
        stack.extend((x, depth + 1) for x in items if isinstance(x, (dict, list)))
    return False
