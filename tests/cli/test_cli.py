"""The ``rlm`` command line, run as a real subprocess against a scripted endpoint:
exit codes, ``--json``, help text, an endpoint that is down, the journal round trip
(run twice, replay, show, runs, export)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import (API_KEY, MODEL, Reply, assert_clean_error, clean_env, closed_port,
                      endpoint_args, last_user, repl, script)


@pytest.fixture
def ctx_file(tmp_path):
    p = tmp_path / "doc.txt"
    p.write_text("The vault code is 4417. " * 20 + "Nothing else matters.\n")
    return p


# --------------------------------------------------------------------------- 11. help, --json


def test_help_mentions_exit_codes(cli):
    for args in (["--help"], ["run", "--help"]):
        res = cli(*args)
        assert res.rc == 0
        out = res.stdout
        assert "exit codes" in out
        for code, word in (("2", "bad input"), ("3", "endpoint"), ("5", "budget"), ("7", "without an answer")):
            assert any(line.strip().startswith(code) and word in line for line in out.splitlines()), \
                (args, code)


def test_no_command_prints_help_and_exits_2(cli):
    res = cli()
    assert res.rc == 2 and "COMMAND" in res.stdout


def test_bad_flag_value_exits_2(cli, ctx_file):
    res = cli("run", "--context", str(ctx_file), "--max-iterations", "many")
    assert res.rc == 2 and "Traceback" not in res.stderr and "invalid int" in res.stderr


def test_json_output(cli, scripted, ctx_file):
    srv = scripted(script([repl("code = context.split()[4].rstrip('.')", "print(code)"),
                           repl("FINAL(code)")]))
    res = cli("run", "--context", str(ctx_file), "--query", "What is the vault code?", "--json",
              "--run-id", "json-run", *endpoint_args(srv))
    assert res.rc == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1
    obj = json.loads(lines[0])
    assert obj["answer"] == "4417"
    assert obj["status"] == "completed"
    assert obj["run_id"] == "json-run"
    assert obj["iterations"] == 2
    u = obj["usage"]
    assert u["prompt_tokens"] == sum(x["prompt_tokens"] for x in srv.usages)
    assert u["completion_tokens"] == sum(x["completion_tokens"] for x in srv.usages)
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert u["calls"] == srv.count == 2


def test_plain_output_is_the_answer_alone(cli, scripted, ctx_file):
    srv = scripted(script([repl("FINAL('just this')")]))
    res = cli("run", "--context", str(ctx_file), "--query", "q", "--no-journal", *endpoint_args(srv))
    assert res.rc == 0, res.stderr
    assert res.stdout == "just this\n"
    assert "completed" in res.stderr  # the summary goes to stderr


def test_model_name_is_required_with_an_endpoint(cli, scripted, ctx_file):
    srv = scripted(script([]))
    res = cli("run", "--context", str(ctx_file), "--base-url", srv.base_url, "--no-journal")
    assert_clean_error(res, 2, "--model")
    assert srv.count == 0


def test_endpoint_settings_from_the_environment(cli, scripted, ctx_file):
    srv = scripted(script([repl("FINAL('via env')")]))
    res = cli("run", "--context", str(ctx_file), "--no-journal", "-q",
              env={"OPENAI_BASE_URL": srv.base_url, "OPENAI_API_KEY": API_KEY, "RLM_MODEL": "env-m"})
    assert res.rc == 0, res.stderr
    assert res.stdout.strip() == "via env"
    assert srv.requests[0]["model"] == "env-m"


# --------------------------------------------------------------------------- 8. endpoint down


def test_endpoint_down_exits_3(cli, ctx_file):
    url = f"http://127.0.0.1:{closed_port()}/v1"
    res = cli("run", "--context", str(ctx_file), "--query", "q", "--base-url", url,
              "--api-key", API_KEY, "--model", MODEL, timeout=120)
    assert_clean_error(res, 3, "unreachable", url.replace(".", r"\."))
    assert res.stdout == ""
    assert res.seconds < 60, f"an unreachable endpoint took {res.seconds:.1f} s to report"


def test_http_401_exits_3_at_once(cli, scripted, ctx_file):
    srv = scripted(lambda req: Reply(status=401, content="invalid api key"))
    res = cli("run", "--context", str(ctx_file), "--query", "q", "--no-journal", *endpoint_args(srv))
    assert_clean_error(res, 3, "HTTP 401", "api-key")
    assert srv.count == 1


# --------------------------------------------------------------------------- 12. no FINAL: exit 7


def test_no_final_exits_7(cli, scripted, ctx_file):
    srv = scripted(script([repl("print('thinking')")] * 3))
    res = cli("run", "--context", str(ctx_file), "--query", "q", "--max-iterations", "2",
              "--no-journal", *endpoint_args(srv))
    assert res.rc == 7, res.stderr
    assert res.stdout == ""
    assert "ended without an answer" in res.stderr and "Traceback" not in res.stderr
    assert srv.count == 3
    assert "last turn" in last_user(srv.requests[-1])


def test_budget_cap_exits_5(cli, scripted, ctx_file):
    srv = scripted(script([repl("print(1)")] * 5))
    res = cli("run", "--context", str(ctx_file), "--query", "q", "--max-calls", "2", "--no-journal",
              *endpoint_args(srv))
    assert res.rc == 5, res.stderr
    assert "calls" in res.stderr and "Traceback" not in res.stderr
    assert srv.count == 2  # the refused call was never sent


# --------------------------------------------------------------------------- 10. the key, CLI side


def test_kernel_cannot_read_the_key_from_the_host_process(cli, scripted, ctx_file):
    """The host holds the key; its kernel must not be able to read it, from its own
    environment or from the environment of the host process that started it."""
    secret = "sk-cli-secret-31337"
    code = repl("import os",
                "print('OWN', dict(os.environ))",
                "try:",
                "    print('PARENT', open(f'/proc/{os.getppid()}/environ', 'rb').read())",
                "except OSError as e:",
                "    print('PARENT unreadable', e)")
    srv = scripted(script([code, repl("FINAL('ok')")]))
    res = cli("run", "--context", str(ctx_file), "--query", "q", "--no-journal", "--model", MODEL,
              env={"OPENAI_BASE_URL": srv.base_url, "OPENAI_API_KEY": secret})
    assert res.rc == 0, res.stderr
    shown = last_user(srv.requests[1])
    assert "OWN" in shown and "PARENT" in shown
    assert secret not in shown


# --------------------------------------------------------------------------- 15. the journal round trip


def test_journal_round_trip(cli, scripted, ctx_file):
    replies = [repl("pos = context.find('vault')", "print('POS', pos)"),
               repl("ans = llm_query('What is the code? ' + context[pos:pos + 30])"),
               repl("FINAL(ans.strip())")]
    srv = scripted(script(replies, lambda req: " 4417 "))
    args = ["run", "--context", str(ctx_file), "--query", "What is the vault code?",
            "--run-id", "trip-1", *endpoint_args(srv)]

    first = cli(*args)
    assert first.rc == 0, first.stderr
    assert first.stdout.strip() == "4417"
    sent = srv.count
    assert sent == 4

    # the same run id again: the recorded answer, no new request
    again = cli(*args)
    assert again.rc == 0, again.stderr
    assert again.stdout.strip() == "4417"
    assert srv.count == sent

    # replay: re-executes the cells, zero requests, same answer
    rp = cli("replay", "trip-1")
    assert rp.rc == 0, rp.stderr
    assert rp.stdout.strip() == "4417"
    assert srv.count == sent
    assert "4 model call(s) served from the journal" in rp.stderr

    # replay --json tells how many calls were served
    rpj = cli("replay", "trip-1", "--json")
    assert rpj.rc == 0, rpj.stderr
    assert json.loads(rpj.stdout)["replayed_calls"] == 4
    assert srv.count == sent

    # show: the stage tree
    sh = cli("show", "trip-1")
    assert sh.rc == 0, sh.stderr
    assert "state=completed" in sh.stdout and "answer: 4417" in sh.stdout
    for kind in ("[run]", "[iteration]", "[model_call]", "[cell]", "[llm_query]"):
        assert kind in sh.stdout, kind
    assert sh.stdout.count("[iteration]") == 3
    assert "4 calls" in sh.stdout

    # runs: lists it
    rs = cli("runs")
    assert rs.rc == 0
    row = [ln for ln in rs.stdout.splitlines() if ln.startswith("trip-1")]
    assert row and "completed" in row[0]
    rsj = json.loads(cli("runs", "--json").stdout)
    assert [r["run_id"] for r in rsj] == ["trip-1"]

    # export: JSON lines
    ex = cli("export", "trip-1")
    assert ex.rc == 0
    recs = [json.loads(ln) for ln in ex.stdout.splitlines() if ln.strip()]
    assert len(recs) > 10
    assert srv.count == sent


def test_replay_works_with_the_endpoint_gone(cli, scripted, ctx_file):
    srv = scripted(script([repl("x = llm_query('hi')"), repl("FINAL(x)")], lambda req: "from-sub"))
    first = cli("run", "--context", str(ctx_file), "--query", "q", "--run-id", "gone-1",
                *endpoint_args(srv))
    assert first.rc == 0 and first.stdout.strip() == "from-sub"
    srv.__exit__(None, None, None)  # the endpoint is down from here on
    rp = cli("replay", "gone-1")
    assert rp.rc == 0, rp.stderr
    assert rp.stdout.strip() == "from-sub"


def test_show_and_runs_escape_control_characters_the_model_or_user_wrote(cli, scripted,
                                                                          ctx_file):
    """An answer, a query or a model name holding escape sequences (clear the screen, set the
    window title, colour) or a right-to-left override is shown with them escaped, never sent
    to the terminal; the answer on `rlm run`'s stdout stays the exact data."""
    evil = "evil \x1b[31mRED\x1b]0;pwned\x07 \u202eright-to-left\x9b tab\tok"
    srv = scripted(lambda req: repl(f"FINAL({evil!r})"))
    run = cli("run", "--context", str(ctx_file), "--query", "q \x1b[2J clear", "--run-id",
              "esc-1", *endpoint_args(srv))
    assert run.rc == 0 and run.stdout.rstrip("\n") == evil  # data, exact
    show, runs = cli("show", "esc-1"), cli("runs")
    assert show.rc == 0 and runs.rc == 0
    for out in (show.stdout, runs.stdout):
        assert not any(c in out for c in "\x1b\x07\u202e\x9b"), repr(out)
    assert "answer: evil \\x1b[31mRED\\x1b]0;pwned\\x07 \\u202eright-to-left\\x9b tab\tok" \
        in show.stdout
    assert "q \\x1b[2J clear" in runs.stdout


