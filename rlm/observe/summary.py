"""What every view says of a whole run: why it ended (:func:`ending`), what it spent
(:func:`spent`), and its row in the runs list (:func:`run_row`, :func:`runs_lines`).

One place decides the words, so ``rlm show``, ``rlm show --follow``, ``rlm runs`` (and
``--watch``), ``rlm view`` and the live view of ``rlm run`` say the same of the same run. A run's
end is read from its journal record (state, ``error``, the cap in ``usage``) or, during a run,
from its ``run`` stage as it ends (status and error).
"""
from __future__ import annotations

import re
import time
import unicodedata
from dataclasses import dataclass
from typing import Any, Mapping

from harness.text import printable

__all__ = ["Ending", "ending", "stage_ending", "header_lines", "run_row", "runs_lines",
           "columns", "RUN_COLUMNS", "Spent", "spent", "usage_text", "show_lines"]

_CAP = re.compile(r"budget cap '(\w+)'")


@dataclass(frozen=True)
class Ending:
    """Why a run ended.

    Attributes:
        kind: ``answered``, ``no_answer`` (the loop ran out of turns without an executed
            FINAL), ``failed``, ``budget_exceeded``, ``cancelled``, ``crashed`` (its process
            is gone and it recorded no end) or ``running`` (it has not ended).
        short: a few words for a column (``cap calls``, ``no FINAL``...; "" when answered).
        text: the whole sentence, with the recorded reason and what to do next.
        head: ``text`` without the recorded reason (the progress line of ``rlm run``, whose
            last line gives the reason once).
    """

    kind: str
    short: str
    text: str
    head: str = ""


def _first_line(text: str) -> str:
    return " ".join(str(text).split())


def ending(rec: Mapping[str, Any]) -> Ending:
    """Why the run of the journal record ``rec`` (``Journal.get_run``) ended."""
    usage = rec.get("usage") if isinstance(rec.get("usage"), Mapping) else {}
    error = rec.get("error")
    reason = error.get("message", error) if isinstance(error, Mapping) else error
    return _ending(rec.get("state") or rec.get("status") or "", str(reason or ""),
                   usage.get("cap"), str(rec.get("run_id") or ""),
                   heartbeat=rec.get("heartbeat_at"), host=rec.get("owner_host"),
                   plain=bool((rec.get("options") or {}).get("plain")))


def stage_ending(stage: Mapping[str, Any], run_id: str = "") -> Ending:
    """Why a run ended, from its ``run`` stage as it reached a terminal status (the live view,
    which sees stages, not the run record)."""
    return _ending(stage.get("status") or "", str(stage.get("error") or ""), None, run_id)


def _ending(state: str, reason: str, cap: str | None, run_id: str, *,
            heartbeat: float | None = None, host: str | None = None,
            plain: bool = False) -> Ending:
    reason = _first_line(reason)
    resume = f"`rlm resume {run_id}` continues it" if run_id else "`rlm resume` continues it"
    if state == "completed":
        return Ending("answered", "", "answered: the reply of a plain completion" if plain
                      else "answered: an executed FINAL set the answer")
    if state == "running":
        return Ending("running", "", "still running")
    if state == "budget_exceeded":
        m = _CAP.search(reason)
        cap = cap or (m.group(1) if m else None)
        what = f"the {cap} cap" if cap else "a budget cap"
        head = f"budget exceeded: {what} stopped it"
        return Ending("budget_exceeded", f"cap {cap}" if cap else "budget cap",
                      head + (f" ({reason})" if reason else ""), head)
    if state == "cancelled":
        why = "" if reason in ("", "interrupted", "KeyboardInterrupt") else f" ({reason})"
        return Ending("cancelled", "cancelled", f"cancelled: interrupted before it ended{why}; "
                      f"{resume}")
    if state == "crashed":
        when = (" (last heartbeat " + time.strftime("%Y-%m-%d %H:%M:%S",
                                                    time.localtime(heartbeat))
                + (f" on {host}" if host else "") + ")") if heartbeat else ""
        return Ending("crashed", "process gone", "crashed: the process running it stopped "
                      f"without recording an end{when}; {resume}")
    if reason.startswith("no FINAL"):
        return Ending("no_answer", "no FINAL", f"no answer: {reason}", "no answer")
    if state == "failed":
        return Ending("failed", reason[:40] or "failed",
                      f"failed: {reason}" if reason else "failed (no reason was recorded)",
                      "failed")
    return Ending(state or "unknown", state, f"{state}: {reason}" if reason else state)


