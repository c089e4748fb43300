"""Sub-calls to a separate endpoint (``sub_base_url``): root and child turns go to the run's
endpoint (server A), ``llm_query``, ``llm_query_batched`` and depth-limit fallbacks to the
sub-call endpoint (server B), each with its own key; the journal keeps B's URL and neither key;
a run that failed at B resumes once B is up, and replays sending nothing to either.

Two real HTTP servers on 127.0.0.1 speaking the OpenAI protocol, real kernels, a real SQLite
journal, and the real ``rlm`` CLI in a subprocess.
"""
from __future__ import annotations

import json

import pytest

import rlm
from conftest import (API_KEY, MODEL, assert_clean_error, closed_port, endpoint_args, is_root,
                      last_user, repl, script)
from harness.journal import Journal
from rlm.api import replay, resume
from scripted_server import Reply

SUB_KEY = "sub-secret-key-b7"  # B's; A's is API_KEY


def sub_only(req: dict):
    """B's responder: a sub-call's answer names its prompt; a loop's turn is refused (400)."""
    if is_root(req):
        return Reply(status=400, content="a loop's turn reached the sub-call endpoint")
    return "B:" + last_user(req)[:30]


def root_only(replies: list):
    """A's responder: the loop turns in order; a sub-call is refused (400, not retried)."""
    return script(replies, sub=lambda req: Reply(status=400, content="a sub-call reached A"))


def journal_bytes(path) -> bytes:
    """Every byte of a SQLite journal: the file and its write-ahead log, if one is left."""
    return b"".join(p.read_bytes() for p in path.parent.glob(path.name + "*"))


def completion(a, b, context="some context", **kw):
    kw.setdefault("journal", False)
    return rlm.completion(context, "q?", base_url=a.base_url, api_key=API_KEY, model=MODEL,
                          sub_base_url=b.base_url, **kw)


# --------------------------------------------------------------------------- where calls go


def test_subcalls_go_to_the_sub_endpoint_with_its_key_and_loops_stay_on_the_runs(scripted,
                                                                                 tmp_path):
    a = scripted(root_only([
        repl("x = llm_query('one')", "ys = llm_query_batched(['two', 'three'])",
             "z = rlm('four', 'what?')", "print(x, ys, z)"),
        repl("FINAL('|'.join([x, *ys, z]))")]))
    b = scripted(sub_only)
    journal = tmp_path / "j.sqlite3"
    res = completion(a, b, sub_api_key=SUB_KEY, journal=str(journal), run_id="split-1")
    assert res.status == "completed", res.reason
    parts = res.answer.split("|")
    assert parts[:3] == ["B:one", "B:two", "B:three"] and parts[3].startswith("B:")
    # A: the two root turns, with A's key; B: the four sub-calls (a fallback among them)
    assert len(a.requests) == 2 and all(is_root(r) for r in a.requests)
    assert len(b.requests) == 4 and not any(is_root(r) for r in b.requests)
    assert a.auth == [f"Bearer {API_KEY}"] * 2
    assert b.auth == [f"Bearer {SUB_KEY}"] * 4
    assert res.stages.get("fallback") == 1 and res.stages.get("llm_query") == 3
    assert res.usage["calls"] == 6  # every call counted, whichever endpoint served it
    # the journal: B's URL in the run's options, neither key anywhere in its bytes
    j = Journal(str(journal))
    try:
        options = j.get_run("split-1")["options"]
    finally:
        j.close()
    assert options["sub_base_url"] == b.base_url and "sub_api_key" not in options
    raw = journal_bytes(journal)
    assert b.base_url.encode() in raw
    assert SUB_KEY.encode() not in raw and API_KEY.encode() not in raw


def test_a_childs_turns_stay_on_the_runs_endpoint_and_its_subcalls_go_to_the_sub_one(scripted):
    # root turn, the child's turn (same server, in order: the root waits on the child), root
    a = scripted(root_only([repl("c = rlm('child context', 'child q')", "print(c)"),
                            repl("FINAL(llm_query('from child'))"),
                            repl("FINAL(c)")]))
    b = scripted(sub_only)
    res = completion(a, b, sub_api_key=SUB_KEY, max_depth=2)
    assert res.status == "completed" and res.answer == "B:from child", res.reason
    assert res.stages.get("child") == 1
    assert len(a.requests) == 3 and len(b.requests) == 1


