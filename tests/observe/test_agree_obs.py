"""What the views and traces say agrees with the journal: spans exported live and from the
journal are the same span for span and attribute for attribute, an OTLP collector that is down
costs one line and no time, one numbering of iterations everywhere, and every link and button of
the HTML view leads somewhere (real headless Chromium).

Real runs: real kernels, a real journal, the scripted OpenAI-protocol server (and the Anthropic
one) on 127.0.0.1, the OTel SDK's in-memory exporter, real `rlm` processes.
"""
from __future__ import annotations

import io
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import API_KEY, MODEL, clean_env, closed_port
import trajectory_run as tr
from scripted_server import Reply, ScriptedServer

from harness.journal import Journal

pytest.importorskip("opentelemetry.sdk", reason="the [otel] extra is not installed")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter)

import rlm  # noqa: E402
from rlm.observe.otel import LiveExporter, export_run  # noqa: E402


def _rlm(*args: str, journal: Path, env: dict | None = None, timeout: float = 120):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "rlm", *args], cwd=journal.parent,
                       capture_output=True, text=True, timeout=timeout,
                       env=clean_env(RLM_JOURNAL=str(journal), **(env or {})))
    return p, time.monotonic() - t0


# ------------------------------------------------------------------ live spans == exported spans

def _spans_by_stage(spans) -> dict:
    out = {}
    for sp in spans:
        sid = sp.attributes["rlm.stage.id"]
        assert sid not in out, f"stage {sid} has two spans"
        out[sid] = sp
    return out


def _same_spans(live_spans, journal: Path, run_id: str) -> dict:
    """Live spans and the spans `export_run` builds from the journal: the same stages, and for
    each the same name, kind, ids, parent, times, status and every attribute."""
    mem = InMemorySpanExporter()
    with Journal(journal) as j:
        n = export_run(j, run_id, exporter=mem)
    later = _spans_by_stage(mem.get_finished_spans())
    live = _spans_by_stage(live_spans)
    assert n == len(later) and set(live) == set(later)
    for sid, a in live.items():
        b = later[sid]
        la, lb = dict(a.attributes), dict(b.attributes)
        missing = {k: lb[k] for k in lb if k not in la}
        extra = {k: la[k] for k in la if k not in lb}
        differ = {k: (la[k], lb[k]) for k in la.keys() & lb.keys() if la[k] != lb[k]}
        assert not (missing or extra or differ), (sid, "live lacks", missing, "live only",
                                                  extra, "differ", differ)
        assert (a.name, a.kind, a.context.span_id, a.context.trace_id) == \
            (b.name, b.kind, b.context.span_id, b.context.trace_id), sid
        assert (a.parent.span_id if a.parent else None) == \
            (b.parent.span_id if b.parent else None), sid
        assert (a.start_time, a.end_time) == (b.start_time, b.end_time), sid
        assert (a.status.status_code, a.status.description) == \
            (b.status.status_code, b.status.description), sid
    return live


def _live() -> tuple[LiveExporter, InMemorySpanExporter]:
    mem = InMemorySpanExporter()
    return LiveExporter(exporter=mem), mem


def test_live_spans_equal_exported_spans_of_a_depth_2_run(tmp_path):
    """The issue's example: live spans had no response model, output cap, temperature or
    finish reasons, which the export had; no span had the reply's id or the server."""
    journal = tmp_path / "j.sqlite3"
    exp, mem = _live()
    try:
        run_id, res = tr.make_run(journal, listeners=[exp.listener])
    finally:
        exp.close()
    assert res.status == "completed", res.reason
    live = _same_spans(mem.get_finished_spans(), journal, run_id)
    calls = [sp for sp in live.values() if sp.attributes["rlm.stage.kind"] == "model_call"]
    done = [sp for sp in calls if sp.attributes["rlm.stage.status"] == "completed"]
    assert len(done) >= 10
    for sp in done:
        a = sp.attributes
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "openai"
        assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == MODEL
        assert re.fullmatch(r"chatcmpl-\d+", a["gen_ai.response.id"]), a
        assert tuple(a["gen_ai.response.finish_reasons"]) == ("stop",)
        assert a["gen_ai.request.max_tokens"] > 0 and a["gen_ai.request.temperature"] == 0.0
        assert a["server.address"] == "127.0.0.1" and a["server.port"] > 0
        assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] > 0
    # the failed child's call: the request's settings and the server, no reply, an error type
    failed = live["run/iteration-2/cell-0/child-1/iteration-0/model_call-0"]
    a = failed.attributes
    assert a["error.type"] == "400" and "gen_ai.response.id" not in a
    assert a["gen_ai.request.max_tokens"] > 0 and a["server.address"] == "127.0.0.1"
    assert live["run/iteration-2/cell-0/child-1"].attributes["error.type"] == "400"


