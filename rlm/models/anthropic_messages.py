"""Model clients: Anthropic's Messages API (``POST /v1/messages``) through the official
``anthropic`` package (``pip install 'rlm-kernels[anthropic]'``); ``--provider anthropic``.

The conversation maps onto the API as it requires: system messages go to the ``system``
parameter (joined by a blank line when there are several), the others stay ``messages``; the
output cap is ``max_tokens`` (the API requires one); ``stop`` goes as ``stop_sequences``.

Failures are handled as the OpenAI-compatible client handles them (:mod:`rlm.models.retry`, the
same tenacity policy): HTTP 429 and 5xx (Anthropic's 529 "overloaded" included), timeouts and
connection errors are retried with ``Retry-After`` honoured and every attempt recorded; every
other failure is an :class:`~rlm.errors.EndpointError` carrying the API's own error type and
message.

The reply's ``text`` blocks are its text (reasoning sections in it cut out, as for any model),
its ``thinking`` blocks its reasoning; ``usage.input_tokens`` (plus any cache-read and
cache-write input tokens) and ``usage.output_tokens`` are its prompt and completion tokens, so
the accountant and every cap see them (counted locally if a server sends none); the
``stop_reason`` is the finish reason, ``end_turn``/``stop_sequence`` read as ``"stop"`` and
``max_tokens`` as a reply cut at the cap.

The base URL is the API's root (``https://api.anthropic.com``, ``$ANTHROPIC_BASE_URL``); one
ending in ``/v1`` (the OpenAI convention) is taken as that root's ``/v1``.
"""
from __future__ import annotations

import importlib.util
import time
from typing import Any
from urllib.parse import urlsplit

from rlm.errors import ConfigError, EndpointError, ModelReplyError, install_hint
from rlm.models.base import Completion, short
from rlm.models.transport import (SDKClient, call_id_header, http_status_error, http_timeout,
                                  plain_http_client, post_json, unreachable_error)
from rlm.models.usage import UsageCounter, count
from rlm.prompting.parsing import split_reasoning

__all__ = ["AnthropicMessagesClient", "DEFAULT_MAX_TOKENS", "build_request", "transient",
           "map_error", "parse_reply", "messages_path"]

#: The output cap sent when a call names none (the API requires one).
DEFAULT_MAX_TOKENS = 4096
#: ``stop_reason`` values that are a reply's natural end (``"stop"`` for the rest of the code).
_STOPPED = {"end_turn": "stop", "stop_sequence": "stop"}
#: What to check, by HTTP status, in a non-transient error's message.
_HINTS = {401: "check --api-key / ANTHROPIC_API_KEY", 403: "check the key's permissions",
          404: "check --model and --base-url"}
#: Usage fields counted as prompt tokens: the uncached input and what was read from or
#: written to the prompt cache (each billed as input).
_INPUT_FIELDS = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
INSTALL = install_hint("anthropic")


def _anthropic():
    # imported on first use, as ``openai`` is: a run overlaps it with its kernel's start-up
    import anthropic
    return anthropic


def messages_path(base_url: str) -> str:
    """The path requests go to: ``/v1/messages`` under the base URL, or ``/messages`` when the
    base URL already ends in ``/v1``."""
    return "/messages" if urlsplit(base_url).path.rstrip("/").endswith("/v1") else "/v1/messages"


# the request --------------------------------------------------------------------------------

