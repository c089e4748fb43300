"""The ``rlm`` command line.

Answers go to stdout, progress and errors to stderr. Errors are one clear
message and an exit code, never a traceback (unless ``RLM_DEBUG=1``). The flags of the run
options come from :data:`rlm.config.options.OPTIONS` (:mod:`rlm.config.flags`).
"""
from __future__ import annotations

import argparse
import json
import importlib
import logging
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rlm.config.argtypes import whole_number
from rlm.cli.argv_secrets import hide_secret_flags
from rlm.config.flags import add_arguments, options_from_args

# the command names of rlm.config.options (RUN, RESUME, REPLAY); the option registry itself is
# imported where it is used, so `rlm run` can start its kernel before that import
RUN, RESUME, REPLAY = "run", "resume", "replay"

EXIT_CODES = """exit codes:
  0    the run completed with an answer
  1    unexpected internal error (a bug: please report it; RLM_DEBUG=1 shows the traceback)
  2    bad input or options (missing, empty, binary or undecodable context; bad flag)
  3    the model endpoint failed: unreachable, or still failing after retries
  4    a kernel failed beyond recovery (could not start, or kept dying)
  5    a budget cap ended the run (status budget_exceeded; the cap is named on stderr)
  6    replay/resume found a divergence from the journal
  7    the run ended without an answer (no FINAL in its iterations, or the model repeated itself)
  8    rlm verify found a violation (the first bad event is named on stderr)
  9    the journal failed under the run (connection lost, disk full, locked, removed) and
       stayed down past RLM_JOURNAL_RETRY_SECONDS; `rlm resume` it once the journal is back
  10   resume stopped at a tool call that may have run already (its tool is not idempotent)
  130  interrupted (Ctrl-C or SIGTERM); the run can be resumed
"""

#: The help of the RUN_ID argument of resume, replay, show, export, view.
RUN_ID_HELP = "the run's id, as printed when it started and listed by rlm runs"

ENVIRONMENT = """environment:
  OPENAI_BASE_URL   endpoint base URL when --base-url is not given
  OPENAI_API_KEY    API key when --api-key is not given (never passed to kernels)
  RLM_MODEL         model name when --model is not given (with an endpoint)
  RLM_JOURNAL       journal: a SQLite file or a postgresql:// URL
                    (default: ~/.local/share/rlm/journal.sqlite3)
  RLM_JOURNAL_RETRY_SECONDS  how long a run waits out a journal fault (default 30)
  RLM_HOST          host name recorded as a run's owner (default: the machine's host name)
  RLM_CACHE_DIR     cache for assembled model weights and token ranks (default ~/.cache/rlm)
  RLM_DEBUG=1       print tracebacks for unexpected errors
  RLM_KERNEL_USER   user kernels run as when the host is root (default: one per kernel)
"""


_positive_int = whole_number(1, 1_000_000)


def _context_arg(paths: list[str]):
    """``--context`` values -> what :func:`rlm.completion` takes: one Path, ``"-"``, or Paths."""
    from rlm.errors import ConfigError
    if any(not p for p in paths):  # Path("") would be the current directory
        raise ConfigError("--context '' is an empty path: give a file, a directory or '-' "
                          "for stdin")
    if len(paths) == 1:
        return "-" if paths[0] == "-" else Path(paths[0])
    if "-" in paths:
        raise ConfigError("--context - (stdin) cannot be combined with other --context paths")
    return [Path(p) for p in paths]


