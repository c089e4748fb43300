"""Compaction end to end: a scripted OpenAI endpoint with a window of N tokens (characters / 4,
as the scripted server counts usage) refuses any longer request with OpenAI's 400
``context_length_exceeded``; real kernels, a real journal, real replays.

A 30-turn run whose every cell prints 4,000 characters fails there without compaction, and
completes with it: the journal holds the ``compaction`` stages, a replay sends no request, and
the kernel's ``history`` holds the whole transcript.
"""
from __future__ import annotations

import re
import threading

import pytest

import rlm
from conftest import API_KEY, MODEL, repl, script
from rlm.prompting import prompts
from scripted_server import Reply, WindowedEndpoint, prompt_tokens_of

WINDOW = 9000  # tokens (characters / 4): about seven turns of 4,000 characters of output
TURNS = 30


def _task(req: dict) -> str:
    msgs = req.get("messages") or []
    return str(msgs[1].get("content") or "") if len(msgs) > 1 else ""


class Model:
    """The scripted model: root turns print 4,000 characters each and add their number to
    ``acc``; a summary request is answered with notes naming the variable; a request whose task
    says CHILD-TASK is the child's (six turns of the same, then its FINAL)."""

    def __init__(self) -> None:
        self.root = self.child = self.summaries = 0
        self.lock = threading.Lock()

    def turn(self, n: int, last: int, tag: str) -> str:
        if n == last:
            return repl("FINAL(f'{acc}|{len(history)}|{history[2][\"content\"][:13]}')")
        body = [f"acc = globals().get('acc', 0) + {n}",
                f"print('{tag}{n:02d} ' + 'lorem ipsum dolor sit amet ' * 160)"]
        if tag == "R" and n == 2:
            body.insert(0, "child = rlm('a context for the child', 'CHILD-TASK: count to six')")
        if tag == "R" and n == 3:
            body.append("print('CHILD=' + child)")
        if n == last - 1:
            body.append("print('HISTORY', len(history), history[-1]['role'])")
        return repl(*body)

    def __call__(self, req: dict):
        first = (req.get("messages") or [{}])[0]
        if first.get("role") != "system":  # rlm() at the depth limit: a plain completion
            return "six"
        system = first.get("content") or ""
        with self.lock:
            if system == prompts.COMPACT_SYSTEM:
                self.summaries += 1
                return (f"NOTES {self.summaries}: `acc` holds the running sum; each turn printed "
                        "filler; go on with the next turn.")
            if "CHILD-TASK" in _task(req):
                self.child += 1
                return self.turn(self.child, 7, "C")
            self.root += 1
            return self.turn(self.root, TURNS, "R")


def run(scripted, journal, **options):
    model = Model()
    endpoint = WindowedEndpoint(model, WINDOW)
    srv = scripted(endpoint)
    opts = dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL, journal=str(journal),
                max_iterations=TURNS, max_depth=2, max_output_chars=4000)
    opts.update(options)
    ctx = journal.parent / "context.txt"  # a file: `rlm replay` loads it again by itself
    ctx.write_text("the context: filler, and the turns print more\n")
    return (lambda: rlm.completion(ctx, "Sum the turn numbers.", **opts)), srv, endpoint, model


def compaction_stages(journal, run_id):
    """The run's stages and its compaction stages, from the journal; the run verifies."""
    from harness.journal import Journal
    from harness.journal.verify import verify_run
    j = Journal(str(journal))
    try:
        stages = j.stages(run_id)
        verdict = verify_run(j, run_id)
    finally:
        j.close()
    assert verdict.ok, [str(v) for v in verdict.violations]
    return stages, [s for s in stages if s.get("kind") == "compaction"]


def test_without_compaction_the_30_turn_run_fails_at_the_window(scripted, tmp_path):
    go, srv, endpoint, model = run(scripted, tmp_path / "j.sqlite3", context_window=0)
    with pytest.raises(rlm.EndpointError, match="too long for the model's window"):
        go()
    assert len(endpoint.rejected) == 1 and endpoint.rejected[0] > WINDOW
    assert model.summaries == 0 and model.root < 12  # it never got near turn 30


def test_with_a_window_it_completes_replays_and_keeps_the_history(scripted, tmp_path):
    journal = tmp_path / "j.sqlite3"
    go, srv, endpoint, model = run(scripted, journal, context_window=WINDOW)
    res = go()
    assert res.status == "completed", res.reason
    acc, n_history, first = res.answer.split("|")
    assert int(acc) == sum(range(1, TURNS))
    # the whole transcript: system, task, 29 replies and 29 feedbacks, then the 30th reply
    assert int(n_history) == 2 + 2 * (TURNS - 1) + 1
    assert first == "```repl\nacc ="  # the first reply, long compacted away
    assert endpoint.rejected == []  # nothing was ever refused: compaction came first
    assert max(prompt_tokens_of(r) + r["max_tokens"] for r in srv.requests) <= WINDOW
    stages, comps = compaction_stages(journal, res.run_id)
    root = [s for s in comps if s["level"] == 0]
    child = [s for s in comps if s["level"] == 1]
    assert len(root) >= 4 and child, [s["id"] for s in comps]  # root and child compacted
    assert all(s["status"] == "completed" and s["evidence"].startswith("NOTES") for s in comps)
    assert all(s["meta"]["trigger"] == "window" and s["meta"]["window"] ==
               {"tokens": WINDOW, "source": "option"} for s in comps)
    assert all(s["meta"]["after_tokens"] < s["meta"]["before_tokens"] for s in comps)
    assert all(re.fullmatch(r".*/iteration-\d+/compaction-0", s["id"]) for s in comps)
    assert model.summaries == len(comps)
    # the child compacted too, and its own `history` held its own whole transcript
    assert any("CHILD=21|15|```repl\nacc =" in str(m["content"])
               for r in srv.requests for m in r["messages"])
    # after a compaction the model is told, with the notes and where the transcript is
    told = [r for r in srv.requests if "NOTES" in str(r["messages"][1]["content"])]
    assert told and "`history`" in told[0]["messages"][1]["content"]
    # a replay sends nothing and reaches the same answer through the same stages
    sent = srv.count
    again = rlm.api.replay(res.run_id, journal=str(journal))
    assert again.answer == res.answer and srv.count == sent
    assert again.replayed_calls == sent


