"""The host end of the kernel-to-host bridge: an authenticated Unix-socket server.

Each kernel is registered with a fresh random token and the process id of the
kernel. A request is served only if its token is registered *and* the process
on the other end of the socket (``SO_PEERCRED``) is that kernel or one of its
descendants, so a token read out of another kernel is useless. The handler sees
the :class:`Registration` (the host's record: which kernel, which owner), never
anything the kernel claims about itself.

Messages, op names and error kinds are defined in :mod:`kernels.protocol`; the
kernel's end is :mod:`kernels.runtime`. The socket lives in a private directory
(mode 0700) removed on :meth:`BridgeServer.close`; when kernels run as another user
(:func:`kernels.sandbox.kernel_identity`, a root host) that user's group may enter it
and connect (mode 0710 and 0660), and the token and peer checks decide as always.

A connection is judged before anything is read from it: the connecting process must be a
registered kernel or descend from one (else it is refused), and that kernel and the host must
have a connection to spare; a frame is read only when its announced length is under the frame
cap and fits the kernel's share of held bytes. Everything refused is told why in one error
reply, and the connection closed. The caps and the peer check are in
:mod:`kernels.bridge_limits`; the accept loop outlives running out of descriptors.

Every request is cleaned by the text policy of :mod:`harness.text` before the handler sees
it (a lone surrogate a cell put in a prompt becomes U+FFFD), and a batched op whose
``prompts`` is not a list is refused (:func:`kernels.protocol.batch_args_error`).
"""
from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from harness.text import clean
from kernels.bridge_limits import (FRAME_ENV, TALLY, BridgeLimits, PeerCheckError, mib, nesting_over,
                                   peer_chain)
from kernels.protocol import (ErrorKind, batch_args_error, decode_frame, encode_error,
                              encode_frame, recv_body, recv_header, reply_error, reply_ok)

_PEERCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


@dataclass
class Registration:
    """The host's record of one kernel: what it may do is decided from this alone.

    Attributes:
        token: the kernel's secret (hex str).
        pid: the kernel's process id; updated when the kernel is restarted.
        owner: the host object serving this kernel's calls (an RLM loop instance).
    """

    token: str
    pid: int
    owner: Any


class BridgeError(Exception):
    """Raised by a handler to send a typed error back to the kernel.

    Args:
        type_: one of :class:`kernels.protocol.ErrorKind`: it names the exception the
            kernel raises (``BudgetExceeded``, ``ChildRLMError``, ``DepthError``,
            ``SubcallError``).
        message: the exception's text (str).
        attrs: its attributes (see :data:`kernels.protocol.ERROR_ATTRS`), JSON-serialisable.

    Attributes:
        type: ``type_``; attrs: dict of ``attrs``.
    """

    def __init__(self, type_: str, message: str, **attrs: Any) -> None:
        super().__init__(message)
        self.type = type_
        self.attrs = attrs

    def to_wire(self) -> dict:
        """The error as sent to the kernel: ``{"type", "message", **attrs}`` (a dict).

        See :func:`kernels.protocol.encode_error`; raises nothing.
        """
        return encode_error(self.type, str(self), **self.attrs)


#: The host's op dispatcher: ``handler(registration, op, args) -> value``. ``op`` is the
#: request's op (str, one of :class:`kernels.protocol.Op` unless the kernel sent junk),
#: ``args`` its arguments (dict). The value must be JSON-serialisable (for a batched op,
#: a list of :func:`kernels.protocol.item_ok` / :func:`~kernels.protocol.item_error`).
#: It raises :class:`BridgeError` for a typed error in the kernel; any other exception
#: reaches the kernel as a ``SubcallError`` with ``"ExcType: message"``. Called on the
#: connection's thread: one call at a time per kernel connection, concurrently across them.
Handler = Callable[[Registration, str, dict], Any]

_REFUSED = ("bridge refused the request: this process is not the kernel "
            "that token was issued to")
_STRANGER = ("bridge refused the connection: this process is not the kernel that a token "
             "was issued to, nor a process such a kernel started")
log = logging.getLogger("kernels.bridge")


