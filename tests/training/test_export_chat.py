"""``rlm export --format chat`` (rlm/training/): recorded model calls as chat-format training
examples, from a real sweep (the scripted OpenAI-protocol server on 127.0.0.1, real kernels,
a real SQLite journal) and from single runs.

The sweep is ``tests/evaluation/test_eval_sweep.py``'s tiny tasks: ``easy`` is answered right
by every method, ``hard`` only by the depth-1 RLM (its one ``llm_query`` finds the answer), so
of the six trials four are correct and two wrong. The export must hold exactly the correct
trials' calls, each exactly as the server received it plus the reply it sent, with its
provenance, and be byte-identical when made again.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sqlite3
import sys
import threading
from pathlib import Path

import pytest

from conftest import API_KEY, MODEL, TESTS, CLIResult, assert_clean_error, clean_env

sys.path.insert(0, str(TESTS / "evaluation"))
import test_eval_sweep as sweep_t  # noqa: E402  (the tiny tasks and their responder)
from scripted_server import ScriptedServer  # noqa: E402


def rlm_process(args: list[str], env: dict | None = None) -> CLIResult:
    """``python -m rlm ARGS`` in a subprocess (the real command line)."""
    p = sweep_t.rlm_cli(args, env or sweep_t.env_with_factory())
    return CLIResult(p.returncode, p.stdout, p.stderr, 0.0)


def rlm(args: list[str], env: dict | None = None) -> CLIResult:
    """``rlm ARGS`` in this process (``rlm.cli.main.main``: the same parser, handlers and
    error reporting, without a second of interpreter start-up per call), with the
    environment's ``RLM_*``/``OPENAI_*`` variables as ``env`` has them."""
    from rlm.cli.main import main
    env = env or {}
    names = {k for k in os.environ if k.startswith(("RLM_", "OPENAI_"))} | set(env)
    saved = {k: os.environ.get(k) for k in names}
    out, err = io.StringIO(), io.StringIO()
    try:
        for k in names:
            os.environ.pop(k, None)
        os.environ.update({k: v for k, v in env.items() if k.startswith(("RLM_", "OPENAI_"))})
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(list(args))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return CLIResult(rc, out.getvalue(), err.getvalue(), 0.0)


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One sweep of 6 trials (n=1): ``(out dir, trial records, requests the server got)``."""
    tmp = tmp_path_factory.mktemp("sweep")
    srv = ScriptedServer(sweep_t.responder)
    srv._thread = threading.Thread(target=srv.httpd.serve_forever,
                                   kwargs={"poll_interval": 0.02}, daemon=True)
    with srv:
        out = tmp / "out"
        res = sweep_t.rlm_cli(sweep_t.grid_args(srv, out, out / "journal.sqlite3", 1),
                              sweep_t.env_with_factory())
        assert res.returncode == 0, res.stderr
        requests = list(srv.requests)
    records = sweep_t.read_jsonl(out / "trials.jsonl")
    assert sorted(r["correct"] for r in records) == [False, False, True, True, True, True]
    return out, records, requests


def recorded_calls(journal: Path, run_ids: set[str]) -> int:
    """Completed model calls with a reply the journal holds for ``run_ids``."""
    with sqlite3.connect(journal) as db:
        rows = db.execute("SELECT run_id, call_id FROM model_calls WHERE response IS NOT NULL"
                          ).fetchall()
    return sum(1 for run_id, _ in rows if run_id in run_ids)


def test_a_sweep_exports_exactly_the_right_trials_as_sent(sweep, tmp_path):
    out, records, requests = sweep
    target = tmp_path / "train.jsonl"
    res = rlm_process(["export", "--format", "chat", "--sweep", str(out), "--correct-only",
               "-o", str(target)])
    assert res.rc == 0, res.stderr
    examples = read(target)
    right = {r["run_id"]: r for r in records if r["correct"]}
    # every call of every right trial, none of a wrong one
    assert {e["metadata"]["run_id"] for e in examples} == set(right)
    assert len(examples) == recorded_calls(out / "journal.sqlite3", set(right)) == 5
    for e in examples:
        sent, reply = e["messages"][:-1], e["messages"][-1]
        # as sent: the very messages the server received, and the reply it gave
        assert any(req["messages"] == sent for req in requests), sent
        assert reply == {"role": "assistant", "content": sweep_t.responder({"messages": sent})}
        meta, trial = e["metadata"], right[e["metadata"]["run_id"]]
        assert meta["trial"]["correct"] is True and meta["trial"]["key"] == trial["key"]
        assert meta["trial"]["identity_sha256"][:20] == trial["run_id"][len("eval-"):]
        assert meta["harness_version"] == trial["identity"]["harness"]
        assert meta["stage_id"].endswith("model_call-0") and meta["model"] == MODEL
    kinds = sorted((e["metadata"]["kind"], e["metadata"]["level"]) for e in examples)
    # easy: base (plain), depth 0 and depth 1 turns; hard depth 1: its turn and its llm_query
    assert kinds == [("llm_query", 1), ("plain", 0), ("turn", 0), ("turn", 0), ("turn", 0)]
    # the same journal gives the same bytes, into a new file or over the old one
    again = tmp_path / "again.jsonl"
    assert rlm(["export", "--format", "chat", "--sweep", str(out), "--correct-only",
                "-o", str(again)]).rc == 0
    assert again.read_bytes() == target.read_bytes()
    assert rlm(["export", "--format", "chat", "--sweep", str(out), "--correct-only",
                "-o", str(target), "--overwrite"]).rc == 0
    assert again.read_bytes() == target.read_bytes()


def test_levels_kinds_and_trial_filters_pick_their_calls(sweep, tmp_path):
    out, records, _ = sweep

    def export(*flags: str) -> list[dict]:
        target = tmp_path / f"x{len(list(tmp_path.iterdir()))}.jsonl"
        res = rlm(["export", "--format", "chat", "--sweep", str(out), *flags, "-o", str(target)])
        assert res.rc == 0, res.stderr
        return read(target)

    subs = export("--correct-only", "--level", "1")
    assert len(subs) == 1 and subs[0]["messages"][0]["role"] == "user"  # a sub-call: no system
    assert subs[0]["messages"][0]["content"].startswith("SUB[hard#0#0]")
    roots = export("--correct-only", "--level", "0", "--kind", "turn")
    assert len(roots) == 3 and all(e["messages"][0]["role"] == "system" for e in roots)
    # wrong trials too: every completed trial's calls (hard base and depth 0 add one each)
    assert len(export()) == 7
    assert {e["metadata"]["trial"]["task"] for e in export("--task", "hard")} == {"hard"}
    depth1 = export("--depth", "1", "--method", "rlm")
    assert {e["metadata"]["trial"]["depth"] for e in depth1} == {1} and len(depth1) == 3
    assert {e["metadata"]["trial"]["score"] for e in export("--min-score", "0.5")} == {1.0}


def test_per_conversation_keeps_each_loop_whole(trajectory, tmp_path):
    journal, run_id, _ = trajectory
    env = clean_env(RLM_JOURNAL=str(journal))

    def export(*flags: str) -> list[dict]:
        target = tmp_path / f"x{len(list(tmp_path.iterdir()))}.jsonl"
        res = rlm(["export", "--format", "chat", run_id, *flags, "-o", str(target)], env)
        assert res.rc == 0, res.stderr
        return read(target)

    calls = export("--kind", "turn")
    convs = export("--kind", "turn", "--per", "conversation")
    # the root loop and the child that completed: one example each, its last call's
    assert [c["metadata"]["conversation"] for c in convs] == [
        "run/iteration-2/cell-0/child-0", "run"]
    root = [c for c in calls if c["metadata"]["conversation"] == "run"]
    assert convs[1]["messages"] == root[-1]["messages"] and convs[1]["metadata"]["turns"] == 4
    for c in root:  # every turn of the root is inside the conversation, as it was sent
        assert convs[1]["messages"][:len(c["messages"])] == c["messages"]
    # by level: the root's turns at 0; the child's turns and the root's sub-calls at 1
    levels = {(c["metadata"]["level"], c["metadata"]["kind"]) for c in export("--level", "1")}
    assert levels == {(1, "turn"), (1, "llm_query")}


def test_a_compacted_conversation_is_exported_as_it_was_sent(scripted, tmp_path):
    """A loop compacted between turns: the conversation is cut at each compaction, so each
    example is a conversation as sent and every turn's call is inside one of them."""
    sys.path.insert(0, str(TESTS / "core"))
    import test_compaction_windowed as comp
    journal = tmp_path / "j.sqlite3"
    go, srv, _, _ = comp.run(scripted, journal, context_window=comp.WINDOW)
    res = go()
    assert res.status == "completed", res.reason
    env = clean_env(RLM_JOURNAL=str(journal))
    per_call, per_conv = tmp_path / "calls.jsonl", tmp_path / "convs.jsonl"
    for target, per in ((per_call, "call"), (per_conv, "conversation")):
        r = rlm(["export", "--format", "chat", res.run_id, "--level", "0", "--kind", "turn",
                 "--per", per, "-o", str(target)], env)
        assert r.rc == 0, r.stderr
    calls, convs = read(per_call), read(per_conv)
    _, comps = comp.compaction_stages(journal, res.run_id)
    root_compactions = [s for s in comps if s["level"] == 0]
    assert len(calls) == comp.TURNS and len(root_compactions) >= 2
    assert len(convs) == len(root_compactions) + 1
    sent = [r["messages"] for r in srv.requests]
    for c in convs:
        assert c["messages"][:-1] in sent
    for c in calls:
        assert sum(1 for v in convs if v["messages"][:len(c["messages"])] == c["messages"]) == 1


