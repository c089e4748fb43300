"""Model clients: retries of transient failures (429, 5xx, timeouts), fast failure of the
rest, an endpoint that is down, and each attempt recorded, through the real ``openai``
client against a real HTTP server."""
from __future__ import annotations

import contextlib
import threading
import time

import pytest

import rlm
from conftest import API_KEY, MODEL, Reply, closed_port, last_user, repl, script
from harness.journal import Journal
from rlm.models.openai_compat import OpenAICompatClient

MSGS = [{"role": "user", "content": "hello"}]


class Flaky:
    """A responder that fails the first ``failures`` requests with ``fail`` and then
    answers from ``then``; it records when each request arrived."""

    def __init__(self, failures: int, fail: Reply, then):
        self.failures, self.fail, self.then = failures, fail, then
        self.arrivals: list[float] = []
        self._lock = threading.Lock()

    def __call__(self, req):
        with self._lock:
            self.arrivals.append(time.monotonic())
            n = len(self.arrivals)
        if n <= self.failures:
            return self.fail
        return self.then(req) if callable(self.then) else self.then


# --------------------------------------------------------------------------- OpenAICompatClient


def test_a_call_carries_the_key_the_call_id_and_the_parameters(scripted):
    # the request goes out through the openai client's post(): auth and headers as create()'s
    srv = scripted(lambda req: "hi")
    c = OpenAICompatClient(srv.base_url, "sk-test-key")
    comp = c.complete(MSGS, "gpt-4o", max_tokens=7, temperature=0.25, stop=["END"],
                      call_id="run1/iteration-0/model_call-0", timeout=30)
    assert comp.text == "hi"
    assert srv.auth == ["Bearer sk-test-key"]
    assert srv.call_ids == ["run1/iteration-0/model_call-0"]
    req = srv.requests[0]
    assert req["model"] == "gpt-4o" and req["messages"] == MSGS
    assert req["max_tokens"] == 7 and req["temperature"] == 0.25 and req["stop"] == ["END"]
    assert "timeout" not in req and "extra_headers" not in req  # options, not body fields


def test_429_with_retry_after_is_retried_and_honoured(scripted):
    flaky = Flaky(2, Reply(status=429, content="slow down", headers={"Retry-After": "0.4"}), "hi")
    srv = scripted(flaky)
    comp = OpenAICompatClient(srv.base_url, API_KEY, max_attempts=4).complete(MSGS, MODEL)
    assert comp.text == "hi"
    assert srv.count == 3
    gaps = [b - a for a, b in zip(flaky.arrivals, flaky.arrivals[1:])]
    assert all(g >= 0.38 for g in gaps), gaps  # the server's Retry-After was waited out
    assert [a["error"] is None for a in comp.attempts] == [False, False, True]
    assert "429" in comp.attempts[0]["error"] or "RateLimit" in comp.attempts[0]["error"]


def test_retry_after_ms_header(scripted):
    flaky = Flaky(1, Reply(status=429, headers={"retry-after-ms": "300"}), "ok")
    srv = scripted(flaky)
    comp = OpenAICompatClient(srv.base_url, API_KEY, max_attempts=2).complete(MSGS, MODEL)
    assert comp.text == "ok" and srv.count == 2
    assert flaky.arrivals[1] - flaky.arrivals[0] >= 0.28


@pytest.mark.parametrize("status", [500, 502, 503])
def test_5xx_is_retried(scripted, status):
    srv = scripted(Flaky(1, Reply(status=status, headers={"Retry-After": "0"}), "fine"))
    comp = OpenAICompatClient(srv.base_url, API_KEY, max_attempts=3).complete(MSGS, MODEL)
    assert comp.text == "fine" and srv.count == 2 and len(comp.attempts) == 2


def test_persistent_5xx_gives_up_after_max_attempts(scripted):
    srv = scripted(lambda req: Reply(status=503, content="overloaded", headers={"Retry-After": "0"}))
    with pytest.raises(rlm.EndpointError) as ei:
        OpenAICompatClient(srv.base_url, API_KEY, max_attempts=3).complete(MSGS, MODEL)
    assert srv.count == 3
    msg = str(ei.value)
    assert "503" in msg and "3 attempt" in msg and srv.base_url in msg


