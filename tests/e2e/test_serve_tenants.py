"""``rlm serve`` as a shared host: one client's cell runs every attack on the host and on what
runs share, one after another, while ten other clients are answered.

One ``rlm serve`` subprocess (the real CLI) in front of a scripted upstream, with small
per-kernel limits (1,024 MiB, 64 processes, 64 MiB of disk) so that each attack meets its limit
at once, and data piped into the server's stdin. The attacker's run (one request, at
``max_depth`` 2) takes one turn per attack, its cells from tests/bridge_attacks.py and
tests/kernel_attacks.py:

- a frame announcing 4 GiB (512 MiB of it sent) and a 70 MiB call: refused at the frame cap;
- a 200,000-deep frame and one that is no object: errors to the cell;
- memory: three processes of 400 MiB held at once under the 1,024 MiB cap: the kernel's group
  killed one or more and the cell's output says how many (where the host cannot make
  per-kernel control groups, the stand-in instead: one process asking for 1,000 MiB gets
  ``MemoryError``, as tests/kernel/test_limits.py asserts there); 1,024 MiB, not that file's
  768, because a 70 MiB call needs more address space than 768 MiB leaves a kernel;
- disk: a 200 MiB file in each of /tmp, home, /dev/shm and the host's working directory, held
  at once, then 20,000 files in each: ``ENOSPC``/``EFBIG`` in the tmpfs places, ``EROFS`` in
  the host's directory;
- a fork bomb: refused (``EAGAIN``) below 64 processes, its children held alive;
- a value put in the session and user keyrings: refused, and the tenants' kernels started after
  it search for it and do not find it;
- ``rlm('-')`` and ``rlm_batched(['/etc/passwd', FIFO])``: each child's context is that text,
  and no upstream request or answer holds the server's stdin or the file;
- a mode-000 directory and a read-only one left in home and the working directory: the kernel's
  directory is gone once the run has answered;
- a sub-call whose upstream error quotes the upstream key: the cell and the serve response
  body (the answer carries what the cell got) hold ``[redacted]`` where the key was; neither
  they, the journal's bytes, ``rlm export`` (which has the failed call) nor the server's log
  hold the key;
- a flood of 2,000 connections: 63 admitted beside the cell's own, the rest refused.

The ten tenants are sent in five waves of two while an attack is at its height: three processes'
memory held, the disk full, the fork bomb's children alive, the keyring value set, the flood's
connections held. The attacker's cell makes a sub-call there, which the upstream answers only
once that wave's two clients have their answers (each starts a kernel, runs a cell and makes a
sub-call), so the waves are inside the attacks by construction, not by timing. Every tenant must
get its own answer (its sub-call's, its own context, the keyring as refused), and the server's
resident memory (psutil, sampled every 20 ms) must grow by less than 128 MiB
(:data:`RSS_BOUND`; 40 MiB measured) over what it held before.

What does not apply to serve: ``-v`` and ``rlm view`` are ``rlm run``'s (the key an upstream
quotes is kept out of them in tests/models/test_redaction.py); the server's log is checked
instead.

Not in scripts/test_unprivileged.sh: its venv installs the core dependencies only, without
serve's web server or psutil; the same attacks from an unprivileged host are that script's
tests/kernel/ files.
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
from conftest import MODEL, clean_env, closed_port, is_root, last_user, repl
from kernel_attacks import BOMB, DISK, HOGS, KEYRING, KEYS, LEAVE, ONE_HOG, cell
from kernels import cgroups
from kernels.bwrap import sandbox_problem
from scripted_server import Reply, ScriptedServer

KEY = "sk-serve-tenants"
#: The server's key for its upstream, which the upstream quotes back in an error.
UPSTREAM_KEY = "sk-upstream-6f1d0c9a77e24b0f"
LEAK = (f"invalid api key {UPSTREAM_KEY}; the request had "
        f"'Authorization: Bearer {UPSTREAM_KEY}'")
#: What the server's stdin holds: it must reach no child, no upstream request, no answer.
PIPED = "STDIN-SECRET-91ab piped into rlm serve\n"
TENANTS = 10
#: How much the server may grow while all this runs, bytes: eleven runs' and three children's
#: own bookkeeping (their threads, journal writes, HTTP clients), never what the attacker's
#: cells hold or send (800 MiB in processes, 200 MiB files, a 4 GiB frame's 512 MiB sent, a
#: 70 MiB call, 2,000 connections). Measured here: 40 MiB.
RSS_BOUND = 128 * 2**20
#: Whether the host makes per-kernel control groups (else per-process limits stand in).
GROUPS = cgroups.unavailable() is None
EPERM = os.strerror(1)

pytestmark = pytest.mark.skipif(sandbox_problem() is not None,
                                reason=f"no sandbox here: {sandbox_problem()}")

#: The attacker's cells in turn: (tag its cell prints, source). Each that holds something asks
#: ``llm_query('during TAG')`` at its height (the flood: ``llm_query('flooded')``).
HOLD = "llm_query('during ' + tag)"
DATA = r'''
import json
one = rlm('-', 'CHILD-Q')
many = rlm_batched(['/etc/passwd', FIFO], 'CHILD-Q')
print("DATA " + json.dumps([one] + many))
'''
LEAKED = r'''
import json
try:
    leak = llm_query('leak please')
except Exception as exc:
    leak = type(exc).__name__ + ': ' + str(exc)
print("LEAK " + json.dumps(leak))
'''
#: The waves: which tenants are sent while which attack is at its height.
WAVES = {"HOGS": (0, 1), "ONE": (0, 1), "DISK": (2, 3), "BOMB": (4, 5), "KEYS": (6, 7),
         "FLOOD": (8, 9)}


def attacks(fifo: str) -> list[tuple[str, str]]:
    memory = ("HOGS", cell(HOGS, HOLD)) if GROUPS else ("ONE", cell(ONE_HOG, HOLD))
    return [("BIG", BIG), ("DEEP", DEEP), memory, ("DISK", cell(DISK, HOLD)),
            ("BOMB", cell(BOMB, HOLD)), ("KEYS", cell(KEYS, HOLD)),
            ("DATA", f"FIFO = {fifo!r}\n" + DATA), ("LEFT", cell(LEAVE)), ("LEAK", LEAKED),
            ("FLOOD", FLOOD)]


def tenant_answer(i: int) -> str:
    return f"answer-for-tenant-{i} | Data of tenant {i}. | {json.dumps([EPERM, EPERM])}"


class Upstream:
    """The scripted upstream: the attacker's turns, its children's, the tenants' and their
    sub-calls; ``launch(numbers)`` (set by the test) sends tenants and waits for them."""

    def __init__(self, fifo: str) -> None:
        self.fifo, self.cells = fifo, attacks(fifo)
        self.attacks: dict = {}
        self.waves: list[str] = []
        self.launch = None

    def __call__(self, req: dict):
        if not is_root(req):
            return self.sub(last_user(req))
        head = json.dumps(req["messages"][:2])  # the system prompt and the first question
        if "CHILD-Q" in head:  # a child of the attacker's rlm(...): it answers its context
            return repl("FINAL(repr(context))")
        if "ATTACKER" not in head:  # a tenant
            n = re.search(r"tenant (\d+): what is my answer", head).group(1)
            return repl(KEYRING, f"FINAL(llm_query('tenant-{n}') + ' | ' + context + ' | ' + "
                        "json.dumps([search(-3), search(-4)]))")
        for tag, code in self.cells:
            got = seen(req, tag)
            if got is None:
                return repl(code)
            self.attacks[tag] = got
        return repl("FINAL('attacks done; ' + leak)")

    def sub(self, prompt: str):
        if prompt.startswith("tenant-"):
            return "answer-for-" + prompt
        if prompt == "leak please":
            return Reply(status=400, content=LEAK)  # not retried: the cell gets it
        if prompt.startswith("during ") or prompt == "flooded":
            tag = "FLOOD" if prompt == "flooded" else prompt.split()[1]
            self.waves.append(tag)
            return "held" if self.launch(WAVES[tag]) else "a wave was not answered in time"
        return "sub:" + prompt[:40]


class Served:
    """The serve process, its upstream, its client and every line it logged."""

    def __init__(self, proc, srv, up, client, journal) -> None:
        self.proc, self.srv, self.up, self.client, self.journal = proc, srv, up, client, journal
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)


@pytest.fixture
def served(tmp_path):
    fifo = tmp_path / "fifo"  # with no writer: opening it would hang whoever opened it
    os.mkfifo(fifo)
    up = Upstream(str(fifo))
    srv = ScriptedServer(up)
    srv._thread = threading.Thread(target=srv.httpd.serve_forever,
                                   kwargs={"poll_interval": 0.02}, daemon=True)
    srv.__enter__()
    port = closed_port()
    journal = tmp_path / "j.sqlite3"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlm", "serve", "--port", str(port), "--api-key", KEY,
         "--max-concurrent-runs", str(TENANTS + 2), "--base-url", srv.base_url,
         "--upstream-api-key", UPSTREAM_KEY, "--model", MODEL, "--journal", str(journal),
         "--sandbox", "required", "--cell-timeout", "300", "--pool-size", "0",
         "--kernel-memory", "1024", "--kernel-processes", "64", "--kernel-disk", "64"],
        env=clean_env(), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, cwd=tmp_path, text=True)
    proc.stdin.write(PIPED * 20)
    proc.stdin.flush()  # left open: the server's stdin has data and no end
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY,
                           max_retries=0, timeout=400)
    s = Served(proc, srv, up, client, journal)
    deadline = time.monotonic() + 60
    while True:
        try:
            client.models.list()
            break
        except openai.APIConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rlm serve did not start: {''.join(s.lines)}")
            time.sleep(0.1)
    yield s
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


def _tenants(client, answers: dict):
    """``launch(numbers)``: send those tenants' requests at once and wait for their answers;
    True when every one was answered within 300 s."""
    def ask(i: int) -> None:
        try:
            r = client.chat.completions.create(model="rlm", messages=[
                {"role": "system", "content": f"Data of tenant {i}."},
                {"role": "user", "content": f"tenant {i}: what is my answer?"}])
            answers[f"t{i}"] = r.choices[0].message.content
        except Exception as exc:  # noqa: BLE001 - recorded, asserted below
            answers[f"t{i}"] = f"{type(exc).__name__}: {exc}"

    def launch(numbers) -> bool:
        threads = [threading.Thread(target=ask, args=(i,)) for i in numbers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        return all(f"t{i}" in answers for i in numbers)
    return launch


def test_ten_tenants_are_answered_while_one_attacks_the_host(served):
    up = served.up
    answers: dict = {}
    up.launch = _tenants(served.client, answers)
    sampler = _Sampler(served.proc.pid)
    raw = served.client.chat.completions.with_raw_response.create(
        model="rlm", messages=[{"role": "system", "content": "some context"},
                               {"role": "user", "content": "ATTACKER q"}],
        extra_body={"rlm": {"max_depth": 2}}, extra_headers={"Idempotency-Key": "attacker"})
    grew = sampler.stop()
    body = raw.http_response.text
    answer = raw.parse().choices[0].message.content
    assert answer.startswith("attacks done; "), (answer, up.attacks)
    assert answers == {f"t{i}": tenant_answer(i) for i in range(TENANTS)}
    assert up.waves == ["HOGS" if GROUPS else "ONE", "DISK", "BOMB", "KEYS", "FLOOD"]
    got = up.attacks
    _bridge_attacks_refused(got)
    _limits_held(got, json.dumps(served.srv.requests))
    _data_and_files(got, served)
    _key_nowhere(answer, body, served)
    assert grew < RSS_BOUND, f"the server grew by {grew / 2**20:.0f} MiB"
    assert served.proc.poll() is None  # still serving


def _bridge_attacks_refused(got: dict) -> None:
    big, deep, flood = got["BIG"], got["DEEP"], got["FLOOD"]
    assert "frame cap of 64 MiB" in big["raw"]["error"]["message"]
    assert "frame cap of 64 MiB" in big["capped"] and big["after"] == "sub:after big"
    assert "nests too deeply" in deep["deep"]["error"]["message"]
    assert "must be a JSON object" in deep["list"]["error"]["message"]
    assert flood["refused"] == flood["opened"] - 63 and flood["held_open"] == 63, flood
    assert flood["held"] == "held" and "cap per kernel (64)" in flood["during"], flood
    assert flood["after"] == "sub:from a thread", flood


def _limits_held(got: dict, sent: str) -> None:
    if GROUPS:  # 3 x 400 MiB cannot be held under 1,024 MiB: the kernel's group killed some
        codes = got["HOGS"]["codes"]
        killed = codes.count(-9)
        assert codes.count(0) <= 2 and killed >= 1, got["HOGS"]
        said = re.search(r"\[(\d+) process(?:es)? of this kernel killed: its processes together "
                         r"exceeded its memory limit \(--kernel-memory 1024 MiB\)\]", sent)
        assert said and int(said[1]) == killed, got["HOGS"]  # the cell's output says why
    else:
        assert got["ONE"] == "MemoryError"
    for place in ("/tmp", "/tmp/home", "/dev/shm"):
        big, many = got["DISK"][place]
        assert big in ("No space left on device", "File too large"), (place, got["DISK"])
        assert many.startswith("No space left on device after "), (place, got["DISK"])
        assert int(many.rsplit(" ", 1)[1]) <= 64 * 256, (place, got["DISK"])
    assert got["DISK"]["workdir"] == ["Read-only file system", "Read-only file system after 0"]
    forks, err = got["BOMB"]
    assert err == "Resource temporarily unavailable" and forks < 64, got["BOMB"]
    assert got["KEYS"] == {"add": [EPERM] * 2, "search": [EPERM] * 2}


def _data_and_files(got: dict, served: Served) -> None:
    assert got["DATA"] == [repr("-"), repr("/etc/passwd"), repr(served.up.fifo)]
    sent = json.dumps(served.srv.requests)
    assert "STDIN-SECRET" not in sent and "root:x:0:0" not in sent
    left = got["LEFT"]
    assert left["made"][0] == "Read-only file system", left  # the host's directory
    deadline = time.monotonic() + 30  # the run has answered: its kernel is shut down
    while os.path.exists(left["workdir"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(left["workdir"])


def _key_nowhere(answer: str, body: str, served: Served) -> None:
    leak = served.up.attacks["LEAK"]
    assert leak.startswith("SubcallError") and "[redacted]" in leak, leak
    assert "[redacted]" in answer  # what the cell got is in the response
    assert UPSTREAM_KEY not in body and "STDIN-SECRET" not in body
    files = [p for p in served.journal.parent.iterdir() if p.name.startswith("j.sqlite3")]
    assert served.journal in files
    for f in files:  # the database and its -wal/-shm, byte for byte
        assert UPSTREAM_KEY.encode() not in f.read_bytes(), f.name
    export = subprocess.run([sys.executable, "-m", "rlm", "export", "attacker", "--journal",
                             str(served.journal)], capture_output=True, text=True,
                            env=clean_env(), timeout=120)
    assert export.returncode == 0, export.stderr
    assert "[redacted]" in export.stdout and "leak please" in export.stdout
    assert UPSTREAM_KEY not in export.stdout
    assert not [ln for ln in served.lines if UPSTREAM_KEY in ln or KEY in ln]
