"""One trial of a depth sweep: its identity (:class:`TrialSpec`, whose run id hashes what decides
its result) and :func:`run_trial`, a journaled RLM run or the ``base`` plain completion, with its
JSONL record (:func:`trial_record`).

A *trial* is one sample (task, length in tokens, seed, trial index) answered by one method:
``base`` (one plain completion of the task's prompt, the context cut to the model's window) or
``rlm`` at one depth with one prompt profile. :mod:`rlm.evaluation.sweep` runs a grid of them;
:mod:`rlm.evaluation.ray_runner` runs them on Ray.
"""
from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from harness.errors import HarnessError, RunMismatchError

from rlm.errors import ConfigError, RLMError

#: The methods a sweep compares.
METHODS = ("base", "rlm")
#: The built-in prompt profiles (a profile may also be a prompt file's path).
PROFILES = ("small", "small-count", "general")
#: Window of a hosted model for the ``base`` method when none is given (tokens).
DEFAULT_BASE_WINDOW = 131072
#: Output cap of a ``base`` call (tokens): the run option ``max_completion_tokens``'s default.
BASE_OUTPUT_TOKENS = 1024
#: The ``base`` prompt is cut to this share of (window - output cap), counted in o200k tokens:
#: the rest is room for a model tokenizer that splits text more finely than o200k and for the
#: chat template's own tokens.
TOKENIZER_MARGIN = 0.9

MakeSample = Callable[[str, int, int, int], Any]


