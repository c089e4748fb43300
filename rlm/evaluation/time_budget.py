"""``rlm eval --time-budget``: a sweep that fits the time it is given.

A grid of 5 tasks x 2 lengths x 5 methods x n = 5 is 250 trials; on a small machine with the
embedded model that is a day. Under a time budget the sweep runs the grid *breadth first*
(:func:`breadth_first`: every cell's first trial, then every cell's second, ...) and, before
starting a trial, asks :class:`TimeBudget` whether its cell's estimated time still fits. At
the budget, trials still running are cancelled (journaled ``cancelled``: the next run resumes
them from the journal, paying only for what had not been answered). The tables are written
from what finished, and the sweep says what was left (:meth:`TimeBudget.left_summary`).

Running the same command again continues: finished trials are skipped, so a long sweep
accumulates over several runs.

Estimates (:meth:`TimeBudget.estimate`): the mean wall time (``wall_s``, seconds) of the cell's
finished trials, from this run and earlier ones (``trials.jsonl``). A cell with none yet gets its
trial while any time is left: its first trials are what its estimate comes from (a trial that
then runs past the budget is cancelled there and resumes on the next run).
"""
from __future__ import annotations

import re
import threading
import time
from collections import defaultdict
from typing import Any, Iterable

from rlm.errors import ConfigError

__all__ = ["TimeBudget", "breadth_first", "cell_of", "parse_duration"]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


#: The longest ``--time-budget`` (seconds): a year.
MAX_BUDGET = 365 * 86400


def parse_duration(text: str, flag: str = "--time-budget") -> float:
    """Seconds in a duration such as ``"90m"``, ``"1h30m"``, ``"2h"``, ``"45s"`` or a bare
    number of seconds (``"5400"``); ``flag`` names the option in messages.

    Raises:
        ConfigError: anything else, or a duration that is not positive or is over
            :data:`MAX_BUDGET`.
    """
    s = str(text).strip().lower().replace(" ", "")
    try:
        seconds = float(s)
    except ValueError:
        pos, seconds = 0, 0.0
        for m in _PART.finditer(s):
            if m.start() != pos:
                break
            seconds += float(m.group(1)) * _UNITS[m.group(2)]
            pos = m.end()
        if pos != len(s) or not s:
            raise ConfigError(f"{flag}: {text!r} is not a duration; write it as 90m, "
                              "1h30m, 2h, 45s or a number of seconds") from None
    if not seconds > 0 or seconds != seconds:
        raise ConfigError(f"{flag} must be positive, got {text!r}")
    if seconds > MAX_BUDGET:  # inf or years: the clock arithmetic would overflow
        raise ConfigError(f"{flag} must be at most 365 days, got {text!r}; leave it out "
                          "for no limit")
    return seconds


def cell_of(axes: Any) -> tuple:
    """The cell a trial belongs to: its grid place without the seed and trial index
    (``(task, length, method, depth, profile, model)``). ``axes``: a spec's
    :meth:`~rlm.evaluation.trial.TrialSpec.axes` list, or a ``trials.jsonl`` record."""
    if isinstance(axes, dict):
        return (axes.get("task"), axes.get("length"), axes.get("method"), axes.get("depth"),
                axes.get("profile"), axes.get("model"))
    task, length, _seed, _trial, method, depth, profile, model = axes
    return (task, length, method, depth, profile, model)


def breadth_first(specs: Iterable[Any]) -> list:
    """``specs`` ordered so every cell gets its k-th trial before any gets its (k+1)-th:
    by trial index, then shortest length, then the grid's own order."""
    indexed = list(enumerate(specs))
    indexed.sort(key=lambda p: (p[1].trial, p[1].length, p[0]))
    return [s for _, s in indexed]


class TimeBudget:
    """Decides which trials still fit in ``seconds`` of wall time. Thread-safe.

    Args:
        seconds: the budget (s), counted from construction.
        recorded: earlier ``trials.jsonl`` records (their ``wall_s`` seed the estimates).

    Attributes:
        skipped: the trials :meth:`admit` refused (their specs), for :meth:`left_summary`.
    """

    def __init__(self, seconds: float, recorded: Iterable[dict] = ()) -> None:
        self.seconds = float(seconds)
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._times: dict[tuple, list[float]] = defaultdict(list)
        self.skipped: list[Any] = []
        self.cancelled = 0
        for rec in recorded:
            self.record(rec)

    def elapsed(self) -> float:
        """Seconds since the budget started."""
        return time.monotonic() - self.t0

    def remaining(self) -> float:
        """Seconds left (0.0 once spent)."""
        return max(0.0, self.seconds - self.elapsed())

    def record(self, rec: dict) -> None:
        """Take a finished trial's wall time (``rec["wall_s"]``, s) into its cell's estimate.
        Records without one (a trial that failed before it ran), and those cut short by the
        budget or by the model endpoint failing, teach nothing."""
        wall = rec.get("wall_s")
        if isinstance(wall, (int, float)) and wall >= 0 \
                and rec.get("failure") not in ("cancelled", "EndpointError"):
            with self._lock:
                self._times[cell_of(rec)].append(float(wall))

    def estimate(self, spec: Any) -> float | None:
        """Estimated seconds of ``spec``'s trial: the mean of its cell's finished trials, or
        None before the cell has one. Cells differ too much for one cell's time to stand for
        another's: measured here, one trial of a profile that looped to its iteration cap took
        1,081 s where a trial of another cell took 51 s."""
        with self._lock:
            own = self._times.get(cell_of(spec.axes()))
            return sum(own) / len(own) if own else None

    def admit(self, spec: Any) -> bool:
        """True if ``spec`` may start now: its estimate ends within the budget (with no
        estimate yet: some budget is left), and no cell was refused a trial of a lower index
        (rounds stay whole: no cell gets its (k+1)-th trial while one misses its k-th). A
        refused spec is kept in :attr:`skipped`."""
        left = self.remaining()
        est = self.estimate(spec)
        lowest = min((s.trial for s in self.skipped), default=None)
        ok = (left > 0 and (est is None or est <= left)
              and (lowest is None or spec.trial <= lowest))
        if not ok:
            self.skipped.append(spec)
        return ok

    def left_summary(self, not_started: Iterable[Any] = ()) -> str:
        """One paragraph for the user: how many trials were left, in how many cells, the
        cells' trials still missing, and how to continue."""
        left = list(self.skipped) + list(not_started)
        if not left and not self.cancelled:
            return ""
        cells: dict[tuple, int] = defaultdict(int)
        for spec in left:
            cells[cell_of(spec.axes())] += 1
        shown = ", ".join(f"{c[0]}@{c[1]} {c[2]}" + (f" d{c[3]}" if c[3] is not None else "")
                          + (f" {c[4]}" if c[4] else "") + f" ({n})"
                          for c, n in sorted(cells.items(), key=lambda p: str(p[0]))[:8])
        more = f" and {len(cells) - 8} more cells" if len(cells) > 8 else ""
        # Only the parts that happened: "0 trial(s) ... were not started: ;" reads as a bug.
        parts = [f"{len(left)} trial(s) in {len(cells)} cell(s) were not started: {shown}{more}"
                 ] if left else []
        if self.cancelled:
            parts.append(f"{self.cancelled} running trial(s) were cancelled at the budget and "
                         "resume from the journal")
        spent = f"{self.seconds:g} s" if self.seconds < 120 else f"{self.seconds / 60:.1f} min"
        return (f"the time budget ({spent}) is spent: {'; '.join(parts)}. Run the "
                "same command again to continue where this one stopped.")
