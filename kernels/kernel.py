"""Kernel lifecycle: start, execute with a timeout, interrupt, restart, shut down.

A :class:`Kernel` is one ipykernel process, launched by :mod:`kernels.launch` (a Jupyter
connection file and the process, before ``jupyter_client`` is even imported) and driven
through ``jupyter_client``'s blocking client, with a scrubbed environment
(:func:`kernels.secrets.kernel_env`, an allow-list: no API keys or tokens of the host), its
own working directory, and IPC transport for its ZeroMQ channels. The kernel imports
:mod:`kernels.runtime` at start-up (:data:`kernels.protocol.BOOT_CODE`), so a kernel taken
from the :class:`KernelPool` needs only one short bind cell (:func:`kernels.protocol.bind_code`)
to serve an RLM.

Each kernel runs under a supervisor (:mod:`kernels.sandbox`, :mod:`kernels.supervisor`):
every process a cell starts, even one that left the kernel's session or process group, is
killed when the kernel shuts down, dies, or its host dies (even by SIGKILL), so nothing a
kernel starts outlives it. When the host runs as root the kernel runs as an unprivileged
user (one of its own, :mod:`kernels.identity`; or ``RLM_KERNEL_USER``). The kernel's own stdout and stderr (where
ipykernel prints its internal tracebacks) go to ``/dev/null``, never to the user's terminal
(``RLM_DEBUG=1`` keeps them); a cell's output reaches the host through Jupyter messages.

Text: cell output and errors are cleaned by the text policy of :mod:`harness.text` (a lone
surrogate becomes U+FFFD), in the kernel and again on the host.
"""
from __future__ import annotations

import functools
import os
import queue
import secrets
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable

from harness.text import clean_text
from kernels import sandbox
from kernels.bwrap import (CTX_DIR, SANDBOX_HOME, SANDBOX_SOCKETS, SandboxSpec, box_bundle,
                           box_file, bwrap_argv, resolve_mode)
from kernels.chance import chance_env
from kernels.gate import StartGate
from kernels.limits import ERRFILE, KernelLimits
from kernels.launch import Launched, connection_info, launch, lifeline_fd
from kernels.outputs import CellOutput, take_message
from kernels.protocol import BOOT_CODE
from kernels.process import (end_kernel, kill_kernel, process_of, reap, remove_tree,
                             stop_kernel, sweep_stale_kernel_dirs, wait_exit, wait_for_ready)
from kernels.secrets import kernel_env


#: The process-wide gate every kernel start passes (see :class:`StartGate`).
START_GATE = StartGate()


@dataclass
class CellResult:
    """What one executed cell produced.

    Attributes:
        output: stdout, stderr, what the cell displayed and the error traceback, in order, as
            text (str, untruncated; see :mod:`kernels.outputs`).
        error: the exception as ``"Name: value"`` if the cell raised, else None.
        timed_out: the cell ran past its timeout and was interrupted.
        interrupted: the cell was interrupted because ``stop`` was set (the run cancelled or
            interrupted from outside), not by its timeout.
        died: the kernel process died during the cell (it has been restarted).
        final: the answer set by ``FINAL``/``FINAL_VAR`` in this cell, if any.
        seconds: wall time of the execution (s).
    """

    output: str = ""
    error: str | None = None
    timed_out: bool = False
    interrupted: bool = False
    died: bool = False
    final: str | None = None
    seconds: float = 0.0


class KernelDied(Exception):
    """The kernel process is gone (or was killed because it ignored an interrupt)."""


