"""The provider-neutral part of the model clients: what a reply is (:class:`Completion`), the
errors no provider owns (:class:`DeadlineExceeded`), what a client is (:class:`ModelClient`, a
``typing.Protocol``) and the table of providers (:data:`PROVIDERS`, :func:`make_client`).

A provider is one module holding a client class and one :class:`Provider` entry in
:data:`PROVIDERS`. The entry names the class by import path, so ``import rlm`` imports no
provider module and no provider SDK: a client's module is imported when a client of that
provider is made, and its SDK (``openai``, ``anthropic``) when the client first sends.

Pure standard library and :mod:`rlm.errors`; nothing here imports a provider's package.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rlm.errors import ConfigError, EndpointError

__all__ = ["CUT_REASONS", "Completion", "DeadlineExceeded", "ModelClient", "Provider",
           "PROVIDERS", "DEFAULT_PROVIDER", "make_client", "provider_env", "provider_spec",
           "short"]

#: ``finish_reason`` values meaning the reply stopped at the output-token limit.
CUT_REASONS = frozenset({"length", "max_tokens", "max_output_tokens", "model_length"})


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
        response_id: the reply's own id as the provider sent it (``chatcmpl-...``, ``msg_...``;
            None if it sent none).
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
    response_id: str | None = None

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
        if self.response_id:
            d["id"] = self.response_id
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
                   reasoning=resp.get("reasoning", ""), finish_reason=resp.get("finish_reason"),
                   response_id=resp.get("id"))


@runtime_checkable
class ModelClient(Protocol):
    """What the run (:mod:`rlm.core.run_tree`, :mod:`rlm.core.drive`) asks of a model client.

    A client holds its endpoint's credentials (never handed to a kernel), retries transient
    failures itself and records every attempt in the :class:`Completion` it returns.
    """

    def complete(self, messages: list[dict], model: str, *, max_tokens: int | None = None,
                 temperature: float | None = None, stop: list[str] | None = None,
                 timeout: float | None = None, deadline: float | None = None,
                 call_id: str | None = None, cancel: Any = None) -> Completion:
        """One chat turn: ``messages`` (``{"role", "content"}`` dicts, system first) to
        ``model``; ``max_tokens`` the output cap; ``deadline`` a ``time.monotonic()`` instant
        no attempt outlives; ``call_id`` traces the call (run id / stage id); ``cancel`` an
        object with ``is_set()``/``wait(s)`` that stops further attempts.

        Raises:
            EndpointError: unreachable, failing after retries, or a non-transient error.
            DeadlineExceeded: the deadline ended the call.
            ModelReplyError: the reply is not a usable completion.
        """
        ...

    def prepare(self) -> None:
        """Do the first call's set-up now (import the SDK, build the HTTP client); never
        raises."""
        ...

    def close(self) -> None:
        """Close the client's connections."""
        ...


@dataclass(frozen=True)
class Provider:
    """One entry of :data:`PROVIDERS`: a factory ``(base_url, api_key, *, max_attempts) ->
    ModelClient`` that imports its client class only when called.

    Attributes:
        target: the client class as ``"module:Class"``.
        key_env: the environment variable the API key is read from when none is given.
        url_env: the environment variable the base URL is read from when none is given.
        default_url: the base URL when only a key is configured.
    """

    target: str
    key_env: str
    url_env: str
    default_url: str

    def client_class(self) -> type:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)

    def __call__(self, base_url: str, api_key: str | None = None, *,
                 max_attempts: int = 6) -> ModelClient:
        return self.client_class()(base_url, api_key, max_attempts=max_attempts)


#: The provider a run uses unless told otherwise.
DEFAULT_PROVIDER = "openai"

#: Every provider, by the name ``--provider`` / ``provider=`` takes.
PROVIDERS: dict[str, Provider] = {
    "openai": Provider("rlm.models.openai_compat:OpenAICompatClient", "OPENAI_API_KEY",
                       "OPENAI_BASE_URL", "https://api.openai.com/v1"),
    "anthropic": Provider("rlm.models.anthropic_messages:AnthropicMessagesClient",
                          "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "https://api.anthropic.com"),
}


def provider_spec(provider: str | None) -> Provider:
    """The :class:`Provider` named ``provider`` (None: :data:`DEFAULT_PROVIDER`).

    Raises:
        ConfigError: no such provider; the message names the known ones.
    """
    name = DEFAULT_PROVIDER if provider is None else provider
    spec = PROVIDERS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ConfigError(f"unknown model provider {name!r}: the known providers are "
                          f"{', '.join(sorted(PROVIDERS))}")
    return spec


def provider_env(provider: str | None) -> Provider:
    """The :class:`Provider` whose environment variables and default URL a run's endpoint is
    resolved with: ``provider``'s, or :data:`DEFAULT_PROVIDER`'s for None or an unknown name
    (which option validation refuses first)."""
    return PROVIDERS.get(provider or DEFAULT_PROVIDER) or PROVIDERS[DEFAULT_PROVIDER]


def make_client(provider: str | None, base_url: str, api_key: str | None = None,
                max_attempts: int = 6) -> ModelClient:
    """A client of ``provider`` for the endpoint at ``base_url``.

    Raises:
        ConfigError: ``provider`` is not in :data:`PROVIDERS` (the message names the known ones).
    """
    return provider_spec(provider)(base_url, api_key, max_attempts=max_attempts)


def short(exc: BaseException | str) -> str:
    """An exception's (or a message's) text for an error message, at most about 300
    characters."""
    s = str(exc)
    return s if len(s) < 300 else s[:300] + "..."
