"""Prompts: the system prompt that teaches the REPL and the answer protocol.

The system prompt shows only metadata about the context (its type, size and
item lengths), never the context itself.

Small models (the embedded 0.5B) copy the worked example almost token for token
and change little more than the question and the search words, so the example is
a complete, correct program for the commonest task, a lookup in a long text:

1. pick the rare words of the question and count how often each occurs;
2. score every match by the words found within 1,000 characters of it, each word
   weighted by 1/its count (a rare word counts more), so the place where the
   question's words meet comes first;
3. ask ``llm_query`` about a 3,000-character window around at most 4 distinct best
   places, with the prompt "Text: ... Question: ... Answer with the answer only, or
   NONE if the text does not say";
4. keep a reply only if it is not NONE and occurs in its window (small sub-models
   invent plausible answers for windows without the fact);
5. call ``FINAL`` from code, with "NOT FOUND" when no window gave a kept reply, so a
   fruitless search ends in one turn instead of being repeated until the iteration
   cap (the 0.5B repeats the same cell turn after turn).

Sizes are inline literals, never variables the model might replace. Words match at
a word start with up to two more letters (plurals), so "Dan" does not match "danger".
A list or dict context is joined into one string first (the ``to_text`` line).
"""
from __future__ import annotations

import json

SYSTEM = """You answer questions about a long text that you cannot see directly. \
The text is stored in the variable `context` inside a Python REPL (a Jupyter kernel). \
The REPL keeps its variables between your turns. You work by writing Python code; \
I run it and show you what it prints.

About `context`: {meta}

Functions you can call in your code:
- `llm_query(prompt)` asks another language model and returns its answer as a string. \
It reads at most about {sub_chars} characters, so give it a small piece of `context` \
together with the question, never the whole `context`.
- `llm_query_batched(prompts)` does the same for a list of prompts at once and returns a list of answers.
{rlm_line}- `FINAL(answer)` gives your final answer and ends the work. `FINAL_VAR("name")` gives \
the value of the variable `name` as the final answer.
- `print(...)` shows you results. Long output is cut to {max_output} characters, so print short pieces.

Rules:
1. Put code in a block that starts with ```repl and ends with ```. I run every such block.
2. Never print all of `context`, and never assign to `context`.
3. Find the relevant part with Python first: search for the rare words of the question \
(names, places, things), then ask about a small window around the best match.
4. When you know the answer, call FINAL(answer) inside a ```repl block. \
Writing FINAL in plain text does nothing.

Example. Question: "What colour is the door of the old lighthouse?"
```repl
import re
question = "What colour is the door of the old lighthouse?"
words = ["lighthouse", "door", "colour"]
{to_text}
def find(word, s):
    return [m.start() for m in re.finditer(r"\\b" + re.escape(word) + r"\\w{{0,2}}\\b", s, re.IGNORECASE)]
counts = {{w: len(find(w, text)) for w in words}}
print(counts)
places = []
for w in words:
    for pos in find(w, text):
        near = text[max(0, pos - 1000):pos + 1000]
        places.append((sum(1 / counts[v] for v in words if find(v, near)), pos))
places.sort(key=lambda p: -p[0])
answer = None
asked = []
for score, pos in places:
    if len(asked) == 4:
        break
    if any(abs(pos - a) < 2000 for a in asked):
        continue
    asked.append(pos)
    window = text[max(0, pos - 1500):pos + 1500]
    reply = llm_query("Text: " + window + "\\n\\nQuestion: " + question + "\\nAnswer with the answer only, or NONE if the text does not say.")
    reply = reply.strip().strip(".")
    print(pos, repr(reply))
    if reply and "NONE" not in reply.upper() and reply.lower() in window.lower():
        answer = reply
        break
if answer is None:
    answer = "NOT FOUND"
FINAL(answer)
```
In your code, use the question you were asked and its own rare words in `words`, not the words of this example."""

#: The example's line that makes one searchable string of ``context``, by context type.
TO_TEXT = {
    "str": "text = context",
    "list": 'text = "\\n\\n".join(str(item) for item in context)',
    "dict": 'text = "\\n\\n".join(str(key) + ": " + str(value) for key, value in context.items())',
}
TO_TEXT_OTHER = "text = str(context)"

RLM_LINE = ("- `rlm(prompt, query)` starts a helper that works like you on `prompt` as its own "
            "`context` and answers `query`; it returns the answer as a string. Use it for big pieces.\n")

FIRST_USER = """Question: {query}

Write a ```repl block that searches `context` for the answer. Do not answer from memory."""