def _add_recorded_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_id", metavar="RUN_ID", help=RUN_ID_HELP)
    p.add_argument("--context", metavar="PATH",
                   help="the context (file or directory), if it was given on stdin or has moved")


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the answer")
    v = p.add_mutually_exclusive_group()
    v.add_argument("-v", "--verbose", action="store_true",
                   help="log every model-call attempt and kernel event to stderr")
    v.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are two lines: the problem, and where the flags are
    (``run`` has some sixty flags: its whole usage would bury the one line that matters).
    ``subcommands``: the subcommands' parsers by name (the top-level parser's)."""

    subcommands: dict | None = None

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists its flags)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``rlm`` argument parser: every subcommand, with the option flags from the registry
    (:data:`rlm.config.options.OPTIONS`) and the view flags from :mod:`rlm.cli.views`."""
    fmt = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog="rlm", formatter_class=fmt,
        description="Recursive language models on real Jupyter kernels: the context lives in a "
                    "kernel as `context`, the model writes code to read it and calls sub-models.",
        epilog=EXIT_CODES + "\n" + ENVIRONMENT)
    from rlm.version import __version__
    parser.add_argument("--version", action="version", version=f"rlm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.subcommands = sub.choices  # name -> its parser, filled as they are added

    r = sub.add_parser("run", help="answer a question about a long context", formatter_class=fmt,
                       epilog=EXIT_CODES + "\n" + ENVIRONMENT,
                       description="Load CONTEXT into a Jupyter kernel and let the model answer QUERY "
                                   "by writing code. The answer goes to stdout.")
    r.add_argument("--context", required=True, action="append", metavar="PATH",
                   help="a file, a directory, or a quoted glob ('logs/*.log.gz'); repeat for "
                   "several. One file: .json and .toml are parsed, .jsonl/.csv/.tsv/.pdf/.html/.gz/.bz2/"
                   ".xz are read by format, anything else is text; '-' reads stdin. A directory, "
                   "glob or several paths: a dict of relative path -> text (.gitignore honoured; "
                   "hidden dirs and virtualenvs skipped; files that are not text are listed, "
                   "not loaded)")
    r.add_argument("--query", metavar="TEXT", help="the question (optional: else the task is in the context)")
    add_arguments(r, RUN)  # every option flag: see rlm/config/options.py
    _add_output(r)

    rs = sub.add_parser("resume", help="resume a crashed, failed or interrupted run from the journal",
                        formatter_class=fmt, epilog=EXIT_CODES)
    _add_recorded_run(rs)
    add_arguments(rs, RESUME)
    _add_output(rs)

    rp = sub.add_parser("replay", help="re-execute a finished run with zero model calls",
                        formatter_class=fmt, epilog=EXIT_CODES)
    _add_recorded_run(rp)
    add_arguments(rp, REPLAY)
    _add_output(rp)

    sh = sub.add_parser("show", help="show a run's stage tree with tokens, cost and time")
    sh.add_argument("run_id", metavar="RUN_ID", help=RUN_ID_HELP)
    sh.add_argument("--max-level", type=int, default=None,
                    help="show only stages at this depth level or shallower")
    add_arguments(sh, "show")

    ls = sub.add_parser("runs", help="list runs in the journal (newest first)")
    ls.add_argument("--limit", type=_positive_int, default=20, metavar="N",
                    help="how many of the latest runs to list (default 20)")
    ls.add_argument("--json", action="store_true")
    add_arguments(ls, "runs")

    from rlm.cli.export import add_parser as add_export_parser  # journal records, chat data
    ex = add_export_parser(sub)
    add_arguments(ex, "export")
    from rlm.cli.views import extend_parser  # rlm view, live view, OpenTelemetry flags
    extend_parser(sub, {"run": r, "resume": rs, "replay": rp, "runs": ls, "show": sh,
                        "export": ex})

    sv = sub.add_parser("serve", help="serve RLM runs as an OpenAI-compatible chat-completions "
                        "endpoint (needs the serve extra)", formatter_class=fmt)
    from rlm.serve.server import add_arguments as add_serve_arguments
    add_serve_arguments(sv)

    vf = sub.add_parser("verify", help="check runs against their journal: hash chain, legal "
                        "transitions, evidence, usage, caps, replayed calls")
    which = vf.add_mutually_exclusive_group(required=True)
    which.add_argument("run_id", metavar="RUN_ID", nargs="?",
                       help="the run to verify (rlm runs lists them)")
    which.add_argument("--all", action="store_true", help="verify every run in the journal")
    vf.add_argument("--json", action="store_true")
    add_arguments(vf, "verify")

    # rlm eval (depth benchmarks), rlm chat (a session), rlm gateway-kernelspec
    for mod in ("rlm.cli.eval", "rlm.cli.chat", "rlm.cli.gateway"):
        importlib.import_module(mod).add_parser(sub)
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


def _all_attempts(usage: dict) -> str:
    """The summary's note on a resumed run's spend over every attempt ('' for a first one)."""
    a = usage.get("all_attempts")
    if not isinstance(a, dict):
        return ""
    return (f" in this attempt; over all attempts {a.get('calls', 0)} call(s), "
            f"{a.get('total_tokens', 0)} tokens, ${a.get('cost_usd', 0):.4f}"
            + (f" ({a['open_at_resume']} call(s) in flight when the last attempt stopped "
               "(a crash or an interrupt) counted at their reservation)"
               if a.get("open_at_resume") else ""))


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
                  f"tokens, ${u.get('cost_usd', 0):.4f}"
                  + (" (estimated: the endpoint reported no usage)" if getattr(res, "usage_estimated", False)
                     else "") + _all_attempts(u) + _sandbox_note(res), file=sys.stderr)
        return 0
    if res.status == "budget_exceeded":
        cap, rid = f"budget cap '{res.cap}'", res.run_id  # said once: the reason names the cap
        said = f"run {rid} ended" if cap in (res.reason or "") else f"{cap} ended run {rid}"
        print(f"rlm: {said}: {res.reason}", file=sys.stderr)
        if res.answer and not args.json:
            print(f"rlm: partial answer (set by FINAL): {res.answer[:500]}", file=sys.stderr)
        return 5
    if res.status == "cancelled":
        return 130
    print(f"rlm: run {res.run_id} ended without an answer: {res.reason}", file=sys.stderr)
    return 7


