"""No orphan kernels: the host killed with SIGKILL (or SIGINT) while children run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from conftest import REPO, TESTS

#: the start of a host script: a scripted endpoint whose sub-calls answer "leaf"
_HOST_START = """
    import sys, time
    sys.path.insert(0, {tests!r})
    from scripted_server import ScriptedServer
    import rlm

    def responder(req):
        msgs = req["messages"]
        if msgs[0]["role"] != "system":
            return "leaf"
"""

HOST = textwrap.dedent(_HOST_START + """\
        turn = sum(1 for m in msgs if m["role"] == "assistant")
        if "of 7 characters" in msgs[0]["content"]:   # children: sleep in their cells
            return "```repl\\nimport time\\nprint('child running', flush=True)\\ntime.sleep(120)\\n```"
        if turn == 0:
            return "```repl\\nouts = rlm_batched(['child-%d' % i for i in range(3)])\\n```"
        return "```repl\\nFINAL('x')\\n```"

    with ScriptedServer(responder) as srv:
        print("READY", flush=True)
        rlm.completion("root context", "q", base_url=srv.base_url, api_key="k", model="m",
                       max_depth=2, pool_size=2, journal=False, cell_timeout=300)
""")


def _kernels_of(host_pid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if "ipykernel" not in cmd:
                continue
            if p.environ().get("JPY_PARENT_PID") == str(host_pid):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def _wait_for_kernels(host_pid: int, n: int, timeout: float = 60) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ks = _kernels_of(host_pid)
        if len(ks) >= n:
            return ks
        time.sleep(0.2)
    raise AssertionError(f"expected {n} kernels of {host_pid}, saw {len(_kernels_of(host_pid))}")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_no_kernel_outlives_its_host(tmp_path, sig):
    script = tmp_path / "host.py"
    script.write_text(HOST.format(tests=str(TESTS)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        # root + 3 children busy in their cells (pool kernels may be there too)
        kernels = _wait_for_kernels(proc.pid, 4)
        time.sleep(1.0)  # let the children reach their sleeping cells
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 8
        alive = kernels
        while time.monotonic() < deadline:
            alive = [k for k in kernels if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]
            if not alive and not _kernels_of(proc.pid):
                break
            time.sleep(0.2)
        assert not alive, f"kernels still alive after the host died: {[k.pid for k in alive]}"
        assert not _kernels_of(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()


LAUNCH_AND_DIE = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    from kernels.kernel import Kernel
    tags = []
    for _ in range(3):
        k = Kernel()
        k._launch()  # the processes are started; nobody waits for them to answer
        tags.append(k.tag)
    print(" ".join(tags), flush=True)
    os._exit(0)  # the host is gone before its supervisors have even started Python
""")


def _tagged(tags: set[str]) -> list[psutil.Process]:
    from kernels.sandbox import TAG_VAR
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get(TAG_VAR) in tags and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def test_a_host_gone_before_its_supervisor_started_leaves_no_kernel(tmp_path):
    """The supervisor learns its host's pid from the host, not from getppid() at its own start:
    a host killed right after launching (a crash mid start-up) had already left the supervisor
    with init as its parent, and its kernel ran on for good."""
    root = str(REPO)
    script = tmp_path / "host.py"
    script.write_text(LAUNCH_AND_DIE.format(root=root))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)
    tags = set(out.stdout.split())
    assert len(tags) == 3, out.stderr
    deadline = time.monotonic() + 10
    alive = _tagged(tags)
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = _tagged(tags)
    try:
        assert not alive, f"processes of a dead host's kernels still running: {alive}"
    finally:
        for p in alive:
            p.kill()


def test_a_kernel_stopped_by_its_host_leaves_no_directory_even_if_the_host_stops_there():
    """The supervisor removes the kernel's temporary directory when told to stop (SIGTERM, as
    a shutdown sends it): a host interrupted again in the middle of its shutdown, which then
    never removes it, left the directory with the context's copy in it."""
    from kernels.bwrap import SandboxSpec
    from kernels.kernel import Kernel
    from kernels.process import wait_exit
    # the supervisor's own clean-up; in a sandbox the directory is a mount point it cannot
    # remove, and the next host sweeps it (the test below)
    k = Kernel(sandbox=SandboxSpec(mode="none")).start()
    try:
        k.execute("open('context-copy.txt', 'w').write('x')")
        workdir, pid = k.workdir, k.pid
        assert os.path.isdir(workdir)
        os.kill(k.km.stop_pid(), signal.SIGTERM)  # what shutdown sends; the host removes nothing
        wait_exit(pid, 10.0)
        assert not os.path.exists(workdir)
    finally:
        k.shutdown()


