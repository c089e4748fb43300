"""Control groups of one kernel each: memory, processes and CPU share counted over every process
the kernel starts, together.

Each sandboxed kernel gets a group (``rlm-k-<host pid>-<tag>``) *inside* the group the host
process itself runs in, per controller, so whatever bounds the host bounds its kernels too:

* ``memory``: the kernel's memory, every process of it together, tmpfs pages it writes (its
  ``/tmp``, home and ``/dev/shm``) and the kernel memory its files cost (inodes) included;
  cgroup v2 ``memory.max`` with ``memory.swap.max`` 0, or v1 ``memory.limit_in_bytes`` and
  ``memory.memsw.limit_in_bytes`` where swap is accounted. Past it the kernel's out-of-memory
  killer ends the largest process of the group (a cell's child, or the kernel itself);
* ``pids``: processes and threads together (``pids.max``): ``fork`` past it is ``EAGAIN``;
* ``cpu``: one share (v2 ``cpu.weight``, v1 ``cpu.shares``): however many processes a kernel
  runs, it competes for the CPU as one.

Where each controller is: ``/proc/self/cgroup`` (the host's own group, per hierarchy) and
``/proc/self/mountinfo`` (where each hierarchy is mounted). A controller in the v2 (unified)
hierarchy is used when the host's group already enables it for its children
(``cgroup.subtree_control``); else the v1 hierarchy that holds it. The harness never writes to
a group it did not create (not even the host's ``subtree_control``), never moves a process
out of its group, and removes its groups with their kernels (:meth:`KernelGroup.close`); a
group whose host died is swept by the next host (:func:`sweep_stale`).

The kernel's supervisor joins the group itself, first thing, through a ``cgroup.procs``
descriptor the host opened (:meth:`KernelGroup.join_fds`; writing ``0`` moves the writer), so
every process the kernel ever starts is counted.

A host that may not create groups (not root, no delegation) gets :data:`None` from
:meth:`KernelGroup.create` and :func:`unavailable` says why; the per-process limits of
:mod:`kernels.supervisor` then stand in (``setrlimit(2)``). Linux only. Reference: the kernel's
``Documentation/admin-guide/cgroup-v2.rst`` and ``cgroup-v1/memory.rst``, ``pids.rst``.
"""
from __future__ import annotations

import errno
import os
import signal
import threading
import time
from dataclasses import dataclass

__all__ = ["PREFIX", "Place", "KernelGroup", "find_places", "unavailable", "sweep_stale"]

#: Names of the harness's groups: ``rlm-k-<host pid>-<tag>``.
PREFIX = "rlm-k-"
#: The controllers a kernel's group uses.
CONTROLLERS = ("memory", "pids", "cpu")


@dataclass(frozen=True)
class Place:
    """Where one controller is: ``version`` 1 or 2, ``dir`` the host's own group directory."""

    controller: str
    version: int
    dir: str


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """``(fstype, root, mountpoint, super options)`` of every cgroup mount in ``mountinfo``."""
    out = []
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        point = fields[4].replace("\\040", " ")
        out.append((tail[0], fields[3], point, set(tail[2].split(","))))
    return out


def _under(mount_root: str, point: str, path: str) -> str | None:
    """The directory of group ``path`` on a hierarchy mounted at ``point`` from ``mount_root``."""
    if mount_root != "/" and not (path == mount_root or path.startswith(mount_root + "/")):
        return None
    rel = path[len(mount_root):] if mount_root != "/" else path
    return os.path.join(point, rel.lstrip("/")).rstrip("/") or "/"


