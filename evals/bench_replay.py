"""Replay benchmark: a 500-call run replayed from the journal vs. the time it first took.

Run: ``python -m evals.bench_replay``. The first run talks to a local scripted endpoint
with 100 ms latency per call at concurrency 8 (a fast hosted model would be slower);
the replay serves every call from the journal, sends none, and re-executes the cells.
Also prints the journal file size and the per-call journal cost seen in the first run.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main(calls: int = 500, latency: float = 0.1) -> None:
    import rlm
    from rlm.api import replay
    from scripted_server import Reply, ScriptedServer

    items = calls - 2  # + the root's two turns
    code = ("```repl\nouts = llm_query_batched(['item %%d' %% i for i in range(%d)])\n"
            "print(len(outs))\n```" % items)

    def responder(req):
        msgs = req["messages"]
        if msgs[0]["role"] == "system":
            turn = sum(1 for m in msgs if m["role"] == "assistant")
            return code if turn == 0 else "```repl\nFINAL(str(sum(len(o) for o in outs)))\n```"
        return Reply("answer to " + msgs[0]["content"], delay=latency)

    with tempfile.TemporaryDirectory() as d, ScriptedServer(responder) as srv:
        journal = str(Path(d) / "j.sqlite3")
        t0 = time.perf_counter()
        res = rlm.completion("context", "q", base_url=srv.base_url, api_key="k", model="m",
                             journal=journal, max_concurrency=8)
        first = time.perf_counter() - t0
        sent = srv.count
        t0 = time.perf_counter()
        rep = replay(res.run_id, journal=journal, context="context")
        again = time.perf_counter() - t0
        assert rep.answer == res.answer
        assert srv.count == sent, "replay sent requests"
        size = Path(journal).stat().st_size
    print(f"{sent}-call run: first {first:.2f} s, replay {again:.2f} s with 0 calls sent "
          f"({first / again:.1f}x faster); {rep.replayed_calls} calls served from the journal; "
          f"journal {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
