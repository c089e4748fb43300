"""Model clients: any OpenAI-compatible chat-completions endpoint through ``openai``.

Transient failures (HTTP 429, 5xx, timeouts, connection errors) are retried by
``tenacity`` with exponential backoff and full jitter, bounded attempts, and the
server's ``Retry-After`` honoured when it sends one. Every attempt is recorded
(and logged at INFO with ``-v``). Other failures (401, 400, 404...) fail at once.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

from tenacity import (RetryCallState, Retrying, retry_if_exception, stop_after_attempt,
                      wait_random_exponential)

from .errors import EndpointError, ModelReplyError

log = logging.getLogger("rlm")

#: Longest honoured Retry-After (s); a server asking for more is waited on this long.
MAX_RETRY_AFTER = 30.0


@dataclass
class Completion:
    """One model reply.

    Attributes:
        text: the reply's content (str).
        prompt_tokens, completion_tokens: usage reported by the endpoint (tokens).
        cost_usd: cost reported by the provider (USD) if it sends one, else None.
        model: the model that answered.
        attempts: one dict per HTTP attempt: ``{"n", "seconds", "error"}``.
        seconds: wall time over all attempts (s).
    """

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = None
    model: str = ""
    attempts: list = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"text": self.text, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "cost_usd": self.cost_usd,
                "model": self.model}


def _openai():
    # imported on first use: ``import openai`` takes ~0.4 s here, and the first model
    # call overlaps it with the kernel's start-up
    import openai
    return openai


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
        timeout: seconds per HTTP attempt.
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
        self._init_lock = __import__("threading").Lock()
        self._backoff = wait_random_exponential(multiplier=backoff_base, max=backoff_max)

    @property
    def _client(self):
        if self._client_obj is None:
            with self._init_lock:
                if self._client_obj is None:
                    self._client_obj = _openai().OpenAI(base_url=self.base_url,
                                                        api_key=self._api_key, max_retries=0,
                                                        timeout=self._timeout)
        return self._client_obj

    def _wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        after = _retry_after(exc) if exc else None
        if after is not None:
            return min(max(after, 0.0), MAX_RETRY_AFTER) + random.uniform(0, 0.05)
        return self._backoff(state)

    def complete(self, messages: list[dict], model: str, *, max_tokens: int | None = None,
                 temperature: float | None = None, stop: list[str] | None = None,
                 timeout: float | None = None, deadline: float | None = None,
                 call_id: str | None = None) -> Completion:
        """Send one chat completion; retry transient failures.

        Args:
            timeout: seconds per attempt (default: the client's).
            call_id: sent as the ``X-RLM-Call-Id`` header (run id and stage id), so a
                provider or proxy can trace, and de-duplicate, retried calls.
            deadline: a ``time.monotonic()`` instant after which no attempt is made or
                kept waiting on (the wall-clock cap); each attempt's timeout is cut to it.

        Returns:
            Completion with text and usage.
        Raises:
            EndpointError: unreachable or failing after ``max_attempts``, or a
                non-transient HTTP error (message says which and what to do).
            ModelReplyError: the reply has no choices/message.
        """
        attempts: list[dict] = []
        t0 = time.monotonic()
        kwargs: dict = {"model": model, "messages": messages}
        if max_tokens is not None:
            kwargs["max_tokens"] = int(max_tokens)
        if temperature is not None:
            kwargs["temperature"] = float(temperature)
        if stop:
            kwargs["stop"] = stop
        if call_id:
            kwargs["extra_headers"] = {"X-RLM-Call-Id": call_id}

        def once():
            n = len(attempts) + 1
            a0 = time.monotonic()
            t = timeout
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _openai().APITimeoutError(request=None)  # type: ignore[arg-type]
                t = left if t is None else min(t, left)
            try:
                client = self._client if t is None else self._client.with_options(timeout=t)
                resp = client.chat.completions.create(**kwargs)
            except Exception as exc:
                attempts.append({"n": n, "seconds": round(time.monotonic() - a0, 4),
                                 "error": f"{type(exc).__name__}: {exc}"[:500]})
                if _transient(exc):
                    log.info("model call attempt %d to %s failed: %s", n, self.base_url,
                             attempts[-1]["error"])
                raise
            attempts.append({"n": n, "seconds": round(time.monotonic() - a0, 4), "error": None})
            return resp

        openai = _openai()
        def past_deadline(state: RetryCallState) -> bool:
            return deadline is not None and time.monotonic() + 0.01 >= deadline

        retrying = Retrying(stop=stop_after_attempt(self.max_attempts) | past_deadline,
                            wait=self._wait,
                            retry=retry_if_exception(_transient), reraise=True)
        try:
            resp = retrying(once)
        except openai.APIStatusError as exc:
            hint = {401: "check --api-key / OPENAI_API_KEY", 403: "check the key's permissions",
                    404: "check --model and --base-url"}.get(exc.status_code, "")
            raise EndpointError(
                f"model endpoint {self.base_url} answered HTTP {exc.status_code} "
                f"after {len(attempts)} attempt(s): {_short(exc)}" + (f"; {hint}" if hint else "")
            ) from None
        except (openai.APIConnectionError, openai.APITimeoutError) as exc:
            raise EndpointError(
                f"model endpoint {self.base_url} unreachable after {len(attempts)} attempt(s) "
                f"({type(exc).__name__}); check that the server is running and --base-url is "
                "right") from None
        except openai.OpenAIError as exc:
            raise EndpointError(f"model endpoint {self.base_url} failed: {_short(exc)}") from None
        choices = getattr(resp, "choices", None) or []
        if not choices or getattr(choices[0], "message", None) is None:
            raise ModelReplyError(f"model endpoint {self.base_url} sent a reply with no message "
                                  "(malformed chat completion)")
        text = choices[0].message.content or ""
        usage = getattr(resp, "usage", None)
        pt = int(getattr(usage, "prompt_tokens", 0) or 0) if usage else 0
        ct = int(getattr(usage, "completion_tokens", 0) or 0) if usage else 0
        cost = None
        if usage is not None:
            extra = getattr(usage, "model_extra", None) or {}
            if isinstance(extra.get("cost"), (int, float)):
                cost = float(extra["cost"])
        return Completion(text=text, prompt_tokens=pt, completion_tokens=ct, cost_usd=cost,
                          model=getattr(resp, "model", None) or model, attempts=attempts,
                          seconds=time.monotonic() - t0)


def _short(exc: BaseException) -> str:
    s = str(exc)
    return s if len(s) < 300 else s[:300] + "..."
