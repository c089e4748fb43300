"""The host side of the user's tools: one call (or a batch) from a kernel, as ``tool`` stages.

Every call is a ``tool`` stage under the cell that made it (meta: the tool's name, the call as
text, the result or error, seconds). In order:

1. resume and replay: a call the journal recorded ``done`` or ``failed`` is served from it, the
   tool not called; one recorded ``started`` (the process died during it) is called again only
   when the tool is idempotent, else the run stops (:class:`~harness.errors.UnfinishedToolCall`,
   naming the call). A replay never calls a tool: a call the journal lacks is a divergence.
2. admission: the cell not interrupted, the wall cap, ``max_tool_calls`` (refused: the stage
   ends ``budget_exceeded``, the cell gets ``BudgetExceeded``, the tool is not called);
3. a durable ``started`` row in the journal, then the call on a thread of its own, cut at
   ``tool_timeout`` seconds (and at the cell's interrupt), then its outcome, durable before the
   kernel sees it.

Before any of that a call must fit what the tool declares (:func:`checked_request`): ``args``
a list, ``kwargs`` an object, bound to the tool's signature (no name it does not declare, and no
name starting with ``_`` unless the tool was made with ``private_args=True``), and its
arguments at most ``max_tool_bytes`` bytes as JSON; a call that does not fit is refused with
``ToolError``, the tool not called and nothing journaled. A result over ``max_tool_bytes``
is a failed call whose journal row keeps only its size.

A tool that raises, times out or returns a value JSON cannot hold is a failed stage, and the
cell gets ``ToolError`` with ``Type: message``. A batch (``tools.map``) makes its stages in input
order first (so ids follow program order), then runs them on the run's scheduler (at most
``max_concurrency`` at once) and answers in input order.
"""
from __future__ import annotations

import json
import threading
import time
import weakref
from typing import Any, Callable

from harness.control import Cancelled
from harness.errors import BudgetExceeded, DivergenceError, UnfinishedToolCall
from harness.journal import request_hash
from harness.journal.errors import JournalError
from harness.stages.tree import Kind, Stage
from kernels.bridge import BridgeError
from kernels.protocol import ErrorKind, Op, item_error, item_ok
from kernels.tool_stubs import json_problem, plain_json, stub_signature

from rlm.tools.spec import Tool

__all__ = ["ToolHost", "host_for", "ToolFailed", "call_text", "checked_request", "json_size"]

_HOSTS: "weakref.WeakKeyDictionary[Any, ToolHost]" = weakref.WeakKeyDictionary()
_HOSTS_LOCK = threading.Lock()
_PREVIEW = 2000  # characters of a call or result kept in a stage (the journal keeps it all)


class ToolFailed(Exception):
    """A tool call failed on the host; ``str(exc)`` is the ``Type: message`` the cell sees."""


def host_for(run: Any) -> "ToolHost":
    """The :class:`ToolHost` of ``run`` (a :class:`~rlm.core.run_tree.RunTree`), made once."""
    with _HOSTS_LOCK:
        host = _HOSTS.get(run)
        if host is None:
            host = _HOSTS[run] = ToolHost(run)
        return host


def call_text(name: str, args: list, kwargs: dict, limit: int = _PREVIEW) -> str:
    """A call as Python-like text (``search('x', limit=3)``), cut to ``limit`` characters."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    text = f"{name}({', '.join(parts)})"
    return text if len(text) <= limit else text[:limit - 4] + "...)"


def _cut(value: Any) -> Any:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= _PREVIEW else text[:_PREVIEW] + f"... [{len(text):,} characters]"


def json_size(value: Any) -> int:
    """Bytes of ``value`` (a JSON value) as compact UTF-8 JSON."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":"),
                          allow_nan=False).encode("utf-8", "surrogatepass"))