def test_a_checked_fallback_goes_to_the_sub_endpoint_too(scripted):
    a = scripted(root_only([repl("FINAL(rlm('four', 'what?', schema={'type': 'integer'}))")]))
    b = scripted(lambda req: "42" if not is_root(req) else Reply(status=400))
    res = completion(a, b, sub_api_key=SUB_KEY)
    assert res.status == "completed" and res.answer == "42", res.reason  # its JSON text
    assert len(a.requests) == 1 and len(b.requests) == 1


def test_a_sub_endpoint_needing_a_key_that_was_not_given_says_what_to_set(scripted,
                                                                       monkeypatch):
    monkeypatch.delenv("RLM_SUB_API_KEY", raising=False)
    a = scripted(root_only([repl("print(llm_query('one'))"), repl("FINAL('no')")]))
    b = scripted(lambda req: "ok" if req["_auth"] == f"Bearer {SUB_KEY}"
                 else Reply(status=401, content="invalid api key"))
    with pytest.raises(rlm.EndpointError) as err:
        completion(a, b)
    msg = str(err.value)
    assert "sub-call endpoint" in msg and b.base_url in msg and "HTTP 401" in msg
    assert "RLM_SUB_API_KEY" in msg and "--api-key" not in msg, msg
    assert b.auth == ["Bearer EMPTY"]  # the run's own key is never sent to B
    assert len(a.requests) == 1  # the run ended there: no further turn
    # the same with the key from the environment: it goes through
    monkeypatch.setenv("RLM_SUB_API_KEY", SUB_KEY)
    a2 = scripted(root_only([repl("FINAL(llm_query('one'))")]))
    assert completion(a2, b).answer == "ok" and b.auth[-1] == f"Bearer {SUB_KEY}"


def test_a_refused_key_quoted_back_is_redacted_and_still_ends_the_run(scripted, tmp_path):
    # OpenAI's 401 quotes the key it was sent: taken out where the text enters the host, and
    # the error, rebuilt without it, still says the endpoint refused its key
    a = scripted(root_only([repl("print(llm_query('one'))"), repl("FINAL('no')")]))
    b = scripted(lambda req: Reply(status=401, content="Incorrect API key provided: "
                                   + req["_auth"].split()[-1]))
    journal = tmp_path / "j.sqlite3"
    with pytest.raises(rlm.EndpointError) as err:
        completion(a, b, sub_api_key="wrong-sub-key-123", journal=str(journal))
    msg = str(err.value)
    assert "HTTP 401" in msg and "[redacted]" in msg and "wrong-sub-key" not in msg, msg
    assert len(a.requests) == 1
    assert b"wrong-sub-key" not in journal_bytes(journal)


def test_a_failed_request_at_the_sub_endpoint_is_the_codes_to_handle(scripted):
    # one request refused (400) is not the endpoint failing: the cell catches it, the run goes on
    a = scripted(root_only([
        repl("try:", "    llm_query('bad')", "except SubcallError as e:", "    print('caught', e)"),
        lambda req: repl("FINAL('went on')") if "sub-call endpoint" in last_user(req)
        else repl("FINAL('the error did not name the sub-call endpoint')")]))
    b = scripted(lambda req: Reply(status=400, content="bad request"))
    res = completion(a, b, sub_api_key=SUB_KEY)
    assert res.status == "completed" and res.answer == "went on", res.reason
    assert len(b.requests) == 1  # a 400 is not retried


# --------------------------------------------------------------------------- resume and replay


def test_a_run_failed_at_a_down_sub_endpoint_resumes_when_it_is_up_and_replays_free(
        scripted, tmp_path, monkeypatch):
    up = {"b": False}
    a = scripted(root_only([repl("x = llm_query('one')", "print(x)"), repl("FINAL(x)")]))
    b = scripted(lambda req: sub_only(req) if up["b"] else Reply(reset=True))
    journal = str(tmp_path / "j.sqlite3")
    with pytest.raises(rlm.EndpointError) as err:
        completion(a, b, sub_api_key=SUB_KEY, journal=journal, run_id="b-down", max_attempts=2)
    msg = str(err.value)
    assert "sub-call endpoint" in msg and "unreachable" in msg and b.base_url in msg
    assert "--sub-base-url" in msg and err.value.result.status == "failed"
    assert len(a.requests) == 1 and len(b.requests) == 2  # both attempts, then the run ended
    # B is up again: resume (the key from the environment, the URL from the journal)
    up["b"] = True
    monkeypatch.setenv("RLM_SUB_API_KEY", SUB_KEY)
    res = resume("b-down", journal=journal, context="some context")
    assert res.status == "completed" and res.answer == "B:one", res.reason
    assert len(a.requests) == 2  # the first turn served from the journal, the second sent
    assert len(b.requests) == 3 and b.auth[-1] == f"Bearer {SUB_KEY}"
    # a replay sends nothing to either endpoint
    monkeypatch.delenv("RLM_SUB_API_KEY")
    again = replay("b-down", journal=journal, context="some context")
    assert again.answer == "B:one" and again.replayed_calls == 3  # two turns, one sub-call
    assert len(a.requests) == 2 and len(b.requests) == 3


