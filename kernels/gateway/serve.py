"""The host's end of the stdin-channel bridge of one gateway kernel.

The kernel's courier (:mod:`kernels.gateway.courier`) sends bridge frames inside
``input_request`` messages; :class:`FrameServer` takes them, answers each on a thread of its own
(so a slow child RLM never holds back a quick ``llm_query`` sent beside it) and gives back, for
each ``input_reply``, every reply that is ready, waiting up to
:data:`kernels.gateway.courier.HOLD_SECONDS` when none is.

Authentication. A Unix-socket bridge checks a request's token *and* that the process on the
other end is the kernel the token was issued to. A gateway kernel has no local process to check;
instead a frame is taken only from this kernel's own channel (the WebSocket the host opened to
that kernel's id, with the gateway's token), and its token must be the one issued to this
kernel, compared in constant time. The registration's pid is :data:`GATEWAY_PID`, which no local
process has, so the token is refused on the host's Unix socket too. A token read out of another
gateway kernel is refused here (it is not this channel's). Each frame then goes through the same
dispatch as the Unix-socket bridge (:meth:`kernels.bridge.BridgeServer.dispatch`), so stages,
caps, the journal, replay and depth are the same.

Each frame has an id, unique for the life of a kernel process; an id seen before is never
dispatched again (a frame sent again after a WebSocket drop is not a second call), and a reply
is kept until the kernel's next request no longer lists its id as waiting, then dropped; while
it does, the reply is sent again (see :mod:`kernels.gateway.courier`).
"""
from __future__ import annotations

import base64
import hmac
import json
import queue
import threading
from typing import Any

from kernels.gateway.fetch import CONTEXT_OP
from kernels.protocol import ErrorKind, encode_error, reply_error, reply_ok

#: The pid a gateway kernel's bridge registration carries: no local process has it.
GATEWAY_PID = -1
#: Bytes of replies one ``input_reply`` carries at most (past the first reply): a gateway's
#: WebSocket server refuses messages past its own limit (tornado's default: 10 MiB).
MAX_REPLY_BYTES = 6 << 20

_REFUSED = "bridge refused the request: that token was not issued to this kernel"


class _Workers:
    """Threads that answer frames: one per frame at once (no frame waits for another, however
    long a child RLM takes), an idle one reused before a new one starts (a start costs about
    0.2 ms, a whole sub-call's budget here); one idle for :data:`IDLE_SECONDS` ends."""

    IDLE_SECONDS = 30.0

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def run(self, fn, *args) -> None:
        """Call ``fn(*args)`` on a worker thread now."""
        with self._lock:
            if self._idle:
                self._idle -= 1
                self._jobs.put((fn, args))
                return
        threading.Thread(target=self._work, args=((fn, args),), daemon=True,
                         name="rlm-gw-call").start()

    def _work(self, job) -> None:
        while True:
            fn, args = job
            fn(*args)
            with self._lock:
                self._idle += 1
            while True:
                try:
                    job = self._jobs.get(timeout=self.IDLE_SECONDS)
                    break
                except queue.Empty:
                    with self._lock:  # no job is being handed over while this is held
                        if self._jobs.empty():
                            self._idle -= 1
                            return


_WORKERS = _Workers()


