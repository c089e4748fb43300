"""The RL environment (rlm/training/env.py): rollouts are real RLM runs (real kernels, the
scripted OpenAI-protocol server on 127.0.0.1, a real journal) scored by the eval task's
scorer, each replayable with no model call.

The samples are ``tests/evaluation/test_eval_sweep.py``'s tiny tasks, whose scripted model
answers ``easy`` right at any depth and ``hard`` right only at depth 1 (its ``llm_query``
finds the answer): rewards 1, 1 / 1, 0 at depth 0 and 1, 1 / 1, 1 at depth 1. What ``rlm
eval`` scores for the same samples is computed by its own trial runner (``run_trial``).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import API_KEY, MODEL, TESTS, clean_env

sys.path.insert(0, str(TESTS / "evaluation"))
import test_eval_sweep as sweep_t  # noqa: E402

FACTORY = "test_eval_sweep:make_sample"
SAMPLES = [("easy", 1024, 0, 0), ("hard", 1024, 0, 0), ("easy", 1024, 0, 1),
           ("hard", 1024, 0, 1)]


def eval_scores(srv, tmp_path, depth: int) -> list[float]:
    """What `rlm eval`'s trial runner scores for SAMPLES at ``depth`` (its own journal)."""
    import os

    from rlm.evaluation.trial import TrialSpec, run_trial
    os.environ["RLM_ENV_TEST_KEY"] = API_KEY
    out = []
    for task, length, seed, index in SAMPLES:
        spec = TrialSpec(task, length, seed, index, "rlm", depth, "small", MODEL,
                         base_url=srv.base_url, api_key_env="RLM_ENV_TEST_KEY",
                         journal=str(tmp_path / f"eval-{depth}.sqlite3"),
                         sample_factory=FACTORY)
        out.append(run_trial(spec, make_sample=sweep_t.make_sample)["score"])
    return out


