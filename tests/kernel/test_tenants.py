"""No run reaches another through what the Linux kernel keeps per user: a fork bomb in one run
while another run's kernel starts, a keyring value left for the next run, the calls the sandbox
refuses (io_uring, new user namespaces), and a root host's kernels each under a user of its
own. Each tried from a real cell of a real sandboxed kernel through the public API."""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest

import rlm
from conftest import API_KEY, MODEL, repl, strict_sandbox
from kernel_attacks import BOMB, KEYS, cell, printed
from kernels import identity
from kernels.bwrap import sandbox_problem
from scripted_server import ScriptedServer

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only"),
              pytest.mark.skipif(sandbox_problem() is not None,
                                 reason=f"no sandbox here: {sandbox_problem()}")]


def _run(cells: list[str], seen: list[str] | None = None, on_first=None, **options):
    """One sandboxed run whose model sends ``cells`` in turn; ``seen`` collects the user
    messages (what each cell printed); ``on_first`` is called when the first cell is sent."""
    seen = [] if seen is None else seen

    def respond(req):
        users = [m["content"] for m in req["messages"] if m["role"] == "user"]
        seen.append(users[-1])
        if len(users) == 1 and on_first is not None:
            on_first()
        return cells[min(len(users) - 1, len(cells) - 1)]

    with ScriptedServer(respond) as srv:
        o = dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL, journal=False,
                 sandbox=strict_sandbox(), cell_timeout=120, kernel_processes=64)
        o.update(options)
        return rlm.completion("ctx", "q", **o)


def test_a_fork_bomb_in_one_run_does_not_stop_another_runs_kernel():
    bombing = threading.Event()
    seen_a: list[str] = []
    out: dict = {}

    def run_a():
        bomb = cell(BOMB, "import time; time.sleep(10)")  # its children live till then
        out["a"] = _run([repl(bomb), repl("FINAL('a done')")], seen_a, on_first=bombing.set)
    t = threading.Thread(target=run_a)
    t.start()
    try:
        assert bombing.wait(60)
        time.sleep(3)  # its processes are all there now
        t0 = time.monotonic()
        b = _run([repl("import os\nprint('B', os.getpid())"), repl("FINAL('b done')")])
        took = time.monotonic() - t0
    finally:
        t.join(120)
    assert b.status == "completed" and b.answer == "b done", b.reason
    assert out["a"].answer == "a done", out["a"].reason
    forks, err = printed(seen_a, "BOMB")
    assert err == "Resource temporarily unavailable" and forks < 64, (forks, err)
    assert took < 60


def test_a_keyring_value_does_not_pass_from_one_run_to_the_next():
    seen1, seen2 = [], []
    _run([repl(cell(KEYS)), repl("FINAL('x')")], seen1)
    _run([repl(cell(KEYS)), repl("FINAL('x')")], seen2)
    refused = os.strerror(1)  # EPERM: the sandbox refuses the keyring calls
    assert printed(seen1, "KEYS") == {"add": [refused] * 2, "search": [refused] * 2}
    assert printed(seen2, "KEYS")["search"] == [refused] * 2


#: io_uring, and a new user namespace by each way there is.
CALLS = r'''
import ctypes, json, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": {"io_uring_setup": 425, "unshare": 272},
      "aarch64": {"io_uring_setup": 425, "unshare": 97}}[os.uname().machine]
def call(n, *a):
    return "allowed" if libc.syscall(n, *a) >= 0 else os.strerror(ctypes.get_errno())
got = {"io_uring": call(nr["io_uring_setup"], 4, ctypes.create_string_buffer(120)),
       "unshare_user": call(nr["unshare"], 0x10000000),
       "unshare_cmd": subprocess.run(["unshare", "--user", "true"]).returncode,
       "threads_and_processes": subprocess.run(["true"]).returncode}
print("CALLS " + json.dumps(got))
'''


def test_io_uring_and_new_user_namespaces_are_refused():
    seen: list[str] = []
    res = _run([repl(CALLS), repl("FINAL('went on')")], seen)
    assert res.answer == "went on", res.reason
    got = printed(seen, "CALLS")
    assert got["io_uring"] == got["unshare_user"] == os.strerror(1), got
    assert got["unshare_cmd"] != 0 and got["threads_and_processes"] == 0, got


WHO = "import os, json\nprint('WHO ' + json.dumps([os.getuid(), os.getgid()]))"


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root host switches kernels to other "
                    "users; a non-root host's kernels run as itself, each in a user namespace "
                    "of its own (bubblewrap), which keeps the process counts apart")
def test_on_a_root_host_each_kernel_runs_as_a_user_of_its_own(monkeypatch):
    monkeypatch.delenv("RLM_KERNEL_USER", raising=False)
    seen1, seen2 = [], []
    _run([repl(WHO), repl("FINAL('x')")], seen1)
    _run([repl(WHO), repl("FINAL('x')")], seen2)
    (u1, g1), (u2, g2) = printed(seen1, "WHO"), printed(seen2, "WHO")
    assert identity.managed(u1) and identity.managed(u2) and u1 != u2
    assert identity.managed(g1) and g1 == g2  # one host: one group (the bridge opens to it)


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid range is a root host's")
def test_a_number_is_held_by_one_holder_and_a_dead_holders_file_is_swept():
    a = identity.lease()
    path = a._path
    assert identity.managed(a.number) and os.path.exists(path)
    identity.sweep()  # a live holder's number stays
    assert os.path.exists(path)
    b = identity.lease()
    assert b.number != a.number
    os.close(a._fd)  # the holder dies without its clean-up: the file is left, unlocked
    a._fd = -1
    assert os.path.exists(path)
    assert identity.sweep() >= 1 and not os.path.exists(path)
    b.close()
    assert not os.path.exists(b._path)
