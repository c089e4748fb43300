"""The kernelspec a gateway host installs, and the launcher its kernels start through.

``python -m kernels.gateway.kernelspec install [--prefix DIR] [--name rlm] [--sandbox MODE]``
(or ``rlm gateway-kernelspec install``) writes ``DIR/share/jupyter/kernels/NAME/kernel.json``
(default ``DIR``: ``sys.prefix``), whose command runs :func:`launch` with the gateway's
connection file. The launcher starts the kernel as the local provider does: ipykernel under
the supervisor (:mod:`kernels.sandbox`), inside bubblewrap (:mod:`kernels.bwrap`) with no
network, the default limits and a scrubbed environment, in a working directory of its own.

Channels. Without a network the kernel cannot serve TCP ports the gateway could reach, so the
gateway must use the IPC transport (``--KernelManager.transport=ipc``): its connection file
then names socket paths next to the file, in a directory every kernel of the gateway shares.
The kernel binds its sockets in its private ``/tmp`` instead (as a local sandboxed kernel does)
and the launcher links the paths the gateway connects to there, through the supervisor's root
(``/proc/PID/root``), so a kernel sees no other kernel's sockets or connection file. Its
working directory is read-only to it but for its context inbox. Interrupts go as messages
(``interrupt_mode: message``): the gateway's process is the launcher, not the kernel.

Contexts. The launcher keeps the host's context cache (``--cache``, default
``$RLM_GATEWAY_CACHE`` or ``~/.cache/rlm-contexts``): mounted read-only in each kernel
(``$RLM_CONTEXT_CACHE``); the files a kernel pulled are offered through a writable inbox and
taken into the cache when it exits, their sha256 checked again (see :mod:`kernels.gateway.fetch`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from kernels.gateway import DEFAULT_KERNELSPEC
from kernels.protocol import BOOT_CODE


def kernel_json(name: str, sandbox: str, python: str, cache: str | None,
                env: dict | None = None, limits: dict | None = None) -> dict:
    """The kernelspec's ``kernel.json`` (dict); ``env``: variables the gateway sets for the
    launcher (e.g. ``PYTHONPATH`` when the project is not installed in ``python``); ``limits``:
    ``{"memory_mb", "processes", "disk_mb"}`` overriding the sandbox's defaults (ints)."""
    argv = [python, "-m", "kernels.gateway.kernelspec", "launch", "--sandbox", sandbox]
    if cache:
        argv += ["--cache", cache]
    for key, value in sorted((limits or {}).items()):
        if value is not None:
            argv += [f"--{key.replace('_', '-')}", str(int(value))]
    return {"argv": argv + ["{connection_file}"], "display_name": f"RLM kernel ({name})",
            "language": "python", "interrupt_mode": "message",
            "env": dict(env or {}), "metadata": {"rlm": {"sandbox": sandbox}}}


def install(prefix: str | None = None, name: str = DEFAULT_KERNELSPEC, sandbox: str = "bwrap",
            python: str | None = None, cache: str | None = None, env: dict | None = None,
            limits: dict | None = None) -> str:
    """Write the kernelspec (see :func:`kernel_json`); returns its directory. Raises OSError
    when it cannot be written."""
    root = os.path.join(prefix or sys.prefix, "share", "jupyter", "kernels", name)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "kernel.json"), "w", encoding="utf-8") as f:
        json.dump(kernel_json(name, sandbox, python or sys.executable, cache, env, limits), f,
                  indent=1)
    return root


def _kernel_argv(connection_file: str) -> list[str]:
    return [sys.executable, "-m", "kernels.ipykernel_main", "-f", connection_file,
            f"--IPKernelApp.exec_lines={BOOT_CODE}", "--HistoryManager.enabled=False",
            "--IPKernelApp.log_level=CRITICAL"]


