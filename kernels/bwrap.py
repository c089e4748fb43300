"""The kernel sandbox: every kernel in a bubblewrap (``bwrap``) container of its own.

Inside, a kernel has (see :func:`bwrap_argv`):

* no network: a network namespace of its own with only a loopback device nobody listens on
  (``--unshare-net``; ``SandboxSpec.network`` keeps the host's network). Its Jupyter channels
  are Unix sockets in its private ``/tmp`` (:data:`SANDBOX_SOCKETS`; the host reaches them
  through ``/proc/<supervisor>/root``), the bridge a Unix socket linked into its working
  directory, which it sees read-only: no host directory is writable to it;
* a PID namespace of its own (``--unshare-pid``): no host process is visible, so no host
  ``/proc/<pid>/cmdline``, ``environ`` or ``mem`` can be opened and no host process traced;
* a read-only view of what it needs and nothing else: ``/usr`` (and the ``/bin``, ``/lib``
  links into it), the interpreter (``sys.base_prefix``), the virtual environment
  (``sys.prefix``), the ``kernels`` and ``harness`` packages, a few files of ``/etc``
  (:data:`ETC_FILES`: no ``shadow``), a minimal ``/dev`` (null, zero, full, random, urandom,
  tty, a pty multiplexer) and its own ``/proc``. No host ``$HOME``, no ``/root``;
* a private ``/tmp`` (and ``HOME`` = ``/tmp/home``, the working directory of its cells) and a
  private ``/dev/shm`` (POSIX semaphores and shared memory: ``multiprocessing`` needs it),
  tmpfs of at most ``SandboxSpec.disk_mb`` each that end with the kernel;
* limits over the whole kernel where the host may create control groups
  (:mod:`kernels.limits`, :mod:`kernels.cgroups`: memory with its tmpfs pages, processes and
  threads, a CPU share), and per process (set by :mod:`kernels.supervisor` before the kernel
  starts; what stands in without a group): address space (``RLIMIT_AS``, ``memory_mb``: a cell
  that needs more gets ``MemoryError``), processes and threads (``RLIMIT_NPROC``,
  ``processes``: counted in the sandbox's user namespace on a non-root host, over the kernel's
  own user on a root host), the size of one file (``RLIMIT_FSIZE``, ``file_mb``: writing past
  it is an ``OSError``), open descriptors (``RLIMIT_NOFILE``, :data:`DESCRIPTORS`);
* system calls it has no use for refused (:mod:`kernels.seccomp`: keyrings, ``io_uring``, new
  user namespaces; and ``--disable-userns`` on a non-root host where bubblewrap has it).

Modes (:data:`MODES`): ``auto`` (the default) sandboxes where bubblewrap works and otherwise
warns once, saying why and what to install; ``required`` refuses to start a kernel without
it (:class:`SandboxUnavailable`); ``none`` starts kernels as before, under the supervisor
only. Every guarantee of :mod:`kernels.sandbox` holds in every mode: the supervisor and its
reaping, the unprivileged user when the host is root, the scrubbed environment.

Where it comes from: bubblewrap's manual (``bwrap(1)``: ``--unshare-*``, ``--die-with-parent``,
``--ro-bind``, ``--tmpfs`` with ``--size``, ``--dev``, ``--proc``); the limits are
``setrlimit(2)``'s. Linux only.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

__all__ = ["CTX_DIR", "box_file", "box_bundle", "MODES", "ETC_FILES", "SandboxSpec", "SandboxUnavailable", "bwrap_argv",
           "sandbox_problem", "resolve_mode", "SANDBOX_HOME", "SANDBOX_SOCKETS", "ENV_VAR"]

log = logging.getLogger("kernels.sandbox")

#: The modes of ``--sandbox``.
MODES = ("auto", "required", "none")
#: The environment variable that sets the mode when no option does.
ENV_VAR = "RLM_SANDBOX"
#: The kernel's home and the working directory of its cells, inside the sandbox.
SANDBOX_HOME = "/tmp/home"
#: Where a sandboxed kernel's Jupyter sockets are (``{this}-1`` ... ``-5``), in its private
#: ``/tmp``; the host reaches them through ``/proc/<supervisor>/root``.
SANDBOX_SOCKETS = "/tmp/.rlm-k"
#: The files of ``/etc`` a kernel sees (read-only; each only if the host has it).
ETC_FILES = ("ld.so.cache", "ld.so.conf", "localtime", "passwd", "group", "nsswitch.conf",
             "mime.types")
#: The kernel's context directory, inside its working directory: bound read-only in the
#: sandbox, so a context file linked there (rather than copied) cannot be written from a cell.
CTX_DIR = "ctx"
#: Open descriptors of each process of a sandboxed kernel (``RLIMIT_NOFILE``).
DESCRIPTORS = 4096
#: Install hint for a machine without bubblewrap.
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap)"


class SandboxUnavailable(RuntimeError):
    """``--sandbox required`` on a machine where the sandbox cannot run (the reason says why)."""


@dataclass(frozen=True)
class SandboxSpec:
    """How a kernel is sandboxed. Defaults are documented in docs/security.md.

    Attributes:
        mode: ``auto``, ``required`` or ``none`` (:data:`MODES`); None: ``$RLM_SANDBOX``, else
            ``auto``.
        network: keep the host's network (``--kernel-network``); default none at all.
        memory_mb: address-space limit of the kernel process (MiB; default 4096).
        processes: processes and threads (default 1024).
        disk_mb: size of the private ``/tmp`` and home (MiB; default 1024).
        file_mb: largest file the kernel may write (MiB; default 1024).
        cpu_weight: the kernel's CPU share where it has a control group (1-10000; 100 is one
            ordinary share, however many processes the kernel runs).
        seed: the seed of the kernel's chance, sandboxed or not: its hash seed, and
            :mod:`random` and NumPy (:mod:`kernels.chance`); the run's ``kernel_seed``.
    """

    mode: str | None = None
    network: bool = False
    memory_mb: int = 4096
    processes: int = 1024
    disk_mb: int = 1024
    file_mb: int = 1024
    cpu_weight: int = 100
    seed: int = 0

    def requested(self) -> str:
        """The mode asked for: ``mode``, else ``$RLM_SANDBOX``, else ``auto``.

        Raises:
            ValueError: ``$RLM_SANDBOX`` holds something else than one of :data:`MODES`.
        """
        mode = self.mode or (os.environ.get(ENV_VAR) or "").strip().lower() or "auto"
        if mode not in MODES:
            raise ValueError(f"{ENV_VAR}={mode!r}: choose one of {', '.join(MODES)}")
        return mode

    def rlimits(self) -> dict[str, int]:
        """The kernel's resource limits, by ``resource`` module name (bytes or counts): per
        process, and the only ones where there is no control group (:mod:`kernels.limits`).
        Open descriptors: :data:`DESCRIPTORS`, or the host's own hard limit if lower."""
        import resource
        mib = 1024 * 1024
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        files = DESCRIPTORS if hard == resource.RLIM_INFINITY else min(DESCRIPTORS, hard)
        return {"RLIMIT_AS": self.memory_mb * mib, "RLIMIT_NPROC": self.processes,
                "RLIMIT_FSIZE": self.file_mb * mib, "RLIMIT_NOFILE": files}


