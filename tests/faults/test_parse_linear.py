"""Issue 26, kind 8: work the host does on a reply is linear in its size.

Every parse of model text (fences, inline openers, reasoning sections, think tags, FINAL in
prose) once had a quadratic member: a 200,000-character one-line reply held a run at 100% CPU
far past its wall cap. Each shape below took minutes to hours at these sizes before the fix and
takes well under a second now; the bounds here are generous (a loaded 2-core machine), the
timings themselves are printed by ``evals/bench_parsing.py``.
"""
from __future__ import annotations

import time

import pytest

from conftest import Reply, is_root, repl, script
from rlm.prompting.parsing import parse_reply, split_reasoning

SIZE = 300_000

SHAPES = {
    "one long line": "Thinking it over " + "word " * (SIZE // 5),
    "backtick runs in prose": "text `` more ``` x " * (SIZE // 19),
    "many think tags on one line": "<think>hm</think>said " * (SIZE // 22),
    "closing lines held in open strings": "```python\ns = '''\n```\n" * (SIZE // 20),
    "inline opener after a long line": "x" * SIZE + " ```repl\nFINAL('a')\n```\n",
    "think tags in lines": "<think>\nhm\n</think>\nsaid\n" * (SIZE // 24),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_each_shape_parses_in_linear_time(shape):
    text = SHAPES[shape]
    t0 = time.perf_counter()
    parsed = parse_reply(text)
    split_reasoning(text)
    took = time.perf_counter() - t0
    assert took < 5.0, f"{shape}: {len(text):,} characters took {took:.1f} s"
    assert parsed.text  # something was parsed, not skipped


def test_parses_still_right_after_the_fix():
    """The linear forms decide as the old patterns did: an inline opener after prose opens a
    block, a backtick run that is no opener does not, tags on one line are all cut out, and a
    closing line held in a string is content when the block closes later."""
    p = parse_reply("Here it is: ```repl\nprint(1)\n```")
    assert p.code_blocks() == ["print(1)"] and "Here it is:" in p.prose
    assert parse_reply("x ``repl\nprint(1)\n```").code_blocks() == []
    assert parse_reply("``` repl at the start\nprint(2)\n```").blocks[0].lang == "repl"
    assert parse_reply("Look: ```` python \nprint(3)\n````").code_blocks() == ["print(3)"]
    text, sections = split_reasoning("<think>a</think>b<think>c</think>d")
    assert (text, sections) == ("bd", ["a", "c"])
    held = "```python\ns = '''\n```json\n{}\n```\n'''\nprint(len(s))\n```"
    assert parse_reply(held).code_blocks() == ["s = '''\n```json\n{}\n```\n'''\nprint(len(s))"]


def test_a_run_with_a_200k_one_line_reply_ends_with_its_answer(api):
    """The issue's example: a root reply of one 200,000-character line before its code."""
    long_line = "Let me think. " + "word " * 40_000
    t0 = time.monotonic()
    res, _ = api(script([long_line + "\n" + repl("FINAL('found')")]), max_wall_seconds=60)
    assert res.answer == "found"
    assert time.monotonic() - t0 < 30


def test_a_long_one_line_sub_call_reply_is_quick(api):
    """Sub-call replies go through the same reasoning cut: a 200k one-line ``llm_query``
    reply comes back whole, fast."""
    def responder(req):
        if is_root(req):
            n = sum(1 for m in req["messages"] if m["role"] == "assistant")
            if n == 0:
                return repl("r = llm_query('say a lot')", "print(len(r))")
            return repl("FINAL('ok')")
        return "x" * 200_000

    t0 = time.monotonic()
    res, _ = api(responder, max_wall_seconds=60)
    assert res.answer == "ok"
    cells = [s.evidence for s in res.tree.all() if s.kind.value == "cell"]
    assert cells[0]["output"].strip() == "200000"
    assert time.monotonic() - t0 < 30


def test_wall_cap_ends_a_run_whose_host_side_work_runs_long(api, monkeypatch):
    """Time the host spends on a reply counts: a parse that ends past the wall cap ends the
    run as ``budget_exceeded`` (cap ``wall``) before any of its code runs."""
    import rlm.core.loop as loop

    real = loop.parse_reply

    def slow(text, cut=False):
        time.sleep(2.5)
        return real(text, cut=cut)

    monkeypatch.setattr(loop, "parse_reply", slow)
    res, srv = api(script([Reply(repl("print('ran')", "FINAL('no')"))]), max_wall_seconds=2)
    assert res.status == "budget_exceeded"
    assert res.answer is None
    assert not [s for s in res.tree.all() if s.kind.value == "cell"]