def _cmd_run(args) -> int:
    from rlm.api import RLM
    from rlm.cli.views import run_hooks
    from rlm.errors import ConfigError
    if args.query is not None and not args.query.strip():  # a shell variable left unset, say
        raise ConfigError("--query is empty: give the question, or leave --query out when the "
                          "task is in the context")
    o = options_from_args(args, RUN)
    context = _context_arg(args.context)
    with run_hooks(args, o), RLM(**o) as r:
        res = r.completion(context, args.query)
    return _emit(res, args)


@contextmanager
def _moved_context_hint(args) -> Iterator[None]:
    """A recorded run's context file that is gone: say how to point at its new place."""
    from rlm.errors import ContextError
    try:
        yield
    except ContextError as exc:
        if args.context or "not found" not in str(exc):
            raise
        raise ContextError(f"{exc}; if it has moved, give its new place with --context PATH "
                           "(the same text: it is checked against the recorded hash)") from None


def _cmd_resume(args) -> int:
    from rlm.api import resume
    from rlm.cli.views import run_hooks
    o = options_from_args(args, RESUME)
    with run_hooks(args, o), _moved_context_hint(args):
        res = resume(args.run_id, context=Path(args.context) if args.context else None, **o)
    return _emit(res, args)


def _cmd_replay(args) -> int:
    from rlm.api import replay
    with _moved_context_hint(args):
        res = replay(args.run_id, context=Path(args.context) if args.context else None,
                     on_progress=_Progress(args.quiet), **options_from_args(args, REPLAY))
    from rlm.cli.views import write_replay_view
    write_replay_view(args, res)
    if not args.quiet and not args.json:
        print(f"[rlm] replay of {args.run_id}: same outcome ({res.status}), "
              f"{res.replayed_calls} model call(s) served from the journal, 0 sent",
              file=sys.stderr)
    return _emit(res, args, summary=False)


def _journal(args):
    from rlm.config.records import open_journal
    return open_journal(args.journal or None, must_exist=True)


