"""Model clients: any OpenAI-compatible chat-completions endpoint through ``openai``.

Transient failures (HTTP 429, 5xx, timeouts, connection errors) are retried by
``tenacity`` with exponential backoff and full jitter, bounded attempts, and the
server's ``Retry-After`` honoured when it sends one. Every attempt is recorded
(and logged at INFO with ``-v``). Other failures (401, 400, 404...) fail at once, except a 400
that rejects a request parameter (see below).

What goes on the wire follows the model's capabilities (:mod:`rlm.models.capabilities`): reasoning
families (o1/o3/o4-mini/gpt-5) get ``max_completion_tokens`` and no temperature. A 400 (or 422)
that names a parameter the request sent as unsupported is retried once without it
(``max_tokens`` <-> ``max_completion_tokens``, anything else dropped); the adaptation is recorded
in the attempt (``"adapted"``) and kept for the rest of the client's calls to that model.

A reply's reasoning is never its text: reasoning sections in the content (``<think>...``) and
separate reasoning fields (``reasoning_content``, ``reasoning``...) go to
:attr:`Completion.reasoning` (see :mod:`rlm.prompting.parsing`). A reply with no usage is counted locally
with tiktoken and marked ``usage_estimated`` (warned once per client).
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import quote

from tenacity import (RetryCallState, Retrying, retry_if_exception, stop_after_attempt,
                      wait_random_exponential)

from rlm.models.capabilities import capabilities

from rlm.errors import EndpointError, ModelReplyError
from rlm.prompting.parsing import reasoning_from_message, split_reasoning

log = logging.getLogger("rlm")

#: ``finish_reason`` values meaning the reply stopped at the output-token limit.
CUT_REASONS = frozenset({"length", "max_tokens", "max_output_tokens", "model_length"})

#: Parameters a 400 may reject and the client may adapt (never ``model`` or ``messages``).
_ADAPTABLE = ("max_completion_tokens", "max_tokens", "temperature", "stop")
_REJECTS = re.compile(r"unsupported|not supported|unrecogni[sz]ed|unknown|not allowed|"
                      r"not permitted|extra (?:inputs|fields)|extra_forbidden|does not support|"
                      r"unexpected|only the default|invalid (?:param|arg|field|request arg)|"
                      r"not (?:a )?valid (?:param|arg)", re.IGNORECASE)

#: Longest honoured Retry-After (s); a server asking for more is waited on this long.
MAX_RETRY_AFTER = 30.0


class DeadlineExceeded(EndpointError):
    """The call could not finish before its deadline (the run's wall-clock cap): an attempt
    was cut at the deadline, or the next retry would have to wait past it."""


@dataclass
class Completion:
    """One model reply.

    Attributes:
        text: the reply's content without its reasoning sections (str).
        prompt_tokens, completion_tokens: usage reported by the endpoint, or counted locally
            when it reported none (tokens).
        cost_usd: cost reported by the provider (USD) if it sends one, else None.
        model: the model that answered.
        attempts: one dict per HTTP attempt: ``{"n", "seconds", "error"}``, plus ``"adapted"``
            (e.g. ``"max_tokens -> max_completion_tokens"``) on an attempt whose 400 made the
            client change the request.
        seconds: wall time over all attempts (s).
        reasoning: the reply's reasoning (separate reasoning fields, then the sections cut out
            of the content), never executed, never the answer (str, "" for none).
        finish_reason: why the reply ended (``"stop"``, ``"length"``...; None if not sent).
        usage_estimated: the endpoint sent no usage, so the token counts are tiktoken's.
        adapted: parameter adaptations in effect for this call, learned from 400s (list of str).
    """

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = None
    model: str = ""
    attempts: list = field(default_factory=list)
    seconds: float = 0.0
    reasoning: str = ""
    finish_reason: str | None = None
    usage_estimated: bool = False
    adapted: list = field(default_factory=list)

    @property
    def cut(self) -> bool:
        """True if the reply stopped at the output-token limit."""
        return (self.finish_reason or "") in CUT_REASONS

    def to_dict(self) -> dict:
        d = {"text": self.text, "prompt_tokens": self.prompt_tokens,
             "completion_tokens": self.completion_tokens, "cost_usd": self.cost_usd,
             "model": self.model}
        if self.reasoning:
            d["reasoning"] = self.reasoning
        if self.finish_reason is not None:
            d["finish_reason"] = self.finish_reason
        if self.usage_estimated:
            d["usage_estimated"] = True
        return d

    def meta(self) -> dict:
        """What a ``model_call`` stage keeps beside its evidence: attempts, and the reasoning,
        finish reason, estimated usage and adaptations when there are any."""
        m: dict = {"attempts": self.attempts}
        if self.reasoning:
            m["reasoning"] = self.reasoning
        if self.finish_reason not in (None, "stop"):
            m["finish_reason"] = self.finish_reason
        if self.usage_estimated:
            m["usage_estimated"] = True
        if self.adapted:
            m["adapted"] = list(self.adapted)
        return m

    @classmethod
    def from_record(cls, resp: dict, model: str) -> "Completion":
        """A completion rebuilt from its journaled response (:meth:`to_dict`), not charged."""
        return cls(text=resp.get("text", ""), model=resp.get("model", model),
                   reasoning=resp.get("reasoning", ""), finish_reason=resp.get("finish_reason"))


def _openai():
    # imported on first use: ``import openai`` takes ~0.4 s here, and the first model
    # call overlaps it with the kernel's start-up
    import openai
    return openai


_REQUEST_OPTIONS = {"extra_headers": "headers", "timeout": "timeout"}

#: Longest wait (s) for a connection to the endpoint, within an attempt's timeout: the
#: ``openai`` client's own default (``openai.DEFAULT_TIMEOUT``: 600 s, connect 5 s), which a
#: plain number of seconds would replace. An endpoint whose host never answers (a firewall
#: dropping packets, an address nothing holds) then fails each attempt in 5 s, not when the
#: operating system gives up (about 2 minutes on Linux) or at the attempt's timeout.
CONNECT_TIMEOUT = 5.0


def _http_timeout(seconds: float):
    """An attempt's ``openai.Timeout``: ``seconds`` for the whole attempt (each read, write and
    pool wait), at most :data:`CONNECT_TIMEOUT` of it to connect."""
    return _openai().Timeout(seconds, connect=min(seconds, CONNECT_TIMEOUT))


_PROXY_VARS = ("http_proxy", "all_proxy")


def _plain_http_client(base_url: str):
    """The HTTP client of an endpoint reached over plain HTTP, or None (``openai``'s default).

    ``openai``'s default client loads the system's CA certificates into a TLS context when it
    is built (about 25 ms of CPU here, on the critical path of a run's first model call) even
    for an ``http://`` endpoint, which never uses it: local servers (vLLM, llama.cpp, the
    embedded model's) are reached that way. For such a URL, with no proxy configured for
    HTTP, the client is ``openai.DefaultHttpxClient`` (its limits and timeout) built without
    a CA store and without following redirects, so nothing it sends can reach an ``https://``
    URL unverified: a redirect is an error naming its status. Otherwise (``https://``, a
    proxy) None: the default client, with certificate verification.
    """
    if not base_url.lower().startswith("http://"):
        return None
    if any(os.environ.get(v) or os.environ.get(v.upper()) for v in _PROXY_VARS):
        return None
    return _openai().DefaultHttpxClient(verify=False, follow_redirects=False)


def _post_chat(client, kwargs: dict) -> dict:
    """``client.chat.completions.create(**kwargs)`` without its typed-parameter transform and
    without building its reply's ``ChatCompletion`` model: the reply's JSON as a dict.

    The body is already plain JSON (str roles and contents, numbers), which the transform
    would walk against the request's TypedDicts and copy unchanged (measured here: 0.9 ms of
    CPU of a 2.5 ms call, ``openai`` 3.57, a local endpoint); and the reply is read for five
    fields, which the model's recursive construction (about 0.25 ms more per call) does not
    check anyway. The request goes out through the client's own ``post`` (the documented way
    to reach any path): same URL, headers, auth and HTTP error mapping; the body comes back as
    bytes and is decoded here. ``kwargs``: the body's fields plus the request options
    ``extra_headers`` and ``timeout`` (an ``openai.Timeout``, or seconds).

    Raises:
        what ``create`` raises for the request (``openai.APIStatusError`` and the rest);
        ValueError: the reply's body is not JSON (``json.JSONDecodeError``, or
            ``UnicodeDecodeError`` for bytes that are not text).
    """
    body, options = {}, {}
    for key, value in kwargs.items():
        opt = _REQUEST_OPTIONS.get(key)
        if opt is None:
            body[key] = value
        else:
            options[opt] = value
    return json.loads(client.post("/chat/completions", body=body, cast_to=bytes,
                                  options=options))


def _transient(exc: BaseException) -> bool:
    openai = _openai()
    if isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError,
                        openai.RateLimitError, openai.InternalServerError)):
        return True
    return isinstance(exc, openai.APIStatusError) and (exc.status_code == 429 or exc.status_code >= 500)


def _retry_after(exc: BaseException) -> float | None:
    resp = getattr(exc, "response", None)
    headers = getattr(resp, "headers", None)
    if not headers:
        return None
    raw = headers.get("retry-after-ms")
    if raw is not None:
        try:
            return float(raw) / 1000.0
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        return None  # an HTTP date; fall back to backoff


class ModelClient:
    """A chat-completions client for one endpoint, with bounded, jittered retries.

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
        self.base_url = base_url
        self.max_attempts = max(1, int(max_attempts))
        self._api_key = api_key or "EMPTY"
        self._timeout = timeout
        self._client_obj = None
        self._hard_deadline = False  # the deadline network backend is in place
        self._init_lock = threading.Lock()
        # per model: parameter -> its replacement (None: dropped), learned from 400s
        self._learned: dict[str, dict[str, str | None]] = {}
        self._warned_usage = False
        self._backoff = wait_random_exponential(multiplier=backoff_base, max=backoff_max)

    @property
    def _client(self):
        if self._client_obj is None:
            with self._init_lock:
                if self._client_obj is None:
                    from rlm.models import http_deadline
                    client = _openai().OpenAI(base_url=self.base_url, api_key=self._api_key,
                                              max_retries=0,
                                              timeout=_http_timeout(self._timeout),
                                              http_client=_plain_http_client(self.base_url))
                    self._hard_deadline = http_deadline.install(client)
                    self._client_obj = client
        return self._client_obj

    def prepare(self) -> None:
        """Build the HTTP client now (importing ``openai``, ~0.5 s of CPU here), as the first
        call would: for a caller with other work under way on threads meanwhile (a big
        context's file being written). Never raises: a client that cannot be built fails the
        first call, with its error, as it would have."""
        try:
            self._client
        except Exception:
            pass

    def close(self) -> None:
        """Close the HTTP connections (a call still in flight on another thread fails)."""
        client = self._client_obj
        if client is not None:
            try:
                client.close()
            except Exception:
                pass

    def _create(self, client, kwargs: dict, deadline: float | None):
        """One HTTP attempt that ends by ``deadline`` whatever the server does: every network
        read and write is cut to it (:mod:`rlm.models.http_deadline`); if that could not be installed
        in this ``openai`` version, the attempt runs on a helper thread left behind at the
        deadline."""
        from rlm.models import http_deadline
        if deadline is None or self._hard_deadline:
            with http_deadline.deadline(deadline):
                return _post_chat(client, kwargs)
        box: dict = {}

        def attempt() -> None:
            try:
                box["value"] = _post_chat(client, kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc
        t = threading.Thread(target=attempt, daemon=True, name="rlm-http")
        t.start()
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            raise _openai().APITimeoutError(request=None)  # type: ignore[arg-type]
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        after = _retry_after(exc) if exc else None
        if after is not None:
            return min(max(after, 0.0), MAX_RETRY_AFTER) + random.uniform(0, 0.05)
        return self._backoff(state)

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
        attempts: list[dict] = []
        t0 = time.monotonic()
        kwargs: dict = {"model": model, "messages": messages}
        caps = capabilities(model)
        if max_tokens is not None:
            kwargs[caps.token_param] = int(max_tokens)
        if temperature is not None and caps.temperature:
            kwargs["temperature"] = float(temperature)
        if stop:
            kwargs["stop"] = stop
        adapted = self._apply_learned(model, kwargs)
        if call_id:
            # a header value is ASCII with no leading or trailing space: a run id may hold any
            # text, so it goes percent-encoded (RFC 3986), as ids do in URLs
            kwargs["extra_headers"] = {"X-RLM-Call-Id": quote(call_id, safe="-_.:/~+")}

        def once():
            n = len(attempts) + 1
            if n > 1 and cancel is not None and cancel.is_set():
                # abandoned during a retry wait: no further attempt is sent
                raise EndpointError(f"model call to {self.base_url} cancelled before attempt {n}")
            a0 = time.monotonic()
            t = timeout
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _openai().APITimeoutError(request=None)  # type: ignore[arg-type]
                t = left if t is None else min(t, left)
            try:
                # the attempt's timeout as a request option: ``with_options`` would copy the
                # whole client (and its resource objects) on every attempt
                resp = self._create(self._client, kwargs if t is None else
                                    dict(kwargs, timeout=_http_timeout(t)), deadline)
            except Exception as exc:
                attempts.append({"n": n, "seconds": round(time.monotonic() - a0, 4),
                                 "error": f"{type(exc).__name__}: {exc}"[:500]})
                if _transient(exc):
                    # the first failure of a call is shown (a retried call may wait a minute
                    # in all); the rest with -v
                    log.log(logging.WARNING if n == 1 else logging.INFO,
                            "model call to %s failed (attempt %d of %d%s): %s", self.base_url,
                            n, self.max_attempts, ", retrying" if n < self.max_attempts else "",
                            attempts[-1]["error"])
                raise
            attempts.append({"n": n, "seconds": round(time.monotonic() - a0, 4), "error": None})
            return resp

        openai = _openai()
        stopped = {"deadline": False}

        def past_deadline(state: RetryCallState) -> bool:
            # tenacity computes the wait before asking to stop: never sleep past the deadline
            if cancel is not None and cancel.is_set():
                return True
            if deadline is not None and (
                    time.monotonic() + (state.upcoming_sleep or 0.0) + 0.01 >= deadline):
                stopped["deadline"] = True
                return True
            return False

        def sleep(seconds: float) -> None:
            if cancel is not None:
                cancel.wait(seconds)
            else:
                time.sleep(seconds)

        def attempts_of(fn):
            # the first attempt is made here, without building tenacity's machinery (most
            # calls need one attempt); when it fails, tenacity takes over with that failure as
            # its first attempt, so the retries, waits and stops are exactly tenacity's
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - handed to tenacity just below
                first = [exc]

            def replayed():
                if first:
                    raise first.pop()
                return fn()
            retrying = Retrying(stop=stop_after_attempt(self.max_attempts) | past_deadline,
                                wait=self._wait, sleep=sleep,
                                retry=retry_if_exception(_transient), reraise=True)
            return retrying(replayed)

        changed: set[str] = set()
        while True:
            try:
                try:
                    resp = attempts_of(once)
                except Exception as exc:
                    if deadline is not None and (stopped["deadline"]
                                                 or time.monotonic() + 0.05 >= deadline):
                        raise DeadlineExceeded(
                            f"model endpoint {self.base_url}: the call could not finish "
                            f"before its deadline after {len(attempts)} attempt(s) (last: "
                            f"{type(exc).__name__}: {_short(exc)})") from None
                    raise
                break
            except openai.APIStatusError as exc:
                change = self._adapt(model, kwargs, exc, changed)
                if change is None:
                    hint = {401: "check --api-key / OPENAI_API_KEY",
                            403: "check the key's permissions",
                            404: "check --model and --base-url"}.get(exc.status_code, "")
                    location = exc.response.headers.get("location") \
                        if 300 <= exc.status_code < 400 else None
                    if location:  # a plain-HTTP client does not follow redirects
                        hint = f"it redirects to {location}: give that as --base-url"
                    raise EndpointError(
                        f"model endpoint {self.base_url} answered HTTP {exc.status_code} "
                        f"after {len(attempts)} attempt(s): {_short(exc)}"
                        + (f"; {hint}" if hint else "")) from None
                attempts[-1]["adapted"] = change
                adapted.append(change)
                log.warning("model %s rejected a request parameter (%s); retrying once with "
                            "%s", model, _short(exc), change)
            except (openai.APIConnectionError, openai.APITimeoutError) as exc:
                raise EndpointError(
                    f"model endpoint {self.base_url} unreachable after {len(attempts)} "
                    f"attempt(s) ({type(exc).__name__}); check that the server is running and "
                    "--base-url is right") from None
            except openai.OpenAIError as exc:
                raise EndpointError(f"model endpoint {self.base_url} failed: {_short(exc)}") \
                    from None
            except ValueError as exc:  # the client's JSON decoding of the reply's body
                raise ModelReplyError(f"model endpoint {self.base_url} sent a reply that is not "
                                      f"valid JSON ({_short(exc)}): is --base-url an "
                                      "OpenAI-compatible endpoint?") from None
        choices = resp.get("choices") if isinstance(resp, dict) else None
        message = choices[0].get("message") if choices and isinstance(choices, list) \
            and isinstance(choices[0], dict) else None
        if not isinstance(message, dict):
            raise ModelReplyError(f"model endpoint {self.base_url} sent a reply with no message "
                                  "(malformed chat completion)")
        raw = message.get("content") or ""
        if not isinstance(raw, str):  # content parts: keep their text
            raw = "".join(p.get("text", "") if isinstance(p, dict) else str(p)
                          for p in (raw if isinstance(raw, list) else [raw]))
        text, sections = split_reasoning(raw)
        reasoning = "\n\n".join(x for x in [reasoning_from_message(message)] + sections if x)
        usage = resp.get("usage")
        usage = usage if isinstance(usage, dict) else {}
        pt, ct = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
        cost = _amount(usage.get("cost"))
        estimated = False
        # no usage, a field missing, or zeros for a non-empty exchange: nothing was reported
        if pt is None or ct is None or (not pt and not ct and (raw or reasoning)):
            estimated = True
            pt, ct = self._estimate(messages, raw, reasoning, pt, ct)
        reply_model = resp.get("model")
        finish = choices[0].get("finish_reason")
        return Completion(text=text, prompt_tokens=int(pt or 0), completion_tokens=int(ct or 0),
                          cost_usd=cost,
                          model=reply_model if isinstance(reply_model, str) and reply_model
                          else model,
                          attempts=attempts, seconds=time.monotonic() - t0,
                          reasoning=reasoning,
                          finish_reason=finish if isinstance(finish, str) else None,
                          usage_estimated=estimated, adapted=adapted)

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
        (each parameter at most once per call) and return what changed, else None."""
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
        if param not in sent:
            if not _REJECTS.search(msg):
                return None
            found = [(m.start(), p) for p in sent
                     for m in [re.search(rf"(?<![A-Za-z_]){p}(?![A-Za-z_])", msg)] if m]
            if not found:
                return None
            param = min(found)[1]
        changed.add(param)
        value = kwargs.pop(param)
        other = {"max_tokens": "max_completion_tokens",
                 "max_completion_tokens": "max_tokens"}.get(param)
        repl = other if other and other not in changed and other not in kwargs else None
        if repl is not None:
            kwargs[repl] = value
            changed.add(repl)
        with self._init_lock:
            self._learned.setdefault(model, {})[param] = repl
        return f"{param} -> {repl or 'dropped'}"

    # usage -----------------------------------------------------------------------------
    def _estimate(self, messages: list[dict], raw: str, reasoning: str, pt, ct) -> tuple[int, int]:
        """Token counts for a reply that reported none (tiktoken, o200k_base); warns once."""
        from rlm.models.tokens import count_messages, count_tokens
        with self._init_lock:
            warn, self._warned_usage = not self._warned_usage, True
        if warn:
            log.warning("model endpoint %s sent no token usage: counting prompt and completion "
                        "tokens locally with tiktoken; usage and cost are estimates, and every "
                        "cap is enforced on them", self.base_url)
        if pt is None or (not pt and not ct):
            pt = count_messages(messages)
        if ct is None or not ct:
            ct = count_tokens(raw) + count_tokens(reasoning)
        return int(pt), int(ct)


def _amount(v) -> float | None:
    """A figure of a reply's ``usage`` (a token count, a cost in USD): a finite number >= 0,
    else None (absent or not such a number: counted locally, or no cost reported)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return None
    return float(v)


def _count(v) -> int | None:
    """A token count of a reply's ``usage`` (:func:`_amount`, whole), else None."""
    a = _amount(v)
    return None if a is None else int(a)


def _short(exc: BaseException) -> str:
    s = str(exc)
    return s if len(s) < 300 else s[:300] + "..."
