"""Real recursion: children with kernels of their own, the host-enforced depth, fan-out.

Scripted replies over a real HTTP server on 127.0.0.1; real kernels.
"""
from __future__ import annotations

import json
import re
import threading

import pytest

import rlm
from scripted_server import Reply, ScriptedServer


def _is_root(req: dict) -> bool:
    return req["messages"][0]["role"] == "system"


def _turn(req: dict) -> int:
    return sum(1 for m in req["messages"] if m["role"] == "assistant")


def _context_chars(req: dict) -> int:
    m = re.search(r"of ([\d,]+) characters", req["messages"][0]["content"])
    return int(m.group(1).replace(",", ""))


def _run(srv, context, query, **kw):
    kw.setdefault("journal", False)
    return rlm.completion(context, query, base_url=srv.base_url, api_key="k", model="m", **kw)


# A loop at any level: its first turn calls rlm() on half of its context and reports
# what came back; the second turn ends with that answer tagged by the context size.
def recursive_responder(req):
    if not _is_root(req):
        return "leaf(" + str(len(req["messages"][0]["content"])) + ")"
    if _turn(req) == 0:
        return ("```repl\nimport os\nsub = rlm(context[: len(context) // 2], 'half?')\n"
                "print('got', sub)\n```")
    return "```repl\nFINAL('n' + str(len(context)) + '[' + sub + ']')\n```"


@pytest.mark.parametrize("depth,children,fallbacks,kernels,max_level", [
    (1, 0, 1, 1, 1),
    (2, 1, 1, 2, 2),
    (3, 2, 1, 3, 3),
])
def test_depth_decides_children_and_fallbacks(depth, children, fallbacks, kernels, max_level):
    ctx = "abcdefgh" * 100  # 800 characters
    with ScriptedServer(recursive_responder) as srv:
        res = _run(srv, ctx, "q", max_depth=depth)
    assert res.status == "completed", res.reason
    assert res.stages.get("child", 0) == children
    assert res.stages.get("fallback", 0) == fallbacks
    # every kernel started counts: one per kernel-bearing level, plus (max_depth >= 2) the
    # pool's two idle ones, shut down unused
    assert res.kernels_started == kernels + (2 if depth >= 2 else 0)
    assert res.max_level == max_level
    # the answer nests one bracket per level: each child's answer flowed into its parent
    n = 800
    for _ in range(children):
        n //= 2
    leaf_prompt = n // 2  # the fallback completes the half of the deepest kernel's context
    assert res.answer.startswith("n800[")
    assert res.answer.count("[") == children + 1
    assert "leaf(" in res.answer
    # the deepest fallback's prompt is the half of the deepest context plus the query line
    m = re.search(r"leaf\((\d+)\)", res.answer)
    assert int(m.group(1)) == leaf_prompt + len("\n\nQuestion: half?")


def test_depth_zero_has_no_subcalls():
    def responder(req):
        if _turn(req) == 0:
            return ("```repl\ntry:\n    llm_query('x')\nexcept Exception as e:\n"
                    "    err = type(e).__name__ + ': ' + str(e)\nprint(err)\nFINAL(err)\n```")
        return "unused"
    with ScriptedServer(responder) as srv:
        res = _run(srv, "some context", "q", max_depth=0)
        assert srv.count == 1  # only the root's own call, the sub-call never reached the server
    assert res.answer.startswith("DepthError")
    assert "max_depth=0" in res.answer


def test_child_failure_is_a_typed_exception_in_the_parent():
    # The child's loop never calls FINAL: it runs out of iterations and fails.
    def responder(req):
        sysmsg = req["messages"][0]["content"] if _is_root(req) else ""
        if "of 12 characters" in sysmsg:  # the child (context is 'child ctx...')
            return "```repl\nprint('thinking')\n```"
        if _turn(req) == 0:
            return ("```repl\ntry:\n    out = rlm('child ctx 12', 'q')\n    kind = 'answer'\n"
                    "except ChildRLMError as e:\n    out = (e.status, e.reason)\n    kind = 'error'\n"
                    "FINAL(kind + ':' + str(out))\n```")
        return "unused"
    with ScriptedServer(responder) as srv:
        res = _run(srv, "root context that is long enough", "q", max_depth=2, max_iterations=2)
    assert res.status == "completed"
    assert res.answer.startswith("error:('failed'")
    assert "no FINAL" in res.answer


