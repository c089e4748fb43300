"""The journal survives its database's faults (issue 26, kind 4).

Real faults under a real ``rlm run`` (the CLI in a subprocess, the scripted OpenAI-protocol
server on 127.0.0.1): a PostgreSQL server restarted or stopped with ``pg_ctl`` during the run's
second model turn, a real small tmpfs filled up under a SQLite journal, the journal's write lock
held by another process, the journal file removed, moved away or replaced under the run.

Every fault strikes when the second root turn's request reaches the server, so the host meets it
when it records that reply. A fault that passes within the retry limit leaves a completed run
whose journal holds every call; one that outlasts it ends the run with exit code 9 and one clear
line, and ``rlm resume`` then completes the run, sending only calls the journal did not hold.
In every case each request that reached the server had its reservation in the journal first.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest

import rlm
from conftest import clean_env, is_root, last_user, repl
from harness.journal import Journal, JournalUnavailableError
from rlm.api import resume as resume_run
from scripted_server import ScriptedServer

RUN = "faulty"
CONTEXT = "the context " * 20
ANSWER = "SUB:p0|SUB:after SUB:p0"


# --------------------------------------------------------------------------- the run


class Scripted:
    """The run's model: turn 0 a batch of 4 sub-calls, turn 1 (the second model turn: where
    ``fault`` strikes, once, before the reply is sent) one more sub-call, turn 2 FINAL."""

    def __init__(self, fault=None) -> None:
        self.fault = fault
        self.struck = False
        self.lock = threading.Lock()

    def __call__(self, req: dict):
        if not is_root(req):
            return "SUB:" + last_user(req)
        turn = sum(1 for m in req["messages"] if m["role"] == "assistant")
        if turn == 1:
            with self.lock:
                strike, self.struck = not self.struck and self.fault is not None, True
            if strike:
                self.fault()
        return [repl("a = llm_query_batched(['p%d' % i for i in range(4)])", "print(a)"),
                repl("b = llm_query('after ' + a[0])", "print(b)"),
                repl("FINAL(a[0] + '|' + b)")][min(turn, 2)]


def _rlm(*args: str, journal: str, tmp: Path, timeout: float = 180, **env: str):
    e = clean_env(RLM_JOURNAL=journal, **env)
    return subprocess.run([sys.executable, "-m", "rlm", *args], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=tmp)


def _run(srv: ScriptedServer, journal: str, tmp: Path, **env: str):
    ctx = tmp / "context.txt"
    ctx.write_text(CONTEXT)
    return _rlm("run", "--context", str(ctx), "--query", "q", "--run-id", RUN, "--base-url",
                srv.base_url, "--api-key", "k", "--model", "m", "--quiet", journal=journal,
                tmp=tmp, **env)


def _resume(srv: ScriptedServer, journal: str, tmp: Path):
    return _rlm("resume", RUN, "--base-url", srv.base_url, "--api-key", "k", "--model", "m",
                "--quiet", journal=journal, tmp=tmp)


def _sent(srv: ScriptedServer) -> list[str]:
    with srv._lock:
        return [c.split("/", 1)[1] for c in srv.call_ids if c]


def _held(journal: str) -> tuple[set[str], set[str]]:
    """(the call ids with a recorded reply, the call ids with a reservation) in the journal."""
    with Journal(journal) as j:
        calls = {c["call_id"] for c in j.model_calls(RUN)}
        reserved = {s["call_id"] for s in j.spend(RUN) if s["reserved"] is not None}
    return calls, reserved


def _one_error(res, rc: int, *needles: str) -> str:
    assert res.returncode == rc, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("rlm: error:")]
    assert len(errors) == 1, res.stderr[-2000:]
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


def _assert_whole(srv: ScriptedServer, journal: str, tmp: Path) -> None:
    """A completed run: every request sent once, each reserved first and its reply recorded,
    and the journal's hash chain intact."""
    sent = _sent(srv)
    assert len(sent) == len(set(sent)) == 8, sent  # 3 root turns + 5 sub-calls
    calls, reserved = _held(journal)
    assert set(sent) == calls == reserved, (sent, calls, reserved)
    with Journal(journal) as j:
        assert j.get_run(RUN)["state"] == "completed"
    verify = _rlm("verify", RUN, journal=journal, tmp=tmp)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def _assert_resumes(srv: ScriptedServer, journal: str, tmp: Path, resume=None) -> None:
    """After a run stopped by the journal: every call it sent was reserved first; the resume
    (``rlm resume``, or ``resume()`` returning the answer) completes it and sends none of the
    calls whose reply the journal holds."""
    before = _sent(srv)
    calls, reserved = _held(journal)
    assert set(before) <= reserved, (before, reserved)
    if resume is None:
        resumed = _resume(srv, journal, tmp)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert resumed.stdout.strip() == ANSWER
    else:
        assert resume() == ANSWER
    again = _sent(srv)[len(before):]
    assert not set(again) & calls, (again, calls)
    with Journal(journal) as j:
        assert j.get_run(RUN)["state"] == "completed"


