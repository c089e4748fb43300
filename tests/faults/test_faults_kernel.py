"""Issue 9, the kernel-side kinds of fault: each test is named after its kind.

* kind 6: batched calls given one string (or bytes, or a dict): a TypeError in the kernel that
  names the argument, and zero calls;
* kind 7: whatever a cell does to the namespace, the next cell and FINAL work;
* kind 8: no process a cell starts outlives the run (other sessions, double forks, setsid,
  signal-ignoring daemons; the kernel dying; the host killed);
* kind 9: text UTF-8 cannot encode (lone surrogates) at every boundary: the run completes,
  the kernel's own stderr never reaches the user's terminal;
* the security item: when the host is root, kernels run unprivileged and cannot read the
  host's memory or environment, nor ptrace it.

Real kernels, the scripted HTTP server on 127.0.0.1, the real ``openai`` client; nothing mocked.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from conftest import (TESTS, endpoint_args, last_user, repl, root_requests, script,
                      sub_requests)


def feedback(srv, turn: int) -> str:
    """The user message the model got after its ``turn``-th root reply (1-based)."""
    return last_user(root_requests(srv)[turn])


# --------------------------------------------------------------------------- kind 6


def test_kind6_batched_given_one_string(api):
    # every member: each batched function (and its alias) given one str, bytes, bytearray
    # or dict; then the same through the raw bridge, bypassing the kernel-side check
    cell = repl(
        "import json",
        "out = {}",
        "cases = {'str': 'Find the code in: ' + context[:60], 'bytes': b'abc def',",
        "         'bytearray': bytearray(b'xyz'), 'dict': {'a': 'one', 'b': 'two'}}",
        "for name in ('llm_query_batched', 'rlm_batched', 'rlm_query_batched'):",
        "    for kind, arg in cases.items():",
        "        try:",
        "            globals()[name](arg)",
        "            out[name + '/' + kind] = 'NO ERROR'",
        "        except TypeError as e:",
        "            out[name + '/' + kind] = str(e)",
        "raw = {}",
        "for op in ('llm_query_batched', 'rlm_batched'):",
        "    try:",
        "        __rlm_rt._call(op, prompts='abcdef', query=None, model=None)",
        "        raw[op] = 'NO ERROR'",
        "    except Exception as e:",
        "        raw[op] = type(e).__name__ + ': ' + str(e)",
        "ok = llm_query_batched(x for x in ['p1', 'p2'])  # any iterable of prompts still works",
        "FINAL(json.dumps({'typed': out, 'raw': raw, 'ok': ok}))")
    res, srv = api(script([cell], lambda req: "A:" + last_user(req)), "The code is 4417. " * 10,
                   max_depth=2)
    assert res.status == "completed", res.reason
    got = json.loads(res.answer)
    assert len(got["typed"]) == 12
    for key, msg in got["typed"].items():
        fn = key.split("/")[0].replace("rlm_query_batched", "rlm_batched")  # an alias
        assert msg != "NO ERROR", key
        assert f"{fn}(prompts)" in msg and "`prompts` must be a list" in msg, (key, msg)
        assert "Nothing was sent" in msg, msg
    for op, msg in got["raw"].items():
        assert msg.startswith("SubcallError") and "must be a list" in msg, (op, msg)
    assert got["ok"] == ["A:p1", "A:p2"]
    # zero calls for every refused batch: only the two items of the good one were sent
    assert len(sub_requests(srv)) == 2
    assert len(root_requests(srv)) == 1


# --------------------------------------------------------------------------- kind 7


CLOBBERS = [
    # (the clobbering cell, what the next cell must still see)
    repl("%reset -f"),
    repl("del FINAL, FINAL_VAR, llm_query, rlm, SHOW_VARS",
         "context = None; llm_query_batched = 'gone'; __rlm_rt = None"),
    repl("import sys, builtins, os",
         "builtins.print = lambda *a, **k: None",
         "print = None",
         "sys.stdout = open(os.devnull, 'w'); sys.stderr = open(os.devnull, 'w')"),
    repl("import sys",
         "for name in ('kernels.runtime', 'kernels.protocol', 'kernels', 'json', 'harness.text'):",
         "    sys.modules[name] = None",
         "del sys.modules['IPython']"),
    repl("import builtins",
         "builtins.__import__ = None",
         "builtins.len = builtins.repr = builtins.str = None"),
    repl("get_ipython().events.callbacks['post_run_cell'].clear()",
         "__builtins__ = {}"),
    repl("ip = get_ipython()",
         "ip.kernel.session.pack = None",
         "ip.reset = None"),
]

CHECK = repl("print('VISIBLE', type(context).__name__, len(context), llm_query('q'),",
             "      callable(FINAL), type(__rlm_rt).__name__)")


def test_kind7_namespace_clobbering_keeps_final_working(api):
    # each clobbering cell is followed by a check cell (the model sees its printed output);
    # the last cell resets the namespace and calls FINAL in the same cell
    replies = []
    for c in CLOBBERS:
        replies += [c, CHECK]
    replies.append(repl("%reset -f", "FINAL('ok')"))
    res, srv = api(script(replies, lambda req: "SUB"), "abcdefghij",
                   max_iterations=len(replies) + 1)
    assert res.status == "completed", res.reason
    assert res.answer == "ok"
    assert len(root_requests(srv)) == len(replies)
    for i in range(len(CLOBBERS)):
        seen = feedback(srv, 2 * i + 2)  # the feedback of the check cell after clobber i
        assert "VISIBLE str 10 SUB True module" in seen, (CLOBBERS[i], seen)
    assert len(sub_requests(srv)) == len(CLOBBERS)


def test_kind7_final_survives_clobbering_in_the_same_cell(api):
    # FINAL first, then the cell wrecks the namespace and the answer path: the answer stands
    cell = repl("FINAL('kept')",
                "%reset -f",
                "import sys, builtins",
                "sys.modules['kernels.runtime'] = None; sys.modules['json'] = None",
                "builtins.__import__ = None",
                "__rlm_rt = None")
    res, srv = api(script([repl("x = 1"), cell]), "abc")
    assert res.status == "completed", res.reason
    assert res.answer == "kept"
    assert len(root_requests(srv)) == 2


# --------------------------------------------------------------------------- kind 8


def _alive_with(token: str) -> list[int]:
    """Live (non-zombie) processes whose command line holds ``token``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if token.encode() in cmd and stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X"):
            out.append(int(name))
    return out


