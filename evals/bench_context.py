"""Directory contexts of 10 MB, 100 MB and 1 GB: load time into a kernel and peak memory, plus a
full run, its replay and a resume over the 100 MB one.

Run: ``python -m evals.bench_context [--sizes 10,100,1000] [--dir /tmp]``. Generated text
files (nested directories, about 10 MB per file at 1 GB, with some non-ASCII words) are
written under ``--dir`` and deleted afterwards; 1 GB needs about 1.1 GB of free disk.

Each measurement runs in a fresh Python process so its peak RSS (``ru_maxrss``) is its own:

- load: ``load_context(Path(dir))`` on the host (walk, UTF-8 check, streaming sha256), then
  ``bind`` in a started kernel (it reads each file in place); reports both times, the host's
  and the kernel's peak RSS. Targets: 1 GB into the kernel in < 10 s, host peak < 1.5 GB.
- run: ``rlm.completion`` end to end against a local scripted endpoint (one turn whose code
  counts the files and characters), journaled.
- replay / resume (100 MB): the finished run replayed from the journal (zero model calls);
  a run whose second model call fails (endpoint down), then resumed: the first call is
  served from the journal and the context is hashed again to check it is unchanged.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the of and to in is was for on that with as by at from error warning request "
         "timeout retry kernel context budget journal replay depth model token cache shard "
         "naïve café über Straße 東京 данные").split()


def generate(root: Path, mb: int) -> tuple[int, int]:
    """Write ``mb`` MB of text files under ``root``; returns (files, bytes)."""
    per_file = 1 if mb <= 10 else 2 if mb <= 100 else 10
    n_files = max(1, mb // per_file)
    total = 0
    for i in range(n_files):
        rng = random.Random(i)
        lines, size = [], 0
        while size < 1_000_000:
            line = f"{i:04d}-{len(lines):06d} " + " ".join(rng.choices(WORDS, k=14)) + "\n"
            lines.append(line)
            size += len(line.encode())
        block = "".join(lines).encode()
        p = root / f"part{i % 10}" / f"sub{i % 3}" / f"log{i:04d}.txt"
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as f:
            for _ in range(per_file):
                f.write(block)
        total += len(block) * per_file
    return n_files, total


def _peak_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_load(directory: str) -> dict:
    """In a fresh process: host load + kernel bind, with times and peak RSS."""
    from kernels.bridge import BridgeServer
    from kernels.kernel import Kernel
    from kernels.protocol import bind_code
    from rlm.context.load import load_context

    bridge = BridgeServer(lambda reg, op, args: None)
    k = Kernel().start()
    try:
        reg = bridge.register(k.pid, None)
        base = _peak_mb()
        t0 = time.perf_counter()
        ctx = load_context(Path(directory))
        t1 = time.perf_counter()
        path = k.share_file(ctx.path, ctx.fmt)  # as the loop does (an unprivileged kernel)
        res, _ = k.execute(bind_code(bridge.path, reg.token, path, ctx.fmt), timeout=600)
        t2 = time.perf_counter()
        assert res.error is None, res.output
        check, _ = k.execute("import resource; print(len(context), sum(map(len, context.values())),"
                             " resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)")
        files, chars, kernel_peak = map(int, check.output.split())
        ctx.discard()
    finally:
        k.shutdown()
        bridge.close()
    return {"host_s": t1 - t0, "kernel_s": t2 - t1, "files": files, "chars": chars,
            "host_peak_mb": _peak_mb(), "host_base_mb": base, "kernel_peak_mb": kernel_peak,
            "copied": bool(ctx.extra_files)}


CODE = ("```repl\nn = len(context)\nchars = sum(len(v) for v in context.values())\n"
        "print(n, chars)\n```")
FINAL = "```repl\nFINAL(str(n) + ' files, ' + str(chars) + ' chars')\n```"


def child_run(directory: str, journal: str, mode: str) -> dict:
    """In a fresh process: a full run (``run``), a run that fails at its second call
    (``fail``), its ``resume``, or a ``replay``; returns the time, answer and peak RSS."""
    sys.path.insert(0, str(ROOT / "tests"))
    import rlm
    from rlm.api import replay, resume
    from scripted_server import Reply, ScriptedServer

    def responder(req):
        turns = sum(1 for m in req["messages"] if m["role"] == "assistant")
        if mode == "fail" and turns == 1:
            return Reply(status=503, content="down")
        return CODE if turns == 0 else FINAL

    o = {"api_key": "k", "model": "m", "journal": journal, "max_attempts": 1}
    with ScriptedServer(responder) as srv:
        t0 = time.perf_counter()
        if mode == "replay":
            res = replay("R", journal=journal)
        elif mode == "resume":
            res = resume("F", base_url=srv.base_url, **o)
        else:
            try:
                res = rlm.completion(Path(directory), "How many files and characters?",
                                     base_url=srv.base_url, run_id="R" if mode == "run" else "F",
                                     **o)
            except rlm.EndpointError as exc:
                return {"seconds": time.perf_counter() - t0, "status": "failed",
                        "error": str(exc)[:80], "host_peak_mb": _peak_mb(), "sent": srv.count}
        dt = time.perf_counter() - t0
        return {"seconds": dt, "status": res.status, "answer": res.answer,
                "replayed_calls": res.replayed_calls, "sent": srv.count,
                "host_peak_mb": _peak_mb()}


def _in_child(*args: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "evals.bench_context", "--child", *args],
                       capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10,100,1000", help="MB, comma-separated")
    ap.add_argument("--dir", default=None, help="where to generate (default: system temp)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        kind, *rest = a.child
        out = child_load(*rest) if kind == "load" else child_run(*rest)
        print(json.dumps(out))
        return 0
    for mb in (int(x) for x in a.sizes.split(",")):
        work = Path(tempfile.mkdtemp(prefix=f"rlm-bench-{mb}mb-", dir=a.dir))
        try:
            data = work / "corpus"
            t0 = time.perf_counter()
            files, nbytes = generate(data, mb)
            print(f"{mb} MB: generated {files} files, {nbytes / 1e6:,.0f} MB in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
            ld = _in_child("load", str(data))
            total = ld["host_s"] + ld["kernel_s"]
            print(f"  load: host walk+check+hash {ld['host_s']:.2f} s, kernel bind "
                  f"{ld['kernel_s']:.2f} s, total {total:.2f} s; {ld['files']} keys, "
                  f"{ld['chars']:,} chars; host peak RSS {ld['host_peak_mb']:.0f} MB "
                  f"({ld['host_peak_mb'] * 2**20 / nbytes:.2f}x "
                  f"the context), kernel peak RSS {ld['kernel_peak_mb']:.0f} MB; "
                  f"copied: {ld['copied']}", flush=True)
            journal = str(work / "journal.sqlite3")
            run = _in_child("run", str(data), journal, "run")
            print(f"  run end to end: {run['seconds']:.2f} s, {run['status']}, "
                  f"answer {run['answer']!r}, host peak RSS {run['host_peak_mb']:.0f} MB", flush=True)
            if 50 <= mb <= 200:
                rp = _in_child("run", str(data), journal, "replay")
                print(f"  replay: {rp['seconds']:.2f} s, {rp['status']}, {rp['replayed_calls']} "
                      f"call(s) from the journal, {rp['sent']} sent, host peak RSS "
                      f"{rp['host_peak_mb']:.0f} MB", flush=True)
                fl = _in_child("run", str(data), journal, "fail")
                rs = _in_child("run", str(data), journal, "resume")
                print(f"  resume after a failed call: first attempt {fl['seconds']:.2f} s "
                      f"({fl['status']}); resume {rs['seconds']:.2f} s, {rs['status']}, "
                      f"{rs['replayed_calls']} call(s) from the journal, {rs['sent']} sent, "
                      f"host peak RSS {rs['host_peak_mb']:.0f} MB", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
