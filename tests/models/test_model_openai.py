"""The OpenAI-compatible client's steps as functions (:mod:`rlm.models.openai_compat`): request
building, the 400 adaptations, which failures are transient, error mapping and reply parsing.
No server: real ``openai`` exceptions over ``httpx2`` requests and responses built here (the
whole client against a real server is ``tests/test_clients.py``)."""
from __future__ import annotations

import httpx2
import openai
import pytest

from rlm.errors import EndpointError, ModelReplyError
from rlm.models.openai_compat import (build_request, map_error, parse_reply, rejected_param,
                                      replace_param, transient)
from rlm.models.tokens import count_messages, count_tokens
from rlm.models.usage import UsageCounter

URL = "http://127.0.0.1:9/v1"
MSGS = [{"role": "user", "content": "hello there"}]


def status_error(status: int, message: str = "nope", headers: dict | None = None,
                 body: object = None) -> openai.APIStatusError:
    """The exception ``openai`` raises for an HTTP ``status`` reply (its own mapping)."""
    request = httpx2.Request("POST", URL + "/chat/completions")
    response = httpx2.Response(status, headers=headers or {}, request=request)
    client = openai.OpenAI(base_url=URL, api_key="k")
    return client._make_status_error(message, body=body, response=response)


def connection_error() -> openai.APIConnectionError:
    return openai.APIConnectionError(request=httpx2.Request("POST", URL))


# --------------------------------------------------------------------------- the request


def test_a_classic_model_gets_max_tokens_and_temperature():
    kw = build_request(MSGS, "gpt-4o", max_tokens=7, temperature=0.25, stop=["END"])
    assert kw == {"model": "gpt-4o", "messages": MSGS, "max_tokens": 7, "temperature": 0.25,
                  "stop": ["END"]}


def test_a_reasoning_model_gets_max_completion_tokens_and_no_temperature():
    kw = build_request(MSGS, "o3-mini", max_tokens=50, temperature=0.0)
    assert kw == {"model": "o3-mini", "messages": MSGS, "max_completion_tokens": 50}


def test_unset_parameters_stay_out_and_the_call_id_is_a_header():
    kw = build_request(MSGS, "m", call_id="run ü/iteration-0/model_call-1")
    assert set(kw) == {"model", "messages", "extra_headers"}
    assert kw["extra_headers"] == {"X-RLM-Call-Id": "run%20%C3%BC/iteration-0/model_call-1"}


def test_a_400_naming_a_parameter_is_found_and_the_cap_moves_to_its_other_name():
    kw = build_request(MSGS, "acme", max_tokens=50, temperature=0.0)
    exc = status_error(400, "Unsupported parameter: 'max_tokens' is not supported with this "
                       "model. Use 'max_completion_tokens' instead.")
    changed: set = set()
    assert rejected_param(exc, kw, changed) == "max_tokens"
    assert replace_param(kw, "max_tokens", changed) == "max_completion_tokens"
    assert kw["max_completion_tokens"] == 50 and "max_tokens" not in kw
    # each parameter once per call; the other name is not swapped back
    assert rejected_param(status_error(400, "max_completion_tokens unsupported"), kw,
                          changed) is None
    assert rejected_param(status_error(400, "temperature: only the default (1) is supported"),
                          kw, changed) == "temperature"
    assert replace_param(kw, "temperature", changed) is None and "temperature" not in kw


def test_other_400s_and_other_statuses_are_not_adaptations():
    kw = build_request(MSGS, "acme", max_tokens=50)
    too_long = status_error(400, "'max_tokens' is too large: 50. This model's maximum context "
                            "length is 40 tokens.")
    assert rejected_param(too_long, kw, set()) is None
    assert rejected_param(status_error(500, "max_tokens unsupported"), kw, set()) is None
    named = status_error(422, "bad", body={"param": "stop"})
    named.param = "stop"
    assert rejected_param(named, dict(kw, stop=["x"]), set()) == "stop"


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("exc,expected", [
    (status_error(429), True), (status_error(500), True), (status_error(503), True),
    (status_error(529), True), (status_error(400), False), (status_error(401), False),
    (status_error(404), False), (connection_error(), True),
    (openai.APITimeoutError(request=httpx2.Request("POST", URL)), True),
    (ValueError("not json"), False), (EndpointError("cancelled"), False)])
