"""Prompts: the system prompt that teaches the REPL and the answer protocol.

The system prompt shows only metadata about the context (its type, size and
item lengths), never the context itself.

Small models (the embedded 0.5B) copy a worked example almost token for token
and change little more than the question and the search words, so the ``small``
profile carries two complete, correct programs and the model picks the one that
fits the question: first a lookup in a long text (the rare words of the question,
the place where they meet, a sub-call about a window around it, a reply kept only
when it answers), then a count with ``re`` (how many times, most common), which code
answers exactly. The programs, and why each line is there, are in
:mod:`rlm.prompting.programs`; sizes are inline literals, never variables the model
might replace, and a list or dict context is joined into one string first (the
``to_text`` line).

That prompt is the ``small`` profile; ``small-count`` (:data:`SYSTEM_SMALL_COUNT`), an
earlier layout with counting first, is kept for comparison. The ``general`` profile
(:data:`SYSTEM_GENERAL`) is for capable hosted models: it describes the tools and a way of working (look at ``context``, search
it with code, split it and map a question over the pieces with batched sub-calls, combine the
pieces' answers in code, hand big sub-problems to ``rlm(...)``, check before ``FINAL``) instead
of giving one program to copy. :data:`PROFILES` names them; ``--prompt`` picks one (or a
template file), and ``rlm eval`` measures them side by side. A loop without sub-calls
(max_depth=0) gets each profile's variant in :data:`PROFILES_NO_SUBCALLS`, which offers no
``llm_query`` or ``rlm``: its lookup prints the best windows for the model to read.
"""
from __future__ import annotations

import json
import string

from rlm.prompting import programs
# re-exported: the compaction texts live in a module of their own
from rlm.prompting.compact_prompts import (COMPACT_SYSTEM, compact_request,  # noqa: F401
                                            compacted_task)

_SMALL_HEAD = """You answer questions about a long text that you cannot see directly. \
The text is stored in the variable `context` inside a Python REPL (a Jupyter kernel). \
The REPL keeps its variables between your turns. You work by writing Python code; \
I run it and show you what it prints.

Functions you can call in your code:
- `llm_query(prompt)` asks another language model and returns its answer as a string. \
It reads at most about {sub_chars} characters, so give it a small piece of `context` \
together with the question, never the whole `context`.
- `llm_query_batched(prompts)` does the same for a list of prompts at once and returns a list of answers.
{rlm_line}{tools_line}- `FINAL(answer)` gives your final answer and ends the work. `FINAL_VAR("name")` gives \
the value of the variable `name` as the final answer.
- `print(...)` shows you results. Long output is cut to {max_output} characters, so print short pieces.
{kernel_line}
"""

#: The rules of the ``small`` profile: which worked program fits which question. The lookup
#: comes first and the counting program second: the 0.5B copies the first program that looks
#: like the question, and with counting first it wrote short code of its own for lookups
#: (docs/benchmarking-depth.md). The map over items is a sentence, not a third program: as a
#: program it was spliced into the lookup.
_SMALL_RULES = r"""Rules:
1. Put code in a block that starts with ```repl and ends with ```. I run every such block.
2. Never print all of `context`, and never assign to `context`.
3. Use the example below that fits the question, changed to the question you were asked:
   - one fact (a name, a number, a date, a code): search for the rare words of the question with Python, then ask about a small window around the best match (Example 1).
   - "how many times", "how often", "most common", "list all": count with Python: `re`, `collections.Counter`, `str.count` (Example 2). Python counts exactly; another model does not. When every item must be read to decide (which items are about X), ask `llm_query_batched` about groups of items and count their replies in Python.
4. When you know the answer, call FINAL(answer) inside a ```repl block. Writing FINAL in plain text does nothing.

Example 1. Question: "What colour is the door of the old lighthouse?"
"""

#: The lookup program (Example 1), shared with :data:`SYSTEM_SMALL_COUNT` (see
#: :mod:`rlm.prompting.programs`).
_LOOKUP = programs.LOOKUP

#: The counting program (Example 2), its hint and the metadata (:mod:`rlm.prompting.programs`).
_SMALL_COUNT_EXAMPLE = programs.COUNT_EXAMPLE

#: The ``small`` profile: the lookup (Example 1) and counting with code (Example 2); the model
#: picks one by the question. Measured on the embedded 0.5B at 36k tokens, depth 1, n = 5
#: (docs/benchmarking-depth.md): word counts 5 of 5, ``cwe`` 5 of 5, ``fwe`` 4 of 5,
#: ``niah_single_2`` 4 of 5 (the lookup alone: 0, 0, 0 and 5 of 5).
SYSTEM = _SMALL_HEAD + _SMALL_RULES + _LOOKUP + _SMALL_COUNT_EXAMPLE