def find_places(proc_cgroup: str = "/proc/self/cgroup",
                mountinfo: str = "/proc/self/mountinfo") -> dict[str, Place]:
    """Where each of :data:`CONTROLLERS` is for this process: ``{controller: Place}``; one
    that is mounted nowhere is missing. v2 first when the host's group there delegates it."""
    own: dict[str, str] = {}
    try:
        with open(proc_cgroup, encoding="utf-8") as f:
            for line in f.read().splitlines():
                _, names, path = line.split(":", 2)
                for name in (names.split(",") if names else [""]):
                    own[name] = path
    except (OSError, ValueError):
        return {}
    places: dict[str, Place] = {}
    for fstype, root, point, opts in _mounts(mountinfo):
        if fstype == "cgroup2" and "" in own:
            d = _under(root, point, own[""])
            if d is None:
                continue
            try:
                with open(os.path.join(d, "cgroup.subtree_control"), encoding="utf-8") as f:
                    enabled = set(f.read().split())
            except OSError:
                continue
            for c in CONTROLLERS:
                if c in enabled:
                    places[c] = Place(c, 2, d)
    for fstype, root, point, opts in _mounts(mountinfo):
        if fstype != "cgroup":
            continue
        for c in CONTROLLERS:
            if c in opts and c not in places and c in own:
                d = _under(root, point, own[c])
                if d is not None and os.path.isdir(d):
                    places[c] = Place(c, 1, d)
    return places


_state: dict = {}
_state_lock = threading.Lock()


def _usable() -> tuple[dict[str, Place], str | None]:
    """The places this process may create groups in, and why some controller is missing
    (None: all of :data:`CONTROLLERS`). Decided once per process."""
    with _state_lock:
        if "places" not in _state:
            places = find_places()
            missing = [c for c in CONTROLLERS if c not in places]
            shut = [p for p in places.values() if not os.access(p.dir, os.W_OK)]
            why = None
            if shut:
                why = ("this process may not create control groups in its own "
                       f"({', '.join(sorted({p.dir for p in shut}))}): no delegation to this user")
            elif missing:
                why = f"no {'/'.join(missing)} controller is available to this process's cgroup"
            _state["places"] = {} if shut else places
            _state["why"] = why
        return _state["places"], _state["why"]


def unavailable() -> str | None:
    """Why per-kernel groups (some controller of :data:`CONTROLLERS`) cannot be made here, or
    None when every one can. A group that failed to be made says so here too."""
    return _usable()[1]


