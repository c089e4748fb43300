"""A reply whose status says success but whose body says failure.

Proxies and gateways (OpenRouter, LiteLLM, some vLLM and llama.cpp fronts) answer ``200`` with
an error object when the model behind them failed: OpenAI's ``{"error": {...}}``, vLLM's
``{"object": "error", ...}``, Anthropic's ``{"type": "error", "error": {...}}``, or an error
inside a choice (``"finish_reason": "error"``). Such a body is no completion: it is classified
like the HTTP status it stands for, so it is retried when that status would be (429, 5xx) and
fails at once otherwise, and the provider's own message is what the user reads.

The status an error object stands for: its numeric ``code`` (or ``status``) when that is an
HTTP error status; else its ``type``/``code`` words (:data:`_BY_WORD`, from the error types the
OpenAI and Anthropic APIs document); else 502, a gateway's failure (an error object with no
status is most often an upstream that failed, and retries are bounded anyway).
"""
from __future__ import annotations

from typing import Any

from rlm.errors import EndpointError

#: Words of an error's ``type`` or ``code`` -> the HTTP status they stand for, first match
#: wins. ``insufficient_quota`` comes before ``rate_limit``: OpenAI sends it as a 429, but
#: waiting does not bring quota back.
_BY_WORD: tuple[tuple[str, int], ...] = (
    ("insufficient_quota", 402), ("billing", 402), ("quota", 402),
    ("rate_limit", 429), ("too_many_requests", 429),
    ("overloaded", 529), ("unavailable", 503), ("timeout", 504), ("server_error", 500),
    ("internal", 500), ("api_error", 500), ("upstream", 502),
    ("authentication", 401), ("unauthorized", 401), ("invalid_api_key", 401),
    ("permission", 403), ("forbidden", 403),
    ("not_found", 404), ("context_length", 400), ("request_too_large", 413),
    ("invalid", 400), ("bad_request", 400),
)

#: The status of an error object that names none.
DEFAULT_STATUS = 502


class ErrorInReply(Exception):
    """An error object in a successful HTTP reply.

    Attributes:
        status_code: the HTTP status it stands for (int, 400-599).
        message: the provider's message (str, may be empty).
        body: the reply's JSON (dict).
    """

    def __init__(self, status_code: int, message: str, body: dict) -> None:
        super().__init__(f"the reply is an error object ({status_code}-like): "
                         f"{message or 'no message'}")
        self.status_code = status_code
        self.message = message
        self.body = body

    @property
    def transient(self) -> bool:
        """True when the status it stands for is worth another attempt (429, 5xx)."""
        return self.status_code == 429 or self.status_code >= 500

    def endpoint_error(self, base_url: str, attempts: int) -> EndpointError:
        """The run's error once the call gives up: the status, the provider's message, and
        how many attempts it had."""
        again = f" after {attempts} attempt(s)" if self.transient else ""
        return EndpointError(f"model endpoint {base_url} answered with an error{again} (HTTP "
                             f"200 carrying a {self.status_code}-like error): "
                             f"{self.message or 'no message'}")


def _status(obj: dict) -> int:
    for key in ("code", "status", "status_code"):
        v = obj.get(key)
        if isinstance(v, str) and v.isdigit():
            v = int(v)
        if isinstance(v, int) and not isinstance(v, bool) and 400 <= v <= 599:
            return v
    words = " ".join(str(obj.get(k) or "") for k in ("type", "code", "status")).lower()
    for word, status in _BY_WORD:
        if word in words:
            return status
    return DEFAULT_STATUS


def _message(obj: dict) -> str:
    for key in ("message", "detail", "error", "msg"):
        v = obj.get(key)
        if isinstance(v, str) and v.strip():
            return " ".join(v.split())[:500]
    return ""


def error_in_reply(body: Any) -> ErrorInReply | None:
    """The error a successful reply's JSON ``body`` carries instead of a completion, or None
    (a completion, or something else :func:`parse_reply` judges)."""
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    if body.get("object") == "error":
        err = body
    if isinstance(err, str) and err.strip():
        err = {"message": err}
    if isinstance(err, dict) and not _has_output(body):
        return ErrorInReply(_status(err), _message(err), body)
    choices = body.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    if isinstance(first, dict) and isinstance(first.get("error"), dict):
        return ErrorInReply(_status(first["error"]), _message(first["error"]), body)
    return None


def _has_output(body: dict) -> bool:
    """A completion's output is there (chat choices, or Anthropic's content): an ``error``
    key beside it is not the reply's failure."""
    return bool(body.get("choices")) or bool(body.get("content"))
