"""``rlm serve`` as a shared host: one client's cell attacks the bridge while ten others are
answered.

One ``rlm serve`` subprocess (the real CLI) in front of a scripted upstream. The attacker's run
takes three turns, one attack each (tests/bridge_attacks.py): a frame announcing 4 GiB and a
70 MiB call, a 200,000-deep frame, a flood of 2,000 connections held open. Ten other clients'
requests are sent with it; their sub-calls are answered only once the flood is in place, and
the flood is held until all ten have their answers. Every one must get its own answer, and the
server's resident memory (psutil, sampled every 20 ms) must stay within :data:`RSS_BOUND` of
what it held before.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import openai
import psutil
import pytest

from bridge_attacks import BIG, DEEP, FLOOD, seen
from conftest import API_KEY, MODEL, clean_env, closed_port, is_root, last_user, repl
from kernels.bwrap import sandbox_problem
from scripted_server import ScriptedServer

KEY = "sk-serve-tenants"
TENANTS = 10
#: How much the server may grow while all this runs, bytes: eleven runs' own bookkeeping (their
#: threads, journal writes, HTTP clients), never an attacker's frames (the 4 GiB frame's 512 MiB
#: sent, 2,000 connections). Measured here: 43 MiB.
RSS_BOUND = 256 * 2**20

pytestmark = pytest.mark.skipif(sandbox_problem() is not None,
                                reason=f"no sandbox here: {sandbox_problem()}")


class Upstream:
    """The attacker's turns, the tenants' turns, and the events that interleave them."""

    def __init__(self) -> None:
        self.flooded = threading.Event()
        self.tenants_done = threading.Event()
        self.answered = 0
        self.lock = threading.Lock()
        self.attacks: dict = {}

    def __call__(self, req: dict):
        if not is_root(req):
            p = last_user(req)
            if p == "flooded":  # the flood is in place: held until every tenant is answered
                self.flooded.set()
                self.tenants_done.wait(300)
                return "held"
            if p.startswith("tenant-"):
                self.flooded.wait(300)
                with self.lock:
                    self.answered += 1
                    if self.answered == TENANTS:
                        self.tenants_done.set()
                return "answer-for-" + p
            return "sub:" + p[:40]
        text = json.dumps(req["messages"])
        if "ATTACKER" not in text:  # a tenant: its answer is its own sub-call's
            n = re.search(r"tenant (\d+): what is my answer", text).group(1)
            return repl(f"FINAL(llm_query('tenant-{n}'))")
        for tag, code in (("BIG", BIG), ("DEEP", DEEP), ("FLOOD", FLOOD)):
            got = seen(req, tag)
            if got is None:
                return repl(code)
            self.attacks[tag] = got
        return repl("FINAL('attacks done')")


@pytest.fixture
def server(tmp_path):
    up = Upstream()
    srv = ScriptedServer(up)
    srv._thread = threading.Thread(target=srv.httpd.serve_forever,
                                   kwargs={"poll_interval": 0.02}, daemon=True)
    srv.__enter__()
    port = closed_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlm", "serve", "--port", str(port), "--api-key", KEY,
         "--max-concurrent-runs", str(TENANTS + 2), "--base-url", srv.base_url,
         "--upstream-api-key", API_KEY, "--model", MODEL, "--journal",
         str(tmp_path / "j.sqlite3"), "--sandbox", "required", "--cell-timeout", "300"],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    base = f"http://127.0.0.1:{port}/v1"
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=400)
    deadline = time.monotonic() + 60
    while True:
        try:
            client.models.list()
            break
        except openai.APIConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rlm serve did not start: {proc.stderr.read().decode()}")
            time.sleep(0.1)
    yield client, up, proc
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    srv.__exit__(None, None, None)


class _Sampler:
    """The peak resident memory of process ``pid`` while it runs, sampled every 20 ms."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.start = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.start


def test_ten_tenants_are_answered_while_one_attacks_the_bridge(server):
    client, up, proc = server
    sampler = _Sampler(proc.pid)
    answers: dict = {}

    def ask(name: str, system: str, question: str) -> None:
        try:
            r = client.chat.completions.create(
                model="rlm", messages=[{"role": "system", "content": system},
                                       {"role": "user", "content": question}])
            answers[name] = r.choices[0].message.content
        except Exception as exc:  # noqa: BLE001 - recorded, asserted below
            answers[name] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=ask, args=("attacker", "some context", "ATTACKER q"))]
    threads += [threading.Thread(target=ask, args=(f"t{i}", f"Data of tenant {i}.",
                                                   f"tenant {i}: what is my answer?"))
                for i in range(TENANTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(420)
    grew = sampler.stop()
    up.tenants_done.set()
    assert answers.pop("attacker") == "attacks done", up.attacks
    assert answers == {f"t{i}": f"answer-for-tenant-{i}" for i in range(TENANTS)}
    big, deep, flood = up.attacks["BIG"], up.attacks["DEEP"], up.attacks["FLOOD"]
    assert "frame cap of 64 MiB" in big["raw"]["error"]["message"]
    assert "frame cap of 64 MiB" in big["capped"] and big["after"] == "sub:after big"
    assert "nests too deeply" in deep["deep"]["error"]["message"]
    assert flood["refused"] == flood["opened"] - 63 and flood["held_open"] == 63, flood
    assert flood["held"] == "held" and "cap per kernel (64)" in flood["during"], flood
    assert grew < RSS_BOUND, f"the server grew by {grew / 2**20:.0f} MiB"
    assert proc.poll() is None  # still serving
    assert os.path.exists(f"/proc/{proc.pid}")
