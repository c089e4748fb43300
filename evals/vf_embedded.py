"""The verifiers adapter on the embedded model: vf-eval's rewards against ``rlm eval``'s scores.

Run with this project's virtual environment, naming a ``vf-eval`` from an environment that has
verifiers 0.4 (the ``[train]`` extra, installed on its own: docs/training.md)::

    .venv/bin/python -m evals.vf_embedded --vf-eval ~/.cache/rlm/vf-venv/bin/vf-eval \
        [--task niah_single_1] [--length 4096] [--n 3] [--seed 2] [--depth 1] [--out DIR]

What it does, in order:

1. starts the embedded model's server (the default 0.5B model) on 127.0.0.1, in this process;
2. runs ``vf-eval rlm-verifiers`` (verifiers' own evaluation entry point, another process and
   environment, with this checkout first on its path) against that server: ``--n`` samples of
   ``--task`` at ``--length`` tokens, one rollout each, every root turn through verifiers'
   interception endpoint; it reads each rollout's reward and run id from vf-eval's traces;
3. runs ``rlm eval``'s trial runner on the same samples against the same server, with the same
   profile and depth, and compares each trial's score with the rollout's reward;
4. stops the server, then replays every rollout from its journal with ``rlm replay``: with no
   server left to answer, a replay that sent a request would fail, so a replay that ends with
   the rollout's answer sent none.

Prints one row per sample (reward, score, replay) and exits 0 only if every reward equals its
score and every replay matched; ``--json FILE`` also writes the rows. Minutes per sample on
2 cores (each run decodes with the 0.5B model on the CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KEY_VAR = "RLM_VF_EMBEDDED_KEY"


def _vf_eval(args: argparse.Namespace, server, out: Path) -> list[dict]:
    """Run vf-eval against ``server``; returns one dict per rollout (sample id, reward, the
    rollout's record, its calls as verifiers saw them)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env[KEY_VAR] = server.api_key
    argv = [args.vf_eval, "rlm-verifiers", "-m", server.model_name,
            "--client.base-url", server.base_url, "--client.api-key-var", KEY_VAR,
            "--env.taskset.tasks", json.dumps([args.task]),
            "--env.taskset.lengths", json.dumps([args.length]),
            "--env.taskset.n", str(args.n), "--env.taskset.seed", str(args.seed),
            "--env.agent.harness.id", "rlm-verifiers",
            "--env.agent.harness.max-depth", str(args.depth),
            "--env.agent.harness.profile", args.profile,
            "--env.agent.harness.concurrency", "1",
            "--env.agent.harness.directory", str(out / "rollouts"),
            "--env.agent.runtime.type", "subprocess", "--no-push", "--no-rich",
            "-o", str(out / "vf-out")]
    t0 = time.monotonic()
    p = subprocess.run(argv, env=env, cwd=out, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"vf-eval failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    print(f"vf-eval: {args.n} rollout(s) in {time.monotonic() - t0:.0f} s", flush=True)
    rows = []
    for traces in sorted((out / "vf-out").glob("*/traces.jsonl")):
        for line in traces.read_text().splitlines():
            episode = json.loads(line)
            for trace in episode["traces"]:
                rows.append({"sample": episode["task"]["data"]["id"],
                             "reward": trace["rewards"]["task_score"]["score"],
                             "rollout": trace["info"]["rlm"], "vf_calls": len(trace["calls"])})
    return sorted(rows, key=lambda r: r["sample"])


def _score(args: argparse.Namespace, server, sample: str, journal: Path) -> dict:
    """``rlm eval``'s trial runner on one sample against ``server``."""
    from rlm.evaluation.trial import TrialSpec, run_trial
    task, length, seed, index = sample.split("|")
    spec = TrialSpec(task, int(length), int(seed), int(index), "rlm", args.depth, args.profile,
                     server.model_name, base_url=server.base_url, api_key_env=KEY_VAR,
                     journal=str(journal))
    return run_trial(spec)


def _replay(rollout: dict) -> tuple[bool, str]:
    """Replay one rollout with ``rlm replay``; (ended with the rollout's answer, detail)."""
    p = subprocess.run([sys.executable, "-m", "rlm", "replay", rollout["run_id"], "--journal",
                        rollout["journal"], "--json"], capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        return False, f"exit {p.returncode}: {p.stderr.strip()[-300:]}"
    answer = json.loads(p.stdout).get("answer")
    return answer == rollout["answer"], f"answer {answer!r:.60}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vf-eval", default=os.environ.get("RLM_VF_EVAL"),
                    help="the vf-eval program of an environment with verifiers 0.4 "
                         "(default: $RLM_VF_EVAL)")
    ap.add_argument("--task", default="niah_single_1", help="an rlm eval task (default %(default)s)")
    ap.add_argument("--length", type=int, default=4096, help="tokens (default %(default)s)")
    ap.add_argument("--n", type=int, default=3, help="samples (default %(default)s)")
    ap.add_argument("--seed", type=int, default=2, help="sample seed (default %(default)s)")
    ap.add_argument("--depth", type=int, default=1, help="max_depth (default %(default)s)")
    ap.add_argument("--profile", default="small", help="prompt profile (default %(default)s)")
    ap.add_argument("--out", help="working directory (default: a new temporary one)")
    ap.add_argument("--json", dest="json_out", help="also write the rows here")
    args = ap.parse_args(argv)
    if not args.vf_eval or not Path(args.vf_eval).is_file():
        ap.error("name vf-eval with --vf-eval or $RLM_VF_EVAL: install verifiers in an "
                 "environment of its own (pip install 'rlm-kernels[train]'; docs/training.md)")
    out = Path(args.out or tempfile.mkdtemp(prefix="rlm-vf-embedded-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"working directory: {out} (the rollouts' journal, vf-eval's traces)", flush=True)
    from rlm.models.embedded.server import EmbeddedServer
    server = EmbeddedServer()
    server.start()
    os.environ[KEY_VAR] = server.api_key
    try:
        rows = _vf_eval(args, server, out)
        for row in rows:
            t0 = time.monotonic()
            rec = _score(args, server, row["sample"], out / "eval.sqlite3")
            row["score"], row["eval_status"] = rec["score"], rec.get("status")
            row["eval_answer"] = rec.get("answer")
            print(f"rlm eval {row['sample']}: score {rec['score']} "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
    finally:
        server.stop()
    ok = bool(rows)
    print(f"\n{'sample':<24} {'vf reward':>9} {'rlm eval':>9} {'calls':>5}  replay")
    for row in rows:
        rollout = row["rollout"]
        row["replayed"], detail = _replay(rollout)
        same = row["reward"] == rollout["reward"] == row["score"]
        ok = ok and same and row["replayed"]
        print(f"{row['sample']:<24} {row['reward']:>9} {row['score']:>9} "
              f"{rollout['usage']['calls']:>5}  {'0 requests' if row['replayed'] else 'FAILED'}"
              f" ({detail})")
    print(f"\n{sum(r['reward'] == r['score'] for r in rows)} of {len(rows)} rewards equal "
          f"rlm eval's score; {sum(r['replayed'] for r in rows)} of {len(rows)} rollouts replayed "
          f"with the server stopped")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
