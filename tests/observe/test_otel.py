"""OpenTelemetry export, received by a real OTLP/HTTP receiver on 127.0.0.1.

The receiver decodes the protobuf ``ExportTraceServiceRequest`` bodies the SDK's exporter sends;
the tests check one span per stage, parents that match the stage tree, and the GenAI semantic
convention attributes on model calls.
"""
from __future__ import annotations

import gzip
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import API_KEY, MODEL, clean_env
import trajectory_run as tr
from scripted_server import ScriptedServer

from harness.journal import Journal

pytest.importorskip("opentelemetry.sdk", reason="the [otel] extra is not installed")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402


class Receiver:
    """An OTLP/HTTP traces receiver: POST /v1/traces with a protobuf body."""

    def __init__(self) -> None:
        self.spans: list = []
        self.paths: list[str] = []
        self.headers: list[dict] = []
        lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = trace_service_pb2.ExportTraceServiceRequest()
                req.ParseFromString(body)
                with lock:
                    outer.paths.append(self.path)
                    outer.headers.append(dict(self.headers))
                    for rs in req.resource_spans:
                        res = {a.key: _value(a.value) for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            for sp in ss.spans:
                                outer.spans.append((res, sp))
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(span) -> dict:
    return {a.key: _value(a.value) for a in span.attributes}


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def _check_tree(spans: list, stages: list[dict], run_id: str) -> dict:
    """One span per stage, parents as in the stage tree, one trace. Returns spans by stage id."""
    by_stage = {}
    for _, sp in spans:
        a = _attrs(sp)
        assert a["rlm.run_id"] == run_id
        assert a["rlm.stage.id"] not in by_stage, "a stage was exported twice"
        by_stage[a["rlm.stage.id"]] = sp
    assert set(by_stage) == {s["id"] for s in stages}
    assert len(spans) == len(stages)
    assert len({sp.trace_id for sp in by_stage.values()}) == 1
    for s in stages:
        sp = by_stage[s["id"]]
        a = _attrs(sp)
        assert (a["rlm.stage.kind"], a["rlm.stage.status"], a["rlm.stage.level"]) == \
            (s["kind"], s["status"], s["level"])
        if s["parent_id"] is None:
            assert sp.parent_span_id == b""
        else:
            assert sp.parent_span_id == by_stage[s["parent_id"]].span_id, s["id"]
        assert sp.end_time_unix_nano >= sp.start_time_unix_nano > 0
    return by_stage


def test_export_of_a_depth_2_run(trajectory, receiver, tmp_path):
    journal, run_id, res = trajectory
    p = subprocess.run([sys.executable, "-m", "rlm", "export", run_id, "--otel"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env=clean_env(RLM_JOURNAL=str(journal),
                                     OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
                                     OTEL_EXPORTER_OTLP_HEADERS="x-team=rlm,authorization=Bearer%20t0k"))
    assert p.returncode == 0, p.stderr
    with Journal(journal) as j:
        stages = j.stages(run_id)
        calls = {c["call_id"]: c for c in j.model_calls(run_id)}
    assert f"sent {len(stages)} spans" in p.stderr
    assert set(receiver.paths) == {"/v1/traces"}
    assert receiver.headers[0].get("x-team") == "rlm"
    assert receiver.headers[0].get("authorization") == "Bearer t0k"
    assert receiver.spans[0][0]["service.name"] == "rlm"
    by_stage = _check_tree(receiver.spans, stages, run_id)
    assert max(s["level"] for s in stages) == 2

    model_calls = [s for s in stages if s["kind"] == "model_call"]
    assert len(model_calls) == 12
    for s in model_calls:
        sp = by_stage[s["id"]]
        a = _attrs(sp)
        assert sp.name == "chat m" and sp.kind == sp.SPAN_KIND_CLIENT
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.request.model"] == MODEL
        assert a["gen_ai.usage.input_tokens"] == s["prompt_tokens"]
        assert a["gen_ai.usage.output_tokens"] == s["completion_tokens"]
        if s["status"] == "completed":
            assert s["prompt_tokens"] > 0 and a["gen_ai.response.model"] == MODEL
            assert a["gen_ai.request.max_tokens"] == calls[s["id"]]["request"]["max_tokens"]
            assert a["gen_ai.request.temperature"] == 0.0
            assert a["rlm.cost_usd"] == pytest.approx(s["cost_usd"]) and a["rlm.cost_usd"] > 0
    # the failed child and its failed call carry ERROR status; a completed stage does not
    failed = by_stage["run/iteration-2/cell-0/child-1"]
    assert failed.status.code == failed.status.STATUS_CODE_ERROR
    assert "HTTP 400" in failed.status.message
    assert by_stage["run"].status.code != failed.status.STATUS_CODE_ERROR
    assert "gen_ai.operation.name" not in _attrs(by_stage["run/iteration-0/cell-0"])


def test_export_to_a_closed_port_is_a_clear_error(trajectory, tmp_path):
    from conftest import closed_port
    journal, run_id, _ = trajectory
    p = subprocess.run([sys.executable, "-m", "rlm", "export", run_id, "--otel",
                        "--otel-endpoint", f"http://127.0.0.1:{closed_port()}/v1/traces"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=clean_env(RLM_JOURNAL=str(journal), OTEL_EXPORTER_OTLP_TIMEOUT="2"))
    assert p.returncode == 2, p.stderr
    assert "did not accept the spans" in p.stderr and "Traceback" not in p.stderr


def test_live_spans_during_a_run(receiver, tmp_path):
    """``RLM_OTEL=1`` on ``rlm run``: every stage's span arrives while the run goes, with the
    same tree, and ids equal to a later export's (both derive them from run and stage ids)."""
    journal = tmp_path / "j.sqlite3"
    ctx = tmp_path / "ctx.txt"
    ctx.write_text(tr.CONTEXT, encoding="utf-8")

    def responder(req):
        if req["messages"][0]["role"] != "system":
            return tr.responder(req)
        turns = sum(1 for m in req["messages"] if m["role"] == "assistant")
        return "```repl\n" + [tr.ROOT_CODE[0], "FINAL(str(len(found)))"][min(turns, 1)] + "\n```"

    with ScriptedServer(responder) as srv:
        p = subprocess.run([sys.executable, "-m", "rlm", "run", "--context", str(ctx), "--query",
                            "q?", "--base-url", srv.base_url, "--api-key", API_KEY, "--model",
                            MODEL, "--run-id", "otel-live", "-q"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=90,
                           env=clean_env(RLM_JOURNAL=str(journal), RLM_OTEL="1",
                                         OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint))
    assert p.returncode == 0 and p.stdout.strip() == "3", p.stderr
    with Journal(journal) as j:
        stages = j.stages("otel-live")
    live = _check_tree(receiver.spans, stages, "otel-live")
    assert _attrs(live["run/iteration-0/model_call-0"])["gen_ai.usage.input_tokens"] > 0

    from rlm.observe.otel import emit_stages
    later = {sp.attributes["rlm.stage.id"]: sp for sp in emit_stages("otel-live", stages)}
    for sid, sp in live.items():
        assert sp.span_id == later[sid].context.span_id.to_bytes(8, "big")
        assert sp.trace_id == later[sid].context.trace_id.to_bytes(16, "big")