def _cmd_show(args) -> int:
    from rlm.errors import ConfigError
    j = _journal(args)
    rec = j.get_run(args.run_id)
    if rec is None:
        raise ConfigError(f"no run {args.run_id!r} in journal {j.path}; list runs with `rlm runs`")
    from rlm.observe.summary import show_lines
    # escaped: a control sequence in an answer must not drive the terminal of its reader
    for line in show_lines(j, rec, args.max_level):  # the header, what it spent, the tree
        print(line)
    return 0


def _cmd_runs(args) -> int:
    from rlm.observe.summary import run_row, runs_lines
    j = _journal(args)
    runs = j.list_runs(limit=args.limit)
    if args.json:
        runs = [dict(r, totals=j.spend_totals(r["run_id"])) for r in runs]  # every attempt
        print(json.dumps(runs, ensure_ascii=False, default=str))
        return 0
    if not runs:
        print(f"no runs in {j.path}")
        return 0
    # columns as wide as their widest cell: a long run id does not shift the others
    for line in runs_lines([run_row(j, r) for r in runs]):
        print(line)
    return 0


def _cmd_verify(args) -> int:
    from harness.journal.verify import verify_journal, violation_rate
    j = _journal(args)
    verdicts = verify_journal(j, None if args.all else [args.run_id])
    rate = violation_rate(verdicts)
    if args.json:
        print(json.dumps({"runs": len(verdicts), "violation_rate": rate,
                          "verdicts": [{"run_id": v.run_id, "ok": v.ok, "events": v.events,
                                        "violations": [str(x) for x in v.violations]}
                                       for v in verdicts]}, ensure_ascii=False))
    else:
        for v in verdicts:
            print(v.summary())
            for x in v.violations[1:] if not v.ok else ():
                print(f"    also {x}")
        if args.all:
            bad = sum(not v.ok for v in verdicts)
            print(f"violation rate: {rate:.4f} ({bad} of {len(verdicts)} runs violated) "
                  f"in {j.path}")
    for v in verdicts:
        if not v.ok:
            print(f"rlm: verify: run {v.run_id} violated its journal at {v.first}",
                  file=sys.stderr)
            return 8
    return 0


def _cmd_export(args) -> int:
    from rlm.cli.export import cmd_export
    return cmd_export(args)


def _cmd_serve(args) -> int:
    from rlm.serve.server import main as serve_main
    return serve_main(args)


def _cmd_chat(args) -> int:
    from rlm.cli.chat import cmd_chat
    return cmd_chat(args)


def _cmd_gateway(args) -> int:
    from rlm.cli.gateway import cmd
    return cmd(args)


def _cmd_eval(args) -> int:
    from rlm.cli.eval import cmd_eval
    return cmd_eval(args)


def _log_unraisable(info) -> None:
    logging.getLogger("rlm").debug("ignored during teardown: %s: %s (in %r)",
                                   info.exc_type.__name__, info.exc_value, info.object)


def _terminate(signum, frame):
    """SIGINT, SIGTERM and SIGHUP: raise KeyboardInterrupt in the main thread, so the command
    cleans up as on Ctrl-C (kernels shut down, the run journaled as cancelled). Not while a
    run writes its end (:func:`harness.control.stops_deferred`): it ends right after.

    Nor inside Python's import system: there the exception can land in the clean-up of a
    module lock, where Python drops it, and the lock other threads wait on may stay taken (the
    kernel's start thread imports while the main thread does: a Ctrl-C in the first second
    could hang the command). The signal is sent again 20 ms later, until outside an import."""
    from harness.control import runs_all_ended, stops_deferred
    if stops_deferred() or (_ONE_RUN and runs_all_ended()):
        return
    f = frame
    while f is not None:
        if f.f_code.co_filename.startswith("<frozen importlib"):
            if signum not in _RESEND:  # one resend at a time
                import threading
                _RESEND.add(signum)
                t = threading.Timer(0.02, _resend, (signum,))
                t.daemon = True
                t.start()
            return
        f = f.f_back
    raise KeyboardInterrupt


