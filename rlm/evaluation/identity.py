"""A trial's identity: everything that decides its result, hashed into its journal run id.

A trial's result depends on more than its place in the grid (task, length, seed, trial,
method, depth, profile, model): on the sample's text, on the prompts the model reads, on the
model itself, on the caps and sampling settings, and on the harness. :func:`identity_parts`
collects all of it as a flat dict (the *parts*, recorded in ``trials.jsonl`` under
``"identity"``); :func:`run_id_of` hashes them. Change any part (one word of a profile, the
model file, an output cap, the harness version) and the trial gets a new run id, so it runs
again instead of being served from the journal.

:func:`mixed_identities` says where the trials of one report differ in anything but the
grid's own axes (``rlm eval --report`` refuses such a mix unless ``--allow-mixed``).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["AXES", "identity_parts", "run_id_of", "changed_parts", "mixed_identities"]

#: The grid's own axes: the parts that name a trial's place in the sweep (its ``key``).
AXES = ("task", "length", "seed", "trial", "method", "depth", "profile", "model")

#: Stored run options that are not settings of the result: which model and endpoint (the
#: ``model_identity`` part says that), where prices come from (``prices_sha256``), the prompt
#: (hashed as rendered) and the depth (an axis).
NOT_SETTINGS = frozenset({"model", "base_url", "sub_model", "child_model", "embedded_model",
                          "price_file", "prompt", "system_template", "max_depth"})

#: Parts that must agree across one report, and the axes they may vary with: ``(part,
#: how a message names it, the axes it belongs to)``. The per-trial hashes (rendered prompts)
#: are functions of these and the axes, so they are not compared themselves.
INVARIANTS = (
    ("harness", "the harness version", ()),
    ("data", "the task data", ()),
    ("settings", "the run settings", ()),
    ("prices_sha256", "the price table", ()),
    ("model_identity", "model {model}", ("model",)),
    ("profile_sha256", "profile {profile}'s text", ("profile",)),
    ("sample_sha256", "sample {task} {length} seed {seed} trial {trial}",
     ("task", "length", "seed", "trial")),
)


def sha256_text(text: str) -> str:
    """Hex sha256 of ``text`` as UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str)


def run_id_of(parts: dict) -> str:
    """The journal run id of a trial with these identity parts: ``"eval-"`` + the first 20 hex
    digits of the sha256 of the parts as canonical JSON (stable across processes and machines)."""
    return "eval-" + sha256_text(_canonical(parts))[:20]


def sample_sha256(sample: Any) -> str:
    """Hex sha256 of what a sample gives the trial: context, query, expected answers, metric."""
    return sha256_text(_canonical([sample.context, sample.query, list(sample.expected),
                                   getattr(sample, "metric", None)]))


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def data_version(sample_factory: str | None) -> dict:
    """Which task data made the samples: the built-in tasks with the version of RULER's data
    package, or the ``module:function`` of one's own sample maker."""
    if sample_factory is None:
        return {"tasks": "rlm.evaluation.tasks",
                "package": f"nvidia-long-context-eval {_dist_version('nvidia-long-context-eval')}"}
    return {"tasks": sample_factory}


def model_identity(spec: Any, provider: str) -> dict:
    """The model a trial talks to: the embedded model's weights (their pinned, verified sha256;
    the file itself is never hashed per trial) and its serving engine, or a hosted model's name
    and API."""
    if spec.base_url is None:
        from rlm.models.embedded.weights import MODELS
        model = MODELS[spec.model]
        return {"name": model.name, "weights_sha256": model.sha256,
                "engine": f"xllamacpp {_dist_version('xllamacpp')}"}
    return {"name": spec.model, "provider": provider}


def run_options(spec: Any) -> dict:
    """The keyword options :func:`rlm.evaluation.trial.run_trial` gives the run of ``spec``
    on top of its endpoint's (:meth:`~rlm.evaluation.trial.TrialSpec.endpoint_options`),
    besides the run id, the journal and the cancel handle."""
    opts: dict[str, Any] = {"max_cost_usd": spec.max_cost_per_trial}
    if getattr(spec, "trial_timeout", None) is not None:
        opts["max_wall_seconds"] = spec.trial_timeout
    if spec.method == "rlm":
        opts["max_depth"] = spec.depth
        if spec.profile is not None:
            opts["prompt"] = spec.profile
    return opts


def settings(opts: Any) -> dict:
    """Every run option the journal keeps to rebuild a run (caps, sampling, output limits,
    kernel limits and seed), as this run gets it, minus :data:`NOT_SETTINGS`."""
    from rlm.config.options import OPTIONS
    out = {}
    for opt in OPTIONS:
        if not opt.stored or opt.name in NOT_SETTINGS:
            continue
        value = (getattr(opts, opt.name, None) if opt.has_attribute
                 else getattr(opts.budget, opt.budget_field, None))
        out[opt.name] = json.loads(_canonical(value))
    return dict(sorted(out.items()))


