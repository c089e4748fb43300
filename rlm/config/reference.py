"""Keyword options named as the reference implementation (alexzhang13/rlm) names them.

Code written for the reference's ``RLM(...)`` should either run here unchanged or fail with an
error that names what to write instead, never with a bare ``unknown option(s)``. Where an
option means the same thing here, it is an alias (translated by :func:`from_reference` before
the options are checked); where it does not, :class:`~rlm.errors.ConfigError` names this
harness's replacement. docs/migration.md shows the two side by side.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any

from rlm.errors import ConfigError

__all__ = ["from_reference", "root_prompt", "REFERENCE_NAMES"]

#: Backends whose endpoint speaks the OpenAI protocol or Anthropic's (``provider`` here).
_PROVIDER_OF = {"openai": "openai", "vllm": "openai", "anthropic": "anthropic"}
#: ``backend_kwargs`` keys and the options they become.
_BACKEND_KEYS = {"model_name": "model", "api_key": "api_key", "base_url": "base_url"}

#: Same meaning, another name: ``reference name -> this harness's option``.
_RENAMED = {"max_budget": "max_cost_usd", "max_timeout": "max_wall_seconds",
            "compaction_threshold_pct": "compact_at"}

#: No option here means the same: what to use instead.
_REPLACED = {
    "persistent": "a session keeps one kernel and conversation across questions: "
                  "`with rlm.Session(context, ...) as s: s.ask('first'); s.ask('second')` "
                  "(see docs/sessions.md)",
    "logger": "every run is journaled: walk `result.tree` (its stages: iterations, cells, "
              "sub-calls, children, with their evidence and usage), or `rlm show RUN_ID` / "
              "`rlm view RUN_ID` / `rlm export RUN_ID` (see docs/migration.md)",
    "custom_sub_tools": "give each tool the levels that have it: "
                        "`rlm.tool(fn, levels=[0])` for the root only (see docs/tools.md)",
    "custom_system_prompt": "the prompt is chosen by profile: `prompt='...'` / `--prompt` "
                            "(see docs/reference/options.md)",
    "other_backends": "name the models of sub-calls and children with `sub_model=` and "
                      "`child_model=`, and a separate endpoint for sub-calls with "
                      "`sub_base_url=` (its key: `sub_api_key=` or RLM_SUB_API_KEY)",
    "other_backend_kwargs": "name the models of sub-calls and children with `sub_model=` and "
                            "`child_model=`, and a separate endpoint for sub-calls with "
                            "`sub_base_url=` (its key: `sub_api_key=` or RLM_SUB_API_KEY)",
    "environment": "code runs in a sandboxed local Jupyter kernel; `sandbox=` sets how strict "
                   "(see docs/security.md)",
    "environment_kwargs": "kernel limits are options: `kernel_memory_mb=`, "
                          "`kernel_processes=`, `kernel_disk_mb=`, `kernel_network=`",
    "depth": "the root is always level 0; `max_depth=` sets how deep children go",
    "max_errors": "a failing cell is fed back to the model; bound a run with `max_iterations=`,"
                  " `max_calls=` or `max_wall_seconds=`",
    "tool_prompts": "a tool's docstring is what the model reads: give host functions as "
                    "`tools=[fn]` (see docs/tools.md)",
    "tool_code": "give host functions as `tools=[fn]`; code the kernel runs itself is the "
                 "model's (see docs/tools.md)",
    "on_subcall_start": "watch the run with `listeners=[f]` (each stage change) or "
                        "`on_progress=f` (progress lines)",
    "on_subcall_complete": "watch the run with `listeners=[f]` (each stage change)",
    "on_iteration_start": "watch the run with `listeners=[f]` (each stage change)",
    "on_iteration_complete": "watch the run with `listeners=[f]` (each stage change)",
}

#: Every reference name :func:`from_reference` knows (frozenset of str).
REFERENCE_NAMES = frozenset({"backend", "backend_kwargs", "custom_tools", "compaction",
                             "verbose"} | set(_RENAMED) | set(_REPLACED))


def _refuse(name: str, value: Any) -> None:
    if name == "persistent" and not value:
        return  # the reference's default: one environment per call, as here
    if name == "environment" and value in (None, "local"):
        return
    if name == "depth" and value in (None, 0):
        return
    if name in ("logger", "custom_sub_tools", "custom_system_prompt", "other_backends",
                "other_backend_kwargs", "environment_kwargs", "max_errors", "tool_prompts",
                "tool_code") and value is None:
        return
    raise ConfigError(f"{name}= is the reference implementation's option and has no "
                      f"equivalent here: {_REPLACED[name]}")


def _backend(o: dict) -> None:
    backend = o.pop("backend", None)
    kwargs = o.pop("backend_kwargs", None)
    if backend is not None:
        provider = _PROVIDER_OF.get(backend)
        if provider is None:
            raise ConfigError(f"backend={backend!r}: this harness talks to an endpoint of the "
                              "OpenAI protocol (or Anthropic's, provider='anthropic'); give "
                              "its address and model instead: base_url='https://.../v1', "
                              "model='...', api_key='...'")
        if backend == "vllm" and not (kwargs or {}).get("base_url") and not o.get("base_url"):
            raise ConfigError("backend='vllm' needs the server's address: "
                              "backend_kwargs={'base_url': 'http://host:8000/v1', ...}")
        _put(o, "provider", provider, "backend")
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise ConfigError(f"backend_kwargs must be a dict, got {type(kwargs).__name__}")
    unknown = sorted(set(kwargs) - set(_BACKEND_KEYS))
    if unknown:
        raise ConfigError(f"backend_kwargs {', '.join(map(repr, unknown))}: only "
                          f"{', '.join(map(repr, _BACKEND_KEYS))} have an equivalent here "
                          "(model=, api_key=, base_url=); pass other settings as options "
                          "(see docs/reference/options.md)")
    for key, value in kwargs.items():
        _put(o, _BACKEND_KEYS[key], value, f"backend_kwargs[{key!r}]")


def _put(o: dict, name: str, value: Any, given_as: str) -> None:
    if name in o and o[name] != value:
        raise ConfigError(f"{given_as} and {name}= disagree ({value!r} and {o[name]!r}); "
                          f"give {name}= alone")
    o[name] = value


def _custom_tools(value: Any) -> tuple:
    """The reference's ``{name: fn}`` / ``{name: {"tool": fn, "description": text}}`` as
    :class:`~rlm.tools.spec.Tool` objects."""
    from rlm.tools import Tool
    if not isinstance(value, dict):
        raise ConfigError(f"custom_tools must be a dict of name -> function, got "
                          f"{type(value).__name__}; or give tools=[fn, ...]")
    out = []
    for name, item in value.items():
        described = isinstance(item, dict)
        fn = item.get("tool") if described else item
        if not callable(fn):
            raise ConfigError(f"custom_tools[{name!r}] is a value, not a function: tools here "
                              "are host functions the kernel calls; put data in the context "
                              "instead (e.g. a dict context, or rlm.Session's add_context)")
        if isinstance(fn, Tool):
            tool = fn if fn.name == name else Tool.from_function(
                fn.fn, name=name, idempotent=fn.idempotent, levels=fn.levels)
        else:
            tool = Tool.from_function(fn, name=name)
        if described and item.get("description"):
            tool = dataclasses.replace(tool, doc=str(item["description"]))
        out.append(tool)
    return tuple(out)


def _progress_printer(line: str) -> None:
    print(f"[rlm] {line}", file=sys.stderr, flush=True)


def from_reference(options: dict) -> dict:
    """``options`` with the reference's names translated (a new dict; ``options`` untouched).

    Aliases: ``backend`` (``"openai"``, ``"vllm"``, ``"anthropic"``) -> ``provider``;
    ``backend_kwargs`` ``model_name``/``api_key``/``base_url`` -> ``model``/``api_key``/
    ``base_url``; ``custom_tools`` -> ``tools``; ``compaction=True`` -> on (the default),
    ``False`` -> ``context_window=0``; ``verbose=True`` -> progress lines on stderr
    (``on_progress``); ``max_budget`` -> ``max_cost_usd``; ``max_timeout`` ->
    ``max_wall_seconds``; ``compaction_threshold_pct`` -> ``compact_at``. (The reference's
    ``completion(prompt, root_prompt=...)`` is :meth:`rlm.RLM.completion`'s ``query``.)

    Raises:
        ConfigError: a reference option with no equivalent here (``persistent=True``,
            ``logger``, ``other_backends``, ...), naming the replacement; an alias whose value
            does not fit, or that disagrees with the same option given by its own name.
    """
    if not REFERENCE_NAMES.intersection(options):
        return options
    o = dict(options)
    for name in sorted(set(_REPLACED).intersection(o)):
        _refuse(name, o.pop(name))
    _backend(o)
    if "custom_tools" in o:
        tools = _custom_tools(o.pop("custom_tools"))
        if o.get("tools"):
            raise ConfigError("give tools= or custom_tools=, not both")
        o["tools"] = tools
    if "compaction" in o:
        if not o.pop("compaction"):
            _put(o, "context_window", 0, "compaction=False")
    if "verbose" in o:
        if o.pop("verbose"):
            _put(o, "on_progress", _progress_printer, "verbose=True")
    for old, new in _RENAMED.items():
        if old in o:
            _put(o, new, o.pop(old), old)
    return o



def root_prompt(query: Any, options: dict) -> Any:
    """The query of a call that may name it as the reference does: ``root_prompt=`` (popped
    from ``options``, a dict of keyword options) is ``query``.

    Raises:
        ConfigError: both given, and they differ.
    """
    if "root_prompt" not in options:
        return query
    given = options.pop("root_prompt")
    if query is not None and given is not None and query != given:
        raise ConfigError("give the question once: query= (root_prompt= is its reference name)")
    return given if given is not None else query
