"""Crash resume and replay from the journal, with a real host process killed by SIGKILL."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from harness.journal import Journal
from scripted_server import Reply, ScriptedServer

CONTEXT = "".join(f"<section {i:02d}: the quick brown fox {i * 7 % 31}> " for i in range(12))


def responder(req):
    """Deterministic replies: a function of the request alone, so reruns see the same ones.

    Root (depth 2): turn 0 fans out to 3 children; turn 1 combines with llm_query; turn 2 ends.
    Children: two turns of batched llm_query, then FINAL.
    """
    msgs = req["messages"]
    if msgs[0]["role"] != "system":
        return "sub[" + msgs[0]["content"][-12:] + "]"
    turn = sum(1 for m in msgs if m["role"] == "assistant")
    if "of 120 characters" in msgs[0]["content"]:  # a child's 120-character context
        if turn == 0:
            return "```repl\na = llm_query_batched([context[:30] + ' one', context[:30] + ' two'])\n```"
        if turn == 1:
            return "```repl\nb = llm_query_batched([context[-30:] + ' three', context[-30:] + ' four'])\n```"
        return "```repl\nFINAL('+'.join(a + b))\n```"
    if turn == 0:
        return ("```repl\nparts = [context[i:i + 120] for i in range(0, 360, 120)]\n"
                "outs = rlm_batched(parts, 'summarise')\nprint(len(outs))\n```")
    if turn == 1:
        return "```repl\nx = llm_query('combine: ' + ' / '.join(outs))\nprint(x)\n```"
    return "```repl\nFINAL(x + ' || ' + ' / '.join(outs))\n```"


HOST = textwrap.dedent("""
    import sys
    from pathlib import Path
    import rlm
    res = rlm.completion(Path(sys.argv[1]), "q", base_url=sys.argv[2], api_key="k", model="m",
                         max_depth=2, journal=sys.argv[3], run_id=sys.argv[4], pool_size=2)
    print("ANSWER=" + res.answer, flush=True)
