"""Every view says why a run ended, in the same words, and `rlm runs` keeps its columns.

Real `rlm` processes against the scripted OpenAI-protocol server on 127.0.0.1 end a run each way
(failed, budget exceeded on a named cap, no answer, cancelled); then the live view of the run
itself (`--plain`), `rlm show`, `rlm show --follow`, `rlm runs`, `rlm runs --watch`'s table and
`rlm view` (its page's data, and one page in headless Chromium) are read for the reason.
"""
from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import pytest

from conftest import API_KEY, MODEL, REPO, clean_env
from scripted_server import Reply, ScriptedServer

from harness.journal import Journal


def _rlm(*args: str, journal: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlm", *args], cwd=journal.parent,
                          capture_output=True, text=True, timeout=timeout,
                          env=clean_env(RLM_JOURNAL=str(journal)))


def _responder(req):
    msgs = req["messages"]
    if msgs[0]["role"] != "system":
        return "sub"
    task = msgs[1]["content"]
    if "fail please" in task:
        return Reply("the endpoint refuses this", status=400)
    if "cancel please" in task:
        return Reply("```repl\nFINAL('late')\n```", delay=30.0)
    if "prose please" in task:
        return "I think the answer is 4."  # never code: no FINAL ever runs
    turns = sum(1 for m in msgs if m["role"] == "assistant")
    return "```repl\n" + ["x = llm_query('a')\nprint(x)", "y = llm_query('b')",
                          "FINAL('ok')"][min(turns, 2)] + "\n```"


#: run id -> (query, extra flags, exit code, words `rlm show` must say, WHY column)
ENDS = {
    "end-failed": ("fail please", [], 3, r"ended: failed: .*HTTP 400", "model endpoint"),
    "end-budget": ("budget please", ["--max-calls", "2"], 5,
                   r"ended: budget exceeded: the calls cap stopped it \(budget cap 'calls'",
                   "cap calls"),
    "end-noanswer": ("prose please", ["--max-iterations", "1"], 7,
                     r"ended: no answer: no FINAL after 1 iterations", "no FINAL"),
    "end-cancelled": ("cancel please", [], 130,
                      r"ended: cancelled: interrupted before it ended; `rlm resume "
                      r"end-cancelled` continues it", "cancelled"),
}


@pytest.fixture(scope="module")
def ended(tmp_path_factory):
    """The four runs, each ended its way by a real `rlm run --plain`: ``(journal, stderr by
    run id)``."""
    tmp = tmp_path_factory.mktemp("ends")
    journal = tmp / "j.sqlite3"
    ctx = tmp / "ctx.txt"
    ctx.write_text("some context", encoding="utf-8")
    errs = {}
    with ScriptedServer(_responder) as srv:
        for run_id, (query, flags, rc, _, _) in ENDS.items():
            cmd = [sys.executable, "-m", "rlm", "run", "--context", str(ctx), "--query", query,
                   "--base-url", srv.base_url, "--api-key", API_KEY, "--model", MODEL,
                   "--run-id", run_id, "--plain", "--max-attempts", "1", *flags]
            proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=clean_env(RLM_JOURNAL=str(journal)))
            if run_id == "end-cancelled":
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not any(
                        "cancel please" in json.dumps(r) for r in srv.requests):
                    time.sleep(0.05)
                proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == rc, (run_id, proc.returncode, err)
            errs[run_id] = err
    return journal, errs


@pytest.mark.parametrize("run_id", list(ENDS))
def test_show_says_why_the_run_ended(ended, run_id):
    """The issue's example: `rlm show` of a failed run printed state=failed and the tree, never
    the recorded reason."""
    journal, _ = ended
    p = _rlm("show", run_id, journal=journal)
    assert p.returncode == 0, p.stderr
    head = p.stdout.splitlines()[:3]
    assert any(re.match(ENDS[run_id][3], ln) for ln in head), head
    # --follow of an ended run prints the same opening lines
    f = _rlm("show", run_id, "--follow", journal=journal)
    assert f.returncode == 0 and f.stdout.splitlines()[:3] == head, f.stdout


