"""Who a kernel runs as, and how it is started so that nothing it starts outlives it.

Every kernel is started under a small supervisor process (:mod:`kernels.supervisor`, standard
library only) that:

* is a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``): a process a cell starts stays
  its descendant even if it leaves the kernel's process group or session
  (``start_new_session=True``, ``setsid``, a double fork), because an orphan is re-parented
  to the nearest subreaper instead of to init;
* kills every descendant (walking ``/proc`` until none is left, so processes forked while it
  kills are caught too) when the kernel exits, when the host asks (SIGTERM, sent by
  :meth:`kernels.kernel.Kernel.shutdown`), or when the host process dies (even by SIGKILL);
* keeps ``no_new_privs`` on the kernel (``prctl(PR_SET_NO_NEW_PRIVS)``: no set-uid program
  run by a cell gains privileges) and kills it if the supervisor itself dies
  (``PR_SET_PDEATHSIG``).

**Unprivileged kernels.** When the host runs as root (containers, CI), a kernel running as
root could read the host's memory and environment (``/proc/<pid>/mem``, ``environ``) or
ptrace it, and so read the API key. So, when the host's effective uid is 0, the supervisor
runs the kernel as an unprivileged user: by default a uid of its own from the range of
:mod:`kernels.identity` (``nobody`` where that range cannot be used), else
:envvar:`RLM_KERNEL_USER` (a user name or a numeric uid) for every kernel. Set
``RLM_KERNEL_USER=root`` to keep root kernels. A non-root host runs kernels as itself (it
cannot switch users; asking it to is an error). An unprivileged kernel:

* gets its working directory and its Jupyter connection file chowned to it, ``HOME`` set to
  its working directory, the bridge socket through group permission (:mod:`kernels.bridge`),
  and a private copy of its context file (:meth:`kernels.kernel.Kernel.share_file`: the
  host's own temporary file is moved rather than copied; a many-file context: of the files
  it may not read itself, :func:`share_bundle`);
* needs to reach the Python interpreter, the standard library, site-packages and this
  project. A directory on those paths that it may not enter (typically ``/root`` holding a
  pyenv interpreter) is covered, in a private mount namespace of the kernel only, by an
  empty tmpfs into which just the needed entries are bind-mounted back (the rest of that
  directory stays invisible to the kernel). This needs ``CAP_SYS_ADMIN``; without it the
  kernel cannot start and the error says which path to open up or to set
  ``RLM_KERNEL_USER=root``.

If the supervisor itself is killed before it can clean up (only possible from outside, or
from a kernel running as the host's own user), the host kills, at the kernel's shutdown, every
process whose environment still holds the kernel's tag (:data:`TAG_VAR`, :func:`kill_tagged`).

Linux only (prctl, /proc); elsewhere kernels start without a supervisor.
"""
from __future__ import annotations

import json
import marshal
import os
import pwd
import shutil
import site
import stat
import sys
import tempfile
from dataclasses import dataclass
from typing import Iterable

from kernels import identity
from kernels.bundle import FILE

__all__ = ["ENV_VAR", "TAG_VAR", "Identity", "KernelUserError", "kernel_identity", "kill_tagged",
           "reveal_plan", "supervised_argv", "supervisor_available", "share_bundle", "share_file"]

#: The environment variable naming the user kernels run as when the host is root.
ENV_VAR = "RLM_KERNEL_USER"

#: The user kernels run as when the host is root and :data:`ENV_VAR` is not set.
DEFAULT_USER = "nobody"

_SUPERVISOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "supervisor.py")


class KernelUserError(RuntimeError):
    """:data:`ENV_VAR` names a user that does not exist, or the host cannot switch to it."""


@dataclass(frozen=True)
class Identity:
    """The unprivileged user a kernel runs as. Attributes: uid, gid (int), name (str)."""

    uid: int
    gid: int
    name: str


def supervisor_available() -> bool:
    """True where kernels run under :mod:`kernels.supervisor` (Linux with /proc)."""
    return sys.platform.startswith("linux") and os.path.isdir("/proc/self")


