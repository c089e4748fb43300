"""The retry policy of every model client, built from ``tenacity``'s parts.

A call is retried while its failure is transient (the provider's predicate: 429, 5xx,
timeouts, connection errors), at most ``max_attempts`` attempts in all, never past the call's
deadline and never once it is cancelled::

    stop  = stop_after_attempt(n) | stop_when_cancelled(cancel) | stop_before_deadline(deadline)
    wait  = wait_retry_after(fallback=wait_random_exponential(multiplier=0.5, max=20))
    retry = retry_if_exception(transient)

``wait_retry_after`` honours the server's ``Retry-After`` / ``retry-after-ms`` (capped at
:data:`MAX_RETRY_AFTER`, plus up to 50 ms of jitter) and otherwise backs off exponentially with
full jitter. tenacity computes the wait before it asks whether to stop, so
``stop_before_deadline`` sees the sleep it would take and stops rather than sleep past the
deadline; it remembers that it did (:attr:`stop_before_deadline.hit`), so the caller can say
the deadline ended the call.

:func:`recorded_attempt` wraps one provider send as an attempt: it cuts the attempt's timeout
to the deadline, refuses to start once cancelled, records ``{"n", "seconds", "error"}`` and
logs a transient failure. :meth:`RetryPolicy.call` runs the attempts: the first without
tenacity's machinery (most calls need one), the rest under :class:`tenacity.Retrying`.
:func:`deadline_error` is the :class:`~rlm.models.base.DeadlineExceeded` a call ends with when
the deadline, not the endpoint, ended it.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt
from tenacity.stop import stop_base
from tenacity.wait import wait_base

from rlm.errors import EndpointError
from rlm.models.base import DeadlineExceeded, short

log = logging.getLogger("rlm")

#: Longest honoured Retry-After (s); a server asking for more is waited on this long.
MAX_RETRY_AFTER = 30.0
#: Jitter added to a honoured Retry-After (s), so many callers told the same do not align.
RETRY_AFTER_JITTER = 0.05
#: A retry whose sleep would end this close to the deadline (s) is not made.
DEADLINE_MARGIN = 0.01
#: A call failing this close to its deadline (s) failed because of it.
DEADLINE_SLACK = 0.05


def retry_after(exc: BaseException) -> float | None:
    """The wait (s) a failed attempt's response asks for: ``retry-after-ms``, else
    ``retry-after`` in seconds; None when there is none (or it is an HTTP date)."""
    resp = getattr(exc, "response", None)
    headers = getattr(resp, "headers", None)
    if not headers:
        return None
    raw = headers.get("retry-after-ms")
    if raw is not None:
        try:
            return float(raw) / 1000.0
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        return None  # an HTTP date; fall back to backoff


class wait_retry_after(wait_base):  # noqa: N801 - named like tenacity's own waits
    """Wait what the server's ``Retry-After`` says (at most ``cap`` s, plus up to ``jitter``
    s), else what ``fallback`` says."""

    def __init__(self, fallback: wait_base, cap: float = MAX_RETRY_AFTER,
                 jitter: float = RETRY_AFTER_JITTER) -> None:
        self.fallback, self.cap, self.jitter = fallback, cap, jitter

    def __call__(self, retry_state: RetryCallState) -> float:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        after = retry_after(exc) if exc else None
        if after is not None:
            return min(max(after, 0.0), self.cap) + random.uniform(0, self.jitter)
        return self.fallback(retry_state)


class stop_when_cancelled(stop_base):  # noqa: N801
    """Stop once ``cancel`` (anything with ``is_set()``, or None) is set."""

    def __init__(self, cancel: Any) -> None:
        self.cancel = cancel

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.cancel is not None and self.cancel.is_set()


class stop_before_deadline(stop_base):  # noqa: N801
    """Stop when the upcoming sleep would end at or past ``deadline`` (a ``time.monotonic()``
    instant, or None for none); :attr:`hit` says it did."""

    def __init__(self, deadline: float | None, margin: float = DEADLINE_MARGIN) -> None:
        self.deadline, self.margin = deadline, margin
        self.hit = False

    def __call__(self, retry_state: RetryCallState) -> bool:
        if self.deadline is None:
            return False
        if time.monotonic() + (retry_state.upcoming_sleep or 0.0) + self.margin >= self.deadline:
            self.hit = True
            return True
        return False


def cancellable_sleep(cancel: Any) -> Callable[[float], None]:
    """tenacity's ``sleep``: ``cancel.wait(s)`` (a cancel ends it at once), else ``time.sleep``."""
    if cancel is None:
        return time.sleep
    return lambda seconds: cancel.wait(seconds)


