"""``rlm serve`` is one request, one run, whatever the client does.

The real ``openai`` client at its default retry settings (it retries timeouts, connection
errors, 408, 409, 429 and 5xx twice unless told ``x-should-retry: false``), plus raw HTTP on a
socket for what a client library would not send. One ``rlm serve`` subprocess (the real CLI,
uvicorn, a SQLite journal, a 1 MiB body limit) in front of the scripted OpenAI-protocol server;
real kernels. A paid run is told by the ``X-RLM-Call-Id`` header of the calls that reach the
upstream (``<run id>/<stage id>``): one client call must reach it under one run id, and no call
id twice.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from urllib.parse import unquote

import openai
import pytest

from conftest import API_KEY, MODEL, clean_env, closed_port, is_root, repl
from scripted_server import Reply, ScriptedServer

KEY = "sk-serve-clients"
LIMIT = 1 << 20  # --max-body-bytes of the server under test


class Upstream:
    def __init__(self) -> None:
        self.responder = lambda req: repl("FINAL('unset')")

    def __call__(self, req):
        return self.responder(req)


class Served:
    """The serve process, its upstream, its address and its journal."""

    def __init__(self, proc, srv: ScriptedServer, up: Upstream, port: int, journal) -> None:
        self.proc, self.srv, self.up, self.port = proc, srv, up, port
        self.base = f"http://127.0.0.1:{port}/v1"
        self.journal_path = journal
        from harness.journal import Journal
        self.journal = Journal(str(journal))

    def client(self, **kw) -> openai.OpenAI:
        """The openai client at its default retries (``max_retries`` is not touched)."""
        return openai.OpenAI(base_url=self.base, api_key=KEY, timeout=kw.pop("timeout", 90),
                             **kw)

    def mark(self) -> int:
        return self.srv.count

    def runs_since(self, mark: int) -> Counter:
        """Upstream calls since ``mark``, counted by the run id they were sent for."""
        with self.srv._lock:
            ids = list(self.srv.call_ids[mark:])
        return Counter(unquote(c).split("/", 1)[0] for c in ids if c)

    def call_ids_since(self, mark: int) -> list[str]:
        with self.srv._lock:
            return [unquote(c) for c in self.srv.call_ids[mark:] if c]

    def state(self, run_id: str) -> str | None:
        rec = self.journal.get_run(run_id)
        return rec and rec["state"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-clients")
    up = Upstream()
    srv = ScriptedServer(up)
    srv._thread = threading.Thread(target=srv.httpd.serve_forever,
                                   kwargs={"poll_interval": 0.02}, daemon=True)
    srv.__enter__()
    port = closed_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlm", "serve", "--port", str(port), "--api-key", KEY,
         "--max-concurrent-runs", "3", "--max-body-bytes", str(LIMIT), "--max-attempts", "1",
         "--kernel-seed", "7",
         "--base-url", srv.base_url, "--upstream-api-key", API_KEY, "--model", MODEL,
         "--journal", str(tmp / "j.sqlite3")],
        env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp)
    s = Served(proc, srv, up, port, tmp / "j.sqlite3")
    deadline = time.monotonic() + 60
    while True:
        try:
            if raw(s, "GET", "/v1/models")[0] == 200:
                break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"rlm serve did not start: {proc.stderr.read().decode()}")
        time.sleep(0.1)
    yield s
    proc.terminate()
    proc.wait(timeout=30)
    srv.__exit__(None, None, None)


def raw(s: Served, method: str, path: str, body: bytes | None = None,
        headers: dict | None = None, timeout: float = 60) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 request on a fresh socket: (status, headers lower-cased, body)."""
    head = {"Host": "127.0.0.1", "Authorization": f"Bearer {KEY}", "Connection": "close",
            **({"Content-Type": "application/json", "Content-Length": str(len(body))}
               if body is not None else {}), **(headers or {})}
    with socket.create_connection(("127.0.0.1", s.port), timeout=timeout) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\n".encode()
                     + "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode() + b"\r\n"
                     + (body or b""))
        return _response(sock, method)


