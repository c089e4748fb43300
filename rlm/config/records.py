"""The journal as the public API and the CLI open it: by path, by ``$RLM_JOURNAL``, or not at all,
and the recorded pieces a resume or replay needs (the run record, its context)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness.errors import DivergenceError

from rlm.context.load import LoadedContext, load_context
from rlm.errors import ConfigError


def open_journal(spec: Any = None, must_exist: bool = False, reads_only: bool = False,
                 durability: str | None = None):
    """Open the journal ``spec`` names.

    Args:
        spec: a path (str | Path) or a ``postgresql://`` URL; ``None``/``True`` for the default
            (``$RLM_JOURNAL``, else ``~/.local/share/rlm/journal.sqlite3``); ``False`` for none;
            an open :class:`harness.journal.Journal`, returned as it is.
        must_exist: for commands that only read (``runs``, ``show``, ``verify``...): a journal
            file named by ``spec`` or ``$RLM_JOURNAL`` must exist (a typo would otherwise
            create an empty journal there and report it clean), and not be an empty file
            (it is refused, not given a schema); one this process may not write is opened
            read-only.
        reads_only: the caller only reads (``rlm view``, ``--watch``, ``--follow``): an
            existing journal this process may not write is opened read-only, and an empty file
            is refused (as with ``must_exist``).
        durability: ``"process"`` or ``"power"`` (see
            :func:`harness.journal.store.durability_level`); None: ``$RLM_JOURNAL_DURABILITY``,
            else ``"process"``.
    Returns:
        a :class:`harness.journal.Journal`, or None when ``spec`` is False.
    Raises:
        ConfigError: the journal cannot be opened or created (bad path, newer schema, ...); with
            ``must_exist``, no such file; with it or ``reads_only``, an empty file.
    """
    if spec is False:
        return None
    if spec is not None and not isinstance(spec, (str, os.PathLike, bool)) \
            and hasattr(spec, "create_run"):
        return spec  # an open Journal given by the caller, who closes it
    from harness.journal import Journal, JournalError
    named = spec if spec not in (None, True) else os.environ.get("RLM_JOURNAL") or None
    _check_scheme(named)
    if must_exist and named is not None and "://" not in str(named) \
            and not Path(named).expanduser().exists():
        raise ConfigError(f"no journal at {named}: check --journal (or RLM_JOURNAL); a run "
                          "creates it")
    kwargs: dict[str, Any] = {"durability": durability} if durability else {}
    if (must_exist or reads_only) and "://" not in str(named):
        from harness.journal import default_journal_path
        local = Path(named).expanduser() if named is not None else default_journal_path()
        if local.is_file() and local.stat().st_size == 0:
            # opening it would write a journal's schema into it: a command that only reads
            # leaves the file as it found it
            raise ConfigError(f"{local} is an empty file, not an rlm journal (it was left as "
                              "it is): check --journal (or RLM_JOURNAL); a run creates one")
        # a journal file this process may not write (another user's, a read-only mount) is
        # read through a read-only connection; only a command that writes (resume) then fails
        if local.is_file() and not _writable(local):
            kwargs["read_only"] = True
    try:
        return Journal(spec if spec not in (None, True) else None, **kwargs)
    except JournalError as exc:
        raise ConfigError(str(exc)) from None


def _check_scheme(named: Any) -> None:
    """A journal named as a URL must be a PostgreSQL one (``postgresql://`` or
    ``postgres://``); anything else with a scheme (``sqlite:///x``, ``mysql://``, a typo such
    as ``postgresq://``) would otherwise be taken as a relative file name.

    Raises:
        ConfigError: another scheme."""
    import re
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", str(named)) if named is not None else None
    if m and m.group(1) not in ("postgresql", "postgres"):  # as is_postgres_url reads it
        raise ConfigError(f"journal {m.group(0)}...: a journal is a SQLite file path or a "
                          "postgresql:// URL (for SQLite give the path itself, e.g. "
                          "--journal ./runs.sqlite3)")


def _writable(path: Path) -> bool:
    """Whether this process may write ``path`` and create files beside it (SQLite's -wal and
    -shm), as ``os.access`` sees it (a read-only mount included)."""
    return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK | os.X_OK)


def find_run(journal, run_id: str) -> dict:
    """The journal record of ``run_id`` (``Journal.get_run``).

    Raises:
        ConfigError: no such run in this journal.
    """
    rec = journal.get_run(run_id)
    if rec is None:
        raise ConfigError(f"no run {run_id!r} in journal {journal.path}; list runs with `rlm runs`")
    return rec


def recorded_chance(record: dict) -> dict:
    """The options that fix a recorded run's kernels' chance as it ran (``kernel_seed``: the
    hash seed, :mod:`random`, NumPy; see :mod:`kernels.chance`), for a resume of it: whatever
    is given now, a resumed run's cells must take the same path. ``{}`` for a run recorded
    before the seed was (its kernels ran with a random hash seed: nothing can repeat it)."""
    seed = (record.get("options") or {}).get("kernel_seed")
    return {"kernel_seed": seed} if isinstance(seed, int) and not isinstance(seed, bool) else {}


def stored_source(record: dict) -> Any:
    """Where a recorded run's context was loaded from: a Path, a list of Paths (a directory,
    glob or several paths), or None (a value or stdin)."""
    o = record.get("options") or {}
    spec = o.get("context_spec")
    if spec:
        return [Path(p) for p in spec["sources"]]
    return Path(o["context_source"]) if o.get("context_source") else None


def spec_options(record: dict) -> dict:
    """The keyword options of a recorded many-file context's filters (``include``,
    ``exclude``, ``max_context_bytes``), those it was given."""
    spec = (record.get("options") or {}).get("context_spec") or {}
    out = {"include": spec.get("include"), "exclude": spec.get("exclude"),
           "max_context_bytes": spec.get("max_bytes")}
    return {k: v for k, v in out.items() if v is not None}


def stored_context(record: dict, context: Any = None, encoding: str | None = None) -> LoadedContext:
    """Load a recorded run's context again, from ``context`` or from where it was recorded
    (with the filters a directory context was loaded with).

    Raises:
        ConfigError: it was given as a value or on stdin and no ``context`` is passed now.
        ContextError: it cannot be loaded.
        DivergenceError: its sha256 differs from the recorded one.
    """
    o = record.get("options") or {}
    if context is None:
        context = stored_source(record)
        if context is None:
            raise ConfigError(f"run {record['run_id']} was given its context as a value or on "
                              "stdin; pass it again with --context PATH")
    spec = o.get("context_spec") or {}
    ctx = load_context(context, encoding=encoding or o.get("context_encoding") or "utf-8",
                       include=spec.get("include"), exclude=spec.get("exclude"),
                       max_bytes=spec.get("max_bytes"))
    want = o.get("context_sha256")
    if want and ctx.sha256 != want:
        ctx.discard()
        raise DivergenceError(f"the context of run {record['run_id']} has changed since it was "
                              "recorded (sha256 differs); resume/replay need the same context")
    return ctx
