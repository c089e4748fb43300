"""The escape suite (tests/kernel/test_escape.py) run against a kernel on the gateway: the same
probes from a cell, the kernel started by the gateway from the project's kernelspec with the
suite's small limits; every probe blocked, and the run goes on."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gw_helpers import REPO, USER, gateway  # noqa: F401 (a fixture)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernel"))
from test_escape import ALL, LIMITS, run_probes  # noqa: E402


def test_every_escape_is_blocked_in_a_gateway_kernel(gateway, tmp_path, monkeypatch):
    # a kernelspec with the suite's limits, so the resource probes ask for more than it allows
    subprocess.run([sys.executable, "-m", "rlm", "gateway-kernelspec", "install", "--prefix",
                    os.path.join(gateway.home, "pfx"), "--name", "rlm-tight",
                    "--env", f"PYTHONPATH={REPO}",
                    "--memory-mb", str(LIMITS["kernel_memory_mb"]),
                    "--processes", str(LIMITS["kernel_processes"]),
                    "--disk-mb", str(LIMITS["kernel_disk_mb"])], check=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True)
    subprocess.run(["chown", "-R", f"{USER}:", gateway.home], check=True)
    monkeypatch.setenv("JUPYTER_GATEWAY_AUTH_TOKEN", gateway.token)
    seen, res, listeners = run_probes(tmp_path, monkeypatch, "required", kernels="gateway",
                                      gateway_url=gateway.url,
                                      gateway_kernelspec="rlm-tight")
    assert res.status == "completed" and res.answer == "went on", res.reason
    assert res.sandbox == "gateway"
    assert set(seen) == set(ALL), seen
    reached = sorted(k for k, v in seen.items() if v)
    assert reached == [], f"a gateway kernel reached: {reached}"
    assert listeners.tcp_hits == 0
