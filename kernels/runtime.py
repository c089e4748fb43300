"""The in-kernel runtime: the names the model's code sees, and their channel to the host.

This module is imported *inside* each Jupyter kernel. It binds ``context`` from
a file and defines ``llm_query``, ``llm_query_batched``, ``rlm``, ``rlm_batched``
(and the ``rlm_query*`` aliases), ``FINAL``, ``FINAL_VAR`` and ``SHOW_VARS``.
Every model call goes to the host over a Unix socket with this kernel's secret
token; the host checks the token *and* the connecting process id, so nothing
the model's code rewrites here (globals, environment, this module) can change
its depth, its budget scope, or let it act as another kernel.

Each thread, and each process a cell forks or spawns, has its own connection to the host
(:func:`_connection`), so answers never cross; a process started afresh finds the bridge in the
environment (:data:`BRIDGE_ENV`). Binding also seeds the kernel's chance (:mod:`kernels.chance`)
and makes ``asyncio.run`` work in a cell (:mod:`kernels.idioms`).

After every cell (and before the host reads the answer) everything the host relies on in
the kernel is put back: this module's own bindings and registries, the reserved names, this
module's handle, builtins, the modules of ``sys.modules``, output capture, the message packer
(see "restoring" below), so no cell can break the next one or the answer path. The batched
functions refuse one str/bytes/dict (``TypeError``, nothing sent). Wire format, op names, error
kinds: :mod:`kernels.protocol`.
"""
from __future__ import annotations

import builtins
import json
import os
import socket
import sys
import threading
from collections.abc import Mapping

from harness.text import clean_text
from kernels.bundle import ContextChanged, load_context, read_text  # noqa: F401 (names kept)
from kernels.chance import seed_kernel
from kernels.idioms import called_with_literal, install as install_idioms
from kernels.transcript import History
from kernels.protocol import (FINAL_ANCHOR, RUNTIME_NAME, ErrorKind, Op, checked_value,
                              decode_error, encode_frame, final_value, is_error_item,
                              recv_message, request, schema_dict)
from kernels.tool_stubs import tool_names

# The module's state survives a re-execution of the module (``importlib.reload`` from a cell).
_OLD = globals()
# Names restored after every cell. Filled in by bind().
RESERVED: dict = _OLD.get("RESERVED", {})
_FINAL: dict = _OLD.get("_FINAL", {})
_STATE = _OLD.get("_STATE") or threading.local()
_CONF: dict = _OLD.get("_CONF", {})
#: What :func:`_restore` puts back after every cell; filled in by :func:`bind`.
_SNAP: dict = _OLD.get("_SNAP", {})
#: What :func:`_restore` repairs the module from first (see :func:`_seal`).
_VAULT: dict = _OLD.get("_VAULT", {})
del _OLD

#: The environment variable :func:`bind` sets to the JSON of ``{"socket", "token"}``, so a
#: process a cell starts afresh (``spawn``) reaches the bridge as a descendant of the kernel.
BRIDGE_ENV = "RLM_KERNEL_BRIDGE"
# what the bridge client needs, taken now: a cell that rebinds socket.socket or os.getpid
# must not cut the kernel off its host (these bindings are restored after every cell)
_Socket, _AF_UNIX, _SOCK_STREAM = socket.socket, socket.AF_UNIX, socket.SOCK_STREAM
_getpid, _environ = os.getpid, os.environ


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
    """This thread's connection to the bridge, in this process.

    One per thread (a reply is read by the thread that asked) and per process: a process the
    cell forked (``os.fork``, a fork-started ``multiprocessing`` pool) inherits its parent's
    socket object, and two processes writing one stream interleave their requests and read
    each other's replies. So a connection made by another process is dropped (closing only
    this process's copy) and a new one opened; the bridge authenticates it as the kernel's
    descendant.
    """
    sock = getattr(_STATE, "sock", None)
    if sock is not None and getattr(_STATE, "pid", None) != _getpid():
        _STATE.sock = None
        try:
            sock.close()
        except OSError:
            pass
        sock = None
    if sock is None:
        sock = _Socket(_AF_UNIX, _SOCK_STREAM)
        sock.connect(_conf()["socket"])
        _STATE.sock, _STATE.pid = sock, _getpid()
    return sock


