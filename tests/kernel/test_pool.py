"""The kernel pool: waiting for a kernel already starting, starts bounded by the machine's cores,
and every kernel started counted (issue 10, item 3).

Real kernels, real processes; the run-level test drives the real ``openai`` client against the
scripted HTTP server.
"""
from __future__ import annotations

import os
import threading
import time

import psutil
import pytest

import kernels.kernel as kk
import rlm
from conftest import REPO, repl, script
from kernels.kernel import StartGate
from kernels.pool import KernelPool, Pending


@pytest.fixture
def gate(monkeypatch):
    """A fresh process-wide start gate (so its ``peak`` is this test's), limit: cores."""
    g = StartGate()
    monkeypatch.setattr(kk, "START_GATE", g)
    return g


def _wait_filled(pool: KernelPool, n: int, timeout: float) -> None:
    """Wait until ``pool`` holds ``n`` ready kernels (asserting it does within ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while len(pool._ready) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pool._ready) == n, "the pool did not fill"


def _kernel_processes() -> list[psutil.Process]:
    """Live (not zombie) ipykernel processes below this test process."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "ipykernel" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def test_gate_limit_defaults_to_the_cores():
    assert StartGate().limit == max(1, os.cpu_count() or 1)
    assert StartGate(0).limit == 1


def test_acquire_waits_for_the_kernel_already_starting(gate):
    pool = KernelPool(1)
    try:
        [first] = list(pool._live)  # the one kernel the pool is starting
        t0 = time.monotonic()
        k = pool.acquire()
        # it got the kernel that was starting, not a cold one started next to it
        assert k is first
        assert k.is_alive()
        assert gate.peak == 1, "a second kernel started while the pool's was starting"
        # the pool refills in the background: that start is counted at once
        assert pool.started == 2
        out, _ = k.execute("print(6 * 7)", timeout=30)
        assert out.output.strip() == "42"
        assert time.monotonic() - t0 < 60
    finally:
        pool.close()
    assert _kernel_processes() == []  # none left once close() returned


def test_acquire_takes_an_adopted_head_start(gate):
    head = Pending()
    pool = KernelPool(0, head=head)
    try:
        k = pool.acquire()
        assert k is head.kernel and k.is_alive()
        assert pool.started == 1  # the adopted kernel; no cold start, no refill (size 0)
        # with nothing starting any more, the next acquire is a cold start
        k2 = pool.acquire()
        assert k2 is not k and k2.is_alive()
        assert pool.started == 2
    finally:
        pool.close()
    assert _kernel_processes() == []  # none left once close() returned


def test_concurrent_acquires_share_out_the_starting_kernels(gate):
    pool = KernelPool(2)
    got: list = []
    errors: list = []

    def take():
        try:
            got.append(pool.acquire())
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=take) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors
        assert len({id(k) for k in got}) == 3 and all(k.is_alive() for k in got)
        assert gate.peak <= gate.limit
    finally:
        pool.close()
    assert _kernel_processes() == []  # none left once close() returned


def test_no_more_kernels_start_at_once_than_the_gate_allows(monkeypatch):
    g = StartGate(1)
    monkeypatch.setattr(kk, "START_GATE", g)
    pool = KernelPool(3)
    try:
        _wait_filled(pool, 3, 120)
        assert g.peak == 1  # three starts, one after another
        assert pool.started == 3
    finally:
        pool.close()
    assert _kernel_processes() == []  # none left once close() returned


def test_starts_at_run_start_are_bounded_by_the_cores(gate):
    # four idle kernels wanted at once: never more starting together than the machine has cores
    pool = KernelPool(4)
    try:
        _wait_filled(pool, 4, 180)
        assert 1 <= gate.peak <= max(1, os.cpu_count() or 1)
    finally:
        pool.close()
    assert _kernel_processes() == []  # none left once close() returned


