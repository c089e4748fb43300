"""The verifiers adapter (rlm/training/verifiers_env.py, plugin id ``rlm-verifiers``): verifiers'
own evaluation entry point, ``vf-eval``, runs our RLM as its rollouts against the scripted
OpenAI-protocol server on 127.0.0.1 (through verifiers' interception server, which records
every model call in its traces), with real kernels and a real journal.

The rewards in vf-eval's traces must equal what ``rlm eval``'s trial runner scores for the same
samples, and every rollout must replay from our journal with no request.

verifiers 0.4.0 cannot be installed beside this project's test environment (it pins
``openai<3`` and pulls in a distribution whose import name is ``kernels``: docs/training.md),
so this test skips unless it runs in an environment that has it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import API_KEY, MODEL, REPO, TESTS, clean_env

pytest.importorskip("verifiers.v1", reason="verifiers 0.4 is not installed (the [train] extra, "
                    "in an environment of its own: docs/training.md)")

sys.path.insert(0, str(TESTS / "evaluation"))
import test_eval_sweep as sweep_t  # noqa: E402

FACTORY = "test_eval_sweep:make_sample"


def test_vf_eval_rewards_match_rlm_eval_and_rollouts_replay_free(scripted, tmp_path):
    from rlm.evaluation.trial import TrialSpec, run_trial
    srv = scripted(sweep_t.responder)
    env = clean_env(RLM_VF_TEST_KEY=API_KEY)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS / "evaluation"), str(TESTS)])
    vf_eval = Path(sys.executable).parent / "vf-eval"
    p = subprocess.run(
        [str(vf_eval), "rlm-verifiers", "-m", MODEL, "--client.base-url", srv.base_url,
         "--client.api-key-var", "RLM_VF_TEST_KEY", "--env.taskset.tasks", '["easy","hard"]',
         "--env.taskset.lengths", "[1024]", "--env.taskset.n", "2",
         "--env.taskset.sample-factory", FACTORY, "--env.agent.harness.id", "rlm-verifiers",
         "--env.agent.harness.sample-factory", FACTORY, "--env.agent.harness.max-depth", "0",
         "--env.agent.harness.directory", str(tmp_path / "rollouts"),
         "--env.agent.harness.concurrency", "1",
         "--env.agent.runtime.type", "subprocess", "--no-push", "--no-rich",
         "-o", str(tmp_path / "out")], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    [traces] = list((tmp_path / "out").glob("*/traces.jsonl"))
    got = {}
    for line in traces.read_text().splitlines():
        episode = json.loads(line)
        [trace] = episode["traces"]
        got[episode["task"]["data"]["id"]] = (trace["rewards"]["task_score"]["score"],
                                              trace["info"]["rlm"], len(trace["calls"]))
    assert sorted(got) == ["easy|1024|0|0", "easy|1024|0|1", "hard|1024|0|0", "hard|1024|0|1"]
    sent = srv.count
    # one rollout at a time, as set, although verifiers loads a harness per episode
    import sqlite3
    spans = []
    for _, rollout, _ in got.values():
        with sqlite3.connect(rollout["journal"]) as db:
            spans += db.execute("SELECT created_at, finished_at FROM runs WHERE run_id = ?",
                                (rollout["run_id"],)).fetchall()
    spans.sort()
    assert len(spans) == 4
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    os.environ["RLM_VF_TEST_KEY"] = API_KEY
    for key, (reward, rollout, calls) in got.items():
        task, length, seed, index = key.split("|")
        spec = TrialSpec(task, int(length), int(seed), int(index), "rlm", 0, "small", MODEL,
                         base_url=srv.base_url, api_key_env="RLM_VF_TEST_KEY",
                         journal=str(tmp_path / "eval.sqlite3"), sample_factory=FACTORY)
        rec = run_trial(spec, make_sample=sweep_t.make_sample)
        want = rec["score"]
        assert reward == rollout["reward"] == want == (1.0 if task == "easy" else 0.0), key
        assert calls == rollout["usage"]["calls"]  # every call went through verifiers
    sent_by_eval = srv.count - sent
    for key, (_, rollout, _) in got.items():
        r = subprocess.run([sys.executable, "-m", "rlm", "replay", rollout["run_id"],
                            "--journal", rollout["journal"], "--json"], env=clean_env(),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["answer"] == rollout["answer"]
    assert srv.count == sent + sent_by_eval  # the replays sent nothing


def test_vf_eval_sends_sub_calls_to_the_harness_sub_endpoint(scripted, tmp_path):
    """``--env.agent.harness.sub-base-url``: each rollout's root turns go through verifiers'
    interception endpoint to the policy's server, its ``llm_query`` to the other server with
    the key the named variable holds; the sub-call is journaled, not in the trace, and that
    key is nowhere in the journal."""
    policy = scripted(sweep_t.responder)
    sub = scripted(sweep_t.responder)
    sub_key = "sk-sub-endpoint-key-0123456789"
    env = clean_env(RLM_VF_TEST_KEY=API_KEY, RLM_VF_SUB_KEY=sub_key)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS / "evaluation"), str(TESTS)])
    journal = tmp_path / "rollouts.sqlite3"
    p = subprocess.run(
        [str(Path(sys.executable).parent / "vf-eval"), "rlm-verifiers", "-m", MODEL,
         "--client.base-url", policy.base_url, "--client.api-key-var", "RLM_VF_TEST_KEY",
         "--env.taskset.tasks", '["hard"]', "--env.taskset.lengths", "[1024]",
         "--env.taskset.n", "2", "--env.taskset.sample-factory", FACTORY,
         "--env.agent.harness.id", "rlm-verifiers", "--env.agent.harness.sample-factory", FACTORY,
         "--env.agent.harness.max-depth", "1",
         "--env.agent.harness.sub-base-url", sub.base_url,
         "--env.agent.harness.sub-api-key-var", "RLM_VF_SUB_KEY",
         "--env.agent.harness.directory", str(tmp_path / "rollouts"),
         "--env.agent.harness.journal", str(journal),
         "--env.agent.runtime.type", "subprocess", "--no-push", "--no-rich",
         "-o", str(tmp_path / "out")], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    [traces] = list((tmp_path / "out").glob("*/traces.jsonl"))
    rewards, trace_calls = [], 0
    for line in traces.read_text().splitlines():
        [trace] = json.loads(line)["traces"]
        rewards.append(trace["rewards"]["task_score"]["score"])
        trace_calls += len(trace["calls"])
        assert trace["info"]["rlm"]["usage"]["calls"] == 2  # the root turn and its sub-call
    assert rewards == [1.0, 1.0]  # the sub endpoint's reply is the answer
    assert trace_calls == 2  # only the root turns went through verifiers
    assert all(m[0]["role"] == "system" for m in (r["messages"] for r in policy.requests))
    assert len(sub.requests) == 2
    assert all(r["messages"][-1]["content"].startswith("SUB[") for r in sub.requests)
    assert sub.auth == [f"Bearer {sub_key}"] * 2
    assert sub_key not in p.stdout + p.stderr
    for f in tmp_path.rglob("*"):
        if f.is_file():
            assert sub_key.encode() not in f.read_bytes(), f


@pytest.mark.parametrize("flag, value, needle", [
    ("profile", "nosuch", "neither a built-in profile"),
    ("max-depth", "-1", "greater than or equal to 0"),
    ("concurrency", "0", "greater than or equal to 1"),
    ("max-wall-seconds", "0", "greater than 0")])
def test_a_bad_harness_setting_stops_vf_eval_before_any_rollout(tmp_path, flag, value, needle):
    env = clean_env(RLM_VF_TEST_KEY=API_KEY)
    env["PYTHONPATH"] = str(REPO)
    p = subprocess.run(
        [str(Path(sys.executable).parent / "vf-eval"), "rlm-verifiers", "-m", MODEL,
         "--client.base-url", "http://127.0.0.1:9/v1", "--client.api-key-var", "RLM_VF_TEST_KEY",
         "--env.agent.harness.id", "rlm-verifiers", f"--env.agent.harness.{flag}", value,
         "--env.agent.harness.directory", str(tmp_path / "rollouts"), "--env.taskset.n", "1",
         "--env.agent.runtime.type", "subprocess", "--no-push", "--no-rich",
         "-o", str(tmp_path / "out")], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=120)
    assert p.returncode != 0
    assert needle in " ".join((p.stdout + p.stderr).split()), p.stderr[-2000:]
    assert not (tmp_path / "rollouts").exists()
