"""Issue 26, kind 3: a replay depends on nothing the kernel leaves to chance.

A kernel's sources of chance are fixed per run by ``--kernel-seed`` (default 0) and recorded with
the run's options in the journal: the hash seed (set order), ``random``, NumPy. A replay and a
resume run under the recorded value, and a replay serves the sub-calls of one cell whatever
their order when they are the same set of requests, never mixing up requests that differ.

Real kernels, the real CLI in subprocesses, the scripted server on 127.0.0.1, real SQLite
journals.
"""
from __future__ import annotations

import json

import pytest

from conftest import API_KEY, MODEL, endpoint_args, last_user, repl, script, sub_requests

import rlm
from harness.errors import DivergenceError
from harness.journal import Journal, request_hash
from harness.replay import Replay

WORDS = "{'alpha', 'beta', 'gamma', 'delta', 'epsilon', 'zeta', 'eta', 'theta'}"


def echo(req):
    return "ECHO:" + last_user(req)


@pytest.fixture
def ctx_file(tmp_path):
    p = tmp_path / "ctx.txt"
    p.write_text("some context")
    return p


def test_example_a_set_loop_replays_three_times(cli, scripted, ctx_file):
    srv = scripted(script([repl(f"out = [llm_query(w) for w in {WORDS}]",
                                "FINAL(','.join(out))")], echo))
    first = cli("run", "--context", str(ctx_file), "--query", "q", "--run-id", "set-1",
                *endpoint_args(srv))
    assert first.rc == 0, first.stderr
    for i in range(3):  # each replay is a new kernel process
        rp = cli("replay", "set-1")
        assert rp.rc == 0, (i, rp.stderr)
        assert rp.stdout == first.stdout
    assert len(sub_requests(srv)) == 8  # the replays sent nothing
    with Journal(str(cli.journal)) as j:
        assert j.get_run("set-1")["options"]["kernel_seed"] == 0  # recorded with the run


CHANCE = repl("import json, random, numpy as np",
              f"order = list({WORDS})",
              "vals = dict(order=order, hash=hash('abc'), random=random.random(),",
              "            shuffled=random.sample(range(20), 5), np=float(np.random.rand()),",
              "            rng=float(np.random.default_rng().random()),",
              "            rng2=float(np.random.default_rng().random()),",
              "            seeded=float(np.random.default_rng(5).random()))",
              "FINAL(json.dumps(vals))")


def test_hash_random_and_numpy_repeat_per_seed_and_replay(api, journal_path):
    pytest.importorskip("numpy")
    a, _ = api(script([CHANCE]), run_id="seed-a", journal=str(journal_path))
    b, _ = api(script([CHANCE]), run_id="seed-b", journal=str(journal_path))
    c, _ = api(script([CHANCE]), run_id="seed-c", journal=str(journal_path), kernel_seed=7)
    va, vb, vc = (json.loads(r.answer) for r in (a, b, c))
    assert va == vb  # two runs, two kernel processes, one seed
    for key in ("order", "hash", "random", "shuffled", "np", "rng"):
        assert va[key] != vc[key], key  # another seed, other values
    assert va["rng"] != va["rng2"]  # successive generators differ
    assert va["seeded"] == vc["seeded"]  # a seed the code gives is its own
    with Journal(str(journal_path)) as j:
        assert j.get_run("seed-c")["options"]["kernel_seed"] == 7
    from rlm.api import replay
    for run_id in ("seed-a", "seed-c"):  # replay under the recorded seed: the same answer
        assert replay(run_id, journal=str(journal_path), context="some context").status == "completed"


def test_a_resume_runs_under_the_recorded_seed(scripted, journal_path):
    # turn 0 prints set order; turn 1's request holds that output (journaled); turn 2 fails.
    # The resume re-runs turn 0's cell: under another seed turn 1 would differ (a divergence)
    state = {"down": True}

    def resp(req):
        msgs = req["messages"]
        turn = sum(1 for m in msgs if m["role"] == "assistant")
        if turn == 0:
            return repl(f"print(list({WORDS}), __import__('random').random())")
        if turn == 1:
            return repl("print('second')")
        if state["down"]:
            from scripted_server import Reply
            return Reply(status=400, content="down for now")
        return repl("FINAL('resumed')")

    srv = scripted(resp)
    common = dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL,
                  journal=str(journal_path))
    with pytest.raises(rlm.errors.RLMError):
        rlm.completion("ctx", "q", run_id="res-1", kernel_seed=11, **common)
    state["down"] = False
    # given another seed (or none), the recorded one still decides
    res = rlm.completion("ctx", "q", run_id="res-1", kernel_seed=3, **common)
    assert res.status == "completed" and res.answer == "resumed"
    assert res.replayed_calls == 2


def any_order(call: str) -> list[str]:
    """A cell making the same sub-calls in an order that differs every time it runs (drawn
    from ``os.urandom``, which no seed fixes)."""
    return ["import os, json",
            f"words = sorted({WORDS}, key=lambda w: os.urandom(8))",
            call,
            "FINAL(json.dumps(dict(zip(words, out)), sort_keys=True))"]


