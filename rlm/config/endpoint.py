"""The model endpoint a run talks to, resolved from its options and the provider's environment
variables (``OPENAI_*`` for ``openai``, ``ANTHROPIC_*`` for ``anthropic``), or None for the
embedded model; and the separate endpoint of its sub-calls, if it has one
(:func:`sub_endpoint`)."""
from __future__ import annotations

import os
from typing import Any, Mapping, NamedTuple

from rlm.errors import ConfigError
from rlm.models.base import DEFAULT_PROVIDER, provider_env

__all__ = ["Endpoint", "SUB_KEY_ENV", "SubEndpoint", "endpoint_configured", "external_endpoint",
           "sub_endpoint"]

#: The environment variable the sub-call endpoint's key is read from (there is no flag for it:
#: a flag's value is in the process list).
SUB_KEY_ENV = "RLM_SUB_API_KEY"


class Endpoint(NamedTuple):
    """A resolved model endpoint: ``base_url`` (str), ``api_key`` (str | None), ``model`` (str)."""

    base_url: str
    api_key: str | None
    model: str


def _endpoint_settings(o: Mapping[str, Any]) -> tuple[str | None, str | None]:
    spec = provider_env(o.get("provider"))  # its own variables: one provider's key stays its own
    return (o.get("base_url") or os.environ.get(spec.url_env),
            o.get("api_key") or os.environ.get(spec.key_env))


def endpoint_configured(o: Mapping[str, Any]) -> bool:
    """True if the run goes to an OpenAI-compatible endpoint rather than the embedded model:
    ``base_url`` or ``api_key`` is given, or ``OPENAI_BASE_URL``/``OPENAI_API_KEY`` is set."""
    base_url, api_key = _endpoint_settings(o)
    return bool(base_url or api_key)


def _provider_needs(o: Mapping[str, Any]) -> None:
    """A provider other than the default names no endpoint of its own: refused, rather than
    running on the embedded model the user did not ask for.

    Raises:
        ConfigError: ``provider`` is set, but neither a base URL nor a key is given (options or
            that provider's variables)."""
    provider = o.get("provider")
    if provider and provider != DEFAULT_PROVIDER and not endpoint_configured(o):
        spec = provider_env(provider)
        raise ConfigError(f"--provider {provider} needs an endpoint: set {spec.key_env} (or "
                          f"--api-key KEY), and {spec.url_env} or --base-url URL for a server "
                          "other than its default")


def external_endpoint(o: Mapping[str, Any]) -> Endpoint | None:
    """The configured endpoint (see :func:`endpoint_configured`), or None for the embedded model.

    The URL defaults to ``https://api.openai.com/v1`` when only a key is set; the model name
    comes from ``model``, else ``$RLM_MODEL``.

    Raises:
        ConfigError: an endpoint is configured but no model name is.
    """
    _provider_needs(o)
    if not endpoint_configured(o):
        return None
    base_url, api_key = _endpoint_settings(o)
    model = o.get("model") or os.environ.get("RLM_MODEL")
    if not model:
        raise ConfigError("a model endpoint is configured but no model name: pass "
                          "--model NAME (or model=..., or set RLM_MODEL)")
    return Endpoint(base_url or provider_env(o.get("provider")).default_url, api_key, model)


class SubEndpoint(NamedTuple):
    """The separate endpoint of a run's sub-calls: ``base_url`` (str), ``api_key`` (str | None)."""

    base_url: str
    api_key: str | None


def sub_endpoint(o: Mapping[str, Any]) -> SubEndpoint | None:
    """Where ``llm_query``, ``llm_query_batched`` and depth-limit fallbacks are sent: the
    ``sub_base_url`` option with its key (``sub_api_key``, else ``$RLM_SUB_API_KEY``), or None
    when no ``sub_base_url`` is given (they go to the run's own endpoint, as ever; a
    ``$RLM_SUB_API_KEY`` alone changes nothing).

    Without a key the endpoint is sent none, as the run's own endpoint is (a local server needs
    none); one that wants a key answers 401, and the error says to set ``RLM_SUB_API_KEY``.

    Raises:
        ConfigError: ``sub_api_key`` without ``sub_base_url``, or ``sub_base_url`` without an
            endpoint of the run's own (the embedded model serves every call of such a run).
    """
    url = o.get("sub_base_url")
    if not url:
        if o.get("sub_api_key"):
            raise ConfigError("sub_api_key is the key of the sub-call endpoint: give its URL "
                              "too (sub_base_url=..., --sub-base-url URL)")
        return None
    if not endpoint_configured(o):
        spec = provider_env(o.get("provider"))
        raise ConfigError("--sub-base-url needs the run's own endpoint as well: pass "
                          f"--base-url (or set {spec.url_env} / {spec.key_env}); without one "
                          "the embedded model serves every call")
    return SubEndpoint(url, o.get("sub_api_key") or os.environ.get(SUB_KEY_ENV) or None)
