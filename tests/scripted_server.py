"""A real HTTP server on 127.0.0.1 speaking the OpenAI chat-completions protocol.

Replies are scripted: a ``responder(request_json) -> Reply | str`` decides each
answer, so tests drive the real ``openai`` client through real sockets. Every
request is recorded (``server.requests``) for assertions such as "the refused
calls never reached the server".
"""
from __future__ import annotations

import json
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable


@dataclass
class Reply:
    """One scripted answer: ``content`` with HTTP ``status`` (200, 429, 500...).

    ``delay`` seconds before answering; ``headers`` extra (e.g. Retry-After);
    ``usage`` overrides the default usage (prompt tokens ~ chars/4); ``omit_usage`` sends a
    reply with no ``usage`` at all (as some endpoints do); ``finish_reason`` is sent as is
    (``"length"``: the reply was cut at the output-token limit); ``message`` adds fields to the
    reply's message (e.g. ``{"reasoning_content": "..."}``); ``error`` adds fields to an error
    reply's ``error`` object (e.g. ``{"param": "max_tokens", "code": "unsupported_parameter"}``).
    """

    content: str = ""
    status: int = 200
    delay: float = 0.0
    headers: dict = field(default_factory=dict)
    usage: dict | None = None
    cost: float | None = None
    omit_usage: bool = False
    # ways a server holds a call open: never answer (until the server stops), close the
    # connection with a reset and no answer, or send the answer (status line, headers and body)
    # one byte every ``trickle`` seconds
    hang: bool = False
    reset: bool = False
    trickle: float = 0.0
    finish_reason: str | None = "stop"
    message: dict = field(default_factory=dict)
    error: dict = field(default_factory=dict)
    # a whole JSON body sent as it is with ``status`` (a 200 carrying an error object)
    body: dict | None = None


def last_user(req: dict) -> str:
    msgs = req.get("messages") or []
    for m in reversed(msgs):
        if m.get("role") == "user":
            return str(m.get("content") or "")
    return ""


def system_text(req: dict) -> str:
    msgs = req.get("messages") or []
    return str(msgs[0].get("content") or "") if msgs and msgs[0].get("role") == "system" else ""


class _Server(ThreadingHTTPServer):
    """A client that hung up (a cut timeout, a cancelled call) is expected here, not an error:
    its reset is not printed, so it cannot land in a later test's captured stderr."""

    def handle_error(self, request, client_address) -> None:
        import sys
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)


