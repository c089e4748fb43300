"""Each model's context window: the tokens one request may hold, prompt and reply together.

Where a window comes from, first match wins (:func:`resolve_window`):

1. the ``context_window`` option (``--context-window TOKENS``), which overrides everything;
2. the embedded model's llama.cpp server, which reports the window of each request slot
   (``GET /props``: ``default_generation_settings.n_ctx``);
3. :data:`BUILTIN_WINDOWS`, the windows the providers publish for their hosted models (names
   resolve as prices do: exact, without a provider prefix, without a dated suffix, then by
   family);
4. an endpoint that rejected a request as too long: its error usually names the window
   (:func:`overflow_error`), and the loop keeps what it learned for its later turns.

A model none of these knows has no window, and its conversation is never compacted before it
is sent (see docs/compaction.md).

Imports nothing from ``rlm`` but its errors.
"""
from __future__ import annotations

import json
import re
import urllib.request
from dataclasses import dataclass
from typing import Any

from rlm.errors import EndpointError

__all__ = ["Window", "BUILTIN_WINDOWS", "ContextWindowExceeded", "known_window",
           "server_window", "resolve_window", "overflow_error"]


@dataclass(frozen=True)
class Window:
    """One model's window.

    Attributes:
        tokens: prompt plus reply, in tokens (int > 0).
        source: where the figure comes from (str): ``"option"``, ``"server"`` (the embedded
            model's ``/props``), ``"table"`` or ``"endpoint"`` (an endpoint's rejection).
    """

    tokens: int
    source: str

    def to_dict(self) -> dict:
        """``{"tokens": int, "source": str}``, as stage meta records it."""
        return {"tokens": self.tokens, "source": self.source}


_OPENAI = "platform.openai.com/docs/models (context window)"
_ANTHROPIC = "docs.anthropic.com/en/docs/about-claude/models (context window)"

#: Published windows of hosted models, tokens: ``{name: (tokens, source of the figure)}``. The
#: names are those of :data:`harness.budget.prices.BUILTIN_PRICES` (plus older OpenAI models).
BUILTIN_WINDOWS: dict[str, tuple[int, str]] = {
    "gpt-4o": (128_000, _OPENAI), "gpt-4o-mini": (128_000, _OPENAI),
    "gpt-4-turbo": (128_000, _OPENAI), "gpt-4": (8_192, _OPENAI),
    "gpt-3.5-turbo": (16_385, _OPENAI),
    "gpt-4.1": (1_047_576, _OPENAI), "gpt-4.1-mini": (1_047_576, _OPENAI),
    "gpt-4.1-nano": (1_047_576, _OPENAI),
    "o1": (200_000, _OPENAI), "o1-pro": (200_000, _OPENAI), "o1-mini": (128_000, _OPENAI),
    "o3": (200_000, _OPENAI), "o3-pro": (200_000, _OPENAI), "o3-mini": (200_000, _OPENAI),
    "o4-mini": (200_000, _OPENAI),
    "gpt-5": (400_000, _OPENAI), "gpt-5-mini": (400_000, _OPENAI),
    "gpt-5-nano": (400_000, _OPENAI),
    # every Claude model since Claude 3 has a 200k window (1M for some only as a beta)
    "claude-opus-4-5": (200_000, _ANTHROPIC), "claude-opus-4-1": (200_000, _ANTHROPIC),
    "claude-opus-4": (200_000, _ANTHROPIC), "claude-sonnet-4-5": (200_000, _ANTHROPIC),
    "claude-sonnet-4": (200_000, _ANTHROPIC), "claude-3-7-sonnet": (200_000, _ANTHROPIC),
    "claude-3-5-sonnet": (200_000, _ANTHROPIC), "claude-haiku-4-5": (200_000, _ANTHROPIC),
    "claude-3-5-haiku": (200_000, _ANTHROPIC), "claude-3-haiku": (200_000, _ANTHROPIC),
}

#: Families by name prefix, for models newer than the table.
_FAMILIES: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"^gpt-5(?:[.-]|$)"), "gpt-5"), (re.compile(r"^gpt-4\.1(?:-|$)"), "gpt-4.1"),
    (re.compile(r"^o\d+(?:-|$)"), "o3"), (re.compile(r"^claude-"), "claude-sonnet-4"),
)
_DATED_SUFFIX = re.compile(r"-(?:\d{4}-\d{2}-\d{2}|\d{8}|latest)$")


