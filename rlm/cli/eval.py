"""``rlm eval``: benchmark depth settings (a sweep of long-context tasks by method, depth and
prompt profile), and ``rlm eval --report DIR`` (tables and plots from the results alone).

The sweep itself is :class:`rlm.evaluation.sweep.Sweep`; this module turns flags into its
:class:`~rlm.evaluation.sweep.Grid`.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from rlm.errors import ConfigError
from rlm.config.options import EMBEDDED_MODELS, MAX_DEPTH_LIMIT, OPTIONS

DEFAULT_TASKS = "niah_single_2,niah_multikey_1,cwe,qa_1,aggregation"
DEFAULT_LENGTHS = "8k,32k"
DEFAULT_METHODS, DEFAULT_DEPTHS, DEFAULT_N = "base,rlm", "0,1,2", 5
#: The environment variable ``--api-key`` is put in for the trials (and Ray workers).
API_KEY_VAR = "RLM_EVAL_API_KEY"

DESCRIPTION = """\
Benchmark depth settings: run long-context tasks (RULER's needle, variable-tracking, word-count
and QA tasks, plus aggregation and pairs over many items) at several context lengths, by two
methods: `base` (one plain completion, the context cut to the model's window) and `rlm` at
each --depths value (0: Python only; 1: llm_query and fallbacks; 2: child kernels; 3:
grandchildren), with each --prompt profile. --n trials per cell, seeded and deterministic.

Every trial is a journaled run whose id hashes everything that decides its result: the
sample, the system prompt and first message as rendered, the model (for the embedded model, its
weights' sha256), the caps and sampling settings, and the harness version. Run the same command
again after an interruption and finished trials are skipped, a trial killed mid-run resumes
from the journal with no repaid model calls; change the profile, the model or a setting, and
the trials it touches run again. The journal is OUT/journal.sqlite3 unless --journal.

Results in --out: trials.jsonl (one line per trial), sweep.json (the grid), summary.md/.csv/
.json (accuracy with a 95% Wilson interval, pass^k, cost/tokens/wall mean, median and p90,
failure kinds per task, length, method, depth and profile) and PNG plots. Each trial's record
carries its identity; --report refuses trials whose identities differ in more than the grid's
axes (another harness version, profile text, model file or setting) unless --allow-mixed.

Before the first trial, everything the sweep and its report need is checked (matplotlib, the
task data, the embedded model's engine and weights): a missing one is exit 2 with its install
command, nothing paid."""

EXAMPLES = """\
examples:
  rlm eval --out results/small                  # the embedded model, default grid
  rlm eval --tasks niah_single_2,qa_1 --lengths 8k,128k --depths 0,1 --n 10 --out results/q
  rlm eval --base-url https://api.openai.com/v1 --model gpt-4.1-mini --prompt general \\
           --max-cost-per-trial 0.50 --concurrency 8 --out results/hosted
  rlm eval --ray 127.0.0.1:6379 --journal /shared/journal.sqlite3 --out results/ray
  rlm eval --report results/small               # rebuild tables and plots from trials.jsonl

A different grid into an existing --out is refused unless --force (then its trials are added
to the same results). With the embedded model, its server gets one request slot per concurrent
trial (at least 2). Errors inside a trial (endpoint, kernel, budget) are results
(status/failure columns), not a stop; bad setup stops the sweep with a message (exit 2).

exit codes:
  0    the sweep ran (or its --time-budget ended it) and its report is written
  2    bad setup: a flag, a task, a sample, a missing dependency, another grid in --out,
       trials that differ in more than the grid's axes (see --allow-mixed)
  3    every trial run now failed on the model endpoint
  130  interrupted (Ctrl-C or SIGTERM): finished trials are kept, the same command continues"""


def _csv(text: str) -> list[str]:
    return [t.strip() for t in str(text).split(",") if t.strip()]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand to ``sub`` (the ``rlm`` subparsers); returns its parser."""
    p = sub.add_parser("eval", help="benchmark depth settings on long-context tasks "
                       "(resumable sweeps, tables, plots)", description=DESCRIPTION,
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("the grid")
    g.add_argument("--tasks", default=DEFAULT_TASKS, metavar="LIST",
                   help=f"comma-separated task names (default {DEFAULT_TASKS})")
    g.add_argument("--lengths", default=DEFAULT_LENGTHS, metavar="LIST",
                   help="context lengths in tokens (o200k): 8k = 8192, 1M = 1048576, or plain "
                        f"numbers (default {DEFAULT_LENGTHS})")
    g.add_argument("--methods", default=DEFAULT_METHODS, metavar="LIST",
                   help="base and/or rlm (default base,rlm)")
    g.add_argument("--depths", default=DEFAULT_DEPTHS, metavar="LIST",
                   help=f"max_depth values of the rlm method, 0..{MAX_DEPTH_LIMIT} (default 0,1,2)")
    g.add_argument("--prompt", metavar="LIST",
                   help="rlm prompt profiles: small, small-count, general, or a prompt "
                        "file's path; comma-separated (default small,general with the embedded "
                        "model, general with an endpoint)")
    g.add_argument("--n", type=int, default=DEFAULT_N, metavar="N",
                   help="trials per cell (default 5)")
    g.add_argument("--seed", type=int, default=0, help="seed of the samples (default 0)")
    g.add_argument("--sample-factory", metavar="MODULE:FUNCTION",
                   help="your own tasks: a function (task, length, seed, index) -> a sample "
                        "with the fields of rlm.evaluation.tasks.Sample; task names are then "
                        "not checked against the built-in ones")
    m = p.add_argument_group("the model (default: the embedded local model)")
    m.add_argument("--model", metavar="NAME", help="model name at the endpoint (env RLM_MODEL)")
    m.add_argument("--base-url", metavar="URL", help="OpenAI-compatible base URL "
                   "(env OPENAI_BASE_URL)")
    m.add_argument("--api-key", metavar="KEY", help="API key (env OPENAI_API_KEY); never "
                   "written to the results")
    m.add_argument("--embedded-model", choices=list(EMBEDDED_MODELS), metavar="NAME",
                   help=f"embedded model without an endpoint: {', '.join(EMBEDDED_MODELS)}")
    threads = next(o for o in OPTIONS if o.name == "embedded_threads")
    m.add_argument(threads.flag, dest="embedded_threads", type=int, metavar=threads.metavar,
                   help=threads.help)
    m.add_argument("--base-window", type=int, metavar="TOKENS",
                   help="the model's context window for the base method (default 131072 for "
                        "an endpoint; the embedded model's own window per request)")
    r = p.add_argument_group("running it")
    r.add_argument("--out", metavar="DIR", help="output directory (required for a sweep)")
    r.add_argument("--concurrency", type=int, default=2, metavar="K",
                   help="trials at once on this machine, each with its own kernels (default 2)")
    r.add_argument("--max-cost-per-trial", type=float, metavar="USD",
                   help="cost cap of each trial (needs a price for the model)")
    r.add_argument("--trial-timeout", metavar="DURATION",
                   help="wall-clock cap of each trial's run (600, 600s, 10m; default: none); a "
                        "trial stopped by it is recorded as budget_exceeded, a result like any "
                        "other, so a sweep's slowest trials cannot take its whole time")
    r.add_argument("--price-file", metavar="PATH|URL", help='JSON prices {"model": {"input": '
                   'USD/1M, "output": USD/1M}} for the cost cap (default: the built-in table)')
    r.add_argument("--journal", metavar="PATH|URL", help="journal of the trials' runs (default "
                   "OUT/journal.sqlite3, the sweep's own; RLM_JOURNAL does not apply)")
    r.add_argument("--ray", metavar="ADDRESS", help="run each trial as a task on the Ray "
                   "cluster at ADDRESS (needs the ray extra)")
    r.add_argument("--time-budget", metavar="DURATION",
                   help="stop after this long (90m, 1h30m, 2h, 5400): trials run breadth first "
                        "(every cell's first trial before any cell's second), each started only "
                        "if its cell's measured time still fits; the report covers what "
                        "finished, and the same command run again continues")
    r.add_argument("--force", action="store_true",
                   help="accept a different grid in an existing --out")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--report", metavar="DIR", help="only rebuild the tables and plots of DIR "
                   "from its trials.jsonl (no trial runs)")
    p.add_argument("--allow-mixed", action="store_true",
                   help="report trials whose identities differ in more than the grid's axes "
                        "(harness version, profile text, model file, settings) together; "
                        "summary.md says where they differ")
    return p


def _endpoint(args) -> tuple[str | None, str, str]:
    """``(base_url or None, model name, api key variable)`` of the sweep."""
    from rlm.config.endpoint import endpoint_configured
    api_var = "OPENAI_API_KEY"
    if args.api_key:
        os.environ[API_KEY_VAR] = args.api_key
        api_var = API_KEY_VAR
    if not endpoint_configured({"base_url": args.base_url, "api_key": args.api_key}):
        if args.model:
            raise ConfigError(f"--model {args.model!r} needs an endpoint: pass --base-url (or "
                              "set OPENAI_BASE_URL); without one the embedded model is used, "
                              "chosen with --embedded-model")
        from rlm.models.catalog import DEFAULT_EMBEDDED_MODEL
        return None, args.embedded_model or DEFAULT_EMBEDDED_MODEL, api_var
    model = args.model or os.environ.get("RLM_MODEL")
    if not model:
        raise ConfigError("a model endpoint is configured but no model name: pass --model NAME "
                          "(or set RLM_MODEL)")
    url = args.base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1"
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--base-url must be an http:// or https:// URL, got {url!r}")
    return url, model, api_var


def _ints(text: str, flag: str, lo: int, hi: int) -> list[int]:
    try:
        values = [int(x) for x in _csv(text)]
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated whole numbers, got {text!r}") from None
    bad = [v for v in values if not lo <= v <= hi]
    if bad or not values:
        raise ConfigError(f"{flag} values must be {lo}..{hi}, got {text!r}")
    return values


def _profiles(text: str | None, embedded: bool) -> list[str]:
    from rlm.evaluation.trial import PROFILES
    out = _csv(text) if text else (["small", "general"] if embedded else ["general"])
    for p in out:
        if p not in PROFILES and not Path(p).is_file():
            raise ConfigError(f"--prompt {p!r} is neither a profile ({', '.join(PROFILES)}) "
                              "nor a prompt file")
        if p not in PROFILES:  # a template file: checked before any trial runs
            from rlm.config.build import _check_template, _template_file
            _check_template(_template_file(p) or "", p)
    return [p if p in PROFILES else str(Path(p).resolve()) for p in out]


def grid_from_args(args):
    """The :class:`~rlm.evaluation.sweep.Grid` the flags describe.

    Raises:
        ConfigError: a bad task, length, method, depth, profile, count or endpoint setting.
    """
    from rlm.evaluation.sweep import Grid
    from rlm.evaluation.trial import METHODS, embedded_window
    from rlm.evaluation.tasks import parse_length, parse_tasks
    base_url, model, api_var = _endpoint(args)
    tasks = _csv(args.tasks) if args.sample_factory else parse_tasks(args.tasks)
    if not tasks:
        raise ConfigError("--tasks names no task")
    lengths = sorted({parse_length(x) for x in _csv(args.lengths)})
    if not lengths:
        raise ConfigError(f"--lengths needs at least one length (8k, 32000, ...), got "
                          f"{args.lengths!r}")
    methods = _csv(args.methods)
    if not methods or any(m not in METHODS for m in methods):
        raise ConfigError(f"--methods must be among {', '.join(METHODS)}, got {args.methods!r}")
    if args.n < 1:
        raise ConfigError(f"--n must be >= 1, got {args.n}")
    if args.max_cost_per_trial is not None and not args.max_cost_per_trial > 0:
        raise ConfigError(f"--max-cost-per-trial must be > 0, got {args.max_cost_per_trial}")
    from rlm.evaluation.time_budget import parse_duration
    trial_timeout = (None if args.trial_timeout is None
                     else parse_duration(args.trial_timeout, "--trial-timeout"))
    if args.base_window is not None and args.base_window <= 2048:
        raise ConfigError(f"--base-window must be > 2048 tokens, got {args.base_window}")
    window = args.base_window or (embedded_window(model) if base_url is None else None)
    if window is not None and window <= 2048:
        raise ConfigError(f"--base-window must be > 2048 tokens, got {window}")
    kw: dict[str, Any] = {"base_window": window} if window else {}
    if base_url is None:
        kw.update(_embedded_server(args))
    return Grid(tasks=tasks, lengths=lengths, methods=methods,
                depths=sorted(set(_ints(args.depths, "--depths", 0, MAX_DEPTH_LIMIT))),
                profiles=_profiles(args.prompt, base_url is None), n=args.n, seed=args.seed,
                model=model, base_url=base_url, api_key_env=api_var,
                max_cost_per_trial=args.max_cost_per_trial, trial_timeout=trial_timeout,
                journal=_journal_spec(args.journal),
                sample_factory=args.sample_factory,
                price_file=str(Path(args.price_file).resolve()) if args.price_file else None, **kw)


def _embedded_server(args) -> dict:
    """The embedded server's settings of a sweep: ``--embedded-threads``, and a request slot
    per concurrent trial (never fewer than the default, so one trial's batched sub-calls still
    decode together)."""
    from rlm.config.validate import validate_options
    from rlm.models.embedded.server import DEFAULT_SLOTS
    validate_options({"embedded_threads": args.embedded_threads})
    slots = max(DEFAULT_SLOTS, args.concurrency) if not args.ray else None
    return {"embedded_threads": args.embedded_threads, "embedded_slots": slots}


def _partial_report(sweep) -> None:
    """After an interruption: the tables and plots of the trials finished so far (none when no
    trial finished; a report that fails is only mentioned, the interruption is the news)."""
    from rlm.evaluation.report import write_report
    if not (sweep.trials_path.is_file() and sweep.trials_path.stat().st_size):
        return
    try:
        write_report(sweep.out, allow_mixed=sweep.allow_mixed)
        print(f"rlm: the report of the finished trials is in {sweep.out}", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - best effort on the way out
        print(f"rlm: no report of the finished trials ({exc})", file=sys.stderr)


def _journal_spec(value: str | None) -> str | None:
    """``--journal``: a ``postgresql://`` URL as given, a file path made absolute (Ray workers
    and later reruns may start elsewhere)."""
    if not value:
        return None
    from harness.journal.pg_store import is_postgres_url
    return value if is_postgres_url(value) else str(Path(value).resolve())


def cmd_eval(args) -> int:
    """``rlm eval``: a sweep into ``--out`` (then its report), or ``--report DIR`` alone."""
    if args.report:
        ignored = _sweep_flags_given(args)
        if ignored:
            print(f"rlm: --report only rebuilds {args.report}'s tables and plots from its "
                  f"trials.jsonl; ignoring {', '.join(ignored)}", file=sys.stderr)
        return _report(Path(args.report), args.quiet, args.allow_mixed)
    if not args.out:
        raise ConfigError("rlm eval needs --out DIR (or --report DIR to rebuild a report)")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConfigError(f"--out {args.out} is a file: give a directory (it is created if "
                          "missing)")
    from rlm.evaluation.sweep import Sweep
    grid = grid_from_args(args)
    if args.ray:
        from rlm.evaluation.ray_runner import import_ray, reachable
        import_ray()  # Ray itself, then its cluster: both before anything is written
        reachable(args.ray)
    budget = None
    if args.time_budget is not None:
        from rlm.evaluation.time_budget import parse_duration
        budget = parse_duration(args.time_budget)
    sweep = Sweep(grid, Path(args.out), concurrency=args.concurrency, ray_address=args.ray,
                  force=args.force, progress=not args.quiet, allow_mixed=args.allow_mixed,
                  time_budget=budget)
    try:
        files = sweep.run()
    except KeyboardInterrupt:
        print("rlm: interrupted; finished trials are in "
              f"{sweep.trials_path}, running ones were cancelled. Run the same command again "
              "to continue (finished trials are skipped, interrupted ones resume).",
              file=sys.stderr)
        _partial_report(sweep)
        return 130
    s = sweep.stats
    if not args.quiet:
        changed = f", {s['changed']} of them again as their identity changed" \
            if s["changed"] else ""
        print(f"[rlm] eval: {s['total']} trials ({s['run']} run now{changed}, {s['skipped']} "
              f"already done), ${s['cost_usd']:.4f} spent, {s['seconds']:.1f} s", file=sys.stderr)
    if sweep.budget is not None and s.get("left"):
        print(f"[rlm] eval: {sweep.budget.left_summary()}", file=sys.stderr)
    for name, path in files.items():
        print(f"{name}\t{path}")
    if s["run"] and s.get("endpoint_errors", 0) == s["run"]:
        print(f"rlm: error: every trial run now ({s['run']}) failed on the model endpoint; check "
              "--base-url/--model/--api-key. Their records say EndpointError; the same command "
              "runs them again once the endpoint answers (journaled calls are not re-sent)",
              file=sys.stderr)
        return 3
    return 0


#: Flags of a sweep that ``--report`` does not use: (flag, attribute, value when not given).
_SWEEP_FLAGS = (("--out", "out", None), ("--tasks", "tasks", DEFAULT_TASKS),
                ("--lengths", "lengths", DEFAULT_LENGTHS),
                ("--methods", "methods", DEFAULT_METHODS),
                ("--depths", "depths", DEFAULT_DEPTHS), ("--prompt", "prompt", None),
                ("--n", "n", DEFAULT_N),
                ("--time-budget", "time_budget", None), ("--trial-timeout", "trial_timeout", None),
                ("--ray", "ray", None), ("--force", "force", False))


def _sweep_flags_given(args) -> list[str]:
    """The sweep flags given with ``--report`` (which only reads trials.jsonl)."""
    return [flag for flag, attr, unset in _SWEEP_FLAGS if getattr(args, attr, unset) != unset]


def _report(out: Path, quiet: bool, allow_mixed: bool) -> int:
    from rlm.evaluation.report import write_report
    from rlm.evaluation.sweep import TRIALS_FILE
    if not (out / TRIALS_FILE).is_file():
        raise ConfigError(f"no {TRIALS_FILE} in {out}: pass the --out directory of a sweep")
    files = write_report(out, allow_mixed=allow_mixed)
    for name, path in files.items():
        print(f"{name}\t{path}")
    if not quiet:
        print(f"[rlm] eval: report rebuilt from {out / TRIALS_FILE}", file=sys.stderr)
    return 0
