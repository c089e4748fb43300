"""At most once: the ``rlm`` CLI process is killed (SIGKILL) while a tool call runs, then
``rlm resume`` either stops and names the call (a tool not marked idempotent: it may have done
its work already) or calls it again and completes (an idempotent one). Each tool call appends a
line to a file, so the test counts how often the tool really ran."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import API_KEY, MODEL, assert_clean_error, clean_env, repl
from harness.journal import Journal
from scripted_server import ScriptedServer

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def server():
    def answer(req):
        tool = "fetch_page('u1')" if "IDEM-Q" in req["messages"][1]["content"] else \
            "send_mail('ann')"
        return repl(f"FINAL({tool})")
    with ScriptedServer(answer) as srv:
        yield srv


def _env(tmp: Path) -> dict:
    return clean_env(PYTHONPATH=f"{HERE}{os.pathsep}{clean_env()['PYTHONPATH']}",
                     OPENAI_API_KEY=API_KEY, RLM_JOURNAL=str(tmp / "j.sqlite3"),
                     TOOLS_TEST_COUNT=str(tmp / "calls.txt"))


def _killed_mid_call(server, tmp: Path, tool: str, query: str) -> None:
    """Start ``rlm run --tool tools_helpers:TOOL`` and SIGKILL it once the tool is running."""
    (tmp / "ctx.txt").write_text("nothing to see\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlm", "run", "--context", str(tmp / "ctx.txt"), "--query",
         query, "--base-url", server.base_url, "--model", MODEL, "--max-depth", "0",
         "--tool", f"tools_helpers:{tool}", "--run-id", "R1"],
        cwd=tmp, env=_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    count = tmp / "calls.txt"
    deadline = time.monotonic() + 60
    while not (count.exists() and count.read_text()) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    assert count.read_text(), "the tool was never called"
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def _resume(tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlm", "resume", "R1"], cwd=tmp,
                          env=_env(tmp), capture_output=True, text=True, timeout=120)


def test_resume_stops_at_an_unfinished_call_of_a_tool_that_is_not_idempotent(server, tmp_path):
    _killed_mid_call(server, tmp_path, "send_mail", "MAIL-Q")
    with Journal(tmp_path / "j.sqlite3") as j:
        (row,) = j.tool_calls("R1")
    assert row["status"] == "started" and row["call_id"] == "run/iteration-0/cell-0/tool-0"
    sent = len(server.requests)
    res = _resume(tmp_path)
    assert res.returncode == 10, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("rlm: error:")]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
    assert "tool call run/iteration-0/cell-0/tool-0 (send_mail)" in errors[0]
    assert "not marked idempotent" in errors[0] and "idempotent=True" in errors[0]
    assert (tmp_path / "calls.txt").read_text().splitlines() == ["send_mail ann"]  # once only
    assert len(server.requests) == sent  # the recorded reply was served, nothing sent


def test_resume_calls_an_idempotent_tool_again_and_completes(server, tmp_path):
    _killed_mid_call(server, tmp_path, "fetch_page", "IDEM-Q")
    sent = len(server.requests)
    res = _resume(tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "page of u1"
    assert (tmp_path / "calls.txt").read_text().splitlines() == ["fetch_page u1"] * 2
    assert len(server.requests) == sent
    with Journal(tmp_path / "j.sqlite3") as j:
        (row,) = j.tool_calls("R1")
        assert j.get_run("R1")["state"] == "completed"
    assert row["status"] == "done" and row["attempts"] == 2 and row["result"] == "page of u1"


def test_a_tool_that_cannot_be_imported_is_a_clear_error(cli, tmp_path):
    (tmp_path / "ctx.txt").write_text("x\n")
    res = cli("run", "--context", str(tmp_path / "ctx.txt"), "--base-url", "http://127.0.0.1:9/v1",
              "--model", MODEL, "--api-key", API_KEY, "--tool", "no_such_module:fn")
    assert_clean_error(res, 2, "--tool no_such_module:fn: cannot import module 'no_such_module'")