def test_bad_input_is_a_clear_error_and_writes_nothing(sweep, tmp_path):
    out, records, _ = sweep
    target = tmp_path / "t.jsonl"

    def refused(args: list[str], *needles: str, env: dict | None = None) -> None:
        assert_clean_error(rlm(args, env), 2, *needles)
        assert not target.exists()

    chat = ["export", "--format", "chat"]
    refused(chat + ["--sweep", str(tmp_path / "nowhere"), "-o", str(target)],
            "no sweep directory")
    refused(chat + ["--sweep", str(out), "--task", "nope", "-o", str(target)],
            "no trials of task nope", "easy, hard")
    refused(chat + ["--sweep", str(out), "--profile", "general", "-o", str(target)],
            "profile general")
    refused(chat + ["--sweep", str(out), "--correct-only", "--level", "3", "-o", str(target)],
            "no completed model call at level 3", "their calls: level 0 plain, level 0 turn, level 1 llm_query")
    env = clean_env(RLM_JOURNAL=str(out / "journal.sqlite3"))
    refused(chat + ["eval-nosuchrun", "-o", str(target)], "no run 'eval-nosuchrun'", env=env)
    refused(chat + [records[0]["run_id"], "--correct-only", "-o", str(target)],
            "--correct-only", "--sweep", env=env)
    refused(chat + ["-o", str(target)], "run ids or --sweep", env=env)
    refused(["export", records[0]["run_id"], records[1]["run_id"]], "exactly one", env=env)
    # an older journal: refused, not migrated
    old = tmp_path / "old" / "journal.sqlite3"
    old.parent.mkdir()
    shutil.copy(out / "journal.sqlite3", old)
    with sqlite3.connect(old) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        db.execute("PRAGMA user_version = 3")
    before = old.read_bytes()
    refused(chat + ["--sweep", str(out), "--journal", str(old), "-o", str(target)],
            "schema version 3, older", "not modified")
    assert old.read_bytes() == before
    # an output that exists is kept, whatever the format
    target.write_text("keep me\n")
    for args in (chat + ["--sweep", str(out)], ["export", records[0]["run_id"]]):
        res = rlm(args + ["-o", str(target)], env)
        assert_clean_error(res, 2, "exists", "--overwrite")
        assert target.read_text() == "keep me\n"