def _escapees(token: str) -> str:
    """Cell lines starting 5 processes that leave the kernel in every usual way."""
    py = "[sys.executable, '-c', 'import time; time.sleep(600)', TOKEN]"
    return "\n".join([
        "import os, subprocess, sys, time",
        f"TOKEN = {token!r}",
        # 1. a new session
        f"subprocess.Popen({py}, start_new_session=True)",
        # 2. a new process group only
        f"subprocess.Popen({py}, process_group=0)",
        # 3. setsid(1) forking into the background, through a shell that exits
        "subprocess.run(['sh', '-c', f'setsid {sys.executable} -c \"import time; time.sleep(600)\" "
        "{TOKEN} </dev/null >/dev/null 2>&1 &'])",
        # 4. a classic double fork with setsid, the middle process exiting at once
        "pid = os.fork()",
        "if pid == 0:",
        "    os.setsid()",
        "    if os.fork() == 0:",
        f"        os.execv(sys.executable, {py})",
        "    os._exit(0)",
        "os.waitpid(pid, 0)",
        # 5. a daemon ignoring every catchable signal, orphaned by nohup's shell
        "subprocess.run(['sh', '-c', f'nohup sh -c \"trap \\'\\' TERM HUP INT QUIT; exec "
        "{sys.executable} -c \\'import signal, time; "
        "[signal.signal(s, signal.SIG_IGN) for s in (1, 2, 3, 15)]; time.sleep(600)\\' "
        "{TOKEN}\" </dev/null >/dev/null 2>&1 &'])",
        "def count():",
        "    n = 0",
        "    for p in os.listdir('/proc'):",
        "        try:",
        "            if p.isdigit() and TOKEN.encode() in open(f'/proc/{p}/cmdline', 'rb').read():",
        "                n += 1",
        "        except OSError:",
        "            pass",
        "    return n",
        "deadline = time.time() + 10",
        "while count() < 5 and time.time() < deadline:",
        "    time.sleep(0.05)",
    ])


