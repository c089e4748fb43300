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

Every request is cleaned by the text policy of :mod:`harness.text` before the handler sees
it (a lone surrogate a cell put in a prompt becomes U+FFFD), and a batched op whose
``prompts`` is not a list is refused (:func:`kernels.protocol.batch_args_error`).
"""
from __future__ import annotations

import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Callable

from harness.text import clean
from kernels.protocol import (ErrorKind, batch_args_error, encode_error, recv_message,
                              reply_error, reply_ok, send_message)

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


def _error_reply(exc: BaseException) -> dict:
    """An untyped host failure as the kernel sees it: a ``SubcallError`` reply."""
    return reply_error(encode_error(ErrorKind.SUBCALL_ERROR, f"{type(exc).__name__}: {exc}"))


def _ancestors(pid: int, stop: int, limit: int = 16) -> bool:
    """True if ``stop`` is ``pid`` or one of its ancestors (reads /proc)."""
    for _ in range(limit):
        if pid == stop:
            return True
        if pid <= 1:
            return False
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                data = f.read()
            pid = int(data[data.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError):
            return False
    return False


def sweep_stale_dirs() -> int:
    """Remove the socket directories (``rlm-bridge-PID-*`` in the temporary directory) that
    hosts killed before they could close their bridge left behind: the ones of this user whose
    process ``PID`` no longer exists. Returns how many were removed; never raises."""
    from kernels.process import remove_dirs_of_gone_hosts
    return remove_dirs_of_gone_hosts("rlm-bridge-", {os.getuid()})


class BridgeServer:
    """Serves kernel requests on a Unix socket, one thread per connection.

    Args:
        handler: the op dispatcher (see :data:`Handler`):
            ``handler(registration, op, args) -> JSON-able value``; raise
            :class:`BridgeError` for a typed error in the kernel. Any other
            exception becomes a ``SubcallError`` with its message.

    Attributes:
        path: filesystem path of the socket (str).

    Raises:
        OSError: the socket directory or the socket could not be created.
    """

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        sweep_stale_dirs()
        self._dir = tempfile.mkdtemp(prefix=f"rlm-bridge-{os.getpid()}-")
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
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="rlm-bridge-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            peer_pid = _PEERCRED.unpack(creds)[0]
            verified: set = set()  # (token, kernel pid) this connection's peer passed
            while True:
                try:
                    req = recv_message(conn)
                except ValueError as exc:  # a whole frame, but not JSON: answer, keep serving
                    reply = _error_reply(exc)
                else:
                    if req is None:
                        return
                    reply = self._dispatch(peer_pid, req, verified)
                send_message(conn, reply)
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    def _dispatch(self, peer_pid: int, req: Any, verified: set | None = None) -> dict:
        """Authenticate one decoded request and run the handler; returns the reply dict.

        ``verified`` (a set, one per connection) remembers the ``(token, kernel pid)`` pairs
        whose peer check this connection's peer passed, so the check's ``/proc`` reads happen
        once per connection, not once per request. The peer of a connection is fixed when it
        connects, and a pair names one kernel process: a restarted kernel (new pid, see
        :meth:`update_pid`) is checked again, a revoked token is refused as before.

        Never raises: a refused request, a :class:`BridgeError` and any other
        exception of the handler all become error replies.
        """
        try:
            token = req.get("token")
            with self._lock:
                reg = self._regs.get(token) if isinstance(token, str) else None
            if reg is None:
                return reply_error(encode_error(ErrorKind.SUBCALL_ERROR, _REFUSED))
            key = (token, reg.pid)
            if verified is None or key not in verified:
                if not _ancestors(peer_pid, reg.pid):
                    return reply_error(encode_error(ErrorKind.SUBCALL_ERROR, _REFUSED))
                if verified is not None:
                    if len(verified) >= 8:
                        verified.clear()
                    verified.add(key)
            op, args = clean(str(req.get("op"))), clean(req.get("args") or {})
            bad = batch_args_error(op, args) if isinstance(args, dict) else "args must be an object"
            if bad:
                return reply_error(encode_error(ErrorKind.SUBCALL_ERROR, bad))
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

    def dispatch(self, peer_pid: int, req: Any) -> dict:
        """Authenticate one decoded request as coming from process ``peer_pid`` and run the
        handler; returns the reply dict. For a channel other than this socket (a gateway
        kernel's stdin channel, :mod:`kernels.gateway.serve`), which vouches for the peer
        itself. Never raises."""
        return self._dispatch(peer_pid, req)
