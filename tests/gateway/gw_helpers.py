"""A real Jupyter Kernel Gateway for the gateway tests, as another user, with its own files.

:func:`start_gateway` starts one; the fixtures :func:`gateway` (one gateway per test module that
imports it: a ``conftest.py`` here would take the name ``conftest`` from the suite's own) and
:func:`on_gateway` give it to tests.

The gateway runs as the user ``rlm-gw`` (created when missing) in a mount namespace of its own:
a private ``/tmp`` and an empty home for root, so no file, Unix socket or hard link of the host's
(its bridge socket, its context files) can reach a kernel by accident; its working directory,
runtime directory and kernelspec live in a directory of its own under ``/var/tmp``. The
kernelspec is the project's (``kernels.gateway.kernelspec install``), sandboxed with bubblewrap,
and the gateway uses IPC channels. The auth token is passed in the gateway's environment, never
in its argv. Skipped with the reason when not root or a part is missing.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
USER = "rlm-gw"


@dataclass
class Gateway:
    """A running gateway: ``url``, ``token``, its directory ``home`` and its process."""

    url: str
    token: str
    home: str
    proc: subprocess.Popen

    def stop(self) -> None:
        """Kill the gateway (and the kernels it started: their launchers die with it)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def why_not() -> str | None:
    if os.geteuid() != 0:
        return "the gateway runs as another user: these tests need root"
    for exe in ("unshare", "setpriv", "bwrap", "useradd"):
        if shutil.which(exe) is None:
            return f"{exe} is not installed"
    try:
        import kernel_gateway  # noqa: F401
        import websocket  # noqa: F401
    except ImportError:
        return "jupyter-kernel-gateway is not installed (pip install -e .[gateway])"
    return None


_SCRIPT = """set -e
for p in $BACK; do mkdir -p "$HOME_DIR/back$p"; mount --rbind "$p" "$HOME_DIR/back$p"; done
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs -o mode=0755 tmpfs /root
for p in $BACK; do mkdir -p "$p"; mount --rbind "$HOME_DIR/back$p" "$p"; done
cd "$HOME_DIR/work"
exec setpriv --reuid "$GW_USER" --regid "$GW_USER" --clear-groups "$@"
"""


#: A Python with Jupyter Enterprise Gateway installed: the tests then run against it instead
#: (its own environment: it pins older jupyter_client and jupyter_server than this project's).
EG_PYTHON_VAR = "RLM_TEST_ENTERPRISE_GATEWAY_PYTHON"


def _gateway_argv(port: int, env: dict) -> list[str]:
    """The gateway's command line: Jupyter Kernel Gateway, or Enterprise Gateway when
    :data:`EG_PYTHON_VAR` names its Python (its token then in ``EG_AUTH_TOKEN``)."""
    eg = os.environ.get(EG_PYTHON_VAR)
    if eg:
        env["EG_AUTH_TOKEN"] = env["KG_AUTH_TOKEN"]
        return [eg, "-m", "enterprise_gateway", "--EnterpriseGatewayApp.ip=127.0.0.1",
                f"--EnterpriseGatewayApp.port={port}", "--KernelManager.transport=ipc",
                "--EnterpriseGatewayApp.log_level=WARN"]
    return [sys.executable, "-m", "kernel_gateway", "--KernelGatewayApp.ip=127.0.0.1",
            f"--KernelGatewayApp.port={port}", "--KernelManager.transport=ipc",
            "--KernelGatewayApp.log_level=WARN"]


def _hidden_paths() -> list[str]:
    """What the namespace's fresh /tmp and /root would hide that the gateway needs (the
    interpreter, the virtualenv, the checkout: a clone under /tmp, a Python under /root), to
    be bound back; a path inside another one listed is left out."""
    paths = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, REPO)}
    hidden = sorted(p for p in paths if p.startswith(("/root/", "/tmp/")))
    return [p for p in hidden if not any(p.startswith(q + "/") for q in hidden)]


def start_gateway(port: int | None = None, token: str | None = None,
                  cull_idle: int | None = None) -> Gateway:
    """Start a gateway (see the module's text); returns once it answers."""
    if subprocess.run(["id", USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", USER], check=True)
    home = tempfile.mkdtemp(prefix="rlm-gw-", dir="/var/tmp")
    os.chmod(home, 0o755)
    for d in ("work", "runtime", "data", "kernels-work", "cache"):
        os.makedirs(os.path.join(home, d))
    subprocess.run([sys.executable, "-m", "rlm", "gateway-kernelspec", "install", "--prefix",
                    os.path.join(home, "pfx"), "--env", f"PYTHONPATH={REPO}",
                    "--cache", os.path.join(home, "cache")],
                   check=True, capture_output=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    subprocess.run(["chown", "-R", f"{USER}:", home], check=True)
    port = port or _free_port()
    token = token if token is not None else secrets.token_hex(16)
    back = _hidden_paths()
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "HOME_DIR": home,
           "GW_USER": USER, "BACK": " ".join(back), "PYTHONPATH": str(REPO),
           "JUPYTER_PATH": os.path.join(home, "pfx", "share", "jupyter"),
           "JUPYTER_RUNTIME_DIR": os.path.join(home, "runtime"),
           "JUPYTER_DATA_DIR": os.path.join(home, "data"),
           "RLM_GATEWAY_WORKDIR": os.path.join(home, "kernels-work"), "KG_AUTH_TOKEN": token}
    argv = _gateway_argv(port, env)
    if cull_idle:
        argv += [f"--MappingKernelManager.cull_idle_timeout={cull_idle}",
                 "--MappingKernelManager.cull_interval=1",
                 "--MappingKernelManager.cull_connected=True"]
    log = open(os.path.join(home, "gateway.log"), "wb")
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                             _SCRIPT, "gateway"] + argv, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    gw = Gateway(f"http://127.0.0.1:{port}", token, home, proc)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            urllib.request.urlopen(gw.url + "/api", timeout=2).read()
            return gw
        except urllib.error.HTTPError:  # it answers (401 without the token): it is up
            return gw
        except OSError:
            time.sleep(0.3)
    gw.stop()
    log_text = Path(home, "gateway.log").read_text(errors="replace")[-2000:]
    shutil.rmtree(home, ignore_errors=True)
    raise RuntimeError("the gateway did not start: " + log_text)


@pytest.fixture(scope="module")
def gateway():
    """A gateway for the test module (see the module's text)."""
    why = why_not()
    if why:
        pytest.skip(why)
    gw = start_gateway()
    yield gw
    gw.stop()
    shutil.rmtree(gw.home, ignore_errors=True)


@pytest.fixture
def on_gateway(gateway, monkeypatch):
    """Options that put every kernel of a run on the module's gateway (its token in the
    environment, as a user sets it)."""
    monkeypatch.setenv("JUPYTER_GATEWAY_AUTH_TOKEN", gateway.token)
    return {"kernels": "gateway", "gateway_url": gateway.url}
