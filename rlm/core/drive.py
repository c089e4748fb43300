"""Driving one whole run: :func:`drive` makes the :class:`~rlm.core.run_tree.RunTree`, records the
run in the journal with a heartbeat, runs the root :class:`~rlm.core.loop.RLMLoop` inside the ``run``
stage, maps how it ended to a status, and always shuts every kernel down."""
from __future__ import annotations

import time

from harness.control import Cancelled
from harness.errors import BudgetExceeded, DivergenceError
from harness.replay import Replay
from harness.stages.tree import Kind, Status, cancel_open
from harness.text import clean_text

from rlm.models.openai_compat import ModelClient
from rlm.context.load import LoadedContext
from rlm.errors import ConfigError, RLMError
from rlm.config.options import Options
from rlm.result import Result, usage_summary
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


def drive(opts: Options, ctx: LoadedContext, query: str | None, *, run_id: str | None = None,
          recorded: Replay | None = None, client: ModelClient | None = None,
          record: bool = True, plain: bool = False) -> Result:
    """Drive one run tree to its end and return the :class:`~rlm.result.Result`.

    ``plain=True``: the run is one plain completion of the context's text (a str), sent as the
    user message (:class:`PlainCall`); the journal's options record says ``"plain": true``.

    The journal (``opts.journal``, unless ``record=False``) gets the run record (unless
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
    from rlm.core.loop import RLMLoop
    t0 = time.monotonic()
    _quick_exit_after_runs()
    if isinstance(query, str):
        query = clean_text(query)  # e.g. undecodable argv bytes (surrogateescape)
    try:
        run = RunTree(opts, run_id=run_id, recorded=recorded, client=client,
                      adopt_head=not plain)
    except BaseException:  # a Ctrl-C during the set-up, say: no loop took the context
        ctx.discard()
        raise
    try:  # until the run is recorded, anything raised closes it and discards the context
        if opts.cancel is not None:  # rlm.aio.CancelToken: cancel the run from outside
            opts.cancel.attach(run)
        # a replay sends nothing (every call is served from the journal, a refusal from its
        # record): it needs no prices, and the price file may be gone
        if record and opts.budget.max_cost_usd is not None:
            try:
                run.accountant.check_prices({m for m in (opts.model, opts.sub_model,
                                                         opts.child_model) if m})
            except Exception as exc:
                raise ConfigError(str(exc)) from None
        if ctx.writing:  # a big context's file is being written behind (rlm.context.load)
            if run.client is not None and recorded is None:
                run.client.prepare()  # the first call's work, done while the file is written
            ctx.settle()
        journal = opts.journal if record else None
        if journal is not None and recorded is None:
            from rlm.config.build import stored_options
            stored = stored_options(opts, ctx)
            if plain:
                stored["plain"] = True
            journal.create_run(run.run_id, query=query or "", model=opts.model,
                               sub_model=opts.sub_model, max_depth=opts.budget.max_depth,
                               options=stored)
    except BaseException:
        run.close()
        ctx.discard()
        raise
    heartbeat = None
    status, answer, reason, cap, raised = "failed", None, "", None, None
    root = None
    try:  # from here on the run ends recorded (a Ctrl-C now is journaled as cancelled)
        if journal is not None:
            heartbeat = journal.start_heartbeat(run.run_id)
        with run.stage(None, Kind.run, 0, model=opts.model, meta={"query": query}) as scope:
            root = (PlainCall(run, scope.id, ctx.read_value(), opts.model) if plain
                    else RLMLoop(run, scope.id, 0, ctx, query, opts.model))
            out = run.run_bounded(root.run)
            answer, status, reason = out.answer, out.status, out.reason
            scope.evidence = answer
            if status != "completed":
                scope.finish(Status.failed, reason or None)
    except BudgetExceeded as exc:
        status, reason, cap = "budget_exceeded", str(exc), exc.cap
        answer = root.partial_answer() if root is not None else None
    except (KeyboardInterrupt, Cancelled):  # Ctrl-C, or a CancelToken (rlm.aio) cancelled
        status, reason, raised = "cancelled", "interrupted", KeyboardInterrupt()
    except (RLMError, DivergenceError) as exc:
        status, reason, raised = "failed", str(exc), exc
    except Exception as exc:  # a bug: the run is still journaled as failed, not left running
        status, reason, raised = "failed", f"internal error: {type(exc).__name__}: {exc}", exc
    finally:
        run.close()
        if root is None:  # ended before a loop took the context: its scratch copy goes here
            ctx.discard()
        cancel_open(run.tree, "cancelled" if status in ("cancelled", "budget_exceeded")
                    or raised is not None else "failed")
    res = Result(answer=answer, status=status, run_id=run.run_id,
                 iterations=root.iterations if root else 0, usage=_usage(run),
                 reason=reason, cap=cap, stages=run.tree.counts_by_kind(),
                 max_level=run.tree.max_level(), kernels_started=run.kernels_started,
                 seconds=time.monotonic() - t0,
                 replayed_calls=recorded.served if recorded else 0, tree=run.tree)
    if journal is not None:
        if heartbeat is not None:
            heartbeat.stop()
        journal.finish_run(run.run_id, status=status, answer=answer,
                           usage=res.journal_usage(), error=reason or None)
    if raised is not None:
        raised.result = res  # type: ignore[attr-defined]
        raised.journaled = journal is not None  # type: ignore[attr-defined]
        raise raised
    return res


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
