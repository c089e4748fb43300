"""The kernel pool and head starts: kernels started before the RLM that needs them.

:class:`Pending` starts a kernel on a thread of its own; :func:`head_start` starts the root's
kernel (and its pool's) before a run exists, so the cold start (~0.6 s) overlaps the host's
set-up; :class:`KernelPool` keeps clean kernels ready for children. A kernel leaves the pool once
and is never returned, so no state is shared between RLM instances.
"""
from __future__ import annotations

import threading
import time
import weakref

from kernels import kernel as _kernel  # its START_GATE, read at each use (tests replace it)
from kernels.bwrap import SandboxSpec
from kernels.kernel import Kernel
from kernels.launch import Launched


class Pending:
    """A kernel starting on a daemon thread of its own, from the moment this is made.

    Args:
        kernel: the (not yet started) :class:`Kernel`; a new one when None.

    Attributes:
        kernel: the kernel. done: an Event set once :meth:`Kernel.start` returned or raised.
        error: the exception the start raised (None: started, or not done yet).
    """

    def __init__(self, kernel: Kernel | None = None, launch_here: bool = False) -> None:
        self.kernel = kernel or Kernel()
        self.done = threading.Event()
        self.error: BaseException | None = None
        _PENDING.add(self)
        km = None
        if launch_here and _kernel.START_GATE.enter(wait=False):
            # launch the process on the caller's thread, before its next imports: ~0.15 s
            # earlier than a thread sharing the interpreter with them would
            try:
                km = self.kernel._launch()
            except Exception as exc:
                _kernel.START_GATE.leave()
                self.error = exc
                self.done.set()
                return
            except BaseException:  # Ctrl-C while launching: it is the caller's, not the start's
                _kernel.START_GATE.leave()
                self.done.set()
                self.kernel.shutdown()
                raise
        threading.Thread(target=self._run, args=(km,), daemon=True,
                         name="rlm-kernel-start").start()

    def _run(self, km: "Launched | None") -> None:
        try:
            if km is None:
                self.kernel.start()
            else:
                try:
                    self.kernel._ready(km)
                finally:
                    _kernel.START_GATE.leave()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()


_head: list[Pending] = []
_head_lock = threading.Lock()
# every start and pool of this process, for shut_down_all() at its exit
_PENDING: "weakref.WeakSet[Pending]" = weakref.WeakSet()
_POOLS: "weakref.WeakSet[KernelPool]" = weakref.WeakSet()

#: Idle kernels a run keeps ready for its children when it may start any (``max_depth >= 2``).
DEFAULT_POOL_SIZE = 2


def pool_size_for(max_depth: int, pool_size: int | None = None) -> int:
    """Idle kernels (int) a run of ``max_depth`` keeps: ``pool_size`` when given, else
    :data:`DEFAULT_POOL_SIZE` when its children get kernels (``max_depth >= 2``), else 0."""
    if pool_size is not None:
        return max(0, int(pool_size))
    return DEFAULT_POOL_SIZE if max_depth >= 2 else 0


def head_start(kernels: int = 1, sandbox: SandboxSpec | None = None) -> "Pending | None":
    """Start ``kernels`` kernels now (none for 0), before the run that needs them exists; the
    ones already pending count (so a second call starts nothing more).

    A process that is about to run an RLM calls this as early as it can, with the root's kernel
    plus its pool's (``1 + pool_size_for(max_depth, pool_size)``): the first kernel's process
    is launched before this returns (when a start place is free, else on a thread), the others
    on threads, through :data:`kernels.kernel.START_GATE` like every start; their cold starts (~0.6 s each, in
    their own processes) then overlap the host's own imports and set-up, and a child started by
    the root's first cell finds a pool kernel ready. The next :class:`KernelPool` made with
    ``head=take_head_start()`` adopts them all; the ones nobody adopts are shut down by
    :func:`drop_head_start` (or when this process exits: their supervisors see the host gone).
    Hides the start-up secrets first (:func:`kernels.secrets.hide_startup_secrets`), as every
    kernel start must.

    Args:
        sandbox: how the kernels are sandboxed (default :class:`SandboxSpec`'s); a run adopts
            them only when its own spec is the same.
    Returns:
        the first :class:`Pending` start (errors surface in the pool that adopts it), None when
        none was asked for and none is pending.
    """
    from kernels.secrets import hide_startup_secrets
    hide_startup_secrets()
    if int(kernels) <= 0:  # none asked for (the run's kernels start elsewhere)
        with _head_lock:
            return _head[0] if _head else None
    with _head_lock:
        while len(_head) < int(kernels):
            _head.append(Pending(Kernel(sandbox=sandbox), launch_here=not _head))
        return _head[0]


