"""One real run that exercises every view: depth 2, batched sub-calls, a timed-out cell, a
kernel that is interrupted, a failed child, a depth-limit fallback, then an answer.

Used by the viewer, live-view and OpenTelemetry tests (real kernels, a real HTTP server on
127.0.0.1 speaking the OpenAI protocol, a real journal).
"""
from __future__ import annotations

import re
from pathlib import Path

from scripted_server import Reply, ScriptedServer

QUERY = "Which fruits are named in the context?"
ANSWER = "apple, banana, cherry (2 children, 1 failed)"
CONTEXT = "apple pie; banana bread; cherry tart. " * 4

ROOT_CODE = [
    # turn 1: batched sub-calls over three pieces
    "pieces = [context[i:i + 40] for i in range(0, 120, 40)]\n"
    "found = llm_query_batched(['Name the fruit in: ' + p for p in pieces])\n"
    "print(found)",
    # turn 2: a cell that runs past its timeout and is interrupted
    "import time\nstarted = True\ntime.sleep(30)",
    # turn 3: two children with kernels of their own; the second one fails
    "outs = rlm_batched(['good child: apple banana', 'BAD child: cherry'], "
    "query='list fruits', return_exceptions=True)\n"
    "print([o if isinstance(o, str) else 'ERR ' + type(o).__name__ for o in outs])",
    # turn 4: the answer
    "FINAL(" + repr(ANSWER) + ")",
]
CHILD_CODE = [
    "x = llm_query('Which fruit is this: ' + context[:30])\n"
    "y = rlm('deeper: ' + context)\nprint(x, y)",
    "FINAL('child saw ' + x)",
]


def _turn(req: dict) -> int:
    return sum(1 for m in req["messages"] if m["role"] == "assistant")


def _chars(req: dict) -> int:
    m = re.search(r"of ([\d,]+) characters", req["messages"][0]["content"])
    return int(m.group(1).replace(",", "")) if m else -1


def responder(req: dict):
    msgs = req["messages"]
    if msgs[0]["role"] != "system":  # a plain completion: llm_query or a fallback
        text = msgs[-1]["content"]
        return Reply("fallback-answer" if text.startswith("deeper:") else "fruit:" + text[-12:],
                     cost=0.0002)
    n = _chars(req)
    if n == len("BAD child: cherry"):
        return Reply("the child's endpoint refuses", status=400)
    code = CHILD_CODE if n == len("good child: apple banana") else ROOT_CODE
    t = _turn(req)
    return Reply("Let me look.\n\n```repl\n" + code[min(t, len(code) - 1)] + "\n```", cost=0.001)


def make_run(journal: Path, **options) -> tuple[str, object]:
    """Run the scripted trajectory into ``journal``; returns ``(run_id, Result)``."""
    import rlm
    with ScriptedServer(responder) as srv:
        res = rlm.completion(CONTEXT, QUERY, base_url=srv.base_url, api_key="k", model="m",
                             journal=str(journal), max_depth=2, cell_timeout=1.5,
                             pool_size=2, max_calls=40, max_tokens=200_000,
                             **options)
    return res.run_id, res


def slow_responder(root_delay: float):
    """:func:`responder` with every turn of the root loop delayed by ``root_delay`` seconds
    (children and sub-calls stay fast, so no cell runs into its timeout but the sleeping one)."""
    def respond(req: dict):
        rep = responder(req)
        if req["messages"][0]["role"] == "system" and _chars(req) == len(CONTEXT):
            rep.delay = root_delay
        return rep
    return respond
