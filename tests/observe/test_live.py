"""The live view: plain progress lines off a terminal, nothing with -q, the rich panel on a
terminal (driven through tmux), and following a run from another process (`rlm show --follow`,
`rlm runs --watch`). Real CLI processes, real kernels, a scripted server on 127.0.0.1.
"""
from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import API_KEY, MODEL, REPO, clean_env
import trajectory_run as tr
from scripted_server import ScriptedServer

from harness.journal import Journal


def _rlm(*args: str, journal: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlm", *args], cwd=journal.parent,
                            env=clean_env(RLM_JOURNAL=str(journal)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _run_args(srv: ScriptedServer, ctx: Path, *extra: str) -> list[str]:
    return ["run", "--context", str(ctx), "--query", tr.QUERY, "--base-url", srv.base_url,
            "--api-key", API_KEY, "--model", MODEL, "--max-depth", "2", "--cell-timeout", "1.5",
            "--max-calls", "40", *extra]


def _wait_for_run(journal: Path, run_id: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if journal.exists():
            with Journal(journal) as j:
                if j.get_run(run_id) is not None:
                    return
        time.sleep(0.05)
    raise AssertionError(f"run {run_id} never appeared in {journal}")


def test_plain_lines_while_following_from_other_processes(tmp_path):
    journal = tmp_path / "j.sqlite3"
    ctx = tmp_path / "ctx.txt"
    ctx.write_text(tr.CONTEXT, encoding="utf-8")
    # a slow endpoint, so the run is still going when the followers start
    with ScriptedServer(tr.slow_responder(0.4)) as srv:
        run = _rlm(*_run_args(srv, ctx, "--run-id", "live-1"), journal=journal)
        _wait_for_run(journal, "live-1")
        follow = _rlm("show", "live-1", "--follow", "--interval", "0.1", journal=journal)
        watch = _rlm("runs", "--watch", "--interval", "0.2", journal=journal)
        out, err = run.communicate(timeout=90)
        f_out, f_err = follow.communicate(timeout=30)
        time.sleep(0.5)  # one more refresh of the watcher after the end
        watch.send_signal(signal.SIGINT)
        w_out, w_err = watch.communicate(timeout=30)
    assert run.returncode == 0, err
    assert out.strip() == tr.ANSWER

    # the run's own stderr is not a terminal: plain lines only, no escape codes
    lines = err.splitlines()
    assert lines and all(ln.startswith("[rlm] ") for ln in lines), err
    assert "\x1b" not in err
    assert any(re.match(r"\[rlm\] L0 cell run/iteration-1/cell-0 failed \(timed out\) in \d", ln)
               for ln in lines), err
    assert any(ln.startswith("[rlm] L1 child run/iteration-2/cell-0/child-1 failed in ")
               for ln in lines), err
    # the child's reason is said once: on the line of its model call, where it began (not
    # again on its iteration's and its own, which failed with it)
    assert err.count("HTTP 400") == 1 and any(
        ln.startswith("[rlm] L1 model_call run/iteration-2/cell-0/child-1/") and "HTTP 400" in ln
        for ln in lines), err
    assert any(ln.startswith("[rlm] L1 child run/iteration-2/cell-0/child-0 completed")
               for ln in lines), err
    so_far = [ln for ln in lines if ln.startswith("[rlm] L0 iteration run/iteration-3 completed")]
    assert len(so_far) == 1 and "so far 11 calls" in so_far[0], err
    assert lines[-1].startswith("[rlm] run live-1: completed")

    # `rlm show --follow` saw the same stage ends from the journal and stopped at the end
    assert follow.returncode == 0, f_err
    assert "\x1b" not in f_err
    assert "[rlm] L1 child run/iteration-2/cell-0/child-1 failed" in f_err
    assert "[rlm] L0 cell run/iteration-1/cell-0 failed (timed out)" in f_err
    assert "state=completed" in f_out and f"answer: {tr.ANSWER}" in f_out
    assert "child-1 [child] failed L1" in f_out

    # `rlm runs --watch` refreshed the list (running, then completed) until Ctrl-C
    assert watch.returncode == 0, w_err
    states = re.findall(r"live-1\s+\S+ \S+\s+(\w+)", w_out)
    assert states[0] == "running" and states[-1] == "completed", w_out


def test_quiet_prints_nothing_on_stderr(tmp_path):
    journal = tmp_path / "j.sqlite3"
    ctx = tmp_path / "ctx.txt"
    ctx.write_text(tr.CONTEXT, encoding="utf-8")
    with ScriptedServer(tr.responder) as srv:
        p = _rlm(*_run_args(srv, ctx, "-q"), journal=journal)
        out, err = p.communicate(timeout=90)
    assert p.returncode == 0
    assert err == ""
    assert out.strip() == tr.ANSWER


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_terminal_shows_the_live_panel(tmp_path):
    """On a terminal (a tmux pane), the rich panel shows active stages and usage vs caps while
    the run goes, and is gone at the end (the answer and summary stay)."""
    journal = tmp_path / "j.sqlite3"
    ctx = tmp_path / "ctx.txt"
    ctx.write_text(tr.CONTEXT, encoding="utf-8")
    sock = str(tmp_path / "tmux.sock")
    session = "rlmlive"
    with ScriptedServer(tr.slow_responder(0.3)) as srv:
        env = clean_env(RLM_JOURNAL=str(journal), TERM="xterm-256color", COLUMNS="150")
        cmd = " ".join([sys.executable, "-m", "rlm", *[f"'{a}'" for a in _run_args(srv, ctx)],
                        f"; echo RC=$? > {tmp_path / 'rc'}; sleep 30"])
        subprocess.run(["tmux", "-S", sock, "new-session", "-d", "-s", session, "-x", "150",
                        "-y", "45", "-c", str(REPO), "env",
                        *[f"{k}={v}" for k, v in env.items() if k in (
                            "PYTHONPATH", "RLM_JOURNAL", "TERM", "PATH", "HOME")],
                        "bash", "-c", cmd], check=True)
        try:
            seen, panes = "", []
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (tmp_path / "rc").exists():
                pane = subprocess.run(["tmux", "-S", sock, "capture-pane", "-p", "-t", session],
                                      capture_output=True, text=True).stdout
                panes.append(pane)
                if not seen and re.search(r"run running · run · L0 · \d+\.\d s", pane):
                    seen = pane
                time.sleep(0.2)
            final = subprocess.run(["tmux", "-S", sock, "capture-pane", "-p", "-t", session],
                                   capture_output=True, text=True).stdout
        finally:
            subprocess.run(["tmux", "-S", sock, "kill-server"], capture_output=True)
    assert (tmp_path / "rc").read_text().strip() == "RC=0", final
    assert seen, "\n----\n".join(panes[-3:])
    # the active stages as a tree, with what each is doing and for how long
    assert re.search(r"model_call-0 running · waiting for the model m · L0 · \d+\.\d s", seen), seen
    assert re.search(r"calls \d+ / 40 +\d+%", seen), seen  # usage against the cap
    assert re.search(r"\d+\.\d s elapsed · \d+ stages · \d+ active", seen), seen
    assert tr.ANSWER in final and "active stages" not in final  # the panel is gone at the end


def test_a_cell_line_says_why_the_cell_stopped():
    from rlm.observe.live import plain_line
    base = {"kind": "cell", "id": "0.c1", "level": 1, "status": "cancelled",
            "started_at": 1.0, "ended_at": 2.5}
    interrupted = plain_line(dict(base, evidence={"timed_out": False, "interrupted": True}))
    assert interrupted.startswith("L1 cell 0.c1 cancelled (interrupted) in 1.50 s"), interrupted
    assert "timed out" not in interrupted
    timed_out = plain_line(dict(base, status="failed", error="KeyboardInterrupt: ",
                                evidence={"timed_out": True, "interrupted": False}))
    assert "failed (timed out)" in timed_out, timed_out


def test_the_live_runs_table_shows_queries_as_text(tmp_path):
    """`rlm runs --watch`: a query holding rich markup or escape sequences is shown as the
    text it is (markup not applied, control characters escaped)."""
    import io

    from rich.console import Console

    from rlm.observe.live import _runs_table
    with Journal(tmp_path / "j.sqlite3") as j:
        j.create_run("markup-1", query="[bold red]x[/] \x1b[2J y", model="m[/]")
        out = io.StringIO()
        Console(file=out, width=200, color_system=None).print(_runs_table(j, 5))
    text = out.getvalue()
    assert "\x1b" not in text
    assert "m[/] / [bold red]x[/] \\x1b[2J y" in text


def _screen(raw: str) -> list[str]:
    """What a terminal shows after ``raw``: enough of one (text, CR, LF, cursor up, erase
    line) for what rich's live display writes."""
    lines, row, col = [""], 0, 0
    for tok in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\r|\n|[^\x1b\r\n]+", raw):
        if tok == "\n":
            row, col = row + 1, 0
            if row == len(lines):
                lines.append("")
        elif tok == "\r":
            col = 0
        elif tok.endswith("A"):
            row = max(0, row - int(tok[2:-1] or 1))
        elif tok.endswith("K"):
            lines[row] = ""
        elif not tok.startswith("\x1b["):
            cur = lines[row].ljust(col)
            lines[row] = cur[:col] + tok + cur[col + len(tok):]
            col += len(tok)
    return lines


def test_lines_printed_from_many_threads_leave_no_stale_panel():
    """Progress lines from the threads of a fan-out, while the panel redraws from its own
    thread and changes height, never leave a copy of the panel behind
    (a race inside rich's Live did, about one run in three of this size)."""
    import io
    import threading
    from rich.console import Console
    from rlm.observe.live import _Rich

    def stage(sid, status):
        return {"event": "transition", "run_id": "r", "stage": {
            "id": sid, "kind": "cell", "status": status, "parent_id": "run",
            "started_at": time.time()}}

    for _ in range(3):
        buf = io.StringIO()
        display = _Rich(buf, {"max_calls": 40})
        display.console = Console(file=buf, force_terminal=True, width=150, height=45)
        with display:
            display.listener({"event": "transition", "run_id": "r", "stage": {
                "id": "run", "kind": "run", "status": "running", "started_at": time.time()}})

            def worker(k):
                for i in range(150):
                    display.listener(stage(f"run/c-{k}-{i}", "running"))
                    display.progress(f"worker {k} line {i}")
                    display.listener(stage(f"run/c-{k}-{i}", "completed"))

            threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        screen = _screen(buf.getvalue())
        stale = [line for line in screen if "active stages" in line or "running ·" in line]
        assert stale == [], stale
        assert sum(line.startswith("[rlm] worker") for line in screen) == 900