def take_head_start(sandbox: SandboxSpec | None = None) -> list[Pending]:
    """The kernels :func:`head_start` started with the sandbox ``sandbox`` (default spec when
    None) and nobody took yet (``[]`` if none), the root's first; the caller owns them from now
    on. Ones started with another spec are shut down."""
    global _head
    with _head_lock:
        heads, _head = _head, []
    want = sandbox or SandboxSpec()
    for head in [h for h in heads if h.kernel.spec != want]:
        head.kernel.shutdown()
    return [h for h in heads if h.kernel.spec == want]


def held() -> tuple:
    """What this process holds now: its starts, its pools and its open bridges (a tuple of
    sets), for :func:`shut_down_all`'s ``since``."""
    import sys  # no bridge module imported yet (a command's start): none open, none to import
    bridge = sys.modules.get("kernels.bridge")
    return set(_PENDING), set(_POOLS), set(bridge.OPEN if bridge is not None else ())


def shut_down_all(wait: float = 0.0, since: tuple | None = None) -> None:
    """For a command about to exit: shut down every kernel this process started that is still
    alive or starting (the ones started ahead, adopted or not, and every pool's), wait up to
    ``wait`` seconds for their starts to end, so that each removes its directory, and close
    every bridge still open. ``since``: what :func:`held` returned when the command began;
    what was held then is left alone (a caller's own pools, when the CLI runs in-process).

    A stop signal can land between a run's set-up steps (after a pool adopted the kernels
    started ahead, before the run held the pool); the exit then cut those starts short and
    left their directories and, for a moment, their processes. Never raises."""
    old_heads, old_pools, old_bridges = since or (set(), set(), set())
    drop_head_start()
    heads = [h for h in list(_PENDING) if h not in old_heads]
    for head in heads:
        try:
            head.kernel.shutdown()
        except Exception:  # noqa: BLE001 - the exit goes on
            pass
    pools = [p for p in list(_POOLS) if p not in old_pools]
    for pool in pools:
        try:
            pool.close()
        except Exception:  # noqa: BLE001
            pass
    deadline = time.monotonic() + wait
    for head in heads:
        head.done.wait(max(0.0, deadline - time.monotonic()))
    for pool in pools:  # the pools' own starts
        with pool._cv:
            pool._cv.wait_for(lambda: pool._starting <= 0,
                              max(0.0, deadline - time.monotonic()))
    from kernels.bridge import close_all
    close_all(skip=old_bridges)


def drop_head_start(wait: float = 0.0) -> None:
    """Shut down the kernels :func:`head_start` started, if nobody took them; a kernel still
    starting stops once it is up. ``wait``: seconds to wait for those starts to end (a shut
    down start ends at once, its directory removed), for a process about to exit: its exit
    would cut them short and leave their directories. Never raises."""
    global _head
    with _head_lock:
        heads, _head = _head, []
    for head in heads:
        head.kernel.shutdown()
    deadline = time.monotonic() + wait
    for head in heads:
        head.done.wait(max(0.0, deadline - time.monotonic()))


