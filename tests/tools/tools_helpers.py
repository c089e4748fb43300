"""Host tools the tool tests give their runs, importable as ``tools_helpers:NAME`` (the tests put
this directory on ``PYTHONPATH`` for CLI runs). Each call appends one line to the file named by
``$TOOLS_TEST_COUNT`` (when set), so a test counts how often a tool really ran."""
from __future__ import annotations

import os
import sqlite3
import time

import rlm


def _count(line: str) -> int:
    """Append ``line`` to the count file; returns how many lines it held before."""
    path = os.environ.get("TOOLS_TEST_COUNT")
    if not path:
        return 0
    before = len(open(path).read().splitlines()) if os.path.exists(path) else 0
    with open(path, "a") as f:
        f.write(line + "\n")
    return before


def lookup(name: str) -> dict:
    """Look a person up in the staff database; returns their row as a dict.

    The database is the SQLite file named by $TOOLS_TEST_DB."""
    _count(f"lookup {name}")
    with sqlite3.connect(os.environ["TOOLS_TEST_DB"]) as con:
        row = con.execute("SELECT name, team, room FROM staff WHERE name = ?", (name,)).fetchone()
    if row is None:
        raise KeyError(f"no staff member named {name!r}")
    return {"name": row[0], "team": row[1], "room": row[2]}


def make_db(path: str) -> None:
    """The staff database :func:`lookup` reads."""
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE staff (name TEXT PRIMARY KEY, team TEXT, room INTEGER)")
        con.executemany("INSERT INTO staff VALUES (?, ?, ?)", [
            ("alice", "search", 101), ("bob", "infra", 102), ("carol", "search", 103),
            ("dave", "billing", 201), ("erin", "infra", 202), ("frank", "billing", 203)])


def send_mail(to: str) -> str:
    """Send one mail (a side effect: not idempotent). The first call hangs for a minute."""
    if _count(f"send_mail {to}") == 0:
        time.sleep(60)
    return f"sent to {to}"


@rlm.tool(idempotent=True, name="fetch_page")
def fetch_page(url: str) -> str:
    """Fetch one page (read-only: safe to call again). The first call hangs for a minute."""
    if _count(f"fetch_page {url}") == 0:
        time.sleep(60)
    return f"page of {url}"


def greet(name: str, punct: str = "!") -> str:
    """Greet one person by name."""
    _count(f"greet {name}")
    return f"hello {name}{punct}"


def echo_kw(**fields) -> dict:
    """Give back the named fields it was passed."""
    _count("echo_kw")
    return fields


@rlm.tool(private_args=True)
def tagged(text: str, _tag: str = "none") -> str:
    """Tag a text (its `_tag` keyword may be passed)."""
    return f"{_tag}:{text}"


def sized(n: int) -> str:
    """A text of ``n`` characters."""
    _count(f"sized {n}")
    return "x" * n