def test_shutdown_of_a_starting_kernel_does_not_wait_for_it(gate):
    head = Pending()
    deadline = time.monotonic() + 30
    while head.kernel._launched is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert not head.done.is_set(), "the kernel answered before the test could stop it"
    t0 = time.monotonic()
    head.kernel.shutdown()
    took = time.monotonic() - t0
    assert _kernel_processes() == []  # gone when shutdown() returns
    assert took < 0.5  # it was killed, not waited for until it answered
    assert head.done.wait(30)
    assert isinstance(head.error, RuntimeError) and "shut down while starting" in str(head.error)


def test_kernels_started_counts_the_pool_kernels_shut_down_unused(api):
    # a one-turn run with a pool of 2: the root's kernel, plus the two the pool keeps ready
    # (one started with the root's, one refilled when the root took its), never used
    res, _ = api(script([repl("FINAL('done')")]), max_depth=2, pool_size=2)
    assert res.status == "completed" and res.answer == "done"
    assert res.kernels_started == 3
    assert _kernel_processes() == []  # and every one of them is gone once the run returned


def test_kernels_started_without_a_pool_counts_only_the_root(api):
    res, _ = api(script([repl("FINAL('done')")]))
    assert res.status == "completed"
    assert res.kernels_started == 1
    assert _kernel_processes() == []


def test_shutdown_at_any_point_of_a_start_leaves_the_process_whole(gate):
    """Stopping kernels at every point of their start (before launch, while it waits for the
    kernel's first answer, just after): each start ends (started, or refused as shut down) and
    no kernel process outlives its shutdown. A shutdown from another thread only kills the
    processes; the starting thread, which is using the manager's ZeroMQ context, tears the
    manager down itself."""
    for delay in (0.0, 0.05, 0.15, 0.3, 0.45, 0.6, 0.8, 1.2):
        head = Pending()
        time.sleep(delay)
        head.kernel.shutdown()
        assert head.done.wait(60), f"start never ended after a shutdown at {delay} s"
        assert head.error is None or "shut down while starting" in str(head.error), head.error
        deadline = time.monotonic() + 10
        while _kernel_processes() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _kernel_processes() == [], f"a kernel outlived its shutdown at {delay} s"


def test_ctrl_c_while_a_head_start_launches_is_the_callers(gate, monkeypatch):
    # Ctrl-C landing in the launch (its imports) must interrupt the caller, not be taken for a
    # failed start the run would then shrug off (it ran on and exited 0)
    def interrupted(self):
        raise KeyboardInterrupt
    monkeypatch.setattr(kk.Kernel, "_launch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Pending(launch_here=True)
    assert gate.active == 0  # its start place was given back


def _kernel_dirs() -> set[str]:
    import glob
    import tempfile
    # this process's only: other hosts on the machine make and remove theirs meanwhile
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"rlm-k-{os.getpid()}-*")))


def test_a_kernel_shut_down_before_it_started_leaves_no_directory(monkeypatch):
    before = _kernel_dirs()
    k = kk.Kernel()
    assert k.workdir == ""  # made only when it launches
    k.shutdown()
    # kernels waiting for a start place when their pool closes (a run interrupted, or its
    # host killed, while its pool starts) make none either
    monkeypatch.setattr(kk, "START_GATE", StartGate(1))
    kk.START_GATE.enter()  # every place taken: the pool's starts wait
    try:
        pool = KernelPool(3)
        time.sleep(0.3)
        pool.close()
    finally:
        kk.START_GATE.leave()
    assert _kernel_dirs() - before == set()


def test_close_waits_for_the_released_kernels_to_be_reaped(gate):
    pool = KernelPool(0)
    kernels = [pool.acquire() for _ in range(2)]
    for k in kernels:  # a cell's own process too: it must not outlive close()
        res, _ = k.execute("import subprocess; p = subprocess.Popen(['sleep', '60'])")
        assert res.error is None
    pids = [k.pid for k in kernels]
    dirs = [k.workdir for k in kernels]
    assert all(pids)
    for k in kernels:
        pool.release(k)
        assert not k.is_alive()  # released: no cell can run on it any more
    pool.close()
    assert _kernel_processes() == []
    for pid in pids:  # the supervisors are reaped, not left as zombies
        assert not psutil.pid_exists(pid)
    assert not any(os.path.exists(d) for d in dirs)
    assert not [p for p in psutil.process_iter(["cmdline"])
                if (p.info["cmdline"] or [])[:2] == ["sleep", "60"]]


