"""``rlm serve`` takes the run options ``rlm run`` shares with it, from the option registry:
every run option is a serve option unless ``NOT_SERVED`` says why not, with the same flags."""
from __future__ import annotations

from rlm.cli.main import build_parser
from rlm.config.flags import options_from_args
from rlm.config.options import NOT_SERVED, OPTIONS, RUN, SERVE


def _flags(parser, command: str) -> set[str]:
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return {s for a in sub.choices[command]._actions for s in a.option_strings}


def _registry_flags(option, command: str) -> set[str]:
    return ({option.flag} if option.flag else set()) | {
        w.flag for w in option.switches if command in w.commands}


def test_serve_takes_every_run_option_but_the_ones_named_with_a_reason():
    run = {o.name for o in OPTIONS if RUN in o.commands}
    serve = {o.name for o in OPTIONS if SERVE in o.commands}
    assert run - serve == set(NOT_SERVED), sorted(run - serve)
    assert all(reason.strip() for reason in NOT_SERVED.values())
    # the five the issue named, by name
    assert {"compact_at", "context_window", "kernel_seed", "pool_size"} <= serve


def test_the_two_commands_parse_the_shared_options_with_the_same_flags():
    parser = build_parser()
    run_flags, serve_flags = _flags(parser, "run"), _flags(parser, "serve")
    for o in OPTIONS:
        if RUN in o.commands and SERVE in o.commands:
            assert _registry_flags(o, RUN) <= run_flags, o.name
            assert _registry_flags(o, RUN) <= serve_flags, o.name  # --no-compaction too
    for name in set(NOT_SERVED) - {"api_key"}:  # serve's --api-key is its own flag
        opt = next(o for o in OPTIONS if o.name == name)
        assert not _registry_flags(opt, RUN) & serve_flags, name


def test_serve_flags_become_the_runs_options():
    parser = build_parser()
    args = parser.parse_args(["serve", "--context-window", "32000", "--compact-at", "0.6",
                              "--kernel-seed", "7", "--pool-size", "2"])
    o = options_from_args(args, SERVE)
    assert (o["context_window"], o["compact_at"], o["kernel_seed"], o["pool_size"]) == (
        32000, 0.6, 7, 2)
    off = options_from_args(parser.parse_args(["serve", "--no-compaction"]), SERVE)
    assert off["context_window"] == 0
