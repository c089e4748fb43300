"""A reply the run received is in the journal before the kernel sees it (issue 26, kind 10).

A real ``rlm run`` process (the CLI), the scripted OpenAI-protocol server on 127.0.0.1 in this
process counting every request by its ``X-RLM-Call-Id``, SIGKILL, then ``rlm resume``:

- killed by the kernel itself the moment it holds replies (a root turn's reply, an
  ``llm_query``'s, a batch of 8 at concurrency 8): the resume sends none of them again;
- killed with three calls of a batch in flight (the issue's example: two batches of 8 at
  concurrency 8): the resume sends exactly those three again, and the calls never sent;
- the journal's write lock held by another process while a reply arrives: the kernel does not
  get the reply until the journal has it, and then a second connection sees it.
"""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import clean_env, is_root, last_user, repl
from scripted_server import ScriptedServer

RUN = "durable"


@pytest.fixture
def shared():
    """A directory the kernel may write (kernels run unsandboxed here: ``--sandbox none``;
    under a root host as an unprivileged user unless told otherwise)."""
    d = Path(tempfile.mkdtemp(prefix="rlm-durable-"))
    d.chmod(0o777)
    yield d
    for f in d.iterdir():
        f.unlink()
    d.rmdir()


def _start(srv: ScriptedServer, journal: Path, tmp: Path, *args: str) -> subprocess.Popen:
    ctx = tmp / "context.txt"
    ctx.write_text("the context " * 20)
    cmd = [sys.executable, "-m", "rlm", *args, "--base-url", srv.base_url, "--api-key", "k",
           "--model", "m", "--quiet", "--sandbox", "none"]
    if args[0] == "run":  # a resume runs with the recorded settings
        cmd[4:4] = ["--context", str(ctx), "--query", "q", "--run-id", RUN, "--concurrency",
                    "8"]
    # RLM_KERNEL_USER=root: under a root host the kernel may signal the host (the kill below)
    env = clean_env(RLM_JOURNAL=str(journal), RLM_KERNEL_USER="root")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp)


def _sent(srv: ScriptedServer) -> list[str]:
    with srv._lock:
        return [c.split("/", 1)[1] for c in srv.call_ids if c]


def _held(journal: Path) -> set[str]:
    con = sqlite3.connect(f"file:{journal}?mode=ro", uri=True)
    try:
        return {c for (c,) in con.execute("SELECT call_id FROM model_calls WHERE run_id = ?",
                                          (RUN,))}
    finally:
        con.close()


def _turn(req: dict) -> int:
    return sum(1 for m in req["messages"] if m["role"] == "assistant")


# --------------------------------------------------------------------------- killed by the kernel

#: What the first cell does before the kernel kills the host: the replies it then holds.
BEFORE_KILL = {
    "root reply": ["pass"],
    "llm_query": ["r = llm_query('solo')"],
    "batch of 8": ["r = llm_query_batched(['item-%d' % i for i in range(8)])"],
}


@pytest.mark.parametrize("holding", list(BEFORE_KILL))
def test_sigkill_right_after_the_kernel_got_replies_sends_none_of_them_again(
        holding, shared, tmp_path):
    """The first cell gets its replies, then SIGKILLs the host at once (once: it removes the
    arming file first). Every reply the kernel held was in the journal: the resume sends only
    the next turn's call, which no one had sent. Before: the replies were written behind, so
    the kill lost them and the resume paid for them again."""
    arm = shared / "arm"
    arm.write_text("")
    state: dict = {"pid": None}

    def responder(req):
        if not is_root(req):
            return "ECHO:" + last_user(req)
        if _turn(req) == 0:
            return repl(*BEFORE_KILL[holding], "import os, signal",
                        f"if os.path.exists({str(arm)!r}):",
                        f"    os.remove({str(arm)!r})",
                        f"    os.kill({state['pid']}, signal.SIGKILL)")
        return repl("FINAL('done')")

    journal = tmp_path / "j.sqlite3"
    with ScriptedServer(responder) as srv:
        p = _start(srv, journal, tmp_path, "run")
        state["pid"] = p.pid
        out, err = p.communicate(timeout=180)
        assert p.returncode == -signal.SIGKILL, (p.returncode, err[-2000:])
        assert not arm.exists()
        received = _sent(srv)  # each was answered, and the kernel had the answers
        held = _held(journal)
        assert set(received) <= held, sorted(set(received) - held)
        p = _start(srv, journal, tmp_path, "resume", RUN)
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0 and out.strip() == "done", err[-2000:]
        again = _sent(srv)[len(received):]
        assert again == ["run/iteration-1/model_call-0"], again


# --------------------------------------------------------------------------- killed mid-batch


