"""The in-kernel runtime: the names the model's code sees, and their channel to the host.

This module is imported *inside* each Jupyter kernel. It binds ``context`` from
a file and defines ``llm_query``, ``llm_query_batched``, ``rlm``, ``rlm_batched``
(and the ``rlm_query*`` aliases), ``FINAL``, ``FINAL_VAR`` and ``SHOW_VARS``.
Every model call goes to the host over a Unix socket with this kernel's secret
token; the host checks the token *and* the connecting process id, so nothing
the model's code rewrites here (globals, environment, this module) can change
its depth, its budget scope, or let it act as another kernel.

The wire format, the op names and the error kinds are in :mod:`kernels.protocol`.
"""
from __future__ import annotations

import json
import socket
import threading

from kernels.protocol import (ErrorKind, Op, decode_error, encode_frame, final_value,
                              is_error_item, recv_message, request)

# Names restored after every cell. Filled in by bind().
RESERVED: dict = {}
_FINAL: dict = {}
_STATE = threading.local()
_CONF: dict = {}


class RLMKernelError(Exception):
    """Base class of errors raised by the in-kernel functions."""


class BudgetExceeded(RLMKernelError):
    """The host refused the call: it would break a budget cap. Never sent to a model.

    Attributes: cap (str), limit, used, requested, remaining (in the cap's unit).
    """

    def __init__(self, message, cap=None, limit=None, used=None, requested=None, remaining=None):
        super().__init__(message)
        self.cap, self.limit, self.used = cap, limit, used
        self.requested, self.remaining = requested, remaining


class ChildRLMError(RLMKernelError):
    """A child RLM failed; ``status`` and ``reason`` say how. Not an answer."""

    def __init__(self, message, status="failed", reason=""):
        super().__init__(message)
        self.status, self.reason = status, reason or message


class DepthError(RLMKernelError):
    """Sub-calls are disabled at this depth (``max_depth=0``)."""


class SubcallError(RLMKernelError):
    """A sub-call failed in the host (endpoint down, bad reply, ...)."""


class BatchError(RLMKernelError):
    """Some items of a batched call failed.

    ``results`` holds, in input order, each item's answer (``str``) or its exception;
    ``errors`` maps the index of each failed item to its exception.
    """

    def __init__(self, message, results=None):
        super().__init__(message)
        self.results = list(results or [])
        self.errors = {i: r for i, r in enumerate(self.results) if isinstance(r, BaseException)}


#: The exception raised in the kernel for each wire error kind.
ERROR_CLASSES = {ErrorKind.BUDGET_EXCEEDED: BudgetExceeded, ErrorKind.CHILD_RLM_ERROR: ChildRLMError,
                 ErrorKind.DEPTH_ERROR: DepthError, ErrorKind.SUBCALL_ERROR: SubcallError}


def _decode_error(err: dict) -> BaseException:
    return decode_error(err, ERROR_CLASSES)


def _connection() -> socket.socket:
    sock = getattr(_STATE, "sock", None)
    if sock is None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(_CONF["socket"])
        _STATE.sock = sock
    return sock


def _call(op: str, **args):
    """Send one request to the host and wait for its reply; returns the reply's value.

    Raises the decoded in-kernel exception if the host answered with an error, and
    ConnectionError if the host closed the connection.
    """
    frame = encode_frame(request(_CONF["token"], op, args))
    sock = _connection()
    try:
        sock.sendall(frame)
        reply = recv_message(sock)
        if reply is None:
            raise ConnectionError("the host closed the bridge connection")
    except BaseException:
        # A half-read reply (e.g. KeyboardInterrupt at the cell timeout) would
        # desynchronise the stream: drop this connection, the next call opens a new one.
        _STATE.sock = None
        try:
            sock.close()
        except OSError:
            pass
        raise
    if reply.get("ok"):
        return reply.get("value")
    raise _decode_error(reply.get("error") or {})


