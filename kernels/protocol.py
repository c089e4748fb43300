"""The host-kernel bridge protocol: the one place that says what crosses the hop.

Imported by both ends: the host (:mod:`kernels.bridge`, :mod:`kernels.kernel` and the
run tree in :mod:`rlm`) and the kernel itself (:mod:`kernels.runtime`, loaded inside
every Jupyter kernel). Standard library only, so importing it inside a kernel costs
nothing measurable.

Two channels make up the hop:

* **Code cells** the host runs in the kernel through Jupyter: :data:`BOOT_CODE` at kernel
  start (imports the runtime as :data:`RUNTIME_NAME`), :func:`bind_code` once per RLM
  instance (bridge socket, secret token, context file), and :data:`FINAL_EXPR`, a Jupyter
  user expression evaluated after every cell and read back with :func:`parse_final`.
* **Bridge messages** the kernel sends to the host over a Unix socket
  (:class:`kernels.bridge.BridgeServer`). Framing, both ways: a 4-byte big-endian
  unsigned length, then that many bytes of UTF-8 JSON (:func:`send_message`,
  :func:`encode_frame`, :func:`recv_message`).

  - request: ``{"token": str, "op": Op.*, "args": dict}`` (:func:`request`); the args of
    each op are listed on :class:`Op`.
  - reply: ``{"ok": true, "value": any}`` (:func:`reply_ok`) or
    ``{"ok": false, "error": error}`` (:func:`reply_error`), with ``"closed": true`` when the
    host closes the connection after it (a refused connection, or a frame it would not read:
    over the frame cap of :mod:`kernels.bridge_limits`, or past the kernel's share).
  - error: ``{"type": ErrorKind.*, "message": str, ...attributes}`` (:func:`encode_error`);
    the attributes of each kind are in :data:`ERROR_ATTRS`. The kernel turns it back into
    its exception with :func:`decode_error`.
  - the value of a batched op (:data:`BATCHED_OPS`) is a list, in input order, of
    ``{"value": any}`` (:func:`item_ok`) or ``{"error": error}`` (:func:`item_error`).
"""
from __future__ import annotations

import ast
import json
import struct
from typing import Any, Mapping

__all__ = [
    "BATCHED_OPS", "BOOT_CODE", "batch_args_error", "checked_value", "schema_dict", "ERROR_ATTRS", "FINAL_ANCHOR", "FINAL_EXPR", "FINAL_KEY", "RUNTIME_NAME",
    "SUBCALL_OPS", "TOOL_OPS", "ErrorKind", "Op", "bind_code", "boot_code", "decode_error",
    "decode_frame", "encode_error", "encode_frame", "final_value", "is_error_item", "item_error", "item_ok", "parse_final",
    "recv_body", "recv_header", "recv_message", "reply_error", "reply_ok", "request", "send_message", "add_context_code",
]


# --------------------------------------------------------------------------- names


class Op:
    """Operation names a kernel may send (the ``"op"`` field of a request).

    Args of each, in the request's ``"args"`` object:

    * ``LLM_QUERY``: ``prompt`` (str), ``model`` (str or None). Value: the reply text (str).
    * ``LLM_QUERY_BATCHED``: ``prompts`` (list[str]), ``model``. Value: a list of items.
    * ``RLM``: ``prompt`` (str, list or dict: the child's context), ``query`` (str or
      None), ``model``, ``schema`` (a JSON Schema dict the child's FINAL value must
      validate against, or None). Value: the child's answer (str; canonical JSON text of
      the checked value when ``schema`` is given).
    * ``RLM_BATCHED``: ``prompts`` (list), ``query``, ``model``, ``schema``. Value: a list
      of items.
    * ``TOOL``: ``tool`` (str: a user tool's name), ``args`` (list), ``kwargs`` (dict), JSON
      values. Value: the tool's result (JSON).
    * ``TOOL_BATCHED``: ``tool``, ``items`` (list of ``{"args", "kwargs"}``). Value: a list of
      items, as for the batched ops.
    """

    LLM_QUERY = "llm_query"
    LLM_QUERY_BATCHED = "llm_query_batched"
    RLM = "rlm"
    RLM_BATCHED = "rlm_batched"
    TOOL = "tool"
    TOOL_BATCHED = "tool_batched"
    HISTORY = "history"  # no args; value: the loop's full transcript ([{"role", "content"}])


#: Every op that asks the host for a model call or a child (all of them, today).
SUBCALL_OPS = frozenset({Op.LLM_QUERY, Op.LLM_QUERY_BATCHED, Op.RLM, Op.RLM_BATCHED})

#: The ops whose value is a list of items (:func:`item_ok` / :func:`item_error`).
BATCHED_OPS = frozenset({Op.LLM_QUERY_BATCHED, Op.RLM_BATCHED})