# --------------------------------------------------------------------------- bad input


def test_sub_endpoint_options_are_checked_before_anything_runs(monkeypatch):
    from rlm.config.validate import validate_options
    for var in ("OPENAI_BASE_URL", "OPENAI_API_KEY", "RLM_SUB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(rlm.ConfigError, match="sub_api_key is the key of the sub-call endpoint"):
        validate_options({"base_url": "http://127.0.0.1:1/v1", "sub_api_key": "k" * 10})
    with pytest.raises(rlm.ConfigError, match="--sub-base-url needs the run's own endpoint"):
        validate_options({"sub_base_url": "http://127.0.0.1:1/v1"})
    with pytest.raises(rlm.ConfigError, match="--sub-base-url must be an http"):
        validate_options({"base_url": "http://127.0.0.1:1/v1", "sub_base_url": "127.0.0.1:1"})
    with pytest.raises(rlm.ConfigError, match="RLM_SUB_API_KEY") as err:
        validate_options({"base_url": "http://127.0.0.1:1/v1",
                          "sub_base_url": "http://u:pw-in-url@127.0.0.1:1/v1"})
    assert "pw-in-url" not in str(err.value)
    # a key in the environment without a URL changes nothing
    monkeypatch.setenv("RLM_SUB_API_KEY", SUB_KEY)
    validate_options({"base_url": "http://127.0.0.1:1/v1"})


# --------------------------------------------------------------------------- the CLI


def test_cli_sends_subcalls_to_the_sub_endpoint_with_the_key_from_the_environment(
        cli, scripted, tmp_path):
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("some context")
    a = scripted(root_only([repl("FINAL(llm_query('one'))")]))
    b = scripted(sub_only)
    res = cli("run", "--context", str(ctx), "--query", "q", *endpoint_args(a), "--sub-base-url",
              b.base_url, "--run-id", "cli-split", "--json", env={"RLM_SUB_API_KEY": SUB_KEY})
    assert res.rc == 0, res.stderr
    assert json.loads(res.stdout)["answer"] == "B:one"
    assert a.auth == [f"Bearer {API_KEY}"] and b.auth == [f"Bearer {SUB_KEY}"]
    assert SUB_KEY not in res.stdout + res.stderr
    raw = journal_bytes(cli.journal)
    assert b.base_url.encode() in raw and SUB_KEY.encode() not in raw
    # the key has no flag: --help names the variable only, and a flag for it is refused
    helped = cli("run", "--help")
    assert "--sub-base-url" in helped.stdout and "RLM_SUB_API_KEY" in helped.stdout
    assert "--sub-api-key" not in helped.stdout
    refused = cli("run", "--context", str(ctx), "--sub-api-key", SUB_KEY)
    assert refused.rc == 2 and "unrecognized arguments" in refused.stderr


def test_cli_unreachable_sub_endpoint_exits_3_then_resumes_with_the_flag(cli, scripted,
                                                                        tmp_path):
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("some context")
    a = scripted(root_only([repl("x = llm_query('one')", "print(x)"), repl("FINAL(x)")]))
    down = f"http://127.0.0.1:{closed_port()}/v1"
    res = cli("run", "--context", str(ctx), "--query", "q", *endpoint_args(a), "--sub-base-url",
              down, "--max-attempts", "2", "--run-id", "cli-down", env={
                  "RLM_SUB_API_KEY": SUB_KEY}, timeout=120)
    assert_clean_error(res, 3, "sub-call endpoint", "unreachable", down.replace(".", r"\."),
                       "--sub-base-url")
    assert res.stdout == ""
    # resumed with the endpoint's new address: the flag overrides the recorded one
    b = scripted(sub_only)
    res = cli("resume", "cli-down", "--sub-base-url", b.base_url, "--json",
              env={"RLM_SUB_API_KEY": SUB_KEY})
    assert res.rc == 0, res.stderr
    assert json.loads(res.stdout)["answer"] == "B:one"
    assert len(a.requests) == 2 and b.auth == [f"Bearer {SUB_KEY}"]