def test_kind8_no_process_outlives_the_run(api):
    token = f"rlm-escapee-{uuid.uuid4().hex}"
    died = f"rlm-escapee-{uuid.uuid4().hex}"
    replies = [
        # the kernel dies (os._exit) after starting escapees: they die with it
        repl(_escapees(died), "print('STARTED', count())", "os._exit(1)"),
        repl("import os", f"TOKEN = {died!r}",
             "print('AFTER DEATH', sum(1 for p in os.listdir('/proc') if p.isdigit() and "
             "TOKEN.encode() in open(f'/proc/{p}/cmdline', 'rb').read()))"),
        # escapees of a live kernel, then FINAL: they must be gone when the run returns
        repl(_escapees(token), "FINAL(str(count()))"),
    ]
    res, srv = api(script(replies), "ctx", max_depth=1)
    assert res.status == "completed", res.reason
    assert res.answer == "5"  # all five were running when FINAL was called
    assert "AFTER DEATH 0" in feedback(srv, 2), feedback(srv, 2)
    deadline = time.monotonic() + 3
    while _alive_with(token) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _alive_with(token) == [], "processes started by a cell outlived the run"
    assert _alive_with(died) == []


def test_kind8_supervisor_killed_by_the_cell(api, monkeypatch):
    # a kernel running as the host's own user can signal its supervisor: SIGKILL (no
    # clean-up possible: the host kills by the kernel's tag) or any other signal (clean-up)
    monkeypatch.setenv("RLM_KERNEL_USER", "root")
    a, b = (f"rlm-escapee-{uuid.uuid4().hex}" for _ in range(2))
    count = ("sum(1 for p in os.listdir('/proc') if p.isdigit() and "
             "T.encode() in open(f'/proc/{p}/cmdline', 'rb').read())")
    replies = [
        repl(_escapees(a), "import signal", "os.kill(os.getppid(), signal.SIGKILL)", "time.sleep(60)"),
        repl("import os", f"T = {a!r}", f"print('LEFT A', {count})"),
        repl(_escapees(b), "import signal", "os.kill(os.getppid(), signal.SIGUSR1)", "time.sleep(60)"),
        repl("import os", f"T = {b!r}", f"FINAL(str({count}))"),
    ]
    res, srv = api(script(replies), "ctx", max_kernel_restarts=3)
    assert res.status == "completed", res.reason
    assert "LEFT A 0" in feedback(srv, 2), feedback(srv, 2)
    assert "died" in feedback(srv, 3)
    assert res.answer == "0"
    assert _alive_with(a) == [] and _alive_with(b) == []


HOST = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from scripted_server import ScriptedServer
    import rlm
    cell = {cell!r}
    def responder(req):
        if req["messages"][0]["role"] != "system":
            return "leaf"
        return "```repl\\n" + cell + "\\nprint('READY', count(), flush=True)\\ntime.sleep(600)\\n```"
    with ScriptedServer(responder) as srv:
        rlm.completion("ctx", "q", base_url=srv.base_url, api_key="k", model="m",
                       journal=False, cell_timeout=300)
