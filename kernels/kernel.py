"""Kernel lifecycle on jupyter_client: start, execute with a timeout, interrupt, restart, shut down.

A :class:`Kernel` is one ipykernel process started by ``jupyter_client`` with
a scrubbed environment (:func:`kernels.secrets.kernel_env`, an allow-list: no API
keys or tokens of the host), its own working directory, and IPC transport for its
ZeroMQ channels. The kernel imports :mod:`kernels.runtime` at start-up
(:data:`kernels.protocol.BOOT_CODE`), so a kernel taken from the :class:`KernelPool`
needs only one short bind cell (:func:`kernels.protocol.bind_code`) to serve an RLM.

Each kernel runs under a supervisor (:mod:`kernels.sandbox`, :mod:`kernels.supervisor`):
every process a cell starts, even one that left the kernel's session or process group, is
killed when the kernel shuts down, dies, or its host dies (even by SIGKILL), so nothing a
kernel starts outlives it. When the host runs as root the kernel runs as an unprivileged
user (``RLM_KERNEL_USER``, default ``nobody``). The kernel's own stdout and stderr (where
ipykernel prints its internal tracebacks) go to ``/dev/null``, never to the user's terminal
(``RLM_DEBUG=1`` keeps them); a cell's output reaches the host through Jupyter messages.

Text: cell output and errors are cleaned by the text policy of :mod:`harness.text` (a lone
surrogate becomes U+FFFD), in the kernel and again on the host.
"""
from __future__ import annotations

import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from jupyter_client import KernelManager

from harness.text import clean_text
from kernels import sandbox
from kernels.protocol import BOOT_CODE
from kernels.secrets import kernel_env

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class CellResult:
    """What one executed cell produced.

    Attributes:
        output: stdout, stderr, results and the error traceback, in order (str, untruncated).
        error: the exception as ``"Name: value"`` if the cell raised, else None.
        timed_out: the cell ran past its timeout and was interrupted.
        died: the kernel process died during the cell (it has been restarted).
        final: the answer set by ``FINAL``/``FINAL_VAR`` in this cell, if any.
        seconds: wall time of the execution (s).
    """

    output: str = ""
    error: str | None = None
    timed_out: bool = False
    died: bool = False
    final: str | None = None
    seconds: float = 0.0


class KernelDied(Exception):
    """The kernel process is gone (or was killed because it ignored an interrupt)."""


