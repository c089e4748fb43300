"""The scripted OpenAI-compatible endpoint of ``evals.bench_side_by_side``, in its own process.

Standard library only, so any interpreter runs it: ``python evals/side_by_side_server.py``
prints ``PORT <n>`` on its first stdout line and serves until killed.

One server answers every figure for both harnesses. The base URL a harness is given names the
script and the latency::

    http://127.0.0.1:PORT/<harness>/<scenario>/<latency_ms>/v1

``<harness>`` is ``ours`` or ``ref``: the two harnesses end a run differently (``FINAL(...)``
here, ``answer["content"] = ...; answer["ready"] = True`` in the reference implementation).
Each POST to ``.../chat/completions`` is answered after ``latency_ms`` by the role of the request:

- a *root* turn (some message carries the marker ``BENCH-ROOT``, which the benchmark puts in the
  query): the scenario's code block on turn 0 (counted by assistant messages), a final answer
  after that;
- a *child* turn (a system message, no marker): an immediate final answer, so a child RLM ends
  in its first turn;
- a *sub-call* (no system message): ``"answer to <prompt>"``.

``GET /stats`` returns ``{"<harness>/<scenario>": requests served}`` (so a replay can be checked
to send none).
"""
from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MARKER = "BENCH-ROOT"

#: what ends a run, per harness (``{v}`` is a Python expression)
FINISH = {
    "ours": "FINAL({v})",
    "ref": "answer['content'] = {v}\nanswer['ready'] = True",
}

# -- the code each root runs on its first turn, by scenario ------------------------------------
# ``{finish}`` is replaced by the harness's way to end the run with the string ``_out``.

# the direct client call it is compared with is timed by the worker in the host process
SUBCALL = """\
import json, statistics, time
for _ in range({warm}):
    llm_query("ping")
_s = []
for _ in range({n}):
    _t0 = time.perf_counter(); llm_query("ping"); _s.append(time.perf_counter() - _t0)
_out = json.dumps({{"sub": statistics.median(_s), "sub_min": min(_s), "n": len(_s)}})
{finish}
"""

CHILD = """\
import json, statistics, time
def _t(f, *a):
    _t0 = time.perf_counter(); f(*a); return time.perf_counter() - _t0
_first = _t({child_fn}, "child context")
_plain, _child = [], []
for _ in range({k}):
    time.sleep({pause})
    _plain.append(_t(llm_query, "plain"))
    _child.append(_t({child_fn}, "child context"))
_out = json.dumps({{"first": _first, "plain": statistics.median(_plain),
                   "child": statistics.median(_child), "children": _child, "plains": _plain}})
{finish}
"""

# The first batch of the run is timed, connection set-up included, for both: in the reference
# (rlms 0.1.3) a second ``llm_query_batched`` in the same run came back as empty strings here
# (its async client outlives the event loop of the first batch), so no warm-up batch.
FANOUT = """\
import json, time
_t0 = time.perf_counter()
_r = llm_query_batched(["item %d" % i for i in range({n})])
_dt = time.perf_counter() - _t0
assert len(_r) == {n} and all(x.startswith("answer to item") for x in _r), _r[:3]
_out = json.dumps({{"fanout": _dt}})
{finish}
"""

# children at once (the gateway benchmark): the batch of child RLMs, timed in the root's cell
CHILD_FANOUT = """\
import json, time
_t0 = time.perf_counter()
_r = rlm_batched(["child %d" % i for i in range({n})])
_dt = time.perf_counter() - _t0
assert len(_r) == {n} and all(x == "child-ok" for x in _r), _r[:3]
_out = json.dumps({{"children": _dt}})
{finish}
"""

CONTEXT = """\
_out = str(len(context))
{finish}
"""

TRIVIAL = """\
_out = "ok"
{finish}
"""

REPLAY = """\
_outs = [llm_query("item %d" % i) for i in range({n})]
_out = str(sum(len(o) for o in _outs))
{finish}
"""