_RESEND, _ONE_RUN = set(), []  # signals being resent; non-empty: the command is one run


def _resend(signum: int) -> None:
    _RESEND.discard(signum)
    os.kill(os.getpid(), signum)


def _install_signal_handlers() -> None:
    import threading
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (a workflow engine stopping the step) and SIGHUP (the terminal closed) clean
        # up like Ctrl-C (kernels shut down, the run journaled cancelled), even when inherited
        # as ignored (nohup): a stop sent on purpose was dropped (setsid outlives a hangup)
        for sig in _STOP_SIGNALS:
            signal.signal(sig, _terminate)


#: The signals that end a command as Ctrl-C does (see :func:`_install_signal_handlers`).
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


#: The flags that decide which kernels a run starts ahead (:func:`_depth_flags`).
_AHEAD_FLAGS = (("--max-depth", "max_depth"), ("--pool-size", "pool_size"),
                ("--kernel-memory", "kernel_memory_mb"), ("--kernel-processes", "kernel_processes"),
                ("--kernel-disk", "kernel_disk_mb"))


def _sandbox_note(res) -> str:
    """How the run's kernels ran, for the summary line (docs/security.md)."""
    mode = getattr(res, "sandbox", None)
    return {"bwrap": "; kernels sandboxed", "none": "; kernels NOT sandboxed",
            "mixed": "; some kernels NOT sandboxed"}.get(mode or "", "")


def _depth_flags(argv: list[str]) -> dict:
    """``max_depth``, ``pool_size`` and the sandbox options as given on an ``rlm run`` command
    line (absent or not a number: left out), read before the full parse so the kernels start
    first, in the sandbox the run asks for."""
    out: dict = {"kernel_network": True} if "--kernel-network" in argv else {}
    for i, arg in enumerate(argv):
        for flag in ("--sandbox", "--kernels"):  # --kernels: no local head start for a gateway
            if arg == flag and i + 1 < len(argv):
                out[flag[2:]] = argv[i + 1]
            elif arg.startswith(flag + "="):
                out[flag[2:]] = arg[len(flag) + 1:]
        for flag, key in _AHEAD_FLAGS:
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(flag + "="):
                value = arg[len(flag) + 1:]
            else:
                continue
            try:
                out[key] = int(value)
            except ValueError:
                pass
    return out


def main(argv: list[str] | None = None) -> int:
    """Run one ``rlm`` command; returns the process exit code (int).

    ``argv``: the arguments after the program name (default ``sys.argv[1:]``, and then the
    values of secret flags, ``--api-key`` and ``--upstream-api-key``, are first read and hidden
    from the process's command line: :func:`rlm.cli.argv_secrets.hide_secret_flags`). For ``rlm run``,
    ``replay`` and ``resume`` the root's kernel (and for ``run`` its pool's) starts before
    anything heavy is imported (:func:`kernels.pool.head_start`), so its cold start overlaps
    the CLI's own start-up; a kernel the run did not take is shut down before this returns.
    """
    if argv is None:
        argv = sys.argv[1:]
        hide_secret_flags()  # before any kernel starts: none may read a key in /proc
    else:
        argv = list(argv)
    try:
        _install_signal_handlers()
        if argv[:1] in (["run"], ["replay"], ["resume"]) and not {"-h", "--help"} & set(argv):
            _ONE_RUN.append(True)  # one run, then the exit: a stop after its end is moot
            from kernels.pool import head_start, held, shut_down_all

            from rlm.config.ahead import kernels_ahead, sandbox_of
            before = held()  # a caller's own kernels, when run in-process, stay
            try:
                ahead = _depth_flags(argv)
                head_start(kernels_ahead(ahead), sandbox_of(ahead))
                return _main(argv)
            finally:
                shut_down_all(wait=3.0, since=before)  # the exit is next: let starts end
        return _main(argv)
    except KeyboardInterrupt:  # before the command's own handler (start-up, imports)
        return _interrupted()


