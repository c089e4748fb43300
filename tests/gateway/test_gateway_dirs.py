"""A directory context on a gateway kernel: sent as content-addressed pieces and a manifest,
each checked by hash, and bound as the same ``context`` a local kernel binds; a second kernel
of the gateway host pulls nothing the shared cache holds; a piece changed after the host named
its hash is refused."""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import time
import uuid
from pathlib import Path

import pytest

from gw_helpers import gateway  # noqa: F401 (a fixture)
from kernels.bridge import BridgeServer
from kernels.gateway.client import GatewayClient
from kernels.gateway.kernel import GatewayKernel
from kernels.kernel import Kernel
from kernels.protocol import bind_code
from rlm.context.load import load_context

# a cell that prints what a kernel holds: its keys (with their escapes) and a digest of it all
SUMMARY = ("import hashlib, json\n"
           "print(json.dumps(list(context)))\n"
           "print(hashlib.sha256(json.dumps(context, sort_keys=True).encode()).hexdigest())")


def _tree(root: Path, salt: str) -> str:
    """A directory with odd-byte names, an empty file, nested folders, a compressed text, a
    JSON file and a binary file (skipped, as locally); returns its path."""
    files = {
        b"caf\xe9.txt": f"latin-1 name {salt}".encode(),
        b"caf\xc3\xa9.txt": f"utf-8 name {salt}".encode(),
        b"d\xe9/a.txt": b"under a latin-1 directory",
        b"empty.txt": b"",
        b"deep/er/still/notes.md": (f"# notes {salt}\n"
                                    + "".join(f"line {i}\n" for i in range(3000))).encode(),
        b"data.json": json.dumps({"n": [1, 2, 3], "s": "\u00e9" + salt}).encode(),
        b"packed.txt.gz": gzip.compress(f"compressed text {salt}\n".encode() * 200),
        b"blob.bin": bytes(range(256)) * 64,
    }
    base = os.path.join(os.fsencode(str(root)), b"ctx-" + salt.encode())
    for name, data in files.items():
        path = os.path.join(base, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return os.fsdecode(base)


def _bind(k, b, ctx) -> str:
    reg = b.register(k.pid, None)
    code = k.bind_cell(b, reg.token, k.share_file(ctx.path, "bundle"), "bundle", None)
    assert len(code) < 400  # a reference, never the files
    res, _ = k.execute(code + "\n" + SUMMARY, timeout=60)
    return res


@pytest.fixture
def started(gateway):
    made = []

    def make():
        k, b = GatewayKernel(GatewayClient(gateway.url, gateway.token)).start(), BridgeServer(
            lambda reg, op, args: "")
        made.append((k, b))
        return k, b
    yield make
    for k, b in made:
        k.shutdown()
        b.close()


def _local_output(ctx, tmp_path) -> str:
    """What a local kernel prints for the same context after binding it."""
    k, b = Kernel(workdir=str(tmp_path)).start(), BridgeServer(lambda reg, op, args: "")
    try:
        reg = b.register(k.pid, None)
        code = bind_code(k.share_socket(b.path), reg.token, k.share_file(ctx.path, "bundle"),
                         "bundle")
        res, _ = k.execute(code + "\n" + SUMMARY, timeout=60)
        assert res.error is None, res.output
        return res.output.strip()
    finally:
        k.shutdown()
        b.close()


def test_a_directory_binds_as_locally_and_is_not_sent_twice(started, gateway, tmp_path):
    root = _tree(tmp_path, uuid.uuid4().hex)
    ctx = load_context(Path(root))
    try:
        value = ctx.read_value()  # what a local kernel's bind reads from the same manifest
        assert "caf\\xe9.txt" in value and value["empty.txt"] == ""
        assert "deep/er/still/notes.md" in value and "blob.bin" not in value
        want = (json.dumps(list(value)) + "\n"
                + hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest())
        assert _local_output(ctx, tmp_path).endswith(want)
        k1, b1 = started()
        res = _bind(k1, b1, ctx)
        assert res.error is None and res.output.strip().endswith(want), res.output
        first = k1.frames.served_bytes
        assert first >= sum(len(v.encode()) if isinstance(v, str) else 0 for v in value.values())
        pieces = list(k1.frames._shares)
        k1.shutdown()  # the launcher takes the checked pieces into the host's cache
        cache = os.path.join(gateway.home, "cache")
        deadline = time.monotonic() + 20
        while (not all(os.path.exists(os.path.join(cache, s)) for s in pieces)
               and time.monotonic() < deadline):
            time.sleep(0.1)
        k2, b2 = started()
        res = _bind(k2, b2, ctx)
        assert res.error is None and res.output.strip().endswith(want), res.output
        assert k2.frames.served_bytes == 0, (first, k2.frames.served_bytes)
    finally:
        ctx.discard()


def test_a_piece_changed_after_it_was_named_is_refused(started, tmp_path):
    root = _tree(tmp_path, uuid.uuid4().hex)
    ctx = load_context(Path(root))
    try:
        k, b = started()
        reg = b.register(k.pid, None)
        shared = k.share_file(ctx.path, "bundle")
        target = os.path.join(os.fsencode(root), b"deep/er/still/notes.md")
        data = bytearray(open(target, "rb").read())
        data[10] ^= 1  # same length: only the hash tells
        with open(target, "wb") as f:
            f.write(bytes(data))
        res, _ = k.execute(k.bind_cell(b, reg.token, shared, "bundle", None), timeout=60)
        assert res.error is not None and "sha256" in res.output, res.output
        res, _ = k.execute("print('context' in dir())", timeout=30)
        assert "True" not in res.output
    finally:
        ctx.discard()
