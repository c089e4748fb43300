"""OpenTelemetry: every stage of a run as a span, over OTLP/HTTP.

Each stage becomes one span whose parent is its parent stage's span; the run is the trace's
root. Span and trace ids are derived from the run id and stage id (sha256), so the spans of a
run exported live (``rlm run --otel``) and later from the journal (``rlm export RUN_ID --otel``)
carry the same ids, and a child can be exported before its parent ends.

Model calls follow the OpenTelemetry GenAI semantic conventions (``gen_ai.operation.name``,
``gen_ai.provider.name``, ``gen_ai.request.model``, ``gen_ai.response.model``,
``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``, ``gen_ai.request.max_tokens``,
``gen_ai.request.temperature``, ``gen_ai.response.finish_reasons``, ``gen_ai.response.id``); every
span also carries the harness's own ``rlm.*`` attributes (run id, stage id, kind, level, status,
cost, calls). Failed and budget-stopped stages get status ERROR with the stage's error.

Where spans go is the standard configuration of the OTLP/HTTP exporter:
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``/v1/traces``
appended), ``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_SERVICE_NAME`` (default ``rlm``). Nothing is
exported unless asked for. Needs ``pip install 'rlm-kernels[otel]'``.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections import deque
from typing import Any, Iterable, Mapping

from rlm.errors import ConfigError, install_hint

__all__ = ["stage_ids", "span_name", "span_attributes", "LiveExporter", "export_run",
           "emit_stages"]

_TERMINAL = {"completed", "failed", "cancelled", "budget_exceeded"}
_BATCH = 512
#: Seconds a live export gathers spans before sending a batch (fewer, larger requests).
_DELAY = 0.5
#: Spans a live export keeps queued while the collector is slow; later ones are dropped.
_MAX_QUEUE = 20_000
#: Seconds the end of a run waits for its last spans (``OTEL_BSP_EXPORT_TIMEOUT`` overrides).
CLOSE_WAIT = 1.0
_HTTP_STATUS = re.compile(r"\bHTTP (\d{3})\b")
_OS_ERROR = re.compile(r"\[Errno -?\d+\][^'\")\]]*")
log = logging.getLogger(__name__)


def _require(quick: bool = False):
    """Raise :class:`ConfigError` unless the SDK and the OTLP/HTTP exporter are installed
    (``quick``: only look them up, without the import's cost)."""
    try:
        if quick:
            from importlib.util import find_spec
            for name in ("opentelemetry.sdk.trace",
                         "opentelemetry.exporter.otlp.proto.http.trace_exporter"):
                if find_spec(name) is None:
                    raise ImportError(name)
            return
        from opentelemetry.sdk import trace as sdk_trace  # noqa: F401
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: F401
            OTLPSpanExporter)
    except ImportError:
        raise ConfigError("OpenTelemetry export needs the SDK and the OTLP/HTTP exporter: "
                          f"{install_hint('otel')}") from None


def stage_ids(run_id: str, stage_id: str | None) -> tuple[int, int]:
    """``(trace_id, span_id)`` of a stage: a 128-bit id per run, a 64-bit id per stage."""
    t = int.from_bytes(hashlib.sha256(f"rlm-trace:{run_id}".encode()).digest()[:16], "big") or 1
    s = int.from_bytes(hashlib.sha256(f"rlm-span:{run_id}:{stage_id}".encode()).digest()[:8],
                       "big") or 1
    return t, s


def _ns(t: float | None) -> int | None:
    return None if t is None else int(t * 1e9)


