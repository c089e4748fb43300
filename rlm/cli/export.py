"""``rlm export``: a run's journal records (``--format journal``, the default), or recorded
runs as chat-format training data (``--format chat``: :mod:`rlm.training.export`).

``rlm/cli/main.py`` adds the subcommand with :func:`add_parser` and runs :func:`cmd_export`;
``--otel`` is handled by :mod:`rlm.cli.views`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlm.config.argtypes import number_between

__all__ = ["add_parser", "cmd_export", "one_run_id"]

FORMATS = ("journal", "chat", "profile")

EPILOG = """examples:
  rlm export RUN_ID -o run.jsonl                         # every record of one run
  rlm export --format chat RUN_ID -o train.jsonl         # its model calls as chat examples
  rlm export --format chat --sweep results/ --correct-only --level 0 -o root.jsonl
  rlm export --format chat --sweep results/ --per conversation --task niah -o conv.jsonl
"""


_score = number_between(0, 1, "a score")


def _level(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 64:
        raise argparse.ArgumentTypeError(f"must be a level from 0 (the root) up, got {text!r}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``rlm export`` to ``sub`` and return its parser (the caller adds the journal and
    view flags)."""
    from rlm.training.chat import KINDS, PER
    ex = sub.add_parser("export", formatter_class=argparse.RawDescriptionHelpFormatter,
                        help="write a run as JSON Lines (one record per stage and event), or "
                        "runs as chat-format training data (--format chat)", epilog=EPILOG)
    ex.add_argument("run_id", metavar="RUN_ID", nargs="*",
                    help="the run's id, as printed when it started and listed by rlm runs "
                    "(--format chat: one or more, or --sweep instead)")
    ex.add_argument("-o", "--output", metavar="PATH", help="output file (default stdout)")
    ex.add_argument("--format", choices=FORMATS, default="journal",
                    help="journal: every record of one run (default); chat: each model call "
                    "as {\"messages\": [...as sent, the reply], \"metadata\": {provenance}}")
    ex.add_argument("--overwrite", action="store_true", help="replace an existing -o file")
    chat = ex.add_argument_group("--format chat (docs/training.md)")
    chat.add_argument("--sweep", metavar="DIR", type=Path,
                      help="export the trials of this `rlm eval --out` directory (its journal)")
    chat.add_argument("--per", choices=PER, default="call",
                      help="one example per model call (default), or per conversation: a "
                      "loop's last call holds its whole conversation as sent (one more per "
                      "compaction)")
    chat.add_argument("--level", type=_level, action="append", metavar="N",
                      help="only calls at this level: 0 the root loop, 1 its sub-calls and "
                      "children, ... (repeat for several)")
    chat.add_argument("--kind", choices=sorted(set(KINDS.values())), action="append",
                      help="only calls of this kind (repeat for several)")
    chat.add_argument("--correct-only", action="store_true",
                      help="only trials the task's scorer marked correct (--sweep)")
    chat.add_argument("--min-score", type=_score, metavar="S",
                      help="only trials scoring at least S, 0..1 (--sweep)")
    chat.add_argument("--task", action="append", metavar="NAME", help="only this task (--sweep)")
    chat.add_argument("--method", action="append", choices=("base", "rlm"),
                      help="only this method (--sweep)")
    chat.add_argument("--depth", type=_level, action="append", metavar="D",
                      help="only runs of this max depth")
    chat.add_argument("--profile", action="append", metavar="NAME",
                      help="only runs of this prompt profile")
    chat.add_argument("--model", action="append", metavar="NAME", help="only runs of this model")
    chat.add_argument("--include-unfinished", action="store_true",
                      help="also runs that did not complete (their completed calls)")
    prof = ex.add_argument_group("--format profile: a prompt profile whose worked examples "
                                 "solved the sweep's training split (--sweep, filters as above)")
    prof.add_argument("--examples", type=int, default=None, metavar="N",
                      help="worked examples to take, 1..10 (default 2): shortest correct "
                      "program per task, skipping programs like one already taken")
    prof.add_argument("--base-profile", choices=("small", "small-count", "general"),
                      help="the built-in profile to extend (default: the trials' own)")
    return ex


