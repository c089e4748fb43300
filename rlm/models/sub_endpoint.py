"""The client of a run's separate sub-call endpoint (the ``sub_base_url`` option): where
``llm_query``, ``llm_query_batched`` and depth-limit fallbacks go when a run sends them
somewhere other than its root turns (an RL trainer's policy endpoint for the root, a fixed
model elsewhere for the sub-calls). Children's turns stay on the run's own endpoint.

It is an OpenAI-compatible client (:class:`~rlm.models.openai_compat.OpenAICompatClient`,
retries and redaction included) whose errors name the sub-call endpoint and its settings
(``--sub-base-url``, ``RLM_SUB_API_KEY``) instead of the run's own
(:func:`rlm.models.transport.for_sub_calls`).
"""
from __future__ import annotations

from typing import Any

from rlm.errors import EndpointError
from rlm.models.base import Completion, ModelClient, make_client
from rlm.models.transport import for_sub_calls

__all__ = ["SubcallClient"]


class SubcallClient:
    """A :class:`~rlm.models.base.ModelClient` for the sub-call endpoint.

    Args:
        base_url: the endpoint's base URL (``http://host:port/v1``).
        api_key: its key (``RLM_SUB_API_KEY``/``sub_api_key``), or None: sent as ``EMPTY``,
            as the run's own endpoint is sent without one (never the run's own key: that
            goes to the run's endpoint only).
        max_attempts: attempts per call including the first (int >= 1).
    """

    def __init__(self, base_url: str, api_key: str | None = None, *,
                 max_attempts: int = 6) -> None:
        self.base_url = base_url
        self._inner: ModelClient = make_client("openai", base_url, api_key,
                                               max_attempts=max_attempts)

    def complete(self, messages: list[dict], model: str, **kwargs: Any) -> Completion:
        """One chat turn, as :meth:`rlm.models.base.ModelClient.complete` (same keyword
        arguments).

        Raises:
            EndpointError: as the inner client's (same class and attributes), its message
                naming the sub-call endpoint: ``sub-call endpoint URL unreachable after N
                attempt(s) ...; check that the server is running and --sub-base-url is
                right``, or ``... answered HTTP 401 ...; check RLM_SUB_API_KEY``.
        """
        try:
            return self._inner.complete(messages, model, **kwargs)
        except EndpointError as exc:
            raise for_sub_calls(exc) from None

    def prepare(self) -> None:
        """Build the HTTP client now; never raises."""
        self._inner.prepare()

    def close(self) -> None:
        """Close the HTTP connections."""
        self._inner.close()
