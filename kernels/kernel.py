"""Kernel lifecycle on jupyter_client: start, execute with a timeout, interrupt, restart, shut down.

A :class:`Kernel` is one ipykernel process started by ``jupyter_client`` with
a scrubbed environment (an allow-list: no API keys or tokens of the host), its
own working directory, and IPC transport for its ZeroMQ channels. The kernel
imports :mod:`kernels.runtime` at start-up, so a kernel taken from the
:class:`KernelPool` needs only one short ``bind`` cell to serve an RLM.

``jupyter_client`` sets ``JPY_PARENT_PID`` and ipykernel's parent poller exits
the kernel within about a second when the host process dies (even by SIGKILL),
so kernels never outlive their host.
"""
from __future__ import annotations

import ast
import json
import os
import queue
import re
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from jupyter_client import KernelManager

#: Environment variables passed through to kernels; everything else is dropped.
ENV_ALLOW = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE",
             "TZ", "TMPDIR", "SHELL", "TERM", "PYTHONPATH", "VIRTUAL_ENV", "SYSTEMROOT",
             "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS")

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

_BOOT = "import kernels.runtime as __rlm_rt"


def scrubbed_env(extra: dict | None = None) -> dict:
    """The kernel's environment: the allow-listed host variables plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k in ENV_ALLOW}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    env.update(extra or {})
    return env


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
    notes: list = field(default_factory=list)


class KernelDied(Exception):
    """The kernel process is gone."""


class Kernel:
    """One ipykernel process driven through a blocking jupyter_client client.

    Args:
        workdir: the kernel's working directory (created if missing; a fresh
            temporary directory when None, removed at shutdown).

    Raises:
        RuntimeError: the kernel did not start or answer within ``start_timeout`` s.
    """

    def __init__(self, workdir: str | None = None, start_timeout: float = 30.0) -> None:
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="rlm-k-")
        os.makedirs(self.workdir, exist_ok=True)
        self.start_timeout = start_timeout
        self.km: KernelManager | None = None
        self.kc = None
        self.restarts = 0
        self._lock = threading.Lock()
        self._closed = False

    # lifecycle -----------------------------------------------------------
    def start(self) -> "Kernel":
        """Start the kernel process and wait until it answers (about 0.6 s cold here)."""
        km = KernelManager(kernel_name="python3", transport="ipc")
        km.ip = os.path.join(self.workdir, ".k")
        km.kernel_spec  # resolve now; the native spec uses this interpreter
        km.kernel_spec.argv[0] = sys.executable
        km.start_kernel(env=scrubbed_env(), cwd=self.workdir,
                        extra_arguments=[f"--IPKernelApp.exec_lines={_BOOT}",
                                         "--HistoryManager.enabled=False",
                                         "--IPKernelApp.log_level=CRITICAL"])
        kc = km.blocking_client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=self.start_timeout)
        except RuntimeError:
            km.shutdown_kernel(now=True)
            raise RuntimeError(f"the Jupyter kernel did not start within {self.start_timeout:g} s")
        with self._lock:
            closed = self._closed
            if not closed:
                self.km, self.kc = km, kc
        if closed:  # shut down while starting (e.g. the pool closed): do not leak it
            kc.stop_channels()
            km.shutdown_kernel(now=True)
            if self._own_dir:
                shutil.rmtree(self.workdir, ignore_errors=True)
            raise RuntimeError("kernel was shut down while starting")
        return self

    @property
    def pid(self) -> int:
        """Process id of the kernel (int); 0 if not started."""
        prov = getattr(self.km, "provisioner", None)
        proc = getattr(prov, "process", None)
        return proc.pid if proc is not None else 0

    def is_alive(self) -> bool:
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
            try:
                km.shutdown_kernel(now=True)
            except Exception:
                pass
        if self._own_dir and km is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # execution -----------------------------------------------------------
    def execute(self, code: str, timeout: float | None = None,
                user_expressions: dict | None = None) -> tuple[CellResult, dict]:
        """Run ``code``; returns the :class:`CellResult` and the evaluated user expressions.

        On timeout the kernel is interrupted; if it does not settle within 3 s,
        ``KernelDied`` is raised after killing it, so the caller restarts it.

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
        idle = False
        while not idle:
            try:
                msg = kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                if not self.is_alive():
                    res.seconds = time.monotonic() - t0
                    raise KernelDied(self._died_text(parts))
                now = time.monotonic()
                if deadline is not None and now > deadline and interrupted_at is None:
                    res.timed_out = True
                    interrupted_at = now
                    self.interrupt()
                elif interrupted_at is not None and now - interrupted_at > 3.0:
                    self.shutdown()
                    raise KernelDied("the cell ignored the interrupt after its timeout")
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
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
            # stay responsive to the timeout even while output streams in
            if (deadline is not None and interrupted_at is None
                    and time.monotonic() > deadline):
                res.timed_out = True
                interrupted_at = time.monotonic()
                self.interrupt()
        exprs: dict = {}
        try:
            reply = kc.get_shell_msg(timeout=5)
            while reply.get("parent_header", {}).get("msg_id") != msg_id:
                reply = kc.get_shell_msg(timeout=5)
            exprs = reply["content"].get("user_expressions") or {}
        except queue.Empty:
            pass
        res.output = "".join(parts)
        res.seconds = time.monotonic() - t0
        return res, exprs

    def evaluate(self, expression: str, timeout: float = 10.0):
        """Evaluate one Python expression in the kernel; returns its value via ``repr``.

        The expression's ``repr`` must be a Python literal (str, number, dict, ...).
        """
        _, exprs = self.execute("", timeout=timeout, user_expressions={"v": expression})
        return _expr_value(exprs.get("v"))

    def _died_text(self, parts: list[str]) -> str:
        tail = "".join(parts)[-500:]
        return "the kernel process died during the cell" + (f"; last output: {tail}" if tail else "")


def _expr_value(v: dict | None):
    if not v:
        return None
    if v.get("status") != "ok":
        raise RuntimeError(f"{v.get('ename')}: {v.get('evalue')}")
    return ast.literal_eval(v["data"]["text/plain"])


FINAL_EXPR = "__import__('json').dumps(__rlm_rt.take_final())"


def parse_final(exprs: dict) -> str | None:
    """The answer from a cell's ``FINAL_EXPR`` user expression, or None."""
    v = exprs.get("final")
    if not v or v.get("status") != "ok":
        return None
    got = json.loads(ast.literal_eval(v["data"]["text/plain"]))
    return None if got is None else got["answer"]


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
        """A started kernel that no RLM has used: from the pool if one is ready, else cold."""
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
        """Shut ``k`` down (kernels are never reused)."""
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
