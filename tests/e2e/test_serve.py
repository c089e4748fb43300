"""``rlm serve`` driven by the real ``openai`` client on 127.0.0.1.

One ``rlm serve`` subprocess (the real CLI, uvicorn) for the module, in front of one scripted
upstream server whose script each test sets. Runs use real kernels.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import urllib.error
import urllib.request

import openai
import pytest

from conftest import API_KEY, MODEL, clean_env, closed_port, repl, root_requests, script
from scripted_server import ScriptedServer

KEY = "sk-serve-test"
SLOTS = 2


def http(url: str, body: bytes | None = None, key: str | None = KEY) -> tuple[int, dict]:
    """A raw request (GET, or POST of ``body``): (status, JSON body)."""
    req = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Upstream:
    """The scripted server's responder, swappable per test."""

    def __init__(self) -> None:
        self.responder = lambda req: repl("FINAL('unset')")

    def __call__(self, req):
        return self.responder(req)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    up = Upstream()
    srv = ScriptedServer(up)
    srv._thread = threading.Thread(target=srv.httpd.serve_forever,
                                   kwargs={"poll_interval": 0.02}, daemon=True)
    srv.__enter__()
    port = closed_port()
    # a host tool the served runs may call (tests/tools/tools_helpers.py), on a real database
    tools_dir = Path(__file__).resolve().parent.parent / "tools"
    sys.path.insert(0, str(tools_dir))
    import tools_helpers
    tools_helpers.make_db(str(tmp / "staff.db"))
    env = clean_env()
    env.update(TOOLS_TEST_DB=str(tmp / "staff.db"), TOOLS_TEST_COUNT=str(tmp / "calls.txt"),
               PYTHONPATH=os.pathsep.join([str(tools_dir), env.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlm", "serve", "--port", str(port), "--api-key", KEY,
         "--max-concurrent-runs", str(SLOTS), "--base-url", srv.base_url,
         "--upstream-api-key", API_KEY, "--model", MODEL, "--journal", str(tmp / "j.sqlite3"),
         "--tool", "tools_helpers:lookup"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp)
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 60
    while True:
        try:
            if http(base + "/models")[0] == 200:
                break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"rlm serve did not start: {proc.stderr.read().decode()}")
        time.sleep(0.1)
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=120)
    yield client, srv, up, base, tmp / "j.sqlite3"
    proc.terminate()
    proc.wait(timeout=20)
    srv.__exit__(None, None, None)


def test_a_served_run_calls_the_servers_tool(served):
    client, srv, up, _, journal = served
    up.responder = lambda req: repl("FINAL(lookup('carol')['team'])")
    r = ask(client, "Which team is Carol on?")
    assert r.choices[0].message.content == "search"
    calls = (journal.parent / "calls.txt").read_text().splitlines()
    assert calls[-1] == "lookup carol"


def ask(client, content="What is the code?", **kw):
    return client.chat.completions.create(
        model="rlm", messages=[{"role": "system", "content": "The code is 7 4 2."},
                               {"role": "user", "content": content}], **kw)


def test_models_and_a_completion_with_the_tree_usage(served):
    client, srv, up, _, journal = served
    assert {m.id for m in client.models.list().data} == {"rlm", f"rlm/{MODEL}"}

    def responder(req):
        turns = sum(1 for m in req["messages"] if m["role"] == "user")
        if req["messages"][0]["role"] != "system":  # a sub-call
            return "seven four two"
        if turns == 1:
            return repl("print(type(context).__name__, context)", "s = llm_query('spell: ' + context)")
        return repl("FINAL(s)")

    up.responder = responder
    n0 = len(srv.usages)
    r = ask(client)
    assert r.choices[0].message.content == "seven four two"
    new = srv.usages[n0:]
    assert len(new) == 3  # two root turns and one llm_query
    assert r.usage.prompt_tokens == sum(u["prompt_tokens"] for u in new)
    assert r.usage.completion_tokens == sum(u["completion_tokens"] for u in new)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    from harness.journal import Journal
    rec = Journal(str(journal)).get_run(r.id)
    assert rec is not None and rec["state"] == "completed"  # id = the run id
    assert rec["query"] == "What is the code?"
    assert r.model_extra["rlm"]["calls"] == 3


def test_a_retried_request_with_the_same_idempotency_key_sends_no_model_call(served):
    client, srv, up, _, _ = served
    up.responder = lambda req: repl("FINAL('once')")
    h = {"Idempotency-Key": "step-42"}
    first = ask(client, extra_headers=h)
    n = srv.count
    again = ask(client, extra_headers=h)
    assert first.id == again.id == "step-42"
    assert again.choices[0].message.content == "once" and srv.count == n
    assert again.usage.total_tokens == first.usage.total_tokens
    # the same key for another question is a conflict, not a silent reuse
    with pytest.raises(openai.ConflictError):
        ask(client, "another question", extra_headers=h)


