"""Which recorded runs an export learns from: run ids of a journal, or the trials of a sweep.

A *source* is one run of a journal, with the sweep's trial record when it came from a sweep
(``rlm eval --out DIR``: ``DIR/trials.jsonl``, whose runs are in the sweep's journal). Filters
pick runs by what the run record or the trial record says; only completed runs are taken
unless ``unfinished`` is set. A filter that leaves nothing is an error that says what there
was to choose from, so no empty file is ever written by mistake.

Reading never changes a journal: a journal file written by an older schema is refused with a
clear error instead of being migrated by an export (:func:`check_not_older`).
"""
from __future__ import annotations

import json
import logging
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlm.errors import ConfigError

log = logging.getLogger("rlm.training")

__all__ = ["Source", "Filters", "sweep_sources", "run_sources", "sweep_journal",
           "present_sources", "check_not_older", "identity_sha256"]


@dataclass(frozen=True)
class Source:
    """One run to export: its ``run_id`` and, from a sweep, its ``trial`` record (the
    ``trials.jsonl`` dict: ``key``, ``task``, ``score``, ``correct``, ``identity``...)."""

    run_id: str
    trial: dict | None = None


@dataclass
class Filters:
    """What to keep (None: no filter on it).

    Attributes:
        correct_only: only trials the scorer marked correct (score 1.0); sweeps only.
        min_score: only trials with ``score >= min_score`` (0..1); sweeps only.
        tasks, methods: trial tasks / methods (``base``, ``rlm``); sweeps only.
        depths: the run's ``max_depth``; profiles: its prompt profile; models: its model name.
        unfinished: also runs that did not complete (default: completed runs only).
    """

    correct_only: bool = False
    min_score: float | None = None
    tasks: list[str] | None = None
    methods: list[str] | None = None
    depths: list[int] | None = None
    profiles: list[str] | None = None
    models: list[str] | None = None
    unfinished: bool = False

    def sweep_only(self) -> list[str]:
        """The flags given that only a sweep can answer (scores and tasks live in its trials)."""
        return [flag for flag, given in (("--correct-only", self.correct_only),
                                         ("--min-score", self.min_score is not None),
                                         ("--task", self.tasks), ("--method", self.methods))
                if given]


def identity_sha256(parts: dict | None) -> str | None:
    """The full sha256 of a trial's identity parts (its run id is ``"eval-"`` + the first 20
    hex digits of it), or None when the record carries no identity."""
    if not isinstance(parts, dict):
        return None
    from rlm.evaluation.identity import _canonical, sha256_text
    return sha256_text(_canonical(parts))


def check_not_older(journal: Any) -> None:
    """Refuse a journal file of an older schema, without changing it (opening it to write
    would migrate it; an export only reads). A path that does not exist, a PostgreSQL URL,
    or a file this check cannot read is left to the journal's own checks.

    Raises:
        ConfigError: the file is an rlm journal of an older schema version.
    """
    from harness.journal.schema import APPLICATION_ID, SCHEMA_VERSION, inspect
    if journal is None or "://" in str(journal) or not Path(journal).expanduser().is_file():
        return
    path = Path(journal).expanduser()
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            version, app_id, _ = inspect(conn)
        finally:
            conn.close()
    except sqlite3.Error:
        return  # not readable as SQLite here: the journal's own open says why
    if app_id == APPLICATION_ID and 0 < version < SCHEMA_VERSION:
        raise ConfigError(
            f"journal {path} has schema version {version}, older than this rlm's "
            f"({SCHEMA_VERSION}); an export only reads and does not migrate it. Migrate it "
            f"first with any command that opens it, e.g. `rlm runs --journal {path}` (the "
            f"migration keeps every record), then export again. The file was not modified.")


def sweep_journal(sweep_dir: Path) -> str:
    """The journal of the sweep in ``sweep_dir``: the one its ``sweep.json`` names when that
    file exists there, else ``sweep_dir/journal.sqlite3`` (a sweep moved with its journal).

    Raises:
        ConfigError: no such directory, or no journal found.
    """
    from rlm.evaluation.sweep import JOURNAL_FILE, SWEEP_FILE
    if not sweep_dir.is_dir():
        raise ConfigError(f"no sweep directory {sweep_dir}: give the --out directory of an "
                          "`rlm eval` run (it holds trials.jsonl and its journal)")
    named = None
    doc_path = sweep_dir / SWEEP_FILE
    if doc_path.exists():
        try:
            doc = json.loads(doc_path.read_text(encoding="utf-8"))
            # "journal" since sweep.json named it; the grid's own field in older ones
            named = doc.get("journal") or (doc.get("grid") or {}).get("journal")
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("%s cannot be read (%s: %s); looking for the journal at %s", doc_path,
                        type(exc).__name__, exc, sweep_dir / JOURNAL_FILE)
    if named and ("://" in named or Path(named).is_file()):
        return named
    local = sweep_dir / JOURNAL_FILE
    if local.is_file():
        return str(local)
    raise ConfigError(f"sweep {sweep_dir} has no journal ({named or local} does not exist); "
                      "give it with --journal PATH|URL")


def _latest(trials: list[dict]) -> list[dict]:
    """One record per trial key, the last written (a rerun supersedes), sorted by key."""
    by_key: dict[str, dict] = {}
    for i, r in enumerate(trials):
        by_key[str(r.get("key") or f"#{i}")] = r
    return [by_key[k] for k in sorted(by_key)]


