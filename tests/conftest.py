"""Shared fixtures for the integration tests.

Everything here drives the real code paths: a real HTTP server on 127.0.0.1
(:mod:`scripted_server`) speaking OpenAI chat completions to the real
``openai`` client, real Jupyter kernels, and the real ``rlm`` CLI in a
subprocess. Nothing is mocked.

- ``journal_path``: ``RLM_JOURNAL`` pointed at a fresh file under ``tmp_path``
  (``RLM_CACHE_DIR`` is left alone: it holds token ranks and model weights).
- ``scripted``: a factory ``scripted(responder, latency=0.0) -> ScriptedServer``;
  each server is started and shut down around the test.
- :func:`script`: a responder from a list of root replies, answering sub-calls
  (requests with no system message) from another function.
- ``cli``: runs ``python -m rlm ...`` in a subprocess with a clean environment.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from scripted_server import Reply, ScriptedServer  # noqa: E402

#: Arguments for every API run against a scripted server (plus base_url).
API_KEY = "test-key"
MODEL = "m"


# --------------------------------------------------------------------------- requests


def is_root(req: dict) -> bool:
    """A root/child loop turn starts with the system prompt; sub-calls have none."""
    msgs = req.get("messages") or []
    return bool(msgs) and msgs[0].get("role") == "system"


def last_user(req: dict) -> str:
    for m in reversed(req.get("messages") or []):
        if m.get("role") == "user":
            return str(m.get("content") or "")
    return ""


def root_requests(srv: ScriptedServer) -> list[dict]:
    with srv._lock:
        return [r for r in srv.requests if is_root(r)]


def sub_requests(srv: ScriptedServer) -> list[dict]:
    with srv._lock:
        return [r for r in srv.requests if not is_root(r)]


def repl(*lines: str) -> str:
    """A model reply holding one ```repl block with ``lines``."""
    return "```repl\n" + "\n".join(lines) + "\n```"


# --------------------------------------------------------------------------- responders


@dataclass
class Script:
    """A responder: root turns come from ``replies`` in order; sub-calls from ``sub``.

    Each root reply is a ``str``, a :class:`Reply`, or a callable ``f(request) -> str | Reply``
    (so a turn can use what the previous cell printed). Past the last reply the server
    answers HTTP 400 (not retried), so a run that asks for more turns than scripted fails
    fast instead of hanging. ``root_seen``/``sub_seen`` count requests per kind.
    """

    replies: list
    sub: Callable[[dict], Any] | None = None

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.root_seen = 0
        self.sub_seen = 0
        self.exhausted = False

    def __call__(self, req: dict):
        if not is_root(req):
            with self._lock:
                self.sub_seen += 1
            if self.sub is None:
                return Reply(status=400, content="this script expects no sub-calls")
            return self.sub(req)
        with self._lock:
            i = self.root_seen
            self.root_seen += 1
        if i >= len(self.replies):
            self.exhausted = True
            return Reply(status=400, content=f"script exhausted after {len(self.replies)} root replies")
        r = self.replies[i]
        return r(req) if callable(r) and not isinstance(r, (str, Reply)) else r


def script(replies: Iterable, sub: Callable[[dict], Any] | None = None) -> Script:
    """Build a responder from root replies, answering sub-calls with ``sub(request)``."""
    return Script(list(replies), sub)


def echo_sub(req: dict) -> str:
    """A sub-call answer that depends on the prompt: ``SUB:<first 40 chars>``."""
    return "SUB:" + last_user(req)[:40]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def journal_path(tmp_path, monkeypatch) -> Path:
    """Point ``RLM_JOURNAL`` at a fresh journal file for this test."""
    p = tmp_path / "journal.sqlite3"
    monkeypatch.setenv("RLM_JOURNAL", str(p))
    return p


@pytest.fixture
def scripted():
    """Factory: ``srv = scripted(responder, latency=0.0)`` -> a started ScriptedServer."""
    servers: list[ScriptedServer] = []

    def start(responder: Callable[[dict], Any], latency: float = 0.0) -> ScriptedServer:
        srv = ScriptedServer(responder, latency=latency)
        # serve_forever polls for shutdown every 0.5 s by default: 0.5 s of teardown per test
        srv._thread = threading.Thread(target=srv.httpd.serve_forever,
                                       kwargs={"poll_interval": 0.02}, daemon=True)
        srv.__enter__()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.__exit__(None, None, None)


@pytest.fixture
def api(scripted):
    """``run = api(responder, context, query, **options)``: one API run against a scripted
    server with the usual test endpoint options; returns ``(result, server)``."""
    import rlm

    def go(responder, context: Any = "some context", query: str | None = "q?", **options):
        srv = scripted(responder)
        o = dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL, journal=False)
        o.update(options)
        return rlm.completion(context, query, **o), srv

    return go


def closed_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (bound, then closed)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def strict_sandbox() -> str:
    """The sandbox mode of tests that need the sandbox and its limits: ``required`` where
    per-kernel control groups can be made (elsewhere ``required`` refuses to start a kernel),
    else ``auto`` (bubblewrap, with the per-process limits standing in)."""
    from kernels import cgroups
    return "required" if cgroups.unavailable() is None else "auto"


def clean_env(**extra: str) -> dict:
    """The host environment minus endpoint/journal settings, with the repo importable."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OPENAI_", "RLM_")) or k == "RLM_CACHE_DIR"}
    # the checked-out code, whatever the editable install maps `rlm` to
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


@dataclass
class CLIResult:
    rc: int
    stdout: str
    stderr: str
    seconds: float


@pytest.fixture
def cli(tmp_path):
    """``cli(*args, input=None, env=None, timeout=90) -> CLIResult``: run ``python -m rlm``.

    The environment is :func:`clean_env` with ``RLM_JOURNAL`` set to a file under
    ``tmp_path`` (shared by every call in the test, so runs can be looked up again).
    """
    journal = tmp_path / "cli-journal.sqlite3"

    def run(*args: str, input: str | bytes | None = None, env: dict | None = None,
            timeout: float = 90) -> CLIResult:
        e = clean_env(RLM_JOURNAL=str(journal))
        if env:
            e.update(env)
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "rlm", *args], cwd=tmp_path, env=e,
                           input=input.encode() if isinstance(input, str) else input,
                           capture_output=True, timeout=timeout)
        return CLIResult(p.returncode, p.stdout.decode("utf-8", "replace"),
                         p.stderr.decode("utf-8", "replace"), time.monotonic() - t0)

    run.journal = journal  # type: ignore[attr-defined]
    return run


def endpoint_args(srv: ScriptedServer) -> list[str]:
    return ["--base-url", srv.base_url, "--api-key", API_KEY, "--model", MODEL]


def assert_clean_error(res: CLIResult, rc: int, *needles: str) -> None:
    """A CLI failure: exit ``rc``, one ``rlm: error:`` line naming the problem, no traceback."""
    assert res.rc == rc, (res.rc, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    errs = [ln for ln in res.stderr.splitlines() if ln.startswith("rlm: error:")]
    assert len(errs) == 1, res.stderr
    for n in needles:
        assert re.search(n, errs[0], re.IGNORECASE), (n, errs[0])


@pytest.fixture(scope="session")
def trajectory(tmp_path_factory):
    """The run the viewer, live-view and OpenTelemetry tests look at (``trajectory_run``),
    journaled once per session: ``(journal_path, run_id, result)``."""
    import trajectory_run
    journal = tmp_path_factory.mktemp("trajectory") / "journal.sqlite3"
    run_id, res = trajectory_run.make_run(journal)
    assert res.status == "completed" and res.answer == trajectory_run.ANSWER, res
    return journal, run_id, res


# --------------------------------------------------------------------------- PostgreSQL


_PG_SERVERS: list[str] = []


@pytest.fixture(scope="session")
def pg_server():
    """A real PostgreSQL server for the session (:func:`evals.pg_server.temporary_server`:
    ``initdb``/``pg_ctl`` in a temporary directory, as ``postgres`` when run as root, on
    127.0.0.1 and a free port). Yields the URL of its ``rlm`` database."""
    from evals.pg_server import temporary_server
    try:
        with temporary_server() as url:
            _PG_SERVERS.append(url)  # for test_zz_verify_all
            yield url
    except FileNotFoundError as exc:
        pytest.fail(f"{exc} (scripts/test.sh installs it)")


@pytest.fixture
def pg_url(pg_server, request) -> str:
    """A fresh, empty journal on the session's server: its own schema in the ``rlm`` database
    (``search_path`` in the URL, the schema named after the test), so tests never see each
    other's runs."""
    from evals.pg_server import fresh_schema
    return fresh_schema(pg_server, prefix=request.node.name)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``last`` run after every other one, in their own order (the verify-all pass
    reads every journal the rest of the suite wrote); the sort is stable, so the rest keep theirs."""
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)