def _conf() -> dict:
    """The bridge's socket and this kernel's token: bound by :func:`bind`, or, in a process
    started afresh by a cell (a ``spawn``/``forkserver`` pool), read from the environment
    :func:`bind` set (:data:`BRIDGE_ENV`). Raises SubcallError when neither has them."""
    if not _CONF:
        raw = _environ.get(BRIDGE_ENV)
        try:
            got = json.loads(raw) if raw else None
            _CONF.update(socket=str(got["socket"]), token=str(got["token"]))
        except (TypeError, ValueError, KeyError):
            raise SubcallError("this process is not connected to an RLM kernel's bridge: "
                               "call llm_query/rlm from the kernel, or from a process it "
                               "started") from None
    return _CONF


class _Closed(Exception):
    """The host's reply said it closed the connection (see ``reply_error(closed=True)``)."""


def _call(op: str, **args):
    """Send one request to the host and wait for its reply; returns the reply's value.

    Raises the decoded in-kernel exception if the host answered with an error, and
    ConnectionError if the host closed the connection.
    """
    frame = encode_frame(request(_conf()["token"], op, args))
    sock = _connection()
    try:
        try:
            sock.sendall(frame)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the host refused the connection or the frame unread: its reply says why
        reply = recv_message(sock)
        if reply is None:
            raise ConnectionError("the host closed the bridge connection")
        if reply.get("closed"):
            raise _Closed
    except BaseException as exc:
        # A half-read reply (e.g. KeyboardInterrupt at the cell timeout) would desynchronise
        # the stream, and a closed one is gone: drop it, the next call opens a new one.
        _STATE.sock = None
        try:
            sock.close()
        except OSError:
            pass
        if not isinstance(exc, _Closed):
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


def _prompt_list(prompts, fn: str, single: str) -> list:
    """``prompts`` as a list, or TypeError if it is one prompt rather than a list of them.

    A str, bytes or a dict given whole would otherwise be iterated item by item (one call
    per character, byte or key): refused before anything is sent.
    """
    if isinstance(prompts, (str, bytes, bytearray, memoryview, Mapping)):
        what = type(prompts).__name__
        size = (f" of {len(prompts)} characters" if isinstance(prompts, str) else
                f" with {len(prompts)} keys" if isinstance(prompts, Mapping) else "")
        raise TypeError(f"{fn}(prompts): the argument `prompts` must be a list of prompts, "
                        f"got one {what}{size}; pass a list such as {fn}([prompt1, prompt2]), "
                        f"or call {single}(prompt) for a single prompt. Nothing was sent.")
    try:
        return list(prompts)
    except TypeError:
        raise TypeError(f"{fn}(prompts): the argument `prompts` must be a list of prompts, "
                        f"not {type(prompts).__name__}. Nothing was sent.") from None


def llm_query_batched(prompts, model=None, return_exceptions=False):
    """Many plain completions, run concurrently by the host; answers in input order (list[str]).

    ``prompts`` is a list (or another iterable) of prompts; one str, bytes or dict raises
    TypeError and nothing is sent. If an item fails, raises BatchError carrying every item's
    result or error, unless ``return_exceptions=True``, which returns the exceptions in
    place. A refusal of the whole batch raises as :func:`llm_query` does.
    """
    prompts = [_text(p, "prompt") for p in _prompt_list(prompts, Op.LLM_QUERY_BATCHED, Op.LLM_QUERY)]
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
    schema = schema_dict(schema)
    return checked_value(_call(Op.RLM, prompt=prompt, query=query, model=model, schema=schema),
                         schema)