def _batch_results(values: list, return_exceptions: bool, what: str):
    results = [(_decode_error(v["error"]) if is_error_item(v)
                else v.get("value") if isinstance(v, dict) else v) for v in values]
    failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
    if failed and not return_exceptions:
        first = results[failed[0]]
        raise BatchError(f"{len(failed)} of {len(results)} {what} items failed "
                         f"(first: item {failed[0]}: {type(first).__name__}: {first}); "
                         "the .results attribute holds every item's answer or error, in order; "
                         "pass return_exceptions=True to get them in place", results)
    return results


def _text(x, name: str) -> str:
    if isinstance(x, str):
        return x
    if x is None:
        raise TypeError(f"{name} must be a string, got None")
    return str(x)


def llm_query(prompt, model=None):
    """One plain completion of ``prompt`` by the sub-call model; returns the reply text (str).

    Raises BudgetExceeded (refused by a cap, never sent), DepthError (``max_depth=0``)
    or SubcallError (the call failed in the host).
    """
    return _call(Op.LLM_QUERY, prompt=_text(prompt, "prompt"), model=model)


def llm_query_batched(prompts, model=None, return_exceptions=False):
    """Many plain completions, run concurrently by the host; answers in input order (list[str]).

    If an item fails, raises BatchError carrying every item's result or error, unless
    ``return_exceptions=True``, which returns the exceptions in place. A refusal of the
    whole batch raises as :func:`llm_query` does.
    """
    prompts = [_text(p, "prompt") for p in prompts]
    values = _call(Op.LLM_QUERY_BATCHED, prompts=prompts, model=model)
    return _batch_results(values, return_exceptions, Op.LLM_QUERY_BATCHED)


def rlm(prompt, query=None, model=None, schema=None):
    """A child RLM whose kernel holds ``prompt`` as its ``context``; returns its answer (str).

    At the depth limit this is a plain completion instead. A failed child raises
    ChildRLMError (with ``status`` and ``reason``), never returns a failure as text;
    otherwise raises as :func:`llm_query` does. With ``schema`` (a JSON Schema dict, or a
    pydantic model class) the child's FINAL value must validate against it before the host
    accepts it, and the checked value comes back decoded (a dict, list, ...), not as text.
    """
    if not isinstance(prompt, (str, list, dict)):
        prompt = str(prompt)
    schema = _schema(schema)
    value = _call(Op.RLM, prompt=prompt, query=query, model=model, schema=schema)
    return _checked(value, schema)


def rlm_batched(prompts, query=None, model=None, return_exceptions=False, schema=None):
    """Many child RLMs, run concurrently by the host; answers in input order (list[str]).

    Failed items raise BatchError, or come back in place with ``return_exceptions=True``,
    as in :func:`llm_query_batched`. ``schema`` checks every child's answer as in :func:`rlm`.
    """
    prompts = [p if isinstance(p, (str, list, dict)) else str(p) for p in prompts]
    schema = _schema(schema)
    values = _call(Op.RLM_BATCHED, prompts=prompts, query=query, model=model, schema=schema)
    results = _batch_results(values, return_exceptions, Op.RLM_BATCHED)
    return [r if isinstance(r, BaseException) else _checked(r, schema) for r in results]


def _schema(schema):
    """A JSON Schema dict from ``schema`` (a dict, a pydantic model class, or None)."""
    if schema is None or isinstance(schema, dict):
        return schema
    if hasattr(schema, "model_json_schema"):
        return schema.model_json_schema()
    raise TypeError("schema must be a JSON Schema dict or a pydantic model class")


def _checked(value, schema):
    """The child's checked answer decoded from its JSON text (unchanged without a schema)."""
    if schema is None or not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def FINAL(value):
    """Set the run's answer to ``str(value)``. Only executed code can end a run."""
    _FINAL.clear()
    _FINAL["answer"] = value if isinstance(value, str) else repr(value) if not isinstance(
        value, (int, float)) else str(value)
    return "FINAL answer recorded."


def FINAL_VAR(name):
    """Set the answer to the value of the variable called ``name`` (a str).

    Passing the value itself (``FINAL_VAR(answer)``) is accepted too. A quoted name
    that is not defined (``FINAL_VAR("answr")``) raises NameError instead of ending
    the run with the name as its answer.
    """
    ns = _user_ns()
    key = name.strip().strip("'\"") if isinstance(name, str) else None
    if key is not None and key in ns:
        value = ns[key]
    elif key is not None and key.isidentifier() and _called_with_literal():
        raise NameError(f"FINAL_VAR: no variable named {key!r}; create it first, "
                        "or call FINAL(value)")
    else:
        value = name
    return FINAL(value if isinstance(value, str) else str(value))


