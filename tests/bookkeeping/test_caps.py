"""Spend caps that hold for the whole tree under fan-out (real server, real kernels)."""
from __future__ import annotations

import json
import threading
import time

import pytest

import rlm
from scripted_server import Reply, ScriptedServer

FANOUT = (
    "```repl\n"
    "import json\n"
    "outs = llm_query_batched(['item %02d ' % i + 'x' * 40 for i in range(64)], return_exceptions=True)\n"
    "ok = [o for o in outs if isinstance(o, str)]\n"
    "refused = [o for o in outs if isinstance(o, BudgetExceeded)]\n"
    "other = [repr(o) for o in outs if not isinstance(o, (str, BudgetExceeded))]\n"
    "caps = sorted({e.cap for e in refused})\n"
    "FINAL(json.dumps({'ok': len(ok), 'refused': len(refused), 'other': other, 'caps': caps,\n"
    "                  'remaining': [e.remaining for e in refused][:1]}))\n"
    "```"
)


def _fanout_server():
    lock = threading.Lock()
    seen = {"sub": 0}

    def responder(req):
        if req["messages"][0]["role"] == "system":
            return Reply(FANOUT, usage={"prompt_tokens": 100, "completion_tokens": 50})
        with lock:
            seen["sub"] += 1
        time.sleep(0.2)
        return Reply("answer", usage={"prompt_tokens": 20, "completion_tokens": 10})
    return responder, seen


def _price_file(tmp_path):
    p = tmp_path / "prices.json"
    # 1000 USD per 1M tokens = 0.001 USD per token, input and output alike
    p.write_text(json.dumps({"m": {"input": 1000.0, "output": 1000.0}}))
    return str(p)


@pytest.mark.parametrize("cap", ["calls", "tokens", "cost"])
def test_64_concurrent_subcalls_never_exceed_the_cap(tmp_path, cap):
    responder, seen = _fanout_server()
    # The root's own call is admitted first (it reserves prompt + 64 output tokens and
    # settles at 150 tokens). Each sub-call reserves its counted prompt + sub_max_tokens=64
    # and settles at 30 tokens. Caps are chosen so that about half the 64 fit.
    kw = dict(max_concurrency=16, sub_max_tokens=64, max_completion_tokens=64, journal=False)
    if cap == "calls":
        kw["max_calls"] = 1 + 32
    elif cap == "tokens":
        kw["max_tokens"] = 150 + 32 * 30
    else:
        kw["max_cost_usd"] = (150 + 32 * 30) * 0.001
        kw["price_file"] = _price_file(tmp_path)
    with ScriptedServer(responder) as srv:
        res = rlm.completion("some context", "q", base_url=srv.base_url, api_key="k", model="m",
                             **kw)
        server_requests = srv.count
        usages = list(srv.usages)
    assert res.status == "completed", res.reason
    out = json.loads(res.answer)
    assert out["other"] == []
    assert out["ok"] + out["refused"] == 64
    assert out["refused"] > 0 and out["caps"] == [cap]
    assert 8 <= out["ok"] <= 56  # about half, depending on how settling interleaves
    # refused calls never reached the server: it saw the root call plus the admitted ones
    assert server_requests == 1 + out["ok"] == 1 + seen["sub"]
    # the recorded spend equals the server's usage and stays within the cap
    total_tokens = sum(u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    assert res.usage["total_tokens"] == total_tokens
    assert res.usage["calls"] == server_requests
    if cap == "calls":
        assert res.usage["calls"] <= kw["max_calls"]
    elif cap == "tokens":
        assert res.usage["total_tokens"] <= kw["max_tokens"]
    else:
        assert res.usage["cost_usd"] == pytest.approx(total_tokens * 0.001)
        assert res.usage["cost_usd"] <= kw["max_cost_usd"] + 1e-12


def test_refused_root_call_ends_the_run_without_an_answer():
    def responder(req):
        return "```repl\nprint(len(context))\n```"  # never calls FINAL
    with ScriptedServer(responder) as srv:
        res = rlm.completion("some context", "q", base_url=srv.base_url, api_key="k", model="m",
                             max_calls=2, journal=False)
        assert srv.count == 2
    assert res.status == "budget_exceeded"
    assert res.cap == "calls"
    assert res.answer is None  # the last reply's code ran without FINAL: no answer


def test_cli_exit_code_names_the_cap(tmp_path):
    import os
    import subprocess
    import sys

    def responder(req):
        return "```repl\nprint(1)\n```"
    ctx = tmp_path / "c.txt"
    ctx.write_text("hello")
    with ScriptedServer(responder) as srv:
        p = subprocess.run([sys.executable, "-m", "rlm", "run", "--context", str(ctx), "--query",
                            "q", "--base-url", srv.base_url, "--api-key", "k", "--model", "m",
                            "--max-calls", "1", "--no-journal"],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ})
    assert p.returncode == 5
    assert "budget cap 'calls'" in p.stderr
    assert "Traceback" not in p.stderr


