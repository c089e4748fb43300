"""An RL environment whose rollout is one real RLM run: sandboxed kernels, caps, a journal.

A trainer hands :class:`Environment` a *sample* (an :class:`rlm.evaluation.tasks.Sample`, or
the ``(task, length, seed, index)`` that makes one) and a :class:`Policy` (the endpoint the
policy model is served on, and where its sub-calls go: the same endpoint, or a separate one).
:meth:`Environment.reset` says what the root model reads first; :meth:`Environment.rollout`
runs the RLM on the sample and scores its answer with the eval task's own scorer
(``sample.score``: RULER's metrics, with their partial credit where the metric has it),
exactly as ``rlm eval`` scores a trial: a run that did not complete scores 0.0. The
:class:`Rollout` carries the run id and the journal, so any rollout can be replayed
with no model call (``rlm replay RUN_ID --journal PATH``) to audit its reward.

The sample's context is written once to a file named by its sha256 in the environment's
directory (the model reads the same ``context`` and the same prompts as from the value), so
a replay finds it without being told. :meth:`Environment.rollouts` runs many at once on a
thread pool (each run has its own kernels; the caps hold per rollout).
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from harness.errors import HarnessError

from rlm.errors import ConfigError, RLMError

__all__ = ["Policy", "Episode", "Rollout", "Environment", "rollout_in_worker"]


@dataclass(frozen=True)
class Policy:
    """Where the policy model is served, and where its sub-calls go.

    Attributes:
        base_url: its OpenAI-compatible endpoint (a trainer's inference server, e.g. vLLM);
            None: the embedded model (``embedded_model``).
        model: the model name the endpoint serves; api_key: its key (never journaled, never
            in a kernel's reach).
        sub_model: the model ``llm_query``, ``llm_query_batched`` and depth-limit fallbacks
            call (None: ``model``, so sub-calls are the policy's too).
        sub_base_url: a separate OpenAI-compatible endpoint for those sub-calls (a fixed model
            beside the policy's server), or None: the policy's endpoint. Children's turns
            stay on ``base_url``. Needs ``base_url``.
        sub_api_key: the key of ``sub_base_url`` (None: ``$RLM_SUB_API_KEY``, else none);
            never journaled, never in a rollout's id, never in a kernel's reach.
        embedded_model: the embedded model's name when ``base_url`` is None.
    """

    base_url: str | None = None
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)
    sub_model: str | None = None
    embedded_model: str | None = None
    sub_base_url: str | None = None
    sub_api_key: str | None = field(default=None, repr=False)

    def options(self) -> dict:
        """The :class:`rlm.RLM` endpoint keyword options of this policy."""
        if self.base_url is None:
            # sub_base_url alone is refused by the run (ConfigError), not dropped here
            embedded = {"embedded_model": self.embedded_model} if self.embedded_model else {}
            return {**embedded, **self._sub_options()}
        return {"base_url": self.base_url, "model": self.model, "api_key": self.api_key,
                "sub_model": self.sub_model, **self._sub_options()}

    def _sub_options(self) -> dict:
        if self.sub_base_url is None and self.sub_api_key is None:
            return {}
        return {"sub_base_url": self.sub_base_url, "sub_api_key": self.sub_api_key}

    def identity(self) -> dict:
        """What names the policy in a rollout's id (no key). ``sub_base_url`` only when set,
        so the ids of rollouts without one stay what they were."""
        ident = {"base_url": self.base_url, "model": self.model, "sub_model": self.sub_model,
                 "embedded_model": self.embedded_model}
        if self.sub_base_url is not None:
            ident["sub_base_url"] = self.sub_base_url
        return ident


@dataclass
class Episode:
    """What :meth:`Environment.reset` returns: the ``sample``, its ``key``
    (``task|length|seed|index``), the ``system`` prompt and ``first_user`` message the root
    model is sent first (the context itself stays in the kernel), and the context ``file``."""

    sample: Any
    key: str
    system: str
    first_user: str
    file: Path


@dataclass
class Rollout:
    """One rollout's outcome.

    Attributes:
        key: the sample's ``task|length|seed|index``; answer: the run's answer (None if
            none); reward: the task's score of it, 0..1 (0.0 unless completed); status: the
            run's status, or ``"error"`` when an error ended it (``error`` says which).
        run_id, journal: where it is recorded (``rlm replay RUN_ID --journal JOURNAL``).
        usage: tokens and cost of the whole run tree (``prompt_tokens``,
            ``completion_tokens``, ``total_tokens``, ``calls``, ``cost_usd``);
            seconds: wall time; replayed_calls: calls served from the journal (a rollout
            whose run id was already recorded).
    """

    key: str
    answer: str | None
    reward: float
    status: str
    run_id: str
    journal: str
    usage: dict
    seconds: float
    replayed_calls: int = 0
    error: str | None = None

    def to_dict(self) -> dict:
        """The rollout as a JSON-able dict."""
        return asdict(self)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str)


class Environment:
    """Rollouts of an RLM on eval samples, each a journaled run scored by the task's scorer.

    Args:
        directory: where the journal (``journal.sqlite3``, unless ``journal`` names
            another: a path or a ``postgresql://`` URL) and the contexts (``contexts/``) go.
        max_depth: the runs' depth (0..3); profile: the prompt profile (``small``,
            ``small-count``, ``general`` or a prompt file).
        caps: run options capping each rollout, e.g. ``{"max_calls": 30, "max_tokens":
            200_000, "max_wall_seconds": 300, "max_iterations": 10}`` (any
            :class:`rlm.RLM` option may be given here: ``sandbox``, ``kernel_memory_mb``...).
        sample_factory: ``"module:function"`` making samples from ``(task, length, seed,
            index)``, as ``rlm eval --sample-factory`` (None: the built-in tasks).
    Raises:
        ConfigError: ``directory`` cannot be made (a file in the way, no permission); bad
            options (when a rollout builds them).
    """

    def __init__(self, directory: str | Path, *, journal: str | None = None,
                 max_depth: int = 1, profile: str = "small", caps: dict | None = None,
                 sample_factory: str | None = None) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file in the way, no permission, a full disk
            raise ConfigError(f"cannot use {self.directory} as the rollouts' directory: "
                              f"{exc.strerror or exc}") from None
        self.journal = journal or str((self.directory / "journal.sqlite3").resolve())
        self.max_depth, self.profile = max_depth, profile
        self.caps = dict(caps or {})
        self.sample_factory = sample_factory
        self._runners: dict[str, Any] = {}
        self._lock = threading.Lock()

    # samples -----------------------------------------------------------------------
    def sample(self, sample: Any) -> Any:
        """``sample`` itself, or the one its ``(task, length, seed, index)`` names.

        Raises:
            ConfigError: the factory cannot make it, or it is not a sample.
        """
        if isinstance(sample, (tuple, list)):
            if len(sample) != 4:
                raise ConfigError(f"a sample's coordinates are (task, length, seed, index), got "
                                  f"{len(sample)} value(s): {tuple(sample)!r:.200}")
            from rlm.evaluation.trial import checked_sample, load_sample_factory
            return checked_sample(load_sample_factory(self.sample_factory), tuple(sample),
                                  self.sample_factory)
        missing = [a for a in ("context", "query", "score") if not hasattr(sample, a)]
        if missing:
            raise ConfigError(f"not a sample: {type(sample).__name__} {sample!r:.100} has no "
                              f"{', '.join(missing)}; give an rlm.evaluation.tasks.Sample or "
                              "its (task, length, seed, index)")
        return sample

    @staticmethod
    def key_of(sample: Any) -> str:
        """``task|length|seed|index`` of a sample."""
        return "|".join(str(getattr(sample, a, "-")) for a in ("task", "length", "seed", "index"))

    def _context_file(self, sample: Any) -> Path:
        """The sample's context in a file named by its sha256 (text as ``.txt``, a list or
        dict as ``.json``, which loads as the same value)."""
        ctx = sample.context
        text = ctx if isinstance(ctx, str) else json.dumps(ctx, ensure_ascii=False)
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        path = self.directory / "contexts" / f"{digest}.{'txt' if isinstance(ctx, str) else 'json'}"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(path.suffix + f".{time.monotonic_ns()}.tmp")
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(path)
        return path

    def _options(self, policy: Policy) -> dict:
        return {**self.caps, "max_depth": self.max_depth, "prompt": self.profile,
                "journal": self.journal}

    def reset(self, sample: Any, policy: Policy | None = None) -> Episode:
        """Start an episode: the sample (made from its coordinates if need be), its context
        file, and what the root model will read first under ``policy``.

        Raises:
            ConfigError: bad sample or options.
        """
        from rlm.config.build import build_options
        from rlm.core.loop import opening
        sample = self.sample(sample)
        policy = policy or Policy()
        o = {**policy.options(), **self._options(policy)}
        if policy.base_url:
            endpoint = (policy.base_url, policy.api_key, policy.model or "")
        else:
            from rlm.models.catalog import DEFAULT_EMBEDDED_MODEL
            endpoint = (None, None, policy.embedded_model or DEFAULT_EMBEDDED_MODEL)
        system, first = opening(sample.context, sample.query, build_options(o, endpoint))
        return Episode(sample, self.key_of(sample), system, first, self._context_file(sample))

    def run_id(self, sample: Any, policy: Policy, tag: str = "", attempt: int = 0) -> str:
        """The rollout's run id: ``"rollout-"`` + 20 hex digits of the sha256 of the sample,
        the policy, the environment's settings, ``tag`` (e.g. the training step) and
        ``attempt`` (the index within a group of rollouts of one sample). The same ones give
        the same id: the run then returns (or resumes) the recorded rollout."""
        from rlm.evaluation.identity import sample_sha256
        from rlm.version import __version__
        parts = {"sample": sample_sha256(sample), "policy": policy.identity(),
                 "depth": self.max_depth, "profile": self.profile, "caps": self.caps,
                 "tag": tag, "attempt": attempt, "harness": __version__}
        return "rollout-" + hashlib.sha256(_canonical(parts).encode()).hexdigest()[:20]

    # rollouts ------------------------------------------------------------------------
    def _runner(self, policy: Policy) -> Any:
        """One :class:`rlm.RLM` per policy, shared by the threads (one embedded server)."""
        key = _canonical(policy.identity())
        with self._lock:
            if key not in self._runners:
                from rlm.api import RLM
                self._runners[key] = RLM(**{k: v for k, v in policy.options().items()
                                            if v is not None})
            return self._runners[key]

    def rollout(self, sample: Any, policy: Policy | None = None, *, tag: str = "",
                attempt: int = 0) -> Rollout:
        """Run the RLM on ``sample`` under ``policy`` and score its answer.

        Returns:
            the :class:`Rollout`. A run the endpoint, a kernel or a cap ended is a rollout
            with reward 0.0 and its status (``"error"`` with ``error`` for an exception),
            not an exception: a trainer's batch goes on.
        Raises:
            ConfigError: bad sample or options (nothing ran).
        """
        policy = policy or Policy()
        ep = self.reset(sample, policy)
        run_id = self.run_id(ep.sample, policy, tag, attempt)
        t0 = time.monotonic()
        res, error = None, None
        try:
            res = self._runner(policy).completion(ep.file, ep.sample.query, run_id=run_id,
                                                  **self._options(policy))
        except ConfigError:
            raise
        except (RLMError, HarnessError) as exc:
            res, error = getattr(exc, "result", None), exc
        completed = error is None and res is not None and res.status == "completed"
        answer = res.answer if res is not None else None
        reward = float(ep.sample.score(answer)) if completed else 0.0
        return Rollout(ep.key, answer, reward,
                       "error" if error is not None else res.status, run_id, self.journal,
                       dict(res.usage) if res is not None else {}, time.monotonic() - t0,
                       res.replayed_calls if res is not None else 0,
                       None if error is None else f"{type(error).__name__}: {error}")

    def settings(self) -> dict:
        """The keyword arguments that make this environment again (in a Ray worker)."""
        return {"directory": str(self.directory.resolve()), "journal": self.journal,
                "max_depth": self.max_depth, "profile": self.profile, "caps": self.caps,
                "sample_factory": self.sample_factory}

    def rollouts(self, samples: Iterable[Any], policy: Policy | None = None, *,
                 group: int = 1, concurrency: int = 2, tag: str = "",
                 ray_address: str | None = None) -> list[Rollout]:
        """``group`` rollouts of each sample (attempts 0..group-1), ``concurrency`` at once
        on a thread pool, or each as a Ray task on the cluster at ``ray_address``
        (:mod:`rlm.training.ray_rollouts`); returned in input order (sample by sample,
        attempt by attempt).

        Raises:
            ConfigError: ``group`` or ``concurrency`` not a whole number of at least 1; bad
                sample or options (raised before or while the batch runs), or Ray missing or
                unreachable.
        """
        for name, value in (("group", group), ("concurrency", concurrency)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a whole number of at least 1, got {value!r}")
        if ray_address is not None:
            from rlm.training.ray_rollouts import rollouts_on_ray
            jobs = [(s, a) for s in samples for a in range(group)]
            return rollouts_on_ray(rollout_in_worker, self.settings(), jobs, policy or Policy(),
                                   tag, ray_address)
        jobs = [(s, a) for s in (self.sample(x) for x in samples) for a in range(group)]
        with ThreadPoolExecutor(max_workers=concurrency,
                                thread_name_prefix="rlm-rollout") as pool:
            futures = [pool.submit(self.rollout, s, policy, tag=tag, attempt=a)
                       for s, a in jobs]
            return [f.result() for f in futures]

    def replay(self, rollout: Rollout) -> Any:
        """Replay a rollout from its journal with no model call; returns the replayed
        :class:`rlm.Result` (``replayed_calls``: the calls served).

        Raises:
            DivergenceError: the replay did not reach the recorded run (its reward cannot be
                trusted); ConfigError: unknown run.
        """
        from rlm.api import replay
        return replay(rollout.run_id, journal=rollout.journal)

    def close(self) -> None:
        """Stop what the rollouts started (an embedded model server). Idempotent."""
        runners, self._runners = self._runners, {}
        for r in runners.values():
            r.close()

    def __enter__(self) -> "Environment":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_WORKER_ENVS: dict[str, Environment] = {}


def rollout_in_worker(settings: dict, sample: Any, policy: Policy, tag: str,
                      attempt: int) -> Rollout:
    """One rollout in a Ray worker: the worker's :class:`Environment` of ``settings`` (made
    once per worker process, so an embedded model server starts once) runs it."""
    key = _canonical(settings)
    if key not in _WORKER_ENVS:
        _WORKER_ENVS[key] = Environment(**settings)
    return _WORKER_ENVS[key].rollout(sample, policy, tag=tag, attempt=attempt)
