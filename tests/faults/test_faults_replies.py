"""Issue 9, the model-reply and endpoint kinds of fault: 1 (reasoning text is not code),
10 (code fences as models really write them, replies cut at the output-token limit),
2 (models that reject request parameters), 3 (missing usage must not switch the caps off).

Real kernels, the scripted HTTP server on 127.0.0.1, the real ``openai`` client; each test
asserts the right behaviour the issue states, over several members of its kind.
"""
from __future__ import annotations

import json
import logging

import pytest

from conftest import API_KEY, MODEL, Reply, endpoint_args, is_root, last_user, repl, script
from rlm.models.capabilities import REASONING, capabilities
from harness.journal import Journal
from rlm.models.openai_compat import OpenAICompatClient
from rlm.errors import EndpointError
from rlm.prompting.parsing import parse_reply
from rlm.models.tokens import count_messages, count_tokens
from scripted_server import reasoning_endpoint

MSGS = [{"role": "user", "content": "hello there"}]


def cells(res) -> list[dict]:
    return [s.evidence for s in res.tree.all() if s.kind.value == "cell"]


def model_calls(res) -> list:
    return [s for s in res.tree.all() if s.kind.value == "model_call"]


# --------------------------------------------------------------------------- kind 1

#: Reasoning spellings in the content: each holds a draft ```repl block calling FINAL.
def _draft(n: int) -> str:
    return f"Maybe just guess:\n```repl\nFINAL('draft-{n}')\n```\nNo: look first."


REASONING_SHAPES = [
    "<think>\n{d}\n</think>\n",                                   # DeepSeek-R1, Qwen3, QwQ
    "<thinking>{d}</thinking>",                                   # Claude-style, Reflection
    "[THINK]{d}[/THINK]\n",                                       # Magistral
    "<seed:think>{d}</seed:think>\n",                             # Seed-OSS
    "◁think▷{d}◁/think▷\n",                                       # Kimi
    "<|begin_of_thought|>\n{d}\n<|end_of_thought|>\n",            # OpenThoughts, Sky-T1
    "<|channel|>analysis<|message|>{d}<|end|><|start|>assistant<|channel|>final<|message|>",
    "{d}\n</think>\n\n",                                          # template opened it: no opener
    "<Think reason='x'>{d}</Think>\n",                            # attributes, any case
]


def test_kind1_reasoning_is_not_code(api, tmp_path, cli):
    """Every reasoning spelling in the content, and both separate reasoning fields: the draft
    FINAL inside never runs and never becomes the answer; the real block after it runs; the
    reasoning is kept in the journal and shown by ``rlm show``; it is not sent back as
    conversation; ``llm_query`` returns a sub-model's answer without its reasoning."""
    replies = []
    for n, shape in enumerate(REASONING_SHAPES):
        replies.append(shape.format(d=_draft(n)) + repl(f"seen.append({n})"))
    # separate reasoning fields (DeepSeek/vLLM/llama.cpp: reasoning_content; OpenRouter/Ollama:
    # reasoning), each holding a draft block; the content has the real block
    replies.append(Reply(repl("seen.append('field-1')"),
                         message={"reasoning_content": _draft(100)}))
    replies.append(Reply(repl("seen.append('field-2')"), message={"reasoning": _draft(101)}))
    # a reply cut while reasoning: nothing of it runs
    replies.append(Reply("<think>\nI will write:\n```repl\nFINAL('draft-cut')\n```\nand th",
                         finish_reason="length"))
    # the last turn: a sub-call whose reply has reasoning, and the real FINAL
    replies.append("<think>```repl\nFINAL('draft-last')\n```</think>\n" + repl(
        "sub = llm_query('what is it?')",
        "FINAL('real:' + sub + ':' + ','.join(map(str, seen)))"))
    seen_first = "seen = []"
    replies[0] = replies[0].replace("seen.append(0)", seen_first + "\nseen.append(0)")

    def sub(req):
        return Reply("<think>```repl\nFINAL('sub-draft')\n```</think>the-sub-answer",
                     message={"reasoning_content": "sub reasoning"})

    jp = tmp_path / "j.sqlite3"
    res, srv = api(script(replies, sub), journal=str(jp), max_iterations=30)
    expected = ",".join([str(n) for n in range(len(REASONING_SHAPES))] + ["field-1", "field-2"])
    assert res.status == "completed", res.reason
    assert res.answer == f"real:the-sub-answer:{expected}"
    roots = [r for r in srv.requests if is_root(r)]
    assert len(roots) == len(replies)  # one turn per reply: no draft ended a run early
    ran = "\n".join(c["code"] for c in cells(res))
    assert "draft" not in ran and "FINAL('sub-draft')" not in ran
    # the conversation sent back holds what the model said, never its reasoning
    history = json.dumps(roots[-1]["messages"])
    assert "draft-" not in history and "Maybe just guess" not in history
    # kept in the journal (stage meta and the recorded responses) ...
    calls = model_calls(res)
    reasoning = [c.meta.get("reasoning", "") for c in calls]
    for n in list(range(len(REASONING_SHAPES))) + [100, 101]:
        assert any(f"FINAL('draft-{n}')" in r for r in reasoning), n
    assert any("sub reasoning" in r and "sub-draft" in r for r in reasoning)
    j = Journal(str(jp))
    recorded = [c["response"] for c in j.model_calls(res.run_id)]
    assert sum("reasoning" in r for r in recorded) == len(replies) + 1
    assert all("draft-" not in r["text"] for r in recorded)
    # ... and shown by `rlm show`
    show = cli("show", res.run_id, "--journal", str(jp))
    assert show.rc == 0, show.stderr
    shown = show.stdout
    assert "reasoning | Maybe just guess:" in shown and "FINAL('draft-3')" in shown
    assert "finish=length" in shown


