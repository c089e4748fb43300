"""A prompt profile bootstrapped from a sweep: worked examples taken from what solved tasks.

A small model copies a worked example almost verbatim, so the programs that solved the
training split's tasks are the examples to show it. :func:`choose_programs` picks them by
this rule (docs/training.md, "Profiles from the journal"):

1. candidates: the correct ``rlm`` trials the filters leave (the training split), each one's
   *program*: the code of its root loop's executed cells, in order;
2. per task, shortest first (characters), so the example a model copies does the least;
3. a program is skipped when it is too like one already chosen (word-set Jaccard similarity
   of :data:`SIMILAR` or more), so each example teaches something else;
4. up to ``examples`` programs, taken round-robin over the tasks (one per task first).

:func:`render_profile` writes them after the base profile's system template as a template
file, which ``--prompt FILE`` and ``rlm eval --prompt FILE`` take (the file format
``rlm.prompting.prompts.check_template`` checks; code braces are doubled).
"""
from __future__ import annotations

import re
from typing import Any

from rlm.errors import ConfigError
from rlm.training.sources import Source

__all__ = ["SIMILAR", "program_of", "choose_programs", "render_profile"]

#: Jaccard similarity of two programs' word sets at which the second is not taken.
SIMILAR = 0.8
_ROOT_CELL = re.compile(r"^run/iteration-(\d+)/cell-(\d+)$")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+|\S")


def program_of(journal: Any, run_id: str) -> str:
    """The code of a run's root loop's executed cells, in program order, joined by blank
    lines ('' when it ran none). A cell re-executed by a resume counts once."""
    cells: dict[tuple[int, int], str] = {}
    for cell in journal.cells(run_id):
        m = _ROOT_CELL.match(cell.get("stage_id") or "")
        if m:
            cells[(int(m[1]), int(m[2]))] = str(cell.get("code") or "").strip()
    return "\n\n".join(code for _, code in sorted(cells.items()) if code)


def _similarity(a: str, b: str) -> float:
    wa, wb = set(_WORD.findall(a)), set(_WORD.findall(b))
    return len(wa & wb) / len(wa | wb) if wa | wb else 1.0


def choose_programs(journal: Any, sources: list[Source], examples: int = 2) -> list[dict]:
    """The worked examples (the module doc's rule), in the order they will be shown.

    Args:
        journal: the sweep's open journal; sources: its trials (with their records) to take
            from, already filtered to the training split and to correct trials.
        examples: how many programs at most (1..10).
    Returns:
        dicts ``{"task", "query", "program", "run_id", "key"}``.
    Raises:
        ConfigError: ``examples`` out of range, or no correct ``rlm`` trial with code.
    """
    if not 1 <= examples <= 10:
        raise ConfigError(f"--examples must be 1 to 10, got {examples}")
    by_task: dict[str, list[dict]] = {}
    for src in sources:
        trial = src.trial or {}
        if trial.get("method") != "rlm" or trial.get("correct") is not True:
            continue
        program = program_of(journal, src.run_id)
        if program:
            run = journal.get_run(src.run_id) or {}
            by_task.setdefault(str(trial.get("task")), []).append(
                {"task": trial.get("task"), "query": run.get("query") or "", "program": program,
                 "run_id": src.run_id, "key": trial.get("key")})
    if not by_task:
        raise ConfigError("no correct rlm trial with code among the trials chosen: a profile "
                          "needs programs that solved tasks; nothing was written")
    queues = {t: sorted(c, key=lambda c: (len(c["program"]), c["key"] or ""))
              for t, c in sorted(by_task.items())}
    chosen: list[dict] = []
    while len(chosen) < examples and any(queues.values()):
        for task in list(queues):
            while queues[task]:
                cand = queues[task].pop(0)
                if all(_similarity(cand["program"], c["program"]) < SIMILAR for c in chosen):
                    chosen.append(cand)
                    break
            if len(chosen) == examples:
                break
    return chosen


_INTRO = ("Worked examples: programs that answered earlier questions of this kind correctly. "
          "Each shows the question and the code of the whole run.")


def render_profile(base: str, chosen: list[dict], *, can_recurse: bool = True) -> str:
    """The template file text: the system template of profile ``base`` (``small``,
    ``small-count``, ``general``), then the worked examples.

    Raises:
        ConfigError: an unknown base profile, or a program that breaks the template.
    """
    from rlm.prompting import prompts
    table = {k: v[0] for k, v in prompts.PROFILES.items()} if can_recurse \
        else prompts.PROFILES_NO_SUBCALLS
    if base not in table:
        raise ConfigError(f"a profile is built on a built-in profile ({', '.join(table)}), "
                          f"not {base!r}")
    parts = [table[base].rstrip("\n"), "", _INTRO]
    for i, c in enumerate(chosen, 1):
        question = " ".join(str(c["query"]).split())
        code = c["program"].replace("{", "{{").replace("}", "}}")
        parts += ["", f"Example {i}. Question: {question.replace('{', '{{').replace('}', '}}')}",
                  "```repl", code, "```"]
    text = "\n".join(parts) + "\n"
    problem = prompts.check_template(text)
    if problem:
        raise ConfigError(f"the bootstrapped profile does not work as a template: {problem}")
    return text
