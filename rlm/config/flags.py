"""Command-line flags from the option registry: every ``rlm`` command that takes keyword options
(``run``, ``resume``, ``replay``, ``serve``, the journal commands) declares them here, from
:data:`rlm.config.options.OPTIONS`, so a flag has one name, type, range and help everywhere."""
from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_arguments", "options_from_args"]


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """Add the flags of every option ``command`` (``"run"``, ``"resume"``...) takes to ``parser``.

    Options of a group go to an argument group titled from :data:`~rlm.config.options.GROUP_TITLES`, the others
    next to the command's own flags, in registry order. Every flag defaults to None ("not
    given"); the run applies the defaults, so a parsed namespace says what the user typed.
    """
    from rlm.config.options import GROUP_TITLES, OPTIONS
    groups: dict[str, Any] = {}
    for opt in OPTIONS:
        if opt.flag is None or command not in opt.commands:
            continue
        target: Any = parser
        if opt.group is not None:
            if opt.group not in groups:
                groups[opt.group] = parser.add_argument_group(GROUP_TITLES[opt.group])
            target = groups[opt.group]
        kw: dict[str, Any] = {"dest": opt.name, "default": None, "help": opt.help}
        if opt.repeat:
            kw["action"] = "append"
        if opt.type in (int, float):
            kw["type"] = opt.type
        if opt.type is bool:  # a flag without a value: given means True
            kw.update(action="store_const", const=True)
        elif opt.choices is not None:
            kw["choices"] = list(opt.choices)
        else:
            kw["metavar"] = opt.metavar
        target.add_argument(opt.flag, **kw)
        for sw in opt.switches:
            if command in sw.commands:
                target.add_argument(sw.flag, action="store_true", help=sw.help)


def options_from_args(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The keyword options the user gave on the command line of ``command``.

    Returns:
        {keyword name: value} for every registry flag that was given (a :class:`~rlm.config.options.Switch` wins
        over its option's own flag; empty values of ``empty_is_unset`` options are dropped).
    """
    from rlm.config.options import OPTIONS
    out: dict[str, Any] = {}
    for opt in OPTIONS:
        if opt.flag is None or command not in opt.commands:
            continue
        v = getattr(args, opt.name, None)
        if opt.empty_is_unset and v == "":
            v = None
        for sw in opt.switches:
            if command in sw.commands and getattr(args, sw.dest, False):
                v = sw.value
        if v is not None:
            out[opt.name] = v
    return out
