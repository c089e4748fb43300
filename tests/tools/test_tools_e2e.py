"""The user's tools end to end: real kernels, the scripted OpenAI-protocol server, a real
SQLite database behind the tool, and the run's real SQLite journal.

One scripted server serves every test of the module; each test's loops are told apart by the
query in their first message, and each turn's reply by how many replies came before."""
from __future__ import annotations

import json
import re

import pytest

import rlm
import tools_helpers
from conftest import API_KEY, MODEL, repl
from harness.journal import Journal
from scripted_server import Reply, ScriptedServer

SCRIPTS: dict[str, list[str]] = {}  # query -> the replies of that loop, turn by turn


def responder(req: dict):
    msgs = req.get("messages") or []
    if not msgs or msgs[0].get("role") != "system":
        return Reply(status=400, content="these tests make no llm_query")
    first = next((m["content"] for m in msgs if m["role"] == "user"), "")
    turn = sum(m["role"] == "assistant" for m in msgs)
    for query, replies in SCRIPTS.items():
        if query in first and turn < len(replies):
            return replies[turn]
    return Reply(status=400, content=f"no script for turn {turn} of {first[:80]!r}")


@pytest.fixture(scope="module")
def server():
    with ScriptedServer(responder) as srv:
        yield srv


@pytest.fixture
def env(tmp_path, monkeypatch):
    db, count = tmp_path / "staff.db", tmp_path / "calls.txt"
    tools_helpers.make_db(str(db))
    monkeypatch.setenv("TOOLS_TEST_DB", str(db))
    monkeypatch.setenv("TOOLS_TEST_COUNT", str(count))
    return tmp_path, (lambda: count.read_text().splitlines() if count.exists() else [])


def _run(server, query, journal, **options):
    ctx = journal.parent / "context.txt"
    ctx.write_text("the context: a staff list lives in the database\n")
    return rlm.completion(ctx, query, base_url=server.base_url, api_key=API_KEY,
                          model=MODEL, journal=str(journal), **options)


def test_sqlite_tool_from_root_and_depth_2_child_then_show_view_and_replay(server, env, capsys):
    tmp, calls = env
    SCRIPTS["ROOT-Q"] = [repl(
        "import json",
        "one = lookup('alice')",
        "many = tools.map('lookup', ['bob', ('carol',)])",
        "deep = rlm('child context', 'CHILD1-Q')",
        "FINAL(json.dumps([one, many, json.loads(deep)]))")]
    SCRIPTS["CHILD1-Q"] = [repl("FINAL(rlm('grandchild context', 'CHILD2-Q'))")]
    SCRIPTS["CHILD2-Q"] = [repl(
        "import json",
        "a = lookup('dave')",
        "b = tools.map('lookup', [{'name': 'erin'}, 'frank'])",
        "FINAL(json.dumps([a, b]))")]
    journal = tmp / "j.sqlite3"
    res = _run(server, "ROOT-Q", journal, tools=[tools_helpers.lookup], max_depth=3)
    assert res.status == "completed", res.reason
    one, many, (a, b) = json.loads(res.answer)
    assert one == {"name": "alice", "team": "search", "room": 101}
    assert [m["room"] for m in many] == [102, 103] and a["team"] == "billing"
    assert [m["name"] for m in b] == ["erin", "frank"]
    assert sorted(calls()) == sorted(f"lookup {n}" for n in
                                     ("alice", "bob", "carol", "dave", "erin", "frank"))
    # the tool stages, in the journal: under the cells that made them, at levels 0 and 2
    with Journal(journal) as j:
        rows = {t["call_id"]: t for t in j.tool_calls(res.run_id)}
        stages = [s for s in j.stages(res.run_id) if s["kind"] == "tool"]
    assert set(rows) == {s["id"] for s in stages} and len(rows) == 6
    assert all(t["status"] == "done" and t["attempts"] == 1 for t in rows.values())
    assert sorted(s["level"] for s in stages) == [0, 0, 0, 2, 2, 2]
    root_ids = sorted(i for i in rows if i.count("/") == 3)
    assert root_ids == [f"run/iteration-0/cell-0/tool-{k}" for k in range(3)]
    assert rows[root_ids[0]]["result"]["room"] == 101
    # the system prompt of every level lists the tool with its signature and docstring
    prompts = [r["messages"][0]["content"] for r in server.requests[-3:]]
    assert all("`lookup(name: str) -> dict`: Look a person up in the staff database" in p
               for p in prompts)
    # rlm show: one line per tool stage with the call and its result
    from rlm.cli.main import main
    assert main(["show", res.run_id, "--journal", str(journal)]) == 0
    shown = capsys.readouterr().out
    assert re.search(r"tool-0 \[tool\] completed L0 .* lookup\('alice'\) -> \{'name': 'alice'",
                     shown), shown
    assert len(re.findall(r"\[tool\] completed L2", shown)) == 3
    # the HTML view carries the tool stages and their calls
    page = tmp / "view.html"
    assert main(["view", res.run_id, "--journal", str(journal), "-o", str(page)]) == 0
    html = page.read_text()
    assert "lookup(&#x27;dave&#x27;)" in html or "lookup('dave')" in html
    assert '"tool"' in html
    assert main(["verify", res.run_id, "--journal", str(journal)]) == 0
    capsys.readouterr()
    # rlm replay: no tool called, no model request sent, the same answer
    before, sent = len(calls()), len(server.requests)
    assert main(["replay", res.run_id, "--journal", str(journal)]) == 0
    out = capsys.readouterr()
    assert "same outcome (completed), 3 model call(s) served from the journal, 0 sent" in out.err
    assert len(calls()) == before and len(server.requests) == sent