def test_live_spans_equal_exported_spans_of_a_budget_stopped_run(tmp_path):
    journal = tmp_path / "j.sqlite3"
    exp, mem = _live()
    with ScriptedServer(tr.responder) as srv:
        try:
            res = rlm.completion(tr.CONTEXT, tr.QUERY, base_url=srv.base_url, api_key=API_KEY,
                                 model=MODEL, journal=str(journal), max_calls=2,
                                 run_id="budget-otel", listeners=[exp.listener])
        finally:
            exp.close()
    assert res.status == "budget_exceeded"
    live = _same_spans(mem.get_finished_spans(), journal, "budget-otel")
    refused = [sp for sp in live.values() if sp.attributes["rlm.stage.status"] == "budget_exceeded"
               and sp.attributes["rlm.stage.kind"] == "model_call"]
    assert refused and all(sp.attributes["error.type"] == "budget_exceeded" for sp in refused)
    # a refused call was never sent: it names no server
    assert all("server.address" not in sp.attributes for sp in refused)
    sent = [sp for sp in live.values() if sp.attributes.get("gen_ai.response.id")]
    assert sent and all(sp.attributes["server.port"] == srv.port for sp in sent)


def test_live_spans_equal_exported_spans_of_an_anthropic_run(tmp_path):
    pytest.importorskip("anthropic")
    from anthropic_server import AnthropicServer
    journal = tmp_path / "j.sqlite3"
    exp, mem = _live()

    def responder(req):
        turns = sum(1 for m in req["messages"] if m["role"] == "assistant")
        return ["```repl\nx = llm_query('sub?')\nprint(x)\n```",
                "```repl\nFINAL('blue')\n```"][min(turns, 1)] if req.get("system") else "sub"

    with AnthropicServer(responder) as srv:
        try:
            res = rlm.completion("the sky is blue", "colour?", provider="anthropic",
                                 base_url=srv.url, api_key=API_KEY, model=MODEL,
                                 journal=str(journal), run_id="anthropic-otel",
                                 listeners=[exp.listener])
        finally:
            exp.close()
    assert res.status == "completed", res.reason
    live = _same_spans(mem.get_finished_spans(), journal, "anthropic-otel")
    calls = [sp for sp in live.values() if sp.attributes["rlm.stage.kind"] == "model_call"]
    assert len(calls) == 3
    for sp in calls:
        a = sp.attributes
        assert a["gen_ai.provider.name"] == "anthropic"
        assert re.fullmatch(r"msg_\d+", a["gen_ai.response.id"]), a
        assert a["server.port"] == srv.port


# ------------------------------------------------------------------ a collector that is down

def _quick_responder(req):
    if req["messages"][0]["role"] != "system":
        return "sub"
    turns = sum(1 for m in req["messages"] if m["role"] == "assistant")
    return "```repl\n" + ["x = llm_query('hi')\nprint(x)", "FINAL('ok')"][min(turns, 1)] + "\n```"


