"""A hard deadline on every byte an HTTP model call waits for.

httpx's timeouts bound each network operation (connect, one read, one write), not a whole
request: a server that trickles its reply one byte a second, or its headers, keeps a read
timeout from ever firing. Here the ``openai`` client's connection pool gets a network backend
that cuts every connect, read and write to the deadline of the call being made on this thread
(:func:`deadline`), and raises the pool's own timeout error once it has passed. So a call ends
at its deadline whatever the server does: never answers, answers slowly, trickles, resets.
Given a cancel handle too, a wait for the reply is cut into slices of :data:`CANCEL_POLL`
seconds and ends :data:`CANCEL_GRACE` seconds after the handle is set: a reply that comes in
that time is still taken (and journaled, so a resume does not pay for it again), and a
cancelled run does not wait out one that takes minutes (a long prefill on a small local
model). A socket read that times out consumes nothing, so waiting again loses no byte.

Both ``httpcore`` and ``httpcore2`` pools (what ``httpx`` / ``httpx2`` use) are wrapped by duck
typing; :func:`install` says whether the client's layout was recognised
(:mod:`rlm.models.transport` falls back to waiting for the call on a helper thread when it was
not). The ``anthropic`` client has the same layout as ``openai``'s and is wrapped the same way.
"""
from __future__ import annotations

import importlib
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["CANCEL_GRACE", "CANCEL_POLL", "cancel_cut", "deadline", "install"]

_local = threading.local()

#: Seconds between two looks at the cancel handle while a read waits (see :func:`deadline`).
CANCEL_POLL = 0.25
#: Seconds a call in flight is still waited for after its cancel (see :func:`deadline`).
CANCEL_GRACE = 2.0


@contextmanager
def deadline(at: float | None, cancel: Any = None) -> Iterator[None]:
    """Network I/O on this thread inside the block ends by ``at`` (``time.monotonic()``), and
    :data:`CANCEL_GRACE` seconds after ``cancel`` (anything with ``is_set()``: an Event, a
    cancel scope) is seen set."""
    prev = (getattr(_local, "at", None), getattr(_local, "cancel", None),
            getattr(_local, "cancel_seen", None))
    _local.at, _local.cancel, _local.cancel_seen = at, cancel, None
    try:
        yield
    finally:
        _local.at, _local.cancel, _local.cancel_seen = prev


def cancel_cut(cancel: Any, state: Any) -> bool:
    """True once ``cancel`` has been set for :data:`CANCEL_GRACE` seconds; ``state`` (an
    object with a ``cancel_seen`` attribute) keeps when it was first seen set."""
    if cancel is None or not cancel.is_set():
        return False
    now = time.monotonic()
    if getattr(state, "cancel_seen", None) is None:
        state.cancel_seen = now
    return now >= state.cancel_seen + CANCEL_GRACE


def _cut(timeout: float | None, error: type[BaseException]) -> float | None:
    at = getattr(_local, "at", None)
    if at is None:
        return timeout
    left = at - time.monotonic()
    if left <= 0:
        raise error("the call's deadline passed")
    return left if timeout is None else min(timeout, left)


class _Stream:
    def __init__(self, inner: Any, errors: Any) -> None:
        self._inner, self._errors = inner, errors

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        cancel = getattr(_local, "cancel", None)
        if cancel is None:
            return self._inner.read(max_bytes, _cut(timeout, self._errors.ReadTimeout))
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            if cancel_cut(cancel, _local):
                raise self._errors.ReadTimeout("the call was cancelled")
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise self._errors.ReadTimeout("timed out")
            wait = CANCEL_POLL if left is None else min(CANCEL_POLL, left)
            try:
                return self._inner.read(max_bytes, _cut(wait, self._errors.ReadTimeout))
            except self._errors.ReadTimeout:
                # a slice ran out (or the call's deadline: _cut raises at once next time)
                if getattr(_local, "at", None) is not None and _local.at <= time.monotonic():
                    raise

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        return self._inner.write(buffer, _cut(timeout, self._errors.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> "_Stream":
        return _Stream(self._inner.start_tls(ssl_context, server_hostname,
                                             _cut(timeout, self._errors.ConnectTimeout)),
                       self._errors)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Backend:
    def __init__(self, inner: Any, errors: Any) -> None:
        self._inner, self._errors = inner, errors

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None, socket_options: Any = None) -> _Stream:
        return _Stream(self._inner.connect_tcp(host, port, _cut(timeout, self._errors.ConnectTimeout),
                                               local_address, socket_options), self._errors)

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Any = None) -> _Stream:
        return _Stream(self._inner.connect_unix_socket(
            path, _cut(timeout, self._errors.ConnectTimeout), socket_options), self._errors)

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def install(openai_client: Any) -> bool:
    """Wrap the network backend of every connection pool of ``openai_client`` (an
    ``openai.OpenAI``). Returns True if at least one pool was wrapped and none was left out."""
    http = getattr(openai_client, "_client", None)
    transports = [getattr(http, "_transport", None)]
    transports += list((getattr(http, "_mounts", None) or {}).values())
    wrapped = 0
    for transport in transports:
        pool = getattr(transport, "_pool", None)
        inner = getattr(pool, "_network_backend", None)
        if pool is None:
            continue
        if inner is None:
            return False
        if isinstance(inner, _Backend):
            wrapped += 1
            continue
        try:
            errors = importlib.import_module(type(pool).__module__.split(".")[0])
            errors.ReadTimeout, errors.WriteTimeout, errors.ConnectTimeout  # noqa: B018
        except (ImportError, AttributeError):
            return False
        pool._network_backend = _Backend(inner, errors)
        wrapped += 1
    return wrapped > 0
