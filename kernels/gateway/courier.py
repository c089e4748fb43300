"""Inside a gateway kernel: the bridge carried by the kernel's own stdin channel.

A kernel behind a Jupyter gateway cannot reach the host's Unix socket; what it can do is what
any kernel does to read ``input()``: send an ``input_request`` on its stdin channel and wait for
the client's ``input_reply``. The host (:mod:`kernels.gateway.serve`) is that client, so bridge
frames ride these two messages: the request's ``prompt`` is :data:`MARK` followed by the JSON
``{"frames": [{"id": int, "frame": request}, ...]}`` and the reply's ``value`` is the JSON
``{"replies": [{"id": int, "frame": reply}, ...]}``.

ipykernel's stdin socket is not thread-safe, so one thread at a time holds it (:class:`Courier`):
the thread that asks while the channel is free sends every pending frame in a single
``input_request`` and hands each reply to the thread that asked; others queue meanwhile. The
host answers with whatever replies are ready (holding the answer up to :data:`HOLD_SECONDS` when
none is), so calls made at once in a cell (threads, batches) travel together and never wait
behind one outstanding request.

Drops. Each request also lists the ids still waiting (``"waiting"``). The host dispatches a
frame id once, ever, and keeps each reply until a later request no longer lists its id, sending
it again while it does. After the host reopens a dropped WebSocket it sends one unsolicited
``input_reply`` marked ``"nudge"``: a courier stuck on a request the drop lost is released by it
and sends every unanswered frame again (the host skips the ones it has). So no call is lost and
none is made twice; a reply that arrives twice is taken once.

:class:`CourierSocket` gives :mod:`kernels.runtime` what it expects of a bridge connection
(``connect``, ``sendall``, ``recv``, ``close``), so the runtime's own ``llm_query``, ``rlm``,
tools, ``FINAL`` and their errors work unchanged; :func:`kernels.gateway.remote.bind` installs
it. Standard library only, and in the kernel ipykernel's own session and stdin socket.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import struct
import threading

from kernels.protocol import ErrorKind, encode_error, reply_error

#: The first characters of an ``input_request`` prompt that carries bridge frames.
MARK = "\x00rlm-bridge:"
#: Seconds the host may hold an answer when no reply is ready yet (it says so; documented here).
HOLD_SECONDS = 0.02
#: Bytes of frames one ``input_request`` carries at most (past its first frame): the host
#: refuses a larger request unread (``"refused"``), failing its frames with a ``SubcallError``.
BATCH_BYTES = 16 << 20
_HEADER = struct.Struct(">I")


class CourierError(ConnectionError):
    """The stdin channel failed (the kernel's client is gone, or stdin is not allowed)."""


class Courier:
    """The kernel's stdin channel for bridge frames, held by one thread at a time.

    A thread that asks while no request is out carries it itself (every frame pending, its
    own and others'), hands each reply to the thread that asked, and gives the channel up when
    its own reply is in: a lone call costs no hand-off between threads. A thread that asks
    while a request is out queues its frame and waits; when the channel is given up, a waiting
    thread with a frame still unanswered takes it. The main thread's request is sent with
    SIGINT deferred (:func:`_deferring_sigint`), so an interrupt never cuts a message in half.

    Args:
        raw_input: ``raw_input(prompt) -> str``: one ``input_request`` and its reply's value,
            blocking (:func:`_asker`).
    """

    def __init__(self, raw_input) -> None:
        self._raw = raw_input
        self._cv = threading.Condition()
        self._out: list[tuple[int, str]] = []  # (id, the frame's JSON text), not sent yet
        self._waiting: dict[int, object] = {}
        self._sent: dict[int, str] = {}  # sent, not answered: sent again after a nudge
        self._resend = False
        self._sending = False  # a thread holds the channel
        self._ids = itertools.count(1)
        self.pid = os.getpid()
        #: input_request round trips made (int), for tests and measurements
        self.trips = 0

    def call(self, frame: dict) -> dict:
        """Send one bridge frame (a request dict) and wait for its reply dict.

        Raises:
            CourierError: the stdin channel failed.
        """
        return self.call_text(json.dumps(frame))

    def call_text(self, frame: str) -> dict:
        """:meth:`call` for a frame already in JSON text (as the runtime encoded it)."""
        if os.getpid() != self.pid:
            raise CourierError("a process a cell started reaches the host through the kernel's "
                               "relay, not its stdin channel (kernels.gateway.relay)")
        with self._cv:
            n = next(self._ids)
            self._out.append((n, frame))
            self._waiting[n] = None
        try:
            got = self._until_answered(n)
        except BaseException:  # interrupted: a late reply is dropped
            with self._cv:
                self._waiting.pop(n, None)
                self._sent.pop(n, None)
            raise
        if isinstance(got, BaseException):
            raise got
        return got

    def _until_answered(self, n: int):
        """Frame ``n``'s reply (or the error it met), carrying requests while the channel is
        free and ``n`` is unanswered."""
        while True:
            with self._cv:
                while self._waiting[n] is None and self._sending:
                    self._cv.wait()
                if self._waiting[n] is not None:
                    return self._waiting.pop(n)
                self._sending = True
                batch, waiting = self._next_request()
            try:
                self._trip(batch, waiting)
            finally:
                with self._cv:
                    self._sending = False
                    self._cv.notify_all()

    def _take_batch(self) -> list:
        """The pending frames for one request, ``[(id, JSON text)]``: up to
        :data:`BATCH_BYTES` (at least one); the rest wait for the next (the lock is held)."""
        batch, size = [], 0
        while self._out and (not batch or size + len(self._out[0][1]) <= BATCH_BYTES):
            k, text = self._out.pop(0)
            batch.append((k, text))
            self._sent[k] = text
            size += len(text)
        return batch

    def _next_request(self) -> tuple[list, list[int]]:
        """The next request's frames and the ids still waiting (the lock is held)."""
        batch = self._take_batch()
        waiting = sorted(k for k, v in self._waiting.items() if v is None)
        if self._resend:  # the last request may have been lost in a drop
            batch = [(k, t) for k, t in self._sent.items() if k in waiting]
            self._resend = False
        return batch, waiting

    def _trip(self, batch: list, waiting: list[int]) -> None:
        """One ``input_request`` and its reply, handed out (the lock is not held)."""
        items = ", ".join(f'{{"id": {k}, "frame": {t}}}' for k, t in batch)
        try:
            value = self._raw(f'{MARK}{{"frames": [{items}], "waiting": {waiting}}}')
            got = json.loads(value)
            replies = got["replies"]
            self.trips += 1
        except (KeyboardInterrupt, SystemExit):
            # this thread's call ends; the batch may not have gone out, so the next request
            # sends every unanswered frame again (the host skips those it has), and replies
            # lost here come again while their ids are listed as waiting
            with self._cv:
                self._resend = True
            raise
        except BaseException as exc:  # noqa: BLE001 - every waiter must hear of it
            err = CourierError(f"the host did not answer on the stdin channel: "
                               f"{type(exc).__name__}: {exc}")
            with self._cv:
                for k in list(self._waiting):
                    if self._waiting[k] is None:
                        self._waiting[k] = err
                self._sent.clear()
            return
        with self._cv:
            self._resend = bool(got.get("nudge"))
            if got.get("refused"):  # the request was too big to read: its frames fail
                refused = reply_error(encode_error(ErrorKind.SUBCALL_ERROR,
                                                   str(got["refused"])))
                replies = [{"id": k, "frame": refused} for k, _ in batch]
            for r in replies:
                if isinstance(r, dict) and self._waiting.get(r.get("id"), 0) is None:
                    self._waiting[r["id"]] = r.get("frame") or {}
                    self._sent.pop(r["id"], None)


_COURIER: list[Courier] = []


def courier() -> Courier:
    """This kernel's courier (made by :func:`install`). Raises CourierError before it."""
    if not _COURIER:
        raise CourierError("this kernel was not bound to a gateway host")
    return _COURIER[0]


class CourierSocket:
    """A bridge "connection" for :mod:`kernels.runtime` that goes through the courier.

    Made as ``CourierSocket(family, type)`` (the runtime's socket constructor call);
    ``connect`` does nothing in the kernel's own process, ``sendall`` takes one whole frame (a
    4-byte length and JSON, as :func:`kernels.protocol.encode_frame` writes it) and sends it,
    ``recv`` returns the reply's frame bytes. In a process the cell forked, ``connect`` opens a
    real Unix socket to ``address``, the kernel's relay (:mod:`kernels.gateway.relay`), and the
    frames go through that.
    """

    def __init__(self, *_args) -> None:
        self._buf = b""
        self._real = None

    def connect(self, address) -> None:
        """Nothing to connect in the kernel's process (the courier owns the channel); in a
        process it started, connect to the relay at ``address``. Raises OSError."""
        if _COURIER and os.getpid() != _COURIER[0].pid and address != "stdin:":
            import socket
            real = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            real.connect(address)
            self._real = real

    def sendall(self, data: bytes) -> None:
        """Send the frame in ``data`` and keep its reply for :meth:`recv`. Raises CourierError
        (OSError through the relay)."""
        if self._real is not None:
            self._real.sendall(data)
            return
        (n,) = _HEADER.unpack(data[:_HEADER.size])
        reply = courier().call_text(data[_HEADER.size:_HEADER.size + n].decode())
        body = json.dumps(reply).encode()
        self._buf += _HEADER.pack(len(body)) + body

    def recv(self, n: int) -> bytes:
        """Up to ``n`` bytes of the replies received (b"" when none is left)."""
        if self._real is not None:
            return self._real.recv(n)
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def close(self) -> None:
        """Drop what is left unread."""
        self._buf = b""
        if self._real is not None:
            self._real.close()


def _refuse_input(prompt: str = "") -> str:
    raise OSError("input() is not available in an RLM kernel: the model's code runs unattended")


@contextlib.contextmanager
def _deferring_sigint():
    """On the main thread, hold a SIGINT (a cell's interrupt) until the block ends, then act
    on it as the handler in force would: a message's parts go out one by one, and one cut off
    in the middle would run into the next. Elsewhere (no interrupt lands there) a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list = []
    old = signal.signal(signal.SIGINT, lambda *a: got.append(a))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if got and callable(old):
            old(*got[0])
        elif got:
            os.kill(os.getpid(), signal.SIGINT)


def _asker(kernel):
    """``kernel.raw_input`` without its first step: ipykernel flushes the cell's stdout and
    stderr before every ``input_request``, from another thread a round trip to the kernel's
    output thread each (about 0.25 ms a sub-call, which no bridge frame needs). The request,
    its signing and the wait for the reply are the kernel's own session and stdin socket's, as
    ``raw_input`` uses them. Falls back to ``raw_input`` itself when the kernel lacks them."""
    try:
        import zmq
        session, sock = kernel.session, kernel.stdin_socket
        kernel._parent_ident["shell"], kernel.get_parent("shell")  # noqa: B018 - probed
    except Exception:  # noqa: BLE001 - another ipykernel: its own raw_input then
        return kernel.raw_input

    def ask(prompt: str) -> str:
        if not getattr(kernel, "_allow_stdin", True):
            raise CourierError("the kernel's client did not allow stdin for this cell")
        while True:  # stale replies (a nudge that found no request waiting) are dropped
            try:
                sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
        with _deferring_sigint():
            session.send(sock, "input_request", {"prompt": prompt, "password": False},
                         kernel.get_parent("shell"), ident=kernel._parent_ident["shell"])
        while True:
            if sock.poll(1000):
                _, reply = session.recv(sock)
                if reply is not None:
                    return reply["content"]["value"]
    return ask


def install(kernel) -> Courier:
    """Make this kernel's courier from its ``raw_input`` and shut ``input()`` off for cells
    (the courier owns the stdin channel). Idempotent; returns the courier."""
    if not _COURIER:
        _COURIER.append(Courier(_asker(kernel)))
        kernel.raw_input = _refuse_input
        kernel.getpass = _refuse_input
    return _COURIER[0]