class _Emitter:
    """Turns stage records into ended SDK spans with the stage's deterministic ids."""

    def __init__(self, processor, service_name: str | None = None) -> None:
        _require()
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.id_generator import IdGenerator

        local = threading.local()
        self._local = local

        class _FixedIds(IdGenerator):  # the ids of the span being started on this thread
            def generate_span_id(self) -> int:
                return local.span_id

            def generate_trace_id(self) -> int:
                return local.trace_id

        name = service_name or os.environ.get("OTEL_SERVICE_NAME") or "rlm"
        # no shutdown at the interpreter's exit: that would wait on the collector there
        self.provider = TracerProvider(resource=Resource.create({"service.name": name}),
                                       id_generator=_FixedIds(), shutdown_on_exit=False)
        self.provider.add_span_processor(processor)
        from rlm.version import __version__
        self.tracer = self.provider.get_tracer("rlm", __version__)

    def emit(self, run_id: str, stage: Mapping[str, Any], call: Mapping | None = None,
             end_fallback: float | None = None) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
        from opentelemetry.trace.status import Status, StatusCode
        trace_id, span_id = stage_ids(run_id, stage["id"])
        ctx = None
        if stage.get("parent_id") is not None:
            parent = SpanContext(trace_id, stage_ids(run_id, stage["parent_id"])[1],
                                 is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
            ctx = trace.set_span_in_context(NonRecordingSpan(parent))
        else:
            from opentelemetry.context import Context
            ctx = Context()  # a new trace, whatever is current
        kind, status = stage.get("kind"), stage.get("status")
        model_call = kind == "model_call"
        start = stage.get("started_at") or stage.get("created_at") or end_fallback
        end = stage.get("ended_at") or end_fallback or start
        attrs = span_attributes(run_id, stage, call)
        name = span_name(stage)
        self._local.trace_id, self._local.span_id = trace_id, span_id
        span = self.tracer.start_span(name, context=ctx, attributes=attrs,
                                      kind=SpanKind.CLIENT if model_call else SpanKind.INTERNAL,
                                      start_time=_ns(start))
        if status in ("failed", "budget_exceeded"):
            span.set_status(Status(StatusCode.ERROR, (stage.get("error") or status)[:500]))
        span.end(end_time=_ns(end if end is not None and start is not None and end >= start
                              else start))


def span_name(stage: Mapping[str, Any]) -> str:
    """A stage's span name: ``chat MODEL`` for a model call (the GenAI conventions'
    ``{gen_ai.operation.name} {gen_ai.request.model}``), ``execute_tool NAME`` for a call of a
    user's tool, ``rlm.KIND`` for every other stage."""
    if stage.get("kind") == "model_call":
        return f"chat {stage.get('model') or ''}".strip()
    if stage.get("kind") == "tool":  # the GenAI conventions' execute_tool span
        return f"execute_tool {(stage.get('meta') or {}).get('tool') or ''}".strip()
    return f"rlm.{stage.get('kind')}"


def _error_type(st: Mapping[str, Any]) -> str:
    """``error.type`` of a failed or stopped stage: the HTTP status its error names (``400``),
    else its status (``failed``, ``budget_exceeded``)."""
    m = _HTTP_STATUS.search(str(st.get("error") or ""))
    return m.group(1) if m else str(st.get("status"))


def span_attributes(run_id: str, st: Mapping[str, Any], call: Mapping | None = None) -> dict:
    """The attributes of a stage's span: the one mapping from a stage record to a span, used by
    the live export (``rlm run --otel``: the stage as it ends) and by ``rlm export --otel`` (the
    stage as the journal holds it), so both say the same.

    A model call's GenAI attributes come from what its stage recorded (``meta.call``: provider,
    output cap, temperature; ``meta.server``: host and port it was sent to; ``meta.reply``:
    the model that answered, the reply's id and finish reason; see
    :func:`rlm.core.run_tree.call_facts`). ``call`` (the journal's model-call record) fills
    in what a stage recorded before those fields existed.
    """
    a: dict[str, Any] = {
        "rlm.run_id": run_id, "rlm.stage.id": st["id"], "rlm.stage.kind": st.get("kind") or "",
        "rlm.stage.level": int(st.get("level") or 0), "rlm.stage.ordinal": int(st.get("ordinal") or 0),
        "rlm.stage.status": st.get("status") or "", "rlm.cost_usd": float(st.get("cost_usd") or 0.0),
        "rlm.calls": int(st.get("calls") or 0),
    }
    if st.get("status") not in _TERMINAL:
        a["rlm.stage.unfinished"] = True  # a crashed run's stage: ended at the last record
    if st.get("status") in ("failed", "budget_exceeded"):
        a["error.type"] = _error_type(st)
    if st.get("model"):
        a["rlm.model"] = st["model"]
    if st.get("kind") == "model_call":
        a.update(_genai(st, call))
    if st.get("kind") == "tool":  # a call of the user's tool (rlm.tools)
        tm = st.get("meta") or {}
        a.update({"gen_ai.operation.name": "execute_tool",
                  "gen_ai.tool.name": tm.get("tool") or "", "gen_ai.tool.call.id": st["id"],
                  "rlm.tool.replayed": bool(tm.get("replayed"))})
    meta = st.get("meta") or {}
    if st.get("kind") == "compaction" and "before_tokens" in meta:  # rlm.core.compaction
        a.update({"rlm.compaction.trigger": str(meta.get("trigger") or ""),
                  "rlm.compaction.before_tokens": int(meta["before_tokens"]),
                  "rlm.compaction.after_tokens": int(meta.get("after_tokens") or 0),
                  "rlm.compaction.window_tokens": int((meta.get("window") or {}).get("tokens")
                                                      or 0)})
    return a


def _genai(st: Mapping[str, Any], call: Mapping | None) -> dict:
    """The GenAI semantic-convention attributes of one model call's span."""
    meta = st.get("meta") or {}
    facts = meta.get("call") if isinstance(meta.get("call"), Mapping) else {}
    server = meta.get("server") if isinstance(meta.get("server"), Mapping) else {}
    reply = meta.get("reply") if isinstance(meta.get("reply"), Mapping) else None
    req = (call or {}).get("request") or {}
    if reply is None:  # recorded before stages kept their reply's facts: the call record's
        resp = (call or {}).get("response")
        reply = resp if isinstance(resp, Mapping) else {}
    a: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": str(facts.get("provider") or "openai"),
        "gen_ai.request.model": st.get("model") or "",
        "gen_ai.usage.input_tokens": int(st.get("prompt_tokens") or 0),
        "gen_ai.usage.output_tokens": int(st.get("completion_tokens") or 0),
    }
    max_tokens = facts.get("max_tokens", req.get("max_tokens"))
    if max_tokens is not None:
        a["gen_ai.request.max_tokens"] = int(max_tokens)
    temperature = facts.get("temperature", req.get("temperature"))
    if temperature is not None:
        a["gen_ai.request.temperature"] = float(temperature)
    for key, attr in (("model", "gen_ai.response.model"), ("id", "gen_ai.response.id")):
        if reply.get(key):
            a[attr] = str(reply[key])
    if reply.get("finish_reason"):
        a["gen_ai.response.finish_reasons"] = [str(reply["finish_reason"])]
    if server.get("address"):
        a["server.address"] = str(server["address"])
        if server.get("port") is not None:
            a["server.port"] = int(server["port"])
    if meta.get("replayed"):
        a["rlm.replayed"] = True
    if isinstance(meta.get("attempts"), list):
        a["rlm.attempts"] = len(meta["attempts"])
    return a


