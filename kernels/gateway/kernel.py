"""A kernel on a Jupyter gateway, with the local :class:`kernels.kernel.Kernel`'s interface.

:class:`GatewayKernel` starts a kernel of the project's kernelspec through the gateway's REST
API, runs cells over the kernel's WebSocket channels (``execute_request`` with
``allow_stdin=True``), and answers the bridge frames the kernel's courier sends on the stdin
channel (:mod:`kernels.gateway.serve`) while a cell runs. A cell's result has the same shape
(:class:`kernels.kernel.CellResult`) and the same timeout, interrupt, kill and death rules as a
local kernel's.

Faults: a gateway that cannot be reached, or refuses the token, at start raises
:class:`kernels.gateway.client.GatewayError` (a RuntimeError, as a local start failure); a
WebSocket that drops is reopened with the same session id, so the gateway replays what the
kernel sent meanwhile, and a reply that could not be sent is sent again (frame ids make a
replayed request harmless); a kernel the gateway no longer has (culled, ended, or the gateway
itself gone) raises :class:`kernels.kernel.KernelDied` from the cell.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid

from harness.text import clean_text
from kernels.gateway import DEFAULT_KERNELSPEC
from kernels.gateway.client import (WS_V1, GatewayClient, GatewayError, decode_v1, encode_v1,
                                     message)
from kernels.gateway.courier import BATCH_BYTES, HOLD_SECONDS, MARK
from kernels.gateway.fetch import ref
from kernels.gateway.serve import GATEWAY_PID, FrameServer, answer_value
from kernels.kernel import CellResult, KernelDied
from kernels.outputs import CellOutput, take_message

#: Seconds a dropped WebSocket is retried before the kernel counts as gone.
RECONNECT_SECONDS = 10.0
#: Seconds of silence on a running cell's channels after which the gateway is asked whether
#: the kernel is still there.
PROBE_SECONDS = 2.0


class _Dropped(Exception):
    """The WebSocket closed under a read or a send."""


class GatewayKernel:
    """One kernel on a Jupyter gateway. Constructing one starts nothing; :meth:`start` does.

    Args:
        client: the gateway (:class:`kernels.gateway.client.GatewayClient`).
        kernelspec: the kernelspec's name on the gateway host.
        start_timeout: seconds :meth:`start` waits for the kernel to answer.
        spec: the run's sandbox spec, kept for the pool's bookkeeping (the gateway host's
            kernelspec decides the sandbox).

    Attributes:
        kernel_id: the gateway's id of the kernel ("" before :meth:`start`).
        sandbox_mode: ``"gateway"``. frames: the :class:`FrameServer` answering its calls.
    """

    sandbox_mode = "gateway"
    #: how its limits are enforced: the gateway host's kernelspec decides, not this host
    limits_mode = ""

    def __init__(self, client: GatewayClient, kernelspec: str = DEFAULT_KERNELSPEC,
                 start_timeout: float = 60.0, spec=None) -> None:
        self.client, self.kernelspec = client, kernelspec
        self.start_timeout = start_timeout
        self.spec = spec
        self.kernel_id = ""
        self.workdir = ""
        self.session = uuid.uuid4().hex
        self.frames = FrameServer()
        self._ws = None
        self._lock = threading.Lock()
        self._closed = False
        self._dead = False
        self._owned: list[str] = []  # the host's temporary context files, removed at the end
        self._last_input: dict | None = None  # the header of the last input_request seen
        #: WebSocket reconnections so far (int)
        self.reconnects = 0

    @property
    def pid(self) -> int:
        """:data:`kernels.gateway.serve.GATEWAY_PID`: the bridge registration of a gateway
        kernel names no local process."""
        return GATEWAY_PID

    # lifecycle -----------------------------------------------------------
    def start(self) -> "GatewayKernel":
        """Start the kernel on the gateway and wait until it answers; returns ``self``.

        Raises:
            GatewayError: the gateway is unreachable, refused the token, or could not start it.
            RuntimeError: it did not answer within ``start_timeout`` s, or :meth:`shutdown` was
                called meanwhile.
        """
        kid = self.client.start_kernel(self.kernelspec, timeout=self.start_timeout)
        with self._lock:
            self.kernel_id = kid
            closed = self._closed
        if closed:
            self.client.delete(kid)
            raise RuntimeError("kernel was shut down while starting")
        try:
            self._ws = self.client.channels(kid, self.session)
            self._wait_ready(time.monotonic() + self.start_timeout)
        except BaseException:
            self.shutdown()
            raise
        return self

    def _wait_ready(self, deadline: float) -> None:
        """Ask for ``kernel_info`` until the kernel answers. Raises RuntimeError at ``deadline``."""
        asked = 0.0
        while time.monotonic() < deadline:
            if time.monotonic() - asked > 1.0:
                req = message("kernel_info_request", {}, self.session, "shell")
                self._send(req)
                asked, want = time.monotonic(), req["header"]["msg_id"]
            m = self._recv(0.1)
            if (m and m.get("channel") == "shell"
                    and m.get("parent_header", {}).get("msg_id") == want):
                return
            if self._closed:
                break
        raise RuntimeError(f"the kernel on the Jupyter gateway at {self.client.url} did not "
                           f"answer within {self.start_timeout:g} s")

    def is_alive(self) -> bool:
        """True once started, until it is shut down or seen dead. Never raises; no request."""
        return bool(self.kernel_id) and not self._closed and not self._dead

    def interrupt(self) -> None:
        """Interrupt the running cell (the gateway signals the kernel). Never raises."""
        if self.kernel_id:
            try:
                self.client.interrupt(self.kernel_id)
            except GatewayError:
                pass

    def restart(self) -> None:
        """Restart the kernel's process on the gateway (same id; everything bound is lost).
        Raises GatewayError."""
        self.client.restart(self.kernel_id, timeout=self.start_timeout)
        self.frames.reset()
        self._dead = False

    def shutdown(self) -> None:
        """End the kernel on the gateway and close its channels. Idempotent; never raises."""
        finish = self.begin_shutdown()
        if finish is not None:
            finish()

    def begin_shutdown(self):
        """Close the channels now; returns a function that ends the kernel on the gateway and
        removes the host's temporary files (it may run on any thread), or None when there is
        nothing left to do. Never raises."""
        with self._lock:
            if self._closed and not self.kernel_id:
                return None
            self._closed = True
            kid, self.kernel_id = self.kernel_id, ""
            ws, self._ws = self._ws, None
            owned, self._owned = self._owned, []
        if ws is not None:
            try:
                ws.close(timeout=0.2)
            except Exception:  # noqa: BLE001 - closing a broken socket
                pass

        def finish() -> None:
            if kid:
                self.client.delete(kid)
            for p in owned:
                try:
                    os.unlink(p)
                except OSError:
                    pass
        return finish

    # contexts and the bridge ---------------------------------------------
    def share_file(self, path: str, fmt: str = "text", move: bool = False) -> str:
        """A reference to ``path``'s content that the kernel pulls over the bridge
        (:func:`kernels.gateway.fetch.ref`); the host keeps the file until the kernel ends
        (``move``: it is the host's temporary file, removed then).

        For a ``"bundle"`` (a many-file context's manifest, :mod:`kernels.bundle`), each
        entry's bytes are shared by their sha256 and the reference names a manifest of those
        references (:meth:`_share_bundle`), which the kernel assembles in its private ``/tmp``
        (:func:`kernels.gateway.fetch.resolve_context`).

        Raises:
            OSError: ``path`` (or a file a manifest names) cannot be read, or a file is
                shorter than its entry says.
        """
        if fmt == "bundle":
            return self._share_bundle(path)
        sha, size = _digest(path)
        self.frames.share(sha, path)
        if move:
            with self._lock:
                self._owned.append(path)
        return ref(sha, size)

    def _share_bundle(self, manifest: str) -> str:
        """The reference to a manifest of content-addressed pieces (see :meth:`share_file`);
        the manifest is the host's temporary file, removed when the kernel ends."""
        import tempfile
        with open(manifest, "rb") as f:
            doc = json.loads(f.read())
        entries = []
        for key, src, offset, length, kind in doc["entries"]:
            sha = _digest(src, offset, length)[0]
            self.frames.share(sha, src, offset, length)
            entries.append([key, ref(sha, length), 0, length, kind])
        fd, remote = tempfile.mkstemp(prefix="rlm-gw-manifest-", suffix=".json")
        with os.fdopen(fd, "w", encoding="ascii") as f:
            json.dump({"version": 1, "entries": entries}, f)
        return self.share_file(remote, move=True)

    def share_socket(self, path: str) -> str:
        """The bridge address a gateway kernel uses: its stdin channel (``"stdin:"``)."""
        return "stdin:"

    def bind_cell(self, bridge, token: str, context_path: str | None, fmt: str,
                  size: int | None = None, checked: bool = False,
                  tools: list | None = None) -> str:
        """The bind cell for this kernel (as :func:`kernels.protocol.bind_code`), its frames
        served through ``bridge`` for ``token``'s registration from now on."""
        self.frames.attach(bridge, token)
        return ("__import__('kernels.gateway.remote', fromlist=['bind']).bind("
                f"{token!r}, {context_path!r}, {fmt!r}, {None if size is None else int(size)!r}"
                + (", checked=True" if checked else "")
                + (f", tools={list(tools)!r})" if tools else ")"))

    # the WebSocket ---------------------------------------------------------
    def _send(self, msg: dict) -> None:
        """Send one message, reopening the channels once if they dropped. Raises KernelDied."""
        import websocket
        for attempt in (0, 1):
            try:
                ws = self._ws
                if ws is None:
                    raise _Dropped()
                _put(ws, msg)
                return
            except (_Dropped, OSError, websocket.WebSocketException):
                if attempt:
                    raise KernelDied("the kernel's channels on the gateway closed") from None
                self._reconnect()  # raises KernelDied when the kernel or its gateway is gone

    def _recv(self, timeout: float) -> dict | None:
        """The next message (dict), or None after ``timeout`` s (or a reconnection)."""
        import websocket
        ws = self._ws
        if ws is None:
            if self._closed:
                raise KernelDied("kernel is not running")
            self._reconnect()
            return None
        try:
            ws.settimeout(timeout)
            raw = ws.recv()
        except websocket.WebSocketTimeoutException:
            return None
        except (websocket.WebSocketException, OSError, AttributeError):
            self._reconnect()
            return None
        if isinstance(raw, bytes):
            return decode_v1(raw)
        try:
            return json.loads(raw) if isinstance(raw, str) and raw else None
        except ValueError:
            return None

    def _reconnect(self) -> None:
        """Reopen the channels with the same session. Raises KernelDied when the kernel is shut
        down, the gateway no longer has it, or the gateway stays unreachable
        :data:`RECONNECT_SECONDS`."""
        deadline = time.monotonic() + RECONNECT_SECONDS
        while not self._closed:
            kid = self.kernel_id
            state = self.client.kernel_state(kid)  # quick: opening channels of a gone kernel
            if state == "absent":                 # makes the gateway wait 10 s
                self._dead = True
                raise KernelDied("the Jupyter gateway no longer has this kernel (culled, or "
                                 "ended by the gateway)")
            try:
                if state != "present":
                    raise GatewayError("it does not answer")
                ws = self.client.channels(kid, self.session)
            except GatewayError as exc:
                if time.monotonic() > deadline:
                    self._dead = True
                    raise KernelDied(f"lost the Jupyter gateway at {self.client.url}: "
                                     f"{exc}") from None
                time.sleep(0.2)
                continue
            with self._lock:
                if self._closed:
                    break
                self._ws = ws
                self.reconnects += 1
            self._nudge()
            return
        raise KernelDied("kernel is not running")

    def _nudge(self) -> None:
        """After a reconnection: one unsolicited ``input_reply`` (``"nudge"``) with the replies
        ready, which releases a courier whose request the drop lost (it then sends its
        unanswered frames again); one that is not waiting drops it. Never raises."""
        value = answer_value(self.frames.replies(0.0), nudge=True)
        msg = message("input_reply", {"status": "ok", "value": value}, self.session, "stdin",
                      parent=self._last_input)
        try:
            _put(self._ws, msg)
        except Exception:  # noqa: BLE001 - dropped again: the next reconnection nudges
            pass

    # execution -----------------------------------------------------------
    def execute(self, code: str, timeout: float | None = None,
                user_expressions: dict | None = None, *, stop=None, grace: float = 3.0,
                on_interrupt=None, extend=None) -> tuple[CellResult, dict]:
        """Run ``code``; as :meth:`kernels.kernel.Kernel.execute` (same arguments, result and
        errors), with the kernel's bridge frames answered while it runs.

        Raises:
            KernelDied: the kernel died, was culled, or the gateway is gone.
        """
        if not self.is_alive():
            raise KernelDied("kernel is not running")
        t0 = time.monotonic()
        req = message("execute_request", {
            "code": code, "silent": False, "store_history": False,
            "user_expressions": user_expressions or {}, "allow_stdin": True,
            "stop_on_error": True}, self.session, "shell")
        msg_id = req["header"]["msg_id"]
        self._send(req)
        out, res = CellOutput(), CellResult()
        watch = _Watch(self, res, timeout, stop, grace, on_interrupt, extend, t0)
        idle = replied = False
        exprs: dict = {}
        probe = _Probe(self)
        while not (idle and replied):
            m = self._recv(0.2)
            if m is None:
                probe()
                self._check_died(out)
                watch()
                continue
            probe.heard()
            kind = m.get("header", {}).get("msg_type") or m.get("msg_type")
            if m.get("channel") == "stdin" and kind == "input_request":
                self._answer_input(m)
                watch()  # a cell making sub-calls back to back still meets its timeout
                continue
            if kind == "status" and m.get("content", {}).get("execution_state") in (
                    "dead", "restarting"):
                self._dead = True
                self._check_died(out)
            if m.get("parent_header", {}).get("msg_id") != msg_id:
                watch()
                continue
            if m.get("channel") == "iopub":
                idle = take_message(kind, m.get("content") or {}, out, res) or idle
            elif m.get("channel") == "shell" and kind == "execute_reply":
                replied = True
                exprs = self._reply(m.get("content") or {}, out, res)
            watch()
        res.output = clean_text(out.text())
        if res.error is not None:
            res.error = clean_text(res.error)
        res.seconds = time.monotonic() - t0
        return res, exprs

    def _check_died(self, out: CellOutput) -> None:
        if self._dead or self._closed:
            tail = out.tail(500)
            raise KernelDied("the kernel on the gateway died during the cell"
                             + (f"; last output: {tail}" if tail else ""))

    @staticmethod
    def _reply(content: dict, out: CellOutput, res: CellResult) -> dict:
        if content.get("status") == "error" and res.error is None:
            res.error = f"{content.get('ename')}: {content.get('evalue')}"
            out.add(res.error + "\n")
        return content.get("user_expressions") or {}

    def _oversized(self, prompt: str) -> str:
        """Why an ``input_request`` is refused unread (its size past one frame at the bridge's
        cap, or a courier's batch), or ""."""
        bridge = self.frames.bridge
        cap = max(getattr(getattr(bridge, "limits", None), "max_frame", 0), BATCH_BYTES)
        if len(prompt) <= cap + (1 << 20):
            return ""
        return (f"bridge refused the request: {len(prompt) >> 20} MiB in one message, over the "
                f"bridge's cap of {cap >> 20} MiB; send less at once")

    def _answer_input(self, m: dict) -> None:
        """Answer one ``input_request``: take its frames, send the replies that are ready."""
        prompt = (m.get("content") or {}).get("prompt") or ""
        replies: list = []
        refused = self._oversized(prompt)
        if not refused and prompt.startswith(MARK):
            try:
                got = json.loads(prompt[len(MARK):])
                frames, waiting = got.get("frames"), got.get("waiting")
            except (ValueError, AttributeError, RecursionError):
                frames, waiting = [], None
            self._last_input = m.get("header")
            self.frames.take(frames, waiting)
            replies = self.frames.replies(HOLD_SECONDS)
        value = (json.dumps({"replies": [], "refused": refused}) if refused
                 else answer_value(replies))
        reply = message("input_reply", {"status": "ok", "value": value}, self.session,
                        "stdin", parent=m.get("header"))
        try:
            self._send(reply)
        except KernelDied:
            self.frames.put_back(replies)
            raise


def _digest(path: str, offset: int = 0, length: int | None = None) -> tuple[str, int]:
    """``(sha256 hex, bytes)`` of the file at ``path``, or of its ``length`` bytes at
    ``offset``. Raises OSError when it cannot be read or holds fewer bytes."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left is None or left > 0:
            block = f.read(1 << 20 if left is None else min(1 << 20, left))
            if not block:
                break
            h.update(block)
            size += len(block)
            left = None if left is None else left - len(block)
    if length is not None and size != length:
        raise OSError(f"context file {path} changed since it was loaded ({size} of {length} "
                      f"bytes at offset {offset})")
    return h.hexdigest(), size


def _put(ws, msg: dict) -> None:
    """Send ``msg`` on ``ws`` in the framing its gateway agreed to (binary :data:`WS_V1`, or
    the JSON text of the older protocol). Raises what the WebSocket raises."""
    if ws.getsubprotocol() == WS_V1:
        ws.send_binary(encode_v1(msg))
    else:
        ws.send(json.dumps(msg))


class _Watch:
    """The cell's clock: interrupts it at its timeout (or ``stop``), kills it when the interrupt
    is ignored for ``grace`` s (as :meth:`kernels.kernel.Kernel.execute`)."""

    def __init__(self, kernel: GatewayKernel, res: CellResult, timeout, stop, grace,
                 on_interrupt, extend, t0: float) -> None:
        self.k, self.res, self.stop, self.grace = kernel, res, stop, grace
        self.on_interrupt, self.extend = on_interrupt, extend
        self.deadline = None if timeout is None else t0 + timeout
        self.at: float | None = None
        self.wait = grace

    def __call__(self) -> None:
        now = time.monotonic()
        if self.at is None:
            stopped = self.stop is not None and self.stop.is_set()
            late = self.deadline is not None and now > self.deadline + (
                self.extend() if self.extend else 0.0)
            if stopped or late:
                self.res.interrupted, self.res.timed_out = bool(stopped), not stopped
                self.at = now
                self.wait = min(self.grace, 1.0) if stopped else self.grace
                self.k.interrupt()
                if self.on_interrupt is not None:
                    self.on_interrupt()
        elif now - self.at > self.wait:
            self.k.shutdown()
            raise KernelDied("the cell ignored the interrupt" + (
                " after its timeout" if self.res.timed_out else ""))


class _Probe:
    """Asks the gateway whether the kernel is still there after :data:`PROBE_SECONDS` of
    silence on its channels: a kernel the gateway culled or ended may send nothing more, and
    a gateway that died may leave the socket open. Marks the kernel dead when the gateway
    answers without it, or has not answered for :data:`RECONNECT_SECONDS`."""

    def __init__(self, kernel: GatewayKernel) -> None:
        self.k = kernel
        self.last = self.asked = time.monotonic()
        self.unreachable_since: float | None = None

    def heard(self) -> None:
        self.last = time.monotonic()

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self.last < PROBE_SECONDS or now - self.asked < PROBE_SECONDS:
            return
        self.asked = now
        state = self.k.client.kernel_state(self.k.kernel_id)
        if state == "present":
            self.unreachable_since = None
            return
        if state == "unreachable":
            self.unreachable_since = self.unreachable_since or now
            if now - self.unreachable_since < RECONNECT_SECONDS:
                return
        self.k._dead = True