def test_kind1_reasoning_spellings_parse():
    """The parser side of kind 1 over more members: tags inside code are code; quoted or
    inline-code mentions of a tag are text; an unclosed section runs to the end."""
    for n, shape in enumerate(REASONING_SHAPES):
        p = parse_reply(shape.format(d=_draft(n)) + repl("x = 1"))
        assert p.code_blocks() == ["x = 1"], (shape, p)
        assert any(f"draft-{n}" in r for r in p.reasoning), shape
        assert "draft" not in p.text and not p.prose_final()
    assert parse_reply(repl("parts = s.split('</think>')", "FINAL(parts[-1])")).code_blocks() \
        == ["parts = s.split('</think>')\nFINAL(parts[-1])"]
    assert parse_reply(repl("tag = '<think>'", "FINAL(tag)")).code_blocks() == \
        ["tag = '<think>'\nFINAL(tag)"]
    p = parse_reply("I skip the `<think>` step.\n" + repl("y = 2"))
    assert p.code_blocks() == ["y = 2"] and not p.reasoning
    p = parse_reply("<think>\n" + repl("FINAL('d')") + "\nstill going")
    assert p.code_blocks() == [] and p.reasoning
    # FINAL written only inside reasoning is not a prose FINAL either
    assert not parse_reply("<think>I'll call FINAL('x')</think>Let me look.").prose_final()


# --------------------------------------------------------------------------- kind 10

NESTED_JSON = repl(
    'doc = """An example reply:',
    "```json",
    '{"answer": 42}',
    "```",
    'Done."""',
    "k10 = [doc.count('```')]")
TILDE = "~~~repl\nfence = '```'\nk10.append(len('''\n```\n'''.strip()))\n~~~"
LONGER = ("````python\nmd = '''\n```python\nprint(1)\n```\n'''\n"
          "k10.append(md.count('```'))\n````")
INDENTED = "Steps:\n1. count\n   ```repl\n   k10.append(4)\n   ```\n"
TEXT_AFTER_CLOSER = repl("k10.append(5)").replace("\n```", "\n``` and now the next block") + \
    "\n" + repl("k10.append(6)")
STRAY_FENCE = "Here:\n```\n" + repl("k10.append(7)")


