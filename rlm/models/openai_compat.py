"""Model clients: any OpenAI-compatible chat-completions endpoint through ``openai``.

Transient failures (HTTP 429, 5xx, timeouts, connection errors) are retried by
``tenacity`` with exponential backoff and full jitter, bounded attempts, and the
server's ``Retry-After`` honoured when it sends one (:mod:`rlm.models.retry`). Every attempt is
recorded (and logged at INFO with ``-v``). Other failures (401, 400, 404...) fail at once, except
a 400 that rejects a request parameter (see below).

What goes on the wire follows the model's capabilities (:mod:`rlm.models.capabilities`): reasoning
families (o1/o3/o4-mini/gpt-5) get ``max_completion_tokens`` and no temperature. A 400 (or 422)
that names a parameter the request sent as unsupported is retried once without it
(``max_tokens`` <-> ``max_completion_tokens``, anything else dropped); the adaptation is recorded
in the attempt (``"adapted"``) and kept for the rest of the client's calls to that model.

A reply's reasoning is never its text: reasoning sections in the content (``<think>...``) and
separate reasoning fields (``reasoning_content``, ``reasoning``...) go to
:attr:`Completion.reasoning` (see :mod:`rlm.prompting.parsing`). A reply with no usage is counted
locally with tiktoken and marked ``usage_estimated`` (warned once per client).

One call, in named steps: :func:`build_request` (messages, model, parameters -> the request),
:meth:`OpenAICompatClient._call` (the retried send, :mod:`rlm.models.retry`, and the 400
adaptations, :func:`rejected_param`), :func:`map_error` (``openai`` exceptions -> the project's
errors) and :func:`parse_reply` (the reply's JSON -> :class:`Completion`).
"""
from __future__ import annotations

import logging
import re
import time
from typing import Any

from rlm.errors import EndpointError, ModelReplyError
from rlm.models.base import CUT_REASONS, Completion, DeadlineExceeded, short
from rlm.models.base import ModelClient  # the Protocol (re-exported for older importers)
from rlm.models.capabilities import capabilities
from rlm.models.retry import MAX_RETRY_AFTER  # re-exported
from rlm.models.transport import (CONNECT_TIMEOUT, SDKClient, call_id_header, http_status_error,
                                  http_timeout, plain_http_client, post_json, unreachable_error)
from rlm.models.usage import UsageCounter, amount, count
from rlm.prompting.parsing import reasoning_from_message, split_reasoning

__all__ = ["OpenAICompatClient", "ModelClient", "Completion", "DeadlineExceeded",
           "CUT_REASONS", "CONNECT_TIMEOUT", "MAX_RETRY_AFTER", "build_request", "transient",
           "map_error", "parse_reply", "rejected_param", "replace_param"]

log = logging.getLogger("rlm")

#: Parameters a 400 may reject and the client may adapt (never ``model`` or ``messages``).
_ADAPTABLE = ("max_completion_tokens", "max_tokens", "temperature", "stop")
_REJECTS = re.compile(r"unsupported|not supported|unrecogni[sz]ed|unknown|not allowed|"
                      r"not permitted|extra (?:inputs|fields)|extra_forbidden|does not support|"
                      r"unexpected|only the default|invalid (?:param|arg|field|request arg)|"
                      r"not (?:a )?valid (?:param|arg)", re.IGNORECASE)
#: The parameter that stands for a rejected one (the output cap goes by either name).
_COUNTERPART = {"max_tokens": "max_completion_tokens", "max_completion_tokens": "max_tokens"}
#: What to check, by HTTP status, in a non-transient error's message.
_HINTS = {401: "check --api-key / OPENAI_API_KEY", 403: "check the key's permissions",
          404: "check --model and --base-url"}


def _openai():
    # imported on first use: ``import openai`` takes ~0.4 s here, and the first model
    # call overlaps it with the kernel's start-up
    import openai
    return openai


def _http_timeout(seconds: float):
    """An attempt's ``openai.Timeout`` (:func:`rlm.models.transport.http_timeout`)."""
    return http_timeout(_openai(), seconds)


# the request --------------------------------------------------------------------------------

