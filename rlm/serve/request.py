"""What one ``POST /v1/chat/completions`` of ``rlm serve`` asks for: its body read under the
server's size limit, the context, query and run options it maps to (:func:`parse_request`), and
the refusal, as a 400 naming the field, of every parameter the server cannot honour or whose
value is out of range. Messages name request fields, never ``rlm run`` flags."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from rlm.config.options import OPTION_NAMES, OPTIONS
from rlm.config.validate import validate_options
from rlm.context.load import Literal
from rlm.errors import ConfigError
from rlm.serve.errors import APIError

__all__ = ["DEFAULT_MAX_BODY_BYTES", "REMOTE_OPTIONS", "ChatRequest", "cap_answer",
           "parse_request", "read_body", "request_options", "run_id_of"]

#: Run options a request may set (the rest are the server's: endpoint, journal, keys, files).
#: In the ``rlm`` object all of them; at the top level all but ``max_tokens`` and
#: ``max_completion_tokens``, which there keep OpenAI's meaning (the answer's length cap).
REMOTE_OPTIONS = frozenset({
    "max_iterations", "max_depth", "cell_timeout", "max_output_chars", "max_cost_usd",
    "max_tokens", "max_calls", "max_wall_seconds", "max_children_per_call", "max_concurrency",
    "max_completion_tokens", "sub_max_tokens", "sub_prompt_chars", "temperature",
}) & OPTION_NAMES
#: OpenAI's names for the answer's length cap (the same thing here).
_ANSWER_CAPS = ("max_tokens", "max_completion_tokens")
_TOP_LEVEL_OPTIONS = REMOTE_OPTIONS - set(_ANSWER_CAPS)

#: The request body limit of ``rlm serve --max-body-bytes`` by default (bytes): room for a
#: context of tens of megabytes, far below what would strain the server's memory.
DEFAULT_MAX_BODY_BYTES = 64 << 20

#: OpenAI request fields that change nothing about a run or its answer, taken and ignored.
_INERT = frozenset({"user", "metadata", "store", "stream_options", "parallel_tool_calls",
                    "prompt_cache_key", "safety_identifier"})
_MAPPED = frozenset({"model", "messages", "stream", "response_format", "context", "rlm",
                     *_ANSWER_CAPS})


# --------------------------------------------------------------------------- the body

async def read_body(request: Any, limit: int) -> bytes:
    """The body of ``request`` (a Starlette request), refused before it is read when it is
    larger than ``limit`` bytes: from its ``Content-Length``, else (a chunked body) as soon as
    the bytes received pass the limit.

    Raises:
        APIError: 413 over the limit; 400 for a ``Content-Length`` that is no number.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise APIError(400, f"the Content-Length header is not a number: {declared!r}") \
                from None
        if size > limit:
            raise _too_large(f"{size} bytes", limit)
    chunks, got = [], 0
    async for chunk in request.stream():
        got += len(chunk)
        if got > limit:
            raise _too_large(f"over {limit} bytes", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: str, limit: int) -> APIError:
    return APIError(413, f"the request body is {size}, over this server's limit of {limit} "
                    f"bytes ({limit / (1 << 20):g} MiB): send a smaller context, or ask the "
                    "server's operator for a larger limit", code="request_too_large")


def read_json(raw: bytes) -> Any:
    """``raw`` as JSON; an :class:`APIError` 400 when it is not (or nests too deep)."""
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise APIError(400, "the request body nests JSON arrays or objects too deeply "
                       "to read") from None


# --------------------------------------------------------------------------- parameters

def _number(lo: float, hi: float, whole: bool = False) -> Callable[[Any], str | None]:
    """A check: the problem of a value that is no number in [``lo``, ``hi``] (whole if asked)."""
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or (whole and not float(v).is_integer()) or not lo <= v <= hi:
            return f"must be a {'whole number' if whole else 'number'} from {lo:g} to {hi:g}"
        return None
    return check