def _exporter(endpoint: str | None = None):
    _require()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()


def _where(endpoint: str | None) -> str:
    """The traces URL the exporter sends to, as its standard configuration resolves it."""
    if endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return endpoint or os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return base.rstrip("/") + "/v1/traces" if base else "http://localhost:4318/v1/traces"


def _short(text: str) -> str:
    """An exporter's error, short: the OS's own words when it quotes them (``[Errno 111]
    Connection refused``), else its first 160 characters."""
    found = _OS_ERROR.findall(text)
    return found[-1].rstrip("'\")") if found else " ".join(text.split())[:160]


class _Hush(logging.Filter):
    """Keeps the OpenTelemetry SDK's own log records of the threads that export for ``rlm``
    (each retry is a warning there) off the terminal, and hands each one's message to that
    thread's callback instead: a failed export is then one line of ours, not one per retry."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: dict[int, Any] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        heard = self.threads.get(record.thread)
        if heard is None:
            return True
        if record.levelno >= logging.WARNING:
            try:
                heard(record.getMessage())
            except Exception:
                pass
        return False


_HUSH = _Hush()


def _hush(thread: int, heard) -> None:
    """Route the SDK's records from ``thread`` to ``heard(message)`` (see :class:`_Hush`)."""
    for name, lg in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith("opentelemetry") and isinstance(lg, logging.Logger) and \
                _HUSH not in lg.filters:
            lg.addFilter(_HUSH)
    _HUSH.threads[thread] = heard


