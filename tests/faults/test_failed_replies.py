"""Issue 26, kind 5: a reply that says it failed is a failure, and a file that its format's
parser gives up on is bad input, never an internal error.

Provider half: a ``200`` whose body is an error object (OpenAI's ``{"error": {...}}``, vLLM's
``{"object": "error"}``, Anthropic's ``{"type": "error"}``, OpenRouter's error inside a choice)
is classified like the status it stands for: retried when transient, refused at once when not,
and its message shown. Real ``openai``/``anthropic`` clients against the scripted servers.

File half: each parser's own limits (``csv``'s 131,072-character field, nesting past the
recursion limit, integers of more than 4,300 digits) through the real CLI: exit 2 with a message
that says what to do for a single file, kept as text with a note inside a directory.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import API_KEY, MODEL, Reply, assert_clean_error, endpoint_args, repl
from rlm.context.load import describe, load_context
from rlm.errors import ContextError, EndpointError
from rlm.models.openai_compat import OpenAICompatClient

MSGS = [{"role": "user", "content": "hello"}]

TRANSIENT_BODIES = {
    "openai server_error": {"error": {"message": "upstream overloaded, try again",
                                      "type": "server_error", "code": None}},
    "an error with no type": {"error": {"message": "upstream overloaded, try again"}},
    "a numeric 503 code": {"error": {"code": 503, "message": "upstream overloaded, try again",
                                     "status": "UNAVAILABLE"}},
    "vLLM ErrorResponse": {"object": "error", "message": "upstream overloaded, try again",
                           "type": "ServiceUnavailableError", "code": 503},
    "anthropic overloaded": {"type": "error", "error": {"type": "overloaded_error",
                                                        "message": "upstream overloaded, try again"}},
    "a rate limit": {"error": {"message": "upstream overloaded, try again",
                               "type": "rate_limit_exceeded"}},
    "openrouter error in a choice": {"id": "x", "choices": [{
        "index": 0, "finish_reason": "error", "message": {"role": "assistant", "content": ""},
        "error": {"code": 502, "message": "upstream overloaded, try again"}}]},
}

PERMANENT_BODIES = {
    "invalid request": ({"error": {"message": "model 'zz' does not exist",
                                   "type": "invalid_request_error", "code": "model_not_found"}},
                        "model 'zz' does not exist"),
    "a numeric 401": ({"error": {"code": 401, "message": "bad key"}}, "bad key"),
    "no quota": ({"error": {"message": "You exceeded your current quota",
                            "type": "insufficient_quota", "code": "insufficient_quota"}},
                 "exceeded your current quota"),
}


def _client(srv, attempts: int = 4) -> OpenAICompatClient:
    return OpenAICompatClient(srv.base_url, API_KEY, max_attempts=attempts, backoff_base=0.01,
                              backoff_max=0.02)


@pytest.mark.parametrize("shape", sorted(TRANSIENT_BODIES))
def test_an_error_body_with_status_200_is_retried_when_transient(scripted, shape):
    calls = []

    def responder(req):
        calls.append(1)
        if len(calls) < 3:
            return Reply(body=TRANSIENT_BODIES[shape])
        return "fine now"

    srv = scripted(responder)
    comp = _client(srv).complete(MSGS, MODEL)
    assert comp.text == "fine now"
    assert len(calls) == 3
    assert [a.get("error") is not None for a in comp.attempts] == [True, True, False]
    assert "upstream overloaded, try again" in str(comp.attempts[0]["error"])


@pytest.mark.parametrize("shape", sorted(TRANSIENT_BODIES))
def test_a_transient_error_body_that_never_clears_names_the_providers_message(scripted, shape):
    srv = scripted(lambda req: Reply(body=TRANSIENT_BODIES[shape]))
    with pytest.raises(EndpointError, match="upstream overloaded, try again") as info:
        _client(srv, attempts=3).complete(MSGS, MODEL)
    assert "after 3 attempt" in str(info.value)
    assert len(srv.requests) == 3


@pytest.mark.parametrize("shape", sorted(PERMANENT_BODIES))
def test_a_permanent_error_body_fails_at_once_with_its_message(scripted, shape):
    body, message = PERMANENT_BODIES[shape]
    srv = scripted(lambda req: Reply(body=body))
    with pytest.raises(EndpointError, match=message):
        _client(srv, attempts=5).complete(MSGS, MODEL)
    assert len(srv.requests) == 1


def test_the_cli_retries_an_error_body_and_shows_it(scripted, cli, tmp_path):
    """The issue's example through ``rlm run --max-attempts 6``: the run recovers after two
    error bodies; with nothing but error bodies it ends exit 3, naming the provider's text."""
    n = {"root": 0}

    def flaky(req):
        n["root"] += 1
        if n["root"] <= 2:
            return Reply(body=TRANSIENT_BODIES["an error with no type"])
        return repl("FINAL('recovered')")

    srv = scripted(flaky)
    ctx = tmp_path / "c.txt"
    ctx.write_text("some context")
    res = cli("run", "--context", str(ctx), "--query", "q", *endpoint_args(srv),
              "--max-attempts", "6", "--no-journal")
    assert res.rc == 0, res.stderr
    assert res.stdout.strip() == "recovered"
    srv2 = scripted(lambda req: Reply(body=TRANSIENT_BODIES["openai server_error"]))
    res = cli("run", "--context", str(ctx), "--query", "q", *endpoint_args(srv2),
              "--max-attempts", "2", "--no-journal")
    assert_clean_error(res, 3, "upstream overloaded, try again")