# --------------------------------------------------------------------------- PostgreSQL


@pytest.fixture(scope="module")
def pg_own():
    """A PostgreSQL server of this module's own (these tests restart and stop it)."""
    from evals.pg_server import temporary_server
    try:
        with temporary_server() as url:
            yield url
    except FileNotFoundError as exc:
        pytest.fail(f"{exc} (scripts/test.sh installs it)")


@pytest.fixture
def pg_journal(pg_own, request):
    from evals.pg_server import fresh_schema
    return fresh_schema(pg_own, prefix=request.node.name)


def _pg_ctl(url: str, *args: str) -> None:
    """``pg_ctl ARGS`` on the server of ``url`` (as ``postgres`` when the tests run as root);
    the server's log goes to its own file, never to a pipe of ours."""
    with psycopg.connect(url, autocommit=True) as c:
        data = c.execute("SHOW data_directory").fetchone()[0]
    _pg_ctl_at(data, *args)


def _pg_ctl_at(data: str, *args: str) -> None:
    from evals.pg_server import pg_bin
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    subprocess.run(as_user + [str(pg_bin() / "pg_ctl"), "-D", data, "-l",
                              str(Path(data).parent / "log"), "-w", "-t", "60", *args],
                   check=True, capture_output=True, timeout=90)


def _pg_start_options(data: str) -> str:
    """The server options it was started with (``postmaster.opts``), for ``pg_ctl start``."""
    argv = shlex.split(Path(data, "postmaster.opts").read_text())[1:]
    rest = []
    i = 0
    while i < len(argv):
        if argv[i] == "-D":
            i += 2
            continue
        rest.append(argv[i])
        i += 1
    return shlex.join(rest)


