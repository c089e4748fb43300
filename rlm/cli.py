"""The ``rlm`` command line.

Answers go to stdout, progress and errors to stderr. Errors are one clear
message and an exit code, never a traceback (unless ``RLM_DEBUG=1``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

EXIT_CODES = """exit codes:
  0    the run completed with an answer
  1    unexpected internal error (a bug: please report it; RLM_DEBUG=1 shows the traceback)
  2    bad input or options (missing, empty, binary or undecodable context; bad flag)
  3    the model endpoint failed: unreachable, or still failing after retries
  4    a kernel failed beyond recovery (could not start, or kept dying)
  5    a budget cap ended the run (status budget_exceeded; the cap is named on stderr)
  6    replay/resume found a divergence from the journal
  7    the run ended without an answer (iterations exhausted, no FINAL)
  130  interrupted (Ctrl-C)
"""

ENVIRONMENT = """environment:
  OPENAI_BASE_URL   endpoint base URL when --base-url is not given
  OPENAI_API_KEY    API key when --api-key is not given (never passed to kernels)
  RLM_MODEL         model name when --model is not given (with an endpoint)
  RLM_JOURNAL       journal file (default: ~/.local/share/rlm/journal.sqlite3)
  RLM_CACHE_DIR     cache for assembled model weights and token ranks (default ~/.cache/rlm)
  RLM_DEBUG=1       print tracebacks for unexpected errors