def build_request(messages: list[dict], model: str, *, max_tokens: int | None = None,
                  temperature: float | None = None, stop: list[str] | None = None,
                  call_id: str | None = None) -> dict:
    """The keyword arguments of one chat completion: ``model`` and ``messages``, the output cap
    as ``max_tokens`` or ``max_completion_tokens`` and the temperature only where the model's
    capabilities (:func:`rlm.models.capabilities.capabilities`) take it, ``stop`` when given,
    and ``extra_headers`` carrying ``call_id`` (:func:`call_id_header`)."""
    kwargs: dict = {"model": model, "messages": messages}
    caps = capabilities(model)
    if max_tokens is not None:
        kwargs[caps.token_param] = int(max_tokens)
    if temperature is not None and caps.temperature:
        kwargs["temperature"] = float(temperature)
    if stop:
        kwargs["stop"] = stop
    if call_id:
        kwargs["extra_headers"] = call_id_header(call_id)
    return kwargs


def rejected_param(exc: BaseException, kwargs: dict, changed: set) -> str | None:
    """The parameter of ``kwargs`` a 400/422 ``exc`` rejects (one of :data:`_ADAPTABLE` not yet
    changed in this call), else None: the error's ``param`` if it names one sent, else the
    first sent parameter its message names, when the message says it is not supported."""
    if getattr(exc, "status_code", None) not in (400, 422):
        return None
    body = getattr(exc, "body", None)
    msg = str(getattr(exc, "message", "") or exc)
    if isinstance(body, dict):
        msg += " " + str(body.get("message") or "") + " " + str(body.get("detail") or "")
    elif body is not None:
        msg += " " + str(body)
    sent = [p for p in _ADAPTABLE if p in kwargs and p not in changed]
    param = getattr(exc, "param", None)
    if param in sent:
        return param
    if not _REJECTS.search(msg):
        return None
    found = [(m.start(), p) for p in sent
             for m in [re.search(rf"(?<![A-Za-z_]){p}(?![A-Za-z_])", msg)] if m]
    return min(found)[1] if found else None


def replace_param(kwargs: dict, param: str, changed: set) -> str | None:
    """Take ``param`` out of ``kwargs``; the output cap moves to its other name unless that
    was already changed or sent. Returns the replacement's name, or None (dropped)."""
    changed.add(param)
    value = kwargs.pop(param)
    other = _COUNTERPART.get(param)
    repl = other if other and other not in changed and other not in kwargs else None
    if repl is not None:
        kwargs[repl] = value
        changed.add(repl)
    return repl


# errors ------------------------------------------------------------------------------------

def transient(exc: BaseException) -> bool:
    """True for a failure worth another attempt: a connection error or timeout, HTTP 429, 5xx."""
    openai = _openai()
    if isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError,
                        openai.RateLimitError, openai.InternalServerError)):
        return True
    return isinstance(exc, openai.APIStatusError) and (exc.status_code == 429
                                                       or exc.status_code >= 500)


def map_error(exc: BaseException, base_url: str, attempts: int) -> BaseException:
    """The project's error for a call that failed with ``exc`` after ``attempts`` attempts:
    an HTTP error (with what to check), an unreachable endpoint, another ``openai`` error
    (:class:`~rlm.errors.EndpointError`), a body that is not JSON
    (:class:`~rlm.errors.ModelReplyError`); ``exc`` itself for anything else."""
    openai = _openai()
    if isinstance(exc, openai.APIStatusError):
        return http_status_error(exc, base_url, attempts, _HINTS, short(exc))
    if isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError)):
        return unreachable_error(exc, base_url, attempts)
    if isinstance(exc, openai.OpenAIError):
        return EndpointError(f"model endpoint {base_url} failed: {short(exc)}")
    if isinstance(exc, ValueError):  # the client's JSON decoding of the reply's body
        return ModelReplyError(f"model endpoint {base_url} sent a reply that is not valid JSON "
                               f"({short(exc)}): is --base-url an OpenAI-compatible endpoint?")
    return exc


# the reply ---------------------------------------------------------------------------------

def _content_text(content: Any) -> str:
    """A message's content as text: a string as it is, content parts by their text."""
    raw = content or ""
    if not isinstance(raw, str):
        raw = "".join(p.get("text", "") if isinstance(p, dict) else str(p)
                      for p in (raw if isinstance(raw, list) else [raw]))
    return raw


