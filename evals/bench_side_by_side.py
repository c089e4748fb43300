"""This harness and the reference implementation, side by side, in one interleaved run.

Run: ``python -m evals.bench_side_by_side [--reps N] [--quick] [--out FILE.md]`` with this
project's virtual environment (``.venv/bin/python -m evals.bench_side_by_side``).

What it does:

1. Makes sure the reference implementation, ``rlms==0.1.3`` from the package registry with its
   ``ipython`` extra (jupyter_client, ipykernel), is installed in its own virtual environment
   (``~/.cache/rlm/bench-ref-venv``, created once and reused; ``--ref-venv`` moves it). Its
   import name is ``rlm`` too, so it never shares an interpreter with this project.
2. Starts ONE scripted OpenAI-compatible endpoint in its own process
   (``evals/side_by_side_server.py``): the base URL names the script and the latency.
3. For every repetition and every figure, runs each harness in a fresh process
   (``evals/side_by_side_worker.py`` through the public API, or the ``rlm`` command), the two
   harnesses alternating which goes first, so drift on a shared machine hits both alike.
   This project's runs write a journal (the default; one journal file for the whole benchmark,
   as a user's default journal is), except the explicit journal-off row. The reference runs
   its IPython environment with a subprocess kernel (``kernel_mode="subprocess"``): a real
   Jupyter kernel, like this project's. Before the first measurement, this project's bytecode
   cache is written (:func:`byte_compile_ours`), as pip wrote the reference's at install.
4. Prints min and median per figure and the ratio of medians (ours / reference), then a
   Markdown table (written to ``--out`` too), with the targets of issue 10.

The figures (what a user pays, whole calls or whole processes):

- *sub-call overhead beyond a direct client call*: inside the root's kernel, a cell times
  ``llm_query("ping")`` 200 times after 20 warm-up calls, latency 0; the worker process (the
  host) times 200 direct ``openai`` client calls to the same endpoint, half before the run and
  half after it; the figure is median(llm_query) - median(direct) in that process (and, less
  sensitive to load, fastest minus fastest). Ours with the journal on and off. (A direct call
  timed *inside* a kernel is no baseline: ipykernel's own threads compete for its GIL.)
- *whole child minus one plain call*: inside the root's kernel (``max_depth=2``), the time of
  ``rlm("child context")`` (ours) / ``rlm_query(...)`` (reference) whose child answers in its
  first turn, minus the median ``llm_query`` in the same process. "Right after run start" is
  the root's first action; "warm pool" is the median of 2 more children, each after a 1.5 s
  pause (the reference has no pool: every child starts a kernel).
- *64 sub-calls at 200 ms*: one ``llm_query_batched`` of 64 prompts, latency 200 ms,
  concurrency 16 (ours ``max_concurrency=16``; the reference's batch concurrency is 16),
  timed in the kernel; ideal 64 / 16 x 0.2 s = 0.80 s.
  A diagnostic row times the same 64 calls made with the ``openai`` client alone
  (``chat.completions.create`` on 16 threads sharing one client, after one untimed call, in
  this project's venv, the same client version as the reference's): the floor the client's own
  CPU per call sets.
- *50 MB context extra wall over 1 KB*: wall time of a one-turn ``completion`` call given the
  context as a ``str`` (read from a file by the worker before the call), 50 MB minus 1 KB;
  eight pairs per repetition (two with ``--quick``).
- *trivial one-turn run, process start to exit*: ours as ``rlm run`` (and, extra row, a
  Python script calling ``rlm.completion``), the reference as a Python script calling
  ``RLM(...).completion``.
- *replay* (ours only): ``rlm replay`` of a finished 200-call run (one root turn running 199
  sequential ``llm_query`` at 50 ms latency) as a fraction of that run's own ``rlm run`` wall
  time; the endpoint's request count checks that the replay sent nothing.

A full run (3 repetitions) takes about 6 minutes on 2 idle cores (15 with other jobs loading
them); ``--quick`` (2 repetitions, fewer samples, a 50-call replay) is for development.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
SERVER = HERE / "side_by_side_server.py"
WORKER = HERE / "side_by_side_worker.py"
REF_SPEC = "rlms[ipython]==0.1.3"
REF_VERSION = "0.1.3"
DEFAULT_REF_VENV = Path.home() / ".cache" / "rlm" / "bench-ref-venv"
QUERY = "BENCH-ROOT {}: answer by running the code."
PROC_TIMEOUT = 300.0
#: small/big context pairs per harness and repetition (the figure is a difference of medians)
CONTEXT_PAIRS = 8


# -- the reference implementation's environment --------------------------------------------

def ref_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ref_ready(venv: Path) -> bool:
    py = ref_python(venv)
    if not py.exists():
        return False
    check = ("import importlib.metadata as m, jupyter_client, ipykernel; "
             f"assert m.version('rlms') == {REF_VERSION!r}")
    return subprocess.run([str(py), "-c", check], cwd=tempfile.gettempdir(),
                          capture_output=True).returncode == 0


def ensure_ref_venv(venv: Path) -> Path:
    """The reference's interpreter, installing ``rlms[ipython]==0.1.3`` into ``venv`` once."""
    if ref_ready(venv):
        return ref_python(venv)
    print(f"installing the reference implementation ({REF_SPEC}) into {venv} ...", flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", None) or sys.executable
    if not ref_python(venv).exists():
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(ref_python(venv)), "-m", "pip", "install", "-q", REF_SPEC], check=True)
    if not ref_ready(venv):
        raise SystemExit(f"the reference implementation did not install into {venv}")
    return ref_python(venv)


