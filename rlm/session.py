"""Sessions: one root kernel and one conversation across many questions.

>>> with rlm.Session(Path("report.txt"), base_url=..., model=...) as s:
...     a1 = s.ask("How many sections are there?")
...     a2 = s.ask("Which of them is the longest?")   # the kernel still holds what a1 made
...     s.add_context(Path("appendix.txt"))           # context_1 in the kernel
...     a3 = s.ask("Does the appendix contradict it?")

Each question is one journaled run (:func:`rlm.core.drive.drive`) with the id
``<session_id>-q<n>``; its recorded options carry the link (``session``: the session id, the
question's number, the previous question's run id, the contexts added so far, the session
caps). :meth:`Session.resume` rebuilds a session after a crash from those records: the finished
questions are replayed in order on one fresh kernel (every model call served from the journal),
an interrupted last question is resumed, and later :meth:`Session.ask` calls are new questions.
"""
from __future__ import annotations

import re
import uuid
from dataclasses import replace
from typing import Any

from harness.errors import BudgetExceeded
from harness.replay import RECORDED_STATES, Replay, begin_resume, same_answer

from rlm.api import RLM
from rlm.config.build import context_options, replay_options, resume_options
from rlm.config.options import check_names
from rlm.config.reference import from_reference, root_prompt
from rlm.config.validate import validate_options
from rlm.config.records import (open_journal, recorded_chance, spec_options, stored_context)
from rlm.context.load import LoadedContext, load_context
from rlm.core.drive import drive
from rlm.core.hooks import RunHooks
from rlm.core.schema import normalize_options
from rlm.core.session_kernel import CutOff, KeptContext, SessionKernel
from rlm.errors import ConfigError, DivergenceError
from rlm.result import Result

__all__ = ["Session", "SESSION_CAPS", "question_run_id"]

#: Session caps: option -> (the per-question option it bounds, the usage total it counts).
SESSION_CAPS = {"session_max_calls": ("max_calls", "calls"),
                "session_max_tokens": ("max_tokens", "total_tokens"),
                "session_max_cost_usd": ("max_cost_usd", "cost_usd")}

_SESSION_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def question_run_id(session_id: str, number: int) -> str:
    """The run id of question ``number`` (1-based) of session ``session_id``."""
    return f"{session_id}-q{number}"


def _context_record(ctx: LoadedContext) -> dict:
    """How a context added to a session is loaded again on resume (the ``context_*`` keys of
    a run's recorded options, so :func:`rlm.config.records.stored_context` reads it)."""
    import os
    named = ctx.source not in ("<value>", "<stdin>", "<bytes>") and ctx.fmt != "bundle"
    return {"context_source": os.path.abspath(ctx.source) if named else None,
            "context_spec": ctx.spec, "context_fmt": ctx.fmt,
            "context_encoding": ctx.encoding, "context_sha256": ctx.sha256}


def _recorded_context(rec: dict, given: list, index: int) -> LoadedContext:
    """Context ``index`` of a session loaded again: ``given[index]`` if given, else from where
    ``rec`` (a run record, or ``{"run_id", "options": context record}``) says it was loaded.

    Raises:
        ConfigError: it was a value (or stdin) and is not given again. DivergenceError: it
        changed since (sha256). ContextError: it cannot be loaded.
    """
    o = rec.get("options") or {}
    src = given[index] if len(given) > index else None
    if src is None and not o.get("context_source") and not o.get("context_spec"):
        raise ConfigError(f"context {index} of session question {rec['run_id']} was given as a "
                          "value (or on stdin): pass every context again, in order, as "
                          "Session.resume(..., contexts=[...]) (rlm chat: --context PATH)")
    return stored_context(rec, src, o.get("context_encoding"))


class _UpToItsEnd(Replay):
    """A strict replay of a question that did not complete (cancelled, or failed at an
    endpoint): it ends (:class:`~rlm.core.session_kernel.CutOff`) where the question was cut
    off, as the question did, and sends nothing: at a root call the run never recorded, or
    whose reply came only once its turn had ended (an abandoned call still settles and is
    recorded, but the loop never read it), or at a cell the run never recorded (the session
    kernel's :meth:`~rlm.core.session_kernel.SessionKernel.before_cell`)."""

    def __init__(self, journal: Any, run_id: str) -> None:
        super().__init__(journal, run_id, strict=True)
        stages = {st["id"]: st for st in journal.stages(run_id)}
        self._unread = {i for i, st in stages.items() if st.get("kind") == "model_call"
                        and _ended_first(stages.get(st.get("parent_id")), st)}

    def lookup(self, call_id: str, req_hash: str) -> dict | None:
        # a refusal the run recorded is served as the refusal (the base class raises it)
        if call_id in self._unread or (self._matching.find(call_id, req_hash) is None
                                       and self.refusal(self._matching.recorded_id(call_id))
                                       is None):
            raise CutOff(call_id)
        return super().lookup(call_id, req_hash)


