"""Runs that meet a gateway's faults: down at start and a refused token (a clear error, exit 4,
the token nowhere), and a gateway that dies mid-run (the run stops, resumable: ``resume``
finishes it on a gateway again, sending only the calls the journal does not hold)."""
from __future__ import annotations

import shutil

import pytest

import rlm
from gw_helpers import gateway, start_gateway, why_not  # noqa: F401 (a fixture)
from rlm.api import resume
from scripted_server import ScriptedServer

API_KEY, MODEL = "test-key", "m"


def repl(*lines: str) -> str:
    return "```repl\n" + "\n".join(lines) + "\n```"


def _is_root(req: dict) -> bool:
    return req["messages"][0]["role"] == "system"


def _turn(req: dict) -> int:
    return sum(1 for m in req["messages"] if m["role"] == "assistant")


def _closed_port() -> int:
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def ctx_file(tmp_path):
    p = tmp_path / "ctx.txt"
    p.write_text("some context")
    return p


def test_a_gateway_that_is_down_at_start_exits_4(cli, ctx_file):
    with ScriptedServer(lambda req: repl("FINAL('x')")) as srv:
        res = cli("run", "--context", str(ctx_file), "--query", "q", "--base-url", srv.base_url,
                  "--api-key", API_KEY, "--model", MODEL, "--kernels", "gateway",
                  "--gateway-url", f"http://127.0.0.1:{_closed_port()}",
                  env={"JUPYTER_GATEWAY_AUTH_TOKEN": "tok-down-123"})
    assert res.rc == 4, res.stderr
    assert "could not reach the Jupyter gateway" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "tok-down-123" not in res.stderr + res.stdout


def test_a_wrong_token_exits_4_and_is_written_nowhere(cli, ctx_file, gateway):
    with ScriptedServer(lambda req: repl("FINAL('x')")) as srv:
        res = cli("run", "--context", str(ctx_file), "--query", "q", "--base-url", srv.base_url,
                  "--api-key", API_KEY, "--model", MODEL, "--kernels", "gateway",
                  "--gateway-url", gateway.url, "--run-id", "badtok",
                  env={"JUPYTER_GATEWAY_AUTH_TOKEN": "wrong-tok-456"})
    assert res.rc == 4, res.stderr
    assert "refused the token" in res.stderr and "JUPYTER_GATEWAY_AUTH_TOKEN" in res.stderr
    assert "wrong-tok-456" not in res.stderr + res.stdout
    assert gateway.token not in res.stderr + res.stdout
    data = cli.journal.read_bytes() if cli.journal.exists() else b""
    assert b"wrong-tok-456" not in data and gateway.token.encode() not in data
    assert b"badtok" in data  # the run was journaled (as failed), without the token


@pytest.mark.parametrize("where", ["gateway", "local"])
def test_a_gateway_that_dies_mid_run_leaves_it_resumable(tmp_path, monkeypatch, where):
    why = why_not()
    if why:
        pytest.skip(why)
    gw = start_gateway()
    port = int(gw.url.rsplit(":", 1)[1])
    monkeypatch.setenv("JUPYTER_GATEWAY_AUTH_TOKEN", gw.token)
    journal = str(tmp_path / "j.sqlite3")
    state = {"kill": True}

    def reply(req):
        if not _is_root(req):
            return "sub-" + req["messages"][-1]["content"][:1]
        if _turn(req) == 0:
            return repl("a = llm_query('a')", "print(a)")
        if _turn(req) == 1:
            if state["kill"]:
                gw.stop()  # the gateway and its kernels die before this cell runs
            return repl("b = llm_query('b')", "print(b)")
        return repl("FINAL(a + b)")
    again = None
    try:
        with ScriptedServer(reply) as srv:
            kw = dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL, journal=journal,
                      max_depth=1, kernels="gateway", gateway_url=gw.url)
            with pytest.raises(rlm.KernelError, match="Jupyter gateway"):
                rlm.completion("ctx", "q", run_id="gw-dies", **kw)
            sent = srv.count  # root turns 0 and 1, llm_query('a')
            state["kill"] = False
            if where == "gateway":  # the gateway is back: the run finishes there
                again = start_gateway(port=port, token=gw.token)
                res = resume("gw-dies", journal=journal, context="ctx")
            else:  # or on this host's own kernels
                res = resume("gw-dies", journal=journal, context="ctx", kernels="local")
            assert (res.status, res.answer) == ("completed", "sub-asub-b"), res.reason
            assert srv.count - sent == 2  # only llm_query('b') and turn 2: nothing re-sent
    finally:
        for g in (gw, again):
            if g is not None:
                g.stop()
                shutil.rmtree(g.home, ignore_errors=True)


def test_a_kernel_the_gateway_culls_between_turns_is_restarted(monkeypatch):
    # a gateway that culls kernels idle for 2 s; the model takes 5 s over its second turn, so
    # the root's kernel is culled while it waits: the next cell finds it gone, the loop starts
    # another on the gateway (context bound again) and the run goes on
    why = why_not()
    if why:
        pytest.skip(why)
    gw = start_gateway(cull_idle=2)
    monkeypatch.setenv("JUPYTER_GATEWAY_AUTH_TOKEN", gw.token)
    seen = []

    def reply(req):
        if not _is_root(req):
            return "x"
        turn = _turn(req)
        seen.append(req["messages"][-1]["content"])
        if turn == 0:
            return repl("x = 41")
        if turn == 1:
            import time
            time.sleep(5)
            return repl("print(x + 1)")
        return repl("FINAL(context + str(globals().get('x')))")
    try:
        with ScriptedServer(reply) as srv:
            res = rlm.completion("ctx", "q", base_url=srv.base_url, api_key=API_KEY,
                                 model=MODEL, journal=False, max_depth=1, kernels="gateway",
                                 gateway_url=gw.url)
    finally:
        gw.stop()
        shutil.rmtree(gw.home, ignore_errors=True)
    assert res.status == "completed", res.reason
    assert res.answer == "ctxNone"  # a fresh kernel: the context again, x gone with the old one
    assert res.kernels_started == 2
    assert "restarted" in seen[2] or "died" in seen[2], seen[2]
