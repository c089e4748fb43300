"""The gateway host's kernelspec (``rlm gateway-kernelspec install``) and its launcher's refusals,
without a gateway."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.gateway import kernelspec

REPO = Path(__file__).resolve().parents[2]


def test_install_writes_a_kernelspec_that_runs_the_launcher(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rlm", "gateway-kernelspec", "install",
                          "--prefix", str(tmp_path), "--name", "rlm-x", "--memory-mb", "768",
                          "--processes", "64", "--env", "PYTHONPATH=/opt/p"],
                         capture_output=True, text=True, cwd=REPO, check=True)
    spec_dir = Path(out.stdout.strip())
    assert spec_dir == tmp_path / "share" / "jupyter" / "kernels" / "rlm-x"
    spec = json.loads((spec_dir / "kernel.json").read_text())
    argv = spec["argv"]
    assert argv[1:4] == ["-m", "kernels.gateway.kernelspec", "launch"]
    assert argv[-1] == "{connection_file}" and "--sandbox" in argv and "bwrap" in argv
    assert argv[argv.index("--memory-mb") + 1] == "768" and "--disk-mb" not in argv
    assert spec["interrupt_mode"] == "message" and spec["env"] == {"PYTHONPATH": "/opt/p"}


def test_the_launcher_refuses_tcp_channels_for_a_sandboxed_kernel(tmp_path):
    conn = tmp_path / "kernel-1.json"
    conn.write_text(json.dumps({"transport": "tcp", "ip": "127.0.0.1", "shell_port": 1,
                                "iopub_port": 2, "stdin_port": 3, "control_port": 4,
                                "hb_port": 5, "key": "k", "signature_scheme": "hmac-sha256"}))
    with pytest.raises(SystemExit, match="--KernelManager.transport=ipc"):
        kernelspec.launch(str(conn), "bwrap")


def test_the_harvest_takes_only_files_whose_hash_is_their_name(tmp_path):
    import hashlib
    inbox, cache = tmp_path / "inbox", tmp_path / "cache"
    inbox.mkdir()
    good = b"the context"
    sha = hashlib.sha256(good).hexdigest()
    (inbox / sha).write_bytes(good)
    (inbox / ("0" * 64)).write_bytes(b"not what the name says")
    (inbox / "link").symlink_to(inbox / sha)
    kernelspec._harvest(str(inbox), str(cache))
    assert sorted(p.name for p in cache.iterdir()) == [sha]
    assert (cache / sha).read_bytes() == good
