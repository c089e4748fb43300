"""Benchmark: kernels on a Jupyter Kernel Gateway against local kernels, side by side.

Usage::

    python -m evals.bench_gateway [--reps 3] [--children 16,64] [--context-mb 100]
                                  [--only child,subcall,children,context] [--pool-size 0]
                                  [--gateway-url URL] [--json]

Each figure is measured in a fresh process per repetition, the two providers interleaved (the
order alternating per repetition), against the scripted endpoint of
:mod:`evals.side_by_side_server` (no model latency):

* ``child_start_s``: the first ``rlm()`` child of a run: its kernel's start and bind, its one
  model turn, its shutdown (the pool is off, so the start is in it);
* ``subcall_ms``: one ``llm_query`` round trip from a cell, median of 60 after 10 warm-up
  calls (the bridge's own cost: the endpoint answers at once);
* ``children_N_s``: ``rlm_batched`` over N children at concurrency 16 (``max_concurrency``),
  with ``--pool-size`` kernels started ahead (default 0: each child's start is in it);
* ``context_s_per_mb``: binding a context of ``--context-mb`` MB in a started kernel (a
  gateway kernel pulls it in chunks and checks its sha256; a local kernel reads a link).

Without ``--gateway-url`` (token from ``$JUPYTER_GATEWAY_AUTH_TOKEN``) it starts a gateway as
this user on 127.0.0.1 with the project's sandboxed kernelspec and IPC channels. Prints a table,
or JSON with ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _start_server() -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "side_by_side_server.py")],
                            stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline().split()[1])
    return proc, port


def _start_gateway() -> tuple[subprocess.Popen, str, str, str]:
    """A gateway as this user: (process, url, token, its directory)."""
    home = tempfile.mkdtemp(prefix="rlm-bench-gw-", dir="/var/tmp")
    os.chmod(home, 0o755)
    env = {**os.environ, "PYTHONPATH": REPO}
    subprocess.run([sys.executable, "-m", "rlm", "gateway-kernelspec", "install", "--prefix",
                    os.path.join(home, "pfx"), "--env", f"PYTHONPATH={REPO}"], check=True,
                   env=env, capture_output=True)
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    token = secrets.token_hex(16)
    os.makedirs(os.path.join(home, "work"))
    genv = {**env, "KG_AUTH_TOKEN": token, "JUPYTER_PATH": os.path.join(home, "pfx", "share",
                                                                          "jupyter"),
            "JUPYTER_RUNTIME_DIR": os.path.join(home, "rt"), "RLM_GATEWAY_WORKDIR":
            os.path.join(home, "work")}
    proc = subprocess.Popen([sys.executable, "-m", "kernel_gateway",
                             "--KernelGatewayApp.ip=127.0.0.1", f"--KernelGatewayApp.port={port}",
                             "--KernelManager.transport=ipc", "--KernelGatewayApp.log_level=WARN"],
                            env=genv, cwd=home, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(url + "/api", timeout=2)
            break
        except urllib.error.HTTPError:
            break
        except OSError:
            time.sleep(0.3)
    return proc, url, token, home


def _worker(args) -> dict:
    """One figure in this (fresh) process; returns it."""
    import rlm
    kernels = args.kernels
    opts = dict(kernels=kernels, gateway_url=args.gateway_url) if kernels == "gateway" else {}
    if args.figure == "context":
        return {"context_s_per_mb": _context_cost(args, kernels)}
    scenario = {"child": "child-quick", "subcall": "subcall-quick"}.get(args.figure,
                                                                        args.figure)
    base = f"http://127.0.0.1:{args.port}/ours/{scenario}/0/v1"
    res = rlm.completion("ctx", "BENCH-ROOT go", base_url=base, api_key="k", model="m",
                         journal=False, max_depth=2, max_concurrency=16,
                         pool_size=args.pool_size if args.figure.startswith("kids") else 0,
                         cell_timeout=600, **opts)
    if res.status != "completed":
        raise SystemExit(f"{args.figure} on {kernels}: {res.status}: {res.reason}")
    out = json.loads(res.answer)
    if args.figure == "child":
        return {"child_start_s": out["first"]}
    if args.figure == "subcall":
        return {"subcall_ms": out["sub"] * 1000}
    return {f"children_{args.figure[4:]}_s": out["children"]}


def _context_cost(args, kernels: str) -> float:
    """Seconds per MB to bind a context of ``--context-mb`` MB in a started kernel."""
    from kernels.bridge import BridgeServer
    from kernels.provider import bind_cell, kernel_factory, parse_placement
    size = args.context_mb * 1_000_000
    where = tempfile.mkdtemp()
    path = os.path.join(where, "ctx.txt")
    with open(path, "w") as f:
        f.write(("0123456789abcdef" * (size // 16 + 1))[:size])
    k = kernel_factory(parse_placement(kernels, args.gateway_url), 0)().start()
    bridge = BridgeServer(lambda reg, op, a: None)
    try:
        reg = bridge.register(k.pid, None)
        t0 = time.perf_counter()
        res, _ = k.execute(bind_cell(k, bridge, reg.token, k.share_file(path), "text", size),
                           timeout=600)
        took = time.perf_counter() - t0
        if res.error:
            raise SystemExit(f"context bind failed on {kernels}: {res.output}")
        return took / args.context_mb
    finally:
        k.shutdown()
        bridge.close()
        shutil.rmtree(where, ignore_errors=True)


def _measure(figure: str, kernels: str, port: int, url: str, token: str, mb: int,
             pool: int = 0) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO, "JUPYTER_GATEWAY_AUTH_TOKEN": token}
    p = subprocess.run([sys.executable, "-m", "evals.bench_gateway", "--worker", figure,
                        "--kernels", kernels, "--port", str(port), "--gateway-url", url,
                        "--context-mb", str(mb), "--pool-size", str(pool)], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"{figure} on {kernels} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark (see the module's text)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--children", default="16,64", help="fan-out sizes: 16, 64 or both")
    ap.add_argument("--context-mb", type=int, default=100)
    ap.add_argument("--only", default="child,subcall,children,context",
                    help="the figures to measure (comma-separated; default all)")
    ap.add_argument("--pool-size", type=int, default=0,
                    help="kernels started ahead for the fan-out figures (default 0)")
    ap.add_argument("--gateway-url")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--kernels", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        a.figure = a.worker
        print(json.dumps(_worker(a)))
        return
    server, port = _start_server()
    gw = home = None
    url, token = a.gateway_url, os.environ.get("JUPYTER_GATEWAY_AUTH_TOKEN", "")
    if not url:
        gw, url, token, home = _start_gateway()
    only = set(a.only.split(","))
    figures = ([f for f in ("child", "subcall") if f in only]
               + [f"kids{n}" for n in a.children.split(",") if n and "children" in only]
               + ["context"] * ("context" in only))
    got: dict = {"local": {}, "gateway": {}}
    try:
        for rep in range(a.reps):
            for fig in figures:
                order = ("local", "gateway") if rep % 2 == 0 else ("gateway", "local")
                for kernels in order:
                    got_one = _measure(fig, kernels, port, url, token, a.context_mb,
                                       a.pool_size)
                    for k, v in got_one.items():
                        got[kernels].setdefault(k, []).append(v)
    finally:
        server.kill()
        if gw is not None:
            os.killpg(gw.pid, 9)
            gw.wait()
            shutil.rmtree(home, ignore_errors=True)
    table = {k: {"local": statistics.median(got["local"][k]),
                 "gateway": statistics.median(got["gateway"][k])} for k in got["local"]}
    if a.json:
        print(json.dumps({"medians": table, "runs": got}, indent=1))
        return
    print(f"{'figure':<22}{'local':>12}{'gateway':>12}{'ratio':>8}")
    for k, v in table.items():
        print(f"{k:<22}{v['local']:>12.4f}{v['gateway']:>12.4f}"
              f"{v['gateway'] / v['local'] if v['local'] else float('nan'):>8.2f}")


if __name__ == "__main__":
    main()
