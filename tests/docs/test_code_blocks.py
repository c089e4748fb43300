"""Every code block in README.md and docs/**/*.md runs as pasted.

Each fenced block is one test, named after its file and line:

* ```` ```python ````: the block is a script, run in a fresh ``python`` process of this venv;
* ```` ```bash ````: the block is a script, run by ``bash -euo pipefail`` with this venv's
  ``bin`` first on ``PATH`` (so ``rlm`` is the project's, and ``.venv/bin/rlm`` works too: the
  working directory holds a ``.venv`` link to this venv);
* ```` ```repl ````: code the model writes in its kernel. The block is the scripted model's
  reply in a real run (``max_depth=2``, so ``rlm(...)`` starts a child with its own kernel) over
  ``essays.txt``, and the run must complete;
* ```` ```json ````: must parse; ```` ```text ```` and ```` ```console ````: output, not code.

A block that cannot run here (installing, the demos, the test suite, ``mkdocs serve``, a server
that runs until stopped, a hosted endpoint, a Ray cluster...) has ``<!-- no-run: reason -->`` on
the line right before its fence and is skipped with that reason; nothing else is.

Every block runs in a fresh directory holding the files the examples name (:data:`FILES`), with
``OPENAI_BASE_URL``/``OPENAI_API_KEY``/``RLM_MODEL`` pointing at a scripted OpenAI-compatible
server on 127.0.0.1 (:mod:`scripted_server`) and ``RLM_JOURNAL`` at a journal in that directory.
The server answers a loop turn with a ```` ```repl ```` block that calls ``FINAL`` (with a value
that matches the JSON Schema when the request carries one) and a sub-call with a short text.
A python block naming ``127.0.0.1:8000`` talks to an ``rlm serve`` the test starts on a free
port (the one place the text is changed: the port).

A block fails when it raises, exits non-zero, or leaves a run in its journal that did not
complete (unless the block names that status, as a block about a budget stop does).
"""
from __future__ import annotations

import gzip
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, clean_env, is_root, last_user
from scripted_server import ScriptedServer