# -- the scripted endpoint, another process ---------------------------------------------------

class Endpoint:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(SERVER)], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True,
                                     cwd=tempfile.gettempdir())
        line = self.proc.stdout.readline()  # "PORT <n>"
        if not line.startswith("PORT "):
            self.close()
            raise SystemExit(f"the scripted endpoint did not start: {line!r}")
        self.port = int(line.split()[1])

    def url(self, harness: str, scenario: str, latency_ms: int = 0) -> str:
        return f"http://127.0.0.1:{self.port}/{harness}/{scenario}/{latency_ms}/v1"

    def stats(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/stats", timeout=30) as r:
            return json.loads(r.read())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# -- one fresh process per measurement --------------------------------------------------------

def child_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OPENAI_", "RLM_")) and k not in ("PYTHONPATH",)}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def timed(argv: list[str], cwd: str) -> tuple[float, str, str]:
    """Run ``argv`` to its exit; (wall seconds from spawn to exit, stdout, stderr)."""
    t0 = time.perf_counter()
    p = subprocess.run(argv, cwd=cwd, env=child_env(), capture_output=True, text=True,
                       timeout=PROC_TIMEOUT)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited {p.returncode}:\n"
                           f"{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return wall, p.stdout, p.stderr


class Bench:
    def __init__(self, args) -> None:
        self.quick = args.quick
        self.ref_py = str(ensure_ref_venv(Path(args.ref_venv).expanduser()))
        self.ours_py = sys.executable
        self.rlm_cli = str(Path(sys.executable).parent / "rlm")
        if not Path(self.rlm_cli).exists():
            raise SystemExit(f"no `rlm` command next to {sys.executable}: run this with the "
                             "project's venv (.venv/bin/python -m evals.bench_side_by_side)")
        self.dir = tempfile.mkdtemp(prefix="rlm-sbs-")
        self.cwd = os.path.join(self.dir, "cwd")
        os.makedirs(self.cwd)
        self.journal = os.path.join(self.dir, "journal.sqlite3")
        self.ctx_small = os.path.join(self.dir, "context-1kb.txt")
        self.ctx_big = os.path.join(self.dir, "context-50mb.txt")
        write_text(self.ctx_small, 1_000)
        write_text(self.ctx_big, args.context_mb * 1_000_000)
        self.context_mb = args.context_mb
        self.ep = Endpoint()
        self.replay_calls = 50 if self.quick else 200
        self.n = 0

    def close(self) -> None:
        self.ep.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # one worker process: the run's answer, the call time, the read time, the process wall
    def worker(self, harness: str, scenario: str, latency_ms: int = 0, **opts) -> dict:
        py = self.ours_py if harness == "ours" else self.ref_py
        if harness == "ours" and "journal" not in opts:
            opts["journal"] = self.journal
        wall, out, err = timed([py, str(WORKER), harness, scenario,
                                self.ep.url(harness, scenario, latency_ms), json.dumps(opts)],
                               self.cwd)
        line = next((ln for ln in out.splitlines() if ln.startswith("BENCH-RESULT ")), None)
        if line is None:
            raise RuntimeError(f"{harness} {scenario}: no result\n{out[-2000:]}\n{err[-3000:]}")
        res = json.loads(line[len("BENCH-RESULT "):])
        if str(res["answer"]).startswith("BENCH-FAILED"):
            raise RuntimeError(f"{harness} {scenario}: the root's code failed: {res['answer']}")
        res["wall"] = wall
        return res

    def inner(self, harness: str, scenario: str, latency_ms: int = 0, **opts) -> dict:
        """The root's in-kernel timings (its answer is JSON), plus the worker's own."""
        res = self.worker(harness, scenario, latency_ms, **opts)
        return dict(json.loads(res["answer"]), worker=res)

    def cli_run(self, scenario: str, latency_ms: int, run_id: str | None = None) -> float:
        argv = [self.rlm_cli, "run", "--context", self.ctx_small, "--query",
                QUERY.format(scenario), "--base-url", self.ep.url("ours", scenario, latency_ms),
                "--api-key", "bench", "--model", "bench", "--journal", self.journal]
        if run_id:
            argv += ["--run-id", run_id]
        wall, out, _ = timed(argv, self.cwd)
        if "BENCH-FAILED" in out:
            raise RuntimeError(f"ours {scenario} (rlm run): {out[-2000:]}")
        return wall

    # -- the figures: each returns {variant: value} for one repetition -----------------------

    def fig_subcall(self, order) -> dict:
        sc = "subcall-quick" if self.quick else "subcall"
        got = {}
        for h in order(["ours", "ours-nojournal", "ref"]):
            harness = "ref" if h == "ref" else "ours"
            direct_url = self.ep.url(harness, "direct")
            extra = {"journal": False} if h == "ours-nojournal" else {}
            r = self.inner(harness, sc + (".nojournal" if extra else ""), direct_url=direct_url,
                           direct_n=60 if self.quick else 200, **extra)
            direct = r["worker"]["direct"]
            got[h] = (r["sub"] - statistics.median(direct)) * 1e3
            got[h + ":direct"] = statistics.median(direct) * 1e3
            got[h + ":llm_query"] = r["sub"] * 1e3
            got[h + ":min-based"] = (r["sub_min"] - min(direct)) * 1e3
        return got

    def fig_child(self, order) -> dict:
        sc = "child-quick" if self.quick else "child"
        got = {}
        for h in order(["ours", "ref"]):
            r = self.inner(h, sc, max_depth=2)
            got[h + ":first"] = (r["first"] - r["plain"]) * 1e3
            got[h + ":warm"] = (r["child"] - r["plain"]) * 1e3
        return got

    def fig_fanout(self, order) -> dict:
        got = {}
        for h in order(["ours", "direct", "ref"]):
            if h == "direct":  # the openai client alone on 16 threads, in our venv
                got[h] = self.inner("ours", "fanout-direct", 200, n=64, concurrency=16)["fanout"]
            else:
                got[h] = self.inner(h, "fanout", 200, concurrency=16)["fanout"]
        return got

    def fig_context(self, order) -> dict:
        """:data:`CONTEXT_PAIRS` small/big pairs per harness (a call's own start-up varies by
        +-0.3 s here, more than the figure: with three, one run's median of the reference's
        figure was below zero, and with five this project's ranged 0.02-0.26 s over three
        repetitions); the time of the ``completion`` call in the worker (process start,
        imports and exit cost the same for both sizes and only add noise)."""
        calls: dict = {}
        for _ in range(2 if self.quick else CONTEXT_PAIRS):
            for size, path in order([("small", self.ctx_small), ("big", self.ctx_big)]):
                for h in order(["ours", "ref"]):
                    r = self.worker(h, "context." + size, context_file=path)
                    expect = os.path.getsize(path)  # ASCII: characters == bytes
                    if int(r["answer"]) != expect:
                        raise RuntimeError(f"{h}: context length {r['answer']} != {expect}")
                    calls.setdefault((h, size), []).append(r["t_call"])
        return {h: statistics.median(calls[(h, "big")]) - statistics.median(calls[(h, "small")])
                for h in ("ours", "ref")}

    def fig_trivial(self, order) -> dict:
        got = {}
        for h in order(["ours", "ours-api", "ref"]):
            if h == "ours":
                got[h] = self.cli_run("trivial", 0)
            else:
                got[h] = self.worker("ours" if h == "ours-api" else "ref", "trivial")["wall"]
        return got

    def fig_replay(self, order) -> dict:
        self.n += 1
        sc = "replay-quick" if self.quick else "replay"
        run_id = f"sbs-replay-{os.getpid()}-{self.n}"
        run = self.cli_run(sc, 50, run_id)
        before = self.ep.stats().get(f"ours/{sc}", 0)
        replay, out, _ = timed([self.rlm_cli, "replay", run_id, "--journal", self.journal],
                               self.cwd)
        sent = self.ep.stats().get(f"ours/{sc}", 0) - before
        return {"ours": replay / run, "ours:run": run, "ours:replay": replay, "ours:sent": sent}

    def warm_up(self) -> None:
        """Byte-compiles this project's packages, then one untimed run of each harness (page
        cache, journal schema)."""
        byte_compile_ours(self.ours_py)
        self.worker("ours", "trivial")
        self.worker("ref", "trivial")
        self.cli_run("trivial", 0)


def byte_compile_ours(python: str) -> None:
    """Write the bytecode cache of this project's packages (``rlm``, ``kernels``, ``harness``),
    as ``pip install`` does for a regular install and did for the reference's venv.

    An editable install (``pip install -e``, what ``scripts/*.sh`` make) leaves the cache to
    the first import, and on a machine with ``PYTHONDONTWRITEBYTECODE`` set (this one) it is
    never written: every process, the host's and every kernel's, then compiles the project's
    sources again, about 0.1 s of CPU per process here, which a user's install does not pay.
    A no-op when the cache is current; a warning when the directory is read-only."""
    code = ("import compileall, os, sys, kernels, harness, rlm\n"
            "ok = all(compileall.compile_dir(os.path.dirname(m.__file__), quiet=1)\n"
            "         for m in (rlm, kernels, harness))\n"
            "sys.exit(0 if ok else 1)")
    env = {k: v for k, v in child_env().items() if k != "PYTHONDONTWRITEBYTECODE"}
    if subprocess.run([python, "-c", code], env=env, cwd=tempfile.gettempdir()).returncode:
        print("warning: this project's bytecode cache could not be written everywhere; its "
              "start-up figures include compiling its sources", file=sys.stderr, flush=True)


def write_text(path: str, n: int) -> None:
    """``n`` characters of varied ASCII text with a line structure, deterministic."""
    words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron "
             "pi rho sigma tau upsilon phi chi psi omega").split()
    lines, size, i = [], 0, 0
    while size < n:
        ln = f"{i:08d} " + " ".join(words[(i * 7 + k) % len(words)] for k in range(12)) + "\n"
        lines.append(ln)
        size += len(ln)
        i += 1
    Path(path).write_text("".join(lines)[:n], encoding="ascii")