def checked_request(tool: Tool, raw: Any, max_bytes: int) -> dict:
    """One call's ``{"args": list, "kwargs": dict}`` as the kernel sent it (``raw``: a dict
    with ``args`` and ``kwargs``), checked against what ``tool`` declares.

    Args:
        tool: the :class:`~rlm.tools.spec.Tool` called. max_bytes: the cap on the arguments'
            size as JSON (bytes; option ``max_tool_bytes``).
    Returns:
        the request, unchanged (a copy of its list and dict).
    Raises:
        ToolFailed: ``args`` is not a list or ``kwargs`` not an object (a dict given as
            ``args`` is not taken as its keys), a keyword starts with ``_`` (unless the tool
            has ``private_args``), the arguments do not bind to the tool's signature (a name
            it does not declare, too many or missing ones), a value is not JSON, or the
            arguments are over ``max_bytes``.
    """
    raw = raw if isinstance(raw, dict) else {}
    args, kwargs = raw.get("args", []), raw.get("kwargs", {})
    name = tool.name
    if args is None:
        args = []
    if kwargs is None:
        kwargs = {}
    if not isinstance(args, list):
        raise ToolFailed(f"TypeError: {name}(): `args` must be a list of positional "
                         f"arguments, got {type(args).__name__}; nothing was called")
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ToolFailed(f"TypeError: {name}(): `kwargs` must be an object of named arguments, "
                         f"got {type(kwargs).__name__}; nothing was called")
    private = sorted(k for k in kwargs if k.startswith("_"))
    if private and not tool.private_args:
        raise ToolFailed(f"TypeError: {name}() takes no argument named {private[0]!r}: names "
                         "starting with '_' are not passed to tools; nothing was called")
    sig = stub_signature({"params": tool.params, "returns": None})
    if sig is not None:
        try:
            sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise ToolFailed(f"TypeError: {name}(): {exc}; nothing was called") from None
    problem = json_problem(args, "`args`") or json_problem(kwargs, "`kwargs`")
    if problem:
        raise ToolFailed(f"TypeError: {name}(): {problem}, not a JSON value; nothing was called")
    size = json_size([args, kwargs])
    if size > max_bytes:
        raise ToolFailed(f"ValueError: {name}(): its arguments take {size:,} bytes as JSON, over "
                         f"the {max_bytes:,}-byte cap (max_tool_bytes); pass less (a path or a "
                         "key the tool can look up), or raise the cap; nothing was called")
    return {"args": list(args), "kwargs": dict(kwargs)}