def test_head_start_of_three_is_adopted_whole_by_the_pool(gate):
    from kernels.pool import head_start, take_head_start
    first = head_start(3)
    assert head_start(3) is first  # already pending: nothing more starts
    heads = take_head_start()
    assert len(heads) == 3 and heads[0] is first and take_head_start() == []
    pool = KernelPool(2, head=heads)
    try:
        k = pool.acquire()  # the first ready of the three: no cold start, no refill
        assert k in [h.kernel for h in heads] and k.is_alive()
        _wait_filled(pool, 2, timeout=60)
        assert pool.started == 3
    finally:
        pool.close()
    assert _kernel_processes() == []


@pytest.mark.parametrize("options, ahead", [
    ({}, 1), ({"max_depth": 1}, 1), ({"max_depth": 2}, 3), ({"max_depth": 3, "pool_size": 0}, 1),
    ({"max_depth": 2, "pool_size": 5}, 6), ({"max_depth": "2"}, 1), ({"max_depth": True}, 1),
    # kernels on a gateway start there: none ahead here, or only the local root's
    ({"max_depth": 2, "kernels": "gateway"}, 0),
    ({"max_depth": 2, "kernels": "root=local,children=gateway"}, 1),
    ({"max_depth": 2, "kernels": "root=gateway,children=local"}, 0)])
def test_kernels_started_ahead_follow_depth_and_pool_size(options, ahead):
    from rlm.config.ahead import kernels_ahead
    assert kernels_ahead(options) == ahead


def test_rlm_run_reads_depth_and_pool_size_before_parsing():
    from rlm.cli.main import _depth_flags
    assert _depth_flags(["run", "--max-depth", "2", "--pool-size=1", "--query", "q"]) == \
        {"max_depth": 2, "pool_size": 1}
    assert _depth_flags(["run", "--max-depth", "x", "--pool-size"]) == {}
    assert _depth_flags(["run", "--kernels", "gateway", "--max-depth=2"]) == \
        {"kernels": "gateway", "max_depth": 2}


def test_close_while_a_cell_runs_ends_it_as_a_dead_kernel_not_a_socket_error(gate):
    """close() (a run interrupted while its loops still run cells) must not close the ZeroMQ
    sockets a loop's thread is reading: it ends the kernels' processes, and the thread sees a
    dead kernel and closes the sockets itself on its way out of the cell."""
    from kernels.kernel import KernelDied
    pool = KernelPool(0)
    k = pool.acquire()
    got: list = []

    def run() -> None:
        got.append(_outcome(k))
        pool.release(k)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.0)  # the cell is running
    pool.close()
    t.join(timeout=30)
    assert not t.is_alive()
    assert len(got) == 1 and isinstance(got[0], KernelDied), got
    assert _kernel_processes() == []


def test_shutdown_from_another_thread_during_a_cell(gate):
    from kernels.kernel import Kernel, KernelDied
    k = Kernel().start()
    pid, workdir = k.pid, k.workdir
    got: list = []
    t = threading.Thread(target=lambda: got.append(_outcome(k)))
    t.start()
    time.sleep(1.0)
    k.shutdown()  # another thread: the processes end now, the sockets are the cell's to close
    assert _gone(pid)
    t.join(timeout=30)
    assert len(got) == 1 and isinstance(got[0], KernelDied), got
    assert k.kc is None and not k.is_alive()
    assert not os.path.exists(workdir) and _kernel_processes() == []
    k.shutdown()  # idempotent


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie not yet reaped); it may be reaped
    between two looks, which is gone too."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _outcome(k):
    try:
        return k.execute("import time; time.sleep(60)", timeout=120)
    except BaseException as exc:  # noqa: BLE001 - what the cell's thread sees
        return exc


