"""Run control: cancellation scopes, and the scheduler that runs sub-calls without stalling.

:class:`CancelScope` is a cancellation token that forms a tree: the run has one, each loop (root
or child) one below the cell that started it, each executed cell one below its loop. Cancelling a
scope cancels everything below it: a cell's interrupt (its timeout, or Ctrl-C) cancels the work
the cell started, the wall-clock cap cancels the whole run. Work that has not been sent yet is
dropped (``cancelled``, nothing charged); work in flight is *abandoned*: whoever waits on it
stops waiting, and it ends on its own, bounded by the same deadlines.

:class:`Scheduler` runs the items of batched sub-calls. It has two lanes:

* the **plain** lane runs plain completions (``llm_query`` items, depth-limit fallbacks) on at most
  ``workers`` daemon threads, first in, first out. A plain item waits only on the model (the
  concurrency gate and the HTTP call), never on other items, so the lane cannot deadlock.
* the **child** lane runs child RLMs: at most ``slots`` at once, each on a thread of its own.
  A child that itself waits on sub-calls (its cell called ``rlm_batched``) gives its slot back
  while it waits (:meth:`Scheduler.yielding`) and takes one again afterwards, so no work ever
  waits on a thread that is itself waiting, at any width and any depth. Deeper work goes first
  (a free slot finishes subtrees before it starts new siblings), which keeps the number of live
  kernels near ``slots`` per level instead of the fan-out width.

Pure standard library; imports nothing from ``rlm`` or ``kernels``.
"""
from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

__all__ = ["Cancelled", "CancelScope", "Task", "Scheduler", "WaitClock", "wait_all",
           "stops_deferred", "stopping_deferred", "run_began", "run_ended", "runs_all_ended"]

log = logging.getLogger(__name__)


class Cancelled(concurrent.futures.CancelledError):
    """Work stopped because its scope was cancelled; ``reason`` says why (``"interrupted"``,
    ``"wall"``, ``"closed"``...). A ``CancelledError``, so a stage it leaves ends ``cancelled``."""

    def __init__(self, reason: str = "cancelled") -> None:
        super().__init__(reason)
        self.reason = reason


