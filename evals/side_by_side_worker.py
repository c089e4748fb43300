"""One measurement of ``evals.bench_side_by_side`` in a fresh process, for either harness.

Run as a script by the harness's own interpreter (this project's venv, or the reference
implementation's venv, where the import name ``rlm`` is the reference's)::

    python evals/side_by_side_worker.py HARNESS SCENARIO BASE_URL JSON_OPTIONS

It drives one whole run through the harness's public API against the scripted endpoint
(``evals/side_by_side_server.py``, another process) and prints one line
``BENCH-RESULT {json}``: the run's answer (the root's in-kernel timings, for the scenarios that
time from inside the kernel), the wall time of the call, the time spent reading the
context file, and, when asked, direct ``openai`` client calls timed in this process before and
after the run (the baseline of the sub-call overhead).

Standard library only at module level: nothing of either harness is imported before the
scenario needs it, and nothing of this repository is put on ``sys.path`` (running a script
puts only ``evals/`` there, which holds no ``rlm``).
"""
from __future__ import annotations

import json
import sys
import time

T_START = time.perf_counter()


def run_ours(scenario: str, base_url: str, opts: dict, ctx, query: str) -> str:
    import rlm

    kw = dict(base_url=base_url, api_key="bench", model="bench",
              journal=opts.get("journal", None), max_depth=opts.get("max_depth", 1))
    if opts.get("concurrency"):
        kw["max_concurrency"] = opts["concurrency"]
    res = rlm.completion(ctx, query, **kw)
    if res.status != "completed":
        raise SystemExit(f"ours: run ended {res.status}: {res.reason}")
    return res.answer


def run_ref(scenario: str, base_url: str, opts: dict, ctx, query: str) -> str:
    from rlm import RLM  # the reference implementation (rlms 0.1.3) in its own venv

    r = RLM(backend="openai",
            backend_kwargs={"model_name": "bench", "base_url": base_url, "api_key": "bench"},
            environment="ipython", environment_kwargs={"kernel_mode": "subprocess"},
            max_depth=opts.get("max_depth", 1), max_iterations=opts.get("max_iterations", 30))
    out = r.completion(ctx, root_prompt=query)
    r.close()
    return out.response


def direct_calls(url: str, n: int) -> list[float]:
    """``n`` direct ``openai`` client calls to the endpoint from this (the host) process, timed;
    after 10 untimed ones. The baseline a sub-call's overhead is measured against."""
    import openai

    c = openai.OpenAI(base_url=url, api_key="bench", max_retries=0)
    out = []
    for i in range(n + 10):
        t0 = time.perf_counter()
        r = c.chat.completions.create(model="bench",
                                      messages=[{"role": "user", "content": "ping"}])
        assert r.choices[0].message.content == "pong"
        if i >= 10:
            out.append(time.perf_counter() - t0)
    c.close()
    return out


def direct_fanout(url: str, n: int, threads: int) -> float:
    """``n`` direct ``openai`` client calls (``chat.completions.create``) on ``threads`` threads
    sharing one client, no harness, after one untimed call: the wall time in seconds. The floor
    the client itself sets for the fan-out figure."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    c = openai.OpenAI(base_url=url, api_key="bench", max_retries=0)

    def one(i: int) -> str:
        r = c.chat.completions.create(model="bench",
                                      messages=[{"role": "user", "content": f"item {i}"}])
        return r.choices[0].message.content

    one(-1)  # untimed, as the harness's client made the root's call before its batch
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        out = list(pool.map(one, range(n)))
    dt = time.perf_counter() - t0
    assert all(x.startswith("answer to item") for x in out), out[:3]
    c.close()
    return dt


def main() -> None:
    harness, scenario, base_url, raw = sys.argv[1:5]
    opts = json.loads(raw)
    if scenario == "fanout-direct":  # no harness: the client alone
        dt = direct_fanout(base_url, opts["n"], opts["concurrency"])
        print("BENCH-RESULT " + json.dumps({"answer": json.dumps({"fanout": dt}), "t_call": dt,
                                            "t_read": 0.0, "t_before_call": 0.0, "direct": []}),
              flush=True)
        return
    t_read = 0.0
    if opts.get("context_file"):
        t0 = time.perf_counter()
        with open(opts["context_file"], encoding="utf-8") as f:
            ctx = f.read()
        t_read = time.perf_counter() - t0
    else:
        ctx = opts.get("context", "bench context: a short text for a trivial run.")
    query = f"BENCH-ROOT {scenario}: answer by running the code."
    direct: list[float] = []
    if opts.get("direct_url"):  # half the baseline before the run, half after it
        direct += direct_calls(opts["direct_url"], opts["direct_n"] // 2)
    t0 = time.perf_counter()
    answer = (run_ours if harness == "ours" else run_ref)(scenario, base_url, opts, ctx, query)
    t_call = time.perf_counter() - t0
    if opts.get("direct_url"):
        direct += direct_calls(opts["direct_url"], opts["direct_n"] - opts["direct_n"] // 2)
    print("BENCH-RESULT " + json.dumps({"answer": answer, "t_call": t_call, "t_read": t_read,
                                        "t_before_call": t0 - T_START, "direct": direct}),
          flush=True)


if __name__ == "__main__":
    main()
