#!/usr/bin/env python3
"""Write docs/reference/options.md from the option registry and the CLI parser.

    .venv/bin/python scripts/gen_reference.py           # (re)write docs/reference/options.md
    .venv/bin/python scripts/gen_reference.py --check   # exit 1 if the file is out of date

The page holds the option tables (flag, API keyword, default, meaning), grouped as
``rlm.config.options.OPTIONS`` groups them, and the ``--help`` text of ``rlm`` and of every
subcommand as ``rlm.cli.main.build_parser`` builds it. ``tests/test_options.py`` renders the page
in memory and fails when the checked-in file differs.

The help text is rendered at a fixed width of 100 columns, without colour, and with the option
layout of Python 3.10-3.12 (``-o PATH, --output PATH``), so the page does not depend on the
terminal or on the Python version that runs this script.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the checkout, whatever an installed copy is
    sys.path.insert(0, str(REPO))

from rlm.cli.main import build_parser  # noqa: E402
from rlm.config.options import GROUP_TITLES, OPTIONS, RUN, Option  # noqa: E402

OUT = REPO / "docs" / "reference" / "options.md"
COLUMNS = 100

#: Links in the registry's ``doc`` texts (written as README anchors) -> the docs pages.
LINKS = {
    "#depth": "../depth.md",
    "#embedding": "../embedding.md#checked-structured-answers",
    "#contexts-files-directories-formats": "../contexts.md",
    "#seeing-a-run": "../viewing.md#opentelemetry",
}

#: Title of the flags that belong to no registry group (they sit with a command's own flags).
UNGROUPED_TITLE = "context, run id, journal and answer"

#: Rows of ``rlm run`` flags that are not keyword options: the CLI defines them itself
#: (``rlm/cli/main.py``, ``rlm/cli/views.py``). ``(first, rows)``: ``first`` go before the
#: registry's rows, ``rows`` in their own table.
CLI_FIRST_ROWS = [
    "| `--context PATH` | first argument | required | a file, a directory or a quoted glob; "
    "repeat for several. One file: `.json` is parsed, other formats as in "
    "[Contexts](../contexts.md); `-` reads stdin. A directory, glob or several paths: a dict of "
    "relative path -> text | run, resume, replay |",
    "| `--query TEXT` | second argument | none | the question; without it the task is read from "
    "the context | run |",
]
CLI_OUTPUT_ROWS = [
    "| `--json` | | | print one JSON object (`answer`, `status`, `run_id`, `iterations`, "
    "`usage`, ...) | run, resume, replay |",
    "| `-v` / `-q` | `on_progress` | live view on a terminal, else plain lines | plain lines plus "
    "every attempt and kernel event / nothing | run, resume, replay |",
    "| `--plain` | | | plain progress lines even on a terminal | run, resume |",
    "| `--otel` | `listeners` | off (env `RLM_OTEL=1`) | export every stage as an OpenTelemetry "
    "span (see [Viewing a run](../viewing.md#opentelemetry)) | run, resume |",
]

ENVIRONMENT = """\
| environment variable | meaning |
|---|---|
| `OPENAI_BASE_URL`, `OPENAI_API_KEY` | endpoint and key when the flags are not given |
| `RLM_SUB_API_KEY` | the key of the sub-call endpoint (`--sub-base-url`), unless `sub_api_key=` gives it; there is no flag |
| `RLM_MODEL` | model name when `--model` is not given |
| `RLM_JOURNAL` | journal: a SQLite file or a `postgresql://` URL (default `$XDG_DATA_HOME/rlm/journal.sqlite3`, i.e. `~/.local/share/rlm/journal.sqlite3`) |
| `RLM_HOST` | host name recorded as a run's owner (default: the machine's host name) |
| `RLM_CACHE_DIR` | assembled model weights and token ranks (default `~/.cache/rlm`) |
| `RLM_DEBUG=1` | show tracebacks of unexpected errors (and let kernels write to the terminal) |
| `RLM_KERNEL_USER` | the user kernels run as when the host runs as root (default: a uid of each kernel's own, from 2^20 up; `root` keeps root kernels); see [Security](../security.md#unprivileged-kernels-when-the-host-is-root) |
| `RLM_OTEL=1` | `--otel` on every `rlm run` and `rlm resume` |
| `RLM_SERVE_API_KEY` | the key `rlm serve` requires (`--api-key`) |
| `TMPDIR` | where scratch files of contexts are written |
"""


# --------------------------------------------------------------------------- option tables

def _shown(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, str):
        return f"`{v}`"
    return f"{v:g}" if isinstance(v, float) else str(v)


def doc_default(opt: Option) -> str:
    """The default as the reference states it (str), e.g. ``20 (6 embedded)``."""
    if opt.doc_default is not None:
        return opt.doc_default
    text = _shown(opt.default)
    if opt.embedded_default is not None:
        text += f" ({_shown(opt.embedded_default)} embedded)"
    return text


def doc_text(opt: Option) -> str:
    """The option's ``doc`` with its README anchors pointed at the docs pages.

    Raises:
        ValueError: a link this script does not know (add it to :data:`LINKS`).
    """
    def page(m: re.Match) -> str:
        anchor = m.group(2)
        if anchor not in LINKS:
            raise ValueError(f"option {opt.name}: no docs page for the link {anchor!r}; "
                             "add it to LINKS in scripts/gen_reference.py")
        return f"[{m.group(1)}]({LINKS[anchor]})"
    return re.sub(r"\[([^\]]+)\]\((#[^)]+)\)", page, opt.doc)


def code(text: str) -> str:
    """``text`` as inline code in a table cell. A ``|`` would end the cell on GitHub, and
    ``\\|`` shows its backslash on the docs site, so such text is HTML with ``&#124;``."""
    if "|" not in text:
        return f"`{text}`"
    escaped = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return f"<code>{escaped.replace('|', '&#124;')}</code>"


def _flag_cell(opt: Option) -> str:
    value = opt.metavar or ("|".join(map(str, opt.choices)) if opt.choices else opt.name.upper())
    head = opt.flag if opt.type is bool else f"{opt.flag} {value}"  # an on/off flag takes none
    flags = [code(head)] + [code(sw.flag) for sw in opt.switches]
    return " / ".join(flags)


def _commands(opt: Option) -> str:
    names = list(opt.commands)
    for sw in opt.switches:
        names += [c for c in sw.commands if c not in names]
    return ", ".join(names)


def flag_row(opt: Option) -> str:
    """``| flag | API option | default | meaning | commands |`` of an option with a flag."""
    return (f"| {_flag_cell(opt)} | `{opt.name}` | {doc_default(opt)} | {doc_text(opt)} | "
            f"{_commands(opt)} |")


def api_row(opt: Option) -> str:
    """``| API option | default | meaning |`` of a Python-only option."""
    return f"| `{opt.name}` | {doc_default(opt)} | {doc_text(opt)} |"


FLAG_HEADER = ["| flag | API option | default | meaning | commands |", "|---|---|---|---|---|"]


def option_tables() -> str:
    """The option tables: one per registry group of flags, then the Python-only keywords."""
    with_flag = [o for o in OPTIONS if o.flag]
    groups: list[str | None] = [None] + [g for g in GROUP_TITLES]
    out: list[str] = []
    for group in groups:
        title = UNGROUPED_TITLE if group is None else GROUP_TITLES[group]
        rows = [flag_row(o) for o in with_flag if o.group == group]
        if group is None:
            rows = CLI_FIRST_ROWS + rows
        out += [f"### {title[0].upper()}{title[1:]}", "", *FLAG_HEADER, *rows, ""]
    out += ["### Output and progress (flags of the CLI only)", "", *FLAG_HEADER,
            *CLI_OUTPUT_ROWS, ""]
    api = [o for o in OPTIONS if not o.flag]
    out += ["### Keyword options of the Python API only", "",
            "| API option | default | meaning |", "|---|---|---|", *map(api_row, api), ""]
    return "\n".join(out)


# --------------------------------------------------------------------------- --help texts

def _invocation(self: argparse.HelpFormatter, action: argparse.Action) -> str:
    """An option's ``--help`` label as Python 3.10-3.12 write it (3.13 shortened it)."""
    if not action.option_strings:
        default = self._get_default_metavar_for_positional(action)
        (metavar,) = self._metavar_formatter(action, default)(1)
        return metavar
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    args = self._format_args(action, self._get_default_metavar_for_optional(action))
    return ", ".join(f"{s} {args}" for s in action.option_strings)


@contextlib.contextmanager
def _fixed_terminal() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in ("COLUMNS", "NO_COLOR", "FORCE_COLOR")}
    os.environ["COLUMNS"], os.environ["NO_COLOR"] = str(COLUMNS), "1"
    os.environ.pop("FORCE_COLOR", None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def help_text(parser: argparse.ArgumentParser) -> str:
    """``parser.format_help()`` at :data:`COLUMNS` columns, in the 3.10-3.12 layout."""
    base = parser.formatter_class
    parser.formatter_class = type("Stable" + base.__name__, (base,),
                                  {"_format_action_invocation": _invocation})
    try:
        with _fixed_terminal():
            return parser.format_help().rstrip() + "\n"
    finally:
        parser.formatter_class = base


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``rlm``'s subcommands in ``--help`` order: name -> parser."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def cli_sections() -> str:
    parser = build_parser()
    out = ["### `rlm`", "", "```text", help_text(parser).rstrip(), "```", ""]
    for name, p in subcommands(parser).items():
        out += [f"### `rlm {name}`", "", "```text", help_text(p).rstrip(), "```", ""]
    return "\n".join(out)


# --------------------------------------------------------------------------- the page

HEADER = f"""\
<!-- Generated by scripts/gen_reference.py from rlm/config/options.py (OPTIONS) and
     rlm/cli/main.py (build_parser). Do not edit: run `.venv/bin/python scripts/gen_reference.py`.
     tests/test_options.py fails when this file is out of date. -->
# Options and CLI reference

Every run option is declared once, in `rlm/config/options.py`. `rlm run --context PATH --query
TEXT [options]` takes the flags below; the same names (the API option column) are keyword
options of `rlm.completion`, `rlm.acompletion`, `rlm.RLM` and `rlm.AsyncRLM`. The commands
column says which `rlm` subcommands take a flag. Defaults marked "embedded" apply when the
embedded model serves the run.

## Run options
"""

ENV_SECTION = f"""\
## Environment variables

{ENVIRONMENT}
Exit codes are listed in [Exit codes and failures](failures.md) and at the end of `rlm --help`.

## Command line help

The `--help` text of `rlm` and of each subcommand, as this version prints it.
"""


def render() -> str:
    """The whole page (str)."""
    return "\n".join([HEADER, option_tables(), ENV_SECTION, cli_sections()]).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if docs/reference/options.md differs; write nothing")
    args = ap.parse_args(argv)
    text = render()
    current = OUT.read_text(encoding="utf-8") if OUT.exists() else None
    if args.check:
        if current != text:
            print(f"{OUT.relative_to(REPO)} is out of date: run "
                  f".venv/bin/python scripts/gen_reference.py", file=sys.stderr)
            return 1
        return 0
    if current != text:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(text, encoding="utf-8")
        print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
