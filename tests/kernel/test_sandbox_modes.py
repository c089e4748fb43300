"""``--sandbox auto|required|none`` where bubblewrap is missing or present: ``required`` refuses
(exit 4, the reason), ``auto`` warns once and runs unsandboxed, and the result says which."""
from __future__ import annotations

import json

import pytest

from conftest import API_KEY, MODEL, repl, script
from kernels.bwrap import sandbox_problem


def _no_bwrap_path(tmp_path) -> str:
    """A PATH with ``true`` but no ``bwrap``."""
    d = tmp_path / "bin"
    d.mkdir()
    (d / "true").symlink_to("/bin/true")
    return str(d)


def _run(cli, srv, tmp_path, *flags, env=None):
    ctx = tmp_path / "c.txt"
    ctx.write_text("hello")
    return cli("run", "--context", str(ctx), "--query", "q", "--base-url", srv.base_url,
               "--api-key", API_KEY, "--model", MODEL, "--json", *flags, env=env)


def test_required_without_bubblewrap_is_exit_4_with_the_reason(cli, scripted, tmp_path):
    srv = scripted(script([repl("FINAL('x')")]))
    r = _run(cli, srv, tmp_path, "--sandbox", "required", env={"PATH": _no_bwrap_path(tmp_path)})
    assert r.rc == 4, r.stderr
    assert "bubblewrap" in r.stderr and "apt-get install bubblewrap" in r.stderr
    assert "Traceback" not in r.stderr


def test_auto_without_bubblewrap_warns_and_says_the_kernels_were_not_sandboxed(cli, scripted,
                                                                               tmp_path):
    srv = scripted(script([repl("FINAL('x')")]))
    r = _run(cli, srv, tmp_path, env={"PATH": _no_bwrap_path(tmp_path)})
    assert r.rc == 0, r.stderr
    assert json.loads(r.stdout)["sandbox"] == "none"
    assert r.stderr.count("without a sandbox") == 1 and "apt-get install bubblewrap" in r.stderr


@pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox: {sandbox_problem()}")
def test_the_default_sandboxes_and_none_does_not(cli, scripted, tmp_path):
    probe = repl("import os\nprint('PIDS', len([p for p in os.listdir('/proc') if p.isdigit()]))",
                 "FINAL(str(len([p for p in os.listdir('/proc') if p.isdigit()])))")
    srv = scripted(script([probe, probe]))
    boxed = _run(cli, srv, tmp_path)
    assert boxed.rc == 0, boxed.stderr
    out = json.loads(boxed.stdout)
    assert out["sandbox"] == "bwrap" and int(out["answer"]) < 10  # its own PID namespace
    shown = cli("show", out["run_id"])
    assert shown.rc == 0 and "kernels=bwrap" in shown.stdout.splitlines()[0], shown.stdout
    plain = _run(cli, srv, tmp_path, "--sandbox", "none")
    out = json.loads(plain.stdout)
    assert out["sandbox"] == "none" and int(out["answer"]) > 10  # the machine's processes


@pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox: {sandbox_problem()}")
def test_kernel_network_keeps_the_hosts_network_in_the_sandbox(cli, scripted, tmp_path):
    """``--kernel-network``: still sandboxed (its own PID namespace), but the cell reaches a
    server on the host's loopback, which without the flag it cannot."""
    def probe(port: int) -> str:
        return repl("import os, socket",
                    "try:\n    socket.create_connection(('127.0.0.1', %d), timeout=2).close()\n"
                    "    reached = 'yes'\nexcept OSError:\n    reached = 'no'" % port,
                    "FINAL(reached + ' ' + str(len([p for p in os.listdir('/proc') "
                    "if p.isdigit()])))")
    srv = scripted(lambda req: probe(int(srv.base_url.rsplit(":", 1)[1].split("/")[0])))
    with_net = json.loads(_run(cli, srv, tmp_path, "--kernel-network").stdout)
    reached, pids = with_net["answer"].split()
    assert (with_net["sandbox"], reached) == ("bwrap", "yes") and int(pids) < 10
    without = json.loads(_run(cli, srv, tmp_path).stdout)
    assert without["answer"].split()[0] == "no"


def test_required_where_no_control_group_can_be_made_refuses_before_a_kernel_starts(
        monkeypatch, tmp_path):
    """Where the per-kernel limits cannot be held (a non-root host without delegation),
    ``required`` refuses with the reason and what to do; ``auto`` lets the per-process limits
    stand in. (The whole CLI path is the next test, on a host without groups.)"""
    from kernels import cgroups, limits
    from kernels.bwrap import SandboxSpec, SandboxUnavailable
    monkeypatch.setattr(cgroups.KernelGroup, "create", classmethod(lambda cls, *a, **k: None))
    monkeypatch.setattr(cgroups, "unavailable", lambda: "no delegation to this user")
    with pytest.raises(SandboxUnavailable) as err:
        limits.KernelLimits(SandboxSpec(mode="required"), "t", str(tmp_path))
    text = str(err.value)
    assert "no delegation to this user" in text and "Delegate=yes" in text
    assert "--sandbox auto" in text
    lim = limits.KernelLimits(SandboxSpec(mode="auto"), "t", str(tmp_path))
    try:
        assert lim.mode == "rlimit" and lim.group is None
    finally:
        lim.close()


@pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox: {sandbox_problem()}")
def test_required_on_a_host_without_groups_is_exit_4_and_auto_runs(cli, scripted, tmp_path):
    from kernels import cgroups
    if cgroups.unavailable() is None:
        pytest.skip("this host may create control groups (the unprivileged run covers this)")
    srv = scripted(script([repl("FINAL('x')"), repl("FINAL('x')")]))
    r = _run(cli, srv, tmp_path, "--sandbox", "required")
    assert r.rc == 4, r.stderr
    assert "per kernel" in r.stderr and "Delegate=yes" in r.stderr
    assert "Traceback" not in r.stderr
    ok = _run(cli, srv, tmp_path, "--sandbox", "auto")
    assert ok.rc == 0, ok.stderr
    out = json.loads(ok.stdout)
    assert out["sandbox"] == "bwrap" and out["kernel_limits"] == "rlimit"
