"""Kernel benchmarks: loading a 50 MB context, the per-cell round trip, a trivial run end to end.

Run: ``python -m evals.bench_kernel``. Prints one line per measure with its target.

- context load: write a 50 MB text context to a file and bind it in a started kernel
  (``kernels.runtime.bind`` reads the file); target < 0.2 s.
- cell round trip: p50 of executing ``x = 1`` and waiting for idle; target < 5 ms.
- trivial run: wall time of ``python -m rlm run`` (process start to exit) for a one-turn
  run against a local scripted endpoint; the reference implementation takes 1.7 s here.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def bench_context_load(mb: int = 50, repeats: int = 3) -> float:
    from kernels.bridge import BridgeServer
    from kernels.protocol import bind_code
    from kernels.kernel import Kernel
    from rlm.context.load import load_context

    text = ("All work and no play makes Jack a dull boy. " * 24 + "\n")
    blob = text * (mb * 1024 * 1024 // len(text))
    best = float("inf")
    bridge = BridgeServer(lambda reg, op, args: None)
    try:
        for _ in range(repeats):
            k = Kernel().start()
            try:
                reg = bridge.register(k.pid, None)
                t0 = time.perf_counter()
                ctx = load_context(blob)  # host writes the file
                res, _ = k.execute(bind_code(bridge.path, reg.token, k.share_file(ctx.path), "text"))
                dt = time.perf_counter() - t0
                assert res.error is None, res.output
                check, _ = k.execute("print(len(context))")
                assert int(check.output) == len(blob)
                best = min(best, dt)
                os.unlink(ctx.path)
            finally:
                k.shutdown()
    finally:
        bridge.close()
    return best


def bench_cell_roundtrip(n: int = 300) -> tuple[float, float]:
    from kernels.kernel import Kernel
    k = Kernel().start()
    try:
        for _ in range(20):
            k.execute("x = 1")
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            k.execute("x = 1")
            ts.append(time.perf_counter() - t0)
    finally:
        k.shutdown()
    ts.sort()
    return statistics.median(ts), ts[int(len(ts) * 0.95)]


def bench_trivial_run(repeats: int = 5) -> float:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from scripted_server import ScriptedServer

    def responder(req):
        return "```repl\nFINAL('done')\n```"

    times = []
    with ScriptedServer(responder) as srv, tempfile.TemporaryDirectory() as d:
        ctx = Path(d) / "ctx.txt"
        ctx.write_text("a small context\n")
        env = dict(os.environ, RLM_JOURNAL=str(Path(d) / "j.sqlite3"))
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "rlm", "run", "--context", str(ctx),
                                  "--query", "q", "--base-url", srv.base_url, "--api-key", "k",
                                  "--model", "m", "--quiet"], env=env, capture_output=True,
                                 text=True)
            times.append(time.perf_counter() - t0)
            assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr
    return statistics.median(times)


def main() -> None:
    load = bench_context_load()
    print(f"context load, 50 MB into a kernel: {load * 1000:.0f} ms (target < 200 ms)")
    p50, p95 = bench_cell_roundtrip()
    print(f"cell round trip: p50 {p50 * 1000:.2f} ms, p95 {p95 * 1000:.2f} ms (target p50 < 5 ms)")
    wall = bench_trivial_run()
    print(f"trivial one-turn run, process start to exit (median of 5): {wall:.2f} s "
          "(reference implementation: 1.7 s)")


if __name__ == "__main__":
    main()
