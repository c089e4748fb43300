"""Command-line glue for the three views of a run: ``rlm view`` (HTML), the live terminal view
(``rlm run``, ``rlm runs --watch``, ``rlm show --follow``) and OpenTelemetry export
(``--otel``, ``rlm export --otel``).

``rlm/cli/main.py`` calls :func:`extend_parser` once, asks :func:`handler_for` before its own
dispatch, and wraps runs in :func:`run_hooks`; everything else lives here.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import webbrowser
from pathlib import Path
from typing import Iterator

from rlm.config.argtypes import number_between


__all__ = ["extend_parser", "handler_for", "run_hooks"]


_interval = number_between(0.05, 3600, "seconds")


def extend_parser(sub: argparse._SubParsersAction, parsers: dict) -> None:
    """Add ``rlm view`` and the view flags of ``run``/``resume``/``replay``/``runs``/``show``/
    ``export`` (``parsers`` maps those command names to their subparsers)."""
    v = sub.add_parser("view", help="write a run's trajectory as one self-contained HTML file",
                       description="Write one HTML file (no server, no network: scripts, styles "
                       "and the run's data inlined) showing the run's header, stage tree, each "
                       "iteration's reply, code and output, sub-calls, children, a timeline and "
                       "search. Deep links: FILE.html#STAGE-ID.")
    v.add_argument("run_id", metavar="RUN_ID",
                   help="the run's id, as printed when it started and listed by rlm runs")
    v.add_argument("-o", "--output", metavar="FILE.html",
                   help="output file (default rlm-view-RUN_ID.html in the current directory, "
                        "characters other than letters, digits and -_.: as _)")
    v.add_argument("--open", action="store_true", help="open the file in a web browser")
    v.add_argument("--max-text", type=int, default=None, metavar="N",
                   help="characters kept per reply, code, output or prompt (default 20000)")
    v.add_argument("--journal", metavar="PATH", help="journal file (env RLM_JOURNAL)")
    for name in ("run", "resume"):
        p = parsers[name]
        p.add_argument("--otel", action="store_true",
                       help="export every stage as an OpenTelemetry span over OTLP/HTTP "
                       "(env RLM_OTEL=1; endpoint and headers from OTEL_EXPORTER_OTLP_*; "
                       "needs the otel extra: `pip install -e '.[otel]'` in the checkout)")
        p.add_argument("--plain", action="store_true",
                       help="plain progress lines even on a terminal (no live view)")
    parsers["replay"].add_argument("--view", metavar="FILE.html",
                                   help="also write the replayed run's trajectory as HTML")
    parsers["runs"].add_argument("--watch", action="store_true",
                                 help="refresh the list until interrupted")
    parsers["runs"].add_argument("--interval", type=_interval, default=1.0, metavar="S",
                                 help="seconds between refreshes with --watch/--follow "
                                 "(default 1)")
    parsers["show"].add_argument("--follow", action="store_true",
                                 help="follow a run going on in another process until it ends")
    parsers["show"].add_argument("--interval", type=_interval, default=0.5, metavar="S",
                                 help="seconds between journal reads with --follow (default 0.5)")
    ex = parsers["export"]
    ex.add_argument("--otel", action="store_true",
                    help="send the run's spans over OTLP/HTTP instead of writing JSON Lines")
    ex.add_argument("--otel-endpoint", metavar="URL",
                    help="OTLP/HTTP traces URL (default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "
                    "OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces, or http://localhost:4318/v1/traces)")


def _journal(args):
    from rlm.config.records import open_journal
    return open_journal(getattr(args, "journal", None) or None, reads_only=True)


def _cmd_view(args) -> int:
    from rlm.errors import ConfigError
    from rlm.observe.view import DEFAULT_MAX_TEXT, payload_from_journal, write_view
    if args.max_text is not None and args.max_text < 1:
        raise ConfigError("--max-text must be at least 1 (characters kept per text)")
    j = _journal(args)
    payload = payload_from_journal(j, args.run_id, max_text=args.max_text or DEFAULT_MAX_TEXT)
    # a run id may hold characters a file name cannot ("/" from a workflow engine's ids)
    safe = "".join(c if c.isalnum() or c in "-_.:" else "_" for c in args.run_id)
    out = Path(args.output or f"rlm-view-{safe}.html")
    write_view(payload, out)
    print(f"[rlm] wrote {out} ({out.stat().st_size:,} bytes, {len(payload['stages'])} stages)",
          file=sys.stderr)
    if args.open:
        webbrowser.open(out.resolve().as_uri())
    return 0


def _cmd_watch(args) -> int:
    from rlm.observe.live import watch_runs
    return watch_runs(_journal(args), limit=args.limit, interval=args.interval)


def _cmd_follow(args) -> int:
    from rlm.observe.live import follow_run
    return follow_run(_journal(args), args.run_id, interval=args.interval,
                      max_level=args.max_level)


def _cmd_export_otel(args) -> int:
    from rlm.cli.export import one_run_id
    from rlm.observe.otel import export_run
    run_id = one_run_id(args, "--otel")
    n = export_run(_journal(args), run_id, endpoint=args.otel_endpoint)
    print(f"[rlm] sent {n} spans of run {run_id}", file=sys.stderr)
    return 0


def handler_for(args):
    """The handler for a command these views own, or ``None`` to use the CLI's own."""
    if args.command == "view":
        return _cmd_view
    if args.command == "runs" and getattr(args, "watch", False):
        return _cmd_watch
    if args.command == "show" and getattr(args, "follow", False):
        return _cmd_follow
    if args.command == "export" and getattr(args, "otel", False):
        return _cmd_export_otel
    return None


def _otel_wanted(args) -> bool:
    return bool(getattr(args, "otel", False)) or os.environ.get("RLM_OTEL", "") not in ("", "0")


@contextlib.contextmanager
def run_hooks(args, options: dict) -> Iterator[dict]:
    """Around one ``rlm run``/``resume``: pick the progress display (live view on a terminal,
    plain lines otherwise or with ``-v``, nothing with ``-q``) and the OpenTelemetry exporter,
    and put their ``on_progress`` callback and stage listeners into ``options``."""
    from rlm.observe.live import make_display
    display = make_display(quiet=getattr(args, "quiet", False),
                           verbose=getattr(args, "verbose", False),
                           plain=getattr(args, "plain", False), stream=sys.stderr,
                           caps=options)
    listeners = [display.listener]
    exporter = None
    if _otel_wanted(args):
        from rlm.observe.otel import LiveExporter
        exporter = LiveExporter()
        listeners.append(exporter.listener)
    options["on_progress"] = display.progress
    options["listeners"] = listeners
    try:
        with display:
            yield options
    finally:
        if exporter is not None:
            exporter.close()


def write_replay_view(args, res) -> None:
    """``rlm replay --view FILE``: the replayed tree with the recorded prompts."""
    if not getattr(args, "view", None):
        return
    from rlm.observe.view import payload_from_result, write_view
    j = _journal(args)
    rec = j.get_run(args.run_id)
    write_view(payload_from_result(j, rec, res), args.view)
    if not getattr(args, "quiet", False):
        print(f"[rlm] wrote {args.view}", file=sys.stderr)
