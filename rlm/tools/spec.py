"""What a user's tool is: :class:`Tool`, the :func:`tool` decorator and :func:`as_tools`, which
turns the ``tools`` option (functions, ``Tool`` objects, ``"module:function"`` strings, or the
records a journal kept) into checked :class:`Tool` objects.

A tool's name, signature and docstring are what the model reads (the system prompt) and what
``help()`` shows in the kernel; its function runs on the host only. A run's journal keeps each
tool as :meth:`Tool.record`: the ``"module:qualname"`` it can be imported from again (None for a
function defined in ``__main__`` or inside another function) and the texts the prompt showed,
so a replay rebuilds the same prompt without importing anything.
"""
from __future__ import annotations

import builtins
import dataclasses
import importlib
import inspect
import keyword
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from kernels.tool_stubs import stub_signature

from rlm.errors import ConfigError, RLMError

__all__ = ["Tool", "ToolError", "tool", "as_tools", "replay_tools", "RESERVED_NAMES"]

#: Names the kernel's own functions and values hold (restored after every cell): no tool may
#: take one. ``context_N`` and ``history_N`` are reserved as a pattern too.
RESERVED_NAMES = frozenset({
    "context", "contexts", "history", "llm_query", "llm_query_batched", "rlm", "rlm_batched",
    "rlm_query", "rlm_query_batched", "FINAL", "FINAL_VAR", "SHOW_VARS", "BudgetExceeded",
    "ChildRLMError", "BatchError", "SubcallError", "DepthError", "ToolError", "tools",
    "RLMKernelError", "In", "Out", "exit", "quit", "get_ipython", "display"})
_RESERVED_PATTERN = re.compile(r"(context|history)_\d+")
_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class ToolError(RLMError):
    """A tool call failed. On the host a tool may raise it to report a failure in its own words;
    in the kernel the cell gets ``ToolError`` with the tool's ``Type: message`` whatever it
    raised (also for a timeout or a result that cannot cross as JSON)."""


def _text(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, type):
        return annotation.__qualname__ if annotation.__module__ == "builtins" else \
            f"{annotation.__module__}.{annotation.__qualname__}"
    return inspect.formatannotation(annotation)


def _default_text(value: Any) -> str:
    """A default's text, free of memory addresses (the prompt must read the same every run)."""
    text = _ADDRESS.sub("", repr(value))
    return text if len(text) <= 60 else text[:57] + "..."