def _called_with_literal() -> bool:
    """True if the FINAL_VAR call in the caller's source line has a quoted argument."""
    import inspect
    import linecache
    import re
    frame = inspect.currentframe()
    try:
        caller = frame.f_back.f_back if frame and frame.f_back else None
        if caller is None:
            return True
        line = linecache.getline(caller.f_code.co_filename, caller.f_lineno)
    finally:
        del frame
    m = re.search(r"FINAL_VAR\s*\(\s*([^)]*)", line or "")
    if not m:
        return True  # unknown call site: be strict
    return m.group(1).lstrip()[:1] in ("'", '"')


def SHOW_VARS():
    """Print and return the user variables (name -> type name), reserved names excluded."""
    ns = _user_ns()
    out = {k: type(v).__name__ for k, v in ns.items()
           if not k.startswith("_") and k not in RESERVED and k not in _IPYTHON_NAMES}
    print(out)
    return out


_IPYTHON_NAMES = {"In", "Out", "exit", "quit", "get_ipython", "open"}


def _user_ns() -> dict:
    return _ip().user_ns


def _ip():
    from IPython import get_ipython
    return get_ipython()


def _restore(*_args) -> None:
    ns = _user_ns()
    for k, v in RESERVED.items():
        if ns.get(k) is not v:
            ns[k] = v


def load_context(path: str, fmt: str):
    """Read the context file written by the host: ``fmt`` is ``"text"`` or ``"json"``.

    Returns the text (str) or the decoded JSON value. Raises OSError if the file cannot
    be read, ValueError if it is not UTF-8 (text) or not JSON (json).
    """
    if fmt == "json":
        with open(path, "rb") as f:
            return json.loads(f.read())
    with open(path, "r", encoding="utf-8", newline="") as f:
        return f.read()


def bind(socket_path: str, token: str, context_path: str | None, fmt: str = "text") -> str:
    """Bind this kernel to one RLM instance: its bridge, its secret and its ``context``.

    Called once per kernel by the host, through :func:`kernels.protocol.bind_code`.

    Args:
        socket_path: the bridge's Unix socket; connected on the first sub-call.
        token: this kernel's secret (hex str).
        context_path: the context file, or None (``context`` is then None).
        fmt: ``"text"`` or ``"json"`` (see :func:`load_context`).

    Returns a short description for the host's log (str). Raises what
    :func:`load_context` raises.
    """
    _CONF.update(socket=socket_path, token=token)
    _STATE.sock = None
    ctx = load_context(context_path, fmt) if context_path else None
    ip = _ip()
    RESERVED.clear()
    RESERVED.update(
        context=ctx, llm_query=llm_query, llm_query_batched=llm_query_batched,
        rlm=rlm, rlm_batched=rlm_batched, rlm_query=rlm, rlm_query_batched=rlm_batched,
        FINAL=FINAL, FINAL_VAR=FINAL_VAR, SHOW_VARS=SHOW_VARS,
        BudgetExceeded=BudgetExceeded, ChildRLMError=ChildRLMError, BatchError=BatchError,
        SubcallError=SubcallError, DepthError=DepthError,
    )
    _restore()
    try:
        ip.events.unregister("post_run_cell", _restore)
    except ValueError:
        pass
    ip.events.register("post_run_cell", _restore)
    return f"context bound: {type(ctx).__name__}"


def take_final():
    """Host-side helper: pop the answer set by FINAL in the last cell, or None.

    Returns ``{"answer": str}`` (see :func:`kernels.protocol.final_value`) or None. The
    host calls this through :data:`kernels.protocol.FINAL_EXPR`, in the same
    ``user_expressions`` round trip as the cell.
    """
    if "answer" in _FINAL:
        return final_value(_FINAL.pop("answer"))
    return None
