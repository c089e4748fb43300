"""A stop signal always stops the run: SIGINT, SIGTERM and SIGHUP, each at several points (the
CLI starting up, the root's model call in flight, a cell running, a child's model call in
flight, between journal commits of a fast run, the run's end), end `rlm run` soon after with
exit 130 and the run journaled `cancelled`, leaving no kernel process and no temporary directory.

The command is started the way a runner under nohup (or a background job) starts it: SIGHUP and
SIGINT inherited as ignored. Before, a SIGHUP so inherited stayed ignored, and the run waited for
its 30 s reply and ended "completed" with exit 0.
"""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from conftest import API_KEY, MODEL, clean_env, repl
from scripted_server import Reply, ScriptedServer

from harness.journal import Journal

SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
LIMIT = 12.0  # seconds from the signal to the exit: the call's cancel grace and the clean-up


def _responder(req):
    msgs = req["messages"]
    if msgs[0]["role"] != "system":
        return "sub"
    task = msgs[1]["content"]
    turn = sum(1 for m in msgs if m["role"] == "assistant")
    if "CHILDQ" in task:  # the child's own model call: long
        return Reply(repl("FINAL('child')"), delay=30.0)
    if "INFLIGHT" in task or "STARTUP" in task:
        return Reply(repl("FINAL('late')"), delay=30.0)
    if "CELL" in task:
        return repl("import time", "print('cell started', flush=True)", "time.sleep(30)")
    if "CHILD" in task:
        return repl("x = rlm('a context for the child', 'CHILDQ: say child')", "FINAL(x)")
    if "COMMIT" in task:  # many short turns: a journal commit every few milliseconds
        return repl(f"x = {turn}", "print(x)") if turn < 40 else repl("FINAL(str(x))")
    return repl("FINAL('done')")


@pytest.fixture(scope="module")
def server():
    with ScriptedServer(_responder) as srv:
        yield srv


def _ignore_stops() -> None:  # as nohup or a background job leaves them
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _leftovers(pid: int) -> list:
    tmp = tempfile.gettempdir()
    dirs = glob.glob(os.path.join(tmp, f"rlm-bridge-{pid}-*")) + \
        glob.glob(os.path.join(tmp, f"rlm-k-{pid}-*"))
    procs = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and \
                    p.environ().get("JPY_PARENT_PID") == str(pid):
                procs.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return dirs + procs


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` yet (``SigCgt`` in /proc): before
    that, the interpreter is still starting and a signal inherited as ignored is dropped by
    the kernel, before any code of ours could see it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(ln for ln in f if ln.startswith("SigCgt:")).split()[1]
    except (OSError, StopIteration):
        return False
    return bool(int(caught, 16) >> (sig - 1) & 1)


def _wait(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "the run never reached the point"
        time.sleep(0.02)


# point -> (query, when to signal: a function of (server, count before, process) that waits)
POINTS = {
    # from the first instant the CLI's code runs (its imports), then 0.25 s and 0.5 s later
    "starting-up": ("STARTUP", lambda srv, n0, p, k: (
        _wait(lambda: _catches(p.pid, signal.SIGHUP)), time.sleep(0.25 * k))),
    "call-in-flight": ("INFLIGHT", lambda srv, n0, p, k: _wait(lambda: srv.count > n0)),
    "cell": ("CELL", lambda srv, n0, p, k: (_wait(lambda: srv.count > n0), time.sleep(0.8))),
    "child": ("CHILD", lambda srv, n0, p, k: _wait(lambda: srv.count > n0 + 1)),
    "journal-commits": ("COMMIT", lambda srv, n0, p, k: _wait(lambda: srv.count > n0 + 3 + 4 * k)),
    "the-end": ("END", lambda srv, n0, p, k: (_wait(lambda: srv.count > n0),
                                               time.sleep(0.05 * k))),
}


@pytest.mark.parametrize("sig", SIGNALS, ids=[s.name for s in SIGNALS])
@pytest.mark.parametrize("point", list(POINTS))
def test_a_stop_signal_at_any_point_cancels_the_run_and_leaves_nothing(server, tmp_path, point,
                                                                        sig):
    query, reach = POINTS[point]
    k = SIGNALS.index(sig)  # a different moment for each signal
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("a context")
    journal = tmp_path / "j.sqlite3"
    n0 = server.count
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlm", "run", "--context", str(ctx), "--query", query,
         "--run-id", "stopped", "--base-url", server.base_url, "--api-key", API_KEY,
         "--model", MODEL, "--max-depth", "2", "--max-iterations", "50"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=clean_env(RLM_JOURNAL=str(journal)), preexec_fn=_ignore_stops)
    try:
        reach(server, n0, proc, k)
        sent = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    state = None
    if journal.exists():
        with Journal(journal) as j:
            rec = j.get_run("stopped")
            state = rec and rec["state"]
    if point == "the-end" and proc.returncode == 0:  # it had finished before the signal
        assert state == "completed" and out.strip() == "done", (state, err)
    else:
        assert proc.returncode == 130, (proc.returncode, err[-3000:])
        assert "Traceback" not in err, err
        # a run that had begun is journaled cancelled (one stopped while the CLI was still
        # being imported has no record yet)
        assert state == "cancelled" or (point == "starting-up" and state is None), (state, err)
    assert took < LIMIT, (took, err)
    assert not _leftovers(proc.pid), _leftovers(proc.pid)
