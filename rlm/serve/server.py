"""``rlm serve``: an OpenAI-compatible HTTP endpoint where each chat completion is one RLM run.

Any OpenAI client (openai-python, LangChain, LlamaIndex, curl) can then use an RLM as a model.
Starlette on uvicorn, installed with ``pip install 'rlm-kernels[serve]'``.

``POST /v1/chat/completions``, the mapping (:mod:`rlm.serve.request`):

* the last ``user`` message is the query; the contents of every earlier ``system``/``developer``/
  ``user`` message, in order, form ``context`` (one string, or a list of strings when there are
  several; the query itself when there are none). A ``context`` field in the body (string, list
  or JSON object) overrides that.
* ``model``: ``rlm`` (the server's model) or ``rlm/<name>`` (``<name>`` on the server's endpoint).
* run options (depth, caps...) from the body: the object ``rlm`` (any of :data:`REMOTE_OPTIONS`),
  or the same names at the top level, except ``max_tokens`` and ``max_completion_tokens``: at
  the top level these are OpenAI's, and both cap the answer's length (tokens; a longer answer
  is cut, ``finish_reason: "length"``). Endpoint, journal and key options are the server's.
* a parameter the server cannot honour (``n`` > 1, ``tools``, ``tool_choice: "required"``,
  ``top_p`` other than 1, ``stop``, ``seed``, ...) is a 400 naming it; so is a value out of
  range, or a field the protocol does not have.
* ``Idempotency-Key`` header -> the run id: a retried request returns the recorded result (or
  resumes a crashed or cancelled run), never a second bill. Without one, an SDK's retry of a
  request (same client key and body, ``x-stainless-retry-count`` >= 1) is served by the run its
  first attempt started, in this server process (:class:`rlm.serve.runs.Attempts`).
* ``response_format``: ``{"type": "json_schema", "json_schema": {"schema": {...}}}`` becomes the
  run's ``answer_schema`` (``json_object``: any JSON object); the answer is checked JSON text.
* the response: ``id`` = the run id, ``usage`` = the whole tree's tokens over every attempt of
  the run, and an ``rlm`` object (status, iterations, calls, cost, replayed calls, seconds).
* ``stream: true``: Server-Sent Events in the protocol's chunk format: the run's stage events
  as they happen (``delta: {}`` chunks with an ``rlm_event`` object), then the answer as content,
  then a ``finish_reason`` chunk with ``usage``, then ``data: [DONE]``.
* a client that hangs up, streaming or not, cancels the run (journaled ``cancelled``,
  resumable by its key or by the SDK's retry).
* a body over ``--max-body-bytes`` is a 413 before it is read.

Errors, on every route and method, in the protocol's shape ``{"error": {"message", "type",
"param", "code"}}``: 400 bad input (``invalid_request_error``), 401 missing or wrong key, 404
unknown model or route, 405 a method the route does not take, 409 an idempotency key reused for
another question or a run still active elsewhere, 413 a body over the limit, 429 every run slot
busy (with ``Retry-After``), 402 a cost/token/call cap stopped the run (``code`` names the cap;
``error.partial_answer`` is what executed code set with FINAL before the stop, usually null), 504 the wall-clock cap, 502 the model endpoint
failed, 500 the run ended without an answer. Every one says ``x-should-retry: false`` but 429
and the 409 of a run still active (``true``), so the openai SDKs do not retry a run that ran.

An upstream failure is told in words of the server's own: the upstream's HTTP status, a short
reason, and the type and code of the upstream's error object when it sends them (e.g. ``the model
endpoint failed: HTTP 401 Unauthorized (invalid_request_error, invalid_api_key)``, with the same
in ``error.upstream``), never the upstream's own text, its URL or a hint meant for the operator:
an upstream may echo the server's key. The operator's log (logger ``rlm.serve``, stderr) keeps
the whole detail, with the server's keys and anything that looks like one (``sk-...``,
``Bearer ...``) redacted.

``GET /v1/models`` lists ``rlm`` and ``rlm/<server model>``. A key (``--api-key``, sent as
``Authorization: Bearer KEY``) is required when the server binds anything but loopback.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import time
import uuid
from typing import Any

from rlm.aio import AsyncRLM, safe_listener
from rlm.errors import ConfigError, install_hint
from rlm.config.options import SERVE
from rlm.serve.errors import APIError, Redactor, _causes, _check_result, _error_of, _public
from rlm.serve.request import (DEFAULT_MAX_BODY_BYTES, REMOTE_OPTIONS, ChatRequest, cap_answer,
                               parse_request, read_body, read_json, request_options, run_id_of)
from rlm.serve.runs import Attempts, LiveRuns, retry_count, run_info, until_disconnect, usage_of
from rlm.serve.sessions import DEFAULT_IDLE_SECONDS, ServeSessions

__all__ = ["REMOTE_OPTIONS", "create_app", "is_loopback", "request_options", "run"]

log = logging.getLogger("rlm.serve")


def is_loopback(host: str) -> bool:
    """True if ``host`` names only this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# --------------------------------------------------------------------------- results

