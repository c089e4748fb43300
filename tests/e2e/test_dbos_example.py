"""The durable-workflow example (examples/dbos_workflow.py) survives a SIGKILL mid-RLM-step.

A real DBOS app on SQLite in a subprocess runs a workflow whose second step is an RLM run against
the scripted server. While that run waits on its third model call, the process (and its
kernels) is killed with SIGKILL. Launching the app again lets DBOS recover the workflow: the
RLM step runs again with the same run id, so the run resumes from the journal. The test checks
the right answer and that no model call the journal held was sent twice.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from conftest import API_KEY, MODEL, REPO, clean_env, last_user, repl
from scripted_server import Reply

pytest.importorskip("dbos")

EXAMPLE = REPO / "examples" / "dbos_workflow.py"
WORKFLOW = "report-7"


def test_a_killed_workflow_recovers_and_resumes_the_rlm_step(scripted, tmp_path):
    third_seen = threading.Event()
    stalls = {"left": 1}

    def responder(req):
        msgs = req["messages"]
        if msgs[0]["role"] != "system":  # the llm_query sub-call
            return "forty-two" if "42" in last_user(req) else "NONE"
        turn = sum(1 for m in msgs if m["role"] == "user")
        if turn == 1:
            return repl("n = sum(int(w) for w in context.split() if w.isdigit())", "print(n)")
        if turn == 2:
            return repl("words = llm_query('Spell ' + str(n) + ' in words.')", "print(words)")
        if stalls["left"]:  # the first time, hang here until the process is killed
            stalls["left"] -= 1
            third_seen.set()
            return Reply(repl("FINAL(words)"), delay=60)
        return repl("FINAL(words)")

    srv = scripted(responder)
    doc = tmp_path / "doc.txt"
    doc.write_text("filler text without numbers\n" * 20 + "the parts are 40 and 2\n")
    data = tmp_path / "data"
    env = clean_env(OPENAI_BASE_URL=srv.base_url, OPENAI_API_KEY=API_KEY, RLM_MODEL=MODEL)

    def example(*args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(EXAMPLE), *args, "--workflow-id", WORKFLOW,
                                 "--data", str(data)], env=env, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    first = example("start", "--doc", str(doc), "--question", "What is the total, in words?")
    try:
        assert third_seen.wait(90), first.stderr.read1().decode() if first.poll() is not None else ""
        # the RLM step is mid-run (its third model call in flight): kill -9 it and its kernels
        procs = [psutil.Process(first.pid)] + psutil.Process(first.pid).children(recursive=True)
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        first.wait(timeout=10)
        psutil.wait_procs(procs[1:], timeout=10)
    finally:
        if first.poll() is None:
            first.kill()
        first.wait(timeout=10)
    assert first.returncode == -signal.SIGKILL, (first.stdout.read().decode()[-3000:], first.stderr.read().decode()[-3000:])

    from harness.journal import Journal
    journal = Journal(str(data / "rlm-journal.sqlite3"))
    (rec,) = journal.list_runs()
    run_id = rec["run_id"]
    assert run_id.startswith(WORKFLOW) and rec["state"] == "crashed"
    held = {f"{run_id}/{c['call_id']}" for c in journal.model_calls(run_id)}
    assert len(held) == 3  # turn 1, the llm_query, turn 2

    second = example("recover")
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err.decode()[-3000:]
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert report == {"question": "What is the total, in words?", "answer": "forty-two"}

    sent = [c for c in srv.call_ids if c]
    assert all(sent.count(c) == 1 for c in held), "a journaled call was sent twice"
    # only the call that was in flight at the kill was sent again
    assert len(sent) == len(held) + 2 and len(set(sent)) == len(held) + 1
    assert Journal(str(data / "rlm-journal.sqlite3")).get_run(run_id)["state"] == "completed"
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers
