"""The caps of a run tree and the pieces the accountant hands out: :class:`Budget` (every cap,
in one place), :class:`Reservation` (what one admitted call may spend) and
:class:`ConcurrencyGate` (model calls and children in flight). The accountant that admits and
settles calls against them is :class:`harness.budget.accountant.Accountant`.

Pure standard library; imports nothing from ``rlm`` or ``kernels``.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass, fields
from decimal import Decimal
from typing import Any, Callable, Mapping

from harness.errors import HarnessError

__all__ = ["Budget", "Reservation", "ReservationError", "ConcurrencyGate", "Permit",
           "PUSD_PER_USD", "Cap", "CAPS", "CAP_BY_NAME"]

#: pico-USD per USD: the accountant's internal cost unit is 1e-12 USD.
PUSD_PER_USD = 10 ** 12


@dataclass(frozen=True)
class Cap:
    """One spend cap of a run tree, as every part that enforces, checks or shows caps reads it.

    Attributes:
        field: the :class:`Budget` attribute and keyword option (``"max_tokens"``).
        name: the cap's name in ``BudgetExceeded.cap``, ``Result.cap`` and ``rlm serve``'s error
            ``code`` (``"tokens"``).
        unit: what it counts (``"tokens"``, ``"USD"``, ``"calls"``, ``"s"``).
        http_status: ``rlm serve``'s status for a run the cap stopped (402 Payment Required; 504
            Gateway Timeout for the wall clock).
        per_call: what one journaled model call's usage dict adds to the total (``rlm verify``
            sums it over the run's calls), or None for a cap not counted in calls (wall).
        slack: ``rlm verify`` allows one call's amount beyond the cap (an amount the accountant
            reserves from an estimate; a call count is exact).
    """

    field: str
    name: str
    unit: str
    http_status: int
    per_call: Callable[[Mapping[str, Any]], float] | None
    slack: bool


def _call_tokens(u: Mapping[str, Any]) -> float:
    return (u.get("prompt_tokens") or 0) + (u.get("completion_tokens") or 0)


#: The cap table, in the order the accountant checks a reservation against them. A new cap is one
#: entry here, one :class:`Budget` field and one option (:mod:`rlm.config.options`); the
#: accountant says what it has used of it (``Accountant._standing``).
CAPS: tuple[Cap, ...] = (
    Cap("max_calls", "calls", "calls", 402, lambda u: 1, False),
    Cap("max_tokens", "tokens", "tokens", 402, _call_tokens, True),
    Cap("max_cost_usd", "cost", "USD", 402, lambda u: u.get("cost_usd") or 0.0, True),
    Cap("max_wall_seconds", "wall", "s", 504, None, False),
    # calls of the user's host tools (rlm.tools): counted per call admitted, never by model calls
    Cap("max_tool_calls", "tool_calls", "calls", 402, None, False),
)
CAP_BY_NAME = {cap.name: cap for cap in CAPS}


def _usd_to_pusd_floor(usd: float) -> int:
    """Largest integer pico-USD not above the decimal value ``repr(usd)`` (for caps)."""
    return int((Decimal(repr(float(usd))) * PUSD_PER_USD).to_integral_value(rounding="ROUND_FLOOR"))


@dataclass
class Budget:
    """Caps for one run tree. ``None`` means "no cap".

    Attributes:
        max_cost_usd: total cost cap (float, USD).
        max_tokens: total prompt + completion tokens cap (int, tokens).
        max_calls: total model calls cap (int, calls).
        max_wall_seconds: wall-clock cap from the accountant's start (float, seconds).
        max_iterations: iterations per loop, root or child (int >= 1, default 20).
        max_depth: kernel-bearing levels (int >= 0, default 1): ``rlm(...)`` at level L starts a
            child kernel when ``L + 1 < max_depth``, else is a plain completion; at 0 the root
            may make no sub-calls at all.
        max_children_per_call: children one call may start (int >= 0 | None).
        max_concurrency: model calls in flight at once (int >= 1, default 8).
        max_tool_calls: calls of the user's host tools over the whole tree (int >= 0 | None).

    Raises:
        ValueError: a negative, non-finite or wrongly typed value (message names the field).
    """

    max_cost_usd: float | None = None
    max_tokens: int | None = None
    max_calls: int | None = None
    max_wall_seconds: float | None = None
    max_iterations: int = 20
    max_depth: int = 1
    max_children_per_call: int | None = None
    max_concurrency: int = 8
    max_tool_calls: int | None = None

    _INTS = ("max_tokens", "max_calls", "max_iterations", "max_depth",
             "max_children_per_call", "max_concurrency", "max_tool_calls")
    _OPTIONAL = ("max_cost_usd", "max_tokens", "max_calls", "max_wall_seconds",
                 "max_children_per_call", "max_tool_calls")
    _MIN_ONE = ("max_iterations", "max_concurrency")

    def __post_init__(self) -> None:
        for f in fields(self):
            name, v = f.name, getattr(self, f.name)
            if v is None:
                if name in self._OPTIONAL:
                    continue
                raise ValueError(f"Budget.{name} may not be None")
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"Budget.{name} must be a number, got {v!r}")
            if name in self._INTS and not isinstance(v, int):
                if float(v).is_integer():
                    v = int(v)
                    setattr(self, name, v)
                else:
                    raise ValueError(f"Budget.{name} must be a whole number, got {v!r}")
            if not math.isfinite(v):
                raise ValueError(f"Budget.{name} must be finite, got {v!r}")
            if v < 0:
                raise ValueError(f"Budget.{name} must be >= 0, got {v!r}")
            if name in self._MIN_ONE and v < 1:
                raise ValueError(f"Budget.{name} must be >= 1, got {v!r}")

    @property
    def subcalls_allowed(self) -> bool:
        """``True`` if the root may call ``llm_query``/``rlm`` at all (``max_depth >= 1``)."""
        return self.max_depth >= 1

    def child_gets_kernel(self, level: int) -> bool:
        """For ``rlm(...)`` called at ``level`` (int): ``True`` if it starts a child with its own
        kernel (``level + 1 < max_depth``), ``False`` if it becomes a plain completion."""
        return level + 1 < self.max_depth

    def to_dict(self) -> dict:
        """All caps as a JSON-able dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Budget":
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        known = {f.name for f in fields(cls)}
        extra = set(d) - known
        if extra:
            raise ValueError(f"unknown Budget field(s) {sorted(extra)}")
        return cls(**dict(d))


