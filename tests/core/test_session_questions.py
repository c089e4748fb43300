"""Sessions (rlm.Session): one root kernel and conversation across questions, real kernels, the
real ``openai`` client against a scripted endpoint on 127.0.0.1, a real SQLite journal."""
from __future__ import annotations

import pytest

import rlm
import rlm.api
from conftest import API_KEY, MODEL, Reply, last_user, repl, root_requests, script
from harness.journal import Journal


def _opts(srv, journal) -> dict:
    return dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL, journal=str(journal),
                cell_timeout=10)


def test_three_questions_share_the_kernel_variables_and_the_conversation(scripted, tmp_path):
    journal = tmp_path / "j.sqlite3"
    replies = [
        # question 1: computes a variable, then answers from it
        repl("words = context.split()", "print('N', len(words))"),
        repl("FINAL(len(words))"),
        # question 2: uses the variable question 1 made (never recomputed)
        repl("FINAL(' '.join(reversed(words)))"),
        # question 3: a cell rebinds the new reserved names; the next cell sees them again
        repl("context_1 = None", "contexts = []", "print(SHOW_VARS())"),
        repl("FINAL(f'{context_1.upper()}|{len(contexts)}|{contexts[0] is context}')"),
    ]
    srv = scripted(script(replies))
    with rlm.Session("alpha beta gamma", session_id="three", **_opts(srv, journal)) as s:
        r1 = s.ask("How many words?")
        kernel_pid = s._held.kernel.pid
        r2 = s.ask("The words backwards?")
        assert s.add_context("the appendix") == 1
        r3 = s.ask("Shout the appendix.")
        assert s._held.kernel.pid == kernel_pid  # one kernel for all three

    assert [r.status for r in (r1, r2, r3)] == ["completed"] * 3, [r.reason for r in (r1, r2, r3)]
    assert (r1.answer, r2.answer, r3.answer) == ("3", "gamma beta alpha", "THE APPENDIX|2|True")
    assert [r.run_id for r in (r1, r2, r3)] == ["three-q1", "three-q2", "three-q3"]
    roots = root_requests(srv)
    # question 2's first request: question 1's whole conversation, then the new question
    q2 = roots[2]["messages"]
    assert q2[:-1] == roots[1]["messages"] + [{"role": "assistant", "content": replies[1]}]
    opening = q2[-1]["content"]
    assert "your answer was: 3" in opening and "still there" in opening
    assert opening.endswith("Question: The words backwards?")
    # question 3 is told of the context added, by name
    assert "`context_1`" in roots[3]["messages"][-1]["content"]
    assert "words" in last_user(roots[4])  # SHOW_VARS: the user's variables, not context_1
    assert "context_1" not in last_user(roots[4])
    # each question is its own journaled run, linked to the session and its predecessor
    with Journal(journal) as j:
        links = [j.get_run(f"three-q{n}")["options"]["session"] for n in (1, 2, 3)]
        states = [j.get_run(f"three-q{n}")["state"] for n in (1, 2, 3)]
    assert states == ["completed"] * 3
    assert [(x["id"], x["question"], x["previous_run"]) for x in links] == [
        ("three", 1, None), ("three", 2, "three-q1"), ("three", 3, "three-q2")]
    assert links[2]["contexts"][0]["context_sha256"] and links[1]["contexts"] == []
    # a later question re-driven on its own would lack the session's kernel: a clear refusal
    with pytest.raises(rlm.ConfigError, match=r"question 2 of session three.*Session.resume"):
        rlm.api.replay("three-q2", journal=str(journal))


def test_session_caps_lower_each_question_and_refuse_a_spent_session(scripted, tmp_path):
    replies = [repl("print(context_1)"), repl("FINAL(context_1)"),  # question 1: 2 calls
               repl("x = 1"), repl("FINAL(x)")]  # question 2: 1 call left of 3
    srv = scripted(script(replies))
    with rlm.Session("ctx", session_id="capped", session_max_calls=3,
                     **_opts(srv, tmp_path / "j.sqlite3")) as s:
        s.add_context("added before the first question")
        r1 = s.ask("q1")
        r2 = s.ask("q2")
        sent = len(srv.requests)
        with pytest.raises(rlm.BudgetExceeded, match="session_calls") as refused:
            s.ask("q3")
    assert r1.answer == "added before the first question"
    # question 1's task names the context added before it
    assert "`context_1`" in root_requests(srv)[0]["messages"][1]["content"]
    assert (r2.status, r2.cap, r2.usage["calls"]) == ("budget_exceeded", "calls", 1)
    assert refused.value.limit == 3 and refused.value.used == 3
    assert len(srv.requests) == sent == 3  # the refused question sent nothing
    assert s.spent["calls"] == 3


def test_a_kernel_that_dies_is_replaced_with_every_context_bound_again(scripted, tmp_path):
    replies = [repl("import os", "os._exit(1)"),
               repl("FINAL(context_0 + '+' + context_1)")]
    srv = scripted(script(replies))
    with rlm.Session("first", **_opts(srv, tmp_path / "j.sqlite3")) as s:
        s.add_context("second")
        res = s.ask("join them")
        assert s._held.kernel is not None and s._held.kernel.is_alive()
    assert (res.status, res.answer) == ("completed", "first+second"), res.reason
    assert "restarted" in last_user(root_requests(srv)[1])


