"""``rlm gateway-kernelspec install``: the kernelspec a Jupyter gateway host installs so its
kernels run under this project's sandbox (:mod:`kernels.gateway.kernelspec`)."""
from __future__ import annotations

import os
from typing import Any


def add_parser(sub: Any) -> None:
    """Add the ``gateway-kernelspec`` subcommand to ``sub`` (the ``rlm`` subparsers)."""
    gk = sub.add_parser("gateway-kernelspec",
                        help="install the sandboxed kernelspec on a Jupyter gateway host",
                        description="Write the kernelspec a Jupyter Kernel Gateway (or "
                                    "Enterprise Gateway) host starts RLM kernels with: each "
                                    "kernel under bubblewrap, no network, the default limits. "
                                    "Start the gateway with --KernelManager.transport=ipc. "
                                    "See docs/remote-kernels.md.")
    gsub = gk.add_subparsers(dest="action", required=True)
    ins = gsub.add_parser("install", help="write the kernelspec")
    ins.add_argument("--prefix", help="install under PREFIX/share/jupyter/kernels (default: "
                                      "this Python's prefix)")
    ins.add_argument("--name", default="rlm", help="the kernelspec's name (default rlm: "
                                                   "--gateway-kernelspec on the host)")
    ins.add_argument("--sandbox", choices=("bwrap", "none"), default="bwrap",
                     help="bwrap (default) or none (a kernel image that is its own sandbox)")
    ins.add_argument("--cache", default=os.environ.get("RLM_GATEWAY_CACHE"),
                     help="the host's context cache directory (default $RLM_GATEWAY_CACHE)")
    ins.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                     help="a variable the gateway sets for its kernels (repeatable)")
    ins.add_argument("--memory-mb", type=int, metavar="MB",
                     help="a kernel's address space, MiB (default 4096, as --kernel-memory)")
    ins.add_argument("--processes", type=int, metavar="N",
                     help="a kernel's processes and threads (default 1024)")
    ins.add_argument("--disk-mb", type=int, metavar="MB",
                     help="a kernel's /tmp and largest file, MiB (default 1024)")


def cmd(args: Any) -> int:
    """Install the kernelspec; prints its directory. Returns the exit status (2: not
    writable)."""
    import sys

    from kernels.gateway.kernelspec import install
    env = dict(e.split("=", 1) for e in args.env if "=" in e)
    try:
        limits = {"memory_mb": args.memory_mb, "processes": args.processes,
                  "disk_mb": args.disk_mb}
        print(install(args.prefix, args.name, args.sandbox, cache=args.cache, env=env,
                      limits=limits))
    except OSError as exc:
        print(f"rlm: error: could not write the kernelspec: {exc}", file=sys.stderr)
        return 2
    return 0