def kernel_identity(environ=None) -> Identity | None:
    """The user kernels run as, or None to run them as the host's own user.

    Reads :data:`ENV_VAR` from ``environ`` (default ``os.environ``): a user name or numeric
    uid. Unset or empty: when the host's effective uid is 0, this host's identity in the
    harness's range (:mod:`kernels.identity`: its group; each kernel gets a uid of its own
    from :func:`kernel_user`), ``nobody`` where that range cannot be used; else None.
    ``root``, ``0`` or the host's own user: None.

    Raises:
        KernelUserError: no such user; or a non-root host was asked to switch users.
    """
    env = os.environ if environ is None else environ
    spec = (env.get(ENV_VAR) or "").strip()
    euid = os.geteuid()
    if not spec:
        if euid != 0 or not supervisor_available():
            return None
        try:  # the host's group in the harness's range: each kernel then gets a uid of its own
            gid = identity.host_group()
            return Identity(gid, gid, f"rlm-{gid}")
        except OSError:
            spec = DEFAULT_USER  # no private place for the numbers: the shared user
    try:
        entry = pwd.getpwuid(int(spec)) if spec.isdigit() else pwd.getpwnam(spec)
        ident = Identity(entry.pw_uid, entry.pw_gid, entry.pw_name)
    except KeyError:
        if spec.isdigit():
            ident = Identity(int(spec), int(spec), spec)
        elif spec == DEFAULT_USER:
            ident = Identity(65534, 65534, spec)
        else:
            raise KernelUserError(f"{ENV_VAR}={spec!r}: no such user on this system; name an "
                                  "existing user (e.g. nobody), or root to run kernels as root") from None
    if ident.uid == euid:
        return None
    if euid != 0:
        raise KernelUserError(f"{ENV_VAR}={spec!r}: only a host running as root can start kernels "
                              f"as another user (this one runs as uid {euid}); unset it")
    if not supervisor_available():
        raise KernelUserError(f"{ENV_VAR} needs Linux (the kernel supervisor uses prctl and /proc)")
    return ident


def kernel_user(ident: Identity | None) -> "tuple[Identity | None, identity.Lease | None]":
    """The user one kernel runs as, given :func:`kernel_identity`'s ``ident``: for the host's
    identity in the harness's range, a uid of the kernel's own (in the host's group) and the
    lease that holds it (close it once the kernel's processes are gone); else ``ident`` itself
    and None (an explicit :data:`ENV_VAR`, or the host's own user).

    Raises:
        OSError: no free number in the range.
    """
    if ident is None or not identity.managed(ident.uid):
        return ident, None
    got = identity.lease()
    return Identity(got.number, ident.gid, f"rlm-{got.number}"), got


# --------------------------------------------------------------------------- paths


def _may(st: os.stat_result, ident: Identity, bit: int) -> bool:
    """Mode-bit check of ``bit`` (4 read, 1 search/execute) for ``ident`` (no supplementary groups)."""
    if st.st_uid == ident.uid:
        return bool(st.st_mode & (bit << 6))
    if st.st_gid == ident.gid:
        return bool(st.st_mode & (bit << 3))
    return bool(st.st_mode & bit)


def _needed_paths(extra: Iterable[str] = ()) -> list[str]:
    """What an unprivileged kernel must reach: interpreter, stdlib, site-packages, this project."""
    paths = [sys.executable, sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.dirname(os.path.abspath(__file__))), tempfile.gettempdir()]
    try:
        paths += site.getsitepackages()
    except Exception:
        pass
    paths += [p for p in (os.environ.get("PYTHONPATH") or "").split(os.pathsep) if p]
    paths += list(extra)
    out: list[str] = []
    for p in paths:
        for q in (os.path.abspath(p), os.path.realpath(p)):
            if os.path.exists(q) and q not in out:
                out.append(q)
    return out


def reveal_plan(ident: Identity, extra: Iterable[str] = ()) -> list[list]:
    """The directories ``ident`` may not enter on the way to what a kernel needs.

    Returns ``[[directory, [entry names to bind back]], ...]``, shallowest first (empty when
    everything is reachable): :mod:`kernels.supervisor` covers each directory with an empty
    tmpfs in the kernel's own mount namespace and bind-mounts those entries back.
    """
    plan: dict[str, set[str]] = {}
    for path in _needed_paths(extra):
        parts = path.strip("/").split("/")
        cur = "/"
        for name in parts:
            try:
                st = os.stat(cur)
            except OSError:
                break
            if not _may(st, ident, 1):
                plan.setdefault(cur, set()).add(name)
            cur = os.path.join(cur, name)
    return [[d, sorted(names)] for d, names in sorted(plan.items(), key=lambda kv: kv[0].count("/")
                                                      if kv[0] != "/" else 0)]


_PLANS: dict[tuple[int, int], list] = {}


