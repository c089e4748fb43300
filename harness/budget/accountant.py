"""Budget caps and the accountant that admits or refuses every model call.

One :class:`Accountant` per run tree, in the host, behind one lock. Every model call is
*reserved* before it is sent (its counted prompt tokens plus its output cap, priced from the
:class:`~harness.budget.prices.PriceTable`) and *settled* with the provider's reported usage afterwards,
or *released* if the call never produced usage. A reservation that would take settled spend plus
outstanding reservations past any cap is refused with
:class:`~harness.errors.BudgetExceeded` and the call is never sent, so spend stays within the caps
however many threads reserve at once.

Why that bound holds, and where it stops: a settled call is charged ``prompt_tokens *
input_price + completion_tokens * output_price``. Since the provider stops at the output cap,
``completion_tokens <= max_output_tokens``, and as long as the caller's prompt count is not below
the provider's, each settlement is at most its reservation; the admission check already counted
the reservation, so settled spend never passes a cap. If a provider reports more than was reserved
(more prompt tokens than the caller counted, a reported cost above the price table's, output past
the cap), the accountant charges what was reported (spend must be true), logs a warning and
records the event in :meth:`Accountant.overruns`; the caps then hold only up to that misreport.
Callers should count prompt tokens generously (include the chat template overhead).

**Calibrated reservations** (``Accountant(..., calibrate=True)``, what a run uses) close that
gap. The accountant learns, per model, the worst ratio seen of what the provider reported to
what was estimated: prompt tokens over the counted prompt, completion tokens over the output cap
(when a provider runs past it), charged cost over the price table's cost of the reported tokens.
Every reservation is the estimate times the worst ratio seen plus :data:`RATIO_MARGIN` (never
below the estimate itself); before a model's first settled call it uses the conservative priors
:data:`PRIOR_PROMPT_RATIO` and :data:`PRIOR_COST_RATIO`. A call is admitted only if that worst
case fits under every cap beside the settled spend and the other outstanding reservations, so the
provider-reported spend stays within the caps as long as no call exceeds the worst ratio seen so
far (plus the margin, or the priors before the first settlement); when a call does, it is charged
in full, noted in :meth:`Accountant.overruns`, and every later reservation uses the new ratio.
Without reported usage, the spend is the local estimate, which never exceeds its reservation.

**Across attempts** (:meth:`Accountant.carry_over`): a resumed run starts from the spend its
journal recorded: settled calls at their usage, a call that was sent but has no recorded
settlement (the process died with it in flight) at its reservation.

Costs are kept internally as integer pico-USD (1e-12 USD), so sums are exact and order
independent: no floating-point drift can admit a call past a cost cap. Prices are rounded to
1e-12 USD per token (i.e. to 1e-6 USD per million tokens).

Replayed calls cost nothing and count nothing: the caller does not reserve them.

This module is pure standard library and imports nothing from ``rlm`` or ``kernels``.
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from harness.errors import BudgetExceeded
from harness.budget.prices import PriceTable, UnknownPrice

__all__ = ["Budget", "Accountant", "Reservation", "ReservationError", "PUSD_PER_USD",
           "ConcurrencyGate", "Permit", "RATIO_MARGIN", "PRIOR_PROMPT_RATIO", "PRIOR_COST_RATIO"]

log = logging.getLogger(__name__)

from harness.budget.caps import (CAPS, PUSD_PER_USD, Budget, ConcurrencyGate,  # noqa: F401
                                 Permit, Reservation, ReservationError, _usd_to_pusd_floor)


#: Calibrated reservations: added (as a fraction) to the worst reported/estimated ratio seen.
RATIO_MARGIN = 0.10
#: Calibrated reservations before a model's first settled call (a run sends that call alone,
#: see ``Accountant.calibrated``): the provider may count up to this many times the local
#: prompt-token estimate...
PRIOR_PROMPT_RATIO = 1.1
#: ... and charge up to this many times the price table's cost.
PRIOR_COST_RATIO = 1.1


class Accountant:
    """Admits or refuses model calls against a :class:`Budget`; one per run tree; thread-safe.

    Args:
        budget: the caps (:class:`Budget`).
        prices: model prices (:class:`~harness.budget.prices.PriceTable`); the built-in table if
            ``None``.
        clock: monotonic clock in seconds (float) for the wall cap; ``time.monotonic`` by
            default. Time zero is construction, or the last :meth:`start`.
        calibrate: reserve calibrated upper bounds instead of the bare estimates (see the
            module docstring); ``margin``: the fraction added to the worst ratio seen.

    Attributes:
        concurrency: a :class:`ConcurrencyGate` of ``budget.max_concurrency`` places; hold one
            (``gate.acquire()``, or ``with acct.concurrency:``) around each model call in flight.
    """

    def __init__(self, budget: Budget, prices: PriceTable | None = None,
                 clock: Callable[[], float] = time.monotonic, *, calibrate: bool = False,
                 margin: float = RATIO_MARGIN) -> None:
        self.budget = budget
        self._calibrate = calibrate
        self._margin = float(margin)
        # per model: worst reported/estimated ratio seen, per "prompt", "output", "cost"
        self._ratios: dict[str, dict[str, float]] = {}
        self._carried: dict | None = None
        self.prices = prices if prices is not None else PriceTable()
        self._clock = clock
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._t0 = clock()
        # caps in internal units
        self._cap_calls = budget.max_calls
        self._cap_tokens = budget.max_tokens
        self._cap_pusd = (None if budget.max_cost_usd is None
                          else _usd_to_pusd_floor(budget.max_cost_usd))
        self._cap_wall = budget.max_wall_seconds
        self._cap_tools = budget.max_tool_calls
        self._tools = 0  # tool calls admitted (this attempt and carried-over ones)
        # settled
        self._prompt = 0
        self._completion = 0
        self._calls = 0
        self._pusd = 0
        # outstanding
        self._o_calls = 0
        self._o_tokens = 0
        self._o_pusd = 0
        self._outstanding: dict[int, Reservation] = {}
        self._refusals: dict[str, int] = {}
        self._overruns: list[dict] = []
        self._unpriced: set[str] = set()
        self.concurrency = ConcurrencyGate(budget.max_concurrency)

    # ------------------------------------------------------------------ setup / wall clock

    def start(self) -> None:
        """Mark time zero for the wall cap (now, by the accountant's clock)."""
        with self._lock:
            self._t0 = self._clock()

    def elapsed(self) -> float:
        """Seconds since time zero (float)."""
        return self._clock() - self._t0

    def wall_remaining(self) -> float | None:
        """Seconds left before the wall cap (float >= 0), ``None`` without a wall cap."""
        if self._cap_wall is None:
            return None
        return max(self._cap_wall - self.elapsed(), 0.0)

    def check_wall(self) -> None:
        """Raise ``BudgetExceeded("wall", limit_s, elapsed_s)`` once elapsed > the wall cap."""
        if self._cap_wall is not None:
            el = self.elapsed()
            if el > self._cap_wall:
                self._refuse("wall")
                raise BudgetExceeded("wall", self._cap_wall, el, 0.0)

    def check_prices(self, models: Iterable[str]) -> None:
        """Fail fast at run start: with a cost cap set, every model must have a price.

        Args:
            models: model names the run may call (root model, sub-call model, ...).

        Raises:
            UnknownPrice: naming every unpriced model and how to add a price file.
        """
        missing = [m for m in models if self.prices.lookup(m) is None]
        if missing and self._cap_pusd is not None:
            raise UnknownPrice(missing)
        self._unpriced.update(missing)

    # ------------------------------------------------------------------ reserve / settle

    def _standing(self, cap: str, tokens: int, cost_pusd: int) -> tuple:
        """``(limit, used, asked)`` of the cap named ``cap`` (see :data:`CAPS`) for a call
        reserving ``tokens`` and ``cost_pusd``, in the accountant's units (cost in pico-USD);
        ``limit`` None: no such cap. The wall clock asks nothing: its used is the elapsed time.
        Call with the lock held."""
        if cap == "calls":
            return self._cap_calls, self._calls + self._o_calls, 1
        if cap == "tokens":
            return self._cap_tokens, self._prompt + self._completion + self._o_tokens, tokens
        if cap == "cost":
            return self._cap_pusd, self._pusd + self._o_pusd, cost_pusd
        if cap == "tool_calls":  # a model call asks none of it
            return self._cap_tools, self._tools, 0
        return self._cap_wall, self._clock() - self._t0, 0.0

    def reserve(self, model: str, prompt_tokens: int, max_output_tokens: int,
                stage_id: str | None = None) -> Reservation:
        """Admit one model call, holding room for its worst case, or refuse it.

        Args:
            model: model name (str), priced through the price table.
            prompt_tokens: counted input tokens (int >= 0; count with tiktoken beforehand).
            max_output_tokens: the call's output cap (int >= 0) as sent to the provider.
            stage_id: the stage making the call (str | None), for reports.

        Reserves 1 call, ``prompt_tokens + max_output_tokens`` tokens and their price in USD;
        with ``calibrate`` each part times the model's worst ratio seen plus the margin (the
        priors before its first settlement), never less than the estimate.

        Returns:
            A :class:`Reservation` to :meth:`settle` or :meth:`release` exactly once.

        Raises:
            BudgetExceeded: with ``cap`` ``"calls"``, ``"tokens"``, ``"cost"`` or ``"wall"``
                (checked in that order) if settled + outstanding + this request would exceed it.
                Nothing is recorded.
            UnknownPrice: a cost cap is set and ``model`` has no price.
            ValueError: negative token counts.
        """
        if prompt_tokens < 0 or max_output_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got prompt_tokens={prompt_tokens}, "
                             f"max_output_tokens={max_output_tokens}")
        price = self.prices.lookup(model)
        if price is None:
            if self._cap_pusd is not None:
                raise UnknownPrice([model])
            pin = pout = None
        else:
            pin = round(price.usd_per_mtok_input * 1_000_000)
            pout = round(price.usd_per_mtok_output * 1_000_000)
        with self._lock:
            rp, ro, cost_factor = self._bounds(model, prompt_tokens, max_output_tokens)
            cost = 0 if pin is None else pin * rp + pout * ro
            if cost_factor != 1.0:
                cost = math.ceil(cost * cost_factor)
            tokens = rp + ro
            for cap in CAPS:
                limit, used, asked = self._standing(cap.name, tokens, cost)
                if limit is not None and used + asked > limit:
                    self._refusals[cap.name] = self._refusals.get(cap.name, 0) + 1
                    if cap.name == "cost":  # held in pico-USD, reported in USD
                        raise BudgetExceeded("cost", self.budget.max_cost_usd,
                                             used / PUSD_PER_USD, asked / PUSD_PER_USD)
                    raise BudgetExceeded(cap.name, limit, used, asked)
            r = Reservation(next(self._ids), model, stage_id, prompt_tokens, max_output_tokens,
                            cost, self, pin, pout, rp, ro)
            self._o_calls += 1
            self._o_tokens += tokens
            self._o_pusd += cost
            self._outstanding[r.id] = r
            if pin is None:
                self._unpriced.add(model)
            return r

    def _bounds(self, model: str, prompt_tokens: int,
                max_output_tokens: int) -> tuple[int, int, float]:
        """(reserved prompt tokens, reserved output tokens, cost factor) for one call. Lock held."""
        if not self._calibrate:
            return prompt_tokens, max_output_tokens, 1.0
        seen = self._ratios.get(model)
        grow = 1.0 + self._margin
        if seen is None:
            fp, fo, fc = PRIOR_PROMPT_RATIO, 1.0, PRIOR_COST_RATIO
        else:
            fp = max(1.0, seen.get("prompt", PRIOR_PROMPT_RATIO / grow) * grow)
            fo = seen.get("output", 1.0)
            fo = fo * grow if fo > 1.0 else 1.0
            fc = seen.get("cost", PRIOR_COST_RATIO / grow)
            fc = fc * grow if fc > 1.0 else 1.0  # a margin only over a provider's own markup
        return (math.ceil(prompt_tokens * fp), math.ceil(max_output_tokens * fo), fc)

    def _observe(self, model: str, est_prompt: int, max_output: int, prompt_tokens: int,
                 completion_tokens: int, charged_pusd: int, pin: int | None,
                 pout: int | None, reported_cost: bool = True) -> None:
        """Learn the worst reported/estimated ratios of ``model`` from one settled call.
        Lock held."""
        seen = self._ratios.setdefault(model, {})

        def worse(key: str, value: float) -> None:
            if value > seen.get(key, 0.0):
                seen[key] = value
        if est_prompt > 0:
            worse("prompt", prompt_tokens / est_prompt)
        if max_output > 0:
            worse("output", completion_tokens / max_output)
        if reported_cost and pin is not None and pout is not None:
            table = pin * prompt_tokens + pout * completion_tokens
            if table > 0:
                worse("cost", charged_pusd / table)
        seen.setdefault("cost", 1.0)  # charged from the table: no markup

    def calibrated(self, model: str) -> bool:
        """True once a call of ``model`` settled (here, or in a carried-over attempt): its
        reservations use learned ratios, not the priors. Until then a run sends its calls of
        that model one at a time, so at most one call rests on the priors."""
        with self._lock:
            return model in self._ratios

    def ratios(self) -> dict[str, dict[str, float]]:
        """Per model, the worst reported/estimated ratio seen so far: ``{"prompt", "output",
        "cost"}`` (floats; a key is missing until a call measured it)."""
        with self._lock:
            return {m: dict(r) for m, r in self._ratios.items()}

    def carry_over(self, records: Iterable[Mapping[str, Any]]) -> dict:
        """Start from the spend recorded by earlier attempts of the same run (a resume).

        Args:
            records: one mapping per reservation an earlier attempt made (the journal's
                ``spend``): ``model``, ``state`` (``"settled"``, ``"released"`` or
                ``"open"``: sent, no settlement recorded), ``reserved`` and ``settled``
                (``{"calls", "prompt_tokens", "completion_tokens", "cost_usd"}``), ``estimate``
                (``{"prompt_tokens", "max_output_tokens"}``).

        A settled call counts at its settled usage (and its ratios are learned); an open one at
        its reservation; a released one not at all. Call before any reservation.

        Returns:
            what was carried over: ``{"calls", "prompt_tokens", "completion_tokens",
            "cost_usd", "open"}`` (``open``: calls counted at their reservation).
        """
        carried = {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "pusd": 0, "open": 0}
        with self._lock:
            for rec in records:
                state = rec.get("state")
                if state == "settled":
                    use = rec.get("settled") or {}
                elif state == "open":
                    use = rec.get("reserved") or {}
                    carried["open"] += 1
                else:
                    continue
                pt = int(use.get("prompt_tokens") or 0)
                ct = int(use.get("completion_tokens") or 0)
                pusd = round(float(use.get("cost_usd") or 0.0) * PUSD_PER_USD)
                carried["calls"] += int(use.get("calls", 1) or 0)
                carried["prompt_tokens"] += pt
                carried["completion_tokens"] += ct
                carried["pusd"] += pusd
                if state == "settled" and self._calibrate:
                    est = rec.get("estimate") or {}
                    price = self.prices.lookup(str(rec.get("model") or ""))
                    pin = pout = None
                    if price is not None:
                        pin = round(price.usd_per_mtok_input * 1_000_000)
                        pout = round(price.usd_per_mtok_output * 1_000_000)
                    self._observe(str(rec.get("model") or ""), int(est.get("prompt_tokens") or 0),
                                  int(est.get("max_output_tokens") or 0), pt, ct, pusd, pin, pout)
            self._calls += carried["calls"]
            self._prompt += carried["prompt_tokens"]
            self._completion += carried["completion_tokens"]
            self._pusd += carried["pusd"]
            out = {"calls": carried["calls"], "prompt_tokens": carried["prompt_tokens"],
                   "completion_tokens": carried["completion_tokens"],
                   "cost_usd": carried["pusd"] / PUSD_PER_USD, "open": carried["open"]}
            self._carried = out
            return dict(out)

    def carried(self) -> dict | None:
        """What :meth:`carry_over` counted (None for a first attempt)."""
        with self._lock:
            return None if self._carried is None else dict(self._carried)

    def _take(self, r: Reservation, action: str) -> None:
        """Drop an outstanding reservation's hold. Lock held."""
        if r._owner is not self:
            raise ReservationError(f"{r!r} belongs to another accountant")
        if r.state != "outstanding":
            raise ReservationError(f"cannot {action} {r!r}: it is already {r.state}")
        del self._outstanding[r.id]
        self._o_calls -= 1
        self._o_tokens -= r.tokens
        self._o_pusd -= r.cost_pusd

    def settle(self, reservation: Reservation, prompt_tokens: int, completion_tokens: int,
               reported_cost_usd: float | None = None) -> float:
        """Replace a reservation by the call's actual usage.

        Args:
            reservation: from :meth:`reserve`, still outstanding.
            prompt_tokens, completion_tokens: usage reported by the provider (int, tokens).
            reported_cost_usd: cost reported by the provider (float, USD), if any; it takes
                precedence over the price table.

        Returns:
            The cost charged (float, USD).

        Raises:
            ReservationError: the reservation was already settled or released (nothing changes).

        If the actual usage exceeds the reservation it is still charged in full, logged and
        recorded in :meth:`overruns` (see the module docstring).
        """
        if prompt_tokens < 0 or completion_tokens < 0:
            raise ValueError("token counts must be >= 0")
        if reported_cost_usd is not None:
            if not math.isfinite(reported_cost_usd) or reported_cost_usd < 0:
                raise ValueError(f"reported_cost_usd must be a finite number >= 0, "
                                 f"got {reported_cost_usd!r}")
            charged = round(reported_cost_usd * PUSD_PER_USD)
        elif reservation._pin is not None:
            charged = reservation._pin * prompt_tokens + reservation._pout * completion_tokens
        else:
            charged = 0
        tokens = prompt_tokens + completion_tokens
        with self._lock:
            self._take(reservation, "settle")
            reservation.state = "settled"
            self._prompt += prompt_tokens
            self._completion += completion_tokens
            self._calls += 1
            self._pusd += charged
            if self._calibrate:
                self._observe(reservation.model, reservation.prompt_tokens,
                              reservation.max_output_tokens, prompt_tokens, completion_tokens,
                              charged, reservation._pin, reservation._pout,
                              reported_cost_usd is not None)
            usd = charged / PUSD_PER_USD
            reservation.charged_usd = usd
            cost_over = charged > reservation.cost_pusd and (
                reservation._pin is not None or self._cap_pusd is not None)
            if tokens > reservation.tokens or cost_over:
                note = {"reservation": reservation.id, "model": reservation.model,
                        "stage_id": reservation.stage_id,
                        "reserved_tokens": reservation.tokens, "actual_tokens": tokens,
                        "reserved_cost_usd": reservation.cost_usd, "charged_cost_usd": usd}
                self._overruns.append(note)
                # only worth a warning when a cap depends on the reservation being an upper bound
                capped = (self._cap_tokens is not None or self._cap_pusd is not None)
                (log.warning if capped else log.debug)(
                    "provider reported more than was reserved; charged in full, caps "
                    "hold only up to this misreport: %s", note)
            return usd

    def release(self, reservation: Reservation) -> None:
        """Drop a reservation without charging (the call was never sent, or failed before the
        provider produced usage).

        Raises:
            ReservationError: the reservation was already settled or released.
        """
        with self._lock:
            self._take(reservation, "release")
            reservation.state = "released"

    # ------------------------------------------------------------------ other caps

    def check_children(self, started: int, requested: int = 1) -> None:
        """Before starting ``requested`` (int) more children from one call that has already
        started ``started`` (int).

        Raises:
            BudgetExceeded: ``cap="children"`` when ``started + requested`` would exceed
                ``max_children_per_call``.
        """
        cap = self.budget.max_children_per_call
        if cap is not None and started + requested > cap:
            self._refuse("children")
            raise BudgetExceeded("children", cap, started, requested)

    def admit_tool_call(self) -> None:
        """Count one call of a user's host tool before it is made, or refuse it.

        Raises:
            BudgetExceeded: ``cap="tool_calls"`` when it would pass ``max_tool_calls``
                (nothing is counted; the tool is not called).
        """
        with self._lock:
            cap = self._cap_tools
            if cap is not None and self._tools + 1 > cap:
                self._refusals["tool_calls"] = self._refusals.get("tool_calls", 0) + 1
                raise BudgetExceeded("tool_calls", cap, self._tools, 1)
            self._tools += 1

    def carry_over_tool_calls(self, calls: int) -> None:
        """Start from the ``calls`` (int) tool calls earlier attempts of the run made (a resume:
        the journal's ``tool_calls``, each attempt of a call counted)."""
        with self._lock:
            self._tools += int(calls)

    def tool_calls(self) -> int:
        """Tool calls counted so far (int: admitted here plus carried over)."""
        with self._lock:
            return self._tools

    def _refuse(self, cap: str) -> None:
        with self._lock:
            self._refusals[cap] = self._refusals.get(cap, 0) + 1

    # ------------------------------------------------------------------ reports

    def totals(self) -> dict:
        """Settled usage: ``{prompt_tokens, completion_tokens, total_tokens, calls,
        cost_usd}`` (ints, cost float USD)."""
        with self._lock:
            return {"prompt_tokens": self._prompt, "completion_tokens": self._completion,
                    "total_tokens": self._prompt + self._completion, "calls": self._calls,
                    "cost_usd": self._pusd / PUSD_PER_USD}

    def outstanding(self) -> dict:
        """Held by unsettled reservations: ``{reservations, calls, tokens, cost_usd}``."""
        with self._lock:
            return {"reservations": len(self._outstanding), "calls": self._o_calls,
                    "tokens": self._o_tokens, "cost_usd": self._o_pusd / PUSD_PER_USD}

    def remaining(self) -> dict:
        """Room left per cap (settled and outstanding both count), ``None`` where uncapped:
        ``{calls, tokens, cost_usd, wall_seconds}``."""
        with self._lock:
            calls = (None if self._cap_calls is None
                     else max(self._cap_calls - self._calls - self._o_calls, 0))
            tokens = (None if self._cap_tokens is None else
                      max(self._cap_tokens - self._prompt - self._completion - self._o_tokens, 0))
            cost = (None if self._cap_pusd is None else
                    max(self._cap_pusd - self._pusd - self._o_pusd, 0) / PUSD_PER_USD)
        return {"calls": calls, "tokens": tokens, "cost_usd": cost,
                "wall_seconds": self.wall_remaining()}

    def refusals(self) -> dict[str, int]:
        """Number of refusals per cap name."""
        with self._lock:
            return dict(self._refusals)

    def overruns(self) -> list[dict]:
        """Settlements that charged more than their reservation (provider misreports)."""
        with self._lock:
            return [dict(o) for o in self._overruns]

    def unpriced_models(self) -> set[str]:
        """Models used or checked without a price (their cost counts as 0 unless the provider
        reported one)."""
        with self._lock:
            return set(self._unpriced)
