"""The host-kernel bridge protocol (kernels/protocol.py) and the secret policy
(kernels/secrets.py): fast, no kernel and no model needed."""
from __future__ import annotations

import ast
import json
import os
import socket
import struct
import sys
from pathlib import Path

import pytest

from kernels import protocol, runtime
from kernels.bridge import BridgeError, BridgeServer
from kernels.protocol import (BATCHED_OPS, ERROR_ATTRS, FINAL_EXPR, FINAL_KEY, SUBCALL_OPS,
                              TOOL_OPS, ErrorKind, Op, bind_code, decode_error, encode_error, parse_final,
                              recv_message, send_message)
from kernels.tool_stubs import tool_names
from kernels.secrets import (KERNEL_ENV_ALLOW, SECRET_NAME, is_secret_name, kernel_env,
                             without_secrets)

KERNELS = Path(protocol.__file__).resolve().parent


def _names(cls) -> set[str]:
    return {v for k, v in vars(cls).items() if not k.startswith("_")}


# --------------------------------------------------------------------------- framing


def test_framing_round_trip_and_end_of_stream():
    a, b = socket.socketpair()
    with a, b:
        msg = {"token": "t", "op": Op.RLM, "args": {"prompt": "é" * 1000, "query": None}}
        send_message(a, msg)
        assert recv_message(b) == msg
        # the wire format: 4-byte big-endian length, then UTF-8 JSON
        send_message(a, {"ok": True})
        (n,) = struct.unpack(">I", b.recv(4))
        assert json.loads(b.recv(n)) == {"ok": True}
        a.sendall(struct.pack(">I", 10) + b"{")  # peer closes mid-frame
        a.close()
        assert recv_message(b) is None


def test_a_frame_that_is_not_json_raises_and_the_stream_stays_in_sync():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", 3) + b"{x}")
        send_message(a, {"next": 1})
        with pytest.raises(ValueError):
            recv_message(b)
        assert recv_message(b) == {"next": 1}


# --------------------------------------------------------------------------- names and errors


def test_op_sets():
    assert SUBCALL_OPS == {Op.LLM_QUERY, Op.LLM_QUERY_BATCHED, Op.RLM, Op.RLM_BATCHED}
    assert SUBCALL_OPS | TOOL_OPS <= _names(Op) and not SUBCALL_OPS & TOOL_OPS
    assert BATCHED_OPS == {Op.LLM_QUERY_BATCHED, Op.RLM_BATCHED} <= SUBCALL_OPS
    # bind() registers the tools' ToolError (kernels.tool_stubs), with or without tools
    tool_names([], vars(runtime))
    assert set(ERROR_ATTRS) == _names(ErrorKind) == set(runtime.ERROR_CLASSES)
    for kind, cls in runtime.ERROR_CLASSES.items():
        assert cls.__name__ == kind  # the kind names the in-kernel exception


def test_errors_round_trip_into_the_kernel_exceptions():
    wire = BridgeError(ErrorKind.BUDGET_EXCEEDED, "no more", cap="tokens", limit=10, used=8,
                       requested=5, remaining=2).to_wire()
    assert wire == encode_error(ErrorKind.BUDGET_EXCEEDED, "no more", cap="tokens", limit=10,
                                used=8, requested=5, remaining=2)
    exc = decode_error(json.loads(json.dumps(wire)), runtime.ERROR_CLASSES)
    assert type(exc) is runtime.BudgetExceeded and str(exc) == "no more"
    assert (exc.cap, exc.limit, exc.used, exc.requested, exc.remaining) == ("tokens", 10, 8, 5, 2)

    child = decode_error({"type": ErrorKind.CHILD_RLM_ERROR, "message": "m"}, runtime.ERROR_CLASSES)
    assert type(child) is runtime.ChildRLMError and (child.status, child.reason) == ("failed", "m")
    depth = decode_error(encode_error(ErrorKind.DEPTH_ERROR, "d"), runtime.ERROR_CLASSES)
    assert type(depth) is runtime.DepthError
    for junk in ({"type": "Nope", "message": "x"}, {"type": ["x"]}, {}):
        exc = decode_error(junk, runtime.ERROR_CLASSES)
        assert type(exc) is runtime.SubcallError
    assert str(decode_error({}, runtime.ERROR_CLASSES)) == "sub-call failed"


