"""``rlm serve`` sessions: a request whose body carries ``"rlm": {"session": ID}`` continues that
session (the same kernel and conversation). The real CLI serves (uvicorn, a SQLite journal) in a
subprocess; the real ``openai`` client calls it; the upstream is the scripted endpoint."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from conftest import API_KEY, MODEL, clean_env, closed_port, last_user, repl, root_requests, script
from harness.journal import Journal


@pytest.fixture
def serve(scripted, tmp_path):
    replies = [repl("total = sum(int(w) for w in context.split())", "FINAL(total)"),
               repl("FINAL(total * 10)"),
               lambda req: repl("FINAL('fresh:' + str('total' in globals()))")]
    srv = scripted(script(replies))
    port = closed_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlm", "serve", "--port", str(port), "--base-url", srv.base_url,
         "--upstream-api-key", API_KEY, "--model", MODEL, "--journal", str(tmp_path / "j.db"),
         "--session-idle-timeout", "1", "--cell-timeout", "10"],
        env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rlm serve did not start: {proc.stderr.read().decode()}")
            time.sleep(0.1)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60,
                           max_retries=0)
    yield client, srv, tmp_path / "j.db", proc
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)


def _ask(client, text: str, session: str | None, **extra):
    body = {"rlm": {"session": session}} if session else {}
    return client.chat.completions.create(
        model="rlm", messages=[{"role": "system", "content": "1 2 3 4"},
                               {"role": "user", "content": text}], extra_body=body, **extra)


def test_a_session_id_maps_requests_to_one_kernel_and_conversation_until_it_expires(serve):
    client, srv, journal, proc = serve
    a1 = _ask(client, "Sum them.", "chat-7")
    a2 = _ask(client, "Ten times that.", "chat-7")  # `total` from the first request
    assert (a1.choices[0].message.content, a2.choices[0].message.content) == ("10", "100")
    roots = root_requests(srv)
    assert roots[1]["messages"][:3] == roots[0]["messages"] + [
        {"role": "assistant", "content": roots[1]["messages"][2]["content"]}]
    assert last_user(roots[1]).endswith("Question: Ten times that.")
    with Journal(journal) as j:
        runs = [j.get_run(f"chat-7-q{n}") for n in (1, 2)]
    assert [r["state"] for r in runs] == ["completed"] * 2
    assert runs[1]["options"]["session"]["previous_run"] == "chat-7-q1"
    # idle past --session-idle-timeout: closed; its id names a journaled session, not a live one
    time.sleep(2.5)
    with pytest.raises(openai.NotFoundError, match="not live on this server"):
        _ask(client, "Again?", "chat-7")
    # a request without a session is a run of its own, on a fresh kernel
    a3 = _ask(client, "Fresh?", None)
    assert a3.choices[0].message.content == "fresh:False"
    with pytest.raises(openai.BadRequestError, match="rlm.session"):
        _ask(client, "Bad id", "no spaces")
