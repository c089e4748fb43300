"""A run that ends without an answer has none: whatever stopped it (a cap on calls, tokens, cost
or wall time, the iteration limit, a cancel, a failure), ``answer`` is None in the Result, null
in ``rlm run --json`` and in the journal, unless executed code set it. The model's last reply
(a code block that never ran, or ran without FINAL) is never an answer."""
from __future__ import annotations

import json
import threading
import time

import pytest

import rlm
from harness.journal import Journal
from conftest import API_KEY, MODEL, endpoint_args, is_root, repl
from scripted_server import Reply

LOOKING = repl("print('still looking')")


def _price_file(tmp_path):
    p = tmp_path / "prices.json"
    p.write_text(json.dumps({MODEL: {"input": 1000.0, "output": 1000.0}}))  # $0.001 a token
    return str(p)


def _big_usage(req):
    # the first root reply reports 5000 prompt tokens: the next call's reservation (its
    # counted prompt, well over 1000 tokens with the system prompt, plus its output cap) breaks
    # a 6000-token cap, while the first call's reservation fits it
    return Reply(LOOKING, usage={"prompt_tokens": 5000, "completion_tokens": 50})


@pytest.mark.parametrize("cap", ["calls", "tokens", "cost"])
def test_a_capped_run_returns_no_answer_not_the_last_reply(api, tmp_path, cap):
    kw: dict = {"calls": dict(max_calls=2),
                "tokens": dict(max_tokens=6000, max_completion_tokens=64),
                "cost": dict(max_cost_usd=6.0, max_completion_tokens=64,
                             price_file=_price_file(tmp_path))}[cap]
    res, srv = api(_big_usage, **kw)
    assert res.status == "budget_exceeded", res.reason
    assert res.cap == cap
    assert srv.count >= 1  # the model replied (a code block) before the cap stopped the run
    assert res.answer is None
    assert res.to_dict()["answer"] is None


def test_a_wall_cap_during_a_model_call_returns_no_answer(api):
    def responder(req):
        if sum(m["role"] == "assistant" for m in req["messages"]):
            time.sleep(6)  # the second call is still in flight when the wall cap falls
        return LOOKING
    t0 = time.monotonic()
    res, _ = api(responder, max_wall_seconds=2)
    assert res.status == "budget_exceeded" and res.cap == "wall", res.reason
    assert res.answer is None
    assert time.monotonic() - t0 < 6


def test_a_final_that_ran_before_the_wall_cap_is_the_partial_answer(api):
    # FINAL ran, then the same cell outlived the wall cap: executed code set this answer (the
    # cap leaves a loaded machine's kernel start the time to get there)
    res, _ = api(lambda req: repl("FINAL('kept')", "import time", "time.sleep(60)"),
                 max_wall_seconds=8, cell_timeout=600)
    assert res.status == "budget_exceeded" and res.cap == "wall", res.reason
    assert res.answer == "kept"


def test_iterations_running_out_leave_no_answer(api):
    res, srv = api(lambda req: LOOKING, max_iterations=1)
    assert res.status == "failed"
    assert srv.count == 2  # the turn and the last turn asking for FINAL
    assert res.answer is None


def test_a_cancelled_run_has_no_answer(api):
    from rlm.aio import CancelToken
    token = CancelToken()

    def responder(req):
        threading.Timer(0.3, token.cancel).start()
        return repl("import time", "time.sleep(20)")
    with pytest.raises(KeyboardInterrupt) as exc:
        api(responder, cancel=token)
    res = exc.value.result
    assert res.status == "cancelled"
    assert res.answer is None


def test_a_child_stopped_by_a_cap_gives_its_cell_an_error_not_a_reply(api):
    def responder(req):
        if is_root(req) and "CHILDQ" in json.dumps(req["messages"][:2]):
            return LOOKING  # the child never sets an answer
        return repl("try:",
                    "    out = repr(rlm('child context', 'CHILDQ'))",
                    "except ChildRLMError as e:",
                    "    out = f'{type(e).__name__}:{e.status}'",
                    "FINAL(out)")
    res, _ = api(responder, max_depth=2, max_calls=3)
    assert res.status == "completed", res.reason
    assert res.answer == "ChildRLMError:budget_exceeded"


def test_cli_json_and_journal_keep_no_answer(cli, scripted, tmp_path):
    srv = scripted(lambda req: LOOKING)
    ctx = tmp_path / "c.txt"
    ctx.write_text("hello")
    out = cli("run", "--context", str(ctx), "--query", "q", *endpoint_args(srv),
              "--max-calls", "1", "--json")
    assert out.rc == 5, out.stderr
    doc = json.loads(out.stdout)
    assert doc["status"] == "budget_exceeded" and doc["answer"] is None
    assert "partial answer" not in out.stderr
    rec = Journal(str(cli.journal)).get_run(doc["run_id"])
    assert rec["state"] == "budget_exceeded" and rec["answer"] is None
    # a replay of it reaches the same (absent) answer
    from rlm.api import replay
    again = replay(doc["run_id"], journal=str(cli.journal))
    assert again.status == "budget_exceeded" and again.answer is None
    assert API_KEY not in out.stdout