@dataclass(frozen=True)
class TrialSpec:
    """One trial: what to run, and where (picklable: a Ray task carries it).

    Attributes:
        task, length (tokens), seed, trial (index): the sample (``make_sample(task, length,
            seed, trial)``, so every method sees the same samples).
        method: ``"base"`` | ``"rlm"``; depth: ``max_depth`` of an ``rlm`` trial (None for base);
        profile: the ``rlm`` prompt profile (``"small"``, ``"small-count"``, ``"general"`` or a
            prompt file's path;
            None for base). A file is named by its path: edit it, rename it.
        model: the model's name (hosted), or the embedded model's name.
        base_url: the OpenAI-compatible endpoint; None for the embedded model.
        api_key_env: the environment variable holding the API key (the key itself is never in a
            spec, a record or ``sweep.json``).
        max_cost_per_trial: cost cap of one trial (USD) or None.
        trial_timeout: wall-clock cap of one trial's run (seconds; the run option
            ``max_wall_seconds``) or None. A trial stopped by it is ``budget_exceeded``.
        journal: the journal's path, or None for the default journal of the process running it.
        base_window: the model's window (tokens, prompt + output) the ``base`` prompt must fit.
        sample_factory: ``"module:function"`` making samples instead of
            :func:`rlm.evaluation.tasks.make_sample` (your own tasks), or None.
        price_file: a JSON price table (``rlm run --price-file``) for the cost cap, or None.
        embedded_threads, embedded_slots: the embedded model server's compute threads and
            request slots (None: its defaults); how fast, not what, it answers.
        parts: the trial's identity (:func:`rlm.evaluation.identity.identity_parts`), filled
            by :func:`identified`; None until then.

    Its place in the grid (:meth:`axes`, :meth:`key`): task, length, seed, trial, method,
    depth, profile and model. Its run id (:meth:`run_id`) hashes everything that decides its
    result (``parts``): the sample, the rendered prompts, the model's identity, the settings
    and the harness version. The rest says where and how the trial runs.
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
    trial_timeout: float | None = None
    journal: str | None = None
    base_window: int = DEFAULT_BASE_WINDOW
    sample_factory: str | None = None
    price_file: str | None = None
    embedded_threads: int | None = None
    embedded_slots: int | None = None
    parts: dict | None = field(default=None, compare=False, hash=False, repr=False)

    def axes(self) -> list:
        """The trial's place in the grid: ``[task, length, seed, trial, method, depth, profile,
        model]``."""
        return [self.task, self.length, self.seed, self.trial, self.method, self.depth,
                self.profile, self.model]

    def key(self) -> str:
        """The trial's unique key in ``trials.jsonl``: its axes joined with ``|``
        (``"cwe|8192|0|3|rlm|1|small|qwen2.5-coder-0.5b"``; ``-`` for a base's depth/profile)."""
        return "|".join("-" if v is None else str(v) for v in self.axes())

    def run_id(self) -> str:
        """The trial's journal run id: ``"eval-"`` + 20 hex digits of the sha256 of its
        identity parts (:func:`rlm.evaluation.identity.run_id_of`). A spec not yet
        :func:`identified` makes its sample to compute them.

        Raises:
            ConfigError: the sample or the options cannot be built.
        """
        from rlm.evaluation.identity import run_id_of
        spec = self if self.parts is not None else identified(self)
        return run_id_of(spec.parts)

    def endpoint_options(self) -> dict:
        """The :class:`rlm.RLM` keyword options of the trial's endpoint."""
        if self.base_url is None:
            opts: dict[str, Any] = {"embedded_model": self.model}
            if self.embedded_threads is not None:
                opts["embedded_threads"] = self.embedded_threads
            if self.embedded_slots is not None:
                opts["embedded_slots"] = self.embedded_slots
            return opts
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


#: What a sample must have (:func:`load_sample_factory`): fields, then methods.
SAMPLE_FIELDS = ("context", "query", "expected", "context_chars", "context_tokens")
SAMPLE_METHODS = ("base_prompt", "score")


def checked_sample(make_sample: MakeSample, where: tuple, factory: str | None) -> Any:
    """The sample ``make_sample(*where)`` makes (``where``: task, length, seed, index), checked
    before any trial pays for it: it has :data:`SAMPLE_FIELDS` and :data:`SAMPLE_METHODS`, a
    context that is not empty, and a ``score`` that works (an unknown metric fails there).

    Raises:
        ConfigError: the factory failed or made something that is not such a sample; the
            message names the factory and the sample.
    """
    task, length, seed, index = where
    who = f"--sample-factory {factory}" if factory else "the built-in tasks"
    what = f"the sample of task {task!r}, length {length}, seed {seed}, trial {index}"
    try:
        sample = make_sample(*where)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code: say whose it is
        raise ConfigError(f"{who} failed making {what}: {type(exc).__name__}: {exc}") from None
    lacks = [f for f in SAMPLE_FIELDS if not hasattr(sample, f)] + \
        [f + "()" for f in SAMPLE_METHODS if not callable(getattr(sample, f, None))]
    if lacks:
        raise ConfigError(f"{who} returned {type(sample).__name__} for {what}, which lacks "
                          f"{', '.join(lacks)}: return an rlm.evaluation.tasks.Sample (see "
                          "'Your own tasks' in docs/benchmarking-depth.md)")
    ctx = sample.context
    if not ctx or (isinstance(ctx, str) and not ctx.strip()):
        raise ConfigError(f"{who} made {what} with an empty context")
    try:
        float(sample.score(""))
    except Exception as exc:  # noqa: BLE001 - an unknown metric, a broken score()
        raise ConfigError(f"{who}: {what} cannot be scored: {type(exc).__name__}: "
                          f"{exc}") from None
    return sample


def identified(spec: TrialSpec, sample: Any = None,
               make_sample: MakeSample | None = None) -> TrialSpec:
    """``spec`` with its identity parts filled (:func:`rlm.evaluation.identity.identity_parts`);
    ``sample`` is the spec's sample, made with ``make_sample`` (default: the spec's sample
    maker) when not given.

    Raises:
        ConfigError: the sample or the run options cannot be built.
    """
    from rlm.evaluation.identity import identity_parts
    if sample is None:
        sample = (make_sample or load_sample_factory(spec.sample_factory))(
            spec.task, spec.length, spec.seed, spec.trial)
    return replace(spec, parts=identity_parts(spec, sample))


def run_trial(spec: TrialSpec, *, runner: Any = None, make_sample: MakeSample | None = None,
              cancel: Any = None) -> dict:
    """Run one trial as a journaled run (or take its recorded result) and return its record.

    Args:
        spec: the trial (:func:`identified` here when it is not yet). runner: an
            :class:`rlm.RLM` with the spec's endpoint options to run it with (shared by a
            sweep's threads: it keeps one embedded model server); None makes one for this
            trial and closes it after.
        make_sample: the sample maker (default: :func:`load_sample_factory` of the spec's).
        cancel: an :class:`rlm.aio.CancelToken` that cancels the run (it stays resumable).
    Returns:
        the trial record: the keys of the spec ``rlm/evaluation`` documents (``key``,
        ``run_id``, ..., ``score``, ``correct``, ``status``, ``failure``, tokens, ``cost_usd``,
        ``wall_s`` (seconds), ``subcalls``, ``max_depth_reached``, ``replayed``,
        ``identity``), plus ``replayed_calls`` (model calls served from the journal) and
        ``error`` (why the run did not complete, or None). Failures inside the run (endpoint,
        kernel, budget, divergence...) are records with ``status``
        ``"error"``/``"failed"``/``"budget_exceeded"``, not raised.
    Raises:
        ConfigError: bad setup (options, prices for a cost cap, a prompt file, the sample
            maker), or the sample made here is not the one the spec's identity names (another
            version of the task data or of the sample maker on this machine).
    """
    from rlm.evaluation.identity import sample_sha256
    sample = (make_sample or load_sample_factory(spec.sample_factory))(
        spec.task, spec.length, spec.seed, spec.trial)
    if spec.parts is None:
        spec = identified(spec, sample)
    elif spec.parts.get("sample_sha256") != sample_sha256(sample):
        raise ConfigError(f"trial {spec.key()}: the sample made here differs from the one the "
                          "sweep identified; install the same task data and sample maker "
                          "wherever trials run")
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
    from rlm.evaluation.identity import run_options
    if spec.method not in METHODS:
        raise ConfigError(f"unknown method {spec.method!r}; choose from {', '.join(METHODS)}")
    # the options the identity was built from, so the run is the one its id names
    opts: dict[str, Any] = {**run_options(spec), "run_id": spec.run_id(),
                            "journal": spec.journal, "cancel": cancel}
    truncated = False
    try:
        if spec.method == "base":
            prompt, truncated = sample.base_prompt(spec.base_prompt_tokens())
            return runner.plain_completion(prompt, **opts), truncated, None
        return runner.completion(sample.context, sample.query, **opts), truncated, None
    except RunMismatchError as exc:
        raise ConfigError(f"trial {spec.key()}: {exc}. The journal holds another run under "
                          "this trial's id: use another --journal") from None
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
        "error": reason, "identity": spec.parts,
    }
