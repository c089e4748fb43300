"""Liveness that does not trust two hosts' clocks: with a shared PostgreSQL journal, a host whose
clock runs ten minutes ahead or behind neither sees a live run as crashed nor is seen so, because
heartbeats are stamped and judged on the database server's clock, never on a host's.

Two hosts are two journals in this process with their own host names (``RLM_HOST``); a host's
clock is skewed by replacing the ``time`` module the run records read (``time.time()`` ten
minutes off) while that host acts. A real PostgreSQL server (the suite's ``pg_url``)."""
from __future__ import annotations

import time
import types

import pytest

from harness.errors import RunActiveError
from harness.journal import Journal
from harness.journal import runs as runs_mod
from harness.replay import begin_resume

SKEW = 600.0  # ten minutes, either way
STALE = 1.5  # seconds: short, so a run really goes stale within the test


class Hosts:
    """Two hosts sharing one journal; ``as_(name)`` makes that host's clock the one the run
    records read (its skew, on top of the real clock)."""

    def __init__(self, url: str, monkeypatch, skews: dict[str, float]) -> None:
        self.mp, self.skews, self.journals = monkeypatch, skews, {}
        for host in skews:
            monkeypatch.setenv("RLM_HOST", host)
            monkeypatch.setenv("RLM_BOOT_ID", f"boot-{host}")
            self.journals[host] = Journal(url, stale_after=STALE)

    def as_(self, host: str) -> Journal:
        skew, real = self.skews[host], time.time
        self.mp.setattr(runs_mod, "time", types.SimpleNamespace(
            time=lambda: real() + skew, monotonic=time.monotonic, sleep=time.sleep))
        return self.journals[host]

    def close(self) -> None:
        for j in self.journals.values():
            j.close()


@pytest.mark.parametrize("a,b", [(SKEW, -SKEW), (-SKEW, SKEW), (0.0, SKEW), (-SKEW, 0.0)],
                         ids=["owner-ahead", "owner-behind", "reader-ahead", "reader-behind"])
def test_a_skewed_clock_neither_sees_a_live_run_crashed_nor_is_seen_so(pg_url, monkeypatch, a,
                                                                       b):
    hosts = Hosts(pg_url, monkeypatch, {"host-a": a, "host-b": b})
    try:
        hosts.as_("host-a").create_run("r", query="q", model="m")
        hb = hosts.as_("host-a").start_heartbeat("r", interval=0.3)
        for _ in range(3):  # host b, minutes off, sees the run live the whole time
            rec = hosts.as_("host-b").get_run("r")
            assert rec["state"] == "running", rec
            assert rec["heartbeat_age"] < STALE, rec  # on the database's clock: a moment
            assert [r["state"] for r in hosts.journals["host-b"].list_runs()] == ["running"]
            assert hosts.as_("host-b").claim_run("r") is False  # a live owner is never taken
            with pytest.raises(RunActiveError, match=r"heartbeat [01] s ago"):
                begin_resume(hosts.as_("host-b"), rec)
            time.sleep(0.4)
        hb()  # host a's process stops beating (as if killed): the run goes stale for real
        time.sleep(STALE + 0.5)
        rec = hosts.as_("host-b").get_run("r")
        assert rec["state"] == "crashed", rec
        assert hosts.as_("host-b").claim_run("r") is True
        # now host b owns it, beating on its own skewed clock: host a sees it live, and its
        # own stale heartbeat is refused (it no longer owns the run)
        assert hosts.as_("host-b").heartbeat("r") is True
        seen = hosts.as_("host-a").get_run("r")
        assert (seen["state"], seen["owner_host"]) == ("running", "host-b"), seen
        assert hosts.as_("host-a").claim_run("r") is False
        assert hosts.as_("host-a").heartbeat("r") is False
        exported = []
        hosts.as_("host-a").export_jsonl("r", types.SimpleNamespace(write=exported.append))
        assert '"state": "running"' in exported[0]
    finally:
        hosts.close()


def test_sqlite_judges_liveness_on_the_one_machines_clock(tmp_path, monkeypatch):
    """One machine, one clock: a heartbeat stamped a moment ago is fresh, and the reads and
    the claim decide staleness alike when that clock moves on past ``stale_after``."""
    path = tmp_path / "j.sqlite3"
    with Journal(path, stale_after=STALE) as j:
        j.create_run("r", query="q", model="m")
        assert j.get_run("r")["state"] == "running" and j.claim_run("r") is False
        real = time.time
        monkeypatch.setattr(runs_mod, "time", types.SimpleNamespace(
            time=lambda: real() + STALE + 1, monotonic=time.monotonic, sleep=time.sleep))
        # the owner is this live process: only the heartbeat's age can make it stale
        assert j.get_run("r")["state"] == "crashed"
        assert j.claim_run("r") is True
