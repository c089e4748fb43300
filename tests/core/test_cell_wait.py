"""A cell's own timeout leaves out the time it waits on its sub-calls (issue: on a loaded
machine a cell waiting 125 s on one ``llm_query`` was cut by the default 60 s cell timeout).

The wall cap still bounds the whole run, and a cell's own work is still timed out."""
from __future__ import annotations

import time

from conftest import Reply, last_user, repl, root_requests, script


def _feedback(srv, turn: int) -> str:
    return last_user(root_requests(srv)[turn])


def test_a_cell_waiting_on_slow_subcalls_is_not_timed_out(api):
    # two sequential sub-calls of 1.2 s each and a batch of two: 3.6 s of waiting in a cell
    # whose own timeout is 1 s; before, it was interrupted at 1 s
    def sub(req):
        return Reply(content="A:" + last_user(req), delay=1.2)

    replies = [repl("a = llm_query('one')", "b = llm_query('two')",
                    "c = llm_query_batched(['three', 'four'])", "print('GOT', a, b, c)"),
               repl("FINAL(a + b)")]
    res, srv = api(script(replies, sub), cell_timeout=1)
    assert res.status == "completed", res.reason
    fb = _feedback(srv, 1)
    assert "GOT A:one A:two ['A:three', 'A:four']" in fb, fb
    assert "timeout" not in fb.lower()


def test_a_cells_own_work_is_still_timed_out_after_a_wait(api):
    # the wait is left out, the cell's own 3 s of sleep is not
    def sub(req):
        return Reply(content="fast", delay=0.8)

    replies = [repl("import time", "a = llm_query('x')", "time.sleep(3)", "print('NE' + 'VER')"),
               repl("FINAL('done')")]
    t0 = time.monotonic()
    res, srv = api(script(replies, sub), cell_timeout=1)
    took = time.monotonic() - t0
    assert res.status == "completed", res.reason
    fb = _feedback(srv, 1)
    assert "NEVER" not in fb and "timeout" in fb.lower()
    assert took < 12  # a 1 s timeout and two short turns; loose for a loaded 2-core machine


def test_the_wall_cap_still_ends_a_cell_that_waits(api):
    def sub(req):
        return Reply(content="late", delay=6)

    replies = [repl("a = llm_query('x')", "FINAL(a)")]
    t0 = time.monotonic()
    res, srv = api(script(replies, sub), cell_timeout=1, max_wall_seconds=3)
    took = time.monotonic() - t0
    assert res.status == "budget_exceeded", (res.status, res.reason)
    assert took < 9