def rlm_batched(prompts, query=None, model=None, return_exceptions=False, schema=None):
    """Many child RLMs, run concurrently by the host; answers in input order (list[str]).

    ``prompts`` is a list of contexts; one str, bytes or dict raises TypeError and nothing
    is sent. Failed items raise BatchError, or come back in place with
    ``return_exceptions=True``, as in :func:`llm_query_batched`. ``schema`` checks every
    child's answer as in :func:`rlm`.
    """
    prompts = [p if isinstance(p, (str, list, dict)) else str(p)
               for p in _prompt_list(prompts, Op.RLM_BATCHED, Op.RLM)]
    schema = schema_dict(schema)
    values = _call(Op.RLM_BATCHED, prompts=prompts, query=query, model=model, schema=schema)
    return [r if isinstance(r, BaseException) else checked_value(r, schema)
            for r in _batch_results(values, return_exceptions, Op.RLM_BATCHED)]


def FINAL(value):
    """Set the run's answer to ``str(value)``. Only executed code can end a run.

    Returns what the model reads (str). When the host checks answers (an answer schema, a
    verify gate, ``rlm(..., schema=)``), the value is *submitted*: the host checks it when the
    cell ends and says so if it does not accept it; the text says that, not "recorded".
    """
    if _CONF.get("pid") != _getpid():  # a forked or spawned process: its answer goes nowhere
        raise RLMKernelError("FINAL was called in a process the cell started, which cannot "
                             "end the run: return the value to the kernel and call FINAL there")
    _FINAL.clear()
    _FINAL["answer"] = clean_text(value if isinstance(value, str) else repr(value) if not isinstance(
        value, (int, float)) else str(value))
    if _CONF.get("checked"):
        return ("FINAL answer submitted: it is checked when this cell ends, and you will be "
                "told if it is not accepted.")
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
    elif key is not None and key.isidentifier() and called_with_literal():
        raise NameError(f"FINAL_VAR: no variable named {key!r}; create it first, "
                        "or call FINAL(value)")
    else:
        value = name
    return FINAL(value if isinstance(value, str) else str(value))


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
    ip = _SNAP.get("ip")
    if ip is not None:
        return ip
    from IPython import get_ipython
    return get_ipython()


# --------------------------------------------------------------------------- restoring
#
# Everything the host relies on inside the kernel is put back after every cell (the
# ``post_run_cell`` event) and again right before the answer is read (``take_final``, run
# by the host's FINAL expression, which uses no name a cell can rebind): the reserved names
# and this module's handle in the namespace, ``__builtins__`` and the builtins a cell
# replaced (``print``...), the modules in ``sys.modules`` at bind time, ``sys.stdout`` and
# ``sys.stderr`` (the kernel's output capture), the kernel session's message packer, and
# the shell methods the host's requests go through. ``%reset`` restores at once.

#: Shell attributes a cell may shadow on the instance; the class's own are what the host uses.
_SHELL_METHODS = ("reset", "user_expressions", "ev", "run_cell", "_format_user_obj")


def _put_back(target: dict, snapshot: dict, skip=()) -> None:
    for k, v in snapshot.items():
        if k not in skip and target.get(k, _put_back) is not v:
            target[k] = v


def _repair(vault: dict) -> None:
    """This module's bindings and registries as :func:`_seal` recorded them (see
    :func:`_restore`); an answer a cell's ``FINAL`` wrote into a rebound ``_FINAL`` is kept.
    The bindings come first: what follows may use builtins a cell replaced."""
    if not vault:
        return
    mine, now = vault["module"], vault["self"].__dict__
    box, kept = now.get("_FINAL"), mine["_FINAL"]
    for k, v in mine.items():
        if now.get(k, vault) is not v:
            now[k] = v
    if box is not kept and box.__class__ is kept.__class__ and "answer" in box:
        kept["answer"] = box["answer"]
    for name, copy in vault["registries"].items():
        reg = mine[name]
        if reg != copy:
            reg.clear()
            reg.update({k: (v.copy() if v.__class__ is kept.__class__ else v)
                        for k, v in copy.items()})
    sock = getattr(mine["_STATE"], "sock", None)
    if sock is not None and type(sock) is not mine["_Socket"]:
        mine["_STATE"].sock = None  # a cell put something else there: the next call reconnects


