"""An upstream that echoes the API key it was sent in its error text: the key never reaches the
caller's exception, the kernel (a failed ``llm_query``), the journal or the terminal."""
from __future__ import annotations

import json
import sqlite3

import pytest

import rlm
from conftest import repl
from rlm.models.openai_compat import OpenAICompatClient
from scripted_server import Reply, ScriptedServer

KEY = "sk-echoed-4f9a1c2b7d"
ECHO = f"Incorrect API key provided: {KEY}"


def test_the_clients_error_does_not_carry_the_echoed_key():
    with ScriptedServer(lambda req: Reply(ECHO, status=401)) as srv:
        with pytest.raises(rlm.EndpointError) as err:
            OpenAICompatClient(srv.base_url, KEY, max_attempts=1).complete(
                [{"role": "user", "content": "hi"}], "m")
    assert KEY not in str(err.value) and "[redacted]" in str(err.value)


def test_a_failed_sub_call_shows_the_kernel_no_key_and_the_journal_keeps_none(tmp_path):
    journal = tmp_path / "j.sqlite3"

    def respond(req):
        last = req["messages"][-1]["content"]
        if "PROBE" in last:  # the llm_query: the upstream fails, echoing the key
            return Reply(ECHO, status=401)
        users = [m for m in req["messages"] if m["role"] == "user"]
        if len(users) == 1:
            return repl("try:\n    llm_query('PROBE')\nexcept Exception as e:\n    print('ERR', e)")
        return repl("FINAL('done')")

    with ScriptedServer(respond) as srv:
        res = rlm.completion("ctx", "q", base_url=srv.base_url, api_key=KEY, model="m",
                             journal=str(journal), max_attempts=1)
        feedback = json.dumps([r["messages"] for r in srv.requests])
    assert res.status == "completed", res.reason
    assert "ERR" in feedback and "[redacted]" in feedback  # the kernel saw the failure...
    assert KEY not in feedback  # ...but not the key
    with sqlite3.connect(journal) as db:
        dump = "\n".join(db.iterdump())
    assert KEY not in dump