class _Silent:
    """A TCP port on 127.0.0.1 that accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.sock.close()


def test_a_collector_that_is_down_costs_one_line_and_no_time(tmp_path):
    """The issue's example: with -q and a collector that was down, the run printed 4 retry
    lines and took 8.1 s instead of 2.5 s. A refused port and a port that never answers:
    at most one line each, and the run ends within a small margin of the same run without
    --otel."""
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("some context", encoding="utf-8")
    silent = _Silent()
    try:
        with ScriptedServer(_quick_responder) as srv:
            args = ["run", "--context", str(ctx), "--query", "q?", "--base-url", srv.base_url,
                    "--api-key", API_KEY, "--model", MODEL, "-q"]
            runs, bases = {}, []
            # runs without --otel before and after, so a loaded machine slows both sides alike
            for name, port in (("base-1", None), ("refused", closed_port()),
                               ("silent", silent.port), ("base-2", None)):
                env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"} if port else {}
                done = _rlm(*args, *(["--otel"] if port else []), "--run-id", name,
                            journal=tmp_path / "j.sqlite3", env=env)
                if port:
                    runs[name] = done
                else:
                    bases.append(done)
    finally:
        silent.close()
    for base, _ in bases:
        assert base.returncode == 0 and base.stdout.strip() == "ok" and base.stderr == ""
    t_base = max(secs for _, secs in bases)
    for name, (p, secs) in runs.items():
        assert p.returncode == 0 and p.stdout.strip() == "ok", (name, p.stderr)
        lines = p.stderr.splitlines()
        assert len(lines) <= 1, (name, lines)
        assert "Traceback" not in p.stderr and "retrying" not in p.stderr, p.stderr
        if lines:
            assert "OpenTelemetry" in lines[0] and "the run goes on" in lines[0], lines
        # the end of the run waits at most 1 s (CLOSE_WAIT) for its last spans
        assert secs < t_base + 2.5, (name, round(secs, 2), round(t_base, 2))
    assert "Connection refused" in runs["refused"][0].stderr


def test_export_to_a_collector_that_is_down_is_one_error_line(trajectory, tmp_path):
    journal, run_id, _ = trajectory
    silent = _Silent()
    try:
        for port in (closed_port(), silent.port):
            p, _ = _rlm("export", run_id, "--otel", "--otel-endpoint",
                        f"http://127.0.0.1:{port}/v1/traces", journal=journal,
                        env={"OTEL_EXPORTER_OTLP_TIMEOUT": "2"})
            assert p.returncode == 2, p.stderr
            lines = p.stderr.splitlines()
            assert len(lines) == 1 and lines[0].startswith("rlm: error:"), lines
            assert "did not accept the spans" in lines[0]
    finally:
        silent.close()


# ------------------------------------------------------------------ one numbering of iterations

TURNS = 19  # the example: its progress line said "iteration 19" for iteration-18
SUBS = 205  # more than the view renders at once, in the tree (200) and in a cell (40)
ROOT = (["r = llm_query_batched(['q%d' % i for i in range(" + str(SUBS) + ")], "
         "return_exceptions=True)\nprint(len(r))", "1/0"]
        + [f"print({t})" for t in range(2, TURNS - 1)] + ["FINAL('done')"])


def _numbered(req):
    if req["messages"][0]["role"] != "system":
        prompt = req["messages"][-1]["content"]
        return Reply("refused", status=400) if prompt == "q7" else Reply("a")
    turns = sum(1 for m in req["messages"] if m["role"] == "assistant")
    return "```repl\n" + ROOT[min(turns, len(ROOT) - 1)] + "\n```"


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    """One run of 19 iterations, journaled, seen by the plain progress lines and the live
    panel as it went: ``(journal, plain text, panel snapshots)``."""
    from rich.console import Console

    from rlm.observe.live import LiveState, make_display
    journal = tmp_path_factory.mktemp("numbered") / "j.sqlite3"
    out = io.StringIO()
    plain = make_display(plain=True, stream=out)
    state, panels = LiveState(), []

    def panel(event):
        state.update(event["stage"], event.get("ts"))
        st = event["stage"]
        if st.get("kind") == "iteration" and event.get("to") == "running":
            buf = io.StringIO()
            Console(file=buf, width=200, color_system=None).print(state.renderable())
            panels.append(buf.getvalue())

    with ScriptedServer(_numbered) as srv:
        res = rlm.completion("some context", "q?", base_url=srv.base_url, api_key=API_KEY,
                             model=MODEL, journal=str(journal), run_id="numbered",
                             listeners=[plain.listener, panel], on_progress=plain.progress)
    assert res.status == "completed" and res.iterations == TURNS, res.reason
    return journal, out.getvalue(), panels


def _no_other_numbering(text: str) -> None:
    assert not re.search(r"iteration \d", text), re.findall(r".*iteration \d.*", text)


def test_progress_lines_panel_and_show_name_iterations_alike(numbered):
    journal, plain, panels = numbered
    for n in range(TURNS):
        assert f"[rlm] L0 run/iteration-{n}: 1 code block(s)" in plain, plain
    assert f"[rlm] L0 iteration run/iteration-{TURNS - 1} completed" in plain
    _no_other_numbering(plain)
    seen = {int(m) for p in panels for m in re.findall(r"iteration-(\d+) running", p)}
    assert seen == set(range(TURNS)), seen
    for p in panels:
        _no_other_numbering(p)
    p, _ = _rlm("show", "numbered", journal=journal)
    assert p.returncode == 0, p.stderr
    shown = [int(m) for m in re.findall(r"^  iteration-(\d+) \[iteration\]", p.stdout, re.M)]
    assert shown == list(range(TURNS)), p.stdout
    _no_other_numbering(p.stdout)


@pytest.fixture(scope="module")
def numbered_page(numbered, tmp_path_factory) -> Path:
    journal = numbered[0]
    out = tmp_path_factory.mktemp("numbered-view") / "numbered.html"
    p, _ = _rlm("view", "numbered", "-o", str(out), journal=journal)
    assert p.returncode == 0, p.stderr
    return out


@pytest.fixture(scope="module")
def browser():
    from evals.chromium import Chromium, find_chromium
    if find_chromium() is None:
        pytest.skip("no Chromium: scripts/test.sh installs the Debian package `chromium`")
    with Chromium(width=1400, height=900) as b:
        yield b


READY = "document.body.dataset.ready === '1'"
_TICK = "const tick = () => new Promise((r) => setTimeout(r, 0));"


def test_the_view_names_iterations_as_every_other_view(numbered_page, browser):
    browser.open(numbered_page.as_uri(), ready=READY)
    labels = lambda: browser.eval(  # noqa: E731
        "[...document.querySelectorAll('#detail section.iter > h3 > :is(a, b.here)')]"
        ".map(a => a.textContent)")
    assert labels() == [f"iteration-{n}" for n in range(10)]
    browser.click("#detail .more-its")
    assert labels() == [f"iteration-{n}" for n in range(TURNS)]
    _no_other_numbering(browser.eval("document.getElementById('detail').textContent"))
    browser.eval(f"location.hash = '#run/iteration-{TURNS - 1}'")
    browser.wait_for("document.querySelector('#detail .stage-h .id').textContent === "
                     f"'run/iteration-{TURNS - 1}'")
    assert labels() == [f"iteration-{TURNS - 1}"]


# ------------------------------------------------------------------ every link leads somewhere

def test_more_sub_calls_of_a_cell_are_one_click_away(numbered_page, browser):
    """The issue's example: "165 more sub-calls: open the cell" did nothing on the cell's own
    page. A button now shows the next 40, until all are there."""
    cell = "run/iteration-0/cell-0"
    browser.open(numbered_page.as_uri() + "#" + cell, ready=READY)
    count = "document.querySelectorAll('#detail details.sub').length"
    assert browser.eval(count) == 40
    clicks = 0
    while browser.eval("!!document.querySelector('#detail .more-subs')"):
        before = browser.eval(count)
        browser.click("#detail .more-subs")
        clicks += 1
        assert browser.eval(count) == min(SUBS, before + 40)
    assert clicks == 5 and browser.eval(count) == SUBS
    ids = browser.eval("[...document.querySelectorAll('#detail details.sub')].map(d => d.id)")
    assert ids == [f"d-{cell}/llm_query-{k}" for k in range(SUBS)]
    # a sub-call opens on a click, with its prompt and answer
    browser.click(f"#detail details.sub[id='d-{cell}/llm_query-{SUBS - 1}'] > summary")
    assert browser.eval(f"document.getElementById('d-{cell}/llm_query-{SUBS - 1}')"
                        ".querySelector('pre.prompt').textContent") == f"q{SUBS - 1}"
    # Expand all reaches every sub-call too
    browser.open("about:blank")
    browser.open(numbered_page.as_uri() + "#" + cell, ready=READY)
    browser.click("#btn-expand")
    assert browser.eval(count) == SUBS


def test_every_link_in_the_view_opens_its_stage(numbered_page, browser):
    """From the run, an iteration, a cell and a sub-call (some with everything expanded):
    every ``#stage`` link of the detail pane leads to another stage, shows it and selects it in
    the tree. (The cell's "165 more sub-calls: open the cell" linked to the cell itself.)"""
    browser.open(numbered_page.as_uri(), ready=READY)
    bad = browser.eval("""(async () => {""" + _TICK + """
        const bad = []; let n = 0;
        const links = () => [...document.querySelectorAll('#detail a[href^="#"]')];
        // [stage shown first, expand everything in it]; at most 40 links each, spread out
        const starts = [["run", false], ["run/iteration-1", true], ["run/iteration-0/cell-0", false],
                        ["run/iteration-0/cell-0/llm_query-7", true]];
        for (const [start, expand] of starts) {
            const open = async () => { location.hash = "#" + start; await tick();
                                       if (expand) window.rlmView.expandAll(); };
            await open();
            const all = [...new Set(links().map(a => a.getAttribute("href")))];
            const step = Math.max(1, Math.ceil(all.length / 40));
            for (let k = 0; k < all.length; k += step) {
                const href = all[k];
                await open();
                links().find(x => x.getAttribute("href") === href).click();
                await tick(); await tick(); n++;
                const want = decodeURIComponent(href.slice(1));
                const got = document.querySelector("#detail .stage-h .id").textContent;
                const sel = document.querySelector("#tree .row.sel");
                // a link to the stage already shown would lead nowhere
                if (want === start || got !== want || !sel) bad.push([start, href, got]);
            }
        }
        return {bad, n};
    })()""")
    assert bad["n"] > 30 and bad["bad"] == [], bad


def test_every_button_of_the_view_shows_something(numbered_page, browser):
    # every button of the detail pane of the run and of the big cell shows more of it
    for start, least in (("run", 1), ("run/iteration-0/cell-0", 5)):
        browser.open("about:blank")
        browser.open(numbered_page.as_uri() + "#" + start, ready=READY)
        items = ("document.querySelectorAll('#detail section.iter, #detail details.sub')"
                 ".length")
        clicks = 0
        while browser.eval("!!document.querySelector('#detail button')") and clicks < 50:
            before = browser.eval(items)
            browser.click("#detail button")
            clicks += 1
            assert browser.eval(items) > before, (start, clicks)
        assert clicks >= least, (start, clicks)
    browser.open("about:blank")
    browser.open(numbered_page.as_uri(), ready=READY)
    # the tree: a cell of 205 sub-calls shows 200 rows, the rest behind "show 5 more of 5"
    rows = "document.querySelectorAll('#tree .row').length"
    before = browser.eval(rows)
    browser.eval("location.hash = '#run/iteration-0/cell-0'")
    browser.wait_for("document.querySelector('#tree .row.sel .nm').textContent === 'cell-0'")
    browser.click("#tree .row.sel .tg")  # open the cell in the tree
    browser.wait_for("document.querySelector('#tree .more') !== null")
    assert browser.eval("document.querySelector('#tree .more').textContent") == \
        f"show {SUBS - 200} more of {SUBS - 200}"
    shown = browser.eval(rows)
    browser.click("#tree .more")
    assert browser.eval(rows) == shown + SUBS - 200 and browser.eval(rows) > before
    # Show failures opens the path to the failed sub-call, deep in a collapsed subtree
    browser.open("about:blank")
    browser.open(numbered_page.as_uri(), ready=READY)
    haz = ("[...document.querySelectorAll('#tree .row.haz .nm')].map(e => e.textContent)")
    assert "llm_query-7" not in browser.eval(haz)
    browser.click("#btn-fail")
    assert "llm_query-7" in browser.eval(haz)
    # a failure link in the header opens the failed stage
    browser.click("#failures a[href='#run/iteration-0/cell-0/llm_query-7']")
    browser.wait_for("document.querySelector('#detail .stage-h .id').textContent === "
                     "'run/iteration-0/cell-0/llm_query-7'")
    assert "HTTP 400" in browser.eval("document.querySelector('#detail .err').textContent")
    # a search hit opens its stage
    browser.eval("window.rlmView.search('q150')")
    hit = "run/iteration-0/cell-0/llm_query-150/model_call-0"
    assert browser.eval("[...document.querySelectorAll('#results .hit .id')]"
                        ".map(e => e.textContent)") == [hit]
    browser.click("#results .hit .id")
    browser.wait_for(f"document.querySelector('#detail .stage-h .id').textContent === '{hit}'")
    # Expand all, then every "show more" button of the page has been used
    browser.eval("location.hash = '#run'")
    browser.wait_for("document.querySelector('#detail .stage-h .id').textContent === 'run'")
    browser.click("#btn-expand")
    assert browser.eval("document.querySelectorAll('#detail .more-its, #detail .more-subs')"
                        ".length") == 0
    assert browser.eval("document.querySelectorAll('#detail section.iter').length") == TURNS
    assert browser.console_errors == []