#: The ops that call a user's host tool (not sub-calls: they work at ``max_depth=0`` too).
TOOL_OPS = frozenset({Op.TOOL, Op.TOOL_BATCHED})


class ErrorKind:
    """Error kinds (the ``"type"`` field of a wire error); each names an in-kernel exception.

    * ``BUDGET_EXCEEDED``: the host refused the call, it would break a cap (never sent).
    * ``CHILD_RLM_ERROR``: a child RLM ended without an answer.
    * ``DEPTH_ERROR``: sub-calls are disabled (``max_depth=0``).
    * ``SUBCALL_ERROR``: anything else that failed in the host, including a refused
      request (unknown token, wrong process) and an unknown kind on decode.
    * ``TOOL_ERROR``: a user's tool failed on the host (it raised, timed out, or returned a
      value that is not JSON); the message is the tool's ``Type: message``.
    """

    BUDGET_EXCEEDED = "BudgetExceeded"
    CHILD_RLM_ERROR = "ChildRLMError"
    DEPTH_ERROR = "DepthError"
    SUBCALL_ERROR = "SubcallError"
    TOOL_ERROR = "ToolError"


#: Attributes each error kind carries on the wire, with the value used when one is absent.
#: The kernel passes them as keyword arguments to the exception's constructor.
ERROR_ATTRS: dict[str, dict[str, Any]] = {
    ErrorKind.BUDGET_EXCEEDED: {"cap": None, "limit": None, "used": None,
                                "requested": None, "remaining": None},
    ErrorKind.CHILD_RLM_ERROR: {"status": "failed", "reason": ""},
    ErrorKind.DEPTH_ERROR: {},
    ErrorKind.SUBCALL_ERROR: {},
    ErrorKind.TOOL_ERROR: {},
}


def batch_args_error(op: str, args: Mapping[str, Any]) -> str | None:
    """Why a batched op's ``prompts`` argument is unusable, or None if it is a list.

    A batched op (:data:`BATCHED_OPS`) takes a *list* of prompts: one ``str`` (or bytes, or a
    dict) would otherwise be iterated item by item, one sub-call per character or key. The
    kernel's runtime raises ``TypeError`` before sending; the host checks again with this.
    """
    if op not in BATCHED_OPS:
        return None
    prompts = args.get("prompts")
    if isinstance(prompts, list):
        return None
    return (f"{op}: the argument `prompts` must be a list of prompts, not a "
            f"{type(prompts).__name__}; pass a list such as [prompt1, prompt2]")


def schema_dict(schema: Any) -> dict | None:
    """The wire form of an ``rlm(..., schema=)``: a JSON Schema dict (a dict as given, a
    pydantic model class's ``model_json_schema()``, or None).

    Raises:
        TypeError: anything else.
    """
    if schema is None or isinstance(schema, dict):
        return schema
    if hasattr(schema, "model_json_schema"):
        return schema.model_json_schema()
    raise TypeError("schema must be a JSON Schema dict or a pydantic model class")


def checked_value(value: Any, schema: dict | None) -> Any:
    """A child's checked answer (canonical JSON text on the wire) decoded; unchanged without a
    schema or when it is not JSON."""
    if schema is not None and isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            pass
    return value


# --------------------------------------------------------------------------- framing

_HEADER = struct.Struct(">I")


def encode_frame(obj: Any) -> bytes:
    """One frame as bytes: a 4-byte big-endian length, then ``obj`` as UTF-8 JSON.

    Raises:
        TypeError / ValueError: ``obj`` is not JSON-serialisable.
    """
    data = json.dumps(obj).encode()
    return _HEADER.pack(len(data)) + data


def send_message(sock: Any, obj: Any) -> None:
    """Send ``obj`` as one frame (see :func:`encode_frame`).

    Args:
        sock: a connected stream socket (anything with ``sendall(bytes)``).
        obj: a JSON-serialisable value (a request or reply dict).

    Raises:
        TypeError / ValueError: ``obj`` is not JSON-serialisable (nothing is sent).
        OSError: the socket failed (the frame may be partly sent).
    """
    sock.sendall(encode_frame(obj))