def _interrupted(exc: BaseException | None = None, command: str | None = None) -> int:
    """Say that the command was interrupted and how to go on; returns exit code 130.
    ``exc``: the ``KeyboardInterrupt``, carrying the run's ``result`` and ``journaled`` when
    it came through a run (:func:`rlm.core.drive.drive`)."""
    res = getattr(exc, "result", None)
    run_id = getattr(res, "run_id", None)
    if command == "replay":
        hint = "The run replayed is unchanged in the journal."
    elif run_id and getattr(exc, "journaled", False):
        hint = f"Resume it with `rlm resume {run_id}`."
    elif run_id:
        hint = f"Run {run_id} was not journaled, so it cannot be resumed."
    else:
        hint = "If the run had started, resume it with `rlm resume RUN_ID` (see `rlm runs`)."
    print(f"rlm: interrupted; every kernel of the run was shut down. {hint}", file=sys.stderr)
    return 130


def entry() -> None:
    """The ``rlm`` console script: :func:`main`, then exit with its code.

    Once the command is done (every kernel shut down, the journal written) and only daemon
    threads are left, the process ends at once after running the exit handlers and flushing
    its streams: tearing down the interpreter's ~1,000 imported modules would add about half
    a second to every command and change nothing on disk.
    """
    import atexit
    import threading
    if not os.environ.get("RLM_DEBUG"):  # a destructor's ignored error (an event loop of a
        sys.unraisablehook = lambda _: None  # kernel start cut short) is no user's traceback
    code = main()
    for sig in _STOP_SIGNALS:  # done: a late signal must not end the exit
        signal.signal(sig, signal.SIG_IGN)
    if any(t.is_alive() and not t.daemon and t is not threading.main_thread()
           for t in threading.enumerate()):
        sys.exit(code)  # a non-daemon thread still works: the normal way, which joins it
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _main(argv: list[str]) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the subcommand's parser, which names the command and its --help
        said_by = (parser.subcommands or {}).get(args.command) or parser
        said_by.error(f"unrecognized arguments: {' '.join(extra)}")
    if not args.command:
        parser.print_help()
        return 2
    _setup_logging(args)
    # errors Python can only report while tearing objects down (an event loop's finalizer at
    # exit, say) are not the run's: they go to the log, never as a traceback on the terminal
    sys.unraisablehook = _log_unraisable
    # text UTF-8 cannot encode (lone surrogates) is written as U+FFFD: see harness/text.py
    from harness.text import protect_streams
    protect_streams()
    from harness.errors import HarnessError

    from rlm.errors import RLMError
    handlers = {"run": _cmd_run, "resume": _cmd_resume, "replay": _cmd_replay,
                "show": _cmd_show, "runs": _cmd_runs, "export": _cmd_export,
                "serve": _cmd_serve, "verify": _cmd_verify, "eval": _cmd_eval,
                "chat": _cmd_chat, "gateway-kernelspec": _cmd_gateway}
    from rlm.cli.views import handler_for
    try:
        return (handler_for(args) or handlers[args.command])(args)
    except BrokenPipeError:
        # stdout closed early (e.g. piped into `head`): not an error of the run
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except KeyboardInterrupt as exc:
        return _interrupted(exc, args.command)
    except (RLMError, HarnessError) as exc:
        print(f"rlm: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)
    except OSError as exc:
        if os.environ.get("RLM_DEBUG"):
            raise
        where = getattr(exc, "filename", None)
        print(f"rlm: error: {exc.strerror or exc}" + (f" ({where})" if where else "") +
              "; check the path, free disk space and permissions", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug: say so plainly
        if os.environ.get("RLM_DEBUG"):
            raise
        print(f"rlm: internal error: {type(exc).__name__}: {exc} (set RLM_DEBUG=1 for the "
              "traceback and please report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    entry()
