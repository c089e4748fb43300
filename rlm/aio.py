"""The async API: ``await rlm.acompletion(...)`` and :class:`AsyncRLM`, with cancellation.

A run is the same synchronous run tree as :func:`rlm.completion` (its kernels, bridge, accountant
and journal), driven on a thread of its own, so many runs share one event loop without sharing
any state: each has its own kernels, accountant and stage tree. The awaiting coroutine never
blocks the loop.

Cancelling the awaiting task ends the run promptly: the :class:`CancelToken` handed to the run
(option ``cancel``) marks the run tree as cancelled (every later model call raises
:class:`RunCancelled` instead of being sent) and cancels the run's
:class:`~harness.control.CancelScope` as Ctrl-C does, so a running cell is interrupted (its
kernel killed if it will not stop) and queued sub-calls are dropped; the run then unwinds as an
interrupted run does: every open stage ``cancelled``, every kernel shut down, the journal's run
record ``cancelled``, which the same ``run_id`` resumes later. The task's ``CancelledError`` is
raised once that cleanup is done (bounded by ``grace`` seconds).

>>> res = await rlm.acompletion("a long text...", "What is X?", base_url=..., model=...)
>>> results = await asyncio.gather(*(rlm.acompletion(c, q, **o) for c in contexts))
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

from rlm.api import RLM
from rlm.result import Result

__all__ = ["AsyncRLM", "CancelToken", "RunCancelled", "acompletion", "await_cancellable",
           "safe_listener"]


class RunCancelled(KeyboardInterrupt):
    """The run was cancelled from outside (its task was cancelled, or :meth:`CancelToken.cancel`).

    A :class:`KeyboardInterrupt`, so the run tree unwinds exactly as on Ctrl-C: stages
    ``cancelled``, kernels shut down, the journal record ``cancelled`` (resumable)."""


class CancelToken:
    """A handle that cancels one run from another thread; pass it as the ``cancel`` option.

    The run tree attaches itself when it starts (:meth:`attach`); a token cancelled before
    that cancels the run as soon as it attaches. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._runs: list[Any] = []

    @property
    def cancelled(self) -> bool:
        """True once :meth:`cancel` was called."""
        return self._cancelled

    def attach(self, run: Any) -> None:
        """Called by :func:`rlm.core.run_tree.drive` with its :class:`~rlm.core.run_tree.RunTree`."""
        with self._lock:
            self._runs.append(run)
            fire = self._cancelled
        if fire:
            _stop(run)

    def cancel(self) -> None:
        """Cancel the run: no new model call is sent, running cells are interrupted."""
        with self._lock:
            self._cancelled = True
            runs = list(self._runs)
        for run in runs:
            _stop(run)


def safe_listener(fn: Callable[[dict], None]) -> Callable[[dict], None]:
    """``fn`` as a stage-tree listener (option ``listeners``) that never raises: a listener
    that raises would roll the stage change back (:mod:`harness.stages.tree`)."""
    def listener(event: dict) -> None:
        try:
            fn(event)
        except Exception:  # noqa: BLE001
            pass
    return listener


def _stop(run: Any) -> None:
    """Mark ``run`` cancelled and cancel its scope (as Ctrl-C does).

    Every later model call raises :class:`RunCancelled`, and the loops check it before and
    after each cell. Cancelling the run's scope interrupts the running cells (a cell that will
    not stop has its kernel killed), abandons calls in flight and drops queued sub-calls;
    a cell that starts afterwards starts under a cancelled scope and is interrupted at once."""
    with run._lock:
        if not isinstance(run.fatal, RunCancelled):
            run.fatal = RunCancelled("the run was cancelled")
    run.scope.cancel("interrupted")


def _in_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """Run ``fn`` on a new daemon thread; its result or exception resolves the returned future.

    A thread per run rather than the loop's default executor, whose few workers would queue
    concurrent runs behind each other."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if isinstance(value, KeyboardInterrupt):
            fut.cancel()  # the run was cancelled; a KeyboardInterrupt would stop the event loop
        elif ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def body() -> None:
        try:
            value = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            try:
                loop.call_soon_threadsafe(settle, False, exc)
            except RuntimeError:  # the loop is closed: nobody awaits any more
                pass
            return
        try:
            loop.call_soon_threadsafe(settle, True, value)
        except RuntimeError:
            pass

    threading.Thread(target=body, name="rlm-async-run", daemon=True).start()
    return fut


async def await_cancellable(fut: "asyncio.Future", token: CancelToken, grace: float) -> Any:
    """The result of ``fut`` (a run on its thread, cancelled through ``token``). When the
    awaiting task is cancelled, the run is cancelled too and given ``grace`` seconds to wind
    down (its stages journaled ``cancelled``) before ``asyncio.CancelledError`` goes on.

    Raises:
        asyncio.CancelledError: the awaiting task was cancelled. Else what ``fut`` raises.
    """
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        token.cancel()
        try:
            await asyncio.wait_for(asyncio.shield(fut), grace)
        except BaseException:  # noqa: BLE001 - the run's own end (RunCancelled) or the grace
            pass
        raise


class AsyncRLM:
    """The async counterpart of :class:`rlm.RLM`: same options, ``await r.completion(...)``.

    Safe to run many completions at once in one event loop; each is its own run tree. Use as
    ``async with AsyncRLM(**options) as r:`` (closes an embedded model server started for it).

    Args:
        grace: seconds a cancelled run is given to wind down (kernels shut down, journal
            written) before the ``CancelledError`` is raised anyway (default 30).
        options: as :class:`rlm.RLM`.
    """

    def __init__(self, *, grace: float = 30.0, **options: Any) -> None:
        self._sync = RLM(**options)
        self.grace = grace

    async def completion(self, context: Any, query: str | None = None, *,
                         cancel: CancelToken | None = None, **overrides: Any) -> Result:
        """Run one RLM; see :meth:`rlm.RLM.completion` for arguments, result and errors.

        Args:
            cancel: a :class:`CancelToken` to cancel the run from elsewhere too (optional; one
                is made per call, cancelled when the awaiting task is).
        Raises:
            asyncio.CancelledError: the task or the token was cancelled (the run is
                journaled ``cancelled`` and resumable by its ``run_id``).
        """
        token = cancel or CancelToken()
        fut = _in_thread(lambda: self._sync.completion(context, query, cancel=token, **overrides))
        return await await_cancellable(fut, token, self.grace)

    async def aclose(self) -> None:
        """Stop the embedded model server, if one was started (off the event loop)."""
        await _in_thread(self._sync.close)

    async def __aenter__(self) -> "AsyncRLM":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


async def acompletion(context: Any, query: str | None = None, **options: Any) -> Result:
    """``await`` one RLM run: the async :func:`rlm.completion` (same arguments and result).

    Cancelling the awaiting task cancels the run (see the module docstring).
    """
    async with AsyncRLM(**options) as r:
        return await r.completion(context, query)
