"""``rlm chat``: a session on a terminal (:class:`rlm.session.Session`).

One question per line, each answered on stdout; the kernel and the conversation carry over
from one question to the next. Line editing and history come from the standard ``readline``
module (the history file is ``chat_history`` in the user data dir). Commands: ``/add PATH``
adds a context (``context_1``, ...), ``/help``, ``/quit``; Ctrl-D ends the session, Ctrl-C
interrupts the question running (the session goes on).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

from rlm.config.flags import add_arguments, options_from_args

CHAT = "chat"  # rlm.config.options.CHAT: the registry is imported when the command runs

COMMANDS = """commands at the prompt:
  QUESTION      any other line is the next question; its answer is printed
  /add PATH     add a context: in the kernel it is context_1, context_2, ... (and `contexts`)
  /help         this list
  /quit         end the session (Ctrl-D too); Ctrl-C stops the question running

Each question is one run in the journal (SESSION_ID-q1, -q2, ...: see `rlm runs`, `rlm show`).
After a crash, `rlm chat --resume SESSION_ID` replays the recorded questions on a fresh kernel
(no model call paid again) and goes on from there.
"""


def add_parser(sub: Any) -> None:
    """Add the ``chat`` subcommand to ``sub`` (the ``rlm`` subparsers)."""
    ch = sub.add_parser(
        "chat", help="ask questions about a context one after another, in one kernel",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=COMMANDS,
        description="Load CONTEXT into a Jupyter kernel and answer one question per line. "
                    "The kernel's variables and the conversation outlive each question.")
    ch.add_argument("--context", action="append", metavar="PATH",
                    help="a file, a directory or a quoted glob, as for `rlm run` (repeat for "
                         "several: one context of them all); with --resume, the first context "
                         "again if it has moved")
    ch.add_argument("--resume", metavar="SESSION_ID",
                    help="continue a session from the journal: its questions are replayed "
                         "(nothing sent), then new ones are asked")
    ch.add_argument("--session-id", metavar="ID",
                    help="name a new session (letters, digits, _ . -; default a new id)")
    v = ch.add_mutually_exclusive_group()
    v.add_argument("-v", "--verbose", action="store_true", help="log every step to stderr")
    v.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    add_arguments(ch, CHAT)


def history_path() -> Path:
    """Where the question history is kept: ``$XDG_DATA_HOME/rlm/chat_history``, else
    ``~/.local/share/rlm/chat_history``."""
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "rlm" / "chat_history"


def _line_editing() -> Callable[[], None]:
    """Turn on ``readline`` line editing with the saved history; returns the function that
    saves it again (a no-op without a terminal or ``readline``)."""
    if not sys.stdin.isatty():
        return lambda: None
    try:
        import readline
    except ImportError:  # a Python built without it: plain input() still works
        return lambda: None
    path = history_path()
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)

    def save() -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass
    return save


def _context_of(paths: list[str]) -> Any:
    """``--context`` values -> one context (a Path, or a list of Paths)."""
    from rlm.errors import ConfigError
    if any(not p for p in paths):
        raise ConfigError("--context got an empty path")
    if "-" in paths:
        raise ConfigError("rlm chat reads its questions from the terminal: give the context "
                          "as a file (--context PATH), not on stdin")
    return Path(paths[0]) if len(paths) == 1 else [Path(p) for p in paths]


def _open(args: Any, o: dict) -> Any:
    from rlm.errors import ConfigError
    from rlm.session import Session
    if args.resume:
        if args.session_id:
            raise ConfigError("--resume continues a session by its id: --session-id is for a "
                              "new one")
        given = [_context_of(args.context)] if args.context else None
        s = Session.resume(args.resume, contexts=given, **o)
        _note(args, f"session {s.session_id} resumed: {len(s.results)} question(s) replayed "
                    "from the journal; its variables are back in the kernel")
        return s
    if not args.context:
        raise ConfigError("rlm chat needs --context PATH (or --resume SESSION_ID)")
    s = Session(_context_of(args.context), session_id=args.session_id, **o)
    _note(args, f"session {s.session_id}: ask a question, /help for commands, Ctrl-D ends")
    return s


def _note(args: Any, msg: str) -> None:
    if not args.quiet:
        print(f"[rlm] {msg}", file=sys.stderr, flush=True)


def cmd_chat(args: Any) -> int:
    """``rlm chat``: open (or resume) the session, then one question per line until
    ``/quit`` or end of input. Returns the exit code (0; errors of a question are printed and
    the session goes on; errors opening it are raised for ``rlm``'s handler)."""
    o = options_from_args(args, CHAT)
    if args.verbose:  # a step line per turn would bury the answers: only when asked for
        o["on_progress"] = lambda msg: print(f"[rlm] {msg}", file=sys.stderr, flush=True)
    save = _line_editing()
    with _open(args, o) as session:
        try:
            _loop(session, args)
        finally:
            save()
            _note(args, f"session {session.session_id} ended; continue it with "
                        f"`rlm chat --resume {session.session_id}`")
    return 0


def _loop(session: Any, args: Any) -> None:
    while True:
        try:
            line = input("rlm> ")
        except EOFError:  # Ctrl-D, or the end of piped input
            print(flush=True)
            return
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /quit ends the session)", flush=True)
            continue
        line = line.strip()
        if not line:
            continue
        if line in ("/quit", "/exit"):
            return
        _one(session, line, args)


def _one(session: Any, line: str, args: Any) -> None:
    """One line: a command or a question; its errors are printed, never raised."""
    from harness.errors import HarnessError

    from rlm.errors import RLMError
    try:
        if line == "/help":
            print(COMMANDS, flush=True)
        elif line == "/add" or line.startswith("/add "):
            path = line[4:].strip()
            if not path:
                print("usage: /add PATH", flush=True)
                return
            n = session.add_context(Path(os.path.expanduser(path)))
            print(f"[added {path} as context_{n}]", flush=True)
        elif line.startswith("/"):
            print(f"unknown command {line.split()[0]}; /help lists them", flush=True)
        else:
            _answer(session.ask(line), args)
    except KeyboardInterrupt:
        print("\n[interrupted; the session goes on]", flush=True)
    except (RLMError, HarnessError) as exc:
        print(f"rlm: error: {exc}", file=sys.stderr, flush=True)


def _answer(res: Any, args: Any) -> None:
    if res.status == "completed":
        print(res.answer, flush=True)
        u = res.usage
        _note(args, f"run {res.run_id}: {res.iterations} iteration(s), {u.get('calls', 0)} "
                    f"model call(s), {u.get('total_tokens', 0)} tokens")
    elif res.status == "budget_exceeded":
        print(f"[no answer: budget cap '{res.cap}' ended run {res.run_id}: {res.reason}]",
              flush=True)
    else:
        print(f"[no answer: run {res.run_id} {res.status}: {res.reason}]", flush=True)