#: The ``small`` profile's name for :data:`SYSTEM`.
SYSTEM_SMALL = SYSTEM

SYSTEM_GENERAL = """You are working on a task whose input is too large to read at once. \
It is stored in the variable `context` inside a persistent Python REPL (a Jupyter kernel); \
you see it only through the code you write. Each turn, write Python in ```repl blocks; I run \
every block and show you what it prints. Variables persist between turns.

About `context`: {meta}

Available in the REPL:
- `llm_query(prompt)`: a plain completion by another language model; returns a string. It \
reads about {sub_chars} characters at most, so pass it one piece of `context` plus a precise \
question, never the whole input.
- `llm_query_batched(prompts)`: many such completions at once (they run concurrently); returns \
a list of strings in the same order. Prefer it to a loop of `llm_query` calls.
{rlm_line}{tools_line}- `FINAL(answer)`: submit the final answer and stop. `FINAL_VAR("name")` submits the \
value of a variable.
- `print(...)`: output longer than {max_output} characters is cut, so print summaries, \
counts and short slices. What you `display(...)` reaches you as text (Markdown, tables); \
images do not.
{kernel_line}
How to work:
1. Look before you plan: print the type and length of `context`, a short slice of its start, \
and for a list or dict a few items, so you know its structure.
2. When the answer sits in a few places, find them with code (`re`, `str.find`, counting \
keywords) and read only small windows around the hits.
3. When the task needs every part of the input (counting, classifying, collecting, \
comparing), split `context` into pieces well under the sub-call limit, ask the same precise \
question of every piece with `llm_query_batched`, and combine the replies in Python (sum, \
merge, deduplicate, sort). Ask for short, structured replies (a number, a list, JSON) that \
your code can parse.
4. A piece that is itself a hard problem can go to `rlm(...)` when it is available.
5. Keep intermediate results in variables, check them (print counts, spot-check a few \
items against `context`) and fix mistakes before you answer.
6. When you are done, call `FINAL(answer)` inside a ```repl block with the answer only, in \
the form the question asks for. Writing FINAL in plain text does nothing.
Never print all of `context` and never assign to `context`."""

_COUNT_RULES = r"""Rules:
1. Put code in a block that starts with ```repl and ends with ```. I run every such block.
2. Never print all of `context`, and never assign to `context`.
3. Pick the example below that fits the question, and change it to the question you were asked:
   - "how many times", "how often", "most common", "most frequent", "list all": count with Python (Example A). Python counts exactly; another model does not.
{map_rule}   - one fact (a name, a number, a date, a code): search for the rare words of the question and {lookup_rule} (Example {lookup_letter}).
4. When you know the answer, call FINAL(answer) inside a ```repl block. Writing FINAL in plain text does nothing.

Example A. Question: "How many times does the word "harbour" appear in the text? Count whole words, ignoring case." (and: "What are the 3 most common words?")
```repl
import re
from collections import Counter
{{to_text}}
count = len(re.findall(r"(?<!\w)" + re.escape("harbour") + r"(?!\w)", text, re.IGNORECASE))
print(count)
top = Counter(re.findall(r"[A-Za-z]+", text)).most_common(3)
print(top)
FINAL(count)
```
For "most common" questions, FINAL the words: `FINAL(", ".join(w for w, n in top))`. "Exactly as written" or "case-sensitive" means: leave out `re.IGNORECASE`.

{map_example}Example {lookup_letter}. Question: "What colour is the door of the old lighthouse?"
"""

_COUNT_MAP_RULE = "   - a question about each item of a list that needs reading (which items are about X): ask `llm_query_batched` about groups of items, then count their replies in Python (Example B).\n"

_COUNT_MAP_EXAMPLE = r"""Example B. Question: "How many of these items are about ships?" (`context` is a list of items like "q0001: ...")
```repl
import re
items = context if isinstance(context, list) else list(context.values()) if isinstance(context, dict) else str(context).split("\n")
groups = [items[i:i + 30] for i in range(0, len(items), 30)]
prompts = ["Items:\n" + "\n".join(str(x) for x in g) + "\n\nWhich of these items are about ships? Reply with their ids only, separated by commas, or NONE." for g in groups]
replies = llm_query_batched(prompts)
ids = set()
for reply in replies:
    ids.update(re.findall(r"q\d+", reply))
print(len(ids), sorted(ids)[:10])
FINAL(len(ids))
```

"""