def identity_parts(spec: Any, sample: Any) -> dict:
    """Everything that decides a trial's result (a flat, JSON-ready dict):

    * the axes (:data:`AXES`);
    * ``sample_sha256`` (context, query, expected answers, metric) and ``data``
      (:func:`data_version`);
    * the prompts as the model reads them: ``system_prompt_sha256`` and ``first_user_sha256``
      (an ``rlm`` trial; rendered as its root loop renders them), or the ``base`` prompt, cut
      to the window, as ``first_user_sha256`` (``system_prompt_sha256`` None); and
      ``profile_sha256``, the profile's template text (None for ``base``);
    * ``model_identity`` (:func:`model_identity`);
    * ``settings`` (:func:`settings`) and ``prices_sha256`` (the price file's bytes, or None);
    * ``harness``: this package's version.

    Raises:
        ConfigError: the options do not build (an unreadable price or prompt file).
    """
    from rlm.config.build import build_options
    from rlm.version import __version__
    opts = build_options({**spec.endpoint_options(), **run_options(spec)},
                         (spec.base_url, None, spec.model))
    system, first, template = _rendered(spec, sample, opts)
    parts = dict(zip(AXES, spec.axes()))
    parts.update({
        "sample_sha256": sample_sha256(sample), "data": data_version(spec.sample_factory),
        "system_prompt_sha256": None if system is None else sha256_text(system),
        "first_user_sha256": sha256_text(first),
        "profile_sha256": None if template is None else sha256_text(template),
        "model_identity": model_identity(spec, opts.provider),
        "settings": settings(opts),
        "prices_sha256": _file_sha256(spec.price_file),
        "harness": __version__})
    return parts


def _file_sha256(path: str | None) -> str | None:
    """Hex sha256 of a file's bytes (None for no file; of the name itself when it is not a
    readable file, e.g. a URL)."""
    if not path:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return sha256_text(path)


def _rendered(spec: Any, sample: Any, opts: Any) -> tuple[str | None, str, str | None]:
    """``(system prompt, first user message, profile template)`` the model reads first."""
    if spec.method == "base":
        return None, sample.base_prompt(spec.base_prompt_tokens())[0], None
    from rlm.core.loop import opening
    from rlm.prompting import prompts
    # the profile is its system template and its first-message wording together
    system_template, first_template = prompts.PROFILES.get(opts.prompt, prompts.PROFILES["small"])
    template = (opts.system_template or system_template) + "\n" + (
        first_template or prompts.FIRST_USER)
    system, first = opening(sample.context, sample.query, opts)
    return system, first, template


def changed_parts(old: dict | None, new: dict) -> list[str]:
    """The names of the parts in which ``new`` differs from ``old`` (``["identity"]`` when
    ``old`` recorded none)."""
    if not old:
        return ["identity"]
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def mixed_identities(records: list[dict]) -> list[str]:
    """Where trial records (one per key) differ in more than the grid's axes: one sentence per
    :data:`INVARIANTS` part that has several values within its axes, and one for records that
    carry no identity beside ones that do. Empty when they are one measurement."""
    known = [r["identity"] for r in records if isinstance(r.get("identity"), dict)]
    problems = []
    if known and len(known) < len(records):
        problems.append(f"{len(records) - len(known)} trials were recorded without their "
                        "identity (by an earlier rlm eval)")
    for part, name, axes in INVARIANTS:
        groups: dict[tuple, Counter] = {}
        for ident in known:
            # None is a value like any other (no price file beside one; a part an older
            # record lacks): skipping it let such trials pass as one measurement
            where = tuple(ident.get(a) for a in axes)
            groups.setdefault(where, Counter())[_canonical(ident.get(part))] += 1
        for where, values in groups.items():
            if len(values) > 1:
                label = name.format(**dict(zip(axes, where)))
                problems.append(f"{label} ({_versions(part, values)})")
    return problems


def _versions(part: str, values: Counter) -> str:
    """How the values of one part differ: which settings, or how many trials hold each."""
    counts = ", ".join(_trials(n) for _, n in values.most_common())
    decoded = [json.loads(v) for v in values]
    if part == "settings":
        keys = sorted({k for d in decoded for k in d if len({_canonical(x.get(k))
                                                             for x in decoded}) > 1})
        return f"{', '.join(keys)} differ; {len(values)} versions in {counts}"
    if part == "harness":
        return "; ".join(f"{json.loads(v) or 'none recorded'} in {_trials(n)}"
                         for v, n in values.most_common())
    if part == "prices_sha256":
        return ", ".join(f"{'no price file' if json.loads(v) is None else 'a price file'} in "
                         f"{_trials(n)}" for v, n in values.most_common())
    return f"{len(values)} versions in {counts}"


def _trials(n: int) -> str:
    return f"{n} trial" if n == 1 else f"{n} trials"