#: The markdown files whose blocks are checked.
SOURCES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
VENV = Path(sys.prefix)
BIN = Path(sys.executable).parent
MODEL = "my-model"
API_KEY = "test-key"
NO_RUN = re.compile(r"^\s*<!--\s*no-run:\s*(.*?)\s*-->\s*$")
OPEN = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)[^`]*$")
RUN_LANGS = {"python", "bash", "repl"}
NOT_CODE = {"text", "console"}
TIMEOUT = 180

ESSAYS = ("Paul Graham wrote essays about startups. " * 40
          + "The secret passphrase for the Lisbon archive is amber-falcon-42. "
          + "He also wrote about programming languages and cities. " * 40)

#: The files every block's working directory holds (relative path -> text).
FILES = {
    "report.txt": "Annual supplier report.\nQ1 met its target. Q2 missed its target by 8%.\n"
                  "In 2019 we dropped Acme Metals as a supplier because of late deliveries.\n",
    "essays.txt": ESSAYS,
    "essay.txt": ESSAYS,
    "notes.md": "# Notes\n\nThe OOM kills started on 3 May after the cache change.\n",
    "notes.txt": "Meeting notes: the retry limit was raised to 6 attempts.\n",
    "contract.txt": "Clause 1: scope.\nClause 7.2: liability is limited to the fees paid.\n",
    "spec.txt": "The service answers within 200 ms at p99.\n",
    "big.log": "2024-05-03 10:00:01 INFO start\n2024-05-03 10:04:17 ERROR OOM kill pid 42\n",
    "logs/app.log": "2024-05-03 10:04:17 kernel: Out of memory: Killed process 42\n",
    "myrepo/README.md": "# myrepo\n\nRetries are configured in app/retry.py.\n",
    "myrepo/app/retry.py": "MAX_ATTEMPTS = 6\nBACKOFF_SECONDS = 0.5\n",
    "myrepo/tests/test_retry.py": "def test_retry():\n    assert True\n",
    "repo/client.py": "import requests\n\ndef get(url):\n    return requests.get(url)\n",
    "repo/util.py": "import json\n",
}
#: gzip files (relative path -> text).
GZ_FILES = {"logs/2024/05/app.log.gz": "2024-05-03 10:04:17 OOM kill pid 42\n"}


# --------------------------------------------------------------------------- the blocks

@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    no_run: str | None  # the reason, when marked

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}-{self.lang or 'none'}"


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of one markdown file (CommonMark fences; indented ones in lists too)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m["indent"]), m["fence"], m["info"].lower()
        prev = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
        mark = NO_RUN.match(prev)
        close = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        out.append(Block(path, i + 1, lang, "\n".join(body) + "\n",
                         mark.group(1) if mark else None))
        i = j + 1
    return out


BLOCKS = [b for src in SOURCES for b in blocks_of(src)]


def test_every_block_has_a_known_language_and_every_marker_a_reason():
    bad = [b.id for b in BLOCKS if b.lang not in RUN_LANGS | NOT_CODE | {"json"}]
    assert not bad, f"fences without a known language (python, bash, repl, json, text): {bad}"
    empty = [b.id for b in BLOCKS if b.no_run is not None and not b.no_run]
    assert not empty, f"<!-- no-run: --> without a reason: {empty}"
    stray = [b.id for b in BLOCKS if b.no_run is not None and b.lang not in RUN_LANGS]
    assert not stray, f"<!-- no-run --> before a block that is not code anyway: {stray}"
    for src in SOURCES:  # a marker whose block moved away would silently stop skipping
        lines = src.read_text(encoding="utf-8").splitlines()
        for n, ln in enumerate(lines):
            if NO_RUN.match(ln):
                nxt = next((x for x in lines[n + 1:] if x.strip()), "")
                assert OPEN.match(nxt), f"{src.relative_to(REPO)}:{n + 1}: no-run marker not " \
                                        "right before a fence"


def test_the_blocks_that_run_stay_few():
    """Each run costs a kernel start: keep the test under ~2.5 minutes."""
    assert len([b for b in BLOCKS if b.lang in RUN_LANGS and b.no_run is None]) <= 37


# --------------------------------------------------------------------------- the model

def schema_instance(schema: dict):
    """A small value that matches ``schema`` (the subset answer schemas use)."""
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return schema_instance(schema[key][0])
    if "enum" in schema:
        return schema["enum"][0]
    t = schema.get("type")
    t = t[0] if isinstance(t, list) else t
    if t == "object" or "properties" in schema:
        props = schema.get("properties", {})
        return {k: schema_instance(v) for k, v in props.items()}
    if t == "array":
        return [schema_instance(schema.get("items", {"type": "string"}))]
    if t == "integer":
        return max(1, int(schema.get("minimum", 1)))
    if t == "number":
        return float(max(1, schema.get("minimum", 1)))
    if t == "boolean":
        return True
    if t == "null":
        return None
    return "7.2"


_SCHEMA_TEXT = "matching this JSON Schema; call FINAL(value) with a dict/list/value (or its JSON text):\n"


def _schema_in(req: dict):
    for m in req.get("messages") or []:
        text = str(m.get("content") or "")
        at = text.find(_SCHEMA_TEXT)
        if at >= 0:
            return json.JSONDecoder().raw_decode(text[at + len(_SCHEMA_TEXT):])[0]
    return None


DEFAULT_REPLY = "```repl\nprint(type(context).__name__, len(context))\nFINAL('scripted answer')\n```"


def responder(repl_block: str | None = None):
    """Loop turns: the schema's instance, else ``repl_block``, else :data:`DEFAULT_REPLY`.
    Sub-calls (no system prompt): the passphrase when asked about it, else a short text."""
    def respond(req: dict):
        if not is_root(req):
            return "amber-falcon-42" if "passphrase" in last_user(req) else "scripted sub-answer"
        schema = _schema_in(req)
        if schema is not None:
            return f"```repl\nFINAL({schema_instance(schema)!r})\n```"
        return f"```repl\n{repl_block}```" if repl_block else DEFAULT_REPLY
    return respond


# --------------------------------------------------------------------------- running

@pytest.fixture
def workdir(tmp_path) -> Path:
    for rel, text in FILES.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    for rel, text in GZ_FILES.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(gzip.compress(text.encode()))
    (tmp_path / ".venv").symlink_to(VENV, target_is_directory=True)
    return tmp_path


def _env(srv: ScriptedServer, workdir: Path) -> dict:
    return clean_env(OPENAI_BASE_URL=srv.base_url, OPENAI_API_KEY=API_KEY, RLM_MODEL=MODEL,
                     RLM_JOURNAL=str(workdir / "journal.sqlite3"),
                     PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                     PYTHONUNBUFFERED="1")


def _runs(journal: Path) -> list[tuple[str, str]]:
    if not journal.exists():
        return []
    con = sqlite3.connect(f"file:{journal}?mode=ro", uri=True)
    try:
        return list(con.execute("SELECT run_id, status FROM runs ORDER BY created_at"))
    finally:
        con.close()


def _check_runs(block: Block, journal: Path) -> None:
    named = {s for s in ("budget_exceeded", "cancelled") if s in block.code}
    unfinished = [(r, s) for r, s in _runs(journal) if s != "completed" and s not in named]
    assert not unfinished, f"{block.id}: runs that did not complete: {unfinished}"


class _Serve:
    """``rlm serve --port 0`` in a subprocess, for the blocks that are its clients."""

    def __init__(self, env: dict, workdir: Path) -> None:
        self.proc = subprocess.Popen(
            [str(BIN / "rlm"), "serve", "--port", "0", "--journal", str(workdir / "serve.sqlite3")],
            cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        self.port = None
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line or "")
            if m:
                self.port = int(m.group(1))
                return
            if not line and self.proc.poll() is not None:
                break
        self.close()
        pytest.fail("rlm serve did not start")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _run(argv: list[str], block: Block, workdir: Path, env: dict) -> None:
    p = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True,
                       timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, (f"{block.id} exited {p.returncode}\n--- block\n{block.code}"
                               f"--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}")


def _runnable(lang: str) -> list:
    return [pytest.param(b, id=b.id, marks=[pytest.mark.skip(reason=b.no_run)] if b.no_run else [])
            for b in BLOCKS if b.lang == lang]


@pytest.mark.parametrize("block", _runnable("python"))
def test_python_block(block: Block, workdir: Path, scripted):
    srv = scripted(responder())
    env = _env(srv, workdir)
    code, serve = block.code, None
    if "127.0.0.1:8000" in code:
        serve = _Serve(env, workdir)
        code = code.replace("127.0.0.1:8000", f"127.0.0.1:{serve.port}")
    script = workdir / "block.py"
    script.write_text(code, encoding="utf-8")
    try:
        _run([sys.executable, str(script)], block, workdir, env)
    finally:
        if serve is not None:
            serve.close()
    _check_runs(block, workdir / "journal.sqlite3")


@pytest.mark.parametrize("block", _runnable("bash"))
def test_bash_block(block: Block, workdir: Path, scripted):
    srv = scripted(responder())
    script = workdir / "block.sh"
    script.write_text(block.code, encoding="utf-8")
    _run(["bash", "-euo", "pipefail", str(script)], block, workdir, _env(srv, workdir))
    _check_runs(block, workdir / "journal.sqlite3")


@pytest.mark.parametrize("block", _runnable("repl"))
def test_repl_block(block: Block, workdir: Path, scripted):
    import rlm
    srv = scripted(responder(block.code))
    res = rlm.completion(workdir / "essays.txt", "What is the secret passphrase?",
                         base_url=srv.base_url, api_key=API_KEY, model=MODEL, max_depth=2,
                         max_iterations=2, journal=str(workdir / "journal.sqlite3"))
    assert res.status == "completed", (block.id, res.status, res.reason)
    assert res.answer != "scripted answer" and res.stages.get("cell"), (block.id, res)  # it ran


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in BLOCKS if b.lang == "json"])
def test_json_block(block: Block):
    json.loads(block.code)
