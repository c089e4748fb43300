"""Where a model's window comes from (:mod:`rlm.models.windows`), and how each kind of endpoint
says a request was too long: OpenAI's ``context_length_exceeded``, vLLM's wording with no code,
llama.cpp's ``exceed_context_size_error`` and Anthropic's "prompt is too long", each through the
real SDK client against a real server on 127.0.0.1, each a ``ContextWindowExceeded`` naming the
window; any other 400 stays a plain ``EndpointError``."""
from __future__ import annotations

import pytest

from anthropic_server import AnthropicServer
from anthropic_server import Reply as AReply
from conftest import API_KEY, MODEL, closed_port
from rlm.config.options import Options
from rlm.errors import EndpointError
from rlm.models.base import make_client
from rlm.models.windows import (ContextWindowExceeded, Window, known_window, resolve_window,
                                server_window)
from scripted_server import Reply, ScriptedServer, context_length_exceeded

MSGS = [{"role": "user", "content": "hello"}]

LLAMA_CPP = Reply(status=400, body={"error": {
    "code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": 2031, "n_ctx": 512,
    "message": "request (2031 tokens) exceeds the available context size (512 tokens), try "
               "increasing it"}})
VLLM = Reply(status=400, content="This model's maximum context length is 4096 tokens. However, "
             "you requested 5000 tokens (4000 in the messages, 1000 in the completion). Please "
             "reduce the length of the messages or completion.", error={"type": "BadRequestError"})


@pytest.mark.parametrize("reply, window, prompt", [
    (context_length_exceeded(16385, 20000, 1024), 16385, 21024),
    (VLLM, 4096, 5000),
    (LLAMA_CPP, 512, 2031),
])
def test_each_openai_compatible_refusal_names_its_window(reply, window, prompt):
    with ScriptedServer(lambda req: reply) as srv:
        client = make_client("openai", srv.base_url, API_KEY, max_attempts=3)
        try:
            with pytest.raises(ContextWindowExceeded) as err:
                client.complete(MSGS, MODEL, max_tokens=16, temperature=0.0)
        finally:
            client.close()
        assert srv.count == 1  # a refusal is not retried
    assert (err.value.window, err.value.prompt_tokens) == (window, prompt)
    assert "too long for the model's window" in str(err.value)
    assert "--context-window" in str(err.value)


def test_anthropic_prompt_too_long_names_its_window():
    too_long = AReply(status=400, text="prompt is too long: 208310 tokens > 200000 maximum")
    with AnthropicServer(lambda req: too_long) as srv:
        client = make_client("anthropic", srv.url, API_KEY, max_attempts=2)
        try:
            with pytest.raises(ContextWindowExceeded) as err:
                client.complete(MSGS, MODEL, max_tokens=16, temperature=0.0)
        finally:
            client.close()
    assert (err.value.window, err.value.prompt_tokens) == (200000, 208310)


def test_another_400_is_not_a_window_refusal():
    other = Reply(status=400, content="Invalid value for 'model'", error={"type": "invalid"})
    with ScriptedServer(lambda req: other) as srv:
        client = make_client("openai", srv.base_url, API_KEY, max_attempts=1)
        try:
            with pytest.raises(EndpointError) as err:
                client.complete(MSGS, MODEL, max_tokens=16, temperature=0.0)
        finally:
            client.close()
    assert not isinstance(err.value, ContextWindowExceeded)


@pytest.mark.parametrize("model, tokens", [
    ("gpt-4o", 128_000), ("openai/gpt-4o-mini", 128_000), ("gpt-4o-2024-08-06", 128_000),
    ("gpt-4.1-mini", 1_047_576), ("gpt-5.1", 400_000), ("o5-mini", 200_000),
    ("claude-sonnet-4-20250514", 200_000), ("claude-opus-9", 200_000), ("gpt-3.5-turbo", 16_385),
])
def test_hosted_windows_resolve_as_prices_do(model, tokens):
    assert known_window(model) == Window(tokens, "table")


def test_the_option_wins_zero_turns_it_off_and_an_unknown_model_has_none():
    assert resolve_window("gpt-4o", Options(context_window=9000)) == Window(9000, "option")
    assert resolve_window("gpt-4o", Options(context_window=0)) is None
    assert resolve_window("my-finetune", Options()) is None
    assert resolve_window("gpt-4o", Options()) == Window(128_000, "table")


def test_a_server_without_props_or_gone_reports_no_window():
    with ScriptedServer(lambda req: "x") as srv:  # answers GET with a model list: no n_ctx
        assert server_window(srv.base_url, API_KEY) is None
    assert server_window(f"http://127.0.0.1:{closed_port()}/v1", API_KEY, timeout=2) is None
