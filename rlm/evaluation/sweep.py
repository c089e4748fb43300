"""Depth sweeps: one trial as a journaled run (:func:`run_trial`), and the sweep that runs a
grid of them (:class:`Sweep`).

A *trial* is one sample (task, length in tokens, seed, trial index) answered by one method:
``base`` (one plain completion of the task's prompt, the context cut to the model's window) or
``rlm`` at one depth with one prompt profile. Every trial is a journaled run whose id hashes
everything that decides its result (:mod:`rlm.evaluation.identity`: the sample, the rendered
prompts, the model, the settings, the harness version), so running the same sweep again

* skips trials already in ``OUT/trials.jsonl`` (one JSON line per finished trial) under the
  same run id, and runs again those whose identity changed since (a profile edit, another
  model file, another output cap): their new record supersedes the old one,
* runs again those the model endpoint failed under (failure ``EndpointError``: nothing of the
  method was measured),
* resumes a trial killed mid-run from the journal (recorded model calls are served, not paid
  again), and
* serves a trial that finished in the journal but never reached the JSONL (the process was
  killed between the two) from the journal: its record says ``replayed: true``, no model call.

Where the journal lives: the ``journal`` of the grid (``rlm eval --journal PATH|URL``), else
``OUT/journal.sqlite3``, the sweep's own (never the shared default journal). Several threads
(and processes) may write one SQLite journal. For Ray see :mod:`rlm.evaluation.ray_runner`.
"""
from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

from rlm.errors import ConfigError, RLMError
from rlm.models.catalog import DEFAULT_EMBEDDED_MODEL
from rlm.evaluation.identity import changed_parts, mixed_identities
from rlm.evaluation.progress import ProgressBar
from rlm.evaluation.trial import (DEFAULT_BASE_WINDOW, METHODS, MakeSample, TrialSpec,
                                  checked_sample, identified, load_sample_factory, run_trial)

#: ``Sweep`` file names inside the output directory.
TRIALS_FILE, SWEEP_FILE, JOURNAL_FILE = "trials.jsonl", "sweep.json", "journal.sqlite3"


# --------------------------------------------------------------------------- the grid


@dataclass
class Grid:
    """The trials of a sweep: tasks x lengths x n trials x (``base`` once; ``rlm`` per depth
    per profile), all on one model.

    Attributes:
        tasks (names), lengths (tokens), methods, depths, profiles: the axes; n: trials per
            cell (sample indices 0..n-1); seed: the samples' seed.
        model, base_url, api_key_env, max_cost_per_trial (USD), trial_timeout (seconds),
        journal, base_window (tokens),
        sample_factory, price_file, embedded_threads, embedded_slots: as in
        :class:`TrialSpec` (``journal`` None: the sweep's own, ``OUT/journal.sqlite3``).
    """

    tasks: list[str]
    lengths: list[int]
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    depths: list[int] = field(default_factory=lambda: [0, 1, 2])
    profiles: list[str] = field(default_factory=lambda: ["small"])
    n: int = 5
    seed: int = 0
    model: str = DEFAULT_EMBEDDED_MODEL
    base_url: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    max_cost_per_trial: float | None = None
    trial_timeout: float | None = None
    journal: str | None = None
    base_window: int = DEFAULT_BASE_WINDOW
    sample_factory: str | None = None
    price_file: str | None = None
    embedded_threads: int | None = None
    embedded_slots: int | None = None

    def trials(self) -> list[TrialSpec]:
        """Every trial, shortest lengths first, then by trial index (so early results cover
        every cell), then task and method."""
        common = dict(model=self.model, base_url=self.base_url, api_key_env=self.api_key_env,
                      max_cost_per_trial=self.max_cost_per_trial,
                      trial_timeout=self.trial_timeout, journal=self.journal,
                      base_window=self.base_window, sample_factory=self.sample_factory,
                      price_file=self.price_file, embedded_threads=self.embedded_threads,
                      embedded_slots=self.embedded_slots)
        variants: list[tuple] = []
        if "base" in self.methods:
            variants.append(("base", None, None))
        if "rlm" in self.methods:
            variants += [("rlm", d, p) for p in self.profiles for d in self.depths]
        return [TrialSpec(task, length, self.seed, i, m, d, p, **common)
                for length in self.lengths for i in range(self.n) for task in self.tasks
                for (m, d, p) in variants]

    def identity(self) -> dict:
        """What ``sweep.json`` compares between runs into one output directory: every field
        but where the journal and the price table are, which variable holds the key and how
        fast the embedded server runs."""
        d = asdict(self)
        for k in ("journal", "api_key_env", "price_file", "embedded_threads", "embedded_slots"):
            d.pop(k)
        return d


