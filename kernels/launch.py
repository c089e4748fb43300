"""Launching a kernel's process without importing ``jupyter_client``.

A kernel is started in two steps: :func:`launch` writes the Jupyter connection file and starts
the process (standard library only), and :meth:`Launched.blocking_client` then connects
``jupyter_client``'s client to it. ``import jupyter_client`` takes about 0.1 s of CPU here
(its asynchronous client, ``zmq.asyncio``, the session module); launching first lets the
kernel's own cold start (about 0.4 s of ipykernel imports, in its own process) run while the
host imports it, instead of after.

What :func:`launch` does is what ``jupyter_client``'s ``KernelManager.start_kernel`` does for
a local kernel on the IPC transport, written against the documented formats rather than its
internals: the connection file (the JSON of the Jupyter messaging documentation, "Connection
files": transport, ip, the five ports, the HMAC key and its signature scheme, mode 0600), and
the process started in a new session (so an interrupt can signal its whole process group)
with ``JPY_PARENT_PID`` set to this process, its standard input closed.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
import uuid
from typing import Any, Callable

#: The five ZeroMQ channels of a kernel and their IPC "ports": suffixes of the socket paths
#: (``{ip}-{port}``); the directory is the kernel's own, so they never collide.
PORTS = {"shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4, "hb_port": 5}

#: How often (ms) a client socket retries connecting to a kernel socket that is not bound yet
#: (see :meth:`Launched.blocking_client`). A cheap local ``connect`` attempt per socket.
RECONNECT_INTERVAL_MS = 10


def connection_info(ip: str) -> dict[str, Any]:
    """The connection information of a new kernel whose IPC sockets are ``{ip}-1`` ... ``-5``:
    a dict in the format of a Jupyter connection file, with a fresh random HMAC key."""
    return {**PORTS, "ip": ip, "transport": "ipc", "key": str(uuid.uuid4()),
            "signature_scheme": "hmac-sha256", "kernel_name": "python3"}


def launch(argv: list[str], *, connection_file: str, info: dict[str, Any], env: dict,
           cwd: str, quiet: bool = True, sandboxed: bool = False, pass_fds: tuple = (),
           group: int | None = None) -> "Launched":
    """Write ``info`` to ``connection_file`` (mode 0600) and start ``argv`` (a kernel command
    line that reads it) in a new session, in ``cwd``, with ``env`` plus ``JPY_PARENT_PID``.

    Args:
        quiet: send the process's stdout and stderr to ``/dev/null`` (else inherit them).
        sandboxed: ``argv`` is bubblewrap's (:mod:`kernels.bwrap`): it is started from one
            long-lived thread, since ``--die-with-parent`` kills the sandbox when the *thread*
            that started it ends (``PR_SET_PDEATHSIG``, prctl(2)), and pool kernels are
            started from threads that end long before their kernels do.
    Returns:
        the :class:`Launched` kernel.
    Raises:
        OSError: the file could not be written or the command could not start (the file is
            removed again).
    """
    fd = os.open(connection_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    if group is not None:  # a kernel user of its own reads it through its group, cannot write
        os.fchown(fd, -1, group)
        os.fchmod(fd, 0o640)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
    out = subprocess.DEVNULL if quiet else None
    def start() -> subprocess.Popen:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                env=dict(env, JPY_PARENT_PID=str(os.getpid())), cwd=cwd,
                                start_new_session=True,
                                pass_fds=((lifeline_fd(),) if sandboxed else ()) + tuple(pass_fds))
    try:
        proc = _on_launcher_thread(start) if sandboxed else start()
    except OSError:
        _remove(connection_file)
        raise
    launched = Launched(proc, connection_file, info)
    launched.sandboxed = sandboxed
    return launched


_lifeline: list[int] = []  # [read end] of the pipe whose write end only this process holds


def lifeline_fd() -> int:
    """The read end of this process's lifeline: a pipe whose write end only this process holds
    (never written, never inherited), so its reader sees end-of-file when this process is gone,
    however it ended. A sandboxed kernel's supervisor watches it (:mod:`kernels.supervisor`):
    in its own PID namespace it cannot watch the host's process itself."""
    with _launcher_lock:
        if not _lifeline or _lifeline[1] != os.getpid():  # new, or inherited across fork
            r, w = os.pipe()  # both non-inheritable: only pass_fds hands the read end on
            _lifeline[:] = [r, os.getpid(), w]
        return _lifeline[0]


_launches: "queue.Queue" = queue.Queue()
_launcher: threading.Thread | None = None
_launcher_lock = threading.Lock()