def test_printable_escapes_controls_and_keeps_text():
    from harness.text import printable
    plain = "caf\u00e9 \u4e2d\u6587 \U0001f600 tab\tand\nnewline"
    assert printable(plain) is plain
    assert printable("a\rb\x00c\x7fd\x85e\u2066f") == "a\\rb\\x00c\\x7fd\\x85e\\u2066f"


def test_show_unknown_run_exits_2(cli):
    # no journal yet at the given path: said so, and none is created by a read-only command
    res = cli("show", "no-such-run")
    assert_clean_error(res, 2, "no journal at", str(cli.journal))
    assert not cli.journal.exists()
    from harness.journal import Journal
    Journal(cli.journal).close()
    res = cli("show", "no-such-run")
    assert_clean_error(res, 2, "no-such-run")


@pytest.mark.parametrize("command", ["replay", "resume"])
def test_replay_and_resume_do_not_create_a_missing_journal(cli, tmp_path, command):
    missing = tmp_path / "no" / "such" / "journal.sqlite3"
    res = cli(command, "some-run", "--journal", str(missing))
    assert_clean_error(res, 2, "no journal at", str(missing))
    assert not missing.exists() and not missing.parent.exists()


@pytest.mark.parametrize("command", [
    ["runs"], ["show", "r"], ["verify", "--all"], ["export", "r"], ["replay", "r"],
    ["resume", "r"], ["view", "r"], ["export", "--format", "chat", "r", "-o", "out.jsonl"]])