@pytest.mark.parametrize("status,hint", [(401, "api-key"), (404, "--model"), (400, "")])
def test_non_transient_errors_fail_at_once(scripted, status, hint):
    srv = scripted(lambda req: Reply(status=status, content="nope"))
    with pytest.raises(rlm.EndpointError) as ei:
        OpenAICompatClient(srv.base_url, API_KEY, max_attempts=5).complete(MSGS, MODEL)
    assert srv.count == 1
    assert f"HTTP {status}" in str(ei.value)
    assert hint in str(ei.value)


def test_timeout_is_retried(scripted):
    flaky = Flaky(1, Reply(content="too late", delay=2.0), "in time")
    srv = scripted(flaky)
    t0 = time.monotonic()
    comp = OpenAICompatClient(srv.base_url, API_KEY, max_attempts=3, backoff_max=0.2).complete(
        MSGS, MODEL, timeout=0.5)
    assert comp.text == "in time"
    assert srv.count == 2
    assert "Timeout" in comp.attempts[0]["error"]
    assert time.monotonic() - t0 < 2.0  # did not wait for the slow reply


def test_backoff_without_retry_after_is_short_and_jittered(scripted):
    flaky = Flaky(2, Reply(status=429), "eventually")
    srv = scripted(flaky)
    t0 = time.monotonic()
    comp = OpenAICompatClient(srv.base_url, API_KEY, max_attempts=3).complete(MSGS, MODEL)
    assert comp.text == "eventually" and srv.count == 3
    # full jitter: each sleep is in [0, 0.5 * 2**n]; two retries stay well under 2 s
    assert time.monotonic() - t0 < 2.5


def test_usage_and_cost_come_from_the_reply(scripted):
    srv = scripted(lambda req: Reply(content="x", usage={"prompt_tokens": 11, "completion_tokens": 3},
                                     cost=0.002))
    comp = OpenAICompatClient(srv.base_url, API_KEY).complete(MSGS, MODEL, max_tokens=7,
                                                          temperature=0.0)
    assert (comp.prompt_tokens, comp.completion_tokens, comp.cost_usd) == (11, 3, 0.002)
    assert srv.requests[0]["max_tokens"] == 7 and srv.requests[0]["model"] == MODEL


# --------------------------------------------------------------------------- 7. retries in a run


@pytest.mark.parametrize("headers", [{"Retry-After": "0"}, {}], ids=["retry-after-0", "backoff"])
def test_run_survives_two_429s(api, tmp_path, headers):
    calls = {"n": 0}
    lock = threading.Lock()
    replies = iter([repl("print('first')"), repl("FINAL('done')")])

    def responder(req):
        with lock:
            calls["n"] += 1
            n = calls["n"]
        if n in (2, 3):  # the second root turn is rate-limited twice
            return Reply(status=429, content="rate limited", headers=headers)
        return next(replies)

    jpath = tmp_path / "j.sqlite3"
    res, srv = api(responder, journal=str(jpath), run_id="retry-run")
    assert res.status == "completed", res.reason
    assert res.answer == "done"
    assert srv.count == 4  # 1 + (2 refused + 1) for the second turn
    assert res.usage["calls"] == 2  # attempts are not calls
    with Journal(str(jpath)) as j:
        calls_ = j.model_calls("retry-run")
    assert len(calls_) == 2
    attempts = [c["attempts"] for c in calls_]
    assert [len(a) for a in attempts] == [1, 3]
    assert [a["error"] is None for a in attempts[1]] == [False, False, True]
    assert all("429" in a["error"] or "RateLimit" in a["error"] for a in attempts[1][:2])
    # the stage tree carries them too
    metas = [s.meta.get("attempts") for s in res.tree.all() if s.kind.value == "model_call"]
    assert sorted(len(m) for m in metas) == [1, 3]