def _write(path: str, value: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(value)


class KernelGroup:
    """One kernel's groups (one directory per hierarchy), made by :meth:`create`.

    Attributes:
        dirs: ``{controller: group directory}``.
        memory_bytes, pids: the limits set (bytes; processes and threads).
    """

    def __init__(self, dirs: dict[str, str], versions: dict[str, int], memory_bytes: int,
                 pids: int) -> None:
        self.dirs = dirs
        self.versions = versions
        self.memory_bytes = memory_bytes
        self.pids = pids
        self._closed = False

    @classmethod
    def create(cls, tag: str, *, memory_bytes: int, pids: int,
               cpu_weight: int = 100) -> "KernelGroup | None":
        """Make the groups of a kernel tagged ``tag`` and set their limits.

        Args:
            tag: the kernel's tag (hex): the name is ``rlm-k-<host pid>-<tag>``.
            memory_bytes: memory of the whole kernel (bytes).
            pids: processes and threads of the whole kernel.
            cpu_weight: its CPU share, 1-10000 (v2's scale; 100 is one ordinary share).
        Returns:
            the group, or None where groups cannot be made here (:func:`unavailable` says
            why; a failure to make one is recorded there, and later kernels skip it).
        """
        places, why = _usable()
        if why is not None:
            return None
        name = f"{PREFIX}{os.getpid()}-{tag}"
        dirs = {c: os.path.join(p.dir, name) for c, p in places.items()}
        versions = {c: p.version for c, p in places.items()}
        group = cls(dirs, versions, memory_bytes, pids)
        try:
            for d in sorted(set(dirs.values())):
                os.mkdir(d, 0o755)
            group._limit(cpu_weight)
        except OSError as exc:
            group.close()
            with _state_lock:  # the caller says so, once, with the limits standing in
                _state["places"], _state["why"] = {}, f"making a control group failed ({exc})"
            return None
        return group

    def _limit(self, cpu_weight: int) -> None:
        mem, v = self.dirs["memory"], self.versions["memory"]
        if v == 2:
            _write(os.path.join(mem, "memory.max"), str(self.memory_bytes))
            _try_write(os.path.join(mem, "memory.swap.max"), "0")
        else:
            _write(os.path.join(mem, "memory.limit_in_bytes"), str(self.memory_bytes))
            _try_write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(self.memory_bytes))
        _write(os.path.join(self.dirs["pids"], "pids.max"), str(self.pids))
        cpu = self.dirs["cpu"]
        if self.versions["cpu"] == 2:
            _write(os.path.join(cpu, "cpu.weight"), str(max(1, min(10000, cpu_weight))))
        else:
            _write(os.path.join(cpu, "cpu.shares"), str(max(2, cpu_weight * 1024 // 100)))

    def join_fds(self) -> list[int]:
        """Descriptors of each group's ``cgroup.procs``, open for writing (one per directory):
        for the kernel's supervisor, which writes ``0`` to each to move itself in and closes
        them. The caller closes its own copies once the supervisor is started. Raises OSError."""
        fds: list[int] = []
        try:
            for d in sorted(set(self.dirs.values())):
                fds.append(os.open(os.path.join(d, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC))
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def hit(self) -> dict[str, int]:
        """How often the kernel ran into its limits so far: ``{"memory": processes killed for
        memory, "pids": forks refused}``. Never raises (an unreadable counter reads 0)."""
        name = "memory.events" if self.versions["memory"] == 2 else "memory.oom_control"
        return {"memory": _counter(os.path.join(self.dirs["memory"], name), "oom_kill"),
                "pids": _counter(os.path.join(self.dirs["pids"], "pids.events"), "max")}

    def close(self) -> None:
        """Kill whatever process is left in the groups and remove them. Idempotent; never
        raises (a group that cannot be removed is left for :func:`sweep_stale`)."""
        if self._closed:
            return
        self._closed = True
        _remove_groups(sorted(set(self.dirs.values())))


def _try_write(path: str, value: str) -> None:
    try:
        _write(path, value)
    except OSError:
        pass  # not there (swap not accounted): the memory limit alone holds


def _counter(path: str, key: str) -> int:
    try:
        with open(path, encoding="ascii") as f:
            for line in f.read().splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[0] == key:
                    return int(parts[1])
    except (OSError, ValueError):
        pass
    return 0


def _remove_groups(dirs: list[str], limit: float = 5.0) -> None:
    """SIGKILL every process of ``dirs`` until none is left, then ``rmdir`` them."""
    deadline = time.monotonic() + limit
    left = [d for d in dirs if os.path.isdir(d)]
    while left and time.monotonic() < deadline:
        for d in list(left):
            if _kill_all(d):
                continue
            try:
                os.rmdir(d)
                left.remove(d)
            except FileNotFoundError:
                left.remove(d)
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    left.remove(d)
        if left:
            time.sleep(0.005)


def _kill_all(d: str) -> bool:
    """SIGKILL every process in group ``d`` (v2: ``cgroup.kill`` where there is one); True
    when some process was still there."""
    try:
        with open(os.path.join(d, "cgroup.procs"), encoding="ascii") as f:
            pids = [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return False
    if not pids:
        return False
    try:
        _write(os.path.join(d, "cgroup.kill"), "1")
        return True
    except OSError:
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return True


def sweep_stale() -> int:
    """Remove the groups (``rlm-k-<pid>-*``) of hosts that are gone, in the groups this process
    may create them in; returns how many. Never raises; a live host's groups are left alone."""
    places, _ = _usable()
    removed = 0
    for d in sorted({p.dir for p in places.values()}):
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            if not name.startswith(PREFIX):
                continue
            try:
                pid = int(name[len(PREFIX):].split("-")[0])
                if pid == os.getpid():
                    continue
                os.kill(pid, 0)
            except ProcessLookupError:
                _remove_groups([os.path.join(d, name)], limit=1.0)
                removed += 1
            except (ValueError, OSError):
                continue
    return removed