""")


def _cli(*args, env=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "rlm", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or dict(os.environ))


@pytest.fixture()
def setup(tmp_path):
    ctx = tmp_path / "context.txt"
    ctx.write_text(CONTEXT)
    host = tmp_path / "host.py"
    host.write_text(HOST)
    return ctx, host, tmp_path


def _recorded_calls(journal: str, run_id: str) -> set[str]:
    """The call ids the journal holds, as sent in the X-RLM-Call-Id header."""
    con = sqlite3.connect(journal)
    try:
        return {f"{run_id}/{c}" for (c,) in con.execute(
            "SELECT call_id FROM model_calls WHERE run_id = ?", (run_id,))}
    finally:
        con.close()


@pytest.mark.timeout(900)  # 20 kill-and-resume cycles of whole processes: slow on 2 busy cores
def test_crash_at_20_points_then_resume(setup):
    ctx, host, tmp = setup
    state = {"pid": None, "kill_at": None, "n": 0, "after_kill": [], "killed": False}
    lock = threading.Lock()

    def killing_responder(req):
        with lock:
            state["n"] += 1
            n = state["n"]
            if req["_auth"] == "Bearer k-resume":
                # sent by the resuming process, told apart by its key: a request the killed
                # host had already sent can still arrive after the kill, and a client port
                # can be reused, so neither the time nor the connection says whose it is
                state["after_kill"].append(req["_call_id"])
            if state["kill_at"] is not None and n == state["kill_at"] and state["pid"]:
                os.kill(state["pid"], signal.SIGKILL)
                state["killed"] = True
        return responder(req)

    with ScriptedServer(killing_responder) as srv:
        # the uninterrupted run: its answer and how many calls it makes
        j0 = str(tmp / "j0.sqlite3")
        p = subprocess.run([sys.executable, str(host), str(ctx), srv.base_url, j0, "clean"],
                           capture_output=True, text=True, timeout=180)
        assert p.returncode == 0, p.stderr
        expected = p.stdout.split("ANSWER=", 1)[1].strip()
        total = state["n"]
        assert total == 25  # 3 root turns + 1 root llm_query + 3 children x (3 turns + 4 subs)
        points = list(range(1, total + 1))[:20]
        for k in points:
            run_id = f"crash-{k}"
            journal = str(tmp / f"j{k}.sqlite3")
            with lock:
                state.update(n=0, kill_at=k, killed=False, after_kill=[])
            proc = subprocess.Popen([sys.executable, str(host), str(ctx), srv.base_url, journal,
                                     run_id], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
            state["pid"] = proc.pid
            proc.communicate(timeout=180)
            assert proc.returncode == -signal.SIGKILL, f"kill point {k} did not kill the host"
            held = _recorded_calls(journal, run_id)
            with lock:
                state["kill_at"] = None
                state["after_kill"] = []
            r = _cli("resume", run_id, "--journal", journal, "--base-url", srv.base_url,
                     "--api-key", "k-resume", "--model", "m", "--quiet")
            assert r.returncode == 0, f"kill point {k}: {r.stderr}"
            assert r.stdout.strip() == expected, f"kill point {k}"
            resent = [c for c in state["after_kill"] if c in held]
            assert not resent, f"kill point {k}: {len(resent)} request(s) the journal held were sent"
            # only calls not yet journaled (in flight at the kill, or never made) went out
            assert len(state["after_kill"]) == total - len(held), f"kill point {k}"


def test_replay_sends_nothing_and_detects_an_edited_journal(setup):
    ctx, host, tmp = setup
    with ScriptedServer(responder) as srv:
        journal = str(tmp / "j.sqlite3")
        env = dict(os.environ, RLM_JOURNAL=journal)
        r = _cli("run", "--context", str(ctx), "--query", "q", "--base-url", srv.base_url,
                 "--api-key", "k", "--model", "m", "--max-depth", "2", "--run-id", "R1",
                 "--quiet", env=env)
        assert r.returncode == 0, r.stderr
        answer = r.stdout.strip()
        sent = srv.count
        # replay: zero requests, same answer
        rp = _cli("replay", "R1", "--quiet", env=env)
        assert rp.returncode == 0, rp.stderr
        assert rp.stdout.strip() == answer
        assert srv.count == sent
        # the same run id again returns the recorded result, nothing sent
        again = _cli("run", "--context", str(ctx), "--query", "q", "--base-url", srv.base_url,
                     "--api-key", "k", "--model", "m", "--max-depth", "2", "--run-id", "R1",
                     "--json", env=env)
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["answer"] == answer
        assert srv.count == sent
        # edit a recorded request: replay must report the divergence, not serve it
        con = sqlite3.connect(journal)
        call_id, req = con.execute("SELECT call_id, request FROM model_calls WHERE run_id='R1' "
                                   "ORDER BY call_id LIMIT 1").fetchone()
        edited = json.loads(req)
        edited["messages"][-1]["content"] += " (edited)"
        con.execute("UPDATE model_calls SET request = ? WHERE run_id='R1' AND call_id = ?",
                    (json.dumps(edited), call_id))
        con.commit()
        con.close()
        bad = _cli("replay", "R1", env=env)
        assert bad.returncode == 6, bad.stderr
        assert "diverge" in bad.stderr.lower()
        assert call_id in bad.stderr
        assert srv.count == sent


def test_resume_refused_while_running_and_replayed_calls_cost_nothing(setup):
    ctx, host, tmp = setup
    gate = threading.Event()

    def slow(req):
        msgs = req["messages"]
        turn = sum(1 for m in msgs if m["role"] == "assistant")
        if turn == 1:
            gate.wait(60)  # hold the run open
        return ("```repl\nx = llm_query('one')\nprint(x)\n```" if turn == 0
                else "```repl\nFINAL(x)\n```") if msgs[0]["role"] == "system" else "the answer"

    with ScriptedServer(slow) as srv:
        journal = str(tmp / "j.sqlite3")
        proc = subprocess.Popen([sys.executable, str(host), str(ctx), srv.base_url, journal,
                                 "live"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while srv.count < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            r = _cli("resume", "live", "--journal", journal, "--base-url", srv.base_url,
                     "--api-key", "k", "--model", "m")
            assert r.returncode == 2
            assert "still running" in r.stderr
        finally:
            gate.set()
            out, _ = proc.communicate(timeout=120)
        assert "ANSWER=the answer" in out
        sent = srv.count
        # resuming a finished run returns the recorded answer, sends nothing
        r = _cli("resume", "live", "--journal", journal, "--base-url", srv.base_url,
                 "--api-key", "k", "--model", "m", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["answer"] == "the answer"
        assert srv.count == sent


def test_resumed_run_is_charged_only_for_live_calls(setup):
    """Kill after 2 answered calls; the resumed run's usage counts only what it sent."""
    ctx, host, tmp = setup
    state = {"n": 0, "pid": None, "sent_after": 0, "killed": False}

    def resp(req):
        state["n"] += 1
        if state["killed"]:
            state["sent_after"] += 1
        msgs = req["messages"]
        turn = sum(1 for m in msgs if m["role"] == "assistant")
        if state["n"] == 3 and state["pid"]:
            os.kill(state["pid"], signal.SIGKILL)
            state["killed"] = True
        if msgs[0]["role"] != "system":
            return Reply("sub-" + msgs[0]["content"], usage={"prompt_tokens": 10, "completion_tokens": 5})
        text = ["```repl\nx = llm_query('a')\n```", "```repl\ny = llm_query('b')\n```",
                "```repl\nFINAL(x + y)\n```"][min(turn, 2)]
        return Reply(text, usage={"prompt_tokens": 100, "completion_tokens": 20})

    with ScriptedServer(resp) as srv:
        journal = str(tmp / "j.sqlite3")
        proc = subprocess.Popen([sys.executable, str(host), str(ctx), srv.base_url, journal, "c1"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        state["pid"] = proc.pid
        proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL
        r = _cli("resume", "c1", "--journal", journal, "--base-url", srv.base_url, "--api-key",
                 "k", "--model", "m", "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
    assert out["answer"] == "sub-asub-b"
    assert out["replayed_calls"] == 2  # root turn 0 and llm_query('a') came from the journal
    assert out["usage"]["calls"] == state["sent_after"]
    assert out["usage"]["calls"] == 3  # turn 1 (in flight at the kill), llm_query('b'), turn 2
    # over all attempts: the 2 answered before the kill, the one in flight (at its
    # reservation), and the 3 sent by the resume
    every = out["usage"]["all_attempts"]
    assert every["calls"] == 6 and every["open_at_resume"] == 1, every
    answered = 100 + 20 + 10 + 5 + 2 * (100 + 20) + 10 + 5
    assert every["total_tokens"] > answered, every  # plus the reservation of the lost call
    with Journal(journal) as j:
        assert j.get_run("c1")["usage"]["all_attempts"] == every


def test_divergence_policy_stop_then_live(setup):
    """A non-deterministic cell makes the resumed request differ from the journal's."""
    ctx, host, tmp = setup
    state = {"n": 0, "pid": None, "killed": False}

    def resp(req):
        state["n"] += 1
        msgs = req["messages"]
        turn = sum(1 for m in msgs if m["role"] == "assistant")
        if state["n"] == 3 and state["pid"] and not state["killed"]:
            os.kill(state["pid"], signal.SIGKILL)
            state["killed"] = True
        # os.urandom: the kernels' random module is seeded per run (kernels.chance)
        return ["```repl\nimport os\nprint(os.urandom(8).hex())\n```",
                "```repl\nprint('second')\n```",
                "```repl\nFINAL('done')\n```"][min(turn, 2)]

    with ScriptedServer(resp) as srv:
        journal = str(tmp / "j.sqlite3")
        proc = subprocess.Popen([sys.executable, str(host), str(ctx), srv.base_url, journal, "d1"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        state["pid"] = proc.pid
        proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL
        before = srv.count
        r = _cli("resume", "d1", "--journal", journal, "--base-url", srv.base_url,
                 "--api-key", "k", "--model", "m")
        assert r.returncode == 6, r.stderr
        assert "run/iteration-1/model_call-0" in r.stderr  # the turn that saw the random output
        assert srv.count == before  # stopped before sending anything
        r = _cli("resume", "d1", "--journal", journal, "--base-url", srv.base_url,
                 "--api-key", "k", "--model", "m", "--on-divergence", "live", "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["answer"] == "done"
        assert out["replayed_calls"] == 1  # turn 0 only; live from the diverging turn on


def test_a_run_with_a_price_file_and_a_cost_cap_resumes_without_giving_it_again(tmp_path):
    # the price file's path is recorded with the run: resume reads it again (it used to fail
    # with 'no price known' and `rlm resume` had no --price-file to give it)
    import rlm
    from rlm.api import replay, resume

    prices = tmp_path / "prices.json"
    prices.write_text('{"priced-model": {"input": 1000, "output": 1000}}')
    state = {"fail": True}

    def reply(req):
        turn = sum(1 for m in req["messages"] if m["role"] == "assistant")
        if turn == 1 and state["fail"]:
            return Reply(status=400, content="bad request (once)")
        if turn == 0:
            return "```repl\nx = 6 * 7\n```"
        return "```repl\nFINAL(str(x))\n```"

    journal = str(tmp_path / "j.sqlite3")
    with ScriptedServer(reply) as srv:
        kw = dict(base_url=srv.base_url, api_key="k", model="priced-model", journal=journal)
        with pytest.raises(rlm.EndpointError):
            rlm.completion("ctx", "q", run_id="priced", price_file=str(prices),
                           max_cost_usd=5.0, **kw)
        state["fail"] = False
        res = resume("priced", journal=journal, context="ctx")
        assert (res.status, res.answer) == ("completed", "42"), res.reason
        assert res.usage["cost_usd"] > 0  # priced from the recorded file
        sent = srv.count
        again = replay("priced", journal=journal, context="ctx")  # replay needs no prices
        assert (again.status, again.answer, srv.count) == ("completed", "42", sent)
        # the file moved: resume says where it looked, and takes the new path
        state["fail"] = True
        with pytest.raises(rlm.EndpointError):
            rlm.completion("ctx", "q", run_id="priced-2", price_file=str(prices),
                           max_cost_usd=5.0, **kw)
        state["fail"] = False
        moved = prices.rename(tmp_path / "moved.json")
        with pytest.raises(rlm.ConfigError, match="prices.json"):
            resume("priced-2", journal=journal, context="ctx")
        res = resume("priced-2", journal=journal, context="ctx", price_file=str(moved))
        assert (res.status, res.answer) == ("completed", "42"), res.reason