def _sandboxed(info: dict, workdir: str, limits: dict, cache: str | None):
    """Start the kernel in the sandbox (as :class:`kernels.kernel.Kernel` starts a local one);
    returns ``(launched, links)``: the :class:`kernels.launch.Launched` kernel and the paths the
    gateway connects to, linked to its sockets. Raises SystemExit for a TCP connection file."""
    from kernels import sandbox as sb
    from kernels.bwrap import CTX_DIR, SANDBOX_HOME, SANDBOX_SOCKETS, SandboxSpec, bwrap_argv
    from kernels.launch import launch as start, lifeline_fd
    from kernels.limits import KernelLimits
    from kernels.secrets import kernel_env
    if info.get("transport") != "ipc":
        raise SystemExit("rlm kernelspec: a sandboxed kernel has no network, so the gateway must "
                         "use IPC channels: start it with --KernelManager.transport=ipc")
    ident, held = sb.kernel_user(sb.kernel_identity())
    spec, tag = _spec(SandboxSpec, limits), os.urandom(8).hex()
    os.makedirs(os.path.join(workdir, CTX_DIR))
    inbox = os.path.join(workdir, "inbox")  # the one directory of it the kernel may write
    os.makedirs(inbox)
    if ident is not None:
        os.chown(inbox, ident.uid, ident.gid)
        os.chown(workdir, -1, ident.gid)
        os.chmod(workdir, 0o750)
    lim = KernelLimits(spec, tag, workdir)
    own = os.path.join(workdir, "kernel.json")
    argv = sb.supervised_argv(_kernel_argv(own), workdir=workdir, connection_file=own,
                              ident=ident, limits=spec.rlimits(), home=SANDBOX_HOME,
                              lifeline=lifeline_fd(), fds=(lim.cgroup_fds, lim.errfd))
    argv = bwrap_argv(argv, workdir=workdir, spec=spec, seccomp_fd=lim.seccomp_fd)
    at = argv.index("--")
    argv[at:at] = ["--bind", inbox, inbox]
    extra = {sb.TAG_VAR: tag, "RLM_CONTEXT_INBOX": inbox}
    if cache and os.path.isdir(cache):
        argv[at:at] = ["--ro-bind", cache, "/rlm-cache"]
        extra["RLM_CONTEXT_CACHE"] = "/rlm-cache"
    km = start(argv, connection_file=own, info=dict(info, ip=SANDBOX_SOCKETS),
               env=kernel_env(extra), cwd=workdir, sandboxed=True, pass_fds=lim.fds(),
               group=ident.gid if ident is not None else None)
    lim.started()
    km.limits = lim
    if held is not None:
        km.leases.append(held)
    km._locate()  # the kernel's sockets, seen through its supervisor's root
    links = []
    for key in ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port"):
        link = f"{info['ip']}-{info[key]}"
        _unlink(link)
        os.symlink(f"{km.info['ip']}-{info[key]}", link)
        links.append(link)
    return km, links


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def launch(connection_file: str, sandbox: str = "bwrap", cache: str | None = None,
           limits: dict | None = None) -> int:
    """Run one kernel for the gateway (see the module's text), with the sandbox's default
    limits or ``limits`` (as :func:`kernel_json`); returns its exit status."""
    with open(connection_file, encoding="utf-8") as f:
        info = json.load(f)
    base = os.environ.get("RLM_GATEWAY_WORKDIR") or tempfile.gettempdir()
    workdir = tempfile.mkdtemp(prefix="rlm-gk-", dir=base)
    os.chmod(workdir, 0o755)
    links: list[str] = []
    km = None
    try:
        if sandbox == "none":
            from kernels.secrets import kernel_env
            proc = subprocess.Popen(_kernel_argv(connection_file), env=kernel_env(),
                                    cwd=workdir)
        else:
            km, links = _sandboxed(info, workdir, limits or {}, cache)
            proc = km.process
        signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
        _end_with_parent(proc)
        rc = proc.wait()
        if cache:
            _harvest(os.path.join(workdir, "inbox"), cache)
        return rc
    finally:
        for link in links:
            _unlink(link)
        if km is not None:
            km.release()
        shutil.rmtree(workdir, ignore_errors=True)


def _end_with_parent(proc: subprocess.Popen) -> None:
    """Kill the kernel (its sandbox dies with it) once the gateway that started this launcher
    is gone, even by SIGKILL: the gateway starts kernels in sessions of their own, so nothing
    else would end them."""
    parent = os.getppid()

    def watch() -> None:
        while proc.poll() is None:
            if os.getppid() != parent:
                proc.kill()
                return
            time.sleep(0.5)
    threading.Thread(target=watch, daemon=True, name="rlm-gk-parent").start()


def _spec(cls, limits: dict):
    """The sandbox spec with ``limits`` (the disk cap is also the file-size cap, as locally)."""
    got = {k: int(v) for k, v in limits.items() if v is not None}
    if "disk_mb" in got:
        got["file_mb"] = got["disk_mb"]
    return cls(**got)


def _harvest(inbox: str, cache: str) -> None:
    """Take the context files a kernel pulled into the host's cache, each only if its content
    has the sha256 its name says (a kernel may have written anything there)."""
    try:
        names = os.listdir(inbox)
        os.makedirs(cache, exist_ok=True)
    except OSError:
        return
    for name in names:
        src = os.path.join(inbox, name)
        h = hashlib.sha256()
        try:
            with open(src, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            if h.hexdigest() == name and not os.path.islink(src):
                shutil.copyfile(src, os.path.join(cache, name + ".part"))
                os.replace(os.path.join(cache, name + ".part"), os.path.join(cache, name))
        except OSError:
            continue


def main(argv: list[str] | None = None) -> int:
    """``install`` or ``launch`` (see the module's text); returns the exit status."""
    ap = argparse.ArgumentParser(prog="rlm gateway-kernelspec",
                                 description="the kernelspec of a Jupyter gateway host")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser("install", help="write the kernelspec")
    ins.add_argument("--prefix", help="install under PREFIX/share/jupyter/kernels "
                                      "(default: this Python's prefix)")
    ins.add_argument("--name", default=DEFAULT_KERNELSPEC)
    ins.add_argument("--sandbox", choices=("bwrap", "none"), default="bwrap")
    ins.add_argument("--cache", default=os.environ.get("RLM_GATEWAY_CACHE"),
                     help="the host's context cache directory (default $RLM_GATEWAY_CACHE)")
    ins.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                     help="a variable the gateway sets for its kernels (repeatable)")
    run = sub.add_parser("launch", help="(run by the gateway) start one kernel")
    run.add_argument("--sandbox", choices=("bwrap", "none"), default="bwrap")
    run.add_argument("--cache")
    for r in (ins, run):
        r.add_argument("--memory-mb", type=int, help="a kernel's address space, MiB")
        r.add_argument("--processes", type=int, help="a kernel's processes and threads")
        r.add_argument("--disk-mb", type=int, help="a kernel's /tmp and largest file, MiB")
    run.add_argument("connection_file")
    a = ap.parse_args(argv)
    if a.cmd == "install":
        env = dict(e.split("=", 1) for e in a.env if "=" in e)
        print(install(a.prefix, a.name, a.sandbox, cache=a.cache, env=env, limits=_limits(a)))
        return 0
    return launch(a.connection_file, a.sandbox, a.cache, _limits(a))


def _limits(a) -> dict:
    return {"memory_mb": a.memory_mb, "processes": a.processes, "disk_mb": a.disk_mb}


if __name__ == "__main__":
    sys.exit(main())
