"""One client call of ``rlm serve``, one run: the SDK retries of a request joined to the run its
first attempt started (:class:`Attempts`), the runs this process is driving (:class:`LiveRuns`),
the client's hang-up (:func:`until_disconnect`), and what a response says a run used over every
attempt (:func:`usage_of`, :func:`run_info`).

The openai SDKs (Python and JavaScript) send a retry of a request with the same body and a
header ``x-stainless-retry-count`` of 1, 2, ... (0 on the first attempt); they retry a timeout,
a connection error, 408, 409, 429 and 5xx unless the response says ``x-should-retry: false``.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from typing import Any

__all__ = ["RETRY_COUNT_HEADER", "Attempts", "LiveRuns", "retry_count", "run_info",
           "until_disconnect", "usage_of"]

#: The header an SDK's retry carries: how many attempts of the request came before it.
RETRY_COUNT_HEADER = "x-stainless-retry-count"


def retry_count(headers: Any) -> int:
    """The attempts that came before this one, from :data:`RETRY_COUNT_HEADER` (0 when the
    header is missing or no whole number)."""
    raw = headers.get(RETRY_COUNT_HEADER)
    try:
        return max(0, int(raw)) if raw is not None else 0
    except ValueError:
        return 0


class Attempts:
    """The run of each recent request, by what its retries repeat: the client's key and the
    body's bytes. A first attempt that starts a run records it (:meth:`started`); a retry with
    the same key and body finds it (:meth:`run_of`) and so is served by the same run (its
    recorded result, or a resume of it), never a second one.

    Kept in memory: ``size`` entries, each for ``ttl`` seconds (the SDKs retry within
    seconds). A retry reaching another server process behind a load balancer is not joined:
    an ``Idempotency-Key`` is, through the shared journal. Thread-unsafe: the event loop's.
    """

    def __init__(self, size: int = 4096, ttl: float = 900.0) -> None:
        self.size, self.ttl = size, ttl
        self._runs: OrderedDict[str, tuple[str, float]] = OrderedDict()

    @staticmethod
    def fingerprint(authorization: str | None, body: bytes) -> str:
        """What every attempt of one request repeats (sha256 hex of the key and the body)."""
        h = hashlib.sha256((authorization or "").encode("utf-8", "replace") + b"\0")
        h.update(body)
        return h.hexdigest()

    def run_of(self, fingerprint: str) -> str | None:
        """The run id the latest first attempt with ``fingerprint`` started, or None."""
        got = self._runs.get(fingerprint)
        if got is None or time.monotonic() - got[1] > self.ttl:
            return None
        return got[0]

    def started(self, fingerprint: str, run_id: str) -> None:
        """Record that the request ``fingerprint`` started run ``run_id``."""
        self._runs.pop(fingerprint, None)
        self._runs[fingerprint] = (run_id, time.monotonic())
        while len(self._runs) > self.size:
            self._runs.popitem(last=False)


class LiveRuns:
    """The runs this server is driving (run id -> the task awaiting it), and which of them are
    being cancelled because their client went away."""

    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Future] = {}
        self.leaving: set[str] = set()

    def add(self, run_id: str, task: "asyncio.Future") -> None:
        """Track ``task`` as run ``run_id``'s until it is done."""
        self.tasks[run_id] = task

        def gone(_: Any) -> None:
            if self.tasks.get(run_id) is task:
                del self.tasks[run_id]
                self.leaving.discard(run_id)
        task.add_done_callback(gone)

    async def cancel(self, run_id: str, task: "asyncio.Future") -> None:
        """Cancel ``task`` (run ``run_id``'s: its client went away) and wait until the run has
        wound down (journaled ``cancelled``, resumable)."""
        self.leaving.add(run_id)
        task.cancel()
        await asyncio.wait({task})

    async def settle(self, run_id: str, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) for run ``run_id`` if it is being cancelled here,
        so that a retry resumes it rather than finding it still running. False if it is live
        here and not leaving (its client is still there)."""
        task = self.tasks.get(run_id)
        if task is None:
            return True
        if run_id not in self.leaving:
            return False
        await asyncio.wait({task}, timeout=timeout)
        return task.done()


async def until_disconnect(receive: Any) -> None:
    """Return when the client of a request whose body was read hangs up (``receive`` is the
    request's ASGI receive callable, which then gives ``http.disconnect``)."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


def _totals(res: Any) -> dict:
    u = res.usage or {}
    return u.get("all_attempts") or u


def usage_of(res: Any) -> dict:
    """The response's ``usage`` of result ``res``: the tokens of every attempt of its run
    (a resumed run's earlier attempts too, as its caps count them)."""
    u = _totals(res)
    prompt, completion = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": int(u.get("total_tokens", prompt + completion))}


def run_info(res: Any) -> dict:
    """The response's ``rlm`` object of result ``res``: ``calls`` and ``cost_usd`` over every
    attempt of the run, ``replayed_calls`` served from the journal in this one."""
    u = _totals(res)
    return {"run_id": res.run_id, "status": res.status, "iterations": res.iterations,
            "calls": u.get("calls", 0), "cost_usd": u.get("cost_usd", 0.0),
            "replayed_calls": res.replayed_calls, "seconds": round(res.seconds, 3)}