def _choices(records: list[dict], name: str) -> str:
    seen = sorted({str(r.get(name)) for r in records})
    return ", ".join(seen) or "none"


def sweep_sources(sweep_dir: Path, f: Filters) -> list[Source]:
    """The trials of the sweep in ``sweep_dir`` that pass ``f``, one per trial key, sorted by
    key (deterministic whatever order the trials finished in).

    Raises:
        ConfigError: no such directory, no or damaged ``trials.jsonl``, or nothing passes
            (the message names the filter that emptied it and what the sweep holds).
    """
    from rlm.evaluation.report import TRIALS_FILE, read_trials
    if not sweep_dir.is_dir():
        raise ConfigError(f"no sweep directory {sweep_dir}: give the --out directory of an "
                          "`rlm eval` run (it holds trials.jsonl and its journal)")
    records = _latest(read_trials(sweep_dir / TRIALS_FILE))
    if not records:
        raise ConfigError(f"sweep {sweep_dir} has no trials in {TRIALS_FILE}")
    steps = [
        ("completed", "completed trials (--include-unfinished takes the others too)",
         lambda r: f.unfinished or r.get("status") == "completed", "status"),
        ("correct", "correct trials (--correct-only)",
         lambda r: not f.correct_only or r.get("correct") is True, "correct"),
        ("score", f"trials scoring at least {f.min_score} (--min-score)",
         lambda r: f.min_score is None or float(r.get("score") or 0) >= f.min_score, "score"),
        ("task", f"trials of task {_one(f.tasks)} (--task)",
         lambda r: not f.tasks or r.get("task") in f.tasks, "task"),
        ("method", f"trials of method {_one(f.methods)} (--method)",
         lambda r: not f.methods or r.get("method") in f.methods, "method"),
        ("depth", f"trials at depth {_one(f.depths)} (--depth)",
         lambda r: not f.depths or r.get("depth") in f.depths, "depth"),
        ("profile", f"trials of profile {_one(f.profiles)} (--profile)",
         lambda r: not f.profiles or r.get("profile") in f.profiles, "profile"),
        ("model", f"trials of model {_one(f.models)} (--model)",
         lambda r: not f.models or r.get("model") in f.models, "model"),
    ]
    for _, what, keep, field_name in steps:
        kept = [r for r in records if keep(r)]
        if not kept:
            raise ConfigError(f"no {what} among the {len(records)} trial(s) left in sweep "
                              f"{sweep_dir} (their {field_name}: {_choices(records, field_name)}"
                              "); nothing was written")
        records = kept
    return [Source(str(r["run_id"]), r) for r in records]


def present_sources(journal: Any, sources: list[Source], sweep_dir: Path) -> list[Source]:
    """The sweep's ``sources`` whose runs ``journal`` holds; those it does not are skipped
    with a warning (logged).

    Raises:
        ConfigError: the journal holds none of them (the sweep's journal is elsewhere)."""
    held = [s for s in sources if journal.get_run(s.run_id) is not None]
    if not held:
        raise ConfigError(f"none of the {len(sources)} run(s) of sweep {sweep_dir} is in "
                          f"journal {journal.path} (e.g. {sources[0].run_id}): give the sweep's "
                          "own journal with --journal PATH|URL; nothing was written")
    if len(held) < len(sources):
        log.warning("%d of the %d trial(s) chosen have no run in journal %s; they are skipped",
                    len(sources) - len(held), len(sources), journal.path)
    return held


def _one(values: list | None) -> str:
    return " or ".join(str(v) for v in values or [])


def run_sources(journal: Any, run_ids: list[str], f: Filters) -> list[Source]:
    """The named runs of ``journal`` (in the order given, each once) that pass ``f``.

    Raises:
        ConfigError: a run id the journal does not hold, a sweep-only filter, or nothing
            passes (the message says which run failed which filter).
    """
    sweep_flags = f.sweep_only()
    if sweep_flags:
        raise ConfigError(f"{', '.join(sweep_flags)}: scores, tasks and methods are recorded "
                          "by a sweep only; export with --sweep DIR instead of run ids")
    out, why = [], []
    for run_id in dict.fromkeys(run_ids):
        rec = journal.get_run(run_id)
        if rec is None:
            raise ConfigError(f"no run {run_id!r} in journal {journal.path}; list runs with "
                              "`rlm runs`")
        opts = rec.get("options") or {}
        checks = [
            (f.unfinished or rec.get("status") == "completed",
             f"is {rec.get('status')}, not completed (--include-unfinished takes it)"),
            (not f.depths or rec.get("max_depth") in f.depths,
             f"has depth {rec.get('max_depth')}"),
            (not f.profiles or opts.get("prompt") in f.profiles,
             f"has profile {opts.get('prompt')}"),
            (not f.models or rec.get("model") in f.models, f"has model {rec.get('model')}"),
        ]
        failed = [reason for ok, reason in checks if not ok]
        if failed:
            why.append(f"run {run_id} {failed[0]}")
        else:
            out.append(Source(run_id))
    if not out:
        raise ConfigError("no run passes the filters: " + "; ".join(why) +
                          "; nothing was written")
    for reason in why:  # a run named and left out is said, never dropped silently
        log.warning("skipped: %s", reason)
    return out
