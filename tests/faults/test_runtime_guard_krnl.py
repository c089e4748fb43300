"""Issue 26, the kernel-runtime items of kinds 8 and 7.

* kind 8: a cell that empties, rebinds or deletes the runtime's own registries (the reserved
  names, the restore hook and its snapshot, the bridge client's settings and connection, the
  answer box) or the standard functions the bridge client uses, disables nothing after it:
  the next cell has ``FINAL`` and its sub-calls, as after ``%reset``.
* kind 7: with an answer check, what ``FINAL`` tells the model agrees with what the host
  decides: "submitted", then "not accepted" (or the run ends), never "recorded" and then
  "not accepted".

Real kernels, the scripted server on 127.0.0.1, the real ``openai`` client.
"""
from __future__ import annotations

import json

import pytest

from conftest import last_user, repl, root_requests, script, sub_requests

CLOBBERS = [
    # (what it breaks, the cell)
    ("the registry emptied", repl("__rlm_rt.RESERVED.clear()", "del FINAL, llm_query")),
    ("the registry rebound", repl("__rlm_rt.RESERVED = {}", "FINAL = llm_query = None")),
    ("the registry deleted", repl("del __rlm_rt.RESERVED", "del FINAL, FINAL_VAR")),
    ("the restore snapshot emptied", repl("__rlm_rt._SNAP.clear()", "del FINAL, llm_query")),
    ("the restore hook removed",
     repl("__rlm_rt._restore = None", "__rlm_rt._repair = None",
          "get_ipython().events.callbacks['post_run_cell'].clear()", "FINAL = None")),
    ("the snapshot's contents emptied",
     repl("__rlm_rt._SNAP['builtins'].clear()", "__rlm_rt.RESERVED.clear()",
          "import builtins", "builtins.len = None", "del FINAL")),
    ("the bridge settings emptied", repl("__rlm_rt._CONF.clear()")),
    ("the bridge settings forged", repl("__rlm_rt._CONF['token'] = 'f' * 32")),
    ("the bridge client's state dropped", repl("__rlm_rt._STATE = None")),
    ("the connection replaced", repl("__rlm_rt._STATE.sock = 'not a socket'")),
    ("socket and os rebound",
     repl("import socket, os", "socket.socket = None", "os.getpid = lambda: 1")),
]

CHECK = repl("print('VISIBLE', llm_query('q'), callable(FINAL), callable(FINAL_VAR),",
             "      callable(llm_query), len('abc'))")


@pytest.mark.parametrize("what, cell", CLOBBERS, ids=[c[0] for c in CLOBBERS])
def test_kind8_clobbered_runtime_disables_nothing_after_the_cell(api, what, cell):
    # the clobbering cell is the first (no bridge connection yet), then a check, then FINAL
    # cell_timeout: a cell that rebinds socket.socket never ends (the kernel's own messaging
    # needs it); the kernel is restarted at the timeout and the run goes on
    res, srv = api(script([cell, CHECK, repl("FINAL(llm_query('last'))")], lambda r: "SUB"),
                   "abc", max_iterations=4, cell_timeout=5)
    assert res.status == "completed", (what, res.reason)
    assert res.answer == "SUB", what
    seen = last_user(root_requests(srv)[2])
    assert "VISIBLE SUB True True True 3" in seen, (what, seen)


def test_kind8_final_into_a_rebound_answer_box_counts(api):
    res, _ = api(script([repl("__rlm_rt._FINAL = {}", "FINAL('kept')")]), "abc")
    assert res.status == "completed" and res.answer == "kept"


def test_kind8_example_registry_set_to_nothing_for_the_rest_of_the_run(api):
    # the item's example: the registry set to nothing early; FINAL still ends the run three
    # cells later, and llm_query works in between
    replies = [repl("__rlm_rt.RESERVED.clear()", "del FINAL"), repl("x = llm_query('a')"),
               repl("y = llm_query('b')"), repl("FINAL(x + y)")]
    res, srv = api(script(replies, lambda r: "S" + last_user(r)), "abc")
    assert res.status == "completed" and res.answer == "SaSb", res.reason
    assert len(sub_requests(srv)) == 2


PERSON = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}


def test_kind7_final_under_a_schema_says_submitted_then_the_verdict(api):
    replies = [repl("FINAL('Ada')"),  # not an object: refused after the cell
               repl("v = 'Ada'", "FINAL_VAR('v')"),
               repl("FINAL({'name': 'Ada'})")]
    res, srv = api(script(replies), "abc", answer_schema=PERSON)
    assert res.status == "completed", res.reason
    assert json.loads(res.answer) == {"name": "Ada"}
    for turn in (1, 2):
        told = last_user(root_requests(srv)[turn])
        assert "FINAL answer recorded" not in told, told
        assert "FINAL answer submitted" in told and "checked when this cell ends" in told
        assert "FINAL was NOT accepted" in told and "is not of type 'object'" in told


def test_kind7_a_verify_gate_and_a_checked_child_say_submitted(api):
    def verify(value):
        return value == "yes" or "say yes"

    res, srv = api(script([repl("FINAL('no')"), repl("FINAL('yes')")]), "abc", verify=verify)
    assert res.status == "completed" and res.answer == "yes"
    told = last_user(root_requests(srv)[1])
    assert "FINAL answer submitted" in told and "say yes" in told
    # a child checked by rlm(..., schema=) is told the same; a run without a check, recorded
    child = repl("FINAL('Ada')")
    root = repl("try:", "    r = rlm('ctx', 'who?', schema={'type': 'object'})",
                "except ChildRLMError as e:", "    r = 'failed'",
                "print(FINAL('plain'))")

    def resp(req):  # the child's conversation is the one whose task is "who?"
        return child if any("who?" in str(m.get("content")) for m in req["messages"][:2]) \
            else root
    res, srv = api(resp, "abc", max_depth=2, max_iterations=1)
    assert res.status == "completed" and res.answer == "plain"
    told = [m["content"] for r in root_requests(srv) for m in r["messages"]
            if m["role"] == "user" and "FINAL answer submitted" in str(m["content"])]
    assert told and "FINAL was NOT accepted" in told[0]  # the child's feedback


def test_kind7_the_bind_cell_tells_the_kernel_when_answers_are_checked():
    from kernels.protocol import bind_code
    assert bind_code("/b.sock", "ab" * 16, None, "text").endswith("'text')")
    assert bind_code("/b.sock", "ab" * 16, "/c", "text", 5, checked=True).endswith(
        "'text', 5, checked=True)")