def one_run_id(args, what: str) -> str:
    """The single run id ``what`` (``--format journal``, ``--otel``) needs.

    Raises:
        ConfigError: none or several given.
    """
    from rlm.errors import ConfigError
    ids = args.run_id or []
    if len(ids) != 1 or getattr(args, "sweep", None) is not None:
        raise ConfigError(f"{what} exports one run: give exactly one RUN_ID "
                          "(several runs or --sweep: --format chat)")
    return ids[0]


_FILTERS = ("sweep", "correct_only", "min_score", "task", "method", "depth", "profile", "model",
            "include_unfinished")
#: The flags each format takes; one given to another format is refused, never ignored.
FLAGS_OF = {"journal": (),
            "chat": _FILTERS + ("per", "level", "kind"),
            "profile": _FILTERS + ("examples", "base_profile")}


def _check_flags(args) -> None:
    """Refuse a flag the chosen ``--format`` does not take.

    Raises:
        ConfigError: names the flags and the formats that take them."""
    from rlm.errors import ConfigError
    every = dict.fromkeys(FLAGS_OF["chat"] + FLAGS_OF["profile"])
    given = [k for k in every if k not in FLAGS_OF[args.format]
             and getattr(args, k, None) not in (None, False, [], "call")]
    if given:
        names = ", ".join(f"--{k.replace('_', '-')}" for k in given)
        takers = sorted({f for k in given for f, flags in FLAGS_OF.items() if k in flags})
        raise ConfigError(f"{names} {'is' if len(given) == 1 else 'are'} not for --format "
                          f"{args.format}: only for --format {' or '.join(takers)}")


def cmd_export(args) -> int:
    """Run ``rlm export``; returns the exit code.

    Raises:
        ConfigError: bad arguments, a run or sweep that does not exist, filters that match
            nothing, an existing output without --overwrite (nothing is written then).
    """
    _check_flags(args)
    if args.format == "chat":
        return _chat(args)
    if args.format == "profile":
        return _profile(args)
    from rlm.errors import ConfigError
    run_id = one_run_id(args, "--format journal")
    from rlm.config.records import open_journal
    from rlm.training.export import _check_output
    out = Path(args.output) if args.output else None
    _check_output(out, args.overwrite)
    j = open_journal(args.journal or None, must_exist=True)
    if j.get_run(run_id) is None:
        raise ConfigError(f"no run {run_id!r} in journal {j.path}")
    if out is None:
        j.export_jsonl(run_id, sys.stdout)
        return 0
    with open(out, "w", encoding="utf-8") as f:
        n = j.export_jsonl(run_id, f)
    print(f"[rlm] wrote {n} records to {out}", file=sys.stderr)
    return 0


def _chat(args) -> int:
    from rlm.training.export import export_chat
    filters = _filters(args)
    res = export_chat(run_ids=args.run_id or None, sweep=args.sweep,
                      journal=args.journal or None, filters=filters, per=args.per,
                      levels=args.level, kinds=args.kind,
                      output=Path(args.output) if args.output else None,
                      overwrite=args.overwrite, stream=sys.stdout)
    dup = f" ({res.duplicates} duplicate(s) dropped)" if res.duplicates else ""
    where = res.path if res.path is not None else "stdout"
    print(f"[rlm] wrote {res.examples} chat example(s) from {res.runs} run(s) to {where}{dup}",
          file=sys.stderr)
    return 0


def _filters(args):
    from rlm.training.sources import Filters
    return Filters(correct_only=args.correct_only, min_score=args.min_score, tasks=args.task,
                   methods=args.method, depths=args.depth, profiles=args.profile,
                   models=args.model, unfinished=args.include_unfinished)


def _profile(args) -> int:
    from rlm.errors import ConfigError
    from rlm.training.export import export_profile
    if args.sweep is None or args.run_id:
        raise ConfigError("--format profile builds on a sweep's right trials: give --sweep DIR "
                          "(and no run ids)")
    if not args.output:
        raise ConfigError("--format profile writes a template file: give -o FILE")
    out, chosen = export_profile(sweep=args.sweep, journal=args.journal or None,
                                 filters=_filters(args),
                                 examples=2 if args.examples is None else args.examples,
                                 base=args.base_profile, output=Path(args.output),
                                 overwrite=args.overwrite)
    for c in chosen:
        print(f"[rlm] worked example: {c['key']} ({len(c['program'])} characters of code, "
              f"run {c['run_id']})", file=sys.stderr)
    print(f"[rlm] wrote the profile {out}: use it with --prompt {out}", file=sys.stderr)
    return 0
