"""Checking option values before a run starts: :func:`validate_options`, from the one registry
(:data:`rlm.config.options.OPTIONS`): ranges, choices, types, URLs, and an endpoint for a model
name. Messages name the ``rlm run`` flag."""
from __future__ import annotations

import math
import os
from typing import Any, Iterable, Mapping

from rlm.config.checks import http_url
from rlm.config.endpoint import endpoint_configured, sub_endpoint
from rlm.config.options import OPTIONS, SANDBOX_MODES, Option
from rlm.errors import ConfigError
from rlm.models.base import provider_env

__all__ = ["validate_options"]


def _alternatives(values: Iterable[Any]) -> str:
    r = [repr(v) for v in values]
    return r[0] if len(r) == 1 else f"{', '.join(r[:-1])} or {r[-1]}"


def validate_options(o: Mapping[str, Any]) -> None:
    """Check the given option values before anything starts; messages name the ``rlm run`` flag.

    ``None`` values are "not given" and pass. Numbers must be finite, in range, and whole for
    ``int`` options; choices must match; ``base_url`` must be http(s); ``run_id`` not blank;
    ``model`` needs an endpoint (``base_url``/``api_key`` or ``OPENAI_BASE_URL``/``OPENAI_API_KEY``)
    and so does ``sub_base_url``, whose key ``sub_api_key`` is refused without it.

    Raises:
        ConfigError: the first bad value, e.g. ``--max-depth must be >= 0 and <= 8, got 9``.
    """
    for opt in OPTIONS:
        v = o.get(opt.name)
        if v is None:
            continue
        if opt.min is not None:
            _check_number(opt, v)
        if opt.choices is not None and v not in opt.choices:
            raise ConfigError(f"{opt.label} must be {_alternatives(opt.choices)}")
        if opt.type is bool and not isinstance(v, bool):
            raise ConfigError(f"{opt.label} must be True or False, got {v!r}")
        if opt.check is not None:
            problem = opt.check(v)
            if problem:
                raise ConfigError(f"{opt.label} {problem}")
    for name in _TEXT_OPTIONS:
        v = o.get(name)
        if v is not None and not isinstance(v, str):
            raise ConfigError(f"{_label(name)} must be a string, got {type(v).__name__} {v!r}")
    journal = o.get("journal")
    if journal is not None and not isinstance(journal, (str, os.PathLike, bool)) \
            and not hasattr(journal, "create_run"):
        raise ConfigError(f"journal must be a path, a postgresql:// URL, False or a Journal, "
                          f"got {type(journal).__name__} {journal!r}")
    if o.get("on_progress") is not None and not callable(o["on_progress"]):
        raise ConfigError(f"on_progress must be callable, got {o['on_progress']!r}")
    listeners = o.get("listeners")
    if listeners is not None and (not isinstance(listeners, (list, tuple))
                                  or not all(callable(x) for x in listeners)):
        raise ConfigError(f"listeners must be a list of callables, got {listeners!r}")
    _check_env_sandbox(o)
    _check_placement(o)
    spec = provider_env(o.get("provider"))
    env_url = os.environ.get(spec.url_env)
    if not o.get("base_url") and env_url:
        problem = http_url(env_url)
        if problem:
            raise ConfigError(f"{spec.url_env} {problem}")
    if o.get("model") and not endpoint_configured(o):
        raise ConfigError(f"--model {o['model']!r} needs an endpoint: pass --base-url (or set "
                          f"{spec.url_env} / {spec.key_env}); without one the embedded model "
                          "is used, chosen with --embedded-model")
    sub_endpoint(o)  # its refusals, before the run is journaled


def _check_env_sandbox(o: Mapping[str, Any]) -> None:
    """``$RLM_SANDBOX`` stands in for ``--sandbox`` when that is not given: checked here, before
    the run is journaled, as the flag is (a bad value is the user's to fix, not a bug)."""
    from kernels.bwrap import ENV_VAR, SandboxSpec
    if o.get("sandbox") is None:
        try:
            SandboxSpec().requested()
        except ValueError:
            raise ConfigError(f"{ENV_VAR}={os.environ.get(ENV_VAR)!r} must be "
                              f"{_alternatives(SANDBOX_MODES)}: fix it, unset it, or pass "
                              "--sandbox") from None


def _check_placement(o: Mapping[str, Any]) -> None:
    """A gateway placement needs the gateway's URL (``--gateway-url`` or
    ``$JUPYTER_GATEWAY_URL``, itself an http(s) URL): checked before the run is journaled."""
    from kernels.provider import parse_placement
    try:
        placed = parse_placement(o.get("kernels"), o.get("gateway_url"))
    except ValueError:
        return  # the option's own check says what is wrong with it
    if not placed.uses_gateway:
        return
    if not placed.gateway_url:
        raise ConfigError("--kernels places kernels on a gateway: pass --gateway-url URL or set "
                          "$JUPYTER_GATEWAY_URL")
    problem = http_url(placed.gateway_url)
    if problem:
        raise ConfigError(f"JUPYTER_GATEWAY_URL {problem}")


#: keyword options whose value is text when given
_TEXT_OPTIONS = ("model", "sub_model", "child_model", "api_key", "sub_api_key", "embedded_model",
                 "encoding", "system_template", "divergence")


def _label(name: str) -> str:
    opt = next((o for o in OPTIONS if o.name == name), None)
    return opt.label if opt is not None else name


def _check_number(opt: Option, v: Any) -> None:
    label = opt.label
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{label} must be a finite number, got {v!r}")
    if opt.type is int and not float(v).is_integer():
        raise ConfigError(f"{label} must be a whole number, got {v!r}")
    lo, hi = opt.min, opt.max
    if (v <= lo if opt.min_exclusive else v < lo) or v > hi:
        rel = f"> {_bound(lo)}" if opt.min_exclusive else f">= {_bound(lo)}"
        raise ConfigError(f"{label} must be {rel} and <= {_bound(hi)}, got {v!r}")


def _bound(x: float) -> str:
    """A limit as a user writes it: whole numbers in full (1048576, not 1.04858e+06)."""
    return f"{int(x)}" if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"