#: run id -> (how the live view's line ends, the reason `rlm run`'s last line gives once)
LIVE = {"end-failed": (r": failed$", r"^rlm: error: .*HTTP 400"),
        "end-budget": (r": budget exceeded: the calls cap stopped it$",
                       r"^rlm: run end-budget ended: budget cap 'calls'"),
        "end-noanswer": (r": no answer$", r"^rlm: run end-noanswer ended without an answer: "
                                          r"no FINAL after 1 iterations"),
        "end-cancelled": (r": " + re.sub(r"^ended: ", "", ENDS["end-cancelled"][3]),
                          r"^rlm: interrupted")}


@pytest.mark.parametrize("run_id", list(ENDS))
def test_the_live_view_says_why_the_run_ended(ended, run_id):
    """Its line says how the run ended; the reason is said once, on the command's last line
    (it was on the line of every stage that failed with it, and on this one)."""
    _, errs = ended
    err = errs[run_id]
    lines = [ln for ln in err.splitlines() if ln.startswith(f"[rlm] run {run_id} ended in ")]
    assert len(lines) == 1, err
    assert re.search(LIVE[run_id][0], lines[0]), lines
    finals = [ln for ln in err.splitlines() if re.search(LIVE[run_id][1], ln)]
    assert len(finals) == 1, err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("run_id", list(ENDS))
