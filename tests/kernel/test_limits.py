"""A kernel takes no more than its share: memory over all its processes, disk in every place it
may write, processes, and what is left behind; each tried from a real cell of a real sandboxed
kernel through the public API, against the scripted endpoint.

On a root host (or one that may create control groups) the per-kernel control group holds;
elsewhere the tests that need it skip, saying why, and assert the documented stand-in instead
(the per-process limits): docs/security.md's table.
"""
from __future__ import annotations

import os
import sys

import pytest

import rlm
from conftest import API_KEY, MODEL, repl, strict_sandbox
from kernel_attacks import DISK, HOGS, LEAVE, ONE_HOG, cell, printed
from kernels import cgroups
from kernels.bwrap import sandbox_problem
from scripted_server import ScriptedServer

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only"),
              pytest.mark.skipif(sandbox_problem() is not None,
                                 reason=f"no sandbox here: {sandbox_problem()}")]

#: Whether this host gives each kernel a control group (else the rlimits stand in).
GROUPS = cgroups.unavailable() is None
needs_groups = pytest.mark.skipif(not GROUPS, reason=f"per-kernel control groups cannot be "
                                  f"made here ({cgroups.unavailable()}): see the stand-in test")
#: Small limits, so every probe stays cheap: a kernel starts in about 100 MiB.
LIMITS = dict(kernel_memory_mb=768, kernel_processes=64, kernel_disk_mb=64)


def _run(cells: list[str], **options):
    """One run whose model sends ``cells`` in turn (the last should FINAL); returns the result
    and every user message the model was sent (what each cell printed)."""
    seen: list[str] = []

    def respond(req):
        users = [m["content"] for m in req["messages"] if m["role"] == "user"]
        seen.append(users[-1])
        return cells[min(len(users) - 1, len(cells) - 1)]

    with ScriptedServer(respond) as srv:
        o = dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL, journal=False,
                 sandbox=strict_sandbox(), cell_timeout=120, **LIMITS)
        o.update(options)
        res = rlm.completion("ctx", "q", **o)
    return res, seen


@needs_groups
def test_memory_is_counted_over_all_of_a_kernels_processes():
    res, seen = _run([repl(cell(HOGS)), repl("FINAL('went on')")])
    assert res.status == "completed" and res.answer == "went on", res.reason
    codes = printed(seen, "HOGS")["codes"]
    # 3 x 400 MiB cannot be held under 768 MiB: the kernel's group killed the others
    assert codes.count(0) <= 1 and codes.count(-9) >= 2, codes
    killed = codes.count(-9)  # and the cell's output says why
    assert (f"[{killed} processes of this kernel killed: its processes together exceeded its "
            "memory limit (--kernel-memory 768 MiB)]") in seen[1], seen[1][-500:]


def test_without_groups_each_process_is_capped_instead():
    """The stand-in (and, where groups hold, the first line of defence): one process that asks
    for more than ``--kernel-memory`` gets ``MemoryError`` and the kernel goes on."""
    res, seen = _run([repl(cell(ONE_HOG)), repl("FINAL('went on')")])
    assert res.answer == "went on", res.reason
    assert res.kernel_limits == ("cgroup" if GROUPS else "rlimit")  # the result says which held
    assert printed(seen, "ONE") == "MemoryError"


#: A kernel that outgrows its memory: a child holds 720 MiB, the kernel adds to it. The kernel
#: offers itself to the out-of-memory killer (``oom_score_adj``; the child takes it back), else
#: the killer would pick the child, the larger process, and the kernel would live on.
OUTGROW = r'''
import subprocess, sys, time
open("/proc/self/oom_score_adj", "w").write("1000")
child = subprocess.Popen([sys.executable, "-c", "open('/proc/self/oom_score_adj', 'w').write('0')\n"
                          "b = bytearray(720 << 20); import time; time.sleep(60)"])
time.sleep(2)
chunks = []
for _ in range(5):
    chunks.append(bytearray(10 << 20))
    time.sleep(0.2)
print("survived")
'''