def test_no_example_carries_a_key(scripted, tmp_path):
    """A key in the context (so in the prompts sent) and in the model's reply is exported as
    ``[redacted]``: the exporter's own key variables and anything key-like."""
    import rlm as rlm_api
    secret = "my-own-secret-value-123"
    keylike = "sk-proj-" + "Ab3" * 8

    def respond(req: dict) -> str:
        if req["messages"][0]["role"] != "system":
            return f"it says {keylike}"
        return "```repl\nFINAL(llm_query('what key? ' + context[-80:]))\n```"

    srv = scripted(respond)
    journal = tmp_path / "j.sqlite3"
    res = rlm_api.completion(f"notes. the key is {secret} and {keylike}.", "which key?",
                             base_url=srv.base_url, api_key=API_KEY, model=MODEL,
                             journal=str(journal))
    assert res.status == "completed" and keylike in res.answer
    target = tmp_path / "t.jsonl"
    r = rlm(["export", "--format", "chat", res.run_id, "-o", str(target)],
            clean_env(RLM_JOURNAL=str(journal), OPENAI_API_KEY=secret))
    assert r.rc == 0, r.stderr
    text = target.read_text()
    assert secret not in text and keylike not in text and "sk-proj" not in text
    assert text.count("[redacted]") >= 3  # the sub-call's prompt and reply, the next turn