def test_a_command_that_reads_leaves_an_empty_journal_file_as_it_is(cli, tmp_path, command):
    empty = tmp_path / "empty.sqlite3"
    empty.write_bytes(b"")
    res = cli(*command, "--journal", str(empty))
    assert_clean_error(res, 2, "empty file", str(empty))
    assert empty.read_bytes() == b""
    assert not list(tmp_path.glob("empty.sqlite3-*"))  # no -wal or -shm beside it
    assert not (tmp_path / "out.jsonl").exists()
    empty.unlink()  # not a journal: the suite's last test verifies every *.sqlite3 left behind


def test_replay_of_an_edited_context_is_a_divergence(cli, scripted, ctx_file):
    srv = scripted(script([repl("FINAL(len(context))")]))
    assert cli("run", "--context", str(ctx_file), "--query", "q", "--run-id", "div-1",
               *endpoint_args(srv)).rc == 0
    ctx_file.write_text("something else entirely")
    res = cli("replay", "div-1")
    assert_clean_error(res, 6, "changed")


def test_a_moved_context_file_is_named_with_the_way_to_point_at_it(cli, scripted, ctx_file,
                                                                   tmp_path):
    """(A finished run's resume needs no context; replay re-reads it. An unfinished run's
    resume goes through the same hint.)"""
    command = "replay"
    srv = scripted(script([repl("FINAL(len(context))")]))
    assert cli("run", "--context", str(ctx_file), "--query", "q", "--run-id", "moved-1",
               *endpoint_args(srv)).rc == 0
    moved = tmp_path / "elsewhere.txt"
    ctx_file.rename(moved)
    res = cli(command, "moved-1")
    assert_clean_error(res, 2, "not found", "--context PATH")
    assert cli(command, "moved-1", "--context", str(moved)).rc == 0


