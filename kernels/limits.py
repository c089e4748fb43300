"""What bounds one sandboxed kernel as a whole, from its launch to its end.

:class:`KernelLimits` holds a sandboxed kernel's control group (:mod:`kernels.cgroups`: memory,
processes and threads, CPU share over all its processes), or notes that the per-process limits
of :mod:`kernels.supervisor` stand in for it (logged once per process), plus the descriptors
its supervisor inherits: the group's ``cgroup.procs`` and the file its start error goes to
(the kernel's working directory is read-only in the sandbox, :mod:`kernels.bwrap`). After a
kernel's death :meth:`KernelLimits.verdict` says which limit it ran into.
"""
from __future__ import annotations

import logging
import os

from kernels import cgroups, seccomp
from kernels.bwrap import SandboxSpec, SandboxUnavailable

__all__ = ["KernelLimits", "ERRFILE", "limits_mode"]

log = logging.getLogger("kernels.sandbox")

#: The file in the kernel's working directory its supervisor writes a start error to.
ERRFILE = ".supervisor-error"

_warned: list[bool] = []


def limits_mode() -> str:
    """How sandboxed kernels are bounded here: ``"cgroup"`` (per kernel, over all its
    processes) or ``"rlimit"`` (per process: the stand-in; :func:`kernels.cgroups.unavailable`
    says why)."""
    return "rlimit" if cgroups.unavailable() else "cgroup"


def _warn_once(why: str, spec: SandboxSpec) -> None:
    if _warned:
        return
    _warned.append(True)
    log.warning("kernel limits hold per process, not per kernel: %s; standing in: each process "
                "gets %d MiB of address space (RLIMIT_AS), the kernel's user %d processes "
                "(RLIMIT_NPROC), each file %d MiB (RLIMIT_FSIZE); no CPU share", why,
                spec.memory_mb, spec.processes, spec.file_mb)


class KernelLimits:
    """The whole-kernel limits of one sandboxed kernel.

    Args:
        spec: the limits asked for (``memory_mb``, ``processes``, ``cpu_weight``).
        tag: the kernel's tag (names its group).
        workdir: the kernel's host working directory (its start error file is made there).

    Attributes:
        group: the kernel's :class:`kernels.cgroups.KernelGroup`, or None (rlimits stand in).
        mode: ``"cgroup"`` or ``"rlimit"``.
        cgroup_fds: descriptors for the supervisor to join the group with ([] without one).
        errfd: the start-error file, open for writing, for the supervisor.
        seccomp_fd: the system calls the kernel is refused (:mod:`kernels.seccomp`), for
            bubblewrap; None on a machine without a filter.

    Raises:
        SandboxUnavailable: no group could be made and the sandbox is ``required``.
        OSError: the error file cannot be made (the group, if any, is removed again).
    """

    def __init__(self, spec: SandboxSpec, tag: str, workdir: str) -> None:
        self.spec = spec
        self.group = cgroups.KernelGroup.create(tag, memory_bytes=spec.memory_mb << 20,
                                                pids=spec.processes, cpu_weight=spec.cpu_weight)
        self.mode = "cgroup" if self.group is not None else "rlimit"
        self._seen: dict[str, int] = {}
        if self.group is None:
            why = cgroups.unavailable() or "no control group could be made"
            if spec.requested() == "required":
                raise SandboxUnavailable(
                    f"--sandbox required, but a kernel's memory, process and CPU limits cannot "
                    f"be held per kernel here: {why}. Run the host in a delegated control group "
                    "(systemd-run --user --scope -p Delegate=yes rlm ...), or use --sandbox "
                    "auto, where per-process limits stand in (docs/security.md)")
            _warn_once(why, spec)
        self.cgroup_fds: list[int] = []
        self.errfd, self.seccomp_fd = -1, None
        try:
            self.seccomp_fd = seccomp.program_fd()
            if self.group is not None:
                self.cgroup_fds = self.group.join_fds()
            self.errfd = os.open(os.path.join(workdir, ERRFILE),
                                 os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError:
            self.close()
            raise

    def fds(self) -> tuple[int, ...]:
        """Every descriptor bubblewrap and the supervisor inherit from here."""
        extra = () if self.seccomp_fd is None else (self.seccomp_fd,)
        return (*self.cgroup_fds, self.errfd, *extra)

    def started(self) -> None:
        """The supervisor has its copies: close the host's. Idempotent."""
        for fd in self.fds():
            if fd < 0:
                continue
            try:
                os.close(fd)
            except OSError:
                pass
        self.cgroup_fds, self.errfd, self.seccomp_fd = [], -1, None

    def _new_hits(self) -> dict[str, int]:
        """The limits run into since the last call (counts), from the group's counters."""
        if self.group is None:
            return {}
        now = self.group.hit()
        new = {k: v - self._seen.get(k, 0) for k, v in now.items() if v > self._seen.get(k, 0)}
        self._seen = now
        return new

    def verdict(self) -> str:
        """After the kernel died: which limit it ran into since the last cell ended, for the
        user ("" when none is known): e.g. "the kernel exceeded its memory limit
        (--kernel-memory 512 MiB, all its processes together)"."""
        said = []
        new = self._new_hits()
        if "memory" in new:
            said.append(f"the kernel exceeded its memory limit (--kernel-memory "
                        f"{self.spec.memory_mb} MiB, all its processes together)")
        if "pids" in new:
            said.append(f"the kernel reached its process limit (--kernel-processes "
                        f"{self.spec.processes}, processes and threads together)")
        return "; ".join(said)

    def note(self) -> str:
        """After a cell: a line for its output when one of the kernel's processes was killed
        for memory during it (the kernel lived on), else "". A refused fork is the cell's own
        ``OSError`` already."""
        n = self._new_hits().get("memory", 0)
        if not n:
            return ""
        return (f"[{n} process{'es' if n > 1 else ''} of this kernel killed: its processes "
                f"together exceeded its memory limit (--kernel-memory {self.spec.memory_mb} "
                "MiB)]\n")

    def close(self) -> None:
        """End the group (killing what is left in it) and close the descriptors. Idempotent;
        never raises."""
        self.started()
        if self.group is not None:
            self.group.close()
