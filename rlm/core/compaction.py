"""Compaction: a loop's conversation kept within its model's window.

Before each turn's model call (:meth:`Compactor.model_call`, from ``RLMLoop._turn``), the
request's token estimate (:func:`rlm.core.run_tree.prompt_estimate`: the larger of the o200k
count and characters / 4) plus the turn's output cap is compared with ``compact_at`` x the
model's window (:mod:`rlm.models.windows`). Past it, the older turns are replaced by a summary:

* kept: the system prompt, the first user message (the task), and the last K turns verbatim (a
  turn: one reply of the model and the feedback after it), K the most turns that fit in
  :data:`KEEP_SHARE` of the threshold beside the summary's output cap;
* in a session, a later question is a new task in the same conversation: the message that
  opened it (``Compactor.question``) is stated again after the summary, and the summary call is
  asked about it, so a compacted request never loses the question now being answered;
* the summary (what was learned, the variables that hold results, what was tried, what is
  left) is written by one model call inside a ``compaction`` stage under the iteration, sent
  through :meth:`~rlm.core.run_tree.RunTree.model_call`: journaled, capped, served from the
  journal on resume and replay. It joins the task in the first user message, with a note that
  compaction happened and that the full transcript is the kernel's ``history``
  (:mod:`kernels.transcript`, fetched over the bridge with ``Op.HISTORY``).

The kernel is untouched. An endpoint that refuses a request as too long
(:class:`~rlm.models.windows.ContextWindowExceeded`) teaches the loop its window: the turn is
compacted once and sent again (a second refusal ends the run). ``context_window=0`` turns all
of this off.

Every decision is replayable: each iteration records the window it used in its meta
(``window``), and a compaction stage records its trigger and window, so a replay (which
probes no server) makes the same decisions and reproduces the same stage ids.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

from harness.stages.tree import Kind
from rlm.core.run_tree import RunTree, prompt_estimate
from rlm.models.base import Completion
from rlm.models.windows import ContextWindowExceeded, Window, resolve_window
from rlm.prompting import prompts

__all__ = ["Compactor", "attach", "history", "KEEP_SHARE"]

#: The share of the compaction threshold the conversation may fill right after a compaction
#: (the rest is room for the turns to come, so it does not compact again at once).
KEEP_SHARE = 0.5

_LOCK = threading.Lock()
# per run: the window of each model (a learned one replaces what was resolved) and the
# recorded stages of a resumed or replayed run, by id
_WINDOWS: "weakref.WeakKeyDictionary[RunTree, dict]" = weakref.WeakKeyDictionary()
_RECORDED: "weakref.WeakKeyDictionary[RunTree, dict]" = weakref.WeakKeyDictionary()
_TERMINAL = ("completed", "failed", "cancelled", "budget_exceeded")


def attach(loop: Any) -> "Compactor":
    """The :class:`Compactor` of ``loop`` (an :class:`~rlm.core.loop.RLMLoop`), made on first
    use and kept as ``loop.compactor``."""
    comp = getattr(loop, "compactor", None)
    if comp is not None:
        return comp
    held = getattr(loop, "held", None)  # a session's root: one compactor for every question
    comp = getattr(held, "compactor", None)
    if comp is None:
        comp = Compactor(loop)
        if held is not None:
            held.compactor = comp
    else:
        # a later question of the session: the message that opens it (the last one of the
        # conversation at its first turn) becomes the question compaction keeps
        comp.loop, comp.run = loop, loop.run_tree
        comp.question, comp.opening = None, True
    loop.compactor = comp
    return comp


def history(loop: Any) -> list[dict]:
    """The full transcript of ``loop`` for the kernel's ``history`` (``Op.HISTORY``): a list
    of ``{"role", "content"}`` dicts, empty before the first turn."""
    comp = getattr(loop, "compactor", None)
    return comp.transcript() if comp is not None else []


def _recorded(run: RunTree) -> dict:
    """The stages the journal recorded for this run (``{id: stage dict}``; empty for a fresh
    run), read once per run."""
    if run.recorded is None:
        return {}
    with _LOCK:
        got = _RECORDED.get(run)
        if got is None:
            got = _RECORDED[run] = {s.get("id"): s for s in
                                    run.recorded.journal.stages(run.run_id)}
        return got


class Compactor:
    """Keeps one loop's conversation within its model's window (see the module docstring).

    Args:
        loop: the loop (``run_tree``, ``level``, ``model``, ``scope`` are read).

    Attributes:
        archive: the messages compaction took out, oldest first (list of dicts).
        compactions: how many times this loop compacted (int).
    """

    def __init__(self, loop: Any) -> None:
        self.loop, self.run = loop, loop.run_tree
        self.archive: list[dict] = []
        self.compactions = 0
        self.task: str | None = None  # the first user message as it was before any compaction
        self.summary: str | None = None
        self.messages: list[dict] = []
        # the message that opened the question now answered when it is not the task (a
        # session's later question); ``opening``: it is still to be read at the next turn
        self.question: str | None = None
        self.opening = False

    @property
    def enabled(self) -> bool:
        """False when the run set ``context_window=0`` (compaction off)."""
        return getattr(self.run.opts, "context_window", None) != 0

    def transcript(self) -> list[dict]:
        """The whole conversation as it was said, before any compaction (copies)."""
        msgs = list(self.messages)
        if self.compactions and len(msgs) >= 2:
            msgs = [msgs[0], {"role": "user", "content": self.task}] + self.archive + msgs[2:]
        return [{"role": m.get("role"), "content": m.get("content")} for m in msgs]

    # the window -------------------------------------------------------------------
    def window(self, iteration: str) -> Window | None:
        """The window this iteration works with: as recorded when the journal holds the
        iteration (resume, replay), else the run's for this model (resolved once)."""
        run, model = self.run, self.loop.model
        rec = _recorded(run).get(iteration)
        if rec is not None and rec.get("status") in _TERMINAL:
            w = (rec.get("meta") or {}).get("window")
            return Window(int(w["tokens"]), str(w["source"])) if w else None
        with _LOCK:
            known = _WINDOWS.setdefault(run, {})
            if model in known:
                return known[model]
        # a replay probes no server: what it did not record, it does not know
        strict = run.recorded is not None and run.recorded.strict
        found = None if strict or not self.enabled else resolve_window(model, run.opts)
        with _LOCK:
            return _WINDOWS[run].setdefault(model, found)

    def _learn(self, window: Window) -> None:
        with _LOCK:
            _WINDOWS.setdefault(self.run, {})[self.loop.model] = window

    # the turn's model call ------------------------------------------------------------
    def model_call(self, it: Any, messages: list[dict], max_tokens: int) -> Completion:
        """The model call of iteration ``it`` (a stage scope) over ``messages`` (compacted in
        place first when they would pass the threshold); on a refusal as too long, one
        compaction and one more try.

        Returns:
            the :class:`~rlm.models.base.Completion`.
        Raises:
            ContextWindowExceeded: refused again after compacting, or compaction is off.
            What :meth:`RunTree.model_call` raises (``BudgetExceeded`` for the summary call
            too).
        """
        self.messages = messages
        if self.task is None and len(messages) >= 2:
            self.task = str(messages[1].get("content") or "")
        if self.opening:
            self.opening = False
            self.question = str(messages[-1].get("content") or "")
        window = self.window(it.id)
        if window is not None:
            it.meta["window"] = window.to_dict()
            if self.enabled:
                need = prompt_estimate(messages) + max_tokens
                if need > self._threshold(window):
                    self.compact(it, messages, window, max_tokens, "window")
        run, loop = self.run, self.loop
        for attempt in (0, 1):
            try:
                self._refused_as_recorded(it, attempt)
                return run.model_call(it.id, loop.level, messages, loop.model, max_tokens,
                                      scope=loop.scope)
            except ContextWindowExceeded as exc:
                if attempt or not self.enabled:
                    raise
                learned = self._learned(exc, messages, max_tokens, window)
                self._learn(learned)
                if not self.compact(it, messages, learned, max_tokens, "refused",
                                    refused=f"{it.id}/model_call-0"):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _threshold(self, window: Window) -> float:
        return float(getattr(self.run.opts, "compact_at", 0.8)) * window.tokens

    @staticmethod
    def _learned(exc: ContextWindowExceeded, messages: list[dict], max_tokens: int,
                 window: Window | None) -> Window:
        """The window a refusal teaches: the one it names, else nine tenths of what was
        sent (never more than the window believed so far)."""
        tokens = exc.window or int(0.9 * (exc.prompt_tokens or
                                          prompt_estimate(messages) + max_tokens))
        if window is not None:
            tokens = min(tokens, window.tokens)
        return Window(max(1, tokens), "endpoint")

    def _refused_as_recorded(self, it: Any, attempt: int) -> None:
        """Resuming or replaying a turn whose first call the endpoint refused as too long:
        that call's stage fails again the same way, and nothing is sent for it."""
        if attempt or self.run.recorded is None:
            return
        rec = _recorded(self.run)
        call_id = f"{it.id}/model_call-0"
        metas = [(rec.get(f"{it.id}/compaction-{n}") or {}).get("meta") or {} for n in (0, 1)]
        meta = next((m for m in metas if m.get("refused") == call_id), None)
        if meta is None:
            return
        stage = self.run.tree.new_stage(it.id, Kind.model_call, self.loop.level,
                                        model=self.loop.model)
        with self.run.stage(existing=stage) as st:
            st.meta["replayed"] = True
            raise ContextWindowExceeded(str((rec.get(call_id) or {}).get("error") or
                                            "refused as too long (recorded)"),
                                        int(meta["window"]["tokens"]))

    # compacting ----------------------------------------------------------------------------
    def compact(self, it: Any, messages: list[dict], window: Window, max_tokens: int,
                trigger: str, refused: str | None = None) -> bool:
        """Replace the older turns of ``messages`` (in place) by a summary, in a
        ``compaction`` stage under ``it``. Returns False when there is nothing to drop.

        Args:
            window: the window to fit; max_tokens: the turn's output cap (tokens).
            trigger: ``"window"`` (the estimate passed the threshold) or ``"refused"`` (the
                endpoint refused the request); refused: the refused call's stage id.
        """
        turns = _turns(messages[2:])
        if len(messages) < 3 or not turns:
            return False
        cap = self._summary_cap(window)
        keep = self._keep(messages, turns, window, max_tokens, cap)
        dropped = [m for t in turns[:len(turns) - keep] for m in t]
        kept = [m for t in turns[len(turns) - keep:] for m in t]
        run, loop = self.run, self.loop
        before = prompt_estimate(messages)
        with run.stage(it.id, Kind.compaction, loop.level, model=loop.model) as st:
            st.meta.update(trigger=trigger, window=window.to_dict(), before_tokens=before,
                           dropped_messages=len(dropped), kept_turns=keep)
            if refused:
                st.meta["refused"] = refused
            request = self._request(dropped, window, cap)
            comp = run.model_call(st.id, loop.level, request, loop.model, cap, scope=loop.scope)
            summary = comp.text.strip() or "(the summary came back empty: read `history`)"
            self.archive.extend(dropped)
            self.compactions += 1
            self.summary = summary
            messages[:] = self._head(messages, summary, self.compactions) + kept
            st.meta["after_tokens"] = prompt_estimate(messages)
            st.evidence = summary
        run.progress(f"L{loop.level} {st.id}: {len(dropped)} message(s) compacted "
                     f"({before:,} -> {st.meta['after_tokens']:,} tokens, window "
                     f"{window.tokens:,})")
        return True

    def _summary_cap(self, window: Window) -> int:
        """The summary call's output cap (tokens): an eighth of the window, at least 256, at
        most the turns' own cap."""
        return max(1, min(self.run.opts.max_completion_tokens, max(256, window.tokens // 8)))

    def _keep(self, messages: list[dict], turns: list[list[dict]], window: Window,
              max_tokens: int, cap: int) -> int:
        """K: the most recent turns kept verbatim, the most that fit within
        :data:`KEEP_SHARE` of the threshold beside the task, a summary of ``cap`` tokens and
        the output cap; at least one turn is always dropped."""
        room = KEEP_SHARE * self._threshold(window) - max_tokens - cap
        head = self._head(messages, "", self.compactions + 1)
        k = 0
        while k < len(turns) - 1 and prompt_estimate(
                head + [m for t in turns[-(k + 1):] for m in t]) <= room:
            k += 1
        return k

    def _head(self, messages: list[dict], summary: str, compactions: int) -> list[dict]:
        """The system prompt and the compacted first user message: the task, the notes and,
        in a session's later question, that question again."""
        return [messages[0], {"role": "user", "content": prompts.compacted_task(
            self.task or "", summary, len(self.archive), compactions, self.question)}]

    def _request(self, dropped: list[dict], window: Window, cap: int) -> list[dict]:
        """The summary call's messages, the turns cut (each message's head and tail kept)
        until the request fits the threshold with the summary's cap."""
        budget = self._threshold(window) - cap
        limit = None
        for _ in range(8):
            req = [{"role": "system", "content": prompts.COMPACT_SYSTEM},
                   {"role": "user", "content": prompts.compact_request(
                       self.task or "", self.summary, prompts.transcript_text(dropped, limit),
                       self.question)}]
            size = prompt_estimate(req)
            if size <= budget:
                break
            longest = max(len(str(m.get("content") or "")) for m in dropped)
            limit = max(200, int((limit or longest) * max(0.1, budget / size) * 0.9))
        return req


def _turns(body: list[dict]) -> list[list[dict]]:
    """The messages after the task, grouped in turns: each starts at a reply of the model
    (``assistant``) and holds the user messages after it."""
    turns: list[list[dict]] = []
    for m in body:
        if m.get("role") == "assistant" or not turns:
            turns.append([m])
        else:
            turns[-1].append(m)
    return turns
