"""Checked structured answers: answer_schema / verify gate the FINAL value before a run completes.

Real kernels, the real ``openai`` client and the scripted server; the model's turns are scripted,
so the tests see exactly which values were refused, what the model was told, and what the stages
keep as evidence.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from conftest import API_KEY, MODEL, endpoint_args, last_user, repl, root_requests, script

import rlm
from harness.stages.tree import Kind
from rlm.core.schema import AnswerCheck, load_answer, to_json_schema

PERSON = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}}}


def cell_checks(res) -> list[dict]:
    return [s.evidence["check"] for s in res.tree.all()
            if s.kind == Kind.cell and isinstance(s.evidence, dict) and "check" in s.evidence]


def test_invalid_final_is_refused_with_the_error_and_the_run_goes_on(api):
    res, srv = api(script([repl('FINAL({"name": "Ada", "age": "36"})'),
                           repl('FINAL({"name": "Ada", "age": 36})')]),
                   answer_schema=PERSON)
    assert res.status == "completed" and res.iterations == 2
    assert json.loads(res.answer) == {"name": "Ada", "age": 36}
    roots = root_requests(srv)
    # the schema is part of the task; the refusal names the failing field
    assert '"required": ["name", "age"]' in roots[0]["messages"][1]["content"]
    told = last_user(roots[1])
    assert "FINAL was NOT accepted" in told and "'36' is not of type 'integer'" in told
    assert "age" in told
    assert [c["ok"] for c in cell_checks(res)] == [False, True]
    assert cell_checks(res)[0]["gate"] == "schema"


def test_a_run_that_never_satisfies_the_schema_fails_within_its_iterations(api):
    res, srv = api(script([repl('FINAL("not a person")')] * 3), answer_schema=PERSON,
                   max_iterations=2)
    assert res.status == "failed" and res.answer is None
    assert len(root_requests(srv)) == 3  # two turns and the last-turn prompt, no more
    assert [c["ok"] for c in cell_checks(res)] == [False, False, False]


@dataclass
class Person:
    name: str
    age: int


def test_dataclass_schema_and_typed_value(api):
    assert to_json_schema(Person)["required"] == ["name", "age"]
    res, _ = api(script([repl('p = {"name": "Ada", "age": 36}', 'FINAL_VAR("p")')]),
                 answer_schema=Person)
    assert res.status == "completed"
    assert load_answer(res.answer, Person) == Person("Ada", 36)


def test_pydantic_model_schema():
    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):
        sku: str
        qty: int

    check = AnswerCheck(to_json_schema(Item))
    assert not check.check('{"sku": "a"}').ok
    v = check.check("{'sku': 'a', 'qty': 2}")  # FINAL(dict) arrives as its repr
    assert v.ok and json.loads(v.answer) == {"sku": "a", "qty": 2}
    assert load_answer(v.answer, Item) == Item(sku="a", qty=2)


def test_verify_gate_refuses_with_its_reason_and_its_verdicts_are_evidence(api):
    seen = []

    def gate(value):
        seen.append(value)
        return True if value == "42" else f"{value} is not the number on page 3"

    res, srv = api(script([repl("FINAL(41)"), repl("FINAL(42)")]), verify=gate)
    assert res.status == "completed" and res.answer == "42"
    assert seen == ["41", "42"]
    assert "41 is not the number on page 3" in last_user(root_requests(srv)[1])
    checks = cell_checks(res)
    assert checks == [{"ok": False, "gate": "verify", "reason": "41 is not the number on page 3"},
                      {"ok": True, "gate": "", "reason": "", "answer": "42"}]


def test_a_raising_gate_refuses_and_schema_comes_before_the_gate(api):
    calls = []

    def gate(value):
        calls.append(value)
        raise ValueError("bad total")

    res, srv = api(script([repl('FINAL("x")'), repl("FINAL([1, 2])")] + [repl("FINAL([3])")] * 3),
                   answer_schema={"type": "array"}, verify=gate, max_iterations=2)
    assert res.status == "failed"
    assert calls == [[1, 2], [3]]  # the schema refused "x" before the gate saw it
    assert "ValueError: bad total" in root_requests(srv)[2]["messages"][-2]["content"]


def test_bad_schema_is_a_config_error():
    with pytest.raises(rlm.ConfigError, match="not a valid JSON Schema"):
        rlm.completion("c", "q", base_url="http://127.0.0.1:9/v1", api_key="k", model="m",
                       journal=False, answer_schema={"type": "nonsense"})


def test_child_rlm_with_schema_returns_checked_data(api):
    child_q = "Count the items"

    def root_or_child(req):
        first = req["messages"][1]["content"]
        turns = sum(1 for m in req["messages"] if m["role"] == "user")
        if child_q in first:  # the child: an invalid value first, then a valid one
            return repl('FINAL({"n": "three"})') if turns == 1 else repl('FINAL({"n": 3})')
        return repl('s = {"type": "object", "required": ["n"], '
                    '"properties": {"n": {"type": "integer"}}}',
                    f'v = rlm("a b c", {child_q!r}, schema=s)', "FINAL(v['n'] * 2)")

    res, srv = api(root_or_child, max_depth=2)
    assert res.status == "completed" and res.answer == "6"  # the parent got a dict, not text
    child_turns = [r for r in srv.requests if child_q in r["messages"][1]["content"]]
    assert len(child_turns) == 2
    assert "is not of type 'integer'" in last_user(child_turns[1])


def test_depth_limit_rlm_with_schema_retries_the_completion(api):
    subs = iter(["the answer is five", '```json\n{"n": 5}\n```'])
    res, srv = api(script([repl('v = rlm("five things", "how many?", '
                                'schema={"type": "object", "required": ["n"]})',
                                "FINAL(v['n'])")], sub=lambda req: next(subs)))
    assert res.status == "completed" and res.answer == "5"
    fb = [s for s in res.tree.all() if s.kind == Kind.fallback]
    assert len(fb) == 1 and [c["ok"] for c in fb[0].evidence["checks"]] == [False, True]


def test_cli_answer_schema_file(cli, scripted, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("Ada is 36.")
    srv = scripted(script([repl('FINAL({"name": "Ada"})'),
                           repl('FINAL({"name": "Ada", "age": 36})')]))
    r = cli("run", "--context", str(ctx), "--query", "who?", "--answer-schema", str(schema),
            "-q", *endpoint_args(srv))
    assert r.rc == 0, r.stderr
    assert json.loads(r.stdout) == {"name": "Ada", "age": 36}