def test_a_refusal_teaches_the_window_once_and_replays(scripted, tmp_path, cli):
    """No window known (an unknown model, no option): the first refused request teaches it
    (the error names it), the turn is compacted and sent again; later turns compact first."""
    journal = tmp_path / "cli-journal.sqlite3"  # the cli fixture's journal
    go, srv, endpoint, model = run(scripted, journal, max_depth=1)
    res = go()
    assert res.status == "completed", res.reason
    assert len(endpoint.rejected) == 1  # refused once, never again
    stages, comps = compaction_stages(journal, res.run_id)
    first = comps[0]
    assert first["meta"]["trigger"] == "refused"
    assert first["meta"]["window"] == {"tokens": WINDOW, "source": "endpoint"}
    refused = next(s for s in stages if s["id"] == first["meta"]["refused"])
    assert refused["kind"] == "model_call" and refused["status"] == "failed"
    assert "context length" in refused["error"]
    assert all(s["meta"]["trigger"] == "window" for s in comps[1:]) and len(comps) >= 4
    sent = srv.count
    out = cli("replay", res.run_id)
    assert out.rc == 0, out.stderr
    assert srv.count == sent  # `rlm replay`: not one request
    shown = cli("show", res.run_id).stdout
    assert f"compaction-0 [compaction] completed L0 {MODEL}" in shown
    assert re.search(r"refused: [\d,]+->[\d,]+ tokens of 9,000, \d+ message\(s\) summarised",
                     shown), shown
    assert re.search(r"model_call-0 \[model_call\] failed", shown), shown


def test_history_is_a_reserved_name_and_works_at_depth_zero(api):
    """``history`` is put back after a cell rebinds or deletes it, and, not being a sub-call,
    it answers at ``max_depth=0`` too; without any compaction it is the conversation itself."""
    replies = [repl("history = 'mine'", "print(type(history).__name__)"),
               repl("del history"),
               repl("FINAL(f\"{len(history)} {history[-1]['role']} {history[0]['role']}\")")]
    res, srv = api(script(replies), "ctx", "what now?", max_depth=0)
    assert res.status == "completed", res.reason
    assert res.answer == f"{2 + 2 * 2 + 1} assistant system"  # restored, then fetched
    assert srv.requests[1]["messages"][-1]["content"].strip() == "Output:\nstr"  # its own


def test_a_failed_run_resumes_with_its_summaries_served_and_the_cap_counts_them(scripted,
                                                                                tmp_path):
    """The endpoint fails (HTTP 500, no retry) at root turn 16, after compactions; resuming
    serves every recorded call, summaries included, and sends only what is left. A call cap
    counts the summary calls like any other."""
    journal = tmp_path / "j.sqlite3"
    go, srv, endpoint, model = run(scripted, journal, context_window=WINDOW, max_depth=1,
                                   max_attempts=1, run_id="compacted-then-failed")
    answer, failed = model.__call__, []

    def flaky(req):  # the 16th root turn fails once
        root = req["messages"][0]["content"] != prompts.COMPACT_SYSTEM and "CHILD" not in \
            _task(req) and req["messages"][0]["role"] == "system"
        if root and model.root == 15 and not failed:
            failed.append(req)
            return Reply(status=500, content="upstream down")
        return answer(req)
    endpoint.responder = flaky
    with pytest.raises(rlm.EndpointError):
        go()
    first = srv.count
    assert len(compaction_stages(journal, "compacted-then-failed")[1]) >= 2
    res = rlm.api.resume("compacted-then-failed", journal=str(journal), base_url=srv.base_url,
                         api_key=API_KEY)
    assert res.status == "completed" and res.answer.startswith(f"{sum(range(1, TURNS))}|61|")
    assert res.replayed_calls == first - 1  # every recorded call served, none sent again
    comps = compaction_stages(journal, "compacted-then-failed")[1]
    assert len(comps) >= 4 and all(s["status"] == "completed" for s in comps)
    # a call cap holds the summary calls too: refused before it is sent
    journal2 = tmp_path / "j2.sqlite3"
    go2, srv2, _, _ = run(scripted, journal2, context_window=WINDOW, max_depth=1, max_calls=7)
    capped = go2()
    assert capped.status == "budget_exceeded" and srv2.count == 7
    comps2 = compaction_stages(journal2, capped.run_id)[1]
    assert [s["status"] for s in comps2] == ["budget_exceeded"], comps2