class ScriptedServer:
    """Start with ``with ScriptedServer(responder) as srv: srv.base_url``.

    Args:
        responder: called for every POST to ``/v1/chat/completions`` with the
            parsed JSON body; returns a :class:`Reply` or a plain string.
        latency: seconds added to every reply.
    """

    def __init__(self, responder: Callable[[dict], Reply | str], latency: float = 0.0) -> None:
        self.responder = responder
        self.latency = latency
        self.requests: list[dict] = []
        self.usages: list[dict] = []
        self.call_ids: list[str | None] = []  # X-RLM-Call-Id of each request, in arrival order
        self.auth: list[str | None] = []  # the Authorization header of each request
        self._lock = threading.Lock()
        self._closing = threading.Event()
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # no 40 ms delayed-ACK stalls on keep-alive

            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):
                body = json.dumps({"object": "list", "data": [{"id": "scripted", "object": "model"}]})
                self._send(200, body.encode(), {})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                req = json.loads(self.rfile.read(n) or b"{}")
                with outer._lock:
                    outer.requests.append(req)
                    outer.call_ids.append(self.headers.get("X-RLM-Call-Id"))
                    outer.auth.append(self.headers.get("Authorization"))
                try:
                    # the responder also sees the call id header as "_call_id", the client's
                    # (host, port) as "_peer" (which connection the request came on) and the
                    # Authorization header as "_auth" (which credentials: which process)
                    rep = outer.responder(dict(req, _call_id=self.headers.get("X-RLM-Call-Id"),
                                               _peer=self.client_address,
                                               _auth=self.headers.get("Authorization")))
                except Exception as exc:  # a bug in a test's script: make it loud
                    rep = Reply(content=f"responder error: {exc!r}", status=500)
                if isinstance(rep, str):
                    rep = Reply(content=rep)
                if outer.latency or rep.delay:
                    time.sleep(outer.latency + rep.delay)
                if rep.hang:
                    outer._closing.wait()
                    self.close_connection = True
                    return
                if rep.reset:
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                               struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                self._trickle = rep.trickle
                if rep.body is not None:
                    self._send(rep.status, json.dumps(rep.body).encode(), rep.headers)
                    return
                if rep.status != 200:
                    err = {"message": rep.content or "scripted error", "type": "scripted",
                           "code": rep.status}
                    err.update(rep.error)
                    body = json.dumps({"error": err})
                    self._send(rep.status, body.encode(), rep.headers)
                    return
                prompt_chars = sum(len(str(m.get("content") or "")) for m in req.get("messages", []))
                usage = rep.usage or {"prompt_tokens": max(1, prompt_chars // 4),
                                      "completion_tokens": max(1, len(rep.content) // 4)}
                usage = dict(usage)
                pt, ct = usage.get("prompt_tokens"), usage.get("completion_tokens")
                if isinstance(pt, int) and isinstance(ct, int):
                    usage["total_tokens"] = pt + ct
                if rep.cost is not None:
                    usage["cost"] = rep.cost
                with outer._lock:
                    outer.usages.append({} if rep.omit_usage else usage)
                message = {"role": "assistant", "content": rep.content}
                message.update(rep.message)
                body = {
                    "id": f"chatcmpl-{len(outer.requests)}", "object": "chat.completion",
                    "created": int(time.time()), "model": req.get("model", "scripted"),
                    "choices": [{"index": 0, "finish_reason": rep.finish_reason,
                                 "message": message}],
                }
                if not rep.omit_usage:
                    body["usage"] = usage
                self._send(200, json.dumps(body).encode(), rep.headers)

            def _send(self, status, body, headers):
                if getattr(self, "_trickle", 0.0):
                    raw = (f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                           f"Content-Length: {len(body)}\r\n"
                           + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                           + "\r\n").encode() + body
                    for i in range(len(raw)):
                        if outer._closing.wait(self._trickle):
                            break
                        try:
                            self.wfile.write(raw[i:i + 1])
                            self.wfile.flush()
                        except OSError:
                            break
                    self.close_connection = True
                    return
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for k, v in headers.items():
                    self.send_header(k, str(v))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = _Server(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "ScriptedServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.requests)


#: The 400s OpenAI's API sends to reasoning models (o1/o3/o4-mini/gpt-5) for the parameters
#: they reject, as published: ``max_tokens`` (use ``max_completion_tokens``) and any
#: ``temperature`` but the default 1.
UNSUPPORTED_MAX_TOKENS = Reply(
    status=400, content="Unsupported parameter: 'max_tokens' is not supported with this model. "
                        "Use 'max_completion_tokens' instead.",
    error={"type": "invalid_request_error", "param": "max_tokens",
           "code": "unsupported_parameter"})
UNSUPPORTED_TEMPERATURE = Reply(
    status=400, content="Unsupported value: 'temperature' does not support 0.0 with this model. "
                        "Only the default (1) value is supported.",
    error={"type": "invalid_request_error", "param": "temperature", "code": "unsupported_value"})


def reasoning_endpoint(responder: Callable[[dict], Reply | str]) -> Callable[[dict], Reply | str]:
    """Wrap ``responder`` so requests behave like OpenAI's reasoning models: ``max_tokens``
    and a temperature other than 1 are answered with those 400s."""
    def wrapped(req: dict):
        if "max_tokens" in req:
            return UNSUPPORTED_MAX_TOKENS
        if req.get("temperature") not in (None, 1, 1.0):
            return UNSUPPORTED_TEMPERATURE
        return responder(req)
    return wrapped


def prompt_tokens_of(req: dict) -> int:
    """A request's prompt size as this server counts it: characters of every message / 4."""
    return sum(len(str(m.get("content") or "")) for m in req.get("messages") or []) // 4


def context_length_exceeded(window: int, prompt: int, completion: int) -> Reply:
    """OpenAI's 400 for a request past the model's window (``context_length_exceeded``), with
    its published wording."""
    return Reply(status=400, content=(
        f"This model's maximum context length is {window} tokens. However, you requested "
        f"{prompt + completion} tokens ({prompt} in the messages, {completion} in the "
        "completion). Please reduce the length of the messages or completion."),
        error={"type": "invalid_request_error", "param": "messages",
               "code": "context_length_exceeded"})


class WindowedEndpoint:
    """Wrap ``responder`` so the endpoint has a window of ``window`` tokens: a request whose
    prompt (characters / 4) plus its ``max_tokens`` passes it gets OpenAI's 400
    ``context_length_exceeded`` (:func:`context_length_exceeded`) and never reaches
    ``responder``. ``rejected`` lists the sizes refused (prompt + completion, tokens)."""

    def __init__(self, responder: Callable[[dict], Reply | str], window: int) -> None:
        self.responder, self.window = responder, window
        self.rejected: list[int] = []

    def __call__(self, req: dict):
        prompt = prompt_tokens_of(req)
        completion = int(req.get("max_tokens") or req.get("max_completion_tokens") or 0)
        if prompt + completion > self.window:
            self.rejected.append(prompt + completion)
            return context_length_exceeded(self.window, prompt, completion)
        return self.responder(req)