def _kind(*types: type) -> Callable[[Any], str | None]:
    names = " or ".join({bool: "true or false", list: "a list", dict: "an object",
                         str: "a string", int: "a whole number"}[t] for t in types)

    def check(v: Any) -> str | None:
        ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
        return None if ok else f"must be {names}"
    return check


_NEVER: Callable[[Any], bool] = lambda v: False  # noqa: E731
_SAMPLING = ("the runs' model calls are sampled by temperature alone: leave it out and set "
             "'temperature'")
_NO_TOOLS = ("the answer is the text a run's code passes to FINAL, never a tool call: leave "
             "it out")

#: The OpenAI parameters this server cannot honour: name -> (check of the value's type and
#: range, or None; the values that ask for nothing, so are taken; why any other is refused).
_UNHONOURED: dict[str, tuple[Callable | None, Callable[[Any], bool], str]] = {
    "n": (_number(1, 128, whole=True), lambda v: v == 1,
          "one request is one run with one answer: send n=1, or several requests"),
    "top_p": (_number(0, 1), lambda v: v == 1, _SAMPLING),
    "frequency_penalty": (_number(-2, 2), lambda v: v == 0, _SAMPLING),
    "presence_penalty": (_number(-2, 2), lambda v: v == 0, _SAMPLING),
    "logit_bias": (_kind(dict), lambda v: not v, _SAMPLING),
    "seed": (_kind(int), _NEVER, "runs are not seeded; the same request with the same "
                                 "Idempotency-Key returns the same recorded answer"),
    "logprobs": (_kind(bool), lambda v: v is False,
                 "an answer a run's code wrote has no token log probabilities"),
    "top_logprobs": (_number(0, 20, whole=True), lambda v: v == 0,
                     "an answer a run's code wrote has no token log probabilities"),
    "tools": (_kind(list), lambda v: not v, _NO_TOOLS),
    "functions": (_kind(list), lambda v: not v, _NO_TOOLS),
    "tool_choice": (None, lambda v: v in ("none", "auto"), _NO_TOOLS),
    "function_call": (None, lambda v: v in ("none", "auto"), _NO_TOOLS),
    "stop": (_kind(str, list), lambda v: not v,
             "the answer is set whole by FINAL, not generated up to a stop sequence"),
    "modalities": (_kind(list), lambda v: v == ["text"], "the answer is text only"),
    "audio": (None, _NEVER, "the answer is text only"),
    "prediction": (None, _NEVER, "an answer comes from a run, not from one generation"),
    "web_search_options": (None, _NEVER, "the runs do not search the web"),
    "reasoning_effort": (None, _NEVER, "it cannot be passed on to the runs' model calls"),
    "verbosity": (None, _NEVER, "it cannot be passed on to the runs' model calls"),
    "service_tier": (None, lambda v: v in ("auto", "default"),
                     "the runs' model calls use the server's endpoint as it is configured"),
}


def check_parameters(body: dict) -> None:
    """Refuse what the server cannot honour: a parameter of :data:`_UNHONOURED` asking for
    anything (``n=2``, ``tools``, ``tool_choice: "required"``, ``top_p`` other than 1, ...), a
    value out of its range (``top_p: 7``), and a field no version of the protocol has.

    Raises:
        APIError: 400 with ``param`` the field: code ``invalid_value`` (type or range),
        ``unsupported_parameter`` (cannot be honoured) or ``unknown_parameter``.
    """
    for name, value in body.items():
        if value is None or name in _MAPPED or name in _INERT or name in _TOP_LEVEL_OPTIONS:
            continue
        rule = _UNHONOURED.get(name)
        if rule is None:
            raise APIError(400, f"unrecognized request field {name!r}: run options go in the "
                           f"'rlm' object ({', '.join(sorted(REMOTE_OPTIONS))})",
                           param=name, code="unknown_parameter")
        check, asks_nothing, why = rule
        problem = check(value) if check is not None else None
        if problem:
            raise APIError(400, f"{name!r} {problem}, got {_shown(value)}", param=name,
                           code="invalid_value")
        if not asks_nothing(value):
            raise APIError(400, f"{name!r} = {_shown(value)} cannot be honoured by this "
                           f"server: {why}", param=name, code="unsupported_parameter")


