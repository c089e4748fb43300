"""A user of its own for every kernel on a root host, from a range the harness manages.

When the host runs as root and :envvar:`RLM_KERNEL_USER` is not set, each kernel runs as a uid
of its own, ``BASE + n`` (:data:`BASE` = 2**20, ``n`` < :data:`SIZE`), and every kernel of one
host process shares that host's group, ``BASE + m`` (the bridge socket opens to it, see
:mod:`kernels.bridge`). No passwd entry is needed: the kernel's ``USER`` is ``rlm-<uid>``. So
the per-user counts and state the Linux kernel keeps (``RLIMIT_NPROC``'s process count,
the user keyring, files, signals between processes) are never shared between two kernels, nor
between two runs.

A number is held by an exclusive ``flock(2)`` on ``<dir>/<n>`` (``/run/rlm-ids``, else in
the temporary directory; root's, mode 0700) for as long as its kernel (or, for the group, its
host) lives: a host that dies frees its numbers with its descriptors. A free number's file is
removed by its last holder, and a dead holder's by the next host (:func:`sweep`); the lock is
checked against the file still at the path, so a removal never lets two holders in.
"""
from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
import tempfile
import threading

__all__ = ["BASE", "SIZE", "Lease", "lease", "host_group", "managed", "sweep"]

#: The first uid and gid of the range (above what distributions hand out to users and to
#: user namespaces' subordinate ranges by default, which start at 100000 in 65536 steps).
BASE = 1 << 20
#: How many numbers the range holds.
SIZE = 1 << 16

_dir_lock = threading.Lock()
_host: list = []  # [Lease of this host's group, pid that took it]


def managed(uid: int) -> bool:
    """Whether ``uid`` (or a gid) is in the harness's range."""
    return BASE <= uid < BASE + SIZE


def _lock_dir() -> str:
    for base in ("/run", tempfile.gettempdir()):
        d = os.path.join(base, "rlm-ids")
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        except OSError:
            continue
        st = os.lstat(d)
        if st.st_uid == os.geteuid() and not (st.st_mode & 0o077) and stat.S_ISDIR(st.st_mode):
            return d
    raise OSError(errno.EACCES, "no private directory for the kernel user numbers "
                  "(/run/rlm-ids, or rlm-ids in the temporary directory)")


class Lease:
    """One number of the range, held until :meth:`close`. Attributes: ``number`` (the uid or
    gid, int)."""

    def __init__(self, number: int, fd: int, path: str) -> None:
        self.number, self._fd, self._path = number, fd, path

    def close(self) -> None:
        """Free the number (its kernel's processes are gone). Idempotent; never raises."""
        if self._fd < 0:
            return
        try:
            os.unlink(self._path)  # while still holding it: a waiting opener re-checks
        except OSError:
            pass
        os.close(self._fd)
        self._fd = -1


def lease(tries: int = 256) -> Lease:
    """Take a free number of the range (uid and gid ``BASE + n``).

    Raises:
        OSError: no private directory for the locks, or ``tries`` numbers in a row were taken.
    """
    with _dir_lock:
        d = _lock_dir()
    start = secrets.randbelow(SIZE)
    for i in range(tries):
        n = (start + i) % SIZE
        path = os.path.join(d, str(n))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            st, now = os.fstat(fd), os.stat(path)
            if (st.st_ino, st.st_dev) == (now.st_ino, now.st_dev):
                return Lease(BASE + n, fd, path)
        except OSError:
            pass  # held by another kernel, or removed under us: the next number
        os.close(fd)
    raise OSError(errno.EAGAIN, f"no free kernel user number after {tries} tries")


def sweep() -> int:
    """Remove the number files no live process holds (left by a host that died holding its
    group's, or a kernel's); returns how many. Never raises."""
    try:
        with _dir_lock:
            d = _lock_dir()
        names = os.listdir(d)
    except OSError:
        return 0
    removed = 0
    for name in names:
        path = os.path.join(d, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            Lease(0, fd, path).close()  # free: removed while held, as a holder would
            removed += 1
        except OSError:
            os.close(fd)  # held
    return removed


def host_group() -> int:
    """This host process's group (``BASE + m``, held while it lives): every kernel it starts
    is in it. Raises OSError as :func:`lease`."""
    with _dir_lock:
        if _host and _host[1] == os.getpid():
            return _host[0].number
    sweep()  # once per host process: what dead hosts left
    got = lease()
    with _dir_lock:
        if _host and _host[1] == os.getpid():
            got.close()
        else:
            _host[:] = [got, os.getpid()]
        return _host[0].number