class Kernel:
    """One ipykernel process driven through a blocking ``jupyter_client`` client.

    Constructing one starts nothing; :meth:`start` does.

    Args:
        workdir: the kernel's working directory (created if missing); when None, a fresh
            temporary directory made when the kernel launches and removed at shutdown.
        start_timeout: seconds :meth:`start` waits for the kernel to answer.
        sandbox: how it is sandboxed (:class:`kernels.bwrap.SandboxSpec`; default: the
            ``$RLM_SANDBOX`` mode, else ``auto``, with the default limits).

    Attributes:
        sandbox_mode: ``"bwrap"`` or ``"none"`` once launched (``""`` before).
        limits_mode: in a sandbox, ``"cgroup"`` (bounded as a whole, :mod:`kernels.cgroups`) or
            ``"rlimit"`` (per process, the stand-in); ``""`` otherwise.

    Raises:
        OSError: ``workdir`` cannot be created.
    """

    def __init__(self, workdir: str | None = None, start_timeout: float = 30.0,
                 sandbox: SandboxSpec | None = None) -> None:
        self._own_dir = workdir is None
        #: the working directory ("" until a kernel of our own is launched: a kernel that
        #: waits for a start place, or is shut down before it launches, has none to leave)
        self.workdir = workdir or ""
        if workdir:
            os.makedirs(workdir, exist_ok=True)
        self.start_timeout = start_timeout
        self.km: Launched | None = None
        self.kc = None
        #: the user the kernel runs as (None: the host's own); see kernels.sandbox
        self.identity: sandbox.Identity | None = None
        #: the tag in the environment of the kernel and every process it starts
        self.tag = ""
        self.spec = sandbox or SandboxSpec()
        self.sandbox_mode = ""
        #: how a sandboxed kernel is bounded: "cgroup" (as a whole) or "rlimit" (per process)
        self.limits_mode = ""
        self._lock = threading.Lock()
        self._closed = False
        self._launched: Launched | None = None  # the process is up, not yet answering
        self._launch_lock = threading.Lock()
        self._cell_thread: int | None = None  # the thread inside execute(), if any
        self._deferred: Callable[[], None] | None = None  # its ZeroMQ teardown, left to it

    # lifecycle -----------------------------------------------------------
    def start(self) -> "Kernel":
        """Start the kernel process and wait until it answers (about 0.6 s cold here).

        The start holds a place in :data:`START_GATE` (waiting for one first when as many
        kernels as the machine has cores are starting). Returns ``self``.

        Raises:
            RuntimeError: the kernel did not answer within ``start_timeout`` s (it is
                killed; the message says why when the supervisor knows), or
                :meth:`shutdown` was called while it was starting.
            kernels.sandbox.KernelUserError: ``RLM_KERNEL_USER`` is unusable.
        """
        with START_GATE:
            return self._ready(self._launch())

    def _launch(self) -> Launched:
        """Launch the kernel's process (the caller holds a place in the gate), without importing
        ``jupyter_client`` (:mod:`kernels.launch`); returns it. Raises RuntimeError when shut
        down before, KernelUserError as :meth:`start`, OSError when it could not start."""
        with self._launch_lock:
            if self._closed:  # shut down while it waited for its place
                raise RuntimeError("kernel was shut down while starting")
            if not self.workdir:
                sweep_stale_kernel_dirs()
                # the host's pid in the name: a sandboxed kernel cannot remove its own directory
                # (a mount point in its sandbox), so the next host sweeps those of dead hosts
                self.workdir = tempfile.mkdtemp(prefix=f"rlm-k-{os.getpid()}-")
        # a user of its own on a root host (kernels.identity), held until its processes end
        self.identity, held = sandbox.kernel_user(sandbox.kernel_identity())
        self.sandbox_mode = resolve_mode(self.spec)
        self.tag = secrets.token_hex(8)
        limits = None
        try:
            if self.sandbox_mode == "bwrap":  # its whole-kernel limits, its start-error file
                limits = KernelLimits(self.spec, self.tag, self.workdir)
                self.limits_mode = limits.mode
            km = self._spawn(limits)
        except BaseException as exc:
            for thing in (limits, held):
                if thing is not None:
                    thing.close()
            if self._closed:  # shut down meanwhile: what was made again of its directory goes
                if self._own_dir:
                    remove_tree(self.workdir)
                if isinstance(exc, (OSError, RuntimeError)):
                    raise RuntimeError("kernel was shut down while starting") from None
            raise
        if held is not None:
            km.leases.append(held)
        return km

    def _spawn(self, limits: KernelLimits | None) -> Launched:
        conn = os.path.join(self.workdir, "kernel.json")
        argv = self._argv(conn, limits)
        gid = self.identity.gid if limits is not None and self.identity is not None else None
        if gid is not None:  # the kernel's user reads its directory through its group only
            os.chown(self.workdir, -1, gid)
            os.chmod(self.workdir, 0o750)
        with self._launch_lock:  # a shutdown() now waits for the launch, then ends it
            if self._closed:
                # a shutdown() since the first check removed the directory, which _argv may
                # have made again (the sandbox's context directory): it is this start's to remove
                if self._own_dir:
                    remove_tree(self.workdir)
                raise RuntimeError("kernel was shut down while starting")
            # in the sandbox the kernel's sockets are in its own /tmp (its working directory
            # here is read-only to it): the host reaches them through its root
            km = launch(argv, connection_file=conn,
                        info=connection_info(SANDBOX_SOCKETS if limits is not None
                                             else os.path.join(self.workdir, ".k")),
                        env=kernel_env({sandbox.TAG_VAR: self.tag,
                                        **chance_env(self.spec.seed)}), cwd=self.workdir,
                        quiet=not os.environ.get("RLM_DEBUG"), sandboxed=limits is not None,
                        pass_fds=limits.fds() if limits is not None else (), group=gid)
            if limits is not None:
                limits.started()
                km.limits = limits
            self._launched = km  # from now on shutdown() ends the process at once
        return km

    def _argv(self, connection_file: str, limits: KernelLimits | None) -> list[str]:
        """The kernel's command line: ipykernel under the supervisor, in the sandbox when
        :attr:`sandbox_mode` is ``"bwrap"`` (its read-only ``ctx`` directory made first)."""
        argv = [sys.executable, "-m", "kernels.ipykernel_main", "-f", connection_file,
                f"--IPKernelApp.exec_lines={BOOT_CODE}", "--HistoryManager.enabled=False",
                "--IPKernelApp.log_level=CRITICAL"]
        if not sandbox.supervisor_available():
            return argv
        boxed = self.sandbox_mode == "bwrap"
        argv = sandbox.supervised_argv(argv, workdir=self.workdir, connection_file=connection_file,
                                       ident=self.identity, own_dir=self._own_dir,
                                       limits=self.spec.rlimits() if boxed else None,
                                       home=SANDBOX_HOME if boxed else None,
                                       lifeline=lifeline_fd() if boxed else None,
                                       fds=limits and (limits.cgroup_fds, limits.errfd))
        if not boxed:
            return argv
        os.makedirs(os.path.join(self.workdir, CTX_DIR), exist_ok=True)
        return bwrap_argv(argv, workdir=self.workdir, spec=self.spec,
                          seccomp_fd=limits.seccomp_fd if limits is not None else None)

    def _ready(self, km: Launched) -> "Kernel":
        """Wait until the launched kernel answers; returns ``self``. Raises as :meth:`start`."""
        try:
            kc = km.blocking_client()
        except RuntimeError as exc:  # its processes ended before it could be reached
            stop_kernel(km, self.tag)
            if self._closed:
                raise RuntimeError("kernel was shut down while starting") from None
            raise RuntimeError(self._start_failure("died" in str(exc))) from None
        kc.start_channels()
        try:
            wait_for_ready(km, kc, self.start_timeout)
        except RuntimeError as exc:
            kc.stop_channels()
            stop_kernel(km, self.tag)
            if self._closed:
                raise RuntimeError("kernel was shut down while starting") from None
            raise RuntimeError(self._start_failure("died" in str(exc))) from None
        with self._lock:
            closed = self._closed
            if not closed:
                self.km, self.kc = km, kc
        if closed:  # shut down while starting (e.g. the pool closed): do not leak it
            kc.stop_channels()
            stop_kernel(km, self.tag)
            if self._own_dir:
                remove_tree(self.workdir)
            raise RuntimeError("kernel was shut down while starting")
        return self

    def _start_failure(self, died: bool) -> str:
        """Why the kernel did not start, for the user: it exited, or it did not answer in time;
        the supervisor's reason when it knows one; and, for a sandboxed kernel whose address
        space was set below the default, that cap, the likeliest cause (a Python kernel maps
        several hundred MiB as it starts; what it needs depends on the machine)."""
        what = ("the Jupyter kernel exited while starting" if died else
                f"the Jupyter kernel did not start within {self.start_timeout:g} s")
        why = self._start_error()
        if why:
            what += f": {why}"
        if self.sandbox_mode == "bwrap" and self.spec.memory_mb < SandboxSpec().memory_mb:
            what += (f" (a sandboxed kernel gets {self.spec.memory_mb} MiB of address space, "
                     f"--kernel-memory; if that is too small for it here, raise it: the "
                     f"default is {SandboxSpec().memory_mb})")
        return what

    def _start_error(self) -> str:
        try:
            with open(os.path.join(self.workdir, ERRFILE), encoding="utf-8",
                      errors="replace") as f:
                return f.read().strip()
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        """Process id of the kernel's top process (int; its supervisor on Linux); 0 if not started.

        The bridge accepts requests from this process and its descendants.
        """
        proc = process_of(self.km)
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
        if self.sandbox_mode == "bwrap":
            return self._box(path, fmt, move)
        if fmt == "bundle":
            return sandbox.share_bundle(path, self.workdir, self.identity)
        return sandbox.share_file(path, self.workdir, self.identity, move=move)

    def _box(self, path: str, fmt: str, move: bool) -> str:
        """:meth:`share_file` for a sandboxed kernel: the content in its read-only ``ctx``
        directory, linked where it may be (:func:`kernels.bwrap.box_file`), a private copy for
        a kernel running as another user where that user may not read it."""
        ctx = os.path.join(self.workdir, CTX_DIR)
        ident = self.identity

        def share(src: str) -> str:
            if ident is None or sandbox.readable_by(src, ident):
                return box_file(src, ctx)
            return sandbox.share_file(src, ctx, ident)
        if fmt == "bundle":
            dest = box_bundle(path, ctx, share)
            if ident is not None:
                sandbox.give(dest, ident)
            return dest
        if move:
            dest = box_file(path, ctx, move=True)
            if ident is not None:
                sandbox.give(dest, ident)
            return dest
        return share(path)

    def share_socket(self, path: str) -> str:
        """A path to the Unix socket ``path`` (the bridge's) that this kernel can connect to:
        ``path`` itself, or a hard link in its working directory when it is sandboxed (its
        ``/tmp`` is its own). Raises OSError when the link cannot be made."""
        if self.sandbox_mode != "bwrap":
            return path
        dest = os.path.join(self.workdir, "bridge.sock")
        try:
            os.unlink(dest)
        except FileNotFoundError:
            pass
        os.link(path, dest)
        return dest

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
        """Kill the kernel at once (SIGKILL) and clean up its files. Idempotent.

        A kernel still starting is killed at once, without waiting for it to answer (its
        :meth:`start`, on another thread, then raises); one not launched yet never is. When
        this returns, no process of this kernel is left.

        Called while another thread is inside :meth:`execute` (a run interrupted while its
        loops still run cells), it ends the processes only; that thread sees the kernel dead
        (:class:`KernelDied`) and closes the channels and ZeroMQ resources itself on its way
        out: closing a socket under a thread that polls it is not safe in ZeroMQ.
        """
        if self._defer_to_cell():
            return
        with self._lock:
            self._closed = True
            km, kc = self.km, self.kc
            self.km = self.kc = None
        if km is None:
            with self._launch_lock:
                launched, self._launched = self._launched, None
            if launched is not None:
                # end its processes only: the thread in start() is using its client's ZeroMQ
                # context (it waits for the kernel) and tears it down itself once the kernel
                # is gone; destroying it from here aborted the interpreter in zmq
                kill_kernel(launched, self.tag, direct=True)
                if self._own_dir:
                    remove_tree(self.workdir)
                return
        end_kernel(km, kc, self.tag, self.workdir if self._own_dir else "")

    def _defer_to_cell(self) -> bool:
        """When another thread is in :meth:`execute`: hand it the ZeroMQ part of the shutdown,
        end the processes here (waiting for them) and return True; else False."""
        me = threading.get_ident()
        with self._lock:
            if self._cell_thread in (None, me) or self.km is None:
                return False
            km, kc = self.km, self.kc
            self._closed = True
            self.km = self.kc = None  # the cell's thread sees it dead at its next poll
            self._deferred = functools.partial(end_kernel, km, kc, self.tag,
                                               self.workdir if self._own_dir else "")
        kill_kernel(km, self.tag, direct=True)
        if self._own_dir:  # no ZeroMQ in it: done here, not left to a thread the exit may cut
            remove_tree(self.workdir)
        return True

    def begin_shutdown(self) -> "Callable[[], None] | None":
        """The first half of :meth:`shutdown`, for a caller that need not wait for the kernel's
        processes to be gone (a child RLM returning its answer): returns a function that does
        the rest, or None when everything is done already. Never raises.

        On this thread: the client's channels and ZeroMQ context are closed, the supervisor is
        sent SIGTERM, and the connection files are removed (everything that touches ZeroMQ, so
        nothing of it runs on another thread). The returned function only
        waits for the supervisor to exit (about 10 ms: it kills the kernel and its
        descendants), kills the process group, reaps the supervisor and removes the working
        directory: it may run on any thread, and must run (no process is left once it
        returns). Without a supervisor, or for a kernel not ready, this is :meth:`shutdown`
        and returns None.
        """
        if self._defer_to_cell():
            return None
        with self._lock:
            km, kc = self.km, self.kc
            proc = process_of(km)
            split = (km is not None and proc is not None and sandbox.supervisor_available()
                     and proc.poll() is None)
            if split:
                self._closed = True
                self.km = self.kc = None
        if not split:
            self.shutdown()
            return None
        try:
            kc.stop_channels()
        except Exception:
            pass
        try:
            os.kill(km.stop_pid(), signal.SIGTERM)  # not reaped before the group is killed
        except OSError:
            pass
        try:
            km.cleanup_resources()
        except Exception:
            pass
        tag, workdir, own = self.tag, self.workdir, self._own_dir

        def finish() -> None:
            try:
                exited = wait_exit(proc.pid, 10.0)
            except (OSError, ChildProcessError):
                exited = True
            if not exited:  # it did not end within 10 s
                try:
                    proc.kill()
                except OSError:
                    pass
            reap(proc)
            km.release()
            if exited and proc.returncode is not None and proc.returncode < 0 and tag:
                sandbox.kill_tagged(tag)  # killed from outside before it could clean up
            if own:
                remove_tree(workdir)
        return finish

    # execution -----------------------------------------------------------
    def execute(self, code: str, timeout: float | None = None,
                user_expressions: dict | None = None, *, stop=None, grace: float = 3.0,
                on_interrupt=None, extend=None) -> tuple[CellResult, dict]:
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
            extend: a callable returning seconds (float) the timeout is pushed back by: the
                time the cell spent waiting on the host (its sub-calls, which have caps of
                their own), so ``timeout`` bounds the cell's own work.

        On timeout (or ``stop``) the kernel is interrupted; if the cell does not settle within
        ``grace`` seconds (it ignores SIGINT, spins in C code, or keeps printing), ``KernelDied``
        is raised after killing it, so the caller restarts it.

        Raises:
            KernelDied: the process died during the cell (or could not be interrupted).
        """
        with self._lock:
            kc = self.kc
            if kc is None:
                raise KernelDied("kernel is not running")
            self._cell_thread = threading.get_ident()
        try:
            return self._execute(kc, code, timeout, user_expressions, stop, grace, on_interrupt,
                                 extend)
        finally:
            with self._lock:
                self._cell_thread = None
                teardown, self._deferred = self._deferred, None
            if teardown is not None:  # shut down from another thread during the cell
                teardown()

    def _execute(self, kc, code: str, timeout: float | None, user_expressions: dict | None,
                 stop, grace: float, on_interrupt, extend=None) -> tuple[CellResult, dict]:
        t0 = time.monotonic()
        msg_id = kc.execute(code, silent=False, store_history=False,
                            user_expressions=user_expressions or {}, allow_stdin=False)
        out = CellOutput()
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
                late = deadline is not None and now > deadline + (extend() if extend else 0.0)
                if stopped or late:
                    if stopped:
                        res.interrupted = True
                    else:
                        res.timed_out = True
                    interrupted_at = now
                    wait = min(grace, 1.0) if stopped else grace
                    self.interrupt()
                    if on_interrupt is not None:
                        on_interrupt()
            elif now - interrupted_at > wait:
                self.shutdown()
                raise KernelDied("the cell ignored the interrupt" + (
                    " after its timeout" if res.timed_out else ""))

        while not idle:
            try:
                msg = kc.get_iopub_msg(timeout=0.2)
            except (ValueError, KeyError, TypeError):
                watch()
                continue  # a malformed message (a cell wrote to the socket): skip it
            except queue.Empty:
                if not self.is_alive():
                    res.seconds = time.monotonic() - t0
                    raise KernelDied(self._died_text(out))
                watch()
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                watch()  # e.g. a thread of an earlier cell printing without pause
                continue
            idle = take_message(msg["msg_type"], msg["content"], out, res)
            if not idle:  # stay responsive to the timeout (and the kill) while output streams
                watch()
        exprs = _shell_reply(kc, msg_id, out, res)
        km = self.km
        if km is not None and km.limits is not None:  # a process killed for memory: say so
            out.add(km.limits.note())
        res.output = clean_text(out.text())
        if res.error is not None:
            res.error = clean_text(res.error)
        res.seconds = time.monotonic() - t0
        return res, exprs

    def _died_text(self, out: CellOutput) -> str:
        tail = out.tail(500)
        km = self.km
        why = km.limits.verdict() if km is not None and km.limits is not None else ""
        return ("the kernel process died during the cell" + (f": {why}" if why else "")
                + (f"; last output: {tail}" if tail else ""))


def _shell_reply(kc, msg_id: str, out: CellOutput, res: CellResult) -> dict:
    """The cell's execute reply: its ``user_expressions`` ({} when the reply does not come in
    5 s). A failed cell whose error message never came (a cell can break the kernel's error
    display) is reported from the reply."""
    try:
        reply = kc.get_shell_msg(timeout=5)
        while reply.get("parent_header", {}).get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=5)
    except queue.Empty:
        return {}
    content = reply["content"]
    if content.get("status") == "error" and res.error is None:
        res.error = f"{content.get('ename')}: {content.get('evalue')}"
        out.add(res.error + "\n")
    return content.get("user_expressions") or {}
