"""Inside the kernel: the user's host tools as callables, and the JSON rule their values obey.

A tool is a host function (``rlm.tool``); the kernel only holds a stand-in of the same name,
signature and docstring (so ``help(search)`` reads like the host's), which sends its arguments
to the host over the bridge (:data:`kernels.protocol.Op.TOOL`) and returns the host's reply.
``tools.map(name, items)`` sends many calls at once (:data:`~kernels.protocol.Op.TOOL_BATCHED`);
the host runs them concurrently and answers in input order.

Arguments and results cross as JSON values: ``None``, ``bool``, ``int``, finite ``float``,
``str``, lists (tuples arrive as lists) and dicts with ``str`` keys, nested. Anything else is a
``TypeError`` in the cell that names the argument, raised before anything is sent
(:func:`json_problem`; the host checks a tool's result with the same function).

Imported by :mod:`kernels.runtime` inside every kernel, and by the host; standard library only.
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any, Callable

from kernels.protocol import ErrorKind, Op

__all__ = ["json_problem", "plain_json", "tool_names", "stub_signature"]

_DEEPEST = 100  # nesting a value may have (deeper, or a value that holds itself, is refused)


def json_problem(value: Any, where: str = "the value", depth: int = 0) -> str | None:
    """Why ``value`` cannot cross the bridge as JSON (str naming the part), or None if it can.

    Args:
        value: any Python object. ``where``: how the message names it (``"argument `q`"``).
    """
    if value is None or isinstance(value, (bool, int, str)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{where} is {value!r} (not a finite number)"
    if depth > _DEEPEST:
        return f"{where} is nested more than {_DEEPEST} levels deep (or holds itself)"
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            problem = json_problem(item, f"{where}[{i}]", depth + 1)
            if problem:
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return (f"{where} has the key {key!r} ({type(key).__name__}); JSON object keys "
                        "are strings")
            problem = json_problem(item, f"{where}[{key!r}]", depth + 1)
            if problem:
                return problem
        return None
    return (f"{where} is a {type(value).__module__}.{type(value).__qualname__}"
            if type(value).__module__ != "builtins" else f"{where} is a {type(value).__name__}")


def plain_json(value: Any) -> Any:
    """``value`` (which passed :func:`json_problem`) as JSON would give it back: tuples as lists."""
    if isinstance(value, (list, tuple)):
        return [plain_json(v) for v in value]
    if isinstance(value, dict):
        return {k: plain_json(v) for k, v in value.items()}
    return value


class _Text:
    """A default value or annotation shown as the host wrote it (its text, not an object)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def stub_signature(spec: Mapping[str, Any]) -> inspect.Signature | None:
    """The signature of a tool's stand-in from its spec's ``params`` (list of ``{"name",
    "kind", "default", "annotation"}``, texts or None) and ``returns`` (text or None); None
    when the host could not read the tool's signature."""
    params = spec.get("params")
    if params is None:
        return None
    empty = inspect.Parameter.empty
    out = [inspect.Parameter(
        p["name"], inspect._ParameterKind[p["kind"]],
        default=empty if p.get("default") is None else _Text(p["default"]),
        annotation=empty if p.get("annotation") is None else _Text(p["annotation"]))
        for p in params]
    returns = spec.get("returns")
    return inspect.Signature(out, return_annotation=empty if returns is None else _Text(returns))


def _request(name: str, sig: inspect.Signature | None, args: tuple, kwargs: dict) -> dict:
    """The JSON request of one call of tool ``name``: ``{"args": list, "kwargs": dict}``.

    Raises:
        TypeError: the arguments do not fit the signature, or one cannot cross as JSON (named).
    """
    if sig is not None:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{name}(): {exc}") from None
        named = list(bound.arguments.items())
    else:
        named = [(str(i), a) for i, a in enumerate(args)] + list(kwargs.items())
    for pname, value in named:
        problem = json_problem(value, f"argument `{pname}`")
        if problem:
            raise TypeError(f"{name}(): {problem}, which cannot cross to the host as JSON; "
                            "pass JSON values (str, int, float, bool, None, lists, dicts with "
                            "str keys). Nothing was sent.")
    return {"args": plain_json(list(args)), "kwargs": plain_json(dict(kwargs))}