def test_the_live_panel_says_why_the_run_ended(ended, run_id):
    """The panel on a terminal, fed the run's recorded stage changes as `rlm run` feeds it
    the live ones: while it shows and after it is gone, it says why the run ended."""
    from rich.console import Console

    from rlm.observe.live import make_display
    journal, _ = ended
    with Journal(journal) as j:
        stages = j.stages(run_id)
    term = _Terminal()
    display = make_display(stream=term)
    assert type(display).__name__ == "_Rich"
    text = re.sub(r"^ended: ", "", ENDS[run_id][3])
    with display:
        for st in stages:
            display.listener({"event": "transition", "run_id": run_id, "stage": st,
                              "to": st["status"]})
        frame = io.StringIO()
        Console(file=frame, width=300, color_system=None).print(display.state.renderable())
        assert re.search(text, frame.getvalue()), frame.getvalue()
    # what stays on the terminal (colours off, lines wrapped at its width joined again)
    after = " ".join(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", term.getvalue()).split())
    assert re.search(rf"\[rlm\] run {run_id} ended in [\d.]+ s: {text}", after), after[-2000:]


@pytest.mark.parametrize("run_id", list(ENDS))
def test_the_view_says_why_the_run_ended(ended, run_id, tmp_path):
    journal, _ = ended
    out = tmp_path / f"{run_id}.html"
    p = _rlm("view", run_id, "-o", str(out), journal=journal)
    assert p.returncode == 0, p.stderr
    html = out.read_text(encoding="utf-8")
    data = html.split('<script id="rlm-data" type="application/json">', 1)[1].split("</script>")[0]
    run = json.loads(data.replace("<\\/", "</"))["run"]
    assert re.match(re.sub(r"^ended: ", "", ENDS[run_id][3]), run["ended"]), run["ended"]


def test_the_view_page_shows_why_a_run_ended(ended, tmp_path):
    from evals.chromium import Chromium, find_chromium
    if find_chromium() is None:
        pytest.skip("no Chromium: scripts/test.sh installs the Debian package `chromium`")
    journal, _ = ended
    out = tmp_path / "failed.html"
    assert _rlm("view", "end-failed", "-o", str(out), journal=journal).returncode == 0
    with Chromium() as b:
        b.open(out.as_uri(), ready="document.body.dataset.ready === '1'")
        assert re.match(r"failed: .*HTTP 400", b.eval("document.getElementById('reason')"
                                                      ".textContent"))
        assert b.console_errors == []


def test_runs_says_why_each_run_ended(ended):
    journal, _ = ended
    p = _rlm("runs", journal=journal)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    why_at = lines[0].index("WHY")
    for run_id, spec in ENDS.items():
        row = next(ln for ln in lines if ln.startswith(run_id + " "))
        assert row[why_at:].startswith(spec[4]), (row, spec[4])


def test_a_crashed_run_says_so_and_how_to_go_on(tmp_path):
    journal = tmp_path / "j.sqlite3"
    code = f"""
import os
from harness.journal import Journal
j = Journal({str(journal)!r})
j.create_run("crashed-1", query="q?", model="m", max_depth=1, options={{}})
os._exit(0)
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=clean_env())
    p = _rlm("show", "crashed-1", journal=journal)
    assert p.returncode == 0, p.stderr
    assert re.search(r"^ended: crashed: the process running it stopped .*`rlm resume "
                     r"crashed-1` continues it", p.stdout, re.M), p.stdout
    assert "process gone" in _rlm("runs", journal=journal).stdout


# ------------------------------------------------------------------ the runs list's columns

def _cols(text: str) -> int:
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _at(row: str, col: int) -> str:
    """What ``row`` shows from terminal column ``col`` on."""
    for k in range(len(row) + 1):
        if _cols(row[:k]) >= col:
            return row[k:] if _cols(row[:k]) == col else "\0" + row[k:]
    return ""


def test_runs_keeps_its_columns_with_long_ids_and_shows_plain_runs(tmp_path):
    """The issue's example: the columns shifted on an eval trial's 25-character run id, and a
    base-method trial (a plain completion) showed an empty query and depth 1."""
    import rlm
    journal = tmp_path / "j.sqlite3"
    # an eval trial's id ("eval-" + 20 hex digits), a short one, a workflow engine's, a wide one
    long_ids = ["eval-0123456789abcdef0123", "r", "a-very-long-run-id-from-a-workflow/step-12",
                "实验-二"]
    with ScriptedServer(lambda req: "```repl\nFINAL('ok')\n```"
                        if req["messages"][0]["role"] == "system" else "Paris") as srv:
        opts = dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL, journal=str(journal))
        for run_id in long_ids:
            assert rlm.completion("ctx", "q?", run_id=run_id, **opts).status == "completed"
        # what a base-method trial runs (rlm.evaluation.trial.run_trial)
        res = rlm.plain_completion("Some context here.\n\nWhat is the capital of France?",
                                   run_id="eval-base0123456789abcdef", **opts)
        assert res.answer == "Paris"
    p = _rlm("runs", journal=journal)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 1 + len(long_ids) + 1, lines
    head = lines[0]
    for name in ("STARTED", "STATE", "HOST", "MODEL / QUERY"):  # left-aligned: start in line
        col = _cols(head[:head.index(name)])
        for row in lines[1:]:
            assert _at(row, col - 2)[:2] == "  " and _at(row, col)[:1] not in (" ", "\0"), \
                (name, row)
    for name in ("DEPTH", "COST $"):  # right-aligned: end in line
        end = _cols(head[:head.index(name)]) + len(name)
        for row in lines[1:]:
            assert _at(row, end - 1)[:1] not in (" ", "\0") and _at(row, end)[:2] == "  ", \
                (name, row)
    for run_id in long_ids + ["eval-base0123456789abcdef"]:
        assert any(ln.startswith(run_id + " ") for ln in lines), (run_id, lines)
    base = next(ln for ln in lines if ln.startswith("eval-base"))
    depth_end = _cols(head[:head.index("DEPTH")]) + len("DEPTH")
    assert _at(base, depth_end - 1)[:1] == "-", base  # a plain completion has no depth
    assert base.endswith(f"{MODEL} / plain: What is the capital of France?"), base
    # the live runs table (`rlm runs --watch`) has the same rows and never wraps a run id
    from rich.console import Console

    from rlm.observe.live import _runs_table
    out = io.StringIO()
    with Journal(journal) as j:
        Console(file=out, width=120, color_system=None).print(_runs_table(j, 20))
    table = out.getvalue()
    for run_id in long_ids:
        assert run_id in table, table
    assert "m / plain: What is the capital of France?" in " ".join(table.split()), table
