"""The Anthropic provider (``--provider anthropic``): the real ``anthropic`` client against a
Messages server on 127.0.0.1 (:mod:`anthropic_server`), alone and in whole runs with real
kernels, and the provider table's refusal of a name it does not know."""
from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("anthropic")

import rlm  # noqa: E402
from anthropic_server import AnthropicServer, Reply, user_text  # noqa: E402
from conftest import repl  # noqa: E402
from harness.journal import Journal  # noqa: E402
from rlm.config.build import resume_options  # noqa: E402
from rlm.errors import ConfigError, EndpointError, ModelReplyError  # noqa: E402
from rlm.models.anthropic_messages import AnthropicMessagesClient  # noqa: E402
from rlm.models.base import PROVIDERS, ModelClient, make_client  # noqa: E402

KEY = "sk-ant-test-0123456789"
MODEL = "claude-test"
MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


@pytest.fixture
def messages_api():
    """Factory: ``srv = messages_api(responder)`` -> a started :class:`AnthropicServer`."""
    servers: list[AnthropicServer] = []

    def start(responder) -> AnthropicServer:
        srv = AnthropicServer(responder).__enter__()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.__exit__(None, None, None)


class Flaky:
    """Fails the first ``failures`` requests with ``fail``, then answers ``then``; records when
    each request arrived."""

    def __init__(self, failures: int, fail: Reply, then):
        self.failures, self.fail, self.then = failures, fail, then
        self.arrivals: list[float] = []
        self._lock = threading.Lock()

    def __call__(self, req):
        with self._lock:
            self.arrivals.append(time.monotonic())
            n = len(self.arrivals)
        return self.fail if n <= self.failures else self.then


def _sent_key(headers: dict) -> str:
    """The key a request carried, whichever header the SDK version puts it in."""
    return headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ")


# --------------------------------------------------------------------------- the client alone


def test_a_reply_maps_the_request_and_the_usage(messages_api):
    srv = messages_api(lambda req: Reply("hi there", usage={"input_tokens": 21,
                                                            "output_tokens": 4}))
    client = make_client("anthropic", srv.url, KEY, max_attempts=2)
    assert isinstance(client, AnthropicMessagesClient) and isinstance(client, ModelClient)
    comp = client.complete(MSGS, MODEL, max_tokens=64, temperature=0.0, stop=["END"],
                           call_id="run1/iteration-0/model_call-0")
    assert comp.text == "hi there"
    assert (comp.prompt_tokens, comp.completion_tokens) == (21, 4)
    assert not comp.usage_estimated and comp.cost_usd is None
    assert comp.finish_reason == "stop" and comp.model == MODEL
    assert [a["error"] for a in comp.attempts] == [None]
    req, headers = srv.requests[0], srv.headers[0]
    assert srv.paths == ["/v1/messages"]
    assert req["system"] == "be brief"  # system messages go to the system parameter
    assert req["messages"] == [{"role": "user", "content": "hello"}]
    assert req["max_tokens"] == 64 and req["model"] == MODEL
    assert req["temperature"] == 0.0 and req["stop_sequences"] == ["END"]
    assert _sent_key(headers) == KEY and headers.get("anthropic-version")
    assert headers["x-rlm-call-id"] == "run1/iteration-0/model_call-0"
    client.close()


def test_thinking_is_reasoning_and_a_cut_reply_is_cut(messages_api):
    srv = messages_api(lambda req: Reply("partial", thinking="let me see",
                                         stop_reason="max_tokens"))
    comp = AnthropicMessagesClient(srv.url + "/v1", KEY).complete(MSGS, MODEL, max_tokens=5)
    assert srv.paths == ["/v1/messages"]  # a base URL ending in /v1 is the same root
    assert comp.text == "partial" and comp.reasoning == "let me see"
    assert comp.cut and comp.finish_reason == "max_tokens"


