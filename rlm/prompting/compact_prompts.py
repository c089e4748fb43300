"""The texts of compaction (:mod:`rlm.core.compaction`): the summary call's system prompt and
user message, and the first user message that carries the summary after a compaction."""
from __future__ import annotations

__all__ = ["COMPACT_SYSTEM", "compact_request", "compacted_task"]

COMPACT_SYSTEM = """You write the working notes of an assistant that answers a task by \
writing Python code in a REPL (a Jupyter kernel whose variables persist). Its conversation \
has grown too long for its model's window, so the older turns are replaced by your notes. \
Write them so it can go on without the turns themselves:
1. What was learned: facts found, partial results, numbers, candidate answers (quote them exactly).
2. The variables that hold results: each name and what it holds.
3. What was tried and did not work.
4. What is left to do.
Be concise and exact. Plain text only: no code blocks, no FINAL."""


def compact_request(task: str, previous: str | None, turns: str,
                    question: str | None = None) -> str:
    """The user message of the summary call: the task, the notes of an earlier compaction
    (``previous``) and the turns to condense (``turns``, as text); in a session's later
    question, ``question`` (the message that opened it), which the notes are for."""
    parts = ([f"The task:\n{task}"] if not question else [
        f"The conversation's first task (answered already):\n{task}",
        f"The question being answered now (write the notes for it):\n{question}"])
    if previous:
        parts.append(f"Notes written at an earlier compaction:\n{previous}")
    parts.append(f"The turns to condense, oldest first:\n{turns}")
    parts.append("Write the notes now.")
    return "\n\n".join(parts)


def compacted_task(task: str, summary: str, dropped: int, compactions: int,
                   question: str | None = None) -> str:
    """The first user message after a compaction: the task as given, then what happened and
    the notes (``summary``); ``dropped``: messages replaced so far, ``compactions``: how many
    compactions; ``question``: a session's later question (the message that opened it)."""
    now = f"\n\n---\nThe task above is done. The question you are answering now:\n{question}"
    return (f"{task}\n\n---\n[The conversation was compacted ({compactions} time(s)): "
            f"{dropped} earlier message(s) were replaced by the notes below to stay within the "
            "model's window. The REPL is untouched: every variable is still there (print it "
            "again, or SHOW_VARS()). The full transcript is in the kernel as `history`, a list "
            "of {'role', 'content'} dicts, oldest first: e.g. "
            "print(history[-4]['content'][:2000]).]\n\nNotes on the earlier turns:\n"
            f"{summary}{now if question else ''}")
