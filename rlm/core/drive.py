"""Driving one whole run: :func:`drive` makes the :class:`~rlm.core.run_tree.RunTree`, records the
run in the journal with a heartbeat, runs the root :class:`~rlm.core.loop.RLMLoop` inside the ``run``
stage, maps how it ended to a status, and always shuts every kernel down."""
from __future__ import annotations

import time
from typing import Any

from harness.control import Cancelled, run_began, run_ended, stopping_deferred
from harness.errors import BudgetExceeded, DivergenceError
from harness.journal.errors import JournalError
from harness.replay import Replay
from harness.stages.tree import Kind, Status, cancel_open
from harness.text import clean_text

from rlm.models.openai_compat import ModelClient
from rlm.context.load import LoadedContext
from rlm.errors import ConfigError, RLMError
from rlm.config.options import Options
from rlm.result import Result, usage_summary
from rlm.core.hooks import RunHooks, RunJournal
from rlm.core.run_tree import RunTree


class PlainCall:
    """The root of a *plain* run: one model call of the context's text as the user message,
    in a ``model_call`` stage right under the ``run`` stage; no kernel, no loop. It stands where
    :class:`~rlm.core.loop.RLMLoop` stands in :func:`drive`, so a plain run is journaled, resumed
    and replayed like any other (its one call is served from the journal by id and hash).

    Args:
        run: the :class:`RunTree`; ``stage_id``: the ``run`` stage's id; ``prompt``: the text
            sent (str); ``model``: the model name. The output cap is the run's
            ``max_completion_tokens`` (tokens).
    """

    def __init__(self, run: RunTree, stage_id: str, prompt: str, model: str) -> None:
        self.run_tree, self.stage_id, self.prompt, self.model = run, stage_id, prompt, model
        self.iterations = 0
        self.last_reply: str | None = None

    def partial_answer(self) -> str | None:
        """The reply, if one came (a budget stop comes before it: then None)."""
        return self.last_reply

    def run(self):
        """Send the one call; returns a completed :class:`~rlm.core.loop.Outcome` with its text.

        Raises:
            BudgetExceeded, EndpointError, DivergenceError: as :meth:`RunTree.model_call`.
        """
        from rlm.core.loop import Outcome
        run = self.run_tree
        self.iterations = 1
        comp = run.model_call(self.stage_id, 0, [{"role": "user", "content": self.prompt}],
                              self.model, run.opts.max_completion_tokens)
        self.last_reply = comp.text
        run.progress("plain completion: one model call")
        return Outcome(comp.text, "completed", 1)


_exit_hook = False


def _quick_exit_after_runs() -> None:
    """Once per process: at exit, freeze the garbage collector's view of the heap
    (``gc.freeze``, an ``atexit`` hook). A run imports about a thousand modules (``openai``'s
    pydantic types above all); the collections the interpreter's teardown would run over all
    of them took 0.25 s or more of every process's exit and free nothing that outlives the
    process. Objects made after the freeze are still collected."""
    global _exit_hook
    if not _exit_hook:
        _exit_hook = True
        import atexit
        import gc
        atexit.register(gc.freeze)