def test_depth2_rollup_equals_server_usage():
    """Children spend: the parent's and the run's totals include every descendant."""
    lock = threading.Lock()
    by_origin: dict[str, list[dict]] = {"root": [], "child": [], "leaf": []}

    def responder(req):
        msgs = req["messages"]
        turn = sum(1 for m in msgs if m["role"] == "assistant")
        if msgs[0]["role"] != "system":
            origin, text = "leaf", "leaf-answer"
        elif "of 11 characters" in msgs[0]["content"]:  # the children's contexts
            origin = "child"
            text = ("```repl\nx = llm_query('leaf? ' + context)\nFINAL(x + '/' + context)\n```"
                    if turn == 0 else "unused")
        else:
            origin = "root"
            text = ("```repl\nr = rlm_batched(['child-ctx-1', 'child-ctx-2'])\n```" if turn == 0
                    else "```repl\nFINAL('|'.join(r))\n```")
        usage = {"prompt_tokens": 7 + len(str(msgs)) % 13, "completion_tokens": 3 + turn}
        with lock:
            by_origin[origin].append(usage)
        return Reply(text, usage=usage)

    with ScriptedServer(responder) as srv:
        res = rlm.completion("the root context", "q", base_url=srv.base_url, api_key="k",
                             model="m", max_depth=2, journal=False)
    assert res.answer == "leaf-answer/child-ctx-1|leaf-answer/child-ctx-2"

    def tot(us):
        return sum(u["prompt_tokens"] + u["completion_tokens"] for u in us)
    allu = by_origin["root"] + by_origin["child"] + by_origin["leaf"]
    assert res.usage["total_tokens"] == tot(allu)
    assert res.usage["calls"] == len(allu) == 2 + 2 + 2
    tree = res.tree
    children = [s for s in tree.all() if s.kind == "child"]
    assert len(children) == 2
    child_sum = sum(tree.rollup(c.id).total_tokens for c in children)
    assert child_sum == tot(by_origin["child"] + by_origin["leaf"])
    # the root's first iteration contains the cell that started both children
    it0 = tree.rollup("run/iteration-0")
    assert it0.total_tokens == by_origin["root"][0]["prompt_tokens"] + \
        by_origin["root"][0]["completion_tokens"] + child_sum
    assert res.usage["by_level"]["1"]["total_tokens"] == tot(by_origin["child"])
    assert res.usage["by_level"]["2"]["total_tokens"] == tot(by_origin["leaf"])


def test_wall_clock_cap_with_stuck_cell_and_slow_call_in_flight():
    def responder(req):
        if req["messages"][0]["role"] != "system":
            return Reply("slow", delay=60)  # a sub-call that would take a minute
        return ("```repl\nimport threading\n"
                "threading.Thread(target=lambda: llm_query('slow one'), daemon=True).start()\n"
                "while True:\n    pass\n```")
    with ScriptedServer(responder) as srv:
        t0 = time.monotonic()
        res = rlm.completion("ctx", "q", base_url=srv.base_url, api_key="k", model="m",
                             max_wall_seconds=3, cell_timeout=600, journal=False)
        elapsed = time.monotonic() - t0
    assert res.status == "budget_exceeded"
    assert res.cap == "wall"
    assert elapsed < 3 + 2, elapsed
    sub = [s for s in res.tree.all() if s.kind == "llm_query"]
    assert sub and all(s.status in ("budget_exceeded", "failed", "cancelled") for s in sub)


def test_a_call_settling_after_its_run_closed_the_journal_logs_no_traceback(tmp_path, caplog):
    """Ctrl-C as a call is in flight: the run ends and closes its journal, then the abandoned
    call releases its reservation. Its reservation is already in the ledger (what a resume
    counts), so the late release is dropped quietly, not logged as a failure with a traceback
    on the user's terminal."""
    import logging
    from types import SimpleNamespace

    from harness.journal.journal import Journal
    from rlm.core.run_tree import RunTree
    journal = Journal(tmp_path / "j.sqlite3")
    journal.close()
    tree = SimpleNamespace(journal=journal, run_id="r")
    with caplog.at_level(logging.DEBUG, logger="rlm"):
        RunTree._ledger(tree, "run/iteration-0/model_call-0", "resv-1", "released",
                        SimpleNamespace(model="m"), quiet=True)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "journal is closed" in caplog.text
    with pytest.raises(Exception, match="closed"):  # not quiet: still raised
        RunTree._ledger(tree, "c", "resv-2", "released", SimpleNamespace(model="m"))
