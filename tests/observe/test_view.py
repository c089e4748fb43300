"""``rlm view``: the HTML trajectory of real runs, checked from the DOM of a headless Chromium.

One real run (``trajectory_run``: depth 2, batched sub-calls, a timed-out cell, a failed child,
a depth-limit fallback) is journaled once for the module; the page is written by the real CLI and
opened in the Debian ``chromium`` (installed by scripts/test.sh when missing) over DevTools on
127.0.0.1. ``RLM_UPDATE_SCREENSHOT=1`` also refreshes the README's screenshot.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, clean_env
import trajectory_run as tr

from evals.chromium import Chromium, find_chromium
from harness.journal import Journal
from rlm.observe.view import build_payload, render_html

needs_chromium = pytest.mark.skipif(
    find_chromium() is None,
    reason="no Chromium: scripts/test.sh installs the Debian package `chromium` when apt is "
           "available; without it the browser checks cannot run")

READY = "document.body.dataset.ready === '1'"


@pytest.fixture(scope="module")
def recorded(trajectory):
    return trajectory


def rlm_cli(*args: str, journal: Path, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlm", *args], cwd=cwd, timeout=timeout,
                          env=clean_env(RLM_JOURNAL=str(journal)), capture_output=True, text=True)


@pytest.fixture(scope="module")
def page(recorded, tmp_path_factory) -> Path:
    journal, run_id, _ = recorded
    out = tmp_path_factory.mktemp("page") / "run.html"
    p = rlm_cli("view", run_id, "-o", str(out), journal=journal, cwd=out.parent)
    assert p.returncode == 0, p.stderr
    return out


@pytest.fixture(scope="module")
def browser():
    if find_chromium() is None:
        pytest.skip("no Chromium (see needs_chromium)")
    with Chromium(width=1400, height=900) as b:
        yield b


def test_page_is_self_contained_and_holds_every_stage(recorded, page):
    journal, run_id, _ = recorded
    html = page.read_text(encoding="utf-8")
    # nothing is fetched: no external script, style, font, image or frame
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)\s*=", html, re.I)
    assert "@import" not in html and "url(" not in html
    assert not re.search(r"https?://(?!127\.0\.0\.1)", html.split('id="rlm-data"')[0])
    data = html.split('<script id="rlm-data" type="application/json">', 1)[1].split("</script>")[0]
    payload = json.loads(data.replace("<\\/", "</"))
    with Journal(journal) as j:
        stage_ids = [s["id"] for s in j.stages(run_id)]
    assert [row[0] for row in payload["stages"]] == stage_ids
    assert payload["run"]["answer"] == tr.ANSWER


def test_long_text_is_cut_with_a_note_and_cannot_close_the_script():
    evil = "</script><script>alert(1)</script>" + "x" * 500
    run = {"run_id": "r1", "state": "completed", "query": evil, "answer": "a", "options": {}}
    stages = [{"id": "run", "parent_id": None, "kind": "run", "status": "completed",
               "evidence": evil}]
    payload = build_payload(run, stages, max_text=100)
    text = payload["stages"][0][-1]["answer"]
    assert text.startswith(evil[:100]) and "434 more characters cut" in text
    html = render_html(payload)
    assert html.count("</script>") == 2  # the data block's and the viewer's, nothing injected


@needs_chromium
def test_browser_shows_stages_answer_every_cell_and_the_failed_child(recorded, page, browser,
                                                                     tmp_path):
    journal, run_id, _ = recorded
    with Journal(journal) as j:
        stages = j.stages(run_id)
        cells = j.cells(run_id)
    browser.open(page.as_uri(), ready=READY)
    assert browser.console_errors == []
    assert browser.eval("document.getElementById('stage-count').textContent") == \
        f"{len(stages)} stages"
    assert browser.eval("document.getElementById('answer').textContent") == tr.ANSWER
    assert browser.eval("document.getElementById('query').textContent") == tr.QUERY
    # how the kernels ran (docs/security.md): from the run record
    sandbox = recorded[2].sandbox  # the run's result, as the journal records it
    assert sandbox in ("bwrap", "none")
    stats = browser.eval("[...document.querySelectorAll('.stat')].map(e => e.textContent)")
    assert any(t.startswith("kernels started (sandbox)") and f"({sandbox})" in t
               for t in stats), stats

    # the tree is lazy: collapsed subtrees are not in the DOM until opened
    rows = browser.eval("document.querySelectorAll('#tree .row').length")
    assert rows < len(stages)
    opened = browser.eval("(() => { const n = [...document.querySelectorAll('#tree .node')]"
                          ".find(n => !n.dataset.open && n.querySelector('.tg').textContent);"
                          " n.querySelector('.tg').click(); return n.id; })()")
    assert browser.eval("document.querySelectorAll('#tree .row').length") > rows
    assert browser.eval(f"document.getElementById('{opened}').dataset.open") == "1"

    # every executed cell's code (children's cells included) is shown once all is expanded
    browser.click("#btn-expand")
    shown = browser.eval("[...document.querySelectorAll('#detail pre.code')]"
                         ".map(e => e.textContent)")
    assert len(cells) == 6
    for c in cells:
        assert c["code"] in shown, c["code"]
    outputs = browser.eval("[...document.querySelectorAll('#detail pre.out')]"
                           ".map(e => e.textContent).join('\\n')")
    assert "fruit:" in outputs  # the batched sub-calls' answers, as the cell printed them
    flags = browser.eval("[...document.querySelectorAll('#detail .flag')].map(e => e.textContent)")
    assert "timed out" in flags

    # the failed child: marked in the tree (with the path to it) and in the trajectory
    failed_child = "run/iteration-2/cell-0/child-1"
    assert browser.eval(f"document.getElementById('d-{failed_child}')"
                        ".querySelector('summary .badge').textContent") == "failed"
    browser.click(f"#failures a[href='#{failed_child}']")
    browser.wait_for(f"document.querySelector('#detail .stage-h .id').textContent === "
                     f"'{failed_child}'")
    assert "HTTP 400" in browser.eval("document.querySelector('#detail .err').textContent")
    path = browser.eval("[...document.querySelectorAll('#tree .row.haz .nm')]"
                        ".map(e => e.textContent)")
    assert {"run", "iteration-2", "cell-0", "child-1"} <= set(path)
    assert browser.eval("document.querySelector('#tree .row.sel .nm').textContent") == "child-1"

    # deep link to a stage, and search over code and prompts
    browser.open("about:blank")
    browser.open(page.as_uri() + "#run/iteration-0/cell-0/llm_query-1", ready=READY)
    assert "Name the fruit in:" in browser.eval(
        "document.querySelector('#detail pre.prompt').textContent")
    browser.eval("window.rlmView.search('bad child')")
    hits = browser.eval("[...document.querySelectorAll('#results .hit .id')]"
                        ".map(e => e.textContent)")
    assert "run/iteration-2/cell-0" in hits  # the code that started the children
    browser.eval("window.rlmView.search('endpoint refuses')")
    hits = browser.eval("[...document.querySelectorAll('#results .hit .id')]"
                        ".map(e => e.textContent)")
    assert failed_child in hits  # its error

    # the timeline: concurrent stages in separate lanes, and a click on a bar opens its stage
    lanes = int(re.search(r"(\d+) lanes", browser.eval(
        "document.getElementById('legend').textContent")).group(1))
    assert lanes >= 4  # run, iteration, cell and the batched sub-calls at once
    cell = "run/iteration-1/cell-0"  # the timed-out cell: a long bar
    clicked = browser.eval(f"""(() => {{
        const cv = document.getElementById('timeline'), r = cv.getBoundingClientRect();
        const g = cv._geo, S = {json.dumps([[s["id"], s["started_at"], s["ended_at"]]
                                            for s in stages])};
        const t0 = Math.min(...S.filter(s => s[1] != null).map(s => s[1]));
        const c = S.find(s => s[0] === '{cell}'), mid = (c[1] + c[2]) / 2;
        const x = r.left + (mid - t0) / g.span * (g.W - 2);
        for (let L = 0; L < {lanes}; L++) {{
            cv.dispatchEvent(new MouseEvent('click', {{clientX: x, clientY: r.top + 14 + L * g.lh + 1,
                                                       bubbles: true}}));
            if (decodeURIComponent(location.hash) === '#{cell}') return L;
        }}
        return -1; }})()""")
    assert clicked >= 0
    browser.wait_for(f"document.querySelector('#detail .stage-h .id').textContent === '{cell}'")

    shot = tmp_path / "view.png"
    browser.eval("window.rlmView.search('')")
    browser.eval("location.hash = '#run/iteration-2/cell-0/child-0'")
    browser.eval("document.querySelectorAll('#detail details.sub').forEach(d => d.open = true)")
    browser.screenshot(shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    if os.environ.get("RLM_UPDATE_SCREENSHOT"):
        shutil.copy(shot, REPO / "docs" / "rlm-view.png")


@needs_chromium
def test_partial_run_of_a_crashed_process_renders(tmp_path, browser):
    # a process journals a run that is mid-cell and dies without finishing it
    journal = tmp_path / "j.sqlite3"
    code = f"""