# -- statistics and the table ----------------------------------------------------------------

FIGURES = ["subcall", "child", "fanout", "context", "trivial", "replay"]


def summarize(samples: dict[str, list[float]]):
    return {k: (min(v), statistics.median(v)) for k, v in samples.items() if v}


def fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "ms":
        return f"{v:,.2f} ms" if abs(v) < 10 else f"{v:,.0f} ms"
    if unit == "s":
        return f"{v:.3f} s" if abs(v) < 10 else f"{v:.2f} s"
    if unit == "%":
        return f"{v * 100:.1f}%"
    return f"{v:.3g}"


def rows(stats: dict, quick: bool) -> list[dict]:
    """Table rows: label, unit, ours key, reference key, target (ratio or absolute)."""
    fan_ideal = 0.80
    nrep = "50" if quick else "200"
    spec = [
        ("sub-call overhead beyond a direct client call, journal on (default)", "ms",
         "subcall:ours", "subcall:ref", ("ratio", 0.5)),
        ("sub-call overhead beyond a direct client call, journal off", "ms",
         "subcall:ours-nojournal", "subcall:ref", ("ratio", 0.3)),
        ("  `llm_query` round trip timed in the kernel, median of 200 (no baseline "
         "subtracted), journal on", "ms", "subcall:ours:llm_query", "subcall:ref:llm_query",
         None),
        ("  the same, journal off", "ms", "subcall:ours-nojournal:llm_query",
         "subcall:ref:llm_query", None),
        ("  the same, fastest llm_query minus fastest direct call of the 200 (less sensitive "
         "to load), journal on", "ms", "subcall:ours:min-based", "subcall:ref:min-based",
         ("ratio", 0.5)),
        ("  the same, fastest minus fastest, journal off", "ms",
         "subcall:ours-nojournal:min-based", "subcall:ref:min-based", ("ratio", 0.3)),
        ("whole child (`rlm()` answering in its first turn) minus one plain call, right after "
         "run start", "ms", "child:ours:first", "child:ref:first", ("ratio", 0.05)),
        ("whole child minus one plain call, warm pool", "ms", "child:ours:warm",
         "child:ref:warm", ("ratio", 0.03)),
        ("64 sub-calls at 200 ms latency, concurrency 16 (ideal 0.80 s)", "s", "fanout:ours",
         "fanout:ref", ("abs", 1.05 * fan_ideal)),
        ("  the same 64 calls made with the `openai` client alone on 16 threads, no harness "
         "(in the 'ours' columns; both harnesses use this client version)", "s",
         "fanout:direct", None, None),
        ("50 MB context: extra wall over a 1 KB context", "s", "context:ours", "context:ref",
         ("ratio", 0.5)),
        ("trivial one-turn run, process start to exit (`rlm run`)", "s", "trivial:ours",
         "trivial:ref", ("ratio", 0.35)),
        ("trivial one-turn run, process start to exit (`rlm.completion` script)", "s",
         "trivial:ours-api", "trivial:ref", ("ratio", 0.35)),
        (f"`rlm replay` of a {nrep}-call run at 50 ms latency, fraction of the run's wall "
         "(ours only)", "%", "replay:ours", None, ("abs", 0.05)),
    ]
    out = []
    for label, unit, ok, rk, goal in spec:
        kind, tgt = goal or (None, None)
        o = stats.get(ok)
        r = stats.get(rk) if rk else None
        ratio = o[1] / r[1] if o and r and r[1] > 0 else None
        if kind is None:  # a diagnostic row: no target of its own
            out.append({"label": label, "ours": o, "ref": r, "ratio": ratio, "target": "-",
                        "meets": None, "unit": unit})
            continue
        if kind == "ratio":
            target = f"<= {tgt}x"
            meets = ratio is not None and ratio <= tgt
        else:
            target = f"<= {fmt(tgt, unit)}"
            meets = o is not None and o[1] <= tgt
        if ok == "fanout:ours" and o:
            target += f" (1.05x the ideal; ours {o[1] / fan_ideal:.2f}x)"
        if ok == "replay:ours" and "replay:ours:sent" in stats:
            target += f", {int(stats['replay:ours:sent'][1])} requests sent"
            meets = meets and stats["replay:ours:sent"][1] == 0
        out.append({"label": label, "ours": o, "ref": r, "ratio": ratio, "target": target,
                    "meets": meets if o else None, "unit": unit})
    return out