def _on_launcher_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` run on the process's one launcher thread (a daemon that lives as long as the
    process); returns its value or raises its exception."""
    global _launcher
    with _launcher_lock:
        if _launcher is None or not _launcher.is_alive():
            _launcher = threading.Thread(target=_serve_launches, name="rlm-kernel-launcher",
                                         daemon=True)
            _launcher.start()
    done, box = threading.Event(), {}
    _launches.put((fn, box, done))
    done.wait()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _serve_launches() -> None:
    while True:
        fn, box, done = _launches.get()
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc
        done.set()


class Launched:
    """One kernel process started by :func:`launch`: what this project needs of a kernel
    manager (the process, its liveness, interrupt, clean-up of its files, a client).

    Attributes:
        process: the ``subprocess.Popen`` (the kernel's supervisor on Linux).
        pgid: its process group (its own: it leads a new session).
        connection_file: path of the connection file. info: its content (dict).
    """

    def __init__(self, process: subprocess.Popen, connection_file: str,
                 info: dict[str, Any]) -> None:
        self.process = process
        self.pgid = process.pid  # start_new_session: the leader of its own group
        self.connection_file = connection_file
        self.info = info
        #: the process is bubblewrap's (kernels.bwrap): the kernel is found below it
        self.sandboxed = False
        #: the kernel's whole-kernel limits (kernels.limits.KernelLimits), None outside a sandbox
        self.limits = None
        #: what it holds until its processes are gone, closed by release() after the limits
        #: (its user's number: kernels.identity.Lease)
        self.leases: list = []
        self._kernel_pid = 0
        self._located = False

    def is_alive(self) -> bool:
        """Whether the process still runs (a ``poll``; never raises)."""
        return self.process.poll() is None

    def interrupt_kernel(self) -> None:
        """SIGINT to the kernel's process group (the supervisor ignores it; the kernel's
        running cell raises KeyboardInterrupt), as ``jupyter_client`` interrupts a kernel
        whose spec says ``interrupt_mode: signal``. In a sandbox, SIGINT goes to the kernel
        process alone: bubblewrap's own process, which leads the group, would die of it.
        Never raises."""
        try:
            if self.sandboxed:
                pid = self.kernel_pid()
                if pid:
                    os.kill(pid, signal.SIGINT)
                return
            os.killpg(self.pgid, signal.SIGINT)
        except OSError:
            pass

    def kernel_pid(self) -> int:
        """The host's process id of the kernel itself (the ``ipykernel`` process below the
        supervisor, and in a sandbox below bubblewrap too), or 0 if it is not running."""
        if not (self._kernel_pid and os.path.exists(f"/proc/{self._kernel_pid}")):
            self._kernel_pid = self._below(lambda argv: argv[1:3] == [b"-m", b"kernels.ipykernel_main"])
        return self._kernel_pid

    def stop_pid(self) -> int:
        """The process the host asks to stop the kernel (SIGTERM): the supervisor. Outside a
        sandbox that is :attr:`process`; inside, the supervisor below bubblewrap (bubblewrap
        itself dies of SIGTERM, and the sandbox with it, before the supervisor can remove
        the kernel's directory). :attr:`process`'s pid when the supervisor is not found."""
        if not self.sandboxed:
            return self.process.pid
        found = self._below(lambda argv: len(argv) > 3 and argv[3].endswith(b"supervisor.py"))
        return found or self.process.pid

    def _below(self, match) -> int:
        """The first process at or below :attr:`process` (breadth first, by
        ``/proc/<pid>/task/<pid>/children``) whose argv (list of bytes) ``match`` accepts; 0."""
        todo = [self.process.pid]
        for _ in range(64):  # a kernel is a few levels down
            if not todo:
                break
            pid = todo.pop(0)
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
                    todo += [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
            if match(argv):
                return pid
        return 0

    def release(self) -> None:
        """After the kernel's processes are ended: remove its control group, then free its
        user's number. Idempotent; never raises."""
        if self.limits is not None:
            self.limits.close()
        for held in self.leases:
            held.close()

    def _locate(self, timeout: float = 30.0) -> None:
        """In a sandbox, point :attr:`info`'s sockets (the kernel's, in its private ``/tmp``)
        at the supervisor's root, ``/proc/<pid>/root``: the working directory the host shares
        with the kernel is read-only to it. Waits for the supervisor (it runs in the sandbox
        once its command line shows); returns at once outside a sandbox.

        Raises:
            RuntimeError: the kernel's processes ended, or the supervisor did not show within
                ``timeout`` seconds.
        """
        if not self.sandboxed or self._located:
            return
        deadline = time.monotonic() + timeout
        while True:
            pid = self._below(lambda argv: len(argv) > 3 and argv[3].endswith(b"supervisor.py"))
            if pid:
                break
            if not self.is_alive():
                raise RuntimeError("Kernel died before replying to kernel_info")
            if time.monotonic() > deadline:
                raise RuntimeError(f"Kernel didn't respond in {timeout:g} seconds")
            time.sleep(0.001)
        self.info = dict(self.info, ip=f"/proc/{pid}/root{self.info['ip']}")
        self._located = True

    def cleanup_resources(self) -> None:
        """Remove the connection file and the IPC socket files. Never raises. (The client
        destroys its own ZeroMQ context when its channels stop.)"""
        _remove(self.connection_file)
        if self.sandboxed:  # its sockets end with its /tmp; and once its supervisor is gone,
            return  # /proc/<that pid>/root may be another process's
        for port in PORTS.values():
            _remove(f"{self.info['ip']}-{port}")

    def blocking_client(self):
        """A new ``jupyter_client.BlockingKernelClient`` for this kernel (channels not started;
        it owns its ZeroMQ context), whose sockets retry a connect every
        :data:`RECONNECT_INTERVAL_MS`.

        The client is usually connected while the kernel is still importing ipykernel, before
        it has bound its sockets; ZeroMQ then tries again after ``ZMQ_RECONNECT_IVL``, 100 ms
        by default (libzmq's ``zmq_setsockopt`` documentation), so the kernel's first reply
        waited up to that long after the kernel was ready (measured here: 22-95 ms, median
        ~70 ms, of a ~0.5 s start; 6-10 ms with a 10 ms interval). Set as the context's
        default, it applies to every socket the client makes.
        """
        import zmq
        from jupyter_client import BlockingKernelClient
        self._locate()
        kc = BlockingKernelClient()
        kc.context.setsockopt(zmq.RECONNECT_IVL, RECONNECT_INTERVAL_MS)
        kc.load_connection_info(self.info)
        return kc


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