def _completion_body(res: Any, model: str, cap: int | None = None) -> dict:
    answer, finish = cap_answer(res.answer, cap)
    return {"id": res.run_id, "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None,
            "choices": [{"index": 0, "finish_reason": finish, "logprobs": None,
                         "message": {"role": "assistant", "content": answer}}],
            "usage": usage_of(res), "rlm": run_info(res)}


def _chunk(run_id: str, model: str, delta: dict, finish: str | None = None, **extra: Any) -> str:
    body = {"id": run_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                         "logprobs": None}], **extra}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _stage_event(ev: dict) -> dict:
    st = ev.get("stage") or {}
    return {"event": ev.get("event"), "stage": st.get("id"), "kind": st.get("kind"),
            "level": st.get("level"), "from": ev.get("from"), "to": ev.get("to")}


# --------------------------------------------------------------------------- the app

class _Slots:
    """At most ``n`` runs at once; a request finding none free is refused (429), not queued."""

    def __init__(self, n: int) -> None:
        self.n, self.used = n, 0

    def take(self) -> bool:
        if self.used >= self.n:
            return False
        self.used += 1
        return True

    def give(self) -> None:
        self.used -= 1


def create_app(options: dict | None = None, *, api_key: str | None = None,
               max_concurrent_runs: int = 4, model_name: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               session_idle_seconds: float = DEFAULT_IDLE_SECONDS):
    """The Starlette app of ``rlm serve``.

    Args:
        options: the server's run options (endpoint, journal, defaults), as :class:`rlm.RLM`'s.
        api_key: the key clients must send (``Authorization: Bearer KEY``), or None for none.
        max_concurrent_runs: runs at once; more get 429 with ``Retry-After``.
        model_name: the upstream model shown by ``/v1/models`` (default ``options["model"]``).
        max_body_bytes: the largest request body (bytes); a larger one is a 413, unread.
        session_idle_seconds: a session (``rlm.session``) unused this long is closed (s);
            every session is closed when the app shuts down.
    """
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    from contextlib import asynccontextmanager
    server = _Server(dict(options or {}), api_key, max_concurrent_runs, model_name,
                     max_body_bytes, session_idle_seconds)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        await asyncio.to_thread(server.sessions.close)  # their kernels go with the server
    app = Starlette(routes=[Route("/v1/models", server.models, methods=["GET"]),
                            Route("/v1/chat/completions", server.chat, methods=["POST"])],
                    exception_handlers={HTTPException: _http_error, Exception: _crash},
                    lifespan=lifespan)
    app.state.runner = server.runner
    return app


async def _http_error(request, exc):
    """Starlette's own refusals (no such route, a method the route does not take) in the
    protocol's error shape."""
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        err = APIError(404, f"no route {request.method} {request.url.path}", code="not_found",
                       headers=headers)
    elif exc.status_code == 405:
        allowed = headers.get("Allow", "")
        err = APIError(405, f"{request.method} is not allowed on {request.url.path}"
                       + (f": use {allowed}" if allowed else ""), code="method_not_allowed",
                       headers=headers)
    else:
        err = APIError(exc.status_code, str(exc.detail), headers=headers)
    return _error_response(err)


async def _crash(request, exc):
    """An exception no route caught: a 500 in the protocol's shape (the detail in the log)."""
    log.error("%s %s: internal error", request.method, request.url.path, exc_info=exc)
    return _error_response(APIError(500, f"internal error: {type(exc).__name__}",
                                    "server_error"))


