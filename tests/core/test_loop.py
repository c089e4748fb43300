"""The RLM loop end to end: real kernels, a real HTTP endpoint with scripted replies.

Each test drives ``rlm.completion`` against :class:`ScriptedServer` and checks what the
model was shown (the requests the server received) and what the run returned.
"""
from __future__ import annotations

import re
import threading
import time

import pytest

import rlm
from conftest import (Reply, assert_clean_error, endpoint_args, last_user, repl, root_requests, script,
                      sub_requests)


def feedback_after(srv, turn: int) -> str:
    """The user message the model got after its ``turn``-th root reply (1-based)."""
    return last_user(root_requests(srv)[turn])


# --------------------------------------------------------------------------- 1. a full run


def test_inspect_context_batched_subcalls_and_usage(api):
    context = "".join(f"line {i}: " + "x" * (i % 7) + " filler text\n" for i in range(200))
    n = len(context)
    expected_x = context.count("x")
    seen_len = {}
    arrivals: list[float] = []
    lock = threading.Lock()

    def turn2(req):
        # the model reads the length the kernel printed, from the request it was sent
        m = re.search(r"LEN=(\d+)", last_user(req))
        assert m, last_user(req)
        seen_len["n"] = int(m.group(1))
        step = int(m.group(1)) // 4 + 1
        return repl(f"chunks = [context[i:i + {step}] for i in range(0, {m.group(1)}, {step})]",
                    "print('CHUNKS', len(chunks))",
                    "counts = llm_query_batched(['Count x in: ' + c for c in chunks])",
                    "print('COUNTS', counts)")

    def sub(req):
        with lock:
            arrivals.append(time.monotonic())
        text = last_user(req)
        assert text.startswith("Count x in: ")
        # a slow sub-model: four of these in sequence would take >= 2 s
        return Reply(content=str(text[len("Count x in: "):].count("x")), delay=0.5,
                     usage={"prompt_tokens": 50, "completion_tokens": 5})

    replies = [repl("print(f'LEN={len(context)}')"),
               turn2,
               repl("FINAL(sum(int(c) for c in counts))")]
    res, srv = api(script(replies, sub), context, "How many x are there?")

    assert res.status == "completed", res.reason
    assert res.answer == str(expected_x)
    assert seen_len["n"] == n
    assert res.iterations == 3
    # four sub-calls, each a single user message with no system prompt, run concurrently
    subs = sub_requests(srv)
    assert len(subs) == 4
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" for r in subs)
    assert max(arrivals) - min(arrivals) < 0.45, "llm_query_batched did not run concurrently"
    # results come back in input order
    chunk_counts = [str(context[i:i + n // 4 + 1].count("x")) for i in range(0, n, n // 4 + 1)]
    assert f"COUNTS {chunk_counts!r}" in feedback_after(srv, 2)
    # usage: exactly what the endpoint reported, summed; one call per request
    assert res.usage["prompt_tokens"] == sum(u["prompt_tokens"] for u in srv.usages)
    assert res.usage["completion_tokens"] == sum(u["completion_tokens"] for u in srv.usages)
    assert res.usage["total_tokens"] == sum(u["total_tokens"] for u in srv.usages)
    assert res.usage["calls"] == srv.count == 3 + 4
    # by level: the root's own turns at level 0, the sub-calls at level 1
    assert res.usage["by_level"]["0"]["calls"] == 3
    assert res.usage["by_level"]["1"] == {"prompt_tokens": 200, "completion_tokens": 20,
                                          "total_tokens": 220, "calls": 4, "cost_usd": 0.0}
    assert res.usage["by_level"]["0"]["prompt_tokens"] == res.usage["prompt_tokens"] - 200


def test_system_prompt_shows_metadata_not_content(api):
    secret_line = "the-needle-is-7781"
    context = "haystack " * 500 + secret_line + " haystack" * 500
    res, srv = api(script([repl("FINAL('ok')")]), context, "find the needle")
    assert res.status == "completed"
    first = srv.requests[0]
    system = first["messages"][0]["content"]
    assert f"{len(context):,} characters" in system
    assert secret_line not in str(first["messages"])
    assert "find the needle" in first["messages"][1]["content"]


def test_usage_counts_provider_cost(api):
    """A provider that reports cost per call: the run's cost is their sum."""
    replies = [Reply(content=repl("x = llm_query('hi')"), cost=0.25),
               Reply(content=repl("FINAL(x)"), cost=0.5)]
    res, srv = api(script(replies, lambda req: Reply(content="hello", cost=0.125)))
    assert res.status == "completed" and res.answer == "hello"
    assert res.usage["cost_usd"] == pytest.approx(0.875)
    assert res.usage["calls"] == srv.count == 3


# --------------------------------------------------------------------------- 2. FINAL_VAR


def test_final_var_by_name(api):
    res, _ = api(script([repl("result = 'the answer is ' + str(6 * 7)", "FINAL_VAR('result')")]))
    assert res.status == "completed"
    assert res.answer == "the answer is 42"


def test_final_var_by_value(api):
    res, _ = api(script([repl("result = 'forty two and more'", "FINAL_VAR(result)")]))
    assert res.status == "completed"
    assert res.answer == "forty two and more"


def test_final_var_by_value_single_word(api):
    """FINAL_VAR is documented to accept the value itself; a one-word value is a value too."""
    res, srv = api(script([repl("city = 'Paris'", "FINAL_VAR(city)"),
                           repl("FINAL('fallback')")]))
    assert res.status == "completed"
    assert res.answer == "Paris", feedback_after(srv, 1) if srv.count > 1 else res


def test_final_var_of_non_string_and_final_of_int(api):
    res, _ = api(script([repl("nums = [1, 2, 3]", "FINAL_VAR('nums')")]))
    assert res.answer == "[1, 2, 3]"
    res, _ = api(script([repl("FINAL(6 * 7)")]))
    assert res.answer == "42"


def test_final_var_unknown_name_is_an_error_the_model_sees(api):
    res, srv = api(script([repl("FINAL_VAR('nothing_here')"), repl("FINAL('ok')")]))
    assert res.status == "completed" and res.answer == "ok"
    assert res.iterations == 2
    fb = feedback_after(srv, 1)
    assert "NameError" in fb and "nothing_here" in fb


def test_error_after_final_in_the_same_cell_keeps_the_answer(api):
    res, srv = api(script([repl("FINAL('kept')", "1 / 0")]))
    assert res.status == "completed" and res.answer == "kept"
    assert srv.count == 1


# --------------------------------------------------------------------------- 3. prose FINAL


def test_prose_final_does_not_end_the_run(api):
    replies = ["I am sure now. FINAL(42)",
               "```repl\nx = 41\n```\nAnd so FINAL(x)",
               repl("FINAL(x + 1)")]
    res, srv = api(script(replies))
    assert res.status == "completed"
    assert res.answer == "42"
    assert res.iterations == 3 and srv.count == 3
    note = feedback_after(srv, 1)
    assert "plain text" in note and "```repl" in note
    # a reply with code and a prose FINAL: the code ran, the prose FINAL did nothing
    assert feedback_after(srv, 2).startswith("Output:")


def test_reply_without_code_is_told_to_write_code(api):
    res, srv = api(script(["Let me think about it.", repl("FINAL('done')")]))
    assert res.status == "completed" and res.iterations == 2
    assert "no ```repl code block" in feedback_after(srv, 1)


def test_python_fence_is_accepted_and_blocks_run_in_order(api):
    reply = ("First:\n```python\nacc = ['a']\n```\nthen\n```repl\nacc.append('b')\nprint(acc)\n```")
    res, srv = api(script([reply, repl("FINAL(''.join(acc))")]))
    assert res.answer == "ab"
    fb = feedback_after(srv, 1)
    assert "Output of block 2/2" in fb and "['a', 'b']" in fb


# --------------------------------------------------------------------------- 4. reserved names


def test_reserved_names_are_restored_after_each_cell(api):
    context = "the original context " * 10
    replies = [
        # inside the cell the assignments hold ...
        repl("context = 'x'", "llm_query = None", "FINAL = print",
             "print('INSIDE', len(context), llm_query)"),
        # ... and the next cell sees the real ones again
        repl("print('LEN', len(context))", "print('SUB', llm_query('ping'))"),
        repl("FINAL(len(context))"),
    ]
    res, srv = api(script(replies, lambda req: "pong"), context)
    assert res.status == "completed", res.reason
    assert res.answer == str(len(context))
    assert "INSIDE 1 None" in feedback_after(srv, 1)
    fb = feedback_after(srv, 2)
    assert f"LEN {len(context)}" in fb
    assert "SUB pong" in fb


def test_reserved_names_restored_between_blocks_of_one_reply(api):
    context = "abcdef" * 7
    reply = repl("del context", "del llm_query") + "\n" + repl("print('LEN', len(context))",
                                                                 "print(llm_query('a'))")
    res, srv = api(script([reply, repl("FINAL('ok')")], lambda req: "sub-ok"), context)
    assert res.status == "completed"
    fb = feedback_after(srv, 1)
    assert f"LEN {len(context)}" in fb and "sub-ok" in fb


# --------------------------------------------------------------------------- 5. cell timeout


def test_stuck_cell_is_interrupted_and_the_run_goes_on(api):
    replies = [repl("before = 123", "while True:", "    pass"),
               repl("print('BEFORE', before)", "FINAL(before)")]
    t0 = time.monotonic()
    res, srv = api(script(replies), cell_timeout=1)
    took = time.monotonic() - t0
    assert res.status == "completed", res.reason
    assert res.answer == "123"
    fb = feedback_after(srv, 1)
    assert "timeout" in fb and "interrupted" in fb
    assert "KeyboardInterrupt" in fb
    assert res.kernels_started == 1  # interrupted, not restarted
    assert took < 15


def test_cell_that_ignores_the_interrupt_is_killed_and_restarted(api):
    context = "ctx " * 25
    replies = [repl("import time", "while True:", "    try:", "        time.sleep(60)",
                    "    except KeyboardInterrupt:", "        pass"),
               repl("print('LEN', len(context))"),
               repl("FINAL('survived')")]
    res, srv = api(script(replies), context, cell_timeout=1)
    assert res.status == "completed", res.reason
    assert res.answer == "survived"
    fb = feedback_after(srv, 1)
    assert "ignored the interrupt" in fb and "restarted" in fb
    assert res.kernels_started == 2
    assert f"LEN {len(context)}" in feedback_after(srv, 2)


# --------------------------------------------------------------------------- 6. kernel death


@pytest.mark.parametrize("kill", ["import os; os._exit(1)",
                                  "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                         ids=["os_exit", "sigkill"])
def test_dead_kernel_is_restarted_with_context(api, kill):
    context = "restart me " * 30
    replies = [repl("lost = 'gone'", kill),
               repl("print('LEN', len(context))", "print('LOST' if 'lost' in globals() else 'FRESH')"),
               repl("FINAL('recovered')")]
    res, srv = api(script(replies), context)
    assert res.status == "completed", res.reason
    assert res.answer == "recovered"
    died = feedback_after(srv, 1)
    assert "died" in died and "restarted" in died
    fb = feedback_after(srv, 2)
    assert f"LEN {len(context)}" in fb
    assert "FRESH" in fb
    assert res.kernels_started == 2


def test_restarted_kernel_reads_the_same_context_from_its_own_file(api, monkeypatch):
    """Each kernel reads the context from a file of its own user (a private file in its
    working directory when it runs as another user than the host: the host's temporary file,
    moved); a kernel started after the first one died gets the very same text again, and the
    host's temporary files are gone after the run."""
    import hashlib
    import os
    import tempfile

    made: list[str] = []
    mkstemp = tempfile.mkstemp

    def spy(*a, **kw):
        fd, path = mkstemp(*a, **kw)
        if kw.get("prefix") == "rlm-ctx-":
            made.append(path)
        return fd, path

    monkeypatch.setattr(tempfile, "mkstemp", spy)
    context = "h\u00e9llo \U0001f600 restart\r\n" * 60000  # ~1.4 MB
    # a kernel's private files: in its working directory, or in a sandbox its ctx directory
    look = ("import glob, hashlib, os, stat; mine = [os.stat(n) for n in glob.glob('.ctx-*') "
            "+ glob.glob('/tmp/rlm-k-*/ctx/.ctx-*')]; "
            "print('CTX', hashlib.sha256(context.encode()).hexdigest(), os.getuid(), "
            "[(s.st_uid, stat.S_IMODE(s.st_mode)) for s in mine])")
    replies = [repl(look), repl("import os; os._exit(1)"), repl(look), repl("FINAL('ok')")]
    res, srv = api(script(replies), context)
    assert res.status == "completed", res.reason
    assert res.kernels_started == 2
    want = hashlib.sha256(context.encode("utf-8")).hexdigest()
    assert "died" in feedback_after(srv, 2)
    other_user = False
    for turn in (1, 3):
        line = next(ln for ln in feedback_after(srv, turn).splitlines() if ln.startswith("CTX"))
        _, digest, uid, files = line.split(" ", 3)
        assert digest == want, f"turn {turn}: the kernel's context differs"
        if int(uid) != os.geteuid():  # another user: its own read-only file, no other
            other_user = True
            assert files == f"[({uid}, 256)]", line
    # the host's file was given to the first kernel, so the second got one written again
    assert len(made) == (2 if other_user else 1), made
    assert not any(os.path.exists(p) for p in made)


def test_kernel_that_keeps_dying_fails_with_kernel_error(api):
    kill = repl("import os; os._exit(3)")
    with pytest.raises(rlm.KernelError) as ei:
        api(script([kill] * 5), max_kernel_restarts=1)
    assert "died" in str(ei.value)


# --------------------------------------------------------------------------- 10. API key


def test_api_key_is_not_visible_in_the_kernel(api, monkeypatch, tmp_path):
    secret = "sk-test-not-for-kernels-9f8e7d"
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    monkeypatch.setenv("RLM_SOME_TOKEN", secret)
    replies = [repl("import os", "print(dict(os.environ))",
                    "print(open('/proc/self/environ', 'rb').read())"),
               repl("FINAL('ok')")]
    jdir = tmp_path / "jdir"
    jdir.mkdir()
    res, srv = api(script(replies), api_key=secret, journal=str(jdir / "j.sqlite3"))
    assert res.status == "completed"
    shown = feedback_after(srv, 1)
    assert "PATH" in shown  # the environment really was printed
    assert secret not in shown
    assert "OPENAI_API_KEY" not in shown
    # and the key went where it belongs: the HTTP request, not the prompt, not the journal
    assert secret not in str(srv.requests)
    for f in jdir.iterdir():
        assert secret.encode() not in f.read_bytes(), f


# --------------------------------------------------------------------------- 12. iterations


def test_max_iterations_then_last_turn_then_failed(api):
    res, srv = api(script([repl("print('working')")] * 3), max_iterations=2)
    assert res.status == "failed"
    assert res.answer is None
    assert "no FINAL" in res.reason
    assert srv.count == 3  # max_iterations turns and one last turn
    last = last_user(srv.requests[-1])
    assert "last turn" in last
    assert "last turn" not in str(srv.requests[1]["messages"])


def test_final_on_the_last_turn_completes(api):
    res, srv = api(script(["no code", "still no code", repl("FINAL('late')")]), max_iterations=2)
    assert res.status == "completed" and res.answer == "late"
    assert res.iterations == 3


# --------------------------------------------------------------------------- 13. long outputs


def test_long_output_is_cut_with_a_note(api):
    replies = [repl("print('HEAD' + 'A' * 3000 + 'TAIL')"), repl("FINAL('ok')")]
    res, srv = api(script(replies), max_output_chars=500)
    assert res.status == "completed"
    fb = feedback_after(srv, 1)
    printed = len("HEAD" + "A" * 3000 + "TAIL\n")  # 3009 characters of output
    assert f"{printed - 500:,} characters cut" in fb
    assert fb.count("A") <= 500
    assert "HEAD" in fb and "TAIL" in fb  # head and tail are both kept
    assert len(fb) < 700


def test_short_output_is_not_cut(api):
    res, srv = api(script([repl("print('B' * 400)"), repl("FINAL('ok')")]), max_output_chars=500)
    fb = feedback_after(srv, 1)
    assert "B" * 400 in fb and "cut" not in fb


# --------------------------------------------------------------------------- 14. depth 0


def test_max_depth_zero_disables_subcalls(api):
    replies = [repl("llm_query('hello')"),
               repl("try:", "    rlm('piece', 'q')", "except DepthError as e:", "    print('CAUGHT', e)",
                    "try:", "    llm_query_batched(['a', 'b'])", "except Exception as e:",
                    "    print('BATCH', type(e).__name__)"),
               repl("FINAL(len(context))")]
    res, srv = api(script(replies, lambda req: "should never be asked"), "abc", max_depth=0)
    assert res.status == "completed", res.reason
    assert res.answer == "3"
    fb = feedback_after(srv, 1)
    assert "DepthError" in fb and "max_depth=0" in fb
    fb2 = feedback_after(srv, 2)
    assert "CAUGHT" in fb2 and "BATCH DepthError" in fb2
    assert sub_requests(srv) == []
    assert "rlm(prompt, query)" not in srv.requests[0]["messages"][0]["content"]


# --------------------------------------------------------------------------- contexts via the API


def test_list_and_dict_contexts_arrive_as_python_values(api):
    res, _ = api(script([repl("FINAL(type(context).__name__ + ':' + '|'.join(context))")]),
                 ["alpha", "beta", "gamma"])
    assert res.answer == "list:alpha|beta|gamma"
    res, srv = api(script([repl("FINAL(sorted(context.items()))")]), {"b": [1, 2], "a": "x"})
    assert res.answer == "[('a', 'x'), ('b', [1, 2])]"
    assert "a dict" in srv.requests[0]["messages"][0]["content"]


def test_unicode_context_is_exact(api):
    context = "naïve café — 東京 🎉\r\nline two\n"
    res, _ = api(script([repl("FINAL(repr(context))")]), context)
    assert res.answer == repr(context)


def test_unknown_option_is_a_config_error():
    with pytest.raises(rlm.ConfigError, match="max_iteration"):
        rlm.completion("ctx", "q", max_iteration=3, journal=False)


# --------------------------------------------------------------------------- more cell behaviour


def test_interrupt_during_a_slow_subcall_does_not_desync_the_bridge(api):
    """A cell interrupted while llm_query waits: the next call gets its own answer, not the
    late reply to the interrupted one. (The cell's own timeout does not run while it waits on
    a sub-call, so the interrupt here is a SIGINT the cell sends itself.)"""
    def sub(req):
        p = last_user(req)
        return Reply(content="SLOW-ANSWER", delay=2.5) if p == "slow" else f"answer to {p}"

    replies = [repl("import os, signal, threading",
                    "threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()",
                    "x = llm_query('slow')"),
               repl("print('GOT', llm_query('fast'))", "print('GOT2', llm_query('again'))"),
               repl("FINAL('ok')")]
    res, srv = api(script(replies, sub), cell_timeout=1)
    assert res.status == "completed", res.reason
    assert "KeyboardInterrupt" in feedback_after(srv, 1)
    fb = feedback_after(srv, 2)
    assert "GOT answer to fast" in fb and "GOT2 answer to again" in fb
    assert "SLOW-ANSWER" not in fb


def test_output_flood_is_interrupted_and_cut(api):
    replies = [repl("while True:", "    print('spam ' * 40)"), repl("FINAL('quiet now')")]
    t0 = time.monotonic()
    res, srv = api(script(replies), cell_timeout=1, max_output_chars=1000)
    assert res.status == "completed", res.reason
    assert time.monotonic() - t0 < 20
    fb = feedback_after(srv, 1)
    assert "characters cut" in fb and "timeout" in fb
    assert len(fb) < 1600


def test_results_stderr_and_errors_are_shown(api):
    replies = [repl("import sys", "print('to stderr', file=sys.stderr)", "6 * 7"),
               repl("input('your name? ')"),
               repl("def f():", "    raise ValueError('bad value 99')", "f()"),
               repl("FINAL('ok')")]
    res, srv = api(script(replies))
    assert res.status == "completed", res.reason
    fb1 = feedback_after(srv, 1)
    assert "to stderr" in fb1 and "42" in fb1
    assert "StdinNotImplementedError" in feedback_after(srv, 2)  # input() fails, it does not hang
    fb3 = feedback_after(srv, 3)
    assert "ValueError: bad value 99" in fb3 and "\x1b[" not in fb3


def test_exit_in_a_cell_does_not_break_the_run(api):
    context = "keep me " * 9
    replies = [repl("exit()"), repl("print('LEN', len(context))"), repl("FINAL('alive')")]
    res, srv = api(script(replies), context)
    assert res.status == "completed", res.reason
    assert res.answer == "alive"
    assert f"LEN {len(context)}" in feedback_after(srv, 2)


def test_batched_item_failure_is_reported_per_item(api):
    def sub(req):
        p = last_user(req)
        return Reply(status=401, content="denied") if p == "bad" else p.upper()

    replies = [repl("try:", "    llm_query_batched(['a', 'bad', 'c'])", "except BatchError as e:",
                    "    print('ERRS', sorted(e.errors), e.results[0], e.results[2])",
                    "r = llm_query_batched(['a', 'bad', 'c'], return_exceptions=True)",
                    "print('TYPES', [type(x).__name__ for x in r])"),
               repl("FINAL('ok')")]
    res, srv = api(script(replies, sub))
    assert res.status == "completed", res.reason
    fb = feedback_after(srv, 1)
    assert "ERRS [1] A C" in fb
    assert "TYPES ['str', 'SubcallError', 'str']" in fb


def test_rlm_at_the_depth_limit_is_a_plain_completion(api):
    seen = []

    def sub(req):
        seen.append(req["messages"])
        return "fallback answer"

    res, srv = api(script([repl("FINAL(rlm('piece of text', 'what is it?'))")], sub), max_depth=1)
    assert res.answer == "fallback answer"
    assert len(seen) == 1 and len(seen[0]) == 1
    assert seen[0][0]["content"] == "piece of text\n\nQuestion: what is it?"
    assert res.stages.get("fallback") == 1 and res.kernels_started == 1


def test_child_rlm_gets_its_own_kernel_and_context(api):
    def responder(req):
        msgs = req["messages"]
        if "child question" in msgs[1]["content"]:
            # the child: its own context, its own kernel (the parent's variables are absent)
            return repl("FINAL(f\"{len(context)}:{'secret_var' in globals()}\")")
        if len(msgs) == 2:
            return repl("secret_var = 1", "out = rlm(context[:50], 'child question')", "print('CHILD', out)")
        return repl("FINAL(out)")

    res, srv = api(responder, "z" * 500, max_depth=2, pool_size=0)
    assert res.status == "completed", res.reason
    assert res.answer == "50:False"
    assert res.kernels_started == 2 and res.max_level == 1
    child_sys = [r for r in srv.requests if "child question" in r["messages"][1]["content"]][0]
    assert "50 characters" in child_sys["messages"][0]["content"]


# --------------------------------------------------------------------------- prompt profiles

def _system_and_task(srv) -> tuple[str, str]:
    first = srv.requests[0]["messages"]
    return first[0]["content"], first[1]["content"]


def test_the_general_profile_is_the_default_with_an_endpoint(api):
    from rlm.prompting import prompts
    res, srv = api(script([repl("FINAL('ok')")]), "some text", "what is it?")
    system, task = _system_and_task(srv)
    assert res.status == "completed"
    # a way of working (map with batched sub-calls, check before FINAL), not a program to copy
    assert "llm_query_batched" in system and "spot-check" in system
    assert "old lighthouse" not in system
    assert task == prompts.FIRST_USER_GENERAL.format(query="what is it?")


def test_the_small_profile_is_the_worked_lookup_example(api):
    res, srv = api(script([repl("FINAL('ok')")]), "some text", "what is it?", prompt="small")
    system, task = _system_and_task(srv)
    assert "old lighthouse" in system and "text = context" in system
    assert task.startswith("Question: what is it?")


def test_the_small_count_profile_counts_first_and_ends_with_the_metadata(api):
    res, srv = api(script([repl("FINAL('ok')")]), "some text", "how many times?",
                   prompt="small-count")
    system, task = _system_and_task(srv)
    assert res.status == "completed"
    # the counting program comes first; the lookup is still there, last of the three
    a, c = system.index("Counter(re.findall"), system.index("old lighthouse")
    assert a < system.index("replies = llm_query_batched(prompts)") < c
    # the metadata is the prompt's tail, so its fixed part is a reusable prefix
    assert system.rstrip().rsplit("\n", 1)[-1].startswith("About `context`:")
    assert task.startswith("Question: how many times?")


@pytest.mark.parametrize("profile", ["small", "small-count", "general", "file"])
def test_a_loop_without_subcalls_is_not_offered_them(api, tmp_path, profile):
    """At max_depth=0 llm_query, llm_query_batched and rlm are refused, so no profile may
    show them as functions to call or in a worked program (a small model copies a refused call
    until the iteration cap); the same profile at depth 1 still offers them."""
    if profile == "file":
        tpl = tmp_path / "mine.txt"
        tpl.write_text("MINE: call llm_query(piece). {meta}", encoding="utf-8")
        profile = str(tpl)
    systems = {}
    for depth in (0, 1):
        res, srv = api(script([repl("FINAL('ok')")]), "some text", "what is it?",
                       prompt=profile, max_depth=depth)
        assert res.status == "completed", res.reason
        systems[depth] = _system_and_task(srv)[0]
    d0, d1 = systems[0], systems[1]
    assert "switched off" in d0 and "switched off" not in d1
    if profile.endswith("mine.txt"):
        return  # a user's own text is kept as written, with the note after it
    for call in ("llm_query(", "llm_query_batched(", "rlm(prompt"):
        assert call not in d0, (profile, call)
    assert "llm_query(" in d1 and "llm_query_batched(" in d1
    if profile.startswith("small"):  # the lookup prints its windows for the model to read
        assert "print(pos, repr(text[max(0, pos - 300):pos + 300]))" in d0


def test_the_no_subcall_lookup_program_shows_the_needle(api):
    """The worked lookup of a loop without sub-calls, run as a model that copies it would run
    it, prints the window with the needle; the model answers from it in the next turn."""
    from rlm.prompting import prompts
    meta = {"type": "str", "chars": 10, "tokens_estimate": 3}
    text = prompts.system_prompt(meta, can_recurse=False, profile="small")
    code = "import re\n" + text.split("```repl\nimport re\n", 1)[1].split("\n```", 1)[0]
    code = code.replace('["lighthouse", "door", "colour"]', '["vault", "code"]')
    filler = "The river ran past the mill and the fields were quiet. " * 400
    context = filler + "The code of the east vault is 7341-QX. " + filler
    res, srv = api(script([repl(*code.splitlines()), repl("FINAL('7341-QX')")]), context,
                   "What is the code of the east vault?", prompt="small", max_depth=0)
    assert res.status == "completed" and res.answer == "7341-QX", res.reason
    seen = feedback_after(srv, 1)
    assert "The code of the east vault is 7341-QX." in seen, seen[:500]
    assert len(seen) < 4000  # three short windows, well inside the output cap


def test_the_embedded_model_defaults_to_the_small_profile():
    from rlm.config.options import OPTIONS
    opt = {o.name: o for o in OPTIONS}["prompt"]
    assert (opt.default_for(False), opt.default_for(True)) == ("general", "small")


def test_a_prompt_file_is_read_once_and_kept_in_the_journal(api, tmp_path, scripted):
    import rlm
    tpl = tmp_path / "mine.txt"
    tpl.write_text("MY PROMPT. Context: {meta}{rlm_line}", encoding="utf-8")
    journal = tmp_path / "j.sqlite3"
    res, srv = api(script([repl("FINAL('ok')")]), "some text", "q?", prompt=str(tpl),
                   journal=str(journal))
    system, _ = _system_and_task(srv)
    assert system.startswith("MY PROMPT. Context: it is a string of 9 characters")
    tpl.unlink()  # replay needs the recorded text, not the file
    from rlm.api import replay
    again = replay(res.run_id, journal=str(journal), context="some text")
    assert again.answer == "ok" and again.replayed_calls == 1


@pytest.mark.parametrize("text,needle", [
    ("{meta:{meta}}", "{meta:{meta}} is not a plain field name"),   # a nested spec
    ("big {meta:>99999999999}", "is not a plain field name"),        # a width that exhausts memory
    ("{meta!r}", "{meta!r} is not a plain field name"),
    ("{0} and {}", "{0} is not a plain field name"),
    ("{meta[0]}", "{meta[0]} is not a plain field name"),
    ("{nope}", "unknown field {nope}"),
    ("a { brace", "not a valid format string")])
def test_a_bad_template_file_is_a_clean_cli_error_before_any_call(cli, scripted, tmp_path, text,
                                                                  needle):
    """A template is filled with text its author never sees (the metadata, the tools), so only
    plain field names pass: a format spec, conversion or index is refused up front (exit 2),
    not a crash mid-run."""
    ctx, tpl = tmp_path / "c.txt", tmp_path / "mine.txt"
    ctx.write_text("text")
    tpl.write_text(text, encoding="utf-8")
    srv = scripted(script([repl("FINAL('ok')")]))
    r = cli("run", "--context", str(ctx), "--query", "q", "--prompt", str(tpl),
            *endpoint_args(srv))
    assert_clean_error(r, 2, re.escape(needle))
    assert srv.count == 0


def test_a_bad_prompt_profile_is_a_clean_cli_error(cli, scripted, tmp_path):
    ctx = tmp_path / "c.txt"
    ctx.write_text("text")
    srv = scripted(script([repl("FINAL('ok')")]))
    r = cli("run", "--context", str(ctx), "--query", "q", "--prompt", "tiny",
            *endpoint_args(srv))
    assert_clean_error(r, 2, "--prompt", "small, small-count, general", "'tiny'")
    assert srv.count == 0
