"""Degenerate turns: a loop that only repeats itself ends early, with a reason.

A small model can fall into a loop that no feedback breaks: the same 1,024-token repetition
cut at the output cap turn after turn with no code run, or the same failing cell resent with
the same error. Each such turn costs a full model call (minutes on the embedded model) and
changes nothing, so running out the iteration budget only delays the same failure.

Two kinds of repeat are tracked, per loop (a root, a child, a session's question):

- **the same reply with no code run**: a reply that ran no cell (no ```repl block, or only
  one cut open at the output-token limit) and is identical or nearly identical
  (:func:`similar`) to the reply of the turn before, which ran no code either;
- **the same failing cells**: a turn whose cells are the same code as the turn before (blank
  lines and trailing spaces aside) and failed with the same error.

The second such turn in a row varies the request once: its feedback gains a note
(:func:`note`) that names the repetition and asks for something else, since the same request
tends to bring the same reply. The third in a row (:data:`LIMIT`) ends the loop as ``failed``
with a reason that says what repeated (:attr:`Repeats.stop`); the run's exit code is 7, as for
any run that ends without an answer. Only what the journal records decides (the reply's
text, whether it was cut, the cells' code and errors), so a replay or a resume repeats the
same decision.
"""
from __future__ import annotations

#: The turn at which the same repetition ends the loop (the first time counts as 1).
LIMIT = 3
#: How alike two replies must be (share of their word 3-grams) to count as the same.
SIMILAR = 0.9


def _shingles(text: str) -> set:
    words = text.split()
    return {tuple(words[i:i + 3]) for i in range(max(1, len(words) - 2))}


def similar(a: str, b: str) -> bool:
    """Whether replies ``a`` and ``b`` are the same but for a little (str, str -> bool): equal
    once whitespace is normalised, or sharing at least :data:`SIMILAR` of their word 3-grams
    (a repetition cut at the cap at another point is still the same reply)."""
    if " ".join(a.split()) == " ".join(b.split()):
        return True
    sa, sb = _shingles(a), _shingles(b)
    return bool(sa and sb) and len(sa & sb) / len(sa | sb) >= SIMILAR


def _code(code: str) -> str:
    return "\n".join(line.rstrip() for line in code.strip().splitlines() if line.strip())


class Repeats:
    """What one loop's last turns repeated: fed each turn's cells (:meth:`cell`) and its end
    (:meth:`turn`). ``stop`` is None until the loop must end, then the reason (str)."""

    def __init__(self) -> None:
        self.stop: str | None = None
        self.kind: str | None = None   # "reply" or "cells": the repetition being counted
        self.key: object = None        # its reply text or its cells
        self.streak = 0
        self.cells: list[tuple[str, str | None]] = []

    def cell(self, code: str, error: str | None) -> None:
        """One cell of the current turn ran: its code and its error (None if none)."""
        self.cells.append((_code(code), error))

    def turn(self, reply: str, cut: bool) -> str | None:
        """The current turn ended with ``reply`` (cut at the output-token limit or not).

        Returns:
            None, or a note to add to the turn's feedback (the second time in a row). The
            :data:`LIMIT`-th time in a row it sets :attr:`stop` (and returns None).
        """
        cells, self.cells = self.cells, []
        if not cells:
            kind, key = "reply", reply
            same = self.kind == kind and similar(reply, self.key)
        elif any(error for _, error in cells):
            kind, key = "cells", tuple(cells)
            same = self.kind == kind and key == self.key
        else:  # code ran and did something: not a repetition
            kind, key, same = None, None, False
        self.streak = self.streak + 1 if same else (1 if kind else 0)
        self.kind, self.key = kind, key
        if self.streak >= LIMIT:
            self.stop = self.reason(cut)
            return None
        return note(kind) if self.streak == LIMIT - 1 else None

    def reason(self, cut: bool) -> str:
        """Why the loop ended (the run's ``reason``)."""
        if self.kind == "reply":
            how = " (cut at the output-token limit)" if cut else ""
            return (f"the model sent the same reply {self.streak} times in a row{how} with no "
                    "code run; the loop ended early instead of spending its remaining turns")
        error = next(e for _, e in reversed(self.key) if e)
        return (f"the model sent the same failing code {self.streak} times in a row "
                f"({error}); the loop ended early instead of spending its remaining turns")


def note(kind: str | None) -> str:
    """The note that varies the request after the second identical turn in a row."""
    if kind == "reply":
        return ("[You sent the same reply as in your last turn, and no code ran. Do something "
                "else now: one short ```repl block, closed with ```. The same reply a third "
                "time ends the work without an answer.]")
    return ("[This is the same code as in your last turn, and it failed the same way. Running "
            "it again will not help: change the code to avoid the error. The same failing "
            "code a third time ends the work without an answer.]")
