"""``rlm view``: one self-contained HTML file showing a run's trajectory.

Everything comes from the journal (the run record, the latest record of every stage, the model
calls' requests) and is inlined into the page with the viewer's script and styles: no server,
no network, no CDN. The page (``view_template.html``) renders the stage tree lazily (a collapsed
subtree is not in the DOM until opened), so runs of 10,000 stages open quickly.

The payload is compact: one array per stage (see :data:`FIELDS`), parents by index, long texts
cut at ``max_text`` characters with a note saying how much was cut.
"""
from __future__ import annotations

import html
import json
import time
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping

from rlm.observe.summary import Spent, ending, spent as spent_of

__all__ = ["FIELDS", "build_payload", "render_html", "payload_from_journal", "write_view"]

#: The order of the per-stage array in the payload (the page reads the same order).
FIELDS = ("id", "parent", "kind", "status", "level", "model", "start", "end", "in_tok",
          "out_tok", "calls", "cost", "error", "text")

#: Default cut for one text field (reply, code, output, prompt, answer), in characters.
DEFAULT_MAX_TEXT = 20_000


def _cut(text: Any, limit: int) -> str | None:
    if text is None:
        return None
    if not isinstance(text, str):
        text = json.dumps(text, ensure_ascii=False, default=str)
    if len(text) <= limit:
        return text
    return (text[:limit] + f"\n[... {len(text) - limit:,} more characters cut by the viewer; "
            "the full text is in the journal: rlm export RUN_ID]")


def _request_texts(request: Mapping | None) -> dict:
    """The parts of a model request worth showing: a sub-call's prompt, or the opening
    system/user messages of a loop's first turn (later turns only repeat the conversation)."""
    msgs = list((request or {}).get("messages") or [])
    if not msgs:
        return {}
    if msgs[0].get("role") != "system":
        return {"prompt": "\n\n".join(str(m.get("content") or "") for m in msgs)}
    out = {"system": str(msgs[0].get("content") or "")}
    if len(msgs) >= 2 and sum(1 for m in msgs if m.get("role") == "assistant") == 0:
        out["user"] = str(msgs[1].get("content") or "")
    return out


def _stage_text(st: Mapping, call: Mapping | None, limit: int) -> dict | None:
    """The texts shown for one stage, by kind."""
    kind, ev = st.get("kind"), st.get("evidence")
    t: dict[str, Any] = {}
    if kind == "model_call":
        t["reply"] = _cut(ev, limit)
        if call is not None:
            for k, v in _request_texts(call.get("request")).items():
                t[k] = _cut(v, limit)
            resp = call.get("response") or {}
            if isinstance(resp, Mapping) and resp.get("finish_reason"):
                t["finish"] = resp.get("finish_reason")
        meta = st.get("meta") or {}
        if meta.get("replayed"):
            t["replayed"] = True
        if isinstance(meta.get("attempts"), list) and len(meta["attempts"]) > 1:
            t["attempts"] = len(meta["attempts"])
    elif kind == "cell":
        if isinstance(ev, Mapping):
            t["code"] = _cut(ev.get("code"), limit)
            t["output"] = _cut(ev.get("output"), limit)
            for flag in ("timed_out", "interrupted", "died"):
                if ev.get(flag):
                    t[flag] = True
            if ev.get("final") is not None:
                t["final"] = _cut(ev.get("final"), limit)
    elif kind == "tool":  # a call of the user's tool: the call, and its result or error
        meta = st.get("meta") or {}
        t["call"] = _cut(meta.get("call"), limit)
        t["answer"] = _cut(meta.get("result") if "result" in meta else meta.get("error"), limit)
        if meta.get("replayed"):
            t["replayed"] = True
    elif kind in ("llm_query", "fallback", "child", "run", "iteration", "compaction"):
        if ev is not None:
            t["answer"] = _cut(ev, limit)
        if kind == "run":
            q = (st.get("meta") or {}).get("query")
            if q:
                t["query"] = _cut(q, limit)
    return {k: v for k, v in t.items() if v is not None} or None


