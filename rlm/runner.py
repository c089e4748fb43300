"""The host side of one run: the iteration loop, sub-calls, children, stages, budget, journal.

One :class:`Run` per run tree. It owns the model clients (and credentials),
the :class:`~harness.budget.Accountant`, the :class:`~harness.stages.StageTree`,
the journal, the kernel pool and the bridge. Each RLM instance (the root and
every child) is an :class:`Instance` with its own kernel and loop.

Every model call goes through :meth:`Run.model_call`, which creates the stage,
serves the call from the journal when resuming/replaying, otherwise reserves
budget, sends it, settles and records it. Nothing else talks to a model.

Every blocking step (a model call, a cell, waiting on children) is bounded by
the wall-clock cap, so a run ends within about a second of ``max_wall_seconds``.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from harness.budget import Accountant, Budget
from harness.errors import BudgetExceeded
from harness.journal import request_hash
from harness.prices import PriceTable
from harness.stages import Kind, Status, StageTree
from kernels.bridge import BridgeError, BridgeServer, Registration
from kernels.kernel import FINAL_EXPR, CellResult, Kernel, KernelDied, KernelPool, parse_final

from . import prompts
from .clients import Completion, ModelClient
from .options import Options
from .context import LoadedContext, describe, load_context
from .errors import ChildRLMError, DivergenceError, EndpointError, KernelError, RLMError
from .parsing import code_blocks, prose_final
from .tokens import count_messages

log = logging.getLogger("rlm")


@dataclass
class Outcome:
    """How one instance (root or child) ended."""

    answer: str | None
    status: str
    iterations: int
    reason: str = ""


class _Replay:
    """Serves recorded model calls from a journal, by call id and request hash."""

    def __init__(self, journal, run_id: str, strict: bool, policy: str) -> None:
        self.journal, self.run_id, self.strict, self.policy = journal, run_id, strict, policy
        self.served = 0
        self.live_from: str | None = None
        self.divergences: list[dict] = []
        self._lock = threading.Lock()

    def lookup(self, call_id: str, req_hash: str):
        if self.live_from is not None and self.policy == "live":
            return None
        rec = self.journal.lookup_model_call(self.run_id, call_id)
        if rec is None:
            if self.strict:
                raise DivergenceError(f"replay: call {call_id} is not in the journal of run "
                                      f"{self.run_id}; the run took a different path")
            return None
        # the stored request itself is re-hashed, so an edited journal is caught too
        stored = rec.get("request")
        stored_hash = request_hash(stored) if isinstance(stored, dict) else rec["request_hash"]
        if rec["request_hash"] != req_hash or stored_hash != req_hash:
            d = {"call_id": call_id, "recorded_hash": stored_hash, "new_hash": req_hash}
            with self._lock:
                self.divergences.append(d)
            if self.policy == "live" and not self.strict:
                with self._lock:
                    self.live_from = self.live_from or call_id
                return None
            raise DivergenceError(
                f"divergence at call {call_id}: the request differs from the one recorded in run "
                f"{self.run_id} (a non-deterministic cell, or a changed prompt or model). "
                "Nothing was served from the journal for it. Resume with --on-divergence live "
                "to continue live from this point.")
        with self._lock:
            self.served += 1
        return rec


class Run:
    """One run tree: root instance, children, stages, budget, journal, kernels.

    Args:
        options: the :class:`Options`.
        run_id: the run's id (a new uuid4 hex if None).
        replay: a ``_Replay`` to serve recorded calls (resume/replay), or None.
    """

    def __init__(self, options: Options, run_id: str | None = None, replay: _Replay | None = None,
                 client: ModelClient | None = None) -> None:
        self.opts = options
        # before any kernel starts: no kernel may read the key from this process's /proc files
        from .secrets import hide_startup_secrets
        hide_startup_secrets()
        self.run_id = run_id or uuid.uuid4().hex[:16]
        self.replay = replay
        listeners = [options.journal.record_event] if options.journal is not None else []
        self.tree = StageTree(self.run_id, listeners)
        self.accountant = Accountant(options.budget, options.prices or PriceTable())
        self.client = client or (ModelClient(options.base_url, options.api_key,
                                             max_attempts=options.max_attempts)
                                 if options.base_url else None)
        pool_size = options.pool_size
        if pool_size is None:
            pool_size = 0 if options.max_depth <= 1 else 2
        self.pool = KernelPool(pool_size)
        self.bridge = BridgeServer(self._handle)
        self._executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="rlm-sub")
        self._need_count = (options.budget.max_tokens is not None
                            or options.budget.max_cost_usd is not None)
        self.cancelled = threading.Event()
        self.fatal: RLMError | None = None  # a divergence anywhere in the tree ends the run
        self.kernels_started = 0
        self._klock = threading.Lock()
        self.instances: list[Instance] = []
        self.sent_calls = 0

    # progress -------------------------------------------------------------
    def progress(self, msg: str) -> None:
        if not self.opts.on_progress:
            log.info(msg)
        if self.opts.on_progress:
            try:
                self.opts.on_progress(msg)
            except Exception:
                pass

    # stage helpers -----------------------------------------------------------
    def start_stage(self, parent: str | None, kind: Kind, level: int, model: str | None = None,
                    meta: dict | None = None):
        st = self.tree.new_stage(parent, kind, level, model=model, meta=meta)
        self.tree.transition(st.id, Status.pending, Status.running)
        return st

    def end_stage(self, stage_id: str, status: Status, **fields) -> None:
        try:
            self.tree.transition(stage_id, Status.running, status, **fields)
        except Exception:
            # already ended (e.g. cancelled by the wall cap): terminal states are absorbing
            pass

    def deadline_left(self) -> float | None:
        return self.accountant.wall_remaining()

    # model calls ------------------------------------------------------------
    def model_call(self, parent: str, kind: Kind, level: int, messages: list[dict], model: str,
                   max_tokens: int) -> Completion:
        """One model call as a stage: journal first (resume/replay), else budget, send, settle.

        Raises:
            BudgetExceeded: refused before sending (stage ``budget_exceeded``).
            EndpointError: the endpoint failed (stage ``failed``).
            DivergenceError: the journal holds a different request under this call id.
        """
        st = self.tree.new_stage(parent, kind, level, model=model)
        request = {"model": model, "messages": messages, "max_tokens": max_tokens,
                   "temperature": self.opts.temperature}
        rh = request_hash(request)
        if self.fatal is not None:
            self.tree.transition(st.id, Status.pending, Status.cancelled, error=str(self.fatal))
            raise self.fatal
        if self.replay is not None:
            try:
                rec = self.replay.lookup(st.id, rh)
            except DivergenceError as exc:
                self.tree.transition(st.id, Status.pending, Status.failed, error=str(exc))
                # a divergence ends the whole run: it is not an error the model's code may catch
                with self._klock:
                    if self.fatal is None:
                        self.fatal = exc
                raise
            if rec is not None:
                resp = rec["response"]
                self.tree.transition(st.id, Status.pending, Status.running)
                self.tree.transition(st.id, Status.running, Status.completed,
                                     evidence=resp.get("text", ""),
                                     meta={"replayed": True})
                return Completion(text=resp.get("text", ""), model=resp.get("model", model))
        try:
            self.accountant.check_wall()
            pt = count_messages(messages) if self._need_count else 0
            resv = self.accountant.reserve(model, pt, max_tokens, stage_id=st.id)
        except BudgetExceeded as exc:
            self.tree.transition(st.id, Status.pending, Status.budget_exceeded, error=str(exc))
            raise
        self.tree.transition(st.id, Status.pending, Status.running)
        if self.client is None:
            self.accountant.release(resv)
            self.end_stage(st.id, Status.failed, error="no model endpoint configured")
            raise EndpointError("no model endpoint configured")
        try:
            with self.accountant.concurrency:
                if self.cancelled.is_set():
                    raise BudgetExceeded("wall", self.opts.budget.max_wall_seconds or 0,
                                         self.accountant.elapsed())
                self.sent_calls += 1
                comp = self.client.complete(messages, model, max_tokens=max_tokens,
                                            temperature=self.opts.temperature,
                                            deadline=self._deadline(),
                                            call_id=f"{self.run_id}/{st.id}")
        except BudgetExceeded as exc:
            self.accountant.release(resv)
            self.end_stage(st.id, Status.budget_exceeded, error=str(exc))
            raise
        except Exception as exc:
            self.accountant.release(resv)
            if self.cancelled.is_set() or self.accountant.wall_remaining() == 0.0:
                err = BudgetExceeded("wall", self.opts.budget.max_wall_seconds or 0,
                                     self.accountant.elapsed())
                self.end_stage(st.id, Status.budget_exceeded, error=str(err))
                raise err from None
            self.end_stage(st.id, Status.failed, error=str(exc))
            raise
        cost = self.accountant.settle(resv, comp.prompt_tokens, comp.completion_tokens,
                                      comp.cost_usd)
        self.tree.add_usage(st.id, comp.prompt_tokens, comp.completion_tokens, cost, calls=1)
        self.end_stage(st.id, Status.completed, evidence=comp.text,
                       meta={"attempts": comp.attempts})
        if self.opts.journal is not None:
            self.opts.journal.record_model_call(
                self.run_id, st.id, request_hash=rh, request=request,
                response=comp.to_dict(), usage={"prompt_tokens": comp.prompt_tokens,
                                                "completion_tokens": comp.completion_tokens,
                                                "cost_usd": cost},
                attempts=comp.attempts, replace=self.replay is not None)
        return comp

    def _deadline(self) -> float | None:
        left = self.deadline_left()
        return None if left is None else time.monotonic() + left + 0.05

    # kernels ------------------------------------------------------------------
    def acquire_kernel(self) -> Kernel:
        k = self.pool.acquire()
        with self._klock:
            self.kernels_started += 1
        return k

    # the bridge handler -----------------------------------------------------
    def _handle(self, reg: Registration, op: str, args: dict) -> Any:
        inst: Instance = reg.owner
        return inst.handle(op, args)

    def close(self) -> None:
        """Shut every kernel of the run down and stop the bridge. Idempotent."""
        self.cancelled.set()
        for inst in list(self.instances):
            inst.close()
        self.pool.close()
        self.bridge.close()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _to_bridge_error(exc: BaseException) -> BridgeError:
    if isinstance(exc, BridgeError):
        return exc
    if isinstance(exc, BudgetExceeded):
        return BridgeError("BudgetExceeded", str(exc), cap=exc.cap, limit=exc.limit,
                           used=exc.used, requested=exc.requested, remaining=exc.remaining)
    if isinstance(exc, ChildRLMError):
        return BridgeError("ChildRLMError", str(exc), status=exc.status, reason=exc.reason)
    return BridgeError("SubcallError", f"{type(exc).__name__}: {exc}")


class Instance:
    """One RLM loop (root at level 0, or a child) with its own kernel.

    Args:
        run: the :class:`Run` it belongs to.
        stage_id: the stage this instance's iterations hang under.
        level: its depth level (root = 0).
        context: the loaded context; ``query``: the question or None.
        model: the model that drives this loop.
    """

    def __init__(self, run: Run, stage_id: str, level: int, context: LoadedContext,
                 query: str | None, model: str) -> None:
        self.run, self.stage_id, self.level = run, stage_id, level
        self.context, self.query, self.model = context, query, model
        self.kernel: Kernel | None = None
        self.reg: Registration | None = None
        self.current_cell: str | None = None
        self.restarts = 0
        self.iterations = 0
        self.last_reply: str | None = None
        self._kernel_future = None
        self._closed = False
        run.instances.append(self)

    def partial_answer(self) -> str | None:
        """The best partial answer after a budget stop: the model's last reply, if any."""
        return self.last_reply

    # kernel ---------------------------------------------------------------
    def _bind(self, kernel: Kernel) -> None:
        run = self.run
        if self.reg is None:
            self.reg = run.bridge.register(kernel.pid, self, level=self.level)
        else:
            run.bridge.update_pid(self.reg.token, kernel.pid)
        code = (f"__rlm_rt.bind({run.bridge.path!r}, {self.reg.token!r}, "
                f"{self.context.path!r}, {self.context.fmt!r})")
        res, _ = kernel.execute(code, timeout=120)
        if res.error:
            raise KernelError(f"could not load the context into the kernel: {res.error}")

    def start_kernel_async(self) -> None:
        """Start acquiring and binding the kernel while the first model call is in flight."""
        self._kernel_future = self.run._executor.submit(self._new_kernel)

    def _new_kernel(self) -> Kernel:
        k = self.run.acquire_kernel()
        try:
            self._bind(k)
        except BaseException:
            self.run.pool.release(k)
            raise
        return k

    def ensure_kernel(self) -> Kernel:
        if self.kernel is None:
            if self._kernel_future is not None:
                fut, self._kernel_future = self._kernel_future, None
                self.kernel = fut.result()
            else:
                self.kernel = self._new_kernel()
        return self.kernel

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._kernel_future is not None:
            try:
                self.kernel = self.kernel or self._kernel_future.result(timeout=30)
            except Exception:
                pass
        if self.reg is not None:
            self.run.bridge.unregister(self.reg.token)
        if self.kernel is not None:
            self.run.pool.release(self.kernel)
            self.kernel = None
        self.context.discard()

    # cells ------------------------------------------------------------------
    def execute(self, code: str) -> CellResult:
        """Run one block; on a dead kernel restart it (context bound again) and say so."""
        kernel = self.ensure_kernel()
        timeout = self.run.opts.cell_timeout
        left = self.run.deadline_left()
        if left is not None:
            timeout = max(0.05, min(timeout, left)) if timeout else max(0.05, left)
        try:
            res, exprs = kernel.execute(code, timeout=timeout, user_expressions={"final": FINAL_EXPR})
        except KernelDied as exc:
            self.restarts += 1
            self.run.pool.release(kernel)
            self.kernel = None
            if self.restarts > self.run.opts.max_kernel_restarts:
                raise KernelError(f"the kernel died {self.restarts} times (last: {exc}); "
                                  "giving up on this RLM") from None
            self.run.progress(f"level {self.level}: kernel died ({exc}); restarting it")
            self.kernel = self._new_kernel()
            return CellResult(output=str(exc), error="KernelDied", died=True)
        res.final = parse_final(exprs)
        if res.error and res.final is None:
            # an error after FINAL in the same cell: the answer still stands
            try:
                _, ex2 = kernel.execute("", timeout=10, user_expressions={"final": FINAL_EXPR})
                res.final = parse_final(ex2)
            except KernelDied:
                pass
        return res

    # bridge requests --------------------------------------------------------
    def handle(self, op: str, args: dict) -> Any:
        run = self.run
        parent = self.current_cell or self.stage_id
        if op in ("llm_query", "rlm", "llm_query_batched", "rlm_batched"):
            if run.opts.max_depth <= 0:
                raise BridgeError("DepthError", f"{op} is disabled: this run has max_depth=0 "
                                  "(no sub-calls); answer with Python alone")
        model = args.get("model")
        if model is not None and model not in self._allowed_models():
            raise BridgeError("SubcallError", f"model {model!r} is not allowed in this run; "
                              f"allowed: {sorted(self._allowed_models())}")
        try:
            if op == "llm_query":
                return self._llm_query(parent, str(args.get("prompt", "")), model)
            if op == "rlm":
                return self._rlm(parent, args.get("prompt"), args.get("query"), model)
            if op in ("llm_query_batched", "rlm_batched"):
                prompts_ = list(args.get("prompts") or [])
                if run.opts.budget.max_children_per_call is not None and \
                        len(prompts_) > run.opts.budget.max_children_per_call:
                    raise BudgetExceeded("children", run.opts.budget.max_children_per_call,
                                         0, len(prompts_))
                if op == "llm_query_batched":
                    # ordinals are assigned here, in input order, before anything runs
                    stages = [self._sub_stage(parent, Kind.llm_query, model) for _ in prompts_]
                    fns = [lambda p=p, s=s: self._llm_query(parent, str(p), model, s)
                           for p, s in zip(prompts_, stages)]
                else:
                    plans = [self._plan_rlm(parent, model) for _ in prompts_]
                    fns = [lambda p=p, pl=pl: self._rlm(parent, p, args.get("query"), model, pl)
                           for p, pl in zip(prompts_, plans)]
                return self._gather(fns)
        except (BudgetExceeded, ChildRLMError, RLMError, DivergenceError) as exc:
            raise _to_bridge_error(exc) from None
        raise BridgeError("SubcallError", f"unknown operation {op!r}")

    def _allowed_models(self) -> set:
        o = self.run.opts
        return {m for m in (o.model, o.sub_model, o.child_model) if m}

    def _gather(self, fns: list) -> list:
        futs = [self.run._executor.submit(f) for f in fns]
        out = []
        for f in futs:
            try:
                out.append({"value": f.result()})
            except BaseException as exc:  # noqa: BLE001 - every item's fate is reported
                out.append({"error": _to_bridge_error(exc).to_wire()})
        return out

    def _sub_stage(self, parent: str, kind: Kind, model: str | None):
        return self.run.tree.new_stage(parent, kind, self.level + 1,
                                       model=model or self.run.opts.sub_model or self.run.opts.model)

    def _llm_query(self, parent: str, prompt: str, model: str | None, stage=None) -> str:
        m = model or self.run.opts.sub_model or self.run.opts.model
        st = stage or self._sub_stage(parent, Kind.llm_query, m)
        return self._plain_completion(st, prompt, m)

    def _plain_completion(self, st, prompt: str, model: str) -> str:
        """One plain completion under the (pending) stage ``st``: llm_query or a fallback."""
        run = self.run
        run.tree.transition(st.id, Status.pending, Status.running)
        try:
            comp = run.model_call(st.id, Kind.model_call, st.level,
                                  [{"role": "user", "content": prompt}], model,
                                  run.opts.sub_max_tokens)
        except BudgetExceeded as exc:
            run.end_stage(st.id, Status.budget_exceeded, error=str(exc))
            raise
        except BaseException as exc:
            run.end_stage(st.id, Status.failed, error=str(exc))
            raise
        run.end_stage(st.id, Status.completed, evidence=comp.text)
        return comp.text

    def _plan_rlm(self, parent: str, model: str | None):
        run = self.run
        child_level = self.level + 1
        if child_level < run.opts.max_depth:
            return self.run.tree.new_stage(parent, Kind.child, child_level,
                                           model=model or run.opts.child_model or run.opts.model)
        return self.run.tree.new_stage(parent, Kind.fallback, child_level,
                                       model=model or run.opts.sub_model or run.opts.model)

    def _rlm(self, parent: str, prompt: Any, query: str | None, model: str | None, stage=None) -> str:
        run = self.run
        st = stage or self._plan_rlm(parent, model)
        if st.kind == Kind.fallback:
            text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
            return self._plain_completion(st, prompts.subcall_prompt(text, query), st.model)
        run.tree.transition(st.id, Status.pending, Status.running)
        # a real child with a kernel of its own
        try:
            ctx = load_context(prompt)
        except RLMError as exc:
            run.end_stage(st.id, Status.failed, error=str(exc))
            raise ChildRLMError(f"child RLM not started: {exc}", "failed", str(exc)) from None
        child = Instance(run, st.id, st.level, ctx, query, st.model)
        run.progress(f"level {st.level}: child {st.id} started")
        try:
            out = child.loop()
        except BudgetExceeded as exc:
            run.end_stage(st.id, Status.budget_exceeded, error=str(exc))
            raise ChildRLMError(f"child RLM {st.id} stopped: {exc}", "budget_exceeded",
                                str(exc)) from None
        except BaseException as exc:
            run.end_stage(st.id, Status.failed, error=str(exc))
            raise ChildRLMError(f"child RLM {st.id} failed: {type(exc).__name__}: {exc}",
                                "failed", str(exc)) from None
        finally:
            child.close()
        if out.status != "completed" or out.answer is None:
            run.end_stage(st.id, Status.failed, error=out.reason)
            raise ChildRLMError(f"child RLM {st.id} ended without an answer ({out.reason})",
                                out.status, out.reason)
        run.end_stage(st.id, Status.completed, evidence=out.answer)
        return out.answer

    # the loop ------------------------------------------------------------------
    def loop(self) -> Outcome:
        """Drive this instance until executed code calls FINAL, or iterations run out.

        Raises:
            BudgetExceeded: a cap refused one of this loop's own model calls.
            EndpointError, KernelError, DivergenceError: unrecoverable failures.
        """
        run, opts = self.run, self.run.opts
        meta = describe(self.context)
        system = prompts.system_prompt(meta, can_recurse=opts.max_depth >= 1,
                                       sub_chars=opts.sub_prompt_chars,
                                       max_output=opts.max_output_chars,
                                       template=opts.system_template)
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": prompts.first_user(self.query)}]
        self.start_kernel_async()
        max_it = max(1, opts.max_iterations)
        for i in range(max_it + 1):
            last = i == max_it
            if last:
                messages.append({"role": "user", "content": prompts.LAST_TURN})
            it = run.start_stage(self.stage_id, Kind.iteration, self.level, model=self.model)
            self.iterations += 1
            try:
                comp = run.model_call(it.id, Kind.model_call, self.level, messages, self.model,
                                      opts.max_completion_tokens)
            except BudgetExceeded as exc:
                run.end_stage(it.id, Status.budget_exceeded, error=str(exc))
                raise
            except BaseException as exc:
                run.end_stage(it.id, Status.failed, error=str(exc))
                raise
            reply = comp.text
            self.last_reply = reply
            messages.append({"role": "assistant", "content": reply})
            blocks = code_blocks(reply)
            run.progress(f"level {self.level} iteration {i + 1}: {len(blocks)} code block(s)")
            if not blocks:
                note = prompts.PROSE_FINAL if prose_final(reply) else prompts.NO_CODE
                messages.append({"role": "user", "content": note})
                run.end_stage(it.id, Status.completed, evidence=note)
                continue
            feedback, answer = [], None
            for j, code in enumerate(blocks):
                cell = run.start_stage(it.id, Kind.cell, self.level)
                self.current_cell = cell.id
                try:
                    res = self.execute(code)
                except BaseException as exc:
                    run.end_stage(cell.id, Status.failed, error=str(exc))
                    run.end_stage(it.id, Status.failed, error=str(exc))
                    raise
                finally:
                    self.current_cell = None
                out = prompts.truncate(res.output, opts.max_output_chars)
                run.end_stage(cell.id, Status.completed if not res.error else Status.failed,
                              evidence={"code": code, "output": out, "final": res.final,
                                        "timed_out": res.timed_out, "died": res.died},
                              error=res.error)
                if opts.journal is not None:
                    opts.journal.record_cell(run.run_id, cell.id, code,
                                             {"output": out, "error": res.error,
                                              "final": res.final})
                feedback.append(prompts.cell_feedback(j, len(blocks), out, res.error,
                                                      res.timed_out, res.died, opts.cell_timeout))
                if run.fatal is not None:
                    run.end_stage(it.id, Status.failed, error=str(run.fatal))
                    raise run.fatal
                if res.final is not None:
                    answer = res.final
                    break
                if res.timed_out and run.accountant.wall_remaining() is not None \
                        and run.accountant.wall_remaining() <= 0:
                    run.accountant.check_wall()
            if answer is not None:
                run.end_stage(it.id, Status.completed, evidence=answer)
                return Outcome(answer, "completed", self.iterations)
            messages.append({"role": "user", "content": "\n\n".join(feedback)})
            run.end_stage(it.id, Status.completed, evidence=feedback[-1][:2000])
        return Outcome(None, "failed", self.iterations,
                       f"no FINAL after {max_it} iterations and a last turn")