def test_max_tool_calls_holds_under_a_batch(server, env):
    tmp, calls = env
    SCRIPTS["CAP-Q"] = [repl(
        "got = tools.map('lookup', ['alice', 'bob', 'carol', 'dave', 'erin'],"
        " return_exceptions=True)",
        "print([type(g).__name__ for g in got])",
        "print([getattr(g, 'cap', None) for g in got])",
        "try:\n    lookup('frank')\nexcept BudgetExceeded as e:\n    print('refused:', e.cap)",
        "FINAL(str(sum(isinstance(g, dict) for g in got)))")]
    res = _run(server, "CAP-Q", tmp / "j.sqlite3", tools=[tools_helpers.lookup],
               max_tool_calls=3, max_depth=0)
    assert res.status == "completed" and res.answer == "3", res.reason
    assert len(calls()) == 3  # exactly the cap: the refused items were never called
    with Journal(tmp / "j.sqlite3") as j:
        out = j.cells(res.run_id)[0]["output"]["output"]
        stages = [s for s in j.stages(res.run_id) if s["kind"] == "tool"]
        assert len(j.tool_calls(res.run_id)) == 3
    assert "['dict', 'dict', 'dict', 'BudgetExceeded', 'BudgetExceeded']" in out
    assert "refused: tool_calls" in out
    assert sorted(s["status"] for s in stages) == ["budget_exceeded"] * 3 + ["completed"] * 3


def _bad_result(x: str) -> set:
    """Returns a set, which JSON cannot hold."""
    return {x}


def _slow(x: str) -> str:
    """Takes longer than the run's tool timeout."""
    import time
    time.sleep(2)
    return x


def test_typed_errors_reach_the_cell_and_the_run_goes_on(server, env):
    tmp, calls = env
    SCRIPTS["ERR-Q"] = [
        repl("try:\n    lookup(object())\nexcept TypeError as e:\n    print('TE:', e)",
             "try:\n    lookup('nobody')\nexcept ToolError as e:\n    print('TOOL:', e)",
             "try:\n    bad_result('x')\nexcept ToolError as e:\n    print('JSON:', e)",
             "try:\n    slow('x')\nexcept ToolError as e:\n    print('SLOW:', e)",
             "lookup('nobody')"),
        repl("FINAL(lookup('alice')['team'])")]
    res = _run(server, "ERR-Q", tmp / "j.sqlite3", max_depth=0, tool_timeout=0.5,
               tools=[tools_helpers.lookup, rlm.tool(_bad_result, name="bad_result"),
                      rlm.tool(_slow, name="slow")])
    assert res.status == "completed" and res.answer == "search", res.reason
    with Journal(tmp / "j.sqlite3") as j:
        cell = j.cells(res.run_id)[0]["output"]
        stages = {s["id"]: s for s in j.stages(res.run_id) if s["kind"] == "tool"}
    out = cell["output"]
    assert "TE: lookup(): argument `name` is a builtins.object" in out or \
        "TE: lookup(): argument `name` is a object" in out, out
    assert "Nothing was sent." in out
    assert "TOOL: KeyError: \"no staff member named 'nobody'\"" in out, out
    assert "JSON: TypeError: tool 'bad_result' returned a value that cannot cross" in out, out
    assert "SLOW: TimeoutError: tool 'slow' stopped waiting" in out, out
    assert "ToolError" in (cell["error"] or "")  # the uncaught one ends that cell, not the run
    # the unserialisable argument never reached the host: no stage, no call
    assert calls().count("lookup nobody") == 2 and "lookup alice" in calls()
    assert sum(s["status"] == "failed" for s in stages.values()) == 4


def test_tools_only_at_their_levels_and_prompt_without_them(server, env):
    tmp, _ = env
    SCRIPTS["LVL-Q"] = [repl("FINAL(rlm('c', 'LVLCHILD-Q'))")]
    SCRIPTS["LVLCHILD-Q"] = [repl("try:\n    lookup('alice')\n    FINAL('had it')\n"
                                  "except NameError:\n    FINAL('no lookup here')")]
    res = _run(server, "LVL-Q", tmp / "j.sqlite3", max_depth=2,
               tools=[rlm.tool(tools_helpers.lookup, levels=[0])])
    assert res.answer == "no lookup here", res.reason
    child = [r for r in server.requests if "LVLCHILD-Q" in r["messages"][1]["content"]][-1]
    assert "lookup" not in child["messages"][0]["content"]
    assert "tools.map" not in child["messages"][0]["content"]