_COUNT_TAIL = r"""In your code, use the question you were asked and its own words, not the words of these examples.

About `context`: {meta}
"""


def _small_count(head: str, lookup: str, with_map: bool) -> str:
    """The ``small-count`` text from its parts: with the map over items (Example B) when
    sub-calls exist, without it (and the lookup as Example B) when they do not."""
    rules = _COUNT_RULES.format(
        map_rule=_COUNT_MAP_RULE if with_map else "",
        lookup_rule=("ask about a small window around the best match" if with_map
                     else "print small windows around the best matches to read them"),
        lookup_letter="C" if with_map else "B",
        map_example=_COUNT_MAP_EXAMPLE if with_map else "")
    return head + rules + lookup + _COUNT_TAIL


#: The ``small-count`` profile: for exact questions (how many times, how often, most common,
#: list all) on small models. Three worked programs the model chooses among: counting with
#: ``re`` and ``collections.Counter`` (A), a map with ``llm_query_batched`` over groups of items
#: reduced in code (B), and the lookup of :data:`SYSTEM` (C); the context's metadata comes last,
#: so the fixed part is a prefix llama.cpp's prompt cache reuses across runs. Measured on the
#: embedded 0.5B at 36k tokens, depth 1, n = 5 (docs/benchmarking-depth.md): word counts 5 of 5
#: (the earlier ``small``, the lookup alone: 0 of 5), lookups 0 of 5 (it: 5 of 5). The 0.5B
#: copies the first program that looks like the question and does not choose well between
#: three, so this layout lost to :data:`SYSTEM` (lookup first, counting second, no third
#: program). Kept to reproduce that comparison.
SYSTEM_SMALL_COUNT = _small_count(_SMALL_HEAD, _LOOKUP, with_map=True)

# Loops without sub-calls (max_depth=0, rlm eval's depth 0 "Python only") refuse llm_query,
# llm_query_batched and rlm, so their prompts must not offer them: a small model that copies
# a worked llm_query call repeats the refused cell until the iteration cap. Each profile's
# variant is its own text with the sub-call lines and steps swapped out (:func:`_swap`), so the
# two cannot drift apart.

#: What a loop without sub-calls reads in place of the sub-call functions' lines.
NO_SUBCALLS_LINE = ("- There are no sub-calls in this run (max_depth=0): `llm_query`, "
                    "`llm_query_batched` and `rlm` are switched off. Your code does the work; "
                    "read what it prints and work out the answer yourself.\n")


def _swap(text: str, start: str, end: str | None, new: str) -> str:
    """``text`` with the span from ``start`` through ``end`` (or ``start`` alone) replaced by
    ``new``. Raises RuntimeError if the span is not there (a profile edit must update this)."""
    i = text.find(start)
    j = i + len(start) if end is None else text.find(end, i) + len(end)
    if i < 0 or (end is not None and j < len(end)):
        raise RuntimeError(f"prompt text to swap not found: {start[:40]!r}")
    return text[:i] + new + text[j:]


_LOOKUP_NO_SUBCALLS = programs.LOOKUP_NO_SUBCALLS
_SMALL_HEAD_NO_SUBCALLS = _swap(_SMALL_HEAD, "- `llm_query(prompt)` asks", "list of answers.\n",
                                NO_SUBCALLS_LINE)

#: :data:`SYSTEM` for a loop without sub-calls: the lookup prints its best windows for the
#: model to read instead of asking ``llm_query`` about them; counting is unchanged (it needs no
#: sub-call), and the map over items, which does, is left out.
SYSTEM_NO_SUBCALLS = _swap(_swap(_swap(
    SYSTEM, "- `llm_query(prompt)` asks", "list of answers.\n", NO_SUBCALLS_LINE),
    "then ask about a small window around the best match", None,
    "then print small windows around the best matches and read them"),
    " When every item must be read to decide", "count their replies in Python.", "").replace(
    _LOOKUP, _LOOKUP_NO_SUBCALLS, 1)

#: :data:`SYSTEM_SMALL_COUNT` for a loop without sub-calls: counting (A) and the printing
#: lookup (B); no map over items.
SYSTEM_SMALL_COUNT_NO_SUBCALLS = _small_count(_SMALL_HEAD_NO_SUBCALLS, _LOOKUP_NO_SUBCALLS,
                                              with_map=False)