def test_529_overloaded_then_success_is_retried(messages_api):
    flaky = Flaky(1, Reply(status=529, text="Overloaded", headers={"retry-after": "0.3"}),
                  Reply("fine"))
    srv = messages_api(flaky)
    comp = AnthropicMessagesClient(srv.url, KEY, max_attempts=3).complete(MSGS, MODEL)
    assert comp.text == "fine" and srv.count == 2
    assert [a["error"] is None for a in comp.attempts] == [False, True]
    assert "529" in comp.attempts[0]["error"] or "Overloaded" in comp.attempts[0]["error"]
    assert flaky.arrivals[1] - flaky.arrivals[0] >= 0.28  # the server's retry-after was waited


def test_the_deadline_cuts_a_slow_reply(messages_api):
    from rlm.models.base import DeadlineExceeded
    srv = messages_api(lambda req: Reply("too late", delay=3.0))
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="before its deadline"):
        AnthropicMessagesClient(srv.url, KEY, max_attempts=3).complete(
            MSGS, MODEL, deadline=time.monotonic() + 0.5)
    assert time.monotonic() - t0 < 2.0 and srv.count == 1


def test_persistent_overload_gives_up_after_max_attempts(messages_api):
    srv = messages_api(lambda req: Reply(status=529, text="Overloaded",
                                         headers={"retry-after": "0"}))
    with pytest.raises(EndpointError) as ei:
        AnthropicMessagesClient(srv.url, KEY, max_attempts=3).complete(MSGS, MODEL)
    assert srv.count == 3
    msg = str(ei.value)
    assert "HTTP 529" in msg and "3 attempt" in msg and "overloaded_error: Overloaded" in msg


@pytest.mark.parametrize("status,kind,hint", [
    (400, "invalid_request_error", ""), (401, "authentication_error", "ANTHROPIC_API_KEY"),
    (404, "not_found_error", "--model")])
def test_other_errors_fail_at_once_with_the_providers_message(messages_api, status, kind, hint):
    text = "max_tokens: must be greater than or equal to 1"
    srv = messages_api(lambda req: Reply(status=status, text=text))
    with pytest.raises(EndpointError) as ei:
        AnthropicMessagesClient(srv.url, KEY, max_attempts=5).complete(MSGS, MODEL)
    assert srv.count == 1
    msg = str(ei.value)
    assert f"HTTP {status}" in msg and f"{kind}: {text}" in msg and hint in msg
    assert not isinstance(ei.value, ModelReplyError)


def test_a_reply_that_is_not_a_message_is_a_model_reply_error(messages_api):
    srv = messages_api(lambda req: Reply("x"))
    client = AnthropicMessagesClient(srv.url, KEY, max_attempts=1)
    client._path = "/v1/nothing"  # a route the server answers with a 404
    with pytest.raises(EndpointError, match="HTTP 404"):
        client.complete(MSGS, MODEL)
    from rlm.models.anthropic_messages import parse_reply
    from rlm.models.usage import UsageCounter
    for body in ({"id": "x"}, [], "hello", {"content": None}):
        with pytest.raises(ModelReplyError, match="malformed Messages reply"):
            parse_reply(body, model=MODEL, base_url=srv.url, messages=MSGS,
                        usage=UsageCounter(srv.url))


def test_missing_usage_is_counted_locally(messages_api):
    srv = messages_api(lambda req: Reply("a few words of reply", omit_usage=True))
    comp = AnthropicMessagesClient(srv.url, KEY).complete(MSGS, MODEL)
    assert comp.usage_estimated and comp.prompt_tokens > 0 and comp.completion_tokens > 0


def test_an_unknown_provider_is_a_config_error_naming_the_known_ones():
    with pytest.raises(ConfigError) as ei:
        make_client("nope", "http://127.0.0.1:1", KEY)
    assert all(name in str(ei.value) for name in PROVIDERS)
    with pytest.raises(ConfigError) as ei:
        rlm.completion("some context", "q?", provider="nope", base_url="http://127.0.0.1:1",
                       api_key=KEY, model=MODEL, journal=False)
    assert "--provider" in str(ei.value)
    assert "'openai'" in str(ei.value) and "'anthropic'" in str(ei.value)