def build_payload(run: Mapping, stages: Iterable[Mapping], calls: Iterable[Mapping] = (), *,
                  max_text: int = DEFAULT_MAX_TEXT, generated_at: float | None = None,
                  spent: Spent | None = None) -> dict:
    """The JSON the page renders.

    Args:
        run: the run record (``Journal.get_run``): query, answer, state, error, models, options
            (budget caps), usage.
        stages: latest stage dicts (``Journal.stages`` or ``StageTree.snapshot``), parents
            before children.
        calls: model-call records (``Journal.model_calls``); their requests give sub-call prompts
            and a loop's system prompt.
        max_text: characters kept per text field.
        spent: what the run spent (:func:`rlm.observe.summary.spent`): the header's cost,
            tokens and calls are its totals over every attempt (and the last attempt's, said
            as such); without it, the run's ``usage``.
    """
    by_call = {c["call_id"]: c for c in calls}
    rows: list[list] = []
    index: dict[str, int] = {}
    for st in stages:
        sid = st["id"]
        parent = index.get(st.get("parent_id")) if st.get("parent_id") is not None else -1
        if parent is None:  # parent missing (a damaged record): attach to the root
            parent = 0 if rows else -1
        index[sid] = len(rows)
        rows.append([sid, parent, st.get("kind"), st.get("status"), st.get("level", 0),
                     st.get("model"), st.get("started_at"), st.get("ended_at"),
                     st.get("prompt_tokens", 0), st.get("completion_tokens", 0),
                     st.get("calls", 0), round(float(st.get("cost_usd") or 0.0), 8),
                     _cut(st.get("error"), 2000),
                     _stage_text(st, by_call.get(sid), max_text)])
    opts = dict(run.get("options") or {})
    usage = dict(run.get("usage") or {})
    ends = [r[7] for r in rows if r[7] is not None] + [r[6] for r in rows if r[6] is not None]
    started = run.get("created_at")
    finished = run.get("finished_at") or (max(ends) if ends else None)
    end = ending({**run, "state": run.get("state") or run.get("status")})
    return {
        "version": 1,
        "generated_at": generated_at if generated_at is not None else time.time(),
        "run": {
            "run_id": run.get("run_id"), "state": run.get("state") or run.get("status"),
            "query": _cut(run.get("query"), max_text), "answer": _cut(run.get("answer"), max_text),
            "reason": _cut(run.get("error"), 4000), "model": run.get("model"),
            # why it ended, in the words of every other view (rlm.observe.summary)
            "ended": None if end.kind == "running" else _cut(end.text, 4000),
            "ended_kind": end.kind,
            "sub_model": run.get("sub_model") or opts.get("sub_model"),
            "child_model": opts.get("child_model"), "max_depth": run.get("max_depth"),
            "budget": opts.get("budget") or {}, "usage": usage,
            "spent": spent.all if spent is not None else None,
            "last_attempt": spent.last if spent is not None else None,
            "created_at": started, "finished_at": finished,
            "replay": bool(run.get("replay")),
        },
        "fields": list(FIELDS),
        "stages": rows,
        "max_text": max_text,
    }


def _template() -> str:
    return resources.files("rlm.observe").joinpath("view_template.html").read_text(encoding="utf-8")


def render_html(payload: Mapping) -> str:
    """The self-contained page: the template with the payload inlined as JSON.

    ``</`` inside the JSON is written ``<\\/`` so no text of the run can close the script tag.
    """
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), default=str)
    data = data.replace("</", "<\\/").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    run = payload.get("run") or {}
    title = html.escape(f"rlm run {run.get('run_id')} ({run.get('state')})")
    page = _template()
    page = page.replace("__RLM_TITLE__", title, 1)
    return page.replace("__RLM_DATA__", data, 1)


def payload_from_journal(journal, run_id: str, *, max_text: int = DEFAULT_MAX_TEXT) -> dict:
    """Read one run through the journal's public readers and build its payload.

    Raises:
        harness.journal.UnknownRunError: no such run.
    """
    from harness.journal import UnknownRunError
    rec = journal.get_run(run_id)
    if rec is None:
        raise UnknownRunError(f"no run {run_id!r} in journal {journal.path}; list runs with "
                              "`rlm runs`")
    return build_payload(rec, journal.stages(run_id), journal.model_calls(run_id),
                         max_text=max_text, spent=spent_of(journal, rec))


def payload_from_result(journal, rec: Mapping, result, *,
                        max_text: int = DEFAULT_MAX_TEXT) -> dict:
    """The payload of a replayed run: its fresh stage tree, with the recorded requests."""
    calls = journal.model_calls(rec["run_id"]) if journal is not None else []
    run = dict(rec)
    run.update(state=result.status, answer=result.answer, error=result.reason or None,
               replay=True, usage=dict(result.usage, kernels_started=result.kernels_started,
                                       iterations=result.iterations, cap=result.cap))
    return build_payload(run, result.tree.snapshot(), calls, max_text=max_text)


def write_view(payload: Mapping, path: str | Path) -> Path:
    """Write the page for ``payload`` to ``path`` (UTF-8) and return the path."""
    p = Path(path)
    p.write_text(render_html(payload), encoding="utf-8")
    return p