INTERRUPTED_HOST = textwrap.dedent(_HOST_START + """\
        if "ROOTQ" not in str(msgs):  # the children: busy in their cells
            return "```repl\\nimport time\\nprint('child running', flush=True)\\ntime.sleep(60)\\n```"
        return "```repl\\nouts = rlm_batched(['child-%d' % i for i in range(2)])\\n```"

    with ScriptedServer(responder) as srv:
        print("READY", flush=True)
        try:
            rlm.completion("root context", "ROOTQ", base_url=srv.base_url, api_key="k",
                           model="m", max_depth=2, journal={journal!r}, run_id="intr")
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
""")


def test_ctrl_c_while_children_run_cancels_every_open_stage(tmp_path):
    """Ctrl-C while the root's cell waits for children busy in theirs: every stage still open
    ends cancelled, none failed (the children's kernels were torn down under their cells'
    threads, which then failed on a closed socket, and the cells were marked failed)."""
    from harness.journal import Journal
    journal = tmp_path / "j.sqlite3"
    script = tmp_path / "host.py"
    script.write_text(INTERRUPTED_HOST.format(tests=str(TESTS),
                                              journal=str(journal)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        _wait_for_kernels(proc.pid, 3)  # the root and two children
        time.sleep(2.0)  # the children are in their cells
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert "INTERRUPTED" in out, out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    j = Journal(journal)
    try:
        stages = j.stages("intr")
    finally:
        j.close()
    by_kind = {}
    for st in stages:
        by_kind.setdefault(st["kind"], []).append(st["status"])
    assert len(by_kind.get("child", [])) == 2 and len(by_kind.get("cell", [])) == 3, by_kind
    assert not [s for s in stages if s["status"] in ("failed", "running", "pending")], \
        [(s["id"], s["status"], s.get("error")) for s in stages]
    assert set(by_kind["cell"]) == {"cancelled"}


def test_a_killed_hosts_bridge_directory_is_swept_by_the_next_bridge(tmp_path, monkeypatch):
    # a host killed with SIGKILL cannot remove its bridge's socket directory; the next host to
    # open a bridge removes the ones whose process is gone, and no other
    import tempfile

    from kernels.bridge import BridgeServer
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = tmp_path / f"rlm-bridge-{int(gone.stdout)}-x1y2"
    dead.mkdir()
    (dead / "b.sock").write_text("")
    alive = tmp_path / f"rlm-bridge-{os.getppid()}-a1b2"
    alive.mkdir()
    other = tmp_path / "rlm-bridge-notapid-c3d4"
    other.mkdir()
    srv = BridgeServer(lambda reg, op, args: None)
    try:
        assert not dead.exists()
        assert alive.exists() and other.exists()
        mine = os.path.basename(os.path.dirname(srv.path))
        assert mine.startswith(f"rlm-bridge-{os.getpid()}-")
    finally:
        srv.close()
    assert not os.path.exists(os.path.dirname(srv.path))


SANDBOXED_AND_KILLED = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from kernels.bwrap import SandboxSpec
    from kernels.kernel import Kernel
    k = Kernel(sandbox=SandboxSpec(mode="required")).start()
    k.share_file({ctx!r})  # the context in its read-only directory
    print(k.workdir, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no shutdown: the host is gone
""")


@pytest.mark.skipif(__import__("kernels.bwrap").bwrap.sandbox_problem() is not None,
                    reason="no sandbox here")
def test_a_killed_hosts_sandboxed_kernel_directory_is_swept_by_the_next_host(tmp_path):
    """A sandboxed kernel's directory (with its context files) outlives a host killed before
    its shutdown; the next host removes it before its first kernel, and its processes end."""
    from kernels import process
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("context")
    script = tmp_path / "host.py"
    script.write_text(SANDBOXED_AND_KILLED.format(root=str(REPO), ctx=str(ctx)))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)
    workdir = out.stdout.strip()
    assert workdir and os.path.isdir(workdir), out.stderr
    deadline = time.monotonic() + 10  # its supervisor sees the lifeline close and ends it
    while _tagged_in(workdir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _tagged_in(workdir), "the dead host's sandboxed kernel is still running"
    process._swept.clear()  # as a new host process would start
    assert process.sweep_stale_kernel_dirs() >= 1
    assert not os.path.exists(workdir)


def _tagged_in(workdir: str) -> list:
    """Processes whose command line names ``workdir`` (its kernel, supervisor, bubblewrap)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(workdir in a for a in (p.info["cmdline"] or [])) \
                    and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out
