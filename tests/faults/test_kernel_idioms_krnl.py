"""Issue 26, kind 1: a cell's own processes and event loops never share the host's plumbing.

Every idiom a model writes from habit to make sub-calls at once either works, with each answer
going to the call that asked for it, or fails with an error that says what to write instead:
fork-, spawn- and forkserver-based ``multiprocessing`` pools, ``os.fork``,
``ProcessPoolExecutor``, threads, ``asyncio.run`` and top-level ``await``. And the system
prompts say what the kernel supports.

Real kernels (in the sandbox where the machine has it, else as the default mode runs them), the
scripted OpenAI-protocol server on 127.0.0.1, the real ``openai`` client. The sub-call answers
carry their prompt (``ECHO:<prompt>``) after a random short delay, so crossed answers show.
"""
from __future__ import annotations

import json
import random
import time

import pytest

from conftest import last_user, repl, root_requests, script, sub_requests


def echo(req):
    time.sleep(random.uniform(0.0, 0.05))  # replies overtake each other
    return "ECHO:" + last_user(req)


def run_cell(api, *lines, sandbox=None, **options):
    """One cell whose FINAL is a JSON object; returns (that object, result, server)."""
    opts = dict(cell_timeout=40)
    if sandbox:
        opts["sandbox"] = sandbox
    opts.update(options)
    res, srv = api(script([repl("import json", *lines)], echo), "ctx", **opts)
    assert res.status == "completed", res.reason
    return json.loads(res.answer), res, srv


def assert_uncrossed(got: dict) -> None:
    for prompt, answer in got.items():
        assert answer == "ECHO:" + prompt, (prompt, answer)


PROMPTS = "prompts = ['item-%d' % i for i in range(8)]"


def test_example_fork_pool_after_a_first_llm_query(api):
    # the example: the first llm_query opens the kernel's connection, the forked
    # workers inherited it, and 7 of 8 answers came back crossed
    got, _, srv = run_cell(api, "warm = llm_query('warm')", "import multiprocessing", PROMPTS,
                           "with multiprocessing.Pool(4) as p:",
                           "    out = p.map(llm_query, prompts)",
                           "FINAL(json.dumps(dict(zip(prompts, out), warm=warm)))")
    assert_uncrossed(got)
    assert len(sub_requests(srv)) == 9


def test_fork_pool_outside_the_sandbox(api):
    got, _, _ = run_cell(api, "llm_query('warm')", "import multiprocessing", PROMPTS,
                         "with multiprocessing.get_context('fork').Pool(4) as p:",
                         "    out = p.map(llm_query, prompts)",
                         "FINAL(json.dumps(dict(zip(prompts, out))))", sandbox="none")
    assert_uncrossed(got)


def test_spawn_pool_reaches_the_bridge(api):
    # a spawned worker is a fresh interpreter: it finds the bridge through the environment
    got, _, _ = run_cell(api, "llm_query('warm')", "import multiprocessing", PROMPTS,
                         "with multiprocessing.get_context('spawn').Pool(3) as p:",
                         "    out = p.map(llm_query, prompts)",
                         "FINAL(json.dumps(dict(zip(prompts, out))))")
    assert_uncrossed(got)


def test_forkserver_process_pool_executor(api):
    got, _, _ = run_cell(api, "llm_query('warm')", "import concurrent.futures as cf",
                         "import multiprocessing", PROMPTS,
                         "ctx = multiprocessing.get_context('forkserver')",
                         "with cf.ProcessPoolExecutor(3, mp_context=ctx) as ex:",
                         "    out = list(ex.map(llm_query, prompts))",
                         "FINAL(json.dumps(dict(zip(prompts, out))))")
    assert_uncrossed(got)


def test_process_pool_executor_and_os_fork(api):
    got, _, _ = run_cell(
        api, "import concurrent.futures as cf, os", "llm_query('warm')", PROMPTS,
        "with cf.ProcessPoolExecutor(4) as ex:",
        "    out = dict(zip(prompts, ex.map(llm_query, prompts)))",
        # os.fork while this process's own connection is open; the child asks, then the parent
        "r, w = os.pipe()",
        "pid = os.fork()",
        "if pid == 0:",
        "    os.write(w, llm_query('from-child').encode()); os._exit(0)",
        "out['from-parent'] = llm_query('from-parent')",
        "os.waitpid(pid, 0)",
        "out['from-child'] = os.read(r, 100).decode()",
        # a fresh interpreter the cell starts finds the bridge too (it is the kernel's child)
        "import subprocess, sys",
        "out['from-python'] = subprocess.run([sys.executable, '-c', 'import kernels.runtime as r; "
        "print(r.llm_query(\"from-python\"), end=\"\")'], capture_output=True, text=True).stdout",
        "FINAL(json.dumps(out))")
    assert_uncrossed(got)
    assert len(got) == 11


