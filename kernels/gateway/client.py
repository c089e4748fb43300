"""The host's client of a Jupyter gateway: its REST API and a kernel's WebSocket channels.

Jupyter Kernel Gateway and Jupyter Enterprise Gateway serve the same API: ``POST /api/kernels``
starts a kernel of a named kernelspec, ``POST /api/kernels/ID/interrupt`` and ``.../restart``
act on it, ``DELETE /api/kernels/ID`` ends it, and ``/api/kernels/ID/channels`` is a WebSocket
carrying the kernel's Jupyter messages as JSON, each with a ``channel`` field (``shell``,
``iopub``, ``stdin``, ``control``). Every request carries ``Authorization: token TOKEN``; the
token is never put in a URL, a message or an exception's text.

HTTP through :mod:`urllib.request`, the WebSocket through ``websocket-client``.
"""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.parse
import urllib.request
import uuid
from datetime import datetime, timezone

#: The variables the gateway's address and token are read from (jupyter_server's names).
URL_VAR = "JUPYTER_GATEWAY_URL"
TOKEN_VAR = "JUPYTER_GATEWAY_AUTH_TOKEN"
#: jupyter_server's binary WebSocket subprotocol (offsets, the channel, the message's parts).
WS_V1 = "v1.kernel.websocket.jupyter.org"
_PARTS = ("header", "parent_header", "metadata", "content")


class GatewayError(RuntimeError):
    """The gateway could not be reached, refused the token, or refused a request.

    Attributes:
        status: the HTTP status (int), or 0 when the gateway was not reached at all.
    """

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class GatewayClient:
    """Requests to one gateway.

    Args:
        url: the gateway's base URL (``http://host:port`` or ``https://...``).
        token: its auth token (str; "" for none).
        timeout: seconds per HTTP request (a kernel start is slower: see :meth:`start_kernel`).

    Raises:
        ValueError: ``url`` is not an http(s) URL.
    """

    def __init__(self, url: str, token: str = "", timeout: float = 10.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"gateway URL {url!r} is not an http(s) URL: pass "
                             "--gateway-url http://HOST:PORT")
        self.url = url.rstrip("/")
        self._token = token
        self.timeout = timeout
        self._json_only = False  # the gateway refused the binary subprotocol once

    def _headers(self) -> dict:
        h = {"Content-Type": "application/json"}
        if self._token:
            h["Authorization"] = f"token {self._token}"
        return h

    def request(self, method: str, path: str, body: dict | None = None,
                timeout: float | None = None) -> dict | None:
        """One REST call; returns the decoded JSON body (None when empty).

        Raises:
            GatewayError: not reached (status 0), the token refused (401/403), or any other
                error status (the gateway's own message included, never the token).
        """
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers=self._headers())
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise self._status_error(exc.code, path, exc.read()) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise GatewayError(f"could not reach the Jupyter gateway at {self.url}: {reason}; "
                               "start it, or point --gateway-url (or $JUPYTER_GATEWAY_URL) at "
                               "a running one") from None
        return json.loads(raw) if raw.strip() else None

    def _status_error(self, code: int, path: str, body: bytes) -> GatewayError:
        if code in (401, 403):
            return GatewayError(f"the Jupyter gateway at {self.url} refused the token (HTTP "
                                f"{code}): set ${TOKEN_VAR} to the gateway's auth token", code)
        try:
            why = json.loads(body).get("message") or ""
        except (ValueError, AttributeError):
            why = body[:200].decode("utf-8", "replace")
        why = why.replace(self._token, "***") if self._token else why
        return GatewayError(f"the Jupyter gateway at {self.url} answered HTTP {code} to "
                            f"{path}: {why}", code)

    def start_kernel(self, name: str, timeout: float = 60.0) -> str:
        """Start a kernel of kernelspec ``name``; returns its id (str). Raises GatewayError."""
        got = self.request("POST", "/api/kernels", {"name": name}, timeout=timeout) or {}
        if "id" not in got:
            raise GatewayError(f"the Jupyter gateway at {self.url} started no kernel: {got}")
        return str(got["id"])

    def interrupt(self, kernel_id: str) -> None:
        """Interrupt the kernel's running cell. Raises GatewayError."""
        self.request("POST", f"/api/kernels/{kernel_id}/interrupt")

    def restart(self, kernel_id: str, timeout: float = 60.0) -> None:
        """Restart the kernel (a fresh process, the same id). Raises GatewayError."""
        self.request("POST", f"/api/kernels/{kernel_id}/restart", {}, timeout=timeout)

    def delete(self, kernel_id: str) -> None:
        """End the kernel; a kernel already gone is no error. Never raises."""
        try:
            self.request("DELETE", f"/api/kernels/{kernel_id}")
        except GatewayError:
            pass

    def kernel_state(self, kernel_id: str) -> str:
        """``"present"``, ``"absent"`` (the gateway answers without it: culled or ended) or
        ``"unreachable"`` (the gateway does not answer, or refuses us). Never raises."""
        try:
            self.request("GET", f"/api/kernels/{kernel_id}", timeout=5)
            return "present"
        except GatewayError as exc:
            return "absent" if exc.status == 404 else "unreachable"

    def channels(self, kernel_id: str, session_id: str):
        """Open the kernel's WebSocket channels (a ``websocket.WebSocket``).

        ``session_id`` names this client's session: reconnecting with the same one lets the
        gateway replay what the kernel sent while the socket was down.

        Raises:
            GatewayError: the WebSocket could not be opened.
        """
        import websocket
        base = urllib.parse.urlsplit(self.url)
        scheme = "wss" if base.scheme == "https" else "ws"
        url = (f"{scheme}://{base.netloc}{base.path}/api/kernels/{kernel_id}/channels"
               f"?session_id={session_id}")
        headers = [f"Authorization: token {self._token}"] if self._token else []
        while True:
            # the binary subprotocol when the gateway speaks it: the gateway then passes each
            # message's parts between the WebSocket and the kernel's socket as they are (only
            # signing what goes in) instead of parsing, re-dating and re-encoding every message;
            # a gateway that does not (it answers without the protocol, which websocket-client
            # refuses) gets JSON text from then on
            protocols = None if self._json_only else [WS_V1]
            try:
                # websocket-client's own UTF-8 check of each frame (pure Python) is skipped:
                # the messages are JSON, parsed anyway
                return websocket.create_connection(
                    url, header=headers, timeout=self.timeout, enable_multithread=True,
                    skip_utf8_validation=True, subprotocols=protocols)
            except websocket.WebSocketBadStatusException as exc:
                status = getattr(exc, "status_code", 0) or 0
                if status in (401, 403):
                    raise self._status_error(status, "channels", b"") from None
                raise self._channels_error(exc, status) from None
            except (websocket.WebSocketTimeoutException, OSError) as exc:
                raise self._channels_error(exc) from None
            except websocket.WebSocketException as exc:
                # the handshake's own refusal is this plain class; a closed connection is not
                if protocols is None or type(exc) is not websocket.WebSocketException:
                    raise self._channels_error(exc) from None
                self._json_only = True

    def _channels_error(self, exc: BaseException, status: int = 0) -> GatewayError:
        return GatewayError(f"could not open the kernel's channels on the Jupyter gateway at "
                            f"{self.url}: {type(exc).__name__}", status)


