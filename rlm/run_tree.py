"""One run tree on the host: model calls, kernels, the bridge, the budget and the journal.

A :class:`RunTree` is made per run. It owns the model client (and so the credentials), the
:class:`~harness.budget.Accountant`, the :class:`~harness.stages.StageTree` (whose first
listener is the journal), the kernel pool and the bridge server. Each RLM loop (the root and
every child, :class:`rlm.loop.RLMLoop`) borrows a kernel from it and sends every model call
through :meth:`RunTree.model_call`: nothing else talks to a model.

:func:`drive` runs a whole tree: it records the run in the journal, keeps its heartbeat, runs
the root loop inside the ``run`` stage, and always shuts every kernel down.

Every blocking step (a model call, a cell, waiting on children) is bounded by the wall-clock
cap, so a run ends within about a second of ``max_wall_seconds``.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from harness.budget import Accountant
from harness.errors import BudgetExceeded, DivergenceError, HarnessError
from harness.journal import request_hash
from harness.prices import PriceTable
from harness.replay import Replay
from harness.stages import Kind, StageScope, StageTree, Status, cancel_open
from kernels.bridge import BridgeServer, Registration
from kernels.kernel import Kernel, KernelPool

from .clients import Completion, ModelClient
from .context import LoadedContext
from .errors import ConfigError, EndpointError, RLMError
from .options import Options
from .result import Result, usage_summary
from .tokens import count_messages

log = logging.getLogger("rlm")


class RunTree:
    """The host-side state of one run tree.

    Args:
        options: the run's :class:`~rlm.options.Options`.
        run_id: the run's id (str); a new random 16-hex id when None.
        recorded: a :class:`harness.replay.Replay` serving recorded calls (resume or replay),
            or None for a fresh run.
        client: a model client to use instead of one built from ``options`` (tests, benches).
    """

    def __init__(self, options: Options, run_id: str | None = None,
                 recorded: Replay | None = None, client: ModelClient | None = None) -> None:
        self.opts = options
        # before any kernel starts: no kernel may read the key from this process's /proc files
        from kernels.secrets import hide_startup_secrets
        hide_startup_secrets()
        self.run_id = run_id or uuid.uuid4().hex[:16]
        self.recorded = recorded
        listeners = [options.journal.record_event] if options.journal is not None else []
        self.tree = StageTree(self.run_id, listeners)
        self.accountant = Accountant(options.budget, options.prices or PriceTable())
        self.client = client or (ModelClient(options.base_url, options.api_key,
                                             max_attempts=options.max_attempts)
                                 if options.base_url else None)
        pool_size = options.pool_size
        if pool_size is None:
            pool_size = 0 if options.budget.max_depth <= 1 else 2
        self.pool = KernelPool(pool_size)
        self.bridge = BridgeServer(self._handle)
        self.executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="rlm-sub")
        self._need_count = (options.budget.max_tokens is not None
                            or options.budget.max_cost_usd is not None)
        self.cancelled = threading.Event()
        self.fatal: HarnessError | RLMError | None = None  # a divergence ends the whole run
        self.kernels_started = 0
        self._lock = threading.Lock()
        self.loops: list[Any] = []

    # progress and stages --------------------------------------------------------
    def progress(self, msg: str) -> None:
        """Report ``msg`` to the ``on_progress`` callback (errors in it are ignored), else log."""
        if not self.opts.on_progress:
            log.info(msg)
            return
        try:
            self.opts.on_progress(msg)
        except Exception:
            pass

    def stage(self, parent: str | None = None, kind: Kind | None = None, level: int = 0,
              **kwargs: Any) -> StageScope:
        """A stage of this run as a ``with`` block; see :meth:`harness.stages.StageTree.stage`."""
        return self.tree.stage(parent, kind, level, **kwargs)

    def deadline_left(self) -> float | None:
        """Seconds left before the wall-clock cap (None without one; 0.0 when past it)."""
        return self.accountant.wall_remaining()

    # model calls ------------------------------------------------------------------
    def model_call(self, parent: str, level: int, messages: list[dict], model: str,
                   max_tokens: int) -> Completion:
        """One model call as a ``model_call`` stage under ``parent``.

        Served from the journal when resuming/replaying and the journal holds it; else
        admitted by the accountant (a reservation of the prompt's tokens, counted with
        tiktoken, plus ``max_tokens``), sent, settled with the reported usage and journaled.

        Args:
            messages: chat messages (``[{"role", "content"}]``); ``max_tokens``: output cap.
        Returns:
            the :class:`~rlm.clients.Completion`.
        Raises:
            BudgetExceeded: refused before sending (stage ``budget_exceeded``), or the wall
                cap ended the call.
            EndpointError: the endpoint failed after retries (stage ``failed``).
            DivergenceError: the journal holds a different request under this call id (it
                then ends the whole run: every later call raises it too).
        """
        if self.fatal is not None:
            raise self.fatal
        request = {"model": model, "messages": messages, "max_tokens": max_tokens,
                   "temperature": self.opts.temperature}
        rh = request_hash(request)
        with self.tree.stage(parent, Kind.model_call, level, model=model, start=False) as st:
            if self.recorded is not None:
                rec = self._lookup(st.id, rh)
                if rec is not None:
                    st.start()
                    resp = rec["response"]
                    st.evidence, st.meta = resp.get("text", ""), {"replayed": True}
                    return Completion(text=resp.get("text", ""), model=resp.get("model", model))
            self.accountant.check_wall()
            pt = count_messages(messages) if self._need_count else 0
            resv = self.accountant.reserve(model, pt, max_tokens, stage_id=st.id)
            st.start()
            try:
                comp = self._send(messages, model, max_tokens, st.id)
            except BaseException:
                self.accountant.release(resv)
                raise
            cost = self.accountant.settle(resv, comp.prompt_tokens, comp.completion_tokens,
                                          comp.cost_usd)
            st.add_usage(comp.prompt_tokens, comp.completion_tokens, cost)
            st.evidence, st.meta = comp.text, {"attempts": comp.attempts}
        if self.opts.journal is not None:
            self.opts.journal.record_model_call(
                self.run_id, st.id, request_hash=rh, request=request, response=comp.to_dict(),
                usage={"prompt_tokens": comp.prompt_tokens,
                       "completion_tokens": comp.completion_tokens, "cost_usd": cost},
                attempts=comp.attempts, replace=self.recorded is not None)
        return comp

    def _lookup(self, call_id: str, rh: str) -> dict | None:
        try:
            return self.recorded.lookup(call_id, rh)
        except DivergenceError as exc:
            # a divergence ends the whole run: it is not an error the model's code may catch
            with self._lock:
                if self.fatal is None:
                    self.fatal = exc
            raise

    def _send(self, messages: list[dict], model: str, max_tokens: int, call_id: str) -> Completion:
        if self.client is None:
            raise EndpointError("no model endpoint configured")
        try:
            with self.accountant.concurrency:
                if self.cancelled.is_set():
                    raise self._wall_error()
                left = self.deadline_left()
                return self.client.complete(
                    messages, model, max_tokens=max_tokens, temperature=self.opts.temperature,
                    deadline=None if left is None else time.monotonic() + left + 0.05,
                    call_id=f"{self.run_id}/{call_id}")
        except BudgetExceeded:
            raise
        except Exception:
            if self.cancelled.is_set() or self.accountant.wall_remaining() == 0.0:
                raise self._wall_error() from None
            raise

    def _wall_error(self) -> BudgetExceeded:
        return BudgetExceeded("wall", self.opts.budget.max_wall_seconds or 0,
                              self.accountant.elapsed())

    # kernels and the bridge ---------------------------------------------------------
    def acquire_kernel(self) -> Kernel:
        """A started kernel from the pool (counted in ``kernels_started``).

        Raises:
            KernelError: no kernel could be started.
        """
        k = self.pool.acquire()
        with self._lock:
            self.kernels_started += 1
        return k

    def _handle(self, reg: Registration, op: str, args: dict) -> Any:
        # the bridge's handler: the registration (never the kernel's word) names the loop
        return reg.owner.subcalls.handle(op, args)

    def close(self) -> None:
        """Shut every kernel of the run down and stop the bridge. Idempotent."""
        self.cancelled.set()
        for loop in list(self.loops):
            loop.close()
        self.pool.close()
        self.bridge.close()
        self.executor.shutdown(wait=False, cancel_futures=True)


def drive(opts: Options, ctx: LoadedContext, query: str | None, *, run_id: str | None = None,
          recorded: Replay | None = None, client: ModelClient | None = None,
          record: bool = True) -> Result:
    """Drive one run tree to its end and return the :class:`~rlm.result.Result`.

    The journal (``opts.journal``, unless ``record=False``) gets the run record (unless
    resuming: it exists), a heartbeat while it runs, every stage event, model call and cell,
    and the final status. Kernels are always shut down.

    Raises:
        ConfigError: a cost cap without a price for one of the run's models (before anything
            is journaled or started).
        RLMError, DivergenceError: an unrecoverable failure (endpoint, kernel, divergence);
            the partial :class:`Result` is attached as ``exc.result``.
        KeyboardInterrupt: interrupted; the run is journaled as ``cancelled``.
    """
    from .loop import RLMLoop
    t0 = time.monotonic()
    run = RunTree(opts, run_id=run_id, recorded=recorded, client=client)
    if opts.budget.max_cost_usd is not None:
        try:
            run.accountant.check_prices({m for m in (opts.model, opts.sub_model,
                                                     opts.child_model) if m})
        except Exception as exc:
            run.close()
            raise ConfigError(str(exc)) from None
    journal = opts.journal if record else None
    heartbeat = None
    if journal is not None:
        if recorded is None:
            from .run_config import stored_options
            journal.create_run(run.run_id, query=query or "", model=opts.model,
                               sub_model=opts.sub_model, max_depth=opts.budget.max_depth,
                               options=stored_options(opts, ctx))
        heartbeat = journal.start_heartbeat(run.run_id)
    status, answer, reason, cap, raised = "failed", None, "", None, None
    root = None
    try:
        with run.stage(None, Kind.run, 0, model=opts.model, meta={"query": query}) as scope:
            root = RLMLoop(run, scope.id, 0, ctx, query, opts.model)
            out = root.run()
            answer, status, reason = out.answer, out.status, out.reason
            scope.evidence = answer
            if status != "completed":
                scope.finish(Status.failed, reason or None)
    except BudgetExceeded as exc:
        status, reason, cap = "budget_exceeded", str(exc), exc.cap
        answer = root.partial_answer() if root is not None else None
    except KeyboardInterrupt:
        status, reason, raised = "cancelled", "interrupted", KeyboardInterrupt()
    except (RLMError, DivergenceError) as exc:
        status, reason, raised = "failed", str(exc), exc
    finally:
        run.close()
        cancel_open(run.tree, "cancelled" if status in ("cancelled", "budget_exceeded")
                    or raised is not None else "failed")
    res = Result(answer=answer, status=status, run_id=run.run_id,
                 iterations=root.iterations if root else 0, usage=usage_summary(run.tree),
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
        if not isinstance(raised, KeyboardInterrupt):
            raised.result = res  # type: ignore[attr-defined]
        raise raised
    return res
