"""Tools through the other front doors: a Session (whose resume serves the recorded tool calls:
the tool is not called again when the kernel is rebuilt) and ``acompletion``."""
from __future__ import annotations

import asyncio

import rlm
import tools_helpers
from conftest import API_KEY, MODEL, repl, script


def _env(tmp_path, monkeypatch):
    db, count = tmp_path / "staff.db", tmp_path / "calls.txt"
    tools_helpers.make_db(str(db))
    monkeypatch.setenv("TOOLS_TEST_DB", str(db))
    monkeypatch.setenv("TOOLS_TEST_COUNT", str(count))
    return lambda: count.read_text().splitlines() if count.exists() else []


def test_a_session_calls_tools_and_its_resume_calls_none_again(scripted, tmp_path, monkeypatch):
    calls = _env(tmp_path, monkeypatch)
    replies = [repl("row = lookup('alice')", "FINAL(row['room'])"),
               repl("FINAL(row['team'] + '/' + str(len(tools.map('lookup', ['bob', 'carol']))))"),
               repl("FINAL(row['name'])")]
    srv = scripted(script(replies))
    opts = dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL, cell_timeout=10,
                journal=str(tmp_path / "j.sqlite3"), tools=[tools_helpers.lookup])
    with rlm.Session("staff questions", session_id="tools-s", **opts) as s:
        r1 = s.ask("Which room is Alice in?")
        r2 = s.ask("Her team, and how many others did you look up?")
    assert (r1.answer, r2.answer) == ("101", "search/2"), (r1.reason, r2.reason)
    assert sorted(calls()) == ["lookup alice", "lookup bob", "lookup carol"]
    sent = len(srv.requests)
    # the kernel rebuilt from the journal: `row` is back, no tool call and no request repeated
    with rlm.Session.resume("tools-s", contexts=["staff questions"], **opts) as s:
        r3 = s.ask("Her name?")
    assert r3.status == "completed" and r3.answer == "alice", r3.reason
    assert len(calls()) == 3 and len(srv.requests) == sent + 1


def test_acompletion_takes_tools(scripted, tmp_path, monkeypatch):
    calls = _env(tmp_path, monkeypatch)
    srv = scripted(script([repl("FINAL(lookup('dave')['team'])")]))

    async def main():
        return await rlm.acompletion("ctx", "Dave's team?", base_url=srv.base_url,
                                     api_key=API_KEY, model=MODEL, journal=False,
                                     tools=[tools_helpers.lookup])
    res = asyncio.run(main())
    assert res.status == "completed" and res.answer == "billing", res.reason
    assert calls() == ["lookup dave"]