@pytest.mark.parametrize("depth", [0, 1])
def test_rollout_rewards_match_eval_and_every_rollout_replays_free(scripted, tmp_path,
                                                                   monkeypatch, depth):
    from rlm.training.env import Environment, Policy
    monkeypatch.syspath_prepend(str(TESTS / "evaluation"))
    srv = scripted(sweep_t.responder)
    want = eval_scores(srv, tmp_path, depth)
    assert want == ([1.0, 0.0, 1.0, 0.0] if depth == 0 else [1.0, 1.0, 1.0, 1.0])
    eval_requests = list(srv.requests)
    policy = Policy(base_url=srv.base_url, model=MODEL, api_key=API_KEY)
    with Environment(tmp_path / "env", max_depth=depth, sample_factory=FACTORY,
                     caps={"max_calls": 10, "max_iterations": 5}) as env:
        rollouts = env.rollouts(SAMPLES, policy, concurrency=3)
        assert [r.reward for r in rollouts] == want
        assert [r.key for r in rollouts] == ["|".join(map(str, s)) for s in SAMPLES]
        assert all(r.status == "completed" and r.usage["calls"] >= 1 for r in rollouts)
        # the rollout's model saw what the eval trial's saw: the same requests were sent
        sent = srv.requests[len(eval_requests):]
        assert sorted(map(repr, (r["messages"] for r in sent))) == sorted(
            map(repr, (r["messages"] for r in eval_requests)))
        n = srv.count
        for r in rollouts:  # the reward can be audited: the run replays with no request
            again = env.replay(r)
            assert again.answer == r.answer and again.replayed_calls == r.usage["calls"]
        assert srv.count == n
    # and from the command line, by the id the reward travelled with
    r = rollouts[1]
    p = subprocess.run([sys.executable, "-m", "rlm", "replay", r.run_id, "--journal",
                        r.journal, "--json"], env=clean_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    replayed = json.loads(p.stdout)
    assert srv.count == n and replayed["answer"] == r.answer
    assert replayed["replayed_calls"] == r.usage["calls"]


def test_reset_group_ids_and_failed_rollouts(scripted, tmp_path, monkeypatch):
    from rlm.training.env import Environment, Policy
    monkeypatch.syspath_prepend(str(TESTS / "evaluation"))
    srv = scripted(sweep_t.responder)
    policy = Policy(base_url=srv.base_url, model=MODEL, api_key=API_KEY)
    with Environment(tmp_path / "env", max_depth=1, sample_factory=FACTORY) as env:
        ep = env.reset(SAMPLES[0], policy)
        assert ep.key == "easy|1024|0|0" and "Q[easy#0#0]" in ep.first_user
        assert ep.file.read_text() == sweep_t.make_sample(*SAMPLES[0]).context
        group = env.rollouts(SAMPLES[:1], policy, group=3, tag="step-7")
        assert len({r.run_id for r in group}) == 3 and all(r.reward == 1.0 for r in group)
        # the same sample, policy, tag and attempt is the same run: served, not sent again
        n = srv.count
        same = env.rollout(SAMPLES[0], policy, tag="step-7", attempt=0)
        assert same.run_id == group[0].run_id and same.reward == 1.0 and srv.count == n
        # caps hold per rollout: one call allowed, so hard's llm_query is refused (its code
        # falls back to a guess, scored 0) and nothing past the cap is sent
        n = srv.count
        capped = Environment(tmp_path / "capped", max_depth=1, sample_factory=FACTORY,
                             caps={"max_calls": 1})
        with capped:
            out = capped.rollouts([SAMPLES[1], SAMPLES[0]], policy)
        assert [(r.answer, r.reward, r.usage["calls"]) for r in out] == [
            ("guess", 0.0, 1), ("easy-0-0", 1.0, 1)]
        assert srv.count == n + 2
    # a policy whose endpoint is down: reward 0 and the error, not an exception
    from conftest import closed_port
    down = Policy(base_url=f"http://127.0.0.1:{closed_port()}/v1", model=MODEL, api_key=API_KEY)
    with Environment(tmp_path / "down", max_depth=1, sample_factory=FACTORY,
                     caps={"max_wall_seconds": 2}) as env:
        r = env.rollout(SAMPLES[0], down)
    assert r.reward == 0.0 and r.answer is None and r.status in ("error", "budget_exceeded"), r


def test_bad_samples_counts_and_directories_are_config_errors(tmp_path, monkeypatch):
    """Said as ConfigError before anything runs, never a bare Python exception."""
    from rlm.errors import ConfigError
    from rlm.training.env import Environment, Policy
    monkeypatch.syspath_prepend(str(TESTS / "evaluation"))
    policy = Policy(base_url="http://127.0.0.1:9/v1", model=MODEL, api_key=API_KEY)
    with Environment(tmp_path / "env", sample_factory=FACTORY) as env:
        for bad, needle in [(("easy", 1024), "(task, length, seed, index)"),
                            (["easy", 1024, 0, 0, 9], "got 5 value(s)"),
                            ("easy", "not a sample"), (42, "not a sample")]:
            with pytest.raises(ConfigError, match=re.escape(needle)):
                env.reset(bad, policy)
        for kw in ({"group": 0}, {"concurrency": 0}, {"group": -2}, {"concurrency": 1.5},
                   {"group": True}):
            with pytest.raises(ConfigError, match="at least 1"):
                env.rollouts(SAMPLES[:1], policy, **kw)
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("x")
    with pytest.raises(ConfigError, match="cannot use .*a-file"):
        Environment(in_the_way)


def test_subcalls_go_to_a_separate_endpoint_by_option(scripted, tmp_path, monkeypatch):
    from conftest import closed_port, is_root
    from rlm.training.env import Environment, Policy
    from scripted_server import Reply
    monkeypatch.syspath_prepend(str(TESTS / "evaluation"))
    sub_key = "sub-endpoint-key-93"
    # the policy's server answers loop turns only, the sub-call server sub-calls only
    pol = scripted(lambda req: sweep_t.responder(req) if is_root(req)
                   else Reply(status=400, content="a sub-call reached the policy"))
    sub = scripted(lambda req: Reply(status=400, content="a turn reached the sub endpoint")
                   if is_root(req) else sweep_t.responder(req))
    same = Policy(base_url=pol.base_url, model=MODEL, api_key=API_KEY)
    policy = Policy(base_url=pol.base_url, model=MODEL, api_key=API_KEY,
                    sub_base_url=sub.base_url, sub_api_key=sub_key)
    assert set(same.identity()) == {"base_url", "model", "sub_model", "embedded_model"}
    assert sub_key not in repr(policy) and sub_key not in json.dumps(policy.identity())
    with Environment(tmp_path / "env", max_depth=1, sample_factory=FACTORY) as env:
        rollouts = env.rollouts(SAMPLES, policy, concurrency=2)
        # the depth-1 rewards: hard's llm_query found its answer at the sub-call endpoint
        assert [r.reward for r in rollouts] == [1.0, 1.0, 1.0, 1.0], rollouts
        assert len(sub.requests) == 2 and sub.auth == [f"Bearer {sub_key}"] * 2
        assert len(pol.requests) == 4 and set(pol.auth) == {f"Bearer {API_KEY}"}
        hard = env.sample(SAMPLES[1])
        assert env.run_id(hard, policy) != env.run_id(hard, same)
        n, m = pol.count, sub.count
        for r in rollouts:  # each replays with no request to either endpoint
            assert env.replay(r).answer == r.answer
        assert (pol.count, sub.count) == (n, m)
    raw = b"".join(p.read_bytes() for p in (tmp_path / "env").glob("journal.sqlite3*"))
    assert sub.base_url.encode() in raw and sub_key.encode() not in raw
    # the sub-call endpoint down: that rollout is an error naming it, reward 0, not an exception
    down = Policy(base_url=pol.base_url, model=MODEL, api_key=API_KEY,
                  sub_base_url=f"http://127.0.0.1:{closed_port()}/v1")
    with Environment(tmp_path / "down", max_depth=1, sample_factory=FACTORY,
                     caps={"max_attempts": 2}) as env:
        r = env.rollout(SAMPLES[1], down)
    assert r.reward == 0.0 and r.status == "error", r
    assert "sub-call endpoint" in r.error and "unreachable" in r.error, r.error


from test_eval_sweep import ray_head  # noqa: E402,F401  (the fixture: a real Ray head)


def test_rollouts_on_ray_give_the_local_rewards_and_replay(scripted, tmp_path, monkeypatch,
                                                           ray_head):  # noqa: F811
    from rlm.training.env import Environment, Policy
    monkeypatch.syspath_prepend(str(TESTS / "evaluation"))
    srv = scripted(sweep_t.responder)
    policy = Policy(base_url=srv.base_url, model=MODEL, api_key=API_KEY)
    with Environment(tmp_path / "env", max_depth=0, sample_factory=FACTORY) as env:
        on_ray = env.rollouts(SAMPLES, policy, ray_address=ray_head, tag="ray")
        assert [r.key for r in on_ray] == ["|".join(map(str, s)) for s in SAMPLES]
        assert [r.reward for r in on_ray] == [1.0, 0.0, 1.0, 0.0]
        local = env.rollouts(SAMPLES, policy, tag="local")
        assert [r.reward for r in local] == [r.reward for r in on_ray]
        n = srv.count
        for r in on_ray:
            assert env.replay(r).answer == r.answer
        assert srv.count == n
