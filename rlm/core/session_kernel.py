"""What a session keeps between its questions: the root's kernel, its bridge registration and
the root conversation (:class:`SessionKernel`).

Each question of a session is one run (:func:`rlm.core.drive.drive`, its own run id and
journal record). A run tree owns its kernels and shuts them all down at its end; the session's
root kernel is the one exception: it comes from the session's own pool, the run's root loop
borrows it (:meth:`SessionKernel.attach`) and gives it back at its close
(:meth:`SessionKernel.keep`) instead of shutting it down. The bridge server lives with the
session too, so the token bound in the kernel stays valid; its registration is re-pointed at
each question's root loop. Children keep fresh kernels from their run's pool.
"""
from __future__ import annotations

import threading
from typing import Any

from kernels.bridge import BridgeServer, Registration
from kernels.kernel import Kernel
from kernels.pool import KernelPool
from kernels.protocol import add_context_code
from kernels.provider import kernel_factory

from rlm.context.load import LoadedContext, describe
from rlm.core.placement import placement_of
from rlm.errors import ConfigError, ContextError, KernelError


class CutOff(Exception):
    """A replayed question reached the point where its recorded run was cut off (cancelled,
    or failed at an endpoint): a cell or a root model call the run never got to."""


def _serve(reg: Registration, op: str, args: dict) -> Any:
    # as RunTree._handle: the registration (never the kernel's word) names the loop
    return reg.owner.subcalls.handle(op, args)