def known_window(model: str) -> Window | None:
    """The published window of a hosted ``model`` (:data:`BUILTIN_WINDOWS`), or None."""
    names = [model]
    if "/" in model:
        names.append(model.rsplit("/", 1)[1])
    names += [_DATED_SUFFIX.sub("", n) for n in list(names) if _DATED_SUFFIX.search(n)]
    for n in names:
        if n in BUILTIN_WINDOWS:
            return Window(BUILTIN_WINDOWS[n][0], "table")
    for n in names:
        for pattern, like in _FAMILIES:
            if pattern.match(n.lower()):
                return Window(BUILTIN_WINDOWS[like][0], "table")
    return None


def server_window(base_url: str, api_key: str | None, timeout: float = 5.0) -> int | None:
    """The per-request window a llama.cpp server reports (``GET /props``, its
    ``default_generation_settings.n_ctx``: the window of one slot), in tokens; None when the
    server does not answer or says nothing usable.

    Args:
        base_url: its OpenAI base URL (``http://127.0.0.1:PORT/v1``); api_key: its key.
        timeout: seconds for the whole request.
    """
    root = base_url.rstrip("/")
    root = root[:-3] if root.endswith("/v1") else root
    req = urllib.request.Request(root + "/props",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            props = json.loads(resp.read())
        n = (props.get("default_generation_settings") or {}).get("n_ctx")
    except (OSError, ValueError, AttributeError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def resolve_window(model: str, opts: Any) -> Window | None:
    """The window of ``model`` in a run with options ``opts`` (an
    :class:`~rlm.config.options.Options`): the ``context_window`` option, else the embedded
    server's report, else the table; None when none knows it (and for ``context_window=0``,
    compaction off)."""
    given = getattr(opts, "context_window", None)
    if given is not None:
        return Window(int(given), "option") if given > 0 else None
    if getattr(opts, "embedded", False) and opts.base_url:
        n = server_window(opts.base_url, opts.api_key)
        if n is not None:
            return Window(n, "server")
    return known_window(model)


class ContextWindowExceeded(EndpointError):
    """The endpoint refused a request as longer than the model's window (HTTP 400
    ``context_length_exceeded`` and its equivalents).

    Attributes:
        window: the window the error names (tokens), or None when it names none.
        prompt_tokens: the request's size the error names (tokens), or None.
    """

    def __init__(self, message: str, window: int | None = None,
                 prompt_tokens: int | None = None) -> None:
        super().__init__(message)
        self.window, self.prompt_tokens = window, prompt_tokens


# what the endpoints say: OpenAI and vLLM ("maximum context length is N tokens ... resulted in M
# tokens"), llama.cpp ("request (M tokens) exceeds the available context size (N tokens)"),
# Anthropic ("prompt is too long: M tokens > N maximum")
_CODES = ("context_length_exceeded", "exceed_context_size_error", "string_above_max_length")
_SAYS = re.compile(r"maximum context length|context size|context window|context_length_exceeded|"
                   r"prompt is too long|too many tokens|reduce the length", re.IGNORECASE)
_WINDOW = (re.compile(r"maximum context length is (\d+)", re.I),
           re.compile(r"context size \((\d+) tokens?\)", re.I),
           re.compile(r"tokens? > (\d+) maximum", re.I))
_PROMPT = (re.compile(r"(?:resulted in|requested) (\d+) tokens", re.I),
           re.compile(r"request \((\d+) tokens?\)", re.I),
           re.compile(r"too long: (\d+) tokens", re.I))


def _first(patterns: tuple, text: str) -> int | None:
    for p in patterns:
        m = p.search(text)
        if m:
            return int(m.group(1))
    return None


def overflow_error(exc: Any, message: str, base_url: str) -> ContextWindowExceeded | None:
    """The :class:`ContextWindowExceeded` of an SDK's HTTP error ``exc`` (with
    ``status_code`` and ``body``) whose body or ``message`` says the request was too long for
    the window, else None (another error)."""
    if getattr(exc, "status_code", None) not in (400, 413, 422):
        return None
    body = getattr(exc, "body", None)
    err = body.get("error", body) if isinstance(body, dict) else {}
    err = err if isinstance(err, dict) else {"message": str(err)}
    words = " ".join(str(err.get(k) or "") for k in ("code", "type"))
    text = " ".join([message, str(err.get("message") or "")])
    if not any(c in words for c in _CODES) and not _SAYS.search(text):
        return None
    window = err.get("n_ctx") if isinstance(err.get("n_ctx"), int) else _first(_WINDOW, text)
    prompt = (err.get("n_prompt_tokens") if isinstance(err.get("n_prompt_tokens"), int)
              else _first(_PROMPT, text))
    return ContextWindowExceeded(
        f"model endpoint {base_url} refused the request as too long for the model's window "
        f"(HTTP {exc.status_code}): {message}; set --context-window TOKENS so the "
        "conversation is compacted before it is sent", window, prompt)
