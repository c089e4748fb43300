"""The bridge refuses before it reads (kernels/bridge.py, kernels/bridge_limits.py).

The first part drives a real :class:`BridgeServer` over its real Unix socket from this process
(registered as the kernel) and from a subprocess: frames over the cap, connections and held
bytes past a kernel's share, a process that is no kernel, deep and malformed JSON, running out
of descriptors. The second part attacks the bridge from a real cell of a real sandboxed kernel
in a real run (as tests/kernel/test_escape.py does): a frame announcing 4 GiB, a flood of
2,000 connections while a second run goes on beside it, a 200,000-deep frame.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from kernels import protocol
from kernels.bridge import BridgeServer
from kernels.bridge_limits import TALLY, BridgeLimits, nesting_over, peer_chain
from kernels.protocol import Op, recv_message, send_message

import rlm
from bridge_attacks import BIG, DEEP, FLOOD, seen
from conftest import API_KEY, MODEL, endpoint_args, is_root, last_user, repl, strict_sandbox
from kernels.bwrap import sandbox_problem

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def rss(pid: int | str = "self") -> int:
    """Resident memory of process ``pid`` (bytes), from ``/proc/PID/status`` (what psutil reads;
    psutil is not installed for the unprivileged run of this file)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class PeakRSS:
    """The highest resident memory of this process while the block runs, sampled every 10 ms:
    ``with PeakRSS() as peak: ...``, then ``peak.grew`` (bytes above the value at entry)."""

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
        self.grew = self.peak - self.start


def _echo(reg, op, args):
    return "hi " + str(args.get("prompt"))[:20]


