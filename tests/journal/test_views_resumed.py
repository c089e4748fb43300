"""Views that agree after a resume: an `rlm run` process is SIGKILLed mid-way (a call in flight,
or every call answered and only the last cell left), `rlm resume` finishes it, and then every
view gives the same totals over all attempts (calls, tokens, cost): the resume's own --json
summary, `rlm show`, `rlm runs` (table and --json), `rlm view` and `rlm export`; and where a view
gives the last attempt's alone, it says so.

Before, `rlm show` and `rlm view` gave the last attempt's figures as the run's (0 calls, 0 tokens,
$0.000000 when the resume sent nothing new) while `rlm runs` gave every attempt's."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import clean_env
from scripted_server import Reply, ScriptedServer

PRICES = '{"pm": {"input": 1000, "output": 1000}}'  # USD per million tokens: 0.001 a token


def _rlm(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlm", *args], capture_output=True, text=True,
                          timeout=timeout, env=clean_env())


def _view(*args: str) -> subprocess.CompletedProcess:
    """A read-only command (show, runs, view, export): its own code, in this process."""
    import contextlib
    import io

    from rlm.cli.main import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


class Killer:
    """Root turns: two llm_query turns, then a slow FINAL cell; sub-calls answer at once.
    ``point``: ``"in_flight"`` kills the host when the second root turn arrives (the call is
    never answered); ``"answered"`` answers the last turn and kills the host while its cell
    sleeps (the resume then sends nothing)."""

    def __init__(self, point: str) -> None:
        self.point, self.pid, self.n = point, None, 0
        self.lock = threading.Lock()

    def kill(self) -> None:
        if self.pid:
            os.kill(self.pid, signal.SIGKILL)
            self.pid = None

    def __call__(self, req: dict):
        msgs = req["messages"]
        if msgs[0]["role"] != "system":
            return Reply("sub", usage={"prompt_tokens": 10, "completion_tokens": 5})
        turn = sum(1 for m in msgs if m["role"] == "assistant")
        with self.lock:
            if self.point == "in_flight" and turn == 1 and self.pid:
                self.kill()
                time.sleep(0.3)  # the host is gone: this reply reaches nobody
            if self.point == "answered" and turn == 2 and self.pid:
                threading.Timer(0.6, self.kill).start()
        text = ["```repl\nx = llm_query('a')\n```", "```repl\ny = llm_query('b')\n```",
                "```repl\nimport time\ntime.sleep(1.5)\nFINAL(x + y)\n```"][min(turn, 2)]
        return Reply(text, usage={"prompt_tokens": 100, "completion_tokens": 20})


def _show_spent(text: str) -> tuple[int, int, float, str]:
    m = re.search(r"^spent: (\d+) call\(s\), ([\d,]+) tokens \(.*?\), \$([\d.]+)(.*)$", text,
                  re.M)
    assert m, text
    return int(m.group(1)), int(m.group(2).replace(",", "")), float(m.group(3)), m.group(4)


@pytest.mark.parametrize("point", ["in_flight", "answered"])
def test_every_view_gives_the_totals_of_every_attempt_after_a_kill_and_resume(tmp_path, point):
    prices = tmp_path / "prices.json"
    prices.write_text(PRICES)
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("some context")
    journal = str(tmp_path / "j.sqlite3")
    model = Killer(point)
    with ScriptedServer(model) as srv:
        p = subprocess.Popen([sys.executable, "-m", "rlm", "run", "--context", str(ctx),
                              "--query", "q", "--base-url", srv.base_url, "--api-key", "k",
                              "--model", "pm", "--journal", journal, "--run-id", "r1",
                              "--price-file", str(prices)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=clean_env())
        model.pid = p.pid
        _, err = p.communicate(timeout=120)
        assert p.returncode == -signal.SIGKILL, err[-2000:]
        r = _rlm("resume", "r1", "--journal", journal, "--json")
        assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    every = res["usage"]["all_attempts"]
    want = (every["calls"], every["total_tokens"], round(every["cost_usd"], 6))
    assert res["totals"] == {k: every[k] for k in res["totals"]}  # the --json summary
    if point == "answered":
        assert res["usage"]["calls"] == 0 and want[0] == 5  # the resume sent nothing
    else:
        assert every["open_at_resume"] == 1 and want[0] == 6
    assert want[2] > 0

    show = _view("show", "r1", "--journal", journal)
    calls, tokens, cost, rest = _show_spent(show.stdout)
    assert (calls, tokens, round(cost, 6)) == want, show.stdout
    last = res["usage"]
    assert f"the last attempt: {last['calls']} call(s)" in rest  # said as the last attempt's
    first = show.stdout.splitlines()[4]  # the tree's own totals say what they cover
    assert first.startswith("run r1:") and "stages as last recorded" in first, show.stdout

    runs = _view("runs", "--journal", journal)
    row = [ln for ln in runs.stdout.splitlines() if ln.startswith("r1 ")]
    assert row and f"{want[2]:.4f}" in row[0].split(), runs.stdout
    listed = json.loads(_view("runs", "--journal", journal, "--json").stdout)
    tot = listed[0]["totals"]
    assert (tot["calls"], tot["total_tokens"], round(tot["cost_usd"], 6)) == want

    page = tmp_path / "view.html"
    assert _view("view", "r1", "--journal", journal, "-o", str(page)).returncode == 0
    html = page.read_text()
    data = json.loads(html.split('<script id="rlm-data" type="application/json">', 1)[1]
                      .split("</script>")[0].replace("<\\/", "</"))
    sp = data["run"]["spent"]
    assert (sp["calls"], sp["total_tokens"], round(sp["cost_usd"], 6)) == want
    assert data["run"]["last_attempt"]["calls"] == last["calls"]
    assert "R.spent || u0" in html  # the header reads the totals over every attempt

    exported = _view("export", "r1", "--journal", journal).stdout.splitlines()
    run_line = json.loads(exported[0])
    tot = run_line["totals"]
    assert run_line["type"] == "run"
    assert (tot["calls"], tot["total_tokens"], round(tot["cost_usd"], 6)) == want