def _error(message: str) -> dict:
    return encode_error(ErrorKind.SUBCALL_ERROR, message)


def _error_reply(exc: BaseException) -> dict:
    """An untyped host failure as the kernel sees it: a ``SubcallError`` reply."""
    return reply_error(_error(f"{type(exc).__name__}: {exc}"))


def _refuse(conn: socket.socket, message: str) -> None:
    """Send ``message`` as a closing error reply (best effort, 1 s at most), then close."""
    try:
        conn.settimeout(1.0)
        conn.sendall(encode_frame(reply_error(_error(message), closed=True)))
    except OSError:
        pass
    _close(conn)


def _close(conn: socket.socket) -> None:
    try:
        conn.close()
    except OSError:
        pass


#: Errors of ``accept`` that pass: out of descriptors or memory (for now), an aborted peer.
_TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM,
                        errno.ECONNABORTED, errno.EINTR, errno.EPROTO, errno.EPERM})


def sweep_stale_dirs() -> int:
    """Remove the socket directories (``rlm-bridge-PID-*`` in the temporary directory) that
    hosts killed before they could close their bridge left behind: the ones of this user whose
    process ``PID`` no longer exists. Returns how many were removed; never raises."""
    from kernels.process import remove_dirs_of_gone_hosts
    return remove_dirs_of_gone_hosts("rlm-bridge-", {os.getuid()})


#: Bridges of this process not yet closed (:func:`close_all`).
OPEN: "set[BridgeServer]" = set()


def close_all(skip: "set[BridgeServer] | frozenset" = frozenset()) -> None:
    """Close every bridge of this process still open but those in ``skip``, for a command
    about to exit: a stop signal between a run's set-up steps could leave one its run never
    held. Never raises."""
    for bridge in [b for b in list(OPEN) if b not in skip]:
        try:
            bridge.close()
        except Exception:  # noqa: BLE001 - the exit goes on
            pass


