"""The stage context manager's body (:class:`StageScope`) and :func:`cancel_open`.

Made by :meth:`harness.stages.tree.StageTree.stage`; see its docstring for how the way a ``with``
block ends decides the stage's terminal status. Pure standard library.
"""
from __future__ import annotations

from typing import Any, Protocol

from harness.errors import BudgetExceeded, IllegalTransition
from harness.stages.model import Stage, Status



class ScopeTree(Protocol):
    """What a :class:`StageScope` needs of its tree (:class:`harness.stages.tree.StageTree` is
    one): compare-and-set transitions, usage roll-up, a stage's status, every stage."""

    def transition(self, *args: Any, **kwargs: Any) -> Any: ...

    def add_usage(self, *args: Any, **kwargs: Any) -> Any: ...

    def status(self, *args: Any, **kwargs: Any) -> Any: ...

    def all(self, *args: Any, **kwargs: Any) -> Any: ...

__all__ = ["StageScope", "cancel_open"]

_CANCELLED_ERRORS: tuple[type[BaseException], ...] = (KeyboardInterrupt,)
try:  # both spellings of "this work was cancelled"
    import asyncio as _asyncio
    import concurrent.futures as _cf
    _CANCELLED_ERRORS = (KeyboardInterrupt, _asyncio.CancelledError, _cf.CancelledError)
except ImportError:  # pragma: no cover - both are standard library
    pass


class StageScope:
    """The body of one stage; made by :meth:`StageTree.stage`, used as a ``with`` block.

    Attributes:
        tree: the :class:`StageTree`. id: the stage id (str). kind, level, model: as created.
        evidence: what the stage produced (str | dict | None), written on its terminal
            transition; the proof that ``completed`` means something.
        meta: extra fields (dict) written with the terminal transition when non-empty.
    """

    __slots__ = ("tree", "id", "kind", "level", "model", "evidence", "meta", "_started",
                 "_start", "_status", "_error", "_usage")

    def __init__(self, tree: ScopeTree, stage: Stage, start: bool) -> None:
        self.tree = tree
        self.id, self.kind, self.level, self.model = stage.id, stage.kind, stage.level, stage.model
        self.evidence: Any = None
        self.meta: dict = {}
        self._started = stage.status is Status.running
        self._start = start
        self._status: Status = Status.completed
        self._error: str | None = None
        self._usage: tuple | None = None  # (prompt, completion, USD, calls) for the exit

    def __enter__(self) -> "StageScope":
        if self._start:
            self.start()
        return self

    def start(self) -> None:
        """``pending -> running`` (once; a no-op when already running)."""
        if not self._started:
            self.tree.transition(self.id, Status.pending, Status.running)
            self._started = True

    def finish(self, status: Status | str, error: str | None = None) -> None:
        """Ask for ``status`` (e.g. ``failed`` for a cell whose code raised) and an ``error``
        text at a normal exit of the block. An exception leaving the block overrides both."""
        self._status = Status(status)
        self._error = error

    def add_usage(self, prompt_tokens: int, completion_tokens: int, cost_usd: float,
                  calls: int = 1) -> None:
        """Add settled usage (tokens, USD, calls) to this stage; see :meth:`StageTree.add_usage`."""
        self.tree.add_usage(self.id, prompt_tokens, completion_tokens, cost_usd, calls)

    def usage_on_exit(self, prompt_tokens: int, completion_tokens: int, cost_usd: float,
                      calls: int = 1) -> None:
        """Settled usage (tokens, USD, calls) of a stage that ends right after: set in its
        terminal transition (one event instead of a ``"usage"`` event and then the end), or
        added as :meth:`add_usage` does if the stage ended meanwhile (a call cancelled in
        flight still cost money). Counters start at 0 (a model call's only usage). Raises
        ``ValueError`` on a negative amount."""
        if prompt_tokens < 0 or completion_tokens < 0 or cost_usd < 0 or calls < 0:
            raise ValueError("usage to add must be non-negative")
        self._usage = (prompt_tokens, completion_tokens, cost_usd, calls)

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            status, error = self._status, self._error
        else:
            if isinstance(exc, BudgetExceeded):
                status = Status.budget_exceeded
            elif isinstance(exc, _CANCELLED_ERRORS):
                status = Status.cancelled
            else:
                status = Status.failed
            error = str(exc) or type(exc).__name__
        prior = Status.running if self._started else Status.pending
        if prior is Status.pending and status is Status.completed:
            status = Status.cancelled
        fields: dict[str, Any] = {}
        if self.evidence is not None:
            fields["evidence"] = self.evidence
        if error is not None:
            fields["error"] = error
        if self.meta:
            fields["meta"] = self.meta
        if self._usage is not None and not self.tree.status(self.id).terminal:
            fields.update(zip(("prompt_tokens", "completion_tokens", "cost_usd", "calls"),
                              self._usage))
        if self.tree.status(self.id).terminal:
            # the run ended around this stage (cancelled at the wall cap or at shutdown):
            # terminal statuses are absorbing, so there is nothing left to record but usage
            self._late_usage()
            return False
        try:
            self.tree.transition(self.id, prior, status, **fields)
        except IllegalTransition:
            if not self.tree.status(self.id).terminal:
                raise
            # it became terminal between the check and the transition: the same case as above
            self._late_usage()
        return False

    def _late_usage(self) -> None:
        if self._usage is not None:
            self.tree.add_usage(self.id, *self._usage)


def cancel_open(tree: ScopeTree, why: str) -> int:
    """Move every stage still ``pending``/``running`` to ``cancelled`` with ``error`` saying
    the run ended (``why``) while it was in flight, so no stage stays open forever.

    Returns:
        how many stages were cancelled (int).
    """
    n = 0
    for st in tree.all():
        if st.status in (Status.pending, Status.running):
            try:
                tree.transition(st.id, st.status, Status.cancelled,
                                error=f"run ended ({why}) while this stage was in flight")
                n += 1
            except IllegalTransition:
                pass  # it ended on its own in between: terminal statuses are absorbing
    return n