""")


def test_kind8_host_killed_leaves_no_process(tmp_path):
    token = f"rlm-escapee-{uuid.uuid4().hex}"
    script_path = tmp_path / "host.py"
    script_path.write_text(HOST.format(tests=str(TESTS), cell=_escapees(token)))
    proc = subprocess.Popen([sys.executable, str(script_path)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        # the 5 escapees, once the shells and forks that started them (whose command lines
        # hold the token too, for a moment) are gone: the same 5 seen three polls in a row
        deadline, alive, seen = time.monotonic() + 60, [], 0
        while seen < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
            now = _alive_with(token)
            seen = seen + 1 if len(now) == 5 and now == alive else 0
            alive = now
        assert len(alive) == 5, alive
        proc.kill()  # SIGKILL: the host gets no chance to clean up
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while _alive_with(token) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive_with(token) == [], "processes outlived their host"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _alive_with(token):
            os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------- kind 9


SURROGATE_REPLY = (
    # the reply itself carries a lone surrogate (a "\ud83d" escape in the endpoint's JSON)
    "Looking \ud83d at it.\n"
    + repl("import os, sys",
           "print('CTX', context[0])",  # the context's own lone surrogate
           "half = chr(0xd83d); pair = chr(0xd83d) + chr(0xde00)",
           "print('MADE', half, pair, '\\udcff')",
           "sub = llm_query('prompt with ' + half)",  # the bridge and the sub-call request
           "print('SUB', sub)",
           # the kernel's own stderr and a broken Jupyter module: never on the terminal
           "os.write(2, b'KERNEL-FD2-MARK\\n')",
           "sys.__stderr__.write('KERNEL-DUNDER-MARK\\n'); sys.__stderr__.flush()",
           "import jupyter_client.session as s; s.json_packer = None",
           "import logging; logging.getLogger('tornado.general').error('KERNEL-LOG-MARK')"))


def _kind9_script():
    return script([
        SURROGATE_REPLY,
        repl("raise ValueError('bad ' + chr(0xdc80))"),  # a traceback holding a surrogate
        repl("FINAL('answer ' + chr(0xd83d) + ' ' + context[1])"),
    ], lambda req: "sub \ud83d reply")


def test_kind9_lone_surrogates_at_every_boundary(cli, scripted, tmp_path):
    ctx = tmp_path / "ctx.json"
    ctx.write_text('["an emoji cut in half: \\ud83d", "code 4417 \\udcff"]')
    run_ids = []
    for extra in ([], ["--no-journal"]):
        srv = scripted(_kind9_script())
        res = cli("run", "--context", str(ctx), "--query", "q \udcff?", *endpoint_args(srv),
                  "--json", *extra)
        assert res.rc == 0, res.stderr
        out = json.loads(res.stdout)  # strict UTF-8 JSON on stdout
        run_ids.append(out["run_id"])
        assert out["answer"] == "answer \ufffd code 4417 \ufffd"
        assert out["status"] == "completed"
        for mark in ("KERNEL-FD2-MARK", "KERNEL-DUNDER-MARK", "KERNEL-LOG-MARK", "Traceback",
                     "UnicodeEncodeError"):
            assert mark not in res.stderr and mark not in res.stdout, (mark, res.stderr)
        # what the model and the sub-model were sent: the policy, U+FFFD, everywhere
        first = feedback(srv, 1)
        assert "CTX an emoji cut in half: \ufffd" in first, first
        assert "MADE \ufffd \U0001f600 \ufffd" in first, first
        assert "SUB sub \ufffd reply" in first, first
        assert "ValueError: bad \ufffd" in feedback(srv, 2)
        assert last_user(sub_requests(srv)[0]) == "prompt with \ufffd"
        assert root_requests(srv)[1]["messages"][2]["content"].startswith("Looking \ufffd at it.")
        assert "q \ufffd?" in json.dumps(root_requests(srv)[0], ensure_ascii=False)
    # the journal holds the first run, cleaned: rlm show prints it
    shown = cli("show", run_ids[0])
    assert shown.rc == 0, shown.stderr
    assert "answer: answer \ufffd code 4417 \ufffd" in shown.stdout


def test_kind9_context_values_with_surrogates(api):
    # a Python value holding lone surrogates (str, list items, dict keys) is a usable context:
    # loaded, hashed and written for the kernel under the policy; one real run with the dict
    from rlm.context.load import load_context
    cases = [("text \ud800 end", "text \ufffd end"),
             (["a\udfff", "b", "\ud83d\ude00"], ["a\ufffd", "b", "\U0001f600"]),
             ({"k\ud83d": "v\ude00", "n": [1, "x\udcff"]}, {"k\ufffd": "v\ufffd", "n": [1, "x\ufffd"]})]
    for value, cleaned in cases:
        loaded = load_context(value)
        try:
            assert loaded.value == cleaned
            assert loaded.sha256 == load_context(cleaned).sha256
            with open(loaded.path, encoding="utf-8") as f:  # strict UTF-8
                assert "\ufffd" in f.read()
        finally:
            loaded.discard()
    res, _ = api(script([repl("FINAL(ascii(context))")]), cases[2][0])
    assert res.status == "completed", res.reason
    assert res.answer == ascii(cases[2][1])


# --------------------------------------------------------------------------- security


PROBE = """import os, ctypes, json
host = {host}
res = {{'uid': os.getuid(), 'ctx': len(context), 'sub': llm_query('hi')}}
res['nnp'] = open('/proc/self/status').read().split('NoNewPrivs:')[1].split()[0]
try:
    open(f'/proc/{{host}}/environ', 'rb').read(64); res['environ'] = 'READ'