def test_replay_of_a_non_deterministic_cell_gives_no_resume_advice(cli, scripted, ctx_file):
    # the divergence message told a replay to "Resume with --on-divergence live", which a
    # replay does not take and a finished run's resume ignores
    # os.urandom: the kernels' random module is seeded per run (kernels.chance)
    srv = scripted(script([repl("import os; print(os.urandom(8).hex())"),
                           repl("FINAL('done')")]))
    assert cli("run", "--context", str(ctx_file), "--query", "q", "--run-id", "nondet-1",
               *endpoint_args(srv)).rc == 0
    res = cli("replay", "nondet-1")
    assert_clean_error(res, 6, "divergence at call", "a replay cannot pass this point")
    assert "--on-divergence" not in res.stderr, res.stderr


def test_replay_of_a_run_without_answer_does_not_print_none(cli, scripted, ctx_file):
    srv = scripted(script([repl("print('hm')")] * 2))
    first = cli("run", "--context", str(ctx_file), "--query", "q", "--max-iterations", "1",
                "--run-id", "noans-1", *endpoint_args(srv))
    assert first.rc == 7, first.stderr
    rp = cli("replay", "noans-1")
    assert srv.count == 2
    assert rp.stdout.strip() != "None", "replay printed the missing answer as the text 'None'"
    assert rp.rc == 7, (rp.rc, rp.stdout, rp.stderr)


def test_rerun_of_a_budget_stopped_run_names_the_cap_again(cli, scripted, ctx_file):
    srv = scripted(script([repl("print(1)")] * 5))
    args = ["run", "--context", str(ctx_file), "--query", "q", "--max-calls", "1",
            "--run-id", "cap-1", *endpoint_args(srv)]
    first = cli(*args)
    # the cap named once, by the reason itself
    assert first.rc == 5 and "\nrlm: run cap-1 ended: budget cap 'calls'" in first.stderr, \
        first.stderr
    again = cli(*args)
    assert srv.count == 1
    assert again.rc == 5, again.stderr
    assert again.stderr.startswith("rlm: run cap-1 ended: budget cap 'calls'"), again.stderr


@pytest.mark.parametrize("after", [0.15, 0.25, 0.35, 0.6])
def test_ctrl_c_during_start_up_interrupts_the_run(scripted, ctx_file, tmp_path, after):
    # Ctrl-C at any moment of `rlm run`'s start-up (imports, the root kernel launching ahead of
    # the run) ends it with exit 130 and the one-line message, never a traceback or a run that
    # goes on to complete
    srv = scripted(lambda req: Reply("```repl\nFINAL('late')\n```", delay=5.0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlm", "run", "--context", str(ctx_file), "--query", "q",
         *endpoint_args(srv)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=clean_env(RLM_JOURNAL=str(tmp_path / "j.sqlite3")))
    time.sleep(after)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, out, err)
    assert "Traceback" not in err and "rlm: interrupted" in err, err
    assert "late" not in out