#: :data:`SYSTEM_GENERAL` for a loop without sub-calls: whole-input work is done in code.
SYSTEM_GENERAL_NO_SUBCALLS = _swap(_swap(_swap(
    SYSTEM_GENERAL, "- `llm_query(prompt)`: a plain completion", "a loop of `llm_query` calls.\n",
    NO_SUBCALLS_LINE),
    "split `context` into pieces well under the sub-call limit", "that your code can parse.",
    "do it in code over the whole of `context` (`re`, `collections.Counter`, parsing, sorting) "
    "and print only counts and short samples."),
    "4. A piece that is itself a hard problem can go to `rlm(...)` when it is available.", None,
    "4. What code cannot decide, read yourself: print it a few hundred characters at a time.")

FIRST_USER_GENERAL = """Task: {query}

Start with a ```repl block that looks at `context`. Do not answer from memory."""

#: The prompt profiles ``--prompt`` names: profile -> (system template, first user message).
PROFILES = {
    "small": (SYSTEM_SMALL, None),
    "small-count": (SYSTEM_SMALL_COUNT, None),
    "general": (SYSTEM_GENERAL, FIRST_USER_GENERAL),
}

#: Each profile's system template for a loop without sub-calls (max_depth=0).
PROFILES_NO_SUBCALLS = {
    "small": SYSTEM_NO_SUBCALLS,
    "small-count": SYSTEM_SMALL_COUNT_NO_SUBCALLS,
    "general": SYSTEM_GENERAL_NO_SUBCALLS,
}

#: The example's line that makes one searchable string of ``context``, by context type.
TO_TEXT = {
    "str": "text = context",
    "list": 'text = "\\n\\n".join(str(item) for item in context)',
    "dict": 'text = "\\n\\n".join(str(key) + ": " + str(value) for key, value in context.items())',
}
TO_TEXT_OTHER = "text = str(context)"

#: What the kernel supports beyond plain code (both profiles): its event loop, threads,
#: processes. ``{kernel_line}`` in a template; empty in a template without it.
KERNEL_LINE = ("- The REPL is a Jupyter kernel: top-level `await` works, and so does "
               "`asyncio.run(main())`. The functions above also work from threads "
               "(`concurrent.futures.ThreadPoolExecutor`) and process pools "
               "(`multiprocessing.Pool`), but `llm_query_batched` is the simplest way to ask "
               "many questions at once.\n")
#: :data:`KERNEL_LINE` for a loop without sub-calls (no functions to call from threads).
KERNEL_LINE_NO_SUBCALLS = ("- The REPL is a Jupyter kernel: top-level `await` works, and so "
                           "does `asyncio.run(main())`.\n")

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


def tools_line(tools: list[dict] | None) -> str:
    """What the system prompt says of the user's tools (``{tools_line}``; "" without any):
    each one's name, signature and the first paragraph of its docstring, then how to batch.

    Args:
        tools: ``{"name", "signature", "summary"}`` per tool (:func:`rlm.tools.prompt_tools`).
    """
    if not tools:
        return ""
    rows = ["- Tools: functions that run outside the REPL, on the host. Call them like any "
            "function; their arguments and results are JSON values (str, numbers, bool, None, "
            "lists, dicts with str keys):"]
    rows += [f"  - `{t['name']}{t['signature']}`" + (f": {t['summary']}" if t["summary"] else "")
             for t in tools]
    first = tools[0]["name"]
    rows.append(f"  For many calls at once, `tools.map(\"{first}\", [args1, args2, ...])` runs "
                "them concurrently and returns their results in the same order (each item a "
                "tuple of arguments, a dict of keyword arguments, or one value). "
                f"`help({first})` shows a tool's whole docstring; a failed call raises "
                "`ToolError`.")
    return "\n".join(rows) + "\n"


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
                  max_output: int = 4000, template: str | None = None,
                  profile: str = "small", tools: list[dict] | None = None) -> str:
    """The system prompt for one RLM loop.

    Args:
        meta: :func:`rlm.context.load.describe` output.
        can_recurse: whether the loop has sub-calls (max_depth >= 1): ``llm_query``,
            ``llm_query_batched`` and ``rlm(...)``. Without them the profile's variant in
            :data:`PROFILES_NO_SUBCALLS` is used (a template file gets a closing note), so the
            model is never offered a function that is refused.
        sub_chars: a safe prompt size for ``llm_query`` (characters).
        max_output: the cell output budget (characters).
        template: a replacement for the profile's template with the same fields (``meta``,
            ``sub_chars``, ``max_output``, ``rlm_line``, ``kernel_line``, ``to_text``; any may
            be left out).
        profile: a key of :data:`PROFILES` (``"small"``, ``"small-count"``, ``"general"``); an
            unknown name
            (e.g. a template file's path, already read into ``template``) means ``small``.
        tools: the user's tools at this loop's level (:func:`tools_line`); a template without
            ``{tools_line}`` gets their lines at its end.
    """
    table = {k: v[0] for k, v in PROFILES.items()} if can_recurse else PROFILES_NO_SUBCALLS
    base = table.get(profile, table["small"])
    text = tools_line(tools)
    out = (template or base).format(meta=format_meta(meta), sub_chars=f"{sub_chars:,}",
                                      max_output=f"{max_output:,}",
                                      rlm_line=RLM_LINE if can_recurse else "",
                                      kernel_line=KERNEL_LINE if can_recurse
                                      else KERNEL_LINE_NO_SUBCALLS, tools_line=text,
                                      to_text=TO_TEXT.get(meta["type"], TO_TEXT_OTHER))
    if text and template and "{tools_line}" not in template:
        out += "\n\n" + text.rstrip("\n")  # the model must hear of the tools somewhere
    if template and not can_recurse:  # a user's text may offer llm_query: say it is off
        out += "\n\n" + NO_SUBCALLS_LINE[2:].rstrip("\n")
    return out


