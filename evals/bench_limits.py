"""What the per-kernel limits cost: a sandboxed kernel's start, and a whole trivial run, with
its control group (:mod:`kernels.cgroups`) and without (the per-process limits alone).

Usage: ``python -m evals.bench_limits [--reps 7]`` (on a host that may create control groups:
root, or a delegated cgroup; elsewhere there is nothing to compare and it says so).

Each measurement is a fresh process, the two modes interleaved (``groups``, ``rlimits``,
``rlimits``, ``groups``, ...), so drift on the machine falls on both alike:

* **kernel start**: a new interpreter imports :mod:`kernels.kernel` and times
  ``Kernel(sandbox=SandboxSpec(mode="auto")).start()`` (launch to the first
  ``kernel_info`` reply), then its shutdown (the group's removal is in it);
* **trivial run**: ``rlm run --sandbox auto`` from process start to exit against the
  scripted endpoint of :mod:`evals.side_by_side_server` (another process), journal on.

``rlimits`` turns the groups off in that process only (as on a host that may not create them);
both modes run ``--sandbox auto``, which is bubblewrap here (``required`` refuses to start a
kernel without its group).
Prints medians and minimums per mode and the differences. Target (issue "Bounded kernels"): at
most 20 ms more per kernel start. Run it with nothing else running: this machine has 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("groups", "rlimits")

#: Run first in each measured process: ``rlimits`` makes the groups unavailable there.
_OFF = """
from kernels import cgroups
if {off!r}:
    cgroups._state.update(places={{}}, why="turned off for the benchmark")
"""

_START = _OFF + """
import time
from kernels.bwrap import SandboxSpec
from kernels.kernel import Kernel
t = time.perf_counter()
k = Kernel(sandbox=SandboxSpec(mode="auto")).start()
started = time.perf_counter() - t
assert k.sandbox_mode == "bwrap", "the benchmark needs bubblewrap"
assert k.limits_mode == ("rlimit" if {off!r} else "cgroup"), k.limits_mode
t = time.perf_counter()
k.shutdown()
print(started, time.perf_counter() - t)
"""

_RUN = _OFF + """
import sys
from rlm.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def kernel_start(mode: str) -> tuple[float, float]:
    """Seconds a fresh process takes to start one sandboxed kernel in ``mode``, and to shut
    it down."""
    out = subprocess.run([sys.executable, "-c", _START.format(off=mode == "rlimits")],
                         cwd=REPO, capture_output=True, text=True, check=True)
    start, stop = out.stdout.strip().splitlines()[-1].split()
    return float(start), float(stop)


def _server() -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, str(REPO / "evals" / "side_by_side_server.py")],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    return proc, int(line.split()[1])


def trivial_run(mode: str, port: int, work: Path) -> float:
    """Seconds from process start to exit of a trivial sandboxed ``rlm run`` in ``mode``."""
    ctx = work / "ctx.txt"
    ctx.write_text("hello world\n")
    env = dict(os.environ, OPENAI_API_KEY="bench-key", RLM_JOURNAL=str(work / "j.sqlite3"),
               PYTHONPATH=str(REPO))
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", _RUN.format(off=mode == "rlimits"), "run",
                    "--context", str(ctx), "--query", "BENCH-ROOT what?", "--model", "m", "-q",
                    "--sandbox", "auto",
                    "--base-url", f"http://127.0.0.1:{port}/ours/trivial/0/v1"],
                   env=env, cwd=work, capture_output=True, check=True)
    return time.perf_counter() - t


def _summary(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1000:7.1f} ms  min {min(xs) * 1000:7.1f} ms"


def main(argv: list[str] | None = None) -> int:
    """Run the figures and print them; 0 on success, 1 where there is nothing to compare."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7, help="measurements per mode (default 7)")
    args = ap.parse_args(argv)
    from kernels import cgroups
    from kernels.bwrap import sandbox_problem
    problem = sandbox_problem() or cgroups.unavailable()
    if problem:
        print(f"nothing to compare on this machine: {problem}")
        return 1
    tables: dict[str, dict[str, list[float]]] = {
        k: {m: [] for m in MODES} for k in ("kernel start", "kernel shutdown", "trivial run")}
    srv, port = _server()
    try:
        with tempfile.TemporaryDirectory() as d:
            for i in range(args.reps):
                for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                    start, stop = kernel_start(mode)
                    tables["kernel start"][mode].append(start)
                    tables["kernel shutdown"][mode].append(stop)
                    tables["trivial run"][mode].append(trivial_run(mode, port, Path(d)))
    finally:
        srv.kill()
    print(f"{args.reps} fresh processes per mode, interleaved; sandbox auto in both (bubblewrap; required refuses without groups)")
    for name, table in tables.items():
        print(name)
        for mode in MODES:
            print(f"  {mode:8s} {_summary(table[mode])}")
        diff = statistics.median(table["groups"]) - statistics.median(table["rlimits"])
        print(f"  groups cost {diff * 1000:+.1f} ms (median against median)")
    print(json.dumps(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