def _signature_parts(fn: Callable[..., Any]) -> tuple[list | None, str | None]:
    """``(params, returns)`` of ``fn`` as texts (see :func:`kernels.tool_stubs.stub_signature`),
    ``(None, None)`` when Python cannot read its signature."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None, None
    empty = inspect.Parameter.empty
    params = [{"name": p.name, "kind": p.kind.name,
               "default": None if p.default is empty else _default_text(p.default),
               "annotation": None if p.annotation is empty else _text(p.annotation)}
              for p in sig.parameters.values()]
    returns = None if sig.return_annotation is empty else _text(sig.return_annotation)
    return params, returns


@dataclass(frozen=True)
class Tool:
    """One host function the kernel's code may call.

    Attributes:
        name: the name it has in the kernel and the prompt (an identifier, not reserved).
        fn: the host function (None for a tool rebuilt from a journal for a replay).
        doc: its docstring (str, "" if none); params, returns: its signature as texts.
        idempotent: calling it twice with the same arguments does no harm, so a resume may
            call it again when an earlier attempt died during the call (default False).
        levels: the loop levels (0 = root) whose kernels have it; None: every level.
        spec: the ``"module:qualname"`` it was given as, or None (see :meth:`import_spec`).
        private_args: the kernel may pass it keywords starting with ``_`` (default False:
            such names are refused, as are names its signature does not declare).
    Calling a ``Tool`` calls its function (a decorated function still works on the host).
    """

    name: str
    fn: Callable[..., Any] | None
    doc: str = ""
    params: list | None = None
    returns: str | None = None
    idempotent: bool = False
    levels: tuple[int, ...] | None = None
    spec: str | None = None
    private_args: bool = False

    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, name: str | None = None,
                      idempotent: bool = False, levels: Iterable[int] | None = None,
                      spec: str | None = None, private_args: bool = False) -> "Tool":
        """A :class:`Tool` of ``fn`` (its name, docstring and signature read from it).

        Raises:
            ConfigError: ``fn`` is not callable, or ``name``/``levels`` are not usable.
        """
        if not callable(fn):
            raise ConfigError(f"a tool must be a function, got {type(fn).__name__} {fn!r}")
        params, returns = _signature_parts(fn)
        return cls(name=_check_name(name or getattr(fn, "__name__", "")), fn=fn,
                   doc=inspect.getdoc(fn) or "", params=params, returns=returns,
                   idempotent=bool(idempotent), levels=_check_levels(levels), spec=spec,
                   private_args=bool(private_args))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fn is None:
            raise ToolError(f"tool {self.name!r} has no function here: it was rebuilt from a "
                            "journal for a replay, which never calls tools")
        return self.fn(*args, **kwargs)

    @property
    def signature(self) -> str:
        """The signature as the model reads it (``"(query: str, limit: int = 5) -> list"``)."""
        sig = stub_signature({"params": self.params, "returns": self.returns})
        return "(...)" if sig is None else str(sig)

    @property
    def summary(self) -> str:
        """The docstring's first paragraph on one line (str, at most 300 characters)."""
        first = " ".join(self.doc.strip().split("\n\n", 1)[0].split())
        return first if len(first) <= 300 else first[:297] + "..."

    def available_at(self, level: int) -> bool:
        """Whether kernels at loop ``level`` (int, root 0) have this tool."""
        return self.levels is None or level in self.levels

    def kernel_spec(self) -> dict:
        """What the kernel's stand-in is made from (:func:`kernels.tool_stubs.tool_names`)."""
        return {"name": self.name, "doc": self.doc, "params": self.params,
                "returns": self.returns}

    def import_spec(self) -> str | None:
        """The ``"module:qualname"`` this tool can be imported from by another process, or None
        (a function of ``__main__``, a lambda or a function defined inside another one)."""
        if self.spec:
            return self.spec
        fn = self.fn
        mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if not mod or mod == "__main__" or "<" in qual or mod not in sys.modules:
            return None
        obj: Any = sys.modules[mod]
        for part in qual.split("."):
            obj = getattr(obj, part, None)
        target = obj.fn if isinstance(obj, Tool) else obj
        return f"{mod}:{qual}" if target is fn else None

    def record(self) -> dict:
        """The journal's record of this tool (JSON-able): ``name``, ``spec`` (see
        :meth:`import_spec`), ``doc``, ``params``, ``returns``, ``idempotent``, ``levels``,
        ``private_args``."""
        return {"name": self.name, "spec": self.import_spec(), "doc": self.doc,
                "params": self.params, "returns": self.returns, "idempotent": self.idempotent,
                "levels": list(self.levels) if self.levels is not None else None,
                "private_args": self.private_args}


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None,
         idempotent: bool = False, read_only: bool = False,
         levels: Iterable[int] | None = None, private_args: bool = False) -> Any:
    """Mark a host function as a tool: ``@rlm.tool``, ``@rlm.tool(idempotent=True)`` or
    ``rlm.tool(fn, name="lookup")``. Returns a :class:`Tool` (still callable on the host).

    Args:
        name: its name in the kernel (default: the function's).
        idempotent: a resume may call it again after a crash during the call (default False:
            the resume stops and names the call instead).
        read_only: it changes nothing; implies ``idempotent``.
        levels: the loop levels that have it (0 = root; default: every level).
        private_args: let the kernel pass keywords starting with ``_`` (default False).
    Raises:
        ConfigError: a name that is not an identifier or is reserved; bad levels.
    """
    def make(f: Callable[..., Any]) -> Tool:
        return Tool.from_function(f, name=name, idempotent=idempotent or read_only,
                                  levels=levels, private_args=private_args)
    return make if fn is None else make(fn)


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ConfigError(f"tool name {name!r} is not a Python identifier; name it with "
                          "rlm.tool(fn, name='...') (from the CLI: `mytool = rlm.tool(fn, "
                          "name='mytool')` in a module of yours, then --tool module:mytool)")
    if (name.startswith("_") or name in RESERVED_NAMES or _RESERVED_PATTERN.fullmatch(name)
            or hasattr(builtins, name)):
        raise ConfigError(f"tool name {name!r} is taken in the kernel (a reserved name, a "
                          "builtin or a private one); give the tool another name with "
                          "rlm.tool(fn, name='...') (from the CLI: `mytool = rlm.tool(fn, "
                          "name='mytool')` in a module of yours, then --tool module:mytool)")
    return name