def markdown(table: list[dict], header: str) -> str:
    lines = [header, "",
             "| figure | ours min | ours median | reference min | reference median | "
             "ratio (ours/ref, medians) | target | meets |",
             "|---|---|---|---|---|---|---|---|"]
    for r in table:
        o, ref, u = r["ours"], r["ref"], r["unit"]
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r["label"], fmt(o and o[0], u), fmt(o and o[1], u), fmt(ref and ref[0], u),
            fmt(ref and ref[1], u), f"{r['ratio']:.3f}" if r["ratio"] is not None else "-",
            r["target"], {True: "yes", False: "**no**", None: "-"}[r["meets"]]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals.bench_side_by_side",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 3; 2 quick)")
    ap.add_argument("--quick", action="store_true", help="fewer samples, for development")
    ap.add_argument("--out", help="also write the Markdown table to this file")
    ap.add_argument("--json", dest="json_out", help="write every raw sample as JSON here")
    ap.add_argument("--ref-venv", default=str(DEFAULT_REF_VENV),
                    help=f"the reference implementation's venv (default {DEFAULT_REF_VENV})")
    ap.add_argument("--from-json", help="print the table from samples saved with --json "
                                        "(no runs)")
    ap.add_argument("--context-mb", type=int, default=50, help=argparse.SUPPRESS)
    ap.add_argument("--only", help="comma-separated figures (" + ",".join(FIGURES) + ")")
    args = ap.parse_args(argv)
    reps = args.reps or (2 if args.quick else 3)
    figures = args.only.split(",") if args.only else FIGURES
    t_start = time.perf_counter()
    if args.from_json:
        samples = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
        reps = max(len(v) for v in samples.values())
        return report(samples, reps, args, t_start)
    bench = Bench(args)
    samples: dict[str, list[float]] = {}
    try:
        print(f"endpoint on port {bench.ep.port}; reference: {bench.ref_py}; "
              f"{reps} repetitions; work dir {bench.dir}", flush=True)
        bench.warm_up()
        for rep in range(reps):
            # alternate which harness (and which context size) goes first
            def order(xs, rep=rep):
                return list(xs) if rep % 2 == 0 else list(reversed(xs))
            for fig in figures:
                t0 = time.perf_counter()
                got = getattr(bench, "fig_" + fig)(order)
                for k, v in got.items():
                    samples.setdefault(f"{fig}:{k}", []).append(v)
                print(f"rep {rep + 1}/{reps} {fig:8s} ({time.perf_counter() - t0:5.1f} s): "
                      + ", ".join(f"{k} {v:.4g}" for k, v in got.items()), flush=True)
    finally:
        bench.close()
    return report(samples, reps, args, t_start)


def report(samples: dict[str, list[float]], reps: int, args, t_start: float) -> int:
    stats = summarize(samples)
    print("\nall samples (min / median):")
    for k in sorted(stats):
        print(f"  {k:32s} {stats[k][0]:10.4g} {stats[k][1]:10.4g}   n={len(samples[k])}")
    table = rows(stats, args.quick)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    header = (f"Side by side with the reference implementation (rlms {REF_VERSION}, IPython "
              f"environment, subprocess kernel), one scripted endpoint in its own process, "
              f"{reps} interleaved repetitions, each measurement a fresh process; "
              f"{os.cpu_count()} cores; {when}; {'--quick; ' if args.quick else ''}"
              + (f"from {args.from_json}." if args.from_json else
                 f"total {time.perf_counter() - t_start:.0f} s."))
    md = markdown(table, header)
    print()
    print(md)
    if args.out:
        Path(args.out).write_text(md, encoding="utf-8")
    if args.json_out and not args.from_json:
        Path(args.json_out).write_text(json.dumps(samples, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