def build_request(messages: list[dict], model: str, *, max_tokens: int | None = None,
                  temperature: float | None = None, stop: list[str] | None = None,
                  call_id: str | None = None) -> dict:
    """The keyword arguments of one Messages request: ``model``, ``max_tokens`` (the call's cap,
    else :data:`DEFAULT_MAX_TOKENS`), the non-system ``messages``, the system messages' text as
    ``system``, ``temperature`` and ``stop_sequences`` when given, and ``extra_headers``
    carrying ``call_id`` (``X-RLM-Call-Id``)."""
    system = [str(m.get("content") or "") for m in messages
              if m.get("role") in ("system", "developer")]
    turns = [{"role": m.get("role"), "content": m.get("content") or ""} for m in messages
             if m.get("role") not in ("system", "developer")]
    kwargs: dict = {"model": model,
                    "max_tokens": int(DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens),
                    "messages": turns}
    if any(system):
        kwargs["system"] = "\n\n".join(s for s in system if s)
    if temperature is not None:
        kwargs["temperature"] = float(temperature)
    if stop:
        kwargs["stop_sequences"] = list(stop)
    if call_id:
        kwargs["extra_headers"] = call_id_header(call_id)
    return kwargs


# errors ------------------------------------------------------------------------------------

def transient(exc: BaseException) -> bool:
    """True for a failure worth another attempt: a connection error or timeout, HTTP 429, 5xx
    (529 "overloaded" included)."""
    anthropic = _anthropic()
    if isinstance(exc, (anthropic.APIConnectionError, anthropic.RateLimitError,
                        anthropic.InternalServerError)):
        return True  # APITimeoutError is an APIConnectionError
    return isinstance(exc, anthropic.APIStatusError) and (exc.status_code == 429
                                                          or exc.status_code >= 500)


def provider_message(exc: BaseException) -> str:
    """What the API said about an error: ``"<error type>: <message>"`` from an error body in
    Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``), else the
    exception's text (shortened)."""
    body = getattr(exc, "body", None)
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and err.get("message"):
        kind = err.get("type")
        return short(f"{kind}: {err['message']}" if kind else str(err["message"]))
    return short(exc)


def map_error(exc: BaseException, base_url: str, attempts: int) -> BaseException:
    """The project's error for a call that failed with ``exc`` after ``attempts`` attempts (see
    :func:`rlm.models.openai_compat.map_error`); ``exc`` itself for anything not the SDK's."""
    anthropic = _anthropic()
    if isinstance(exc, anthropic.APIStatusError):
        return http_status_error(exc, base_url, attempts, _HINTS, provider_message(exc))
    if isinstance(exc, anthropic.APIConnectionError):
        return unreachable_error(exc, base_url, attempts)
    if isinstance(exc, anthropic.AnthropicError):
        return EndpointError(f"model endpoint {base_url} failed: {short(exc)}")
    if isinstance(exc, ValueError):  # the reply's body is not JSON
        return ModelReplyError(f"model endpoint {base_url} sent a reply that is not valid JSON "
                               f"({short(exc)}): is --base-url an Anthropic Messages endpoint?")
    return exc


# the reply ---------------------------------------------------------------------------------

def _input_tokens(usage: dict) -> int | None:
    """Prompt tokens of a reply's usage: ``input_tokens`` (None if it is not a count) plus the
    cache tokens that are counts."""
    base = count(usage.get("input_tokens"))
    if base is None:
        return None
    return base + sum(count(usage.get(f)) or 0 for f in _INPUT_FIELDS[1:])


