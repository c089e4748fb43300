"""Recursion benchmarks: child start latency, bridge overhead per sub-call, fan-out throughput.

Run: ``python -m evals.bench_recursion``. Prints one line per measure with its target.

- child start: time for a child RLM's kernel to be ready with its ``context`` bound,
  taken from the pre-started pool vs. started cold (target p50 < 50 ms from the pool;
  the reference implementation's child costs 1.29 s here).
- bridge overhead: p50 of ``llm_query`` from inside a kernel minus p50 of a direct
  :class:`rlm.models.openai_compat.OpenAICompatClient` call to the same local endpoint (target
  < 0.5 ms; reference about 1.5 ms). The in-kernel path includes the stage records and the
  budget accountant, so this is the whole harness overhead of a sub-call.
- fan-out: 64 ``llm_query_batched`` items against an endpoint with 200 ms latency at
  concurrency 16; ideal 64 / 16 x 0.2 s = 0.8 s (target within 1.1x; reference 0.96 s).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def bench_child_start(samples: int = 15) -> tuple[float, float]:
    from kernels.bridge import BridgeServer
    from kernels.protocol import bind_code
    from kernels.pool import KernelPool
    from rlm.context.load import load_context

    bridge = BridgeServer(lambda reg, op, args: None)
    ctx = load_context("child context " * 100)

    def start_one(pool: KernelPool) -> float:
        t0 = time.perf_counter()
        k = pool.acquire()
        reg = bridge.register(k.pid, None)
        res, _ = k.execute(bind_code(bridge.path, reg.token, k.share_file(ctx.path), "text"))
        dt = time.perf_counter() - t0
        assert res.error is None, res.output
        pool.release(k)
        return dt

    pooled, cold = [], []
    pool = KernelPool(2)
    try:
        for _ in range(samples):
            deadline = time.monotonic() + 30
            while pool._ready.qsize() < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            pooled.append(start_one(pool))
    finally:
        pool.close()
    cold_pool = KernelPool(0)
    try:
        for _ in range(5):
            cold.append(start_one(cold_pool))
    finally:
        cold_pool.close()
        bridge.close()
    return statistics.median(pooled), statistics.median(cold)


def bench_bridge_overhead(n: int = 300) -> tuple[float, float]:
    import rlm
    from rlm.models.openai_compat import OpenAICompatClient
    from scripted_server import ScriptedServer

    code = (
        "```repl\nimport time\nts = []\nfor i in range(%d):\n"
        "    t0 = time.perf_counter(); llm_query('ping'); ts.append(time.perf_counter() - t0)\n"
        "ts.sort()\nFINAL(str(ts[len(ts) // 2]))\n```" % n)

    def responder(req):
        if req["messages"][0]["role"] == "system":
            return code
        return "pong"

    with ScriptedServer(responder) as srv:
        client = OpenAICompatClient(srv.base_url, "k")
        for _ in range(20):
            client.complete([{"role": "user", "content": "ping"}], "m", max_tokens=512)
        direct = []
        for _ in range(n):
            t0 = time.perf_counter()
            client.complete([{"role": "user", "content": "ping"}], "m", max_tokens=512,
                            temperature=0.0)
            direct.append(time.perf_counter() - t0)
        res = rlm.completion("ctx", "q", base_url=srv.base_url, api_key="k", model="m",
                             journal=False)
    return float(res.answer), statistics.median(direct)


def bench_fanout(latency: float = 0.2, items: int = 64, concurrency: int = 16) -> float:
    import rlm
    from scripted_server import Reply, ScriptedServer

    code = ("```repl\nimport time\nt0 = time.perf_counter()\n"
            "outs = llm_query_batched(['p%%d' %% i for i in range(%d)])\n"
            "FINAL(str(time.perf_counter() - t0))\n```" % items)

    def responder(req):
        if req["messages"][0]["role"] == "system":
            return code
        return Reply("x", delay=latency)

    with ScriptedServer(responder) as srv:
        res = rlm.completion("ctx", "q", base_url=srv.base_url, api_key="k", model="m",
                             journal=False, max_concurrency=concurrency)
    return float(res.answer)


def main() -> None:
    pooled, cold = bench_child_start()
    print(f"child start: p50 {pooled * 1000:.1f} ms from the pool, {cold * 1000:.0f} ms cold "
          "(target p50 < 50 ms from the pool; reference 1.29 s)")
    in_kernel, direct = bench_bridge_overhead()
    print(f"bridge overhead per sub-call: p50 {(in_kernel - direct) * 1000:.2f} ms "
          f"(in-kernel llm_query {in_kernel * 1000:.2f} ms vs direct client {direct * 1000:.2f} ms; "
          "target < 0.5 ms, reference ~1.5 ms)")
    fan = bench_fanout()
    print(f"64 sub-calls, 200 ms latency, concurrency 16: {fan:.3f} s "
          f"({fan / 0.8:.2f}x the ideal 0.8 s; target <= 1.1x, reference 0.96 s)")


if __name__ == "__main__":
    main()
