"""``rlm serve`` never relays what its upstream said: an upstream that echoes the server's own
key (in a 401's error object, in a 500's text along with its URL) is answered to the client in
the server's words only (the status, a short reason, the upstream error's type and code), in a
502 body and in a stream's error event alike; the operator's log (stderr) keeps the detail with
the key redacted.

Real processes: one ``rlm serve`` subprocess (the real CLI, uvicorn) in front of the scripted
OpenAI-protocol server on 127.0.0.1, called with the real ``openai`` client.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import openai
import pytest

from conftest import MODEL, clean_env
from scripted_server import Reply, ScriptedServer

UPSTREAM_KEY = "sk-secret-123"  # the server's key for its upstream, which the upstream echoes
CLIENT_KEY = "serve-client-key-5521"


class Upstream:
    def __init__(self) -> None:
        self.responder = lambda req: Reply(status=500)

    def __call__(self, req):
        return self.responder(req)


class Served:
    """The serve process, its upstream and every line it wrote to stderr (read as it runs)."""

    def __init__(self, proc, srv, up, base: str) -> None:
        self.proc, self.srv, self.up, self.base = proc, srv, up, base
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def log_line(self, *needles: str, timeout: float = 20) -> str:
        """The first stderr line holding every one of ``needles`` (waiting for it)."""
        deadline = time.monotonic() + timeout
        while True:
            for line in list(self.lines):
                if all(n in line for n in needles):
                    return line
            assert time.monotonic() < deadline, ("no log line with", needles, self.lines)
            time.sleep(0.05)

    @property
    def upstream_place(self) -> str:
        return f"127.0.0.1:{self.srv.port}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-secrets")
    up = Upstream()
    srv = ScriptedServer(up)
    srv._thread = threading.Thread(target=srv.httpd.serve_forever,
                                   kwargs={"poll_interval": 0.02}, daemon=True)
    srv.__enter__()
    # the keys as the environment gives them (the way the docs prefer): the flags' own hiding
    # is tests/cli/test_argv_secret.py's
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlm", "serve", "--port", "0", "--base-url", srv.base_url,
         "--model", MODEL, "--max-attempts", "1", "--journal", str(tmp / "j.sqlite3")],
        env=clean_env(OPENAI_API_KEY=UPSTREAM_KEY, RLM_SERVE_API_KEY=CLIENT_KEY),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp, text=True)
    line = proc.stderr.readline()
    m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
    if not m:
        proc.kill()
        raise RuntimeError(f"rlm serve did not start: {line}{proc.stderr.read()}")
    s = Served(proc, srv, up, f"http://127.0.0.1:{m[1]}/v1")
    yield s
    proc.terminate()
    proc.wait(timeout=20)
    srv.__exit__(None, None, None)


def echo_401(req):
    return Reply(status=401, content=f"Incorrect API key provided: {UPSTREAM_KEY}",
                 error={"type": "invalid_request_error", "code": "invalid_api_key"})


def crash_500(base_url: str):
    def responder(req):
        return Reply(status=500, content=f"Internal failure at {base_url}/chat/completions "
                     f"(Authorization: Bearer {UPSTREAM_KEY}); see the gateway log",
                     error={"type": "server_error", "code": "upstream_crashed"})
    return responder


CASES = {
    # name: (responder factory, upstream status, type, code, the upstream's own words)
    "401-echoing-the-key": (lambda s: echo_401, 401, "invalid_request_error", "invalid_api_key",
                            "Incorrect API key provided"),
    "500-with-key-and-url": (lambda s: crash_500(s.srv.base_url), 500, "server_error",
                             "upstream_crashed", "Internal failure at"),
}


def forbidden(s: Served, words: str) -> list[str]:
    """What no client may ever receive: the key (and any key-like part of it), the upstream's
    URL and address, its own words, and the operator's hints."""
    return [UPSTREAM_KEY, "sk-", "Bearer", s.srv.base_url, s.upstream_place, words,
            "gateway log", "check --api-key", "OPENAI_API_KEY", "--base-url"]


def received(headers, text: str) -> str:
    """Every header and the body a client received, as one text."""
    return "".join(f"{k}: {v}\n" for k, v in headers.items()) + "\n" + text