def test_bad_session_input_gives_clear_errors(scripted, tmp_path):
    journal = tmp_path / "j.sqlite3"
    srv = scripted(script([repl("FINAL(1)")]))
    o = _opts(srv, journal)
    with pytest.raises(rlm.ConfigError, match="give session_id, not run_id"):
        rlm.Session("c", run_id="r1", **o)
    with pytest.raises(rlm.ConfigError, match="session_id must be"):
        rlm.Session("c", session_id="no spaces please", **o)
    with pytest.raises(rlm.ConfigError, match="--session-max-calls|session_max_calls"):
        rlm.Session("c", session_max_calls=0, **o)
    with pytest.raises(rlm.ConfigError, match="no journal at"):
        rlm.Session.resume("nope", **o)
    with rlm.Session("c", session_id="once", **o) as s:
        with pytest.raises(rlm.ConfigError, match="query must be a str"):
            s.ask(42)
        assert s.ask("q").answer == "1"
    with pytest.raises(rlm.ConfigError, match=r"Session.resume\('once'\)"):
        rlm.Session("c", session_id="once", **o)
    with pytest.raises(rlm.ConfigError, match="closed"):
        s.ask("again")
    with pytest.raises(rlm.ConfigError, match="no session 'nope'"):
        rlm.Session.resume("nope", **o)
    with pytest.raises(rlm.ConfigError, match="given as a value"):
        rlm.Session.resume("once", **o)


def test_a_cancelled_question_mid_session_replays_up_to_where_it_was_cut(scripted, tmp_path):
    import threading

    from rlm.aio import CancelToken
    replies = [repl("n = 1", "FINAL(n)"),
               Reply(content=repl("n = 100", "FINAL(n)"), delay=1.0),  # cancelled: its cell never ran
               repl("n += 1", "FINAL(n)"),  # question 3: the cancelled turn never ran
               repl("FINAL(n * 10)")]
    srv = scripted(script(replies))
    o = _opts(srv, tmp_path / "j.sqlite3")
    with rlm.Session("c", session_id="cut", **o) as s:
        assert s.ask("one").answer == "1"
        token = CancelToken()
        threading.Timer(0.3, token.cancel).start()
        with pytest.raises(KeyboardInterrupt):
            s.ask("slow", cancel=token)
        assert s.ask("three").answer == "2"
    sent = len(srv.requests)
    with rlm.Session.resume("cut", contexts=["c"], **o) as s:
        assert len(srv.requests) == sent  # all three replayed: nothing sent
        assert [(r.status, r.answer) for r in s.results] == [
            ("completed", "1"), ("cancelled", None), ("completed", "2")]
        assert s.ask("four").answer == "20"


def test_a_question_cut_off_inside_its_cell_resumes_with_the_cells_variables(scripted,
                                                                             tmp_path):
    """Ctrl-C (a cancel) while a cell runs: the resumed session runs that cell again for as
    long as it ran, then ends the question there without reading its output, as it did; the
    next question's request is then the one recorded (before, the replay ran the cell to its
    end, fed its output back and diverged at question 2's first call)."""
    import threading
    import time

    from rlm.aio import CancelToken
    replies = [repl("import time", "x = 5", "time.sleep(20)", "x = 6"), repl("FINAL(x)"),
               repl("FINAL(x * 10)")]
    srv = scripted(script(replies))
    o = _opts(srv, tmp_path / "j.sqlite3")
    o["cell_timeout"] = 60
    with rlm.Session("c", session_id="cutcell", **o) as s:
        token = CancelToken()
        threading.Timer(1.5, token.cancel).start()
        with pytest.raises(KeyboardInterrupt):
            s.ask("slow", cancel=token)
        assert s.ask("after").answer == "5"
    sent = len(srv.requests)
    t0 = time.monotonic()
    with rlm.Session.resume("cutcell", contexts=["c"], **o) as s:
        assert len(srv.requests) == sent
        assert time.monotonic() - t0 < 15  # the cell was cut again, not slept to its end
        assert [(r.status, r.answer) for r in s.results] == [("cancelled", None),
                                                             ("completed", "5")]
        assert s.ask("ten times").answer == "50"


def test_two_open_sessions_with_one_id_and_a_closed_one_say_what_to_do(scripted, tmp_path):
    srv = scripted(script([repl("FINAL(1)"), repl("FINAL(2)")]))
    o = _opts(srv, tmp_path / "j.sqlite3")
    s1, s2 = rlm.Session("c", session_id="dup", **o), rlm.Session("c", session_id="dup", **o)
    try:
        assert s2.ask("first").answer == "1"
        with pytest.raises(rlm.errors.ConfigError, match="another Session with this id") as e:
            s1.ask("second")
        assert "Session.resume('dup')" in str(e.value)
    finally:
        s1.close()
        s2.close()
    with pytest.raises(rlm.errors.ConfigError, match=r"closed; continue it with "
                                                     r"rlm.Session.resume\('dup'\)"):
        s2.ask("after close")
