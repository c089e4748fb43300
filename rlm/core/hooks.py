"""What a run is handed besides its settings: the journal it writes, the stage listeners, the
progress callback and the cancel handle (:class:`RunHooks`), and the journal's surface a run uses
(:class:`RunJournal`).

:class:`rlm.config.options.Options` holds settings only (what the journal records for resume
and replay); these are live objects of the calling process, given to
:class:`rlm.core.run_tree.RunTree` and :func:`rlm.core.drive.drive` directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

__all__ = ["RunJournal", "RunHooks"]


class RunJournal(Protocol):
    """The journal operations a run performs (:class:`harness.journal.Journal` is one; so is any
    store behind it: SQLite or PostgreSQL). Arguments and records as there documented."""

    def create_run(self, run_id: str, *, query: str, model: str, sub_model: str | None = None,
                   max_depth: int = 1, options: dict | None = None) -> Any: ...

    def start_heartbeat(self, run_id: str, interval: float = 2.0) -> Any: ...

    def finish_run(self, run_id: str, *, status: str, answer: str | None = None,
                   usage: dict | None = None, error: str | None = None) -> Any: ...

    def record_event_behind(self, event: dict) -> None: ...

    def record_model_call(self, run_id: str, call_id: str, **fields: Any) -> Any: ...

    def record_cell(self, run_id: str, stage_id: str, code: str, output: Any,
                    **fields: Any) -> Any: ...

    def record_spend(self, run_id: str, call_id: str, reservation: str, event: str,
                     **fields: Any) -> Any: ...

    def spend(self, run_id: str) -> list[dict]: ...


@dataclass(frozen=True)
class RunHooks:
    """The live objects a run reports to and is steered by.

    Attributes:
        journal: the :class:`RunJournal` the run writes, or None (no journal; a replay).
        listeners: stage-tree listeners (callables taking one event dict) after the journal's,
            e.g. the live view or the OpenTelemetry exporter; one that raises is logged, not
            raised into the run.
        on_progress: called with one line (str) per step of the run, or None (logged).
        cancel: a :class:`rlm.aio.CancelToken` (anything with ``attach(run_tree)``), or None.
        session: the :class:`rlm.core.session_kernel.SessionKernel` of the session this run is
            one question of (its root borrows the session's kernel, bridge and conversation),
            or None.
    """

    journal: RunJournal | None = None
    listeners: Sequence[Callable[[dict], None]] = ()
    on_progress: Callable[[str], None] | None = None
    cancel: Any = None
    session: Any = None

    @classmethod
    def from_options(cls, o: Mapping[str, Any], journal: RunJournal | None) -> "RunHooks":
        """The hooks among validated keyword options ``o`` (``listeners``, ``on_progress``,
        ``cancel``), with the journal the caller opened."""
        return cls(journal=journal, listeners=tuple(o.get("listeners") or ()),
                   on_progress=o.get("on_progress"), cancel=o.get("cancel"))