def parse_reply(body: Any, *, model: str, base_url: str, messages: list[dict],
                usage: UsageCounter) -> Completion:
    """A chat completion's JSON as a :class:`Completion`: its first choice's text without its
    reasoning (:func:`rlm.prompting.parsing.split_reasoning`), the reasoning, the reported
    model and finish reason, and its usage and cost (taken only as finite numbers >= 0;
    counted locally by ``usage`` when missing or malformed).

    Raises:
        ModelReplyError: the body has no first choice with a message object.
    """
    choices = body.get("choices") if isinstance(body, dict) else None
    message = choices[0].get("message") if choices and isinstance(choices, list) \
        and isinstance(choices[0], dict) else None
    if not isinstance(message, dict):
        raise ModelReplyError(f"model endpoint {base_url} sent a reply with no message "
                              "(malformed chat completion)")
    raw = _content_text(message.get("content"))
    text, sections = split_reasoning(raw)
    reasoning = "\n\n".join(x for x in [reasoning_from_message(message)] + sections if x)
    reported = body.get("usage")
    reported = reported if isinstance(reported, dict) else {}
    pt, ct, estimated = usage.settle(messages, raw, reasoning,
                                     count(reported.get("prompt_tokens")),
                                     count(reported.get("completion_tokens")))
    reply_model = body.get("model")
    finish = choices[0].get("finish_reason")
    return Completion(text=text, prompt_tokens=pt, completion_tokens=ct,
                      cost_usd=amount(reported.get("cost")),
                      model=reply_model if isinstance(reply_model, str) and reply_model
                      else model, reasoning=reasoning,
                      finish_reason=finish if isinstance(finish, str) else None,
                      usage_estimated=estimated,
                      response_id=body["id"] if isinstance(body.get("id"), str) else None)


# the client --------------------------------------------------------------------------------

