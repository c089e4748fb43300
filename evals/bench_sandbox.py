"""What the kernel sandbox costs: kernel start and a whole trivial run, with and without it.

Usage: ``python -m evals.bench_sandbox [--reps 7]``

Each measurement is a fresh process, the two modes interleaved (``none``, ``required``,
``none``, ...), so drift on the machine falls on both alike:

* **kernel start**: a new interpreter imports :mod:`kernels.kernel` and times
  ``Kernel(sandbox=...).start()`` (launch to the first ``kernel_info`` reply);
* **trivial run**: ``rlm run`` from process start to exit against the scripted endpoint of
  :mod:`evals.side_by_side_server` (another process), journal on.

Prints the medians and minimums per mode and the differences. Target (issue: "a sandbox for
every kernel"): at most 30 ms more per kernel start, hidden from a run's first child by the warm
pool. Run it with nothing else running: this machine has 2 cores.
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
MODES = ("none", "required")

_START = """
import time
from kernels.bwrap import SandboxSpec
from kernels.kernel import Kernel
t = time.perf_counter()
k = Kernel(sandbox=SandboxSpec(mode={mode!r})).start()
print(time.perf_counter() - t)
k.shutdown()
"""


def kernel_start(mode: str) -> float:
    """Seconds a fresh process takes to start one kernel in ``mode``."""
    out = subprocess.run([sys.executable, "-c", _START.format(mode=mode)], cwd=REPO,
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _server() -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, str(REPO / "evals" / "side_by_side_server.py")],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    return proc, int(line.split()[1])


def trivial_run(mode: str, port: int, work: Path) -> float:
    """Seconds from process start to exit of a trivial ``rlm run`` in ``mode``, journal on."""
    ctx = work / "ctx.txt"
    ctx.write_text("hello world\n")
    env = dict(os.environ, OPENAI_API_KEY="bench-key", RLM_JOURNAL=str(work / "j.sqlite3"))
    t = time.perf_counter()
    subprocess.run([str(Path(sys.executable).parent / "rlm"), "run", "--context", str(ctx),
                    "--query", "BENCH-ROOT what?", "--model", "m", "-q", "--sandbox", mode,
                    "--base-url", f"http://127.0.0.1:{port}/ours/trivial/0/v1"],
                   env=env, cwd=work, capture_output=True, check=True)
    return time.perf_counter() - t


def _summary(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1000:7.1f} ms  min {min(xs) * 1000:7.1f} ms"


def main(argv: list[str] | None = None) -> int:
    """Run the figures and print them; 0 on success."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7, help="measurements per mode (default 7)")
    args = ap.parse_args(argv)
    from kernels.bwrap import sandbox_problem
    problem = sandbox_problem()
    if problem:
        print(f"no sandbox on this machine: {problem}")
        return 1
    starts: dict[str, list[float]] = {m: [] for m in MODES}
    runs: dict[str, list[float]] = {m: [] for m in MODES}
    srv, port = _server()
    try:
        with tempfile.TemporaryDirectory() as d:
            for i in range(args.reps):
                for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                    starts[mode].append(kernel_start(mode))
                    runs[mode].append(trivial_run(mode, port, Path(d)))
    finally:
        srv.kill()
    print(f"{args.reps} fresh processes per mode, interleaved")
    for name, table in (("kernel start", starts), ("trivial rlm run (process start to exit)",
                                                   runs)):
        print(name)
        for mode in MODES:
            print(f"  {mode:8s} {_summary(table[mode])}")
        diff = statistics.median(table["required"]) - statistics.median(table["none"])
        print(f"  sandbox costs {diff * 1000:+.1f} ms (median against median)")
    print(json.dumps({"kernel_start": starts, "trivial_run": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