def test_kind10_fences_as_models_write_them(api):
    """A block ends only at a closing fence that matches its opener: nested ```json inside a
    string, ~~~ fences holding ```, four-backtick fences holding ```, indented fences in a
    list, text after a closing fence, a stray bare fence. Every block runs whole: no
    SyntaxError, every value is right."""
    replies = [NESTED_JSON, TILDE, LONGER, INDENTED, TEXT_AFTER_CLOSER, STRAY_FENCE,
               repl("FINAL(','.join(map(str, k10)))")]
    res, srv = api(script(replies), max_iterations=20)
    assert res.status == "completed", res.reason
    assert res.answer == "2,3,2,4,5,6,7"
    assert not any("SyntaxError" in (c["output"] or "") for c in cells(res))
    assert srv.count == len(replies)


def test_kind10_cut_reply_never_runs_its_unclosed_block(api):
    """``finish_reason: "length"``: the closed blocks before the cut run, the unclosed last
    block never does (even when it is valid Python), and the model is told its reply was
    cut; a cut reply with no code at all is told so too."""
    cut1 = Reply(repl("x = 1") + "\nNow the answer:\n```repl\nprint('partial')\nFINAL('cut-1')",
                 finish_reason="length")
    cut2 = Reply("Let me think about how to write this... the answer is prob",
                 finish_reason="length")
    cut3 = Reply("~~~repl\nFINAL('cut-3')\n", finish_reason="length")
    replies = [cut1, cut2, cut3, repl("FINAL('done:' + str(x))")]
    res, srv = api(script(replies), max_iterations=10)
    assert res.status == "completed" and res.answer == "done:1"
    ran = [c["code"] for c in cells(res)]
    assert ran == ["x = 1", "FINAL('done:' + str(x))"]
    told = [last_user(r) for r in srv.requests[1:]]
    assert all("cut off at the output-token limit" in t for t in told), told
    assert "was not run" in told[0] and "Output:" in told[0]
    assert "was not run" not in told[1] and "```repl" in told[1]
    assert "was not run" in told[2]
    calls = model_calls(res)
    assert [c.meta.get("finish_reason") for c in calls] == ["length"] * 3 + [None]


def test_kind10_fence_shapes_parse():
    """More members at the parser: CommonMark's closing rule (same character, at least as long,
    nothing after it) and the cut rule."""
    assert parse_reply("````repl\na = '''\n```\n'''\n````").code_blocks() == ["a = '''\n```\n'''"]
    assert parse_reply("~~~python\nb = 1\n```\n~~~").code_blocks() == ["b = 1\n```"]
    assert parse_reply("```repl\nc = 1\n````\n").code_blocks() == ["c = 1"]  # longer closes
    assert parse_reply("```repl\nd = 1\n~~~\n```").code_blocks() == ["d = 1\n~~~"]
    # a ```json example in prose (not in a code block) is not run, its contents neither
    p = parse_reply("Format:\n```json\n{\"a\": 1}\n```\n" + repl("e = 1"))
    assert p.code_blocks() == ["e = 1"]
    assert parse_reply("```markdown\n" + repl("f = 1") + "\n```").code_blocks() == []
    # an unclosed last block runs, unless the reply was cut at the limit
    assert parse_reply("```repl\ng = 1").code_blocks() == ["g = 1"]
    assert parse_reply("```repl\ng = 1", cut=True).code_blocks(cut=True) == []
    # a block cut inside a string with an inner fence is not closed at the inner fence
    assert parse_reply("```repl\nh = '''\n```\n", cut=True).code_blocks(cut=True) == []


# --------------------------------------------------------------------------- kind 2


def test_kind2_reasoning_families_get_the_parameters_they_accept(api):
    """``o4-mini`` (root) and ``gpt-5-nano`` (sub-calls) against an endpoint that rejects
    ``max_tokens`` and any temperature but the default, as OpenAI's does: every request goes
    out with ``max_completion_tokens`` and no temperature, none is rejected."""
    replies = [repl("a = llm_query('hi')", "FINAL('ok:' + a)")]
    res, srv = api(reasoning_endpoint(script(replies, lambda r: "sub")), model="o4-mini",
                   sub_model="gpt-5-nano", max_completion_tokens=300, sub_max_tokens=100)
    assert res.status == "completed" and res.answer == "ok:sub"
    assert srv.count == 2
    assert [r.get("max_completion_tokens") for r in srv.requests] == [300, 100]
    assert all("max_tokens" not in r and "temperature" not in r for r in srv.requests)
    assert [r["model"] for r in srv.requests] == ["o4-mini", "gpt-5-nano"]
    for name in ("o1", "o3-mini", "openai/o4-mini", "o3-2025-04-16", "gpt-5", "gpt-5.1-mini",
                 "o5-mini"):
        assert capabilities(name) == REASONING, name
    assert capabilities("gpt-4o").token_param == "max_tokens"
    assert capabilities("llama-3.1-8b").temperature


