"""A gateway kernel on its own (``kernels.gateway.kernel.GatewayKernel``) against a real Jupyter
Kernel Gateway: the bridge over the stdin channel with a bridge server's real dispatch, calls at
once from a cell's threads, contexts pulled by hash, the sandbox on the gateway host, and
faults: a WebSocket that drops mid-call, a kernel the gateway ends, a gateway that is down or
refuses the token."""
from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest

from gw_helpers import gateway  # noqa: F401 (a fixture)
from kernels.bridge import BridgeServer
from kernels.gateway import client as client_mod
from kernels.gateway.client import WS_V1, GatewayClient, GatewayError, decode_v1, encode_v1
from kernels.gateway.kernel import GatewayKernel
from kernels.kernel import KernelDied
from kernels.provider import KernelLike


class Calls:
    """A bridge handler that answers ``llm_query`` with ``echo:PROMPT`` after ``delay`` s and
    counts each prompt it served."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay, self.seen, self.lock = delay, [], threading.Lock()

    def __call__(self, reg, op, args):
        with self.lock:
            self.seen.append(args.get("prompt"))
        time.sleep(self.delay)
        return "echo:" + str(args.get("prompt"))


@pytest.fixture
def bound(gateway, tmp_path):
    """``make(handler, context=str) -> (kernel, bridge)``: a started gateway kernel bound to a
    bridge server with ``handler``; both closed after the test."""
    made = []

    def make(handler, context: str = "the context"):
        k = GatewayKernel(GatewayClient(gateway.url, gateway.token)).start()
        b = BridgeServer(handler)
        made.append((k, b))
        reg = b.register(k.pid, None)
        path = tmp_path / f"ctx{len(made)}.txt"
        path.write_text(context)
        code = k.bind_cell(b, reg.token, k.share_file(str(path)), "text", len(context.encode()))
        res, _ = k.execute(code, timeout=60)
        assert res.error is None, res.output
        return k, b
    yield make
    for k, b in made:
        k.shutdown()
        b.close()


def test_calls_from_threads_travel_together_and_each_runs_once(bound):
    calls = Calls(delay=0.3)
    k, _ = bound(calls)
    assert isinstance(k, KernelLike) and k.sandbox_mode == "gateway"
    res, _ = k.execute(
        "import threading, time\nout = {}\nt0 = time.time()\n"
        "ts = [threading.Thread(target=lambda i=i: out.__setitem__(i, llm_query(str(i))))"
        " for i in range(16)]\n[t.start() for t in ts]; [t.join() for t in ts]\n"
        "print(sorted(out.values()) == sorted('echo:%d' % i for i in range(16)), "
        "round(time.time() - t0, 2))", timeout=60)
    ok, took = res.output.split()
    assert ok == "True", res.output
    # 16 calls of 0.3 s each at once: together, not one behind the other (4.8 s)
    assert float(took) < 2.5, res.output
    assert sorted(calls.seen) == sorted(str(i) for i in range(16))


@pytest.mark.parametrize("protocol", ["v1", "json"])
def test_one_stdin_round_trip_per_call(bound, monkeypatch, protocol):
    # on the binary subprotocol, and on the JSON text one a gateway without it falls back to
    if protocol == "json":
        monkeypatch.setattr(client_mod, "WS_V1", "no-such-subprotocol")
    calls = Calls()
    k, _ = bound(calls)
    assert k._ws.getsubprotocol() == (WS_V1 if protocol == "v1" else None)
    res, _ = k.execute(
        "from kernels.gateway.courier import courier\nn0 = courier().trips\n"
        "for i in range(20):\n    llm_query(str(i))\nprint(courier().trips - n0)", timeout=60)
    assert res.output.strip() == "20", res.output  # no polling for a reply already there
    assert len(calls.seen) == 20


def test_a_context_is_pulled_checked_and_not_sent_twice(bound):
    text = "".join(chr(0x41 + i % 26) for i in range(9 << 20)) + "é"  # 9 MiB: three chunks
    k, _ = bound(Calls(), context=text)
    sha = hashlib.sha256(text.encode()).hexdigest()
    res, _ = k.execute(f"import hashlib\nprint(hashlib.sha256(context.encode()).hexdigest() "
                       f"== {sha!r}, len(context))", timeout=60)
    assert res.output.split() == ["True", str(len(text))], res.output
    served = []
    real = k.frames._chunk
    k.frames._chunk = lambda args: served.append(args) or real(args)
    # the same context bound again (a session's restarted context): read from the kernel's
    # own copy, no chunk sent; the cell carries a reference, never the text
    code = ("__import__('kernels.contexts', fromlist=['add']).add("
            f"{k.share_file(k.frames._shares[sha])!r}, 'text', 1)")
    assert len(code) < 200
    res, _ = k.execute(code + "\nprint(context_1 == context)", timeout=60)
    assert res.output.strip().endswith("True") and served == [], res.output


def test_a_tampered_token_is_refused_on_the_stdin_channel(bound):
    calls = Calls()
    k, b = bound(calls)
    other = b.register(-1, None)  # another gateway kernel's token, valid on the bridge
    res, _ = k.execute(
        "import kernels.runtime as rt\n"
        f"rt._CONF['token'] = {other.token!r}\n"
        "try:\n    llm_query('x')\nexcept Exception as e:\n    print(type(e).__name__, e)",
        timeout=30)
    assert "SubcallError" in res.output and "not issued to this kernel" in res.output
    assert calls.seen == []


def test_the_sandbox_holds_on_the_gateway_host(bound, gateway):
    k, _ = bound(Calls())
    port = gateway.url.rsplit(":", 1)[1]
    res, _ = k.execute(
        "import os, socket\n"
        "s = socket.socket(); s.settimeout(2)\n"
        f"try:\n    s.connect(('127.0.0.1', {port})); print('NET-OPEN')\n"
        "except OSError:\n    print('net-blocked')\n"
        # the gateway's own files (its log, the other kernels' connection files) are not there
        f"seen = [p for p in ('gateway.log', 'runtime', 'pfx') "
        f"if os.path.exists(os.path.join({gateway.home!r}, p))]\n"
        "print('gw-files-hidden' if not seen else 'GW-FILES %s' % seen)\n"
        "try:\n    open('/etc/shadow').read(); print('SHADOW-READ')\n"
        "except OSError:\n    print('shadow-blocked')", timeout=30)
    assert "net-blocked" in res.output and "NET-OPEN" not in res.output, res.output
    assert "gw-files-hidden" in res.output and "shadow-blocked" in res.output, res.output


@pytest.mark.parametrize("when", [0.05, 0.4])
def test_a_dropped_websocket_loses_no_call_and_makes_none_twice(bound, when):
    calls = Calls(delay=0.3)
    k, _ = bound(calls)

    def drop():
        time.sleep(when)
        k._ws.sock.shutdown(2)  # the connection breaks under the reader
    threading.Thread(target=drop, daemon=True).start()
    res, _ = k.execute(
        "import threading\nout = {}\n"
        "ts = [threading.Thread(target=lambda i=i: out.__setitem__(i, llm_query(str(i))))"
        " for i in range(8)]\n[t.start() for t in ts]; [t.join() for t in ts]\n"
        "after = llm_query('after')", timeout=60)
    assert res.error is None, res.output
    # (output the kernel sent in the instant of the drop may be lost: read the values after)
    res, _ = k.execute("print(sorted(out.values()) == sorted('echo:%d' % i for i in range(8)),"
                       " after)", timeout=60)
    assert res.output.split() == ["True", "echo:after"], res.output
    assert k.reconnects >= 1
    assert sorted(calls.seen) == sorted([str(i) for i in range(8)] + ["after"])


def test_a_kernel_the_gateway_ends_mid_cell_is_reported_dead(bound, gateway):
    k, _ = bound(Calls())
    client = GatewayClient(gateway.url, gateway.token)
    threading.Timer(0.5, client.delete, args=(k.kernel_id,)).start()  # as a cull does
    t0 = time.monotonic()
    with pytest.raises(KernelDied):
        k.execute("import time\ntime.sleep(30)", timeout=60)
    assert time.monotonic() - t0 < 15
    assert not k.is_alive()


def test_a_gateway_that_is_down_or_refuses_the_token_says_so(gateway):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(GatewayError, match="could not reach the Jupyter gateway") as down:
        GatewayKernel(GatewayClient(f"http://127.0.0.1:{port}", "tok-xyz")).start()
    assert down.value.status == 0 and "tok-xyz" not in str(down.value)
    with pytest.raises(GatewayError, match="refused the token") as bad:
        GatewayKernel(GatewayClient(gateway.url, "wrong-token-123")).start()
    assert bad.value.status in (401, 403) and "wrong-token-123" not in str(bad.value)
    assert gateway.token not in str(bad.value)


def test_a_context_on_the_gateway_host_already_is_not_sent_again(bound, gateway, tmp_path):
    # the first kernel pulls it; when it exits, the launcher takes the checked file into the
    # host's cache; a second kernel finds it there (read-only) and pulls nothing
    text = "cached context " * 50_000
    sha = hashlib.sha256(text.encode()).hexdigest()
    k1, _ = bound(Calls(), context=text)
    k1.shutdown()
    cached = os.path.join(gateway.home, "cache", sha)
    deadline = time.monotonic() + 20
    while not os.path.exists(cached) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.path.exists(cached)
    k2 = GatewayKernel(GatewayClient(gateway.url, gateway.token)).start()
    b = BridgeServer(Calls())
    try:
        served = []
        real = k2.frames._chunk
        k2.frames._chunk = lambda args: served.append(args) or real(args)
        reg = b.register(k2.pid, None)
        path = tmp_path / "again.txt"
        path.write_text(text)
        res, _ = k2.execute(k2.bind_cell(b, reg.token, k2.share_file(str(path)), "text",
                                         len(text.encode())) + "\nprint(len(context))",
                            timeout=60)
        assert res.error is None and res.output.strip().endswith(str(len(text))), res.output
        assert served == []
    finally:
        k2.shutdown()
        b.close()


def test_oversized_requests_are_refused_with_the_cap_named(bound, monkeypatch):
    # the host's frame cap at 1 MiB: a 3 MB prompt is one frame over it (refused by the
    # bridge's own check); a 20 MB one makes the whole request too big to read (refused unread)
    monkeypatch.setenv("RLM_BRIDGE_MAX_FRAME_MB", "1")
    calls = Calls()
    k, _ = bound(calls)
    res, _ = k.execute(
        "for n in (3_000_000, 20_000_000):\n"
        "    try:\n        llm_query('x' * n)\n"
        "    except SubcallError as e:\n        print(n, 'refused', 'cap' in str(e))\n"
        "print(llm_query('small'))", timeout=120)
    assert res.output.split("\n")[:3] == ["3000000 refused True", "20000000 refused True",
                                          "echo:small"], res.output
    assert calls.seen == ["small"]


def test_a_cell_past_its_timeout_is_interrupted_and_the_kernel_goes_on(bound):
    k, _ = bound(Calls())
    t0 = time.monotonic()
    res, _ = k.execute("x = 1\nimport time\ntime.sleep(30)", timeout=1.0)
    assert res.timed_out and "KeyboardInterrupt" in (res.error or ""), res
    assert time.monotonic() - t0 < 10
    res, _ = k.execute("print(x + 1, llm_query('still'))", timeout=30)
    assert res.output.split() == ["2", "echo:still"], res.output


def test_binary_frames_carry_a_message_whole():
    msg = {"header": {"msg_id": "a", "msg_type": "input_reply"}, "parent_header": {"x": "é"},
           "metadata": {}, "content": {"value": "\x00rlm" + "z" * 1000}, "channel": "stdin"}
    assert decode_v1(encode_v1(msg)) == dict(msg, buffers=[])
    assert decode_v1(b"not a frame") is None and decode_v1(b"") is None


def test_interrupts_while_the_main_thread_carries_calls_lose_none(bound):
    # the thread that asks carries the request itself, the cell's main thread too: interrupts
    # landing at any point of its calls (sending, waiting, reading) leave no frame lost, none
    # made twice, and the channel usable by a cell's other threads and by the next cell
    calls = Calls(delay=0.002)
    k, _ = bound(calls)
    res, _ = k.execute(
        "import threading\ndone = []\n"
        "def bg():\n    for i in range(300):\n        done.append(llm_query('b%d' % i))\n"
        "t = threading.Thread(target=bg)\nt.start()", timeout=30)
    assert res.error is None, res.output
    for _ in range(3):
        res, _ = k.execute("while True:\n    llm_query('main')", timeout=0.7)
        assert res.timed_out and "KeyboardInterrupt" in (res.error or ""), res
    res, _ = k.execute("t.join(60)\nprint(len(done), done[-1], llm_query('after'))",
                       timeout=90)
    assert res.output.split() == ["300", "echo:b299", "echo:after"], res.output
    bg = [p for p in calls.seen if p.startswith("b")]
    assert sorted(bg) == sorted(f"b{i}" for i in range(300))  # each made once
