"""The stage context manager: every stage's lifecycle in one ``with`` block."""
from __future__ import annotations

import concurrent.futures

import pytest

from harness.errors import BudgetExceeded, IllegalTransition
from harness.stages.tree import Kind, StageTree, Status, cancel_open


def _tree():
    events = []
    tree = StageTree("r1", [events.append])
    return tree, events


def test_normal_exit_completes_with_evidence_and_meta():
    tree, events = _tree()
    with tree.stage(None, Kind.run, 0, model="m") as s:
        assert tree.get(s.id).status is Status.running
        s.evidence = "the answer"
        s.meta = {"attempts": 2}
    st = tree.get(s.id)
    assert st.status is Status.completed and st.evidence == "the answer"
    assert st.meta == {"attempts": 2} and st.ended_at is not None
    assert [e["to"] for e in events] == ["pending", "running", "completed"]


@pytest.mark.parametrize("exc,status", [
    (BudgetExceeded("calls", 1, 1, 1), Status.budget_exceeded),
    (KeyboardInterrupt(), Status.cancelled),
    (concurrent.futures.CancelledError(), Status.cancelled),
    (RuntimeError("boom"), Status.failed),
])
def test_exceptions_map_to_terminal_status_and_propagate(exc, status):
    tree, _ = _tree()
    with pytest.raises(type(exc)):
        with tree.stage(None, Kind.run, 0) as s:
            raise exc
    st = tree.get(s.id)
    assert st.status is status
    assert st.error == (str(exc) or type(exc).__name__)


def test_finish_asks_for_a_status_at_normal_exit():
    tree, _ = _tree()
    root = tree.new_stage(None, Kind.run, 0)
    with tree.stage(root.id, Kind.cell, 0) as s:
        s.finish(Status.failed, "NameError: x")
    assert tree.get(s.id).status is Status.failed
    assert tree.get(s.id).error == "NameError: x"


def test_unstarted_stage_goes_from_pending_to_its_terminal_status():
    tree, events = _tree()
    with pytest.raises(BudgetExceeded):
        with tree.stage(None, Kind.run, 0, start=False):
            raise BudgetExceeded("tokens", 10, 9, 5)
    assert tree.get("run").status is Status.budget_exceeded
    assert [e["to"] for e in events] == ["pending", "budget_exceeded"]  # never "running"


def test_existing_pending_stage_keeps_its_ordinal():
    tree, _ = _tree()
    root = tree.new_stage(None, Kind.run, 0)
    planned = [tree.new_stage(root.id, Kind.llm_query, 1) for _ in range(3)]
    for st in reversed(planned):  # completion order differs from submission order
        with tree.stage(existing=st) as s:
            s.evidence = st.id
    assert [tree.get(p.id).evidence for p in planned] == [
        "run/llm_query-0", "run/llm_query-1", "run/llm_query-2"]


def test_already_terminal_at_exit_is_tolerated_and_changes_nothing():
    tree, events = _tree()
    with tree.stage(None, Kind.run, 0) as s:
        assert cancel_open(tree, "wall cap") == 1
        s.evidence = "late"
    st = tree.get(s.id)
    assert st.status is Status.cancelled and st.evidence is None
    assert [e["to"] for e in events] == ["pending", "running", "cancelled"]


def test_other_failures_to_record_are_not_swallowed():
    tree, _ = _tree()
    with pytest.raises(IllegalTransition):
        with tree.stage(None, Kind.run, 0) as s:
            # moved behind the scope's back to a non-terminal status it does not expect
            tree.transition(s.id, Status.running, Status.completed)
            tree._stages[s.id].status = Status.pending  # a corrupted tree must be loud
    assert tree.get(s.id).status is Status.pending