class Kernel:
    """One ipykernel process driven through a blocking jupyter_client client.

    Constructing one starts nothing; :meth:`start` does.

    Args:
        workdir: the kernel's working directory (created if missing; a fresh
            temporary directory when None, removed at shutdown).
        start_timeout: seconds :meth:`start` waits for the kernel to answer.

    Raises:
        OSError: ``workdir`` cannot be created.
    """

    def __init__(self, workdir: str | None = None, start_timeout: float = 30.0) -> None:
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="rlm-k-")
        os.makedirs(self.workdir, exist_ok=True)
        self.start_timeout = start_timeout
        self.km: KernelManager | None = None
        self.kc = None
        #: the user the kernel runs as (None: the host's own); see kernels.sandbox
        self.identity: sandbox.Identity | None = None
        #: the tag in the environment of the kernel and every process it starts
        self.tag = ""
        self._lock = threading.Lock()
        self._closed = False

    # lifecycle -----------------------------------------------------------
    def start(self) -> "Kernel":
        """Start the kernel process and wait until it answers (about 0.6 s cold here).

        Returns ``self``.

        Raises:
            RuntimeError: the kernel did not answer within ``start_timeout`` s (it is
                killed; the message says why when the supervisor knows), or
                :meth:`shutdown` was called while it was starting.
            kernels.sandbox.KernelUserError: ``RLM_KERNEL_USER`` is unusable.
        """
        self.identity = sandbox.kernel_identity()
        km = KernelManager(kernel_name="python3", transport="ipc")
        km.ip = os.path.join(self.workdir, ".k")
        km.connection_file = os.path.join(self.workdir, "kernel.json")
        km.kernel_spec  # resolve now; the native spec uses this interpreter
        argv = [sys.executable, *km.kernel_spec.argv[1:]]
        if sandbox.supervisor_available():
            argv = sandbox.supervised_argv(argv, workdir=self.workdir,
                                           connection_file=km.connection_file,
                                           ident=self.identity, own_dir=self._own_dir)
        km.kernel_spec.argv = argv
        quiet = {} if os.environ.get("RLM_DEBUG") else {"stdout": subprocess.DEVNULL,
                                                         "stderr": subprocess.DEVNULL}
        self.tag = secrets.token_hex(8)
        km.start_kernel(env=kernel_env({sandbox.TAG_VAR: self.tag}), cwd=self.workdir,
                        extra_arguments=[f"--IPKernelApp.exec_lines={BOOT_CODE}",
                                         "--HistoryManager.enabled=False",
                                         "--IPKernelApp.log_level=CRITICAL"], **quiet)
        kc = km.blocking_client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=self.start_timeout)
        except RuntimeError:
            kc.stop_channels()
            _stop(km, self.tag)
            why = self._start_error()
            raise RuntimeError(f"the Jupyter kernel did not start within {self.start_timeout:g} s"
                               + (f": {why}" if why else ""))
        with self._lock:
            closed = self._closed
            if not closed:
                self.km, self.kc = km, kc
        if closed:  # shut down while starting (e.g. the pool closed): do not leak it
            kc.stop_channels()
            _stop(km, self.tag)
            if self._own_dir:
                shutil.rmtree(self.workdir, ignore_errors=True)
            raise RuntimeError("kernel was shut down while starting")
        return self

    def _start_error(self) -> str:
        try:
            with open(os.path.join(self.workdir, ".supervisor-error"), encoding="utf-8",
                      errors="replace") as f:
                return f.read().strip()
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        """Process id of the kernel's top process (int; its supervisor on Linux); 0 if not started.

        The bridge accepts requests from this process and its descendants.
        """
        prov = getattr(self.km, "provisioner", None)
        proc = getattr(prov, "process", None)
        return proc.pid if proc is not None else 0

    def share_file(self, path: str, fmt: str = "text", move: bool = False) -> str:
        """A path to ``path``'s content that this kernel can read (a private copy when it
        runs as another user, see :func:`kernels.sandbox.share_file`; ``move``: the host's
        temporary file, which it will not read again, is moved there instead of copied); for
        a ``"bundle"`` (a many-file context's manifest), a manifest whose files it can read
        (:func:`kernels.sandbox.share_bundle`; ``move`` is ignored).

        Raises:
            OSError: a copy could not be made.
        """
        if fmt == "bundle":
            return sandbox.share_bundle(path, self.workdir, self.identity)
        return sandbox.share_file(path, self.workdir, self.identity, move=move)

    def is_alive(self) -> bool:
        """True if the kernel was started, not shut down, and its process still runs.

        Never raises; cheap (a ``poll`` of the child process).
        """
        return bool(self.km is not None and self.km.is_alive())

    def interrupt(self) -> None:
        """Send SIGINT to the kernel: the running cell raises KeyboardInterrupt."""
        if self.km is not None:
            self.km.interrupt_kernel()

    def shutdown(self) -> None:
        """Kill the kernel at once (SIGKILL) and clean up its files. Idempotent."""
        with self._lock:
            self._closed = True
            km, kc = self.km, self.kc
            self.km = self.kc = None
        if kc is not None:
            try:
                kc.stop_channels()
            except Exception:
                pass
        if km is not None:
            _stop(km, self.tag)
        if self._own_dir and km is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # execution -----------------------------------------------------------
    def execute(self, code: str, timeout: float | None = None,
                user_expressions: dict | None = None, *, stop=None, grace: float = 3.0,
                on_interrupt=None) -> tuple[CellResult, dict]:
        """Run ``code``; returns the :class:`CellResult` and the evaluated user expressions.

        Args:
            code: Python source of one cell.
            timeout: seconds before the cell is interrupted (None: no limit).
            user_expressions: name -> Python expression, evaluated after the cell (e.g.
                ``{FINAL_KEY: FINAL_EXPR}``); returned as Jupyter's
                ``{name: {"status", "data": {"text/plain": repr}}}`` dict ({} if the
                reply did not arrive within 5 s).

            stop: anything with ``is_set()`` (an Event, a cancel scope): once set, the cell is
                interrupted as at its timeout (checked every 0.2 s).
            grace: seconds an interrupted cell gets to stop before its kernel is killed
                (``min(grace, 1)`` when ``stop`` interrupted it).
            on_interrupt: called (no arguments) when the cell is interrupted.

        On timeout (or ``stop``) the kernel is interrupted; if the cell does not settle within
        ``grace`` seconds (it ignores SIGINT, spins in C code, or keeps printing), ``KernelDied``
        is raised after killing it, so the caller restarts it.

        Raises:
            KernelDied: the process died during the cell (or could not be interrupted).
        """
        if self.kc is None:
            raise KernelDied("kernel is not running")
        kc = self.kc
        t0 = time.monotonic()
        msg_id = kc.execute(code, silent=False, store_history=False,
                            user_expressions=user_expressions or {}, allow_stdin=False)
        parts: list[str] = []
        res = CellResult()
        deadline = None if timeout is None else t0 + timeout
        interrupted_at = None
        wait = grace
        idle = False

        def watch() -> None:
            # interrupt at the timeout (or stop); kill when the interrupt is ignored
            nonlocal interrupted_at, wait
            now = time.monotonic()
            if interrupted_at is None:
                stopped = stop is not None and stop.is_set()
                if stopped or (deadline is not None and now > deadline):
                    res.timed_out = True
                    interrupted_at = now
                    wait = min(grace, 1.0) if stopped else grace
                    self.interrupt()
                    if on_interrupt is not None:
                        on_interrupt()
            elif now - interrupted_at > wait:
                self.shutdown()
                raise KernelDied("the cell ignored the interrupt after its timeout")

        while not idle:
            try:
                msg = kc.get_iopub_msg(timeout=0.2)
            except (ValueError, KeyError, TypeError):
                watch()
                continue  # a malformed message (a cell wrote to the socket): skip it
            except queue.Empty:
                if not self.is_alive():
                    res.seconds = time.monotonic() - t0
                    raise KernelDied(self._died_text(parts))
                watch()
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                watch()  # e.g. a thread of an earlier cell printing without pause
                continue
            mtype, content = msg["msg_type"], msg["content"]
            if mtype == "stream":
                parts.append(content.get("text", ""))
            elif mtype in ("execute_result", "display_data"):
                data = content.get("data", {})
                if "text/plain" in data:
                    parts.append(data["text/plain"] + "\n")
            elif mtype == "error":
                tb = "\n".join(content.get("traceback") or [])
                parts.append(_ANSI.sub("", tb) + "\n")
                res.error = f"{content.get('ename')}: {content.get('evalue')}"
            elif mtype == "status" and content.get("execution_state") == "idle":
                idle = True
            if not idle:  # stay responsive to the timeout (and the kill) while output streams
                watch()
        exprs: dict = {}
        try:
            reply = kc.get_shell_msg(timeout=5)
            while reply.get("parent_header", {}).get("msg_id") != msg_id:
                reply = kc.get_shell_msg(timeout=5)
            content = reply["content"]
            exprs = content.get("user_expressions") or {}
            if content.get("status") == "error" and res.error is None:
                # the cell failed but its error message never came (a cell can break the
                # kernel's error display): report it from the reply
                res.error = f"{content.get('ename')}: {content.get('evalue')}"
                parts.append(res.error + "\n")
        except queue.Empty:
            pass
        res.output = clean_text("".join(parts))
        if res.error is not None:
            res.error = clean_text(res.error)
        res.seconds = time.monotonic() - t0
        return res, exprs

    def _died_text(self, parts: list[str]) -> str:
        tail = "".join(parts)[-500:]
        return "the kernel process died during the cell" + (f"; last output: {tail}" if tail else "")