def journal_record(journal: str | None) -> str | None:
    """How ``sweep.json`` names a sweep's journal: a file as its absolute path, a PostgreSQL
    URL without its password (never written to disk; libpq finds it in ``PGPASSWORD`` or
    ``~/.pgpass``), None as None."""
    from harness.journal.pg_store import is_postgres_url, redact
    if journal is None:
        return None
    if is_postgres_url(journal):
        return redact(journal).replace(":***@", "@", 1)
    return str(Path(journal).expanduser().resolve())


# --------------------------------------------------------------------------- the sweep


class JsonlWriter:
    """Appends one JSON line per record to ``path``, flushed and fsynced per line (a line is
    complete on disk before the next trial's record). Single writer: call from one thread.

    A torn last line (a writer killed mid-line) is cut off when the file is opened.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        _cut_torn_tail(self.path)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        """Append ``record`` as one line and fsync it."""
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        """Close the file. Idempotent."""
        self._f.close()


def _cut_torn_tail(path: Path) -> None:
    """Truncate ``path`` after its last newline (drop a line a killed writer left unfinished)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        f.truncate(data.rfind(b"\n") + 1)


class ReportFailed(RLMError):
    """The sweep's trials ran and are recorded in ``trials.jsonl``, but its report (tables,
    plots) could not be written. Exit code 2 for an OS error (a full disk, a read-only
    directory), 1 for anything else (a bug). ``rlm eval --report OUT`` rebuilds the report
    from the recorded trials without running any of them again."""

    def __init__(self, sweep: "Sweep", exc: BaseException) -> None:
        if isinstance(exc, OSError):
            where = f" ({exc.filename})" if exc.filename else ""
            what = f"{exc.strerror or exc}{where}; check free disk space and permissions"
            self.exit_code = 2
        else:
            what = f"{type(exc).__name__}: {exc} (a bug: please report it)"
        super().__init__(
            f"the trials are recorded in {sweep.trials_path}, but writing the report failed: "
            f"{what}. Rebuild the tables and plots with `rlm eval --report {sweep.out}`; no "
            "trial runs again")


def _unmeasured(record: dict) -> bool:
    """A recorded trial that measured nothing of its method: the model endpoint failed under it
    (down, or failing past its retries). The next run of the sweep runs it again; every other
    failure (out of turns, a cap, a kernel that kept dying) is a result and stays."""
    return record.get("failure") == "EndpointError"