# --------------------------------------------------------------------------- whole runs


def _root(req: dict) -> bool:
    """A root/child loop turn carries the system prompt; sub-calls do not."""
    return bool(req.get("system"))


def test_a_run_end_to_end_journals_the_provider_and_counts_its_tokens(messages_api, tmp_path):
    def responder(req):
        if _root(req):
            return Reply(repl("FINAL('the answer is ' + llm_query('which colour?'))"),
                         usage={"input_tokens": 1200, "output_tokens": 30})
        return Reply("blue", usage={"input_tokens": 9, "output_tokens": 1})
    srv = messages_api(responder)
    jpath = tmp_path / "j.sqlite3"
    res = rlm.completion("the sky is blue", "what colour is the sky?", provider="anthropic",
                         base_url=srv.url, api_key=KEY, model=MODEL, journal=str(jpath),
                         run_id="anthropic-run")
    assert res.status == "completed", res.reason
    assert res.answer == "the answer is blue"
    assert srv.count == 2 and srv.paths == ["/v1/messages"] * 2
    assert all(_sent_key(h) == KEY for h in srv.headers)
    # the accountant counted the server's tokens, not an estimate
    assert (res.usage["prompt_tokens"], res.usage["completion_tokens"]) == (1209, 31)
    assert res.usage["calls"] == 2 and not res.usage_estimated
    assert "what colour is the sky?" in user_text(srv.requests[0])
    with Journal(str(jpath)) as j:
        rec = j.get_run("anthropic-run")
    assert rec["options"]["provider"] == "anthropic"
    assert resume_options(rec)["provider"] == "anthropic"  # resume talks to the same API
    assert KEY.encode() not in jpath.read_bytes()  # the key is never journaled


def test_the_call_cap_holds_and_no_refused_call_is_sent(messages_api, tmp_path):
    srv = messages_api(lambda req: Reply(repl("print(len(context))")))  # never calls FINAL
    res = rlm.completion("some context", "q?", provider="anthropic", base_url=srv.url,
                         api_key=KEY, model=MODEL, journal=str(tmp_path / "j.sqlite3"),
                         max_calls=1)
    assert res.status == "budget_exceeded" and res.cap == "calls"
    assert srv.count == 1 and res.usage["calls"] == 1


def test_the_token_cap_sees_the_reported_usage(messages_api, tmp_path):
    # the reply reports 5000 output tokens: past the 6000-token cap with its prompt, so the
    # next turn is refused before it is sent (an estimate of the short reply would admit it)
    srv = messages_api(lambda req: Reply(repl("print(1)"),
                                         usage={"input_tokens": 1500, "output_tokens": 5000}))
    res = rlm.completion("some context", "q?", provider="anthropic", base_url=srv.url,
                         api_key=KEY, model=MODEL, journal=str(tmp_path / "j.sqlite3"),
                         max_tokens=6000)
    assert res.status == "budget_exceeded" and res.cap == "tokens"
    assert srv.count == 1
    assert res.usage["total_tokens"] == 6500


def test_the_key_comes_from_anthropic_api_key_and_never_from_openais(messages_api,
                                                                    monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-must-not-travel")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:1")  # overridden by base_url
    srv = messages_api(lambda req: Reply(repl("FINAL('ok')")))
    res = rlm.completion("some context", "q?", provider="anthropic", base_url=srv.url,
                         model=MODEL, journal=False)
    assert res.answer == "ok"
    assert [_sent_key(h) for h in srv.headers] == [KEY]