import os
from harness.journal import Journal
from harness.journal.encoding import request_hash
from harness.stages.tree import StageTree, Kind, Status
j = Journal({str(journal)!r})
j.create_run("crashed1", query="q?", model="m", max_depth=1, options={{}})
t = StageTree("crashed1", [j.record_event])
r = t.new_stage(None, Kind.run, 0); t.transition(r.id, "pending", "running")
it = t.new_stage(r.id, Kind.iteration, 0); t.transition(it.id, "pending", "running")
mc = t.new_stage(it.id, Kind.model_call, 0); t.transition(mc.id, "pending", "running")
reply = "```repl\\nwhile True: pass\\n```"
t.transition(mc.id, "running", "completed", evidence=reply)
request = {{"model": "m", "messages": [{{"role": "user", "content": "q?"}}], "max_tokens": 8,
           "temperature": 0.0}}
j.record_model_call("crashed1", mc.id, request_hash=request_hash(request), request=request,
                    response={{"text": reply}}, usage=None, attempts=[])  # as a real run does
c = t.new_stage(it.id, Kind.cell, 0); t.transition(c.id, "pending", "running")
os._exit(0)
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=clean_env())
    out = tmp_path / "crashed.html"
    p = rlm_cli("view", "crashed1", "-o", str(out), journal=journal, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    browser.open(out.as_uri(), ready=READY)
    assert browser.console_errors == []
    assert browser.eval("document.querySelector('h1 .badge').textContent") == "crashed"
    assert browser.eval("document.getElementById('stage-count').textContent") == "4 stages"
    detail = browser.eval("document.getElementById('detail').textContent")
    assert "while True: pass" in detail and "the cell did not finish" in detail


def test_replay_view_shows_the_replayed_tree(tmp_path):
    # (a run with a failed model call cannot be replayed: the failed call has no recorded
    # response, so this uses the first turns of the trajectory and an answer)
    import rlm
    from scripted_server import ScriptedServer
    journal = tmp_path / "j.sqlite3"
    ctx = tmp_path / "context.txt"
    ctx.write_text(tr.CONTEXT, encoding="utf-8")

    def responder(req):
        if req["messages"][0]["role"] != "system":
            return tr.responder(req)
        turns = sum(1 for m in req["messages"] if m["role"] == "assistant")
        code = [tr.ROOT_CODE[0], "FINAL('from ' + str(len(found)) + ' pieces')"][min(turns, 1)]
        return "```repl\n" + code + "\n```"

    with ScriptedServer(responder) as srv:
        res = rlm.completion(ctx, "q?", base_url=srv.base_url, api_key="k", model="m",
                             journal=str(journal))
    assert res.answer == "from 3 pieces"
    out = tmp_path / "replay.html"
    p = rlm_cli("replay", res.run_id, "--view", str(out), journal=journal, cwd=tmp_path,
                timeout=120)
    assert p.returncode == 0, p.stderr
    html = out.read_text(encoding="utf-8")
    data = html.split('<script id="rlm-data" type="application/json">', 1)[1].split("</script>")[0]
    payload = json.loads(data.replace("<\\/", "</"))
    assert payload["run"]["replay"] is True and payload["run"]["answer"] == "from 3 pieces"
    assert len(payload["stages"]) == sum(res.stages.values())
    # every model call was served from the journal, and the recorded prompts are shown
    texts = {row[0]: row[-1] or {} for row in payload["stages"]}
    assert texts["run/iteration-0/model_call-0"].get("replayed") is True
    assert "Name the fruit in:" in texts["run/iteration-0/cell-0/llm_query-0/model_call-0"]["prompt"]


@needs_chromium
def test_budget_stopped_run_shows_the_cap_it_hit(tmp_path, browser):
    import rlm
    from scripted_server import ScriptedServer
    journal = tmp_path / "j.sqlite3"
    with ScriptedServer(tr.responder) as srv:
        res = rlm.completion(tr.CONTEXT, tr.QUERY, base_url=srv.base_url, api_key="k",
                             model="m", journal=str(journal), max_calls=2)
    assert res.status == "budget_exceeded"
    out = tmp_path / "budget.html"
    p = rlm_cli("view", res.run_id, "-o", str(out), journal=journal, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    browser.open(out.as_uri(), ready=READY)
    assert browser.eval("document.querySelector('h1 .badge').textContent") == "budget_exceeded"
    assert "calls" in browser.eval("document.getElementById('reason').textContent")
    stat = browser.eval("[...document.querySelectorAll('.stat')].find(e => e.textContent"
                        ".startsWith('model calls')).textContent")
    assert re.search(r"2 / 2\s*100%", stat), stat
    stopped = browser.eval("[...document.querySelectorAll('#failures a')].map(a => a.textContent)")
    assert any("budget_exceeded" in a for a in stopped), stopped


def test_default_file_name_of_a_run_id_with_a_slash(tmp_path):
    # a workflow engine's run id ("flow/step-1") cannot be a file name as it is
    journal = tmp_path / "j.sqlite3"
    code = f"""
from harness.journal import Journal
j = Journal({str(journal)!r})
j.create_run("flow/step-1", query="q?", model="m", max_depth=1, options={{}})
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=clean_env())
    p = rlm_cli("view", "flow/step-1", journal=journal, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "rlm-view-flow_step-1.html").is_file(), list(tmp_path.iterdir())
