"""Errors of the bookkeeping layer. ``harness`` imports nothing from ``rlm`` or ``kernels``."""
from __future__ import annotations


class HarnessError(Exception):
    """Base class of bookkeeping errors."""

    exit_code = 1


class IllegalTransition(HarnessError):
    """A stage transition not in the table, or whose expected prior status did not match.

    Raised before anything changes: the stage and the journal are left as they were.
    """


class BudgetExceeded(HarnessError):
    """A call was refused (never sent) because it would break a budget cap.

    Attributes:
        cap: which cap: ``"cost"`` (USD), ``"tokens"``, ``"calls"``, ``"wall"`` (seconds),
            ``"iterations"``, ``"depth"``, ``"children"``.
        limit: the cap's value, in its unit.
        used: settled spend so far plus outstanding reservations, in the cap's unit.
        requested: what this call would have reserved, in the cap's unit.
        remaining: ``max(limit - used, 0)``.
    """

    exit_code = 5

    def __init__(self, cap: str, limit: float, used: float, requested: float = 0.0,
                 message: str | None = None) -> None:
        self.cap = cap
        self.limit = limit
        self.used = used
        self.requested = requested
        self.remaining = max(limit - used, 0)
        if message is None and cap == "wall":
            message = (f"budget cap 'wall' reached: the run's wall-clock limit is {limit:g} s "
                       f"and {used:.1f} s have passed")
        super().__init__(message or (
            f"budget cap '{cap}' would be exceeded: limit {limit:g}, used {used:g}, "
            f"this call needs {requested:g}, remaining {self.remaining:g}"))


class DivergenceError(HarnessError):
    """Resume or replay met a model call whose request differs from the journal's record,
    a call the journal does not hold (strict replay), or a different final answer (exit 6).

    Nothing is served from the journal for the diverging call.
    """

    exit_code = 6


class RunActiveError(HarnessError):
    """A run id names a run that is still running (its owner's heartbeat is fresh), or another
    process claimed it first: it is not a resume target (exit 2)."""

    exit_code = 2


class RunMismatchError(HarnessError):
    """A run id was given with another query or another context than the ones it was recorded
    with: a run id names one question about one context (exit 2)."""

    exit_code = 2


class UnfinishedToolCall(DivergenceError):
    """Resume met a tool call that started in an earlier attempt and never recorded its result,
    and the tool is not marked idempotent: calling it again could repeat its side effect, so the
    run stops here (at most once). ``call_id`` names the call's stage, ``tool`` the tool (exit 10).
    """

    exit_code = 10

    def __init__(self, call_id: str, tool: str, run_id: str) -> None:
        self.call_id, self.tool = call_id, tool
        super().__init__(
            f"tool call {call_id} ({tool}) of run {run_id} started before the crash and never "
            f"recorded its result, and {tool!r} is not marked idempotent, so resume will not "
            "call it again (it may have done its work already). Check in the system it acts on "
            f"whether that call took effect. If calling it again is safe, mark the tool "
            f"idempotent (rlm.tool(fn, idempotent=True) or read_only=True; from the CLI, "
            "`name = rlm.tool(fn, idempotent=True)` in your module and --tool module:name) "
            "and resume again; "
            "otherwise start a new run.")