def _recv_exact(sock: Any, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv_header(sock: Any) -> int | None:
    """Read one frame's 4-byte header: the announced length of its body (int, bytes), or None
    if the peer closed the connection first. Reads nothing more. Raises OSError."""
    head = _recv_exact(sock, _HEADER.size)
    return None if head is None else _HEADER.unpack(head)[0]


def recv_body(sock: Any, n: int) -> bytes | None:
    """Read a frame's body of ``n`` bytes (the length :func:`recv_header` returned), or None
    if the peer closed the connection first. Raises OSError."""
    return _recv_exact(sock, n)


def decode_frame(body: bytes) -> Any:
    """A frame's body decoded from UTF-8 JSON.

    Raises:
        ValueError: it is not UTF-8 JSON, or it nests too deeply to decode (a
            ``RecursionError`` in the decoder is reported as this, with the same meaning).
    """
    try:
        return json.loads(body)
    except RecursionError:
        raise ValueError("the frame's JSON nests too deeply to decode") from None


def recv_message(sock: Any) -> Any:
    """Receive one frame written by :func:`send_message` and decode its JSON.

    Args:
        sock: a connected stream socket (anything with ``recv(n) -> bytes``).

    Returns:
        The decoded value (a dict for every well-formed request or reply), or None if
        the peer closed the connection before a whole frame arrived.

    Raises:
        ValueError: the frame arrived whole but is not UTF-8 JSON, or nests too deeply
            (:func:`decode_frame`; the stream is still in sync: the next frame can be read).
        OSError: the socket failed.
    """
    n = recv_header(sock)
    if n is None:
        return None
    body = _recv_exact(sock, n)
    if body is None:
        return None
    return decode_frame(body)


# --------------------------------------------------------------------------- messages


def request(token: str, op: str, args: dict) -> dict:
    """A kernel's request: ``{"token": token, "op": op, "args": args}``.

    Args:
        token: the kernel's secret (hex str, from :func:`bind_code`).
        op: one of :class:`Op`.
        args: the op's arguments (see :class:`Op`), JSON-serialisable.
    """
    return {"token": token, "op": op, "args": args}


def reply_ok(value: Any) -> dict:
    """A successful reply: ``{"ok": True, "value": value}`` (value JSON-serialisable)."""
    return {"ok": True, "value": value}


def reply_error(error: dict, closed: bool = False) -> dict:
    """A failed reply: ``{"ok": False, "error": error}``, ``error`` from :func:`encode_error`.

    ``closed``: the host closes the connection after this reply (it refused the connection,
    or a frame it did not read): the reply then carries ``"closed": true`` and the kernel
    opens a new connection for its next call.
    """
    return {"ok": False, "error": error, "closed": True} if closed else {"ok": False, "error": error}


def item_ok(value: Any) -> dict:
    """One successful item of a batched op's value: ``{"value": value}``."""
    return {"value": value}


def item_error(error: dict) -> dict:
    """One failed item of a batched op's value: ``{"error": error}`` (see :func:`encode_error`)."""
    return {"error": error}


def is_error_item(item: Any) -> bool:
    """True if ``item`` (one element of a batched op's value) is a failed item."""
    return isinstance(item, dict) and "error" in item


def encode_error(kind: str, message: str, **attrs: Any) -> dict:
    """A wire error: ``{"type": kind, "message": message, **attrs}``.

    Args:
        kind: one of :class:`ErrorKind` (not checked: an unknown kind decodes as
            ``SUBCALL_ERROR`` in the kernel).
        message: the text the kernel's exception carries (str).
        attrs: the kind's attributes (see :data:`ERROR_ATTRS`), JSON-serialisable.
    """
    return {"type": kind, "message": message, **attrs}


def decode_error(error: Mapping[str, Any], classes: Mapping[str, type]) -> BaseException:
    """Turn a wire error back into an exception instance (it is returned, not raised).

    Args:
        error: a dict from :func:`encode_error`; missing fields take their defaults
            (message ``"sub-call failed"``, attributes as in :data:`ERROR_ATTRS`).
        classes: exception class per :class:`ErrorKind`; must hold ``SUBCALL_ERROR``,
            used for an unknown or missing kind. Each class is called as
            ``cls(message, **attributes)``.

    Raises:
        KeyError: ``classes`` has no ``SUBCALL_ERROR`` entry and the kind is unknown.
    """
    kind = error.get("type")
    cls = classes.get(kind) if isinstance(kind, str) else None
    if cls is None:
        kind, cls = ErrorKind.SUBCALL_ERROR, classes[ErrorKind.SUBCALL_ERROR]
    attrs = {k: error.get(k, default) for k, default in ERROR_ATTRS.get(kind, {}).items()}
    return cls(error.get("message", "sub-call failed"), **attrs)


# --------------------------------------------------------------------------- code cells

#: The name the runtime module is bound to in every kernel's namespace.
RUNTIME_NAME = "__rlm_rt"

#: The kernel's start-up line (``IPKernelApp.exec_lines``): imports the runtime.
BOOT_CODE = f"import kernels.runtime as {RUNTIME_NAME}"

#: The key under which :data:`FINAL_EXPR` is sent in a cell's ``user_expressions``.
FINAL_KEY = "final"

#: The name of the in-kernel class whose ``take_final()`` pops the answer (see :data:`FINAL_EXPR`).
FINAL_ANCHOR = "_RLMFinal"

#: A user expression (Python source, str) evaluated in the kernel after a cell: the JSON
#: text of ``{"answer": str}`` if the cell called ``FINAL``/``FINAL_VAR``, else ``null``.
#: It pops the answer, so each answer is read once. Send it as
#: ``user_expressions={FINAL_KEY: FINAL_EXPR}`` and read it with :func:`parse_final`.
#:
#: It uses no name at all (no global, no builtin, no module): it finds the runtime's
#: :data:`FINAL_ANCHOR` class among ``object``'s subclasses and calls its ``take_final()``,
#: which first restores everything the host relies on in the kernel. So whatever a cell did
#: to its namespace (``%reset -f``, ``del``, ``__builtins__`` or ``sys.modules`` tampering,
#: rebinding the runtime's handle), the answer its ``FINAL`` recorded still reaches the host.
FINAL_EXPR = ("([a for c in ().__class__.__base__.__subclasses__() "
              f"if c.__name__ == {FINAL_ANCHOR!r} for a in (c.take_final(),) if a] + ['null'])[0]")


def boot_code() -> str:
    """The kernel's start-up code, :data:`BOOT_CODE` (str)."""
    return BOOT_CODE


def bind_code(bridge_path: str, token: str, context_path: str | None, fmt: str,
              size: int | None = None, checked: bool = False, tools: list | None = None) -> str:
    """The cell that binds a started kernel to one RLM instance (Python source, str).

    It calls ``kernels.runtime.bind``: the kernel connects to the bridge socket with
    ``token`` on its first call, and ``context`` is loaded from ``context_path``. Every
    value travels as a ``repr`` literal; the context itself never does.

    Args:
        bridge_path: filesystem path of the bridge's Unix socket.
        token: the kernel's secret from :meth:`kernels.bridge.BridgeServer.register`.
        context_path: the file holding the context, or None for no context.
        fmt: ``"text"`` (UTF-8 text), ``"json"`` (a JSON document) or ``"bundle"`` (a
            many-file context's manifest, :mod:`kernels.bundle`).
        size: the file's size in bytes when the host loaded it (the user's own file, read
            in place), or None: a file of another size is refused (``ContextChanged``).
        checked: the host checks the instance's FINAL value (an answer schema or gate), so
            ``FINAL`` in the kernel says the value was submitted, not recorded.
        tools: the user's tools at this instance's level, one JSON-able spec each (name,
            docstring, signature: :func:`kernels.tool_stubs.tool_names`), or None.

    The cell prints nothing; it raises in the kernel (an error in the cell result) if the
    context file is missing or is not valid for ``fmt``.
    """
    return (f"{RUNTIME_NAME}.bind({bridge_path!r}, {token!r}, {context_path!r}, {fmt!r}"
            + (f", {int(size)!r}" if size is not None else "")
            + (", checked=True" if checked else "")
            + (f", tools={list(tools)!r})" if tools else ")"))


def add_context_code(context_path: str, fmt: str, index: int, size: int | None = None) -> str:
    """The cell that binds one more context of a session in a bound kernel (Python source):
    ``context_{index}`` and ``contexts[index]`` (:func:`kernels.contexts.add`). Like
    :func:`bind_code`, the path travels as a literal, never the context; the cell leaves no
    name behind and prints nothing."""
    return (f"__import__('kernels.contexts', fromlist=['add']).add({context_path!r}, {fmt!r}, "
            f"{int(index)!r}, {None if size is None else int(size)!r});")


def final_value(answer: str) -> dict:
    """The in-kernel side of :data:`FINAL_EXPR`: the object recorded for one answer."""
    return {"answer": answer}


def parse_final(exprs: dict) -> str | None:
    """The answer from a cell's evaluated user expressions, or None.

    Args:
        exprs: the ``user_expressions`` of the cell's ``execute_reply`` (a dict of
            ``{"status", "data": {"text/plain": repr}}`` per key), sent with
            ``{FINAL_KEY: FINAL_EXPR}``.

    Returns:
        The answer set by ``FINAL``/``FINAL_VAR`` in that cell (str), or None if there
        is none or the expression failed (e.g. the kernel was restarted in between).
    """
    v = exprs.get(FINAL_KEY)
    if not v or v.get("status") != "ok":
        return None
    got = json.loads(ast.literal_eval(v["data"]["text/plain"]))
    if got is None:
        return None
    answer = got["answer"]
    # the text policy of harness.text (this module is standard library only): lone
    # surrogates, which UTF-8 cannot encode, become U+FFFD
    return answer.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