def parse_reply(body: Any, *, model: str, base_url: str, messages: list[dict],
                usage: UsageCounter) -> Completion:
    """A Messages reply's JSON as a :class:`Completion`: its ``text`` blocks (reasoning sections
    cut out, :func:`rlm.prompting.parsing.split_reasoning`), its ``thinking`` blocks and those
    sections as the reasoning, the reported model, the ``stop_reason`` (``end_turn`` and
    ``stop_sequence`` as ``"stop"``), and its usage (counted locally by ``usage`` when missing
    or malformed).

    Raises:
        ModelReplyError: the body has no list of content blocks.
    """
    content = body.get("content") if isinstance(body, dict) else None
    if not isinstance(content, list):
        raise ModelReplyError(f"model endpoint {base_url} sent a reply with no content "
                              "(malformed Messages reply)")
    blocks = [b for b in content if isinstance(b, dict)]
    raw = "".join(str(b.get("text") or "") for b in blocks if b.get("type") == "text")
    thinking = [str(b.get("thinking") or "") for b in blocks if b.get("type") == "thinking"]
    text, sections = split_reasoning(raw)
    reasoning = "\n\n".join(x for x in thinking + sections if x)
    reported = body.get("usage")
    reported = reported if isinstance(reported, dict) else {}
    pt, ct, estimated = usage.settle(messages, raw, reasoning, _input_tokens(reported),
                                     count(reported.get("output_tokens")))
    reply_model, finish = body.get("model"), body.get("stop_reason")
    return Completion(text=text, prompt_tokens=pt, completion_tokens=ct, cost_usd=None,
                      model=reply_model if isinstance(reply_model, str) and reply_model
                      else model, reasoning=reasoning,
                      finish_reason=_STOPPED.get(finish, finish) if isinstance(finish, str)
                      else None, usage_estimated=estimated,
                      response_id=body["id"] if isinstance(body.get("id"), str) else None)


# the client --------------------------------------------------------------------------------

class AnthropicMessagesClient(SDKClient):
    """A Messages API client for one endpoint, with the same bounded, jittered retries as
    :class:`rlm.models.openai_compat.OpenAICompatClient`; implements
    :class:`rlm.models.base.ModelClient`.

    Args: as :class:`rlm.models.transport.SDKClient` (``base_url`` the API's root).

    Raises:
        ConfigError: the ``anthropic`` package is not installed.
    """

    def __init__(self, base_url: str, api_key: str | None = None, *, max_attempts: int = 6,
                 timeout: float = 600.0, backoff_base: float = 0.5,
                 backoff_max: float = 20.0) -> None:
        if importlib.util.find_spec("anthropic") is None:
            raise ConfigError(f"--provider anthropic needs the anthropic package: {INSTALL}")
        super().__init__(base_url, api_key, max_attempts=max_attempts, timeout=timeout,
                         backoff_base=backoff_base, backoff_max=backoff_max)
        self._path = messages_path(base_url)

    def _sdk(self):
        return _anthropic()

    def _new_client(self):
        anthropic = _anthropic()
        # the key is always given, so the SDK reads no credentials of its own (environment,
        # profiles) and sends only the one the run was configured with
        return anthropic.Anthropic(base_url=self.base_url, api_key=self._api_key, max_retries=0,
                                   timeout=http_timeout(anthropic, self._timeout),
                                   http_client=plain_http_client(anthropic, self.base_url))

    def _post(self, client, kwargs: dict) -> dict:
        """``client.messages.create(**kwargs)`` as the reply's JSON (through the SDK client's
        ``post``, :func:`rlm.models.transport.post_json`), read here for the few fields used."""
        return post_json(client, self._path, kwargs)

    def _transient(self, exc: BaseException) -> bool:
        return transient(exc)

    def complete(self, messages: list[dict], model: str, *, max_tokens: int | None = None,
                 temperature: float | None = None, stop: list[str] | None = None,
                 timeout: float | None = None, deadline: float | None = None,
                 call_id: str | None = None, cancel=None) -> Completion:
        """Send one Messages request; retry transient failures. The arguments, return value and
        errors are :meth:`rlm.models.openai_compat.OpenAICompatClient.complete`'s."""
        t0 = time.monotonic()
        kwargs = build_request(messages, model, max_tokens=max_tokens, temperature=temperature,
                               stop=stop, call_id=call_id)
        attempts: list[dict] = []
        try:
            body = self._send(kwargs, attempts, timeout=timeout, deadline=deadline,
                              cancel=cancel)
        except Exception as exc:
            err = map_error(exc, self.base_url, len(attempts))
            if err is exc:
                raise
            raise self._redacted(err) from None
        comp = parse_reply(body, model=model, base_url=self.base_url, messages=messages,
                           usage=self._usage)
        comp.attempts, comp.seconds = attempts, time.monotonic() - t0
        return comp
