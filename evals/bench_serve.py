"""``rlm serve`` benchmark: its overhead per request beyond the Python API, and its throughput.

Run: ``python -m evals.bench_serve``. Everything on 127.0.0.1: a scripted OpenAI-compatible
upstream (``tests/scripted_server.py``), ``rlm serve`` as a subprocess (the real CLI on uvicorn),
and the real ``openai`` client.

1. Overhead, two ways:
   * a recorded run (the ``Idempotency-Key`` of a finished run): the API returns the journal's
     result without a kernel or a model call, so the difference is the server alone (HTTP,
     JSON, the request mapping, the thread hand-off);
   * fresh one-turn runs (a kernel each), API and server interleaved: each request's time
     outside the run itself (wall minus the run's own ``seconds``), server minus API. A kernel
     start varies by more than the overhead, so the raw walls are printed but not subtracted.
2. Throughput: 16 concurrent clients, each sending requests of two model turns (200 ms upstream
   latency per call) to a server with 16 run slots.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

KEY = "bench-key"


def _free_port() -> int:
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _serve(upstream: str, journal: str, slots: int) -> tuple[subprocess.Popen, str]:
    import os
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "RLM_"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "rlm", "serve", "--port", str(port),
                             "--api-key", KEY, "--max-concurrent-runs", str(slots),
                             "--base-url", upstream, "--upstream-api-key", "k", "--model", "m",
                             "--journal", journal], env=env, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/v1"
    for _ in range(600):
        try:
            req = urllib.request.Request(base + "/models",
                                         headers={"Authorization": f"Bearer {KEY}"})
            urllib.request.urlopen(req, timeout=2).read()
            return proc, base
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("rlm serve did not start")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(fresh: int = 10, recorded: int = 200, clients: int = 16, per_client: int = 2,
         latency: float = 0.2) -> None:
    import openai

    import rlm
    from scripted_server import Reply, ScriptedServer

    def responder(req):
        msgs = req["messages"]
        turn = sum(1 for m in msgs if m["role"] == "user")
        delay = latency if "slow" in msgs[1]["content"] else 0.0
        if turn == 1 and "two" in msgs[1]["content"]:
            return Reply("```repl\nx = len(context)\n```", delay=delay)
        return Reply("```repl\nFINAL('done')\n```", delay=delay)

    with tempfile.TemporaryDirectory() as d, ScriptedServer(responder) as up:
        journal = str(Path(d) / "j.sqlite3")
        proc, base = _serve(up.base_url, journal, clients)
        try:
            client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=300)
            api = dict(base_url=up.base_url, api_key="k", model="m", journal=journal)
            msgs = [{"role": "system", "content": "ctx"}, {"role": "user", "content": "q one"}]

            # 1a. recorded runs: the server's own cost
            rlm.completion("ctx", "q one", run_id="bench-rec", **api)
            client.chat.completions.create(model="rlm", messages=msgs,
                                           extra_headers={"Idempotency-Key": "bench-rec"})
            t_api, t_srv, t_raw = [], [], []
            raw = json.dumps({"model": "rlm", "messages": msgs}).encode()
            hdrs = {"Authorization": f"Bearer {KEY}", "Idempotency-Key": "bench-rec",
                    "Content-Type": "application/json"}
            for _ in range(recorded):
                t0 = time.perf_counter()
                rlm.completion("ctx", "q one", run_id="bench-rec", **api)
                t_api.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                client.chat.completions.create(model="rlm", messages=msgs,
                                               extra_headers={"Idempotency-Key": "bench-rec"})
                t_srv.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                urllib.request.urlopen(urllib.request.Request(
                    base + "/chat/completions", data=raw, headers=hdrs), timeout=30).read()
                t_raw.append(time.perf_counter() - t0)
            rec_api, rec_srv = statistics.median(t_api), statistics.median(t_srv)
            rec_raw = statistics.median(t_raw)

            # 1b. fresh one-turn runs, interleaved
            f_api, f_srv, out_api, out_srv = [], [], [], []
            for _ in range(fresh):
                t0 = time.perf_counter()
                res = rlm.completion("ctx", "q one", **api)
                f_api.append(time.perf_counter() - t0)
                out_api.append(f_api[-1] - res.seconds)
                t0 = time.perf_counter()
                r = client.chat.completions.create(model="rlm", messages=msgs)
                f_srv.append(time.perf_counter() - t0)
                out_srv.append(f_srv[-1] - r.model_extra["rlm"]["seconds"])

            # 2. throughput: 16 clients at once
            lat: list[float] = []
            lock = threading.Lock()
            m2 = [{"role": "system", "content": "ctx"},
                  {"role": "user", "content": "q two slow"}]

            def worker() -> None:
                c = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=300)
                for _ in range(per_client):
                    t0 = time.perf_counter()
                    r = c.chat.completions.create(model="rlm", messages=m2)
                    assert r.choices[0].message.content == "done"
                    with lock:
                        lat.append(time.perf_counter() - t0)

            threads = [threading.Thread(target=worker) for _ in range(clients)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    n = clients * per_client
    print(f"recorded run (Idempotency-Key hit), p50 of {recorded}: API {rec_api * 1e3:.1f} ms; "
          f"server with a plain HTTP client {rec_raw * 1e3:.1f} ms -> overhead "
          f"{(rec_raw - rec_api) * 1e3:.1f} ms (target < 20 ms); with the openai client "
          f"{rec_srv * 1e3:.1f} ms")
    over = statistics.median(out_srv) - statistics.median(out_api)
    print(f"fresh one-turn run, p50 of {fresh}: API {statistics.median(f_api) * 1e3:.0f} ms, "
          f"server {statistics.median(f_srv) * 1e3:.0f} ms (kernel start dominates); outside "
          f"the run: API {statistics.median(out_api) * 1e3:.1f} ms, server "
          f"{statistics.median(out_srv) * 1e3:.1f} ms -> overhead {over * 1e3:.1f} ms")
    print(f"throughput: {clients} clients x {per_client} runs (2 model turns, "
          f"{latency * 1e3:.0f} ms upstream latency each): {n} runs in {wall:.1f} s = "
          f"{n / wall:.2f} runs/s; latency p50 {_pct(lat, 0.5):.2f} s, p90 {_pct(lat, 0.9):.2f} s")


if __name__ == "__main__":
    main()