class BridgeServer:
    """Serves kernel requests on a Unix socket, one thread per admitted connection.

    Args:
        handler: the op dispatcher (see :data:`Handler`):
            ``handler(registration, op, args) -> JSON-able value``; raise
            :class:`BridgeError` for a typed error in the kernel. Any other
            exception becomes a ``SubcallError`` with its message.
        limits: the caps (:class:`~kernels.bridge_limits.BridgeLimits`); default
            :meth:`~kernels.bridge_limits.BridgeLimits.from_env`. Connections and held bytes
            are counted over every bridge of the process (:data:`~kernels.bridge_limits.TALLY`).

    Attributes:
        path: filesystem path of the socket (str).
        limits: the caps in force.

    Raises:
        OSError: the socket directory or the socket could not be created.
        ValueError: ``RLM_BRIDGE_MAX_FRAME_MB`` is set but not a positive number.
    """

    def __init__(self, handler: Handler, limits: BridgeLimits | None = None) -> None:
        self._handler = handler
        self.limits = limits or BridgeLimits.from_env()
        self._tally = TALLY
        sweep_stale_dirs()
        self._dir = tempfile.mkdtemp(prefix=f"rlm-bridge-{os.getpid()}-")
        OPEN.add(self)  # until closed: close_all() at the process's exit
        os.chmod(self._dir, 0o700)
        self.path = os.path.join(self._dir, "b.sock")
        self._regs: dict[str, Registration] = {}
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._open_to_kernel_user()
        self._sock.listen(128)
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept_loop, name="rlm-bridge", daemon=True)
        self._thread.start()

    def _open_to_kernel_user(self) -> None:
        from kernels.sandbox import KernelUserError, kernel_identity
        try:
            ident = kernel_identity()
        except KernelUserError:
            return  # the kernel cannot start either, and says why
        if ident is None:
            return
        os.chown(self._dir, -1, ident.gid)
        os.chmod(self._dir, 0o710)
        os.chown(self.path, -1, ident.gid)
        os.chmod(self.path, 0o660)

    # registrations -----------------------------------------------------
    def register(self, pid: int, owner: Any) -> Registration:
        """Create a new secret token for the kernel process ``pid``, served by ``owner``.

        Returns the :class:`Registration`; its ``token`` (32 hex chars) goes into
        :func:`kernels.protocol.bind_code`. What the kernel may do (its level, its budget
        scope) is kept on ``owner`` by the host, never taken from the kernel.
        """
        reg = Registration(token=secrets.token_hex(16), pid=pid, owner=owner)
        with self._lock:
            self._regs[reg.token] = reg
        return reg

    def update_pid(self, token: str, pid: int) -> None:
        """The kernel was restarted: only the new process may use ``token`` from now on.

        Raises KeyError if ``token`` is not registered.
        """
        with self._lock:
            self._regs[token].pid = pid

    def unregister(self, token: str) -> None:
        """Revoke ``token``: later requests with it are refused."""
        with self._lock:
            self._regs.pop(token, None)

    # serving -----------------------------------------------------------
    def _accept_loop(self) -> None:
        """Accept connections until :meth:`close`; never ends otherwise. Out of descriptors
        (or memory) the loop waits, from 10 ms up to 1 s, and tries again: the waiting
        connections stay queued in the socket's backlog meanwhile."""
        pause = 0.0
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if self._closed:
                    return
                pause = min(1.0, max(0.01, pause * 2))
                if exc.errno not in _TRANSIENT:
                    log.debug("bridge accept failed: %s", exc)
                time.sleep(pause)
                continue
            pause = 0.0
            try:
                self._admit(conn)
            except Exception as exc:  # one connection never ends the loop
                log.debug("bridge could not admit a connection: %s", exc)
                _close(conn)

    def _owner_of(self, peer_pid: int) -> tuple[Registration | None, list[int]]:
        """The registration whose kernel ``peer_pid`` is (or descends from), nearest first,
        and the peer's chain of ancestors. Raises :class:`PeerCheckError`."""
        chain = peer_chain(peer_pid)
        with self._lock:
            by_pid = {reg.pid: reg for reg in self._regs.values()}
        for pid in chain:
            if pid in by_pid:
                return by_pid[pid], chain
        return None, chain

    def _admit(self, conn: socket.socket) -> None:
        """Decide on a new connection before reading anything from it: whose kernel it is
        from (refused if none), and whether that kernel and the host have a connection to
        spare (refused with the cap if not); then serve it on a thread of its own."""
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        try:
            reg, chain = self._owner_of(_PEERCRED.unpack(creds)[0])
        except PeerCheckError as exc:
            _refuse(conn, f"bridge could not check the caller ({exc}); try again")
            return
        if reg is None:
            _refuse(conn, _STRANGER)
            return
        refused = self._tally.admit(reg.token, self.limits)
        if refused:
            _refuse(conn, "bridge refused the connection: " + refused)
            return
        with self._lock:
            self._conns.add(conn)
        try:
            threading.Thread(target=self._serve, args=(conn, reg.token, chain), daemon=True,
                             name="rlm-bridge-conn").start()
        except RuntimeError:  # no thread to be had: this connection is refused, not lost
            self._ended(conn, reg.token)
            _refuse(conn, "bridge refused the connection: the host cannot start a thread "
                          "for it now; try again shortly")

    def _ended(self, conn: socket.socket, key: str) -> None:
        with self._lock:
            self._conns.discard(conn)
        self._tally.leave(key)

    def _serve(self, conn: socket.socket, key: str, chain: list[int]) -> None:
        """Serve one admitted connection's requests in turn until it closes. A frame is read
        only when its announced length is under the frame cap and fits the kernel's share of
        held bytes; otherwise the kernel is told why and the connection closed unread."""
        try:
            verified: set = set()  # (token, kernel pid) this connection's peer passed
            while True:
                n = recv_header(conn)
                if n is None:
                    return
                refused = self._over_frame(n) or self._tally.hold(key, n, self.limits)
                if refused:
                    _refuse(conn, "bridge refused the request: " + refused)
                    return
                try:
                    body = recv_body(conn, n)
                    if body is None:
                        return
                    reply = self._answer(chain, body, verified)
                    del body
                    conn.sendall(self._encode(reply))
                finally:
                    self._tally.release(key, n)
        except OSError:
            return
        except Exception as exc:  # never a traceback on the host's terminal
            log.debug("bridge connection ended: %s: %s", type(exc).__name__, exc)
        finally:
            self._ended(conn, key)
            _close(conn)

    def _over_frame(self, n: int) -> str | None:
        cap = self.limits.max_frame
        if n <= cap:
            return None
        return (f"the request is {mib(n)}, over the bridge's frame cap of {mib(cap)} (the "
                f"host's {FRAME_ENV}); send less at once, e.g. split a context across "
                "several calls")

    @staticmethod
    def _encode(reply: dict) -> bytes:
        """``reply`` as a frame; a value that cannot be sent becomes an error reply."""
        try:
            return encode_frame(reply)
        except (TypeError, ValueError, RecursionError) as exc:
            return encode_frame(_error_reply(exc))

    def _answer(self, chain: list[int], body: bytes, verified: set) -> dict:
        """The reply to one frame's body: an error for one that is not a JSON object or
        nests too deeply, else :meth:`_dispatch`'s."""
        try:
            req = decode_frame(body)
        except ValueError as exc:  # a whole frame, but not JSON: answer, keep serving
            return _error_reply(exc)
        if not isinstance(req, dict):
            return reply_error(_error("bridge refused the request: it must be a JSON object "
                                      f"{{\"token\", \"op\", \"args\"}}, not a "
                                      f"{type(req).__name__}"))
        if nesting_over(req, self.limits.nesting):
            return reply_error(_error(
                f"bridge refused the request: its JSON nests more than {self.limits.nesting} "
                "levels deep; pass deeper data as JSON text (json.dumps) instead"))
        return self._dispatch(chain, req, verified)

    def _dispatch(self, chain: list[int], req: dict, verified: set | None = None) -> dict:
        """Authenticate one decoded request and run the handler; returns the reply dict.

        ``chain`` is the connection's peer and its ancestors (read once, when it connected);
        the request's token must name a registered kernel among them. ``verified`` (a set,
        one per connection) remembers the ``(token, kernel pid)`` pairs that passed, so
        a connection's later requests skip the check. The peer of a connection is fixed when
        it connects, and a pair names one kernel process: a restarted kernel (new pid, see
        :meth:`update_pid`) is checked again, a revoked token is refused as before.

        Never raises: a refused request, a :class:`BridgeError` and any other
        exception of the handler all become error replies.
        """
        try:
            token = req.get("token")
            with self._lock:
                reg = self._regs.get(token) if isinstance(token, str) else None
            if reg is None:
                return reply_error(_error(_REFUSED))
            key = (token, reg.pid)
            if verified is None or key not in verified:
                if reg.pid not in chain:
                    return reply_error(_error(_REFUSED))
                if verified is not None:
                    if len(verified) >= 8:
                        verified.clear()
                    verified.add(key)
            op, args = clean(str(req.get("op"))), clean(req.get("args") or {})
            bad = batch_args_error(op, args) if isinstance(args, dict) else "args must be an object"
            if bad:
                return reply_error(_error(bad))
            value = self._handler(reg, op, args)
            return reply_ok(value)
        except BridgeError as exc:
            return reply_error(exc.to_wire())
        except Exception as exc:  # the kernel gets a message, the host goes on
            return _error_reply(exc)

    def close(self) -> None:
        """Stop serving, drop every connection and remove the socket directory."""
        if self._closed:
            return
        self._closed = True
        OPEN.discard(self)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
            self._regs.clear()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        shutil.rmtree(self._dir, ignore_errors=True)

    def dispatch(self, peer_pid: int, body: bytes) -> dict:
        """The reply to one request frame's body (JSON bytes) that came over a channel other
        than this socket (a gateway kernel's stdin channel, :mod:`kernels.gateway.serve`),
        which vouches for the peer itself: authenticated as coming from process ``peer_pid``,
        under the same frame cap and nesting limit as a frame read here. Never raises."""
        refused = self._over_frame(len(body))
        if refused:
            return reply_error(_error("bridge refused the request: " + refused))
        return self._answer([peer_pid], body, set())
