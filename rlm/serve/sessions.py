"""``rlm serve``'s sessions: a request whose body carries ``"rlm": {"session": "<id>"}`` is the
next question of that session (:class:`rlm.session.Session`): the same kernel and conversation
as the earlier requests with that id. The first request's context (its ``context`` field, or
its messages before the last user message) is the session's; each request's last user message
is its question. A session idle for ``--session-idle-timeout`` seconds is closed (its kernel
shut down; the journal keeps its questions); every session is closed when the server stops.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from rlm.aio import CancelToken, await_cancellable
from rlm.serve.errors import APIError

log = logging.getLogger("rlm")

#: Seconds a session may sit idle before it is closed, by default.
DEFAULT_IDLE_SECONDS = 600


class _Live:
    """One live session: the :class:`~rlm.session.Session`, when it was last used, whether a
    question is running."""

    def __init__(self, session: Any) -> None:
        self.session, self.last, self.busy = session, time.monotonic(), False


class ServeSessions:
    """The sessions of one ``rlm serve`` app, by id.

    Args:
        options: the server's run options (endpoint, journal, defaults), as :class:`rlm.RLM`'s.
        runner: the server's :class:`rlm.RLM` (its endpoint, an embedded server) the sessions
            share. idle_seconds: a session unused this long is closed (s). grace: how long a
            cancelled question may take to wind down (s).
    """

    def __init__(self, options: dict, runner: Any, idle_seconds: float = DEFAULT_IDLE_SECONDS,
                 grace: float = 10.0) -> None:
        self.options, self.runner, self.idle, self.grace = options, runner, idle_seconds, grace
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, daemon=True, name="rlm-sessions")
        self._reaper.start()

    def run_id(self, session_id: str) -> str:
        """The run id the session's next question will have."""
        from rlm.session import question_run_id
        with self._lock:
            live = self._live.get(session_id)
        n = live.session._held.question + 1 if live is not None else 1
        return question_run_id(session_id, n)

    def _take(self, session_id: str, req: Any) -> _Live:
        """The live session ``session_id`` marked busy, opened with ``req``'s context when new.

        Raises:
            APIError: 409 a question of it is running; 404 it is not live here but the journal
            holds it (expired, or another server's); 400 a bad id.
        """
        from rlm.errors import ConfigError
        from rlm.session import Session
        with self._lock:
            live = self._live.get(session_id)
            if live is not None:
                if live.busy:
                    raise APIError(409, f"session {session_id!r} is answering another question: "
                                   "send the next one when it is done", code="session_busy",
                                   retryable=True)
                live.busy = True
                return live
        try:
            opts = {k: v for k, v in self.options.items() if v is not None}
            session = Session(req.context, session_id=session_id, runner=self.runner, **opts)
        except ConfigError as exc:
            gone = "already in journal" in str(exc)
            raise APIError(404 if gone else 400, (
                f"session {session_id!r} is not live on this server (closed after "
                f"{self.idle:g} s idle, or the server restarted); its questions are in the "
                "journal: start a new session id") if gone else str(exc),
                code="session_not_found" if gone else "invalid_value",
                param="rlm.session") from None
        live = _Live(session)
        live.busy = True
        with self._lock:
            if session_id in self._live:  # opened at the same time by another request
                session.close()
                raise APIError(409, f"session {session_id!r} is answering another question",
                               code="session_busy", retryable=True)
            self._live[session_id] = live
        return live

    async def ask(self, session_id: str, req: Any, listeners: list | None = None) -> Any:
        """Ask ``req.query`` in session ``session_id`` (opened from ``req`` when new); returns
        the question's :class:`~rlm.result.Result`. A cancelled awaiting task cancels the
        question (journaled ``cancelled``) and the session goes on.

        Raises:
            APIError: as :meth:`_take`; otherwise what :meth:`rlm.session.Session.ask` raises.
        """
        live = await asyncio.to_thread(self._take, session_id, req)
        token = CancelToken()
        extra = dict(req.options)
        if listeners:
            extra["listeners"] = [*(extra.get("listeners") or ()), *listeners]
        fut = asyncio.ensure_future(asyncio.to_thread(
            live.session.ask, req.query, cancel=token, **extra))

        def free(_: Any) -> None:
            live.last, live.busy = time.monotonic(), False
        fut.add_done_callback(free)
        return await await_cancellable(fut, token, self.grace)

    def _reap(self) -> None:
        """Close sessions idle past the timeout, every few seconds until :meth:`close`."""
        while not self._stop.wait(min(5.0, max(0.2, self.idle / 4))):
            now = time.monotonic()
            with self._lock:
                old = [(k, v) for k, v in self._live.items()
                       if not v.busy and now - v.last > self.idle]
                for k, _ in old:
                    del self._live[k]
            for k, v in old:
                log.info("session %s: idle for %.0f s, closed", k, now - v.last)
                v.session.close()

    def close(self) -> None:
        """Close every session (the server is stopping). Idempotent."""
        self._stop.set()
        with self._lock:
            live, self._live = list(self._live.values()), {}
        for v in live:
            try:
                v.session.close()
            except Exception:  # noqa: BLE001 - the others still close
                log.warning("a session did not close cleanly", exc_info=True)
