"""What ``rlm serve`` tells a client when something failed: :class:`APIError` (an error
response in the protocol's shape), the mapping of a run's failure to one (an upstream failure
becomes the server's own words: the status, a short reason, the upstream error's type and code,
never its text or URL), and the :class:`Redactor` that takes the server's keys out of anything
a client or the log would read."""
from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any

from harness.budget.caps import CAP_BY_NAME
from harness.redact import KEYLIKE, REDACTED  # noqa: F401 (REDACTED re-exported)
from harness.redact import Redactor as BorderRedactor

from rlm.errors import ConfigError, ContextError, EndpointError, RLMError
from rlm.models.transport import provider_secrets


class APIError(Exception):
    """An error response: HTTP ``status`` with the protocol's error object.

    Its headers say ``x-should-retry: false`` unless ``retryable`` (then ``true``): the openai
    SDKs retry 408, 409, 429 and 5xx by default, and a retry of a request whose run already ran
    cannot change what it found. Only a busy server (429) and a run still running elsewhere
    (409) are worth a retry.
    """

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict | None = None,
                 retryable: bool = False, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.headers = status, dict(headers or {})
        self.headers.setdefault("x-should-retry", "true" if retryable else "false")
        self.body = {"error": {"message": message, "type": type_, "param": param, "code": code,
                               **extra}}


# --------------------------------------------------------------------------- secrets

class Redactor:
    """Takes secrets out of text: the server's own keys (``secrets``: its upstream key, its
    clients' key, the values of the host's key variables, :func:`rlm.models.transport.
    provider_secrets`), their base64, and anything that looks like a key: the one redaction of
    :class:`harness.redact.Redactor`, which the model clients apply where provider text
    enters. :meth:`public` also takes out the upstream's URL and address (``urls``), for what
    a client receives."""

    def __init__(self, secrets: Any = (), urls: Any = ()) -> None:
        self._redact = BorderRedactor(list(secrets) + provider_secrets(None))
        self.secrets = self._redact.secrets
        places: set[str] = set()
        for url in urls:
            if isinstance(url, str) and url:
                from urllib.parse import urlsplit
                places.add(url.rstrip("/"))
                try:
                    netloc = urlsplit(url).netloc.rpartition("@")[2]
                except ValueError:
                    netloc = ""
                if netloc:
                    places.add(netloc)
        self.places = sorted(places, key=len, reverse=True)

    def keys(self, text: str) -> str:
        """``text`` with every secret, its base64 and every key-like token replaced by
        ``[redacted]``."""
        return self._redact.text(text)

    def public(self, text: str) -> str:
        """``text`` as a client may see it: :meth:`keys`, and no upstream URL or address."""
        text = self.keys(text)
        for place in self.places:
            text = text.replace(place, "the model endpoint")
        return text

    def record(self, record: logging.LogRecord) -> bool:
        """A :class:`logging.Filter` function: the record's message with its keys redacted."""
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format: logging reports it as it would
            return True
        clean = self.keys(msg)
        if clean != msg:
            record.msg, record.args = clean, None
        return True


#: How an endpoint failure's text (rlm.models.transport, rlm.models.retry) begins, the run's
#: endpoint's or the sub-call endpoint's (``sub_base_url``): the text of a run recorded as failed
#: that way is the upstream's, never a client's to read.
_ENDPOINT_TEXT = re.compile(r"model (?:endpoint|call to) |sub-call endpoint |"
                            r"the llama\.cpp server|embedded server")
_HTTP_STATUS = re.compile(r"\banswered HTTP (\d{3})\b")
#: An upstream error's type or code, as relayed: a short identifier, nothing else.
_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]{0,63}")


