"""The async API: many runs in one event loop, and cancellation that really stops a run.

Real kernels, the real ``openai`` client, the scripted server with latency. A kernel left behind
is looked for among this process's children (``psutil``).
"""
from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import psutil

from conftest import API_KEY, MODEL, repl

import rlm
from harness.journal import Journal


def two_turns(req: dict) -> str:
    """Turn 1 reads the last word of ``context``; turn 2 answers it (every run differs)."""
    users = [m for m in req["messages"] if m["role"] == "user"]
    if len(users) == 1:
        return repl("w = context.split()[-1]", "print(w)")
    return repl("FINAL(w)")


def live_kernels(settle: float = 10.0) -> list[psutil.Process]:
    """This process's kernel processes still alive after up to ``settle`` seconds (a kernel
    shut down at a run's end may take a moment to exit on a loaded machine; a leaked one
    stays)."""
    deadline = time.monotonic() + settle
    while True:
        out = []
        for p in psutil.Process().children(recursive=True):
            try:
                if "ipykernel" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.Error:
                pass
        if not out or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


def test_twenty_concurrent_runs_in_one_event_loop(scripted):
    latency = 1.5
    srv = scripted(two_turns, latency=latency)
    o = dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL, journal=False)

    async def main():
        t0 = time.monotonic()
        async with rlm.AsyncRLM(**o) as r:
            many = await asyncio.gather(*(r.completion(f"ctx word{i}", "last word?")
                                          for i in range(20)))
        return many, time.monotonic() - t0

    many, wall = asyncio.run(main())
    assert [r.answer for r in many] == [f"word{i}" for i in range(20)]
    assert all(r.status == "completed" and r.usage["calls"] == 2 for r in many)
    assert len({r.run_id for r in many}) == 20
    # each run waits 2 x latency on the model: one after another, 20 runs wait 60 s for it.
    # Together the ideal is 2 x latency = 3 s, plus starting 20 kernels on this machine (about
    # 0.3-0.7 s of CPU each, overlapped with the first model call).
    ideal, sequential = 2 * latency, 20 * 2 * latency
    print(f"20 concurrent runs: {wall:.1f} s (ideal {ideal:.1f} s + kernel starts; "
          f"sequential >= {sequential:.0f} s)")
    assert wall < sequential / 2
    assert not live_kernels()


def test_cancelling_a_run_stops_it_and_the_run_id_resumes(scripted, tmp_path):
    # the hold file lives where the kernel can see it: under a root host kernels run as an
    # unprivileged user, who cannot enter the test's private tmp_path
    shared = Path(tempfile.mkdtemp(prefix="rlm-hold-"))
    shared.chmod(0o777)
    flag, started = shared / "hold", shared / "started"
    flag.write_text("")
    hold = repl("import os, time", f"open({str(started)!r}, 'w').close()",
                f"while os.path.exists({str(flag)!r}): time.sleep(0.05)", "print('released')")

    def responder(req):
        users = [m for m in req["messages"] if m["role"] == "user"]
        return hold if len(users) == 1 else repl("FINAL('resumed answer')")

    srv = scripted(responder)
    journal = tmp_path / "j.sqlite3"
    # sandbox="none": the cell signals through a host directory, which a sandbox would hide
    o = dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL, journal=str(journal),
             run_id="cancel-me", sandbox="none")

    async def cancel_mid_cell():
        task = asyncio.create_task(rlm.acompletion("ctx", "q?", **o))
        deadline = time.monotonic() + 60
        while not started.exists():  # the first cell is running (and holding)
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return time.monotonic() - t0
        raise AssertionError("the task was not cancelled")

    took = asyncio.run(cancel_mid_cell())
    assert took < 5.0, took
    assert not live_kernels()  # every kernel of the run was shut down
    j = Journal(str(journal))
    rec = j.get_run("cancel-me")
    assert rec["state"] == "cancelled"
    stages = j.stages("cancel-me")
    assert srv.count == 1
    # the run, its iteration and the held cell were open: all cancelled, none left running
    by_id = {s["stage_id"] if "stage_id" in s else s["id"]: s["status"] for s in stages}
    assert by_id["run"] == "cancelled"
    assert "running" not in by_id.values() and "pending" not in by_id.values()
    assert any(k.endswith("cell-0") and v == "cancelled" for k, v in by_id.items()), (by_id, j.cells("cancel-me"))

    # the same run id resumes: the recorded first call is served, only the second is sent
    flag.unlink()
    started.unlink()
    res = asyncio.run(rlm.acompletion("ctx", "q?", **o))
    assert res.status == "completed" and res.answer == "resumed answer"
    assert res.replayed_calls == 1 and srv.count == 2
    assert not live_kernels()
    started.unlink()
    shared.rmdir()


def test_cancelled_run_marks_open_stages_cancelled(scripted):
    # a run cancelled before it starts its first call: nothing is sent, the run is cancelled
    srv = scripted(lambda req: repl("FINAL(1)"))
    token = rlm.aio.CancelToken()
    token.cancel()

    async def main():
        r = rlm.AsyncRLM(base_url=srv.base_url, api_key=API_KEY, model=MODEL, journal=False)
        try:
            await r.completion("ctx", "q?", cancel=token)
        except asyncio.CancelledError:
            return "cancelled"
        return "finished"

    assert asyncio.run(main()) == "cancelled"
    assert srv.count == 0 and not live_kernels()


def test_a_cancel_ends_a_model_call_in_flight_at_once(scripted, tmp_path):
    """A root turn whose reply takes a minute (a long prefill on a small local model): the
    cancel ends the HTTP wait after its grace (2 s), the run is journaled cancelled, nothing
    is retried, and the same run id resumes. (A reply within the grace is still taken:
    tests/e2e/test_serve_clients.py's hang-up tests resume with it replayed.)"""
    from scripted_server import Reply
    state = {"slow": True}

    def responder(req):
        if state["slow"]:
            return Reply(content=repl("FINAL('late')"), delay=60.0)
        return repl("FINAL('resumed')")
    srv = scripted(responder)
    journal = tmp_path / "j.sqlite3"
    from rlm.aio import CancelToken
    token = CancelToken()
    o = dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL, journal=str(journal),
             run_id="slow-reply", cancel=token)
    import threading
    box: dict = {}

    def run():
        try:
            box["result"] = rlm.completion("ctx", "q?", **o)
        except BaseException as exc:  # noqa: BLE001 - the cancel's own end
            box["error"] = exc
        box["ended"] = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while srv.count < 1:  # the root's first call is in flight
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    t0 = time.monotonic()
    token.cancel()
    t.join(30)
    assert not t.is_alive()
    took = box["ended"] - t0
    from rlm.models.http_deadline import CANCEL_GRACE
    assert CANCEL_GRACE <= took < CANCEL_GRACE + 4.0, took  # not the reply's 60 s
    assert "result" not in box, box
    assert srv.count == 1  # the cut call was not sent again
    assert Journal(str(journal)).get_run("slow-reply")["state"] == "cancelled"
    assert not live_kernels()
    state["slow"] = False
    res = rlm.completion("ctx", "q?", **dict(o, cancel=None))
    assert res.status == "completed" and res.answer == "resumed"