def _shown(value: Any) -> str:
    """``value`` as a message quotes it: its repr, or its type for a long one (a tool list)."""
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__} of {len(value)} item(s)" \
        if isinstance(value, (list, dict)) else text[:57] + "..."


def answer_cap(body: dict) -> int | None:
    """The answer's length cap (tokens) a request sets: ``max_tokens`` or
    ``max_completion_tokens`` at the top level (the same thing), or None.

    Raises:
        APIError: 400 for a value that is no whole number >= 1, or both given and different.
    """
    given = {k: body[k] for k in _ANSWER_CAPS if body.get(k) is not None}
    for name, v in given.items():
        problem = _number(1, 1e9, whole=True)(v)
        if problem:
            raise APIError(400, f"{name!r} {problem}, got {v!r}", param=name,
                           code="invalid_value")
    if len(set(given.values())) > 1:
        raise APIError(400, "'max_tokens' and 'max_completion_tokens' both cap the answer's "
                       "length here: give one of them, or the same value",
                       param="max_completion_tokens", code="invalid_value")
    return int(next(iter(given.values()))) if given else None


def cap_answer(answer: str | None, cap: int | None) -> tuple[str | None, str]:
    """``(answer, finish_reason)``: the answer cut to ``cap`` tokens (o200k_base, as the
    server counts) with ``"length"`` when it is longer, else as it is with ``"stop"``."""
    if cap is None or not answer:
        return answer, "stop"
    from rlm.models.tokens import encoding
    tokens = encoding().encode_ordinary(answer)
    if len(tokens) <= cap:
        return answer, "stop"
    return encoding().decode(tokens[:cap]), "length"


def _check_run_options(given: dict, where: dict) -> None:
    """Check each run option's value as ``rlm run`` does, the message naming the request
    field it came from (``where[name]``: ``rlm.max_depth`` or ``max_depth``).

    Raises:
        APIError: 400 with ``param`` that field.
    """
    labels = {o.name: o.label for o in OPTIONS}
    for name, value in given.items():
        try:
            validate_options({name: value})
        except ConfigError as exc:
            msg, label = str(exc), labels.get(name, name)
            if msg.startswith(label):
                msg = msg[len(label):].lstrip()
            raise APIError(400, f"{where[name]!r} {msg}", param=where[name],
                           code="invalid_value") from None


# --------------------------------------------------------------------------- the mapping

@dataclass
class ChatRequest:
    """One chat-completions request as a run: ``context`` and ``query`` of the run,
    ``options`` its run options (checked), ``model`` the name the response shows, ``stream``
    whether it is streamed, ``answer_cap`` the answer's length cap in tokens (or None)."""

    context: Any
    query: str
    options: dict = field(default_factory=dict)
    model: str = "rlm"
    stream: bool = False
    answer_cap: int | None = None
    #: the request field each run option came from (``max_depth`` or ``rlm.max_depth``)
    fields: dict = field(default_factory=dict)
    #: ``rlm.session``: the session this request is the next question of (rlm.serve.sessions)
    session: str | None = None


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and p.get("type") in ("text", "input_text"))
    if content is None:
        return ""
    raise APIError(400, f"'{where}' must be a string or a list of text parts", param=where)


