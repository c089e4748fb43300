"""A run's configuration in its three forms, converted from one into another by the registry.

* keyword options (what :func:`rlm.completion`, :class:`rlm.RLM` and the CLI pass),
* the :class:`~rlm.config.options.Options` a run tree is driven with (:func:`build_options`),
* the journal record of a run's options (:func:`stored_options`), and back from it to keyword
  options for ``rlm resume`` (:func:`resume_options`) or to :class:`~rlm.config.options.Options` for
  ``rlm replay`` (:func:`replay_options`);
* the arguments of :func:`rlm.context.load.load_context` among the keyword options
  (:func:`context_options`); the journal keeps them in the record's ``context_spec``.

Which option goes where is declared in :data:`rlm.config.options.OPTIONS` (``stored``,
``budget_field``, ``embedded_default``...); only the endpoint's options and ``price_file``
are named here, since they are resolved rather than copied.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from harness.budget.accountant import Budget
from harness.budget.prices import PriceTable

from rlm.errors import ConfigError
from rlm.config.endpoint import endpoint_configured, sub_endpoint
from rlm.config.options import ENDPOINT, OPTIONS, Option, Options
from rlm.tools import as_tools, replay_tools, tool_records


def _value(opt: Option, o: Mapping[str, Any], embedded: bool) -> Any:
    v = o.get(opt.name)
    if v is None:
        v = opt.default_for(embedded)
    if opt.type is int and isinstance(v, float):
        v = int(v)  # a whole float (validate_options refuses the others)
    return v


def build_options(o: Mapping[str, Any], endpoint: tuple[str, str | None, str]) -> Options:
    """The :class:`Options` of a run from keyword options and its resolved endpoint.

    Args:
        o: keyword options (validated by :func:`~rlm.config.validate.validate_options`); absent or None values take
            their default, or their ``embedded_default`` when no endpoint is configured.
        endpoint: (base_url, api_key, model) the run talks to (an :class:`~rlm.config.options.Endpoint`, or the
            embedded server's). With the embedded model, ``sub_model``/``child_model`` are
            dropped (it serves every call) and the model is priced as local (free). The
            sub-calls' own endpoint, if any, comes from ``o``
            (:func:`~rlm.config.endpoint.sub_endpoint`: ``sub_base_url`` and its key).
    Raises:
        ConfigError: a budget value :class:`~harness.budget.accountant.Budget` refuses, an
            unreadable price file, or a sub-call endpoint
            :func:`~rlm.config.endpoint.sub_endpoint` refuses.
    """
    embedded = not endpoint_configured(o)
    base_url, api_key, model = endpoint
    try:
        budget = Budget(**{opt.budget_field: _value(opt, o, embedded)
                           for opt in OPTIONS if opt.budget_field})
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
    opts = Options(model=model, sub_model=None if embedded else o.get("sub_model"),
                   child_model=None if embedded else o.get("child_model"),
                   base_url=base_url, api_key=api_key, budget=budget, prices=prices,
                   embedded=embedded,
                   price_file=str(Path(o["price_file"]).expanduser().resolve())
                   if o.get("price_file") else None)
    for opt in OPTIONS:
        if opt.to_options:
            setattr(opts, opt.name, _value(opt, o, embedded))
    sub = sub_endpoint(o)
    if sub is not None:
        opts.sub_base_url, opts.sub_api_key = sub
    opts.tools = as_tools(opts.tools)  # functions, specs, records -> checked rlm.tools.Tool
    if opts.system_template is None:
        opts.system_template = _template_file(opts.prompt)
    if opts.system_template is not None:
        _check_template(opts.system_template, opts.prompt)
    return opts


def _check_template(template: str, prompt: str) -> None:
    """A system prompt template must format with the fields :func:`rlm.prompting.prompts.system_prompt`
    gives (``meta``, ``sub_chars``, ``max_output``, ``rlm_line``, ``to_text``).

    Raises:
        ConfigError: it is empty, names another field, or is not a valid format string.
    """
    from rlm.prompting.prompts import check_template
    problem = check_template(template)
    if problem:
        where = f"--prompt {prompt}" if os.path.exists(prompt) else "system_template"
        raise ConfigError(f"{where}: {problem}")


def _template_file(prompt: str) -> str | None:
    """The text of a ``--prompt PATH`` template (None for a profile name). It is kept in the
    run's record as ``system_template``, so resume and replay do not need the file.

    Raises:
        ConfigError: the file cannot be read as UTF-8 text.
    """
    from rlm.prompting.prompts import PROFILES
    if prompt in PROFILES:
        return None
    try:
        return Path(prompt).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--prompt {prompt}: cannot read the template file ({exc}); give "
                          f"{', '.join(PROFILES)} or a readable UTF-8 file") from None


def stored_options(opts: Options, ctx: Any) -> dict:
    """The JSON-able record of a run's settings that resume and replay re-drive it from.

    Args:
        opts: the run's :class:`Options`.
        ctx: its loaded context (``source``, ``fmt``, ``encoding``, ``sha256``, ``spec``).
    Returns:
        every ``stored`` option that is an :class:`Options` attribute, ``embedded`` (bool),
        ``budget`` (:meth:`Budget.to_dict`), and ``context_source`` (absolute path, or None for
        a value, stdin or a many-file context), ``context_spec`` (a directory/glob/paths
        context: ``{sources, include, exclude, max_bytes}`` to load it again, else None),
        ``context_fmt``, ``context_encoding``, ``context_sha256``, ``tools`` (each
        :meth:`rlm.tools.Tool.record`). Never an API key (``sub_base_url`` is kept, its key
        is not).
    """
    d = {opt.name: getattr(opts, opt.name) for opt in OPTIONS if opt.stored and opt.has_attribute}
    d["embedded"] = opts.embedded
    d["budget"] = opts.budget.to_dict()
    d["tools"] = tool_records(opts.tools)  # importable specs and the texts the prompt showed
    d["context_source"] = os.path.abspath(ctx.source) if ctx.source not in (
        "<value>", "<stdin>", "<bytes>") and ctx.fmt != "bundle" else None
    d["context_spec"] = getattr(ctx, "spec", None)
    d["context_fmt"] = ctx.fmt
    d["context_encoding"] = getattr(ctx, "encoding", "utf-8")
    d["context_sha256"] = ctx.sha256
    return d


def context_options(o: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of :func:`rlm.context.load.load_context` among keyword options:
    ``encoding``, ``include``/``exclude`` (a pattern becomes a one-item list), ``max_bytes``."""
    pats = {k: [o[k]] if isinstance(o.get(k), str) else (list(o[k]) if o.get(k) else None)
            for k in ("include", "exclude")}
    return {"encoding": o.get("encoding"), "max_bytes": o.get("max_context_bytes"), **pats}


def _recorded(opt: Option, stored: Mapping[str, Any]) -> Any:
    if opt.has_attribute:
        return stored.get(opt.name)
    return (stored.get("budget") or {}).get(opt.budget_field)


def resume_options(record: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword options that re-create a recorded run for ``rlm resume`` (inverse of
    :func:`stored_options`).

    Args:
        record: the journal's run record (its ``options`` key holds :func:`stored_options`).
    Returns:
        {keyword name: value} of every ``stored`` option the record holds a value for; endpoint
        options are left out when the run used the embedded model (its server picks them).
    """
    stored = record.get("options") or {}
    out = {}
    for opt in OPTIONS:
        if not opt.stored or (stored.get("embedded") and opt.group == ENDPOINT):
            continue
        v = _recorded(opt, stored)
        if v is not None:
            out[opt.name] = v
    if stored.get("tools"):  # imported again from their specs (rlm.tools.as_tools)
        out["tools"] = list(stored["tools"])
    return out


def replay_options(record: Mapping[str, Any]) -> Options:
    """The :class:`Options` that replay a recorded run (every model call served from the journal).

    Unlike :func:`resume_options` it keeps the recorded endpoint and model names as they were
    (requests must hash the same) and builds no endpoint, prices or defaults of its own.

    Args:
        record: the journal's run record.
    """
    stored = record.get("options") or {}
    opts = Options(budget=Budget.from_dict(stored.get("budget") or {}))
    for opt in OPTIONS:
        if opt.stored and opt.has_attribute and opt.name in stored:
            setattr(opts, opt.name, stored[opt.name])
    opts.tools = replay_tools(stored.get("tools"))  # the prompt's texts; never called
    return opts