def message(msg_type: str, content: dict, session: str, channel: str,
            parent: dict | None = None) -> dict:
    """A Jupyter message as the gateway's WebSocket takes it (dict with ``channel``)."""
    return {"header": {"msg_id": uuid.uuid4().hex, "username": "rlm", "session": session,
                       "msg_type": msg_type, "version": "5.3",
                       "date": datetime.now(timezone.utc).isoformat()},
            "parent_header": parent or {}, "metadata": {}, "content": content,
            "channel": channel, "buffers": []}


def encode_v1(msg: dict) -> bytes:
    """``msg`` (as :func:`message` makes it) in :data:`WS_V1` framing: the count of offsets
    and the offsets (8-byte little-endian each), the channel, then the JSON of the header,
    parent header, metadata and content."""
    parts = [msg["channel"].encode()] + [json.dumps(msg[k]).encode() for k in _PARTS]
    offsets = [8 * (len(parts) + 2)]
    for part in parts:
        offsets.append(offsets[-1] + len(part))
    head = b"".join(n.to_bytes(8, "little") for n in [len(offsets)] + offsets)
    return head + b"".join(parts)


def decode_v1(data: bytes) -> dict | None:
    """A :data:`WS_V1` frame as a message dict (with ``channel`` and ``buffers``), or None when
    it is not one."""
    try:
        count = int.from_bytes(data[:8], "little")
        if not 3 <= count <= 1024 or len(data) < 8 * (count + 1):
            return None
        offs = [int.from_bytes(data[8 * i:8 * i + 8], "little") for i in range(1, count + 1)]
        chunks = [data[a:b] for a, b in zip(offs, offs[1:])]  # the last offset: the end
        msg = {"channel": chunks[0].decode()}
        for k, part in zip(_PARTS, chunks[1:5]):
            msg[k] = json.loads(part) if part else {}
        msg["buffers"] = chunks[5:]
        return msg
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