class ToolHost:
    """Serves the tool calls of one run. Thread-safe (batched items run concurrently).

    Args:
        run: the :class:`~rlm.core.run_tree.RunTree`; its options name the tools
            (``opts.tools``, :class:`~rlm.tools.spec.Tool` objects) and ``tool_timeout`` (s).
    A resumed run's ``max_tool_calls`` starts from the calls its earlier attempts made.
    """

    def __init__(self, run: Any) -> None:
        self.run = run
        self.tools: dict[str, Tool] = {t.name: t for t in getattr(run.opts, "tools", ()) or ()}
        self.timeout = float(getattr(run.opts, "tool_timeout", 30.0) or 30.0)
        self.max_bytes = int(getattr(run.opts, "max_tool_bytes", 0) or 1 << 20)
        if run.recorded is not None and run.journal is not None:
            run.accountant.carry_over_tool_calls(run.journal.tool_call_attempts(run.run_id))

    def handle(self, op: str, args: dict, parent: str, level: int, scope: Any,
               runner: Callable[..., list], wire: Callable[[BaseException], BridgeError]) -> Any:
        """Serve one tool request of a kernel at loop ``level`` under the cell ``parent``.

        Args:
            op: :data:`~kernels.protocol.Op.TOOL` (args ``tool``, ``args``, ``kwargs``) or
                ``TOOL_BATCHED`` (``tool``, ``items``: list of ``{"args", "kwargs"}``).
            scope: the cell's cancel scope. runner: runs item functions with their pending
                stages on the scheduler and returns the tasks
                (:meth:`rlm.core.subcalls.Subcalls._run`); wire: an exception as the typed
                error the kernel raises (:func:`rlm.core.subcalls.to_bridge_error`).
        Returns:
            the tool's result (JSON), or for a batch a list of items in input order.
        Raises:
            BridgeError: an unknown tool, a failed call (``ToolError``); BudgetExceeded,
                DivergenceError, Cancelled: as their stages end.
        """
        tool = self._tool(args.get("tool"), level)
        if op == Op.TOOL:
            try:
                req = checked_request(tool, args, self.max_bytes)
                stage = self._stage(parent, level, tool, req)
                return self.serve(stage, tool, req, scope)
            except ToolFailed as exc:
                raise BridgeError(ErrorKind.TOOL_ERROR, str(exc)) from None
        items = args.get("items")
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise BridgeError(ErrorKind.SUBCALL_ERROR, "tools.map: `items` must be a list of "
                              "calls")
        reqs = []
        for k, item in enumerate(items):  # the whole batch is refused before any call
            try:
                reqs.append(checked_request(tool, item, self.max_bytes))
            except ToolFailed as exc:
                raise BridgeError(ErrorKind.TOOL_ERROR, f"tools.map item {k}: {exc}") from None
        stages = [self._stage(parent, level, tool, r) for r in reqs]  # ids in input order
        fns = [lambda s=s, r=r: self.serve(s, tool, r, scope) for s, r in zip(stages, reqs)]
        return [self._item(task, scope, wire) for task in runner(fns, stages, scope)]

    def _item(self, task: Any, scope: Any, wire: Callable[[BaseException], BridgeError]) -> dict:
        """One batched item's answer: its result, or its error as the kernel raises it."""
        if not task.done():
            return item_error(wire(Cancelled(scope.reason or "interrupted")).to_wire())
        try:
            return item_ok(task.result())
        except ToolFailed as exc:
            return item_error(BridgeError(ErrorKind.TOOL_ERROR, str(exc)).to_wire())
        except BaseException as exc:  # noqa: BLE001 - every item's fate is reported
            if isinstance(exc, JournalError) and self.run.fatal is None:
                self.run.fatal = exc  # a journal that cannot record a call ends the run
            return item_error(wire(exc).to_wire())

    def _tool(self, name: Any, level: int) -> Tool:
        tool = self.tools.get(name) if isinstance(name, str) else None
        if tool is None or not tool.available_at(level):
            here = sorted(n for n, t in self.tools.items() if t.available_at(level))
            raise BridgeError(ErrorKind.TOOL_ERROR, f"no tool named {name!r} at level {level}; "
                              f"the tools here are {here or 'none'}")
        return tool

    def _stage(self, parent: str, level: int, tool: Tool, req: dict) -> Stage:
        return self.run.tree.new_stage(parent, Kind.tool, level, meta={
            "tool": tool.name, "call": call_text(tool.name, req["args"], req["kwargs"])})

    def serve(self, stage: Stage, tool: Tool, req: dict, scope: Any) -> Any:
        """One call in its pending ``stage`` (see the module docstring); returns the result.

        Raises:
            ToolFailed: the tool failed (now, or as recorded). BudgetExceeded, DivergenceError
                (:class:`~harness.errors.UnfinishedToolCall` included; it ends the run),
                Cancelled: the stage ends accordingly.
        """
        run = self.run
        request = {"tool": tool.name, "args": req["args"], "kwargs": req["kwargs"]}
        rh = request_hash(request)
        with run.stage(existing=stage, start=False) as st:
            st.meta.update(tool=tool.name, call=call_text(tool.name, req["args"], req["kwargs"]))
            if run.fatal is not None:
                raise run.fatal
            rec = self._recorded(st.id, rh, tool)
            if rec is not None and rec["status"] != "started":
                st.start()
                st.meta["replayed"] = True
                return self._outcome(st, rec["status"], rec.get("result"), rec.get("error"), 0.0)
            if rec is not None:
                st.meta["called_again"] = True  # an idempotent call an earlier attempt cut off
            self._admit(st, scope)
            if run.journal is not None:
                run.journal.record_tool_start(run.run_id, st.id, tool=tool.name,
                                              request_hash=rh, request=request)
            st.start()
            status, result, error, secs = self._call(tool, req, scope)
            if run.journal is not None:
                run.journal.record_tool_result(run.run_id, st.id, status=status, result=result,
                                               error=error)
            return self._outcome(st, status, result, error, secs)

    def _recorded(self, call_id: str, rh: str, tool: Tool) -> dict | None:
        """The journal's record of this call (resume, replay), or None. A started one of a
        tool that is not idempotent ends the run."""
        run = self.run
        if run.recorded is None:
            return None
        try:
            rec = run.recorded.tool_call(call_id, rh)
            if rec is not None and rec["status"] == "started" and not tool.idempotent:
                raise UnfinishedToolCall(call_id, tool.name, run.run_id)
        except DivergenceError as exc:
            if run.fatal is None:  # the whole run stops here, as at a model call's divergence
                run.fatal = exc
            raise
        return rec

    def _admit(self, st: Any, scope: Any) -> None:
        run = self.run
        run.check_scope(scope)  # an interrupted cell calls nothing more
        try:
            run.accountant.check_wall()
            run.accountant.admit_tool_call()
        except BudgetExceeded as exc:
            st.meta["refused"] = {"cap": exc.cap, "limit": exc.limit, "used": exc.used,
                                  "requested": exc.requested}
            raise

    def _call(self, tool: Tool, req: dict, scope: Any) -> tuple[str, Any, str | None, float]:
        """Call the tool on a thread of its own; ``(status, result, error, seconds)``."""
        box: dict = {}

        def target() -> None:
            try:
                box["value"] = tool(*req["args"], **req["kwargs"])
            except BaseException as exc:  # noqa: BLE001 - every failure is the call's outcome
                box["error"] = exc

        t0 = time.monotonic()
        left = self.run.deadline_left()
        limit = self.timeout if left is None else min(self.timeout, left)
        thread = threading.Thread(target=target, daemon=True, name=f"rlm-tool-{tool.name}")
        thread.start()
        while thread.is_alive() and time.monotonic() - t0 < limit and not scope.cancelled:
            thread.join(0.05)
        secs = time.monotonic() - t0
        if thread.is_alive():
            why = (f"the cell was interrupted ({scope.reason}) while it ran" if scope.cancelled
                   else f"it did not return within {limit:g} s (tool_timeout)")
            return "failed", None, (f"TimeoutError: tool {tool.name!r} stopped waiting: {why}; "
                                    "it may still be running on the host"), secs
        if "error" in box:
            exc = box["error"]
            return "failed", None, f"{type(exc).__name__}: {exc}", secs
        problem = json_problem(box.get("value"), "its result")
        if problem:
            return "failed", None, (f"TypeError: tool {tool.name!r} returned a value that cannot "
                                    f"cross to the kernel as JSON: {problem}; return JSON values"
                                    ), secs
        size = json_size(box.get("value"))
        if size > self.max_bytes:  # the journal keeps the size, not the value
            return "failed", None, (f"ValueError: tool {tool.name!r} returned {size:,} bytes as "
                                    f"JSON, over the {self.max_bytes:,}-byte cap "
                                    "(max_tool_bytes); have it return less, or raise the cap"
                                    ), secs
        return "done", plain_json(box.get("value")), None, secs

    def _outcome(self, st: Any, status: str, result: Any, error: str | None,
                 secs: float) -> Any:
        st.meta["seconds"] = round(secs, 6)
        if status == "failed":
            st.meta["error"] = error
            raise ToolFailed(error or "ToolError: the tool failed")
        st.meta["result"] = _cut(result)
        st.evidence = _cut(result)
        return result