class SessionKernel:
    """The root kernel, bridge and conversation that outlive one question of a session.

    Args:
        context: the session's first context (``context`` and ``context_0`` in the kernel);
            kept, with every context added later, until :meth:`close` discards them.

    Attributes:
        bridge: the session's :class:`~kernels.bridge.BridgeServer` (every question's run uses
            it instead of one of its own).
        kernel, reg: the held kernel and its registration (None before the first question,
            and after a kernel that died was not replaced).
        messages: the root conversation so far (list of chat messages), None before the first
            question; the root loop of each question appends to it.
        contexts: every context, in order (list of :class:`~rlm.context.load.LoadedContext`).
        question: the number of the question running or last run (int; 0 before the first).
        link: what the current question's run records of its session (dict, JSON-able).
        answer: the last question's answer (str | None), told to the model in the next one.
    """

    def __init__(self, context: LoadedContext) -> None:
        try:
            self.bridge = BridgeServer(_serve)
        except ValueError as exc:  # RLM_BRIDGE_MAX_FRAME_MB (kernels.bridge_limits)
            raise ConfigError(str(exc)) from None
        self.pool: KernelPool | None = None
        self.kernel: Kernel | None = None
        self.reg: Registration | None = None
        self.messages: list[dict] | None = None
        #: the root's compactor (rlm.core.compaction), kept across questions so the kernel's
        #: ``history`` holds every question's turns, those compacted away included
        self.compactor: Any = None
        self.contexts: list[LoadedContext] = [context]
        self.question = 0
        self.link: dict = {}
        self.answer: str | None = None
        #: while a cut-off question is replayed: the ids of the cells its run recorded
        self.cells: set[str] | None = None
        #: ... and the cells it was interrupted in: id -> seconds each ran before the cut
        self.cut: dict[str, float] | None = None
        self._told = 1  # contexts the model has been told of
        self._lock = threading.Lock()
        self._closed = False

    @property
    def first(self) -> LoadedContext:
        """The first context (each question's run records it as its context)."""
        return self.contexts[0]

    # the root loop's side ----------------------------------------------------------
    def acquire(self, run: Any) -> Kernel:
        """A fresh kernel from the session's pool (the first question's, or one replacing a
        kernel that died), sandboxed as ``run`` (a :class:`~rlm.core.run_tree.RunTree`) says.

        Raises:
            KernelError: no kernel could be started.
        """
        with self._lock:
            if self._closed:
                raise KernelError("the session is closed")
            if self.pool is None:
                # the root's provider (rlm.core.placement): local, or a gateway's kernel
                self.pool = KernelPool(0, sandbox=run.sandbox, factory=kernel_factory(
                    placement_of(run.opts), 0, run.sandbox))
            pool = self.pool
        try:
            kernel = pool.acquire()
        except RuntimeError as exc:
            raise KernelError(str(exc)) from None
        run.took(kernel)
        return kernel

    def attach(self, loop: Any) -> bool:
        """Lend the held kernel to ``loop`` (a root :class:`~rlm.core.loop.RLMLoop`): its
        registration now serves that loop. Returns False when no kernel is held."""
        if self.kernel is None or self.reg is None:
            return False
        self.reg.owner = loop
        loop.kernel, loop.reg = self.kernel, self.reg
        return True

    def keep(self, loop: Any) -> None:
        """Take the kernel back from ``loop`` at its close (it may be a replacement of the one
        lent, after a death; None if it died and none replaced it)."""
        self.kernel, self.reg = loop.kernel, loop.reg
        if self.kernel is None and self.reg is not None:
            self.bridge.unregister(self.reg.token)
            self.reg = None

    def before_cell(self, cell_id: str, scope: Any) -> Any:
        """Called by the root loop before it runs a cell, with the cell's cancel scope.

        Returns:
            None, or, for the cell a replayed cut-off question was interrupted in (Ctrl-C, a
            cancel), a callable the loop calls once the cell is back, which raises
            :class:`CutOff`: the cell is interrupted after as long as it ran then (its code
            up to about that point runs again, so the kernel gets the same variables), and
            the question ends there, its output unread, as it did.
        Raises:
            CutOff: a cut-off question is replayed and its run never got to this cell.
        """
        if self.cells is not None and cell_id not in self.cells:
            raise CutOff(cell_id)
        seconds = (self.cut or {}).get(cell_id)
        if seconds is None:
            return None
        timer = threading.Timer(seconds, scope.cancel, ("interrupted",))
        timer.daemon = True
        timer.start()

        def end() -> None:
            timer.cancel()
            raise CutOff(cell_id)
        return end

    def bind_added(self, kernel: Kernel) -> None:
        """Bind every context after the first in ``kernel`` (a new kernel, or a restarted one).

        Raises:
            ContextError: a context could not be loaded in the kernel.
        """
        for index in range(1, len(self.contexts)):
            self._bind_one(kernel, index)

    def _bind_one(self, kernel: Kernel, index: int) -> None:
        ctx = self.contexts[index]
        path = ctx.share(kernel)
        stamp = ctx.stamp
        res, _ = kernel.execute(add_context_code(path, ctx.fmt, index,
                                                 stamp[0] if stamp else None), timeout=120)
        if res.error:
            raise ContextError(f"could not load context_{index} ({ctx.source}) into the "
                               f"session's kernel: {res.error}")

    # the session's side ------------------------------------------------------------
    def add(self, ctx: LoadedContext) -> int:
        """Add ``ctx`` as the next context; bound in the held kernel at once (else when the
        first question's kernel is bound). Returns its index (int >= 1).

        Raises:
            ContextError: it could not be loaded in the kernel (it is not added then).
        """
        with self._lock:
            self.contexts.append(ctx)
            index = len(self.contexts) - 1
        if self.kernel is not None:
            try:
                self._bind_one(self.kernel, index)
            except BaseException:
                with self._lock:
                    self.contexts.pop()
                raise
        return index

    def untold(self) -> list[tuple[int, dict]]:
        """The contexts added since the model was last told, as ``(index, describe())``
        pairs; they count as told from now on."""
        with self._lock:
            new = list(range(self._told, len(self.contexts)))
            self._told = len(self.contexts)
        return [(i, describe(self.contexts[i])) for i in new]

    def close(self) -> None:
        """Shut the held kernel down, stop the bridge and discard every context's scratch
        files. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.reg is not None:
            self.bridge.unregister(self.reg.token)
        if self.kernel is not None and self.pool is not None:
            self.pool.release(self.kernel)
        self.kernel = self.reg = None
        if self.pool is not None:
            self.pool.close()
        self.bridge.close()
        for ctx in self.contexts:
            LoadedContext.discard(ctx)


class KeptContext(LoadedContext):
    """A context a session keeps for all its questions: :meth:`discard` does nothing (a
    question's run would discard its context at its end); :meth:`SessionKernel.close`
    discards it."""

    def discard(self) -> None:
        """Nothing: the session discards it when it closes."""

    @classmethod
    def of(cls, ctx: LoadedContext) -> "KeptContext":
        """``ctx`` as a kept context (the same fields; ``ctx`` itself is not used again)."""
        from dataclasses import fields
        return cls(**{f.name: getattr(ctx, f.name) for f in fields(ctx)})