def _token(value: Any) -> str | None:
    """``value`` (an upstream error's ``type`` or ``code``) if it is a short identifier (or an
    integer) that looks like no key, else None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and _TOKEN.fullmatch(value) and not KEYLIKE.search(value):
        return value
    return None


def _causes(exc: BaseException):
    """``exc`` and what it came from (``__cause__``, else ``__context__``), at most 8 deep."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen and len(seen) < 8:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def upstream_failure(exc: BaseException) -> dict:
    """What may be told of an endpoint failure ``exc``: ``{"status", "type", "code",
    "reason"}``, each None when unknown. The status and the error object's type and code come
    from the provider SDK's error the failure was raised from (its ``status_code`` and decoded
    ``body``: OpenAI's error object, or Anthropic's ``{"error": {...}}``), else the status from
    the failure's text; the reason is the server's own words, never the upstream's text."""
    from rlm.errors import ModelReplyError
    from rlm.models.base import DeadlineExceeded
    out: dict = {"status": None, "type": None, "code": None, "reason": None}
    names = []
    for e in _causes(exc):
        names.append(type(e).__name__)
        status = getattr(e, "status_code", None)
        if out["status"] is None and isinstance(status, int) and 100 <= status <= 599:
            out["status"] = status
            body = getattr(e, "body", None)
            err = body.get("error") if isinstance(body, dict) else None
            err = err if isinstance(err, dict) else body
            if isinstance(err, dict):
                out["type"], out["code"] = _token(err.get("type")), _token(err.get("code"))
    if out["status"] is None:
        m = _HTTP_STATUS.search(str(exc))
        if m:
            out["status"] = int(m[1])
    if out["status"] is not None:
        try:
            out["reason"] = HTTPStatus(out["status"]).phrase
        except ValueError:
            out["reason"] = None
    elif isinstance(exc, DeadlineExceeded) or any("Timeout" in n for n in names[1:]):
        out["reason"] = "the call timed out"
    elif any("Connection" in n or "Connect" in n for n in names[1:]) or \
            " unreachable after " in str(exc):
        out["reason"] = "unreachable"
    elif isinstance(exc, ModelReplyError):
        out["reason"] = "its reply is not a usable chat completion"
    elif " cancelled before attempt " in str(exc):
        out["reason"] = "the call was cancelled"
    else:
        out["reason"] = "no usable reply"
    return out


def _upstream_error(exc: BaseException) -> APIError:
    """The 502 of an endpoint failure, in the server's own words (:func:`upstream_failure`)."""
    f = upstream_failure(exc)
    if f["status"] is not None:
        what = f"HTTP {f['status']}" + (f" {f['reason']}" if f["reason"] else "")
    else:
        what = f["reason"]
    detail = ", ".join(x for x in (f["type"], f["code"]) if x)
    return APIError(502, f"the model endpoint failed: {what}" + (f" ({detail})" if detail else ""),
                    "upstream_error", code="upstream_error",
                    upstream={"status": f["status"], "type": f["type"], "code": f["code"]})


def _check_result(res: Any) -> None:
    """Raise the protocol error of a run that did not complete."""
    if res.status == "completed":
        return
    if res.status == "budget_exceeded":
        cap = CAP_BY_NAME.get(res.cap or "")
        status = cap.http_status if cap is not None else 402
        raise APIError(status, f"the run stopped at its {res.cap} cap: {res.reason}",
                       "budget_exceeded", code=res.cap, run_id=res.run_id,
                       partial_answer=res.answer)
    reason = res.reason or res.status
    if _ENDPOINT_TEXT.search(reason):  # a recorded endpoint failure: the upstream's text
        reason = _upstream_error(EndpointError(reason)).body["error"]["message"]
    raise APIError(500, f"the run ended without an answer: {reason}",
                   "run_failed", code=res.status, run_id=res.run_id)


def _error_of(exc: BaseException) -> APIError:
    """The protocol error of a run that raised ``exc``. An endpoint failure is told in the
    server's own words (:func:`_upstream_error`): its text is the upstream's."""
    from harness.errors import DivergenceError, RunActiveError, RunMismatchError
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RunMismatchError):  # the run id is the request's Idempotency-Key
        return APIError(409, str(exc).replace("run id", "Idempotency-Key"),
                        code="idempotency_conflict")
    if isinstance(exc, RunActiveError):  # its owner (a pid, a host) is the operator's to know
        return APIError(409, "this request's run is still running elsewhere (a request with "
                        "the same Idempotency-Key, or another server process): retry once it "
                        "has finished", code="run_active", retryable=True)
    if isinstance(exc, DivergenceError):
        return APIError(409, str(exc), "run_failed", code="divergence")
    if isinstance(exc, (ConfigError, ContextError)):
        return APIError(400, str(exc))
    from harness.journal.errors import JournalError, JournalUnavailableError
    if isinstance(exc, JournalUnavailableError):  # the run resumes once its database is back
        return APIError(503, str(exc), "server_error", code="journal_unavailable",
                        retryable=True)
    if isinstance(exc, JournalError):
        return APIError(500, str(exc), "server_error", code="journal_error")
    if isinstance(exc, EndpointError):
        return _upstream_error(exc)
    if isinstance(exc, RLMError):
        if _ENDPOINT_TEXT.search(str(exc)):  # e.g. a child's failure quoting its endpoint's
            return _upstream_error(exc)
        return APIError(500, str(exc), "run_failed", code=type(exc).__name__)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


def _public(err: APIError, redactor: Redactor) -> APIError:
    """``err`` with no key and no upstream URL in its message (a last guard: every message
    built from an exception's text passes here before a client reads it)."""
    e = err.body.get("error")
    if isinstance(e, dict) and isinstance(e.get("message"), str):
        clean = redactor.public(e["message"])
        if clean != e["message"]:
            e["message"] = clean
    return err
