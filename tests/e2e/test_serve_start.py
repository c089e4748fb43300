"""``rlm serve`` refuses at start what every request would fail on (exit 2, one clear line), and
a server without a journal refuses an Idempotency-Key it could not honour."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import API_KEY, MODEL, clean_env, closed_port, repl
from scripted_server import ScriptedServer


def _serve(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlm", "serve", "--port", str(closed_port()),
                           *args], env=clean_env(), capture_output=True, text=True, cwd=cwd,
                          timeout=60)


@pytest.mark.parametrize("case", ["missing price file", "malformed price file",
                                  "endpoint without a model"])
def test_what_every_request_would_fail_on_is_refused_at_start(case, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    args = {"missing price file": ["--base-url", "http://127.0.0.1:9/v1", "--model", MODEL,
                                   "--price-file", str(tmp_path / "nope.json")],
            "malformed price file": ["--base-url", "http://127.0.0.1:9/v1", "--model", MODEL,
                                     "--price-file", str(bad)],
            "endpoint without a model": ["--base-url", "http://127.0.0.1:9/v1"]}[case]
    r = _serve(*args, "--no-journal", cwd=tmp_path)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.startswith("rlm: error:") and "Traceback" not in r.stderr


def test_a_server_without_a_journal_refuses_an_idempotency_key(tmp_path):
    from starlette.testclient import TestClient

    from rlm.serve.server import create_app
    with ScriptedServer(lambda req: repl("FINAL('ok')")) as srv:
        app = create_app({"base_url": srv.base_url, "api_key": API_KEY, "model": MODEL,
                          "journal": False})
        with TestClient(app) as client:
            body = {"model": "rlm", "messages": [{"role": "user", "content": "q"}]}
            r = client.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": "k1"})
            assert r.status_code == 400, r.text
            assert "no journal" in r.json()["error"]["message"]
            assert len(srv.requests) == 0  # nothing was run, nothing paid
            r = client.post("/v1/chat/completions", json=body)  # without a key: served
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