@pytest.mark.parametrize("call", [
    "out = [llm_query('say ' + w) for w in words]",
    "import concurrent.futures as cf\nwith cf.ThreadPoolExecutor(4) as ex:\n"
    "    out = list(ex.map(lambda w: llm_query('say ' + w), words))",
    "out = [rlm('say ' + w) for w in words]",  # depth-limit fallbacks
], ids=["sequential", "threads", "fallbacks"])
def test_a_cell_making_the_same_sub_calls_in_another_order_replays(api, journal_path, call):
    res, srv = api(script([repl(*any_order(call))], echo), run_id="ord-1",
                   journal=str(journal_path))
    assert res.status == "completed", res.reason
    for key, answer in json.loads(res.answer).items():
        assert answer.startswith("ECHO:say " + key), (key, answer)
    from rlm.api import replay
    for _ in range(2):
        rp = replay("ord-1", journal=str(journal_path), context="some context")
        assert rp.answer == res.answer and rp.replayed_calls == 9


def test_a_cell_whose_sub_calls_differ_is_a_divergence_not_a_mix(api, journal_path):
    # same count, one request new each time: never served another request's answer
    cell = any_order("out = [llm_query('say ' + w) for w in words[:-1]] + "
                        "[llm_query('fresh ' + os.urandom(4).hex())]")
    res, _ = api(script([repl(*cell)], echo), run_id="mix-1", journal=str(journal_path))
    assert res.status == "completed", res.reason
    from rlm.api import replay
    with pytest.raises(DivergenceError, match="llm_query"):
        replay("mix-1", journal=str(journal_path), context="some context")


# --------------------------------------------------------------------------- the matching


def _recorded(journal: Journal, run_id: str, calls: dict[str, str]) -> None:
    """Record ``calls`` (call id -> prompt; the response is 'R:' + call id) as a finished run."""
    journal.create_run(run_id, query="q", model=MODEL)
    for call_id, prompt in calls.items():
        req = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
        journal.record_model_call(run_id, call_id, request_hash=request_hash(req), request=req,
                                  response={"text": "R:" + call_id}, usage={}, attempts=[])
    journal.finish_run(run_id, status="completed", answer="x")


def _h(prompt: str) -> str:
    return request_hash({"model": MODEL, "messages": [{"role": "user", "content": prompt}]})


CELL = "run/iteration-0/cell-0"


def test_matching_serves_each_recorded_sibling_once_and_never_another_request(tmp_path):
    with Journal(str(tmp_path / "j.sqlite3")) as j:
        _recorded(j, "m", {f"{CELL}/llm_query-0/model_call-0": "A",
                           f"{CELL}/llm_query-1/model_call-0": "B",
                           f"{CELL}/llm_query-2/model_call-0": "A",
                           f"{CELL}/fallback-0/model_call-0": "B",
                           "run/iteration-1/cell-0/llm_query-0/model_call-0": "C"})
        r = Replay(j, "m", strict=True)

        def served(seg: str, prompt: str, cell: str = CELL) -> str:
            return r.lookup(f"{cell}/{seg}/model_call-0", _h(prompt))["response"]["text"]

        # the cell now asks B, A, A: B is served llm_query-1's answer, each A its own
        assert served("llm_query-0", "B") == f"R:{CELL}/llm_query-1/model_call-0"
        assert served("llm_query-1", "A") == f"R:{CELL}/llm_query-0/model_call-0"
        assert served("llm_query-2", "A") == f"R:{CELL}/llm_query-2/model_call-0"
        assert served("fallback-0", "B") == f"R:{CELL}/fallback-0/model_call-0"  # its own kind
        with pytest.raises(DivergenceError):  # the recorded set is used up
            r.lookup(f"{CELL}/llm_query-3/model_call-0", _h("A"))
        with pytest.raises(DivergenceError):  # another cell's request is not this cell's
            r.lookup("run/iteration-1/cell-0/llm_query-0/model_call-0", _h("A"))
        assert r.served == 4


def test_matching_in_a_resume_sends_live_what_the_journal_does_not_hold(tmp_path):
    with Journal(str(tmp_path / "j.sqlite3")) as j:
        _recorded(j, "m", {f"{CELL}/llm_query-0/model_call-0": "A",
                           f"{CELL}/llm_query-1/model_call-0": "B"})
        r = Replay(j, "m", strict=False)
        # a call the crash left unrecorded goes live; it does not take a sibling's answer
        assert r.lookup(f"{CELL}/llm_query-2/model_call-0", _h("A")) is None
        assert r.lookup(f"{CELL}/llm_query-0/model_call-0", _h("B"))["response"]["text"] \
            == f"R:{CELL}/llm_query-1/model_call-0"
        assert r.lookup(f"{CELL}/llm_query-1/model_call-0", _h("A"))["response"]["text"] \
            == f"R:{CELL}/llm_query-0/model_call-0"
        fresh = Replay(j, "m", strict=False)
        with pytest.raises(DivergenceError):  # a request the cell never made: a divergence
            fresh.lookup(f"{CELL}/llm_query-0/model_call-0", _h("Z"))