"""


def _add_endpoint(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model endpoint (default: the embedded local model)")
    g.add_argument("--model", help="root model name (env RLM_MODEL)")
    g.add_argument("--base-url", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 "
                   "(env OPENAI_BASE_URL)")
    g.add_argument("--api-key", help="API key (env OPENAI_API_KEY)")
    g.add_argument("--sub-model", help="model for llm_query and depth-limit fallbacks "
                   "(default: --model)")
    g.add_argument("--child-model", help="model driving child RLMs (default: --model)")
    g.add_argument("--embedded-model", default=None,
                   choices=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2-135m"],
                   help="embedded model when no endpoint is set (default qwen2.5-coder-0.5b)")
    g.add_argument("--max-attempts", type=int, default=None, metavar="N",
                   help="HTTP attempts per model call, first included, for 429/5xx/timeouts/"
                   "connection errors (default 6; exponential backoff with jitter)")
    g.add_argument("--large", action="store_true",
                   help="use the embedded 1.5B model (same as --embedded-model qwen2.5-coder-1.5b)")


def _add_limits(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("loop, depth and budget")
    g.add_argument("--max-iterations", type=int, default=None, metavar="N",
                   help="turns per RLM loop before a last-turn prompt (default 20; 6 with the "
                   "embedded model, which repeats itself when stuck)")
    g.add_argument("--max-depth", type=int, default=None, metavar="N",
                   help="kernel-bearing levels: 0 no sub-calls, 1 rlm() is a plain completion "
                   "(default), d>1 children get kernels while level+1 < d")
    g.add_argument("--cell-timeout", type=float, default=None, metavar="S",
                   help="seconds per executed code block before the kernel is interrupted (default 60)")
    g.add_argument("--max-output-chars", type=int, default=None, metavar="N",
                   help="characters of cell output shown to the model per turn "
                   "(default 4000; 2000 with the embedded model)")
    g.add_argument("--max-cost", type=float, default=None, metavar="USD",
                   help="cost cap for the whole run tree, in USD")
    g.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="token cap (prompt + completion) for the whole run tree")
    g.add_argument("--max-calls", type=int, default=None, metavar="N",
                   help="cap on model calls for the whole run tree")
    g.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="wall-clock cap for the run, in seconds")
    g.add_argument("--max-children", type=int, default=None, metavar="N",
                   help="cap on items one batched call may start")
    g.add_argument("--concurrency", type=int, default=None, metavar="N",
                   help="model calls in flight at once (default 8)")
    g.add_argument("--pool-size", type=int, default=None, metavar="N",
                   help="pre-started idle kernels for children (default 0 at depth <= 1, else 2)")
    g.add_argument("--price-file", metavar="PATH",
                   help='JSON prices {"model": {"input": USD/1M, "output": USD/1M}}')


def _add_context(p: argparse.ArgumentParser) -> None:
    """The context options of ``rlm run`` (kept together for the option registry)."""
    g = p.add_argument_group("context")
    g.add_argument("--context", required=True, action="append", metavar="PATH",
                   help="a file, a directory, or a quoted glob ('logs/*.log.gz'); repeat for "
                   "several. One file: .json is parsed, .jsonl/.csv/.tsv/.pdf/.html/.gz/.bz2/.xz "
                   "are read by format, anything else is text; '-' reads stdin. A directory, "
                   "glob or several paths: a dict of relative path -> text (.gitignore honoured; "
                   "hidden dirs and virtualenvs skipped; files that are not text are listed, "
                   "not loaded)")
    g.add_argument("--include", action="append", metavar="PATTERN",
                   help="with a directory/glob: load only paths matching this gitignore-style "
                   "pattern ('*.py', 'docs/'); repeatable")
    g.add_argument("--exclude", action="append", metavar="PATTERN",
                   help="with a directory/glob: leave out paths matching this pattern; repeatable")
    g.add_argument("--max-context-bytes", type=int, default=None, metavar="N",
                   help="cap on the context's text, per file and in total (default 2000000000); "
                   "over it, the error names the biggest files")
    g.add_argument("--encoding", default=None, help="text encoding of the context files (default: "
                   "UTF-8, else detected with charset-normalizer and noted for the model)")


def _context_arg(paths: list[str]):
    """``--context`` values -> what :func:`rlm.completion` takes: one Path, ``"-"``, or Paths."""
    from .errors import ConfigError
    if len(paths) == 1:
        return "-" if paths[0] == "-" else Path(paths[0])
    if "-" in paths:
        raise ConfigError("--context - (stdin) cannot be combined with other --context paths")
    return [Path(p) for p in paths]


def _add_recorded_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("--context", metavar="PATH",
                   help="the context file, if it was given on stdin or has moved")
    p.add_argument("--encoding", default=None, help="text encoding of the context "
                   "(default: the one the run was recorded with)")


def _add_journal(p: argparse.ArgumentParser) -> None:
    p.add_argument("--journal", metavar="PATH", help="journal file (env RLM_JOURNAL)")


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the answer")
    v = p.add_mutually_exclusive_group()
    v.add_argument("-v", "--verbose", action="store_true",
                   help="log every model-call attempt and kernel event to stderr")
    v.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="rlm", formatter_class=fmt,
        description="Recursive language models on real Jupyter kernels: the context lives in a "
                    "kernel as `context`, the model writes code to read it and calls sub-models.",
        epilog=EXIT_CODES + "\n" + ENVIRONMENT)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    r = sub.add_parser("run", help="answer a question about a long context", formatter_class=fmt,
                       epilog=EXIT_CODES + "\n" + ENVIRONMENT,
                       description="Load CONTEXT into a Jupyter kernel and let the model answer QUERY "
                                   "by writing code. The answer goes to stdout.")
    _add_context(r)
    r.add_argument("--query", metavar="TEXT", help="the question (optional: else the task is in the context)")
    r.add_argument("--run-id", metavar="ID",
                   help="name the run; an id that finished returns the recorded result, a crashed "
                   "or failed one is resumed")
    r.add_argument("--no-journal", action="store_true", help="do not write a journal")
    _add_endpoint(r)
    _add_limits(r)
    _add_journal(r)
    _add_output(r)

    rs = sub.add_parser("resume", help="resume a crashed, failed or interrupted run from the journal",
                        formatter_class=fmt, epilog=EXIT_CODES)
    _add_recorded_run(rs)
    rs.add_argument("--on-divergence", choices=["stop", "live"], default="stop",
                    help="a recorded call whose request differs: stop with a report (default) or "
                    "go live from that point")
    _add_endpoint(rs)
    _add_journal(rs)
    _add_output(rs)

    rp = sub.add_parser("replay", help="re-execute a finished run with zero model calls",
                        formatter_class=fmt, epilog=EXIT_CODES)
    _add_recorded_run(rp)
    _add_journal(rp)
    _add_output(rp)

    sh = sub.add_parser("show", help="show a run's stage tree with tokens, cost and time")
    sh.add_argument("run_id", metavar="RUN_ID")
    sh.add_argument("--max-level", type=int, default=None,
                    help="show only stages at this depth level or shallower")
    _add_journal(sh)

    ls = sub.add_parser("runs", help="list runs in the journal (newest first)")
    ls.add_argument("--limit", type=int, default=20)
    ls.add_argument("--json", action="store_true")
    _add_journal(ls)

    ex = sub.add_parser("export", help="write a run as JSON Lines (one record per stage and event)")
    ex.add_argument("run_id", metavar="RUN_ID")
    ex.add_argument("-o", "--output", metavar="PATH", help="output file (default stdout)")
    _add_journal(ex)
    return parser


class _Progress:
    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[rlm] {msg}", file=sys.stderr, flush=True)


def _setup_logging(args) -> None:
    level = logging.INFO if getattr(args, "verbose", False) else logging.WARNING
    logging.basicConfig(level=level, format="[rlm] %(message)s", stream=sys.stderr)
    logging.getLogger("rlm").setLevel(level)
    for noisy in ("httpx", "openai", "httpcore", "traitlets", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _run_options(args) -> dict:
    o = {
        "model": args.model, "base_url": args.base_url, "api_key": args.api_key,
        "sub_model": args.sub_model, "child_model": args.child_model,
        "embedded_model": "qwen2.5-coder-1.5b" if args.large else args.embedded_model,
    }
    for a, k in (("max_iterations", "max_iterations"), ("max_depth", "max_depth"),
                 ("cell_timeout", "cell_timeout"), ("max_output_chars", "max_output_chars"),
                 ("max_cost", "max_cost_usd"), ("max_tokens", "max_tokens"),
                 ("max_calls", "max_calls"), ("timeout", "max_wall_seconds"),
                 ("max_children", "max_children_per_call"), ("concurrency", "max_concurrency"),
                 ("pool_size", "pool_size"), ("price_file", "price_file"),
                 ("max_attempts", "max_attempts")):
        if getattr(args, a, None) is not None:
            o[k] = getattr(args, a)
    return {k: v for k, v in o.items() if v is not None}


def _journal_opt(args):
    if getattr(args, "no_journal", False):
        return False
    return args.journal or None


def _emit(res, args, summary: bool = True) -> int:
    if args.json:
        print(json.dumps(res.to_dict(), ensure_ascii=False))
    elif res.answer is not None and res.status == "completed":
        print(res.answer)
    if res.status == "completed":
        if summary and not args.json and not args.quiet:
            u = res.usage
            print(f"[rlm] run {res.run_id}: completed in {res.seconds:.1f} s, {res.iterations} "
                  f"iteration(s), {u.get('calls', 0)} model call(s), {u.get('total_tokens', 0)} "
                  f"tokens, ${u.get('cost_usd', 0):.4f}", file=sys.stderr)
        return 0
    if res.status == "budget_exceeded":
        print(f"rlm: budget cap '{res.cap}' ended run {res.run_id}: {res.reason}", file=sys.stderr)
        if res.answer and not args.json:
            print(f"rlm: partial answer (last model reply): {res.answer[:500]}", file=sys.stderr)
        return 5
    if res.status == "cancelled":
        return 130
    print(f"rlm: run {res.run_id} ended without an answer: {res.reason}", file=sys.stderr)
    return 7


def _cmd_run(args) -> int:
    from .api import RLM
    progress = _Progress(args.quiet)
    o = _run_options(args)
    o["journal"] = _journal_opt(args)
    o["encoding"] = args.encoding
    for a in ("include", "exclude", "max_context_bytes"):
        if getattr(args, a) is not None:
            o[a] = getattr(args, a)
    if args.run_id:
        o["run_id"] = args.run_id
    o["on_progress"] = progress
    context = _context_arg(args.context)
    with RLM(**o) as r:
        res = r.completion(context, args.query)
    return _emit(res, args)


def _cmd_resume(args) -> int:
    from .api import resume
    o = _run_options(args)
    o["journal"] = args.journal or None
    o["divergence"] = args.on_divergence
    if args.encoding:
        o["encoding"] = args.encoding
    o["on_progress"] = _Progress(args.quiet)
    res = resume(args.run_id, context=Path(args.context) if args.context else None, **o)
    return _emit(res, args)


def _cmd_replay(args) -> int:
    from .api import replay
    res = replay(args.run_id, journal=args.journal or None,
                 context=Path(args.context) if args.context else None,
                 encoding=args.encoding, on_progress=_Progress(args.quiet))
    if not args.quiet and not args.json:
        print(f"[rlm] replay of {args.run_id}: same outcome ({res.status}), "
              f"{res.replayed_calls} model call(s) served from the journal, 0 sent",
              file=sys.stderr)
    return _emit(res, args, summary=False)


def _journal(args):
    from .api import _open_journal
    return _open_journal(args.journal or None)


def _cmd_show(args) -> int:
    from harness.stages import StageTree
    from .errors import ConfigError
    j = _journal(args)
    rec = j.get_run(args.run_id)
    if rec is None:
        raise ConfigError(f"no run {args.run_id!r} in journal {j.path}; list runs with `rlm runs`")
    tree = StageTree.from_records(args.run_id, j.stages(args.run_id))
    print(f"run {args.run_id}  state={rec['state']}  query={rec.get('query')!r}")
    if rec.get("answer") is not None:
        print(f"answer: {rec['answer']}")
    text = tree.render(max_level=args.max_level)
    print(text)
    return 0


def _cmd_runs(args) -> int:
    import time
    j = _journal(args)
    runs = j.list_runs(limit=args.limit)
    if args.json:
        print(json.dumps(runs, ensure_ascii=False, default=str))
        return 0
    if not runs:
        print(f"no runs in {j.path}")
        return 0
    print(f"{'RUN ID':<18} {'STARTED':<19} {'STATE':<15} {'DEPTH':>5} {'COST $':>9}  MODEL / QUERY")
    for r in runs:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.get("created_at") or 0))
        cost = (r.get("usage") or {}).get("cost_usd") or 0.0
        q = (r.get("query") or "").replace("\n", " ")
        print(f"{r['run_id']:<18} {started:<19} {r['state']:<15} {r.get('max_depth', ''):>5} "
              f"{cost:>9.4f}  {r.get('model')} / {q[:60]}")
    return 0


def _cmd_export(args) -> int:
    from .errors import ConfigError
    j = _journal(args)
    if j.get_run(args.run_id) is None:
        raise ConfigError(f"no run {args.run_id!r} in journal {j.path}")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            n = j.export_jsonl(args.run_id, f)
        print(f"[rlm] wrote {n} records to {args.output}", file=sys.stderr)
    else:
        j.export_jsonl(args.run_id, sys.stdout)
    return 0


def _terminate(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rlm`` console script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    _setup_logging(args)
    # SIGTERM (a workflow engine stopping the step) cleans up like Ctrl-C: kernels are shut
    # down and the run is journaled as cancelled, so the same run id resumes it later.
    signal.signal(signal.SIGTERM, _terminate)
    from harness.errors import HarnessError

    from .errors import RLMError
    handlers = {"run": _cmd_run, "resume": _cmd_resume, "replay": _cmd_replay,
                "show": _cmd_show, "runs": _cmd_runs, "export": _cmd_export}
    try:
        return handlers[args.command](args)
    except BrokenPipeError:
        # stdout closed early (e.g. piped into `head`): not an error of the run
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except KeyboardInterrupt:
        print("rlm: interrupted; every kernel of the run was shut down. Resume with "
              "`rlm resume RUN_ID` (see `rlm runs`).", file=sys.stderr)
        return 130
    except (RLMError, HarnessError) as exc:
        print(f"rlm: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)
    except OSError as exc:
        print(f"rlm: error: {exc.strerror or exc} ({getattr(exc, 'filename', '') or ''}); "
              "check the path, free disk space and permissions", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug: say so plainly
        if os.environ.get("RLM_DEBUG"):
            raise
        print(f"rlm: internal error: {type(exc).__name__}: {exc} (set RLM_DEBUG=1 for the "
              "traceback and please report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