def _response(sock: socket.socket, method: str = "POST") -> tuple[int, dict, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        got = sock.recv(65536)
        if not got:
            break
        data += got
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    n = int(hdrs.get("content-length", "0")) if method != "HEAD" else 0
    while len(rest) < n:
        got = sock.recv(65536)
        if not got:
            break
        rest += got
    return status, hdrs, rest


def ask(client, content="What is the code?", **kw):
    return client.chat.completions.create(
        model="rlm", messages=[{"role": "system", "content": "The code is 7 4 2."},
                               {"role": "user", "content": content}], **kw)


def turn(req: dict) -> int:
    """Which root turn a request is (1 for the first)."""
    return sum(1 for m in req["messages"] if m["role"] == "user")


def steps(n: int, delay: float, answer: str = "done"):
    """A responder: ``n`` root turns of ``delay`` seconds each, the last one FINAL(answer)."""
    def responder(req):
        if not is_root(req):
            return "sub"
        k = turn(req)
        return Reply(repl(f"step = {k}") if k < n else repl(f"FINAL({answer!r})"), delay=delay)
    return responder


def wait_for(pred, timeout: float = 60, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# --------------------------------------------------------------------------- one call, one run

def _no_final(req):
    return repl("print('still looking')") if is_root(req) else "sub"


def _sleeps(req):
    return repl("import time", "time.sleep(8)")


@pytest.mark.parametrize("outcome, extra, status, error", [
    ("no answer", {"max_iterations": 1}, 500, openai.InternalServerError),
    ("wall cap", {"max_wall_seconds": 1}, 504, openai.InternalServerError),
    ("upstream failed", {}, 502, openai.InternalServerError),
    ("calls cap", {"max_calls": 1}, 402, openai.APIStatusError),
])
def test_a_run_that_did_not_answer_is_not_retried_into_more_runs(served, outcome, extra,
                                                                  status, error):
    # the example: a 500 (no answer) and a 504 (wall cap) were retried twice by the SDK, three
    # paid runs per client call
    served.up.responder = {"no answer": _no_final, "wall cap": _sleeps,
                           "upstream failed": lambda req: Reply(status=503),
                           "calls cap": _no_final}[outcome]
    mark = served.mark()
    t0 = time.monotonic()
    with pytest.raises(error) as exc:
        ask(served.client(), extra_body={"rlm": extra})
    assert exc.value.status_code == status, exc.value.body
    runs = served.runs_since(mark)
    assert len(runs) == 1, runs  # one paid run, not three
    assert exc.value.response.headers.get("x-should-retry") == "false"
    run_id = next(iter(runs))
    assert served.state(run_id) in ("failed", "budget_exceeded")
    # no executed FINAL: no answer, in the response and the journal (never the last reply)
    assert served.journal.get_run(run_id)["answer"] is None
    if status == 402:
        assert exc.value.body["partial_answer"] is None, exc.value.body
    calls = served.call_ids_since(mark)
    assert len(calls) == len(set(calls))
    assert time.monotonic() - t0 < 20  # no retry backoff on top


def test_the_run_options_serve_shares_with_run_reach_its_runs(served):
    # --kernel-seed (one of the run options serve lacked): the served run's kernel draws what
    # a run with kernel_seed=7 draws, and the journal records the seed with the run
    served.up.responder = lambda req: repl("import random", "FINAL(repr(random.random()))")
    reply = ask(served.client())
    served_answer = reply.choices[0].message.content
    import rlm
    direct = rlm.completion("ctx", "q", base_url=served.srv.base_url, api_key=API_KEY,
                            model=MODEL, kernel_seed=7, journal=False)
    assert served_answer == direct.answer, (served_answer, direct.answer)
    other = rlm.completion("ctx", "q", base_url=served.srv.base_url, api_key=API_KEY,
                           model=MODEL, kernel_seed=8, journal=False)
    assert other.answer != served_answer
    assert served.journal.get_run(reply.id)["options"]["kernel_seed"] == 7


def test_a_conflicting_idempotency_key_is_refused_once(served):
    served.up.responder = lambda req: repl("FINAL('first')")
    client = served.client()
    assert ask(client, extra_headers={"Idempotency-Key": "clients-409"}).choices[0] \
        .message.content == "first"
    with pytest.raises(openai.ConflictError) as exc:
        ask(client, "another question", extra_headers={"Idempotency-Key": "clients-409"})
    assert exc.value.response.headers.get("x-should-retry") == "false"
    assert "Idempotency-Key 'clients-409'" in exc.value.body["message"]
    assert "run id" not in exc.value.body["message"]


def test_a_client_timeout_retried_by_the_sdk_resumes_the_same_run(served):
    # the SDK retries a timed-out request with the same body: each retry is served by the
    # run its first attempt started (resumed, recorded calls not sent again)
    served.up.responder = steps(8, 0.6, "after retries")
    mark = served.mark()
    client = served.client(timeout=3.0)
    try:
        answer = ask(client, "slow question").choices[0].message.content
    except openai.APITimeoutError:
        answer = None
    runs = served.runs_since(mark)
    assert len(runs) == 1, runs
    run_id = next(iter(runs))
    calls = served.call_ids_since(mark)
    assert len(calls) == len(set(calls)), Counter(calls).most_common(3)
    if answer is None:  # the client gave up: its run is cancelled, and resumable
        wait_for(lambda: served.state(run_id) == "cancelled", what="the run cancelled")
        r = ask(served.client(), "slow question", extra_headers={"Idempotency-Key": run_id})
        answer = r.choices[0].message.content
        assert r.model_extra["rlm"]["replayed_calls"] > 0
    assert answer == "after retries"
    calls = served.call_ids_since(mark)
    assert len(calls) == len(set(calls)) and len(served.runs_since(mark)) == 1


# --------------------------------------------------------------------------- hang-ups

def _body(content: str) -> bytes:
    return json.dumps({"model": "rlm", "messages": [{"role": "user", "content": content}]}) \
        .encode()


@pytest.mark.parametrize("keyed", [False, True])
def test_a_non_streaming_client_that_hangs_up_cancels_its_run(served, keyed):
    # the example: 9 more upstream calls went out after the disconnect
    served.up.responder = steps(40, 0.3, "resumed")
    mark = served.mark()
    content = f"hang up {'keyed' if keyed else 'bare'}"
    body = _body(content)
    key = {"Idempotency-Key": f"hangup-{time.time_ns()}"} if keyed else {}
    head = {"Host": "127.0.0.1", "Authorization": f"Bearer {KEY}",
            "Content-Type": "application/json", "Content-Length": str(len(body)), **key}
    sock = socket.create_connection(("127.0.0.1", served.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n"
                 + "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode() + b"\r\n" + body)
    wait_for(lambda: served.mark() >= mark + 3, what="three upstream calls")
    sock.close()
    run_id = next(iter(served.runs_since(mark)))
    wait_for(lambda: served.state(run_id) == "cancelled", 40, "the run journaled cancelled")
    sent = served.mark()
    time.sleep(1.5)
    assert served.mark() == sent  # nothing goes out after the run is cancelled
    assert sent - mark <= 5, sent - mark  # at most the calls in flight at the hang-up
    # resumable: its run id as the key, the recorded calls served, not sent again
    served.up.responder = steps(5, 0.0, "resumed")
    if keyed:
        assert run_id == key["Idempotency-Key"]
    r = served.client().chat.completions.create(
        model="rlm", messages=[{"role": "user", "content": content}],
        extra_headers={"Idempotency-Key": run_id})
    assert r.choices[0].message.content == "resumed" and r.id == run_id
    assert r.model_extra["rlm"]["replayed_calls"] >= 3
    calls = served.call_ids_since(mark)
    assert len(calls) == len(set(calls))


def test_a_streaming_client_that_hangs_up_cancels_its_run_and_usage_counts_every_attempt(
        served):
    # the example: after a resumed request, usage reported 0 calls and 0 tokens (only what
    # the last attempt sent)
    served.up.responder = steps(40, 0.3, "streamed")
    client = served.client()
    key = {"Idempotency-Key": f"stream-hangup-{time.time_ns()}"}
    mark, u0 = served.mark(), len(served.srv.usages)
    stream = ask(client, "stream then hang up", stream=True, extra_headers=key)
    for _ in stream:
        if served.mark() >= mark + 3:
            break
    stream.close()
    run_id = key["Idempotency-Key"]
    wait_for(lambda: served.state(run_id) == "cancelled", 40, "the run journaled cancelled")
    sent = served.mark()
    time.sleep(1.5)
    assert served.mark() == sent
    served.up.responder = steps(6, 0.0, "streamed")
    r = ask(client, "stream then hang up", extra_headers=key)
    assert r.choices[0].message.content == "streamed"
    with served.srv._lock:
        used = served.srv.usages[u0:]
    assert r.model_extra["rlm"]["calls"] == len(served.call_ids_since(mark)) == 6
    assert r.usage.prompt_tokens == sum(u["prompt_tokens"] for u in used)
    assert r.usage.completion_tokens == sum(u["completion_tokens"] for u in used)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    again = ask(client, "stream then hang up", extra_headers=key)  # the recorded result
    assert again.usage == r.usage and again.model_extra["rlm"]["calls"] == 6
    chunks = list(ask(client, "stream then hang up", stream=True, extra_headers=key))
    assert chunks[-1].usage == r.usage


# --------------------------------------------------------------------------- parameters

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("extra, param, code, words", [
    ({"n": 2}, "n", "unsupported_parameter", "one run with one answer"),
    ({"tools": [TOOL], "tool_choice": "required"}, "tools", "unsupported_parameter", "tool call"),
    ({"tool_choice": "required"}, "tool_choice", "unsupported_parameter", "tool call"),
    ({"top_p": 7}, "top_p", "invalid_value", "must be a number from 0 to 1, got 7"),
    ({"top_p": 0.5}, "top_p", "unsupported_parameter", "temperature alone"),
    ({"frequency_penalty": 3}, "frequency_penalty", "invalid_value", "from -2 to 2"),
    ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter", "temperature"),
    ({"logprobs": True}, "logprobs", "unsupported_parameter", "log probabilities"),
    ({"stop": ["\nObservation:"]}, "stop", "unsupported_parameter", "stop sequence"),
    ({"seed": 7}, "seed", "unsupported_parameter", "Idempotency-Key"),
    ({"logit_bias": {"42": 5}}, "logit_bias", "unsupported_parameter", "temperature"),
    ({"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter", "text only"),
    ({"n": 0}, "n", "invalid_value", "whole number from 1"),
    ({"temperature": 7}, "temperature", "invalid_value", "'temperature' must be >= 0 and <= 2"),
    ({"rlm": {"max_depth": 99}}, "rlm.max_depth", "invalid_value",
     "'rlm.max_depth' must be >= 0 and <= 8, got 99"),
    ({"max_depth": "2"}, "max_depth", "invalid_value", "'max_depth' must be a finite number"),
    ({"rlm": {"cell_timeout": -1}}, "rlm.cell_timeout", "invalid_value", "must be > 0"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value", "whole number from 1"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", "invalid_value",
     "both cap the answer's length"),
    ({"stream": "yes"}, "stream", "invalid_value", "true or false"),
    ({"frobnicate": 1}, "frobnicate", "unknown_parameter", "unrecognized request field"),
    ({"rlm": {"max_cost_usd": 1}}, "rlm.max_cost_usd", "unsupported_value", "needs a price"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "invalid_value", "not a valid JSON Schema"),
])
def test_a_parameter_the_server_cannot_honour_is_a_400_naming_it(served, extra, param, code,
                                                                  words):
    # the example: n=2 returned one choice, tools with tool_choice "required" returned text
    # with finish_reason "stop", top_p 7 was accepted
    mark = served.mark()
    with pytest.raises(openai.BadRequestError) as exc:
        ask(served.client(), extra_body=extra)
    err = exc.value.body
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err
    assert words in err["message"], err["message"]
    assert "--" not in err["message"], err["message"]  # request fields, not CLI flags
    assert served.mark() == mark  # nothing ran, nothing paid


def test_parameters_that_ask_for_nothing_are_taken(served):
    served.up.responder = lambda req: repl("FINAL('plain')")
    r = ask(served.client(), n=1, top_p=1, tool_choice="none", logprobs=False, stop=[],
            presence_penalty=0, user="u-1", metadata={"k": "v"}, store=False,
            frequency_penalty=0, temperature=0.2, parallel_tool_calls=True,
            extra_body={"max_depth": 1})
    assert r.choices[0].message.content == "plain" and len(r.choices) == 1


def test_max_tokens_and_max_completion_tokens_cap_the_answer_only(served):
    # the example: a top-level max_completion_tokens (LangChain's max_tokens=300) became every
    # inner model call's output cap
    served.up.responder = lambda req: repl("FINAL('one two three four five six seven eight')")
    client = served.client()
    mark = served.mark()
    r = ask(client, max_completion_tokens=300)
    assert r.choices[0].message.content == "one two three four five six seven eight"
    assert r.choices[0].finish_reason == "stop"
    with served.srv._lock:
        caps = {q.get("max_tokens") or q.get("max_completion_tokens")
                for q in served.srv.requests[mark:]}
    assert caps and 300 not in caps, caps  # the inner calls keep their own cap
    for kw in ({"max_tokens": 3}, {"max_completion_tokens": 3}):
        r = ask(client, **kw)
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].message.content == "one two three"
    chunks = list(ask(client, max_tokens=3, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        "one two three"
    assert chunks[-1].choices[0].finish_reason == "length"
    # the inner calls' cap is the rlm object's max_completion_tokens
    mark = served.mark()
    ask(client, "own cap", extra_body={"rlm": {"max_completion_tokens": 300}})
    with served.srv._lock:
        caps = {q.get("max_tokens") or q.get("max_completion_tokens")
                for q in served.srv.requests[mark:]}
    assert caps == {300}, caps


# --------------------------------------------------------------------------- the body limit

def _vmhwm(pid: int) -> int:
    """Peak resident memory of process ``pid`` (kB)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM"))


def test_a_body_over_the_limit_is_413_before_it_is_read(served):
    # the example: a 512 MB body was read whole (1.1 GB of memory) before the 400
    before = _vmhwm(served.proc.pid)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nAuthorization: Bearer " + KEY.encode() + b"\r\nContent-Length: "
            + str(512 << 20).encode() + b"\r\n\r\n")
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
        sock.sendall(head)  # and not one byte of the body
        status, hdrs, body = _response(sock)
    assert status == 413 and time.monotonic() - t0 < 5
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large" and str(LIMIT) in err["message"]
    assert hdrs.get("x-should-retry") == "false"
    assert _vmhwm(served.proc.pid) - before < 20_000  # kB: nothing of it was buffered


def test_a_chunked_body_is_cut_at_the_limit(served):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nAuthorization: Bearer " + KEY.encode() + b"\r\nTransfer-Encoding: chunked"
            b"\r\n\r\n")
    piece = b"x" * (64 << 10)
    sent = 0
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
        sock.sendall(head)
        sock.settimeout(0.05)
        reply = b""
        while sent < 64 * LIMIT and not reply:
            try:
                sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                sent += len(piece)
                reply = sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                break
        sock.settimeout(30)
        while b"request_too_large" not in reply:
            got = sock.recv(65536)
            if not got:
                break
            reply += got
    assert reply.startswith(b"HTTP/1.1 413"), reply[:80]
    assert sent < 4 * LIMIT, sent  # cut near the limit, not read to the end
    assert b'"code": "request_too_large"' in reply or b'"code":"request_too_large"' in reply


def test_the_openai_client_gets_the_413_of_a_context_over_the_limit(served):
    mark = served.mark()
    with pytest.raises(openai.APIStatusError) as exc:
        ask(served.client(), "q", extra_body={"context": "x" * (2 * LIMIT)})
    assert exc.value.status_code == 413 and exc.value.body["code"] == "request_too_large"
    assert served.mark() == mark
    # just under the limit is served
    served.up.responder = lambda req: repl("FINAL(str(len(context)))")
    r = ask(served.client(), "q", extra_body={"context": "x" * (LIMIT - 4096)})
    assert r.choices[0].message.content == str(LIMIT - 4096)


# --------------------------------------------------------------------------- error shapes

@pytest.mark.parametrize("method, path, status, code", [
    ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
    ("PUT", "/v1/chat/completions", 405, "method_not_allowed"),
    ("OPTIONS", "/v1/chat/completions", 405, "method_not_allowed"),
    ("POST", "/v1/models", 405, "method_not_allowed"),
    ("DELETE", "/v1/models", 405, "method_not_allowed"),
    ("GET", "/", 404, "not_found"),
    ("PATCH", "/v1/completions", 404, "not_found"),
    ("DELETE", "/v1/responses/abc", 404, "not_found"),
])
def test_every_method_and_route_answers_errors_in_the_openai_shape(served, method, path,
                                                                   status, code):
    got, hdrs, body = raw(served, method, path, b"{}" if method in ("POST", "PUT") else None)
    assert got == status
    assert hdrs["content-type"].startswith("application/json"), hdrs
    err = json.loads(body)["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == code, err
    assert err["type"] == "invalid_request_error" and path in err["message"]
    if status == 405:
        assert hdrs.get("allow"), hdrs


def test_a_retry_without_a_journal_is_refused_rather_than_run_twice():
    from starlette.testclient import TestClient

    from rlm.serve.server import create_app
    with ScriptedServer(lambda req: repl("FINAL('ok')")) as srv:
        app = create_app({"base_url": srv.base_url, "api_key": API_KEY, "model": MODEL,
                          "journal": False})
        with TestClient(app) as client:
            body = {"model": "rlm", "messages": [{"role": "user", "content": "q"}]}
            first = client.post("/v1/chat/completions", json=body,
                                headers={"x-stainless-retry-count": "0"})
            assert first.status_code == 200, first.text
            n = len(srv.requests)
            again = client.post("/v1/chat/completions", json=body,
                                headers={"x-stainless-retry-count": "1"})
            assert again.status_code == 409, again.text
            assert again.json()["error"]["code"] == "retry_not_joinable"
            assert again.headers["x-should-retry"] == "false"
            assert len(srv.requests) == n  # not run twice
            fresh = client.post("/v1/chat/completions", json=body)  # a new call: served
            assert fresh.status_code == 200


def test_a_journal_that_fails_under_a_run_is_a_retryable_503_not_an_internal_error():
    """A journal failure is the server's database, not the client's request nor a bug: 503
    ``journal_unavailable`` (the run resumes from the journal once it is back) with
    ``x-should-retry: true``; another journal error is a 500 naming the journal."""
    from harness.journal.errors import JournalError, JournalUnavailableError
    from rlm.serve.errors import _error_of
    err = _error_of(JournalUnavailableError("cannot record the reply: journal j.sqlite3 is "
                                            "locked; resume once it is back"))
    assert err.status == 503
    assert err.body["error"]["code"] == "journal_unavailable"
    assert err.headers["x-should-retry"] == "true"
    assert "locked" in err.body["error"]["message"]
    other = _error_of(JournalError("journal j.sqlite3 is not a database"))
    assert other.status == 500 and other.body["error"]["code"] == "journal_error"
    assert "internal error" not in other.body["error"]["message"]
