"""Many hosts, one PostgreSQL journal: two processes posing as two hosts (``RLM_HOST``, and a
boot id each). Host A runs and is killed by SIGKILL mid-run; host B sees the run crashed once
its heartbeat is stale, resumes it and finishes without re-sending a journaled call; two
resumers racing on one crashed run leave exactly one winner, the other told who won."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psycopg
import pytest
from test_resume import HOST, responder

from scripted_server import ScriptedServer
from harness.journal import Journal
from harness.journal.verify import verify_journal, violation_rate

STALE = 10.0  # the journal's default stale_after: another host must wait this long


def _env(host: str, url: str) -> dict:
    return dict(os.environ, RLM_HOST=host, RLM_BOOT_ID=f"boot-{host}", RLM_JOURNAL=url)


def _held(url: str, run_id: str) -> set[str]:
    with psycopg.connect(url) as c:
        return {f"{run_id}/{r[0]}" for r in c.execute(
            "SELECT call_id FROM model_calls WHERE run_id = %s", (run_id,))}


def _resume(url: str, host: str, run_id: str, base_url: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlm", "resume", run_id, "--journal", url,
                             "--base-url", base_url, "--api-key", "k-resume", "--model", "m",
                             "--quiet"], env=_env(host, url), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _crash_on_host_a(url, tmp_path, srv, state, run_id, kill_at):
    ctx = tmp_path / "context.txt"
    ctx.write_text("".join(f"<section {i:02d}: the quick brown fox {i * 7 % 31}> "
                           for i in range(12)))
    host = tmp_path / "host.py"
    host.write_text(HOST)
    state.update(n=0, kill_at=kill_at, killed=False, after=[])
    proc = subprocess.Popen([sys.executable, str(host), str(ctx), srv.base_url, url, run_id],
                            env=_env("host-a", url), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    state["pid"] = proc.pid
    proc.communicate(timeout=180)
    assert proc.returncode == -signal.SIGKILL
    state["kill_at"] = None
    state["after"] = []


@pytest.fixture
def server():
    state = {"pid": None, "kill_at": None, "n": 0, "after": [], "killed": False}
    lock = threading.Lock()

    def killing(req):
        with lock:
            state["n"] += 1
            if req["_auth"] == "Bearer k-resume":
                # a resumer's request, told apart by its key: a request the killed host had
                # sent (pool_size=2) can reach this handler after the kill
                state["after"].append(req["_call_id"])
            if state["kill_at"] is not None and state["n"] == state["kill_at"] and state["pid"]:
                os.kill(state["pid"], signal.SIGKILL)
                state["killed"] = True
        return responder(req)
    with ScriptedServer(killing) as srv:
        yield srv, state


def test_host_b_resumes_what_host_a_left_and_one_of_two_racers_wins(pg_url, tmp_path, server):
    srv, state = server
    _crash_on_host_a(pg_url, tmp_path, srv, state, "two-hosts", kill_at=12)
    held = _held(pg_url, "two-hosts")
    assert held
    with Journal(pg_url) as j:
        run = j.get_run("two-hosts")
        assert run["owner_host"] == "host-a" and run["state"] == "running"  # not yet stale
    # a live-looking run is refused from host B ...
    early = _resume(pg_url, "host-b", "two-hosts", srv.base_url)
    _out, err = early.communicate(timeout=120)
    assert early.returncode != 0 and "still running" in err, err
    # ... until its heartbeat is stale: then two resumers race (host B and host C)
    time.sleep(max(0.0, run["heartbeat_at"] + STALE + 0.5 - time.time()))
    racers = [_resume(pg_url, h, "two-hosts", srv.base_url) for h in ("host-b", "host-c")]
    outs = [r.communicate(timeout=180) for r in racers]
    codes = [r.returncode for r in racers]
    assert sorted(codes) != [0, 0] and 0 in codes, outs
    loser = outs[codes.index(0) ^ 1][1]
    winner = ("host-b", "host-c")[codes.index(0)]
    assert f"already resumed by {winner}" in loser or "still running" in loser, loser
    resent = [c for c in state["after"] if c in held]
    assert not resent, f"{len(resent)} journaled call(s) were sent again"
    with Journal(pg_url) as j:
        run = j.get_run("two-hosts")
        assert run["status"] == "completed" and run["owner_host"] == winner
        verdicts = verify_journal(j)
    assert violation_rate(verdicts) == 0.0, [v.summary() for v in verdicts]
    r = subprocess.run([sys.executable, "-m", "rlm", "runs", "--journal", pg_url],
                       capture_output=True, text=True, timeout=60, env=_env("host-d", pg_url))
    assert winner in r.stdout, r.stdout


def test_two_hosts_claiming_one_crashed_run_at_once_one_wins(pg_url, monkeypatch):
    """Both hosts read the run as crashed, then claim at the same moment: the database's row
    lock lets one UPDATE through, the other is told which host resumed it."""
    from harness.errors import RunActiveError
    from harness.replay import begin_resume
    monkeypatch.setenv("RLM_HOST", "host-a")
    with Journal(pg_url) as a:
        a.create_run("r", query="q", model="m")
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute("UPDATE runs SET heartbeat_at = %s", (time.time() - 60,))
    hosts = []
    for h in ("host-b", "host-c"):
        monkeypatch.setenv("RLM_HOST", h)
        hosts.append(Journal(pg_url))
    records = [j.get_run("r") for j in hosts]
    assert [r["state"] for r in records] == ["crashed", "crashed"]
    barrier, results = threading.Barrier(2), {}

    def resume(i):
        barrier.wait()
        try:
            results[i] = begin_resume(hosts[i], records[i]) is not None
        except RunActiveError as exc:
            results[i] = str(exc)
    threads = [threading.Thread(target=resume, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wins = [i for i in range(2) if results[i] is True]
    assert len(wins) == 1, results
    winner = ("host-b", "host-c")[wins[0]]
    assert f"already resumed by {winner}" in results[1 - wins[0]]
    assert hosts[0].get_run("r")["owner_host"] == winner
    for j in hosts:
        j.close()


@pytest.mark.parametrize("kill_at", [1, 9, 20])
def test_sigkill_then_resume_on_the_same_host(pg_url, tmp_path, server, kill_at):
    """test_resume's crash test on PostgreSQL: a host killed at a model call is seen crashed at
    once on its own host (its pid is gone), and the resume re-sends no journaled call."""
    srv, state = server
    _crash_on_host_a(pg_url, tmp_path, srv, state, f"crash-{kill_at}", kill_at=kill_at)
    held = _held(pg_url, f"crash-{kill_at}")
    r = _resume(pg_url, "host-a", f"crash-{kill_at}", srv.base_url)
    out, err = r.communicate(timeout=180)
    assert r.returncode == 0, err
    assert out.strip().startswith("sub["), out
    assert not [c for c in state["after"] if c in held]
    assert len(state["after"]) == 25 - len(held)


def test_every_command_works_on_a_postgres_journal(pg_url, cli, scripted, tmp_path):
    """run, runs, show, export, replay and verify with RLM_JOURNAL a PostgreSQL URL."""
    import json
    from conftest import endpoint_args, repl, script
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("the context")
    srv = scripted(script([repl("x = llm_query('hi')"), repl("FINAL(x)")], lambda r: "from-sub"))
    env = {"RLM_JOURNAL": pg_url, "RLM_HOST": "host-a"}
    run = cli("run", "--context", str(ctx), "--query", "q", "--run-id", "pg-1",
              *endpoint_args(srv), env=env)
    assert run.rc == 0 and run.stdout.strip() == "from-sub", run.stderr
    srv.__exit__(None, None, None)  # everything below reads the journal only
    runs = cli("runs", env=env)
    assert "pg-1" in runs.stdout and "host-a" in runs.stdout, runs.stderr
    show = cli("show", "pg-1", env=env)
    assert show.rc == 0 and "model_call" in show.stdout, show.stderr
    out = tmp_path / "pg-1.jsonl"
    assert cli("export", "pg-1", "-o", str(out), env=env).rc == 0
    types = [json.loads(line)["type"] for line in out.read_text().splitlines()]
    assert types[0] == "run" and "event" in types and "model_call" in types and "cell" in types
    replay = cli("replay", "pg-1", env=env)
    assert replay.rc == 0 and replay.stdout.strip() == "from-sub", replay.stderr
    verify = cli("verify", "--all", env=env)
    assert verify.rc == 0 and "violation rate: 0.0000" in verify.stdout, verify.stderr
