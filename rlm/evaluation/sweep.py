"""Depth sweeps: one trial as a journaled run (:func:`run_trial`), and the sweep that runs a
grid of them (:class:`Sweep`).

A *trial* is one sample (task, length in tokens, seed, trial index) answered by one method:
``base`` (one plain completion of the task's prompt, the context cut to the model's window) or
``rlm`` at one depth with one prompt profile. Every trial is a journaled run whose id is a
hash of its identity (:meth:`TrialSpec.run_id`), so running the same sweep again

* skips trials already in ``OUT/trials.jsonl`` (one JSON line per finished trial),
* resumes a trial killed mid-run from the journal (recorded model calls are served, not paid
  again), and
* serves a trial that finished in the journal but never reached the JSONL (the process was
  killed between the two) from the journal: its record says ``replayed: true``, no model call.

Where the journal lives: the ``journal`` of the trials (``rlm eval --journal PATH``), else the
default journal of the process running the trial (``$RLM_JOURNAL``, else
``~/.local/share/rlm/journal.sqlite3``). Several threads (and processes) may write one SQLite
journal. For Ray see :mod:`rlm.evaluation.ray_runner`.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from harness.errors import HarnessError, RunMismatchError

from rlm.errors import ConfigError, RLMError
from rlm.config.options import DEFAULT_EMBEDDED_MODEL

#: The methods a sweep compares.
METHODS = ("base", "rlm")
#: The built-in prompt profiles (a profile may also be a prompt file's path).
PROFILES = ("small", "general")
#: Window of a hosted model for the ``base`` method when none is given (tokens).
DEFAULT_BASE_WINDOW = 131072
#: Output cap of a ``base`` call (tokens): the run option ``max_completion_tokens``'s default.
BASE_OUTPUT_TOKENS = 1024
#: The ``base`` prompt is cut to this share of (window - output cap), counted in o200k tokens:
#: the rest is room for a model tokenizer that splits text more finely than o200k and for the
#: chat template's own tokens.
TOKENIZER_MARGIN = 0.9
#: ``Sweep`` file names inside the output directory.
TRIALS_FILE, SWEEP_FILE = "trials.jsonl", "sweep.json"

MakeSample = Callable[[str, int, int, int], Any]


@dataclass(frozen=True)
class TrialSpec:
    """One trial: what to run, and where (picklable: a Ray task carries it).

    Attributes:
        task, length (tokens), seed, trial (index): the sample (``make_sample(task, length,
            seed, trial)``, so every method sees the same samples).
        method: ``"base"`` | ``"rlm"``; depth: ``max_depth`` of an ``rlm`` trial (None for base);
        profile: the ``rlm`` prompt profile (``"small"``, ``"general"`` or a prompt file's path;
            None for base). A file is named by its path: edit it, rename it.
        model: the model's name (hosted), or the embedded model's name.
        base_url: the OpenAI-compatible endpoint; None for the embedded model.
        api_key_env: the environment variable holding the API key (the key itself is never in a
            spec, a record or ``sweep.json``).
        max_cost_per_trial: cost cap of one trial (USD) or None.
        journal: the journal's path, or None for the default journal of the process running it.
        base_window: the model's window (tokens, prompt + output) the ``base`` prompt must fit.
        sample_factory: ``"module:function"`` making samples instead of
            :func:`rlm.evaluation.tasks.make_sample` (your own tasks), or None.
        price_file: a JSON price table (``rlm run --price-file``) for the cost cap, or None.

    Identity (:meth:`key`, :meth:`run_id`): task, length, seed, trial, method, depth, profile and
    model; the rest says where and how the trial runs.
    """

    task: str
    length: int
    seed: int
    trial: int
    method: str
    depth: int | None
    profile: str | None
    model: str
    base_url: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    max_cost_per_trial: float | None = None
    journal: str | None = None
    base_window: int = DEFAULT_BASE_WINDOW
    sample_factory: str | None = None
    price_file: str | None = None

    def identity(self) -> list:
        """The fields naming the trial: ``[task, length, seed, trial, method, depth, profile,
        model]``."""
        return [self.task, self.length, self.seed, self.trial, self.method, self.depth,
                self.profile, self.model]

    def key(self) -> str:
        """The trial's unique key in ``trials.jsonl``: its identity joined with ``|``
        (``"cwe|8192|0|3|rlm|1|small|qwen2.5-coder-0.5b"``; ``-`` for a base's depth/profile)."""
        return "|".join("-" if v is None else str(v) for v in self.identity())

    def run_id(self) -> str:
        """The trial's journal run id: ``"eval-"`` + the first 20 hex digits of the sha256 of
        its identity as JSON (stable across processes, machines and versions)."""
        blob = json.dumps(self.identity(), separators=(",", ":"))
        return "eval-" + hashlib.sha256(blob.encode("utf-8")).hexdigest()[:20]

    def endpoint_options(self) -> dict:
        """The :class:`rlm.RLM` keyword options of the trial's endpoint."""
        if self.base_url is None:
            return {"embedded_model": self.model}
        return {"base_url": self.base_url, "model": self.model, "price_file": self.price_file,
                "api_key": os.environ.get(self.api_key_env) or None}

    def base_prompt_tokens(self) -> int:
        """The ``base`` prompt's size limit (o200k tokens): :data:`TOKENIZER_MARGIN` of
        ``base_window`` minus :data:`BASE_OUTPUT_TOKENS`."""
        return int((self.base_window - BASE_OUTPUT_TOKENS) * TOKENIZER_MARGIN)


def embedded_window(name: str) -> int:
    """The embedded model ``name``'s window per request (tokens): its ``ctx_per_slot``, the
    ``n_ctx`` :class:`rlm.models.embedded.EmbeddedServer` gives each request by default.

    Raises:
        ConfigError: an unknown embedded model.
    """
    from rlm.models.embedded.weights import MODELS
    if name not in MODELS:
        raise ConfigError(f"unknown embedded model {name!r}; choose one of: "
                          f"{', '.join(sorted(MODELS))}")
    return MODELS[name].ctx_per_slot


def load_sample_factory(name: str | None) -> MakeSample:
    """The sample maker ``name`` names (``"module:function"``), or the built-in tasks'
    :func:`rlm.evaluation.tasks.make_sample` for None. The function takes ``(task, length,
    seed, index)`` and returns an object with :class:`rlm.evaluation.tasks.Sample`'s fields and
    methods (``context``, ``query``, ``expected``, ``context_chars``, ``context_tokens``,
    ``base_prompt(max_tokens)``, ``score(answer)``).

    Raises:
        ConfigError: not ``module:function``, or it cannot be imported.
    """
    if name is None:
        from rlm.evaluation.tasks import make_sample
        return make_sample
    mod, _, fn = name.partition(":")
    if not mod or not fn:
        raise ConfigError(f"--sample-factory must be MODULE:FUNCTION, got {name!r}")
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--sample-factory {name!r} cannot be loaded: {exc}") from None


def _profile_options(profile: str | None) -> dict:
    """The run option choosing the prompt profile (``prompt``), once the registry has it;
    before that the built-in system prompt (the ``small`` profile) is used."""
    from rlm.config.options import OPTION_NAMES
    if profile is not None and "prompt" in OPTION_NAMES:
        return {"prompt": profile}
    return {}


def run_trial(spec: TrialSpec, *, runner: Any = None, make_sample: MakeSample | None = None,
              cancel: Any = None) -> dict:
    """Run one trial as a journaled run (or take its recorded result) and return its record.

    Args:
        spec: the trial. runner: an :class:`rlm.RLM` with the spec's endpoint options to run it
            with (shared by a sweep's threads: it keeps one embedded model server); None makes
            one for this trial and closes it after.
        make_sample: the sample maker (default: :func:`load_sample_factory` of the spec's).
        cancel: an :class:`rlm.aio.CancelToken` that cancels the run (it stays resumable).
    Returns:
        the trial record: the keys of the spec ``rlm/evaluation`` documents (``key``,
        ``run_id``, ..., ``score``, ``correct``, ``status``, ``failure``, tokens, ``cost_usd``,
        ``wall_s`` (seconds), ``subcalls``, ``max_depth_reached``, ``replayed``), plus
        ``replayed_calls`` (model calls served from the journal) and ``error`` (why the run did
        not complete, or None). Failures inside the run (endpoint, kernel, budget, divergence...)
        are records with ``status`` ``"error"``/``"failed"``/``"budget_exceeded"``, not raised.
    Raises:
        ConfigError: bad setup (options, prices for a cost cap, a prompt file, the sample
            maker), or the run id was recorded for another sample (the task data or the base
            window changed since: use another journal).
    """
    sample = (make_sample or load_sample_factory(spec.sample_factory))(
        spec.task, spec.length, spec.seed, spec.trial)
    own = runner is None
    if own:
        from rlm.api import RLM
        runner = RLM(**spec.endpoint_options())
    t0 = time.monotonic()
    try:
        res, truncated, error = _attempt(spec, sample, runner, cancel)
    finally:
        if own:
            runner.close()
    replayed = res is not None and error is None and res.tree is None
    wall = _recorded_wall(spec) if replayed else time.monotonic() - t0
    # a resumed or recorded run's own usage leaves out the calls served from the journal
    usage = _journaled_usage(spec) if res is not None and (replayed or res.replayed_calls) \
        else None
    return trial_record(spec, sample, res, truncated=truncated, wall_s=wall, replayed=replayed,
                        error=error, usage=usage)


def _attempt(spec: TrialSpec, sample: Any, runner: Any, cancel: Any) -> tuple:
    """Run the trial's method; returns ``(Result | None, truncated, error | None)``."""
    opts: dict[str, Any] = {"run_id": spec.run_id(), "journal": spec.journal,
                            "max_cost_usd": spec.max_cost_per_trial, "cancel": cancel}
    truncated = False
    try:
        if spec.method == "base":
            prompt, truncated = sample.base_prompt(spec.base_prompt_tokens())
            return runner.plain_completion(prompt, **opts), truncated, None
        if spec.method != "rlm":
            raise ConfigError(f"unknown method {spec.method!r}; choose from {', '.join(METHODS)}")
        res = runner.completion(sample.context, sample.query, max_depth=spec.depth,
                                **_profile_options(spec.profile), **opts)
        return res, truncated, None
    except RunMismatchError as exc:
        raise ConfigError(f"trial {spec.key()}: {exc}. The sample (or the base window) "
                          "changed since this journal recorded it: use another --journal") from None
    except ConfigError:
        raise
    except (RLMError, HarnessError) as exc:
        return getattr(exc, "result", None), truncated, exc


def _recorded_wall(spec: TrialSpec) -> float:
    """Seconds the journal says the trial's run took (finished minus created), or 0.0."""
    from rlm.config.records import open_journal
    rec = open_journal(spec.journal).get_run(spec.run_id()) or {}
    if rec.get("finished_at") and rec.get("created_at"):
        return max(0.0, float(rec["finished_at"]) - float(rec["created_at"]))
    return 0.0


def _journaled_usage(spec: TrialSpec) -> dict:
    """Token and cost totals of the model calls the journal holds for the trial's run
    (``prompt_tokens``, ``completion_tokens``, ``total_tokens``: tokens; ``cost_usd``: USD):
    what the run's path cost whichever attempt sent each call. Calls sent by an attempt that
    was killed before recording them are not in it."""
    from rlm.config.records import open_journal
    out = {"prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0}
    for call in open_journal(spec.journal).model_calls(spec.run_id()):
        u = call.get("usage") or {}
        for k in out:
            out[k] += u.get(k) or 0
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


def _outcome(res: Any, error: BaseException | None, score: float) -> tuple[str, str | None]:
    """``(status, failure kind)`` of a trial (see :func:`trial_record`)."""
    if error is not None:
        return "error", type(error).__name__
    if res.status == "completed":
        return "completed", None if score == 1.0 else "wrong"
    if res.status == "failed":
        return "failed", "max_iterations" if res.reason.startswith("no FINAL") else "failed"
    return res.status, res.status  # budget_exceeded, cancelled


def trial_record(spec: TrialSpec, sample: Any, res: Any, *, truncated: bool, wall_s: float,
                 replayed: bool, error: BaseException | None = None,
                 usage: dict | None = None) -> dict:
    """The JSONL record of one finished trial.

    Args:
        spec: the trial; sample: its sample; res: the run's :class:`rlm.Result` (None if an
            error left none); truncated: the base prompt's context was cut; wall_s: seconds;
        replayed: the whole result came from the journal; error: the error that ended the run;
        usage: token/cost totals to report instead of ``res.usage`` (a resumed run's, from
        the journal).
    Returns:
        a dict with ``score`` (``sample.score(answer)`` for a completed run, else 0.0, in
        0..1), ``correct`` (score == 1.0), ``status`` (the run's status, or ``"error"``),
        ``failure`` (None, ``"wrong"``, ``"max_iterations"``, ``"failed"``,
        ``"budget_exceeded"``, ``"cancelled"`` or the error's class name), token and cost
        totals of the whole run tree (tokens, USD), ``subcalls`` (``llm_query``, ``child`` and
        ``fallback`` stages), ``max_depth_reached`` (deepest level, root 0).
    """
    answer = res.answer if res is not None else None
    completed = error is None and res.status == "completed"
    score = float(sample.score(answer)) if completed else 0.0
    status, failure = _outcome(res, error, score)
    usage = usage if usage is not None else (res.usage if res is not None else {})
    stages = res.stages if res is not None else {}
    reason = str(error) if error is not None else (res.reason or None)
    return {
        "key": spec.key(), "run_id": spec.run_id(), "task": spec.task, "length": spec.length,
        "seed": spec.seed, "trial": spec.trial, "method": spec.method, "depth": spec.depth,
        "profile": spec.profile, "model": spec.model, "answer": answer,
        "expected": list(sample.expected), "score": score, "correct": score == 1.0,
        "status": status, "failure": failure, "truncated": bool(truncated),
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "completion_tokens": int(usage.get("completion_tokens") or 0),
        "tokens": int(usage.get("total_tokens") or 0),
        "cost_usd": float(usage.get("cost_usd") or 0.0), "wall_s": round(float(wall_s), 3),
        "subcalls": sum(int(stages.get(k) or 0) for k in ("llm_query", "child", "fallback")),
        "max_depth_reached": int(res.max_level) if res is not None else 0,
        "context_chars": int(sample.context_chars), "context_tokens": int(sample.context_tokens),
        "replayed": bool(replayed),
        "replayed_calls": int(res.replayed_calls) if res is not None else 0,
        "error": reason,
    }


# --------------------------------------------------------------------------- the grid


@dataclass
class Grid:
    """The trials of a sweep: tasks x lengths x n trials x (``base`` once; ``rlm`` per depth
    per profile), all on one model.

    Attributes:
        tasks (names), lengths (tokens), methods, depths, profiles: the axes; n: trials per
            cell (sample indices 0..n-1); seed: the samples' seed.
        model, base_url, api_key_env, max_cost_per_trial (USD), journal, base_window (tokens),
        sample_factory, price_file: as in :class:`TrialSpec`.
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
    journal: str | None = None
    base_window: int = DEFAULT_BASE_WINDOW
    sample_factory: str | None = None
    price_file: str | None = None

    def trials(self) -> list[TrialSpec]:
        """Every trial, shortest lengths first, then by trial index (so early results cover
        every cell), then task and method."""
        common = dict(model=self.model, base_url=self.base_url, api_key_env=self.api_key_env,
                      max_cost_per_trial=self.max_cost_per_trial, journal=self.journal,
                      base_window=self.base_window, sample_factory=self.sample_factory,
                      price_file=self.price_file)
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
        but where the journal and the price table are and which variable holds the key."""
        d = asdict(self)
        for k in ("journal", "api_key_env", "price_file"):
            d.pop(k)
        return d


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


class Sweep:
    """Runs a :class:`Grid` into an output directory, resumably.

    ``OUT/sweep.json`` keeps the grid; a later run into the same directory with another grid is
    refused (:class:`ConfigError`) unless ``force``: then its trials are added to the same
    results (the report covers every trial in ``trials.jsonl``) and the earlier grids are kept
    in ``sweep.json`` under ``"earlier"``. ``OUT/trials.jsonl`` gets one line per finished
    trial (:class:`JsonlWriter`); trials whose key is already there are skipped. At the end
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
    """

    def __init__(self, grid: Grid, out: Path, *, concurrency: int = 2,
                 ray_address: str | None = None, force: bool = False,
                 make_sample: MakeSample | None = None, progress: bool = True) -> None:
        if concurrency < 1:
            raise ConfigError(f"--concurrency must be >= 1, got {concurrency}")
        self.grid, self.out, self.concurrency = grid, Path(out), concurrency
        self.ray_address, self.force, self.progress = ray_address, force, progress
        self.make_sample = make_sample or load_sample_factory(grid.sample_factory)
        self.specs = grid.trials()
        self.stats = {"total": len(self.specs), "skipped": 0, "run": 0, "cost_usd": 0.0,
                      "seconds": 0.0}

    @property
    def trials_path(self) -> Path:
        """``OUT/trials.jsonl``."""
        return self.out / TRIALS_FILE

    def run(self) -> dict[str, Path]:
        """Run every trial not yet in ``trials.jsonl``, then write the report.

        Returns:
            the report's files (``write_report``'s ``{name: path}``).
        Raises:
            ConfigError: another grid in ``out`` (without ``force``), or a trial's bad setup
                (the sweep stops; finished trials stay recorded).
            KeyboardInterrupt: interrupted; running trials are cancelled (resumable).
        """
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
        from rlm.evaluation.report import read_trials, write_report
        done = ({r.get("key") for r in read_trials(self.trials_path)}
                if self.trials_path.is_file() else set())
        todo = [s for s in self.specs if s.key() not in done]
        self.stats["skipped"] = len(self.specs) - len(todo)
        writer = JsonlWriter(self.trials_path)
        records = self._execute(todo)
        try:
            with _Bar(self.progress, len(self.specs), self.stats["skipped"]) as bar:
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
        return write_report(self.out)

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
        doc = {"grid": now, "earlier": earlier}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    def _execute(self, todo: list[TrialSpec]) -> Iterator[dict]:
        if not todo:
            return iter(())
        if self.ray_address:
            from rlm.evaluation.ray_runner import run_on_ray
            return run_on_ray(todo, self.ray_address)
        # create the journal (file and schema) once, before threads open it at the same time:
        # a new SQLite file's first opens race on setting it up
        from rlm.config.records import open_journal
        open_journal(self.grid.journal).close()
        return _run_local(todo, self.concurrency, self.make_sample)


def _run_local(todo: list[TrialSpec], concurrency: int, make_sample: MakeSample) -> Iterator[dict]:
    """Run ``todo`` on ``concurrency`` threads with one shared :class:`rlm.RLM`; yields each
    record as its trial finishes. On an exception in the caller (Ctrl-C) or a ConfigError of a
    trial, queued trials are dropped and running ones cancelled (journaled ``cancelled``,
    resumable), and their threads are waited for."""
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
                                                         tokens, pending):
                pass
            if not pending:
                break
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                tokens.pop(fut, None)
                yield fut.result()
    finally:
        for token in list(tokens.values()):
            token.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        runner.close()


def _submit(pool: ThreadPoolExecutor, queue: Iterator[TrialSpec], runner: Any,
            make_sample: MakeSample, tokens: dict, pending: set) -> bool:
    from rlm.aio import CancelToken
    spec = next(queue, None)
    if spec is None:
        return False
    token = CancelToken()
    fut = pool.submit(run_trial, spec, runner=runner, make_sample=make_sample, cancel=token)
    tokens[fut] = token
    pending.add(fut)
    return True


class _Bar:
    """The sweep's progress bar on stderr (rich): trials done/total, elapsed, ETA, spend."""

    def __init__(self, enabled: bool, total: int, done: int) -> None:
        self.enabled, self.total, self.done = enabled, total, done
        self._progress = None
        self._task = None
        self._lock = threading.Lock()

    def __enter__(self) -> "_Bar":
        if self.enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)
            self._progress = Progress(
                TextColumn("[rlm eval] trials"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                TextColumn("spent ${task.fields[spend]:.4f}"),
                console=Console(stderr=True))
            self._progress.start()
            self._task = self._progress.add_task("trials", total=self.total,
                                                 completed=self.done, spend=0.0)
        return self

    def advance(self, spend: float) -> None:
        """One more trial finished; ``spend``: USD spent by this run so far."""
        if self._progress is not None:
            self._progress.update(self._task, advance=1, spend=spend)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

