"""Sub-calls from a kernel: ``llm_query``, ``rlm`` and their batched forms, served on the host.

The bridge hands each request of a loop's kernel to that loop's :class:`Subcalls` (the host
looked the kernel up by its token and process id; nothing the kernel says about itself
counts). Every sub-call is a stage under the cell that made it:

* ``llm_query`` -> an ``llm_query`` stage holding one plain completion;
* ``rlm`` -> a ``child`` stage with an RLM loop and kernel of its own while
  ``Budget.child_gets_kernel(level)``, else a ``fallback`` stage holding a plain completion.

Batched forms create all their stages first, in input order (so ordinals, and with them the
stage ids replay keys on, follow program order, never completion order), then run them on the
run's :class:`~harness.control.Scheduler` (plain completions on its bounded pool, children in
its ``max_concurrency`` slots) and return every item's value or error, in input order. A child
that waits on its own batched sub-calls gives its slot back while it waits, so fan-out of any
width, nested at any depth, never stalls.

Every sub-call works under the scope of the cell that made it. When that cell is interrupted
(its timeout, or Ctrl-C), the items it started that were not sent yet are cancelled (stage
``cancelled``, nothing charged), the ones in flight are abandoned (their concurrency places are
freed at once, so the next turn does not wait for them), later requests of the cell are refused,
and the model is told how many (:func:`interrupt_note`).
"""
from __future__ import annotations

import json
from typing import Any, Callable, Protocol

from harness.control import Cancelled, CancelScope, Task, wait_all
from harness.errors import BudgetExceeded, DivergenceError
from harness.journal.errors import JournalError
from harness.stages.tree import Kind, Stage, Status
from kernels.bridge import BridgeError
from kernels.protocol import (BATCHED_OPS, SUBCALL_OPS, TOOL_OPS, ErrorKind, Op, item_error,
                              item_ok)

from rlm.prompting import prompts
from rlm.context.load import load_value
from rlm.errors import ChildRLMError, RLMError
from rlm.core import compaction
from rlm.core.schema import AnswerCheck, checked_completion, to_json_schema
from rlm.tools.host import host_for


class SubcallOwner(Protocol):
    """What :class:`Subcalls` reads of the loop whose kernel sends the requests
    (:class:`rlm.core.loop.RLMLoop` is one)."""

    run_tree: Any
    stage_id: str
    level: int
    scope: CancelScope
    cell_scope: CancelScope | None
    current_cell: str | None
    task: Task | None


class ChildLoop(Protocol):
    """A child RLM loop as :class:`Subcalls` drives it: run to its end, then close its kernel."""

    def run(self) -> Any: ...

    def close(self) -> None: ...


#: Makes a child loop: ``(run_tree, stage_id, level, context, query, model, scope=, check=)``.
ChildFactory = Callable[..., ChildLoop]


def to_bridge_error(exc: BaseException) -> BridgeError:
    """The typed error the kernel raises for a failed sub-call (see ``kernels.protocol``)."""
    if isinstance(exc, BridgeError):
        return exc
    if isinstance(exc, BudgetExceeded):
        return BridgeError(ErrorKind.BUDGET_EXCEEDED, str(exc), cap=exc.cap, limit=exc.limit,
                           used=exc.used, requested=exc.requested, remaining=exc.remaining)
    if isinstance(exc, ChildRLMError):
        return BridgeError(ErrorKind.CHILD_RLM_ERROR, str(exc), status=exc.status,
                           reason=exc.reason)
    if isinstance(exc, Cancelled):
        return BridgeError(ErrorKind.SUBCALL_ERROR, f"cancelled ({exc.reason}): the cell that "
                           "made this call was interrupted; it was not sent and costs nothing")
    return BridgeError(ErrorKind.SUBCALL_ERROR, f"{type(exc).__name__}: {exc}")