LAUNCH_FIRST = """
import sys
import kernels.kernel as kk
from kernels.kernel import Kernel
from kernels.pool import Pending
seen = []  # whether jupyter_client was imported at the moment the process was started
_launch = kk.launch
def recording(*a, **kw):
    seen.append("jupyter_client" in sys.modules)
    return _launch(*a, **kw)
kk.launch = recording
p = Pending(Kernel(), launch_here=True)  # launched on this thread, as head_start does
launched = p.kernel._launched
print("IMPORTED_BEFORE_LAUNCH", seen == [False], launched is not None, flush=True)
p.done.wait(60)
assert p.error is None, p.error
k = p.kernel
r, _ = k.execute("print(6 * 7)")
t, _ = k.execute("import time; time.sleep(30)", timeout=1.0)  # interrupted: SIGINT to its group
u, _ = k.execute("print('still')")
print("OUT", r.output.strip(), t.timed_out, u.output.strip(), flush=True)
k.shutdown()
import os
print("GONE", not os.path.exists(launched.connection_file), not os.path.exists(k.workdir),
      flush=True)
"""


def test_a_kernel_is_launched_before_jupyter_client_is_imported(tmp_path):
    # the process starts first (kernels/launch.py); jupyter_client comes with the client only
    import subprocess
    import sys
    root = str(REPO)
    p = subprocess.run([sys.executable, "-c", LAUNCH_FIRST], capture_output=True, text=True,
                       timeout=120, cwd=root)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "IMPORTED_BEFORE_LAUNCH True True" in p.stdout, p.stdout
    assert "OUT 42 True still" in p.stdout, p.stdout
    assert "GONE True True" in p.stdout, p.stdout


def test_a_kernel_starts_without_the_debugger_and_imports_from_its_directory():
    # kernels/ipykernel_main.py: ipykernel's launcher with debugpy left out of its start (a
    # cold start 70-100 ms shorter); the cells' own imports still find modules in the kernel's
    # directory, and debugpy itself
    k = kk.Kernel().start()
    try:
        res, _ = k.execute(
            "import sys\n"
            "print('DEBUGPY', 'debugpy' in sys.modules)\n"
            "open('mod_in_workdir.py', 'w').write('V = 41')\n"
            "import mod_in_workdir\n"
            "print('V', mod_in_workdir.V + 1)\n", timeout=60)
        assert res.error is None, res.output
        assert "DEBUGPY False" in res.output, res.output  # not imported, and not blocked
        assert "V 42" in res.output, res.output
        # ipykernel started without its debugger; a cell can still import debugpy, twice
        for _ in range(2):
            res, _ = k.execute("import debugpy; print('HAS', hasattr(debugpy, 'listen'))",
                               timeout=60)
            assert res.error is None and "HAS True" in res.output, res.output
        res, _ = k.execute("print('DBG', get_ipython().kernel.debugger)", timeout=60)
        assert "AttributeError" in (res.error or "") or "DBG None" in res.output, res.output
    finally:
        k.shutdown()


def test_a_kernels_client_retries_its_connects_soon():
    # the client connects while the kernel is still importing; ZeroMQ's default retry after a
    # refused connect is 100 ms, which every start waited out after the kernel was ready
    import zmq

    from kernels.launch import RECONNECT_INTERVAL_MS
    k = kk.Kernel().start()
    try:
        assert RECONNECT_INTERVAL_MS <= 20
        channels = (k.kc.shell_channel, k.kc.iopub_channel, k.kc.stdin_channel,
                    k.kc.control_channel)
        for ch in channels:
            assert ch.socket.getsockopt(zmq.RECONNECT_IVL) == RECONNECT_INTERVAL_MS, ch
        res, _ = k.execute("print(6 * 7)", timeout=60)
        assert "42" in res.output, res.output
    finally:
        k.shutdown()
