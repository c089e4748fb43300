"""What request parameters each model family accepts: the capability table beside the price table.

OpenAI's reasoning models (the o-series: ``o1``, ``o3``, ``o3-mini``, ``o4-mini``...; and the
``gpt-5`` family) reject ``max_tokens`` with HTTP 400 "Unsupported parameter: 'max_tokens' is not
supported with this model. Use 'max_completion_tokens' instead.", and reject any ``temperature``
but the default (1) with "Unsupported value: 'temperature' does not support 0.0 with this model.
Only the default (1) value is supported." (platform.openai.com/docs/guides/reasoning, "Reasoning
models"; the parameter is documented as ``max_completion_tokens`` in the chat-completions
reference, ``max_tokens`` being deprecated and "not compatible with o-series models"). So for
them the output cap goes out as ``max_completion_tokens`` and no temperature is sent.

Every other model gets the classic parameters (``max_tokens``, ``temperature``), which every
OpenAI-compatible server (vLLM, llama.cpp, Ollama, LiteLLM...) accepts. A model the table gets
wrong, or does not know, is adapted at run time by the client: a 400 that names a parameter it
sent is retried once without it (``max_tokens`` <-> ``max_completion_tokens``; anything else is
dropped), and the adaptation is recorded with the call's attempts.

Names resolve as prices do (:meth:`harness.budget.prices.PriceTable.lookup`): exact name, then without a
provider prefix (``openai/o4-mini``), then without a dated suffix (``o3-2025-04-16``), then by
family prefix (any ``o<digit>`` model, any ``gpt-5*`` model).

Pure standard library; imports nothing from ``rlm`` or ``kernels``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Capabilities", "CLASSIC", "REASONING", "BUILTIN_CAPABILITIES", "capabilities"]


@dataclass(frozen=True)
class Capabilities:
    """The request parameters one model accepts.

    Attributes:
        token_param: the name the output cap is sent under: ``"max_tokens"`` or
            ``"max_completion_tokens"``.
        temperature: ``False`` if the model accepts only its default temperature, so none is sent.
        reasoning: the model is a reasoning model (it spends hidden reasoning tokens inside the
            output cap).
    """

    token_param: str = "max_tokens"
    temperature: bool = True
    reasoning: bool = False

    def __post_init__(self) -> None:
        if self.token_param not in ("max_tokens", "max_completion_tokens"):
            raise ValueError(f"Capabilities.token_param must be 'max_tokens' or "
                             f"'max_completion_tokens', got {self.token_param!r}")


#: What any chat model accepts: the default for names the table does not know.
CLASSIC = Capabilities()
#: OpenAI reasoning models: ``max_completion_tokens``, default temperature only.
REASONING = Capabilities("max_completion_tokens", temperature=False, reasoning=True)

#: Known models (the same names as :data:`harness.budget.prices.BUILTIN_PRICES` where both exist).
BUILTIN_CAPABILITIES: dict[str, Capabilities] = {
    "o1": REASONING, "o1-mini": REASONING, "o1-preview": REASONING, "o1-pro": REASONING,
    "o3": REASONING, "o3-mini": REASONING, "o3-pro": REASONING, "o4-mini": REASONING,
    "gpt-5": REASONING, "gpt-5-mini": REASONING, "gpt-5-nano": REASONING,
    "gpt-5-pro": REASONING,
    "gpt-4o": CLASSIC, "gpt-4o-mini": CLASSIC, "gpt-4.1": CLASSIC, "gpt-4.1-mini": CLASSIC,
    "gpt-4.1-nano": CLASSIC,
}

#: Families by name prefix, for models newer than the table (``o5-mini``, ``gpt-5.1``...).
_FAMILIES: list[tuple[re.Pattern, Capabilities]] = [
    (re.compile(r"^o\d+(?:-|$)"), REASONING),
    (re.compile(r"^gpt-5(?:[.-]|$)"), REASONING),
]
_DATED_SUFFIX = re.compile(r"-(?:\d{4}-\d{2}-\d{2}|\d{8}|latest)$")


def capabilities(model: str, table: dict[str, Capabilities] | None = None) -> Capabilities:
    """The :class:`Capabilities` of ``model`` (:data:`CLASSIC` when nothing matches).

    Args:
        model: the model name as sent to the endpoint.
        table: entries that override :data:`BUILTIN_CAPABILITIES` (``{name: Capabilities}``).
    """
    known = dict(BUILTIN_CAPABILITIES)
    if table:
        known.update(table)
    names = [model]
    if "/" in model:
        names.append(model.rsplit("/", 1)[1])
    names += [_DATED_SUFFIX.sub("", n) for n in list(names) if _DATED_SUFFIX.search(n)]
    for n in names:
        if n in known:
            return known[n]
    for n in names:
        for pattern, caps in _FAMILIES:
            if pattern.match(n.lower()):
                return caps
    return CLASSIC
