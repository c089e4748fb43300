"""Inside a gateway kernel: sub-calls from the processes a cell starts.

Only the kernel's own process holds the stdin channel (:mod:`kernels.gateway.courier`). A
process a cell forks or spawns reaches the host as a local kernel's does, through a Unix
socket, here one the kernel's process listens on in its private ``/tmp`` (:func:`start`): it
reads each frame (a 4-byte length and JSON, :func:`kernels.protocol.encode_frame`), sends it on
through the courier and writes the reply back the same way. The host checks the frame's token
as for any other frame; the relay admits only a process that descends from the kernel's
(``SO_PEERCRED`` and ``/proc``, as :mod:`kernels.bridge` does) and frames under the cap.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import tempfile
import threading

from kernels.bridge_limits import MAX_FRAME_BYTES, PeerCheckError, peer_chain
from kernels.protocol import ErrorKind, encode_error, reply_error

_HEADER = struct.Struct(">I")
_PEERCRED = struct.Struct("3i")
#: The largest frame the relay reads (bytes): the host's default frame cap (the host applies
#: its own, maybe lower, to every frame).
MAX_FRAME = MAX_FRAME_BYTES
_STARTED: list[str] = []


def start() -> str:
    """Listen for this kernel's child processes (once per process); returns the socket's path.
    Raises OSError when the socket cannot be made."""
    if _STARTED:
        return _STARTED[0]
    where = tempfile.mkdtemp(prefix="rlm-relay-")  # 0700: the kernel's user only
    path = os.path.join(where, "r.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    threading.Thread(target=_accept, args=(srv, os.getpid()), daemon=True,
                     name="rlm-relay").start()
    _STARTED.append(path)
    return path


def _accept(srv: socket.socket, kernel_pid: int) -> None:
    while True:
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        try:
            threading.Thread(target=_serve, args=(conn, kernel_pid), daemon=True,
                             name="rlm-relay-conn").start()
        except RuntimeError:  # no thread to be had: the caller hears the connection close
            conn.close()


def _descends(conn: socket.socket, kernel_pid: int) -> bool:
    pid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                           _PEERCRED.size))[0]
    try:
        return pid != kernel_pid and kernel_pid in peer_chain(pid, limit=64)
    except PeerCheckError:
        return False


def _serve(conn: socket.socket, kernel_pid: int) -> None:
    """Relay one child's frames in turn until it closes the connection."""
    from kernels.gateway.courier import CourierError, courier
    with conn:
        if not _descends(conn, kernel_pid):
            _send(conn, reply_error(encode_error(
                ErrorKind.SUBCALL_ERROR, "only a process this kernel started may use its relay")))
            _drain(conn)
            return
        while True:
            head = _read(conn, _HEADER.size)
            if head is None:
                return
            (n,) = _HEADER.unpack(head)
            if n > MAX_FRAME:
                _send(conn, reply_error(encode_error(
                    ErrorKind.SUBCALL_ERROR, f"a frame of {n} bytes is over the relay's cap "
                                             f"({MAX_FRAME} bytes): refused unread")))
                return
            body = _read(conn, n)
            if body is None:
                return
            try:
                reply = courier().call_text(body.decode("utf-8"))
            except (CourierError, UnicodeDecodeError) as exc:
                reply = reply_error(encode_error(ErrorKind.SUBCALL_ERROR, str(exc)))
            if not _send(conn, reply):
                return


def _drain(conn: socket.socket, limit: int = 1 << 16, seconds: float = 2.0) -> None:
    """Read and drop what a refused peer sends (at most ``limit`` bytes, ``seconds`` s) before
    closing: closed at once, its frame still being written would fail with a broken pipe
    instead of reaching the refusal it can read."""
    conn.settimeout(seconds)
    got = 0
    while got < limit:
        try:
            chunk = conn.recv(min(limit - got, 1 << 14))
        except OSError:
            return
        if not chunk:
            return
        got += len(chunk)


def _read(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        try:
            got = conn.recv(min(n - len(buf), 1 << 20))
        except OSError:
            return None
        if not got:
            return None
        buf += got
    return bytes(buf)


def _send(conn: socket.socket, reply: dict) -> bool:
    body = json.dumps(reply).encode()
    try:
        conn.sendall(_HEADER.pack(len(body)) + body)
        return True
    except OSError:
        return False