def test_anthropic_error_body_with_status_200_is_retried():
    import anthropic_server as a
    from rlm.models.anthropic_messages import AnthropicMessagesClient
    body = {"type": "error", "error": {"type": "overloaded_error",
                                       "message": "upstream overloaded, try again"}}
    replies = [a.Reply(body=body), a.Reply(text="fine now")]
    with a.AnthropicServer(lambda req: replies.pop(0)) as srv:
        client = AnthropicMessagesClient(srv.url, "k", max_attempts=3, backoff_base=0.01,
                                         backoff_max=0.02)
        comp = client.complete(MSGS, "claude-x", max_tokens=50)
    assert comp.text == "fine now"
    assert "upstream overloaded, try again" in str(comp.attempts[0]["error"])


# --------------------------------------------------------------------------- files

def _files(d: Path) -> dict[str, str]:
    return {
        "long.csv": "a,b\n1," + "x" * 140_000 + "\n",
        "long.tsv": "a\tb\n1\t" + "y" * 140_000 + "\n",
        "deep.jsonl": "[" * 100_000 + "]" * 100_000 + "\n",
        "bigint.jsonl": "1" * 5000 + "\n",
    }


SINGLE = {
    "long.csv": ("a,b\n1," + "x" * 140_000 + "\n", "field larger than field limit"),
    "deep.json": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "mid.json": ("[" * 960 + "]" * 960, "nested too deeply"),
    "deep.jsonl": ("[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),
    "bigint.json": ("[" + "1" * 5000 + "]", "4300 digits"),
    "bigint.jsonl": ("1" * 5000 + "\n", "4300 digits"),
}


@pytest.mark.parametrize("name", sorted(SINGLE))
def test_a_file_its_parser_gives_up_on_is_exit_2_not_an_internal_error(cli, tmp_path, name):
    text, why = SINGLE[name]
    (tmp_path / name).write_text(text)
    res = cli("run", "--context", str(tmp_path / name), "--query", "q",
              "--base-url", "http://127.0.0.1:9/v1", "--api-key", "k", "--model", "m",
              "--no-journal")
    assert_clean_error(res, 2, name, why, r"rename it to \.txt")


def test_in_a_directory_such_files_are_kept_as_text_with_a_note(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    for name, text in _files(d).items():
        (d / name).write_text(text)
    (d / "ok.csv").write_text("a,b\n1,2\n")
    ctx = load_context(d)
    try:
        value = json.loads(Path(ctx.path).read_text()) if ctx.value is None else ctx.value
        listing = describe(ctx)["listing"]
    finally:
        ctx.discard()
    for name in _files(d):
        assert f"{name}: kept as text" in listing, listing
    assert "field larger than field limit" in listing


def test_a_deeply_nested_value_given_to_the_api_is_a_context_error():
    import rlm
    v: list = []
    for _ in range(990):
        v = [v]
    with pytest.raises(ContextError, match="nested too deeply"):
        rlm.completion(v, "q", base_url="http://127.0.0.1:9/v1", api_key="k", model="m",
                       journal=False)
