"""The public Python API: :func:`completion`, the :class:`RLM` class and :class:`Result`.

>>> import rlm
>>> res = rlm.completion(Path("essays.txt"), "What is the magic number?",
...                      base_url="http://127.0.0.1:8000/v1", model="my-model")
>>> res.answer, res.status, res.usage["total_tokens"]
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from harness.budget import Budget
from harness.errors import BudgetExceeded
from harness.prices import PriceTable
from harness.stages import Kind, StageTree, Status

from .context import load_context
from .errors import ConfigError, DivergenceError, RLMError, RunActiveError
from .runner import Instance, Options, Run, _Replay

DEFAULT_EMBEDDED = "qwen2.5-coder-0.5b"

#: Journal states for which a run id returns the recorded result instead of running again.
#: ``failed``/``cancelled``/``crashed`` runs are resumed (a retried workflow step continues).
RECORDED_STATES = ("completed", "budget_exceeded")


@dataclass
class Result:
    """What a run produced.

    Attributes:
        answer: the answer set by executed ``FINAL``/``FINAL_VAR`` (str), or on a
            budget stop the best partial answer that exists (str | None).
        status: ``completed``, ``failed``, ``budget_exceeded`` or ``cancelled``.
        run_id: the run's id (str); the journal key for resume/replay.
        iterations: root loop turns taken (int).
        usage: ``prompt_tokens``, ``completion_tokens``, ``total_tokens``, ``calls``,
            ``cost_usd`` (USD), plus ``by_model`` and ``by_level`` breakdowns.
        reason: why the run ended when it did not complete (str).
        cap: the budget cap that ended it (``cost``, ``tokens``, ``calls``, ``wall``...).
        stages: stage counts by kind (iteration, cell, llm_query, child, fallback...).
        max_level: deepest level reached (int; root = 0).
        kernels_started: kernels started for this run (int).
        seconds: wall time of the run (s).
        replayed_calls: model calls served from the journal (not sent, not charged).
        tree: the :class:`harness.stages.StageTree` (not in :meth:`to_dict`).
    """

    answer: str | None
    status: str
    run_id: str
    iterations: int = 0
    usage: dict = field(default_factory=dict)
    reason: str = ""
    cap: str | None = None
    stages: dict = field(default_factory=dict)
    max_level: int = 0
    kernels_started: int = 0
    seconds: float = 0.0
    replayed_calls: int = 0
    tree: StageTree | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        """A JSON-able dict of every field except ``tree``."""
        return {"answer": self.answer, "status": self.status, "run_id": self.run_id,
                "iterations": self.iterations, "usage": self.usage, "reason": self.reason,
                "cap": self.cap, "stages": self.stages, "max_level": self.max_level,
                "kernels_started": self.kernels_started, "seconds": round(self.seconds, 3),
                "replayed_calls": self.replayed_calls}


_OPTION_KEYS = {
    "model", "sub_model", "child_model", "base_url", "api_key", "max_iterations", "max_depth",
    "cell_timeout", "max_output_chars", "max_completion_tokens", "sub_max_tokens",
    "sub_prompt_chars", "temperature", "max_cost_usd", "max_tokens", "max_calls",
    "max_wall_seconds", "max_children_per_call", "max_concurrency", "pool_size",
    "max_kernel_restarts", "max_attempts", "journal", "run_id", "embedded_model", "price_file",
    "on_progress", "divergence", "system_template", "encoding",
    # many-file contexts (see rlm/sources.py)
    "include", "exclude", "max_context_bytes",
}


def _usage(tree: StageTree) -> dict:
    total = tree.rollup("run") if "run" in tree else None
    out = total.to_dict() if total is not None else {
        "prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "calls": 0, "cost_usd": 0.0}
    out["by_model"] = {m: u.to_dict() for m, u in tree.usage_by_model().items()}
    out["by_level"] = {str(k): u.to_dict() for k, u in tree.usage_by_level().items()}
    return out


class RLM:
    """Holds options for repeated runs; keeps an embedded model server alive between them.

    Keyword options (all optional; see README "Options" for the CLI flags):
        model, sub_model, child_model (str): model names. Without ``base_url``
            (and without ``OPENAI_BASE_URL``/``OPENAI_API_KEY``) the embedded model serves all.
        base_url, api_key (str): an OpenAI-compatible endpoint; default from
            ``OPENAI_BASE_URL``/``OPENAI_API_KEY``.
        max_iterations (int, 20), max_depth (int, 1), cell_timeout (s, 60),
        max_output_chars (characters, 4000), max_cost_usd (USD), max_tokens (tokens),
        max_calls (int), max_wall_seconds (s), max_children_per_call (int),
        max_concurrency (int, 8), pool_size (kernels), journal (path, or False for
        none; default ``$RLM_JOURNAL`` or the user data dir), embedded_model
        (``qwen2.5-coder-0.5b`` | ``qwen2.5-coder-1.5b`` | ``smollm2-135m``),
        price_file (JSON path), on_progress (callable taking a str), divergence
        (``"stop"`` | ``"live"``).

    Raises:
        ConfigError: unknown option names or bad values.
    """

    def __init__(self, **options: Any) -> None:
        unknown = set(options) - _OPTION_KEYS
        if unknown:
            raise ConfigError(f"unknown option(s): {', '.join(sorted(unknown))}")
        self.options = options
        self._server = None
        self._lock = threading.Lock()

    # endpoint ------------------------------------------------------------------
    def _endpoint(self, o: dict) -> tuple[str, str | None, str]:
        base_url = o.get("base_url") or os.environ.get("OPENAI_BASE_URL")
        api_key = o.get("api_key") or os.environ.get("OPENAI_API_KEY")
        if base_url or api_key:
            model = o.get("model") or os.environ.get("RLM_MODEL")
            if not model:
                raise ConfigError("a model endpoint is configured but no model name: pass "
                                  "--model NAME (or model=...)")
            return base_url or "https://api.openai.com/v1", api_key, model
        with self._lock:
            if self._server is None:
                from .embedded import EmbeddedServer
                name = o.get("embedded_model") or DEFAULT_EMBEDDED
                progress = o.get("on_progress")
                if progress:
                    progress(f"starting the embedded model {name} on 127.0.0.1")
                srv = EmbeddedServer(name)
                srv.start()
                self._server = srv
            return self._server.base_url, self._server.api_key, self._server.model_name

    def close(self) -> None:
        """Stop the embedded model server, if one was started. Idempotent."""
        with self._lock:
            srv, self._server = self._server, None
        if srv is not None:
            srv.stop()

    def __enter__(self) -> "RLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # runs ------------------------------------------------------------------------
    def _options(self, o: dict, journal) -> Options:
        base_url, api_key, model = self._endpoint(o)
        embedded = o.get("base_url") is None and not os.environ.get("OPENAI_BASE_URL") \
            and not (o.get("api_key") or os.environ.get("OPENAI_API_KEY"))
        try:
            budget = Budget(max_cost_usd=o.get("max_cost_usd"), max_tokens=o.get("max_tokens"),
                            max_calls=o.get("max_calls"),
                            max_wall_seconds=o.get("max_wall_seconds"),
                            max_iterations=int(o["max_iterations"] if o.get("max_iterations")
                                               is not None else (6 if embedded else 20)),
                            max_depth=int(o.get("max_depth", 1)),
                            max_children_per_call=o.get("max_children_per_call"),
                            max_concurrency=int(o.get("max_concurrency", 8)))
        except (ValueError, TypeError) as exc:
            raise ConfigError(str(exc)) from None
        prices = PriceTable()
        if o.get("price_file"):
            try:
                prices = PriceTable.from_file(o["price_file"])
            except Exception as exc:
                raise ConfigError(str(exc)) from None
        if embedded:
            prices.add_local(model)
        opts = Options(model=model if embedded else (o.get("model") or model),
                       sub_model=None if embedded else o.get("sub_model"),
                       child_model=None if embedded else o.get("child_model"),
                       base_url=base_url, api_key=api_key,
                       max_iterations=budget.max_iterations, max_depth=budget.max_depth,
                       budget=budget, prices=prices, journal=journal, embedded=embedded)
        for k in ("cell_timeout", "max_output_chars", "max_completion_tokens", "sub_max_tokens",
                  "sub_prompt_chars", "temperature", "pool_size", "max_kernel_restarts",
                  "max_attempts", "on_progress", "divergence", "system_template"):
            if o.get(k) is not None:
                setattr(opts, k, o[k])
        if embedded:
            # a small local model: keep what we feed it small (its window is 8k tokens per slot)
            if o.get("max_output_chars") is None:
                opts.max_output_chars = 2000
            if o.get("sub_prompt_chars") is None:
                opts.sub_prompt_chars = 4000
            if o.get("sub_max_tokens") is None:
                # sub-call answers here are a few tokens; a rambling one costs ~25 s at 512
                opts.sub_max_tokens = 256
        if opts.max_depth < 0:
            raise ConfigError("max_depth must be >= 0")
        if opts.divergence not in ("stop", "live"):
            raise ConfigError("divergence must be 'stop' or 'live'")
        return opts

    def completion(self, context: Any, query: str | None = None, **overrides: Any) -> Result:
        """Run one RLM over ``context`` (str, list, dict, or a ``Path``/``"-"`` to load).

        Returns:
            :class:`Result`. Budget stops return a Result with status ``budget_exceeded``.
        Raises:
            ContextError: the context is empty, binary, missing or undecodable.
            EndpointError: the model endpoint failed (after retries).
            KernelError: a kernel could not start or kept dying.
            DivergenceError: resume/replay found a request that differs from the journal.
            RunActiveError: ``run_id`` names a run that is still running elsewhere.
            ConfigError: bad options.
        """
        unknown = set(overrides) - _OPTION_KEYS
        if unknown:
            raise ConfigError(f"unknown option(s): {', '.join(sorted(unknown))}")
        o = {**self.options, **overrides}
        validate_options(o)
        if o.get("model") and not (o.get("base_url") or os.environ.get("OPENAI_BASE_URL")
                                   or o.get("api_key") or os.environ.get("OPENAI_API_KEY")):
            raise ConfigError(f"--model {o['model']!r} needs an endpoint: pass --base-url (or set "
                              "OPENAI_BASE_URL / OPENAI_API_KEY); without one the embedded model "
                              "is used, chosen with --embedded-model")
        journal = _open_journal(o.get("journal"))
        run_id = o.get("run_id")
        replay = None
        ctx = load_context(context, **context_options(o))
        try:
            if journal is not None and run_id:
                rec = journal.get_run(run_id)
                if rec is not None:
                    replay = self._prepare_rerun(journal, rec, ctx, query, o)
                    if isinstance(replay, Result):
                        ctx.discard()
                        return replay
            opts = self._options(o, journal)
        except BaseException:
            ctx.discard()
            raise
        return execute(opts, ctx, query, run_id=run_id, replay=replay)

    @staticmethod
    def _prepare_rerun(journal, rec: dict, ctx, query: str | None, o: dict):
        """A run id that is already in the journal: its recorded Result, or a _Replay to resume."""
        run_id = rec["run_id"]
        _check_same_run(rec, ctx, query)
        if rec["state"] in RECORDED_STATES:
            return _recorded_result(journal, rec)
        if rec["state"] == "running":
            age = time.time() - (rec.get("heartbeat_at") or 0)
            raise RunActiveError(
                f"run {run_id} is still running (pid {rec.get('owner_pid')} on "
                f"{rec.get('owner_host')}, heartbeat {age:.0f} s ago); wait for it "
                "to finish, or resume it once its heartbeat is stale")
        if not journal.claim_run(run_id):
            raise RunActiveError(f"run {run_id} could not be claimed for resume "
                                 "(another process took it first)")
        return _Replay(journal, run_id, strict=False, policy=o.get("divergence") or "stop")


def _check_same_run(rec: dict, ctx, query: str | None) -> None:
    """A run id names one question about one context: refuse to reuse it for another."""
    if (rec.get("query") or "") != (query or ""):
        raise ConfigError(f"run id {rec['run_id']!r} was recorded with another query "
                          f"({rec.get('query')!r}); use a new --run-id for a new question")
    want = (rec.get("options") or {}).get("context_sha256")
    if want:
        if ctx.sha256 != want:
            raise ConfigError(f"run id {rec['run_id']!r} was recorded with another context "
                              "(sha256 differs); use a new --run-id for a new context")


#: The deepest tree a run may ask for: each level holds kernels (about 60 MB each) while
#: its children run, so a runaway recursion is refused before it exhausts memory.
MAX_DEPTH_LIMIT = 8

# option -> (CLI flag, minimum, strictly greater than the minimum?, maximum)
_NUMERIC = {
    "max_depth": ("--max-depth", 0, False, MAX_DEPTH_LIMIT),
    "max_iterations": ("--max-iterations", 1, False, 10_000),
    "cell_timeout": ("--cell-timeout", 0, True, 86_400),
    "max_output_chars": ("--max-output-chars", 100, False, 10_000_000),
    "max_completion_tokens": ("max_completion_tokens", 1, False, 1_000_000),
    "sub_max_tokens": ("sub_max_tokens", 1, False, 1_000_000),
    "sub_prompt_chars": ("sub_prompt_chars", 100, False, 10_000_000),
    "max_cost_usd": ("--max-cost", 0, True, 1e9),
    "max_tokens": ("--max-tokens", 1, False, 10**15),
    "max_calls": ("--max-calls", 1, False, 10**12),
    "max_wall_seconds": ("--timeout", 0, True, 10**9),
    "max_children_per_call": ("--max-children", 1, False, 10**6),
    "max_concurrency": ("--concurrency", 1, False, 1024),
    "pool_size": ("--pool-size", 0, False, 64),
    "max_attempts": ("--max-attempts", 1, False, 100),
    "max_kernel_restarts": ("max_kernel_restarts", 0, False, 100),
    "max_context_bytes": ("--max-context-bytes", 1, False, 2**40),
}


def validate_options(o: dict) -> None:
    """Check option values before anything starts; messages name the CLI flag.

    Raises:
        ConfigError: a value out of range, not a number, or a bad endpoint URL.
    """
    import math
    for key, (flag, lo, strict, hi) in _NUMERIC.items():
        v = o.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"{flag} must be a finite number, got {v!r}")
        if (v <= lo if strict else v < lo) or v > hi:
            rel = f"> {lo:g}" if strict else f">= {lo:g}"
            raise ConfigError(f"{flag} must be {rel} and <= {hi:g}, got {v!r}")
    url = o.get("base_url")
    if url is not None and not str(url).startswith(("http://", "https://")):
        raise ConfigError(f"--base-url must be an http:// or https:// URL, got {url!r}")
    if o.get("run_id") is not None and not str(o["run_id"]).strip():
        raise ConfigError("--run-id must not be empty")
    for key in ("include", "exclude"):
        v = o.get(key)
        if v is not None and not (isinstance(v, str) or (isinstance(v, (list, tuple)) and all(
                isinstance(x, str) for x in v))):
            raise ConfigError(f"--{key} must be a glob pattern or a list of them, got {v!r}")


def context_options(o: dict) -> dict:
    """The keyword arguments of :func:`load_context` among the run options."""
    pats = {k: [o[k]] if isinstance(o.get(k), str) else (list(o[k]) if o.get(k) else None)
            for k in ("include", "exclude")}
    return {"encoding": o.get("encoding"), "max_bytes": o.get("max_context_bytes"), **pats}


def _new_id() -> str:
    import uuid
    return uuid.uuid4().hex[:16]


def _open_journal(spec):
    if spec is False:
        return None
    from harness.journal import Journal, JournalError
    try:
        return Journal(spec if spec not in (None, True) else None)
    except JournalError as exc:
        raise ConfigError(str(exc)) from None


def _recorded_result(journal, rec: dict) -> Result:
    usage = dict(rec.get("usage") or {})
    extra = {k: usage.pop(k, None) for k in ("iterations", "cap", "stages", "max_level",
                                              "kernels_started")}
    return Result(answer=rec.get("answer"), status=rec.get("status") or rec["state"],
                  run_id=rec["run_id"], iterations=int(extra["iterations"] or 0),
                  usage=usage, reason=rec.get("error") or "", cap=extra["cap"],
                  stages=extra["stages"] or {}, max_level=int(extra["max_level"] or 0),
                  kernels_started=int(extra["kernels_started"] or 0), replayed_calls=0)


def execute(opts: Options, ctx, query: str | None, *, run_id: str | None = None,
            replay: _Replay | None = None, client=None, record: bool = True) -> Result:
    """Drive one run tree to its end and return the :class:`Result`.

    The journal (``opts.journal``) gets the run record, every stage event, every
    model call and cell, and the final status; kernels are always shut down.
    """
    t0 = time.monotonic()
    run = Run(opts, run_id=run_id, replay=replay, client=client)
    if opts.budget.max_cost_usd is not None:
        # a configuration error at start: refused before the run is journaled or started
        try:
            run.accountant.check_prices({m for m in (opts.model, opts.sub_model,
                                                     opts.child_model) if m})
        except Exception as exc:
            run.close()
            raise ConfigError(str(exc)) from None
    journal = opts.journal if record else None
    hb = None
    if journal is not None:
        if replay is None:
            journal.create_run(run.run_id, query=query or "", model=opts.model,
                               sub_model=opts.sub_model, max_depth=opts.max_depth,
                               options=stored_options(opts, ctx))
        hb = journal.start_heartbeat(run.run_id)
    status, answer, reason, cap, exc_out = "failed", None, "", None, None
    inst = None
    try:
        root = run.start_stage(None, Kind.run, 0, model=opts.model, meta={"query": query})
        inst = Instance(run, root.id, 0, ctx, query, opts.model)
        try:
            out = inst.loop()
            answer, status, reason = out.answer, out.status, out.reason
            run.end_stage(root.id, Status.completed if status == "completed" else Status.failed,
                          evidence=answer, error=reason or None)
        except BudgetExceeded as exc:
            status, reason, cap = "budget_exceeded", str(exc), exc.cap
            answer = inst.partial_answer() if hasattr(inst, "partial_answer") else None
            run.end_stage(root.id, Status.budget_exceeded, error=reason)
        except KeyboardInterrupt:
            status, reason = "cancelled", "interrupted"
            run.end_stage(root.id, Status.cancelled, error=reason)
            exc_out = KeyboardInterrupt()
        except (RLMError, DivergenceError) as exc:
            status, reason = "failed", str(exc)
            run.end_stage(root.id, Status.failed, error=reason)
            exc_out = exc
    finally:
        run.close()
        _settle_open_stages(run.tree, "cancelled" if status in ("cancelled", "budget_exceeded")
                            or exc_out is not None else "failed")
    res = Result(answer=answer, status=status, run_id=run.run_id,
                 iterations=inst.iterations if inst else 0, usage=_usage(run.tree),
                 reason=reason, cap=cap, stages=run.tree.counts_by_kind(),
                 max_level=run.tree.max_level(), kernels_started=run.kernels_started,
                 seconds=time.monotonic() - t0,
                 replayed_calls=replay.served if replay else 0, tree=run.tree)
    if journal is not None:
        if hb is not None:
            hb.stop()
        usage = dict(res.usage)
        usage["iterations"] = res.iterations
        usage["cap"] = res.cap
        usage["stages"] = res.stages
        usage["max_level"] = res.max_level
        usage["kernels_started"] = res.kernels_started
        journal.finish_run(run.run_id, status=status if not isinstance(exc_out, KeyboardInterrupt)
                           else "cancelled", answer=answer, usage=usage, error=reason or None)
    if exc_out is not None:
        if isinstance(exc_out, RLMError):
            exc_out.result = res  # type: ignore[attr-defined]
        raise exc_out
    return res


#: Options kept in the journal so that ``rlm resume``/``rlm replay`` rebuild the same run.
_STORED = ("model", "sub_model", "child_model", "max_iterations", "max_depth", "cell_timeout",
           "max_output_chars", "max_completion_tokens", "sub_max_tokens", "sub_prompt_chars",
           "temperature", "max_kernel_restarts", "system_template")


def stored_options(opts: Options, ctx) -> dict:
    """The JSON-able settings a run needs to be re-driven (never the API key)."""
    d = {k: getattr(opts, k) for k in _STORED}
    d["base_url"] = opts.base_url
    d["embedded"] = opts.embedded
    d["budget"] = opts.budget.to_dict()
    d["context_source"] = os.path.abspath(ctx.source) if ctx.source not in (
        "<value>", "<stdin>", "<bytes>") and ctx.fmt != "bundle" else None
    d["context_spec"] = ctx.spec  # a directory/glob/paths context: how to load it again
    d["context_fmt"] = ctx.fmt
    d["context_encoding"] = getattr(ctx, "encoding", "utf-8")
    d["context_sha256"] = ctx.sha256
    return d


def _stored_run(journal, run_id: str) -> dict:
    rec = journal.get_run(run_id)
    if rec is None:
        raise ConfigError(f"no run {run_id!r} in journal {journal.path}; list runs with `rlm runs`")
    return rec


def _stored_source(rec: dict) -> Any:
    """The context a recorded run was loaded from: a Path, a list of Paths, or None."""
    o = rec.get("options") or {}
    spec = o.get("context_spec")
    if spec:
        return [Path(p) for p in spec["sources"]]
    return Path(o["context_source"]) if o.get("context_source") else None


def _stored_context(rec: dict, context: Any, encoding: str | None = None):
    o = rec.get("options") or {}
    if context is None:
        context = _stored_source(rec)
        if context is None:
            raise ConfigError(f"run {rec['run_id']} was given its context as a value or on stdin; "
                              "pass it again with --context PATH")
    spec = o.get("context_spec") or {}
    ctx = load_context(context, encoding=encoding or o.get("context_encoding") or "utf-8",
                       include=spec.get("include"), exclude=spec.get("exclude"),
                       max_bytes=spec.get("max_bytes"))
    want = o.get("context_sha256")
    if want and ctx.sha256 != want:
        raise DivergenceError(f"the context of run {rec['run_id']} has changed since it was "
                              "recorded (sha256 differs); resume/replay need the same context")
    return ctx


def replay(run_id: str, *, journal: Any = None, context: Any = None, encoding: str | None = None,
           on_progress: Callable[[str], None] | None = None) -> Result:
    """Re-execute a finished run with zero model calls and check it reaches the same answer.

    Every model call is served from the journal (by call id and request hash);
    cells really re-execute in fresh kernels. Nothing is written to the journal.

    Returns:
        the replayed :class:`Result` (``replayed_calls`` = calls served).
    Raises:
        DivergenceError: a call is missing from the journal, its request differs
            (e.g. an edited journal or a non-deterministic cell), or the answer differs.
        ConfigError: unknown run, or a run that has not finished.
    """
    j = _open_journal(journal if journal is not None else None)
    rec = _stored_run(j, run_id)
    if rec["state"] not in ("completed", "failed", "budget_exceeded"):
        raise ConfigError(f"run {run_id} is {rec['state']}; only a finished run can be replayed "
                          "(resume it with `rlm resume`)")
    ctx = _stored_context(rec, context, encoding)
    opts = _options_from_record(rec, journal=None)
    opts.on_progress = on_progress
    rp = _Replay(j, run_id, strict=True, policy="stop")
    res = execute(opts, ctx, rec.get("query") or None, run_id=run_id, replay=rp, record=False)
    if res.answer != rec.get("answer"):
        raise DivergenceError(f"replay of run {run_id} reached a different answer: "
                              f"{res.answer!r} instead of {rec.get('answer')!r}")
    return res


def _options_from_record(rec: dict, journal) -> Options:
    o = dict(rec.get("options") or {})
    budget = Budget.from_dict(o.pop("budget", {}) or {})
    opts = Options(budget=budget, journal=journal)
    for k in _STORED:
        if k in o:
            setattr(opts, k, o[k])
    opts.base_url = o.get("base_url")
    return opts


def resume(run_id: str, *, context: Any = None, **options: Any) -> Result:
    """Resume a crashed, failed or interrupted run from the journal.

    Re-drives it from its start in fresh kernels; every model call whose id and
    request hash match the journal is served from it (not sent, not charged);
    the run goes live at the first call the journal does not hold. A finished
    run returns its recorded result at once.

    Raises:
        RunActiveError: the run is still running (fresh heartbeat).
        DivergenceError: a recorded call differs (policy ``divergence="stop"``).
        ConfigError: unknown run id.
    """
    j = _open_journal(options.get("journal"))
    rec = _stored_run(j, run_id)
    if rec["state"] in RECORDED_STATES:
        return _recorded_result(j, rec)
    ctx_src = context
    enc = options.pop("encoding", None) or (rec.get("options") or {}).get("context_encoding")
    if ctx_src is None:
        _stored_context(rec, None, enc).discard()  # checks it is there and unchanged
        ctx_src = _stored_source(rec)
    stored = dict(rec.get("options") or {})
    spec = stored.get("context_spec") or {}
    for src, dst in (("include", "include"), ("exclude", "exclude"),
                     ("max_bytes", "max_context_bytes")):
        if spec.get(src) is not None and options.get(dst) is None:
            options[dst] = spec[src]
    merged = {k: stored[k] for k in _STORED if stored.get(k) is not None}
    b = stored.get("budget") or {}
    for src, dst in (("max_cost_usd", "max_cost_usd"), ("max_tokens", "max_tokens"),
                     ("max_calls", "max_calls"), ("max_wall_seconds", "max_wall_seconds"),
                     ("max_children_per_call", "max_children_per_call"),
                     ("max_concurrency", "max_concurrency")):
        if b.get(src) is not None:
            merged[dst] = b[src]
    if not stored.get("embedded") and stored.get("base_url"):
        merged["base_url"] = stored["base_url"]
    if stored.get("embedded"):
        merged.pop("model", None)
        merged.pop("sub_model", None)
        merged.pop("child_model", None)
    merged.update({k: v for k, v in options.items() if v is not None})
    merged["run_id"] = run_id
    if enc:
        merged["encoding"] = enc
    with RLM(**merged) as r:
        return r.completion(ctx_src, rec.get("query") or None)


def _settle_open_stages(tree: StageTree, why: str) -> None:
    """Stages still pending/running when the run ended (in-flight calls at an interrupt,
    children cut off by a cap) are marked cancelled, so no stage stays "running" forever."""
    for st in tree.all():
        if st.status in (Status.pending, Status.running):
            try:
                tree.transition(st.id, st.status, Status.cancelled,
                                error=f"run ended ({why}) while this stage was in flight")
            except Exception:
                pass


def completion(context: Any, query: str | None = None, **options: Any) -> Result:
    """Run one RLM: ``context`` (str/list/dict, or ``Path``/``"-"``) and an optional ``query``.

    Same options as :class:`RLM`. An embedded model server started for this
    call is stopped before it returns. See :meth:`RLM.completion` for errors.
    """
    with RLM(**options) as r:
        return r.completion(context, query)