# ---------------------------------------------------------------------------- what it spent

_TOTAL_KEYS = ("calls", "prompt_tokens", "completion_tokens", "total_tokens", "cost_usd")


@dataclass(frozen=True)
class Spent:
    """What a run spent.

    Attributes:
        all: over every attempt, from the journal's spend ledger (``Journal.spend_totals``:
            ``calls``, ``prompt_tokens``, ``completion_tokens``, ``total_tokens``, ``cost_usd``,
            ``open``: calls in flight when an attempt died, counted at their reservation).
        last: the last attempt's own (the same keys, from the run record's ``usage``) when the
            run was resumed and has ended, else None (one attempt, or still running).
    """

    all: dict
    last: dict | None = None


def spent(journal, rec: Mapping[str, Any]) -> Spent:
    """What the run of record ``rec`` spent: the one source of the totals every view shows
    (``rlm show``, ``rlm view``, ``rlm runs`` and its ``--json``), so they agree after a
    resume. Raises what ``Journal.spend_totals`` raises (``JournalError``)."""
    usage = rec.get("usage") if isinstance(rec.get("usage"), Mapping) else {}
    last = None
    if isinstance(usage.get("all_attempts"), Mapping):
        last = {k: usage.get(k) or 0 for k in _TOTAL_KEYS}
    return Spent(journal.spend_totals(rec["run_id"]), last)


def usage_text(u: Mapping[str, Any]) -> str:
    """``N call(s), T tokens (I in / O out), $C`` of a totals dict (see :class:`Spent`)."""
    return (f"{u.get('calls', 0)} call(s), {u.get('total_tokens', 0):,} tokens "
            f"({u.get('prompt_tokens', 0):,} in / {u.get('completion_tokens', 0):,} out), "
            f"${float(u.get('cost_usd') or 0):.6f}")


def spent_line(sp: Spent) -> str:
    """The ``spent: ...`` line of ``rlm show``: the totals over every attempt, then the last
    attempt's when the run was resumed."""
    line = f"spent: {usage_text(sp.all)}" + (" over all attempts" if sp.last is not None
                                              else "")
    if sp.all.get("open"):
        line += (f" ({sp.all['open']} call(s) in flight when an attempt stopped counted at "
                 "their reservation)")
    if sp.last is not None:
        line += f"; the last attempt: {usage_text(sp.last)}"
    return line


def header_lines(rec: Mapping[str, Any], sp: Spent | None = None) -> list[str]:
    """The opening lines of ``rlm show`` and ``rlm show --follow``: the run id, state, query
    (and how its kernels ran), why it ended (``ended: ...``, once it has), its answer, and
    what it spent (``sp``, from :func:`spent`; no line without it).
    What the model or the user wrote is shown with its control characters escaped."""
    sandbox = (rec.get("usage") or {}).get("sandbox") if isinstance(rec.get("usage"), Mapping) \
        else None
    lines = [f"run {printable(str(rec['run_id']))}  state={rec['state']}  "
             f"query={rec.get('query')!r}"
             + (f"  kernels={printable(str(sandbox))}" if sandbox else "")]
    end = ending(rec)
    if end.kind != "running":
        lines.append(f"ended: {printable(end.text)}")
    if rec.get("answer") is not None:
        lines.append(f"answer: {printable(rec['answer'])}")
    if sp is not None:
        lines.append(spent_line(sp))
    return lines