class Sweep:
    """Runs a :class:`Grid` into an output directory, resumably.

    ``OUT/sweep.json`` keeps the grid; a later run into the same directory with another grid is
    refused (:class:`ConfigError`) unless ``force``: then its trials are added to the same
    results (the report covers every trial in ``trials.jsonl``) and the earlier grids are kept
    in ``sweep.json`` under ``"earlier"``. ``OUT/trials.jsonl`` gets one line per finished
    trial (:class:`JsonlWriter`); a trial whose key's last record there has its run id is
    skipped, one whose identity changed since runs again (the new record supersedes the old).
    The journal is the grid's, else ``OUT/journal.sqlite3``. At the end
    :func:`rlm.evaluation.report.write_report` writes the tables and plots.

    Args:
        grid: the trials; out: the output directory (created).
        concurrency: trials run at once on this machine (threads; each trial has its own
            kernels; one :class:`rlm.RLM`, so one embedded model server, is shared).
        ray_address: run each trial as a Ray task on the cluster at this address instead
            (:mod:`rlm.evaluation.ray_runner`).
        force: accept a different grid in an existing output directory.
        make_sample: the sample maker (default: the grid's ``sample_factory`` or the built-in
            tasks); with Ray the workers load the grid's ``sample_factory`` themselves.
        progress: show a progress bar on stderr (trials done/total, ETA, spend).
        allow_mixed: accept trials in ``out`` whose identities differ from this sweep's in
            more than the grid's axes (:func:`rlm.evaluation.identity.mixed_identities`).
        time_budget: seconds the sweep may take (None: no limit): trials run breadth first,
            each started only while its cell's estimated time still fits, and those running
            at the budget are cancelled (:mod:`rlm.evaluation.time_budget`); ``stats["left"]``
            then counts the trials not run.

    ``stats`` after :meth:`run`: ``total``, ``skipped`` (recorded under the same run id),
    ``changed`` (recorded, but their identity changed since: run again), ``run`` (trials run
    now), ``cost_usd`` (USD), ``seconds``, and ``endpoint_errors`` when there were some.
    """

    def __init__(self, grid: Grid, out: Path, *, concurrency: int = 2,
                 ray_address: str | None = None, force: bool = False,
                 make_sample: MakeSample | None = None, progress: bool = True,
                 allow_mixed: bool = False, time_budget: float | None = None) -> None:
        if concurrency < 1:
            raise ConfigError(f"--concurrency must be >= 1, got {concurrency}")
        if grid.journal is None:  # the sweep's own journal, never the shared default one
            grid = replace(grid, journal=str((Path(out) / JOURNAL_FILE).resolve()))
        self.grid, self.out, self.concurrency = grid, Path(out), concurrency
        self.ray_address, self.force, self.progress = ray_address, force, progress
        self.allow_mixed = allow_mixed
        if time_budget is not None and ray_address:
            raise ConfigError("--time-budget works with trials run on this machine, not --ray")
        self.time_budget = time_budget
        self.budget = None  # the TimeBudget of a run under time_budget (its left trials)
        self.make_sample = make_sample or load_sample_factory(grid.sample_factory)
        self.specs = grid.trials()
        self.stats = {"total": len(self.specs), "skipped": 0, "changed": 0, "run": 0,
                      "cost_usd": 0.0, "seconds": 0.0}

    @property
    def trials_path(self) -> Path:
        """``OUT/trials.jsonl``."""
        return self.out / TRIALS_FILE

    def run(self) -> dict[str, Path]:
        """Run every trial not yet in ``trials.jsonl``, then write the report.

        Returns:
            the report's files (``write_report``'s ``{name: path}``).
        Raises:
            ConfigError: something the sweep or its report needs is not installed
                (:func:`rlm.evaluation.needs.check_needs`, before anything is written), another
                grid in ``out`` (without ``force``), trials of an earlier grid in ``out`` that
                differ in more than the axes (without ``allow_mixed``), or a trial's bad setup
                (the sweep stops; finished trials stay recorded).
            ReportFailed: every trial ran and is recorded, but writing the report failed.
            KeyboardInterrupt: interrupted; running trials are cancelled (resumable).
        """
        from rlm.evaluation.needs import check_needs
        check_needs(self.grid)
        self.out.mkdir(parents=True, exist_ok=True)
        self._lock_out()
        try:
            return self._run_locked()
        finally:
            os.close(self._lock_fd)

    def _run_locked(self) -> dict[str, Path]:
        t0 = time.monotonic()
        self._check_grid()
        _cut_torn_tail(self.trials_path)
        from rlm.evaluation.report import read_trials
        recorded = read_trials(self.trials_path) if self.trials_path.is_file() else []
        self.specs = self._identify()
        todo = self._plan({r.get("key"): r for r in recorded})  # the last record of a key wins
        if self.time_budget is not None:
            from rlm.evaluation.time_budget import TimeBudget, breadth_first
            todo = breadth_first(todo)
            self.budget = TimeBudget(self.time_budget, recorded)
        writer = JsonlWriter(self.trials_path)
        records = self._execute(todo)
        try:
            with ProgressBar(self.progress, len(self.specs), self.stats["skipped"]) as bar:
                for rec in records:
                    writer.write(rec)
                    self.stats["run"] += 1
                    self.stats["cost_usd"] += rec.get("cost_usd") or 0.0
                    if rec.get("failure") == "EndpointError":
                        self.stats["endpoint_errors"] = self.stats.get("endpoint_errors", 0) + 1
                    bar.advance(self.stats["cost_usd"])
        finally:
            getattr(records, "close", lambda: None)()  # cancels what still runs
            writer.close()
            self.stats["seconds"] = time.monotonic() - t0
            if self.budget is not None:
                self.stats["left"] = len(self.budget.skipped) + self.budget.cancelled
        if self.budget is not None and not self.stats["run"] and not recorded:
            return {}  # the budget ended before a first trial finished: nothing to report yet
        return self._report()

    def _report(self) -> dict[str, Path]:
        """The report of ``trials.jsonl`` once the trials are paid for: a failure (a full disk,
        a plotting bug) raises :class:`ReportFailed`, which says the trials are kept."""
        from rlm.evaluation.report import write_report
        try:
            return write_report(self.out, allow_mixed=self.allow_mixed)
        except RLMError:
            raise  # mixed identities and missing packages say what to do themselves
        except Exception as exc:
            raise ReportFailed(self, exc) from exc

    def _identify(self) -> list[TrialSpec]:
        """The grid's trials with their identities (:func:`identified`), each sample made once
        (the grid lists the methods of one sample together)."""
        if self.progress:
            print(f"[rlm] eval: building the samples of {len(self.specs)} trials",
                  file=sys.stderr)
        specs, cache = [], {}
        for spec in self.specs:
            where = (spec.task, spec.length, spec.seed, spec.trial)
            if where not in cache:
                cache.clear()
                cache[where] = checked_sample(self.make_sample, where, self.grid.sample_factory)
            specs.append(identified(spec, cache[where]))
        return specs

    def _plan(self, latest: dict[str, dict]) -> list[TrialSpec]:
        """The trials to run: those whose key's last record has another run id (or none).
        Says how many recorded ones changed identity, and refuses (before any trial) a mix
        with trials of an earlier grid that differ in more than the axes.

        Raises:
            ConfigError: such a mix, without ``allow_mixed``.
        """
        todo = [s for s in self.specs if (latest.get(s.key()) or {}).get("run_id") != s.run_id()
                or _unmeasured(latest[s.key()])]
        retried = [s for s in todo if s.key() in latest and _unmeasured(latest[s.key()])]
        changed = [s for s in todo if s.key() in latest and s not in retried]
        self.stats["skipped"] = len(self.specs) - len(todo)
        self.stats["changed"] = len(changed)
        keys = {s.key() for s in self.specs}
        kept = [r for k, r in latest.items() if k not in keys]  # earlier grids' trials
        problems = mixed_identities(kept + [{"identity": s.parts} for s in self.specs])
        if problems and not self.allow_mixed:
            raise ConfigError(
                f"{self.out} holds trials of an earlier grid that differ from this sweep's in "
                f"more than the grid's axes: {'; '.join(problems)}. Run that grid again too "
                "(its trials then run under the current setup), pass --allow-mixed to report "
                "them together, or pick another --out")
        if retried:
            print(f"[rlm] eval: {len(retried)} recorded trials failed on the model endpoint: "
                  "running them again (their journaled calls are not sent again)",
                  file=sys.stderr)
        if changed:
            what = sorted({p for s in changed
                           for p in changed_parts(latest[s.key()].get("identity"), s.parts)})
            print(f"[rlm] eval: {len(changed)} recorded trials changed identity since they ran "
                  f"({', '.join(what)}): running them again", file=sys.stderr)
        return todo

    def _lock_out(self) -> None:
        """One sweep per ``--out`` at a time (two would run, and pay for, every trial twice):
        an exclusive ``flock`` on ``OUT/.lock``, held until this process exits.

        Raises:
            ConfigError: another process holds it.
        """
        import fcntl
        fd = os.open(self.out / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"another rlm eval is running into {self.out}; wait for it, or "
                              "pick another --out") from None
        self._lock_fd = fd

    def _check_grid(self) -> None:
        path = self.out / SWEEP_FILE
        now = self.grid.identity()
        earlier: list = []
        if path.exists():
            try:
                saved = json.loads(path.read_text(encoding="utf-8"))
            except ValueError:
                raise ConfigError(f"{path} is not valid JSON; move it away or pick another "
                                  "--out") from None
            before = saved.get("grid") or {}
            earlier = list(saved.get("earlier") or [])
            ran = self.trials_path.is_file() and self.trials_path.stat().st_size > 0
            if before != now and not ran:
                before = now  # that grid stopped before any trial (a setup error): replace it
            if before != now:
                if not self.force:
                    diff = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
                    raise ConfigError(
                        f"{self.out} holds a sweep with another grid (differs in: "
                        f"{', '.join(diff)}); pass --force to add these trials to its results, "
                        "or pick another --out")
                earlier.append(before)
        # where the trials' runs are, for `rlm export --sweep` (outside the grid: moving the
        # journal does not change what a trial is)
        doc = {"grid": now, "journal": journal_record(self.grid.journal), "earlier": earlier}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    def _execute(self, todo: list[TrialSpec]) -> Iterator[dict]:
        if not todo:
            return iter(())
        if self.ray_address:
            from rlm.evaluation.ray_runner import run_on_ray
            return run_on_ray(todo, self.ray_address)
        # open the journal once before any trial: one that cannot be opened stops the sweep
        # with one error here, not one per trial
        from rlm.config.records import open_journal
        open_journal(self.grid.journal).close()
        return _run_local(todo, self.concurrency, self.make_sample, self.budget)