def _check_levels(levels: Iterable[int] | None) -> tuple[int, ...] | None:
    if levels is None:
        return None
    try:
        out = tuple(sorted({int(x) for x in levels}))
    except (TypeError, ValueError):
        raise ConfigError(f"tool levels must be loop levels (ints >= 0), got {levels!r}") from None
    if any(x < 0 for x in out):
        raise ConfigError(f"tool levels must be >= 0 (the root is 0), got {levels!r}")
    return out


def _import(spec: str) -> Any:
    """The object a ``"module:qualname"`` names. Raises ConfigError saying what is wrong."""
    if not isinstance(spec, str) or not _SPEC.fullmatch(spec):
        raise ConfigError(f"--tool {spec!r}: give a tool as module:function "
                          "(e.g. mytools:search), importable by this Python")
    mod_name, qual = spec.split(":", 1)
    try:
        obj: Any = importlib.import_module(mod_name)
    except Exception as exc:  # noqa: BLE001 - any failure to import is the user's to fix
        raise ConfigError(f"--tool {spec}: cannot import module {mod_name!r} "
                          f"({type(exc).__name__}: {exc}); is it on PYTHONPATH?") from None
    for part in qual.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"--tool {spec}: module {mod_name!r} has no {qual!r}")
        obj = getattr(obj, part)
    return obj


def _one(item: Any) -> Tool:
    if isinstance(item, Tool):
        return item
    if isinstance(item, str):
        obj = _import(item)
        if isinstance(obj, Tool):
            return dataclasses.replace(obj, spec=item)
        if not callable(obj):
            raise ConfigError(f"--tool {item}: {type(obj).__name__} {obj!r} is not a function")
        return Tool.from_function(obj, spec=item)
    if callable(item):
        return Tool.from_function(item)
    raise ConfigError(f"tools: {item!r} is not a function, an rlm.tool or a 'module:function' "
                      "string")


def _from_record(rec: Mapping[str, Any]) -> Tool:
    """The tool a journal recorded, imported again from its spec (a resume)."""
    if not rec.get("spec"):
        raise ConfigError(
            f"this run was recorded with the tool {rec.get('name')!r}, a function that cannot "
            "be imported again (defined in __main__ or inside another function); give it "
            f"again: `rlm resume RUN_ID --tool module:function`, or "
            f"rlm.resume(run_id, tools=[{rec.get('name')}])")
    got = _one(rec["spec"])
    if got.name != rec["name"]:
        got = dataclasses.replace(got, name=_check_name(rec["name"]))
    return dataclasses.replace(got, idempotent=bool(rec.get("idempotent", got.idempotent)),
                               levels=_check_levels(rec.get("levels")),
                               private_args=bool(rec.get("private_args", got.private_args)))


def as_tools(items: Any) -> tuple[Tool, ...]:
    """The ``tools`` option as checked :class:`Tool` objects, in order.

    Args:
        items: None, or one or a list of: a function, a :class:`Tool`, a ``"module:function"``
            string, or a journal record (:meth:`Tool.record`, a resume). A tool given by name
            replaces the recorded one of that name, in the recorded one's place (so the prompt
            lists the tools in the same order).
    Raises:
        ConfigError: an item that is none of these, cannot be imported, has a bad or reserved
            name, two tools of one name, or a recorded tool that cannot be imported again and
            was not given.
    """
    if items is None:
        return ()
    if isinstance(items, (str, Tool, Mapping)) or callable(items):
        items = [items]
    records = [i for i in items if isinstance(i, Mapping)]
    given = [_one(i) for i in items if not isinstance(i, Mapping)]
    names = [t.name for t in given]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"two tools are named {', '.join(map(repr, twice))}; give each tool "
                          "its own name (rlm.tool(fn, name='...'))")
    by_name = {t.name: t for t in given}
    out = [by_name.pop(r.get("name")) if r.get("name") in by_name else _from_record(r)
           for r in records]
    return tuple(out + [t for t in given if t.name in by_name])


def replay_tools(records: Iterable[Mapping[str, Any]] | None) -> tuple[Tool, ...]:
    """Tools rebuilt from a journal's records with no function (a replay serves every call
    from the journal and imports nothing)."""
    return tuple(Tool(name=r["name"], fn=None, doc=r.get("doc") or "", params=r.get("params"),
                      returns=r.get("returns"), idempotent=bool(r.get("idempotent")),
                      levels=_check_levels(r.get("levels")), spec=r.get("spec"),
                      private_args=bool(r.get("private_args")))
                 for r in records or ())
