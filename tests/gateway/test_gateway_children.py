"""Sub-calls from the processes a cell starts in a gateway kernel (fork-, spawn- and
forkserver-started pools, ``os.fork``, a Python subprocess): each reaches the host through the
kernel's relay and its answer comes back to the call that asked; the relay admits only the
kernel's descendants."""
from __future__ import annotations

import json

import pytest

from gw_helpers import gateway  # noqa: F401 (a fixture)
from test_gateway_kernel import Calls, bound  # noqa: F401 (a fixture)

PROMPTS = [f"p{i}" for i in range(6)]


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_pool_of_processes_makes_sub_calls(bound, method):
    calls = Calls(delay=0.05)
    k, _ = bound(calls)
    res, _ = k.execute(
        "import json, multiprocessing\n"
        "warm = llm_query('warm')\n"
        f"with multiprocessing.get_context({method!r}).Pool(3) as p:\n"
        f"    out = p.map(llm_query, {PROMPTS!r})\n"
        "print(json.dumps(out))", timeout=120)
    assert res.error is None, res.output
    assert json.loads(res.output.strip().splitlines()[-1]) == [f"echo:{p}" for p in PROMPTS]
    assert sorted(calls.seen) == sorted(PROMPTS + ["warm"])  # each made once


def test_a_forked_child_a_subprocess_and_the_relay_refuses_the_kernel_itself(bound):
    calls = Calls()
    k, _ = bound(calls)
    res, _ = k.execute(
        "import os\n"
        "r, w = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.write(w, llm_query('from the child').encode()); os._exit(0)\n"
        "os.waitpid(pid, 0); print(os.read(r, 100).decode())\n"
        # a Python subprocess finds the relay through the environment the bind cell set
        "import subprocess, sys\n"
        "print(subprocess.run([sys.executable, '-c', 'from kernels.runtime import llm_query; "
        "print(llm_query(\"from a subprocess\"))'], capture_output=True, text=True)"
        ".stdout.strip())\n"
        # the kernel's own process is not one it started: the relay refuses it
        "import socket, struct, json\n"
        "from kernels.gateway import relay\n"
        "s = socket.socket(socket.AF_UNIX); s.connect(relay.start())\n"
        "body = json.dumps({'token': 'x', 'op': 'llm_query', 'args': {'prompt': 'no'}}).encode()\n"
        # written after the relay has refused it (the refusal waits to be read)
        "import time; time.sleep(0.3)\n"
        "s.sendall(struct.pack('>I', len(body)) + body)\n"
        "n = struct.unpack('>I', s.recv(4))[0]; print(json.loads(s.recv(n))['error'])",
        timeout=60)
    assert res.error is None, res.output
    lines = res.output.strip().splitlines()
    assert lines[0] == "echo:from the child", res.output
    assert lines[1] == "echo:from a subprocess", res.output
    assert "only a process this kernel started" in lines[2], res.output
    assert calls.seen == ["from the child", "from a subprocess"]
