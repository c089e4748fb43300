"""A real HTTP server on 127.0.0.1 speaking Anthropic's Messages protocol (``POST /v1/messages``).

The Anthropic twin of :mod:`scripted_server`: replies are scripted by a
``responder(request_json) -> Reply | str``, so tests drive the real ``anthropic`` client through
real sockets. A reply is a message (``{"type": "message", "content": [{"type": "text", ...}],
"usage": {"input_tokens", "output_tokens"}, "stop_reason", ...}``); an error reply has
Anthropic's error shape (``{"type": "error", "error": {"type", "message"}}``). Every request is
recorded (``server.requests``, with its headers in ``server.headers``) for assertions such as
"the refused calls never reached the server".
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

#: Anthropic's error ``type`` for each HTTP status it uses (docs.anthropic.com, "Errors").
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}


@dataclass
class Reply:
    """One scripted answer: ``text`` with HTTP ``status`` (200, 429, 529...).

    ``delay`` seconds before answering; ``headers`` extra (e.g. ``retry-after``); ``usage``
    overrides the default usage (input tokens ~ characters/4); ``omit_usage`` sends none;
    ``stop_reason`` is sent as is (``"max_tokens"``: cut at the cap); ``thinking`` adds a
    ``thinking`` block before the text; ``error_type`` overrides the error's ``type``.
    """

    text: str = ""
    status: int = 200
    delay: float = 0.0
    headers: dict = field(default_factory=dict)
    usage: dict | None = None
    omit_usage: bool = False
    stop_reason: str | None = "end_turn"
    thinking: str | None = None
    error_type: str | None = None
    body: dict | None = None  # a whole JSON body sent as it is (a 200 carrying an error)


def user_text(req: dict) -> str:
    """The text of the request's last user turn."""
    for m in reversed(req.get("messages") or []):
        if m.get("role") == "user":
            c = m.get("content")
            if isinstance(c, list):
                return "".join(b.get("text", "") for b in c if isinstance(b, dict))
            return str(c or "")
    return ""


def _chars(req: dict) -> int:
    n = len(str(req.get("system") or ""))
    for m in req.get("messages") or []:
        n += len(str(m.get("content") or ""))
    return n


class _Server(ThreadingHTTPServer):
    """A client that hung up (a cut timeout, a cancelled call) is expected, not an error."""

    def handle_error(self, request, client_address) -> None:
        import sys
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)


class AnthropicServer:
    """Start with ``with AnthropicServer(responder) as srv: srv.url``.

    Args:
        responder: called for every ``POST /v1/messages`` with the parsed JSON body; returns a
            :class:`Reply` or a plain string (the reply's text).
    Attributes:
        url: the API's root (``http://127.0.0.1:PORT``), what ``base_url`` takes.
        requests, headers, paths: each request's body, headers (lower-case names) and path.
        usages: the usage sent with each successful reply.
    """

    def __init__(self, responder: Callable[[dict], Reply | str]) -> None:
        self.responder = responder
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.paths: list[str] = []
        self.usages: list[dict] = []
        self._lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, *a):  # quiet
                pass

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                req = json.loads(self.rfile.read(n) or b"{}")
                with outer._lock:
                    outer.requests.append(req)
                    outer.headers.append({k.lower(): v for k, v in self.headers.items()})
                    outer.paths.append(self.path)
                if self.path.split("?")[0] != "/v1/messages":
                    self._error(404, f"no route {self.path}", {})
                    return
                try:
                    rep = outer.responder(req)
                except Exception as exc:  # a bug in a test's script: make it loud
                    rep = Reply(text=f"responder error: {exc!r}", status=500)
                if isinstance(rep, str):
                    rep = Reply(text=rep)
                if rep.delay:
                    time.sleep(rep.delay)
                if rep.body is not None:
                    self._send(rep.status, rep.body, rep.headers)
                    return
                if rep.status != 200:
                    self._error(rep.status, rep.text or "scripted error", rep.headers,
                                rep.error_type)
                    return
                self._message(req, rep)

            def _message(self, req: dict, rep: Reply) -> None:
                usage = dict(rep.usage or {"input_tokens": max(1, _chars(req) // 4),
                                           "output_tokens": max(1, len(rep.text) // 4)})
                with outer._lock:
                    outer.usages.append({} if rep.omit_usage else usage)
                    number = len(outer.requests)
                content = [{"type": "thinking", "thinking": rep.thinking, "signature": "s"}] \
                    if rep.thinking is not None else []
                content.append({"type": "text", "text": rep.text})
                body = {"id": f"msg_{number:04d}", "type": "message", "role": "assistant",
                        "model": req.get("model", "scripted"), "content": content,
                        "stop_reason": rep.stop_reason, "stop_sequence": None}
                if not rep.omit_usage:
                    body["usage"] = usage
                self._send(200, body, rep.headers)

            def _error(self, status: int, message: str, headers: dict,
                       kind: str | None = None) -> None:
                body = {"type": "error",
                        "error": {"type": kind or ERROR_TYPES.get(status, "api_error"),
                                  "message": message},
                        "request_id": f"req_{len(outer.requests):04d}"}
                self._send(status, body, headers)

            def _send(self, status: int, body: dict, headers: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.send_header("request-id", f"req_{len(outer.requests):04d}")
                for k, v in headers.items():
                    self.send_header(k, str(v))
                self.end_headers()
                self.wfile.write(raw)

        self.httpd = _Server(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever,
                                        kwargs={"poll_interval": 0.02}, daemon=True)

    def __enter__(self) -> "AnthropicServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.requests)
