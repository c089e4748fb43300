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
import os
import threading
from typing import Any, Iterable, Mapping

from rlm.errors import ConfigError, install_hint

__all__ = ["stage_ids", "LiveExporter", "export_run", "emit_stages"]

_TERMINAL = {"completed", "failed", "cancelled", "budget_exceeded"}
_BATCH = 512


def _require():
    try:
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
        self.provider = TracerProvider(resource=Resource.create({"service.name": name}),
                                       id_generator=_FixedIds())
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
        attrs = _attributes(run_id, stage, call)
        name = f"chat {stage.get('model') or ''}".strip() if model_call else f"rlm.{kind}"
        self._local.trace_id, self._local.span_id = trace_id, span_id
        span = self.tracer.start_span(name, context=ctx, attributes=attrs,
                                      kind=SpanKind.CLIENT if model_call else SpanKind.INTERNAL,
                                      start_time=_ns(start))
        if status in ("failed", "budget_exceeded"):
            span.set_status(Status(StatusCode.ERROR, (stage.get("error") or status)[:500]))
            span.set_attribute("error.type", status)
        span.end(end_time=_ns(end if end is not None and start is not None and end >= start
                              else start))


def _attributes(run_id: str, st: Mapping[str, Any], call: Mapping | None) -> dict:
    a: dict[str, Any] = {
        "rlm.run_id": run_id, "rlm.stage.id": st["id"], "rlm.stage.kind": st.get("kind") or "",
        "rlm.stage.level": int(st.get("level") or 0), "rlm.stage.ordinal": int(st.get("ordinal") or 0),
        "rlm.stage.status": st.get("status") or "", "rlm.cost_usd": float(st.get("cost_usd") or 0.0),
        "rlm.calls": int(st.get("calls") or 0),
    }
    if st.get("status") not in _TERMINAL:
        a["rlm.stage.unfinished"] = True  # a crashed run's stage: ended at the last record
    if st.get("model"):
        a["rlm.model"] = st["model"]
    if st.get("kind") == "model_call":
        a["gen_ai.operation.name"] = "chat"
        a["gen_ai.provider.name"] = "openai"  # the wire protocol: any OpenAI-compatible endpoint
        a["gen_ai.request.model"] = st.get("model") or ""
        a["gen_ai.usage.input_tokens"] = int(st.get("prompt_tokens") or 0)
        a["gen_ai.usage.output_tokens"] = int(st.get("completion_tokens") or 0)
        meta = st.get("meta") or {}
        if meta.get("replayed"):
            a["rlm.replayed"] = True
        if isinstance(meta.get("attempts"), list):
            a["rlm.attempts"] = len(meta["attempts"])
        req = (call or {}).get("request") or {}
        if req.get("max_tokens") is not None:
            a["gen_ai.request.max_tokens"] = int(req["max_tokens"])
        if req.get("temperature") is not None:
            a["gen_ai.request.temperature"] = float(req["temperature"])
        resp = (call or {}).get("response") or {}
        if isinstance(resp, Mapping):
            if resp.get("model"):
                a["gen_ai.response.model"] = str(resp["model"])
            if resp.get("finish_reason"):
                a["gen_ai.response.finish_reasons"] = [str(resp["finish_reason"])]
            if resp.get("id"):
                a["gen_ai.response.id"] = str(resp["id"])
    return a


def _exporter(endpoint: str | None = None):
    _require()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()


class LiveExporter:
    """A stage-tree listener that exports each stage's span when the stage ends, batched in
    the background (``rlm run --otel``). :meth:`close` flushes and shuts the exporter down."""

    def __init__(self, endpoint: str | None = None, exporter=None) -> None:
        _require()
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        self._emitter = _Emitter(BatchSpanProcessor(exporter or _exporter(endpoint)))
        self.spans = 0

    def listener(self, event: dict) -> None:
        """A :class:`harness.stages.tree.StageTree` listener: emit one span when a stage reaches a
        terminal status. Never raises (a raising listener would roll the stage change back)."""
        try:
            st = event["stage"]
            if event.get("event") == "transition" and st.get("status") in _TERMINAL:
                self._emitter.emit(event["run_id"], st)
                self.spans += 1
        except Exception:  # tracing must never break the run (a raising listener rolls back)
            pass

    def close(self) -> None:
        """Flush the spans still queued and shut the exporter down (blocks up to the SDK's
        export timeout)."""
        self._emitter.provider.force_flush()
        self._emitter.provider.shutdown()


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
    try:
        for i in range(0, len(spans), _BATCH):
            if exp.export(spans[i:i + _BATCH]) != SpanExportResult.SUCCESS:
                where = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or \
                    os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318"
                raise ConfigError(f"the OTLP endpoint {where} did not accept the spans of run "
                                  f"{run_id} (sent {i} of {len(spans)}); is a collector "
                                  "listening there?")
    finally:
        exp.shutdown()
    return len(spans)