def test_pg_restart_during_the_second_turn_reconnects_and_loses_nothing(pg_journal, tmp_path):
    """The issue's example: ``pg_ctl restart`` while the second model turn is in flight. Before:
    exit 2, "cannot record the reserved spend ... connection is closed", records lost. Now the
    journal reconnects, writes what was queued, and the run completes whole."""
    srv_script = Scripted(lambda: _pg_ctl(pg_journal, "restart", "-m", "fast"))
    with ScriptedServer(srv_script) as srv:
        res = _run(srv, pg_journal, tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.strip() == ANSWER
        assert srv_script.struck
        _assert_whole(srv, pg_journal, tmp_path)


def test_pg_down_past_the_limit_is_exit_9_then_resumes_once_back(pg_journal, tmp_path):
    """The server stops during the second turn and stays down past RLM_JOURNAL_RETRY_SECONDS:
    the run stops as a journal failure (exit 9, never exit 2's bad input), and resumes cleanly
    once the server is back."""
    with psycopg.connect(pg_journal, autocommit=True) as c:
        data = c.execute("SHOW data_directory").fetchone()[0]
    options = _pg_start_options(data)
    with ScriptedServer(Scripted(lambda: _pg_ctl_at(data, "stop", "-m", "fast"))) as srv:
        try:
            t0 = time.monotonic()
            res = _run(srv, pg_journal, tmp_path, RLM_JOURNAL_RETRY_SECONDS="2")
            took = time.monotonic() - t0
        finally:
            _pg_ctl_at(data, "start", "-o", options)
        line = _one_error(res, 9, "unavailable", "rlm resume")
        assert "unreachable" in line and took < 60, (took, line)
        _assert_resumes(srv, pg_journal, tmp_path)


# --------------------------------------------------------------------------- SQLite: a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A real 8 MiB tmpfs (needs root, or CAP_SYS_ADMIN)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (the full-disk tests need root or "
                    f"CAP_SYS_ADMIN): {r.stderr.strip() or 'mount failed'}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(disk: Path) -> Path:
    """Fill ``disk`` up to its last byte with one file; return it (remove it to free)."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 20, 1 << 16, 1 << 12, 1 << 9, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass
    return filler


def test_a_full_disk_under_a_sqlite_journal_is_waited_out(small_disk, tmp_path):
    """The tmpfs holding the journal fills up during the second turn and is freed 2 s later:
    the journal retries, the run completes, nothing is lost. Before: exit 2 ("is full")."""
    journal = str(small_disk / "journal.sqlite3")

    def fill_then_free() -> None:
        filler = _fill(small_disk)
        threading.Timer(2.0, lambda: filler.unlink(missing_ok=True)).start()

    with ScriptedServer(Scripted(fill_then_free)) as srv:
        res = _run(srv, journal, tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.strip() == ANSWER
        assert "is full" in res.stderr and "retrying" in res.stderr  # said so, once, and waited
        _assert_whole(srv, journal, tmp_path)


def test_a_disk_that_stays_full_is_exit_9_then_resumes_once_freed(small_disk, tmp_path):
    journal = str(small_disk / "journal.sqlite3")
    fills: list[Path] = []
    with ScriptedServer(Scripted(lambda: fills.append(_fill(small_disk)))) as srv:
        res = _run(srv, journal, tmp_path, RLM_JOURNAL_RETRY_SECONDS="1.5")
        _one_error(res, 9, "unavailable", "is full", "rlm resume")
        fills[0].unlink()
        _assert_resumes(srv, journal, tmp_path)


# --------------------------------------------------------------------------- SQLite: a lock


def _hold_lock(journal: Path, seconds: float) -> subprocess.Popen:
    """Another process holds the journal's write lock for ``seconds``; returns once it has it."""
    code = ("import sqlite3, sys, time\n"
            "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "c.execute('BEGIN IMMEDIATE')\n"
            "print('locked', flush=True)\n"
            "time.sleep(float(sys.argv[2]))\n"
            "c.execute('ROLLBACK')\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(journal), str(seconds)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def _api_run(srv: ScriptedServer, journal: Journal):
    return rlm.completion(CONTEXT, "q", base_url=srv.base_url, api_key="k",
                          model="m", journal=journal, run_id=RUN)


def test_a_lock_held_past_the_busy_timeout_is_waited_out(tmp_path):
    """Another process holds the write lock for 2 s, ten times the journal's busy timeout:
    the journal retries and the run completes. Before: "stayed locked", the run failed."""
    path = tmp_path / "journal.sqlite3"
    holders: list[subprocess.Popen] = []
    with ScriptedServer(Scripted(lambda: holders.append(_hold_lock(path, 2.0)))) as srv:
        with Journal(path, busy_timeout=0.2, retry_seconds=20) as j:
            res = _api_run(srv, j)
        assert (res.status, res.answer) == ("completed", ANSWER), res.reason
        holders[0].wait(timeout=30)
        _assert_whole(srv, str(path), tmp_path)


def test_a_lock_held_past_the_limit_raises_journal_unavailable_then_resumes(tmp_path):
    path = tmp_path / "journal.sqlite3"
    holders: list[subprocess.Popen] = []
    with ScriptedServer(Scripted(lambda: holders.append(_hold_lock(path, 6.0)))) as srv:
        # stale_after=3: this process lives on, so the run it could not finish counts as
        # crashed once its heartbeat is 3 s old (a CLI run's process is gone: at once)
        with Journal(path, busy_timeout=0.2, retry_seconds=1.0, stale_after=3) as j:
            with pytest.raises(JournalUnavailableError, match="locked") as info:
                _api_run(srv, j)
        assert info.value.exit_code == 9 and rlm.errors.JournalUnavailableError is type(info.value)
        holders[0].wait(timeout=30)

        def resume() -> str:
            time.sleep(3.5)
            with Journal(path, stale_after=3) as again:
                return resume_run(RUN, context=CONTEXT, journal=again, base_url=srv.base_url,
                                  api_key="k", model="m").answer
        _assert_resumes(srv, str(path), tmp_path, resume)


def test_a_lock_never_released_stops_the_run_within_the_limit_and_lets_it_exit(tmp_path):
    """A lock held far longer than the busy timeout and the limit: the first write waits the
    busy timeout (3 s), the retries the limit (1 s) and no longer (each retry's own wait is cut
    to what is left), and closing the journal does not wait on the lock again. Before: each
    retry waited the whole busy timeout, and the run's way out waited for the lock."""
    path = tmp_path / "journal.sqlite3"
    holders: list[subprocess.Popen] = []
    with ScriptedServer(Scripted(lambda: holders.append(_hold_lock(path, 60.0)))) as srv:
        t0 = time.monotonic()
        try:
            with Journal(path, busy_timeout=3.0, retry_seconds=1.0) as j:
                with pytest.raises(JournalUnavailableError, match="locked"):
                    _api_run(srv, j)
                stopped = time.monotonic() - t0
            closed = time.monotonic() - t0
        finally:
            for h in holders:
                h.kill()
                h.wait(timeout=30)
    assert stopped < 10, f"the run stopped {stopped:.1f} s after it began"
    assert closed - stopped < 3, f"closing took {closed - stopped:.1f} s more"


# --------------------------------------------------------------------------- SQLite: the file


def _remove(journal: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{journal}{suffix}").unlink(missing_ok=True)


@pytest.mark.parametrize("how", ["removed", "moved"])
def test_a_journal_file_removed_under_the_run_is_restored_whole(tmp_path, how):
    """``rm journal.sqlite3*`` (or ``mv`` of the file alone) during the second turn: the
    journal is restored at its path from the open connection and the run completes with every
    record there. Before: the run wrote on into the unlinked file and its journal was gone."""
    path = tmp_path / "journal.sqlite3"
    fault = (lambda: _remove(path)) if how == "removed" else \
        (lambda: os.rename(path, tmp_path / "moved.sqlite3"))
    with ScriptedServer(Scripted(fault)) as srv:
        res = _run(srv, str(path), tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.strip() == ANSWER
        assert "restored" in res.stderr
        _assert_whole(srv, str(path), tmp_path)
        replay = _rlm("replay", RUN, "--quiet", journal=str(path), tmp=tmp_path)
        assert replay.returncode == 0 and replay.stdout.strip() == ANSWER, replay.stderr
        assert len(_sent(srv)) == 8  # the replay sent nothing


def test_a_journal_file_replaced_under_the_run_is_saved_aside_and_resumes(tmp_path):
    """Another journal is put at the path during the run: nothing of this run is written
    into it; this process's copy is saved beside it (exit 9, naming the copy), and once put
    back the run resumes."""
    path = tmp_path / "journal.sqlite3"
    other = tmp_path / "other.sqlite3"
    Journal(other).close()

    def replace() -> None:
        _remove(path)
        shutil.copy(other, path)

    with ScriptedServer(Scripted(replace)) as srv:
        res = _run(srv, str(path), tmp_path)
        line = _one_error(res, 9, "replaced", "saved as")
        saved = Path(line.split("saved as ", 1)[1].split(". ", 1)[0].rstrip("."))
        assert saved.is_file(), line
        with Journal(path) as j:  # the file put there is left as it was
            assert j.get_run(RUN) is None
        os.replace(saved, path)
        for suffix in ("-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        _assert_resumes(srv, str(path), tmp_path)
