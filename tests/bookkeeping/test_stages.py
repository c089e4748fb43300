"""Tests of harness.stages.tree: the transition table, compare-and-set, ids, rollups, listeners."""
from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time

import pytest

from harness.errors import IllegalTransition
from harness.stages.tree import (TERMINAL, TRANSITIONS, Kind, Stage, StageTree, Status, Usage)


@pytest.fixture(autouse=True)
def _fast_thread_switching():
    """Switch threads very often so races surface in the concurrency tests."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def sleepy_clock() -> float:
    """A wall clock that gives up the GIL. The tree reads its clock between checking a stage
    (its status, or the next free ordinal) and writing it, so without the lock concurrent
    writers would interleave right there."""
    time.sleep(0.0002)
    return time.time()


def make_tree(listeners=(), clock=None):
    tree = StageTree("r1", listeners, clock=clock or Clock())
    tree.new_stage(None, Kind.run, 0)
    return tree


def drive_to(tree: StageTree, sid: str, status: Status) -> None:
    """Move a pending stage to ``status`` through legal transitions only."""
    if status is Status.pending:
        return
    tree.transition(sid, Status.pending, Status.running)
    if status is not Status.running:
        tree.transition(sid, Status.running, status)


ILLEGAL = [(a, b) for a, b in itertools.product(Status, Status) if b not in TRANSITIONS[a]]


# ---------------------------------------------------------------------- the table


def test_table_shape():
    assert set(TRANSITIONS) == set(Status)
    assert TERMINAL == {Status.completed, Status.failed, Status.cancelled,
                        Status.budget_exceeded}
    assert TRANSITIONS[Status.pending] == {Status.running, Status.cancelled,
                                           Status.budget_exceeded, Status.failed}
    assert TRANSITIONS[Status.running] == {Status.completed, Status.failed, Status.cancelled,
                                           Status.budget_exceeded}
    for t in TERMINAL:
        assert TRANSITIONS[t] == frozenset()
    # 6*6 pairs, 8 legal ones
    assert len(ILLEGAL) == 36 - 8


@pytest.mark.parametrize("frm,to", ILLEGAL, ids=[f"{a.value}->{b.value}" for a, b in ILLEGAL])
def test_every_illegal_transition_raises_and_changes_nothing(frm, to):
    events: list[dict] = []
    tree = make_tree([events.append])
    sid = tree.new_stage("run", Kind.cell, 0).id
    drive_to(tree, sid, frm)
    before = tree.get(sid).to_dict()
    n_events = len(events)
    with pytest.raises(IllegalTransition):
        tree.transition(sid, frm, to, error="boom", evidence={"x": 1}, prompt_tokens=7,
                        meta={"k": "v"})
    assert tree.get(sid).to_dict() == before
    assert tree.get(sid).status is frm
    assert len(events) == n_events


@pytest.mark.parametrize("actual", list(Status))
def test_stale_expected_status_raises_and_changes_nothing(actual):
    """CAS: a legal pair (expected -> new) is refused when the stage is not in ``expected``."""
    events: list[dict] = []
    tree = make_tree([events.append])
    sid = tree.new_stage("run", Kind.cell, 0).id
    drive_to(tree, sid, actual)
    before = tree.get(sid).to_dict()
    n_events = len(events)
    for expected in Status:
        if expected is actual:
            continue
        for new in TRANSITIONS[expected]:
            with pytest.raises(IllegalTransition):
                tree.transition(sid, expected, new, evidence="stale")
    assert tree.get(sid).to_dict() == before
    assert len(events) == n_events


@pytest.mark.parametrize("terminal", sorted(TERMINAL, key=lambda s: s.value))
def test_terminal_statuses_are_absorbing(terminal):
    tree = make_tree()
    sid = tree.new_stage("run", Kind.llm_query, 0).id
    drive_to(tree, sid, terminal)
    for new in Status:
        with pytest.raises(IllegalTransition):
            tree.transition(sid, terminal, new)
    assert tree.get(sid).status is terminal


def test_legal_transitions_set_fields_and_timestamps():
    events: list[dict] = []
    tree = make_tree([events.append])
    sid = tree.new_stage("run", Kind.model_call, 0, model="gpt-4o").id
    s = tree.transition(sid, "pending", "running")
    assert s.status is Status.running and s.started_at is not None and s.ended_at is None
    s = tree.transition(sid, Status.running, Status.completed, evidence="the reply",
                        meta={"finish_reason": "stop"})
    assert s.status is Status.completed
    assert s.evidence == "the reply" and s.meta == {"finish_reason": "stop"}
    assert s.ended_at is not None and s.ended_at >= s.started_at
    ev = events[-1]
    assert ev["event"] == "transition" and ev["run_id"] == "r1"
    assert (ev["from"], ev["to"]) == ("running", "completed")
    assert ev["stage"]["evidence"] == "the reply" and isinstance(ev["ts"], float)


def test_transition_rejects_unsettable_fields_without_change():
    events: list[dict] = []
    tree = make_tree([events.append])
    sid = tree.new_stage("run", Kind.cell, 0).id
    n = len(events)
    for bad in ({"id": "x"}, {"status": Status.completed}, {"level": 3}, {"nonsense": 1}):
        with pytest.raises(TypeError):
            tree.transition(sid, Status.pending, Status.running, **bad)
    assert tree.get(sid).status is Status.pending and len(events) == n


def test_returned_stages_are_copies():
    tree = make_tree()
    s = tree.get("run")
    s.status = Status.completed
    s.meta["x"] = 1
    assert tree.get("run").status is Status.pending and tree.get("run").meta == {}


# ---------------------------------------------------------------------- concurrency


def test_concurrent_stale_writers_exactly_one_wins():
    targets = sorted(TRANSITIONS[Status.running], key=lambda s: s.value)
    for _round in range(30):
        events: list[dict] = []
        tree = make_tree([events.append], clock=sleepy_clock)
        sid = tree.new_stage("run", Kind.child, 1).id
        tree.transition(sid, Status.pending, Status.running)
        n_before = len(events)
        barrier = threading.Barrier(16)
        wins: list[tuple[int, Status]] = []
        losses: list[int] = []
        lock = threading.Lock()

        def writer(i: int) -> None:
            new = targets[i % len(targets)]
            barrier.wait()
            try:
                tree.transition(sid, Status.running, new, evidence=f"writer-{i}")
            except IllegalTransition:
                with lock:
                    losses.append(i)
            else:
                with lock:
                    wins.append((i, new))

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wins) == 1 and len(losses) == 15
        winner, status = wins[0]
        final = tree.get(sid)
        assert final.status is status
        assert final.evidence == f"writer-{winner}"
        assert len(events) == n_before + 1
        assert events[-1]["stage"]["evidence"] == f"writer-{winner}"


def test_concurrent_new_stage_gets_unique_ordinals():
    tree = make_tree(clock=sleepy_clock)
    parent = tree.new_stage("run", Kind.iteration, 0).id
    n = 64
    barrier = threading.Barrier(n)
    got: list[Stage] = []
    lock = threading.Lock()

    def submit() -> None:
        barrier.wait()
        s = tree.new_stage(parent, Kind.llm_query, 0)
        with lock:
            got.append(s)

    threads = [threading.Thread(target=submit) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(s.ordinal for s in got) == list(range(n))
    assert {s.id for s in got} == {f"{parent}/llm_query-{i}" for i in range(n)}
    assert len(tree.children(parent)) == n


def test_listener_order_equals_transition_order_under_threads():
    events: list[dict] = []
    tree = make_tree([events.append])
    ids = [tree.new_stage("run", Kind.cell, 0).id for _ in range(32)]

    def work(sid: str) -> None:
        tree.transition(sid, Status.pending, Status.running)
        tree.transition(sid, Status.running, Status.completed)

    threads = [threading.Thread(target=work, args=(sid,)) for sid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seen: dict[str, list[tuple]] = {}
    for ev in events:
        seen.setdefault(ev["stage"]["id"], []).append((ev["from"], ev["to"]))
    for sid in ids:
        assert seen[sid] == [(None, "pending"), ("pending", "running"),
                             ("running", "completed")]
    # timestamps from the (monotone) clock appear in delivery order
    ts = [ev["ts"] for ev in events]
    assert ts == sorted(ts)


# ---------------------------------------------------------------------- ids


def _program(tree: StageTree) -> list[str]:
    ids = []
    for it in range(2):
        i = tree.new_stage("run", Kind.iteration, 0).id
        ids.append(i)
        ids.append(tree.new_stage(i, Kind.model_call, 0, model="m").id)
        c = tree.new_stage(i, Kind.cell, 0).id
        ids.append(c)
        for _ in range(3):
            ids.append(tree.new_stage(c, Kind.llm_query, 0).id)
        child = tree.new_stage(c, Kind.child, 1).id
        ids.append(child)
        ids.append(tree.new_stage(child, Kind.iteration, 1).id)
        ids.append(tree.new_stage(c, Kind.fallback, 1).id)
    return ids


def test_ids_are_deterministic_paths():
    a = _program(make_tree())
    b = _program(make_tree())
    assert a == b
    assert len(set(a)) == len(a)
    assert "run/iteration-1/cell-0/llm_query-2" in a
    assert "run/iteration-0/cell-0/child-0/iteration-0" in a
    assert "run/iteration-0/cell-0/fallback-0" in a
    assert make_tree().get("run").id == "run"


def test_explicit_ordinal_and_duplicates():
    tree = make_tree()
    assert tree.new_stage("run", Kind.cell, 0, ordinal=5).id == "run/cell-5"
    # automatic ordinals continue after the highest used one
    assert tree.new_stage("run", Kind.cell, 0).id == "run/cell-6"
    with pytest.raises(ValueError):
        tree.new_stage("run", Kind.cell, 0, ordinal=5)
    with pytest.raises(ValueError):
        tree.new_stage(None, Kind.run, 0)  # second root
    with pytest.raises(ValueError):
        tree.new_stage("run", Kind.run, 0)
    with pytest.raises(KeyError):
        tree.new_stage("run/nope-0", Kind.cell, 0)


# ---------------------------------------------------------------------- usage


def test_rollup_sums_descendants_only():
    tree = make_tree()
    it0 = tree.new_stage("run", Kind.iteration, 0).id
    it1 = tree.new_stage("run", Kind.iteration, 0).id
    m0 = tree.new_stage(it0, Kind.model_call, 0, model="big").id
    cell = tree.new_stage(it0, Kind.cell, 0).id
    child = tree.new_stage(cell, Kind.child, 1).id
    cm = tree.new_stage(child, Kind.model_call, 1, model="small").id
    m1 = tree.new_stage(it1, Kind.model_call, 0, model="big").id
    tree.add_usage(m0, 100, 10, 0.5)
    tree.add_usage(cm, 40, 4, 0.25)
    tree.add_usage(cm, 60, 6, 0.25)
    tree.add_usage(m1, 1000, 100, 2.0)

    assert tree.rollup(child) == Usage(100, 10, 2, 0.5)
    assert tree.rollup(it0) == Usage(200, 20, 3, 1.0)
    assert tree.rollup(it1) == Usage(1000, 100, 1, 2.0)
    assert tree.rollup("run") == Usage(1200, 120, 4, 3.0)
    assert tree.rollup(cell).total_tokens == 110

    by_model = tree.usage_by_model()
    assert by_model["big"] == Usage(1100, 110, 2, 2.5)
    assert by_model["small"] == Usage(100, 10, 2, 0.5)
    by_level = tree.usage_by_level()
    assert by_level == {0: Usage(1100, 110, 2, 2.5), 1: Usage(100, 10, 2, 0.5)}
    assert tree.counts_by_kind() == {"run": 1, "iteration": 2, "model_call": 3, "cell": 1,
                                     "child": 1}
    assert tree.max_level() == 1


def test_usage_arithmetic_and_dict():
    u = Usage(1, 2, 3, 0.5) + Usage(10, 20, 1, 0.25)
    assert u == Usage(11, 22, 4, 0.75)
    assert u.to_dict() == {"prompt_tokens": 11, "completion_tokens": 22, "total_tokens": 33,
                           "calls": 4, "cost_usd": 0.75}
    with pytest.raises(ValueError):
        make_tree().add_usage("run", -1, 0, 0.0)


# ---------------------------------------------------------------------- listeners


def test_listener_exception_rolls_back_transition():
    journal: list[dict] = []
    fail = {"on": False}

    def flaky(ev: dict) -> None:
        if fail["on"]:
            raise OSError("disk full")

    tree = make_tree([journal.append, flaky])
    sid = tree.new_stage("run", Kind.cell, 0).id
    tree.transition(sid, Status.pending, Status.running)
    before = tree.get(sid).to_dict()
    n = len(journal)

    fail["on"] = True
    with pytest.raises(OSError, match="disk full"):
        tree.transition(sid, Status.running, Status.completed, evidence="out", error=None)
    after = tree.get(sid)
    assert after.to_dict() == before
    assert after.status is Status.running and after.evidence is None and after.ended_at is None
    # the journal saw the change and then its compensation, restoring the same state
    assert [e["event"] for e in journal[n:]] == ["transition", "rollback"]
    assert journal[-1]["stage"] == before
    assert (journal[-1]["from"], journal[-1]["to"]) == ("completed", "running")

    fail["on"] = False
    tree.transition(sid, Status.running, Status.completed, evidence="out")
    assert tree.get(sid).status is Status.completed


def test_listener_exception_rolls_back_creation_and_usage():
    fail = {"on": True}

    def flaky(ev: dict) -> None:
        if fail["on"] and ev["event"] in ("created", "usage"):
            raise RuntimeError("journal down")

    tree = StageTree("r1", [flaky])
    fail["on"] = False
    tree.new_stage(None, Kind.run, 0)
    fail["on"] = True
    with pytest.raises(RuntimeError):
        tree.new_stage("run", Kind.cell, 0)
    assert "run/cell-0" not in tree and tree.children("run") == []
    with pytest.raises(RuntimeError):
        tree.add_usage("run", 5, 5, 1.0)
    assert tree.rollup("run") == Usage()
    fail["on"] = False
    # the ordinal was not consumed by the failed creation
    assert tree.new_stage("run", Kind.cell, 0).id == "run/cell-0"


def test_first_listener_failure_reaches_no_one_else():
    second: list[dict] = []

    def journal(ev: dict) -> None:
        if ev["event"] == "transition":
            raise OSError("write failed")

    tree = StageTree("r1", [journal, second.append])
    tree.new_stage(None, Kind.run, 0)
    with pytest.raises(OSError):
        tree.transition("run", Status.pending, Status.running)
    assert tree.get("run").status is Status.pending
    assert [e["event"] for e in second] == ["created"]


def test_reentrant_listener_is_refused_not_deadlocked():
    holder: dict = {}

    def nosy(ev: dict) -> None:
        if ev["event"] == "transition":
            holder["tree"].get("run")

    tree = StageTree("r1", [nosy])
    holder["tree"] = tree
    tree.new_stage(None, Kind.run, 0)
    with pytest.raises(RuntimeError, match="call back"):
        tree.transition("run", Status.pending, Status.running)
    assert tree.get("run").status is Status.pending


# ---------------------------------------------------------------------- persistence, render


def test_snapshot_roundtrip_and_continuation():
    tree = make_tree()
    _program(tree)
    tree.transition("run", Status.pending, Status.running)
    tree.add_usage("run/iteration-0/model_call-0", 10, 5, 0.01)
    tree.transition("run/iteration-0/cell-0", Status.pending, Status.failed, error="boom",
                    evidence={"stderr": "Traceback"})
    snap = tree.snapshot()
    rebuilt = StageTree.from_records("r1", reversed(snap))
    assert rebuilt.snapshot() == snap
    assert rebuilt.rollup("run") == tree.rollup("run")
    assert rebuilt.get("run/iteration-0/cell-0").status is Status.failed
    # new stages continue the recorded ordinals
    assert rebuilt.new_stage("run", Kind.iteration, 0).id == "run/iteration-2"
    assert Stage.from_dict(snap[3]).to_dict() == snap[3]
    with pytest.raises(ValueError):
        StageTree.from_records("r1", [snap[1]])  # parent missing


def test_render_shows_totals_and_nodes():
    tree = make_tree()
    it = tree.new_stage("run", Kind.iteration, 0).id
    m = tree.new_stage(it, Kind.model_call, 0, model="gpt-4o").id
    tree.transition("run", Status.pending, Status.running)
    tree.transition(m, Status.pending, Status.running, started_at=100.0)
    tree.add_usage(m, 1000, 200, 0.0045)
    tree.transition(m, Status.running, Status.completed, ended_at=103.5)
    text = tree.render()
    lines = text.splitlines()
    assert lines[0].startswith("run r1: 3 stages, 1 calls, 1200 tokens")
    assert "$0.004500" in lines[0]
    assert lines[1].startswith("run [run] running L0")
    assert lines[2].startswith("  iteration-0 [iteration] pending")
    assert lines[3].startswith("    model_call-0 [model_call] completed L0 gpt-4o tok=1200")
    assert lines[3].endswith("$0.004500 3.50s")
    assert lines[2].endswith(" -")  # never started


def test_harness_imports_nothing_from_rlm_or_kernels():
    code = ("import sys, harness, harness.errors, harness.stages.tree, harness.budget.prices, "
            "harness.budget.accountant; bad = sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('rlm', 'kernels')); print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