def supervised_argv(argv: list[str], *, workdir: str, connection_file: str,
                    ident: Identity | None, own_dir: bool = False,
                    limits: dict[str, int] | None = None, home: str | None = None,
                    lifeline: int | None = None,
                    fds: "tuple[list[int], int] | None" = None) -> list[str]:
    """``argv`` (a kernel command line) wrapped to run under :mod:`kernels.supervisor`.

    Args:
        argv: the kernel's command
            (``[python, -m, kernels.ipykernel_main, -f, {connection_file}, ...]``).
        workdir: the kernel's working directory (chowned to ``ident``; its ``HOME``).
        connection_file: the Jupyter connection file (chowned to ``ident``).
        ident: the user to run as, or None for the host's own user.
        own_dir: ``workdir`` is a temporary directory of ours: the supervisor removes it if
            the host dies (else the host does at shutdown).
        limits: resource limits by ``resource`` name, set on the kernel; not None when the
            supervisor runs in a sandbox (:mod:`kernels.bwrap`): its host is then outside its
            PID namespace, and the sandbox itself shows the kernel only what it needs.
        home: the kernel's home and working directory inside the sandbox.
        lifeline: in a sandbox, the file descriptor the supervisor inherits whose end-of-file
            says the host is gone (:func:`kernels.launch.lifeline_fd`).
        fds: in a sandbox, ``(cgroup.procs descriptors, start-error descriptor)`` the
            supervisor inherits (:class:`kernels.limits.KernelLimits`): it joins the kernel's
            control groups through the first, and reports a failed start through the second
            (the working directory is read-only in the sandbox).
    """
    conf: dict = {"errfile": os.path.join(workdir, ".supervisor-error"),
                  "own_dir": workdir if own_dir else None,
                  # the supervisor's parent: it may already be gone when the supervisor starts
                  "host": os.getpid()}
    sandboxed = limits is not None
    if sandboxed:  # the host is not visible in the sandbox: watch bubblewrap, which dies with it
        conf.update(host=0, rlimits=limits, lifeline=lifeline)
        if fds is not None:
            conf.update(cgroup_fds=list(fds[0]), errfd=fds[1])
    if ident is not None:
        # a uid of the harness's range owns nothing: one plan serves its host's every kernel
        key = (-1, ident.gid) if identity.managed(ident.uid) else (ident.uid, ident.gid)
        if key not in _PLANS and not sandboxed:
            _PLANS[key] = reveal_plan(ident)
        # in a sandbox the working directory is read-only: its group lets the kernel read it
        chown = [os.path.dirname(home), home] if sandboxed and home else [workdir, connection_file]
        conf.update(uid=ident.uid, gid=ident.gid, user=ident.name, home=home or workdir,
                    chown=chown, reveal=[] if sandboxed else _PLANS[key])
    # marshal, then hex: the supervisor runs under this same interpreter (sys.executable) and
    # decodes it with built-ins alone; json and base64 would import re, enum and functools
    # there, about 20 ms on the way to every kernel's start
    blob = marshal.dumps(conf).hex()
    return [sys.executable, "-I", "-S", _SUPERVISOR, blob, "--", *argv]


#: The environment variable that tags every process of one kernel (see :func:`kill_tagged`).
TAG_VAR = "RLM_KERNEL_TAG"


def kill_tagged(tag: str, rounds: int = 20) -> int:
    """SIGKILL every process whose environment holds ``TAG_VAR=tag``; returns how many.

    The fallback for a kernel whose supervisor died before it could clean up (killed from
    outside, or by a cell of a kernel running as the host's own user): its descendants
    inherited the tag. A process that replaced its whole environment is not found.
    """
    import signal
    needle = f"{TAG_VAR}={tag}".encode() + b"\0"
    killed = 0
    for _ in range(rounds):
        found = 0
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    env = b"\0" + f.read() + b"\0"
                if b"\0" + needle in env:
                    os.kill(int(name), signal.SIGKILL)
                    found += 1
            except OSError:
                continue
        killed += found
        if not found:
            break
    return killed


def share_file(path: str, workdir: str, ident: Identity | None, *, move: bool = False) -> str:
    """A path to ``path``'s content that a kernel running as ``ident`` can read.

    ``path`` itself when the kernel runs as the host's user; else a private copy in the
    kernel's ``workdir``, owned by ``ident`` and readable only by it.

    Args:
        move: ``path`` is a temporary file of the host that the host will not read again:
            it is moved into ``workdir`` rather than copied (no second write of a big
            context; a copy when ``workdir`` is on another filesystem). Either way the kernel
            gets the only file it can read and the host no file the kernel can write; after
            a move ``path`` no longer exists. Ignored when the kernel runs as the host's user.

    A copy is only made of a file the user who started rlm may read under their own rights
    (:func:`starting_user`: on a root host through sudo; else root's rights apply), or of a
    scratch file of the host's own.
    Raises:
        PermissionError: that user may not read ``path`` (named): no copy is made.
        OSError: the copy (or the move) could not be made.
    """
    if ident is None:
        return path
    base = os.path.basename(path)
    dest = os.path.join(workdir, f".ctx-{len(os.listdir(workdir))}-{base}")
    if not move:
        _check_users(path, starting_user(), {})
        shutil.copyfile(path, dest)
    else:
        try:
            os.rename(path, dest)
        except OSError:  # another filesystem
            shutil.copyfile(path, dest)
            os.unlink(path)
    _give(dest, ident)
    return dest