def _cut_cells(journal: Any, run_id: str) -> dict[str, float]:
    """The root cells of a cut-off question that were interrupted (stage ``cancelled``), with
    the seconds each ran (``ended_at - started_at``, at least 0.05)."""
    out = {}
    for st in journal.stages(run_id):
        if st.get("kind") == "cell" and st.get("level") == 0 and st.get("status") == "cancelled":
            ran = (st.get("ended_at") or 0) - (st.get("started_at") or st.get("created_at") or 0)
            out[st["id"]] = max(0.05, ran)
    return out


def _ended_first(turn: dict | None, call: dict) -> bool:
    """True if ``turn`` (a root ``iteration`` stage record) ended no later than ``call``."""
    if not turn or turn.get("kind") != "iteration" or turn.get("level") != 0:
        return False
    return (turn.get("ended_at") or 0) <= (call.get("ended_at") or float("inf"))


class Session:
    """A root kernel and conversation that outlive one question; a context manager.

    Args:
        context: the first context, as :func:`rlm.completion` takes it (``context`` and
            ``context_0`` in the kernel).
        session_id: the session's id (letters, digits, ``_.-``; default a new 12-hex id). Its
            questions' runs are ``<session_id>-q1``, ``-q2``, ...
        runner: an :class:`rlm.RLM` whose endpoint (an embedded model server it started) the
            session uses, not closed with it (``rlm serve``'s); default one of its own.
        options: the keyword options of :class:`rlm.RLM`, for every question (an ``ask`` may
            override some), plus the session caps ``session_max_calls``,
            ``session_max_tokens`` and ``session_max_cost_usd``: over all the questions,
            each question's own cap (``max_calls``...) is lowered to what is left of them.

    Attributes:
        session_id: the session's id (str).
        results: the :class:`~rlm.result.Result` of every question so far, in order (the
            replayed ones, after :meth:`resume`, as recorded).
        spent: ``calls``, ``total_tokens`` and ``cost_usd`` over those questions (dict).

    Raises:
        ConfigError: bad options, a bad ``session_id``, or one the journal already holds
            (resume it with :meth:`resume`). ContextError: the context cannot be loaded.
    """

    def __init__(self, context: Any, *, session_id: str | None = None,
                 runner: RLM | None = None, **options: Any) -> None:
        self._start(session_id, options, None, runner)
        if self._journal is not None and self._journal.get_run(
                question_run_id(self.session_id, 1)) is not None:
            self._close_journal()
            raise ConfigError(f"session {self.session_id!r} is already in journal "
                              f"{self._journal.path}: continue it with "
                              f"Session.resume({self.session_id!r})")
        try:
            ctx = load_context(context, **context_options(self._o))
        except BaseException:
            self._close_journal()
            raise
        self._held = SessionKernel(KeptContext.of(ctx))

    def _start(self, session_id: str | None, options: dict, journal: Any,
               runner: RLM | None = None) -> None:
        # a session is what the reference's persistent=True asks for
        options = from_reference({k: v for k, v in options.items() if k != "persistent"})
        check_names(options)
        o = normalize_options(dict(options))
        validate_options(o)
        if o.get("run_id"):
            raise ConfigError("a session names its questions' runs itself "
                              "(<session_id>-q1, -q2, ...): give session_id, not run_id")
        if session_id is not None and (not isinstance(session_id, str)
                                       or not _SESSION_ID.fullmatch(session_id)):
            raise ConfigError(f"session_id must be 1 to 64 letters, digits, '_', '.' or '-', "
                              f"got {session_id!r}")
        self.session_id = session_id or uuid.uuid4().hex[:12]
        self._o = o
        self._journal = journal if journal is not None else open_journal(
            o.get("journal"), durability=o.get("journal_durability"))
        self._own_journal = self._journal is not None and self._journal is not o.get("journal")
        # the endpoint (and an embedded model server it starts); a runner given is shared
        self._rlm = runner or RLM(**{k: v for k, v in o.items() if k != "journal"})
        self._own_rlm = runner is None
        self.results: list[Result] = []
        self.spent = {"calls": 0, "total_tokens": 0, "cost_usd": 0.0}
        self._prev: str | None = None
        self._added: list[dict] = []  # _context_record of each context after the first
        self._closed = False

    # questions ---------------------------------------------------------------------
    def ask(self, query: str | None = None, **overrides: Any) -> Result:
        """Ask the next question: one run on the session's kernel, continuing its conversation.

        Args:
            query: the question (str; None: the task is at the start of the newest context).
            overrides: keyword options for this question only (caps, ``max_iterations``...).
        Returns:
            its :class:`~rlm.result.Result` (``run_id`` ``<session_id>-q<n>``).
        Raises:
            BudgetExceeded: a session cap is spent; the question is refused, nothing is sent.
            ConfigError: bad options, or the session is closed. Otherwise as
            :func:`rlm.completion` (the session stays usable after a failed question).
        """
        self._check_open()
        query = root_prompt(query, overrides)  # (the reference's name for the question)
        if query is not None and not isinstance(query, str):
            raise ConfigError(f"query must be a str or None, got {type(query).__name__}")
        overrides = from_reference(overrides)
        check_names(overrides)
        base = normalize_options({**self._o, **overrides})
        validate_options(base)
        o = self._capped(base)
        opts = self._rlm._options(o)
        held = self._held
        number = held.question + 1
        run_id = question_run_id(self.session_id, number)
        if self._journal is not None and self._journal.get_run(run_id) is not None:
            raise ConfigError(
                f"question {number} of session {self.session_id!r} is already in the journal "
                f"{self._journal.path}: another Session with this id asked it (two open "
                "sessions cannot share one id). Use another session_id, or, once the other "
                f"is closed, continue it with rlm.Session.resume({self.session_id!r})")
        held.question, held.link = number, self._link(number, base)
        hooks = replace(RunHooks.from_options(o, self._journal), session=held)
        try:
            return self._drive(lambda: drive(opts, held.first, query, hooks=hooks,
                                             run_id=run_id))
        except BaseException:
            if self._journal is not None and self._journal.get_run(run_id) is None:
                held.question = number - 1  # never recorded: the number is free again
            raise

    def _drive(self, go) -> Result:
        try:
            res = go()
        except BaseException as exc:
            res = getattr(exc, "result", None)
            if res is not None:
                self._ended(res)
            raise
        self._ended(res)
        return res

    def _link(self, number: int, o: dict) -> dict:
        """What question ``number``'s run records of its session (``o``: its options before
        the session caps lowered its own)."""
        return {"id": self.session_id, "question": number, "previous_run": self._prev,
                "contexts": list(self._added),
                "caps": {k: o[k] for k in SESSION_CAPS if o.get(k) is not None},
                "own_caps": {f: o.get(f) for f, _ in SESSION_CAPS.values()}}

    def _capped(self, o: dict) -> dict:
        """``o`` with each question cap lowered to what is left of its session cap.

        Raises:
            BudgetExceeded: a session cap has nothing left (cap named ``session_calls``,
            ``session_tokens`` or ``session_cost``)."""
        o = dict(o)
        for cap, (field, used_key) in SESSION_CAPS.items():
            limit = o.get(cap)
            if limit is None:
                continue
            used = self.spent[used_key]
            left = limit - used
            if left <= 0 or (field != "max_cost_usd" and left < 1):
                name = "session_" + cap.split("_")[2]
                raise BudgetExceeded(name, limit, used, message=(
                    f"budget cap '{name}' reached: the session has used {used:g} of its "
                    f"{cap} {limit:g}; question {self._held.question + 1} is refused (nothing "
                    "was sent). Start a new session or raise the cap"))
            own = o.get(field)
            o[field] = left if own is None else min(own, left)
        return o

    def _ended(self, res: Result) -> None:
        usage = res.usage or {}
        for key in self.spent:
            self.spent[key] += usage.get(key) or 0
        self._held.answer = res.answer if res.status == "completed" else None
        self._prev = res.run_id
        self.results.append(res)

    # contexts -------------------------------------------------------------------------
    def add_context(self, more: Any) -> int:
        """Add a context (as :func:`rlm.completion` takes one). In the kernel it is
        ``context_<n>`` and ``contexts[n]``; the next question's message tells the model.

        Returns:
            its index ``n`` (int >= 1; ``context_0`` is the first context).
        Raises:
            ContextError: it cannot be loaded. ConfigError: the session is closed.
        """
        self._check_open()
        ctx = KeptContext.of(load_context(more, **context_options(self._o)))
        try:
            index = self._held.add(ctx)
        except BaseException:
            LoadedContext.discard(ctx)
            raise
        self._added.append(_context_record(ctx))
        return index

    # resume ---------------------------------------------------------------------------
    @classmethod
    def resume(cls, session_id: str, *, contexts: list | None = None,
               **options: Any) -> "Session":
        """Rebuild a session from its journal after a crash, then continue it.

        The recorded questions are re-driven in order on one fresh kernel: a finished one is
        replayed (every model call and sub-call served from the journal, nothing sent; its
        cells really run, so the kernel's variables come back), an interrupted last one is
        resumed (served from the journal up to where it stopped, then live). Later
        :meth:`ask` calls are new questions.

        Args:
            session_id: the session's id. contexts: the contexts again, in order (first, then
                each added one); needed only for those given as values, else they are read
                from where they were loaded. options: as for :class:`Session`; the recorded
                ones are the defaults.
        Raises:
            ConfigError: no such session in the journal. DivergenceError: a replayed question
            took another path, or a context changed. RunActiveError: its last question is
            still running elsewhere.
        """
        given = list(contexts or [])
        j = open_journal(options.get("journal"), must_exist=True)
        try:
            first = j.get_run(question_run_id(session_id, 1)) if j is not None else None
            if first is None:
                where = j.path if j is not None else "(no journal)"
                raise ConfigError(f"no session {session_id!r} in journal {where}; sessions "
                                  "are journaled as runs <session_id>-q1, -q2, ... (rlm runs)")
            link = (first.get("options") or {}).get("session") or {}
            merged = {**resume_options(first), **spec_options(first), **link.get("caps", {})}
            for field, v in (link.get("own_caps") or {}).items():  # before the session's
                merged[field] = v  # caps lowered them
            merged.update({k: v for k, v in options.items() if v is not None})
            merged.pop("journal", None)
            ctx = _recorded_context(first, given, 0)
        except BaseException:
            if j is not options.get("journal") and j is not None:
                j.close()
            raise
        self = cls.__new__(cls)
        self._start(session_id, merged, j)
        self._own_journal = j is not options.get("journal")
        self._held = SessionKernel(KeptContext.of(ctx))
        try:
            self._redo_all(given)
        except BaseException:
            self.close()
            raise
        return self

    def _redo_all(self, given: list) -> None:
        n = 1
        while True:
            rec = self._journal.get_run(question_run_id(self.session_id, n))
            if rec is None:
                return
            last = self._journal.get_run(question_run_id(self.session_id, n + 1)) is None
            self._redo(rec, given, last)
            n += 1

    def _redo(self, rec: dict, given: list, last: bool) -> None:
        """Re-drive one recorded question: replayed, or (the last one, unfinished) resumed."""
        link = (rec.get("options") or {}).get("session") or {}
        for crec in (link.get("contexts") or [])[len(self._added):]:
            k = len(self._added) + 1
            ctx = _recorded_context({"run_id": rec["run_id"], "options": crec}, given, k)
            self._held.add(KeptContext.of(ctx))
            self._added.append(crec)
        held = self._held
        held.question = int(link.get("question") or held.question + 1)
        held.link = dict(link)
        query = rec.get("query") or None
        if not last or rec["state"] in RECORDED_STATES:
            hooks = RunHooks(on_progress=self._o.get("on_progress"), session=held)
            cut = rec["state"] not in RECORDED_STATES  # it ended before an answer
            served = (_UpToItsEnd(self._journal, rec["run_id"]) if cut
                      else Replay(self._journal, rec["run_id"], strict=True))
            if cut:
                held.cells = {c["stage_id"] for c in self._journal.cells(rec["run_id"])}
                held.cut = _cut_cells(self._journal, rec["run_id"])
            try:
                res = drive(replay_options(rec), held.first, query, hooks=hooks,
                            run_id=rec["run_id"], recorded=served, record=False)
            except CutOff:
                res = Result.from_record(rec)
            finally:
                held.cells = held.cut = None
            if not same_answer(rec, res.answer):
                raise DivergenceError(f"replay of question {held.question} (run "
                                      f"{rec['run_id']}) reached {res.answer!r} instead of "
                                      f"{rec.get('answer')!r}")
            self._ended(Result.from_record(rec))
            return
        recorded = begin_resume(self._journal, rec, self._o.get("divergence") or "stop")
        o = {**self._o, **recorded_chance(rec)}
        opts = self._rlm._options(o)
        hooks = replace(RunHooks.from_options(o, self._journal), session=held)
        self._drive(lambda: drive(opts, held.first, query, hooks=hooks, run_id=rec["run_id"],
                                  recorded=recorded))

    # closing ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError(f"session {self.session_id} is closed; continue it with "
                              f"rlm.Session.resume({self.session_id!r})")

    def _close_journal(self) -> None:
        if self._own_journal and self._journal is not None:
            self._journal.close()

    def close(self) -> None:
        """Shut the session's kernel down, stop an embedded model server it started, discard
        its contexts' scratch files and close a journal it opened. Idempotent; the journal
        keeps every question, so :meth:`resume` can continue it."""
        if self._closed:
            return
        self._closed = True
        try:
            self._held.close()
        finally:
            if self._own_rlm:
                self._rlm.close()
            self._close_journal()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