def _conn(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    return s


def _ask(s: socket.socket, token: str, prompt="x") -> dict:
    """One request and its reply; as the kernel's runtime does, a refused connection's reply
    is read even when the host closed it before the request could be sent."""
    try:
        send_message(s, protocol.request(token, Op.LLM_QUERY, {"prompt": prompt}))
    except (BrokenPipeError, ConnectionResetError):
        pass
    return recv_message(s)


@pytest.fixture
def bridge():
    servers = []

    def make(**limits):
        srv = BridgeServer(_echo, BridgeLimits(**limits) if limits else None)
        servers.append(srv)
        return srv
    yield make
    for srv in servers:
        srv.close()
    deadline = time.monotonic() + 5  # every connection's thread has counted itself out
    while (TALLY.conns or TALLY.held) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert TALLY.conns == 0 and TALLY.held == 0


def test_a_frame_announcing_4_gib_is_refused_unread_naming_the_cap(bridge):
    srv = bridge()
    reg = srv.register(os.getpid(), "me")
    before = rss()
    with _conn(srv.path) as s:
        try:  # the header, then 256 MiB of the body: the host stops reading after the header
            s.sendall(struct.pack(">I", 2**32 - 1))
            chunk = b"\0" * (1 << 20)
            for _ in range(256):
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = recv_message(s)
    assert reply["ok"] is False and reply["closed"] is True
    msg = reply["error"]["message"]
    assert "the request is 4 GiB" in msg, msg
    assert "frame cap of 64 MiB" in msg and "RLM_BRIDGE_MAX_FRAME_MB" in msg
    assert rss() - before < 64 * 2**20
    with _conn(srv.path) as s:  # the kernel's next connection is served as before
        assert _ask(s, reg.token) == {"ok": True, "value": "hi x"}


def test_the_frame_cap_is_the_hosts_to_set(bridge, monkeypatch):
    monkeypatch.setenv("RLM_BRIDGE_MAX_FRAME_MB", "0.01")
    srv = bridge()
    assert srv.limits.max_frame == int(0.01 * 2**20)
    reg = srv.register(os.getpid(), "me")
    with _conn(srv.path) as s:
        assert _ask(s, reg.token, "y" * 5000)["ok"] is True
        reply = _ask(s, reg.token, "y" * 20000)
    assert "frame cap of 0.01 MiB" in reply["error"]["message"]
    monkeypatch.setenv("RLM_BRIDGE_MAX_FRAME_MB", "lots")
    with pytest.raises(ValueError, match="RLM_BRIDGE_MAX_FRAME_MB='lots'"):
        BridgeLimits.from_env()


def test_connections_past_a_kernels_share_are_refused_and_its_share_comes_back(bridge):
    srv = bridge(per_kernel=4)
    reg = srv.register(os.getpid(), "me")
    held = [_conn(srv.path) for _ in range(4)]
    try:
        for s in held:
            assert _ask(s, reg.token)["ok"] is True
        with _conn(srv.path) as extra:
            reply = _ask(extra, reg.token)
        assert reply["closed"] is True
        assert "cap per kernel (4)" in reply["error"]["message"]
        held.pop().close()
        deadline = time.monotonic() + 5
        while TALLY.conns > 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        with _conn(srv.path) as again:
            assert _ask(again, reg.token)["ok"] is True
    finally:
        for s in held:
            s.close()


def test_bytes_held_past_a_kernels_share_are_refused_before_they_are_read(bridge):
    srv = bridge(max_frame=2**20, held_per_kernel=3 * 2**19)
    reg = srv.register(os.getpid(), "me")
    with _conn(srv.path) as slow, _conn(srv.path) as other:
        slow.sendall(struct.pack(">I", 2**20) + b"{")  # 1 MiB announced, 1 byte sent: held
        time.sleep(0.2)
        other.sendall(struct.pack(">I", 2**20))
        reply = recv_message(other)
        assert "cap per kernel (1.5 MiB)" in reply["error"]["message"], reply
        slow.close()
        with _conn(srv.path) as third:  # the held bytes came back with the connection
            assert _ask(third, reg.token)["ok"] is True


def test_a_process_that_is_no_kernel_is_refused_with_nothing_read(bridge):
    srv = bridge()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        reg = srv.register(other.pid, "them")  # a kernel that is not this process
        with _conn(srv.path) as s:
            reply = _ask(s, reg.token)
        assert reply["closed"] is True
        assert "bridge refused the connection: this process is not the kernel" \
            in reply["error"]["message"]
    finally:
        other.kill()
        other.wait()


def test_deep_malformed_and_unsendable_frames_are_errors_to_the_kernel(bridge, capfd):
    def handler(reg, op, args):
        return object() if args.get("prompt") == "unsendable" else "fine"
    srv = BridgeServer(handler)
    try:
        reg = srv.register(os.getpid(), "me")
        with _conn(srv.path) as s:
            deep = b"[" * 200_000 + b"]" * 200_000
            s.sendall(struct.pack(">I", len(deep)) + deep)
            assert "nests too deeply" in recv_message(s)["error"]["message"]
            nested: dict = {"prompt": "x"}
            for _ in range(150):
                nested = {"a": nested}
            send_message(s, protocol.request(reg.token, Op.LLM_QUERY, nested))
            assert "nests more than 100 levels" in recv_message(s)["error"]["message"]
            for junk in (b"[1, 2]", b"42", b'"x"', b"\xff\xfe", b"{"):
                s.sendall(struct.pack(">I", len(junk)) + junk)
                reply = recv_message(s)
                assert reply["ok"] is False and "closed" not in reply, (junk, reply)
            assert _ask(s, reg.token, "unsendable")["error"]["message"].startswith("TypeError")
            assert _ask(s, reg.token) == {"ok": True, "value": "fine"}  # still in sync
    finally:
        srv.close()
    assert "Traceback" not in capfd.readouterr().err


#: Run in a subprocess: a bridge whose host runs out of descriptors. A blocked ``accept`` holds
#: the descriptor it will return (Linux reserves it when called), so the bridge is made while
#: 200 descriptors are open: that reserved one is above the limit set later, and with every
#: one below it taken, ``accept`` itself fails (EMFILE) once it is called again.
_STARVED = textwrap.dedent(r'''
    import gc, glob, os, resource, sys, time
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    low = [os.open("/dev/null", os.O_RDONLY) for _ in range(200)]
    from kernels.bridge import BridgeServer
    srv = BridgeServer(lambda reg, op, args: "served")
    reg = srv.register(os.getppid(), "parent")
    def in_accept():  # the bridge's thread waits in accept (its descriptor reserved)
        for p in glob.glob("/proc/self/task/*/syscall"):
            try:
                n = open(p).read().split()[0]
            except (OSError, IndexError):
                continue
            if n in ("43", "288", "202", "242"):  # accept, accept4: x86-64, arm64
                return True
        return False
    while not in_accept():
        time.sleep(0.01)
    gc.collect()
    high = []
    try:
        while True:
            high.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    print(srv.path, reg.token, flush=True)  # none free: the peer check cannot read /proc
    sys.stdin.readline()
    resource.setrlimit(resource.RLIMIT_NOFILE, (150, 256))  # accept's own is above 150 now
    print("starved", flush=True)
    sys.stdin.readline()
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    for fd in low + high:
        os.close(fd)
    print("freed", flush=True)
    sys.stdin.readline()
''')


def _say(child) -> str:
    child.stdin.write("\n")
    child.stdin.flush()
    return child.stdout.readline().strip()


def test_out_of_descriptors_the_peer_check_says_so_and_accept_goes_on():
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    child = subprocess.Popen([sys.executable, "-c", _STARVED], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        path, token = child.stdout.readline().split()
        with _conn(path) as s:
            reply = _ask(s, token)
        assert "could not check the caller" in reply["error"]["message"], reply
        assert "Too many open files" in reply["error"]["message"]
        assert "not the kernel" not in reply["error"]["message"]
        assert _say(child) == "starved"
        # b: refused as above if accept was already waiting with its descriptor reserved
        # (then accept is called again with none free), else queued behind the failing accept
        b, c = _conn(path), _conn(path)
        try:
            try:  # refused at once, the host may have closed it already
                send_message(b, protocol.request(token, Op.LLM_QUERY, {"prompt": "x"}))
            except (BrokenPipeError, ConnectionResetError):
                pass
            b.settimeout(2)
            try:
                first = recv_message(b)
            except TimeoutError:
                first = None
            if first is not None:
                assert "could not check the caller" in first["error"]["message"], first
            send_message(c, protocol.request(token, Op.LLM_QUERY, {"prompt": "x"}))
            time.sleep(0.5)  # c is queued by the kernel while accept keeps failing
            assert _say(child) == "freed"
            # served: had accept taken them while starved, the peer check would have failed
            b.settimeout(10)
            if first is None:
                assert recv_message(b) == {"ok": True, "value": "served"}
            assert recv_message(c) == {"ok": True, "value": "served"}
        finally:
            b.close()
            c.close()
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(10) == 0
        assert "Traceback" not in child.stderr.read()
    finally:
        child.kill()
        child.wait()


def test_peer_chain_and_nesting():
    chain = peer_chain(os.getpid())
    assert chain[0] == os.getpid() and chain[1] == os.getppid()
    assert peer_chain(2**22 + 12345) == [2**22 + 12345]  # gone: itself, no ancestors
    assert not nesting_over({"a": [1, {"b": []}]}, 4)  # four levels
    assert nesting_over({"a": [1, {"b": []}]}, 3)
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert nesting_over(deep, 100)


# --------------------------------------------------------------------------- from a real cell

needs_sandbox = pytest.mark.skipif(sandbox_problem() is not None,
                                   reason=f"no sandbox here: {sandbox_problem()}")
#: What the host may grow by while a cell announces 4 GiB, sends 512 MiB of it and asks for a
#: 70 MiB call, bytes: a run's own bookkeeping, never the frames.
BIG_BOUND = 128 * 2**20


def _sub(req: dict) -> str:
    return "sub:" + last_user(req)[:40]


def _attacker(tag: str, code: str, got: dict):
    """A responder whose root runs ``code`` in its first cell, then FINALs what it printed."""
    def respond(req):
        if not is_root(req):
            return _sub(req)
        printed = seen(req, tag)
        if printed is None:
            return repl(code)
        got.update(printed)
        return repl("FINAL('survived')")
    return respond


@needs_sandbox
def test_a_cell_announcing_gigabytes_is_refused_and_the_host_stays_small(scripted):
    got: dict = {}
    srv = scripted(_attacker("BIG", BIG, got))
    with PeakRSS() as peak:
        res = rlm.completion("ctx", "q", base_url=srv.base_url, api_key=API_KEY, model=MODEL,
                             journal=False, sandbox=strict_sandbox(), cell_timeout=120)
    assert res.status == "completed" and res.answer == "survived", res.reason
    raw = got["raw"]
    assert raw["ok"] is False and raw["closed"] is True
    assert "the request is 4 GiB, over the bridge's frame cap of 64 MiB" in raw["error"]["message"]
    assert got["capped"].startswith("SubcallError: bridge refused the request: the request is 70 MiB")
    assert "frame cap of 64 MiB" in got["capped"]
    assert got["after"] == "sub:after big"
    assert peak.grew < BIG_BOUND, f"the host grew by {peak.grew / 2**20:.0f} MiB"


@needs_sandbox
def test_a_connection_flood_is_refused_past_the_kernels_share_and_another_run_goes_on(scripted):
    """Run A's cell holds 2,000 connections; run B, beside it in the same host process (the
    same caps over all bridges), makes ten calls while the flood is held."""
    flooded, b_done = threading.Event(), threading.Event()
    got: dict = {}
    quiet: dict = {}

    def respond(req):
        if not is_root(req):
            p = last_user(req)
            if p == "flooded":  # A's flood is in place: hold it until B is done
                flooded.set()
                b_done.wait(120)
                return "held"
            if p.startswith("b-"):
                flooded.wait(120)
                if p == "b-9":
                    b_done.set()
                return "B:" + p
            return _sub(req)
        if "quiet-run" in json.dumps(req["messages"]):
            printed = seen(req, "QUIET")
            if printed is None:
                return repl("import json", "out = [llm_query(f'b-{i}') for i in range(10)]",
                            "print('QUIET ' + json.dumps({'out': out}))")
            quiet.update(printed)
            return repl("FINAL('quiet done')")
        return _attacker("FLOOD", FLOOD, got)(req)

    srv = scripted(respond)
    opts = dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL, journal=False,
                sandbox=strict_sandbox(), cell_timeout=180)
    other: dict = {}
    t = threading.Thread(target=lambda: other.update(res=rlm.completion("ctx", "quiet-run", **opts)))
    t.start()
    res = rlm.completion("ctx", "flood-run", **opts)
    t.join(240)
    b_done.set()
    assert res.status == "completed" and res.answer == "survived", res.reason
    assert other["res"].status == "completed" and other["res"].answer == "quiet done"
    assert quiet["out"] == [f"B:b-{i}" for i in range(10)]
    assert got["opened"] >= 500, got  # as many as the cell could open (its descriptors)
    assert got["refused"] == got["opened"] - 63, got  # 64 per kernel: its own, and 63 more
    assert got["held_open"] == 63, got
    assert "cap per kernel (64)" in got["message"], got
    assert got["during"].startswith("SubcallError: bridge refused the connection"), got
    assert got["held"] == "held" and got["after"] == "sub:from a thread", got


@needs_sandbox
def test_a_deep_frame_is_an_error_to_the_cell_and_no_traceback_under_q(scripted, cli, tmp_path):
    got: dict = {}
    srv = scripted(_attacker("DEEP", DEEP, got))
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("some context")
    res = cli("run", "--context", str(ctx), "--query", "q", *endpoint_args(srv), "-q",
              "--sandbox", strict_sandbox(), "--no-journal", timeout=180)
    assert res.rc == 0, res.stderr
    assert res.stdout.strip() == "survived"
    # a host without control-group delegation says once which limits stand in (documented)
    said = [ln for ln in res.stderr.splitlines()
            if ln.strip() and not ln.startswith("kernel limits hold per process")]
    assert "Traceback" not in res.stderr and not said, res.stderr
    assert "nests too deeply" in got["deep"]["error"]["message"]
    assert "must be a JSON object" in got["list"]["error"]["message"]
    assert got["after"] == "sub:after deep"