class _Sender:
    """Sends the spans of ended stages in batches from a daemon thread, so a slow, hung or
    absent collector never holds the run: :meth:`put` only queues the stage's record; the
    thread imports the SDK, builds the spans and exports them; :meth:`close` waits at most
    ``wait`` seconds for what is still queued. The first failed export (a refused connection,
    an error status, a timeout, spans left unsent at close) is one warning on
    ``rlm.observe.otel``; nothing else is logged."""

    def __init__(self, make_exporter, where: str, wait: float) -> None:
        self._make, self.where, self.wait = make_exporter, where, wait
        self._exp = None
        self._queue: deque = deque()
        self._cv = threading.Condition()
        self._closing = self._busy = False
        self._busy_since = 0.0
        self.failure: str | None = None
        self.sent = self.dropped = 0
        self._thread = threading.Thread(target=self._loop, name="rlm-otel", daemon=True)
        self._thread.start()

    def put(self, run_id: str, stage: Mapping) -> None:
        """Queue the span of one ended stage (``stage``: its record, copied)."""
        with self._cv:
            if len(self._queue) >= _MAX_QUEUE or self._closing:
                self.dropped += 1
                return
            self._queue.append((run_id, dict(stage)))
            if len(self._queue) in (1, _BATCH):  # the thread waits for a first one or a full batch
                self._cv.notify_all()

    def _loop(self) -> None:
        try:
            self._exp = self._make()  # the SDK's import and set-up: off the run's threads
            collect = _collector()
            emitter = _Emitter(collect)
        except Exception as exc:  # e.g. a malformed OTEL_* setting
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        me = threading.get_ident()
        _hush(me, self._heard)
        try:
            while self._next_batch(collect, emitter):
                ok, why = self._send(collect.spans)
                with self._cv:
                    self._busy = False
                    self.sent += len(collect.spans) if ok else 0
                    self.dropped += 0 if ok else len(collect.spans)
                    self._cv.notify_all()
                collect.spans.clear()
                if not ok:
                    self._fail(why)
        finally:
            _HUSH.threads.pop(me, None)  # a later thread may get the same id

    def _next_batch(self, collect, emitter) -> bool:
        """Wait for stages (gathering a batch for :data:`_DELAY` seconds unless the run is
        ending), build their spans into ``collect``; False when there is nothing more to do."""
        with self._cv:
            while not self._queue and not self._closing:
                self._cv.wait()
            if not self._queue or (self._closing and self.failure is not None):
                return False
            if not self._closing and len(self._queue) < _BATCH:
                self._cv.wait(_DELAY)
            batch = [self._queue.popleft() for _ in range(min(_BATCH, len(self._queue)))]
            self._busy, self._busy_since = True, time.monotonic()
        for run_id, st in batch:
            try:
                emitter.emit(run_id, st)
            except Exception:  # one odd record costs its span, not the export
                self.dropped += 1
        return True

    def _send(self, batch: list) -> tuple[bool, str]:
        from opentelemetry.sdk.trace.export import SpanExportResult
        if not batch:
            return True, ""
        try:
            return self._exp.export(list(batch)) == SpanExportResult.SUCCESS, "it refused them"
        except Exception as exc:  # an exporter's bug must not end the thread silently
            return False, f"{type(exc).__name__}: {exc}"

    def _heard(self, message: str) -> None:
        self._fail(_short(message))

    def _fail(self, why: str) -> None:
        with self._cv:
            if self.failure is not None:
                return
            self.failure = why
            self._cv.notify_all()
        log.warning("OpenTelemetry: the collector at %s did not take this run's spans (%s); "
                    "the run goes on without exporting them", self.where, why)

    def close(self) -> None:
        """Stop taking spans and wait up to ``wait`` seconds (none once an export failed, nor
        for a request already out that long) for the queued ones to be sent; then shut the
        exporter down. Never raises."""
        deadline = time.monotonic() + self.wait
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            while (self._queue or self._busy) and self.failure is None:
                now = time.monotonic()
                # a request already out for longer than the wait is hung: no point waiting
                left = min(deadline, self._busy_since + self.wait if self._busy else deadline)
                if left <= now:
                    break
                self._cv.wait(left - now)
            unsent = len(self._queue) + (1 if self._busy else 0)
        if unsent and self.failure is None:
            self._fail(f"it did not answer within {self.wait:g} s")
        try:
            if self._exp is not None:
                self._exp.shutdown()  # also ends a retry the exporter is waiting out
        except Exception:
            pass


def _close_wait() -> float:
    """Seconds :meth:`LiveExporter.close` waits for the last spans: ``OTEL_BSP_EXPORT_TIMEOUT``
    (milliseconds) when set, else :data:`CLOSE_WAIT`."""
    raw = os.environ.get("OTEL_BSP_EXPORT_TIMEOUT", "")
    try:
        value = float(raw) / 1000.0 if raw.strip() else CLOSE_WAIT
    except ValueError:
        value = CLOSE_WAIT
    return value if value >= 0 and value == value else CLOSE_WAIT