def test_response_format_schema_corrects_an_invalid_final(served):
    client, srv, up, _, _ = served
    up.responder = script([repl("FINAL({'code': '742'})"), repl("FINAL({'code': 742})")])
    schema = {"type": "object", "required": ["code"], "properties": {"code": {"type": "integer"}}}
    r = ask(client, response_format={"type": "json_schema",
                                     "json_schema": {"name": "code", "schema": schema}})
    assert json.loads(r.choices[0].message.content) == {"code": 742}
    assert r.model_extra["rlm"]["iterations"] == 2
    assert "'742' is not of type 'integer'" in root_requests(srv)[-1]["messages"][-1]["content"]


def test_streaming_sends_stage_events_then_the_answer(served):
    client, srv, up, _, _ = served
    up.responder = script([repl("x = 6 * 7"), repl("FINAL(x)")])
    chunks = list(ask(client, stream=True))
    events = [c.model_extra.get("rlm_event") for c in chunks if c.model_extra.get("rlm_event")]
    kinds = {(e["kind"], e["to"]) for e in events}
    assert ("iteration", "completed") in kinds and ("cell", "completed") in kinds
    assert ("run", "completed") in kinds
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "42"
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage.total_tokens > 0
    assert len({c.id for c in chunks}) == 1


def test_errors_401_400_404(served):
    client, _, _, base, _ = served
    bad = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        ask(bad)
    status, body = http(base + "/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    status, body = http(base + "/chat/completions", b'{"model": "rlm", "messages": []}')
    assert status == 400 and body["error"]["param"] == "messages"
    assert http(base + "/models", key=None)[0] == 401
    with pytest.raises(openai.BadRequestError, match="server-only"):
        ask(client, extra_body={"rlm": {"base_url": "http://evil"}})
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_429_when_every_run_slot_is_busy(served, tmp_path):
    client, srv, up, _, _ = served
    flag = tmp_path / "hold"
    flag.write_text("")
    up.responder = lambda req: repl("import os, time",
                                    f"while os.path.exists({str(flag)!r}): time.sleep(0.05)",
                                    "FINAL('held')")
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(ask(client, f"q{i}")))
               for i in range(SLOTS)]
    for t in threads:
        t.start()
    try:
        n = srv.count
        deadline = time.monotonic() + 60
        while srv.count < n + SLOTS:  # both held runs are running (their slots taken)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(openai.RateLimitError) as exc:
            ask(client, "one too many")
        assert exc.value.response.headers.get("retry-after") == "1"
        assert exc.value.response.headers.get("x-should-retry") == "true"  # no run was started
        assert exc.value.body["code"] == "rate_limit_exceeded"
    finally:
        flag.unlink()
        for t in threads:
            t.join(timeout=60)
    assert [r.choices[0].message.content for r in results] == ["held"] * SLOTS


# --------------------------------------------------------------------------- the mapping alone