def test_a_signal_landing_in_an_import_is_delivered_again_after_it():
    # Raised inside Python's import system, the KeyboardInterrupt could land in a module
    # lock's clean-up, where Python drops it and may leave the lock taken: with the kernel's
    # start thread importing too, an early Ctrl-C hung `rlm run`. The handler defers it.
    import threading

    from rlm.cli import main as rcli
    code = compile("import sys\nframe = sys._getframe()", "<frozen importlib._bootstrap>", "exec")
    ns: dict = {}
    exec(code, ns)
    got = threading.Event()
    old = signal.signal(signal.SIGUSR1, lambda *a: got.set())
    try:
        rcli._terminate(signal.SIGUSR1, ns["frame"])  # in an import: no exception now...
        assert got.wait(5), "the signal was not sent again"  # ...but the signal comes back
        with pytest.raises(KeyboardInterrupt):  # anywhere else: at once
            rcli._terminate(signal.SIGUSR1, sys._getframe())
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_runs_columns_line_up_with_wide_characters_in_run_ids(cli, scripted, tmp_path):
    # a CJK character takes two terminal columns: padding counted characters pushed the
    # STARTED column of such a row out of line
    import unicodedata
    srv = scripted(script([repl("FINAL('ok')")] * 3))
    (tmp_path / "ctx.txt").write_text("a short context")
    for run_id in ("实验一", "run-ascii", "测试-α"):
        res = cli("run", "--context", str(tmp_path / "ctx.txt"), "--query", "q", "--run-id",
                  run_id, "-q",
                  *endpoint_args(srv))
        assert res.rc == 0, res.stderr
    rows = cli("runs").stdout.splitlines()
    assert len(rows) == 4, rows

    def column_of_started(row: str) -> int:
        head = row[:row.index("2")] if not row.startswith("RUN ID") else row[:row.index("STARTED")]
        return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in head)
    assert len({column_of_started(r) for r in rows}) == 1, rows


@pytest.mark.parametrize("bad", ["0", "-1", "x", "99999999999999999999"])
def test_runs_limit_must_be_in_range(cli, bad):
    res = cli("runs", "--limit", bad)
    assert res.rc == 2 and "--limit: must be a whole number from 1" in res.stderr, res.stderr


@pytest.mark.parametrize("bad", ["-1", "nan", "0", "inf"])
def test_watch_interval_must_be_in_range(cli, bad):
    res = cli("runs", "--watch", "--interval", bad)
    assert res.rc == 2 and "--interval: must be seconds from 0.05" in res.stderr, res.stderr


def test_the_wall_cap_message_gives_the_limit_and_the_time_passed():
    from harness.errors import BudgetExceeded
    msg = str(BudgetExceeded("wall", 30, 31.26, 0.0))
    assert msg == ("budget cap 'wall' reached: the run's wall-clock limit is 30 s and 31.3 s "
                   "have passed")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_cancels_the_run_and_cleans_up(scripted, tmp_path, sig):
    # SIGHUP (the terminal closed) ended the process at once: the run stayed "running" until
    # seen as crashed, and its bridge directory was left in /tmp
    import glob
    import tempfile

    from harness.journal import Journal
    srv = scripted(lambda req: Reply("```repl\nFINAL('late')\n```", delay=30.0))
    (tmp_path / "ctx.txt").write_text("a context")
    journal = tmp_path / "j.sqlite3"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlm", "run", "--context", str(tmp_path / "ctx.txt"), "--query",
         "q", "--run-id", "stopped", *endpoint_args(srv)], cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=clean_env(RLM_JOURNAL=str(journal)))
    deadline = time.monotonic() + 60
    while srv.count == 0 and time.monotonic() < deadline:  # the run's first call is out
        time.sleep(0.05)
    assert srv.count == 1
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err and "rlm resume stopped" in err, err
    with Journal(journal) as j:
        assert j.get_run("stopped")["state"] == "cancelled"
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"rlm-bridge-{proc.pid}-*"))


def test_resume_of_a_finished_run_checks_the_context_given(cli, scripted, tmp_path):
    first, other = tmp_path / "first.txt", tmp_path / "other.txt"
    first.write_text("the context it ran with")
    other.write_text("another context entirely")
    srv = scripted(lambda req: repl("FINAL('recorded answer')"))
    run = cli("run", "--context", str(first), "--query", "q", "--run-id", "done-1",
              *endpoint_args(srv))
    assert run.rc == 0 and run.stdout.strip() == "recorded answer"
    same = cli("resume", "done-1", "--context", str(first))
    assert same.rc == 0 and same.stdout.strip() == "recorded answer", same.stderr
    wrong = cli("resume", "done-1", "--context", str(other))
    assert_clean_error(wrong, 6, "differs", "same context")
    assert "--run-id" not in wrong.stderr