def test_no_op_or_error_name_is_a_bare_string_outside_protocol():
    banned = _names(Op) | _names(ErrorKind) | {protocol.RUNTIME_NAME}
    for path in KERNELS.glob("*.py"):
        if path.name == "protocol.py":
            continue
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and id(node) not in docs:
                assert node.value not in banned, f"{path.name}:{node.lineno}: {node.value!r}"


def test_protocol_imports_only_the_standard_library():
    tree = ast.parse((KERNELS / "protocol.py").read_text())
    for node in ast.walk(tree):
        mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                else [node.module] if isinstance(node, ast.ImportFrom) else [])
        for m in mods:
            assert m.split(".")[0] in sys.stdlib_module_names or m == "__future__", m


# --------------------------------------------------------------------------- code cells


def test_bind_code_and_final_expression():
    code = bind_code("/tmp/b'x.sock", "ab" * 16, None, "json")
    assert code == f"__rlm_rt.bind({'/tmp/b' + chr(39) + 'x.sock'!r}, {'ab' * 16!r}, None, 'json')"
    call = ast.parse(code).body[0].value
    assert [ast.literal_eval(a) for a in call.args] == ["/tmp/b'x.sock", "ab" * 16, None, "json"]
    assert protocol.boot_code() == protocol.BOOT_CODE == "import kernels.runtime as __rlm_rt"

    def reply(obj):
        return {FINAL_KEY: {"status": "ok", "data": {"text/plain": repr(json.dumps(obj))}}}
    assert parse_final(reply(protocol.final_value("42"))) == "42"
    assert parse_final(reply(None)) is None
    assert parse_final({FINAL_KEY: {"status": "error"}}) is None
    assert parse_final({}) is None
    assert "take_final()" in FINAL_EXPR


# --------------------------------------------------------------------------- the bridge


def test_bridge_answers_junk_and_refusals_without_dropping_the_connection():
    seen = []

    def handler(reg, op, args):
        seen.append((reg.owner, op, args))
        if op == Op.LLM_QUERY:
            return "hi " + args["prompt"]
        raise BridgeError(ErrorKind.DEPTH_ERROR, "no")

    bridge = BridgeServer(handler)
    try:
        reg = bridge.register(os.getpid(), owner="me")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(bridge.path)
            s.sendall(struct.pack(">I", 1) + b"{")
            bad = recv_message(s)
            assert bad["ok"] is False and bad["error"]["type"] == ErrorKind.SUBCALL_ERROR
            assert bad["error"]["message"].startswith("JSONDecodeError: ")
            send_message(s, protocol.request("f" * 32, Op.LLM_QUERY, {"prompt": "x"}))
            refused = recv_message(s)
            assert refused["error"]["type"] == ErrorKind.SUBCALL_ERROR
            assert "not the kernel that token was issued to" in refused["error"]["message"]
            send_message(s, protocol.request(reg.token, Op.LLM_QUERY, {"prompt": "x"}))
            assert recv_message(s) == {"ok": True, "value": "hi x"}
            send_message(s, protocol.request(reg.token, Op.RLM, {}))
            assert recv_message(s) == {"ok": False, "error": {"type": "DepthError", "message": "no"}}
        assert seen == [("me", Op.LLM_QUERY, {"prompt": "x"}), ("me", Op.RLM, {})]
    finally:
        bridge.close()
    assert not os.path.exists(bridge.path)


# --------------------------------------------------------------------------- secrets


def test_one_secret_policy():
    assert not [n for n in KERNEL_ENV_ALLOW if is_secret_name(n)]
    for name in ("OPENAI_API_KEY", "RLM_SOME_TOKEN", "aws_secret_access_key", "DB_PASSWORD",
                 "SSH_AUTH_SOCK", "GOOGLE_APPLICATION_CREDENTIALS", "PASSWD"):
        assert is_secret_name(name) and SECRET_NAME.search(name)
    host = {"PATH": "/bin", "HOME": "/h", "OPENAI_API_KEY": "sk", "OPENAI_BASE_URL": "u",
            "RLM_JOURNAL": "j", "MY_TOKEN": "t"}
    assert kernel_env({"X": "1"}, environ=host) == {
        "PATH": "/bin", "HOME": "/h", "PYTHONUNBUFFERED": "1",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1", "X": "1"}
    assert without_secrets(host) == {"PATH": "/bin", "HOME": "/h", "OPENAI_BASE_URL": "u",
                                     "RLM_JOURNAL": "j"}