class Rejects:
    """An endpoint that rejects some parameters with a given 400, and answers otherwise."""

    def __init__(self, rejects: dict, then="fine"):
        self.rejects, self.then = rejects, then

    def __call__(self, req):
        for param, rep in self.rejects.items():
            if param in req:
                return rep
        return self.then(req) if callable(self.then) else self.then


OPENAI_STYLE = Reply(status=400, content="Unsupported parameter: 'max_tokens' is not supported "
                     "with this model. Use 'max_completion_tokens' instead.",
                     error={"param": "max_tokens", "code": "unsupported_parameter"})
VLLM_STYLE = Reply(status=400, content="[{'type': 'extra_forbidden', 'loc': ('body', "
                   "'max_completion_tokens'), 'msg': 'Extra inputs are not permitted'}]")
AZURE_STYLE = Reply(status=400, content="Unrecognized request argument supplied: max_tokens")
TEMPERATURE = Reply(status=400, content="temperature is not supported with this model")
STOP = Reply(status=422, content="Unsupported parameter: 'stop' is not supported here.")


@pytest.mark.parametrize("model,rejects,sent_after,change", [
    ("acme-r1", {"max_tokens": OPENAI_STYLE}, "max_completion_tokens",
     "max_tokens -> max_completion_tokens"),
    ("acme-r1", {"max_tokens": AZURE_STYLE}, "max_completion_tokens",
     "max_tokens -> max_completion_tokens"),
    # a server that knows only max_tokens, asked for a model the table calls a reasoning one
    ("o3-mini", {"max_completion_tokens": VLLM_STYLE}, "max_tokens",
     "max_completion_tokens -> max_tokens"),
    ("acme-r1", {"temperature": TEMPERATURE}, None, "temperature -> dropped"),
    ("acme-r1", {"stop": STOP}, None, "stop -> dropped"),
])
def test_kind2_a_named_parameter_is_adapted_once(scripted, model, rejects, sent_after, change):
    """An unknown (or mis-tabled) model answering 400/422 that names a parameter it was sent is
    retried once without it; the adaptation is recorded in the attempts and kept, so later
    calls go out adapted at once."""
    srv = scripted(Rejects(rejects))
    client = OpenAICompatClient(srv.base_url, API_KEY)
    comp = client.complete(MSGS, model, max_tokens=50, temperature=0.0, stop=["\n\n"])
    assert comp.text == "fine"
    assert srv.count == 2
    first, second = srv.requests
    gone = next(iter(rejects))
    assert gone in first and gone not in second
    if sent_after:
        assert second[sent_after] == 50
    assert comp.attempts[0]["adapted"] == change and comp.attempts[1]["error"] is None
    comp2 = client.complete(MSGS, model, max_tokens=60, temperature=0.0, stop=["\n\n"])
    assert srv.count == 3 and gone not in srv.requests[2]  # learned: no second 400
    assert comp2.adapted and comp2.attempts[0]["error"] is None


def test_kind2_two_rejected_parameters_and_the_journal(api, tmp_path):
    """An endpoint that rejects both ``max_tokens`` and ``temperature`` for an unknown model:
    the first call adapts both (two retries, one per parameter), the run completes, and the
    adaptations are in the journal's attempts and shown by the stage."""
    rejects = Rejects({"max_tokens": OPENAI_STYLE, "temperature": TEMPERATURE},
                      then=script([repl("FINAL('ok')")]))
    jp = tmp_path / "j.sqlite3"
    res, srv = api(rejects, model="acme-reasoner", journal=str(jp))
    assert res.status == "completed" and res.answer == "ok"
    assert srv.count == 3
    attempts = Journal(str(jp)).model_calls(res.run_id)[0]["attempts"]
    assert [a.get("adapted") for a in attempts] == [
        "max_tokens -> max_completion_tokens", "temperature -> dropped", None]
    assert model_calls(res)[0].meta["adapted"] == [
        "max_tokens -> max_completion_tokens", "temperature -> dropped"]