class ReservationError(HarnessError):
    """A reservation was settled or released twice, or handed to the wrong accountant."""


class Reservation:
    """Room held for one model call between :meth:`Accountant.reserve` and
    :meth:`Accountant.settle` / :meth:`Accountant.release`.

    Attributes:
        id: sequence number within the accountant (int).
        model: model name (str). stage_id: stage the call belongs to (str | None).
        prompt_tokens, max_output_tokens: as passed to ``reserve`` (int, tokens).
        tokens: reserved tokens, ``prompt_tokens + max_output_tokens`` (int).
        cost_usd: reserved cost (float, USD; 0 for an unpriced model without a cost cap).
        state: ``"outstanding"``, ``"settled"`` or ``"released"``.
        charged_usd: cost charged by ``settle`` (float, USD | None).
    """

    __slots__ = ("id", "model", "stage_id", "prompt_tokens", "max_output_tokens", "tokens",
                 "reserved_prompt_tokens", "reserved_output_tokens",
                 "cost_pusd", "state", "charged_usd", "_owner", "_pin", "_pout")

    def __init__(self, id: int, model: str, stage_id: str | None, prompt_tokens: int,
                 max_output_tokens: int, cost_pusd: int, owner: object,
                 pin: int | None, pout: int | None, reserved_prompt_tokens: int | None = None,
                 reserved_output_tokens: int | None = None) -> None:
        self.id = id
        self.model = model
        self.stage_id = stage_id
        self.prompt_tokens = prompt_tokens
        self.max_output_tokens = max_output_tokens
        # what is held: the estimate itself, or its calibrated upper bound
        self.reserved_prompt_tokens = (prompt_tokens if reserved_prompt_tokens is None
                                       else reserved_prompt_tokens)
        self.reserved_output_tokens = (max_output_tokens if reserved_output_tokens is None
                                       else reserved_output_tokens)
        self.tokens = self.reserved_prompt_tokens + self.reserved_output_tokens
        self.cost_pusd = cost_pusd
        self.state = "outstanding"
        self.charged_usd: float | None = None
        self._owner = owner
        self._pin = pin
        self._pout = pout

    @property
    def cost_usd(self) -> float:
        """Reserved cost (float, USD)."""
        return self.cost_pusd / PUSD_PER_USD

    def to_dict(self) -> dict:
        """JSON-able summary."""
        return {"id": self.id, "model": self.model, "stage_id": self.stage_id,
                "prompt_tokens": self.prompt_tokens, "max_output_tokens": self.max_output_tokens,
                "reserved_prompt_tokens": self.reserved_prompt_tokens,
                "reserved_output_tokens": self.reserved_output_tokens,
                "tokens": self.tokens, "cost_usd": self.cost_usd, "state": self.state,
                "charged_usd": self.charged_usd}

    def __repr__(self) -> str:
        return (f"Reservation(id={self.id}, model={self.model!r}, stage_id={self.stage_id!r}, "
                f"tokens={self.tokens}, cost_usd={self.cost_usd:.6g}, state={self.state!r})")


class Permit:
    """One model call's place in a :class:`ConcurrencyGate`; :meth:`release` is idempotent, so
    whoever abandons the call (a cell's interrupt) may free the place before the call ends."""

    __slots__ = ("_gate", "_held")

    def __init__(self, gate: "ConcurrencyGate") -> None:
        self._gate = gate
        self._held = True

    def release(self) -> None:
        """Give the place back (once; later calls do nothing)."""
        self._gate._release(self)


class ConcurrencyGate:
    """At most ``n`` model calls in flight at once.

    :meth:`acquire` waits for a place, but never past a deadline and never once its ``cancel``
    (anything with ``is_set()``) is set. Also usable as ``with gate:`` (waits without bound).

    Args:
        n: places (int >= 1).
    """

    def __init__(self, n: int) -> None:
        self.n = max(1, int(n))
        self._cv = threading.Condition()
        self._used = 0
        self._local = threading.local()

    def acquire(self, cancel: Any = None, deadline: float | None = None) -> Permit | None:
        """A :class:`Permit`, or None if ``cancel`` was set or the ``time.monotonic()``
        ``deadline`` passed first."""
        with self._cv:
            while self._used >= self.n:
                if cancel is not None and cancel.is_set():
                    return None
                wait = 0.05 if cancel is not None else None
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    wait = left if wait is None else min(wait, left)
                self._cv.wait(wait)
            self._used += 1
            return Permit(self)

    def _release(self, permit: Permit) -> None:
        with self._cv:
            if permit._held:
                permit._held = False
                self._used -= 1
                self._cv.notify()

    def in_flight(self) -> int:
        """Places taken now (int)."""
        with self._cv:
            return self._used

    def __enter__(self) -> "ConcurrencyGate":
        permit = self.acquire()
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(permit)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._local.stack.pop().release()