class FrameServer:
    """Answers the bridge frames of one gateway kernel.

    Attributes:
        dispatched: frames handed to the bridge's dispatch so far (int).
    """

    def __init__(self) -> None:
        self._bridge: Any = None
        self._token = ""
        self._shares: dict[str, str] = {}
        self._pieces: dict[str, tuple[int, int]] = {}  # sha -> (offset, length) in its file
        self.served_bytes = 0  # context bytes sent to this kernel (a measure; tests read it)
        self._cv = threading.Condition()
        self._seen: set[int] = set()
        # replies as JSON text (made on the worker's thread, not the WebSocket reader's)
        self._ready: dict[int, str] = {}
        self._delivered: dict[int, str] = {}  # handed out, kept until no longer waited for
        self._running = 0
        self.dispatched = 0

    def attach(self, bridge: Any, token: str) -> None:
        """Serve this kernel's frames through ``bridge`` (a :class:`kernels.bridge.BridgeServer`)
        for the registration of ``token``."""
        with self._cv:
            self._bridge, self._token = bridge, token

    def share(self, sha256: str, path: str, offset: int = 0, length: int | None = None) -> None:
        """Let this kernel pull the file at ``path`` as context ``sha256``; or, given
        ``length``, the ``length`` bytes at ``offset`` of it (one piece of a many-file
        context)."""
        with self._cv:
            self._shares[sha256] = path
            if length is None:
                self._pieces.pop(sha256, None)
            else:
                self._pieces[sha256] = (int(offset), int(length))

    def reset(self) -> None:
        """The kernel process was restarted: its frame ids start again."""
        with self._cv:
            self._seen.clear()
            self._ready.clear()
            self._delivered.clear()

    @property
    def bridge(self) -> Any:
        """The :class:`kernels.bridge.BridgeServer` its frames go to (None before
        :meth:`attach`)."""
        return self._bridge

    @property
    def busy(self) -> bool:
        """Frames taken whose replies are not yet given back."""
        with self._cv:
            return bool(self._running or self._ready)

    def take(self, frames: list, waiting: list | None = None) -> None:
        """Start answering the frames of one ``input_request`` (``[{"id", "frame"}]``);
        ``waiting``: the ids the kernel still waits for (replies handed out for other ids are
        dropped, those for these ids are made ready again)."""
        if isinstance(waiting, list):
            want = {w for w in waiting if isinstance(w, int)}
            with self._cv:
                for k in list(self._delivered):
                    reply = self._delivered.pop(k)
                    if k in want:
                        self._ready.setdefault(k, reply)
        for item in frames if isinstance(frames, list) else []:
            fid = item.get("id") if isinstance(item, dict) else None
            if not isinstance(fid, int):
                continue
            with self._cv:
                if fid in self._seen:
                    continue
                self._seen.add(fid)
                self._running += 1
            _WORKERS.run(self._answer_one, fid, item.get("frame"))

    def _answer_one(self, fid: int, frame: Any) -> None:
        try:
            reply = self.answer(frame)
        except Exception as exc:  # noqa: BLE001 - the kernel hears of it
            reply = reply_error(encode_error(ErrorKind.SUBCALL_ERROR,
                                             f"{type(exc).__name__}: {exc}"))
        try:
            text = json.dumps(reply)
        except (TypeError, ValueError, RecursionError) as exc:  # a value JSON cannot carry
            text = json.dumps(reply_error(encode_error(ErrorKind.SUBCALL_ERROR,
                                                       f"{type(exc).__name__}: {exc}")))
        with self._cv:
            self._running -= 1
            self._ready[fid] = text
            self._cv.notify_all()

    def replies(self, hold: float) -> list:
        """The replies ready now (``[(id, JSON text)]``, up to :data:`MAX_REPLY_BYTES`), waiting
        up to ``hold`` s for one when none is ready but some frame is still being answered.
        Each is kept until the kernel no longer waits for it (see :meth:`take`)."""
        with self._cv:
            if not self._ready and self._running:
                self._cv.wait(hold)
            out, size = [], 0
            for k in list(self._ready):
                n = len(self._ready[k])
                if out and size + n > MAX_REPLY_BYTES:
                    break  # the rest go with the next answer
                out.append((k, self._ready[k]))
                self._delivered[k] = self._ready.pop(k)
                size += n
        return out

    def put_back(self, replies: list) -> None:
        """Replies that could not be sent (the WebSocket dropped): sent with the next answer."""
        with self._cv:
            for k, text in replies:
                self._ready[k] = text

    def answer(self, frame: Any) -> dict:
        """One frame's reply: refused unless its token is this kernel's; a context chunk is
        served here, anything else by the bridge's dispatch."""
        with self._cv:
            bridge, token = self._bridge, self._token
        got = frame.get("token") if isinstance(frame, dict) else None
        if bridge is None or not isinstance(got, str) or not token or not hmac.compare_digest(
                got.encode(), token.encode()):
            return reply_error(encode_error(ErrorKind.SUBCALL_ERROR, _REFUSED))
        if frame.get("op") == CONTEXT_OP:
            return self._chunk(frame.get("args") or {})
        return bridge.dispatch(GATEWAY_PID, json.dumps(frame).encode())

    def _chunk(self, args: dict) -> dict:
        with self._cv:
            sha = str(args.get("sha256"))
            path, piece = self._shares.get(sha), self._pieces.get(sha)
        if path is None:
            return reply_error(encode_error(ErrorKind.SUBCALL_ERROR,
                                            "no such context was shared with this kernel"))
        off, n = max(0, int(args.get("offset") or 0)), int(args.get("length") or 0)
        n = max(0, min(n, 16 << 20))
        if piece is not None:  # never past the piece: the rest of the file was not shared
            n = max(0, min(n, piece[1] - off))
            off += piece[0]
        with open(path, "rb") as f:
            f.seek(off)
            data = f.read(n)
        with self._cv:
            self.served_bytes += len(data)
        return reply_ok({"data": base64.b64encode(data).decode("ascii")})


def answer_value(replies: list, nudge: bool = False) -> str:
    """The ``input_reply`` value for :meth:`FrameServer.replies`' replies: the JSON text of
    ``{"replies": [{"id", "frame"}], "nudge"?}``, each reply's text put in as it is."""
    items = ", ".join(f'{{"id": {int(k)}, "frame": {text}}}' for k, text in replies)
    return f'{{"replies": [{items}]' + (', "nudge": true}' if nudge else "}")