@needs_groups
def test_a_kernel_killed_at_its_memory_limit_is_reported_and_restarted():
    res, seen = _run([repl(OUTGROW), repl("FINAL('went on')")])
    assert res.status == "completed" and res.answer == "went on", res.reason
    after = seen[1]
    assert "the kernel exceeded its memory limit (--kernel-memory 768 MiB" in after, after[:2000]


#: 1.5 GiB written to a 2 GiB /dev/shm: tmpfs pages are the writer's memory.
SHM = r'''
with open("/dev/shm/fill", "wb") as f:
    for n in range(1500):
        f.write(b"z" * (1 << 20))
print("wrote it all")
'''


@needs_groups
def test_what_a_kernel_writes_to_its_tmpfs_counts_as_its_memory():
    res, seen = _run([repl(SHM), repl("FINAL('went on')")], kernel_disk_mb=2048)
    assert res.status == "completed" and res.answer == "went on", res.reason
    assert "wrote it all" not in seen[1]
    assert "the kernel exceeded its memory limit (--kernel-memory 768 MiB" in seen[1], seen[1][:2000]


def test_open_descriptors_are_capped_per_process():
    fds = repl("import json, os\nfds = []\ntry:\n    while len(fds) < 100000:\n"
                "        fds.append(os.open('/dev/null', os.O_RDONLY))\n    err = None\n"
                "except OSError as e:\n    err = e.strerror\n"
                "print('FDS ' + json.dumps([len(fds), err]))\n"
                "for fd in fds:\n    os.close(fd)")
    res, seen = _run([fds, repl("FINAL('went on')")])
    assert res.answer == "went on", res.reason
    n, err = printed(seen, "FDS")
    assert err == "Too many open files" and n < 4096, (n, err)


def test_disk_is_capped_in_every_place_a_cell_may_write():
    res, seen = _run([repl(cell(DISK)), repl("FINAL('went on')")])
    assert res.status == "completed" and res.answer == "went on", res.reason
    got = printed(seen, "DISK")
    for place in ("/tmp", "/tmp/home", "/dev/shm"):
        big, many = got[place]
        assert big in ("No space left on device", "File too large"), (place, got)
        assert many.startswith("No space left on device after "), (place, got)
        assert int(many.rsplit(" ", 1)[1]) <= 64 * 256, (place, got)  # 4 KiB each in 64 MiB
    assert got["workdir"] == ["Read-only file system",
                              "Read-only file system after 0"], got


@pytest.mark.parametrize("mode", ["sandboxed", "none"])
def test_a_kernels_files_go_with_it_whatever_modes_a_cell_set(mode):
    res, seen = _run([repl(cell(LEAVE)), repl("FINAL('went on')")],
                     sandbox=strict_sandbox() if mode == "sandboxed" else mode)
    assert res.answer == "went on", res.reason
    got = printed(seen, "LEFT")
    if mode == "sandboxed":  # the host's directory is read-only to it; the rest is its tmpfs
        assert got["made"][0] == "Read-only file system", got
    else:
        assert got["made"][0] == got["workdir"], got
    assert not os.path.exists(got["workdir"]), os.listdir(got["workdir"])


def test_the_sweep_removes_a_dead_hosts_directory_whatever_its_modes(tmp_path, monkeypatch):
    """A host killed before its clean-up: the next host's sweep removes its kernel's directory,
    mode-000 directories and read-only files in it too."""
    import subprocess
    import tempfile

    from kernels.process import remove_dirs_of_gone_hosts
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    d = tmp_path / f"rlm-k-{dead}-x"
    (d / "closed" / "deeper").mkdir(parents=True)
    (d / "closed" / "deeper" / "f").write_text("x")
    (d / "ro").mkdir()
    (d / "ro" / "f").write_text("x")
    for p, m in ((d / "closed" / "deeper", 0), (d / "closed", 0), (d / "ro" / "f", 0o444),
                 (d / "ro", 0o555)):
        os.chmod(p, m)
    assert remove_dirs_of_gone_hosts("rlm-k-", {os.getuid()}) == 1
    assert not d.exists()