def _messages(body: dict) -> tuple[Any, str]:
    """(context, query) of the body's ``messages`` (see :mod:`rlm.serve.server`)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise APIError(400, "'messages' must be a non-empty list of message objects",
                       param="messages")
    last = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=None)
    if last is None:
        raise APIError(400, "'messages' holds no user message: the last one is the query",
                       param="messages")
    query = _text(msgs[last].get("content"), f"messages[{last}].content")
    pieces = [_text(m.get("content"), f"messages[{i}].content")
              for i, m in enumerate(msgs[:last])
              if m.get("role") in ("system", "developer", "user")]
    return (pieces[0] if len(pieces) == 1 else pieces if pieces else query), query


def parse_request(body: Any) -> ChatRequest:
    """The :class:`ChatRequest` of one request body (parsed JSON).

    Raises:
        APIError: 400 for a malformed body, a parameter the server cannot honour or a value
        out of range (``param`` names the field); 404 for an unknown model.
    """
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    context, query = _messages(body)
    if "context" in body:
        context = body["context"]
        if not isinstance(context, (str, list, dict)):
            raise APIError(400, "'context' must be a string, a list or a JSON object",
                           param="context")
    check_parameters(body)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise APIError(400, f"'stream' must be true or false, got {stream!r}", param="stream",
                       code="invalid_value")
    opts: dict = {}
    model = body.get("model")
    if model not in (None, "rlm"):
        if not isinstance(model, str) or not model.startswith("rlm/") or len(model) <= 4:
            raise APIError(404, f"the model {model!r} does not exist: use 'rlm' or 'rlm/<model>'",
                           code="model_not_found", param="model")
        opts["model"] = model[4:]
    extra = body.get("rlm") or {}
    if not isinstance(extra, dict):
        raise APIError(400, "'rlm' must be an object of run options", param="rlm")
    extra = dict(extra)
    session = extra.pop("session", None)
    if session is not None and (not isinstance(session, str)
                                or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", session)):
        raise APIError(400, "'rlm.session' must be a session id: 1 to 64 letters, digits, "
                       f"'_', '.' or '-', got {session!r}", param="rlm.session",
                       code="invalid_value")
    unknown = set(extra) - REMOTE_OPTIONS
    if unknown:
        raise APIError(400, f"unknown or server-only run option(s) in 'rlm': "
                       f"{', '.join(sorted(unknown))}; allowed: "
                       f"{', '.join(sorted(REMOTE_OPTIONS))}, session", param="rlm")
    given = {k: body[k] for k in _TOP_LEVEL_OPTIONS if body.get(k) is not None}
    where = {k: k for k in given}
    given.update({k: v for k, v in extra.items() if v is not None})
    where.update({k: f"rlm.{k}" for k, v in extra.items() if v is not None})
    _check_run_options(given, where)
    opts.update(given)
    schema = _response_schema(body.get("response_format"))
    if schema is not None:
        opts["answer_schema"] = schema
    # a client's text is its context whatever it looks like: "-" is not the server's stdin
    context = Literal(context) if isinstance(context, str) else context
    return ChatRequest(context, query, opts, str(model or "rlm"), bool(stream),
                       answer_cap(body), where, session)


def request_options(body: Any, server_model: str | None = None) -> tuple[Any, str, dict]:
    """(context, query, run options) of one request body (:func:`parse_request`).

    Raises:
        APIError: as :func:`parse_request`.
    """
    req = parse_request(body)
    return req.context, req.query, req.options


def _response_schema(rf: Any) -> dict | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "'response_format.type' must be 'text', 'json_object' or "
                       "'json_schema'", param="response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return {"type": "object"}
    js = rf.get("json_schema")
    schema = js.get("schema") if isinstance(js, dict) else None
    if not isinstance(schema, dict):
        raise APIError(400, "'response_format.json_schema.schema' must be a JSON Schema object",
                       param="response_format")
    from rlm.core.schema import to_json_schema
    try:
        return to_json_schema(schema)
    except ConfigError as exc:
        msg = str(exc).replace("answer_schema", "'response_format.json_schema.schema'", 1)
        raise APIError(400, msg, param="response_format.json_schema.schema",
                       code="invalid_value") from None


def run_id_of(key: str | None) -> str | None:
    """The run id an ``Idempotency-Key`` header value names (None for no header).

    Raises:
        APIError: 400 for a key that is blank, longer than 200 characters or not printable.
    """
    if key is None:
        return None
    # HTTP hands header values over as Latin-1; a client sends a non-ASCII key as UTF-8 bytes,
    # which read back as the text it meant (else it stays as it came)
    try:
        key = key.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        pass
    key = key.strip()
    if not key or len(key) > 200 or not key.isprintable():
        raise APIError(400, "Idempotency-Key must be 1 to 200 printable characters",
                       param="Idempotency-Key")
    return key