@dataclass
class RetryPolicy:
    """The ``stop``, ``wait``, ``retry`` and ``sleep`` of one call (see :func:`retry_policy`);
    ``deadline_stop`` is the part of ``stop`` that watches the deadline."""

    stop: stop_base
    wait: wait_base
    retry: Any
    sleep: Callable[[float], None]
    deadline_stop: stop_before_deadline

    def retrying(self) -> Retrying:
        return Retrying(stop=self.stop, wait=self.wait, sleep=self.sleep, retry=self.retry,
                        reraise=True)

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` under the policy; the last failure is raised as it is.

        The first attempt is made here, without building tenacity's machinery (most calls need
        one attempt); when it fails, tenacity takes over with that failure as its first
        attempt, so the retries, waits and stops are exactly tenacity's."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - handed to tenacity just below
            first = [exc]

        def replayed():
            if first:
                raise first.pop()
            return fn()
        return self.retrying()(replayed)


def retry_policy(max_attempts: int, transient: Callable[[BaseException], bool], *,
                 backoff: wait_base, deadline: float | None = None,
                 cancel: Any = None) -> RetryPolicy:
    """The policy of one call: at most ``max_attempts`` attempts, retrying failures
    ``transient`` says are, waiting ``Retry-After`` or ``backoff``, never past ``deadline``
    and not once ``cancel`` is set."""
    deadline_stop = stop_before_deadline(deadline)
    return RetryPolicy(
        stop=stop_after_attempt(max_attempts) | stop_when_cancelled(cancel) | deadline_stop,
        wait=wait_retry_after(backoff), retry=retry_if_exception(transient),
        sleep=cancellable_sleep(cancel), deadline_stop=deadline_stop)


def attempt_timeout(timeout: float | None, deadline: float | None,
                    timeout_error: Callable[[], BaseException]) -> float | None:
    """An attempt's timeout (s): ``timeout`` cut to what is left before ``deadline``.

    Raises:
        ``timeout_error()`` (the provider's timeout, so it is handled as one) when the deadline
        has passed.
    """
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise timeout_error()
    return left if timeout is None else min(timeout, left)


def recorded_attempt(send: Callable[[float | None], Any], attempts: list[dict], *,
                     label: str, max_attempts: int, transient: Callable[[BaseException], bool],
                     timeout_error: Callable[[], BaseException], timeout: float | None = None,
                     deadline: float | None = None, cancel: Any = None) -> Callable[[], Any]:
    """One attempt of a call, as a function of no arguments for :meth:`RetryPolicy.call`.

    ``send(t)`` makes the request with the attempt's timeout ``t`` (s, or None: the client's).
    Each attempt appends ``{"n", "seconds", "error"}`` to ``attempts`` (``n`` counts on from
    what it holds); a transient failure is logged, the call's first as a warning. No attempt
    after the first is made once ``cancel`` is set (:class:`~rlm.errors.EndpointError`).
    """
    def once():
        n = len(attempts) + 1
        if n > 1 and cancel is not None and cancel.is_set():
            # abandoned during a retry wait: no further attempt is sent
            raise EndpointError(f"model call to {label} cancelled before attempt {n}")
        a0 = time.monotonic()
        t = attempt_timeout(timeout, deadline, timeout_error)
        try:
            resp = send(t)
        except Exception as exc:
            attempts.append({"n": n, "seconds": round(time.monotonic() - a0, 4),
                             "error": f"{type(exc).__name__}: {exc}"[:500]})
            ended = (cancel is not None and cancel.is_set()) or (
                deadline is not None and time.monotonic() + DEADLINE_SLACK >= deadline)
            if transient(exc) and not ended:
                # the first failure of a call is shown (a retried call may wait a minute in
                # all); the rest with -v. A call cut by its cancel or deadline is not retried
                # and says so where it ends (the run's cancelled or wall-cap message)
                log.log(logging.WARNING if n == 1 else logging.INFO,
                        "model call to %s failed (attempt %d of %d%s): %s", label, n,
                        max_attempts, ", retrying" if n < max_attempts else "",
                        attempts[-1]["error"])
            raise
        attempts.append({"n": n, "seconds": round(time.monotonic() - a0, 4), "error": None})
        return resp
    return once


def deadline_error(exc: BaseException, policy: RetryPolicy, deadline: float | None,
                   label: str, attempts: list[dict]) -> DeadlineExceeded | None:
    """The :class:`DeadlineExceeded` a call that failed with ``exc`` ends with, if the deadline
    ended it (the policy stopped for it, or the failure came at the deadline), else None."""
    if deadline is None or not (policy.deadline_stop.hit
                                or time.monotonic() + DEADLINE_SLACK >= deadline):
        return None
    return DeadlineExceeded(
        f"model endpoint {label}: the call could not finish before its deadline after "
        f"{len(attempts)} attempt(s) (last: {type(exc).__name__}: {short(exc)})")