FIRST_USER_NO_QUERY = """There is no separate question: the task is given in `context` itself. \
Look at the start of `context` to find out what is asked, then solve it. Write a ```repl block."""

NO_CODE = ("Your reply had no ```repl code block, so nothing ran. Write Python code in a ```repl "
           "block. When you know the answer, call FINAL(answer) inside the code block.")

PROSE_FINAL = ("You wrote FINAL in plain text, which does not end the work. Call FINAL(answer) "
               "inside a ```repl code block so it is executed.")

CUT_REPLY = ("Your reply was cut off at the output-token limit ({max_tokens:,} tokens){what}. "
             "Write a shorter reply: one short ```repl block, closed with ```, and little text "
             "around it.")


def cut_reply(max_tokens: int, unclosed_block: bool) -> str:
    """What the model is told when its reply stopped at the output-token limit."""
    what = (" before its last ```repl block was closed, so that block was not run"
            if unclosed_block else "")
    return CUT_REPLY.format(max_tokens=max_tokens, what=what)


LAST_TURN = ("This is your last turn. Call FINAL(answer) in a ```repl block now with your best "
             "answer from what you found so far.")


def format_meta(meta: dict) -> str:
    """One sentence of context metadata for the system prompt (a dict's ``listing`` as is)."""
    if meta.get("listing"):
        return meta["listing"]
    kind = {"str": "a string", "list": "a list", "dict": "a dict"}.get(meta["type"], meta["type"])
    s = (f"it is {kind} of {meta['chars']:,} characters (about {meta['tokens_estimate']:,} tokens)")
    if meta["type"] == "list":
        lens = meta.get("item_chars", [])
        s += f" with {meta['items']} items; item lengths: {lens}"
        if meta["items"] > len(lens):
            s += " ..."
    elif meta["type"] == "dict":
        s += f" with {meta['items']} keys; lengths by key: {json.dumps(meta.get('item_chars', {}))}"
    return s + "." + (" " + meta["note"] if meta.get("note") else "")


def system_prompt(meta: dict, *, can_recurse: bool, sub_chars: int = 6000,
                  max_output: int = 4000, template: str | None = None) -> str:
    """The system prompt for one RLM loop.

    Args:
        meta: :func:`rlm.context.describe` output.
        can_recurse: whether ``rlm(...)`` may be mentioned (max_depth >= 1).
        sub_chars: a safe prompt size for ``llm_query`` (characters).
        max_output: the cell output budget (characters).
        template: a replacement for :data:`SYSTEM` with the same fields (``meta``,
            ``sub_chars``, ``max_output``, ``rlm_line``, ``to_text``; any may be left out).
    """
    return (template or SYSTEM).format(meta=format_meta(meta), sub_chars=f"{sub_chars:,}",
                                       max_output=f"{max_output:,}",
                                       rlm_line=RLM_LINE if can_recurse else "",
                                       to_text=TO_TEXT.get(meta["type"], TO_TEXT_OTHER))


def first_user(query: str | None) -> str:
    return FIRST_USER.format(query=query) if query else FIRST_USER_NO_QUERY


def cell_feedback(index: int, code_blocks: int, output: str, error: str | None,
                  timed_out: bool, died: bool, timeout: float | None) -> str:
    """Text fed back to the model for one executed block."""
    head = f"Output of block {index + 1}/{code_blocks}:" if code_blocks > 1 else "Output:"
    notes = []
    if timed_out:
        notes.append(f"[the block ran longer than its {timeout:g} s timeout and was interrupted; "
                     "variables set before the interruption are kept. Try a faster approach.]")
    if died:
        notes.append("[the kernel process died while running this block (crash, os._exit or out of "
                     "memory). It was restarted with `context` loaded again; all other variables "
                     "were lost.]")
    body = output if output.strip() else "(no output)"
    return "\n".join([head, body] + notes)


def truncate(text: str, limit: int) -> str:
    """Cut ``text`` to ``limit`` characters, keeping head and tail, saying how much was cut."""
    if len(text) <= limit:
        return text
    keep_head = int(limit * 0.7)
    keep_tail = limit - keep_head
    cut = len(text) - limit
    return (text[:keep_head] + f"\n... [{cut:,} characters cut; print smaller pieces] ...\n"
            + (text[-keep_tail:] if keep_tail > 0 else ""))


def subcall_prompt(prompt: str, query: str | None) -> str:
    """The user message of a plain completion (``llm_query`` or a depth-limit fallback)."""
    return prompt if not query else f"{prompt}\n\nQuestion: {query}"