def test_which_failures_are_transient(exc, expected):
    assert transient(exc) is expected


@pytest.mark.parametrize("status,hint", [(401, "check --api-key / OPENAI_API_KEY"),
                                         (403, "permissions"), (404, "check --model"),
                                         (400, None)])
def test_an_http_error_is_an_endpoint_error_with_what_to_check(status, hint):
    err = map_error(status_error(status, "the provider says no"), URL, 3)
    assert type(err) is EndpointError
    msg = str(err)
    assert msg.startswith(f"model endpoint {URL} answered HTTP {status} after 3 attempt(s): ")
    assert "the provider says no" in msg
    assert (hint in msg) if hint else ";" not in msg


def test_a_redirect_names_where_it_goes():
    err = map_error(status_error(307, "moved", headers={"location": "https://x/v1"}), URL, 1)
    assert "it redirects to https://x/v1: give that as --base-url" in str(err)


def test_unreachable_other_sdk_errors_bad_json_and_the_rest():
    err = map_error(connection_error(), URL, 2)
    assert type(err) is EndpointError and "unreachable after 2 attempt(s)" in str(err)
    assert "--base-url" in str(err)
    err = map_error(openai.OpenAIError("odd"), URL, 1)
    assert type(err) is EndpointError and str(err).endswith("failed: odd")
    err = map_error(ValueError("Expecting value"), URL, 1)
    assert isinstance(err, ModelReplyError) and "not valid JSON" in str(err)
    other = KeyError("a bug")
    assert map_error(other, URL, 1) is other  # not the endpoint's: raised as it is


# --------------------------------------------------------------------------- the reply


def parse(body, messages=MSGS, counter=None):
    return parse_reply(body, model="asked", base_url=URL, messages=messages,
                       usage=counter or UsageCounter(URL))


def test_a_reply_becomes_a_completion():
    comp = parse({"model": "served", "choices": [{"finish_reason": "length", "message": {
        "role": "assistant", "content": "<think>hmm</think>the text",
        "reasoning_content": "first"}}],
        "usage": {"prompt_tokens": 31, "completion_tokens": 4.0, "cost": 0.25}})
    assert (comp.text, comp.reasoning) == ("the text", "first\n\nhmm")
    assert (comp.prompt_tokens, comp.completion_tokens, comp.cost_usd) == (31, 4, 0.25)
    assert comp.model == "served" and comp.finish_reason == "length" and comp.cut
    assert not comp.usage_estimated and comp.attempts == []


def test_content_parts_are_joined_and_the_asked_model_stands_in():
    comp = parse({"choices": [{"message": {"content": [{"type": "text", "text": "a"}, "b"]}}],
                  "usage": {"prompt_tokens": 1, "completion_tokens": 1}, "model": ""})
    assert comp.text == "ab" and comp.model == "asked" and comp.finish_reason is None


@pytest.mark.parametrize("usage,reported_ct", [
    (None, None), ([1, 2], None), ({"prompt_tokens": 0, "completion_tokens": 0}, None),
    ({"prompt_tokens": -1, "completion_tokens": 2}, 2),
    ({"prompt_tokens": float("inf"), "completion_tokens": 1}, 1)])
def test_missing_or_malformed_usage_is_counted_locally(usage, reported_ct):
    # only what is missing is counted: a count the reply did report is kept
    body = {"choices": [{"message": {"content": "one two three"}}]}
    if usage is not None:
        body["usage"] = usage
    comp = parse(body)
    assert comp.usage_estimated and comp.cost_usd is None
    assert comp.prompt_tokens == count_messages(MSGS)
    assert comp.completion_tokens == (reported_ct or count_tokens("one two three"))


def test_the_usage_warning_comes_once_per_counter(caplog):
    counter = UsageCounter(URL)
    with caplog.at_level("WARNING", logger="rlm"):
        for _ in range(3):
            parse({"choices": [{"message": {"content": "x"}}]}, counter=counter)
    assert sum("no token usage" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("body", [{}, [], "hello", {"choices": None}, {"choices": ["x"]},
                                  {"choices": [{"message": "hi"}]}])
def test_a_body_without_a_message_is_a_model_reply_error(body):
    with pytest.raises(ModelReplyError, match="malformed chat completion"):
        parse(body)
