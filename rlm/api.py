"""The public Python API, a thin front door: :func:`completion`, :class:`RLM`, :func:`resume`
and :func:`replay` (results are :class:`~rlm.result.Result`); :func:`plain_completion` is one
plain model call journaled as a run (a baseline for benchmarks).

Each call checks its options (:mod:`rlm.config.options`), loads the context, decides what a known run id
means (:mod:`harness.replay`) and hands the run to :func:`rlm.core.drive.drive`.

>>> import rlm
>>> res = rlm.completion(Path("essays.txt"), "What is the magic number?",
...                      base_url="http://127.0.0.1:8000/v1", model="my-model")
>>> res.answer, res.status, res.usage["total_tokens"]
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from harness.replay import (RECORDED_STATES, Replay, begin_resume, check_same_run, replay_target,
                            same_answer)

from rlm.context.load import load_context
from rlm.errors import DivergenceError
from rlm.config.endpoint import external_endpoint
from rlm.config.options import DEFAULT_EMBEDDED_MODEL, Options, check_names
from rlm.config.reference import from_reference, root_prompt
from rlm.config.validate import validate_options
from rlm.config.records import (find_run, open_journal, recorded_chance, spec_options,
                                stored_context, stored_source)
from rlm.result import Result
from rlm.config.build import build_options, context_options, replay_options, resume_options
from rlm.core.hooks import RunHooks
from rlm.core.drive import drive
from rlm.core.schema import normalize_options


class RLM:
    """Holds options for repeated runs; keeps an embedded model server alive between them.

    Keyword options (all optional) are the names in :data:`rlm.config.options.OPTIONS`, which declares
    each one's type, default, range and CLI flag (docs/reference/options.md lists them). The main ones:
        model, sub_model, child_model (str): model names. Without ``base_url``
            (and without ``OPENAI_BASE_URL``/``OPENAI_API_KEY``) the embedded model serves all.
        base_url, api_key (str): an OpenAI-compatible endpoint; default from
            ``OPENAI_BASE_URL``/``OPENAI_API_KEY``.
        max_iterations (int, 20), max_depth (int, 1), cell_timeout (s, 60),
        max_output_chars (characters, 4000), max_cost_usd (USD), max_tokens (tokens),
        max_calls (int), max_wall_seconds (s), max_children_per_call (int),
        max_concurrency (int, 8), pool_size (kernels), journal (path, or False for
        none; default ``$RLM_JOURNAL`` or the user data dir), embedded_model (str, one of
        :data:`rlm.config.options.EMBEDDED_MODELS`), price_file (JSON path), on_progress (callable
        taking a str), divergence (``"stop"`` | ``"live"``); loading the context: encoding
        (default: UTF-8, else detected), include/exclude (gitignore-style patterns for a
        directory or glob), max_context_bytes (bytes, 2,000,000,000).

    Raises:
        ConfigError: unknown option names or bad values.
    """

    def __init__(self, **options: Any) -> None:
        options = from_reference(options)  # the reference's names: aliases, or what to use
        check_names(options)
        self.options = options
        self._server = None
        self._lock = threading.Lock()

    # endpoint ------------------------------------------------------------------
    def _endpoint(self, o: dict) -> tuple[str, str | None, str]:
        endpoint = external_endpoint(o)
        if endpoint is not None:
            return endpoint
        with self._lock:
            if self._server is None:
                from rlm.models.embedded import EmbeddedServer
                name = o.get("embedded_model") or DEFAULT_EMBEDDED_MODEL
                progress = o.get("on_progress")
                if progress:
                    progress(f"starting the embedded model {name} on 127.0.0.1")
                srv = EmbeddedServer(name, threads=o.get("embedded_threads"),
                                     parallel=o.get("embedded_slots"))
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
    def _options(self, o: dict) -> Options:
        return build_options(o, self._endpoint(o))

    def completion(self, context: Any, query: str | None = None, **overrides: Any) -> Result:
        """Run one RLM over ``context``: str, list, dict, or to load: a ``Path`` (a file, a
        directory, a glob), a list of ``Path``, a dict with ``Path`` values, or ``"-"``.

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
        query = root_prompt(query, overrides)  # (the reference's name for the question)
        return self._run(context, query, from_reference(overrides), plain=False)

    def plain_completion(self, prompt: str, **overrides: Any) -> Result:
        """One plain completion of ``prompt`` (str, sent as the user message; no kernel, no
        system prompt) as a journaled run: a run record, one ``model_call`` stage under the
        ``run`` stage, the reply as the answer. A baseline to compare an RLM with.

        Same options as :meth:`completion` (the output cap is ``max_completion_tokens``,
        tokens); with ``run_id``, a finished run returns its recorded :class:`Result` with no
        model call, a crashed one is resumed (its call served from the journal if recorded).

        Returns:
            :class:`Result` (``iterations`` 1, ``answer`` the reply text).
        Raises:
            ConfigError: ``prompt`` is not a non-empty str, or bad options. EndpointError,
            DivergenceError, RunActiveError: as :meth:`completion`.
        """
        if not isinstance(prompt, str) or not prompt.strip():
            from rlm.errors import ConfigError
            raise ConfigError("a plain completion needs a non-empty str prompt")
        return self._run(prompt, None, overrides, plain=True)

    def _run(self, context: Any, query: str | None, overrides: dict, *, plain: bool) -> Result:
        if plain:
            return self._run_now(context, query, overrides, plain=True)
        from kernels.pool import drop_head_start, head_start

        from rlm.config.ahead import kernels_ahead, sandbox_of
        # the root's kernel (and its pool's) start now, overlapping the set-up below
        given = {**self.options, **overrides}
        head_start(kernels_ahead(given), sandbox_of(given))
        try:
            return self._run_now(context, query, overrides, plain=False)
        finally:
            drop_head_start()  # only one the run did not take (a recorded result, an error)

    def _run_now(self, context: Any, query: str | None, overrides: dict, *,
                 plain: bool) -> Result:
        check_names(overrides)
        o = normalize_options({**self.options, **overrides})  # answer_schema -> a JSON Schema
        validate_options(o)
        journal = open_journal(o.get("journal"), durability=o.get("journal_durability"))
        try:
            return self._run_journaled(o, journal, context, query, plain=plain)
        finally:
            # a journal opened here (from a path or URL) is this run's: closed with it (its
            # connection, its files, its writer thread), else a process running many runs (rlm
            # serve, a pipeline) ran out of file handles; a Journal object given stays open
            if journal is not None and journal is not o.get("journal"):
                journal.close()

    def _run_journaled(self, o: dict, journal: Any, context: Any, query: str | None, *,
                       plain: bool) -> Result:
        run_id = o.get("run_id")
        recorded = None
        ctx = load_context(context, **context_options(o))
        try:
            if journal is not None and run_id:
                rec = journal.get_run(run_id)
                if rec is not None:
                    # a known run id: its recorded result, or a resume of it
                    check_same_run(rec, query, ctx.sha256)
                    recorded = begin_resume(journal, rec, o.get("divergence") or "stop")
                    if recorded is None:
                        ctx.discard()
                        return Result.from_record(rec)
                    o = {**o, **recorded_chance(rec)}  # the kernels' seed it ran with
            opts = self._options(o)
        except BaseException:
            ctx.discard()
            if recorded is not None:  # claimed, never started: resumable again at once
                journal.release_run(rec)
            raise
        hooks = RunHooks.from_options(o, journal)
        if not plain:
            return drive(opts, ctx, query, hooks=hooks, run_id=run_id, recorded=recorded)
        try:  # no loop owns the context file: discard it here
            return drive(opts, ctx, None, hooks=hooks, run_id=run_id, recorded=recorded,
                         plain=True)
        finally:
            ctx.discard()


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
        ConfigError: unknown run. RunActiveError: a run that has not finished.
    """
    j = open_journal(journal, must_exist=True)  # a typo must not create an empty journal
    try:
        rec = find_run(j, run_id)
        _not_a_later_question(rec, "replay")
        replay_target(rec)
        ctx = stored_context(rec, context, encoding)
        opts = replay_options(rec)
        plain = bool((rec.get("options") or {}).get("plain"))
        try:
            res = drive(opts, ctx, rec.get("query") or None,
                        hooks=RunHooks(on_progress=on_progress), run_id=run_id,
                        recorded=Replay(j, run_id, strict=True), record=False, plain=plain)
        finally:
            if plain:
                ctx.discard()
    finally:
        if j is not journal:  # opened here: closed here (a Journal object given stays open)
            j.close()
    if not same_answer(rec, res.answer):
        raise DivergenceError(f"replay of run {run_id} reached a different answer: "
                              f"{res.answer!r} instead of {rec.get('answer')!r}")
    return res


def resume(run_id: str, *, context: Any = None, **options: Any) -> Result:
    """Resume a crashed, failed or interrupted run from the journal.

    Re-drives it from its start in fresh kernels; every model call whose id and
    request hash match the journal is served from it (not sent, not charged);
    the run goes live at the first call the journal does not hold. A finished
    run returns its recorded result at once.

    Raises:
        RunActiveError: the run is still running (fresh heartbeat).
        DivergenceError: a recorded call differs (policy ``divergence="stop"``), or the
            ``context`` given is not the one the run was recorded with (also for a finished
            run).
        ConfigError: unknown run id.
    """
    j = open_journal(options.get("journal"), must_exist=True)
    try:
        rec = find_run(j, run_id)
    finally:
        if j is not options.get("journal"):  # the run below opens (and closes) its own
            j.close()
    enc = options.pop("encoding", None) or (rec.get("options") or {}).get("context_encoding")
    if rec["state"] in RECORDED_STATES:
        if context is not None:  # a context given must be the run's, finished or not
            stored_context(rec, context, enc).discard()
        return Result.from_record(rec)
    _not_a_later_question(rec, "resume")
    ctx_src = context
    if ctx_src is None:
        stored_context(rec, None, enc).discard()  # checks it is there and unchanged
        ctx_src = stored_source(rec)
    # the recorded settings (and a directory context's filters); given options override them
    merged = {**resume_options(rec), **spec_options(rec)}
    if options.get("tools") is not None and merged.get("tools"):
        # tools given again stand in for the recorded ones of their names (rlm.tools.as_tools)
        given = options["tools"]
        options = {**options, "tools": [*merged["tools"], *(
            given if isinstance(given, (list, tuple)) else [given])]}
    merged.update({k: v for k, v in options.items() if v is not None})
    merged["run_id"] = run_id
    if enc:
        merged["encoding"] = enc
    with RLM(**merged) as r:
        if (rec.get("options") or {}).get("plain"):  # one plain completion: its prompt
            loaded = stored_context(rec, ctx_src, enc)
            loaded.discard()
            return r.plain_completion(loaded.read_value())
        return r.completion(ctx_src, rec.get("query") or None)


def _not_a_later_question(rec: dict, what: str) -> None:
    """Refuse to re-drive a session's second or later question on its own: it starts from the
    session's kernel and conversation, which only the session rebuilds.

    Raises:
        ConfigError: naming the session and how to go on."""
    link = (rec.get("options") or {}).get("session") or {}
    if int(link.get("question") or 1) > 1:
        sid = link.get("id")
        from rlm.errors import ConfigError
        raise ConfigError(f"run {rec['run_id']} is question {link['question']} of session "
                          f"{sid}: it continues that session's kernel and conversation, so it "
                          f"cannot {what} on its own; rebuild the session instead: "
                          f"rlm.Session.resume({sid!r}) or `rlm chat --resume {sid}`")


def plain_completion(prompt: str, **options: Any) -> Result:
    """One plain completion of ``prompt`` as a journaled run (see :meth:`RLM.plain_completion`;
    same options as :class:`RLM`). An embedded model server started for it is stopped after."""
    with RLM(**options) as r:
        return r.plain_completion(prompt)


def completion(context: Any, query: str | None = None, **options: Any) -> Result:
    """Run one RLM: ``context`` (str/list/dict, or ``Path``/paths/``"-"``), optional ``query``.

    Same options as :class:`RLM`. An embedded model server started for this
    call is stopped before it returns. See :meth:`RLM.completion` for errors.
    """
    query = root_prompt(query, options)
    with RLM(**options) as r:
        return r.completion(context, query)