def _stop(km: KernelManager, tag: str) -> None:
    """Shut a kernel down at once, with every process it started. Never raises.

    The supervisor is asked first (SIGTERM: it kills the kernel and all its descendants,
    which may have left its process group); it is waited for without being reaped, so
    its process group id cannot be reused before jupyter_client's own kill and cleanup.
    If the supervisor was already gone (killed before it could clean up), every process
    still carrying the kernel's ``tag`` is killed (:func:`kernels.sandbox.kill_tagged`).
    """
    proc = getattr(getattr(km, "provisioner", None), "process", None)
    if not sandbox.supervisor_available() or proc is None:
        pass
    elif proc.poll() is not None:
        if proc.returncode < 0 and tag:  # the supervisor was killed: it could not clean up
            sandbox.kill_tagged(tag)
    else:
        try:
            os.kill(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
                    break
                time.sleep(0.005)
        except (OSError, ChildProcessError):
            pass
    try:
        km.shutdown_kernel(now=True)
    except Exception:
        pass


class KernelPool:
    """Pre-started clean kernels, so an RLM (a child especially) starts in milliseconds.

    A kernel leaves the pool once and is never returned: it is shut down when
    its RLM instance ends, so no state is ever shared between instances. The
    pool refills in a background thread. ``size=0`` keeps no idle kernels
    (every :meth:`acquire` is a cold start).

    Args:
        size: idle kernels to keep ready (int >= 0).
    """

    def __init__(self, size: int = 0) -> None:
        self.size = max(0, int(size))
        self._ready: queue.Queue[Kernel] = queue.Queue()
        self._lock = threading.Lock()
        self._starting = 0
        self._closed = False
        self.started = 0  # kernels started over the pool's life (cold ones included)
        self._live: set[Kernel] = set()
        self._fill()

    def _fill(self) -> None:
        with self._lock:
            if self._closed:
                return
            need = self.size - self._ready.qsize() - self._starting
            self._starting += max(need, 0)
        for _ in range(max(need, 0)):
            threading.Thread(target=self._start_one, daemon=True, name="rlm-pool").start()

    def _start_one(self) -> None:
        try:
            k = self._new()
        except Exception:
            with self._lock:
                self._starting -= 1
            return
        with self._lock:
            self._starting -= 1
            closed = self._closed
        if closed:
            self._drop(k)
        else:
            self._ready.put(k)

    def _new(self) -> Kernel:
        k = Kernel()
        with self._lock:
            self._live.add(k)
            self.started += 1
        try:
            return k.start()
        except Exception:
            self._drop(k)
            raise

    def _drop(self, k: Kernel) -> None:
        with self._lock:
            self._live.discard(k)
        k.shutdown()

    def acquire(self) -> Kernel:
        """A started kernel that no RLM has used: from the pool if one is ready, else cold.

        Raises:
            RuntimeError: a cold start failed (see :meth:`Kernel.start`).
        """
        k = None
        while True:
            try:
                k = self._ready.get_nowait()
            except queue.Empty:
                k = None
                break
            if k.is_alive():
                break
            self._drop(k)
        if k is None:
            k = self._new()
        self._fill()
        return k

    def release(self, k: Kernel) -> None:
        """Shut ``k`` down (kernels are never reused). Never raises."""
        self._drop(k)

    def close(self) -> None:
        """Shut down every kernel this pool started that is still alive. Idempotent."""
        with self._lock:
            self._closed = True
            live = list(self._live)
            self._live.clear()
        threads = [threading.Thread(target=k.shutdown, daemon=True) for k in live]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