def test_a_profile_bootstrapped_from_the_right_trials_runs(sweep, tmp_path, scripted):
    """``--format profile``: the shortest right program per task, a copy of one already
    taken skipped, after the base profile's template; a run with ``--prompt FILE`` on a
    held-out sample (another seed) is sent those examples."""
    import rlm as rlm_api
    from rlm.prompting import prompts
    out, records, _ = sweep
    target = tmp_path / "boot.txt"
    res = rlm(["export", "--format", "profile", "--sweep", str(out), "--examples", "3",
               "-o", str(target)])
    assert res.rc == 0, res.stderr
    text = target.read_text()
    assert text.startswith(prompts.PROFILES["small"][0].rstrip("\n"))
    # easy's program (the same at depth 0 and 1: taken once) and hard's depth-1 program;
    # hard's wrong depth-0 trial gives none
    added = text.split("Worked examples:")[1]
    assert added.count("\nExample ") == 2 and "Example 3" not in added
    assert "Example 1. Question: Q[easy#0#0] what is the code?" in added
    assert "FINAL('easy-0-0')" in added and "llm_query('SUB[hard#0#0]')" in added
    assert added.count("FINAL('easy-0-0')") == 1
    assert prompts.check_template(text) is None

    def respond(req: dict):  # the scripted model reads its task from the question, not from
        msgs = req["messages"]  # the examples the system prompt now carries
        if msgs[0]["role"] == "system":
            msgs = [{"role": "system", "content": ""}] + msgs[1:]
        return sweep_t.responder({"messages": msgs})

    srv = scripted(respond)
    held_out = sweep_t.make_sample("hard", 1024, 1, 0)
    run = rlm_api.completion(held_out.context, held_out.query, base_url=srv.base_url,
                             api_key=API_KEY, model=MODEL, prompt=str(target), journal=False)
    assert run.status == "completed" and run.answer == held_out.expected[0]
    system = srv.requests[0]["messages"][0]["content"]
    assert "llm_query('SUB[hard#0#0]')" in system and "Worked examples" in system
    # bad input: no right trial in the split, no sweep, an existing file
    assert_clean_error(rlm(["export", "--format", "profile", "--sweep", str(out), "--method",
                            "base", "-o", str(tmp_path / "x.txt")]), 2, "no correct rlm trial")
    assert not (tmp_path / "x.txt").exists()
    assert_clean_error(rlm(["export", "--format", "profile", "-o", str(tmp_path / "x.txt")]),
                       2, "--sweep")
    assert_clean_error(rlm(["export", "--format", "profile", "--sweep", str(out),
                            "-o", str(target)]), 2, "exists")