except OSError as e:
    res['environ'] = type(e).__name__
try:
    m = open(f'/proc/{{host}}/mem', 'rb')
    try:
        addr = int(open(f'/proc/{{host}}/maps').readline().split('-')[0], 16)
    except OSError:
        addr = 0x400000
    m.seek(addr); m.read(16); res['mem'] = 'READ'
except OSError as e:
    res['mem'] = type(e).__name__
libc = ctypes.CDLL(None, use_errno=True)
for name, req in (('attach', 16), ('seize', 0x4206)):
    r = libc.ptrace(req, host, 0, 0)
    res[name] = 'ATTACHED' if r == 0 else os.strerror(ctypes.get_errno())
    if r == 0:
        os.waitpid(host, 0x40000000); libc.ptrace(17, host, 0, 0)
try:
    os.kill(host, 0); res['signal'] = 'SENT'
except OSError as e:
    res['signal'] = type(e).__name__
FINAL(json.dumps(res))"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the host runs kernels as itself unless it is root")
def test_security_unprivileged_kernel_cannot_read_host(api, monkeypatch, tmp_path):
    monkeypatch.delenv("RLM_KERNEL_USER", raising=False)
    # a context file only root can read: the kernel still gets its context
    ctx = tmp_path / "private.txt"
    ctx.write_text("secret context " * 4)
    os.chmod(ctx, 0o600)
    from pathlib import Path
    # without the sandbox: the user switch alone must hold (tests/kernel/test_escape.py tries
    # the same from inside the sandbox, where the host's /proc is not even there)
    res, srv = api(script([repl(PROBE.format(host=os.getpid()))], lambda r: "sub-ok"),
                   Path(ctx), sandbox="none")
    assert res.status == "completed", res.reason
    got = json.loads(res.answer)
    from kernels import identity
    assert identity.managed(got["uid"])  # a user of its own (kernels.identity), the default
    assert got["ctx"] == len("secret context " * 4)
    assert got["sub"] == "sub-ok"  # the bridge socket works for the unprivileged kernel
    assert got["nnp"] == "1"
    assert got["environ"] == "PermissionError"
    assert got["mem"] == "PermissionError"
    assert got["attach"] == os.strerror(1) and got["seize"] == os.strerror(1)  # EPERM
    assert got["signal"] == "PermissionError"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a root host")
def test_security_kernel_user_is_configurable(api, monkeypatch):
    import rlm
    monkeypatch.setenv("RLM_KERNEL_USER", "root")  # the opt-out: root kernels
    res, _ = api(script([repl("import os", "FINAL(str(os.getuid()))")]), "ctx")
    assert (res.status, res.answer) == ("completed", "0"), res.reason
    monkeypatch.setenv("RLM_KERNEL_USER", "no-such-user-rlm")
    with pytest.raises(rlm.KernelError) as err:  # exit 4 on the command line
        api(script([repl("FINAL('x')")]), "ctx")
    assert err.value.exit_code == 4
    assert "RLM_KERNEL_USER='no-such-user-rlm': no such user" in str(err.value)


def test_the_first_cell_right_after_start_loses_no_output():
    """A started kernel's IOPub channel is connected when start() returns (the start no longer
    waits for 0.2 s of IOPub silence, but still for one IOPub message): the first cell's output
    and its end arrive, on several fresh kernels."""
    from kernels.kernel import Kernel
    for _ in range(4):
        k = Kernel().start()
        try:
            res, _ = k.execute("print('first', flush=True)\n1 + 1", timeout=20)
            assert not res.timed_out and res.error is None
            assert res.output == "first\n2\n"
        finally:
            k.shutdown()