class CancelScope:
    """A cancellation token in a tree; thread-safe.

    Args:
        parent: the enclosing scope (cancelling it cancels this one), or None.
        name: for messages and debugging.

    Attributes:
        cancelled_items, abandoned_items: counts kept by the work run under this scope (sub-calls
            dropped before they were sent; sub-calls abandoned in flight), for the model's
            feedback. Change them with :meth:`count`.
    """

    def __init__(self, parent: "CancelScope | None" = None, name: str = "") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._reason: str | None = None
        self._callbacks: dict[int, Callable[[], Any]] = {}
        self._keys = itertools.count()
        self._children: set[CancelScope] = set()
        self._parent = parent
        self.cancelled_items = 0
        self.abandoned_items = 0
        if parent is not None:
            parent._adopt(self)

    def _adopt(self, child: "CancelScope") -> None:
        with self._lock:
            reason = self._reason
            if reason is None:
                self._children.add(child)
                return
        child.cancel(reason)

    def child(self, name: str = "") -> "CancelScope":
        """A new scope below this one."""
        return CancelScope(self, name)

    @property
    def cancelled(self) -> bool:
        """True once this scope (or an ancestor) was cancelled."""
        return self._event.is_set()

    def is_set(self) -> bool:
        """Same as :attr:`cancelled` (so a scope can stand where a ``threading.Event`` is read)."""
        return self._event.is_set()

    @property
    def reason(self) -> str | None:
        """Why it was cancelled (str), or None."""
        return self._reason

    def cancel(self, reason: str = "cancelled") -> bool:
        """Cancel this scope and every scope below it; run the ``on_cancel`` callbacks.

        Returns:
            True if this call cancelled it, False if it already was (the first reason stays).
        """
        with self._lock:
            if self._reason is not None:
                return False
            self._reason = reason
            self._event.set()
            callbacks = list(self._callbacks.values())
            self._callbacks.clear()
            children = list(self._children)
            self._children.clear()
        for fn in callbacks:
            try:
                fn()
            except Exception:  # a callback's failure must not stop the others
                log.exception("cancel callback failed")
        for c in children:
            c.cancel(reason)
        return True

    def on_cancel(self, fn: Callable[[], Any]) -> Callable[[], None]:
        """Call ``fn()`` once when this scope is cancelled (at once if it already is).

        Returns:
            a function that unregisters ``fn`` (call it when the work is over).
        """
        with self._lock:
            if self._reason is None:
                key = next(self._keys)
                self._callbacks[key] = fn

                def remove() -> None:
                    with self._lock:
                        self._callbacks.pop(key, None)
                return remove
        fn()
        return lambda: None

    def check(self) -> None:
        """Raise :class:`Cancelled` if cancelled."""
        if self._event.is_set():
            raise Cancelled(self._reason or "cancelled")

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until cancelled or ``timeout`` seconds pass; True if cancelled."""
        return self._event.wait(timeout)

    def count(self, cancelled: int = 0, abandoned: int = 0) -> None:
        """Add to :attr:`cancelled_items` / :attr:`abandoned_items`."""
        with self._lock:
            self.cancelled_items += cancelled
            self.abandoned_items += abandoned

    def close(self) -> None:
        """Detach from the parent: this scope's work is over (it is no longer cancelled with
        the parent, and the parent keeps no reference to it)."""
        p = self._parent
        if p is not None:
            with p._lock:
                p._children.discard(self)

    def __repr__(self) -> str:
        return f"CancelScope({self.name!r}, reason={self._reason!r})"


class Task:
    """One item submitted to a :class:`Scheduler`: a small future.

    Attributes:
        state: ``"pending"`` (not started), ``"running"``, ``"done"`` or ``"cancelled"``
            (dropped before it started: its function never ran).
        level: the depth level of the work (child lane priority).
    """

    def __init__(self, fn: Callable[[], Any], scope: CancelScope, lane: str, level: int) -> None:
        self.fn, self.scope, self.lane, self.level = fn, scope, lane, level
        self.state = "pending"
        self.holds_slot = False
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["Task"], Any]] = []
        self._lock = threading.Lock()
        self._unhook: Callable[[], None] = lambda: None

    def done(self) -> bool:
        """True when it finished (value or error) or was cancelled before it started."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until :meth:`done` (or ``timeout`` seconds); returns :meth:`done`."""
        return self._done.wait(timeout)

    def result(self) -> Any:
        """The value; raises the work's exception, or :class:`Cancelled` if it never ran.

        Raises:
            RuntimeError: called before it is done.
        """
        if not self._done.is_set():
            raise RuntimeError("task not finished")
        if self._error is not None:
            raise self._error
        return self._value

    def add_done_callback(self, fn: Callable[["Task"], Any]) -> None:
        """Call ``fn(task)`` when it is done (at once if it already is)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, value: Any = None, error: BaseException | None = None,
                state: str = "done") -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._value, self._error, self.state = value, error, state
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        self._unhook()
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                log.exception("task callback failed")

    def _run(self) -> None:
        try:
            value = self.fn()
        except BaseException as exc:  # noqa: BLE001 - the waiter gets every outcome
            self._finish(error=exc)
        else:
            self._finish(value=value)


class _Resume:
    """A parent's request to take a child slot back after waiting (see ``yielding``)."""

    __slots__ = ("granted", "abandoned")

    def __init__(self) -> None:
        self.granted = False
        self.abandoned = False