def _restore(*_args, _vault=_VAULT, _repair=_repair) -> None:
    """Put back everything the host relies on in the kernel (see above). Never raises.

    It starts from :data:`_VAULT`, which it holds itself (a default argument, not a global a
    cell can rebind): this module's own bindings, then the contents of its registries
    (``RESERVED``, ``_CONF``, ``_SNAP``), so a cell that empties, rebinds or deletes any of
    them, or this function, disables nothing after it.
    """
    try:
        _repair(_vault)
    except Exception:
        pass
    if not _SNAP:
        return
    for step in (_restore_modules, _restore_namespace, _restore_kernel):
        try:
            step()
        except Exception:
            pass


def _seal() -> None:
    """Record what :func:`_repair` puts back: this module's dict and its registries' contents
    (copies, one level deep). Called by :func:`bind` once everything is bound."""
    self = sys.modules[__name__]
    _VAULT.clear()
    _VAULT.update(self=self, module=dict(vars(self)), registries={
        name: {k: (dict(v) if type(v) is dict else v) for k, v in reg.items()}
        for name, reg in (("RESERVED", RESERVED), ("_CONF", _CONF), ("_SNAP", _SNAP))})


def _restore_modules() -> None:
    _put_back(sys.modules, _SNAP["modules"])
    for mod, snap in _SNAP["module_dicts"]:
        _put_back(vars(mod), snap)
    _put_back(vars(builtins), _SNAP["builtins"], _SNAP["ipython_builtins"])


def _restore_namespace() -> None:
    ns = _SNAP["ip"].user_ns
    _put_back(ns, RESERVED)
    _put_back(ns, {RUNTIME_NAME: _SNAP["self"], "__builtins__": builtins})
    if "print" in ns and ns["print"] is not _SNAP["builtins"]["print"]:
        del ns["print"]  # output capture: a cell's own `print = ...` does not outlive it


def _restore_kernel() -> None:
    ip = _SNAP["ip"]
    sys.stdout, sys.stderr = _SNAP["streams"]
    own = vars(ip)
    for name in _SHELL_METHODS:
        if name in _SNAP["shell"]:
            if own.get(name) is not _SNAP["shell"][name]:
                own[name] = _SNAP["shell"][name]
        elif name in own:
            del own[name]
    ip.reset = _reset  # %reset (and %reset -f) restores at once, not only after the cell
    session = _SNAP["session"]
    if session is not None and session.pack is not _pack:
        session.pack = _pack
    callbacks = ip.events.callbacks.get("post_run_cell")
    if callbacks is not None and _restore not in callbacks:
        ip.events.register("post_run_cell", _restore)


def _reset(*args, **kwargs):
    """The shell's ``reset`` (``%reset``), followed at once by :func:`_restore`."""
    ip = _SNAP["ip"]
    try:
        return type(ip).reset(ip, *args, **kwargs)
    finally:
        _restore()