def _stub(spec: Mapping[str, Any], call: Callable[..., Any]) -> Callable[..., Any]:
    """The kernel's stand-in for one tool: same name, signature and docstring."""
    name = spec["name"]
    sig = stub_signature(spec)

    def tool(*args: Any, **kwargs: Any) -> Any:
        return call(Op.TOOL, tool=name, **_request(name, sig, args, kwargs))

    tool.__name__ = tool.__qualname__ = name
    tool.__doc__ = spec.get("doc") or None
    tool.__module__ = "tools"
    if sig is not None:
        tool.__signature__ = sig  # type: ignore[attr-defined]
    tool._rlm_request = lambda args, kwargs: _request(name, sig, args, kwargs)  # type: ignore
    return tool


def _items(name: str, items: Any) -> list:
    """``tools.map``'s items as a list, each an args tuple, a kwargs dict or one value."""
    if isinstance(items, (str, bytes, bytearray, Mapping)):
        raise TypeError(f"tools.map({name!r}, items): `items` must be a list of calls, got one "
                        f"{type(items).__name__}; pass a list such as [('a',), ('b',)] or "
                        "['a', 'b']. Nothing was sent.")
    try:
        return list(items)
    except TypeError:
        raise TypeError(f"tools.map({name!r}, items): `items` must be a list of calls, not "
                        f"{type(items).__name__}. Nothing was sent.") from None


class _Tools:
    """``tools`` in the kernel: the host tools by name (``tools.search``) and ``tools.map``."""

    def __init__(self, stubs: dict, call: Callable[..., Any], results: Callable[..., Any]) -> None:
        self._stubs, self._call, self._results = stubs, call, results

    def map(self, name: str, items: Any, return_exceptions: bool = False) -> list:
        """Call tool ``name`` once per item, concurrently on the host; results in input order.

        Each item is a tuple of positional arguments, a dict of keyword arguments, or one value
        (the tool's only argument; wrap a dict or tuple meant as one value as ``(value,)``). A
        failed item raises BatchError (its ``.results`` holds every item's result or error),
        unless ``return_exceptions=True``, which returns the exceptions in place.
        """
        stub = self._stubs.get(name)
        if stub is None:
            raise NameError(f"tools.map: no tool named {name!r}; the tools here are "
                            f"{sorted(self._stubs) or 'none'}")
        reqs = []
        for item in _items(name, items):
            if isinstance(item, tuple):
                reqs.append(stub._rlm_request(item, {}))
            elif isinstance(item, dict):
                reqs.append(stub._rlm_request((), item))
            else:
                reqs.append(stub._rlm_request((item,), {}))
        values = self._call(Op.TOOL_BATCHED, tool=name, items=reqs)
        return self._results(values, return_exceptions, f"tools.map({name!r})")

    def __getattr__(self, name: str) -> Any:
        stubs = self.__dict__.get("_stubs") or {}
        if name in stubs:
            return stubs[name]
        raise AttributeError(f"no tool named {name!r}; the tools here are "
                             f"{sorted(stubs) or 'none'}")

    def __dir__(self) -> list:
        return sorted(self._stubs) + ["map"]

    def __repr__(self) -> str:
        return f"<tools: {', '.join(sorted(self._stubs)) or 'none'}; tools.map(name, items)>"


def tool_names(specs: list | None, runtime: Mapping[str, Any]) -> dict:
    """The names the tools add to the kernel's namespace (reserved: restored after every cell).

    Args:
        specs: one dict per tool available at this kernel's level (``name``, ``doc``, ``params``,
            ``returns``: see :func:`stub_signature`), from :func:`kernels.protocol.bind_code`;
            None for none.
        runtime: the namespace of :mod:`kernels.runtime`: its bridge call ``_call``, batched
            result decoder ``_batch_results``, ``ERROR_CLASSES`` (``ToolError`` is added to it)
            and base exception ``RLMKernelError``.
    Returns:
        ``{name: stand-in, ..., "tools": the tools object, "ToolError": its class}``.
    """
    call, results = runtime["_call"], runtime["_batch_results"]
    classes, base = runtime["ERROR_CLASSES"], runtime["RLMKernelError"]
    err = classes.get(ErrorKind.TOOL_ERROR)
    if err is None:
        err = type(ErrorKind.TOOL_ERROR, (base,), {"__doc__": "A tool call failed on the host "
                   "(the tool raised, timed out or returned a non-JSON value)."})
        classes[ErrorKind.TOOL_ERROR] = err
    stubs = {s["name"]: _stub(s, call) for s in specs or ()}
    return {**stubs, "tools": _Tools(stubs, call, results), ErrorKind.TOOL_ERROR: err}
