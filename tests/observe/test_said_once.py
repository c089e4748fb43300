"""Messages said once: when a run fails, the reason is on one clear last line of `rlm run`'s
stderr, not on the line of every stage that failed with it (the model call, the iteration, the
run) as well; progress lines stay short.

Before, a closed port's reason was said 4 times and a resume's exit-10 refusal 5 times. Real
`rlm` processes, each failing one way: the endpoint down, an authentication error (401), a
budget cap, a kernel that keeps dying, and a resume that stops at a tool call that may have run.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import API_KEY, MODEL, clean_env, closed_port, repl
from scripted_server import Reply, ScriptedServer

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _responder(req):
    msgs = req["messages"]
    task = msgs[1]["content"] if len(msgs) > 1 else ""
    if "AUTH" in task:
        return Reply(status=401, content='{"error": {"message": "Incorrect API key provided: '
                                         'sk-wrong", "type": "invalid_request_error"}}')
    if "DIE" in task:
        return repl("import os", "os._exit(3)")
    if "BUDGET" in task:
        return repl("x = llm_query('a')", "print(x)")
    if "MAIL" in task:
        return repl("FINAL(send_mail('ann'))")
    return "sub"


@pytest.fixture(scope="module")
def server():
    with ScriptedServer(_responder) as srv:
        yield srv


def _env(tmp: Path) -> dict:
    return clean_env(PYTHONPATH=f"{TOOLS}{os.pathsep}{clean_env()['PYTHONPATH']}",
                     RLM_JOURNAL=str(tmp / "j.sqlite3"), TOOLS_TEST_COUNT=str(tmp / "n.txt"))


def _run(tmp: Path, base_url: str, query: str, *flags: str) -> subprocess.Popen:
    ctx = tmp / "ctx.txt"
    ctx.write_text("some context")
    return subprocess.Popen([sys.executable, "-m", "rlm", "run", "--context", str(ctx),
                             "--query", query, "--base-url", base_url, "--api-key", API_KEY,
                             "--model", MODEL, "--max-attempts", "1", "--run-id", "R1", *flags],
                            cwd=tmp, env=_env(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _said_once(err: str, rc: int, want_rc: int, marker: str) -> None:
    """The last line states the reason (``marker`` in it); no other line repeats it."""
    lines = err.strip().splitlines()
    assert rc == want_rc, (rc, err)
    finals = [ln for ln in lines if ln.startswith("rlm: ") and marker in ln]
    assert len(finals) == 1, err
    last = finals[0]
    reason = last.split(": ", 2)[-1] if last.startswith("rlm: error: ") else \
        last.split(": ", 1)[-1]
    # the reason, and any 40 characters of it, once
    for probe in {reason, reason[:40], reason[-40:], marker}:
        assert err.count(probe) == 1, (probe, err)
    assert "Traceback" not in err, err
    assert all(len(ln) <= 300 for ln in lines if ln.startswith("[rlm]")), err  # short lines


@pytest.mark.parametrize("query,flags,rc,marker", [
    ("DOWN", ["--base-url", "http://127.0.0.1:{port}/v1"], 3, "unreachable"),
    ("AUTH please", [], 3, "Incorrect API key"),
    ("BUDGET please", ["--max-calls", "2"], 5, "budget cap 'calls'"),
    ("DIE please", [], 4, "giving up"),
], ids=["endpoint-down", "auth-401", "budget", "kernel-died"])
def test_a_failed_run_says_its_reason_once(server, tmp_path, query, flags, rc, marker):
    flags = [f.format(port=closed_port()) for f in flags]
    p = _run(tmp_path, server.base_url, query, *flags)
    _, err = p.communicate(timeout=120)
    _said_once(err, p.returncode, rc, marker)


def test_a_resume_refused_at_a_tool_call_says_so_once(server, tmp_path):
    p = _run(tmp_path, server.base_url, "MAIL please", "--max-depth", "0", "--tool",
             "tools_helpers:send_mail")
    count, deadline = tmp_path / "n.txt", time.monotonic() + 60
    while not (count.exists() and count.read_text()) and time.monotonic() < deadline:
        assert p.poll() is None, p.communicate()
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.communicate(timeout=30)
    r = subprocess.run([sys.executable, "-m", "rlm", "resume", "R1"], cwd=tmp_path,
                       env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    _said_once(r.stderr, r.returncode, 10, "not marked idempotent")
    assert re.search(r"\[rlm\] run R1 ended in [\d.]+ s: failed$", r.stderr, re.M), r.stderr
