"""Where the per-kernel control groups go and what is written to them, on fake hierarchies (a
cgroup v2 tree that delegates, one that does not, v1 beside v2 as on this project's CI), and
the seccomp filter's program for each machine it knows. The real groups are tried from cells
in test_limits.py."""
from __future__ import annotations

import os
import struct

import pytest

from kernels import cgroups, seccomp


def _fake(tmp_path, proc: str, mounts: list[str], dirs: dict[str, dict[str, str]]):
    (tmp_path / "cgroup").write_text(proc)
    (tmp_path / "mountinfo").write_text("\n".join(mounts) + "\n")
    for d, files in dirs.items():
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (tmp_path / d / name).write_text(text)
    return str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")


def test_v2_is_used_where_the_hosts_group_delegates_its_controllers(tmp_path):
    root = tmp_path / "fs"
    proc, info = _fake(tmp_path, "0::/user.slice/app\n",
                       [f"30 23 0:26 / {root} rw - cgroup2 cgroup2 rw"],
                       {"fs/user.slice/app": {"cgroup.subtree_control": "cpu memory pids\n"}})
    places = cgroups.find_places(proc, info)
    assert {c: (p.version, p.dir) for c, p in places.items()} == {
        c: (2, str(root / "user.slice" / "app")) for c in ("memory", "pids", "cpu")}


def test_a_v2_group_that_does_not_delegate_is_not_used(tmp_path):
    proc, info = _fake(tmp_path, "0::/session.scope\n",
                       [f"30 23 0:26 / {tmp_path / 'fs'} rw - cgroup2 cgroup2 rw"],
                       {"fs/session.scope": {"cgroup.subtree_control": "\n"}})
    assert cgroups.find_places(proc, info) == {}


def test_v1_controllers_beside_a_v2_tree_without_them(tmp_path):
    """As on this project's CI: v1 memory, pids and cpu; the v2 tree has only hugetlb."""
    fs = tmp_path / "fs"
    proc, info = _fake(
        tmp_path, "8:pids:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n",
        [f"32 31 0:29 / {fs}/cpu rw - cgroup cgroup rw,cpu",
         f"35 31 0:32 / {fs}/memory rw - cgroup cgroup rw,memory",
         f"39 31 0:36 / {fs}/pids rw - cgroup cgroup rw,pids",
         f"41 31 0:38 / {fs}/unified rw - cgroup2 cgroup2 rw"],
        {"fs/cpu": {}, "fs/memory/process_api/abc": {}, "fs/pids": {},
         "fs/unified": {"cgroup.subtree_control": "hugetlb\n"}})
    places = cgroups.find_places(proc, info)
    assert {c: (p.version, p.dir) for c, p in places.items()} == {
        "memory": (1, f"{fs}/memory/process_api/abc"), "pids": (1, f"{fs}/pids"),
        "cpu": (1, f"{fs}/cpu")}


def test_the_limits_written_on_each_version(tmp_path):
    for v in (1, 2):
        d = tmp_path / f"v{v}"
        d.mkdir()
        g = cgroups.KernelGroup({c: str(d) for c in cgroups.CONTROLLERS},
                                {c: v for c in cgroups.CONTROLLERS}, 512 << 20, 64)
        g._limit(cpu_weight=100)
        got = {p.name: p.read_text() for p in d.iterdir()}
        if v == 2:
            assert got == {"memory.max": str(512 << 20), "memory.swap.max": "0",
                           "pids.max": "64", "cpu.weight": "100"}
        else:
            assert got == {"memory.limit_in_bytes": str(512 << 20),
                           "memory.memsw.limit_in_bytes": str(512 << 20), "pids.max": "64",
                           "cpu.shares": "1024"}


def test_what_a_group_ran_into_is_read_from_its_counters(tmp_path):
    g = cgroups.KernelGroup({"memory": str(tmp_path), "pids": str(tmp_path), "cpu": str(tmp_path)},
                            {"memory": 1, "pids": 1, "cpu": 1}, 1, 1)
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    (tmp_path / "pids.events").write_text("max 0\n")
    assert g.hit() == {"memory": 0, "pids": 0}
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    (tmp_path / "pids.events").write_text("max 7\n")
    assert g.hit() == {"memory": 2, "pids": 7}


def test_the_seccomp_program_for_each_machine():
    for machine, arch in (("x86_64", 0xC000003E), ("aarch64", 0xC00000B7)):
        prog = seccomp.program(machine)
        ops = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
        assert ops[0] == (0x20, 0, 0, 4) and ops[1][3] == arch  # the architecture first
        assert ops[-1] == (0x06, 0, 0, 0x7FFF0000)  # everything else allowed
        refused = {op[3] for op in ops if op[0] == 0x15}
        assert {425, 426, 427, 435} <= refused  # io_uring, clone3 the same on both
        for i, op in enumerate(ops):  # every jump lands inside the program
            if op[0] in (0x15, 0x35, 0x45):
                assert i + 1 + max(op[1], op[2]) < len(ops)
    assert seccomp.program("riscv64") is None


@pytest.mark.skipif(cgroups.unavailable() is not None,
                    reason=f"no control groups here: {cgroups.unavailable()}")
def test_the_groups_of_a_dead_host_are_swept_and_a_live_ones_are_not():
    import subprocess
    import sys
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout)
    places = cgroups.find_places()
    mine = cgroups.KernelGroup.create("live", memory_bytes=64 << 20, pids=8)
    stale = [os.path.join(p.dir, f"{cgroups.PREFIX}{dead}-gone") for p in places.values()]
    try:
        for d in set(stale):
            os.mkdir(d)
        assert cgroups.sweep_stale() >= 1
        assert not any(os.path.exists(d) for d in stale)
        assert all(os.path.isdir(d) for d in mine.dirs.values())  # this host's: left alone
    finally:
        mine.close()
        for d in set(stale):
            if os.path.isdir(d):
                os.rmdir(d)
    assert not any(os.path.exists(d) for d in mine.dirs.values())