def _redactor(options: dict, api_key: str | None) -> Redactor:
    """The :class:`Redactor` of a server with run ``options`` and client key ``api_key``: its
    upstream key and URL as the options give them or as the provider's variables do, and the
    sub-call endpoint's (``sub_base_url``, ``$RLM_SUB_API_KEY``)."""
    from rlm.config.endpoint import SUB_KEY_ENV, external_endpoint
    urls = [options.get("base_url"), options.get("sub_base_url")]
    keys = [options.get("api_key"), options.get("sub_api_key"), api_key,
            os.environ.get(SUB_KEY_ENV)]
    try:
        endpoint = external_endpoint(options)
    except Exception:  # noqa: BLE001 - no model name yet: the run says so, not this
        endpoint = None
    if endpoint is not None:
        urls.append(endpoint.base_url)
        keys.append(endpoint.api_key)
    return Redactor(keys, urls)


def _error_response(err: APIError):
    from starlette.responses import JSONResponse
    return JSONResponse(err.body, status_code=err.status, headers=err.headers)


class _Server:
    """The routes of one ``rlm serve`` app: its runner, run slots, client key, model name, body
    limit, and the runs its requests started (:class:`Attempts`, :class:`LiveRuns`)."""

    def __init__(self, options: dict, api_key: str | None, max_concurrent_runs: int,
                 model_name: str | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 session_idle_seconds: float = DEFAULT_IDLE_SECONDS) -> None:
        self.runner = AsyncRLM(**options)
        self.sessions = ServeSessions(options, self.runner._sync, session_idle_seconds,
                                      self.runner.grace)
        self.options = options
        self.slots = _Slots(max(1, int(max_concurrent_runs)))
        self.api_key = api_key
        self.upstream = model_name or options.get("model")
        self.redactor = _redactor(options, api_key)
        self.max_body_bytes = int(max_body_bytes)
        self.attempts, self.live = Attempts(), LiveRuns()
        #: a retried request is told apart from a new one only through the journal
        self.journaled = options.get("journal") is not False

    def error_of(self, exc: BaseException, run_id: str) -> APIError:
        """The error response of run ``run_id`` that raised ``exc`` (:func:`_error_of`), with no
        key or upstream URL in it; a server-side failure (5xx) is logged with its whole detail,
        keys redacted, for the operator."""
        err = _error_of(exc)
        if err.status >= 500:
            detail = "".join(f"{type(e).__name__}: {e}" if i == 0 else
                             f" (from {type(e).__name__}: {e})"
                             for i, e in enumerate(_causes(exc)) if i < 2)
            log.warning("run %s: answered HTTP %d (%s); %s", run_id, err.status,
                        self.redactor.keys(err.body["error"]["message"]),
                        self.redactor.keys(detail))
        return _public(err, self.redactor)

    def authorize(self, request) -> None:
        """Raise a 401 :class:`APIError` unless the request carries the server's key."""
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        token = got[7:].strip() if got[:7].lower() == "bearer " else ""
        if not token or not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                           "invalid_request_error", code="invalid_api_key")

    def check_prices(self, req: ChatRequest) -> None:
        """A request's cost cap needs a price for every model its run calls: refused (400)
        before anything runs when the server has none."""
        if req.options.get("max_cost_usd") is None:
            return
        try:
            _check_prices_at_start({**self.options, **req.options})
        except ConfigError:
            field = req.fields.get("max_cost_usd", "max_cost_usd")
            raise APIError(400, f"{field!r} needs a price for every model the run calls, and "
                           "this server has none for its model: leave it out (and cap "
                           "'rlm.max_tokens' or 'rlm.max_calls' instead), or ask the server's "
                           "operator to add a price", param=field, code="unsupported_value") \
                from None

    async def run_id_for(self, request, raw: bytes) -> tuple[str, str | None]:
        """(run id, fingerprint to record once its run starts, or None) of a request: its
        ``Idempotency-Key``; else, for an SDK's retry, the run its first attempt started; else
        a new id. A run of the same id this server is cancelling is waited for first.

        Raises:
            APIError: 400 a bad key or a key without a journal; 409 the run is still running
            here for a client still connected (retryable), or a retry without a journal.
        """
        run_id = run_id_of(request.headers.get("idempotency-key"))
        fingerprint = None
        if run_id is not None and not self.journaled:
            raise APIError(400, "this server keeps no journal (rlm serve --no-journal), so "
                           "an Idempotency-Key cannot be honoured: send the request without "
                           "one, or run the server with a journal", param="Idempotency-Key")
        if run_id is None:
            fingerprint = Attempts.fingerprint(request.headers.get("authorization"), raw)
            if retry_count(request.headers) > 0:
                run_id = self.attempts.run_of(fingerprint)
            if run_id is not None and not self.journaled:
                raise APIError(409, "this is a retry of a request whose run already started, "
                               "and this server keeps no journal to return or resume that run "
                               "from, so it is not run twice: send the request again as a new "
                               "one", code="retry_not_joinable")
            run_id = run_id or "srv-" + uuid.uuid4().hex[:16]
        if not await self.live.settle(run_id, self.runner.grace + 5):
            raise APIError(409, "this request's run is still running for an earlier request "
                           "(a client still connected): retry once it has finished",
                           code="run_active", retryable=True)
        return run_id, fingerprint

    async def models(self, request):
        """``GET /v1/models``: ``rlm`` and ``rlm/<upstream model>``."""
        from starlette.responses import JSONResponse
        try:
            self.authorize(request)
        except APIError as err:
            return _error_response(err)
        data = [{"id": "rlm", "object": "model", "created": 0, "owned_by": "rlm"}]
        if self.upstream:
            data.append({"id": f"rlm/{self.upstream}", "object": "model", "created": 0,
                         "owned_by": "rlm"})
        return JSONResponse({"object": "list", "data": data})

    async def chat(self, request):
        """``POST /v1/chat/completions``: one RLM run (streamed when the body asks)."""
        from starlette.responses import StreamingResponse
        try:
            self.authorize(request)
            raw = await read_body(request, self.max_body_bytes)
            req = parse_request(read_json(raw))
            self.check_prices(req)
            if req.session is not None:  # the session's next question names its run
                if request.headers.get("idempotency-key"):
                    raise APIError(400, "a session's questions are named by the session "
                                   "('rlm.session'): send no Idempotency-Key with it",
                                   param="Idempotency-Key")
                run_id, fingerprint = self.sessions.run_id(req.session), None
            else:
                run_id, fingerprint = await self.run_id_for(request, raw)
            if not self.slots.take():
                raise APIError(429, f"all {self.slots.n} run slots are busy; retry later",
                               "rate_limit_error", code="rate_limit_exceeded",
                               headers={"Retry-After": "1"}, retryable=True)
        except APIError as err:
            return _error_response(err)
        if fingerprint is not None:  # a run starts: the request's retries are served by it
            self.attempts.started(fingerprint, run_id)
        if req.stream:
            return StreamingResponse(self.stream(req, run_id), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            return await self.answer(request, req, run_id)
        finally:
            self.slots.give()

    async def answer(self, request, req: ChatRequest, run_id: str):
        """The response of a run that is not streamed; a client that hangs up before it ends
        cancels it (journaled ``cancelled``, resumable)."""
        from starlette.responses import JSONResponse, Response
        task = self._start(req, run_id, dict(req.options))
        self.live.add(run_id, task)
        gone = asyncio.ensure_future(until_disconnect(request.receive))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not task.done():
            log.info("run %s: the client went away; the run is cancelled (resumable)", run_id)
            await self.live.cancel(run_id, task)
            return Response(status_code=499)  # nobody is there to read it
        try:
            res = task.result()
            _check_result(res)
        except Exception as exc:  # noqa: BLE001 - every failure is an error response
            return _error_response(self.error_of(exc, run_id))
        return JSONResponse(_completion_body(res, req.model, req.answer_cap))

    def _start(self, req: ChatRequest, run_id: str, opts: dict) -> "asyncio.Future":
        """The task of one request's run: the next question of its session, or a run."""
        if req.session is not None:
            return asyncio.ensure_future(self.sessions.ask(req.session, req,
                                                           opts.get("listeners")))
        return asyncio.ensure_future(self.runner.completion(req.context, req.query,
                                                            run_id=run_id, **opts))

    async def stream(self, req: ChatRequest, run_id: str):
        """The Server-Sent Events of one run: stage events as they happen, then the answer, the
        usage and ``[DONE]``; a client that goes away cancels the run."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_event(ev: dict) -> None:  # a run thread, under the stage tree's lock: be quick
            if ev.get("event") == "transition":
                loop.call_soon_threadsafe(events.put_nowait, _stage_event(ev))

        opts = dict(req.options)
        listeners = [*(opts.pop("listeners", None) or ()), safe_listener(on_event)]
        task = self._start(req, run_id, {**opts, "listeners": listeners})
        self.live.add(run_id, task)
        try:
            yield _chunk(run_id, req.model, {"role": "assistant", "content": ""})
            async for chunk in _relay(task, events, run_id, req.model, self.error_of,
                                      req.answer_cap):
                yield chunk
        finally:
            try:
                if not task.done():  # the client went away: cancel the run
                    await self.live.cancel(run_id, task)
            except BaseException:  # noqa: BLE001 - this generator is being cancelled too
                pass
            finally:
                self.slots.give()


async def _relay(task: "asyncio.Future", events: "asyncio.Queue", run_id: str, model: str,
                 error_of: Any = None, cap: int | None = None):
    """The chunks of a streamed run after its first: each stage event while ``task`` runs, the
    ones left when it ends, then its answer (cut to ``cap`` tokens) and usage (or its error
    event: ``error_of(exc, run_id)``, default :func:`_error_of`) and ``[DONE]``."""
    while True:
        getter = asyncio.ensure_future(events.get())
        done, _ = await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            yield _chunk(run_id, model, {}, rlm_event=getter.result())
            continue
        getter.cancel()
        break
    while not events.empty():
        yield _chunk(run_id, model, {}, rlm_event=events.get_nowait())
    try:
        res = task.result()
        _check_result(res)
    except Exception as exc:  # noqa: BLE001 - sent as the stream's error event
        err = error_of(exc, run_id) if error_of is not None else _public(_error_of(exc), Redactor())
        yield f"data: {json.dumps(err.body)}\n\n"
        return
    answer, finish = cap_answer(res.answer, cap)
    yield _chunk(run_id, model, {"content": answer})
    yield _chunk(run_id, model, {}, finish, usage=usage_of(res), rlm=run_info(res))
    yield "data: [DONE]\n\n"


def run(options: dict | None = None, *, host: str = "127.0.0.1", port: int = 8000,
        api_key: str | None = None, max_concurrent_runs: int = 4,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        session_idle_seconds: float = DEFAULT_IDLE_SECONDS) -> None:
    """Serve until interrupted (uvicorn), on ``host``:``port`` (``port`` 0: a free port, the
    one taken is printed); arguments as :func:`create_app`'s.

    Raises:
        ConfigError: bound beyond loopback without a key, the ``serve`` extra is missing, or
        the address cannot be listened on (a port another process holds, an address this
        machine does not have).
    """
    if not is_loopback(host) and not api_key:
        raise ConfigError(f"rlm serve on {host} (not loopback) needs --api-key KEY "
                          "(or RLM_SERVE_API_KEY): anyone who reaches it could spend your budget")
    try:
        import uvicorn
    except ImportError:
        raise ConfigError(f"rlm serve needs the serve extra: {install_hint('serve')}") \
            from None
    app = create_app(options, api_key=api_key, max_concurrent_runs=max_concurrent_runs,
                     max_body_bytes=max_body_bytes, session_idle_seconds=session_idle_seconds)
    # what the process logs (the runs' retries and failures quote the upstream) has its keys
    # redacted, whichever logger it comes from
    redact = _redactor(dict(options or {}), api_key).record
    for handler in logging.getLogger().handlers:
        handler.addFilter(redact)
    import sys
    shown = f"[{host}]" if ":" in host else host  # an IPv6 address, as URLs write it
    # bound here rather than by uvicorn: a port in use is a clear error (uvicorn logs it and
    # exits 1), and with --port 0 the port the system chose can be printed
    sock = _bind(host, port, shown)
    port = sock.getsockname()[1]
    print(f"rlm serve: http://{shown}:{port}/v1 (model 'rlm'"
          f"{', key required' if api_key else ''})", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM once uvicorn has shut down: a normal stop
        pass


def _bind(host: str, port: int, shown: str):
    """A TCP socket bound to ``host``:``port`` (IPv6 for an address with a colon) and
    listening, for uvicorn to serve on.

    Raises:
        ConfigError: it cannot be bound (naming the address and what to do).
    """
    import errno
    import socket
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        # listening before the address is printed: a client that connects on reading it
        # waits in the backlog until uvicorn accepts, rather than being refused
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        hint = {errno.EADDRINUSE: "another process is listening there: choose another "
                                  "--port (0: any free port)",
                errno.EADDRNOTAVAIL: "this machine has no such address: check --host",
                errno.EACCES: "ports below 1024 need privileges: choose --port 1024 or above"
                }.get(exc.errno, "check --host and --port")
        raise ConfigError(f"rlm serve cannot listen on {shown}:{port}: "
                          f"{exc.strerror or exc}; {hint}") from None
    except BaseException:
        sock.close()
        raise
    return sock


# --------------------------------------------------------------------------- the command

def _check_prices_at_start(o: dict) -> None:
    """What every request would fail on is refused at start (exit 2), not blamed on clients
    with a 400 each time: an endpoint without a model name, an unreadable or malformed price
    file, and with a cost cap a model without a price. Raises ConfigError."""
    from harness.budget.accountant import Accountant, Budget
    from harness.budget.prices import PriceTable

    from rlm.config.endpoint import external_endpoint
    endpoint = external_endpoint(o)  # raises for a URL or key without a model name
    try:
        prices = PriceTable.from_file(o["price_file"]) if o.get("price_file") else PriceTable()
    except Exception as exc:  # a missing or malformed price file
        raise ConfigError(str(exc)) from None
    if o.get("max_cost_usd") is None or endpoint is None:  # the embedded model: local, free
        return
    try:
        Accountant(Budget(max_cost_usd=o["max_cost_usd"]), prices).check_prices(
            {m for m in (endpoint.model, o.get("sub_model"), o.get("child_model")) if m})
    except Exception as exc:  # UnknownPrice
        raise ConfigError(str(exc).replace("(CLI: --price-file PATH; API: price_file=PATH)",
                                           "(rlm serve --price-file PATH)")) from None


def add_arguments(p: Any) -> None:
    """The flags of ``rlm serve``: the server's own (address, client key, run slots, the upstream
    key), then the run defaults and the journal from the option registry
    (:data:`rlm.config.options.SERVE_OPTIONS`), as ``rlm run`` declares them."""
    from rlm.config.argtypes import whole_number
    from rlm.config.flags import add_arguments as add_registry_flags
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; "
                   "anything but loopback needs --api-key)")
    p.add_argument("--port", type=whole_number(0, 65535, "a TCP port"), default=8000,
                   help="TCP port, 0-65535 (default 8000; 0: any free port)")
    p.add_argument("--api-key", default=os.environ.get("RLM_SERVE_API_KEY"), metavar="KEY",
                   help="key clients must send as 'Authorization: Bearer KEY' "
                        "(env RLM_SERVE_API_KEY, preferred: a flag's value is hidden from the "
                        "process list only once read)")
    p.add_argument("--max-concurrent-runs", type=whole_number(1), default=4, metavar="N",
                   help="runs at once; further requests get 429 with Retry-After (default 4)")
    p.add_argument("--max-body-bytes", type=whole_number(1), default=DEFAULT_MAX_BODY_BYTES,
                   metavar="N", help="largest request body in bytes; a larger one is answered "
                   f"413 before it is read (default {DEFAULT_MAX_BODY_BYTES}: 64 MiB)")
    p.add_argument("--session-idle-timeout", type=whole_number(1), default=DEFAULT_IDLE_SECONDS,
                   metavar="S", help="a session (a request's 'rlm': {'session': ID}) unused "
                   f"this many seconds is closed, its kernel shut down (default "
                   f"{DEFAULT_IDLE_SECONDS:g})")
    p.add_argument("--upstream-api-key", metavar="KEY",
                   help="API key of the model endpoint the runs use (env OPENAI_API_KEY, "
                        "preferred: a flag's value is hidden from the process list only once "
                        "read)")
    add_registry_flags(p, SERVE)


def main(args: Any) -> int:
    """``rlm serve``: serve until Ctrl-C; returns the exit code. The journal is opened here,
    once, and shared by every run (a :class:`harness.journal.Journal` is safe across threads).

    Raises:
        ConfigError: a bad option, an unpriced model under a cost cap, an unreachable journal.
    """
    from rlm.config.flags import options_from_args
    from rlm.config.validate import validate_options
    from rlm.config.records import open_journal
    o = options_from_args(args, SERVE)
    if args.upstream_api_key:
        o["api_key"] = args.upstream_api_key
    if o.get("price_file"):  # the runs read it from wherever they run
        o["price_file"] = os.path.abspath(os.path.expanduser(o["price_file"]))
    validate_options(o)
    if o.get("tools"):  # a bad --tool fails at start, not at the first request
        from rlm.tools import as_tools
        o["tools"] = list(as_tools(o["tools"]))
    _check_prices_at_start(o)
    journal = open_journal(o.get("journal"), durability=o.get("journal_durability"))
    o["journal"] = journal if journal is not None else False
    try:
        run(o, host=args.host, port=args.port, api_key=args.api_key,
            max_concurrent_runs=args.max_concurrent_runs, max_body_bytes=args.max_body_bytes,
            session_idle_seconds=args.session_idle_timeout)
    finally:
        if journal is not None:
            journal.close()
    return 0