class LiveExporter:
    """A stage-tree listener that exports each stage's span when the stage ends
    (``rlm run --otel``), sent in batches from a background thread.

    The run never waits for the collector, nor for the SDK's import: the listener only queues
    the stage's record, and :meth:`close` waits at most ``close_wait`` seconds (default
    :data:`CLOSE_WAIT`, or ``OTEL_BSP_EXPORT_TIMEOUT`` in milliseconds) for the last ones. A
    collector that refuses, fails or does not answer costs one warning line on the
    ``rlm.observe.otel`` logger, never an error of the run.

    Args:
        endpoint: the OTLP/HTTP traces URL (default: the standard ``OTEL_EXPORTER_OTLP_*``
            configuration); exporter: an SDK ``SpanExporter`` to use instead.
    Raises:
        ConfigError: the SDK or the OTLP/HTTP exporter is not installed.
    """

    def __init__(self, endpoint: str | None = None, exporter=None,
                 close_wait: float | None = None) -> None:
        _require(quick=True)
        self._sender = _Sender((lambda: exporter) if exporter is not None
                               else (lambda: _exporter(endpoint)), _where(endpoint),
                               _close_wait() if close_wait is None else close_wait)
        self.spans = 0

    @property
    def failure(self) -> str | None:
        """Why the export failed (str), or None while it has not."""
        return self._sender.failure

    def listener(self, event: dict) -> None:
        """A :class:`harness.stages.tree.StageTree` listener: queue one span when a stage reaches
        a terminal status. Never raises (a raising listener would roll the stage change back)."""
        try:
            st = event["stage"]
            if event.get("event") == "transition" and st.get("status") in _TERMINAL:
                self._sender.put(event["run_id"], st)
                self.spans += 1
        except Exception:  # tracing must never break the run (a raising listener rolls back)
            pass

    def close(self) -> None:
        """Send what is still queued, waiting at most ``close_wait`` seconds, and shut the
        exporter down. Never raises."""
        self._sender.close()


def _collector():
    """A span processor that keeps ended spans, so the caller can export them and check."""
    from opentelemetry.sdk.trace import SpanProcessor

    class Collect(SpanProcessor):
        def __init__(self) -> None:
            self.spans: list = []

        def on_end(self, span) -> None:
            self.spans.append(span)

    return Collect()


def emit_stages(run_id: str, stages: Iterable[Mapping], calls: Iterable[Mapping] = (),
                end_fallback: float | None = None) -> list:
    """Build the ended spans (SDK ``ReadableSpan``) of a recorded run, parents first."""
    _require()
    collect = _collector()
    emitter = _Emitter(collect)
    by_call = {c["call_id"]: c for c in calls}
    for st in stages:
        emitter.emit(run_id, st, by_call.get(st["id"]), end_fallback)
    return collect.spans


def export_run(journal, run_id: str, *, endpoint: str | None = None, exporter=None) -> int:
    """Send a recorded run's spans (one per stage) over OTLP/HTTP; returns how many.

    Raises:
        ConfigError: unknown run, the SDK is missing, or the endpoint refused the spans.
    """
    _require()
    from opentelemetry.sdk.trace.export import SpanExportResult
    rec = journal.get_run(run_id)
    if rec is None:
        raise ConfigError(f"no run {run_id!r} in journal {journal.path}")
    stages = journal.stages(run_id)
    last = max([t for s in stages for t in (s.get("ended_at"), s.get("started_at")) if t]
               + [rec.get("finished_at") or rec.get("heartbeat_at") or 0.0])
    spans = emit_stages(run_id, stages, journal.model_calls(run_id), end_fallback=last)
    exp = exporter or _exporter(endpoint)
    heard: list[str] = []
    me = threading.get_ident()
    _hush(me, heard.append)  # the SDK's retry warnings: the error below says it once
    try:
        for i in range(0, len(spans), _BATCH):
            if exp.export(spans[i:i + _BATCH]) != SpanExportResult.SUCCESS:
                why = f": {_short(heard[-1])}" if heard else ""
                raise ConfigError(f"the OTLP endpoint {_where(endpoint)} did not accept the spans "
                                  f"of run {run_id} (sent {i} of {len(spans)}){why}; is a "
                                  "collector listening there?")
    finally:
        try:
            exp.shutdown()
        finally:
            _HUSH.threads.pop(me, None)
    return len(spans)