class KernelPool:
    """Pre-started clean kernels, so an RLM (a child especially) starts in milliseconds.

    A kernel leaves the pool once and is never returned: it is shut down when
    its RLM instance ends, so no state is ever shared between instances. The
    pool refills in background threads, each start through :data:`kernels.kernel.START_GATE` (so no more
    kernels start at once than the machine has cores). ``size=0`` keeps no idle kernels.

    :meth:`acquire` takes a ready kernel; when none is ready but one is starting (and no
    other caller waits for it) it waits for the first one ready; only otherwise does it start
    one cold. :attr:`started` counts every kernel the pool started, including the ones it shut
    down unused.

    Args:
        size: idle kernels to keep ready (int >= 0).
        head: kernels already starting (:func:`take_head_start`: a list of :class:`Pending`,
            or one) to adopt: they count towards ``size`` and in :attr:`started`; the first
            ready is the first :meth:`acquire`'s.
        sandbox: how its kernels are sandboxed (:class:`kernels.bwrap.SandboxSpec`).
        factory: makes a new (not started) kernel; default a local :class:`Kernel` with
            ``sandbox`` (see :func:`kernels.provider.kernel_factory`).
    """

    def __init__(self, size: int = 0, head: "Pending | list[Pending] | None" = None,
                 sandbox: SandboxSpec | None = None, factory=None) -> None:
        self.size = max(0, int(size))
        self.spec = sandbox
        self._make = factory or (lambda: Kernel(sandbox=sandbox))
        self._ready: list[Kernel] = []
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._starting = 0  # kernels starting for the pool (not cold ones)
        self._waiting = 0  # acquire() calls waiting for one of them
        self._closed = False
        #: kernels started over the pool's life: pool, adopted and cold ones, used or not (int)
        self.started = 0
        self._live: set[Kernel] = set()
        self._reaping: list[threading.Thread] = []  # released kernels' processes being reaped
        _POOLS.add(self)
        heads = [] if head is None else [head] if isinstance(head, Pending) else list(head)
        for h in heads:
            with self._lock:
                self._starting += 1
                self.started += 1
                self._live.add(h.kernel)
            threading.Thread(target=self._adopt, args=(h,), daemon=True,
                             name="rlm-pool").start()
        self._fill()

    def _fill(self) -> None:
        with self._lock:
            if self._closed:
                return
            need = max(0, self.size - len(self._ready) - (self._starting - self._waiting))
            self._starting += need
            self.started += need
            kernels = [self._make() for _ in range(need)]
            self._live.update(kernels)
        for k in kernels:
            threading.Thread(target=self._start_one, args=(k,), daemon=True,
                             name="rlm-pool").start()

    def _start_one(self, k: Kernel) -> None:
        try:
            k.start()
        except Exception:
            self._started_one(k, ok=False)
            return
        self._started_one(k, ok=True)

    def _adopt(self, head: Pending) -> None:
        head.done.wait()
        self._started_one(head.kernel, ok=head.error is None)

    def _started_one(self, k: Kernel, ok: bool) -> None:
        with self._cv:
            self._starting -= 1
            keep = ok and not self._closed
            if keep:
                self._ready.append(k)
            self._cv.notify_all()  # a waiter takes it, or (a failed start) starts its own
        if not keep:
            self._drop(k)

    def _new(self) -> Kernel:
        k = self._make()
        with self._lock:
            self._live.add(k)
            self.started += 1
        try:
            return k.start()
        except Exception:
            self._drop(k)
            raise

    def _drop(self, k: Kernel) -> None:
        with self._lock:
            self._live.discard(k)
        k.shutdown()

    def _take(self) -> Kernel | None:
        """A ready kernel that is alive, waiting for a starting one if no other caller
        waits for it; None when a cold start is the way (nothing ready or claimable)."""
        with self._cv:
            claimed = False
            try:
                while True:
                    while self._ready:
                        k = self._ready.pop(0)
                        if k.is_alive():
                            return k
                        self._live.discard(k)
                        threading.Thread(target=k.shutdown, daemon=True).start()
                    if self._closed:
                        return None
                    if not claimed:
                        if self._starting <= self._waiting:
                            return None  # every starting kernel is someone else's
                        claimed = True
                        self._waiting += 1
                    elif self._starting < self._waiting:
                        return None  # a start failed: not enough left for every waiter
                    self._cv.wait(0.5)
            finally:
                if claimed:
                    self._waiting -= 1

    def acquire(self) -> Kernel:
        """A started kernel that no RLM has used: a ready pool kernel; else the first pool
        kernel to be ready if one is starting for no other caller; else a cold start.

        Returns:
            the :class:`Kernel` (the caller gives it back with :meth:`release`).
        Raises:
            RuntimeError: a cold start failed (see :meth:`Kernel.start`).
        """
        k = self._take()
        if k is None:
            k = self._new()
        self._fill()
        return k

    def release(self, k: Kernel) -> None:
        """Shut ``k`` down (kernels are never reused). Never raises.

        The caller waits only for the part of the shutdown that uses ZeroMQ (about 2 ms, see
        :meth:`Kernel.begin_shutdown`); waiting for the processes to exit (about 10 ms) and
        removing the kernel's directory happen on a thread of the pool, which :meth:`close`
        waits for.
        """
        with self._lock:
            self._live.discard(k)
        finish = k.begin_shutdown()
        if finish is None:
            return
        with self._lock:
            if not self._closed:  # else close() may be past its join: finish here
                t = threading.Thread(target=finish, daemon=True, name="rlm-kernel-reap")
                t.start()  # before close() can see it (a thread not started cannot be joined)
                self._reaping = [x for x in self._reaping if x.is_alive()]
                self._reaping.append(t)
                return
        finish()

    def close(self) -> None:
        """Shut down every kernel this pool started that is still alive; a kernel still
        starting stops once it is up. Returns when every started one is gone, released ones
        included. Idempotent."""
        with self._cv:
            self._closed = True
            live = list(self._live)
            self._live.clear()
            reaping, self._reaping = self._reaping, []
            self._cv.notify_all()
        threads = [threading.Thread(target=k.shutdown, daemon=True) for k in live]
        for t in threads:
            t.start()
        for t in threads + reaping:
            t.join(timeout=10)