def drive(opts: Options, ctx: LoadedContext, query: str | None, *, hooks: RunHooks = RunHooks(),
          run_id: str | None = None, recorded: Replay | None = None,
          client: ModelClient | None = None, record: bool = True, plain: bool = False) -> Result:
    """Drive one run tree to its end and return the :class:`~rlm.result.Result`.

    ``plain=True``: the run is one plain completion of the context's text (a str), sent as the
    user message (:class:`PlainCall`); the journal's options record says ``"plain": true``.

    The journal (``hooks.journal``, unless ``record=False``) gets the run record (unless
    resuming: it exists), a heartbeat while it runs, every stage event, model call and cell,
    and the final status. Kernels are always shut down.

    Raises:
        ConfigError: a cost cap without a price for one of the run's models (before anything
            is journaled or started).
        RLMError, DivergenceError: an unrecoverable failure (endpoint, kernel, divergence);
            the partial :class:`Result` is attached as ``exc.result``.
        KeyboardInterrupt: interrupted; the run is journaled as ``cancelled``. Like the
            errors above it carries the partial ``result``, and ``journaled`` (bool: whether
            the run was recorded, so that it can be resumed).
    """
    t0 = time.monotonic()
    _quick_exit_after_runs()
    if isinstance(query, str):
        query = clean_text(query)  # e.g. undecodable argv bytes (surrogateescape)
    journal = hooks.journal if record else None
    try:
        run = RunTree(opts, hooks, run_id=run_id, recorded=recorded, client=client,
                      adopt_head=not plain and hooks.session is None)
    except BaseException:  # a Ctrl-C during the set-up, say: no loop took the context
        ctx.discard()
        raise
    try:  # until the run is recorded, anything raised closes it and discards the context
        _set_up(run, ctx, query, hooks, journal, record=record, plain=plain)
    except BaseException:
        run.close()
        ctx.discard()
        raise
    end, heartbeat = _RunEnd(), None
    run_began()
    try:  # from here on the run ends recorded (a Ctrl-C now is journaled as cancelled)
        if journal is not None:
            heartbeat = journal.start_heartbeat(run.run_id)
        _run_root(run, ctx, query, end, plain=plain)
    except BaseException as exc:
        end.failed(exc)
    finally:
        # the end runs whole: a stop signal now waits for it (harness.control), else the run
        # was left running and its kernels behind
        with stopping_deferred():
            run.close()
            if end.root is None:  # ended before a loop took the context: its copy goes here
                ctx.discard()
            _settle_cells(run.tree, CELL_SETTLE_SECONDS)
            cancel_open(run.tree, "cancelled" if end.status in ("cancelled", "budget_exceeded")
                        or end.raised is not None else "failed")
    with stopping_deferred():
        res = _result(run, end, recorded, t0)
        if journal is not None:
            if heartbeat is not None:
                heartbeat.stop()
            journal.finish_run(run.run_id, status=end.status, answer=end.answer,
                               usage=res.journal_usage(), error=end.reason or None)
        run_ended()
    if end.raised is not None:
        end.raised.result = res  # type: ignore[attr-defined]
        end.raised.journaled = journal is not None  # type: ignore[attr-defined]
        raise end.raised
    return res


#: Seconds a run's end waits for cells still running (a child's cell winding down after its
#: parent's interrupt: a kernel that ignores it is killed after 1 s, ``kernels.kernel``) to end
#: on their own, so their stages keep their evidence instead of being swept without it.
CELL_SETTLE_SECONDS = 2.0


def _settle_cells(tree: Any, seconds: float) -> None:
    """Wait up to ``seconds`` (s) while any ``cell`` stage of ``tree`` is still running."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(
            st.kind == Kind.cell and st.status == Status.running for st in tree.all()):
        time.sleep(0.05)


def _set_up(run: RunTree, ctx: LoadedContext, query: str | None, hooks: RunHooks,
            journal: RunJournal | None, *, record: bool, plain: bool) -> None:
    """Before the run is recorded: attach the cancel handle, check prices, wait for a context
    written behind, and create the run's journal record (not when resuming: it exists)."""
    opts = run.opts
    if hooks.cancel is not None:  # rlm.aio.CancelToken: cancel the run from outside
        hooks.cancel.attach(run)
    # a replay sends nothing (every call is served from the journal, a refusal from its
    # record): it needs no prices, and the price file may be gone
    if record and opts.budget.max_cost_usd is not None:
        try:
            run.accountant.check_prices({m for m in (opts.model, opts.sub_model,
                                                     opts.child_model) if m})
        except Exception as exc:
            raise ConfigError(str(exc)) from None
    if ctx.writing:  # a big context's file is being written behind (rlm.context.load)
        if run.client is not None and run.recorded is None:
            run.client.prepare()  # the first call's work, done while the file is written
        ctx.settle()
    if journal is not None and run.recorded is None:
        from rlm.config.build import stored_options
        stored = stored_options(opts, ctx)
        if plain:
            stored["plain"] = True
        if hooks.session is not None:  # the question's link to its session and predecessor
            stored["session"] = dict(hooks.session.link)
        journal.create_run(run.run_id, query=query or "", model=opts.model,
                           sub_model=opts.sub_model, max_depth=opts.budget.max_depth,
                           options=stored)