SCRIPTS = {
    "subcall": (SUBCALL, {"n": 200, "warm": 20}),
    "subcall-quick": (SUBCALL, {"n": 60, "warm": 10}),
    "child": (CHILD, {"k": 2, "pause": 1.5}),
    "child-quick": (CHILD, {"k": 1, "pause": 1.5}),
    "fanout": (FANOUT, {"n": 64}),
    "kids16": (CHILD_FANOUT, {"n": 16}),
    "kids64": (CHILD_FANOUT, {"n": 64}),
    "context": (CONTEXT, {}),
    "trivial": (TRIVIAL, {}),
    "replay": (REPLAY, {"n": 199}),  # + the root's one turn = 200 calls
    "replay-quick": (REPLAY, {"n": 49}),
}

CHILD_FN = {"ours": "rlm", "ref": "rlm_query"}


def root_code(harness: str, scenario: str, port: int) -> str:
    # "context.50mb" -> the "context" script
    template, params = SCRIPTS.get(scenario) or SCRIPTS[scenario.split(".", 1)[0]]
    return template.format(finish=FINISH[harness].format(v="_out"), child_fn=CHILD_FN[harness],
                           **params)


def fence(code: str) -> str:
    return "```repl\n" + code.rstrip("\n") + "\n```"


def reply_for(harness: str, scenario: str, req: dict, port: int) -> str:
    msgs = req.get("messages") or []
    has_system = any(m.get("role") == "system" for m in msgs)
    if not has_system:  # a sub-call or a direct client call
        last = str(msgs[-1].get("content") or "") if msgs else ""
        return "pong" if last == "ping" else "answer to " + last[:200]
    is_root = any(MARKER in str(m.get("content") or "") for m in msgs if m.get("role") == "user")
    if not is_root:  # a child RLM: done in its first turn
        return fence(FINISH[harness].format(v="'child-ok'"))
    turn = sum(1 for m in msgs if m.get("role") == "assistant")
    if turn == 0:
        return fence(root_code(harness, scenario, port))
    # the first turn's code did not end the run: report what the REPL said, loudly
    first = next(i for i, m in enumerate(msgs) if m.get("role") == "assistant")
    feedback = " | ".join(str(m.get("content") or "") for m in msgs[first + 1:])[-3000:]
    return fence(FINISH[harness].format(v=json.dumps("BENCH-FAILED " + feedback)))


class State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.port = 0


STATE = State()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, *a):  # quiet
        pass

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.rstrip("/") == "/stats":
            with STATE.lock:
                body = json.dumps(STATE.counts)
            self._send(200, body.encode())
            return
        self._send(200, json.dumps({"object": "list", "data": [
            {"id": "bench", "object": "model"}]}).encode())

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n)
        parts = self.path.strip("/").split("/")
        # <harness>/<scenario>/<latency_ms>/v1/chat/completions
        if len(parts) < 6 or parts[0] not in FINISH or parts[-2:] != ["chat", "completions"]:
            self._send(404, json.dumps({"error": {"message": f"no route {self.path}"}}).encode())
            return
        harness, scenario, latency_ms = parts[0], parts[1], float(parts[2])
        t0 = time.perf_counter()
        req = json.loads(raw or b"{}")
        with STATE.lock:
            key = f"{harness}/{scenario}"
            STATE.counts[key] = STATE.counts.get(key, 0) + 1
        try:
            content = reply_for(harness, scenario, req, STATE.port)
        except Exception as exc:  # a bug in a script: loud
            self._send(500, json.dumps({"error": {"message": repr(exc)}}).encode())
            return
        wait = latency_ms / 1000.0 - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        chars = sum(len(str(m.get("content") or "")) for m in req.get("messages") or [])
        usage = {"prompt_tokens": max(1, chars // 4), "completion_tokens": max(1, len(content) // 4)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        body = {"id": "chatcmpl-bench", "object": "chat.completion", "created": int(time.time()),
                "model": req.get("model", "bench"),
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": content}}],
                "usage": usage}
        self._send(200, json.dumps(body).encode())


def main() -> None:
    httpd = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1]) if len(sys.argv) > 1 else 0),
                                Handler)
    httpd.daemon_threads = True
    httpd.request_queue_size = 128
    STATE.port = httpd.server_address[1]
    print(f"PORT {STATE.port}", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