def test_forged_depth_and_stolen_token_are_refused():
    """A child rewrites env vars, globals, the bridge module and uses the root's token:
    the host still treats it as level 1 and refuses to act for the stolen token."""
    stolen = {}

    def responder(req):
        if not _is_root(req):
            return "plain completion"
        sysmsg = req["messages"][0]["content"]
        is_child = "of 10 characters" in sysmsg
        if not is_child:
            if _turn(req) == 0:
                return ("```repl\nprint('TOKEN=' + __rlm_rt._CONF['token'])\n"
                        "r = rlm('child-ctx!', 'q')\nprint(r)\n```")
            return "```repl\nFINAL(r)\n```"
        # the child: try everything to look like the root (level 0) and go deeper
        if _turn(req) == 0:
            tok = stolen.get("token", "")
            code = f"""```repl
import os, json, kernels.runtime as rt
os.environ['RLM_LEVEL'] = '0'; os.environ['RLM_DEPTH'] = '0'
level = 0; depth = 0; __rlm_level = 0
rt._CONF['level'] = 0
# forge: use the root kernel's token
mine = rt._CONF['token']
rt._CONF['token'] = {tok!r}
rt._STATE.sock = None
try:
    stolen_result = rlm('deeper', 'q')
except Exception as e:
    stolen_result = 'refused:' + type(e).__name__ + ':' + str(e)
rt._CONF['token'] = mine
rt._STATE.sock = None
deeper = rlm('deeper', 'q')
FINAL(json.dumps([stolen_result, deeper]))
```"""
            return code
        return "unused"

    def wrapped(req):
        for m in req["messages"]:
            mt = re.search(r"TOKEN=([0-9a-f]{32})", str(m.get("content")))
            if mt:
                stolen["token"] = mt.group(1)
        return responder(req)

    with ScriptedServer(wrapped) as srv:
        res = _run(srv, "root context of some size", "q", max_depth=2)
    assert stolen.get("token"), "the root's token was not captured"
    stolen_result, deeper = json.loads(res.answer)
    assert stolen_result.startswith("refused:SubcallError")
    assert "not the kernel that token was issued to" in stolen_result
    # the child is at level 1 of max_depth=2: its rlm() is a plain completion, not a kernel
    assert deeper == "plain completion"
    assert res.stages.get("child", 0) == 1
    assert res.kernels_started == 2 + 2  # root and child, plus the pool's two idle kernels
    assert res.max_level == 2


def test_batched_with_one_failing_item_keeps_the_others():
    def responder(req):
        if not _is_root(req):
            text = req["messages"][0]["content"]
            if "BAD" in text:
                return Reply("bad request", status=400)
            return "ok-" + text
        if _turn(req) == 0:
            return ("```repl\nps = ['a', 'b', 'BAD', 'd']\n"
                    "try:\n    llm_query_batched(ps)\nexcept BatchError as e:\n"
                    "    kept = [r if isinstance(r, str) else 'ERR:' + type(r).__name__ for r in e.results]\n"
                    "inplace = llm_query_batched(ps, return_exceptions=True)\n"
                    "inplace = [r if isinstance(r, str) else 'ERR' for r in inplace]\n"
                    "FINAL(repr((kept, inplace)))\n```")
        return "unused"
    with ScriptedServer(responder) as srv:
        res = _run(srv, "ctx", "q")
    kept, inplace = eval(res.answer)  # noqa: S307 - our own repr
    assert kept == ["ok-a", "ok-b", "ERR:SubcallError", "ok-d"]
    assert inplace == ["ok-a", "ok-b", "ERR", "ok-d"]


def test_batched_children_run_concurrently_in_input_order():
    # children at depth 2, each answering with its own context; the server is slow, so
    # running 4 children one after another would take > 4 x 2 x 0.3 s
    lock = threading.Lock()
    inflight = {"now": 0, "max": 0}

    def responder(req):
        with lock:
            inflight["now"] += 1
            inflight["max"] = max(inflight["max"], inflight["now"])
        try:
            import time
            time.sleep(0.3)
            if not _is_root(req):
                return "leaf"
            sysmsg = req["messages"][0]["content"]
            if "of 6 characters" in sysmsg:  # children: contexts 'item-0'..'item-3'
                return "```repl\nFINAL(context.upper())\n```"
            if _turn(req) == 0:
                return ("```repl\nouts = rlm_batched(['item-%d' % i for i in range(4)])\n"
                        "FINAL(','.join(outs))\n```")
            return "unused"
        finally:
            with lock:
                inflight["now"] -= 1

    with ScriptedServer(responder) as srv:
        res = _run(srv, "root ctx", "q", max_depth=2, pool_size=4)
    assert res.answer == "ITEM-0,ITEM-1,ITEM-2,ITEM-3"
    assert res.stages["child"] == 4
    assert inflight["max"] >= 2  # children's calls overlapped
    ids = sorted(s.id for s in res.tree.all() if s.kind == "child")
    assert ids == [f"run/iteration-0/cell-0/child-{i}" for i in range(4)]
