"""The sweep's progress bar on stderr (rich): trials done/total, elapsed, ETA, spend.

The ETA is the trials still to run divided by this run's throughput (trials finished now per
second since the sweep started), counting down between finishes. It shows from the first
finished trial: rich's own estimate needs two finishes within 30 seconds, which trials of a
minute or more never give, so it stayed ``-:--:--`` to the end.
"""
from __future__ import annotations

import threading
import time

__all__ = ["eta_seconds", "ProgressBar"]


def eta_seconds(elapsed: float, finished: int, remaining: int) -> float | None:
    """Seconds until the last trial finishes, at this run's pace.

    Args:
        elapsed: seconds since this run's first trial started, when the last one finished.
        finished: trials finished by this run (skipped ones not counted).
        remaining: trials still to finish.
    Returns:
        ``elapsed / finished * remaining`` (seconds), or None before the first finish.
    """
    if finished <= 0:
        return None
    return max(0.0, elapsed / finished * remaining)


def format_eta(seconds: float | None) -> str:
    """``h:mm:ss`` of ``seconds`` (rounded), or ``-:--:--`` for None."""
    if seconds is None:
        return "-:--:--"
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def _eta_column():
    from rich.progress import ProgressColumn
    from rich.text import Text

    class EtaColumn(ProgressColumn):
        """``ETA h:mm:ss`` from the task's ``eta_at`` field (a ``time.monotonic()`` instant,
        or None before the first finish), counting down as it renders."""

        def render(self, task) -> Text:
            at = task.fields.get("eta_at")
            left = None if at is None else max(0.0, at - time.monotonic())
            return Text(f"ETA {format_eta(left)}", style="progress.remaining")

    return EtaColumn()


class ProgressBar:
    """A context manager showing the sweep's progress on stderr; does nothing when disabled.

    Args:
        enabled: show it. total: trials in the grid. done: trials already recorded (skipped).
        console: the rich Console to draw on (default one on stderr).
    """

    def __init__(self, enabled: bool, total: int, done: int, console=None) -> None:
        self.enabled, self.total, self.done = enabled, total, done
        self.console = console
        self.finished = 0
        self.started = time.monotonic()
        self._progress = None
        self._task = None
        self._lock = threading.Lock()

    def __enter__(self) -> "ProgressBar":
        self.started = time.monotonic()
        if self.enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn)
            self._progress = Progress(
                TextColumn("[rlm eval] trials"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), _eta_column(),
                TextColumn("spent ${task.fields[spend]:.4f}"),
                console=self.console or Console(stderr=True))
            self._progress.start()
            self._task = self._progress.add_task("trials", total=self.total,
                                                 completed=self.done, spend=0.0, eta_at=None)
        return self

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left at this run's pace (:func:`eta_seconds`), or None before a finish."""
        now = time.monotonic() if now is None else now
        remaining = self.total - self.done - self.finished
        return eta_seconds(now - self.started, self.finished, remaining)

    def advance(self, spend: float) -> None:
        """One more trial finished; ``spend``: USD spent by this run so far."""
        with self._lock:
            self.finished += 1
            now = time.monotonic()
            left = self.eta(now)
            if self._progress is not None:
                self._progress.update(self._task, advance=1, spend=spend,
                                      eta_at=None if left is None else now + left)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