class Scheduler:
    """Runs sub-call items: plain ones on a bounded pool, children in bounded slots.

    Args:
        slots: child RLMs running at once (int >= 1); the rest wait their turn.
        workers: threads of the plain lane (int >= 1); about the model-call concurrency.

    Every thread is a daemon thread: a run that ends (at its wall cap, or interrupted) never
    waits on abandoned work, and neither does the interpreter's exit.
    """

    def __init__(self, slots: int, workers: int) -> None:
        self.slots = max(1, int(slots))
        self.workers = max(1, int(workers))
        self._lock = threading.Lock()
        self._slot_freed = threading.Condition(self._lock)
        self._plain_ready = threading.Condition(self._lock)
        self._heap: list[tuple] = []
        self._active = 0
        self._plain: deque[Task] = deque()
        self._threads = 0
        self._idle = 0
        self._seq = itertools.count()
        self._closed = False
        self._local = threading.local()

    # ------------------------------------------------------------------ submitting

    def current(self) -> Task | None:
        """The task running on the calling thread (None outside the scheduler's threads)."""
        return getattr(self._local, "task", None)

    def submit(self, fn: Callable[[], Any], *, scope: CancelScope, lane: str = "plain",
               level: int = 0) -> Task:
        """Queue ``fn()`` in ``lane`` (``"plain"`` or ``"child"``) under ``scope``.

        If ``scope`` is cancelled before the task starts, it never runs: it ends ``cancelled``
        with :class:`Cancelled`. Child tasks start deepest ``level`` first, then in order.
        """
        if lane not in ("plain", "child"):
            raise ValueError(f"unknown lane {lane!r}")
        task = Task(fn, scope, lane, level)
        with self._lock:
            closed = self._closed
            if not closed:
                if lane == "plain":
                    self._plain.append(task)
                    if self._idle == 0 and self._threads < self.workers:
                        self._threads += 1
                        threading.Thread(target=self._plain_worker, daemon=True,
                                         name="rlm-plain").start()
                    else:
                        self._plain_ready.notify()
                else:
                    heapq.heappush(self._heap, ((-level, 1), next(self._seq), task))
                    self._dispatch()
        if closed:
            task._finish(error=Cancelled("closed"), state="cancelled")
            return task
        remove = scope.on_cancel(lambda: self._drop(task))
        task._unhook = remove
        if task.done():  # it finished before the hook was in place
            remove()
        return task

    def _drop(self, task: Task) -> None:
        """Cancel ``task`` if it has not started (its entry is skipped when reached)."""
        with self._lock:
            if task.state != "pending":
                return
            task.state = "cancelled"
        task._finish(error=Cancelled(task.scope.reason or "cancelled"), state="cancelled")

    # ------------------------------------------------------------------ the child lane

    def _dispatch(self) -> None:
        """Start queued child work while slots are free. Lock held."""
        while self._active < self.slots and self._heap:
            _, _, entry = heapq.heappop(self._heap)
            if isinstance(entry, _Resume):
                if entry.abandoned:
                    continue
                entry.granted = True
                self._active += 1
                self._slot_freed.notify_all()
                continue
            if entry.state != "pending":
                continue
            entry.state = "running"
            entry.holds_slot = True
            self._active += 1
            threading.Thread(target=self._run_child, args=(entry,), daemon=True,
                             name="rlm-child").start()

    def _run_child(self, task: Task) -> None:
        self._local.task = task
        try:
            task._run()
        finally:
            self._local.task = None
            with self._lock:
                if task.holds_slot:
                    task.holds_slot = False
                    self._active -= 1
                    self._dispatch()

    @contextmanager
    def yielding(self, task: Task | None, level: int, scope: CancelScope) -> Iterator[None]:
        """While the block runs, ``task`` (a child waiting on its own sub-calls) gives its slot
        back; afterwards it waits for one again (before new work at its level), unless
        ``scope`` is cancelled meanwhile. A no-op for work that holds no slot (the root)."""
        with self._lock:
            holds = task is not None and task.holds_slot
            if holds:
                task.holds_slot = False
                self._active -= 1
                self._dispatch()
        try:
            yield
        finally:
            if holds:
                ticket = _Resume()
                with self._lock:
                    heapq.heappush(self._heap, ((-level, 0), next(self._seq), ticket))
                    self._dispatch()
                    while not ticket.granted and not scope.cancelled and not self._closed:
                        self._slot_freed.wait(0.1)
                    if ticket.granted:
                        task.holds_slot = True  # type: ignore[union-attr]
                    else:
                        ticket.abandoned = True

    # ------------------------------------------------------------------ the plain lane

    def _plain_worker(self) -> None:
        while True:
            with self._lock:
                while not self._plain and not self._closed:
                    self._idle += 1
                    self._plain_ready.wait()
                    self._idle -= 1
                if self._closed:
                    self._threads -= 1
                    return
                task = self._plain.popleft()
                if task.state != "pending":
                    continue
                task.state = "running"
            self._local.task = task
            try:
                task._run()
            finally:
                self._local.task = None

    # ------------------------------------------------------------------ shutdown

    def active(self) -> dict:
        """``{"children": running child slots, "queued": waiting items}`` (for reports, tests)."""
        with self._lock:
            queued = sum(1 for t in self._plain if t.state == "pending") + sum(
                1 for _, _, e in self._heap if isinstance(e, Task) and e.state == "pending")
            return {"children": self._active, "queued": queued}

    def close(self) -> None:
        """Stop: queued work is cancelled, threads exit (running work is abandoned). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            queued = [t for t in self._plain] + [e for _, _, e in self._heap
                                                  if isinstance(e, Task)]
            self._plain.clear()
            self._heap.clear()
            self._plain_ready.notify_all()
            self._slot_freed.notify_all()
        for t in queued:
            self._drop(t)


def wait_all(tasks: Sequence[Task], scope: CancelScope, deadline: float | None = None) -> bool:
    """Wait until every task is done, ``scope`` is cancelled or the ``time.monotonic()``
    ``deadline`` passes. Returns True if every task is done."""
    if all(t.done() for t in tasks):
        return True
    wake = threading.Event()
    left = [len(tasks)]
    lock = threading.Lock()

    def one_done(_t: Task) -> None:
        with lock:
            left[0] -= 1
            if left[0] <= 0:
                wake.set()

    for t in tasks:
        t.add_done_callback(one_done)  # at once for a task already done
    remove = scope.on_cancel(wake.set)
    try:
        while not wake.is_set() and not scope.cancelled:
            timeout = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if timeout <= 0:
                break
            wake.wait(timeout)
    finally:
        remove()
    return all(t.done() for t in tasks)


class WaitClock:
    """Seconds a cell has spent waiting on the host: the time during which at least one of its
    sub-calls (or tool calls) was in flight, overlapping calls counted once. Thread-safe.

    A cell's own timeout (``--cell-timeout``) bounds the cell's code, not the calls it is
    waiting on, which have caps of their own (the model's deadlines, the tool timeout, the wall
    cap); the kernel's timer is pushed back by :meth:`waited` (see ``Kernel.execute``'s
    ``extend``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight = 0
        self._since = 0.0
        self._total = 0.0

    def enter(self) -> None:
        """One call starts waiting."""
        with self._lock:
            if self._inflight == 0:
                self._since = time.monotonic()
            self._inflight += 1

    def leave(self) -> None:
        """One call is answered (or failed)."""
        with self._lock:
            self._inflight = max(0, self._inflight - 1)
            if self._inflight == 0:
                self._total += time.monotonic() - self._since

    def waited(self) -> float:
        """Seconds waited so far (float), the wait in progress included."""
        with self._lock:
            extra = time.monotonic() - self._since if self._inflight else 0.0
            return self._total + extra

    def reset(self) -> None:
        """Start counting afresh (a new cell); calls still in flight keep counting."""
        with self._lock:
            self._total = 0.0
            if self._inflight:
                self._since = time.monotonic()