class OpenAICompatClient(SDKClient):
    """A chat-completions client for one endpoint, with bounded, jittered retries; implements
    :class:`rlm.models.base.ModelClient`.

    Args:
        base_url: the endpoint's base URL (``http://host:port/v1``).
        api_key: the API key (never passed to kernels); "EMPTY" for local servers.
        max_attempts: attempts per call including the first (int >= 1).
        timeout: seconds per HTTP attempt, at most :data:`CONNECT_TIMEOUT` of it to connect.
        backoff_max: cap of one backoff sleep (s); the sleep is uniform in
            ``[0, min(backoff_max, backoff_base * 2**attempt)]`` (full jitter).
    """

    def __init__(self, base_url: str, api_key: str | None = None, *, max_attempts: int = 6,
                 timeout: float = 600.0, backoff_base: float = 0.5,
                 backoff_max: float = 20.0) -> None:
        super().__init__(base_url, api_key, max_attempts=max_attempts, timeout=timeout,
                         backoff_base=backoff_base, backoff_max=backoff_max)
        # per model: parameter -> its replacement (None: dropped), learned from 400s
        self._learned: dict[str, dict[str, str | None]] = {}

    def _sdk(self):
        return _openai()

    def _new_client(self):
        return _openai().OpenAI(base_url=self.base_url, api_key=self._api_key, max_retries=0,
                                timeout=_http_timeout(self._timeout),
                                http_client=plain_http_client(_openai(), self.base_url))

    def _post(self, client, kwargs: dict) -> dict:
        """``client.chat.completions.create(**kwargs)`` without its typed-parameter transform
        and without building its reply's ``ChatCompletion`` model
        (:func:`rlm.models.transport.post_json`): the body is already plain JSON, which the
        transform would walk and copy unchanged (measured here: 0.9 ms of CPU of a 2.5 ms
        call, ``openai`` 3.57, a local endpoint), and the reply is read for five fields."""
        return post_json(client, "/chat/completions", kwargs)

    def _transient(self, exc: BaseException) -> bool:
        return transient(exc)

    def complete(self, messages: list[dict], model: str, *, max_tokens: int | None = None,
                 temperature: float | None = None, stop: list[str] | None = None,
                 timeout: float | None = None, deadline: float | None = None,
                 call_id: str | None = None, cancel=None) -> Completion:
        """Send one chat completion; retry transient failures.

        Args:
            timeout: seconds per attempt (default: the client's).
            call_id: sent as the ``X-RLM-Call-Id`` header (run id and stage id), so a
                provider or proxy can trace, and de-duplicate, retried calls.
            deadline: a ``time.monotonic()`` instant after which no attempt is made or
                kept waiting on (the wall-clock cap): every network read and write of an
                attempt is cut to it (a server that never answers, answers slowly or trickles
                its reply is let go at the deadline), and a retry whose wait (backoff or
                ``Retry-After``) would end past it is not made.
            cancel: anything with ``is_set()``/``wait(s)`` (an Event, a cancel scope): once
                set, no further attempt is made and a retry wait ends at once.

        The output cap goes out as ``max_tokens`` or ``max_completion_tokens`` and the
        temperature is left out as the model's capabilities say; a 400 rejecting one of them is
        retried once without it (see the module docstring).

        Returns:
            Completion with text, reasoning and usage (counted locally if the reply has none).
        Raises:
            EndpointError: unreachable or failing after ``max_attempts``, or a
                non-transient HTTP error (message says which and what to do).
            DeadlineExceeded: the deadline ended the call (an ``EndpointError``).
            ModelReplyError: the reply has no choices/message, or its body is not valid JSON.
        """
        t0 = time.monotonic()
        kwargs = build_request(messages, model, max_tokens=max_tokens, temperature=temperature,
                               stop=stop, call_id=call_id)
        adapted = self._apply_learned(model, kwargs)
        attempts: list[dict] = []
        body = self._call(model, kwargs, attempts, adapted, timeout=timeout, deadline=deadline,
                          cancel=cancel)
        comp = parse_reply(body, model=model, base_url=self.base_url, messages=messages,
                           usage=self._usage)
        comp.attempts, comp.seconds, comp.adapted = attempts, time.monotonic() - t0, adapted
        return comp

    def _call(self, model: str, kwargs: dict, attempts: list[dict], adapted: list[str], *,
              timeout: float | None, deadline: float | None, cancel) -> dict:
        """The reply's JSON: ``kwargs`` sent with retries (:meth:`SDKClient._send`); a 400
        rejecting a parameter changes ``kwargs`` (recorded in the attempt and ``adapted``) and
        the call goes again; any other failure is raised as :func:`map_error` says."""
        changed: set[str] = set()
        while True:
            try:
                return self._send(kwargs, attempts, timeout=timeout, deadline=deadline,
                                  cancel=cancel)
            except Exception as exc:
                change = self._adapt(model, kwargs, exc, changed) \
                    if isinstance(exc, _openai().APIStatusError) else None
                if change is None:
                    err = map_error(exc, self.base_url, len(attempts))
                    if err is exc:
                        raise
                    raise self._redacted(err) from None
                attempts[-1]["adapted"] = change
                adapted.append(change)
                log.warning("model %s rejected a request parameter (%s); retrying once with "
                            "%s", model, short(exc), change)

    # request parameters ----------------------------------------------------------------
    def _apply_learned(self, model: str, kwargs: dict) -> list[str]:
        """Apply the adaptations learned for ``model`` to ``kwargs``; returns them as text."""
        if model not in self._learned:  # nothing learned for it (the usual case): no lock
            return []
        with self._init_lock:
            learned = dict(self._learned.get(model, {}))
        out = []
        for param, repl in learned.items():
            if param in kwargs:
                value = kwargs.pop(param)
                if repl is not None and repl not in kwargs:
                    kwargs[repl] = value
                out.append(f"{param} -> {repl or 'dropped'} (learned)")
        return out

    def _adapt(self, model: str, kwargs: dict, exc, changed: set) -> str | None:
        """If ``exc`` is a 400/422 rejecting a parameter ``kwargs`` holds, change ``kwargs``
        (each parameter at most once per call), remember it for ``model`` and return what
        changed, else None."""
        param = rejected_param(exc, kwargs, changed)
        if param is None:
            return None
        repl = replace_param(kwargs, param, changed)
        with self._init_lock:
            self._learned.setdefault(model, {})[param] = repl
        return f"{param} -> {repl or 'dropped'}"

