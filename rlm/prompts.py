"""Prompts: the system prompt that teaches the REPL and the answer protocol.

The system prompt shows only metadata about the context (its type, size and
item lengths), never the context itself. Small models copy the worked example
closely, so the example is written to be right in every detail: it searches
``context`` with Python first, reads a small window, asks ``llm_query`` about
that window only, keeps an answer only if it is found in the window, and ends
with ``FINAL`` from code. Sizes are inline literals, never variables.
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
counts = {{w: len(re.findall(re.escape(w), context, re.IGNORECASE)) for w in words}}
print(counts)
places = []
for m in re.finditer("|".join(re.escape(w) for w in words), context, re.IGNORECASE):
    near = context[max(0, m.start() - 1000):m.start() + 1000].lower()
    places.append((sum(1 / counts[w] for w in words if w.lower() in near), m.start()))
places.sort(key=lambda p: -p[0])
answer = None
asked = []
for score, pos in places:
    if len(asked) == 4:
        break
    if any(abs(pos - a) < 2000 for a in asked):
        continue
    asked.append(pos)
    window = context[max(0, pos - 1500):pos + 1500]
    reply = llm_query("Text: " + window + "\\n\\nQuestion: " + question + "\\nAnswer with the answer only, or NONE if the text does not say.")
    reply = reply.strip().strip(".")
    print(pos, repr(reply))
    if reply and "NONE" not in reply.upper() and reply.lower() in window.lower():
        answer = reply
        break
if answer:
    FINAL(answer)
else:
    print("Not found yet: search again with other words from the question.")
```
In your code, use the question you were asked and its own rare words in `words`, not the words of this example."""

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

LAST_TURN = ("This is your last turn. Call FINAL(answer) in a ```repl block now with your best "
             "answer from what you found so far.")


def format_meta(meta: dict) -> str:
    """One sentence of context metadata for the system prompt."""
    kind = {"str": "a string", "list": "a list", "dict": "a dict"}.get(meta["type"], meta["type"])
    s = (f"it is {kind} of {meta['chars']:,} characters (about {meta['tokens_estimate']:,} tokens)")
    if meta["type"] == "list":
        lens = meta.get("item_chars", [])
        s += f" with {meta['items']} items; item lengths: {lens}"
        if meta["items"] > len(lens):
            s += " ..."
    elif meta["type"] == "dict":
        s += f" with {meta['items']} keys; lengths by key: {json.dumps(meta.get('item_chars', {}))}"
    return s + "."


def system_prompt(meta: dict, *, can_recurse: bool, sub_chars: int = 6000,
                  max_output: int = 4000, template: str | None = None) -> str:
    """The system prompt for one RLM loop.

    Args:
        meta: :func:`rlm.context.describe` output.
        can_recurse: whether ``rlm(...)`` may be mentioned (max_depth >= 1).
        sub_chars: a safe prompt size for ``llm_query`` (characters).
        max_output: the cell output budget (characters).
        template: a replacement for :data:`SYSTEM` with the same fields.
    """
    return (template or SYSTEM).format(meta=format_meta(meta), sub_chars=f"{sub_chars:,}",
                                       max_output=f"{max_output:,}",
                                       rlm_line=RLM_LINE if can_recurse else "")


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
