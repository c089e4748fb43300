"""Benchmark ``rlm view`` on a large run: a 10,000-stage journal, its HTML, and the time until
the page's stage tree is interactive in headless Chromium.

    python -m evals.bench_view [--stages 10000] [--repeat 3] [--keep DIR]

The journal is written through the real ``StageTree`` + ``Journal`` (every stage's transitions
and model calls with their requests), shaped like a wide run: root iterations whose cells fan
out batched ``llm_query`` calls, some with child RLMs that have iterations and sub-calls of
their own, a few failures. Time-to-interactive is the page's own ``performance.now()`` at the
first moment the page's main thread answers (polled over DevTools every 10 ms) after its
start-up script has parsed the data and rendered the header, the tree and the trajectory and
attached its handlers (navigation start = 0); then a collapsed node is clicked and its
expansion timed. Needs Chromium (``scripts/install_chromium.sh``).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from harness.journal import Journal, request_hash
from harness.stages.tree import Kind, StageTree, Status

from evals.chromium import Chromium


class _Clock:
    def __init__(self) -> None:
        self.t = time.time() - 3600.0

    def __call__(self) -> float:
        self.t += 0.004
        return self.t


def _call(tree: StageTree, j: Journal, run_id: str, parent: str, level: int, prompt: str,
          reply: str, fail: bool = False) -> None:
    st = tree.new_stage(parent, Kind.model_call, level, model="bench-model")
    tree.transition(st.id, Status.pending, Status.running)
    if fail:
        tree.transition(st.id, Status.running, Status.failed, error="HTTP 500 after 6 attempts")
        return
    tree.add_usage(st.id, len(prompt) // 4, len(reply) // 4, 0.00002)
    tree.transition(st.id, Status.running, Status.completed, evidence=reply)
    req = {"model": "bench-model", "messages": [{"role": "user", "content": prompt}],
           "max_tokens": 256, "temperature": 0.0}
    j.record_model_call(run_id, st.id, request_hash=request_hash(req), request=req,
                        response={"text": reply, "model": "bench-model"},
                        usage={"prompt_tokens": len(prompt) // 4,
                               "completion_tokens": len(reply) // 4}, attempts=[])


def _loop(tree, j, run_id, parent, level, iterations, fan, kids_every, budget) -> None:
    for i in range(iterations):
        if len(tree) >= budget:
            return
        it = tree.new_stage(parent, Kind.iteration, level, model="bench-model")
        tree.transition(it.id, Status.pending, Status.running)
        code = (f"chunks = [context[i:i + 2000] for i in range(0, len(context), 2000)]\n"
                f"answers = llm_query_batched([f'Text: {{c}} Question: item {i}?' "
                f"for c in chunks[:{fan}]])\nprint(answers[:3])")
        _call(tree, j, run_id, it.id, level, "(conversation so far)",
              f"Iteration {i}: I will map over the chunks.\n\n```repl\n{code}\n```")
        cell = tree.new_stage(it.id, Kind.cell, level)
        tree.transition(cell.id, Status.pending, Status.running)
        for q in range(fan):
            if len(tree) >= budget - 1:
                break
            lq = tree.new_stage(cell.id, Kind.llm_query, level + 1, model="bench-model")
            tree.transition(lq.id, Status.pending, Status.running)
            bad = (i * fan + q) % 997 == 13
            _call(tree, j, run_id, lq.id, level + 1, f"Text: chunk {q} of iteration {i} " * 8 +
                  "Question: which item?", f"item-{i}-{q}", fail=bad)
            tree.transition(lq.id, Status.running, Status.failed if bad else Status.completed,
                            evidence=None if bad else f"item-{i}-{q}",
                            error="sub-call failed" if bad else None)
        if kids_every and i % kids_every == kids_every - 1 and level == 0:
            for c in range(3):
                if len(tree) >= budget - 20:
                    break
                ch = tree.new_stage(cell.id, Kind.child, level + 1, model="bench-model")
                tree.transition(ch.id, Status.pending, Status.running)
                _loop(tree, j, run_id, ch.id, level + 1, 2, 8, 0, budget)
                tree.transition(ch.id, Status.running, Status.completed, evidence=f"child {c}")
        tree.transition(cell.id, Status.running, Status.completed,
                        evidence={"code": code, "output": f"['item-{i}-0', 'item-{i}-1']",
                                  "final": None, "timed_out": False, "died": False})
        tree.transition(it.id, Status.running, Status.completed, evidence="Output: ...")


def make_journal(path: Path, stages: int) -> str:
    """Write a run of exactly ``stages`` stages into a fresh journal; returns its run id."""
    run_id = f"bench{stages}"
    with Journal(path) as j:
        j.create_run(run_id, query="Which items are listed in the corpus?", model="bench-model",
                     max_depth=2, options={"budget": {"max_calls": 20000, "max_depth": 2,
                                                      "max_iterations": 200}})
        tree = StageTree(run_id, [j.record_event], clock=_Clock())
        root = tree.new_stage(None, Kind.run, 0, model="bench-model")
        tree.transition(root.id, Status.pending, Status.running)
        _loop(tree, j, run_id, root.id, 0, 10_000, 60, 5, stages - 300)
        while len(tree) < stages:  # top up to the exact count with answered sub-calls
            st = tree.new_stage(root.id, Kind.llm_query, 1, model="bench-model")
            tree.transition(st.id, Status.pending, Status.running)
            tree.transition(st.id, Status.running, Status.completed, evidence="extra")
        tree.transition(root.id, Status.running, Status.completed, evidence="done")
        u = tree.rollup("run")
        j.finish_run(run_id, status="completed", answer="items 0..n", usage=u.to_dict())
        assert len(j.stages(run_id)) == len(tree) == stages, (len(tree), stages)
    return run_id


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", metavar="DIR", help="keep the journal and the HTML in DIR")
    a = ap.parse_args(argv)
    from rlm.observe.view import payload_from_journal, write_view
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(a.keep or tmp)
        d.mkdir(parents=True, exist_ok=True)
        journal = d / "bench-view.sqlite3"
        for f in d.glob("bench-view.sqlite3*"):
            f.unlink()
        t0 = time.perf_counter()
        run_id = make_journal(journal, a.stages)
        t1 = time.perf_counter()
        with Journal(journal) as j:
            payload = payload_from_journal(j, run_id)
        html = write_view(payload, d / "bench-view.html")
        t2 = time.perf_counter()
        size = html.stat().st_size
        print(f"journal: {a.stages:,} stages written in {t1 - t0:.1f} s")
        print(f"rlm view: HTML rendered in {t2 - t1:.2f} s, {size:,} bytes ({size / 1e6:.2f} MB)")
        tti, ready, paint, expand, deep = [], [], [], [], []
        with Chromium(width=1400, height=900, timeout=60) as b:
            for _ in range(a.repeat):
                b.open("about:blank")
                b.open(html.as_uri(), ready=None)
                # the first moment the page's main thread answers once the tree is ready: an
                # input event sent then would be handled (polled every 10 ms over DevTools)
                tti.append(b.wait_for("window.rlmView && window.rlmView.readyAt && "
                                      "performance.now()", timeout=60))
                ready.append(b.eval("window.rlmView.readyAt"))
                paint.append(b.wait_for(
                    "(performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime"))
                assert b.eval("window.rlmView.stages") == a.stages
                # interactive: expand a collapsed node with a real click, time it
                expand.append(b.eval(
                    "(() => { const n = [...document.querySelectorAll('#tree .node')].find("
                    "n => !n.dataset.open && n.querySelector('.tg').textContent);"
                    " const t = performance.now(); n.querySelector('.tg').click();"
                    " if (!n.dataset.open) throw new Error('did not open');"
                    " return performance.now() - t; })()"))
                # a deep link into the last child: path opened, trajectory rendered
                last = payload["stages"][-1][0]
                deep.append(b.eval(f"(() => {{ const t = performance.now(); "
                                   f"window.rlmView.select({last!r}); "
                                   f"return performance.now() - t; }})()"))
            assert not b.console_errors, b.console_errors
        print(f"time to interactive (navigation start -> tree rendered and the page answering "
              f"input), median of {a.repeat}: {statistics.median(tti):.0f} ms (runs: "
              f"{', '.join(f'{x:.0f}' for x in tti)} ms); target < 2000 ms")
        print(f"start-up script done (tree, header, trajectory rendered): "
              f"{statistics.median(ready):.0f} ms")
        print(f"first contentful paint, median: {statistics.median(paint):.0f} ms")
        print(f"expand a collapsed node on click: {statistics.median(expand):.1f} ms; "
              f"open a deep link: {statistics.median(deep):.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