def test_subcall_429_is_retried_inside_the_kernel_call(api):
    sub = Flaky(1, Reply(status=429, headers={"Retry-After": "0"}), "sub answer")
    res, srv = api(script([repl("x = llm_query('q')"), repl("FINAL(x)")], sub))
    assert res.answer == "sub answer"
    assert len(sub.arrivals) == 2


def test_subcall_endpoint_error_is_an_exception_in_the_kernel(api):
    replies = [repl("try:", "    llm_query('q')", "except Exception as e:",
                    "    print('ERR', type(e).__name__, e)"),
               repl("FINAL('handled')")]
    res, srv = api(script(replies, lambda req: Reply(status=401, content="bad key")))
    assert res.status == "completed" and res.answer == "handled"
    fb = last_user(srv.requests[-1])
    assert "ERR SubcallError" in fb and "401" in fb


# --------------------------------------------------------------------------- 8. endpoint down


def test_a_plain_http_endpoint_that_redirects_is_an_error_not_followed(scripted, monkeypatch):
    # an http:// endpoint's client has no CA store (it never does TLS), so it must never
    # reach an https:// URL: a redirect is reported, not followed (one request, no retry)
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    to = f"https://127.0.0.1:{closed_port()}/v1/chat/completions"
    srv = scripted(lambda req: Reply(status=307, content="moved", headers={"Location": to}))
    with pytest.raises(rlm.EndpointError) as ei:
        OpenAICompatClient(srv.base_url, API_KEY, max_attempts=3).complete(MSGS, MODEL)
    assert "HTTP 307" in str(ei.value) and srv.count == 1
    assert f"it redirects to {to}" in str(ei.value)


def test_with_a_proxy_configured_a_plain_http_endpoint_gets_the_default_client(scripted,
                                                                             monkeypatch):
    # with a proxy for HTTP the client is openai's default (verified TLS, redirects followed):
    # the redirect is followed to the https URL, where nothing listens
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    to = f"https://127.0.0.1:{closed_port()}/v1/chat/completions"
    srv = scripted(lambda req: Reply(status=307, content="moved", headers={"Location": to}))
    with pytest.raises(rlm.EndpointError) as ei:
        OpenAICompatClient(srv.base_url, API_KEY, max_attempts=1).complete(MSGS, MODEL)
    assert "unreachable" in str(ei.value) and srv.count == 1


BAD_BODIES = {"junk": b"{not json", "empty": b"", "truncated": b'{"choices": [{"message": {',
              "array": b"[]", "string": b'"hello"', "no-choices": b'{"id": "x"}',
              "choices-null": b'{"choices": null}', "choice-not-object": b'{"choices": ["x"]}',
              "message-not-object": b'{"choices": [{"message": "hi"}]}',
              "not-text": b"\x80\x81\xfe{}"}


