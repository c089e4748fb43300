"""One run tree on the host: model calls, kernels, the bridge, the budget and the journal.

A :class:`RunTree` is made per run. It owns the model clients (and so the credentials: the run's
endpoint's, and the sub-call endpoint's when ``sub_base_url`` names one), the
:class:`~harness.budget.accountant.Accountant`, the :class:`~harness.stages.tree.StageTree` (whose first
listener is the journal), the kernel pool and the bridge server. Each RLM loop (the root and
every child, :class:`rlm.core.loop.RLMLoop`) borrows a kernel from it and sends every model call
through :meth:`RunTree.model_call`: nothing else talks to a model.

:func:`rlm.core.drive.drive` runs a whole tree: it records the run in the journal, keeps its heartbeat, runs
the root loop inside the ``run`` stage, and always shuts every kernel down.

Run control (:mod:`harness.control`): the run has a :class:`~harness.control.CancelScope`;
every loop, cell and sub-call works under a scope below it. At ``max_wall_seconds`` a watchdog
cancels the run's scope: a model call stops waiting (its HTTP reads are cut to the deadline, its
retries never sleep past it), a cell is interrupted and, if it will not stop, its kernel killed,
queued sub-calls are dropped; so a run ends within a few seconds of the cap whatever the server or
the cell does. Sub-call items run on the run's :class:`~harness.control.Scheduler`: plain
completions on a bounded pool, children in ``max_concurrency`` slots that a waiting parent gives
back, so no fan-out of any width or depth stalls. All of these threads are daemon threads.

Spend (:mod:`harness.budget.accountant`): reservations are calibrated upper bounds (the worst
reported/estimated ratio seen per model, plus a margin), and every reservation is written to the
journal's spend ledger before its call is sent, so a resumed run starts from what every earlier
attempt spent (:meth:`harness.budget.accountant.Accountant.carry_over`).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, Callable

from harness.budget.accountant import Accountant, Permit
from harness.control import Cancelled, CancelScope, Scheduler, Task
from harness.errors import BudgetExceeded, DivergenceError, HarnessError
from harness.journal import request_hash
from harness.budget.prices import PriceTable
from harness.replay import Replay
from harness.stages.tree import Kind, StageScope, StageTree
from harness.text import clean, clean_text
from kernels.bridge import BridgeServer, Registration
from kernels.bridge_limits import BridgeLimits
from kernels.kernel import Kernel
from kernels.pool import pool_size_for

from rlm.models.base import Completion, ModelClient, make_client
from rlm.models.sub_endpoint import SubcallClient
from rlm.models.transport import endpoint_unusable
from rlm.errors import ConfigError, EndpointError, RLMError
from rlm.config.ahead import sandbox_of
from rlm.config.options import Options
from rlm.core.hooks import RunHooks
from rlm.core.placement import make_pools
from rlm.models.tokens import count_messages

log = logging.getLogger("rlm")


def _isolated(listener):
    """``listener`` (a stage-tree listener given in the options) as the run calls it: an
    exception it raises is logged (a warning the first time, then at DEBUG) and goes no
    further. Raised into the tree, it would roll the stage change back and send the journal,
    which had recorded it, a rollback it cannot write, so the run failed with its events lost;
    a listener only watches the run (a view, an exporter), it cannot veto it."""
    warned = False

    def call(event: dict) -> None:
        nonlocal warned
        try:
            listener(event)
        except Exception as exc:  # noqa: BLE001 - a listener's bug is not the run's
            log.log(logging.DEBUG if warned else logging.WARNING,
                    "stage listener %r raised %s: %s (it keeps receiving events; the run goes "
                    "on)", listener, type(exc).__name__, exc)
            warned = True
    return call


class RunTree:
    """The host-side state of one run tree.

    Args:
        options: the run's :class:`~rlm.config.options.Options` (settings only).
        hooks: the journal it writes, its listeners, progress callback and cancel handle
            (:class:`~rlm.core.hooks.RunHooks`; none by default).
        run_id: the run's id (str); a new random 16-hex id when None.
        recorded: a :class:`harness.replay.Replay` serving recorded calls (resume or replay),
            or None for a fresh run.
        client: a model client to use instead of one built from ``options`` (tests, benches).
        adopt_head: take the kernel started ahead of the run (:func:`kernels.pool.head_start`)
            into the pool, for the root (False for a run with no kernel: a plain completion).
    """

    def __init__(self, options: Options, hooks: RunHooks = RunHooks(), run_id: str | None = None,
                 recorded: Replay | None = None, client: ModelClient | None = None,
                 adopt_head: bool = True) -> None:
        self.opts = options
        # before any kernel starts: no kernel may read the key from this process's /proc files
        from kernels.secrets import hide_startup_secrets
        hide_startup_secrets()
        self.run_id = run_id or uuid.uuid4().hex[:16]
        self.recorded = recorded
        self.journal = hooks.journal
        self.on_progress = hooks.on_progress
        # transitions are written behind (harness.journal.behind): in the journal's next batch,
        # within WRITE_BEHIND_SECONDS, at a read or at the run's finish
        listeners = ([self.journal.record_event_behind] if self.journal is not None
                     else [])
        # live view, OpenTelemetry, a caller's own (after the journal), each kept from the run
        listeners += [_isolated(f) for f in hooks.listeners]
        self.tree = StageTree(self.run_id, listeners)
        self.accountant = Accountant(options.budget, options.prices or PriceTable(),
                                     calibrate=True)
        self.attempt = uuid.uuid4().hex[:12]  # names this attempt's reservations in the ledger
        if recorded is not None and self.journal is not None:
            # caps hold over every attempt of the run: start from what the journal recorded
            self.carried = self.accountant.carry_over(self.journal.spend(self.run_id))
        else:
            self.carried = None
        self._own_client = client is None
        self.client = client or (make_client(options.provider, options.base_url,
                                             options.api_key, max_attempts=options.max_attempts)
                                 if options.base_url else None)
        # sub-calls' own endpoint (sub_base_url), else they share the client above
        self.sub_client = (SubcallClient(options.sub_base_url, options.sub_api_key,
                                         max_attempts=options.max_attempts)
                           if options.sub_base_url else None)
        pool_size = pool_size_for(options.budget.max_depth, options.pool_size)
        # the kernel a caller started ahead of the run (kernels.pool.head_start), if any: the
        # root takes it, so its cold start overlaps the host's set-up
        self.sandbox = sandbox_of(vars(options))
        try:  # the host's bridge caps (RLM_BRIDGE_MAX_FRAME_MB), checked before any kernel
            limits = BridgeLimits.from_env()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.sandbox_modes: set[str] = set()  # how the kernels it took ran
        self.limit_modes: set[str] = set()  # and how the sandboxed ones were bounded
        # the root's and the children's kernels, where --kernels places them
        self.pool = make_pools(options, self.sandbox, pool_size, adopt_head)
        # a session's question: the session's bridge, so the token in its kernel stays valid
        self.session = hooks.session
        self.bridge = hooks.session.bridge if hooks.session else BridgeServer(self._handle, limits)
        # children run in max_concurrency slots; plain items on as many threads
        self.scheduler = Scheduler(slots=options.budget.max_concurrency,
                                   workers=options.budget.max_concurrency)
        self.scope = CancelScope(name="run")
        self._watchdog: threading.Timer | None = None
        left = self.accountant.wall_remaining()
        if left is not None:
            self._watchdog = threading.Timer(left, self.scope.cancel, args=("wall",))
            self._watchdog.daemon = True
            self._watchdog.start()
        self._need_count = (options.budget.max_tokens is not None
                            or options.budget.max_cost_usd is not None)
        self.fatal: HarnessError | RLMError | None = None  # a divergence ends the whole run
        self._probe_cv = threading.Condition()
        self._probing: set[str] = set()  # models whose first call is in flight
        self._lock = threading.Lock()
        self.loops: list[Any] = []

    # progress and stages --------------------------------------------------------
    def progress(self, msg: str) -> None:
        """Report ``msg`` to the ``on_progress`` callback (errors in it are ignored), else log."""
        if not self.on_progress:
            log.info(msg)
            return
        try:
            self.on_progress(msg)
        except Exception:
            pass

    def stage(self, parent: str | None = None, kind: Kind | None = None, level: int = 0,
              **kwargs: Any) -> StageScope:
        """A stage of this run as a ``with`` block; see :meth:`harness.stages.tree.StageTree.stage`."""
        return self.tree.stage(parent, kind, level, **kwargs)

    def deadline_left(self) -> float | None:
        """Seconds left before the wall-clock cap (None without one; 0.0 when past it)."""
        return self.accountant.wall_remaining()

    # model calls ------------------------------------------------------------------
    def model_call(self, parent: str, level: int, messages: list[dict], model: str,
                   max_tokens: int, scope: CancelScope | None = None,
                   sub: bool = False) -> Completion:
        """One model call as a ``model_call`` stage under ``parent``.

        Served from the journal when resuming/replaying and the journal holds it; else
        admitted by the accountant (a calibrated reservation of the prompt's estimated tokens
        plus ``max_tokens``), given a concurrency place, its reservation written to the
        journal's spend ledger, sent, settled with the reported usage and journaled.

        Args:
            messages: chat messages (``[{"role", "content"}]``); ``max_tokens``: output cap.
            scope: the work's cancel scope (default: the run's). Cancelled before the call is
                sent: nothing is sent or charged (stage ``cancelled``); while it is in flight:
                its concurrency place is freed at once and the call is abandoned (it still
                settles if its reply comes before its deadline).
            sub: True for a sub-call (``llm_query``, a depth-limit fallback): sent to the
                sub-call endpoint when the run has one (:attr:`sub_client`), else to the
                run's own. Its request, journal record and charge are the same either way.
        Returns:
            the :class:`~rlm.models.openai_compat.Completion`.
        Raises:
            BudgetExceeded: refused before sending (stage ``budget_exceeded``), or the wall
                cap ended the call.
            Cancelled: ``scope`` was cancelled (not by the wall cap) before the reply.
            EndpointError: the endpoint failed after retries (stage ``failed``). A sub-call
                endpoint that cannot be used at all (unreachable, or refusing its key) also
                ends the whole run, as the run's own endpoint would: it becomes
                :attr:`fatal`, so no further cell runs and the run fails with its message.
            DivergenceError: the journal holds a different request under this call id (it
                then ends the whole run: every later call raises it too).
        """
        if self.fatal is not None:
            raise self.fatal
        messages = clean(messages)  # the text policy (harness.text): lone surrogates -> U+FFFD
        request = {"model": model, "messages": messages, "max_tokens": max_tokens,
                   "temperature": self.opts.temperature}
        # the hash keys the journal and a replay's lookup: not computed when neither is there
        journaled = self.recorded is not None or self.journal is not None
        rh = request_hash(request) if journaled else None
        scope = scope or self.scope
        with self.tree.stage(parent, Kind.model_call, level, model=model, start=False) as st:
            st.meta["call"] = call_facts(request, self.opts.provider)  # read by the spans
            if self.recorded is not None:
                rec = self._lookup(st.id, rh)
                if rec is not None:
                    st.start()
                    comp = Completion.from_record(rec["response"], model)
                    st.evidence = comp.text
                    st.meta.update(comp.meta(), replayed=True, reply=reply_facts(comp))
                    return comp
            resv, probe = self._admit(st, model, messages, max_tokens, scope)
            client = self.sub_client if sub and self.sub_client is not None else self.client
            server = server_facts(getattr(client, "base_url", None))
            if server is not None:
                st.meta["server"] = server
            comp, cost = self._send_admitted(st, resv, probe, messages, model, max_tokens, scope,
                                             client)
            st.usage_on_exit(comp.prompt_tokens, comp.completion_tokens, cost)
            st.evidence = comp.text
            st.meta.update(comp.meta(), reply=reply_facts(comp))
        if self.journal is not None:
            self.journal.record_model_call(
                self.run_id, st.id, request_hash=rh, request=request, response=comp.to_dict(),
                usage={"prompt_tokens": comp.prompt_tokens,
                       "completion_tokens": comp.completion_tokens, "cost_usd": cost,
                       "estimated": comp.usage_estimated},
                attempts=comp.attempts, replace=self.recorded is not None)  # durable: the
            # reply is in the journal before anything acts on it (group-committed with the
            # replies that arrive at the same time: harness.journal.behind)
        return comp

    def _admit(self, st: StageScope, model: str, messages: list[dict], max_tokens: int,
               scope: CancelScope) -> tuple:
        """Admission of one call (its stage still pending): not cancelled, inside the wall cap,
        a calibrated reservation granted. Returns ``(reservation, calibration probe)``.

        Raises:
            BudgetExceeded: refused; the refusal is kept in the stage's meta, so a replay
                refuses the same call the same way. Cancelled: ``scope`` was cancelled.
        """
        pt = prompt_estimate(messages) if self._need_count else 0
        try:
            self.check_scope(scope)  # cancelled (a cell's interrupt): nothing is sent
            self.accountant.check_wall()
            probe = self._calibration_turn(model, scope)
            try:
                return self.accountant.reserve(model, pt, max_tokens, stage_id=st.id), probe
            except BaseException:
                self._probe_done(model, probe)
                raise
        except BudgetExceeded as exc:
            st.meta["refused"] = {"cap": exc.cap, "limit": exc.limit, "used": exc.used,
                                  "requested": exc.requested}
            raise

    def _send_admitted(self, st: StageScope, resv: Any, probe: Any, messages: list[dict],
                       model: str, max_tokens: int, scope: CancelScope,
                       client: ModelClient | None) -> tuple:
        """Send an admitted call: a concurrency place, the reservation durable in the spend
        ledger *before* sending, the call, then settlement. Returns ``(completion, cost USD)``.
        On any failure the reservation is released (and the ledger says so)."""
        ledger = f"{self.attempt}-{resv.id}"
        try:
            permit = self._permit(scope)
            try:
                self._ledger(st.id, ledger, "reserved", resv)  # durable before sending
            except BaseException:
                permit.release()
                raise
        except BaseException:
            self.accountant.release(resv)
            self._probe_done(model, probe)
            raise
        st.start()
        # abandoned (the cell interrupted): free the place now, the call ends on its own
        unhook = scope.on_cancel(permit.release)
        try:
            comp = self._send(client, messages, model, max_tokens, st.id, scope)
        except BaseException:
            self.accountant.release(resv)
            self._probe_done(model, probe)
            self._ledger(st.id, ledger, "released", resv, quiet=True)
            raise
        finally:
            unhook()
            permit.release()
        comp.text, comp.reasoning = clean_text(comp.text), clean_text(comp.reasoning or "")
        try:
            cost = self.accountant.settle(resv, comp.prompt_tokens, comp.completion_tokens,
                                          comp.cost_usd)
        finally:
            self._probe_done(model, probe)  # settled: the model is calibrated now
        self._ledger(st.id, ledger, "settled", resv, comp=comp, cost=cost, quiet=True)
        return comp, cost

    def _lookup(self, call_id: str, rh: str) -> dict | None:
        try:
            return self.recorded.lookup(call_id, rh)
        except DivergenceError as exc:
            # a divergence ends the whole run: it is not an error the model's code may catch
            with self._lock:
                if self.fatal is None:
                    self.fatal = exc
            raise

    def _calibration_turn(self, model: str, scope: CancelScope) -> bool:
        """Under a token or cost cap, a model's calls wait while its first one is in flight
        (until it settles, the reservations rest on conservative priors, not on measured
        ratios; one such call at a time bounds what a misestimate can cost). Returns True
        for that first call (pass it to :meth:`_probe_done`)."""
        if not self._need_count or self.accountant.calibrated(model):
            return False
        with self._probe_cv:
            while True:
                if self.accountant.calibrated(model):
                    return False
                if model not in self._probing:
                    self._probing.add(model)
                    return True
                left = self.deadline_left()
                if scope.cancelled or left == 0.0:
                    break
                self._probe_cv.wait(0.05)
        self.check_scope(scope)
        raise self._wall_error()

    def _probe_done(self, model: str, probe: bool) -> None:
        if probe:
            with self._probe_cv:
                self._probing.discard(model)
                self._probe_cv.notify_all()

    def _permit(self, scope: CancelScope) -> Permit:
        """A concurrency place for one call; waits at most until the wall cap or ``scope``'s
        cancellation (then raises as :meth:`check_scope`)."""
        left = self.deadline_left()
        permit = self.accountant.concurrency.acquire(
            cancel=scope, deadline=None if left is None else time.monotonic() + left)
        if permit is None:
            self.check_scope(scope)
            raise self._wall_error()
        return permit

    def _ledger(self, call_id: str, reservation: str, event: str, resv: Any, *,
                comp: Completion | None = None, cost: float = 0.0, quiet: bool = False) -> None:
        """Append one row to the journal's spend ledger (no journal: nothing). ``quiet``: a
        failure is logged, not raised (the call already happened)."""
        journal = self.journal
        if journal is None:
            return
        if event == "reserved":
            amounts = dict(calls=1, prompt_tokens=resv.reserved_prompt_tokens,
                           completion_tokens=resv.reserved_output_tokens, cost_usd=resv.cost_usd,
                           detail={"prompt_tokens": resv.prompt_tokens,
                                   "max_output_tokens": resv.max_output_tokens})
        elif event == "settled" and comp is not None:
            amounts = dict(calls=1, prompt_tokens=comp.prompt_tokens,
                           completion_tokens=comp.completion_tokens, cost_usd=cost)
        else:
            amounts = {}
        try:
            # the reservation is durable before the call is sent (with every record queued
            # before it); its settlement or release may be written behind
            journal.record_spend(self.run_id, call_id, reservation, event, model=resv.model,
                                 behind=event != "reserved", **amounts)
        except Exception:
            if not quiet:
                raise
            if getattr(journal, "closed", False):
                # a call abandoned as the run ended (Ctrl-C, say) settles after the journal
                # closed: its reservation stays in the ledger, which is what a resume counts
                log.debug("spend of call %s not journaled (%s): the journal is closed",
                          call_id, event)
                return
            log.warning("could not journal the %s spend of call %s", event, call_id,
                        exc_info=True)

    def check_scope(self, scope: CancelScope) -> None:
        """Raise if ``scope`` is cancelled: ``BudgetExceeded("wall")`` when the wall cap did it,
        else :class:`~harness.control.Cancelled`."""
        if scope.cancelled:
            if scope.reason == "wall" or self.accountant.wall_remaining() == 0.0:
                raise self._wall_error()
            raise Cancelled(scope.reason or "cancelled")

    def _send(self, client: ModelClient | None, messages: list[dict], model: str,
              max_tokens: int, call_id: str, scope: CancelScope) -> Completion:
        from rlm.models.openai_compat import DeadlineExceeded
        if client is None:
            raise EndpointError("no model endpoint configured")
        try:
            self.check_scope(scope)
            left = self.deadline_left()
            return client.complete(
                messages, model, max_tokens=max_tokens, temperature=self.opts.temperature,
                deadline=None if left is None else time.monotonic() + left + 0.05,
                call_id=f"{self.run_id}/{call_id}", cancel=scope)
        except (BudgetExceeded, Cancelled):
            raise
        except Exception as exc:
            if isinstance(exc, DeadlineExceeded) or self.accountant.wall_remaining() == 0.0:
                raise self._wall_error() from None
            if scope.cancelled:
                self.check_scope(scope)
            if client is self.sub_client and endpoint_unusable(exc):
                # the root's endpoint may be fine, but no sub-call can succeed: the run fails
                # here, naming the sub-call endpoint, as it would at its own endpoint's failure
                with self._lock:
                    if self.fatal is None:
                        self.fatal = exc
            raise

    def _wall_error(self) -> BudgetExceeded:
        return BudgetExceeded("wall", self.opts.budget.max_wall_seconds or 0,
                              self.accountant.elapsed())

    # kernels and the bridge ---------------------------------------------------------
    @property
    def kernels_started(self) -> int:
        """Kernels started for this run so far (int): every one the pool started, used or
        shut down unused, the one adopted from a head start included."""
        return self.pool.started

    def acquire_kernel(self, level: int = 0) -> Kernel:
        """A started kernel for ``level`` (0: the root) from the pool its placement names (see
        :meth:`kernels.pool.KernelPool.acquire`, :mod:`rlm.core.placement`).

        Raises:
            KernelError: no kernel could be started.
        """
        try:
            kernel = self.pool.acquire(level)
        except RuntimeError as exc:  # could not start (the message says why)
            from rlm.errors import KernelError
            raise KernelError(str(exc)) from None
        self.took(kernel)
        return kernel

    def took(self, kernel: Any) -> None:
        """Note how ``kernel`` (a :class:`kernels.kernel.Kernel` this run uses) ran."""
        self.sandbox_modes.add(kernel.sandbox_mode)
        if kernel.limits_mode:
            self.limit_modes.add(kernel.limits_mode)

    @property
    def kernel_limits(self) -> str | None:
        """How this run's sandboxed kernels were bounded: ``"cgroup"`` (each as a whole),
        ``"rlimit"`` (per process), ``"mixed"``, or None (no sandboxed kernel)."""
        if not self.limit_modes:
            return None
        return next(iter(self.limit_modes)) if len(self.limit_modes) == 1 else "mixed"

    @property
    def sandbox_mode(self) -> str | None:
        """How this run's kernels ran: ``"bwrap"``, ``"none"``, ``"mixed"``, or None (none
        started yet)."""
        if not self.sandbox_modes:
            return None
        return next(iter(self.sandbox_modes)) if len(self.sandbox_modes) == 1 else "mixed"

    def spawn(self, fn: Callable[[], Any]) -> Task:
        """Run ``fn()`` now on a daemon thread of its own (a kernel start overlapping the first
        model call); returns its :class:`~harness.control.Task`."""
        task = Task(fn, self.scope, "spawn", 0)
        task.state = "running"
        threading.Thread(target=task._run, daemon=True, name="rlm-spawn").start()
        return task

    #: Seconds past the wall cap after which :meth:`run_bounded` stops waiting for the root.
    WALL_GRACE = 3.0

    def run_bounded(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` (the root loop) on a daemon thread, waited on here; returns its result or
        raises its exception.

        The wait ends early in two cases, so the caller (``drive``) always gets control back:
        Ctrl-C (``KeyboardInterrupt`` here cancels the run's scope, gives the loop a moment to
        wind down, and is re-raised), and the wall cap: if ``fn`` has not returned
        :data:`WALL_GRACE` seconds after it (a thread starved of CPU, stuck in an import or in C
        code), the wall-cap ``BudgetExceeded`` is raised and ``fn`` is abandoned.
        """
        task = self.spawn(fn)
        cap = self.opts.budget.max_wall_seconds
        try:
            while not task.wait(0.2):
                if cap is not None and self.accountant.elapsed() > cap + self.WALL_GRACE:
                    self.scope.cancel("wall")
                    task.wait(0.5)
                    if not task.done():
                        raise self._wall_error()
        except KeyboardInterrupt:
            self.scope.cancel("interrupted")
            task.wait(1.0)
            raise
        return task.result()

    def _handle(self, reg: Registration, op: str, args: dict) -> Any:
        # the bridge's handler: the registration (never the kernel's word) names the loop;
        # the time the cell waits here is not counted against its own timeout
        clock = getattr(reg.owner, "wait_clock", None)
        if clock is None:
            return reg.owner.subcalls.handle(op, args)
        clock.enter()
        try:
            return reg.owner.subcalls.handle(op, args)
        finally:
            clock.leave()

    def close(self) -> None:
        """Shut every kernel of the run down and stop the bridge. Idempotent.

        Work still queued is dropped, work in flight abandoned (its threads are daemons)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        self.scope.cancel("closed")
        self.scheduler.close()
        for loop in list(self.loops):
            loop.close()
        self.pool.close()
        if self.session is None:  # a session's bridge outlives its questions
            self.bridge.close()
        if self._own_client and self.client is not None:
            self.client.close()  # abandoned calls still reading give up now
        if self.sub_client is not None:
            self.sub_client.close()


def prompt_estimate(messages: list[dict]) -> int:
    """Prompt tokens to reserve for ``messages``: the larger of the o200k count (with chat
    framing) and a 4-characters-per-token count, so a provider whose tokenizer splits this text
    more finely than o200k (older vocabularies, long runs of digits or repeated characters) is
    still covered by the estimate; the accountant's calibration covers the rest."""
    chars = sum(len(str(m.get("content") or "")) for m in messages)
    return max(count_messages(messages), (chars + 3) // 4 + 3 + 4 * len(messages))


# what a model_call stage records of its call for the views and spans (rlm.observe.otel) ----

def call_facts(request: dict, provider: str) -> dict:
    """The request's settings a span reports: ``provider`` (the API spoken), ``max_tokens``
    (the output cap, tokens) and ``temperature``."""
    return {"provider": provider, "max_tokens": request.get("max_tokens"),
            "temperature": request.get("temperature")}


def server_facts(base_url: str | None) -> dict | None:
    """Where a call is sent: ``{"address": host, "port": int}`` of ``base_url`` (the scheme's
    port when it names none); never the URL's user, password, path or query."""
    from urllib.parse import urlsplit
    try:
        u = urlsplit(base_url or "")
        port = u.port or {"http": 80, "https": 443}.get(u.scheme)
    except ValueError:  # a port that is not a number: the client refuses it on its own
        return None
    return {"address": u.hostname, "port": port} if u.hostname else None


def reply_facts(comp: Completion) -> dict:
    """What the reply said of itself: ``model`` (the model that answered), ``id`` (the
    provider's id of the reply) and ``finish_reason``."""
    return {"model": comp.model, "id": comp.response_id, "finish_reason": comp.finish_reason}
