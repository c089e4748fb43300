"""Degenerate turns end early: the same reply with no code run, or the same failing cell,
three times in a row ends the loop as failed with a reason, never the whole iteration budget
(rlm.core.degenerate). Real kernels, the real client, the scripted endpoint."""
from __future__ import annotations

import pytest

from conftest import Reply, last_user, repl, root_requests, script

LOOP = "The answer is the the the " * 200  # a repetition as the 0.5B writes one


def _cut(text: str) -> Reply:
    return Reply(content=text, finish_reason="length")


@pytest.mark.parametrize("replies", [
    [_cut(LOOP)] * 12,                                        # identical, cut at the cap
    [_cut(LOOP[:4000 + 7 * i]) for i in range(12)],           # cut at another point each time
    [_cut("```repl\nprint(1)\n" + LOOP)] * 12,                 # an unclosed block: nothing ran
    ["I cannot see the text, so I will guess: the door is blue."] * 12,  # no code, not cut
], ids=["identical", "near-identical", "unclosed-block", "same-prose"])
def test_the_same_reply_with_no_code_run_ends_the_loop_at_the_third(api, replies):
    res, srv = api(script(replies), "some text", "What colour is the door?", max_iterations=10)
    assert res.status == "failed"
    assert "same reply 3 times in a row" in res.reason and "no code run" in res.reason
    assert res.answer is None
    roots = root_requests(srv)
    assert len(roots) == 3  # not 10 turns and a last one
    # the request was varied once: the third request names the repetition
    assert "You sent the same reply as in your last turn" in last_user(roots[2])
    assert "same reply" not in last_user(roots[1])


def test_the_same_failing_cell_ends_the_loop_at_the_third(api):
    cell = repl("counts = {'author': 0}", "score = 1 / counts['author']")
    res, srv = api(script([cell] * 12), "some text", "q?", max_iterations=10)
    assert res.status == "failed"
    assert "same failing code 3 times in a row" in res.reason
    assert "ZeroDivisionError" in res.reason
    roots = root_requests(srv)
    assert len(roots) == 3
    assert "This is the same code as in your last turn" in last_user(roots[2])


@pytest.mark.parametrize("replies", [
    # different failing cells: the model is trying things
    [repl(f"x = 1 / {i % 1}") if i % 2 else repl(f"y = [][{i}]") for i in range(5)],
    # the same cell, but it runs without error: it did something
    [repl("print('looking')")] * 5,
    # the same reply twice, then another: the streak is broken
    [_cut(LOOP), _cut(LOOP), _cut("Something else entirely, " * 300), _cut(LOOP),
     _cut(LOOP)],
], ids=["different-errors", "same-cell-no-error", "broken-streak"])
def test_turns_that_change_or_run_code_use_the_whole_budget(api, replies):
    res, srv = api(script(replies + [repl("FINAL('done')")]), "some text", "q?",
                   max_iterations=5)
    assert res.status == "completed", res.reason
    assert res.answer == "done"
    assert len(root_requests(srv)) == 6


def test_a_child_loop_that_repeats_itself_ends_early_and_its_parent_goes_on(api):
    """A child's loop (rlm(...) from a cell) is a loop too: it ends at its third repeat, the
    cell gets its failure, and the root is not held for the child's whole budget."""
    child_turns = []

    def responder(req):
        if "child task" in str(req["messages"][1].get("content", "")):
            child_turns.append(1)
            return _cut(LOOP)
        return None

    root = [repl("try:", "    r = rlm('the child text', 'child task')",
                 "except Exception as exc:", "    r = 'child failed: ' + str(exc)",
                 "FINAL(r)")]
    replies = iter(root)

    def all_turns(req):
        return responder(req) or next(replies)

    res, _ = api(script([all_turns] * 5), "root text", "q?", max_depth=2, max_iterations=10)
    assert res.status == "completed", res.reason
    assert "same reply 3 times" in res.answer
    assert len(child_turns) == 3


def test_similar_replies():
    from rlm.core.degenerate import similar
    assert similar(LOOP, LOOP[:3000])
    assert similar("a b c", " a  b\nc ")
    assert not similar("The door is blue.", "The door is red and the key is under the mat.")
    assert not similar(LOOP, "Something else entirely, " * 300)


def test_a_replay_ends_where_the_run_ended_with_the_same_reason(api, tmp_path):
    """The decision uses only what the journal records: a replay serves the three calls and
    ends with the same status and reason, sending nothing."""
    from rlm.api import replay
    journal = tmp_path / "j.sqlite3"
    cell = repl("x = {}['missing']")
    res, srv = api(script([cell] * 12), "some text", "q?", max_iterations=10,
                   journal=str(journal))
    assert res.status == "failed" and "same failing code 3 times" in res.reason
    sent = len(srv.requests)
    again = replay(res.run_id, journal=str(journal), context="some text")
    assert (again.status, again.reason, again.replayed_calls) == (res.status, res.reason, 3)
    assert len(srv.requests) == sent


def test_the_cli_exits_7_and_says_what_repeated(cli, scripted, tmp_path):
    from conftest import endpoint_args
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("some text")
    srv = scripted(script([_cut(LOOP)] * 12))
    res = cli("run", "--context", str(ctx), "--query", "q", "--max-iterations", "10",
              "--no-journal", *endpoint_args(srv))
    assert res.rc == 7, res.stderr
    assert "same reply 3 times in a row" in res.stderr and "Traceback" not in res.stderr
    assert srv.count == 3