def _run_local(todo: list[TrialSpec], concurrency: int, make_sample: MakeSample,
               budget: Any = None) -> Iterator[dict]:
    """Run ``todo`` on ``concurrency`` threads with one shared :class:`rlm.RLM`; yields each
    record as its trial finishes. On an exception in the caller (Ctrl-C) or a ConfigError of a
    trial, queued trials are dropped and running ones cancelled (journaled ``cancelled``,
    resumable), and their threads are waited for. Under a ``budget``
    (:class:`~rlm.evaluation.time_budget.TimeBudget`) a trial starts only if it fits, and the
    ones running when it is spent are cancelled (no record: the next run resumes them)."""
    from rlm.aio import CancelToken
    from rlm.api import RLM
    runner = RLM(**todo[0].endpoint_options())
    tokens: dict[Future, CancelToken] = {}
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="rlm-eval")
    queue = iter(todo)
    try:
        pending: set[Future] = set()
        while True:
            while len(pending) < concurrency and _submit(pool, queue, runner, make_sample,
                                                         tokens, pending, budget):
                pass
            if not pending:
                break
            finished, pending = wait(pending, return_when=FIRST_COMPLETED,
                                     timeout=None if budget is None else budget.remaining())
            for fut in finished:
                tokens.pop(fut, None)
                rec = fut.result()
                if budget is not None:
                    budget.record(rec)
                yield rec
            if budget is not None and pending and budget.remaining() <= 0:
                _cancel_at_budget(pending, tokens, budget)
                pending = set()
    finally:
        for token in list(tokens.values()):
            token.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        runner.close()


def _cancel_at_budget(pending: set, tokens: dict, budget: Any) -> None:
    """The budget is spent: cancel the trials still running and wait for them (their runs are
    journaled ``cancelled``; their results, if any came first, are dropped: a resumed run
    gives them next time)."""
    for fut in pending:
        token = tokens.pop(fut, None)
        if token is not None:
            token.cancel()
    wait(pending)
    budget.cancelled += len(pending)


def _submit(pool: ThreadPoolExecutor, queue: Iterator[TrialSpec], runner: Any,
            make_sample: MakeSample, tokens: dict, pending: set, budget: Any = None) -> bool:
    from rlm.aio import CancelToken
    spec = next(queue, None)
    while spec is not None and budget is not None and not budget.admit(spec):
        spec = next(queue, None)  # does not fit what is left of the budget: left for later
    if spec is None:
        return False
    token = CancelToken()
    fut = pool.submit(run_trial, spec, runner=runner, make_sample=make_sample, cancel=token)
    tokens[fut] = token
    pending.add(fut)
    return True
