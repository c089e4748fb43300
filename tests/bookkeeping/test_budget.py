"""Tests of harness.budget.accountant and harness.budget.prices: caps under concurrency, settle/release, prices."""
from __future__ import annotations

import json
import random
import sys
import threading
import time

import pytest

from harness.budget.accountant import Accountant, Budget, Reservation, ReservationError
from harness.errors import BudgetExceeded, HarnessError
from harness.budget.prices import Price, PriceTable, PriceTableError, UnknownPrice


@pytest.fixture(autouse=True)
def _fast_thread_switching():
    """Switch threads very often so races surface in the concurrency tests."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def table() -> PriceTable:
    # 1 USD / 1M input tokens, 2 USD / 1M output tokens: reserve(1000, 500) = 0.002 USD
    return PriceTable({"m": Price(1.0, 2.0)}, builtin=False)


def sleepy_clock() -> float:
    """A monotonic clock that gives up the GIL. The accountant reads its clock (for the wall
    cap) after the other cap checks and before recording the reservation, so if the lock did
    not cover check-and-record, concurrent reservations would interleave right there."""
    time.sleep(0.0002)
    return time.monotonic()


def racy_accountant(**caps) -> Accountant:
    return Accountant(Budget(max_wall_seconds=3600, **caps), table(), clock=sleepy_clock)


def race(n: int, fn) -> tuple[list, list[BudgetExceeded]]:
    """Run ``fn()`` once in each of ``n`` threads released together."""
    barrier = threading.Barrier(n)
    ok, refused = [], []
    lock = threading.Lock()

    def run() -> None:
        barrier.wait()
        try:
            r = fn()
        except BudgetExceeded as e:
            with lock:
                refused.append(e)
        else:
            with lock:
                ok.append(r)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ok, refused


# ---------------------------------------------------------------------- Budget


@pytest.mark.parametrize("field", ["max_cost_usd", "max_tokens", "max_calls",
                                   "max_wall_seconds", "max_iterations", "max_depth",
                                   "max_children_per_call", "max_concurrency"])
def test_budget_rejects_negative_values(field):
    with pytest.raises(ValueError, match=field):
        Budget(**{field: -1})


def test_budget_validation_details():
    with pytest.raises(ValueError, match="max_iterations"):
        Budget(max_iterations=0)
    with pytest.raises(ValueError, match="max_concurrency"):
        Budget(max_concurrency=0)
    with pytest.raises(ValueError, match="max_cost_usd"):
        Budget(max_cost_usd=float("nan"))
    with pytest.raises(ValueError, match="max_tokens"):
        Budget(max_tokens=10.5)
    with pytest.raises(ValueError, match="max_calls"):
        Budget(max_calls=True)
    b = Budget(max_cost_usd=0, max_tokens=0, max_calls=0, max_depth=0)  # zero caps are valid
    assert Budget.from_dict(b.to_dict()) == b


def test_depth_semantics():
    assert not Budget(max_depth=0).subcalls_allowed
    b1 = Budget(max_depth=1)
    assert b1.subcalls_allowed and not b1.child_gets_kernel(0)  # rlm() at the root -> fallback
    b3 = Budget(max_depth=3)
    assert b3.child_gets_kernel(0) and b3.child_gets_kernel(1) and not b3.child_gets_kernel(2)


def test_children_cap():
    a = Accountant(Budget(max_children_per_call=4), table())
    a.check_children(0, 4)
    with pytest.raises(BudgetExceeded) as ei:
        a.check_children(2, 3)
    assert (ei.value.cap, ei.value.used, ei.value.requested) == ("children", 2, 3)
    assert a.refusals() == {"children": 1}


# ---------------------------------------------------------------------- concurrency: caps


def test_64_threads_calls_cap_admits_exactly_the_cap():
    a = racy_accountant(max_calls=32)
    ok, refused = race(64, lambda: a.reserve("m", 1000, 500))
    assert len(ok) == 32 and len(refused) == 32
    assert {e.cap for e in refused} == {"calls"}
    assert a.outstanding()["calls"] == 32
    for r in ok:
        a.settle(r, 1000, 500)
    assert a.totals()["calls"] == 32 <= 32
    assert a.outstanding() == {"reservations": 0, "calls": 0, "tokens": 0, "cost_usd": 0.0}


def test_64_threads_tokens_cap_admits_exactly_the_cap():
    per_call = 1000 + 500
    a = racy_accountant(max_tokens=per_call * 32 + per_call - 1)
    ok, refused = race(64, lambda: a.reserve("m", 1000, 500))
    assert len(ok) == 32
    assert {e.cap for e in refused} == {"tokens"}
    for r in ok:
        a.settle(r, 1000, 500)
    assert a.totals()["total_tokens"] == per_call * 32 <= a.budget.max_tokens
    assert a.overruns() == []


def test_64_threads_cost_cap_admits_exactly_the_cap():
    a = racy_accountant(max_cost_usd=0.065)  # 32 * 0.002 = 0.064 < 0.065 < 0.066
    ok, refused = race(64, lambda: a.reserve("m", 1000, 500))
    assert len(ok) == 32
    assert {e.cap for e in refused} == {"cost"}
    assert refused[0].requested == pytest.approx(0.002)
    for r in ok:
        assert a.settle(r, 1000, 500) == pytest.approx(0.002)
    assert a.totals()["cost_usd"] <= 0.065
    assert a.totals()["cost_usd"] == pytest.approx(0.064)


def test_cost_cap_boundary_is_exact():
    """A call costing exactly what is left is admitted; one pico-dollar more is not."""
    a = Accountant(Budget(max_cost_usd=0.3), PriceTable({"m": Price(0.1, 0.2)}, builtin=False))
    r = a.reserve("m", 1_000_000, 1_000_000)  # 0.1 + 0.2 = 0.3 USD exactly
    with pytest.raises(BudgetExceeded):
        a.reserve("m", 0, 1)  # 0.2 micro-USD more
    a.settle(r, 1_000_000, 1_000_000)
    assert a.totals()["cost_usd"] <= 0.3


def test_many_threads_reserve_settle_loops_never_exceed_caps():
    a = racy_accountant(max_calls=500, max_tokens=300_000, max_cost_usd=0.5)
    violations: list[str] = []
    stop = threading.Event()

    def monitor() -> None:
        while not stop.is_set():
            t = a.totals()
            if t["calls"] > 500 or t["total_tokens"] > 300_000 or t["cost_usd"] > 0.5:
                violations.append(repr(t))

    def worker(seed: int) -> None:
        rnd = random.Random(seed)
        while True:
            p, out = rnd.randint(100, 2000), rnd.randint(10, 1000)
            try:
                r = a.reserve("m", p, out)
            except BudgetExceeded:
                return
            if rnd.random() < 0.1:
                a.release(r)
            else:
                a.settle(r, p, rnd.randint(0, out))

    mon = threading.Thread(target=monitor)
    mon.start()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    mon.join()
    t = a.totals()
    assert not violations
    assert t["calls"] <= 500 and t["total_tokens"] <= 300_000 and t["cost_usd"] <= 0.5
    assert a.outstanding()["reservations"] == 0
    assert a.overruns() == []
    # the run really went to a cap (the test exercises refusals, not an idle accountant)
    assert sum(a.refusals().values()) >= 64


# ---------------------------------------------------------------------- settle / release


def test_release_frees_room_and_charges_nothing():
    a = Accountant(Budget(max_calls=1, max_tokens=2000), table())
    r = a.reserve("m", 1000, 500, stage_id="run/iteration-0/model_call-0")
    with pytest.raises(BudgetExceeded) as ei:
        a.reserve("m", 10, 10)
    assert ei.value.cap == "calls" and ei.value.used == 1
    a.release(r)
    assert r.state == "released"
    assert a.totals() == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
                          "calls": 0, "cost_usd": 0.0}
    r2 = a.reserve("m", 1000, 500)
    assert a.settle(r2, 900, 100) == pytest.approx((900 * 1 + 100 * 2) / 1e6)
    with pytest.raises(ReservationError):
        a.release(r)
    with pytest.raises(ReservationError):
        a.settle(r, 1, 1)


def test_settle_twice_raises_and_changes_nothing():
    a = Accountant(Budget(), table())
    r = a.reserve("m", 100, 100)
    a.settle(r, 100, 50)
    before = a.totals()
    with pytest.raises(ReservationError, match="already settled"):
        a.settle(r, 100, 50)
    with pytest.raises(ReservationError):
        a.release(r)
    assert a.totals() == before
    other = Accountant(Budget(), table())
    with pytest.raises(ReservationError, match="another accountant"):
        other.settle(a.reserve("m", 1, 1), 1, 1)


def test_settle_uses_reported_cost_when_given():
    a = Accountant(Budget(max_cost_usd=1.0), table())
    r = a.reserve("m", 1000, 500)
    assert a.settle(r, 1000, 400, reported_cost_usd=0.00123) == pytest.approx(0.00123)
    assert a.totals()["cost_usd"] == pytest.approx(0.00123)
    r = a.reserve("m", 1000, 500)
    assert a.settle(r, 1000, 400) == pytest.approx(0.0018)  # 1000*1 + 400*2 per 1e6
    assert a.totals()["cost_usd"] == pytest.approx(0.00303)
    assert r.charged_usd == pytest.approx(0.0018)


def test_provider_overrun_is_charged_and_noted():
    a = Accountant(Budget(max_tokens=1000), table())
    r = a.reserve("m", 100, 100, stage_id="s")
    a.settle(r, 150, 100)  # provider counted more prompt tokens than the caller
    assert a.totals()["total_tokens"] == 250
    (note,) = a.overruns()
    assert note["stage_id"] == "s" and note["reserved_tokens"] == 200
    assert note["actual_tokens"] == 250


def test_refusal_reports_cap_numbers():
    a = Accountant(Budget(max_tokens=1000), table())
    a.settle(a.reserve("m", 300, 300), 300, 300)
    held = a.reserve("m", 100, 100)
    with pytest.raises(BudgetExceeded) as ei:
        a.reserve("m", 150, 100)
    e = ei.value
    assert (e.cap, e.limit, e.used, e.requested, e.remaining) == ("tokens", 1000, 800, 250, 200)
    assert isinstance(e, HarnessError)
    assert a.remaining()["tokens"] == 200
    a.release(held)


# ---------------------------------------------------------------------- prices


def test_unknown_price_with_cost_cap_raises_at_check_prices():
    a = Accountant(Budget(max_cost_usd=1.0), PriceTable())
    a.check_prices(["gpt-4o", "local/qwen2.5-coder-0.5b"])
    with pytest.raises(UnknownPrice) as ei:
        a.check_prices(["gpt-4o", "mystery-model-7b"])
    msg = str(ei.value)
    assert "mystery-model-7b" in msg and "price file" in msg and "gpt-4o'" not in msg
    assert ei.value.models == ["mystery-model-7b"]
    with pytest.raises(UnknownPrice):
        a.reserve("mystery-model-7b", 10, 10)
    assert a.outstanding()["calls"] == 0


def test_unknown_price_without_cost_cap_is_allowed():
    a = Accountant(Budget(max_calls=5), PriceTable())
    a.check_prices(["mystery-model-7b"])
    r = a.reserve("mystery-model-7b", 10, 10)
    assert r.cost_usd == 0.0
    assert a.settle(r, 10, 5, reported_cost_usd=0.01) == pytest.approx(0.01)
    assert "mystery-model-7b" in a.unpriced_models()


def test_builtin_lookup_and_cost():
    p = PriceTable()
    assert p.lookup("gpt-4o") == Price(2.50, 10.00)
    assert p.lookup("gpt-4o-2024-08-06") == Price(2.50, 10.00)
    assert p.lookup("gpt-4o-mini-2024-07-18") == Price(0.15, 0.60)
    assert p.lookup("gpt-4o-mini") != p.lookup("gpt-4o")
    assert p.lookup("openai/gpt-4.1-mini") == Price(0.40, 1.60)
    assert p.lookup("claude-sonnet-4-20250514") == Price(3.0, 15.0)
    assert p.lookup("claude-3-5-haiku-latest") == Price(0.80, 4.00)
    assert p.lookup("no-such-model") is None
    assert p.lookup("local/anything") == Price(0.0, 0.0)
    assert PriceTable(local_models={"qwen2.5-coder"}).lookup("qwen2.5-coder") == Price(0, 0)
    assert p.cost("gpt-4o", 1_000_000, 1_000_000) == pytest.approx(12.5)
    assert p.cost("gpt-5-nano", 2_000_000, 0) == pytest.approx(0.10)
    with pytest.raises(UnknownPrice):
        p.cost("no-such-model", 1, 1)
    with pytest.raises(ValueError):
        Price(-1.0, 1.0)


def test_price_file_extends_and_overrides(tmp_path):
    f = tmp_path / "prices.json"
    f.write_text(json.dumps({"_source": "our contract, 2026-01",
                             "gpt-4o": {"input": 1.0, "output": 4.0},
                             "my-proxy-model": {"input": 0.5, "output": 1}}))
    p = PriceTable().load(f)
    assert p.lookup("gpt-4o") == Price(1.0, 4.0)
    assert p.lookup("gpt-4o-2024-11-20") == Price(1.0, 4.0)
    assert p.lookup("my-proxy-model") == Price(0.5, 1.0)
    assert p.lookup("gpt-4.1") == Price(2.0, 8.0)  # built-ins kept
    assert PriceTable.from_file(f).lookup("my-proxy-model") == Price(0.5, 1.0)


@pytest.mark.parametrize("content,needle", [
    (None, "not found"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "top level"),
    ('{"m": 3}', "expected an object"),
    ('{"m": {"input": 1}}', "missing"),
    ('{"m": {"input": 1, "output": -2}}', "usd_per_mtok_output"),
    ('{"m": {"input": "1", "output": 2}}', "usd_per_mtok_input"),
    ('{"m": {"input": 1, "output": 2, "cached": 0.1}}', "unknown key"),
])
def test_price_file_errors(tmp_path, content, needle):
    f = tmp_path / "prices.json"
    if content is not None:
        f.write_text(content)
    p = PriceTable()
    with pytest.raises(PriceTableError, match=needle) as ei:
        p.load(f)
    assert str(f) in str(ei.value)
    assert isinstance(ei.value, HarnessError)


def test_price_file_is_all_or_nothing(tmp_path):
    f = tmp_path / "prices.json"
    f.write_text('{"ok-model": {"input": 1, "output": 1}, "bad": {"input": 1}}')
    p = PriceTable()
    with pytest.raises(PriceTableError):
        p.load(f)
    assert p.lookup("ok-model") is None


# ---------------------------------------------------------------------- wall clock


class FakeClock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


def test_wall_cap_with_fake_clock():
    clock = FakeClock()
    a = Accountant(Budget(max_wall_seconds=10), table(), clock=clock)
    assert a.wall_remaining() == 10
    clock.t += 5
    a.check_wall()
    assert a.wall_remaining() == 5
    r = a.reserve("m", 1, 1)
    clock.t += 5  # exactly at the cap: still allowed (refused once elapsed > cap)
    a.check_wall()
    clock.t += 0.5
    with pytest.raises(BudgetExceeded) as ei:
        a.check_wall()
    assert (ei.value.cap, ei.value.limit, ei.value.used) == ("wall", 10, 10.5)
    with pytest.raises(BudgetExceeded) as ei:
        a.reserve("m", 1, 1)
    assert ei.value.cap == "wall"
    assert a.wall_remaining() == 0
    a.settle(r, 1, 1)  # a call in flight can still be settled after the wall cap
    a.start()
    assert a.wall_remaining() == 10
    a.reserve("m", 1, 1)
    assert Accountant(Budget(), table(), clock=clock).wall_remaining() is None


def test_reservation_object():
    a = Accountant(Budget(), table())
    r = a.reserve("m", 1000, 500, stage_id="run/x")
    assert isinstance(r, Reservation)
    assert (r.tokens, r.state, r.stage_id) == (1500, "outstanding", "run/x")
    assert r.cost_usd == pytest.approx(0.002)
    assert a.outstanding() == {"reservations": 1, "calls": 1, "tokens": 1500,
                               "cost_usd": pytest.approx(0.002)}
    with pytest.raises(ValueError):
        a.reserve("m", -1, 0)