def _pack(obj) -> bytes:
    """The kernel session's message packer: JSON as UTF-8, text cleaned by the text policy.

    Jupyter's own packer fails on a lone surrogate (a cell printing half an emoji), which
    would lose the output and print a traceback from the kernel's I/O thread; this one
    replaces it with U+FFFD (:mod:`harness.text`) and never sends invalid UTF-8.
    """
    try:
        text = json.dumps(obj, default=_json_default, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        text = json.dumps(_json_clean(obj), default=_json_default, ensure_ascii=False,
                          allow_nan=False)
    return clean_text(text).encode("utf-8")


def _install_packer() -> None:
    """Give the running kernel's session :func:`_pack` (at import: before any cell runs)."""
    try:
        session = _ip().kernel.session
    except Exception:  # not inside a kernel (the host imports this module too)
        return
    session.pack = _pack


def _snapshot(ip) -> None:
    """Record what :func:`_restore` puts back (called by :func:`bind`)."""
    import harness.text as text
    import kernels.protocol as protocol
    self = sys.modules[__name__]
    kernel = getattr(ip, "kernel", None)
    _SNAP.clear()
    _SNAP.update(
        ip=ip, self=self, modules=dict(sys.modules),
        shell={k: v for k, v in vars(ip).items() if k in _SHELL_METHODS},
        module_dicts=[(m, dict(vars(m))) for m in (self, protocol, text, json)],
        builtins=dict(vars(builtins)),
        ipython_builtins=set(getattr(getattr(ip, "builtin_trap", None), "auto_builtins", ()))
        | {"__IPYTHON__", "display", "get_ipython"},
        streams=(sys.stdout, sys.stderr),
        session=getattr(kernel, "session", None),
    )


def take_final(*, _restore=_restore):
    """Host-side helper: restore the kernel's plumbing, then pop the answer FINAL set, as JSON.

    Returns the JSON text of ``{"answer": str}`` (see :func:`kernels.protocol.final_value`),
    or None if no answer is waiting. The host calls this through
    :data:`kernels.protocol.FINAL_EXPR`, in the same ``user_expressions`` round trip as the
    cell, on the class named :data:`kernels.protocol.FINAL_ANCHOR`.
    """
    _restore()
    if "answer" in _FINAL:
        return json.dumps(final_value(clean_text(_FINAL.pop("answer"))))
    return None


#: The anchor the host's FINAL expression finds without any name (see FINAL_EXPR).
_Anchor = type(FINAL_ANCHOR, (), {"take_final": staticmethod(take_final), "__slots__": ()})

try:
    from jupyter_client.jsonutil import json_clean as _json_clean
    from jupyter_client.jsonutil import json_default as _json_default
except ImportError:  # pragma: no cover - jupyter_client is a dependency
    _json_clean, _json_default = (lambda o: o), None
_install_packer()


def bind(socket_path: str, token: str, context_path: str | None, fmt: str = "text",
         size: int | None = None, checked: bool = False, tools: list | None = None) -> str:
    """Bind this kernel to one RLM instance: its bridge, its secret and its ``context``.

    Called once per kernel by the host, through :func:`kernels.protocol.bind_code` (``tools``).

    Args:
        socket_path: the bridge's Unix socket; connected on the first sub-call.
        token: this kernel's secret (hex str).
        context_path: the context file, or None (``context`` is then None).
        fmt: ``"text"``, ``"json"`` or ``"bundle"`` (see :func:`load_context`).
        size: the context file's size when the host loaded it, or None (see
            :func:`load_context`).
        checked: the host checks this instance's FINAL value (an answer schema or gate):
            :func:`FINAL` then says the value was submitted, not recorded.

    Returns a short description for the host's log (str). Raises what
    :func:`load_context` raises.
    """
    _CONF.update(socket=socket_path, token=token, checked=bool(checked), pid=_getpid())
    _environ[BRIDGE_ENV] = json.dumps({"socket": socket_path, "token": token})
    _STATE.sock = None
    ctx = load_context(context_path, fmt, size) if context_path else None
    ip = _ip()
    RESERVED.clear()
    RESERVED.update(
        context=ctx, context_0=ctx, contexts=[ctx] if context_path else [], llm_query=llm_query,
        llm_query_batched=llm_query_batched, rlm=rlm, rlm_batched=rlm_batched, rlm_query=rlm,
        rlm_query_batched=rlm_batched, FINAL=FINAL, FINAL_VAR=FINAL_VAR, SHOW_VARS=SHOW_VARS,
        history=History(lambda: _call(Op.HISTORY)),  # fetched when read (kernels.transcript)
        BudgetExceeded=BudgetExceeded, ChildRLMError=ChildRLMError, BatchError=BatchError,
        SubcallError=SubcallError, DepthError=DepthError, **tool_names(tools, globals()),
    )
    try:
        ip.events.unregister("post_run_cell", _restore)
    except ValueError:
        pass
    ip.events.register("post_run_cell", _restore)
    # exit()/quit() would stop the kernel 0.1 s after the cell, racing whatever cell comes next;
    # the REPL stays up instead (a run ends only through FINAL)
    ip.ask_exit = _ignore_exit
    install_idioms()  # asyncio.run(main()) works in a cell (kernels.idioms)
    seed_kernel()  # random (and NumPy, once imported) seeded with the run's seed (kernels.chance)
    _snapshot(ip)
    _seal()
    _restore()
    return f"context bound: {type(ctx).__name__}"


def _ignore_exit() -> None:
    """The shell's ``ask_exit`` in an RLM kernel: says that ``exit()``/``quit()`` do nothing."""
    print("[exit() ignored: this REPL stays up; call FINAL(answer) to finish]")
