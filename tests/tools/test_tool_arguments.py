"""A tool call takes only what the tool declares, from real cells against real kernels: `args`
a list and `kwargs` an object (a dict sent as `args` is not taken as its keys), no name the
function does not declare, no `_` name unless the tool allows it, and arguments and results
within `max_tool_bytes`; a refused call reaches no tool and leaves the journal small."""
from __future__ import annotations

import json

import pytest

import rlm
import tools_helpers
from conftest import API_KEY, MODEL, repl
from harness.journal import Journal
from scripted_server import ScriptedServer

RAW = ("import kernels.runtime as _rt",
       "def raw(**a):",
       "    try:",
       "        return repr(_rt._call('tool', **a))",
       "    except Exception as e:",
       "        return f'{type(e).__name__}: {e}'")

SCRIPT: list[str] = []


@pytest.fixture(scope="module")
def server():
    with ScriptedServer(lambda req: SCRIPT[0]) as srv:
        yield srv


@pytest.fixture
def env(tmp_path, monkeypatch):
    count = tmp_path / "calls.txt"
    monkeypatch.setenv("TOOLS_TEST_COUNT", str(count))
    return tmp_path, (lambda: count.read_text().splitlines() if count.exists() else [])


def _run(server, tmp, lines, **options):
    SCRIPT[:] = [repl(*RAW, "import json", *lines)]
    res = rlm.completion("ctx", "q", base_url=server.base_url, api_key=API_KEY, model=MODEL,
                         journal=str(tmp / "j.sqlite3"), max_depth=0, **options)
    assert res.status == "completed", res.reason
    return res, json.loads(res.answer)


def test_args_must_be_a_list_and_kwargs_an_object(server, env):
    tmp, calls = env
    res, out = _run(server, tmp, [
        "FINAL(json.dumps([",
        "  raw(tool='greet', args={'name': 'ann'}),",          # a dict as args: not its keys
        "  raw(tool='greet', args='ann'),",                    # a string as args
        "  raw(tool='greet', args=['ann'], kwargs=['punct']),",  # a list as kwargs
        "  raw(tool='greet', args=['ann'], kwargs={'punct': '?'}),",
        "]))"], tools=[tools_helpers.greet])
    assert out[0].startswith("ToolError: TypeError: greet(): `args` must be a list"), out[0]
    assert "got dict" in out[0]
    assert out[1].startswith("ToolError: TypeError: greet(): `args` must be a list"), out[1]
    assert out[2].startswith("ToolError: TypeError: greet(): `kwargs` must be an object"), out[2]
    assert out[3] == "'hello ann?'"
    assert calls() == ["greet ann"]  # only the well-formed call reached the tool
    with Journal(tmp / "j.sqlite3") as j:
        assert len(j.tool_calls(res.run_id)) == 1


def test_names_the_tool_does_not_declare_are_refused(server, env):
    tmp, calls = env
    _, out = _run(server, tmp, [
        "FINAL(json.dumps([",
        "  raw(tool='greet', args=['ann'], kwargs={'shout': True}),",  # undeclared
        "  raw(tool='greet', args=['ann', '!', 'extra']),",              # one too many
        "  raw(tool='greet', kwargs={'punct': '.'}),",                   # `name` missing
        "  raw(tool='echo_kw', kwargs={'a': 1, '_b': 2}),",              # a private name
        "  raw(tool='echo_kw', kwargs={'a': 1}),",                       # **fields takes `a`
        "  raw(tool='greet', args=['ann'], kwargs={'__class__': 1}),",
        "  tagged('t', _tag='mine'),",                                   # allowed by the tool
        "]))"], tools=[tools_helpers.greet, tools_helpers.echo_kw, tools_helpers.tagged])
    assert "unexpected keyword argument 'shout'" in out[0], out[0]
    assert "too many positional arguments" in out[1], out[1]
    assert "missing a required argument: 'name'" in out[2], out[2]
    assert "names starting with '_' are not passed to tools" in out[3], out[3]
    assert out[4] == "{'a': 1}"
    assert "'__class__'" in out[5] and "names starting with '_'" in out[5], out[5]
    assert out[6] == "mine:t"
    assert calls() == ["echo_kw"]


def test_arguments_and_results_over_the_byte_cap_are_refused(server, env):
    tmp, calls = env
    res, out = _run(server, tmp, [
        "def err(f):",
        "    try:",
        "        return f()",
        "    except ToolError as e:",
        "        return 'ToolError: ' + str(e)",
        "FINAL(json.dumps([",
        "  err(lambda: greet('a' * 5000)),",                     # arguments over the cap
        "  err(lambda: len(sized(5000))),",                      # result over the cap
        "  err(lambda: len(sized(100))),",
        "  err(lambda: tools.map('greet', ['b', 'c' * 5000])),",  # one big batch item
        "]))"], tools=[tools_helpers.greet, tools_helpers.sized], max_tool_bytes=4096)
    assert "over the 4,096-byte cap (max_tool_bytes)" in out[0] and "5,0" in out[0], out[0]
    assert "returned 5,002 bytes as JSON, over the 4,096-byte cap" in out[1], out[1]
    assert out[2] == 100
    assert out[3].startswith("ToolError: tools.map item 1:") and "4,096-byte cap" in out[3]
    # the big argument and the refused batch reached no tool; the big result was made
    assert calls() == ["sized 5000", "sized 100"]
    with Journal(tmp / "j.sqlite3") as j:
        rows = j.tool_calls(res.run_id)
    assert [r["status"] for r in rows] == ["failed", "done"]
    assert rows[0]["result"] is None and "5,002 bytes" in rows[0]["error"]
    assert len(json.dumps(rows, default=str)) < 4096  # neither big value was journaled


def test_the_byte_cap_is_an_option_with_a_default(server, env):
    from rlm.config.options import Options
    assert Options().max_tool_bytes == 1 << 20
    with pytest.raises(rlm.ConfigError, match="max-tool-bytes"):
        rlm.completion("ctx", "q", base_url=server.base_url, api_key=API_KEY, model=MODEL,
                       journal=False, max_tool_bytes=0)