def test_kind2_other_400s_still_fail_at_once(scripted):
    """A 400 that does not reject a parameter (here: a context too long, naming max_tokens)
    is not retried: one request, a clear EndpointError."""
    too_long = Reply(status=400, content="'max_tokens' is too large: 50. This model's maximum "
                                         "context length is 40 tokens.")
    srv = scripted(lambda req: too_long)
    with pytest.raises(EndpointError, match="HTTP 400"):
        OpenAICompatClient(srv.base_url, API_KEY).complete(MSGS, "acme", max_tokens=50)
    assert srv.count == 1


# --------------------------------------------------------------------------- kind 3

LOOP40 = repl(
    "out, why = [], None",
    "for i in range(40):",
    "    try:",
    "        out.append(llm_query('Summarise part ' + str(i) + ': ' + context[:1200]))",
    "    except Exception as e:",
    "        why = type(e).__name__",
    "        break",
    "print(len(out), why)")
ESSAY = " ".join(f"Sentence {i} of a report on suppliers and their shipments." for i in range(300))


def _no_usage(replies, sub_text="A short summary of the part. " * 6):
    return script([Reply(r, omit_usage=True) for r in replies],
                  lambda req: Reply(sub_text, omit_usage=True))


def test_kind3_missing_usage_keeps_the_token_cap(api):
    """No ``usage`` on any reply, root or sub-call: the tokens are counted locally, the token
    cap holds on the estimate (the loop of 40 is cut short, the cell can catch it), the usage is
    marked estimated on the stages and the result, and is not 0."""
    res, srv = api(_no_usage([LOOP40, repl("FINAL(str(len(out)))")]), context=ESSAY,
                   max_tokens=4000)
    subs = [r for r in srv.requests if not is_root(r)]
    assert 0 < len(subs) < 40
    assert res.usage_estimated is True and res.to_dict()["usage_estimated"] is True
    assert 0 < res.usage["total_tokens"] <= 4000
    calls = [c for c in model_calls(res) if c.status.value == "completed"]
    assert calls and all(c.meta.get("usage_estimated") for c in calls)
    assert all(c.prompt_tokens > 0 and c.completion_tokens > 0 for c in calls)
    # the estimate is tiktoken's count of what was sent and received
    sub_call = next(c for c in calls if c.level == 1 and c.status.value == "completed")
    assert sub_call.completion_tokens == count_tokens("A short summary of the part. " * 6)
    assert sub_call.prompt_tokens == count_messages(subs[0]["messages"])
    assert res.status in ("budget_exceeded", "completed")
    if res.status == "budget_exceeded":
        assert res.cap == "tokens"


def test_kind3_missing_usage_keeps_the_cost_cap(api):
    """The same with a cost cap on a priced model: cost comes from the price table applied to
    the estimate, is not 0, and stays under the cap."""
    res, srv = api(_no_usage([LOOP40, repl("FINAL(str(len(out)))")]), context=ESSAY,
                   model="gpt-4o-mini", max_cost_usd=0.002)
    subs = [r for r in srv.requests if not is_root(r)]
    assert 0 < len(subs) < 40
    assert res.usage_estimated
    assert 0 < res.usage["cost_usd"] <= 0.002
    expected = sum(c.prompt_tokens * 0.15e-6 + c.completion_tokens * 0.60e-6
                   for c in model_calls(res))
    assert res.usage["cost_usd"] == pytest.approx(expected)


