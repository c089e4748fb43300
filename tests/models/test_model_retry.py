"""The retry policy of the model clients (:mod:`rlm.models.retry`), piece by piece: Retry-After,
the wait, the composed stop, the first-attempt-then-tenacity call, the recorded attempt and the
deadline's error. No server: the pieces are plain functions and tenacity objects."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from tenacity import RetryCallState, Retrying, wait_fixed
from tenacity.stop import stop_any

from rlm.errors import EndpointError
from rlm.models.base import DeadlineExceeded
from rlm.models.retry import (MAX_RETRY_AFTER, RetryPolicy, attempt_timeout, deadline_error,
                              recorded_attempt, retry_after, retry_policy, stop_before_deadline,
                              stop_when_cancelled, wait_retry_after)


class Transient(Exception):
    """A failure the tests' predicate calls transient, with the response headers it carries."""

    def __init__(self, headers: dict | None = None):
        super().__init__("try again")
        self.response = SimpleNamespace(headers=headers or {})


class Fatal(Exception):
    pass


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, Transient)


def state(exc: BaseException | None = None, attempt: int = 1, sleep: float = 0.0):
    """A tenacity call state after a failed attempt ``attempt`` with ``exc``."""
    s = RetryCallState(retry_object=Retrying(), fn=None, args=(), kwargs={})
    s.attempt_number = attempt
    if exc is not None:
        s.set_exception((type(exc), exc, None))
    s.upcoming_sleep = sleep
    return s


@pytest.mark.parametrize("headers,expected", [
    ({"retry-after-ms": "300"}, 0.3), ({"retry-after": "2"}, 2.0),
    ({"retry-after-ms": "soon", "retry-after": "1.5"}, 1.5),
    ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, None), ({}, None)])
def test_retry_after_reads_the_response_headers(headers, expected):
    assert retry_after(Transient(headers)) == expected
    assert retry_after(Fatal()) is None  # no response at all


def test_the_wait_honours_retry_after_capped_and_jittered_else_backs_off():
    wait = wait_retry_after(wait_fixed(1.25))
    w = wait(state(Transient({"retry-after": "0.4"})))
    assert 0.4 <= w <= 0.45
    assert MAX_RETRY_AFTER <= wait(state(Transient({"retry-after": "9999"}))) \
        <= MAX_RETRY_AFTER + 0.05
    assert 0.0 <= wait(state(Transient({"retry-after": "-3"}))) <= 0.05
    assert wait(state(Transient())) == 1.25  # no header: the fallback's backoff
    assert wait(state()) == 1.25


def test_the_stop_is_composed_of_attempts_cancel_and_deadline():
    cancel = threading.Event()
    policy = retry_policy(3, is_transient, backoff=wait_fixed(0), cancel=cancel,
                          deadline=time.monotonic() + 5)
    assert isinstance(policy.stop, stop_any)  # stop_after_attempt(n) | ... | ...
    assert not policy.stop(state(Transient(), attempt=1))
    assert policy.stop(state(Transient(), attempt=3))
    assert not policy.deadline_stop.hit
    assert policy.stop(state(Transient(), attempt=1, sleep=10.0))  # would sleep past it
    assert policy.deadline_stop.hit
    cancel.set()
    fresh = retry_policy(3, is_transient, backoff=wait_fixed(0), cancel=cancel)
    assert fresh.stop(state(Transient(), attempt=1)) and not fresh.deadline_stop.hit


def test_the_stop_parts_alone():
    assert not stop_when_cancelled(None)(state())
    assert not stop_before_deadline(None)(state(sleep=1e9))
    past = stop_before_deadline(time.monotonic() - 1)
    assert past(state()) and past.hit


