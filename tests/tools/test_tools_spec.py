"""The user's tools without a kernel: what a tool is, how the ``tools`` option is checked and
recorded, the JSON rule, the kernel's stand-ins, the cap, and the journal's tool calls."""
from __future__ import annotations

import inspect

import pytest

import rlm
import tools_helpers
from harness.budget.accountant import Accountant, Budget
from harness.errors import BudgetExceeded, DivergenceError
from harness.journal import Journal, request_hash
from harness.replay import Replay
from kernels.tool_stubs import json_problem, tool_names
from rlm.config.build import build_options, resume_options, stored_options
from rlm.errors import ConfigError
from rlm.prompting.prompts import system_prompt
from rlm.tools import as_tools, prompt_tools, replay_tools, tool_records


def search(query: str, limit: int = 5) -> list:
    """Search the index.

    Returns at most ``limit`` hits."""
    return [query] * limit


@pytest.mark.parametrize("name", ["context", "llm_query", "tools", "FINAL", "context_3", "print",
                                  "_private", "class", "two words"])
def test_a_tool_may_not_take_a_reserved_or_unusable_name(name):
    with pytest.raises(ConfigError, match="tool name"):
        rlm.tool(search, name=name)


def test_bad_tool_specs_and_duplicates_get_clear_errors():
    with pytest.raises(ConfigError, match="cannot import module 'no_such_mod'"):
        as_tools(["no_such_mod:fn"])
    with pytest.raises(ConfigError, match="has no 'nope'"):
        as_tools(["tools_helpers:nope"])
    with pytest.raises(ConfigError, match="module:function"):
        as_tools(["just-a-name"])
    with pytest.raises(ConfigError, match="two tools are named 'search'"):
        as_tools([search, rlm.tool(len, name="search")])
    with pytest.raises(ConfigError, match="not a function"):
        as_tools([42])


def test_read_only_implies_idempotent_and_levels_are_checked():
    assert rlm.tool(read_only=True)(search).idempotent
    assert not rlm.tool(search).idempotent
    assert rlm.tool(search, levels=[2, 0]).levels == (0, 2)
    with pytest.raises(ConfigError, match="levels"):
        rlm.tool(search, levels=[-1])
    t = rlm.tool(search)
    assert t("a", 2) == ["a", "a"]  # still a function on the host


def test_the_journal_records_specs_and_a_resume_imports_them_again():
    def local(x):
        return x
    tools = as_tools(["tools_helpers:lookup", tools_helpers.fetch_page, local])
    recs = tool_records(tools)
    assert [r["spec"] for r in recs] == ["tools_helpers:lookup", "tools_helpers:fetch_page", None]
    assert recs[1]["idempotent"] and not recs[0]["idempotent"]
    # resumed: importable ones come back; the one recorded by name only must be given again
    with pytest.raises(ConfigError, match="recorded with the tool 'local'.*--tool module:function"):
        as_tools(recs)
    back = as_tools([*recs, rlm.tool(lambda x: x, name="local")])
    assert [t.name for t in back] == ["lookup", "fetch_page", "local"]  # the recorded order
    assert back[0].fn is tools_helpers.lookup and back[1].idempotent
    # the options record round trip (rlm.config.build)
    opts = build_options({"tools": ["tools_helpers:lookup"], "base_url": "http://h/v1"},
                         ("http://h/v1", None, "m"))
    ctx = type("C", (), {"source": "/c.txt", "fmt": "text", "encoding": "utf-8", "sha256": "x"})
    rec = {"options": stored_options(opts, ctx)}
    assert resume_options(rec)["tools"] == tool_records(opts.tools)
    assert replay_tools(rec["options"]["tools"])[0].fn is None


def test_the_prompt_lists_name_signature_and_first_paragraph_of_each_tool():
    meta = {"type": "str", "chars": 10, "tokens_estimate": 3}
    for profile in ("small", "general"):
        text = system_prompt(meta, can_recurse=True, profile=profile,
                             tools=prompt_tools(as_tools([search]), 0))
        assert "- `search(query: str, limit: int = 5) -> list`: Search the index." in text
        assert "Returns at most" not in text and 'tools.map("search"' in text
    plain = system_prompt(meta, can_recurse=True, profile="general")
    assert "tools.map" not in plain and "Tools:" not in plain
    custom = system_prompt(meta, can_recurse=True, template="Only {meta}",
                           tools=prompt_tools(as_tools([search]), 0))
    assert custom.startswith("Only ") and "`search(" in custom


def test_kernel_stand_ins_keep_signature_and_docstring_and_refuse_non_json():
    sent = []
    names = tool_names([as_tools([search])[0].kernel_spec()], {
        "_call": lambda op, **a: sent.append((op, a)) or "ok", "_batch_results": None,
        "ERROR_CLASSES": {}, "RLMKernelError": Exception})
    stub = names["search"]
    assert str(inspect.signature(stub)) == "(query: str, limit: int = 5) -> list"
    assert inspect.getdoc(stub).startswith("Search the index.")
    assert stub("q", limit=2) == "ok"
    assert sent == [("tool", {"tool": "search", "args": ["q"], "kwargs": {"limit": 2}})]
    with pytest.raises(TypeError, match=r"argument `limit` is a set.*Nothing was sent"):
        stub("q", limit={1})
    with pytest.raises(TypeError, match="missing a required argument"):
        stub()
    assert len(sent) == 1
    assert json_problem({"a": [1, 2.5, None, True, ("t",)]}) is None
    assert "key 1" in json_problem({1: "x"})
    assert "nan" in json_problem([float("nan")])
    loop: list = []
    loop.append(loop)
    assert "nested" in json_problem(loop)


def test_the_tool_call_cap_is_admitted_per_call_and_carried_over():
    acct = Accountant(Budget(max_tool_calls=3, max_calls=10))
    acct.carry_over_tool_calls(2)
    acct.admit_tool_call()
    with pytest.raises(BudgetExceeded) as err:
        acct.admit_tool_call()
    assert err.value.cap == "tool_calls" and acct.tool_calls() == 3
    acct.reserve("m", 10, 10)  # model calls are not counted against it
    with pytest.raises(ValueError, match="max_tool_calls"):
        Budget(max_tool_calls=-1)


def test_journal_tool_calls_and_a_replay_that_lacks_one(tmp_path):
    with Journal(tmp_path / "j.sqlite3") as j:
        j.create_run("r", query="q", model="m")
        req = {"tool": "search", "args": ["a"], "kwargs": {}}
        j.record_tool_start("r", "run/c/tool-0", tool="search", request_hash=request_hash(req),
                            request=req)
        j.record_tool_start("r", "run/c/tool-0", tool="search", request_hash=request_hash(req),
                            request=req)  # an idempotent call made again
        j.record_tool_result("r", "run/c/tool-0", status="done", result=["A"])
        (row,) = j.tool_calls("r")
        assert (row["status"], row["result"], row["attempts"]) == ("done", ["A"], 2)
        assert j.tool_call_attempts("r") == 2
        replay = Replay(j, "r", strict=True)
        assert replay.tool_call("run/c/tool-0", request_hash(req))["result"] == ["A"]
        with pytest.raises(DivergenceError, match="never calls a tool"):
            replay.tool_call("run/c/tool-1", request_hash(req))
        with pytest.raises(DivergenceError, match="arguments differ"):
            replay.tool_call("run/c/tool-0", request_hash({**req, "args": ["b"]}))
        lines = []
        j.export_jsonl("r", type("W", (), {"write": lambda self, s: lines.append(s)})())
        assert any('"type": "tool_call"' in ln for ln in lines)