def interrupt_note(scope: CancelScope) -> str:
    """The sentence the model reads after a cell whose interrupt stopped sub-calls ("" if none)."""
    cancelled, abandoned = scope.cancelled_items, scope.abandoned_items
    if not cancelled and not abandoned:
        return ""
    parts = []
    if cancelled:
        parts.append(f"{cancelled} sub-call(s) it had started but not sent were cancelled "
                     "(never sent, not charged)")
    if abandoned:
        parts.append(f"{abandoned} sub-call(s) in flight were abandoned (their results are lost)")
    return "\nWhen the cell was interrupted, " + "; ".join(parts) + "."


class Subcalls:
    """Serves one loop's sub-call requests. Thread-safe (batched items run concurrently).

    Args:
        loop: the loop whose kernel sends the requests (:class:`~rlm.core.loop.RLMLoop`).
        start_child: makes the loop of a child RLM (the loop's own class; injected so this
            module does not import the loop that imports it).
    """

    def __init__(self, loop: SubcallOwner, start_child: ChildFactory) -> None:
        self.loop = loop
        self.run_tree = loop.run_tree
        self.start_child = start_child

    def handle(self, op: str, args: dict) -> Any:
        """Serve one bridge request.

        Args:
            op: an operation of :class:`kernels.protocol.Op`; args: its arguments
                (``prompt``/``prompts``, ``query``, ``model``).
        Returns:
            ``str`` for a single call; for a batched one a list, in input order, of
            ``{"value": str}`` or ``{"error": wire error}``.
        Raises:
            BridgeError: depth 0, a model the run does not allow, a refused cap, a failed
                child or endpoint (the kernel raises the matching exception).
        """
        if op == Op.HISTORY:  # the loop's full transcript, at any depth (rlm.core.compaction)
            return compaction.history(self.loop)
        budget = self.run_tree.opts.budget
        if op in SUBCALL_OPS and not budget.subcalls_allowed:
            raise BridgeError(ErrorKind.DEPTH_ERROR, f"{op} is disabled: this run has "
                              "max_depth=0 (no sub-calls); answer with Python alone")
        model = args.get("model")
        allowed = self._allowed_models()
        if model is not None and model not in allowed:
            raise BridgeError(ErrorKind.SUBCALL_ERROR, f"model {model!r} is not allowed in this "
                              f"run; allowed: {sorted(allowed)}")
        parent = self.loop.current_cell or self.loop.stage_id
        scope = self.loop.cell_scope or self.loop.scope
        try:
            # an interrupted cell (or a run past its wall cap) spends nothing more: each call
            # still gets its stage, which ends cancelled (or budget_exceeded) before sending
            if op in TOOL_OPS:  # the user's host tools (rlm.tools), at every depth
                return host_for(self.run_tree).handle(op, args, parent, self.loop.level, scope,
                                                      self._run, to_bridge_error)
            if op == Op.LLM_QUERY:
                return self.llm_query(parent, str(args.get("prompt", "")), model, scope=scope)
            if op == Op.RLM:
                return self.rlm(parent, args.get("prompt"), args.get("query"), model,
                                scope=scope, schema=to_json_schema(args.get("schema")))
            if op in BATCHED_OPS:
                return self._batched(op, parent, list(args.get("prompts") or []),
                                     args.get("query"), model, scope,
                                     schema=to_json_schema(args.get("schema")))
        except (BudgetExceeded, ChildRLMError, RLMError, DivergenceError, Cancelled,
                JournalError) as exc:
            self._journal_failed(exc)
            raise to_bridge_error(exc) from None
        raise BridgeError(ErrorKind.SUBCALL_ERROR, f"unknown operation {op!r}")

    def _journal_failed(self, exc: BaseException) -> None:
        """A journal that could not record a sub-call (its reservation or its reply) ends the
        whole run, as a divergence does: the model's code may catch the error, but no further
        cell runs (``RunTree.fatal``)."""
        if isinstance(exc, JournalError) and self.run_tree.fatal is None:
            self.run_tree.fatal = exc

    def _allowed_models(self) -> set:
        o = self.run_tree.opts
        return {m for m in (o.model, o.sub_model, o.child_model) if m}

    def _batched(self, op: str, parent: str, items: list, query: str | None,
                 model: str | None, scope: CancelScope, schema: dict | None = None) -> list:
        self.run_tree.accountant.check_children(0, len(items))
        if op == Op.LLM_QUERY_BATCHED:
            # stages (and so ordinals) are made here, in input order, before anything runs
            stages = [self._sub_stage(parent, Kind.llm_query, model) for _ in items]
            fns = [lambda p=p, s=s: self._plain_completion(s, str(p), scope)
                   for p, s in zip(items, stages)]
        else:
            stages = [self._plan_rlm(parent, model) for _ in items]
            check = AnswerCheck(schema) if schema is not None else None
            fns = [lambda p=p, s=s: self._run_rlm(s, p, query, scope, check)
                   for p, s in zip(items, stages)]
        out = []
        for task in self._run(fns, stages, scope):
            if not task.done():
                out.append(item_error(to_bridge_error(Cancelled(
                    scope.reason or "interrupted")).to_wire()))
                continue
            try:
                out.append(item_ok(task.result()))
            except BaseException as exc:  # noqa: BLE001 - every item's fate is reported
                self._journal_failed(exc)
                out.append(item_error(to_bridge_error(exc).to_wire()))
        return out

    def _run(self, fns: list[Callable[[], str]], stages: list[Stage],
             scope: CancelScope) -> list[Task]:
        """Run ``fns`` (one per pending stage) on the scheduler and wait for them, giving this
        loop's child slot back meanwhile. Returns the tasks: each done, or, when ``scope`` was
        cancelled first, abandoned in flight. Items dropped before they started get their stage
        ``cancelled``; the counts go to ``scope`` for :func:`interrupt_note`."""
        run = self.run_tree
        tasks = [run.scheduler.submit(f, scope=scope, level=st.level,
                                      lane="child" if st.kind == Kind.child else "plain")
                 for f, st in zip(fns, stages)]
        with run.scheduler.yielding(self.loop.task, self.loop.level, scope):
            wait_all(tasks, scope)
        dropped = abandoned = 0
        for task, st in zip(tasks, stages):
            if task.state == "cancelled":
                dropped += 1
                # never started: pending -> cancelled (a stage the run already ended stays so)
                with run.stage(existing=st, start=False) as never_sent:
                    never_sent.finish(Status.cancelled,
                                      f"cancelled before it was sent ({scope.reason})")
            elif not task.done():
                abandoned += 1
        if dropped or abandoned:
            scope.count(cancelled=dropped, abandoned=abandoned)
        return tasks

    # plain completions -------------------------------------------------------------
    def _sub_stage(self, parent: str, kind: Kind, model: str | None) -> Stage:
        o = self.run_tree.opts
        return self.run_tree.tree.new_stage(parent, kind, self.loop.level + 1,
                                       model=model or o.sub_model or o.model)

    def llm_query(self, parent: str, prompt: str, model: str | None,
                  stage: Stage | None = None, scope: CancelScope | None = None) -> str:
        """One ``llm_query``: a plain completion by the sub-call model; returns its text.

        Raises:
            BudgetExceeded, EndpointError, DivergenceError, Cancelled: as
                ``RunTree.model_call``.
        """
        st = stage or self._sub_stage(parent, Kind.llm_query, model)
        return self._plain_completion(st, prompt, scope or self.loop.scope)

    def _plain_completion(self, stage: Stage, prompt: str, scope: CancelScope) -> str:
        """A plain completion inside the pending stage (an ``llm_query`` or a ``fallback``),
        sent to the sub-call endpoint when the run has one (``sub_base_url``)."""
        run = self.run_tree
        with run.stage(existing=stage) as sc:
            comp = run.model_call(sc.id, sc.level, [{"role": "user", "content": prompt}],
                                  stage.model, run.opts.sub_max_tokens, scope=scope, sub=True)
            sc.evidence = comp.text
        return comp.text

    # children ------------------------------------------------------------------------
    def _plan_rlm(self, parent: str, model: str | None) -> Stage:
        """The pending stage of one ``rlm(...)``: a ``child`` with a kernel while the budget
        gives one at this level, else a ``fallback`` completion."""
        o = self.run_tree.opts
        if o.budget.child_gets_kernel(self.loop.level):
            return self.run_tree.tree.new_stage(parent, Kind.child, self.loop.level + 1,
                                           model=model or o.child_model or o.model)
        return self._sub_stage(parent, Kind.fallback, model)

    def rlm(self, parent: str, prompt: Any, query: str | None, model: str | None,
            stage: Stage | None = None, scope: CancelScope | None = None,
            schema: dict | None = None) -> str:
        """One ``rlm(prompt, query)``: a child RLM's answer, or a fallback completion.

        A child runs in one of the scheduler's slots (it waits for one like a batched item).

        Raises:
            ChildRLMError: the child could not start, failed, hit a cap or gave no answer
                (``.status``, ``.reason``).
            BudgetExceeded, EndpointError, Cancelled: from a fallback completion, or the
                cell was interrupted.
        """
        scope = scope or self.loop.scope
        st = stage or self._plan_rlm(parent, model)
        check = AnswerCheck(schema) if schema is not None else None  # rlm(..., schema=)
        if st.kind == Kind.fallback:
            return self._run_rlm(st, prompt, query, scope, check)
        (task,) = self._run([lambda: self._run_rlm(st, prompt, query, scope, check)], [st],
                            scope)
        if not task.done():
            raise Cancelled(scope.reason or "interrupted")
        return task.result()

    def _run_rlm(self, st: Stage, prompt: Any, query: str | None, scope: CancelScope,
                 check: AnswerCheck | None = None) -> str:
        """The body of one ``rlm`` item: a fallback completion, or a child loop (``check``:
        what its answer must pass, from ``rlm(..., schema=)``)."""
        if st.kind == Kind.fallback:
            text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
            if check is not None:
                return checked_completion(self.run_tree, st, prompts.subcall_prompt(text, query),
                                          check, scope=scope)
            return self._plain_completion(st, prompts.subcall_prompt(text, query), scope)
        try:
            return self._child(st, prompt, query, scope, check)
        except ChildRLMError:
            raise
        except BudgetExceeded as exc:
            raise ChildRLMError(f"child RLM {st.id} stopped: {exc}", "budget_exceeded",
                                str(exc)) from None
        except Cancelled as exc:
            raise ChildRLMError(f"child RLM {st.id} cancelled: {exc.reason}", "cancelled",
                                exc.reason) from None
        except BaseException as exc:
            raise ChildRLMError(f"child RLM {st.id} failed: {type(exc).__name__}: {exc}",
                                "failed", str(exc)) from None

    def _child(self, stage: Stage, prompt: Any, query: str | None, scope: CancelScope,
               check: AnswerCheck | None = None) -> str:
        run = self.run_tree
        with run.stage(existing=stage) as sc:
            try:
                ctx = load_value(prompt)  # a cell's value: never a path, never stdin
            except RLMError as exc:
                raise ChildRLMError(f"child RLM not started: {exc}", "failed", str(exc)) from None
            child = self.start_child(run, sc.id, sc.level, ctx, query, stage.model, scope=scope,
                                     check=check)
            run.progress(f"level {sc.level}: child {sc.id} started")
            try:
                out = child.run()
            finally:
                child.close()
            if out.status == "completed" and out.answer is not None:
                sc.evidence = out.answer
                return out.answer
            sc.finish(Status.failed, out.reason)
        raise ChildRLMError(f"child RLM {stage.id} ended without an answer ({out.reason})",
                            out.status, out.reason)
