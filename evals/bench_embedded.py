"""The embedded model on this machine: threads, a competing process, and the prompt cache.

Run: ``python -m evals.bench_embedded [--threads 1,2] [--no-needle] [--chars 36000]``.

For each thread count, without and then with a competing process (one busy Python process,
as a kernel computing or a second trial would be), it starts the embedded server and prints:

- prefill tokens/s: a fresh ~1,200-token prompt (llama.cpp's ``timings.prompt_per_second``);
- decode tokens/s: 48 generated tokens (``timings.predicted_per_second``);
- needle s: the wall time of a whole ``rlm.completion`` needle run (``evals.needle``, seed 0,
  depth 1, the small profile), with whether it was right (``--no-needle`` leaves it out).

Then the prompt cache across a loop's turns (one server, the default threads): for a three-turn
conversation with three concurrent sub-calls between turns 2 and 3, the tokens each turn
prefilled (``prompt_n``) against those served from the cache (``cache_n``). The configurations
run one after another in one process, on the same machine state; run it with nothing else
running.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import time
import urllib.request
from typing import Any


def _spin(stop: Any) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def _post(srv: Any, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": srv.model_name, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0}
    req = urllib.request.Request(srv.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {srv.api_key}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.loads(r.read())


def _prompt(tag: str, n: int = 150) -> list[dict]:
    rules = " ".join(f"Rule {i} of set {tag}: answer briefly and exactly." for i in range(n))
    return [{"role": "system", "content": rules}, {"role": "user", "content": "Say hello."}]


def _speeds(srv: Any, tag: str) -> tuple[float, float]:
    t = _post(srv, _prompt(tag), 48)["timings"]
    return t["prompt_per_second"], t["predicted_per_second"]


def _needle(srv: Any, chars: int) -> tuple[float, bool]:
    import rlm
    from evals.needle import make_haystack, score
    text, question, answer = make_haystack(chars, 0.6, seed=0)
    t0 = time.monotonic()
    res = rlm.completion(text, question, base_url=srv.base_url, api_key=srv.api_key,
                         model=srv.model_name, max_depth=1, prompt="small", journal=False)
    return time.monotonic() - t0, score(res.answer or "", answer)


def one_config(threads: int, loaded: bool, needle: bool, chars: int) -> dict:
    """Start a server with ``threads``, optionally beside a busy process; measure it."""
    from rlm.models.embedded import EmbeddedServer
    stop = mp.Event()
    spinner = mp.Process(target=_spin, args=(stop,), daemon=True) if loaded else None
    if spinner:
        spinner.start()
    try:
        with EmbeddedServer(threads=threads) as srv:
            _post(srv, [{"role": "user", "content": "hi"}], 2)  # warm
            prefill, decode = _speeds(srv, f"{threads}-{loaded}")
            out = {"threads": threads, "competing": loaded, "prefill_tps": prefill,
                   "decode_tps": decode}
            if needle:
                out["needle_s"], out["needle_right"] = _needle(srv, chars)
            return out
    finally:
        if spinner:
            stop.set()
            spinner.join(5)


def prompt_cache() -> list[tuple[str, int, int]]:
    """``(turn, prompt_n, cache_n)`` of a three-turn loop with sub-calls before turn 3."""
    from rlm.models.embedded import EmbeddedServer
    rows = []
    with EmbeddedServer() as srv:
        msgs = _prompt("cache")
        for k in range(3):
            if k == 2:
                subs = [[{"role": "user", "content": f"Count {i}: " + "x " * 300}]
                        for i in range(3)]
                with cf.ThreadPoolExecutor(3) as ex:
                    for i, r in enumerate(ex.map(lambda m: _post(srv, m, 4), subs)):
                        t = r["timings"]
                        rows.append((f"sub-call {i}", t["prompt_n"], t["cache_n"]))
            r = _post(srv, msgs, 8)
            t = r["timings"]
            rows.append((f"turn {k + 1}", t["prompt_n"], t["cache_n"]))
            msgs = msgs + [{"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                           {"role": "user", "content": f"Again, turn {k + 2}."}]
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cores = len(os.sched_getaffinity(0))
    p.add_argument("--threads", default=",".join(str(t) for t in sorted({max(1, cores - 1), cores})),
                   help="thread counts to compare (default: cores-1 and cores)")
    p.add_argument("--no-needle", action="store_true", help="leave out the needle runs")
    p.add_argument("--chars", type=int, default=36_000 * 4,
                   help="needle document size in characters (default 144,000, ~36k tokens)")
    args = p.parse_args(argv)
    print(f"machine: {cores} cores; load average {os.getloadavg()[0]:.2f} at start")
    print(f"{'threads':>7} {'competing':>9} {'prefill tok/s':>13} {'decode tok/s':>12} "
          f"{'needle s':>9} {'right':>5}")
    for threads in [int(t) for t in args.threads.split(",")]:
        for loaded in (False, True):
            r = one_config(threads, loaded, not args.no_needle, args.chars)
            print(f"{r['threads']:>7} {str(r['competing']):>9} {r['prefill_tps']:>13.1f} "
                  f"{r['decode_tps']:>12.1f} {r.get('needle_s', float('nan')):>9.1f} "
                  f"{str(r.get('needle_right', '-')):>5}", flush=True)
    print("\nprompt cache across a loop's turns (default threads):")
    print(f"{'request':>12} {'prefilled':>9} {'from cache':>10}")
    for name, prefilled, cached in prompt_cache():
        print(f"{name:>12} {prefilled:>9} {cached:>10}")


if __name__ == "__main__":
    main()