def test_the_first_attempt_is_made_without_tenacity_and_failures_are_retried():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise Transient()
        return "ok"
    policy = retry_policy(5, is_transient, backoff=wait_fixed(0))
    assert policy.call(flaky) == "ok" and len(calls) == 3
    calls.clear()
    assert policy.call(lambda: calls.append(1) or "once") == "once" and len(calls) == 1

    def always(exc):
        def f():
            calls.append(1)
            raise exc
        return f
    for exc, tries in ((Transient(), 5), (Fatal("no"), 1)):
        calls.clear()
        with pytest.raises(type(exc)) as ei:
            retry_policy(5, is_transient, backoff=wait_fixed(0)).call(always(exc))
        assert ei.value is exc and len(calls) == tries  # the last failure, as it was


def test_a_cancel_ends_the_retry_wait_at_once():
    cancel = threading.Event()
    threading.Timer(0.1, cancel.set).start()
    policy = retry_policy(5, is_transient, backoff=wait_fixed(30), cancel=cancel)
    t0 = time.monotonic()
    with pytest.raises(Transient):
        policy.call(lambda: (_ for _ in ()).throw(Transient()))
    assert time.monotonic() - t0 < 5
    assert isinstance(policy, RetryPolicy)


def test_a_recorded_attempt_records_logs_and_respects_cancel_and_deadline(caplog):
    attempts: list[dict] = []
    outcomes = iter([Transient(), "reply"])
    seen_timeouts = []

    def send(t):
        seen_timeouts.append(t)
        out = next(outcomes)
        if isinstance(out, Exception):
            raise out
        return out
    once = recorded_attempt(send, attempts, label="http://x", max_attempts=2,
                            transient=is_transient, timeout_error=TimeoutError, timeout=7.0)
    with caplog.at_level("INFO", logger="rlm"), pytest.raises(Transient):
        once()
    assert once() == "reply"
    assert [(a["n"], a["error"]) for a in attempts] == [(1, "Transient: try again"), (2, None)]
    assert seen_timeouts == [7.0, 7.0]
    assert "attempt 1 of 2, retrying" in caplog.records[0].getMessage()

    cancel = threading.Event()
    cancel.set()
    later = recorded_attempt(send, attempts, label="http://x", max_attempts=3,
                             transient=is_transient, timeout_error=TimeoutError, cancel=cancel)
    with pytest.raises(EndpointError, match="cancelled before attempt 3"):
        later()
    late = recorded_attempt(send, [], label="http://x", max_attempts=3, transient=is_transient,
                            timeout_error=TimeoutError, deadline=time.monotonic() - 1)
    with pytest.raises(TimeoutError):
        late()


def test_an_attempts_timeout_is_cut_to_the_deadline():
    assert attempt_timeout(5.0, None, TimeoutError) == 5.0
    assert attempt_timeout(None, None, TimeoutError) is None
    left = attempt_timeout(100.0, time.monotonic() + 2, TimeoutError)
    assert 1.5 < left <= 2.0
    assert 0 < attempt_timeout(None, time.monotonic() + 3, TimeoutError) <= 3.0
    with pytest.raises(TimeoutError):
        attempt_timeout(5.0, time.monotonic() - 0.1, TimeoutError)


def test_the_deadline_error_names_the_attempts_and_the_last_failure():
    policy = retry_policy(3, is_transient, backoff=wait_fixed(0), deadline=time.monotonic() + 60)
    attempts = [{"n": 1}, {"n": 2}]
    assert deadline_error(Transient(), policy, None, "http://x", attempts) is None
    assert deadline_error(Transient(), policy, time.monotonic() + 60, "http://x", attempts) is None
    policy.deadline_stop.hit = True
    err = deadline_error(Transient(), policy, time.monotonic() + 60, "http://x", attempts)
    assert isinstance(err, DeadlineExceeded) and isinstance(err, EndpointError)
    assert "after 2 attempt(s) (last: Transient: try again)" in str(err)
    fresh = retry_policy(3, is_transient, backoff=wait_fixed(0))
    assert isinstance(deadline_error(Fatal("x"), fresh, time.monotonic(), "u", []),
                      DeadlineExceeded)  # failing at the deadline is failing because of it