# ------------------------------------------------------------------ the end of a run, whole

_deferring = [0]  # sections open (any thread): a stop signal's handler runs in the main thread
_deferring_lock = threading.Lock()


@contextmanager
def stopping_deferred() -> Iterator[None]:
    """A section that a stop signal (Ctrl-C, SIGTERM, SIGHUP) must not cut short: the end of a
    run (its kernels shut down, its last stages and its end journaled). While one is open,
    :func:`stops_deferred` is True and a signal handler that asks (the CLI's) lets the section
    finish instead of raising in it: cut there, a run was left ``running`` (then seen as
    crashed) and its kernels' directories behind. The run ends right after anyway."""
    with _deferring_lock:
        _deferring[0] += 1
    try:
        yield
    finally:
        with _deferring_lock:
            _deferring[0] -= 1


def stops_deferred() -> bool:
    """Whether a :func:`stopping_deferred` section is open (bool)."""
    return _deferring[0] > 0


_runs = [0, 0]  # runs begun and ended in this process (drive counts them)


def run_began() -> None:
    """Count a run begun in this process (:func:`runs_all_ended`)."""
    with _deferring_lock:
        _runs[0] += 1


def run_ended() -> None:
    """Count a run whose end is written (journaled, its kernels shut down)."""
    with _deferring_lock:
        _runs[1] += 1


def runs_all_ended() -> bool:
    """Whether a run began in this process and every one begun has ended: a command that runs
    one and exits then has nothing left to stop (a stop signal now would only make its exit
    code say "interrupted" for a run journaled as finished)."""
    with _deferring_lock:
        return _runs[0] > 0 and _runs[0] == _runs[1]