def test_sigkill_mid_batch_resends_only_the_calls_in_flight(tmp_path):
    """The issue's example: two batches of 8 ``llm_query`` calls at concurrency 8, SIGKILL while
    three calls of the second batch are in flight (their replies held back by the server).
    The resume sends those three again, then the next turn; none of the 13 answered calls."""
    hold = threading.Event()
    killed = threading.Event()
    lock = threading.Lock()
    waiting: list[str] = []

    def responder(req):
        if not is_root(req):
            prompt = last_user(req)
            if prompt in ("b-5", "b-6", "b-7") and not killed.is_set():
                with lock:
                    waiting.append(req["_call_id"])
                hold.wait(60)  # in flight until the host is dead
            return "ECHO:" + prompt
        if _turn(req) == 0:
            return repl("a = llm_query_batched(['a-%d' % i for i in range(8)])",
                        "b = llm_query_batched(['b-%d' % i for i in range(8)])")
        return repl("FINAL('|'.join(a + b))")

    journal = tmp_path / "j.sqlite3"
    with ScriptedServer(responder) as srv:
        p = _start(srv, journal, tmp_path, "run")
        deadline = time.monotonic() + 120
        while len(_sent(srv)) < 17 or len(waiting) < 3:  # 1 root turn + 16 sub-calls
            assert time.monotonic() < deadline and p.poll() is None, p.poll()
            time.sleep(0.02)
        time.sleep(0.5)  # the 13 answered replies have long arrived
        os.kill(p.pid, signal.SIGKILL)
        p.communicate(timeout=60)
        killed.set()
        hold.set()
        received = _sent(srv)
        in_flight = {c.split("/", 1)[1] for c in waiting}
        answered = set(received) - in_flight
        assert len(answered) == 14 and answered <= _held(journal)  # 13 sub-calls + turn 0
        p = _start(srv, journal, tmp_path, "resume", RUN)
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-2000:]
        assert out.strip() == "|".join(f"ECHO:{x}-{i}" for x in "ab" for i in range(8))
        again = _sent(srv)[len(received):]
        assert sorted(again) == sorted(in_flight | {"run/iteration-1/model_call-0"}), again


# --------------------------------------------------------------------------- durable first


def test_the_kernel_gets_a_reply_only_once_a_second_connection_sees_it(shared, tmp_path):
    """Another process holds the journal's write lock while an ``llm_query`` reply arrives.
    The kernel (which writes a file the moment it has the reply) does not get it while the
    journal cannot record it; once the lock is released it does, and the reply is then visible
    to a second connection. Before: the kernel had it at once, with the journal locked."""
    mark = shared / "got-it"
    journal = tmp_path / "j.sqlite3"
    locker: list[subprocess.Popen] = []
    replied = threading.Event()
    code = ("import sqlite3, sys\n"
            "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "c.execute('BEGIN IMMEDIATE')\n"
            "print('locked', flush=True)\n"
            "sys.stdin.read()\n"
            "c.execute('ROLLBACK')\n")

    def responder(req):
        if not is_root(req):
            p = subprocess.Popen([sys.executable, "-c", code, str(journal)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert p.stdout.readline().strip() == "locked"
            locker.append(p)
            replied.set()
            return "ECHO:" + last_user(req)
        if _turn(req) == 0:
            return repl("r = llm_query('probe')", f"open({str(mark)!r}, 'w').write(r)")
        return repl("FINAL(r)")

    with ScriptedServer(responder) as srv:
        p = _start(srv, journal, tmp_path, "run")
        try:
            assert replied.wait(120), "the sub-call never came"
            time.sleep(2.0)  # the reply has arrived at the host; the journal is locked
            assert not mark.exists(), "the kernel got a reply the journal did not hold"
        finally:
            if locker:
                locker[0].stdin.close()  # release the lock
                locker[0].wait(30)
        deadline = time.monotonic() + 60
        while not mark.exists():
            assert time.monotonic() < deadline and p.poll() is None, p.poll()
            time.sleep(0.005)
        con = sqlite3.connect(f"file:{journal}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT response FROM model_calls WHERE run_id = ? AND call_id "
                               "LIKE '%llm_query-0/model_call-0'", (RUN,)).fetchall()
        finally:
            con.close()
        assert len(rows) == 1 and "ECHO:probe" in rows[0][0], rows
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == "ECHO:probe", err[-2000:]


# --------------------------------------------------------------------------- group commit


def test_concurrent_replies_share_a_commit(tmp_path):
    """Eight replies recorded at once (a batch's), each durable before its call returns, share
    the journal's commits: while another process holds the write lock they queue up, and once
    it is released they go in two commits (the one that was waiting, and one for the rest), not
    eight. Before: one commit each."""
    from harness.journal import Journal, request_hash
    path = tmp_path / "j.sqlite3"
    commits: list[int] = []
    with Journal(path, busy_timeout=10) as j:
        j.create_run(RUN, query="q", model="m")
        real = j._commit

        def counted(items, action):  # counts the transactions, changes nothing
            commits.append(len(items))
            return real(items, action)
        j._commit = counted  # type: ignore[method-assign]
        blocker = sqlite3.connect(str(path), isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        done: list[bool] = []

        def reply(i: int) -> None:
            req = {"model": "m", "messages": [{"role": "user", "content": f"item-{i}"}]}
            done.append(j.record_model_call(RUN, f"it/llm_query-{i}/model_call-0",
                                            request_hash=request_hash(req), request=req,
                                            response={"text": f"ECHO:item-{i}"}, usage={},
                                            attempts=[]))
        threads = [threading.Thread(target=reply, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        assert not done  # none returned: none is committed yet
        blocker.execute("ROLLBACK")
        blocker.close()
        for t in threads:
            t.join(30)
        assert done == [True] * 8
        assert len(commits) <= 2 and sum(commits) == 8, commits
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:  # every reply is visible to a second connection
            assert con.execute("SELECT count(*) FROM model_calls").fetchone()[0] == 8
        finally:
            con.close()
