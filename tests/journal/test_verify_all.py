"""Last in the session (marked ``last``; ``conftest.py`` orders it): ``rlm verify --all`` over every journal the suite's runs wrote, on both
stores, reports a violation rate of 0.

Left out, by the test that wrote them: the storage unit tests (``test_journal``,
``test_journal_pg``: they record hand-made events, not runs), and the journals tests edit on
purpose to show that verify catches it (the tamper tests and the edited-journal replay test), or
to show that a journal of an older schema is refused (the chat export's bad-input test)."""
from __future__ import annotations

import pytest

import test_journal
import test_journal_pg
import test_verify

_EDITED = {"test_replay_sends_nothing_and_detects_an_edited_journal",
           "test_bad_input_is_a_clear_error_and_writes_nothing"} | {
    n for n in dir(test_verify) if n.startswith("test_") and n != "test_a_real_run_verifies_clean"}
_UNIT = {n for mod in (test_journal, test_journal_pg) for n in dir(mod) if n.startswith("test_")}
_SKIP = _EDITED | _UNIT


def _skipped(test_dir: str) -> bool:
    # pytest names a test's tmp_path after the test, cut to 30 characters, plus a number
    return any(test_dir.startswith(name[:30]) for name in _SKIP)


def _verify(spec: str) -> tuple[int, str]:
    """``rlm verify --all --journal SPEC``: the command's own code, in this process."""
    import contextlib
    import io

    from rlm.cli.main import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["verify", "--all", "--journal", spec])
    return code, out.getvalue()


@pytest.mark.last
def test_every_journal_the_suite_wrote_verifies(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    journals = [p for p in base.rglob("*.sqlite3")
                if p.relative_to(base).parts and not _skipped(p.relative_to(base).parts[0])]
    failures = []
    checked = 0
    for path in journals:
        code, out = _verify(str(path))
        checked += "0 of 0 runs" not in out
        if code != 0 or "violation rate: 0.0000" not in out:
            failures.append(f"{path}:\n{out}")
    checked += _verify_postgres(failures)
    assert not failures, "\n".join(failures)
    if not checked:
        pytest.skip("no journal with runs was written in this session")


def _verify_postgres(failures: list) -> int:
    """Every schema of the session's PostgreSQL server, if a test started it."""
    from conftest import _PG_SERVERS
    if not _PG_SERVERS:
        return 0
    url = _PG_SERVERS[0]
    import psycopg
    with psycopg.connect(url) as c:
        schemas = [r[0] for r in c.execute(
            "SELECT table_schema FROM information_schema.tables WHERE table_name = 'runs'")]
    checked = 0
    for schema in schemas:
        if _skipped(schema) or any(schema.startswith(n.lower()[:40]) for n in _SKIP):
            continue
        code, out = _verify(f"{url}?options=-csearch_path%3D{schema}")
        checked += "0 of 0 runs" not in out
        if code != 0 or "violation rate: 0.0000" not in out:
            failures.append(f"{schema}:\n{out}")
    return checked