def _give(path: str, ident: Identity) -> None:
    os.chown(path, ident.uid, ident.gid)
    os.chmod(path, stat.S_IRUSR)


def _readable(path: str, ident: Identity, searchable: dict[str, bool]) -> bool:
    """True if ``ident`` may read ``path`` (its mode bits and every directory above it)."""
    real = os.path.realpath(path)
    d = os.path.dirname(real)
    todo = []
    while d not in searchable:
        todo.append(d)
        if d == os.path.dirname(d):
            break
        d = os.path.dirname(d)
    for d in reversed(todo):  # shallowest first: a closed parent closes everything below
        parent = os.path.dirname(d)
        try:
            searchable[d] = searchable.get(parent, True) and _may(os.stat(d), ident, 1)
        except OSError:
            searchable[d] = False
    try:
        return searchable[os.path.dirname(real)] and _may(os.stat(real), ident, 4)
    except OSError:
        return False


def starting_user(environ=None) -> Identity | None:
    """The user who started rlm, when the host runs as root through sudo (``SUDO_UID`` and
    ``SUDO_GID`` of ``environ``, default ``os.environ``): a private copy for a kernel is only
    made of what that user may read. None: not root, no ``SUDO_UID`` (root's own rights
    apply), or sudo from root."""
    env = os.environ if environ is None else environ
    uid, gid = ((env.get(k) or "").strip() for k in ("SUDO_UID", "SUDO_GID"))
    if os.geteuid() != 0 or not uid.isdigit() or int(uid) == 0:
        return None
    try:
        entry = pwd.getpwuid(int(uid))
        name, primary = entry.pw_name, entry.pw_gid
    except KeyError:
        name, primary = (env.get("SUDO_USER") or "").strip() or f"uid {uid}", int(uid)
    return Identity(int(uid), int(gid) if gid.isdigit() else primary, name)


def _check_users(path: str, user: Identity | None, searchable: dict[str, bool]) -> None:
    """Refuse to copy ``path`` for a kernel unless ``user`` (:func:`starting_user`; None: no
    one to check for) may read it (:func:`_readable`: no supplementary groups, no ACLs), or
    it is a scratch file of the host's own (``rlm-ctx-*``, a regular file it owns).

    Raises:
        PermissionError: ``user`` may not read it (``filename``: ``path``).
    """
    if user is None or _readable(path, user, searchable):
        return
    try:
        st = os.lstat(path)
        if (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1
                and os.path.basename(path).startswith("rlm-ctx-")):  # rlm.context.files.PREFIX
            return
    except OSError:
        pass
    import errno
    raise PermissionError(errno.EACCES, f"{user.name} (uid {user.uid}), who started rlm "
                          "through sudo, may not read it: no copy of it is made for the kernel "
                          "with root's rights", path)


def share_bundle(manifest: str, workdir: str, ident: Identity | None) -> str:
    """:func:`share_file` for a many-file context: its manifest (:mod:`kernels.bundle`) and
    every file it names.

    The kernel's own copy of the manifest names, for each file: the file itself when ``ident``
    may read it already (a directory context is not copied for nothing), else a private copy in
    ``workdir`` readable only by ``ident`` (the host's scratch file, files under a directory
    ``ident`` may not enter), made only of a file the user who started rlm may read
    (:func:`share_file`). ``manifest`` itself when the kernel runs as the host's user.

    Raises:
        PermissionError: a file to copy that the user who started rlm may not read (named).
        OSError: a copy could not be made.
    """
    if ident is None:
        return manifest
    with open(manifest, "rb") as f:
        doc = json.loads(f.read())
    n = len(os.listdir(workdir))
    shared: dict[str, str] = {}
    searchable: dict[str, bool] = {}
    user, users_searchable = starting_user(), {}
    for entry in doc["entries"]:
        src = entry[FILE]
        if src not in shared:
            if _readable(src, ident, searchable):
                shared[src] = src
            else:
                _check_users(src, user, users_searchable)  # (PermissionError: no copy)
                shared[src] = os.path.join(workdir, f".ctx-{n}-{len(shared)}-"
                                                    f"{os.path.basename(src)}")
                shutil.copyfile(src, shared[src])
                _give(shared[src], ident)
        entry[FILE] = shared[src]
    dest = os.path.join(workdir, f".ctx-{n}-manifest.json")
    with open(dest, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    _give(dest, ident)
    return dest


def readable_by(path: str, ident: Identity) -> bool:
    """True if ``ident`` may read ``path`` under its own rights (mode bits of the file and of
    every directory above it)."""
    return _readable(path, ident, {})


def give(path: str, ident: Identity) -> None:
    """Make ``path`` (a private copy of ours) ``ident``'s, readable by it alone."""
    _give(path, ident)