@contextlib.contextmanager
def _serving(body: bytes):
    """A server on 127.0.0.1 answering every POST with HTTP 200 and ``body``; yields its
    base URL."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("kind", sorted(BAD_BODIES))
def test_a_malformed_reply_body_is_a_model_reply_error(kind):
    # a 200 whose body is not a chat completion (not JSON at all, cut short, the wrong shape)
    # is the endpoint's fault, said as such: never an internal error of the harness
    with _serving(BAD_BODIES[kind]) as url:
        with pytest.raises(rlm.ModelReplyError) as ei:
            OpenAICompatClient(url, API_KEY, max_attempts=1).complete(MSGS, MODEL)
        assert "model endpoint http://127.0.0.1" in str(ei.value)


@pytest.mark.parametrize("usage", [
    '{"prompt_tokens": Infinity, "completion_tokens": 5, "cost": NaN}',
    '{"prompt_tokens": -7, "completion_tokens": 5, "cost": -1.5}',
    '{"prompt_tokens": "12", "completion_tokens": null, "cost": "0.1"}',
    '[1, 2]',
])
def test_usage_that_is_not_a_count_is_estimated_not_trusted(usage):
    # a reply's usage is read as counts only: anything else (not finite, negative, a string,
    # not an object) is counted locally, and such a cost is dropped; a negative cost or count
    # would lower what the caps see
    body = ('{"choices": [{"message": {"role": "assistant", "content": "hello there"}}], '
            f'"usage": {usage}}}').encode()
    with _serving(body) as url:
        c = OpenAICompatClient(url, API_KEY, max_attempts=1).complete(MSGS, MODEL)
    assert c.text == "hello there"
    assert c.usage_estimated
    assert c.prompt_tokens > 0 and c.completion_tokens > 0
    assert c.cost_usd is None


def test_usage_counts_and_cost_reported_as_numbers_are_taken():
    body = (b'{"choices": [{"message": {"role": "assistant", "content": "hi"}, '
            b'"finish_reason": "stop"}], "model": "served-model", '
            b'"usage": {"prompt_tokens": 31, "completion_tokens": 4.0, "cost": 0.25}}')
    with _serving(body) as url:
        c = OpenAICompatClient(url, API_KEY, max_attempts=1).complete(MSGS, MODEL)
    assert (c.text, c.prompt_tokens, c.completion_tokens, c.cost_usd) == ("hi", 31, 4, 0.25)
    assert not c.usage_estimated and c.finish_reason == "stop" and c.model == "served-model"


def test_endpoint_down_raises_endpoint_error():
    port = closed_port()
    url = f"http://127.0.0.1:{port}/v1"
    t0 = time.monotonic()
    with pytest.raises(rlm.EndpointError) as ei:
        rlm.completion("some text", "q?", base_url=url, api_key=API_KEY, model=MODEL,
                       journal=False, max_attempts=2)
    assert time.monotonic() - t0 < 15
    msg = str(ei.value)
    assert "unreachable" in msg and url in msg and "2 attempt" in msg
    assert "--base-url" in msg
    res = getattr(ei.value, "result", None)
    assert res is not None and res.status == "failed" and res.answer is None


@contextlib.contextmanager
def _host_that_never_answers():
    """A base URL on 127.0.0.1 whose connections are never set up: a listening socket with a
    full backlog (one connection queued, never accepted), so the kernel drops new SYNs, as a
    firewall or an address nobody holds would."""
    import socket
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    filler = socket.create_connection(srv.getsockname(), timeout=5)
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}/v1"
    finally:
        filler.close()
        srv.close()


def test_a_host_that_never_answers_fails_each_attempt_at_the_connect_timeout(caplog):
    # a plain number of seconds replaced openai's 5 s connect timeout: each attempt waited for
    # the operating system's own (about 2 minutes) before failing, and 6 attempts, 13 minutes
    from rlm.models.openai_compat import CONNECT_TIMEOUT
    assert CONNECT_TIMEOUT <= 10
    with _host_that_never_answers() as url:
        c = OpenAICompatClient(url, API_KEY, max_attempts=2, backoff_max=0.1)
        assert c._client.timeout.connect == CONNECT_TIMEOUT
        assert c._client.timeout.read == 600.0  # a slow model still has its whole timeout
        t0 = time.monotonic()
        with caplog.at_level("INFO", logger="rlm"), pytest.raises(rlm.EndpointError) as ei:
            c.complete([{"role": "user", "content": "hi"}], MODEL, timeout=300)
        took = time.monotonic() - t0
    assert 2 * CONNECT_TIMEOUT - 1 < took < 2 * CONNECT_TIMEOUT + 20, took
    assert "unreachable after 2 attempt" in str(ei.value)
    # the first failure is a warning (the user sees it without -v), the retry's is INFO
    fails = [r for r in caplog.records if "failed (attempt" in r.getMessage()]
    assert [r.levelname for r in fails] == ["WARNING", "INFO"], [r.getMessage() for r in fails]
    assert "attempt 1 of 2, retrying" in fails[0].getMessage()


def test_endpoint_down_marks_the_journal_run_failed(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}/v1"
    jpath = tmp_path / "j.sqlite3"
    with pytest.raises(rlm.EndpointError):
        rlm.completion("some text", "q?", base_url=url, api_key=API_KEY, model=MODEL,
                       journal=str(jpath), run_id="down-run", max_attempts=1)
    with Journal(str(jpath)) as j:
        rec = j.get_run("down-run")
    assert rec["state"] == "failed"
    assert "unreachable" in (rec.get("error") or "")
