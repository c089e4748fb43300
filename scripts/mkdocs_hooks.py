"""MkDocs hooks (mkdocs.yml ``hooks:``): README.md is the docs site's front page, the API
reference shows the docstrings' Sphinx roles as plain code, and ``--strict`` counts warnings
under ``-q`` too.

The README lives at the repository root, where GitHub shows it, and links into ``docs/`` with
paths such as ``docs/depth.md``. The site is built from ``docs/``, so the hook adds the README
as the page ``index.md`` with those links made relative to ``docs/`` (``depth.md``). A link
from the README to anything outside ``docs/`` stays as it is and fails ``mkdocs build --strict``,
as a broken link on the site would.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

#: ``](docs/...)`` and ``src="docs/...``: the README's links and images into docs/
_INTO_DOCS = re.compile(r"(\]\(|src=\")docs/")
#: a Sphinx role as Markdown renders it (``:class:<code>~rlm.result.Result</code>``)
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|data|mod|attr|exc|obj|envvar):<code>(~?)([^<]*)</code>")


def on_startup(command: str, dirty: bool) -> None:
    """Keep ``mkdocs build --strict -q`` strict. ``-q`` raises the ``mkdocs`` logger to
    ERROR, so a warning (a broken link, a page outside the nav) was never made, never counted,
    and the build passed. The logger is put back to WARNING and its console handlers keep the
    quiet level instead: warnings are counted (and fail a strict build) but not printed."""
    log = logging.getLogger("mkdocs")
    if log.level > logging.WARNING:
        for handler in log.handlers:
            handler.setLevel(max(handler.level, log.level))
        log.setLevel(logging.WARNING)


def front_page(readme: str) -> str:
    """The README's text with its ``docs/`` links made relative to ``docs/`` (str)."""
    return _INTO_DOCS.sub(r"\1", readme)


def on_files(files: Files, config) -> Files:
    if files.get_file_from_path("index.md") is not None:
        raise ValueError("docs/index.md exists: the front page is README.md (scripts/mkdocs_hooks.py)")
    readme = Path(config["config_file_path"]).parent / "README.md"
    files.append(File.generated(config, "index.md", content=front_page(readme.read_text("utf-8"))))
    return files


def _plain_role(m: re.Match) -> str:
    name = m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)
    return f"<code>{name}</code>"


def on_page_content(html: str, page, config, files) -> str:
    """The docstrings are written for Sphinx (``:class:`X` ``); show each role as its code."""
    return _ROLE.sub(_plain_role, html)