def show_lines(journal, rec: Mapping[str, Any], max_level: int | None = None) -> list[str]:
    """What ``rlm show`` prints (and ``rlm show --follow`` once the run ended): the
    :func:`header_lines` with what the run spent, then its stage tree. When the stages' own
    totals are not the run's (a resumed run: its re-done stages hold the last attempt's calls,
    its replayed ones none), the tree's first line says so. Escaped for a terminal."""
    from harness.stages.tree import StageTree
    tree = StageTree.from_records(rec["run_id"], journal.stages(rec["run_id"]))
    sp = spent(journal, rec)
    note = ""
    if "run" in tree:
        own = tree.rollup("run").to_dict()
        if any(round(float(own.get(k) or 0), 9) != round(float(sp.all.get(k) or 0), 9)
               for k in _TOTAL_KEYS):
            note = (" in the stages as last recorded (a call served from the journal counts "
                    "0 there; `spent` above counts every attempt)")
    return header_lines(rec, sp) + [printable(tree.render(max_level=max_level, note=note))]


# ---------------------------------------------------------------------------- the runs list

#: The runs list's columns: (heading, key of :func:`run_row`, right-aligned).
RUN_COLUMNS = (("RUN ID", "run_id", False), ("STARTED", "started", False),
               ("STATE", "state", False), ("WHY", "why", False), ("HOST", "host", False),
               ("DEPTH", "depth", True), ("COST $", "cost", True),
               ("MODEL / QUERY", "what", False))
_WHY_WIDTH = 28
_QUERY_WIDTH = 60


def columns(text: str) -> int:
    """Terminal columns ``text`` takes: wide characters (CJK, most emoji: Unicode East Asian
    Width W or F) two, combining marks none, others one."""
    return sum(0 if unicodedata.combining(c) else
               2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _plain_prompt(journal, run_id: str) -> str:
    """A plain completion's prompt (no query of its own: the prompt is its context), by its
    last line, where a question usually is."""
    try:
        calls = journal.model_calls(run_id)
        msgs = (calls[0].get("request") or {}).get("messages") or [] if calls else []
        text = str(msgs[-1].get("content") or "") if msgs else ""
    except Exception:  # a damaged record: the row says nothing rather than failing the list
        return ""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def run_row(journal, rec: Mapping[str, Any]) -> dict[str, str]:
    """The runs list's row of one run record, every value printable text (control characters
    escaped): run id, start (local time), state, why it ended (short), owner host, depth (``-``
    for a plain completion: no kernel, no depth), cost (USD over every attempt, as
    :func:`spent` counts it), and the model and query (a plain completion's prompt, marked
    ``plain:``)."""
    plain = bool((rec.get("options") or {}).get("plain"))
    cost = float(spent(journal, rec).all["cost_usd"])
    query = rec.get("query") or ""
    if plain and not query:
        query = "plain: " + _plain_prompt(journal, rec["run_id"])
    return {
        "run_id": printable(str(rec["run_id"])),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.get("created_at") or 0)),
        "state": printable(str(rec.get("state"))),
        "why": printable(_cut(ending(rec).short, _WHY_WIDTH)),
        "host": printable(str(rec.get("owner_host") or "-")),
        "depth": "-" if plain else str(rec.get("max_depth", "")),
        "cost": f"{cost:.4f}",
        "what": printable(f"{rec.get('model')} / " + _cut(query.replace("\n", " "),
                                                            _QUERY_WIDTH)),
    }


def runs_lines(rows: list[dict[str, str]]) -> list[str]:
    """The runs list as text lines, a heading first: each column as wide as its widest cell
    (counted in terminal columns), so every row lines up whatever the length of its run id."""
    widths = {key: max([columns(head)] + [columns(r[key]) for r in rows])
              for head, key, _ in RUN_COLUMNS}

    def line(cells: dict[str, str]) -> str:
        out = []
        for head, key, right in RUN_COLUMNS:
            text = cells[key]
            if key == "what":  # the last column: no padding
                out.append(text)
                continue
            pad = " " * (widths[key] - columns(text))
            out.append(pad + text if right else text + pad)
        return "  ".join(out).rstrip()

    return [line({key: head for head, key, _ in RUN_COLUMNS})] + [line(r) for r in rows]