@functools.lru_cache(maxsize=1)
def sandbox_problem() -> str | None:
    """Why kernels cannot be sandboxed here (str), or None when they can.

    Checked once per process: Linux, a ``bwrap`` on ``PATH``, and a probe that starts
    ``true`` in new network, PID and mount namespaces (user namespaces may be disabled, or a
    container may forbid them).
    """
    if not sys.platform.startswith("linux"):
        return "the sandbox needs Linux (bubblewrap and kernel namespaces)"
    exe = shutil.which("bwrap")
    if exe is None:
        return f"bubblewrap (bwrap) is not installed: {INSTALL_HINT}"
    true = shutil.which("true") or "/bin/true"
    try:
        p = subprocess.run([exe, "--ro-bind", "/", "/", "--unshare-net", "--unshare-pid",
                            "--die-with-parent", "--", true], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap could not run here ({exc})"
    if p.returncode != 0:
        why = p.stderr.decode("utf-8", "replace").strip().splitlines()
        return ("bubblewrap cannot create namespaces here"
                + (f" ({why[-1]})" if why else "") + ": enable unprivileged user namespaces "
                "(sysctl kernel.unprivileged_userns_clone=1) or run where they are allowed")
    return None


@functools.lru_cache(maxsize=1)
def disables_userns() -> bool:
    """Whether the installed bubblewrap has ``--disable-userns`` (0.8.0 and later): read from
    its ``--help`` once per process."""
    try:
        p = subprocess.run([shutil.which("bwrap") or "bwrap", "--help"], capture_output=True,
                           timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return b"--disable-userns" in p.stdout + p.stderr


_warned = False


def resolve_mode(spec: SandboxSpec) -> str:
    """``"bwrap"`` when the kernel is sandboxed, ``"none"`` when not.

    ``auto`` on a machine without the sandbox logs one warning per process saying why.

    Raises:
        SandboxUnavailable: ``required`` where the sandbox cannot run.
        ValueError: a bad ``$RLM_SANDBOX``.
    """
    global _warned
    mode = spec.requested()
    if mode == "none":
        return "none"
    problem = sandbox_problem()
    if problem is None:
        return "bwrap"
    if mode == "required":
        raise SandboxUnavailable(f"--sandbox required, but {problem}")
    if not _warned:
        _warned = True
        log.warning("kernels run without a sandbox (they can reach the network and this user's "
                    "files): %s; or pass --sandbox none to silence this", problem)
    return "none"


def _system_binds() -> list[str]:
    """``/usr`` read-only, and ``/bin``, ``/sbin``, ``/lib*`` as the host has them (links into
    ``/usr`` on a merged-``/usr`` system, else read-only binds)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for name in ETC_FILES:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    return args


def _python_paths() -> list[str]:
    """What the kernel's interpreter needs, outside ``/usr``: the interpreter and standard
    library, the virtual environment, and this project's ``kernels`` and ``harness`` packages
    (not the directory holding them: a checkout may hold ``.env`` files and journals)."""
    import harness.text  # a module of it: the package itself may resolve to a namespace
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [sys.base_prefix, sys.prefix, sys.exec_prefix, os.path.dirname(sys.executable),
             os.path.dirname(os.path.realpath(sys.executable)), here,
             os.path.dirname(os.path.abspath(harness.text.__file__))]
    out: list[str] = []
    for p in paths:
        for q in (os.path.abspath(p), os.path.realpath(p)):
            if q.startswith("/usr/") or q == "/usr" or not os.path.isdir(q):
                continue
            if not any(q == o or q.startswith(o + "/") for o in out):
                out = [o for o in out if not o.startswith(q + "/")] + [q]
    return out


def _ancestors(path: str) -> list[str]:
    """The directories above ``path`` ("/" and ``/usr`` excluded): ``/a/b/c`` -> ``/a``, ``/a/b``."""
    parts = path.strip("/").split("/")[:-1]
    out = ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return [d for d in out if d != "/usr" and not d.startswith("/usr/")]


def bwrap_argv(argv: list[str], *, workdir: str, spec: SandboxSpec,
               seccomp_fd: int | None = None) -> list[str]:
    """``argv`` (the supervised kernel command) run inside a new sandbox.

    Args:
        argv: the command (:func:`kernels.sandbox.supervised_argv`'s).
        workdir: the kernel's host directory (connection file, the bridge's link, its context
            files): bound read-only at the same path.
        spec: the limits and the network setting.
        seccomp_fd: a descriptor bubblewrap inherits holding the seccomp filter to load
            (:mod:`kernels.seccomp`), or None.
    """
    exe = shutil.which("bwrap") or "bwrap"
    args = [exe, "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--hostname", "rlm-kernel"]
    if not spec.network:
        args.append("--unshare-net")
    if os.geteuid() != 0 and disables_userns():
        # no user namespace inside this one (a cell would hold every capability in it); a
        # root host's kernel cannot make one either: the seccomp filter refuses it there
        args += ["--unshare-user", "--disable-userns"]
    if os.geteuid() == 0:
        # the supervisor drops to the kernel user inside; bwrap run by root drops every
        # capability unless told, and these are what that takes
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_CHOWN",
                 # and to end and clean up after a kernel user's processes and files
                 "--cap-add", "CAP_KILL", "--cap-add", "CAP_DAC_OVERRIDE"]
    args += _system_binds()
    # the private /tmp first: a checkout or a virtual environment under /tmp is bound on top
    # /dev/shm writable by the kernel (bubblewrap's is root's, 0755): POSIX semaphores and
    # shared memory live there, and every multiprocessing pool, queue and lock needs one
    size = str(spec.disk_mb * 1024 * 1024)
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", size,
             "--tmpfs", "/dev/shm", "--size", size, "--tmpfs", "/tmp"]
    paths = _python_paths()
    # the directories above them, empty and open (bubblewrap would copy a host directory's
    # mode: /root's 0700 would shut an unprivileged kernel out of a pyenv interpreter there)
    parents = sorted({a for p in paths for a in _ancestors(p)}, key=lambda d: (d.count("/"), d))
    for d in parents:
        if d != "/tmp":
            args += ["--perms", "0755", "--dir", d]
    for p in paths:
        args += ["--ro-bind", p, p]
    for d in _ancestors(workdir):  # open, in the private /tmp: the host's may be 0700 (pytest's)
        if d not in parents and d != "/tmp":
            args += ["--perms", "0755", "--dir", d]
    args += ["--dir", SANDBOX_HOME, "--ro-bind", workdir, workdir,
             "--ro-bind", os.path.join(workdir, CTX_DIR), os.path.join(workdir, CTX_DIR),
             "--setenv", "HOME", SANDBOX_HOME, "--setenv", "TMPDIR", "/tmp",
             "--chdir", SANDBOX_HOME]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    return args + ["--"] + list(argv)


def box_file(path: str, ctx_dir: str, *, move: bool = False, name: str | None = None) -> str:
    """``path``'s content at a path inside the sandbox: in ``ctx_dir`` (read-only there), as a
    hard link when ``path`` is on the same filesystem (no copy of a big context), else a copy;
    ``move``: the host's own temporary file, renamed in (or copied, then removed).

    Raises:
        OSError: neither a link nor a copy could be made.
    """
    dest = os.path.join(ctx_dir, name or f".ctx-{len(os.listdir(ctx_dir))}-{os.path.basename(path)}")
    if move:
        try:
            os.rename(path, dest)
            return dest
        except OSError:  # another filesystem
            shutil.copyfile(path, dest)
            os.unlink(path)
            return dest
    try:
        os.link(path, dest)
    except OSError:  # another filesystem, or a file this user may not link
        shutil.copyfile(path, dest)
    return dest


def box_bundle(manifest: str, ctx_dir: str, share: "Callable[[str], str] | None" = None) -> str:
    """A copy of a many-file context's manifest (:mod:`kernels.bundle`) in ``ctx_dir`` whose
    files are all inside the sandbox: each file once, by :func:`box_file`, or by ``share``
    (``path -> path in ctx_dir``) when given (a kernel running as another user).

    Raises:
        OSError: a file could not be linked or copied.
    """
    import json

    from kernels.bundle import FILE
    with open(manifest, "rb") as f:
        doc = json.loads(f.read())
    n = len(os.listdir(ctx_dir))
    boxed: dict[str, str] = {}
    for i, entry in enumerate(doc["entries"]):
        src = entry[FILE]
        if src not in boxed:
            boxed[src] = (share(src) if share is not None else
                          box_file(src, ctx_dir,
                                   name=f".ctx-{n}-{len(boxed)}-{os.path.basename(src)}"))
        entry[FILE] = boxed[src]
    dest = os.path.join(ctx_dir, f".ctx-{n}-manifest.json")
    with open(dest, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    return dest
