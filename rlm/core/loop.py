"""The loop of one RLM (the root, or a child at any level), with a kernel of its own.

Each turn (an ``iteration`` stage): one model call with the conversation so far; every
```` ```repl ```` block of the reply runs in the loop's kernel (one ``cell`` stage each); the
outputs go back to the model. The loop ends only when executed code sets the answer
(``FINAL``/``FINAL_VAR``); after ``max_iterations`` turns one last turn asks for it.

Sub-calls the kernel's code makes (``llm_query``, ``rlm`` and their batched forms) reach the
loop's :class:`~rlm.core.subcalls.Subcalls` through the bridge while a cell runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.control import CancelScope, Cancelled, Task, WaitClock
from harness.stages.tree import Kind, Status
from kernels.bridge import Registration
from kernels.kernel import CellResult, Kernel, KernelDied
from kernels.protocol import FINAL_EXPR, FINAL_KEY, parse_final
from kernels.provider import bind_cell

from rlm.prompting import prompts
from rlm.context.load import LoadedContext, describe
from rlm.errors import ContextError, KernelError
from rlm.prompting.parsing import parse_reply
from rlm.core import compaction, degenerate
from rlm.core.run_tree import RunTree
from rlm.core.schema import AnswerCheck
from rlm.core.subcalls import Subcalls, interrupt_note
from rlm.tools import kernel_specs, prompt_tools


@dataclass
class Outcome:
    """How one loop ended.

    Attributes:
        answer: the answer executed code set (str), or None.
        status: ``"completed"`` (an answer) or ``"failed"`` (iterations ran out).
        iterations: turns taken (int). reason: why there is no answer (str).
    """

    answer: str | None
    status: str
    iterations: int
    reason: str = ""


class RLMLoop:
    """One RLM: a model driving its own kernel that holds ``context``.

    Args:
        run: the :class:`~rlm.core.run_tree.RunTree` it belongs to (kept as ``run_tree``).
        stage_id: the stage its iterations hang under (the ``run`` or a ``child`` stage).
        level: its depth level (int; root = 0).
        context: the loaded context; ``query``: the question (str | None).
        model: the model that drives this loop (str).
        scope: the cancel scope it runs under (the cell that started a child; default the
            run's); the loop works in a scope of its own below it, each cell in one below that.
    """

    def __init__(self, run: RunTree, stage_id: str, level: int, context: LoadedContext,
                 query: str | None, model: str, scope: CancelScope | None = None,
                 check: AnswerCheck | None = None) -> None:
        self.run_tree, self.stage_id, self.level = run, stage_id, level
        self.scope = (scope or run.scope).child(stage_id)
        self.cell_scope: CancelScope | None = None
        # time the running cell waits on its sub-calls: not counted against its own timeout
        self.wait_clock = WaitClock()
        self.task: Task | None = run.scheduler.current()  # a child's slot in the scheduler
        # what FINAL must pass (rlm.core.schema): the run's answer_schema/verify at the root,
        # the schema of rlm(..., schema=) for a child
        self.check = check if check is not None or level else AnswerCheck.from_options(run.opts)
        self.context, self.query, self.model = context, query, model
        self.subcalls = Subcalls(self, start_child=RLMLoop)
        self.kernel: Kernel | None = None
        self.reg: Registration | None = None
        self.current_cell: str | None = None
        self.restarts = 0
        self.iterations = 0
        # what executed code set with FINAL (and the answer check let through) while the run
        # was stopping: the only partial answer a loop has (never the model's unexecuted reply)
        self.final_set: str | None = None
        self.repeats = degenerate.Repeats()  # ends a loop that only repeats itself
        self._kernel_future: Task | None = None
        self._closed = False
        # a session's question (rlm.core.session_kernel): the root borrows the session's
        # kernel and conversation and gives them back at its close
        self.held = getattr(run, "session", None) if level == 0 else None
        run.loops.append(self)

    def partial_answer(self) -> str | None:
        """The answer after a budget stop: what executed code set (``FINAL``/``FINAL_VAR``)
        before the cap ended the loop, else None. The model's last reply is never an answer:
        its code did not run, or ran without setting one."""
        return self.final_set

    # the loop ------------------------------------------------------------------
    def run(self) -> Outcome:
        """Drive this RLM until executed code sets the answer, or the turns run out.

        Returns:
            the :class:`Outcome` (``failed`` with a reason when no FINAL came).
        Raises:
            BudgetExceeded: a cap refused one of this loop's own model calls.
            EndpointError, KernelError, DivergenceError: unrecoverable failures.
        """
        opts = self.run_tree.opts
        if self.run_tree.fatal is not None:  # e.g. cancelled (rlm.aio) before it began: no kernel
            raise self.run_tree.fatal
        messages = self._opening_messages()
        if self.held is None or not self.held.attach(self):
            self._kernel_future = self.run_tree.spawn(self._new_kernel)
        turns = max(1, opts.budget.max_iterations)
        for i in range(turns + 1):
            if i == turns:
                messages.append({"role": "user", "content": prompts.LAST_TURN})
            answer = self._turn(i, messages)
            if answer is not None:
                return Outcome(answer, "completed", self.iterations)
            if self.repeats.stop:
                return Outcome(None, "failed", self.iterations, self.repeats.stop)
        return Outcome(None, "failed", self.iterations,
                       f"no FINAL after {turns} iterations and a last turn")

    def _opening_messages(self) -> list[dict]:
        """The conversation this loop starts from: the system prompt and the task; in a
        session after its first question, the session's conversation so far and a message
        opening the new question (:func:`rlm.prompting.prompts.next_question`)."""
        held = self.held
        if held is not None and held.messages is not None:
            held.messages.append({"role": "user", "content": prompts.next_question(
                held.question, self.query, held.untold(), held.answer)})
            return held.messages
        system, task = opening(self.context, self.query, self.run_tree.opts, level=self.level)
        if self.check is not None:
            task += "\n\n" + self.check.instructions()
        added = held.untold() if held is not None else []
        if added:  # contexts a session added before its first question
            task += "\n\n" + "\n".join(prompts.context_lines(added))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        if held is not None:
            held.messages = messages
        return messages

    def _turn(self, i: int, messages: list[dict]) -> str | None:
        """One iteration: a model call, then its code blocks; returns the answer or None.
        Appends the reply and the feedback to ``messages``."""
        run = self.run_tree
        with run.stage(self.stage_id, Kind.iteration, self.level, model=self.model) as it:
            self.iterations += 1
            # kept within the model's window: older turns compacted first when needed
            comp = compaction.attach(self).model_call(it, messages,
                                                      run.opts.max_completion_tokens)
            # reasoning is never code: only the reply's visible text is parsed and kept in
            # the conversation; a reply cut at the output-token limit never runs its
            # unclosed last block, and the model is told
            parsed = parse_reply(comp.text, cut=comp.cut)
            run.accountant.check_wall()  # host-side work counts against the wall cap too
            reply = parsed.text
            messages.append({"role": "assistant", "content": reply})
            blocks = parsed.code_blocks(cut=comp.cut)
            cut_note = (prompts.cut_reply(run.opts.max_completion_tokens,
                                          parsed.unclosed_code()) if comp.cut else None)
            # named by its stage id, as every view and the journal name it
            run.progress(f"L{self.level} {it.id}: {len(blocks)} code block(s)"
                         + (" (reply cut at the output-token limit)" if comp.cut else ""))
            if not blocks:
                note = prompts.PROSE_FINAL if parsed.prose_final() else prompts.NO_CODE
                if cut_note:
                    note = cut_note if parsed.unclosed_code() else cut_note + " " + note
                more = self.repeats.turn(reply, comp.cut)  # a repeat: rlm.core.degenerate
                note += "\n\n" + more if more else ""
                messages.append({"role": "user", "content": note})
                it.evidence = note
                return None
            feedback, answer = self._run_blocks(it.id, blocks)
            if answer is not None:
                it.evidence = answer
                return answer
            if cut_note:
                feedback.append(cut_note)
            more = self.repeats.turn(reply, comp.cut)
            feedback += [more] if more else []
            messages.append({"role": "user", "content": "\n\n".join(feedback)})
            it.evidence = feedback[-1][:2000]
            return None

    def _run_blocks(self, iteration: str, blocks: list[str]) -> tuple[list[str], str | None]:
        """Run a reply's blocks in order, each a ``cell`` stage, until one sets the answer.

        Returns:
            (the feedback text of each block run, the answer or None).
        """
        run, opts = self.run_tree, self.run_tree.opts
        feedback: list[str] = []
        for j, code in enumerate(blocks):
            if run.fatal is not None:  # a divergence or a cancel: run no further cell
                raise run.fatal
            with run.stage(iteration, Kind.cell, self.level) as cell:
                # the cell's sub-calls work under its scope: its interrupt cancels them
                cell_scope = self.scope.child(cell.id)
                # a session's cut-off question replayed: where it ended (see before_cell)
                cut = (self.held.before_cell(cell.id, cell_scope) if self.held is not None
                       else None)
                self.current_cell, self.cell_scope = cell.id, cell_scope
                try:
                    res = self.run_cell(code, cell_scope)
                except BaseException as exc:
                    cell.evidence = cut_off_evidence(code, exc)
                    raise
                finally:
                    self.current_cell, self.cell_scope = None, None
                    cell_scope.close()
                if cut is not None:
                    cut()
                # a kernel that died is the restart cap's to judge (exit 4), not a repetition
                self.repeats.cell(code, None if res.died else res.error)
                out = prompts.truncate(res.output, opts.max_output_chars)
                cell.evidence = cell_evidence(code, out, res)
                if res.final is not None and self.check is not None:
                    verdict = self.check.check(res.final)  # the FINAL-acceptance gate
                    cell.evidence["check"] = verdict.evidence()
                    res.final = verdict.answer
                    if not verdict.ok:
                        out = (out + "\n" if out else "") + verdict.feedback()
                if isinstance(run.fatal, KeyboardInterrupt) or (
                        self.scope.cancelled and self.scope.reason != "wall"):
                    # the run was cancelled (rlm.aio, Ctrl-C, a parent cell's interrupt) while
                    # this cell ran: it was interrupted, not failed (the wall cap says so itself)
                    cell.finish(Status.cancelled, res.error or "the run was cancelled")
                elif res.error:
                    cell.finish(Status.failed, res.error)
            if run.journal is not None:
                run.journal.record_cell(run.run_id, cell.id, code,
                                         {"output": out, "error": res.error, "final": res.final},
                                         behind=True)
            feedback.append(prompts.cell_feedback(j, len(blocks), out, res.error, res.timed_out,
                                                  res.died, opts.cell_timeout)
                            + interrupt_note(cell_scope))
            if res.final is not None:  # kept if the run stops before it returns (wall cap)
                self.final_set = res.final
            if run.fatal is not None:
                raise run.fatal
            run.check_scope(self.scope)  # the run's wall cap, or the parent cell's interrupt
            if res.final is not None:
                return feedback, res.final
            left = run.deadline_left()
            if res.timed_out and left is not None and left <= 0:
                run.accountant.check_wall()
        return feedback, None

    # the kernel ------------------------------------------------------------------
    def _bind(self, kernel: Kernel) -> None:
        """Register the kernel with the bridge and bind ``context`` and the runtime in it."""
        run = self.run_tree
        if self.reg is None:
            self.reg = run.bridge.register(kernel.pid, self)
        else:
            run.bridge.update_pid(self.reg.token, kernel.pid)
        # a kernel running as another user (root host) reads a private copy of the context
        # (a many-file context: of the files that user may not read)
        path = self.context.share(kernel)
        stamp = self.context.stamp  # the user's own file, read in place: its size then
        code = bind_cell(kernel, run.bridge, self.reg.token, path, self.context.fmt,
                         stamp[0] if stamp else None, checked=self.check is not None,
                         tools=kernel_specs(run.opts.tools, self.level))
        res, _ = kernel.execute(code, timeout=120)
        if res.error and res.error.startswith("ContextChanged:"):
            # named as the user knows it (the kernel may have read a private copy)
            raise ContextError(f"context file {self.context.path} changed since it was "
                               "loaded: the kernel would not see the text the run's journal "
                               "records; run again once nothing writes to it")
        if res.error:
            raise KernelError(f"could not load the context into the kernel: {res.error}")
        if self.held is not None:  # a session's later contexts: context_1, ...
            self.held.bind_added(kernel)

    def _new_kernel(self) -> Kernel:
        k = (self.held.acquire(self.run_tree) if self.held is not None
             else self.run_tree.acquire_kernel(self.level))
        try:
            self._bind(k)
        except BaseException:
            self.run_tree.pool.release(k)
            raise
        return k

    def ensure_kernel(self) -> Kernel:
        """This loop's kernel, waiting for the one started with the first model call.

        Raises:
            KernelError: it could not start or be bound.
        """
        if self.kernel is None:
            if self._kernel_future is not None:
                fut = self._kernel_future
                while not fut.wait(0.1):  # a kernel start never outlives the wall cap
                    self.run_tree.check_scope(self.scope)
                self._kernel_future = None
                self.kernel = fut.result()
            else:
                self.kernel = self._new_kernel()
        return self.kernel

    def run_cell(self, code: str, scope: CancelScope | None = None) -> CellResult:
        """Run one block, bounded by the cell timeout, the wall cap and ``scope``.

        At its timeout (or when ``scope`` is cancelled from above) the cell is interrupted and
        ``scope`` cancelled (the sub-calls it started stop: see :mod:`rlm.core.subcalls`); a cell
        that ignores the interrupt has its kernel killed. A dead kernel is restarted
        (``context`` bound again) and the block reported as ``died``, unless the run or this
        loop is ending; an error raised after ``FINAL`` in the same block keeps the answer.

        Raises:
            KernelError: the kernel died more than ``max_kernel_restarts`` times.
            BudgetExceeded, Cancelled: the wall cap or a parent's interrupt ended the loop.
        """
        run = self.run_tree
        scope = scope or self.scope
        kernel = self.ensure_kernel()
        timeout = run.opts.cell_timeout
        left = run.deadline_left()
        grace = 3.0
        # the cell's own timeout leaves out the time it waits on its sub-calls (they have
        # caps of their own); the wall cap still ends it (its watchdog cancels ``scope``)
        extend = self.wait_clock.waited if timeout else None
        if left is not None:
            if not timeout or left <= timeout:
                grace = 1.0  # the wall cap is what ends this cell: no long wait for it
            timeout = max(0.05, min(timeout, left)) if timeout else max(0.05, left)
        self.wait_clock.reset()
        try:
            res, exprs = kernel.execute(code, timeout=timeout,
                                        user_expressions={FINAL_KEY: FINAL_EXPR}, stop=scope,
                                        grace=grace, extend=extend,
                                        on_interrupt=lambda: scope.cancel("interrupted"))
        except KernelDied as exc:
            scope.cancel("interrupted")
            if self.scope.cancelled or run.deadline_left() == 0.0:
                self.run_tree.pool.release(kernel)
                self.kernel = None
                run.check_scope(self.scope)
                run.accountant.check_wall()
            return self._restart(kernel, exc)
        res.final = parse_final(exprs)
        if res.error and res.final is None:
            try:
                _, ex2 = kernel.execute("", timeout=10, user_expressions={FINAL_KEY: FINAL_EXPR})
                res.final = parse_final(ex2)
            except KernelDied:
                pass
        return res

    def _restart(self, kernel: Kernel, exc: KernelDied) -> CellResult:
        self.restarts += 1
        self.run_tree.pool.release(kernel)
        self.kernel = None
        if self.restarts > self.run_tree.opts.max_kernel_restarts:
            raise KernelError(f"the kernel died {self.restarts} times (last: {exc}); "
                              "giving up on this RLM") from None
        self.run_tree.progress(f"level {self.level}: kernel died ({exc}); restarting it")
        self.kernel = self._new_kernel()
        return CellResult(output=str(exc), error="KernelDied", died=True)

    def close(self) -> None:
        """Give the kernel back (it is shut down, never reused) and drop the context file."""
        if self._closed:
            return
        self._closed = True
        self.scope.cancel("closed")  # whatever this loop's kernel still asks for is refused
        self.scope.close()
        fut, self._kernel_future = self._kernel_future, None
        if self.held is not None:  # a session's root: the kernel goes back to the session
            self._give_back(fut)
            return
        if fut is not None:
            # never wait for a kernel still starting: it is shut down when it is ready
            def drop(task: Task) -> None:
                try:
                    k = task.result()
                except BaseException:
                    return
                if k is not self.kernel:
                    self.run_tree.pool.release(k)
            fut.add_done_callback(drop)
        if self.reg is not None:
            self.run_tree.bridge.unregister(self.reg.token)
        if self.kernel is not None:
            self.run_tree.pool.release(self.kernel)
            self.kernel = None
        self.context.discard()

    def _give_back(self, fut: Task | None) -> None:
        """A session's root at its close: its kernel (waiting for one still starting) and
        registration go back to the session, not shut down."""
        if self.kernel is None and fut is not None and fut.wait(60):
            try:
                self.kernel = fut.result()
            except BaseException:
                pass
        self.held.keep(self)
        self.kernel = self.reg = None


def cell_evidence(code: str, output: str, res: CellResult) -> dict:
    """A cell stage's evidence: its ``code``, its ``output`` (as the model was shown it) and
    how ``res`` ended (``final``, ``timed_out``, ``interrupted``, ``died``)."""
    return {"code": code, "output": output, "final": res.final, "timed_out": res.timed_out,
            "interrupted": res.interrupted, "died": res.died}


def cut_off_evidence(code: str, exc: BaseException) -> dict:
    """The evidence of a cell that did not return: its run was cancelled (a parent cell's
    interrupt, Ctrl-C), the wall cap ended it, or its kernel died and could not be restarted.

    Without it such a cell stage would say nothing of what it ran or why it stopped; a kernel
    killed after an interrupt it did not answer in time ends this way too (``kernels.kernel``).

    Returns:
        :func:`cell_evidence` with no output and no ``final``, and ``error``.
    """
    ended = CellResult(interrupted=isinstance(exc, (Cancelled, KeyboardInterrupt)),
                       died=isinstance(exc, KernelError))
    return dict(cell_evidence(code, "", ended), error=f"{type(exc).__name__}: {exc}")


def opening(context: Any, query: str | None, opts: Any, level: int = 0) -> tuple[str, str]:
    """``(system prompt, first user message)`` a loop opens with, before an answer check's
    instructions: what the model reads first, for ``context`` (what
    :func:`rlm.context.load.describe` takes) under the run's options (``opts``: an
    :class:`~rlm.config.options.Options`). ``rlm eval`` hashes the same text into a trial's
    identity. ``level``: the loop's (0 = root), which decides the tools it lists."""
    system = prompts.system_prompt(describe(context), can_recurse=opts.budget.subcalls_allowed,
                                   tools=prompt_tools(getattr(opts, "tools", ()), level),
                                   sub_chars=opts.sub_prompt_chars,
                                   max_output=opts.max_output_chars,
                                   template=opts.system_template, profile=opts.prompt)
    return system, prompts.first_user(query, opts.prompt)