def client(s: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.base, api_key=CLIENT_KEY, max_retries=0, timeout=120)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_failed_upstream_is_told_in_the_servers_words_without_its_text(served, case):
    make, status, type_, code, words = CASES[case]
    served.up.responder = make(served)
    rid = f"plain-{case}"
    with pytest.raises(openai.APIStatusError) as exc:
        client(served).chat.completions.create(
            model="rlm", messages=[{"role": "user", "content": "q"}],
            extra_headers={"Idempotency-Key": rid})
    err = exc.value
    assert err.status_code == 502
    everything = received(err.response.headers, err.response.text)
    for bad in forbidden(served, words):
        assert bad not in everything, (bad, everything)
    body = err.response.json()["error"]
    assert body["type"] == "upstream_error"
    assert body["message"].startswith(f"the model endpoint failed: HTTP {status} ")
    assert f"({type_}, {code})" in body["message"], body
    assert body["upstream"] == {"status": status, "type": type_, "code": code}
    # the operator's log has the detail (the upstream's words and URL), the key redacted
    line = served.log_line(f"run {rid}:", words)
    assert served.srv.base_url in line and "[redacted]" in line, line
    assert not [ln for ln in served.lines if UPSTREAM_KEY in ln or CLIENT_KEY in ln]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_failed_upstream_in_a_stream_is_an_error_event_of_the_servers_words(served, case):
    make, status, type_, code, words = CASES[case]
    served.up.responder = make(served)
    rid = f"stream-{case}"
    c = client(served)
    # the raw stream: every header and every Server-Sent Event the client receives
    with c.chat.completions.with_streaming_response.create(
            model="rlm", messages=[{"role": "user", "content": "q"}], stream=True,
            extra_headers={"Idempotency-Key": rid}) as resp:
        assert resp.status_code == 200
        headers = dict(resp.headers)
        events = [ln for ln in resp.iter_lines() if ln]
    everything = received(headers, "\n".join(events))
    for bad in forbidden(served, words):
        assert bad not in everything, (bad, everything)
    errors = [e for e in events if e.startswith("data: {\"error\"")]
    assert len(errors) == 1, events
    body = json.loads(errors[0][len("data: "):])["error"]
    assert body["message"].startswith(f"the model endpoint failed: HTTP {status} ")
    assert f"({type_}, {code})" in body["message"]
    assert body["upstream"] == {"status": status, "type": type_, "code": code}
    # the same through the client's own stream reading: its error is the server's words
    with pytest.raises(openai.APIError) as exc:
        for _ in c.chat.completions.create(
                model="rlm", messages=[{"role": "user", "content": "q"}], stream=True,
                extra_headers={"Idempotency-Key": rid + "-sdk"}):
            pass
    said = f"{exc.value} {exc.value.body}"
    for bad in forbidden(served, words):
        assert bad not in said, (bad, said)
    assert f"HTTP {status}" in said and code in said
    line = served.log_line(f"run {rid}:", words)
    assert served.srv.base_url in line and "[redacted]" in line, line
    assert not [ln for ln in served.lines if UPSTREAM_KEY in ln or CLIENT_KEY in ln]


# --------------------------------------------------------------------------- the mapping alone

def test_a_recorded_endpoint_failure_is_not_relayed_either():
    # a retried request may find its run recorded as failed: the recorded reason is the
    # upstream's text
    from rlm.result import Result
    from rlm.serve.server import APIError, _check_result
    reason = ("model endpoint http://10.0.0.7:8000/v1 answered HTTP 401 after 1 attempt(s): "
              "Error code: 401 - Incorrect API key provided: sk-secret-123; check --api-key")
    with pytest.raises(APIError) as e:
        _check_result(Result(answer=None, status="failed", run_id="r", reason=reason))
    msg = e.value.body["error"]["message"]
    assert e.value.status == 500 and "HTTP 401" in msg, msg
    for bad in ("sk-secret", "10.0.0.7", "Incorrect", "check --api-key"):
        assert bad not in msg, msg


def test_upstream_errors_of_either_provider_give_their_type_and_code_only():
    from rlm.errors import EndpointError
    from rlm.serve.server import _error_of

    class SDKError(Exception):  # what openai/anthropic raise: status_code and the decoded body
        def __init__(self, status, body):
            super().__init__(f"Error code: {status} - {body}")
            self.status_code, self.body = status, body

    def failed(cause):
        try:
            try:
                raise cause
            except SDKError:
                raise EndpointError(f"model endpoint http://up:1/v1 answered HTTP "
                                    f"{cause.status_code}: {cause}") from None
        except EndpointError as exc:
            return _error_of(exc)

    anthropic = failed(SDKError(401, {"type": "error", "error": {
        "type": "authentication_error", "message": "invalid x-api-key sk-ant-abc123"}}))
    assert anthropic.status == 502
    assert anthropic.body["error"]["message"] == \
        "the model endpoint failed: HTTP 401 Unauthorized (authentication_error)"
    # a type or code that is no short identifier, or looks like a key, is not relayed
    odd = failed(SDKError(400, {"message": "m", "type": "see http://up:1 for help",
                                "code": "sk-leaked-999"}))
    assert odd.body["error"]["message"] == "the model endpoint failed: HTTP 400 Bad Request"
    assert odd.body["error"]["upstream"] == {"status": 400, "type": None, "code": None}
    unreachable = _error_of(EndpointError("model endpoint http://up:1/v1 unreachable after 6 "
                                          "attempt(s) (APIConnectionError); check that the "
                                          "server is running and --base-url is right"))
    assert unreachable.body["error"]["message"] == "the model endpoint failed: unreachable"


def test_a_sub_call_endpoints_failure_is_told_in_the_servers_words_too(monkeypatch):
    # sub_base_url: its failure reads "sub-call endpoint URL ...", raised or recorded; neither
    # its text, nor its URL, nor its key (RLM_SUB_API_KEY) reaches a client
    from rlm.errors import EndpointError
    from rlm.result import Result
    from rlm.serve.server import APIError, _check_result, _error_of, _public, _redactor
    monkeypatch.setenv("RLM_SUB_API_KEY", "sub-secret-777")
    reason = ("sub-call endpoint http://10.0.0.9:8001/v1 unreachable after 6 attempt(s) "
              "(APIConnectionError); check that the server is running and --sub-base-url is "
              "right")
    assert _error_of(EndpointError(reason)).body["error"]["message"] == \
        "the model endpoint failed: unreachable"
    with pytest.raises(APIError) as e:
        _check_result(Result(answer=None, status="failed", run_id="r", reason=reason))
    assert "10.0.0.9" not in e.value.body["error"]["message"]
    redactor = _redactor({"base_url": "http://10.0.0.7:8000/v1", "model": MODEL,
                          "sub_base_url": "http://10.0.0.9:8001/v1"}, None)
    leaked = APIError(500, "upstream said sub-secret-777 at http://10.0.0.9:8001/v1")
    msg = _public(leaked, redactor).body["error"]["message"]
    assert "sub-secret-777" not in msg and "10.0.0.9" not in msg, msg