class _RunEnd:
    """How a run ended: status, answer, reason, the cap that stopped it, the exception to raise
    (None: return the result) and the root (loop or plain call) once one took the context."""

    def __init__(self) -> None:
        self.status, self.answer, self.reason = "failed", None, ""
        self.cap: str | None = None
        self.raised: BaseException | None = None
        self.root: Any = None

    def failed(self, exc: BaseException) -> None:
        """Record how ``exc`` ended the run (a budget stop keeps the partial answer)."""
        if isinstance(exc, BudgetExceeded):
            self.status, self.reason, self.cap = "budget_exceeded", str(exc), exc.cap
            self.answer = self.root.partial_answer() if self.root is not None else None
        elif isinstance(exc, (KeyboardInterrupt, Cancelled)):  # Ctrl-C, or rlm.aio's token
            self.status, self.reason, self.raised = "cancelled", "interrupted", KeyboardInterrupt()
        elif isinstance(exc, (RLMError, DivergenceError, JournalError)):
            self.status, self.reason, self.raised = "failed", str(exc), exc
        elif isinstance(exc, OSError):  # the machine's (a full disk, a path not writable)
            where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
            self.status, self.raised = "failed", exc
            self.reason = f"{exc.strerror or exc}{where}"
        elif isinstance(exc, Exception):  # a bug: journaled as failed, not left running
            self.status, self.raised = "failed", exc
            self.reason = f"internal error: {type(exc).__name__}: {exc}"
        else:  # SystemExit and the like: not the run's to record as anything else
            raise exc


def _run_root(run: RunTree, ctx: LoadedContext, query: str | None, end: _RunEnd, *,
              plain: bool) -> None:
    """Run the root (an :class:`~rlm.core.loop.RLMLoop`, or :class:`PlainCall`) inside the
    ``run`` stage, bounded by the wall cap; its outcome goes into ``end``."""
    from rlm.core.loop import RLMLoop
    opts = run.opts
    with run.stage(None, Kind.run, 0, model=opts.model, meta={"query": query}) as scope:
        end.root = (PlainCall(run, scope.id, ctx.read_value(), opts.model) if plain
                    else RLMLoop(run, scope.id, 0, ctx, query, opts.model))
        out = run.run_bounded(end.root.run)
        end.answer, end.status, end.reason = out.answer, out.status, out.reason
        scope.evidence = end.answer
        if end.status != "completed":
            scope.finish(Status.failed, end.reason or None)


def _result(run: RunTree, end: _RunEnd, recorded: Replay | None, t0: float) -> Result:
    """The run's :class:`~rlm.result.Result` from how it ended."""
    return Result(answer=end.answer, status=end.status, run_id=run.run_id,
                  iterations=end.root.iterations if end.root else 0, usage=_usage(run),
                  reason=end.reason, cap=end.cap, stages=run.tree.counts_by_kind(),
                  max_level=run.tree.max_level(), kernels_started=run.kernels_started,
                  seconds=time.monotonic() - t0,
                  replayed_calls=recorded.served if recorded else 0, tree=run.tree,
                  sandbox=run.sandbox_mode, kernel_limits=run.kernel_limits)


def _usage(run: RunTree) -> dict:
    """The result's ``usage``: this attempt's calls (:func:`usage_summary`); for a resumed run
    also ``all_attempts``, what the logical run spent over every attempt as its accountant
    counts it (earlier attempts from the journal's spend ledger, a call in flight at a crash
    at its reservation; ``open_at_resume``: how many such calls)."""
    usage = usage_summary(run.tree)
    carried = run.carried
    if carried is not None:
        usage["all_attempts"] = dict(run.accountant.totals(), open_at_resume=carried["open"])
    return usage
