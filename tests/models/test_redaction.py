"""One redaction at the border (harness/redact.py, rlm/models/transport.py): provider text is
cleaned where it enters the host, so a key an upstream quotes reaches no journal, export,
view, log line, kernel or model request.

A real ``rlm run -v`` against the scripted endpoint, whose replies quote the key in use, the
``Authorization`` header, base64 of the key and of ``user:KEY``, and the value of a key
variable of the host: in transient errors (retried: several attempts journaled), in an error a
sub-call gets (it reaches the cell, and from there the next model request), and in a
successful reply. None of them may be found in the SQLite journal's bytes, ``rlm export``,
``rlm view``'s HTML, or what the run printed.
"""
from __future__ import annotations

import base64
import secrets
from pathlib import Path

from conftest import MODEL, is_root, last_user, repl
from harness.redact import KEYLIKE, REDACTED, Redactor
from scripted_server import Reply

KEY = "sk-live-" + secrets.token_hex(20)
ENV_KEY = "envkey-" + secrets.token_hex(16)  # ANTHROPIC_API_KEY of the host: not sk-shaped


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


LEAK = (f"invalid api key {KEY}; request had 'Authorization: Bearer {KEY}'; token={_b64(KEY)}; "
        f"basic={_b64('user:' + KEY)}; url-safe={base64.urlsafe_b64encode(KEY.encode()).decode()}"
        f"; other key {ENV_KEY}")
#: Strings that must be found nowhere: the keys, and the parts of base64 text that hold them.
NEEDLES = sorted({KEY, ENV_KEY, "Bearer " + KEY, _b64(KEY)}
                 | set(Redactor([KEY, ENV_KEY]).needles), key=len)


def _nowhere(where: str, text: str | bytes) -> None:
    data = text if isinstance(text, bytes) else text.encode()
    for n in NEEDLES:
        assert n.encode() not in data, f"{n!r} found in {where}"


def test_a_key_an_upstream_quotes_is_nowhere_the_run_writes_or_prints(cli, scripted, tmp_path):
    root_seen = {"n": 0}

    def respond(req):
        if not is_root(req):
            p = last_user(req)
            if p == "leak please":
                return Reply(status=400, content=LEAK)  # not retried: the cell gets it
            return "the key is " + KEY + " and " + ENV_KEY  # a 200 quoting them
        root_seen["n"] += 1
        if root_seen["n"] <= 2:
            return Reply(status=500, content=LEAK)  # transient: retried, each attempt journaled
        if root_seen["n"] == 3:
            return repl("try:", "    r = llm_query('leak please')",
                        "except Exception as e:", "    r = 'ERR ' + str(e)",
                        "print(r)", "print(llm_query('echo'))")
        return repl("FINAL('done')")

    srv = scripted(respond)
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("some context")
    env = {"ANTHROPIC_API_KEY": ENV_KEY}
    run = cli("run", "--context", str(ctx), "--query", "q", "--base-url", srv.base_url,
              "--api-key", KEY, "--model", MODEL, "--run-id", "leaky", "-v", env=env,
              timeout=180)
    assert run.rc == 0, run.stderr
    assert run.stdout.strip() == "done"
    assert "model call to" in run.stderr and REDACTED in run.stderr  # -v printed the attempts
    _nowhere("rlm run -v's output", run.stdout + run.stderr)
    # what the cell saw, and the next model request carried, was cleaned too
    later = [r for r in srv.requests if is_root(r)][-1]
    assert "ERR " in str(later["messages"]) and REDACTED in str(later["messages"])
    _nowhere("the model requests", str(srv.requests[3:]))

    journal = Path(cli.journal)
    files = [p for p in journal.parent.iterdir() if p.name.startswith(journal.name)]
    assert journal in files
    for f in files:  # the database and its -wal/-shm, byte for byte
        _nowhere(f.name, f.read_bytes())
    export = cli("export", "leaky", env=env)
    assert export.rc == 0, export.stderr
    assert REDACTED in export.stdout and '"n": 2' in export.stdout  # the attempts are there
    _nowhere("rlm export", export.stdout)
    view = cli("view", "leaky", "-o", str(tmp_path / "view.html"), env=env)
    assert view.rc == 0, view.stderr
    html = (tmp_path / "view.html").read_text()
    assert "invalid api key" in html
    _nowhere("rlm view", html)


def test_the_redactor_takes_out_keys_their_base64_and_key_shapes():
    r = Redactor([KEY, "EMPTY", "short"])
    assert r.secrets == [KEY]
    out = r.text(LEAK)
    for n in (KEY, _b64(KEY), "Bearer " + KEY):
        assert n not in out
    assert ENV_KEY in out  # not given to this one: left as is
    assert KEYLIKE.search(out) is None
    assert r.secrets_out("a reply about sk-example keys") == "a reply about sk-example keys"
    value = {"choices": [{"message": {"content": "it is " + KEY}}], "n": 1}
    assert r.value(value) == {"choices": [{"message": {"content": "it is " + REDACTED}}], "n": 1}
    same = {"a": ["b"]}
    assert r.value(same) is same