def test_the_cli_takes_provider_anthropic(messages_api, cli, tmp_path):
    srv = messages_api(lambda req: Reply(repl("FINAL('from the cli')"),
                                         usage={"input_tokens": 700, "output_tokens": 9}))
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("some context")
    res = cli("run", "--context", str(ctx), "--query", "q?", "--provider", "anthropic",
              "--base-url", srv.url, "--model", MODEL, "--json",
              env={"ANTHROPIC_API_KEY": KEY})
    assert res.rc == 0, res.stderr
    import json
    out = json.loads(res.stdout)
    assert out["answer"] == "from the cli" and out["usage"]["prompt_tokens"] == 700
    assert [_sent_key(h) for h in srv.headers] == [KEY]


# --------------------------------------------------------------------------- the steps


def test_build_request_maps_system_messages_and_requires_max_tokens():
    from rlm.models.anthropic_messages import DEFAULT_MAX_TOKENS, build_request
    msgs = [{"role": "system", "content": "one"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"}, {"role": "developer", "content": "two"},
            {"role": "user", "content": None}]
    kw = build_request(msgs, MODEL, call_id="r/s")
    assert kw["system"] == "one\n\ntwo" and kw["max_tokens"] == DEFAULT_MAX_TOKENS
    assert kw["messages"] == [{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "a"},
                              {"role": "user", "content": ""}]
    assert "temperature" not in kw and "stop_sequences" not in kw
    assert kw["extra_headers"] == {"X-RLM-Call-Id": "r/s"}
    assert "system" not in build_request([{"role": "user", "content": "q"}], MODEL, max_tokens=3)


def test_the_messages_path_under_the_base_url():
    from rlm.models.anthropic_messages import messages_path
    assert messages_path("https://api.anthropic.com") == "/v1/messages"
    assert messages_path("https://api.anthropic.com/") == "/v1/messages"
    assert messages_path("http://127.0.0.1:8/v1") == "/messages"
    assert messages_path("http://127.0.0.1:8/proxy/v1/") == "/messages"


def test_transient_and_mapped_errors_of_the_sdk():
    import anthropic
    import httpx2
    from rlm.models.anthropic_messages import map_error, transient
    client = anthropic.Anthropic(base_url="http://127.0.0.1:9", api_key=KEY)

    def status(code, body=None):
        resp = httpx2.Response(code, request=httpx2.Request("POST", "http://127.0.0.1:9"))
        return client._make_status_error(f"Error code: {code}", body=body, response=resp)
    for code, expected in ((529, True), (503, True), (500, True), (429, True), (400, False),
                           (401, False), (413, False)):
        assert transient(status(code)) is expected, code
    conn = anthropic.APIConnectionError(request=httpx2.Request("POST", "http://127.0.0.1:9"))
    assert transient(conn) and not transient(ValueError("x"))
    err = map_error(status(413, {"type": "error", "error": {
        "type": "request_too_large", "message": "Request exceeds the maximum size"}}),
        "http://127.0.0.1:9", 1)
    assert "HTTP 413" in str(err) and "request_too_large: Request exceeds" in str(err)
    assert "unreachable after 4 attempt(s)" in str(map_error(conn, "u", 4))
    assert isinstance(map_error(ValueError("bad json"), "u", 1), ModelReplyError)
    bug = KeyError("x")
    assert map_error(bug, "u", 1) is bug


def test_parse_reply_counts_cache_tokens_as_input():
    from rlm.models.anthropic_messages import parse_reply
    from rlm.models.usage import UsageCounter
    body = {"model": "claude-served", "stop_reason": "stop_sequence",
            "content": [{"type": "thinking", "thinking": "hm"}, {"type": "text", "text": "a"},
                        {"type": "tool_use", "id": "t"}, {"type": "text", "text": "b"}],
            "usage": {"input_tokens": 10, "cache_read_input_tokens": 90,
                      "cache_creation_input_tokens": None, "output_tokens": 3}}
    comp = parse_reply(body, model=MODEL, base_url="u", messages=MSGS, usage=UsageCounter("u"))
    assert (comp.text, comp.reasoning, comp.model) == ("ab", "hm", "claude-served")
    assert (comp.prompt_tokens, comp.completion_tokens) == (100, 3)
    assert comp.finish_reason == "stop" and not comp.usage_estimated