#: The fields a system prompt template may use (``{meta}`` ...; ``{{``/``}}`` for braces).
TEMPLATE_FIELDS = ("meta", "sub_chars", "max_output", "rlm_line", "kernel_line", "tools_line",
                   "to_text")


def check_template(template: str) -> str | None:
    """None if ``template`` formats with :data:`TEMPLATE_FIELDS`, each a plain ``{name}``,
    else what is wrong (str)."""
    if not template.strip():
        return "the template is empty"
    plain = ", ".join("{" + f + "}" for f in TEMPLATE_FIELDS)
    try:
        fields = [f for f in string.Formatter().parse(template) if f[1] is not None]
    except ValueError as exc:
        return (f"the template is not a valid format string ({exc}); write {{{{ and }}}} for "
                "literal braces")
    for _, name, spec, conversion in fields:
        if name not in TEMPLATE_FIELDS and not (spec or conversion) and name.isidentifier():
            return (f"the template names the unknown field {{{name}}}; the fields are {plain} "
                    "(write {{ and }} for literal braces)")
        # a field is filled with text its author does not see (the metadata, the tools): a
        # format spec, a conversion or an index on it can fail, or blow up, at run time
        if name not in TEMPLATE_FIELDS or spec or conversion:
            shown = "{" + name + (f"!{conversion}" if conversion else "") + \
                (f":{spec}" if spec else "") + "}"
            return (f"the template's field {shown} is not a plain field name; the fields are "
                    f"{plain} (write {{{{ and }}}} for literal braces)")
    return None


def first_user(query: str | None, profile: str = "small") -> str:
    """The first user message: the question (worded for ``profile``), or, without one, the
    instruction to find the task at the start of ``context``."""
    if not query:
        return FIRST_USER_NO_QUERY
    return (PROFILES.get(profile, PROFILES["small"])[1] or FIRST_USER).format(query=query)


def next_question(number: int, query: str | None, added: list, answer: str | None) -> str:
    """The user message that opens question ``number`` (>= 2) of a session, after the
    conversation so far: the last answer, the contexts added since (``added``: ``(index,
    describe() metadata)`` pairs), that the kernel and its variables are still there, then the
    question (or, without one, where to find the task)."""
    said = (answer if len(answer or "") <= 500 else answer[:500] + " ...") if answer else None
    lines = [f"Question {number - 1} is over" + (f"; your answer was: {said}" if said else
                                                   " without an answer") + ".",
             f"A new question (number {number}) begins. The kernel is the same: `context` and "
             "every variable you made are still there (SHOW_VARS() lists them)."]
    lines += context_lines(added)
    lines.append(f"Question: {query}" if query else
                 "The new task is at the start of the newest context.")
    return "\n".join(lines)


def context_lines(added: list) -> list[str]:
    """One line per context a session added (``(index, describe() metadata)`` pairs)."""
    return [f"New context: `context_{i}` (also `contexts[{i}]`; `contexts` lists them all); "
            + format_meta(meta) for i, meta in added]


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


# compaction (rlm.core.compaction): the summary call and its message are in
# rlm.prompting.compact_prompts (imported above)


def transcript_text(messages: list, limit: int | None = None) -> str:
    """``messages`` as one text, each headed by its role; each content cut to ``limit``
    characters (head and tail kept) when given."""
    return "\n\n".join(f"[{m.get('role')}]\n"
                       + (truncate(str(m.get("content") or ""), limit) if limit
                          else str(m.get("content") or "")) for m in messages)