def test_threads_and_asyncio_run_and_top_level_await(api):
    got, _, _ = run_cell(
        api, "import asyncio, concurrent.futures as cf, threading", PROMPTS,
        "out = {}",
        "with cf.ThreadPoolExecutor(4) as ex:",
        "    out.update(zip(prompts, ex.map(llm_query, prompts)))",
        "async def ask(tag):",
        "    ps = [tag + str(i) for i in range(4)]",
        "    return dict(zip(ps, await asyncio.gather(*(asyncio.to_thread(llm_query, p) for p in ps))))",
        "out.update(asyncio.run(ask('run-')))",  # the idiom of every asyncio script
        "out.update(await ask('await-'))",
        "FINAL(json.dumps(out))")
    assert_uncrossed(got)
    assert len(got) == 16


def test_asyncio_run_returns_raises_and_nests(api):
    got, _, _ = run_cell(
        api, "import asyncio",
        "async def boom():",
        "    raise KeyError('inner')",
        "try:",
        "    asyncio.run(boom())",
        "    raised = 'nothing'",
        "except KeyError as e:",
        "    raised = 'KeyError ' + str(e)",
        "async def outer():",
        "    return asyncio.run(asyncio.sleep(0, result='nested'))",
        "try:",
        "    asyncio.run(42)",
        "    bad = 'accepted'",
        "except ValueError as e:",
        "    bad = 'ValueError'",
        "FINAL(json.dumps({'raised': raised, 'nested': asyncio.run(outer()), 'bad': bad}))")
    assert got == {"raised": "KeyError 'inner'", "nested": "nested", "bad": "ValueError"}


def test_what_cannot_work_says_what_to_write_instead(api):
    # loop.run_until_complete on the kernel's running loop, and a cell's function sent to a
    # spawned worker (which cannot import the cell): the model is told what to write instead
    replies = [
        repl("import asyncio", "async def main():", "    return 1",
             "asyncio.get_event_loop().run_until_complete(main())"),
        repl("import concurrent.futures as cf, multiprocessing",
             "def ask(p):", "    return llm_query(p)",
             "with cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context('spawn')) as ex:",
             "    print(list(ex.map(ask, ['a'])))"),
        repl("FINAL('done')"),
    ]
    res, srv = api(script(replies, echo), "ctx", cell_timeout=40)
    assert res.status == "completed", res.reason
    roots = root_requests(srv)
    loop_told, spawn_told = last_user(roots[1]), last_user(roots[2])
    assert "This event loop is already running" in loop_told
    assert "[hint:" in loop_told and "`await main()`" in loop_told, loop_told
    assert "BrokenProcessPool" in spawn_told, spawn_told
    assert "[hint:" in spawn_told and "cannot see functions defined in a cell" in spawn_told
    assert "ThreadPoolExecutor" in spawn_told


def test_a_process_not_started_by_the_kernel_is_refused(api):
    # spawned workers find the bridge through the environment; a process outside the kernel's
    # tree that read it is still refused (the bridge checks the peer), while the run is live
    import subprocess
    import sys
    from conftest import REPO
    probe = ("import json, sys; import kernels.runtime as rt; "
             "rt._CONF.update(json.loads(sys.argv[1]))\n"
             "try:\n    print('SERVED', rt.llm_query('x'))\n"
             "except Exception as e:\n    print(type(e).__name__, e)")

    def sub(req):
        prompt = last_user(req)
        if not prompt.startswith("BRIDGE:"):
            return "ECHO:" + prompt
        p = subprocess.run([sys.executable, "-c", probe, prompt[len("BRIDGE:"):]], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
        return p.stdout.strip() or p.stderr.strip()[-300:]

    cell = repl("import os, json",
                "out = llm_query('BRIDGE:' + os.environ['RLM_KERNEL_BRIDGE'])",
                "FINAL(json.dumps({'probe': out, 'mine': llm_query('mine')}))")
    res, srv = api(script([cell], sub), "ctx", sandbox="none")
    assert res.status == "completed", res.reason
    got = json.loads(res.answer)
    assert got["probe"].startswith("SubcallError") and "not the kernel" in got["probe"], got
    assert got["mine"] == "ECHO:mine"
    assert len(sub_requests(srv)) == 2  # the probe's call never reached the model


@pytest.mark.parametrize("profile", ["general", "small"])
def test_the_system_prompts_say_what_the_kernel_supports(profile):
    from rlm.prompting import prompts
    meta = {"type": "str", "chars": 10, "tokens_estimate": 3}
    text = prompts.system_prompt(meta, can_recurse=True, profile=profile)
    for needle in ("top-level `await`", "asyncio.run(main())", "ThreadPoolExecutor",
                   "multiprocessing.Pool", "llm_query_batched"):
        assert needle in text, (profile, needle)


def test_final_in_a_process_the_cell_started_is_a_clear_error(api):
    got, _, _ = run_cell(api, "import multiprocessing",
                         "def final_in_child(_):",
                         "    try:",
                         "        FINAL('from a worker')",
                         "        return 'accepted'",
                         "    except Exception as e:",
                         "        return type(e).__name__ + ': ' + str(e)",
                         "with multiprocessing.Pool(1) as p:",
                         "    told = p.map(final_in_child, [0])[0]",
                         "FINAL(json.dumps({'told': told}))")
    assert got["told"].startswith("RLMKernelError: FINAL was called in a process the cell "
                                  "started"), got
