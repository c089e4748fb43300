"""``rlm export --format chat``: recorded runs -> one chat-format JSONL file.

:func:`export_chat` takes its sources (run ids of a journal, or a sweep directory), filters,
builds the examples (:mod:`rlm.training.chat`), drops repeats and writes them, one JSON object
per line, keys in a fixed order, so the same journal always gives a byte-identical file. The
file is written whole or not at all: to a temporary file beside it, then renamed; nothing is
written when no example passes the filters, and an existing file is kept unless ``overwrite``.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlm.errors import ConfigError
from rlm.training.chat import PER, dedupe, examples_of_run
from rlm.training.sources import (Filters, check_not_older, present_sources, run_sources,
                                  sweep_journal, sweep_sources)

__all__ = ["ChatExport", "export_chat", "key_redactor"]

log = logging.getLogger("rlm.training")


@dataclass
class ChatExport:
    """What :func:`export_chat` did: ``examples`` written, ``duplicates`` dropped, ``runs``
    they came from, the ``path`` written (None: written to the stream given)."""

    examples: int
    duplicates: int
    runs: int
    path: Path | None


def key_redactor() -> Any:
    """``text -> text`` with API keys and bearer tokens replaced by ``[redacted]``: the
    redaction ``rlm serve`` applies (:class:`rlm.serve.errors.Redactor`: the keys of
    ``OPENAI_API_KEY``, ``ANTHROPIC_API_KEY``, ``RLM_SERVE_API_KEY`` and anything key-like)."""
    from rlm.serve.errors import Redactor
    return Redactor().keys


def _check_output(output: Path | None, overwrite: bool) -> None:
    if output is None:
        return
    if output.is_dir():
        raise ConfigError(f"-o {output} is a directory: give a file name")
    if output.exists() and not overwrite:
        raise ConfigError(f"{output} exists; pass --overwrite to replace it, or give another "
                          "-o FILE (nothing was written)")
    if not output.parent.is_dir():
        raise ConfigError(f"the directory of -o {output} does not exist")


def _open_journal(spec: Any) -> Any:
    from rlm.config.records import open_journal
    check_not_older(spec if spec is not None else os.environ.get("RLM_JOURNAL") or
                    _default_journal())
    return open_journal(spec, must_exist=True)


def _default_journal() -> str:
    from harness.journal import default_journal_path
    return str(default_journal_path())


def export_chat(*, run_ids: list[str] | None = None, sweep: Path | None = None,
                journal: Any = None, filters: Filters | None = None, per: str = "call",
                levels: list[int] | None = None, kinds: list[str] | None = None,
                output: Path | None = None, overwrite: bool = False,
                stream: Any = None) -> ChatExport:
    """Write the chat examples of the chosen runs as JSON Lines.

    Args:
        run_ids: runs of ``journal`` to export; or ``sweep``: an ``rlm eval --out`` directory
            whose trials are exported (its journal unless ``journal`` names another).
        journal: a journal path or ``postgresql://`` URL (None: ``$RLM_JOURNAL`` or the
            default journal for run ids; the sweep's own for a sweep).
        filters: :class:`rlm.training.sources.Filters` (None: completed runs only).
        per, levels, kinds: see :func:`rlm.training.chat.examples_of_run`.
        output: the file to write (refused if it exists unless ``overwrite``); None writes to
            ``stream``.
    Returns:
        a :class:`ChatExport`.
    Raises:
        ConfigError: both or neither of ``run_ids``/``sweep``; a sweep directory or run id
            that does not exist; a journal of an older schema; filters that leave no run or
            no example; an existing ``output`` without ``overwrite``. Nothing is written then.
    """
    if bool(run_ids) == (sweep is not None):
        raise ConfigError("give run ids or --sweep DIR (one of the two) to export")
    if per not in PER:
        raise ConfigError(f"--per must be one of {', '.join(PER)}, got {per!r}")
    filters = filters or Filters()
    _check_output(output, overwrite)
    if sweep is not None:
        sources = sweep_sources(sweep, filters)
        journal = journal if journal is not None else sweep_journal(sweep)
        j = _open_journal(journal)
        sources = present_sources(j, sources, sweep)
    else:
        j = _open_journal(journal)
        sources = run_sources(j, list(run_ids or []), filters)
    from rlm.version import __version__
    redact = key_redactor()
    examples = [ex for src in sources
                for ex in examples_of_run(j, src, per=per, levels=levels, kinds=kinds,
                                          redact=redact, version=__version__)]
    kept, dropped = dedupe(examples)
    if not kept:
        what = [f"at level {' or '.join(map(str, levels))}" if levels else "",
                f"of kind {' or '.join(kinds)}" if kinds else ""]
        raise ConfigError(f"the {len(sources)} run(s) chosen hold no completed model call "
                          f"{' '.join(w for w in what if w) or 'with a reply'}"
                          f"{_what_there_is(j, sources) if levels or kinds else ''}; "
                          "nothing was written")
    text = "".join(json.dumps(ex, ensure_ascii=False, separators=(",", ":")) + "\n"
                   for ex in kept)
    if output is None:
        stream.write(text)
    else:
        _write_whole(output, text)
    return ChatExport(len(kept), dropped, len(sources), output)


def _what_there_is(journal: Any, sources: list) -> str:
    """`` (their calls: level 0 turn, level 1 llm_query)``: the levels and kinds the runs'
    completed calls have, for a filter that left none ('' when they have none at all)."""
    from rlm.training.chat import call_facts
    seen = sorted({(c["level"], c["kind"]) for src in sources
                   for c in call_facts(journal.stages(src.run_id),
                                       journal.model_calls(src.run_id))})
    return (" (their calls: " + ", ".join(f"level {lv} {kind}" for lv, kind in seen) + ")"
            if seen else "")


def _write_whole(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it (never half a file)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(fd, 0o666 & ~umask)  # as open() would create it, not mkstemp's 0600
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def export_profile(*, sweep: Path, journal: Any = None, filters: Filters | None = None,
                   examples: int = 2, base: str | None = None, output: Path,
                   overwrite: bool = False) -> tuple[Path, list[dict]]:
    """Write a prompt profile (a template file) whose worked examples are programs that
    solved the sweep's training split (:mod:`rlm.training.profile`).

    Args:
        sweep: an ``rlm eval --out`` directory; filters: which of its trials are the training
            split (``correct_only`` is implied); examples: how many programs; base: the
            built-in profile to extend (default: the one profile the chosen trials ran with).
        output: the template file (refused if it exists unless ``overwrite``).
    Returns:
        ``(output, the chosen programs)``.
    Raises:
        ConfigError: as :func:`export_chat`, no correct ``rlm`` trial with code, or the
            chosen trials ran with several profiles and no ``base`` is given.
    """
    from rlm.training.profile import choose_programs, render_profile
    filters = filters or Filters()
    filters.correct_only = True
    _check_output(output, overwrite)
    sources = sweep_sources(sweep, filters)
    j = _open_journal(journal if journal is not None else sweep_journal(sweep))
    sources = present_sources(j, sources, sweep)
    chosen = choose_programs(j, sources, examples)
    if len(chosen) < examples:
        log.warning("%d worked example(s) taken of the %d asked: the others were too like one "
                    "already taken, or there were no more correct programs", len(chosen),
                    examples)
    if base is None:
        used = sorted({str(s.trial.get("profile")) for s in sources
                       if s.trial and s.trial.get("method") == "rlm"})
        if len(used) != 1:
            raise ConfigError(f"the trials chosen ran with profiles {', '.join(used)}: pick "
                              "one with --profile, or name the base with --base-profile")
        base = used[0]
    _write_whole(output, render_profile(base, chosen))
    return output, chosen