def test_kind3_partial_or_zero_usage_is_estimated_and_warned_once(scripted, caplog):
    """Members of the kind at the client: no usage, usage without completion tokens, all-zero
    usage for a non-empty reply; each is counted locally; the warning comes once; a full
    report is taken as is."""
    replies = iter([Reply("one two three", omit_usage=True),
                    Reply("four five", usage={"prompt_tokens": 17, "completion_tokens": None}),
                    Reply("six", usage={"prompt_tokens": 0, "completion_tokens": 0}),
                    Reply("seven", usage={"prompt_tokens": 5, "completion_tokens": 2})])
    srv = scripted(lambda req: next(replies))
    client = OpenAICompatClient(srv.base_url, API_KEY)
    with caplog.at_level(logging.WARNING, logger="rlm"):
        a, b, c, d = (client.complete(MSGS, MODEL) for _ in range(4))
    assert (a.prompt_tokens, a.completion_tokens) == (count_messages(MSGS),
                                                      count_tokens("one two three"))
    assert (b.prompt_tokens, b.completion_tokens) == (17, count_tokens("four five"))
    assert (c.prompt_tokens, c.completion_tokens) == (count_messages(MSGS), count_tokens("six"))
    assert [x.usage_estimated for x in (a, b, c, d)] == [True, True, True, False]
    assert (d.prompt_tokens, d.completion_tokens) == (5, 2)
    warned = [r for r in caplog.records if "no token usage" in r.getMessage()]
    assert len(warned) == 1


def test_kind3_json_and_stderr_say_estimated(scripted, cli, tmp_path):
    """Through the CLI: ``--json`` carries ``usage_estimated: true`` and non-zero tokens; the
    warning is on stderr once."""
    srv = scripted(_no_usage([repl("a = llm_query('x')", "b = llm_query('y')", "FINAL(a + b)")],
                             sub_text="s"))
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("some context")
    res = cli("run", "--context", str(ctx), "--query", "q?", *endpoint_args(srv), "--json",
              "--max-tokens", "100000")
    assert res.rc == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["answer"] == "ss" and out["usage_estimated"] is True
    assert out["usage"]["total_tokens"] > 0 and out["usage"]["calls"] == 3
    assert res.stderr.count("sent no token usage") == 1


def test_a_bug_mid_run_still_journals_the_run_as_failed(api, tmp_path, monkeypatch):
    # an unexpected exception (a bug of the harness, simulated here) used to leave the run
    # 'running' in the journal, shown as crashed; it ends 'failed' with the error named
    import rlm.core.loop
    from harness.journal import Journal

    def broken(self, *a, **kw):
        raise RuntimeError("simulated bug")
    monkeypatch.setattr(rlm.core.loop.RLMLoop, "_turn", broken)
    path = tmp_path / "j.sqlite3"
    with pytest.raises(RuntimeError, match="simulated bug") as err:
        api(script([repl("FINAL('x')")]), journal=str(path), run_id="bug-run")
    assert err.value.result.status == "failed"
    with Journal(path) as j:
        rec = j.get_run("bug-run")
    assert rec["status"] == "failed", rec
    assert "internal error: RuntimeError: simulated bug" in (rec.get("error") or ""), rec


def test_a_refused_cost_cap_leaves_no_copy_of_the_context(api, tmp_path, monkeypatch):
    import tempfile

    import rlm
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(rlm.ConfigError, match="price"):
        api(script([repl("FINAL('x')")]), "a context given as a string", model="no-price-model",
            max_cost_usd=0.5)
    assert not list(tmp_path.glob("rlm-ctx-*")), list(tmp_path.iterdir())


@pytest.mark.parametrize("run_id", [" leading space", "é", "日本/ü", "a b"])
def test_any_printable_run_id_reaches_the_endpoint_as_an_ascii_header(api, tmp_path, run_id):
    # the run id travels in the X-RLM-Call-Id header, which must be ASCII without surrounding
    # space: such ids broke every call (exit 3) before it was percent-encoded
    from urllib.parse import unquote
    res, srv = api(script([repl("FINAL('ok')")]), journal=str(tmp_path / "j.sqlite3"),
                   run_id=run_id)
    assert (res.status, res.answer) == ("completed", "ok"), res.reason
    assert srv.call_ids and all(cid.isascii() and unquote(cid).startswith(run_id)
                                for cid in srv.call_ids), srv.call_ids
