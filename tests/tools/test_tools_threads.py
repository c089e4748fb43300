"""Tool calls one cell makes from threads get their stage ids in the order they reach the host,
which the threads leave to chance: replay and resume match them as a set (each recorded call
serving once, by its arguments), as they match a cell's plain sub-calls. Before, the replay of
such a run stopped at a "divergence at tool call ... its arguments differ"."""
from __future__ import annotations

import rlm
import rlm.api
import tools_helpers
from conftest import API_KEY, MODEL, repl, script

NAMES = ["alice", "bob", "carol", "dave", "erin", "frank"]


def test_tool_calls_from_threads_replay_in_any_order(scripted, tmp_path, monkeypatch):
    db, count = tmp_path / "staff.db", tmp_path / "calls.txt"
    tools_helpers.make_db(str(db))
    monkeypatch.setenv("TOOLS_TEST_DB", str(db))
    monkeypatch.setenv("TOOLS_TEST_COUNT", str(count))
    code = repl(
        "import os, threading, time",
        "rooms = {}",
        "def ask(n):",
        "    time.sleep(os.urandom(1)[0] / 1000)  # an arrival order no seed decides",
        "    rooms[n] = lookup(n)['room']",
        f"threads = [threading.Thread(target=ask, args=(n,)) for n in {NAMES!r}]",
        "[t.start() for t in threads]",
        "[t.join() for t in threads]",
        "FINAL(sum(rooms.values()))")
    srv = scripted(script([code]))
    journal = str(tmp_path / "j.sqlite3")
    res = rlm.completion("staff", "Sum the rooms.", base_url=srv.base_url, api_key=API_KEY,
                         model=MODEL, journal=journal, tools=[tools_helpers.lookup])
    assert res.status == "completed", res.reason
    called, sent = len(count.read_text().splitlines()), len(srv.requests)
    assert called == len(NAMES)
    for _ in range(3):  # three replays, each in an order of its own
        again = rlm.api.replay(res.run_id, journal=journal, context="staff")
        assert again.status == "completed" and again.answer == res.answer, again.reason
    assert len(count.read_text().splitlines()) == called and len(srv.requests) == sent
