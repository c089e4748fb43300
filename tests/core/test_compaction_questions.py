"""Compaction keeps the question being answered, wherever it runs: a session's later questions
(new tasks in the same conversation), a child's loop, a session resumed after a failure and one
replayed from its journal. Every request a loop sends states its current question, and every
summary call is asked about it (the scripted endpoint keeps each request it got)."""
from __future__ import annotations

import threading

import pytest

import rlm
from conftest import API_KEY, MODEL, repl
from rlm.prompting import prompts
from scripted_server import Reply, WindowedEndpoint

WINDOW = 6000  # tokens (characters / 4): a few turns of 3,000 characters of output
TURNS = 10  # per question: nine turns of big output, then FINAL
QUESTIONS = ["Sum the turn numbers ALPHA-QUESTION.", "Now the squares BETA-QUESTION.",
             "And the cubes GAMMA-QUESTION."]
MARKS = ["ALPHA-QUESTION", "BETA-QUESTION", "GAMMA-QUESTION"]


def _text(req: dict) -> str:
    return "\n".join(str(m.get("content") or "") for m in req.get("messages") or [])


def _summary(req: dict) -> bool:
    return (req.get("messages") or [{}])[0].get("content") == prompts.COMPACT_SYSTEM


class Questions:
    """The scripted model of a session: question k takes :data:`TURNS` turns (each printing
    3,000 characters), the last one its FINAL; ``seen`` keeps ``(question, request)`` pairs."""

    def __init__(self, fail_at: tuple[int, int] | None = None) -> None:
        self.lock = threading.Lock()
        self.q, self.n = 0, 0
        self.seen: list[tuple[int, dict]] = []
        self.fail_at = fail_at  # (question, turn): answered once with HTTP 500

    def __call__(self, req: dict):
        with self.lock:
            if _summary(req):
                self.seen.append((self.q, req))
                return f"NOTES {len(self.seen)}: `acc` holds the running total; go on."
            self.n += 1
            if self.fail_at == (self.q, self.n):
                self.fail_at, self.n = None, self.n - 1
                return Reply(status=500, content="upstream down")
            self.seen.append((self.q, req))
            q, n = self.q, self.n
            if n == TURNS:
                self.q, self.n = self.q + 1, 0
        if n == TURNS:
            return repl("FINAL(acc)")
        return repl(f"acc = globals().get('acc', 0) + {n}",
                    f"print('Q{q}TURN{n:02d} ' + 'lorem ipsum dolor ' * 160)")


def _options(srv, tmp_path, **more) -> dict:
    o = dict(base_url=srv.base_url, api_key=API_KEY, model=MODEL,
             journal=str(tmp_path / "j.sqlite3"), max_iterations=12, max_output_chars=3000,
             cell_timeout=10, context_window=WINDOW)
    o.update(more)
    return o


def _assert_each_request_states_its_question(model: Questions, upto: int) -> None:
    summaries = {q: 0 for q in range(upto)}
    compacted = {q: 0 for q in range(upto)}
    for q, req in model.seen:
        text = _text(req)
        assert MARKS[q] in text, (q, text[:3000])  # the question now answered is stated
        if _summary(req):
            summaries[q] += 1
        elif "was compacted" in str(req["messages"][1]["content"]):
            compacted[q] += 1
    # each question compacted (its summaries asked about it) and went on compacted
    assert all(summaries[q] >= 2 and compacted[q] >= 2 for q in range(upto)), (summaries,
                                                                                compacted)


def test_a_sessions_later_questions_survive_compaction(scripted, tmp_path):
    model = Questions()
    srv = scripted(WindowedEndpoint(model, WINDOW))
    with rlm.Session("some context", session_id="qs", **_options(srv, tmp_path)) as s:
        answers = [s.ask(q) for q in QUESTIONS]
    assert [r.status for r in answers] == ["completed"] * 3, [r.reason for r in answers]
    _assert_each_request_states_its_question(model, 3)
    # a later question's summary is asked for that question, and says which was first
    late = [req for q, req in model.seen if q == 2 and _summary(req)]
    assert all("answered now" in req["messages"][1]["content"] for req in late)


def test_a_session_resumed_and_replayed_sends_the_same_compacted_requests(scripted,
                                                                          tmp_path):
    """Question 2 fails once (HTTP 500, no retry) after it compacted; resuming the session
    serves every recorded call and sends the rest with question 2 in each; a second resume
    (every question replayed from the journal) sends nothing."""
    model = Questions(fail_at=(1, 9))
    srv = scripted(WindowedEndpoint(model, WINDOW))
    opts = _options(srv, tmp_path, max_attempts=1)
    with rlm.Session("some context", session_id="qr", **opts) as s:
        assert s.ask(QUESTIONS[0]).status == "completed"
        with pytest.raises(rlm.EndpointError):
            s.ask(QUESTIONS[1])
    sent = srv.count
    s = rlm.Session.resume("qr", contexts=["some context"], **opts)
    with s:
        assert [r.status for r in s.results] == ["completed", "completed"]
    # the resumed question sent only its last turn(s): the failed one, then its FINAL
    assert 1 <= srv.count - sent <= 3
    _assert_each_request_states_its_question(model, 2)
    before = srv.count
    with rlm.Session.resume("qr", contexts=["some context"], **opts) as again:
        assert [r.answer for r in again.results] == [r.answer for r in s.results]
    assert srv.count == before  # replayed: every compacted request matched its record


class Child:
    """A root that starts one child (``rlm``) whose loop compacts; ``child`` keeps the child's
    requests (turns and summaries)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.n = 0
        self.child: list[dict] = []

    def __call__(self, req: dict):
        first = (req.get("messages") or [{}])[0]
        if first.get("role") != "system":
            return "plain"
        text = _text(req)
        # the root's task (or its summary's) names ROOT-QUESTION; anything else is the child's
        if "ROOT-QUESTION" not in str(req["messages"][1]["content"]):
            with self.lock:
                self.child.append(req)
                if _summary(req):
                    return "NOTES: `acc` holds the child's total."
                self.n += 1
                n = self.n
            if n == TURNS:
                return repl("FINAL(acc)")
            return repl(f"acc = globals().get('acc', 0) + {n}",
                        f"print('CTURN{n:02d} ' + 'lorem ipsum dolor ' * 160)")
        if _summary(req):  # a root summary (not expected: the root is short)
            return "NOTES: the root."
        if "CHILD=" in text:
            return repl("FINAL(child)")
        return repl("child = rlm('a context for the child', 'CHILD-QUESTION: count up')",
                    "print('CHILD=' + str(child))")


def test_a_childs_loop_keeps_its_own_question_through_compaction(scripted, tmp_path):
    model = Child()
    srv = scripted(WindowedEndpoint(model, WINDOW))
    res = rlm.completion("root context", "Ask a child ROOT-QUESTION.",
                         **_options(srv, tmp_path, max_depth=2))
    assert res.status == "completed" and res.answer == str(sum(range(1, TURNS))), res.reason
    summaries = [r for r in model.child if _summary(r)]
    compacted = [r for r in model.child if not _summary(r)
                 and "was compacted" in str(r["messages"][1]["content"])]
    assert len(summaries) >= 2 and len(compacted) >= 2
    # every child request (summaries too) is about the child's question, not the root's
    assert all("CHILD-QUESTION" in _text(r) for r in model.child)
    sent = srv.count
    again = rlm.api.replay(res.run_id, journal=str(tmp_path / "j.sqlite3"),
                           context="root context")
    assert again.answer == res.answer and srv.count == sent