def test_a_sweep_finds_its_journal_where_sweep_json_names_it(sweep, tmp_path):
    """A sweep whose journal is not in its directory (``rlm eval --journal PATH``): the export
    finds it through ``sweep.json``; a journal holding none of its runs is said to, and a
    damaged ``sweep.json`` is warned about, not ignored."""
    out, records, _ = sweep
    moved = tmp_path / "moved"
    moved.mkdir()
    for name in ("trials.jsonl", "sweep.json"):
        shutil.copy(out / name, moved / name)
    assert json.loads((moved / "sweep.json").read_text())["journal"] == str(
        (out / "journal.sqlite3").resolve())
    target = tmp_path / "t.jsonl"
    res = rlm_process(["export", "--format", "chat", "--sweep", str(moved), "--correct-only",
                       "-o", str(target)])
    assert res.rc == 0, res.stderr
    assert len(read(target)) > 0
    # another journal, holding none of the sweep's runs: said so, nothing written
    from harness.journal import Journal
    other = tmp_path / "other.sqlite3"
    with Journal(other) as j:
        j.create_run("unrelated", query="q", model="m")
    for fmt in (["--format", "chat"], ["--format", "profile"]):
        res = rlm_process(["export", *fmt, "--sweep", str(moved), "--journal", str(other),
                           "-o", str(tmp_path / "x.out")])
        assert_clean_error(res, 2, "none of the", "is in journal", "--journal")
        assert not (tmp_path / "x.out").exists()
    # a damaged sweep.json: warned about, then DIR/journal.sqlite3 (there is none here)
    (moved / "sweep.json").write_text("{{{")
    res = rlm_process(["export", "--format", "chat", "--sweep", str(moved), "-o",
                       str(tmp_path / "y.jsonl")])
    assert "sweep.json cannot be read" in res.stderr
    assert_clean_error(res, 2, "has no journal")


def test_a_flag_another_format_takes_is_refused(sweep, tmp_path):
    out, records, _ = sweep
    env = clean_env(RLM_JOURNAL=str(out / "journal.sqlite3"))
    run_id = records[0]["run_id"]
    cases = [(["export", run_id, "--level", "0"], "--level is not for --format journal",
              "chat"),
             (["export", run_id, "--examples", "3"], "--examples is not for --format journal",
              "profile"),
             (["export", "--format", "chat", run_id, "--examples", "3", "--base-profile",
               "general"], "--examples, --base-profile are not for --format chat", "profile"),
             (["export", "--format", "profile", "--sweep", str(out), "--level", "1", "--per",
               "conversation"], "--per, --level are not for --format profile", "chat")]
    for args, *needles in cases:
        assert_clean_error(rlm(args + ["-o", str(tmp_path / "f.out")], env), 2, *needles)
        assert not (tmp_path / "f.out").exists()


def test_a_named_run_left_out_by_a_filter_is_said(sweep, tmp_path):
    out, records, _ = sweep
    env = sweep_t.env_with_factory(out / "journal.sqlite3")
    by_depth = {r["depth"]: r["run_id"] for r in records if r["method"] == "rlm"}
    res = rlm_process(["export", "--format", "chat", by_depth[0], by_depth[1], "--depth", "1",
                       "-o", str(tmp_path / "d.jsonl")], env)
    assert res.rc == 0, res.stderr
    assert f"skipped: run {by_depth[0]} has depth 0" in res.stderr