def test_request_mapping():
    from rlm.serve.server import APIError, request_options
    ctx, q, o = request_options({"model": "rlm", "messages": [
        {"role": "system", "content": "doc A"}, {"role": "user", "content": "doc B"},
        {"role": "assistant", "content": "ignored"},
        {"role": "user", "content": [{"type": "text", "text": "the question"}]}],
        "rlm": {"max_depth": 2}, "max_tokens": 5, "temperature": 0.3}, "m")
    assert (ctx, q) == (["doc A", "doc B"], "the question")
    assert o == {"max_depth": 2, "temperature": 0.3}  # OpenAI's max_tokens is not ours
    ctx, q, o = request_options({"model": "rlm/big", "context": {"k": [1]},
                                 "messages": [{"role": "user", "content": "q"}],
                                 "response_format": {"type": "json_object"}}, "m")
    assert (ctx, q, o) == ({"k": [1]}, "q", {"model": "big", "answer_schema": {"type": "object"}})
    assert request_options({"messages": [{"role": "user", "content": "only"}]}, "m")[:2] == \
        ("only", "only")
    for body, status in [([], 400), ({"messages": [{"role": "system", "content": "x"}]}, 400),
                         ({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404),
                         ({"messages": [{"role": "user", "content": "x"}],
                           "response_format": {"type": "json_schema"}}, 400)]:
        with pytest.raises(APIError) as e:
            request_options(body, "m")
        assert e.value.status == status


def test_run_outcomes_map_to_status_codes():
    from rlm.result import Result
    from rlm.serve.server import APIError, _check_result
    for status, cap, code in [("budget_exceeded", "wall", 504), ("budget_exceeded", "cost", 402),
                              ("failed", None, 500)]:
        with pytest.raises(APIError) as e:
            _check_result(Result(answer="partial", status=status, run_id="r", cap=cap))
        assert e.value.status == code and e.value.body["error"]["run_id"] == "r"
    _check_result(Result(answer="a", status="completed", run_id="r"))


def test_serve_refuses_a_non_loopback_bind_without_a_key(cli):
    r = cli("serve", "--host", "0.0.0.0", "--port", str(closed_port()), timeout=60)
    assert r.rc == 2 and "needs --api-key" in r.stderr


def test_a_body_nested_too_deep_is_a_400_not_a_crash(served):
    _, _, _, base, _ = served
    deep = b'{"model": "rlm", "messages": [{"role": "user", "content": "q"}], "context": ' + \
        b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, body = http(base + "/chat/completions", deep)
    assert status == 400 and "too deeply" in body["error"]["message"], body
    assert http(base + "/models")[0] == 200  # and the server is still there


@pytest.mark.parametrize("flags, message", [
    (["--port", "99999"], "--port: must be a TCP port from 0 to 65535"),
    (["--port", "-1"], "--port: must be a TCP port from 0 to 65535"),
    (["--max-concurrent-runs", "0"], "--max-concurrent-runs: must be a whole number >= 1"),
    (["--max-body-bytes", "0"], "--max-body-bytes: must be a whole number >= 1"),
    (["--max-cost", "1"], r"no price known for model\(s\) .* \(rlm serve --price-file PATH\)"),
    (["--max-cost", "1", "--price-file", "missing.json"], "price file not found"),
])
def test_serve_refuses_bad_flags_at_start(cli, flags, message):
    # a port out of range was uvicorn's traceback; a cost cap without a price failed every
    # request, and serve had no --price-file to give one
    r = cli("serve", "--base-url", "http://127.0.0.1:9/v1", "--upstream-api-key", API_KEY,
            "--model", MODEL, *flags, timeout=60)
    assert r.rc == 2, (r.rc, r.stderr)
    assert re.search(message, r.stderr) and "Traceback" not in r.stderr, r.stderr


def _ask(base: str) -> str:
    """One question to an `rlm serve` without a key at ``base``, through the openai client:
    the answer's text."""
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
    res = client.chat.completions.create(model="rlm",
                                         messages=[{"role": "user", "content": "q"}])
    return res.choices[0].message.content


def test_serve_takes_a_price_file_for_its_cost_cap(tmp_path):
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({MODEL: {"input": 1.0, "output": 2.0}}))
    with ScriptedServer(lambda req: repl("FINAL('priced')")) as srv:
        port = closed_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlm", "serve", "--port", str(port), "--base-url",
             srv.base_url, "--upstream-api-key", API_KEY, "--model", MODEL, "--max-cost", "5",
             "--price-file", str(prices), "--journal", str(tmp_path / "j.sqlite3")],
            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
        try:
            base = f"http://127.0.0.1:{port}/v1"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if http(base + "/models", key=None)[0] == 200:
                        break
                except OSError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.1)
            assert _ask(base) == "priced"
        finally:
            proc.terminate()
            proc.wait(timeout=20)


def test_a_utf8_idempotency_key_names_the_run_as_sent(served):
    # header values arrive as Latin-1: a UTF-8 key became mojibake with C1 control characters
    _, _, up, base, journal = served
    up.responder = lambda req: repl("FINAL('keyed')")
    key = "ключ-é"
    req = urllib.request.Request(base + "/chat/completions", method="POST", data=json.dumps(
        {"model": "rlm", "messages": [{"role": "user", "content": "q"}]}).encode())
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {KEY}")
    req.add_header("Idempotency-Key", key.encode("utf-8").decode("latin-1"))  # UTF-8 on the wire
    with urllib.request.urlopen(req, timeout=60) as r:
        body = json.loads(r.read())
    assert body["rlm"]["run_id"] == key, body["rlm"]
    assert body["choices"][0]["message"]["content"] == "keyed"


def test_serve_on_port_0_prints_the_port_it_took_and_stops_cleanly(tmp_path):
    with ScriptedServer(lambda req: repl("FINAL('on a free port')")) as srv:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlm", "serve", "--port", "0", "--base-url", srv.base_url,
             "--upstream-api-key", API_KEY, "--model", MODEL, "--journal",
             str(tmp_path / "j.sqlite3")],
            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
            text=True)
        try:
            line = proc.stderr.readline()
            m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            assert m and int(m[1]) != 0, line
            base = f"http://127.0.0.1:{m[1]}/v1"
            # listening once the address is printed: the first connection is not refused
            with urllib.request.urlopen(base + "/models", timeout=60) as resp:
                assert resp.status == 200
            assert _ask(base) == "on a free port"
        finally:
            proc.terminate()
            code = proc.wait(timeout=20)
        assert code == 0, proc.stderr.read()  # SIGTERM: a normal stop


def test_serve_on_a_port_in_use_says_so(cli):
    import socket
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = cli("serve", "--port", str(port), "--base-url", "http://127.0.0.1:9/v1",
                "--upstream-api-key", API_KEY, "--model", MODEL, timeout=60)
    assert r.rc == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr
    assert "another process is listening there" in r.stderr
