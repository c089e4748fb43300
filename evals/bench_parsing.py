"""How long the host takes to take a model reply apart, against the reply's size.

Every parse of model text (reasoning sections, fences, ``FINAL`` in prose, think tags) must be
linear in the reply's length: a reply is untrusted input, and a quadratic pattern on a 200,000-
character line once held a run at 100% CPU far past its wall cap. This script builds replies of
each shape at sizes from 1k to 10M characters, times ``rlm.prompting.parsing.parse_reply`` (what
the loop runs on every root reply) and ``split_reasoning`` (what the model clients run on every
reply, sub-calls included), and prints the time and the time per million characters. A linear
parser keeps the last column about flat as the size grows; a quadratic one multiplies it by ten
per row.

Usage::

    .venv/bin/python evals/bench_parsing.py            # 1k .. 10M characters
    .venv/bin/python evals/bench_parsing.py --max 1e6  # stop at 1M

Prints one table per shape: size (characters), seconds for parse_reply, seconds for
split_reasoning, microseconds per 1,000 characters (the larger of the two), and the growth of
that figure from the smallest size (``x1.0`` is linear).
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

from rlm.prompting.parsing import parse_reply, split_reasoning


def _repeat(unit: str, size: int) -> str:
    return (unit * (size // len(unit) + 1))[:size]


def _one_line(size: int) -> str:
    return _repeat("word ", size)


def _many_lines(size: int) -> str:
    return _repeat("a line of prose about the context, nothing more.\n", size)


def _inline_fences(size: int) -> str:
    # prose with backtick runs, never a valid inline opener: the worst case of that pattern
    return _repeat("text `` more ``` x ", size)


def _nested_unclosed(size: int) -> str:
    head = "Here is the plan:\n````repl\n```python\nx = 1\n"
    return head + _repeat("print('''```\n", size - len(head))


def _open_strings_in_blocks(size: int) -> str:
    # each block's closing line sits in a string it opened: a search for its real end each
    return _repeat("```python\ns = \'\'\'\n```\n", size)


def _many_fences(size: int) -> str:
    return _repeat("```repl\nprint(1)\n```\nok\n", size)


def _unclosed_openers(size: int) -> str:
    return _repeat("```repl\n", size)


def _many_think(size: int) -> str:
    return _repeat("<think>hm</think>said ", size)


def _unclosed_think(size: int) -> str:
    return _repeat("<think a ", size)


def _final_prose(size: int) -> str:
    return _repeat("FINAL      FINAL_VAR   ", size)


def _one_line_sub_reply(size: int) -> str:
    return "The answer is " + _repeat("x", size - 14)


SHAPES: dict[str, Callable[[int], str]] = {
    "one line": _one_line,
    "many lines": _many_lines,
    "backtick runs in prose": _inline_fences,
    "nested, unclosed fences": _nested_unclosed,
    "fences held in open strings": _open_strings_in_blocks,
    "many closed fences": _many_fences,
    "unclosed openers": _unclosed_openers,
    "many think tags": _many_think,
    "unclosed think attributes": _unclosed_think,
    "FINAL words in prose": _final_prose,
    "one-line sub-call reply": _one_line_sub_reply,
}


def _time(fn: Callable[[str], object], text: str) -> float:
    t0 = time.perf_counter()
    fn(text)
    return time.perf_counter() - t0


def _sizes(largest: int) -> list[int]:
    out, n = [], 1000
    while n <= largest:
        out.append(n)
        n *= 10
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the parse times; returns 0. ``--max`` bounds the largest reply (characters)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max", type=float, default=1e7, help="largest reply, in characters")
    args = ap.parse_args(argv)
    worst = 1.0
    for name, make in SHAPES.items():
        print(f"\n{name}")
        print(f"{'chars':>10} {'parse_reply s':>14} {'split_reasoning s':>18} "
              f"{'us/1k chars':>12} {'growth':>7}")
        base = None
        for size in _sizes(int(args.max)):
            text = make(size)
            tp = _time(lambda t: parse_reply(t), text)
            ts = _time(split_reasoning, text)
            per_k = max(tp, ts) / (size / 1000) * 1e6
            base = base or per_k
            growth = per_k / base
            if size >= 100_000:
                worst = max(worst, growth)
            print(f"{size:>10,} {tp:>14.4f} {ts:>18.4f} {per_k:>12.2f} {'x' + format(growth, '.1f'):>7}")
    print(f"\nworst growth of time per character from 1k up (1.0 is linear): x{worst:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
