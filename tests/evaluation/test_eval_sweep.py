"""``rlm eval``'s sweep (rlm/evaluation/sweep.py, ray_runner.py, rlm/cli/eval.py) against the
scripted OpenAI-protocol server on 127.0.0.1, with real kernels and real SQLite journals.

The trials use the tiny tasks of this module (``--sample-factory test_eval_sweep:make_sample``,
the documented hook for one's own tasks), so the expected answers are known exactly:

* ``easy``: every method answers right.
* ``hard``: the base call and the depth-0 RLM answer wrong; the depth-1 RLM gets the answer
  from one ``llm_query`` (at depth 0 the call is refused and its code falls back to a guess).

Also here: the base method as a journaled plain completion (a second call is served from the
journal), a SIGKILL mid-sweep then a rerun (no finished trial runs twice, the server sees no
journaled call twice, the interrupted trial resumes from the journal), a trial finished in the
journal but missing from the JSONL (served with no call), grid checks, and a sweep on a real
Ray head started on 127.0.0.1 giving the same results as the local run.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import API_KEY, MODEL, REPO, TESTS, assert_clean_error, clean_env, endpoint_args

FACTORY = "test_eval_sweep:make_sample"
TASKS = ("easy", "hard")


# --------------------------------------------------------------------------- the tiny tasks


@dataclass(frozen=True)
class TinySample:
    """A sample with the fields and methods of rlm.evaluation.tasks.Sample."""

    task: str
    length: int
    seed: int
    index: int
    context: str
    query: str
    expected: list
    metric: str = "exact"
    context_chars: int = 0
    context_tokens: int = 0

    def base_prompt(self, max_tokens: int) -> tuple[str, bool]:
        return f"BASE {self.query}\n{self.context}", self.task == "hard"

    def score(self, answer: str | None) -> float:
        return 1.0 if (answer or "").strip() == self.expected[0] else 0.0


def make_sample(task: str, length: int, seed: int, index: int) -> TinySample:
    answer = f"{task}-{seed}-{index}"
    ctx = f"filler text. the code of {task} #{index} is {answer}. more filler."
    return TinySample(task, length, seed, index, ctx, f"Q[{task}#{index}#{seed}] what is the code?",
                      [answer], context_chars=len(ctx), context_tokens=len(ctx) // 4)


def bad_raises(task: str, length: int, seed: int, index: int):
    raise RuntimeError("boom in factory")


def bad_none(task: str, length: int, seed: int, index: int):
    return None


def bad_metric(task: str, length: int, seed: int, index: int):
    from rlm.evaluation.tasks import Sample
    good = make_sample(task, length, seed, index)
    return Sample(task, length, seed, index, good.context, good.query, good.expected, "nope",
                  good.context_chars, good.context_tokens)


def bad_empty(task: str, length: int, seed: int, index: int):
    return TinySample(task, length, seed, index, "  \n", "q?", ["x"])


def repl(*lines: str) -> str:
    return "```repl\n" + "\n".join(lines) + "\n```"


def responder(req: dict) -> str:
    """Answers by what the request carries, so concurrent trials get their own replies."""
    msgs = req.get("messages") or []
    text = "\n".join(str(m.get("content") or "") for m in msgs)
    task, index, seed = re.search(r"(?:Q|SUB)\[(\w+)#(\d+)#(\d+)\]", text).groups()
    answer = f"{task}-{seed}-{index}"
    if msgs and msgs[0].get("role") == "system":  # an RLM's root turn
        if task == "easy":
            return repl(f"FINAL({answer!r})")
        return repl("try:", f"    a = llm_query('SUB[{task}#{index}#{seed}]')", "except Exception:",
                    "    a = 'guess'", "FINAL(a)")
    if text.startswith("SUB["):
        return answer
    return answer if task == "easy" else "no idea"  # the base call


#: (task, method, depth) -> (correct, subcalls, max_depth_reached) of every trial of the cell
EXPECTED = {("easy", "base", None): (True, 0, 0), ("easy", "rlm", 0): (True, 0, 0),
            ("easy", "rlm", 1): (True, 0, 0), ("hard", "base", None): (False, 0, 0),
            ("hard", "rlm", 0): (False, 0, 0), ("hard", "rlm", 1): (True, 1, 1)}


def grid_args(srv, out: Path, journal: Path, n: int = 2, *extra: str) -> list[str]:
    return ["eval", "--sample-factory", FACTORY, "--tasks", ",".join(TASKS),
            "--lengths", "1k", "--methods", "base,rlm", "--depths", "0,1", "--prompt", "small",
            "--n", str(n), "--out", str(out), "--journal", str(journal), "-q",
            *endpoint_args(srv), *extra]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_records(records: list[dict], n: int) -> None:
    """Exactly the grid's trials, each once, with the known outcome."""
    keys = [r["key"] for r in records]
    assert len(keys) == len(set(keys)) == n * len(TASKS) * 3, keys
    for r in records:
        correct, subcalls, reached = EXPECTED[(r["task"], r["method"], r["depth"])]
        want = f"{r['task']}-0-{r['trial']}"
        assert r["expected"] == [want]
        assert r["correct"] is correct and r["score"] == (1.0 if correct else 0.0), r
        assert r["status"] == "completed" and r["failure"] == (None if correct else "wrong"), r
        assert r["subcalls"] == subcalls and r["max_depth_reached"] == reached, r
        assert r["answer"] == (want if correct else "guess" if r["method"] == "rlm"
                               else "no idea"), r
        assert r["truncated"] is (r["method"] == "base" and r["task"] == "hard")
        assert r["profile"] == (None if r["method"] == "base" else "small")
        assert r["model"] == MODEL and r["run_id"].startswith("eval-") and r["tokens"] > 0
        assert r["prompt_tokens"] + r["completion_tokens"] == r["tokens"]


def env_with_factory(journal: Path | None = None) -> dict:
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), str(Path(__file__).parent)])
    if journal is not None:
        env["RLM_JOURNAL"] = str(journal)
    return env


def rlm_cli(args: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlm", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


# --------------------------------------------------------------------------- run ids, base


def test_run_ids_are_stable_hashes_of_the_identity():
    import hashlib
    from dataclasses import replace

    from rlm.evaluation.sweep import Grid
    from rlm.evaluation.trial import TrialSpec, identified
    a = identified(TrialSpec("easy", 8192, 0, 3, "rlm", 1, "small", "m",
                             base_url="http://x/v1"), make_sample=make_sample)
    # where and how fast a trial runs is not what it is
    b = identified(replace(a, base_url="http://y/v1", journal="/tmp/j", api_key_env="K",
                           parts=None), make_sample=make_sample)
    canonical = json.dumps(a.parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert a.run_id() == b.run_id() == "eval-" + hashlib.sha256(
        canonical.encode()).hexdigest()[:20]
    assert a.key() == "easy|8192|0|3|rlm|1|small|m"
    others = [replace(a, depth=2), replace(a, profile="general"), replace(a, seed=1),
              replace(a, model="m2"), replace(a, max_cost_per_trial=1.0)]
    ids = {identified(replace(o, parts=None), make_sample=make_sample).run_id() for o in others}
    assert len({a.run_id(), *ids}) == 6
    specs = Grid(tasks=["t"], lengths=[1024], depths=[0, 1], profiles=["small", "general"],
                 n=2).trials()
    # base once per sample, rlm per depth per profile
    assert [(s.method, s.depth, s.profile) for s in specs[:5]] == [
        ("base", None, None), ("rlm", 0, "small"), ("rlm", 1, "small"), ("rlm", 0, "general"),
        ("rlm", 1, "general")]
    assert len(specs) == 10 and {s.trial for s in specs} == {0, 1}


def test_base_is_a_journaled_plain_completion_served_again_from_the_journal(scripted, tmp_path,
                                                                          monkeypatch):
    from rlm.evaluation.trial import TrialSpec, identified, run_trial
    srv = scripted(responder)
    journal = tmp_path / "j.sqlite3"
    monkeypatch.setenv("RLM_EVAL_TEST_KEY", API_KEY)
    spec = identified(TrialSpec("easy", 1024, 0, 0, "base", None, None, MODEL,
                                base_url=srv.base_url, api_key_env="RLM_EVAL_TEST_KEY",
                                journal=str(journal), base_window=4096), make_sample=make_sample)
    first = run_trial(spec, make_sample=make_sample)
    assert first["correct"] and not first["replayed"] and len(srv.requests) == 1
    # the call is one user message (no system prompt), the prompt cut to the window
    assert srv.requests[0]["messages"] == [{"role": "user", "content": make_sample(
        "easy", 1024, 0, 0).base_prompt(0)[0]}]
    again = run_trial(spec, make_sample=make_sample)
    assert again["replayed"] and len(srv.requests) == 1
    assert {k: v for k, v in again.items() if k not in ("wall_s", "replayed")} == {
        k: v for k, v in first.items() if k not in ("wall_s", "replayed")}
    with sqlite3.connect(journal) as db:
        stages = db.execute("SELECT stage_id, kind, status FROM stages WHERE run_id = ?",
                            (spec.run_id(),)).fetchall()
        opts = json.loads(db.execute("SELECT options FROM runs WHERE run_id = ?",
                                     (spec.run_id(),)).fetchone()[0])
    assert sorted(stages) == [("run", "run", "completed"),
                              ("run/model_call-0", "model_call", "completed")]
    assert opts["plain"] is True
    assert spec.base_prompt_tokens() == int((4096 - 1024) * 0.9)


# --------------------------------------------------------------------------- sweeps


def test_small_sweep_gives_the_expected_records(scripted, tmp_path):
    srv = scripted(responder)
    out, journal = tmp_path / "out", tmp_path / "j.sqlite3"
    res = rlm_cli(grid_args(srv, out, journal) + ["--concurrency", "3"], env_with_factory())
    assert res.returncode == 0, res.stderr
    records = read_jsonl(out / "trials.jsonl")
    check_records(records, n=2)
    assert not any(r["replayed"] for r in records)
    assert json.loads((out / "sweep.json").read_text())["grid"]["tasks"] == list(TASKS)
    calls = len(srv.requests)
    assert calls == 2 * (3 + 4)  # easy: one call per method; hard: base, d0, d1 (root + sub)
    # run again: every trial is skipped, nothing is sent
    again = rlm_cli(grid_args(srv, out, journal), env_with_factory())
    assert again.returncode == 0, again.stderr
    assert len(srv.requests) == calls and read_jsonl(out / "trials.jsonl") == records
    # a trial finished in the journal but missing from the JSONL is served from the journal
    lines = (out / "trials.jsonl").read_text().splitlines(keepends=True)
    dropped = json.loads(lines[3])
    (out / "trials.jsonl").write_text("".join(lines[:3] + lines[4:]) + lines[3][:20])  # torn
    again = rlm_cli(grid_args(srv, out, journal), env_with_factory())
    assert again.returncode == 0, again.stderr
    assert len(srv.requests) == calls
    after = read_jsonl(out / "trials.jsonl")
    check_records(after, n=2)
    served = [r for r in after if r["key"] == dropped["key"]]
    assert served[0]["replayed"] and served[0]["answer"] == dropped["answer"]
    # another grid into the same directory: refused without --force, added with it
    other = rlm_cli(grid_args(srv, out, journal, 3), env_with_factory())
    assert_clean_error_cli(other, "another grid", "--force")
    forced = rlm_cli(grid_args(srv, out, journal, 3, "--force"), env_with_factory())
    assert forced.returncode == 0, forced.stderr
    check_records(read_jsonl(out / "trials.jsonl"), n=3)
    assert len(json.loads((out / "sweep.json").read_text())["earlier"]) == 1


def assert_clean_error_cli(res: subprocess.CompletedProcess, *needles: str) -> None:
    from conftest import CLIResult
    assert_clean_error(CLIResult(res.returncode, res.stdout, res.stderr, 0.0), 2, *needles)


def test_bad_setup_is_a_clear_error(scripted, tmp_path):
    srv = scripted(responder)
    env = env_with_factory()
    out, journal = tmp_path / "out", tmp_path / "j.sqlite3"
    assert_clean_error_cli(rlm_cli(grid_args(srv, out, journal, 2, "--methods", "base,magic"),
                                   env), "--methods")
    assert_clean_error_cli(rlm_cli(grid_args(srv, out, journal, 2, "--depths", "0,x"), env),
                           "--depths")
    assert_clean_error_cli(rlm_cli(["eval", "--report", str(tmp_path / "none")], env),
                           "trials.jsonl")
    # a cost cap without a price for the model stops the sweep before any call
    res = rlm_cli(grid_args(srv, out, journal, 2, "--max-cost-per-trial", "0.5"), env)
    assert_clean_error_cli(res, "price")
    assert srv.requests == []
    # with a price the cap holds per trial: a call that could cost more is refused, unsent,
    # and the trial is a budget_exceeded record; under the cap the records carry the cost
    prices = tmp_path / "prices.json"

    def priced(usd_per_million: float, name: str) -> list[dict]:
        prices.write_text(json.dumps({MODEL: {"input": usd_per_million,
                                              "output": usd_per_million}}))
        res = rlm_cli(grid_args(srv, tmp_path / name, tmp_path / f"{name}.sqlite3", 1,
                                "--methods", "base", "--max-cost-per-trial", "0.5",
                                "--price-file", str(prices)), env)
        assert res.returncode == 0, res.stderr
        return read_jsonl(tmp_path / name / "trials.jsonl")

    # the output cap alone (1024 tokens) would cost over 1 USD
    for r in priced(1000.0, "dear"):
        assert (r["status"], r["failure"], r["score"], r["cost_usd"]) == (
            "budget_exceeded", "budget_exceeded", 0.0, 0.0), r
    assert srv.requests == []
    records = priced(100.0, "cheap")
    assert len(records) == 2 and len(srv.requests) == 2
    for r in records:
        assert r["status"] == "completed"
        assert r["cost_usd"] == pytest.approx(r["tokens"] * 100.0 / 1e6)


def test_trial_timeout_caps_each_trial(scripted, tmp_path):
    """--trial-timeout is each trial's wall cap: a root turn slower than it ends the trial as
    budget_exceeded (a result), while the fast trials of the same sweep complete."""
    from scripted_server import Reply

    def slow_hard(req):
        text = "\n".join(str(m.get("content") or "") for m in req.get("messages") or [])
        return Reply(content=responder(req), delay=10.0 if "Q[hard#" in text else 0.0)
    srv = scripted(slow_hard)
    env = env_with_factory()
    out = tmp_path / "out"
    for bad in ("0", "abc", "inf", "-5m"):
        assert_clean_error_cli(rlm_cli(grid_args(srv, out, tmp_path / "j.sqlite3", 1,
                                                 "--trial-timeout=" + bad), env),
                               "--trial-timeout")
    assert srv.count == 0
    res = rlm_cli(grid_args(srv, out, tmp_path / "j.sqlite3", 1, "--methods", "rlm",
                            "--depths", "1", "--trial-timeout", "4s"), env)
    assert res.returncode == 0, res.stderr
    by_task = {r["task"]: r for r in read_jsonl(out / "trials.jsonl")}
    assert by_task["easy"]["status"] == "completed" and by_task["easy"]["correct"], by_task["easy"]
    hard = by_task["hard"]
    assert (hard["status"], hard["failure"], hard["correct"]) == (
        "budget_exceeded", "budget_exceeded", False), hard
    assert hard["wall_s"] < 8.0, hard  # cut at the cap, not after the slow reply
    assert hard["identity"]["settings"]["max_wall_seconds"] == 4.0


def test_sigkill_mid_sweep_then_rerun_pays_no_call_twice(scripted, tmp_path):
    from scripted_server import Reply
    srv = scripted(lambda req: Reply(content=responder(req), delay=0.4))
    out, journal = tmp_path / "out", tmp_path / "j.sqlite3"
    args = grid_args(srv, out, journal, 3) + ["--concurrency", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "rlm", *args], env=env_with_factory(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        _wait_for_mid_trial(proc, out / "trials.jsonl", journal, min_lines=2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finished = {r["key"]: r for r in read_jsonl(out / "trials.jsonl")}
    assert 2 <= len(finished) < 18
    with sqlite3.connect(journal) as db:
        journaled = {f"{r}/{c}" for r, c in db.execute("SELECT run_id, call_id FROM model_calls")}
        cut = {r for (r,) in db.execute(  # killed mid-run with a call recorded
            "SELECT DISTINCT r.run_id FROM runs r JOIN model_calls c ON c.run_id = r.run_id "
            "WHERE r.status = 'running'")}
    assert cut
    seen_before = len(srv.call_ids)

    res = rlm_cli(args, env_with_factory())
    assert res.returncode == 0, res.stderr
    records = read_jsonl(out / "trials.jsonl")
    check_records(records, n=3)
    by_key = {r["key"]: r for r in records}
    for key, rec in finished.items():  # no finished trial ran twice
        assert by_key[key] == rec
    sent_after = [c for c in srv.call_ids[seen_before:]]
    assert not set(sent_after) & journaled  # no journaled call was sent again
    finished_runs = {r["run_id"] for r in finished.values()}
    assert not {c.split("/")[0] for c in sent_after} & finished_runs
    # the trials killed mid-run were resumed: their recorded calls were served from the journal
    for rec in (r for r in records if r["run_id"] in cut):
        assert rec["replayed_calls"] >= 1 and not rec["replayed"], rec
    assert len(sent_after) == len(set(sent_after))


def _wait_for_mid_trial(proc, jsonl: Path, journal: Path, min_lines: int,
                        timeout: float = 90) -> None:
    """Wait until ``min_lines`` trials are in the JSONL and some run in the journal is
    running with a model call recorded."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()
        lines = jsonl.read_text().count("\n") if jsonl.exists() else 0
        if lines >= min_lines and journal.exists():
            try:
                with sqlite3.connect(journal, timeout=5) as db:
                    row = db.execute(
                        "SELECT r.run_id FROM runs r JOIN model_calls c ON c.run_id = r.run_id "
                        "WHERE r.status = 'running' LIMIT 1").fetchone()
            except sqlite3.OperationalError:
                row = None
            if row:
                return
        time.sleep(0.03)
    raise AssertionError("the sweep never had a trial mid-run with a recorded call")


# --------------------------------------------------------------------------- Ray


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _wait_for_head(proc: subprocess.Popen, log: Path, timeout: float = 90.0) -> None:
    """Until the head says it is up: a driver connecting earlier can hang on a half-started
    cluster (seen: 'Failed to connect to the observability pubsub')."""
    deadline = time.monotonic() + timeout
    while b"Ray runtime started" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the Ray head did not start:\n" + log.read_text(errors="replace"))
        time.sleep(0.2)


@pytest.fixture
def ray_head():
    """A real Ray head on 127.0.0.1 (``ray start --head --block`` in its own process group,
    killed in teardown); yields its address."""
    pytest.importorskip("ray", reason="ray is not installed (pip install 'rlm-kernels[ray]')")
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's unix socket paths
    ray_bin = Path(sys.executable).with_name("ray")
    cmd = [str(ray_bin), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
           f"--port={port}", "--include-dashboard=false", "--num-cpus=2",
           f"--temp-dir={temp}", "--disable-usage-stats",
           f"--dashboard-port={_free_port()}",
           f"--dashboard-agent-listen-port={_free_port()}",
           f"--object-store-memory={100 * 1024 * 1024}"]
    env = env_with_factory()
    log = Path(temp) / "head.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        _wait_for_head(proc, log)
        yield f"127.0.0.1:{port}"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(5)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def test_ray_sweep_gives_the_local_results(scripted, tmp_path, ray_head):
    srv = scripted(responder)
    local = rlm_cli(grid_args(srv, tmp_path / "local", tmp_path / "local.sqlite3"),
                    env_with_factory())
    assert local.returncode == 0, local.stderr
    calls_local = len(srv.requests)
    on_ray = rlm_cli(grid_args(srv, tmp_path / "ray", tmp_path / "ray.sqlite3")
                     + ["--ray", ray_head], env_with_factory(), timeout=240)
    assert on_ray.returncode == 0, on_ray.stderr
    assert len(srv.requests) == 2 * calls_local  # the Ray run really ran every trial

    def comparable(path: Path) -> dict:
        skip = {"wall_s"}
        return {r["key"]: {k: v for k, v in r.items() if k not in skip} for r in read_jsonl(path)}

    a = comparable(tmp_path / "local" / "trials.jsonl")
    b = comparable(tmp_path / "ray" / "trials.jsonl")
    check_records(list(b.values()), n=2)
    assert a == b


# --------------------------------------------------------------------------- setup mistakes

class _Res:
    """A CompletedProcess in the shape ``assert_clean_error`` reads."""

    def __init__(self, p: subprocess.CompletedProcess) -> None:
        self.rc, self.stdout, self.stderr = p.returncode, p.stdout, p.stderr


def test_mistakes_are_caught_before_anything_is_written(scripted, tmp_path):
    srv = scripted(responder)
    bad = tmp_path / "bad.txt"
    bad.write_text("Answer {nope}")
    out = tmp_path / "out"
    for extra, needle in ((["--prompt", str(bad)], "unknown field {nope}"),
                          (["--lengths", ","], "--lengths needs at least one length"),
                          (["--ray", f"127.0.0.1:{_free_port()}"], "no Ray cluster answers"),
                          # the user's samples are checked before the first trial pays
                          (["--sample-factory", "test_eval_sweep:bad_raises"],
                           "bad_raises failed making the sample of task 'easy'.*boom in factory"),
                          (["--sample-factory", "test_eval_sweep:bad_none"],
                           "returned NoneType .* which lacks context"),
                          (["--sample-factory", "test_eval_sweep:bad_metric"],
                           "cannot be scored: .*unknown metric 'nope'"),
                          (["--sample-factory", "test_eval_sweep:bad_empty"],
                           "with an empty context")):
        args = grid_args(srv, out, tmp_path / "j.sqlite3") + extra
        res = _Res(rlm_cli(args, env_with_factory(), timeout=60))
        assert_clean_error(res, 2, needle)
        assert not (out / "trials.jsonl").exists()
    assert srv.count == 0


def test_one_sweep_per_out_dir_and_a_grid_that_ran_nothing_is_replaced(scripted, tmp_path):
    import fcntl
    srv = scripted(responder)
    out = tmp_path / "out"
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps({"grid": {"tasks": ["other"]}, "earlier": []}))
    with open(out / ".lock", "w") as held:  # another rlm eval at work in this directory
        fcntl.flock(held, fcntl.LOCK_EX)
        res = _Res(rlm_cli(grid_args(srv, out, tmp_path / "j.sqlite3"), env_with_factory()))
        assert_clean_error(res, 2, "another rlm eval is running")
    assert srv.count == 0
    # the recorded grid never ran a trial (no trials.jsonl): a new grid takes its place
    res = rlm_cli(grid_args(srv, out, tmp_path / "j.sqlite3"), env_with_factory())
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "sweep.json").read_text())["grid"]["tasks"] == list(TASKS)


def test_a_sweep_whose_every_trial_failed_on_the_endpoint_exits_3(tmp_path):
    out = tmp_path / "out"
    args = ["eval", "--sample-factory", FACTORY, "--tasks", "easy", "--lengths", "1k",
            "--methods", "base", "--n", "2", "--out", str(out), "--journal",
            str(tmp_path / "j.sqlite3"), "-q", "--base-url", f"http://127.0.0.1:{_free_port()}/v1",
            "--api-key", API_KEY, "--model", MODEL]
    res = rlm_cli(args, env_with_factory())
    assert res.returncode == 3, res.stderr
    assert "every trial run now (2) failed on the model endpoint" in res.stderr
    assert "the same command runs them again" in res.stderr
    assert [r["failure"] for r in read_jsonl(out / "trials.jsonl")] == ["EndpointError"] * 2


def test_trials_the_endpoint_failed_under_run_again_once_it_answers(scripted, tmp_path):
    from scripted_server import Reply
    down = {"now": True}
    srv = scripted(lambda req: Reply("refused", status=401) if down["now"] else responder(req))
    out = tmp_path / "out"
    args = ["eval", "--sample-factory", FACTORY, "--tasks", "easy", "--lengths", "1k",
            "--methods", "base", "--n", "2", "--out", str(out), "--journal",
            str(tmp_path / "j.sqlite3"), *endpoint_args(srv)]
    res = rlm_cli([*args, "-q"], env_with_factory())
    assert res.returncode == 3, res.stderr
    assert [r["failure"] for r in read_jsonl(out / "trials.jsonl")] == ["EndpointError"] * 2
    down["now"] = False  # the key works again: the two trials measured nothing, so they run
    sent = srv.count
    res = rlm_cli(args, env_with_factory())
    assert res.returncode == 0, res.stderr
    assert "2 recorded trials failed on the model endpoint: running them again" in res.stderr
    assert srv.count == sent + 2
    latest = {r["key"]: r for r in read_jsonl(out / "trials.jsonl")}
    assert len(latest) == 2 and all(r["failure"] is None and r["correct"]
                                    for r in latest.values()), latest
    res = rlm_cli([*args, "-q"], env_with_factory())  # measured now: results, not run again
    assert res.returncode == 0 and srv.count == sent + 2, res.stderr


def test_ctrl_c_reports_the_finished_trials_and_the_rerun_completes(scripted, tmp_path):
    srv = scripted(responder, latency=0.4)
    out, journal = tmp_path / "out", tmp_path / "j.sqlite3"
    args = [sys.executable, "-m", "rlm", *grid_args(srv, out, journal, 3), "--concurrency", "1"]
    proc = subprocess.Popen(args, env=env_with_factory(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not ((out / "trials.jsonl").is_file() and read_jsonl(out / "trials.jsonl")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Run the same command again" in err and "report of the finished trials" in err
    done = read_jsonl(out / "trials.jsonl")
    assert 1 <= len(done) < 3 * len(TASKS) * 3
    assert f"{len(done)} trials" in (out / "summary.md").read_text()
    res = rlm_cli(grid_args(srv, out, journal, 3), env_with_factory())
    assert res.returncode == 0, res.stderr
    check_records(read_jsonl(out / "trials.jsonl"), n=3)  # each trial once, none repeated
